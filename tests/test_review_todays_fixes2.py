"""Adversarial review (2) of today's fixes (commits after ae8ca56: 3a14e65, 5b598cd, c6164e1).

What it proved wrong (each test failed before its fix, for the reason given).

1. Process mode: an interrupt right after the served ops were popped from ``_outstanding`` still loses the
   loads once the child dies.
   Test: ``test_process_an_interrupt_right_after_the_pop_loses_no_load``.
   Where: ``disk/proc.py:423-436`` ``ProcessDiskStore.start_reads``. The ops are popped under the lock
   (l. 424-425). The ``try`` that calls ``_unqueued`` covers only ``put_many`` (l. 431-435). The lines
   between them are outside it: the ``served = [...]`` comprehension (l. 428, a backward jump where
   CPython runs a pending SIGINT handler) and ``cached.served -= ...`` (l. 429). An interrupt there leaves
   the ops untracked and the reads held. If the child then dies, ``_gone`` answers "0 op(s) in flight",
   and the next pass sends the held reads to the down store, which discards them. Both loads stay
   PENDING for ever. The test raises KeyboardInterrupt from the ``cached.served`` assignment.
   Fixed with 2 below: the served reads leave ``_held`` and their reports enter ``_served`` in one step; each
   op leaves ``_outstanding`` recorded with its entry in one C call (``ProcessDiskStore._queue_served``), and
   what an interrupt leaves there is queued by the next pass.

2. Thread mode (introduced by 3a14e65) and process mode (left by it): a served read whose report was
   already queued when the interrupt came is run a second time, and writes into a host slot that its
   first answer gave back and the owner has reused. A key's host copy then holds another key's bytes,
   and a load hands the engine wrong bytes.
   Tests: ``test_thread_a_read_answered_before_an_interrupt_never_writes_a_reused_host_slot`` and
   ``test_process_a_read_answered_before_an_interrupt_never_writes_a_reused_host_slot``.
   Where: ``disk/readers.py:112-114`` ``Readers.serve_cached`` and ``disk/proc.py:430-436`` with
   ``_unqueued`` (l. 447-456). ``put_many`` is a Python loop of ``put()``. When it is interrupted after
   some reports were queued, every served read stays held (and in process mode its op is tracked again).
   ``TierManager._block_until``'s ``finally: self._poll(True)`` (manager.py:663) then hands the held
   reads to the disk side and applies the queued report in the same pass. The promote is DONE and the
   host slot's lease is gone, but the reader or child still reads the old key's bytes into ``op.dst``.
   cached.py's invariant ("the slot is not published before its report") no longer holds for that
   second read. The commit's "at worst answers one twice (the second counted stale)" misses that the
   second *read* writes the slot.
   Fixed: a served read never runs again. It leaves the held reads in the same step (two stores, no call
   between) as its report enters a list of reports still to queue (``_served``, both stores); an interrupt
   leaves them to the next pass, which queues them all again (a report queued twice is counted stale).

3. SlabScheduler.prepare_store protects only ``_asked``. In a step with no lookups, a store's reservation
   evicts the blocks that the last asking step told a waiting request are hits.
   Test: ``test_a_store_in_a_step_without_lookups_keeps_the_waiting_requests_hits``.
   Where: ``integrations/scheduler.py:276-278``. ``tick()`` (l. 408-410) keeps the last asking step's
   keys (``_kept``) from the evict-ahead exactly for steps that ask nothing. vLLM has such steps: the
   batch is full, or the token budget is spent on running requests, so the waiting queue is not scanned.
   Running requests still store a block in those steps, and the reservation evicts a HIT block, contrary
   to prepare_store's docstring ("a request deferred by a read-back finds, when asked again, the blocks
   it was told are hits").
   Fixed: the same rule as ``tick``: this step's ``_asked`` if it made lookups (``_looked``), else ``_kept``.

4. SlabScheduler.close: a close broken off after ``core.close_disk`` returned (in ``refresh_gauges`` or
   ``metrics.closed``) is finished by the next close(). That close runs ``close_disk`` again, which
   restarts the disk I/O process after a clean close.
   Test: ``test_a_close_broken_off_after_the_disk_closed_does_not_restart_the_disk_process``.
   Where: ``integrations/scheduler.py:446-451`` (``_closed`` is now set last, so every step runs again)
   and ``core/tiers.py:1149-1155``. ``close_disk`` takes ``disk.down`` for a death, but
   ``ProcessDiskStore._gone(closed=True)`` sets ``_down`` after a clean close too (proc.py:344). It
   calls ``disk.restart(force=True)``: a new child is spawned at shutdown, runs the whole recovery scan
   (up to ``_OPEN_TIMEOUT_S``), logs "disk I/O process restarted", counts a restart, and is closed again.
   Fixed: ``TierCore.close_disk`` returns at once once it closed the disk store (``disk_closed``); this
   covers TierManager.close(), which sets its own flag last too.

Checked and found right (the unmarked tests below pin some of it):

* reads an interrupted queueing left held go to the disk side at the next pass, and the page-cache
  ``served`` count stays exact (``test_reads_served_again_after_an_interrupt_are_counted_once``, both modes);
* Tombs.delete_if_token: a delete under any token drops an unparsable record, and the writer's scan frees
  only that slot. Live entries keep theirs, and the next write gets the freed slot
  (``test_an_owner_delete_of_an_unparsable_record_frees_its_slot_and_no_live_one``). A tomb's durability
  still depends on ``unsettled`` only, not on the return value. ``settle_orphans`` ignores the return,
  and recovery frees the slot;
* the readers' offset guard: ``run[-1][0]`` is the largest slot of a sorted run. The owner's page-cache
  reads cannot meet such a slot, because recovery drops records whose slot lies past the file
  (recovery.py:107);
* the dead-child accounting in start_reads (``passed``/``served`` corrected under the lock);
* TierCore.drop_key / reset: each key READY in the host or on disk is reported once, a store in flight
  never is, and none is held after the reset
  (``test_reset_reports_each_block_held_removed_once_and_none_still_held``);
* ``_waited``: one lookup key for failed read-backs (entry not READY), RETRY then MISS, and RETRY then HIT.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

import tiered_kv.manager as manager_mod
from tiered_kv.disk import cached as cached_mod

import disk_helpers as dh
from test_review_owner_reads import _interrupt_queueing, _kill_and_settle_answers
from test_review_scheduler3 import _settle, full_slab_of_a_waiting_prefix
from test_review_scheduler_logic import _keys, _vllm_prefix_step
from test_vllm_scheduler import (  # noqa: F401  (rig: the scheduler fixture)
    rig, store_ready, worker_store,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def drig(tmp_path: Path) -> Iterator[dh.Rig]:
    """The disk tests' Rig (disk_helpers.rig) under another name: ``rig`` is the scheduler's here."""
    r = dh.Rig(tmp_path)
    yield r
    r.close_all()


# =============================================================================== 1. process: interrupt after the pop
def test_process_an_interrupt_right_after_the_pop_loses_no_load(drig: dh.Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both reads are served from the page cache; their ops are popped from ``_outstanding`` under the lock.
    A SIGINT handled at the next bytecode check after the lock (the list comprehension that filters
    ``served``, or the ``cached.served -=`` line: modelled by a KeyboardInterrupt from that assignment) is
    outside the ``try`` that calls ``_unqueued``: the ops stay untracked, the reads stay held.  The child dies
    (here: just before the interrupt is raised): ``_gone`` answers nothing for them, and the interrupted
    wait's last pass sends the held reads to the dead store (``kick`` discards them).  Both loads pend for
    ever.  (With a live child the re-sent, untracked reads are answered: the loss needs its death before
    it answers them.)"""
    kv, mgr, ks = dh.disk_only_keys(drig, "process", n=2)
    store = mgr.disk
    monkeypatch.setattr(manager_mod, "CLOSE_TIMEOUT_S", 2.0)
    c = store.cached
    real_read = c.read
    armed: list[int] = []

    class Trap(cached_mod.CachedReads):
        @property
        def served(self) -> int:  # type: ignore[override]
            return self.__dict__["served"]

        @served.setter
        def served(self, v: int) -> None:
            if armed == [1]:   # the first change of ``served`` after read() returned: start_reads' own
                armed.append(2)
                # the child dies before it could answer the reads the interrupted wait's last pass re-sends
                # (untracked, they would be answered by a live child): its death answers what it had
                _kill_and_settle_answers(mgr)
                raise KeyboardInterrupt
            self.__dict__["served"] = v

    def read(ops, until=None):  # type: ignore[no-untyped-def]
        got = real_read(ops, until)
        if not armed and len(got[0]) == 2:
            armed.append(1)
        return got

    c.__class__ = Trap
    monkeypatch.setattr(c, "read", read)
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    try:
        with pytest.raises(KeyboardInterrupt):
            mgr.wait(jobs, timeout=30)
        assert armed == [1, 2]
        mgr.wait(jobs, timeout=3)
        assert all(j.done for j in jobs), [j.state.name for j in jobs]
    finally:
        drig.close(mgr)


