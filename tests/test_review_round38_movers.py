"""Round 38 adversarial review of the CPU movers (``tiered_kv/movers/{native,rowcopy,thread,base,__init__}.py``)
and how ``TierManager`` drives them (``_poll``, ``_block_until``, ``store_many``/``load_many``).

Findings (each proven by a test that failed on the reviewed tree, main at 9c7cf94; all fixed since:
``_block_until`` takes the hold inside its ``try`` and marks it (``TierManager._waiting``), which ``poll()`` ends
when an interrupt left it; ``split_batches`` sizes a transfer without a row list as 0 bytes, for ``screen`` to
answer; ``NativeMover._start`` checks a group's rows and slots with ``array("q")`` and starts each transfer of a
group it refuses again alone):

1. **A ``wait()`` broken off by an interrupt around its mover hold leaves the mover holding for good: later
   copies are never started by ``poll()``.**  ``TierManager._block_until`` calls ``mover.hold(True)`` *before*
   its ``try`` (an interrupt landing at that call's return skips the ``finally``), and its ``finally`` un-holds
   with ``mover.hold(False)`` (an interrupt landing at that call's entry, before its first statement, leaves
   ``_holding`` set).  Either way ``wait()`` raises ``KeyboardInterrupt`` and the mover stays in hold mode:
   ``NativeMover.flush``/``ThreadMover.flush`` do nothing while holding, so every store and load submitted
   afterwards waits in the mover's ``_held`` queue.  An engine that only ``poll()``s never sees those jobs
   reported (its load rows stay fenced, its host slots leased, stores are shed once the slab fills) until some
   later ``wait()``/``flush()``/``close()`` happens to un-hold the mover.  Both CPU movers.
   (``test_a_wait_interrupted_around_its_hold_leaves_later_copies_to_poll``)
2. **A transfer whose rows are not a sequence (``None``) breaks the whole flush instead of being answered
   alone; the thread mover is wedged for good.**  ``screen`` answers such a transfer alone ("rows or slots not
   sequences (None): answered alone ... instead of failing the flush of every other one"), but both movers call
   ``split_batches`` -- which takes ``len(t.rows)`` -- *before* the screen.  ``NativeMover._start_held`` then
   answers every held transfer failed ("copy not started") and ``flush()`` raises ``TypeError``;
   ``ThreadMover.flush`` puts the transfers back at the front of ``_held`` and raises, so *every* later
   ``flush()`` and ``close()`` raises the same ``TypeError``: no transfer is ever copied or answered again and
   ``close()`` never stops the workers.  (``test_a_transfer_without_a_row_list_is_answered_alone``)
3. **On the native mover a malformed first transfer fails every transfer of its direction.**
   ``NativeMover._start`` concatenates a group's rows and calls ``list_args``; ``is_run`` raises ``TypeError`` when
   the first row is a float and the last row minus it is ``len - 1`` (``range(0.0, ...)``), and the ``except``
   around ``list_args`` answers *all* transfers of the group "malformed".  Its comment assumes only a lone
   transfer gets there; the launcher-refusal path right below starts each transfer again alone for exactly this
   reason, and the thread mover (same ``list_args`` through ``index_args``) answers only the bad one.
   (``test_a_malformed_first_transfer_fails_alone_on_the_native_mover``)
4. **The native mover copies a row given as a 0-d float tensor from the truncated row and reports it ok.**
   ``Transfer(rows=[torch.tensor(3.5), ...])``: ``transfer_error``/``screen`` pass it (it compares as a number),
   ``list_args`` hands the list on, and TorchScript's ``List[int]`` argument conversion turns a one-element tensor
   into ``int(item())`` = 3: row 3's bytes land in the slot and the store is reported ok.  ``base.transfer_error``'s
   contract is the opposite ("a row that is not an int fails where it is used ... where torch.tensor would
   truncate 1.5 to row 1"); the thread mover (``array("q")``/``ctypes.memmove``) refuses it.  Slots likewise.
   (``test_a_float_tensor_row_is_refused_not_truncated_by_the_native_mover``)

Findings 2-4 are reachable only through the movers' own API (``TierManager`` and the vLLM copier hand them
plain int lists), so they are latent for the front ends; finding 1 is reachable through ``TierManager``.

Checked and found to hold (no test here: already covered or not a defect):

* an interrupt inside ``NativeMover._start``'s ``except Exception`` handler before ``inflight.remove(b)`` would
  leave a batch with no future in ``_inflight`` (never answered, ``close()`` spinning) -- but on CPython 3.11 a
  signal is handled only at a call's return, a function's entry or a backward jump, and nothing in that handler
  before the ``remove`` returns is one (``b in inflight`` compares ``_Batch`` objects by identity in C); not
  reachable;
* int-like rows (numpy ints, 0-d and 1-element integer tensors, ``bool``, tuples, ``range``) land the right
  bytes on every path of both movers (launched, copied inline by the owner, memmove, Python threads);
* catch-up (``ThreadMover.flush``/``_help``) takes batches with ``get_nowait`` and moves ``_taken`` with C calls:
  no batch copied by the owner and a worker both;
* fences: a row's store and a load into it are kept apart by ``BlockBusyError``/``_give_up_row``; duplicate
  destinations cannot arise through the front ends (slot leases, row fences, ``check_many``);
* ``make_mover`` only picks ``NativeMover`` where ``wide_planes`` fits (which implies ``fast_planes`` fits).
"""

