"""Review round 37: the page-cache reads a chunk per pass (476f67f), ARC's mark across a reservation's handover
(33a3132), and the cluster redirects followed on the store's own link (568247f).

Each test fails on the tree under review (568247f) and says, in its docstring, what is wrong, where, and a fix.
What it proved wrong, fixed since: (1) a handover broken off between the removal of the fetch's entry and the new
entry left ARC's mark with no reservation: ``TierIndex.reserve`` abandons it then (and when no slot is found);
(2) ``_block_until``'s ``finally`` reset ``read_here`` only after ``mover.hold(False)``, so an interrupt there left
``poll()`` reading the page cache: it is reset first now; (3) ``CachedReads.read_chunk`` counted the reads after a
chunk handed on even where nothing of the chunk was looked at: only where it was, now.

Deterministic: interrupts are injected at a chosen call's return (a wrapper that raises ``KeyboardInterrupt``
after the real call returned, or the interrupt sweeps' return hook of ``tests/test_interrupt_locks.py``), page
cache answers are forced by monkeypatching (``tests/test_cached_reads.py``'s helpers), no sleeps order anything,
every disk tier lives under ``tmp_path``.
"""

from __future__ import annotations

import inspect
import uuid
from typing import Any

import pytest

from disk_helpers import Rig, disk_only_keys, rig, row_is  # noqa: F401  (rig: the fixture)
from test_cached_reads import _chunks_of, _reads
from test_interrupt_policy import _sweep as _sweep_points
from test_review_round36 import _arc_ghost_hit
from tiered_kv.core.index import TierIndex
from tiered_kv.disk.cached import CachedReads
from tiered_kv.disk.records import Promote
from tiered_kv.manager import TierManager

pytestmark = pytest.mark.timeout(120)

IO = ["process", "thread"]


# ============================================================================ 1. ARC: a handover broken off
def test_a_handover_broken_off_before_the_new_reservation_leaves_arcs_mark_behind() -> None:
    """WRONG: ``TierIndex.reserve(key, ..., replace=fetch)`` (core/index.py:reserve) now takes the fetch's entry out
    with ``remove(replace, handover=True)``, which skips ``policy.abandon(key)``: ARC's ``adapted`` mark is meant to
    pass to the new reservation.  But the new entry is made only after ``_evict_one`` -- several calls later.  An
    interrupt at any call return between the two (the sweep finds 14 such points: ``remove``'s ``_maybe_free``,
    ``_evict_one``/``victim``/``_pick``/``_evicted``, ``Entry.__init__``) leaves the key with *no* reservation at all,
    and the engine's handler (``TierCore.begin_store_one`` -> ``_unreserve``) finds no entry under the store's token
    to abort (the fetch is only told it was superseded): nothing ever tells ARC that the reservation ended.  The
    mark outlives it (``ARC.abandon``'s own contract: "a ghost hit's mark goes with it, so a later insert of
    ``key`` is a ghost hit only if it is one then"): the store's retry is not adapted for, and a later
    reservation of the key when it is no ghost any more is still taken for a ghost hit (no T1-only victim, filed
    in T2).  Before 33a3132 the removal dropped the mark at once (and adapted ``p`` twice instead).

    Fix: undo the handover when the new entry is not made -- in ``reserve``, wrap the part after
    ``remove(replace, handover=True)`` in ``try/except BaseException`` that calls ``self.policy.abandon(key)`` when
    ``entries.get(key)`` is not the new entry (and on the ``return None`` after a failed ``_evict_one``); or have
    ``TierCore._unreserve`` call ``index.policy.abandon(k)`` for a key whose superseded fetch left no entry."""
    leaked: list[str] = []

    def setup() -> tuple[TierIndex, Any, uuid.UUID]:
        idx, fetch = _arc_ghost_hit()   # ``a`` reserved by a fetch: a ghost hit, p adapted once and ``a`` marked
        return idx, fetch, uuid.uuid4()

    def call(st: tuple[TierIndex, Any, uuid.UUID]) -> Any:
        idx, fetch, tok = st
        return idx.reserve(b"a", tok, (), fetch)   # the engine's store of ``a`` takes over the fetch's reservation

    def after(st: tuple[TierIndex, Any, uuid.UUID], label: str) -> None:
        idx, fetch, tok = st
        e = idx.get(b"a")
        # what TierCore._unreserve does for a begin_store_one an interrupt broke off
        if e is not None and e.writer is tok and e.state.name == "WRITING":
            idx.abort(e)
            idx.writer_done(e)
        arc = idx.policy
        if idx.get(b"a") is None and b"a" in arc.adapted:
            # what the mark does later: twelve new keys push ``a`` out of the ghost lists, then ``a`` is stored anew
            # -- no ghost hit, so T1 is its place (it lands there when the mark went with the reservation)
            for i in range(12):
                e = idx.reserve(b"x%d" % i, uuid.uuid4())
                assert e is not None
                idx.publish(e)
            ghost = b"a" in arc.b1 or b"a" in arc.b2
            e = idx.reserve(b"a", uuid.uuid4())
            assert e is not None
            idx.publish(e)
            leaked.append(f"{label}: no entry for b'a' yet it stayed marked; later, no ghost any more "
                          f"(in B1/B2: {ghost}), its new entry was filed in {'T2' if b'a' in arc.t2 else 'T1'}")

    assert _sweep_points(TierIndex.reserve, setup, call, after) > 1
    assert not leaked, ("ARC's ghost mark outlived every reservation of b'a' (no entry, yet ``adapted`` holds it) "
                        "after a handover broken off:\n  " + "\n  ".join(leaked))