# =============================================================================== 2. thread: a read executed twice
def test_thread_a_read_answered_before_an_interrupt_never_writes_a_reused_host_slot(
        drig: dh.Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner serves c0 and c1 from the page cache; queueing is interrupted after c0's report.  Both reads
    stay held ("at worst answered twice").  The next pass hands them to a reader (held here by a gate) and
    applies c0's report: c0 is READY in host slot S, its lease gone.  Stores then evict c0 and reuse S for
    another key X.  The reader then runs the stale read of c0 into S: X's host copy holds c0's bytes, and
    a load of X hands the engine wrong bytes."""
    kv, mgr, ks = dh.disk_only_keys(drig, "thread", n=2)
    store = mgr.disk
    readers = store.readers
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    fired = _interrupt_queueing(readers._out, monkeypatch)
    gate = threading.Event()
    entered = threading.Event()
    real_run = readers._run

    def gated_run(ops):  # type: ignore[no-untyped-def]
        entered.set()
        assert gate.wait(60)
        return real_run(ops)

    monkeypatch.setattr(readers, "_run", gated_run)
    try:
        with pytest.raises(KeyboardInterrupt):
            mgr.wait(jobs, timeout=30)
        assert fired
        mgr.poll()       # (before the fix: the interrupted wait's last pass handed the held reads to a reader, gated)
        mgr.wait(jobs, timeout=30)
        assert [j.state.name for j in jobs] == ["DONE", "DONE"] and dh.row_is(kv, 0, ks[0])
        assert not entered.is_set(), "a read served before the interrupt was handed to a reader again"
        slot = mgr._core.index.get(ks[0]).slot
        new = dh.keys(8, "x")
        for i, k in enumerate(new):      # host churn: c0 is evicted, its slot reused
            dh.store_one(mgr, kv, k, 2 + i % 6)
        owner = [k for k in new if (e := mgr._core.index.get(k)) is not None and e.slot == slot]
        assert owner, "the host slot was not reused (test setup)"
        x = owner[0]
        assert bytes(mgr.host_bytes(x).numpy()) == bytes(dh.content(x).numpy())
        gate.set()                        # the reader runs the held reads: c0's again (stale), c1's
        mgr.wait([jobs[1]], timeout=30)
        readers_idle = readers._reads.empty()
        assert readers_idle
        got = bytes(mgr.host_bytes(x).numpy())
        assert got == bytes(dh.content(x).numpy()), (
            f"host copy of {x!r} overwritten; it holds {ks[0]!r}'s bytes (the stale second read): "
            f"{got == bytes(dh.content(ks[0]).numpy())}")
        assert not entered.is_set()
    finally:
        gate.set()
        drig.close(mgr)


# =============================================================================== 3. scheduler: a step with no lookups
def test_a_store_in_a_step_without_lookups_keeps_the_waiting_requests_hits(rig) -> None:  # noqa: F811
    """prepare_store's docstring: "a request deferred by a read-back finds, when asked again, the blocks it
    was told are hits".  vLLM does not ask a waiting request at every step (the batch is full, or the token
    budget is spent on running requests), but running requests store a block at such a step.  tick() keeps
    the last asking step's keys (``_kept``) from the evict-ahead for exactly that case; prepare_store
    protects only ``_asked`` (empty in such a step) and evicts them."""
    R = _keys(4)
    tiers = full_slab_of_a_waiting_prefix(rig, R)
    # step 1: the waiting request is asked: k0..k2 HIT, k3 PENDING (evicts other-x); deferred
    assert _vllm_prefix_step(tiers, R) is None
    tiers.tick()
    _settle(tiers)
    assert all(tiers.state_of(k)[0] == "ready" for k in R)
    # step 2: the batch is full, the waiting request is not asked; a running request stores a block
    p = tiers.prepare_store([b"run-000"])
    if p.keys:
        worker_store(tiers.slab, p.keys, p.slots, p.seq, "run")
        tiers.complete_store(p.keys)
    tiers.tick()
    _settle(tiers)
    gone = [k for k in R if tiers.state_of(k)[0] != "ready"]
    assert not gone, f"the store of a step without lookups evicted {gone}, which the last step told HIT/PENDING"
    # step 3: the waiting request is asked again
    assert _vllm_prefix_step(tiers, R) == 4


# =============================================================================== 4. scheduler: close finished twice
def test_a_close_broken_off_after_the_disk_closed_does_not_restart_the_disk_process(
        rig, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """close() now sets ``_closed`` last, so the next close() re-runs every step.  An interrupt after
    ``core.close_disk`` returned (in ``refresh_gauges``/``metrics.closed``) leaves a process store that
    closed cleanly: its ``_gone(closed=True)`` set ``_down``.  The second close()'s ``close_disk`` sees
    ``disk.down`` and calls ``disk.restart(force=True)``: a new disk I/O process is spawned at shutdown,
    runs the whole recovery scan (up to ``_OPEN_TIMEOUT_S``), reconciles, logs "disk I/O process
    restarted", and is closed again."""
    tiers = rig.open(rig.slab(num_slots=8, row_bytes=256), disk=True, disk_blocks=32, disk_io="process")
    store_ready(tiers, [b"a", b"b"])
    assert tiers.flush(timeout=30)
    disk = tiers.core.disk
    first = disk.store
    real = tiers.metrics.closed
    fired: list[int] = []

    def closed_then_interrupt() -> None:
        if not fired:
            fired.append(1)
            raise KeyboardInterrupt
        real()

    monkeypatch.setattr(tiers.metrics, "closed", closed_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        tiers.close()
    assert fired and first.down          # the disk closed cleanly before the interrupt
    tiers.close()                        # finishes the close
    assert disk.restarts == 0 and disk.store is first, (
        f"the second close() started a new disk I/O process (restarts={disk.restarts}) after a clean close")


# =============================================================================== checked: the served count
@pytest.mark.parametrize("io", ["process", "thread"])
def test_reads_served_again_after_an_interrupt_are_counted_once(drig: dh.Rig, monkeypatch: pytest.MonkeyPatch,
                                                                io: str) -> None:
    """Checked, right: the held reads an interrupted queueing left go to the disk side at the next (non-blocking)
    pass, so page_cache_reads_total{served} stays 2 for 2 loads."""
    kv, mgr, ks = dh.disk_only_keys(drig, io, n=2)
    store = mgr.disk
    q = store._out if io == "process" else store.readers._out
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    fired = _interrupt_queueing(q, monkeypatch)
    try:
        with pytest.raises(KeyboardInterrupt):
            mgr.wait(jobs, timeout=30)
        assert fired
        mgr.wait(jobs, timeout=30)
        mgr.poll()
        assert [j.state.name for j in jobs] == ["DONE", "DONE"] and all(dh.row_is(kv, i, k) for i, k in enumerate(ks))
        served = dh.metric(mgr, "tiered_kv_disk_page_cache_reads_total", outcome="served")
        assert served == 2, f"{served} page-cache reads counted served for 2 loads"
    finally:
        drig.close(mgr)


# =============================================================================== 2b. process: the same, left by 3a14e65
class _WriteGate:
    """``tiered_kv.disk.proc.os`` with ``write`` refused (the pipe to the child full) while ``shut``."""

    def __init__(self) -> None:
        import os as real
        self._os = real
        self.shut = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._os, name)

    def write(self, fd: int, data: Any) -> int:
        if self.shut:
            raise BlockingIOError
        return self._os.write(fd, data)