from __future__ import annotations

import collections
import time
from typing import Any, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry

from fakes import fill_row, make_config, make_kv, row_matches
from tiered_kv import TierManager
from tiered_kv.jobs import JobKind
from tiered_kv.movers import CompletionQueue, NativeMover, ThreadMover, Transfer

_STORE, _LOAD = JobKind.STORE, JobKind.LOAD


def _rows(n: int, width: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, width), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def _mover(kind: str, dev: torch.Tensor, host: torch.Tensor, q: CompletionQueue) -> Any:
    if kind == "native":
        return NativeMover([(dev, host)], q, batch_max=64)
    return ThreadMover([(dev, host)], q, num_workers=1, batch_max=64)


# ============================================================================= 1
@pytest.mark.parametrize("where", ["at-hold-on-return", "at-hold-off-entry"])
@pytest.mark.parametrize("cpu_mover", ["native", "threads"])
def test_a_wait_interrupted_around_its_hold_leaves_later_copies_to_poll(cpu_mover: str, where: str) -> None:
    """What is wrong: ``TierManager._block_until`` (tiered_kv/manager.py) turns the mover's hold on *outside* its
    ``try`` and off with a call its ``finally`` cannot protect.  A ``KeyboardInterrupt`` landing at the return of
    ``mover.hold(True)`` (the ``finally`` never runs) or at the entry of ``mover.hold(False)`` (before its first
    statement) leaves the mover holding; ``flush()`` is then a no-op for both CPU movers, so stores/loads submitted
    after the interrupted ``wait()`` are never started by ``poll()``: their jobs stay PENDING, load rows fenced,
    slots leased, until a later ``wait()``/``flush()``/``close()`` un-holds the mover by chance.

    The interrupt is injected exactly where a signal lands (a call's return / a function's entry) by wrapping the
    mover's ``hold``.

    Fix: take the hold inside the ``try`` (``try: mover.hold(True) ...``), and make the un-hold survive an
    interrupt at its entry -- e.g. the manager records that a blocking call holds the mover (a flag set before
    ``hold(True)``, cleared once ``hold(False)`` returned) and ``poll()``/``_poll(last=True)`` outside
    ``_block_until`` calls ``mover.hold(False)`` while the flag is still set."""
    kv = make_kv(16)
    mgr = TierManager(make_config(16, cpu_mover=cpu_mover), kv, registry=CollectorRegistry())
    mover = mgr._mover
    assert isinstance(mover, NativeMover if cpu_mover == "native" else ThreadMover)
    real_hold = mover.hold
    fired: list[bool] = []

    def hold(on: bool) -> None:
        if not fired and where == "at-hold-off-entry" and not on:
            fired.append(True)
            raise KeyboardInterrupt   # a signal handled at hold(False)'s entry, before its first statement
        real_hold(on)
        if not fired and where == "at-hold-on-return" and on:
            fired.append(True)
            raise KeyboardInterrupt   # a signal handled at hold(True)'s return, before _block_until's try

    mover.hold = hold  # type: ignore[method-assign]
    try:
        fill_row(kv, 0, b"k0")
        j0 = mgr.store(b"k0", 0)
        assert j0 is not None
        with pytest.raises(KeyboardInterrupt):
            mgr.wait([j0], timeout=5.0)
        assert fired
        mover.hold = real_hold  # type: ignore[method-assign]

        # the engine goes on, poll()ing each step: a store and a load of the stored key
        fill_row(kv, 1, b"k1")
        j1 = mgr.store(b"k1", 1)
        assert j1 is not None
        deadline = time.monotonic() + 2.0   # a real copy of one 4 KiB row: microseconds
        while not (j0.done and j1.done) and time.monotonic() < deadline:
            mgr.poll()
        stuck = [j for j in (j0, j1) if not j.done]
        assert not stuck, (
            f"{cpu_mover}: after a wait() interrupted {where}, poll() never started the copies of "
            f"{[str(j.state) for j in stuck]} jobs (the mover was left holding: _holding="
            f"{getattr(mover, '_holding', None)}, {len(getattr(mover, '_held', ()))} transfers held)")
        assert row_matches(kv, 1, b"k1") and mgr.host_bytes(b"k1") is not None
        kv[5].zero_()
        j2 = mgr.load(b"k1", 5)
        assert j2 is not None
        deadline = time.monotonic() + 2.0
        while not j2.done and time.monotonic() < deadline:
            mgr.poll()
        assert j2.done and row_matches(kv, 5, b"k1")
    finally:
        mover.hold = real_hold  # type: ignore[method-assign]
        mgr.close()