# ============================================================================ 2. read_here after an interrupt
def _interrupt_finally_hold(mgr: TierManager) -> list[bool]:
    """``KeyboardInterrupt`` at the return of the ``mover.hold(False)`` in ``_block_until``'s ``finally`` (the call
    ran; the interrupt lands as it returns); returns the list the firing is recorded in."""
    src, first = inspect.getsourcelines(TierManager._block_until)
    fin = next(i for i, line in enumerate(src) if line.strip() == "finally:")
    at = first + next(i for i in range(fin, len(src)) if src[i].strip() == "mover.hold(False)")
    mover = mgr._mover
    real = mover.hold
    fired: list[bool] = []

    def hold(on: bool) -> None:
        real(on)
        caller = inspect.currentframe().f_back   # type: ignore[union-attr]
        if not on and not fired and caller is not None and caller.f_code is TierManager._block_until.__code__ \
                and caller.f_lineno == at:
            fired.append(True)
            raise KeyboardInterrupt("at the return of hold(False) in _block_until's finally")

    mover.hold = hold   # type: ignore[method-assign]
    return fired


@pytest.mark.parametrize("io", IO)
def test_an_interrupt_in_the_blocking_calls_finally_leaves_poll_reading_the_page_cache(rig: Rig, io: str) -> None:  # noqa: F811
    """WRONG: ``TierManager._block_until`` (manager.py) resets ``core.read_here``/``read_until`` in its ``finally``
    only after ``mover.hold(False)``.  An interrupt at that call's return (or anywhere inside it) skips the reset
    and the last pass: ``read_here`` stays True.  With the chunked reads this now matters: the wait returns with
    reads *held* (``later``: chunk 2 on), and every later ``poll()`` -- which "never reads here" (docs,
    test_poll_never_reads_on_the_engines_thread) -- reads the page cache on the engine's thread, a chunk per
    ``poll()``, and holds the rest across the engine's calls instead of handing them to the disk I/O side (a
    ``poll()``-only engine gets one chunk per step, served on its own thread).  Before 476f67f no read stayed
    held after any pass, so the same interrupt left nothing for a stale ``read_here`` to do in ``poll()``
    until the engine queued new reads.

    Fix: in the ``finally``, reset ``core.read_here, core.read_until = False, None`` first (before
    ``mover.hold(False)``), or nest: ``try: mover.hold(False) finally: core.read_here, ... = False, None;
    self._poll(True)``; and/or have ``TierCore.apply_arrived`` pass ``cached_here`` only from inside a blocking
    call (e.g. a flag ``_block_until`` sets and every ``poll()`` clears)."""
    kv, mgr, ks = disk_only_keys(rig, io, n=4)
    _chunks_of(mgr, 1)   # one block per pass: after the first pass three reads are held
    fired = _interrupt_finally_hold(mgr)
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    assert all(j is not None for j in jobs)
    cached = mgr.disk.cached
    with pytest.raises(KeyboardInterrupt):
        mgr.wait([], timeout=30)   # done at once: its first pass read one chunk, three reads held
    assert fired and cached.served == 1 and mgr.disk.reads_held
    mgr.poll()   # the engine's next step
    assert not mgr._core.read_here and cached.served == 1 and not mgr.disk.reads_held, (
        f"after a wait() interrupted in its finally, read_here={mgr._core.read_here}: the engine's poll() served "
        f"{cached.served - 1} read(s) from the page cache on its own thread, and reads are still held="
        f"{mgr.disk.reads_held} (for the next poll)")


