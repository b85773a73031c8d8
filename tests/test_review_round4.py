"""Adversarial review, round 4: commits 64fd0c9 (an interrupted close finished by the next one), bccfbcd (held
reads leave the owner as they are queued; ``served`` counted with its report kept), 8a774a0 (the ``_served``
pending reports) and 63e2d2d (SlabScheduler's ``_waiting``/``_requests`` bounds).

Interrupts are injected as before: a function the code calls raises KeyboardInterrupt at the chosen call (a
SIGINT is handled at the eval-breaker check a call ends with; CPython 3.11's CALL of a builtin class, ``map``
included, checks it -- an itimer loop over ``r.held = []; deque(map(q.put, b), 0)`` lost the items in 84,108 of
111,800 interrupts, and none with the ``map`` built before the store).

What it proved wrong, each test failing before its fix:

1. ``Readers._enqueue`` emptied ``_held_reads`` before the ``map()`` call that built the puts: a SIGINT at that
   call's check lost every held read (loads PENDING for ever).  Fixed: the ``map`` is made before the lock; the
   store and the C loop of puts have no call between them.
   ``test_thread_an_interrupt_at_enqueues_map_call_loses_no_held_read``.
2. The ``_requests`` bound (one request per host slot) forgot a request that still waited when more requests
   than host slots waited on one shared read-back: 3 requests, 2 slots, 1 block counted (keys, disk hits, host
   hits) = (4, 2, 1), not (3, 3, 0).  Fixed: the bound is ``scheduler.REQUESTS_MAX`` (65,536) requests, not tied
   to the slots.  ``test_more_requests_than_slots_waiting_on_one_read_back_each_count_one_key_and_a_disk_hit``;
   the bound itself: ``test_requests_never_finished_are_forgotten_oldest_first_past_the_requests_bound``.
3. ``ProcessDiskStore._release`` marked the pipes and the path lock released before closing them; interrupted
   after the first ``os.close``, the next close() returned at once and the path stayed locked.  Fixed: each
   is closed in a ``finally`` of the one before.
   ``test_a_close_interrupted_while_it_releases_the_path_is_finished_by_the_next_close``.
4. ``DiskTier.restart`` interrupted after adopting the new store but before its reconciliation deletes: the
   next close skipped the restart, and a key invalidated while the child was dead came back at the next open.
   ``test_an_interrupt_in_close_s_restart_after_adoption_keeps_an_invalidated_key_deleted``.
5. ``DiskTier.restart`` interrupted between taking the started store and adopting it: the new child and its
   share of the path lock belonged to no one; at close the path stayed locked
   (``test_an_interrupt_in_close_s_restart_before_adoption_leaks_no_disk_process``), in a pass every later
   restart failed with DiskInUseError
   (``test_an_interrupt_in_a_pass_s_restart_before_adoption_does_not_leave_the_tier_down_for_good``).
   Fixed (4, 5): the started store is taken in one step (``_starting`` cleared, ``_adopting`` set) and adopted
   by ``DiskTier._adopt``, whose parts can run again; the tier is ``down`` until it ends, so the next pass's
   or close's ``restart()`` finishes an adoption an interrupt broke off.
6. ``DiskStore.close`` (disk_io="thread") set ``_closed`` first: a Ctrl-C in its readers' join and the next
   close() returned at once, the writer never told to close and the path locked.  Fixed: ``_closed`` is set
   once the path is released (or left to the reaper); each step can run again.
   ``test_thread_a_close_interrupted_while_it_joins_the_readers_is_finished_by_the_next_close``.
7. ``Readers.start``'s fall-backs (no reader left, none can start) emptied ``_held_reads`` before answering
   them: an interrupt there lost the loads.  Fixed: the answers are made first, and the reads leave the held
   ones in the same step as their reports join ``_served`` (``Readers._answer_unread``).
   ``test_thread_an_interrupt_while_reads_with_no_reader_are_answered_loses_none``.
8. ``RemoteStore.close`` set ``_closed`` before telling its threads to close: after an interrupt the next close
   returned at once and the reader thread ran on.  Fixed: ``_closing`` (no more work) first, ``_closed`` last.
   ``test_a_close_interrupted_while_it_stops_the_remote_threads_is_finished_by_the_next_close``.

Checked and found right (a plain test pins it): a process close interrupted in its first kick() after the "X"
is queued sends one "X", restarts nothing, and the child exits 0.
"""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any, Iterator