# ============================================================================= 2
@pytest.mark.parametrize("kind", ["native", "threads"])
def test_a_transfer_without_a_row_list_is_answered_alone(kind: str) -> None:
    """What is wrong: ``NativeMover._start_held`` and ``ThreadMover.flush`` (tiered_kv/movers/native.py,
    thread.py) call ``split_batches`` (thread.py), which takes ``len(t.rows)``, *before* ``screen`` -- whose
    documented job is to answer a transfer whose rows or slots are not sequences (None) alone "instead of failing
    the flush of every other one".  Native: every transfer of the flush is answered failed ("copy not started:
    TypeError") and ``flush()`` raises.  Threads: the transfers go back to the front of ``_held`` and ``flush()``
    raises -- and so does every later ``flush()`` and ``close()``: nothing is ever copied or answered again, and
    the workers are never stopped.

    Fix: make ``split_batches`` size a transfer it cannot measure as 0 bytes (``try: size = len(t.rows) * block
    except TypeError: size = 0``) so that the screen answers it, or screen before batching."""
    dev, host = _rows(8, 16, 3801), torch.zeros((8, 16), dtype=torch.uint8)
    q = CompletionQueue()
    m = _mover(kind, dev, host, q)
    ts = [Transfer("g1", _STORE, [0], [0]), Transfer("bad", _STORE, None, [1]),  # type: ignore[arg-type]
          Transfer("g2", _STORE, [2], [2])]
    raised: Optional[BaseException] = None
    try:
        for t in ts:
            m.submit(t)
        try:
            m.flush()
        except Exception as exc:   # noqa: BLE001 - the defect: the manager's poll() would raise it
            raised = exc
    finally:
        # (cleanup only: take the malformed transfer out, or a wedged thread mover's close() raises for ever)
        m._held = collections.deque(t for t in m._held if t.rows is not None)
        m.close()
    got = {r.token: r for r in q.drain()}
    assert raised is None, f"{kind}: flush() raised {raised!r} for one malformed transfer"
    assert sorted(got) == ["bad", "g1", "g2"], f"{kind}: answered {sorted(got)}"
    assert not got["bad"].ok
    assert got["g1"].ok and got["g2"].ok, f"{kind}: good neighbours failed: {got['g1'].error!r}"
    assert torch.equal(host[0], dev[0]) and torch.equal(host[2], dev[2])


