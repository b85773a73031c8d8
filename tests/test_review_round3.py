"""Adversarial review, round 3: commits 8a774a0 (served reads and interrupts), 56a88ab (prepare_store's
protection, ``close_disk`` returning once ``disk_closed``), a8d851c (``lookup(..., request=)``).

What it proved wrong (each test failed before its fix, for the reason given; "Fixed:" says how):

1. 56a88ab: a close() interrupted while it waits for the disk I/O process's clean exit is finished by a
   second close() that restarts the disk I/O process.
   Test: ``test_a_close_interrupted_while_the_child_exits_cleanly_restarts_no_disk_process``.
   Where: ``core/tiers.py:1142-1158`` ``TierCore.close_disk``. ``disk_closed`` is set only after
   ``disk.store.close()`` returns (l. 1158). ``ProcessDiskStore.close`` blocks in ``_finish_close``
   (``self._receiver.join``, ``disk/proc.py:582``) for up to 120 s, which is where a Ctrl-C lands. By then the
   child got "X", exited cleanly, and ``_gone(closed=True)`` set ``_down`` (proc.py:347). The second close's
   ``close_disk`` sees ``disk.down`` (l. 1150), applies arrived reports and calls ``disk.restart(force=True)``.
   A new child is spawned at shutdown, runs recovery, is counted and logged as a restart, then closed. This is
   the same bug 56a88ab claims fixed ("finishing a broken-off close restarts no disk process"), reached
   through a different interrupt point.
   Fixed: ``close_disk`` notes ``disk_closing`` once its restart (if any) is behind it, before
   ``store.close()``; a close run again only finishes the store's close.  Suggested: tell a clean close apart from a death. For example, ``DiskTier.down`` is False once the store's close
   was asked (``ProcessDiskStore._closing``). Or ``close_disk`` records that it called ``store.close()``
   before the call, and then skips the restart.

2. 8a774a0: a ProcessDiskStore.close() broken off inside its ``start_reads()`` never tells the child to
   exit. The next close() waits ``_CLOSE_TIMEOUT_S`` (120 s) and then SIGKILLs the child, along with the
   writes it had queued.
   Test: ``test_process_close_broken_off_in_its_start_reads_still_tells_the_child_to_exit``.
   Where: ``disk/proc.py:556-559``. ``self._closing = True`` is set before ``self.start_reads()`` and
   ``self._cmds.append(("X",))``. The next close skips both because ``_closing`` is already set. The window
   is all of ``start_reads``, including the ``_queue_served()`` this commit added there, whose ``put_many``
   is a Python loop. The comment at proc.py:575-577 says this outcome is exactly what must not happen
   ("the child never told to exit, would hold the interrupted host for the whole deadline and then kill the
   child with its writes").
   Fixed: ``_exit_queued``, set in the same call-free step as the "X" is queued.  Suggested: record the "X" separately from ``_closing``, e.g. ``if not self._exit_sent: self.start_reads();
   self._cmds.append(("X",)); self._exit_sent = True``. Or queue "X" first, then make sure
   ``start_reads`` puts its "P"/"R" commands ahead of it.

3. 8a774a0 (claim "an interrupt anywhere loses no answer"), thread mode: ``Readers.start`` drops the held
   reads when an interrupt lands between taking them and queueing them. Their loads stay PENDING for ever.
   Test: ``test_thread_an_interrupt_while_held_reads_are_handed_to_the_readers_loses_none``.
   Where: ``disk/readers.py:140`` ``self._held_reads = []`` comes before ``self._enqueue(held)``
   (l. 144). An interrupt in ``_enqueue`` (after ``self._read_limit()`` returns, or between two
   ``self._reads.put`` of its batches, l. 157-162) loses them. The owner's thread calls this in every
   ``apply_arrived``.
   Fixed: ``Readers._enqueue`` empties ``_held_reads`` and queues the batches in one C loop of puts, under
   its lock.  Suggested: take the reads out of ``_held_reads`` only once they are queued. Slice ``held`` from the batches
   already put, in one step with the put, as ``_served`` does for served reads. Or catch BaseException in
   ``start`` and put the un-queued rest back at the front of ``_held_reads``.

4. 8a774a0 (``cached.served`` exactness), both modes: reads served from the page cache are counted
   ``served`` although an interrupt discarded their reports. The disk side then reads them again and answers
   the loads, so ``page_cache_reads_total{served}`` counts reads that answered no load.
   Test: ``test_reads_whose_served_reports_an_interrupt_discarded_are_not_counted_served`` (thread,
   process).
   Where: ``disk/cached.py:120`` counts ``served`` inside ``read()``. Between its return and the two stores
   into ``_held``/``_served`` (``disk/readers.py:115-119``; ``disk/proc.py:429-434``) there is the call's own
   eval-breaker check, and in process mode also the ``[[r] for r in served]`` comprehension (a call plus a
   backward jump). An interrupt there leaves the reads held, and the next pass hands them on.
   ``proc.py:463``'s own comment defines "served" as "reads that answered a load" (it takes the ones the
   child's death answered back off).
   Fixed as suggested: count ``served`` where the reports enter ``_served`` (the caller, in the same call-free step as the
   stores, with ``n = len(served)`` computed before), not inside ``CachedReads.read``. Build the
   ``[[r] ...]`` entries inside ``read`` or before the stores.

5. a8d851c: keyed by (request, block), ``_waiting`` keeps its old bound of one entry per host slot. Several
   requests waiting on the same read-backs overflow it. The oldest live request's waits are forgotten: it
   counts each of those blocks a second lookup key, and its hit from the read-back it waited on counts
   ``host``, not ``disk``.
   Test: ``test_requests_sharing_a_read_back_prefix_each_count_one_key_and_disk_hits``.
   Where: ``integrations/scheduler.py:207-208`` (``len(waiting) > core.index.num_slots`` trims the oldest;
   its rationale "a read-back holds a host slot" held only while ``_waiting`` had one entry per block).
   Requests sharing a prefix whose read-back is in flight are the case the commit sets out to count exactly
   (its counts-machine test 3). Here, 3 requests on a 2-block prefix in a 4-slot slab give 8 keys, 4 disk
   hits and 2 host hits instead of 6, 6 and 0.
   Fixed: ``_waiting`` is trimmed only past one entry per host slot per request named, plus one.  Suggested:
   bound the wait entries by what they can refer to, e.g. trim ``_waiting`` only past
   ``num_slots * max(1, len(self._requests))``. Or keep per request the keys it waits on (``_requests``
   holds them already) and rely on ``request_finished`` and the ``_requests`` bound (6).

6. a8d851c: the ``_requests`` bound (one request per host slot) forgets a live request that still waits.
   Requests whose waits all ended stay in ``_requests`` until vLLM finishes them, so they count toward the
   bound. The oldest entry, dropped first, is the request that has been waiting longest. It loses its wait
   on a read-back in flight: its next ask is a second lookup key, and its hit counts ``host``, not ``disk``.
   Test: ``test_a_request_still_waiting_is_not_forgotten_by_the_requests_bound`` (2 slots, 3 requests; the
   ``_waiting`` bound is not reached): (5, 2, 1) instead of (4, 3, 0).
   Where: ``integrations/scheduler.py:199-201`` (``request_finished(next(iter(self._requests)))``); the
   commit message says "requests never finished are forgotten", but the code also forgets live ones.
   Fixed as suggested (``SlabScheduler._unwait``): drop a request from ``_requests`` once it waits on nothing (``_hit``, the MISS path), so the bound
   counts waiting requests only. Or make the bound skip requests that still have a ``_waiting`` entry.
   (Both 5 and 6 were checked in a scratch copy: with these fixes, the two tests and
   test_scheduler_counts_machine.py pass.)

Checked and found right (the unmarked tests pin some of it):

* process ``_queue_served``: an interrupt after an ``e.extend(map(dict.pop, ...))`` (the entry recorded
  with its op), or after a partial ``put_many``, loses no answer and runs no read twice. The next pass
  re-queues (the duplicate is stale), and ``cached.served`` stays exact
  (``test_process_interrupts_at_each_step_of_queue_served_lose_no_answer``). By reading the code: no call
  separates ``cached.served -= ...`` from ``self._served = []``, so no interrupt lands between them;
* fixes 1-4 were applied in a scratch copy: tests 1-4 pass there, and so do test_review_todays_fixes2.py and
  test_review_owner_reads.py;
* process: the child dying between the served reads and their queueing. The entry whose op the death
  answered is dropped and taken off ``served`` (``test_process_child_death_before_queueing_served_...``);
* a restart swapping the store: ``end_step`` and ``close_disk`` call ``apply_arrived`` (which queues
  ``_served``) before ``restart``, and ``restart`` closes the old store, whose ``close()`` queues it too;
* flush() (TierManager, SlabScheduler) passes through ``apply_arrived``, so ``_served`` is queued there;
* thread ``Readers._queue_served``: interrupted anywhere, the reports stay for the next pass
  (``start``/``serve_cached``/``stop`` all queue them first);
* 56a88ab ``prepare_store``: ``_asked if _looked else _kept`` is the same rule ``tick()`` uses;
* a8d851c: ``_waited`` for named requests, ``request_finished``, and the landed-then-evicted read-back
  (one key, one disk hit) behave as documented for one request, or for two within the bound.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

import tiered_kv.disk.proc as proc_mod
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


# =============================================================================== 1. close_disk after a clean exit
def test_a_close_interrupted_while_the_child_exits_cleanly_restarts_no_disk_process(
        rig, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """A Ctrl-C while ProcessDiskStore.close() waits for the child (``_finish_close``'s receiver join, up to
    120 s, the likeliest place for it): the child was told "X" and exits cleanly meanwhile (``_down``), but
    ``disk_closed`` is not set.  The second close() restarts the disk I/O process at shutdown."""
    tiers = rig.open(rig.slab(num_slots=8, row_bytes=256), disk=True, disk_blocks=32, disk_io="process")
    store_ready(tiers, [b"a", b"b"])
    assert tiers.flush(timeout=30)
    disk = tiers.core.disk
    first = disk.store
    receiver = first._receiver
    real_join = receiver.join
    fired: list[int] = []

    def join_then_interrupt(timeout: Any = None) -> None:
        real_join(timeout)                 # the child got "X" and exits cleanly: _gone(closed=True)
        if not fired and first._closing:
            fired.append(1)
            raise KeyboardInterrupt        # the SIGINT that arrived during the join is raised at its return

    monkeypatch.setattr(receiver, "join", join_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        tiers.close()
    assert fired and first.down and first.exit_code == 0 and not tiers.core.disk_closed
    tiers.close()                          # finishes the close
    assert disk.restarts == 0 and disk.store is first, (
        f"the second close() started a new disk I/O process (restarts={disk.restarts}) after a clean exit")


# =============================================================================== 2. close never sends "X"
def test_process_close_broken_off_in_its_start_reads_still_tells_the_child_to_exit(
        rig, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """close() sets ``_closing``, then calls start_reads() (a SIGINT during it -- e.g. in the ``_queue_served``
    8a774a0 put there, or in its kick() -- is raised at its return at the latest), then queues "X".  The next
    close() skips both: the child is never told to exit, and is killed at the deadline (here 3 s; 120 s
    by default)."""
    monkeypatch.setattr(proc_mod, "_CLOSE_TIMEOUT_S", 3.0)
    tiers = rig.open(rig.slab(num_slots=8, row_bytes=256), disk=True, disk_blocks=32, disk_io="process")
    store_ready(tiers, [b"a", b"b"])
    assert tiers.flush(timeout=30)
    first = tiers.core.disk.store
    real = first.start_reads
    fired: list[int] = []

    def start_reads_then_interrupt(*a: Any, **kw: Any) -> None:
        real(*a, **kw)
        if not fired and first._closing:
            fired.append(1)
            raise KeyboardInterrupt

    monkeypatch.setattr(first, "start_reads", start_reads_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        tiers.close()
    assert fired
    tiers.close()
    assert first.down
    assert first.exit_code == 0, (
        f"the disk I/O process was never told to exit: killed at the close deadline (exit {first.exit_code})")


# =============================================================================== 3. thread: Readers.start drops reads
def test_thread_an_interrupt_while_held_reads_are_handed_to_the_readers_loses_none(
        drig: dh.Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    kv, mgr, ks = dh.disk_only_keys(drig, "thread", n=2)
    monkeypatch.setattr(manager_mod, "CLOSE_TIMEOUT_S", 2.0)   # the close must not wait 30 s for a lost read
    readers = mgr.disk.readers
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    assert len(readers._held_reads) == 2
    real_limit = readers._read_limit
    fired: list[int] = []

    def limit_then_interrupt() -> int:
        n = real_limit()
        if not fired:
            fired.append(1)
            raise KeyboardInterrupt   # a SIGINT handled at the eval-breaker check after the call returns
        return n

    monkeypatch.setattr(readers, "_read_limit", limit_then_interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            mgr.poll()                # (non-blocking pass: no page-cache reads; the held reads go to start())
        assert fired
        mgr.wait(jobs, timeout=5)
        assert [j.state.name for j in jobs] == ["DONE", "DONE"], (
            f"loads never answered after an interrupt in Readers.start: {[j.state.name for j in jobs]}, "
            f"held={len(readers._held_reads)}")
    finally:
        drig.close(mgr)


# =============================================================================== 4. served counted, report discarded
@pytest.mark.parametrize("io", ["thread", "process"])
def test_reads_whose_served_reports_an_interrupt_discarded_are_not_counted_served(
        drig: dh.Rig, monkeypatch: pytest.MonkeyPatch, io: str) -> None:
    """An interrupt right after ``CachedReads.read`` returned (a SIGINT that came during the reads: the longest
    part of the pass) discards its reports; the reads stay held and the interrupted wait's last pass hands them
    to the disk side, which answers the loads.  Each load is answered once, by one side: ``served`` plus the
    reads the disk side ran must be 2."""
    kv, mgr, ks = dh.disk_only_keys(drig, io, n=2)
    monkeypatch.setattr(manager_mod, "CLOSE_TIMEOUT_S", 2.0)
    store = mgr.disk
    c = store.cached
    real_read = c.read
    fired: list[int] = []

    def read_then_interrupt(ops: Any, until: Any = None) -> Any:
        got = real_read(ops, until)
        if not fired and got[0]:
            fired.append(len(got[0]))
            raise KeyboardInterrupt
        return got

    monkeypatch.setattr(c, "read", read_then_interrupt)
    ran: list[Any] = []   # reads the disk side ran (thread: readers._run; process: "P" ops sent to the child)
    if io == "thread":
        real_run = store.readers._run

        def run(ops: Any) -> Any:
            ran.extend(ops)
            return real_run(ops)

        monkeypatch.setattr(store.readers, "_run", run)
    else:
        real_kick = store.kick

        def kick() -> None:
            ran.extend(cmd for cmd in store._cmds if cmd[0] == "P")
            real_kick()

        monkeypatch.setattr(store, "kick", kick)
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    try:
        with pytest.raises(KeyboardInterrupt):
            mgr.wait(jobs, timeout=30)
        assert fired == [2]
        mgr.wait(jobs, timeout=30)
        mgr.poll()
        assert [j.state.name for j in jobs] == ["DONE", "DONE"]
        assert all(dh.row_is(kv, i, k) for i, k in enumerate(ks))
        served = dh.metric(mgr, PC, outcome="served")
        assert served + len(ran) == 2, (
            f"{served:.0f} reads counted served from the page cache, and the disk side ran {len(ran)}, for 2 loads")
    finally:
        drig.close(mgr)


# =============================================================================== 5. the waiting bound, per request
def test_requests_sharing_a_read_back_prefix_each_count_one_key_and_disk_hits(rig) -> None:  # noqa: F811
    """Three requests share a 2-block prefix on disk (4 host slots): each is told PENDING for both blocks in
    one step, as vLLM asks its waiting queue, and each asks again once the read-backs landed.  Each (request,
    block) is one lookup key and a disk hit (the read-back it waited on): 6 keys, 6 disk hits."""
    slab = rig.slab(num_slots=4, row_bytes=256)
    tiers = rig.open(slab, disk=True, disk_blocks=16, disk_io="thread", host_evict_ahead_blocks=0)
    P = [b"p0", b"p1"]
    store_ready(tiers, P)
    assert tiers.flush(timeout=30)
    for f in (b"f0", b"f1", b"f2", b"f3"):
        store_ready(tiers, [f])
    assert tiers.flush(timeout=30)
    tiers.tick()
    assert all(tiers.state_of(k) == (None, "ready") for k in P), [tiers.state_of(k) for k in P]
    base = _counts(tiers.metrics)
    reqs = ["R1", "R2", "R3"]
    for r in reqs:                                   # one step: each waiting request asks its prefix
        seen: set[bytes] = set()
        for k in P:
            assert tiers.lookup(k, protect=seen, request=r) == PENDING
            seen.add(k)
    wait_promotes(tiers)
    for r in reqs:                                   # a later step: each asks again, the read-backs landed
        seen = set()
        for k in P:
            assert tiers.lookup(k, protect=seen, request=r) == HIT
            seen.add(k)
    keys, hits = _counts(tiers.metrics)
    got = (keys - base[0], hits["disk"] - base[1]["disk"], hits["host"] - base[1]["host"])
    assert got == (6, 6, 0), f"(lookup keys, disk hits, host hits) = {got} for 3 requests x 2 blocks read back"


# =============================================================================== checked: _queue_served under interrupts
def test_process_interrupts_at_each_step_of_queue_served_lose_no_answer(
        drig: dh.Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked, right: an interrupt after the first entry recorded its op (``e.extend``), then one after
    a partial ``put_many`` (first report queued): each pass resumes from ``_served``; both loads DONE once, the
    rows right, ``served`` == 2, and no read handed to the child."""
    kv, mgr, ks = dh.disk_only_keys(drig, "process", n=2)
    monkeypatch.setattr(manager_mod, "CLOSE_TIMEOUT_S", 2.0)
    store = mgr.disk
    sent: list[Any] = []
    real_kick = store.kick

    def kick() -> None:
        sent.extend(cmd for cmd in store._cmds if cmd[0] == "P")
        real_kick()

    monkeypatch.setattr(store, "kick", kick)

    class Entry(list):   # the served entries: interrupt right after the first one recorded its op
        fired = False

        def extend(self, it: Any) -> None:   # type: ignore[override]
            super().extend(it)
            if not Entry.fired:
                Entry.fired = True
                raise KeyboardInterrupt

    real_qs = store._queue_served

    def queue_served() -> None:
        store._served = [e if isinstance(e, Entry) else Entry(e) for e in store._served]
        real_qs()

    monkeypatch.setattr(store, "_queue_served", queue_served)
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    q = store._out
    real_put_many = q.put_many
    put_fired: list[int] = []

    def put_many(items: Any) -> None:
        if not put_fired and len(items) == 2:
            put_fired.append(1)
            q.put(items[0])
            raise KeyboardInterrupt
        real_put_many(items)

    monkeypatch.setattr(q, "put_many", put_many)
    try:
        with pytest.raises(KeyboardInterrupt):
            mgr.wait(jobs, timeout=30)   # after the first e.extend; its finally pass: after the first put()
        assert Entry.fired and put_fired
        mgr.wait(jobs, timeout=30)
        mgr.poll()
        assert [j.state.name for j in jobs] == ["DONE", "DONE"]
        assert all(dh.row_is(kv, i, k) for i, k in enumerate(ks))
        assert not sent and not store._served and not store._outstanding
        assert dh.metric(mgr, PC, outcome="served") == 2
    finally:
        drig.close(mgr)