import pytest

import tiered_kv.disk.proc as proc_mod
import tiered_kv.disk.readers as readers_mod
import tiered_kv.manager as manager_mod

import disk_helpers as dh
from test_scheduler_counts_machine import _counts
from test_vllm_scheduler import (  # noqa: F401  (rig: the scheduler fixture)
    HIT, PENDING, rig, store_ready, wait_promotes,
)

pytestmark = pytest.mark.timeout(120)

PC = "tiered_kv_disk_page_cache_reads_total"


@pytest.fixture
def drig(tmp_path: Path) -> Iterator[dh.Rig]:
    """The disk tests' Rig (disk_helpers.rig) under another name: ``rig`` is the scheduler's here."""
    r = dh.Rig(tmp_path)
    yield r
    r.close_all()


# =============================================================================== 1. Readers._enqueue
def test_thread_an_interrupt_at_enqueues_map_call_loses_no_held_read(
        drig: dh.Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    kv, mgr, ks = dh.disk_only_keys(drig, "thread", n=2)
    monkeypatch.setattr(manager_mod, "CLOSE_TIMEOUT_S", 1.0)   # the close must not wait 30 s for a lost read
    readers = mgr.disk.readers
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    assert len(readers._held_reads) == 2
    fired: list[int] = []

    def map_then_interrupt(*a: Any) -> Any:
        m = builtins.map(*a)
        if not fired:
            fired.append(1)
            raise KeyboardInterrupt   # the SIGINT handled at the eval-breaker check after map() returned
        return m

    monkeypatch.setattr(readers_mod, "map", map_then_interrupt, raising=False)
    try:
        with pytest.raises(KeyboardInterrupt):
            mgr.poll()                # (non-blocking pass: no page-cache reads; the held reads go to start())
        assert fired
        mgr.wait(jobs, timeout=2)
        assert [j.state.name for j in jobs] == ["DONE", "DONE"], (
            f"loads never answered after an interrupt in Readers._enqueue: {[j.state.name for j in jobs]}, "
            f"held={len(readers._held_reads)}")
    finally:
        drig.close(mgr)


# =============================================================================== 2. the _requests bound
def test_more_requests_than_slots_waiting_on_one_read_back_each_count_one_key_and_a_disk_hit(rig) -> None:  # noqa: F811
    slab = rig.slab(num_slots=2, row_bytes=256)
    tiers = rig.open(slab, disk=True, disk_blocks=16, disk_io="thread", host_evict_ahead_blocks=0)
    P = b"p0"
    store_ready(tiers, [P])
    assert tiers.flush(timeout=30)
    for f in (b"f0", b"f1"):
        store_ready(tiers, [f])
    assert tiers.flush(timeout=30)
    tiers.tick()
    assert tiers.state_of(P) == (None, "ready"), tiers.state_of(P)
    base = _counts(tiers.metrics)
    reqs = ["R1", "R2", "R3"]
    for r in reqs:                      # one step: three waiting requests share the prefix block P
        assert tiers.lookup(P, request=r) == PENDING
    forgotten = [r for r in reqs if (r, P) not in tiers._waiting]
    wait_promotes(tiers)
    for r in reqs:                      # a later step: each asks again, the read-back landed
        assert tiers.lookup(P, request=r) == HIT
    keys, hits = _counts(tiers.metrics)
    got = (keys - base[0], hits["disk"] - base[1]["disk"], hits["host"] - base[1]["host"])
    assert got == (3, 3, 0), (f"(lookup keys, disk hits, host hits) = {got} for 3 requests waiting on 1 read-back; "
                              f"forgotten while they waited: {forgotten}")


def test_requests_never_finished_are_forgotten_oldest_first_past_the_requests_bound(
        rig, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The bound that replaced one request per slot still bounds a front end that never finishes its requests."""
    import tiered_kv.integrations.scheduler as sched_mod

    monkeypatch.setattr(sched_mod, "REQUESTS_MAX", 2)
    slab = rig.slab(num_slots=2, row_bytes=256)
    tiers = rig.open(slab, disk=True, disk_blocks=16, disk_io="thread", host_evict_ahead_blocks=0)
    P = b"p0"
    store_ready(tiers, [P])
    assert tiers.flush(timeout=30)
    for f in (b"f0", b"f1"):
        store_ready(tiers, [f])
    assert tiers.flush(timeout=30)
    tiers.tick()
    for r in ("R1", "R2", "R3"):
        assert tiers.lookup(P, request=r) == PENDING
    assert list(tiers._requests) == ["R2", "R3"]
    assert sorted(r for r, _ in tiers._waiting) == ["R2", "R3"]
    wait_promotes(tiers)


# =============================================================================== 3. ProcessDiskStore._release
def test_a_close_interrupted_while_it_releases_the_path_is_finished_by_the_next_close(
        drig: dh.Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    import os as real_os

    kv = dh.make_kv(rows=8)
    mgr = drig.open(kv, host_slots=8, disk_slots=64, disk_io="process")
    dh.store_seq(mgr, kv, dh.keys(2, "r"))
    store = mgr.disk
    fired: list[int] = []

    class Os:   # proc.py's ``os``: its first close() inside _release is followed by a SIGINT
        def __getattr__(self, name: str) -> Any:
            return getattr(real_os, name)

        @staticmethod
        def close(fd: int) -> None:
            real_os.close(fd)
            if not fired and store._rep_r < 0:   # (inside _release: the pipes marked closed)
                fired.append(fd)
                raise KeyboardInterrupt

    lock_fd, rep_r = store._lock_fd, store._rep_r
    rep_ino = real_os.fstat(rep_r).st_ino
    monkeypatch.setattr(proc_mod, "os", Os())
    try:
        with pytest.raises(KeyboardInterrupt):
            mgr.close()
        assert fired
        mgr.close()                       # finishes the close
        monkeypatch.undo()
        dh.assert_reopens(drig, kv, host_slots=8, disk_slots=64, disk_io="process")
    finally:   # what the broken-off close left open (nothing, once fixed)
        monkeypatch.undo()
        proc_mod.lock.release(lock_fd)    # (a no-op for a lock no longer held)
        try:
            if real_os.fstat(rep_r).st_ino == rep_ino:
                real_os.close(rep_r)
        except OSError:
            pass


# =============================================================================== 4/5. restart at close, interrupted
def _dead_child_with_an_invalidated_key(drig: dh.Rig) -> tuple[Any, Any, Any]:
    """A process-mode manager whose disk holds a and b; its disk I/O process killed (down, no pass restarted
    it), then ``a`` invalidated: its delete is lost with the child, only close()'s restart can delete it."""
    kv = dh.make_kv(rows=8)
    mgr = drig.open(kv, host_slots=8, disk_slots=64, disk_io="process")
    dh.store_seq(mgr, kv, [b"a", b"b"])
    old = mgr.disk
    old.kill_for_test()
    old._receiver.join(30)
    assert old.down
    mgr.invalidate(b"a")
    return kv, mgr, old


def test_an_interrupt_in_close_s_restart_after_adoption_keeps_an_invalidated_key_deleted(
        drig: dh.Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    kv, mgr, old = _dead_child_with_an_invalidated_key(drig)
    tier = mgr._core.disk
    real = tier._export_recovery
    fired: list[int] = []

    def export_then_interrupt() -> None:
        real()
        if not fired and tier.store is not old:
            fired.append(1)
            raise KeyboardInterrupt

    monkeypatch.setattr(tier, "_export_recovery", export_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        mgr.close()
    assert fired
    mgr.close()                       # finishes the close
    again = drig.open(kv, host_slots=8, disk_slots=64, disk_io="process")
    back = again._core.dindex.ready(b"a") is not None
    kv.zero_()
    served = back and dh.load_ok(again, kv, b"a", 0)
    drig.close(again)
    assert not back, (f"a key invalidated while the disk I/O process was dead is on disk again after the next open "
                      f"(a load of it served its old bytes: {served})")


def test_an_interrupt_in_close_s_restart_before_adoption_leaks_no_disk_process(
        drig: dh.Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    kv, mgr, old = _dead_child_with_an_invalidated_key(drig)
    tier = mgr._core.disk
    real_start, real_count = tier._start, tier.count_page_cache_reads
    started: list[int] = []
    fired: list[int] = []

    outcomes: list[list[Any]] = []

    def start() -> bool:
        started.append(1)
        ok = real_start()
        if tier._starting is not None:
            outcomes.append(tier._starting[1])
        return ok

    def count_then_interrupt() -> None:
        real_count()
        if started and not fired:
            fired.append(1)
            raise KeyboardInterrupt   # restart's call right before ``self.store = store``

    monkeypatch.setattr(tier, "_start", start)
    monkeypatch.setattr(tier, "count_page_cache_reads", count_then_interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            mgr.close()
        assert fired
        mgr.close()                       # finishes the close
        dh.assert_reopens(drig, kv, " (a restarted disk I/O process no one holds)", host_slots=8, disk_slots=64,
                          disk_io="process")
    finally:   # a started store no one adopted (none, once fixed): closed here, its child told to exit
        for got in outcomes:
            for st in got:
                if isinstance(st, proc_mod.ProcessDiskStore) and st is not tier.store:
                    st.close()


# =============================================================================== 6. DiskStore.close (thread mode)
def test_thread_a_close_interrupted_while_it_joins_the_readers_is_finished_by_the_next_close(
        drig: dh.Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    kv = dh.make_kv(rows=8)
    mgr = drig.open(kv, host_slots=8, disk_slots=64, disk_io="thread")
    dh.store_seq(mgr, kv, dh.keys(2, "t"))
    store = mgr.disk
    real_join = store.readers.join
    fired: list[int] = []

    def join_then_interrupt(timeout: Any = None) -> bool:
        done = real_join(timeout)
        if not fired:
            fired.append(1)
            raise KeyboardInterrupt   # the SIGINT that came during the join (close's first long wait)
        return done

    monkeypatch.setattr(store.readers, "join", join_then_interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            mgr.close()
        assert fired
        mgr.close()                       # finishes the close
        writer_alive = store.writer._thread.is_alive()
        dh.assert_reopens(drig, kv, f" (writer thread alive: {writer_alive})", host_slots=8, disk_slots=64,
                          disk_io="thread")
    finally:   # what the broken-off close left running (nothing, once fixed)
        if store._lock_fd >= 0:
            store._closed = False
            store.close()


# =============================================================================== 7. Readers.start, no reader left
def test_thread_an_interrupt_while_reads_with_no_reader_are_answered_loses_none(
        drig: dh.Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    kv, mgr, ks = dh.disk_only_keys(drig, "thread", n=2)
    monkeypatch.setattr(manager_mod, "CLOSE_TIMEOUT_S", 1.0)
    readers = mgr.disk.readers
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    assert len(readers._held_reads) == 2

    def no_thread() -> None:
        raise RuntimeError("can't start new thread")

    real_on_error = readers._on_error
    fired: list[int] = []

    def on_error_then_interrupt(kind: str, msg: str) -> None:
        real_on_error(kind, msg)
        if not fired:
            fired.append(1)
            raise KeyboardInterrupt

    monkeypatch.setattr(readers, "_readerless", True)        # the last reader died and none could start
    monkeypatch.setattr(readers, "_spawn", no_thread)
    monkeypatch.setattr(readers, "_on_error", on_error_then_interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            mgr.poll()
        assert fired
        mgr.wait(jobs, timeout=2)     # still no reader: the loads are answered (misses), not left waiting
        assert all(j.done for j in jobs), (
            f"loads never answered after an interrupt in Readers.start's no-reader path: "
            f"{[j.state.name for j in jobs]}, held={len(readers._held_reads)}")
    finally:
        readers._readerless = False
        drig.close(mgr)


def test_an_interrupt_in_a_pass_s_restart_before_adoption_does_not_leave_the_tier_down_for_good(
        drig: dh.Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    kv = dh.make_kv(rows=8)
    mgr = drig.open(kv, host_slots=8, disk_slots=64, disk_io="process")
    dh.store_seq(mgr, kv, [b"a", b"b"])
    old = mgr.disk
    tier = mgr._core.disk
    real_start, real_adopt = tier._start, tier._adopt
    outcomes: list[list[Any]] = []
    fired: list[int] = []

    def start() -> bool:
        ok = real_start()
        if tier._starting is not None:
            outcomes.append(tier._starting[1])
        return ok

    def interrupt_then_adopt(store: Any, now: float) -> None:
        if outcomes and not fired and tier._starting is None and tier.store is old:
            fired.append(1)
            raise KeyboardInterrupt   # the started store taken (``_starting`` None), not yet ``self.store``
        real_adopt(store, now)

    monkeypatch.setattr(tier, "_start", start)
    monkeypatch.setattr(tier, "_adopt", interrupt_then_adopt)
    try:
        old.kill_for_test()
        old._receiver.join(30)
        mgr.poll()                    # this pass starts the new process (on a starter thread) ...
        assert outcomes and tier._starting is not None
        tier._starting[0].join(30)
        with pytest.raises(KeyboardInterrupt):
            mgr.poll()                # ... and this one adopts it
        assert fired
        for _ in range(3):            # the next passes restart it again (no back-off: the last one ran long)
            dh.settle_restart(mgr)
            mgr.poll()
        dh.settle_restart(mgr)
        assert mgr.disk is not old and not mgr.disk.dead, (
            f"the disk tier is still down after the interrupted restart: restarts={tier.restarts}, "
            f"usable={tier.usable}")
    finally:   # a started store no one adopted (none, once fixed): closed here, its child told to exit
        for got in outcomes:
            for st in got:
                if isinstance(st, proc_mod.ProcessDiskStore) and st is not tier.store:
                    st.close()


# =============================================================================== 9. RemoteStore.close
def test_a_close_interrupted_while_it_stops_the_remote_threads_is_finished_by_the_next_close(
        rig, redis_url, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    tiers = rig.open(rig.slab(num_slots=4, row_bytes=256), remote_url=redis_url)
    store = tiers.core.remote.store
    writer, reader = store._writer, store._reader
    real = writer.begin_close
    fired: list[int] = []

    def begin_close_then_interrupt(deadline: float) -> None:
        real(deadline)
        if not fired:
            fired.append(1)
            raise KeyboardInterrupt

    monkeypatch.setattr(writer, "begin_close", begin_close_then_interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            tiers.close()
        assert fired
        tiers.close()                     # finishes the close
        assert reader.join(1.0), "the remote reader thread still runs after close() was finished"
    finally:   # what the broken-off close left running (nothing, once fixed)
        reader.begin_close(0.0)
        reader.join(5.0)


# =============================================================================== checked, right
def test_process_a_close_interrupted_in_its_first_kick_tells_the_child_to_exit_once(
        drig: dh.Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked, right (64fd0c9): close() interrupted in its first kick(), the "X" queued and known to be: the next
    close() queues no second "X", starts no new process, and the child exits cleanly; the path is free."""
    monkeypatch.setattr(proc_mod, "_CLOSE_TIMEOUT_S", 5.0)
    kv = dh.make_kv(rows=8)
    mgr = drig.open(kv, host_slots=8, disk_slots=64, disk_io="process")
    dh.store_seq(mgr, kv, dh.keys(2, "k"))
    store = mgr.disk
    tier = mgr._core.disk
    real_kick = store.kick
    fired: list[int] = []
    exits: list[int] = []

    def kick() -> None:
        if store._exit_queued and not fired:
            fired.append(1)
            raise KeyboardInterrupt
        exits.append(sum(1 for c in store._cmds if c[0] == "X"))
        real_kick()

    monkeypatch.setattr(store, "kick", kick)
    with pytest.raises(KeyboardInterrupt):
        mgr.close()
    assert fired
    mgr.close()
    assert store.down and store.exit_code == 0 and tier.restarts == 0 and tier.store is store
    assert sum(exits) == 1, exits
    drig.close(drig.open(kv, host_slots=8, disk_slots=64, disk_io="process"))
