"""Adversarial review of the owner's own page-cache reads while it blocks in ``wait()``
(``disk/cached.py``, the ``cached_here`` paths of ``ProcessDiskStore.start_reads`` and
``Readers.serve_cached``, ``DiskTier.count_page_cache_reads``, the metric
``tiered_kv_disk_page_cache_reads_total{outcome=served|handed_on}``).

What it proved wrong (each test failed before its fix):

1. ``handed_on`` counts reads that a dead disk I/O process had already answered as failed.
   Test: ``test_handed_on_does_not_count_reads_a_dead_child_already_failed``.
   Where: ``disk/proc.py`` ``ProcessDiskStore.start_reads`` (l. 419-426) reads the page cache even when
   ``_dead`` is set. It takes the dropped reads off ``cached.served`` but never off ``cached.passed``,
   which ``disk/cached.py:121`` counted. The cold ones go into ``_cmds``, and ``kick()`` discards them
   because the store is down. The metric then says 2 reads went to the disk I/O side when none did,
   while ``served`` is corrected for the same situation.
   Fixed: no page-cache read once the child is dead, and one that died during the reads takes what it
   answered off ``cached.passed`` too (under ``_lock``).

2. Thread mode (``disk_io="thread"``): an interrupt while the reads served here are being queued loses
   the ones not yet queued. Their loads stay PENDING forever, and ``close()`` waits ``CLOSE_TIMEOUT_S``
   for them. Test: ``test_thread_an_interrupt_while_served_reads_are_queued_loses_none``.
   Where: ``disk/readers.py:109-111`` ``Readers.serve_cached`` sets ``self._held_reads = rest``
   *before* ``self._out.put_many(served)``, whose Python loop of ``put()`` an interrupt can break.
   ``proc.py`` does it the other way round on purpose: put first, then drop them from ``_held``.
   Fixed: the served reads leave the held ones as their reports enter a list still to queue, in one step;
   an interrupt leaves that list to the next pass (a report queued twice is counted stale; no read runs
   twice: see test_review_todays_fixes2.py).

3. Process mode: a served read whose ``put_many`` an interrupt broke off has already been popped from
   ``_outstanding`` but stays in ``_held``. If the child is dead (or dies) it is never answered: the
   next pass drops it (``pop() is None and dead``), or sends it to the child untracked, and ``_gone``
   does not know it. Its load stays PENDING forever.
   Test: ``test_process_a_read_popped_by_an_interrupted_pass_is_answered_after_the_child_dies``.
   Where: ``disk/proc.py:423-427`` (the filter ``pop(...) is not None or not dead``, and
   ``put_many`` outside any handler).
   Fixed: the reports wait in ``ProcessDiskStore._served``, each with the op it took out of
   ``_outstanding`` (recorded in the same C call), until they are queued, by this pass or the next.

Checked and found right (the unmarked tests pin it):

* the checksum is verified on every owner read (damaged or foreign bytes in a "cached" slot, a
  short read, ``EIO``, a truncated slot file): the read goes to the disk I/O side, or is a miss
  there. It never crashes, never hands out wrong bytes, never turns the feature off;
* a load cancelled (``free_block``) or a key invalidated before the owner reads: the served report is
  discarded and counted stale (``kind="promote"``). The row is not written and the key is not served
  again;
* the child dying inside the owner's reads: every load is answered (a miss that keeps the disk
  entry), nothing leaks, and the reads after the restart are right;
* the counters across a restart of the child, at ``close()`` (also after a death), after a cold
  block, and with ``disk_read_cached_in_wait=False``.
"""

from __future__ import annotations

import errno
import os
from typing import Any

import pytest

import tiered_kv.manager as manager_mod
from tiered_kv.disk import cached as cached_mod
from tiered_kv.disk.format import where_slot

from disk_helpers import (Rig, disk_only_keys, metric, metric_sum, restart_disk_process, rig, row_is,  # noqa: F401
                          settle_restart, slot_file)

pytestmark = pytest.mark.timeout(120)

PC = "tiered_kv_disk_page_cache_reads_total"
IO = ["process", "thread"]