# ============================================================================= 3
@pytest.mark.parametrize("kind", [_STORE, _LOAD])
def test_a_malformed_first_transfer_fails_alone_on_the_native_mover(kind: JobKind) -> None:
    """What is wrong: ``NativeMover._start`` (tiered_kv/movers/native.py) concatenates a group's rows and slots and
    calls ``list_args`` (rowcopy.py) in a ``try`` whose handler answers *every* transfer of the group failed
    ("malformed transfer").  ``is_run`` raises there as soon as the concatenation's first row is a float and its
    last row minus that is ``len - 1`` (``range(0.0, 2)``) -- i.e. whenever a malformed transfer comes first in
    the flush.  The good transfer beside it is failed although nothing is wrong with it (a malformed one in the
    middle is refused by the launcher instead, and each is started again alone: only it fails; the thread mover,
    through the same ``list_args``, fails only the bad one too).

    Fix: in that handler, when the group holds more than one transfer, start each again alone
    (``self._start([[t]])`` as the launch-refusal path does) instead of failing them all."""
    dev, host = _rows(8, 16, 3802), _rows(8, 16, 3803)
    dev0, host0 = dev.clone(), host.clone()
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=64)
    try:
        m.submit(Transfer("bad", kind, [0.0], [0]))   # type: ignore[list-item]  # a float row, first
        m.submit(Transfer("good", kind, [1], [1]))
        m.flush()
    finally:
        m.close()
    got = {r.token: r for r in q.drain()}
    assert sorted(got) == ["bad", "good"]
    assert got["good"].ok, f"a valid transfer failed because of its malformed neighbour: {got['good'].error!r}"
    if kind is _STORE:
        assert torch.equal(host[1], dev0[1])
    else:
        assert torch.equal(dev[1], host0[1])


# ============================================================================= 4
@pytest.mark.parametrize("path", ["launched", "owner-inline"])
@pytest.mark.parametrize("side", ["rows", "slots"])
def test_a_float_tensor_row_is_refused_not_truncated_by_the_native_mover(path: str, side: str) -> None:
    """What is wrong: the native mover hands a transfer's row list to the compiled launcher/copy as TorchScript
    ``List[int]`` (``NativeMover._start`` via ``rowcopy.list_args``), and that conversion accepts a one-element
    float tensor as ``int(item())``: a row ``torch.tensor(3.5)`` is copied as row 3 and reported ok -- wrong
    bytes in the slot, published as the key's.  ``screen``/``transfer_error`` (tiered_kv/movers/base.py) let it
    through since it compares as a number, and promise instead that "a row that is not an int fails where it is
    used ... where torch.tensor would truncate 1.5 to row 1".  The thread mover refuses the same transfer
    (``array("q")`` and ``ctypes.memmove`` call ``__index__``, which a float tensor refuses).

    Fix: give the launcher only exact ints: check the group's lists where they are built, e.g. ``array("q", rows)``
    (C speed; refuses anything without an integral ``__index__``) before ``list_args`` -- a failure there starting
    the transfers again alone (finding 3)."""
    dev, host = _rows(8, 16, 3804), torch.zeros((8, 16), dtype=torch.uint8)
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=64)
    rows: list[Any] = [torch.tensor(3.5), 5, 1]
    slots: list[Any] = [0, 1, 2]
    if side == "slots":
        rows, slots = [3, 5, 1], [torch.tensor(0.5), 1, 2]
    try:
        if path == "owner-inline":
            m.hold(True)
        m.submit(Transfer("t", _STORE, rows, slots))
        if path == "owner-inline":
            while m.help_one():   # three rows: the blocking owner's inline compiled copy (not memmove)
                pass
            m.hold(False)
        m.flush()
    finally:
        m.close()
    (r,) = q.drain()
    assert not r.ok, (f"a transfer naming {side} {rows if side == 'rows' else slots} was reported ok: row 3 copied "
                      f"into slot 0 = {torch.equal(host[0], dev[3])} (the float tensor truncated to an int)")