def test_process_child_death_before_queueing_served_answers_each_load_once(
        drig: dh.Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked, right: the child dies after the page-cache reads, before ``_queue_served`` takes the ops out of
    ``_outstanding``; its death answers them failed, the served reports are dropped and taken off ``served``."""
    kv, mgr, ks = dh.disk_only_keys(drig, "process", n=2)
    monkeypatch.setattr(manager_mod, "CLOSE_TIMEOUT_S", 2.0)
    store = mgr.disk
    real_qs = store._queue_served
    killed = threading.Event()

    def die_then_queue() -> None:
        if not killed.is_set() and store._served and len(store._served[0]) == 1:
            killed.set()
            store.kill_for_test()
            store._receiver.join(30)
        real_qs()

    monkeypatch.setattr(store, "_queue_served", die_then_queue)
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    try:
        mgr.wait(jobs, timeout=30)
        assert killed.is_set()
        mgr.poll()
        assert all(j.done for j in jobs)
        assert not store._served
        assert dh.metric(mgr, PC, outcome="served") == 0
        dh.settle_restart(mgr)
    finally:
        drig.close(mgr)


def test_a_request_still_waiting_is_not_forgotten_by_the_requests_bound(rig, monkeypatch) -> None:  # noqa: F811
    """2 host slots, 3 live requests that each waited on a read-back (R2 and R1's first wait answered, R1 waiting
    on a second block, R3 on its first).  ``_requests`` keeps requests whose waits ended until they finish, so
    the third one past the bound (then one per host slot; ``REQUESTS_MAX`` since, set to 2 here) dropped the oldest,
    R1, which still waits on A: its next ask is a second lookup key and a host hit.  (4 host slots: no read-back
    needs a slot a request was told is a hit, which none may take any more.)"""
    import tiered_kv.integrations.scheduler as sched_mod

    monkeypatch.setattr(sched_mod, "REQUESTS_MAX", 2)
    slab = rig.slab(num_slots=4, row_bytes=256)
    tiers = rig.open(slab, disk=True, disk_blocks=16, disk_io="thread", host_evict_ahead_blocks=0)
    X, A, B, C = b"x", b"a", b"b", b"c"
    for k in (X, A, B, C, b"f0", b"f1", b"f2", b"f3"):
        store_ready(tiers, [k])
        assert tiers.flush(timeout=30)
    tiers.tick()
    assert all(tiers.state_of(k) == (None, "ready") for k in (X, A, B, C)), [tiers.state_of(k) for k in (X, A, B, C)]
    base = _counts(tiers.metrics)
    # step 1: R1 asks its prefix [X, A]: X PENDING; R2 asks [B]: PENDING
    assert tiers.lookup(X, request="R1") == PENDING
    assert tiers.lookup(B, request="R2") == PENDING
    wait_promotes(tiers)
    # step 2: R2 asks again: HIT; R1 asks again: X HIT, A PENDING
    assert tiers.lookup(B, request="R2") == HIT
    assert tiers.lookup(X, request="R1") == HIT
    assert tiers.lookup(A, protect={X}, request="R1") == PENDING
    # step 3: a new request R3 asks [C]: PENDING
    assert tiers.lookup(C, request="R3") == PENDING
    assert len(tiers._waiting) <= 2
    wait_promotes(tiers)
    # step 4: R1 asks again: A served from the read-back it waited on
    assert tiers.lookup(A, request="R1") == HIT
    keys, hits = _counts(tiers.metrics)
    got = (keys - base[0], hits["disk"] - base[1]["disk"], hits["host"] - base[1]["host"])
    assert got == (4, 3, 0), (
        f"(lookup keys, disk hits, host hits) = {got}: R1 asked X and A, R2 B, R3 C; 3 read-backs served")