def test_process_a_read_answered_before_an_interrupt_never_writes_a_reused_host_slot(
        drig: dh.Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the thread-mode test: c0's report was queued before the interrupt, ``_unqueued`` re-tracked both ops
    and both reads stay held.  The next pass applies c0's report (c0 READY in host slot S, lease gone) and sends
    both reads to the child (held in the owner's backlog here: a full pipe).  Stores reuse S for X; the child
    then reads c0's bytes into S: X's host copy holds c0's bytes."""
    import tiered_kv.disk.proc as proc_mod
    kv, mgr, ks = dh.disk_only_keys(drig, "process", n=2)
    store = mgr.disk
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    gate = _WriteGate()
    monkeypatch.setattr(proc_mod, "os", gate)
    fired = _interrupt_queueing(store._out, monkeypatch, then=lambda: setattr(gate, "shut", True))
    try:
        with pytest.raises(KeyboardInterrupt):
            mgr.wait(jobs, timeout=30)       # its last pass (finally) applies c0's report, sends both reads again
        assert fired
        mgr.wait(jobs, timeout=30)   # (before the fix: c1 pending, both reads sent again into the backlog)
        assert [j.state.name for j in jobs] == ["DONE", "DONE"] and dh.row_is(kv, 0, ks[0])
        slot = mgr._core.index.get(ks[0]).slot
        x: Optional[bytes] = None
        for i, k in enumerate(dh.keys(24, "x")):   # host churn until c0 is evicted and its slot reused
            dh.fill(kv, 2 + i % 6, k)
            job = mgr.store(k, 2 + i % 6)
            if job is not None:
                mgr.wait([job], timeout=30)
            e = mgr._core.index.get(k)
            if e is not None and e.slot == slot and e.state.value == "ready":
                x = k
                break
        assert x is not None, "the host slot was not reused (test setup)"
        assert bytes(mgr.host_bytes(x).numpy()) == bytes(dh.content(x).numpy())
        gate.shut = False
        mgr.wait([jobs[1]], timeout=30)      # the backlog goes: the child reads c0 (again) and c1
        assert jobs[1].state.name == "DONE"
        assert mgr.flush(timeout=30)
        got = bytes(mgr.host_bytes(x).numpy())
        assert got == bytes(dh.content(x).numpy()), (
            f"host copy of {x!r} overwritten; it holds {ks[0]!r}'s bytes (the stale second read): "
            f"{got == bytes(dh.content(ks[0]).numpy())}")
    finally:
        gate.shut = False
        drig.close(mgr)


# =============================================================================== checked: the unparsable-record delete
def test_an_owner_delete_of_an_unparsable_record_frees_its_slot_and_no_live_one(tmp_path: Path) -> None:
    """Checked, right (5b598cd): a delete under any token drops a record with no parseable header; the scan frees
    its slot only; the live entries keep theirs, and the next writes take the freed slot, never a live one."""
    r = dh.StoreRig(tmp_path / "d", slots=4)
    try:
        ks = dh.keys(4, "u")
        toks = {k: r.write(k) for k in ks}
        assert r.flush()
        slots = {k: r.slot_of(k) for k in ks}
        r.break_header(ks[1])
        r.s.submit_delete(uuid.uuid4(), ks[1])   # an eviction whose token cannot match an unparsable record
        assert r.flush() and r.flush()
        assert r.s.slots_in_use == 3
        new = r.write(b"fresh")
        assert r.flush()
        assert r.slot_of(b"fresh") == slots[ks[1]]
        for k in (ks[0], ks[2], ks[3]):
            rep, got = r.read(k, toks[k])
            assert rep.ok and got == bytes(dh.content(k).numpy()), k
        rep, got = r.read(b"fresh", new)
        assert rep.ok and got == bytes(dh.content(b"fresh").numpy())
    finally:
        r.close()


# =============================================================================== checked: reset in the evicted keys
def test_reset_reports_each_block_held_removed_once_and_none_still_held(rig) -> None:  # noqa: F811
    """Checked, right (c6164e1): after a reset, take_evicted names every key READY in the host or on disk
    once (host-only, disk-only, both), none that was never offloaded, and none is READY anywhere after."""
    tiers = rig.open(rig.slab(num_slots=4, row_bytes=256), disk=True, disk_blocks=32, disk_io="thread")
    ks = [b"k%d" % i for i in range(7)]
    for k in ks:                                   # 7 keys through 4 slots: 3 on disk only, 4 on both
        store_ready(tiers, [k])
        assert tiers.flush(timeout=30)
        tiers.tick()
    tiers.take_evicted()
    held = [k for k in ks if tiers.state_of(k) != (None, None)]
    assert len(held) == 7
    p = tiers.prepare_store([b"pending"])          # a store in flight: never published, never reported
    assert p.keys
    tiers.reset()
    gone = tiers.take_evicted()
    assert sorted(gone) == sorted(ks), gone
    assert all(tiers.state_of(k) == (None, None) for k in ks + [b"pending"])