# ============================================================================ 3. handed_on counts reads never looked at
@pytest.mark.parametrize("io", IO)
def test_a_chunk_with_nothing_looked_at_counts_the_reads_after_it_handed_on(rig: Rig, io: str) -> None:  # noqa: F811
    """WRONG: ``CachedReads.read_chunk`` (disk/cached.py) counts every op after the chunk ``handed_on``
    (``self.passed += ...``) whenever ``read()`` left any op of the chunk -- also when ``read()`` looked at none
    of them and counted nothing: the slot file not open for the owner (``_open()`` < 0: not made yet, gone), or
    no op of the chunk with a known record (``where`` 0).  Five reads, two per pass, the slot file not openable:
    ``tiered_kv_disk_page_cache_reads_total{outcome="handed_on"}`` says 3 (the three after the first chunk,
    never looked at) while the two of the chunk count 0; the same batch in one pass counts 0 (the metric's
    definition: "looked at and left to the disk I/O side").  The count depends on the chunk size, and on a
    tier whose owner cannot open the slot file it grows with every batch though no page-cache read is made.

    Fix: count ``later`` only when ``read()`` stopped at a block it looked at (not cached, failed check, past
    the deadline): e.g. ``before = self.passed`` ... ``if self.passed > before: self.passed += sum(...)``, or
    have ``read()`` return why it stopped (cold / disabled / no record)."""
    kv, mgr, ks = disk_only_keys(rig, io, n=5)
    _chunks_of(mgr, 2)
    cached = mgr.disk.cached
    cached.close()
    cached._open = lambda: -1   # the owner cannot open the slot file (not there yet, removed, no permission)
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    assert all(j is not None for j in jobs)
    mgr.wait(jobs, timeout=30)
    assert all(j.state.name == "DONE" for j in jobs) and all(row_is(kv, i, k) for i, k in enumerate(ks))
    served, passed = _reads(mgr)
    assert (served, passed) == (0, 0), (
        f"no read was looked at (the slot file could not be opened), yet the page-cache read counter says "
        f"served={served}, handed_on={passed}")


def test_read_chunk_counts_handed_on_only_for_reads_it_looked_at(tmp_path: Any) -> None:
    """The same at the unit: ``read_chunk`` of five ops with records, no slot file: ``read`` of them all counts 0
    handed on, ``read_chunk`` with two per pass counts 3 (control: ``read`` of the same ops)."""
    block = 4096
    ops = [Promote(uuid.uuid4(), b"k%d" % i, uuid.uuid4(), memoryview(bytearray(block)), (i + 1) << 128)
           for i in range(5)]
    whole = CachedReads(tmp_path, "ns", block)
    if not whole.enabled:
        pytest.skip("no preadv2/RWF_NOWAIT here")
    served, rest = whole.read(ops)
    assert (served, len(rest), whole.passed) == ([], 5, 0)   # control: nothing looked at, nothing counted
    chunked = CachedReads(tmp_path, "ns", block)
    chunked.chunk_ops = 2
    served, rest, later = chunked.read_chunk(ops)
    assert served == [] and len(rest) == 5 and later == []
    assert chunked.passed == whole.passed, (
        f"read_chunk counted {chunked.passed} reads handed on that it never looked at (read of the same ops: "
        f"{whole.passed})")