def _all_cold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every page-cache read is refused as not cached (what RWF_NOWAIT answers for a cold block)."""
    def preadv(fd, bufs, off, flags):  # type: ignore[no-untyped-def]
        raise BlockingIOError(errno.EAGAIN, "not cached")

    monkeypatch.setattr(cached_mod, "_PREADV", preadv)
    monkeypatch.setattr(cached_mod.FileResidency, "cached", lambda self, off, n: None)


def _kill_and_settle_answers(mgr: Any) -> None:
    """SIGKILL the disk I/O process and wait (a join, no sleep) until its receiver answered every op it had."""
    store = mgr.disk
    store.kill_for_test()
    store._receiver.join(30)
    assert store.dead and store.down


def _interrupt_queueing(q: Any, monkeypatch: pytest.MonkeyPatch, then: Any = None) -> list[int]:
    """The first ``q.put_many`` of two served reads queues the first, then raises KeyboardInterrupt (a SIGINT
    between the two ``put()`` of CompletionQueue.put_many's loop); ``then()`` runs just before it raises."""
    real = q.put_many
    fired: list[int] = []

    def put_then_interrupt(items):  # type: ignore[no-untyped-def]
        if not fired and len(items) == 2:
            fired.append(1)
            q.put(items[0])
            if then is not None:
                then()
            raise KeyboardInterrupt
        return real(items)

    monkeypatch.setattr(q, "put_many", put_then_interrupt)
    monkeypatch.setattr(manager_mod, "CLOSE_TIMEOUT_S", 2.0)   # the test's close() must not wait 30 s for a lost read
    return fired


# =============================================================================================== findings
def test_handed_on_does_not_count_reads_a_dead_child_already_failed(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two reads held when the child dies: its death answers both failed. The owner's pass then
    counts both handed_on (they go into ``_cmds``, which ``kick()`` discards because the store is down).
    Had the blocks been cached, the same two would have been taken off ``served``."""
    kv, mgr, ks = disk_only_keys(rig, "process", n=2)
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    assert all(j is not None for j in jobs)
    _kill_and_settle_answers(mgr)
    _all_cold(monkeypatch)
    mgr.wait(jobs, timeout=30)
    assert [j.state.name for j in jobs] == ["FAILED", "FAILED"]   # answered by the death, not by any reader
    assert metric(mgr, PC, outcome="served") == 0
    assert metric(mgr, PC, outcome="handed_on") == 0, "reads no disk reader ever got were counted handed_on"


def test_thread_an_interrupt_while_served_reads_are_queued_loses_none(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    kv, mgr, ks = disk_only_keys(rig, "thread", n=2)
    store = mgr.disk
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    fired = _interrupt_queueing(store.readers._out, monkeypatch)
    try:
        with pytest.raises(KeyboardInterrupt):
            mgr.wait(jobs, timeout=30)
        assert fired
        mgr.wait(jobs, timeout=2)
        assert [j.state.name for j in jobs] == ["DONE", "DONE"], (
            f"{[j.state.name for j in jobs]}: the second read is neither held ({len(store.readers._held_reads)}) "
            f"nor answered")
        assert all(row_is(kv, i, k) for i, k in enumerate(ks))
    finally:
        rig.close(mgr)   # with CLOSE_TIMEOUT_S still patched


def test_process_a_read_popped_by_an_interrupted_pass_is_answered_after_the_child_dies(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both reads are served here and popped from ``_outstanding``. The first is queued, then the
    interrupt comes and the child dies with it. ``_gone`` answers nothing ("0 op(s) in flight"), and the
    next pass sends the second read to the dead store (discarded) or drops it (``pop() is None and
    dead``). Its load pends forever."""
    kv, mgr, ks = disk_only_keys(rig, "process", n=2)
    store = mgr.disk
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    fired = _interrupt_queueing(store._out, monkeypatch, then=lambda: _kill_and_settle_answers(mgr))
    try:
        with pytest.raises(KeyboardInterrupt):
            mgr.wait(jobs, timeout=30)
        assert fired
        mgr.wait(jobs, timeout=2)
        assert all(j.done for j in jobs), [j.state.name for j in jobs]
    finally:
        rig.close(mgr)   # with CLOSE_TIMEOUT_S still patched


# =============================================================================================== checked: right
def test_the_child_dying_inside_the_owner_reads_answers_every_load(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The child dies during the owner's second page-cache read. Every load is answered (a miss; the
    disk entries stay), the reads served meanwhile are not counted, nothing leaks, and after the restart
    the same keys are served here with their bytes."""
    kv, mgr, ks = disk_only_keys(rig, "process", n=3)
    disk0 = mgr.disk_blocks
    store = mgr.disk
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    real = cached_mod._PREADV
    calls: list[int] = []

    def preadv(fd, bufs, off, flags):  # type: ignore[no-untyped-def]
        calls.append(off)
        got = real(fd, bufs, off, flags)
        if len(calls) == 2:
            _kill_and_settle_answers(mgr)
        return got

    monkeypatch.setattr(cached_mod, "_PREADV", preadv)
    mgr.wait(jobs, timeout=30)
    monkeypatch.undo()
    assert [j.state.name for j in jobs] == ["FAILED"] * 3
    assert store.cached.served == 0
    for _ in range(200):
        if mgr.disk is not store and mgr._core.disk._starting is None:
            break
        mgr.wait(timeout=0.05)
        settle_restart(mgr)
    assert mgr.disk is not store
    assert mgr.host_used_slots == mgr.host_blocks and mgr.disk_blocks == disk0 and mgr.jobs_in_flight == 0
    assert metric(mgr, PC, outcome="served") == 0
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    mgr.wait(jobs, timeout=30)
    mgr.poll()
    assert [j.state.name for j in jobs] == ["DONE"] * 3 and all(row_is(kv, i, k) for i, k in enumerate(ks))
    assert metric(mgr, PC, outcome="served") == 3


def _fake_pread(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """mincore says "cached"; the read then fails (EIO), comes back short, or brings wrong bytes."""
    real = cached_mod._PREADV

    def preadv(fd, bufs, off, flags):  # type: ignore[no-untyped-def]
        dst = bufs[0]
        n = len(dst)
        if how == "eio":
            raise OSError(errno.EIO, "I/O error")
        if how == "short":
            return real(fd, [dst[: n // 2]], off, flags)
        dst[:] = bytes(n)   # "garbage": a full read of the wrong bytes
        return n

    monkeypatch.setattr(cached_mod, "_PREADV", preadv)
    monkeypatch.setattr(cached_mod.FileResidency, "cached", lambda self, off, n: True)


@pytest.mark.parametrize("io", IO)
@pytest.mark.parametrize("how", ["eio", "short", "garbage"])
def test_a_cached_block_whose_owner_read_fails_goes_to_the_disk_side(rig: Rig, monkeypatch: pytest.MonkeyPatch,
                                                                    io: str, how: str) -> None:
    kv, mgr, ks = disk_only_keys(rig, io, n=2)
    store = mgr.disk
    _fake_pread(monkeypatch, how)
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    mgr.wait(jobs, timeout=30)
    monkeypatch.undo()
    assert [j.state.name for j in jobs] == ["DONE", "DONE"]
    assert all(row_is(kv, i, k) for i, k in enumerate(ks))
    assert store.cached.enabled and store.cached.served == 0
    mgr.poll()
    assert metric(mgr, PC, outcome="handed_on") == 2 and metric(mgr, PC, outcome="served") == 0


@pytest.mark.parametrize("io", IO)
def test_a_truncated_slot_file_is_a_miss_never_a_crash(rig: Rig, io: str) -> None:
    kv, mgr, ks = disk_only_keys(rig, io, n=2)
    os.truncate(slot_file(rig.path), 0)
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    mgr.wait(jobs, timeout=30)
    assert [j.state.name for j in jobs] == ["FAILED", "FAILED"]
    assert mgr.disk.cached.served == 0
    assert not any(row_is(kv, i, k) for i, k in enumerate(ks))
    assert all(mgr._core.dindex.get(k) is None for k in ks)


@pytest.mark.parametrize("io", IO)
def test_a_load_cancelled_before_the_owner_reads_is_discarded(rig: Rig, io: str) -> None:
    kv, mgr, ks = disk_only_keys(rig, io, n=2)
    j0 = mgr.load(ks[0], 0)
    j1 = mgr.load(ks[1], 1)
    mgr.free_block(0)         # the engine reuses row 0: its load is cancelled (the read goes on as a prefetch)
    mgr.invalidate(ks[1])     # key 1 is never served again: its promote is cancelled
    mgr.wait(timeout=30)
    mgr.poll()
    assert j0.state.name == "CANCELLED" and j1.state.name == "CANCELLED"
    assert mgr.free_block(0) is True
    assert mgr.host_bytes(ks[1]) is None and mgr.load(ks[1], 1) is None
    assert metric_sum(mgr, "tiered_kv_stale_callbacks_total", kind="promote") == 1
    got = mgr.host_bytes(ks[0])
    assert got is None or bytes(got.numpy()) == bytes(row_content(ks[0]))


def row_content(key: bytes) -> Any:
    from disk_helpers import content
    return content(key).numpy()


def test_the_counts_survive_a_restart_of_the_disk_process(rig: Rig) -> None:
    kv, mgr, ks = disk_only_keys(rig, "process", n=3)
    job = mgr.load(ks[0], 0)
    mgr.wait([job], timeout=30)
    restart_disk_process(mgr)
    jobs = [mgr.load(k, i + 1) for i, k in enumerate(ks[1:])]
    mgr.wait(jobs, timeout=30)
    mgr.poll()
    assert all(row_is(kv, i, k) for i, k in enumerate(ks))
    assert metric(mgr, PC, outcome="served") == 3 and metric(mgr, PC, outcome="handed_on") == 0


def test_close_counts_the_reads_it_served(rig: Rig) -> None:
    kv, mgr, ks = disk_only_keys(rig, "process", n=2)
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    store = mgr.disk
    rig.close(mgr)   # close() blocks until the promotes are in: it reads them here
    assert all(j.state.name == "DONE" for j in jobs)
    assert all(row_is(kv, i, k) for i, k in enumerate(ks))
    assert metric(mgr, PC, outcome="served") == store.cached.served == 2
    assert metric(mgr, PC, outcome="handed_on") == 0


def test_close_after_a_death_counts_exactly(rig: Rig) -> None:
    kv, mgr, ks = disk_only_keys(rig, "process", n=2)
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    _kill_and_settle_answers(mgr)
    rig.close(mgr)
    assert all(j.state.name == "FAILED" for j in jobs)
    assert metric(mgr, PC, outcome="served") == 0


@pytest.mark.parametrize("io", IO)
def test_counts_after_a_cold_block_are_exact(rig: Rig, io: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kv, mgr, ks = disk_only_keys(rig, io, n=3)
    second = sorted(where_slot(mgr._core.dindex.ready(k).where) for k in ks)[1]
    sb = mgr.disk.cached._slot_bytes
    real = cached_mod.FileResidency.cached
    monkeypatch.setattr(cached_mod.FileResidency, "cached",
                        lambda self, off, n: False if off == second * sb else real(self, off, n))
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    mgr.wait(jobs, timeout=30)
    mgr.poll()
    assert [j.state.name for j in jobs] == ["DONE"] * 3 and all(row_is(kv, i, k) for i, k in enumerate(ks))
    served, handed = metric(mgr, PC, outcome="served"), metric(mgr, PC, outcome="handed_on")
    assert (served, handed) == (mgr.disk.cached.served, mgr.disk.cached.passed)
    assert served + handed == 3 and handed >= 1


@pytest.mark.parametrize("io", IO)
def test_off_means_no_owner_read(rig: Rig, io: str) -> None:
    kv, mgr, ks = disk_only_keys(rig, io, n=2, disk_read_cached_in_wait=False)
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    mgr.wait(jobs, timeout=30)
    mgr.poll()
    assert [j.state.name for j in jobs] == ["DONE"] * 2 and all(row_is(kv, i, k) for i, k in enumerate(ks))
    assert metric(mgr, PC, outcome="served") == metric(mgr, PC, outcome="handed_on") == 0
