"""Review round 33: the two-phase PROMOTE / remote reports (8701146, eab11f9), adversarially.

What it proved wrong (each test failed on the tree it reviewed; fixed since, as each docstring proposes):

1. a fetch part invalidated between two passes over the fetch's report was published and counted found (and,
   under the vLLM scheduler, reported stored): ``_fetch_reported`` now takes an ok part whose entry left the index
   before a pass published it as superseded, in ``job._dead``;
2. (older) a load whose ``load()`` an interrupt broke off stayed among a read's waiters: the read's report, applied
   before the load's failed one, queued a copy for it into a row about to be unfenced: ``_unsubmit`` takes the
   load off its reads first (``release_load``);
3. a fetch's report run again marked its parts landed again, so a remote hit was counted twice: only the pass that
   publishes an entry marks it landed;
4. a read's report run again, after an invalidate cancelled a load whose copy the first pass had queued, failed
   and abandoned that load under its running copy: a cancelled load is passed over before the failed branch;
5. (older) ``flush()`` returned False when its last pass applied a store's report, whose new write-through put
   it does not cover: the drain is judged by the wait itself;
6. ``_deliver_cancelled`` took a cancelled load whose copy a broken-off pass had queued (still naming the read)
   for one still waiting, and abandoned it: it is waiting only if its copy is not queued (``_copy_queued``).
"""

from __future__ import annotations

from typing import Any

import pytest

from disk_helpers import keys, metric
from test_interrupt_remote import DEADLINE_S, _manager, _queued, _stored_elsewhere, _until
from tiered_kv.jobs import JobKind


class _Boom(KeyboardInterrupt):
    pass


def _raise_after(obj: Any, name: str, when: Any) -> list[int]:
    """Make ``obj.name`` (an instance attribute override) raise KeyboardInterrupt at the return of the first call
    for which ``when(*args)`` holds (the call itself runs through: an interrupt lands at a call's return)."""
    real = getattr(obj, name)
    fired: list[int] = []

    def wrapper(*a: Any, **kw: Any) -> Any:
        out = real(*a, **kw)
        if not fired and when(*a, **kw):
            fired.append(1)
            setattr(obj, name, real)
            raise _Boom()
        return out

    setattr(obj, name, wrapper)
    return fired


def test_fetch_part_invalidated_between_passes_is_not_published(redis_url: str) -> None:
    """What is wrong: ``TierCore._fetch_reported`` (tiered_kv/core/tiers.py ~1228) fixes the stale parts
    (``job._dead``) once, in its first pass, from ``not e.live``.  A part whose key is invalidated after an
    interrupt broke that first pass off, before the pass reached the part, is not in ``_dead``: the second pass
    publishes its (removed, WRITING) entry -- ``publish`` of a removed entry just frees its slot -- and
    ``_fetch_applied`` counts it found (``moved``, bytes) and, under ``collect_published`` (the vLLM scheduler),
    appends its key to ``published``: the front end is told a block is held that was invalidated, and no eviction
    will ever tell it the block is gone.  Nor is it counted stale (superseded), as the same invalidate before the
    first pass (or before the report, on the old code) is.

    Interleaving: a fetch of 4 keys reported ok; ``poll()`` applies it; the first pass publishes part 0 and is
    interrupted at the return of ``remote.fetched`` for part 1 (before part 1's publish); the engine calls
    ``invalidate(ks[1])`` (``drop_key``: its entry WRITING under a FETCH, so only removed from the index); the next
    ``poll()`` runs the second pass.

    Proposed fix: in ``_fetch_reported``, a part whose entry is out of the index and not READY (never published by
    a pass before) is stale: ``if i in stale or (not e.live and e.state is not READY and ok_i): stale[i] =
    SUPERSEDED`` (writing into ``job._dead``, one store per part, before ``writer_done``); a part published by a
    pass before and removed since stays found."""
    ks = keys(4, "r33f-")
    _stored_elsewhere(redis_url, "r33f", ks)
    b = _manager(redis_url, "r33f", 2)
    core = b._core
    core.collect_published = True
    try:
        assert b.lookup(ks) == 0
        b.poll()   # the probe submitted
        _queued(b, 1, "the probe")
        b.poll()   # the probe's answer applied: the fetch submitted
        fetch = [j for j in core.jobs.values() if j.kind is JobKind.FETCH]
        assert len(fetch) == 1 and len(fetch[0]._entries) == 4, fetch
        _queued(b, 1, "the fetch")
        core.published.clear()
        fired = _raise_after(core.remote, "fetched", lambda key, token: key == ks[1])
        with pytest.raises(KeyboardInterrupt):
            b.poll()
        assert fired
        b.invalidate(ks[1])
        b.poll()   # the second pass
        _until(lambda: not core.jobs, b, "quiescence")
        assert ks[1] not in core.index
        assert ks[1] not in core.published, f"an invalidated key told as published: {core.published}"
        assert metric(b, "tiered_kv_stale_callbacks_total", kind="fetch", reason="superseded") == 1
    finally:
        b.close()


def test_interrupted_load_behind_a_landed_read_queues_no_copy(tmp_path: Any, monkeypatch: Any) -> None:
    """What is wrong: ``TierManager._unsubmit`` (tiered_kv/manager.py ~399) answers a load an interrupt broke off in
    ``_submit_load`` by putting a failed Report at the *back* of the completion queue, but leaves the job waiting
    for its read from disk (``p._waiters`` names it).  When that read's report is queued already (another load
    started it), the next poll applies it first: ``TierCore._promote_reported`` leases the host entry to the
    abandoned load and calls ``on_load_ready`` -> ``_load_ready`` queues its copy (``Transfer.taken``); then the
    failed report is applied by ``_load_reported``: the lease is released (the slot may be evicted and reused while
    the copy still reads it) and the row is unfenced and answered failed, while the copy into that row (which the
    caller, whose ``load()`` raised, believes unused) lands later.

    Interleaving: ``prepare_landed`` (a load_many of k1, k2 waits for two reads whose reports are queued); the
    engine calls ``load(k1, 13)``: ``begin_load`` registers it waiting for k1's read, ``_submit_load`` is
    interrupted at the return of ``_add_job``; ``_unsubmit`` queues its failed report; the next ``poll()``.

    Proposed fix: in ``_unsubmit``, a load still waiting for reads (``job._waiters``) is given up at once instead
    of through the queue: ``core.release_load(job)`` (the reads forget it first), then the failed report as now
    (``_load_reported`` finds nothing left to release); or make ``_promote_reported``/``_load_ready`` skip a load
    ``_unsubmit`` answered (a flag set before the put)."""
    from test_review_round29_sweep import World, key
    from test_review_round31 import prepare_landed
    import tiered_kv.manager as manager

    w = World(29, str(tmp_path / "disk"))
    m = w.mgr
    try:
        prepare_landed(w)
        real = manager._add_job

        def add_job(*a: Any) -> None:
            real(*a)
            monkeypatch.setattr(manager, "_add_job", real)
            raise _Boom()

        monkeypatch.setattr(manager, "_add_job", add_job)
        with pytest.raises(KeyboardInterrupt):
            m.load(key(1), 13)
        comps = m.poll()
        mine = [c for c in comps if c.job.kind is JobKind.LOAD and 13 in c.job.blocks]
        assert len(mine) == 1 and not mine[0].ok, comps
        t = mine[0].job._transfer
        assert t is None or not t.taken, "a copy into row 13 was queued for a load answered failed"
    finally:
        m.close()


def test_fetch_report_run_again_counts_a_remote_hit_once(redis_url: str) -> None:
    """What is wrong: ``TierCore._fetch_reported`` (tiered_kv/core/tiers.py ~1238) calls ``remote.landed_key(key, e)``
    for every found part at every pass.  A lookup between an interrupted first pass and the second finds a part the
    first pass published, counts it a remote hit and takes it off ``RemoteTier.landed`` (``hits_among``: "counted
    once"); the second pass puts it back, so the next lookup of the same block counts it a remote hit again
    (``tiered_kv_lookup_hits_total{tier="remote"}`` 2 for one fetched block; on the old code, applied once, the second
    lookup is a host hit).

    Interleaving: a fetch of 4 keys reported ok; ``poll()`` applies it; its first pass publishes part 0 (landed) and
    is interrupted at the return of ``remote.fetched`` for part 1; ``lookup([k0])`` (a remote hit, taken off
    ``landed``); ``poll()`` (the second pass: k0 landed again); ``lookup([k0])`` (counted remote again).

    Proposed fix: mark landed only what this pass publishes: ``if index.publish(e) and e.state`` was WRITING before
    (``publish`` returns True for an entry published already too): e.g. test ``e.state is WRITING`` before the
    publish and call ``landed_key`` only then."""
    ks = keys(4, "r33h-")
    _stored_elsewhere(redis_url, "r33h", ks)
    b = _manager(redis_url, "r33h", 2)
    core = b._core
    try:
        assert b.lookup(ks) == 0
        b.poll()
        _queued(b, 1, "the probe")
        b.poll()
        _queued(b, 1, "the fetch")
        fired = _raise_after(core.remote, "fetched", lambda key, token: key == ks[1])
        with pytest.raises(KeyboardInterrupt):
            b.poll()
        assert fired
        assert b.lookup([ks[0]]) == 1
        b.poll()   # the second pass
        _until(lambda: not core.jobs, b, "quiescence")
        assert b.lookup([ks[0]]) == 1
        b.poll()
        assert metric(b, "tiered_kv_lookup_hits_total", tier="remote") == 1
    finally:
        b.close()


def _prepare_two_waiting(w: Any) -> None:
    """``prepare_disk``, then a second load of k1 (row 13) waiting for the same read as the load_many (rows 11,
    12); a poll starts the reads; returns once both reads' reports wait in the completion queue (not applied)."""
    import time

    from test_review_round29_sweep import key, prepare_disk

    prepare_disk(w)
    m = w.mgr
    assert w.load(key(1), 13) is not None and w.held[-1]._waiters
    w.take(m.poll())
    w.settle_copies()
    q = m._completions._q
    deadline = time.monotonic() + DEADLINE_S
    while q.qsize() < 2 and time.monotonic() < deadline:   # waits for the reader threads only, not for an order
        time.sleep(0.001)
    assert q.qsize() >= 2, "the reads from disk never reported"


def test_invalidate_between_promote_passes_keeps_a_queued_load(tmp_path: Any, monkeypatch: Any) -> None:
    """What is wrong: ``TierCore._promote_reported`` (tiered_kv/core/tiers.py ~955-962) works out ``ok = r.ok and
    entry.live`` again at every pass and tests ``not ok`` before ``w.state is CANCELLING``.  A first pass that
    published the entry and queued a waiting load's copy (``on_load_ready``) but was interrupted before
    ``w._waiters = None`` leaves the load naming the read.  ``invalidate(key)`` then cancels that load (its copy
    queued: ``_cancel`` leaves it CANCELLING, fenced until the copy's report) and removes the published entry; the
    second pass finds ``entry.live`` False, so ``ok`` is False, and calls ``on_load_failed`` (which unfences its row:
    no answer, it is not PENDING) and ``abandon`` on the load: its record goes and its lease is released while its
    copy still reads the slot, and when the copy's report comes no job has its token (``unknown_token``): the load
    is never reported (``wait()`` on it never returns), and the slot may be reused under the copy.

    Interleaving (sweep found it at k=15/16 of the promote pass, ``movers/native.py:159``): two loads wait for k1's
    read (the load_many of k1, k2 into rows 11, 12 and ``load(k1, 13)``); ``poll()`` applies k1's read: the first
    pass leases the entry to both, queues row 13's copy and is interrupted at ``mover.submit``'s return;
    ``invalidate(k1)``; the next ``poll()``/``wait()``.

    Proposed fix: in the waiters loop test ``w.state is CANCELLING`` (continue: the front end finishes it) before
    the failed branch; and fix the read's outcome in the first pass (store ``ok`` on the job, as ``_fetch_reported``
    does ``_dead``), so that a later pass never fails a load an earlier pass treated as landed."""
    from test_review_round29_sweep import World, check_disk, key
    import tiered_kv.manager as manager

    monkeypatch.setattr(manager, "CLOSE_TIMEOUT_S", 0.5)
    w = World(31, str(tmp_path / "disk"))
    m = w.mgr
    try:
        _prepare_two_waiting(w)
        row13 = w.held[-1]
        fired = _raise_after(m._mover, "submit", lambda t: list(t.rows) == [13])
        with pytest.raises(KeyboardInterrupt):
            w.take(m.poll())
        assert fired
        m._mover.flush()
        w.settle_copies()
        m.invalidate(key(1))
        w.expect.pop(key(1), None)
        check_disk(w, "invalidate(k1) between the passes of k1's read")
        assert w.seen.get(id(row13)) == 1
    finally:
        m.close()


def test_flush_is_not_failed_by_a_put_its_last_pass_starts(redis_url: str) -> None:
    """What is wrong: ``TierCore._flush`` (tiered_kv/core/tiers.py ~1527-1529) waits with ``block_until(lambda:
    n[PUT] == 0)`` and then takes ``ok = n[PUT] == 0``; but ``TierManager._block_until`` ends with a last
    ``_poll(True)`` (its ``finally``) after ``done()`` was seen True, and a store's report applied there starts that
    store's write-through put (``after_publish`` -> ``start_puts``).  That put was not queued when ``flush()`` was
    called, nothing failed and nothing timed out, yet ``flush()`` returns False.  Seen as the flaky failure of
    ``test_a_seeded_engine_every_call_interrupted_remote_tier``'s ``assert m.flush(...)`` (its ``settle``): scratch
    runs of its ``_engine`` with seeds 100..600 failed there for about 3% of the seeds (e.g. 116, 124, 153, 181,
    187, 234; which ones varies from run to run), each with one PUT in flight and no fault.

    Interleaving (made deterministic here): a store's copy report arrives after the flush's wait saw no put in flight
    and before ``_block_until``'s final pass applies it.

    Proposed fix: in ``_flush``, judge the puts the flush covers, not the count after the last pass: e.g. note the
    tokens (or a sequence number) of the PUT jobs in flight when the flush starts and wait for those (or take ``ok``
    from ``done()`` as seen inside ``block_until``, before its final pass)."""
    from disk_helpers import fill

    a = _manager(redis_url, "r33flush", 1)
    try:
        k = b"r33flush-0"
        fill(a._device_blocks, 0, k)
        job = a.store(k, 0)
        assert job is not None
        a.poll()   # the copy submitted
        q = a._completions
        import time
        deadline = time.monotonic() + DEADLINE_S
        while q._q.qsize() < 1:   # (the copy runs on its own time: harvested, never applied here)
            assert time.monotonic() < deadline, "the store's copy never reported"
            a._mover.harvest()
            time.sleep(0.001)
        held = q.drain()
        real = a._block_until

        def block_until(done: Any, timeout: Any) -> None:
            def done2() -> bool:
                d = done()
                if d and held:   # the store's report lands right after the wait saw no put in flight
                    for r in held:
                        q.put(r)
                    held.clear()
                return d
            real(done2, timeout)

        a._block_until = block_until   # (flush hands core.flush the bound method it finds here)
        ok = a.flush(timeout=DEADLINE_S)
        del a._block_until
        assert not held
        assert ok, "flush() False: no fault, no timeout"
    finally:
        a.close()


def test_retried_cancel_between_promote_passes_does_not_abandon_a_queued_copy(tmp_path: Any, monkeypatch: Any
                                                                             ) -> None:
    """What is wrong: ``TierManager._deliver_cancelled`` (tiered_kv/manager.py ~682) takes a load in ``_deliver`` whose
    ``_waiters`` is non-empty for one still waiting for its reads (no copy queued) and abandons it: record gone,
    leases released, row unfenced, answered cancelled.  But since 8701146 a load names its last read until the
    read's pass ends (``w._waiters = None`` after ``on_load_ready``), and ``_promote_reported`` skips a CANCELLING
    load without clearing it, so the name stays for good once the load is cancelled between two passes.  Then a load
    whose copy is queued is abandoned: its lease goes while the copy reads the slot, its row is unfenced (and told
    cancelled) while the copy may still land there, and the copy's report finds no job (``unknown_token``).
    ``_cancel``'s own predicate checks ``_copy_queued``; ``_deliver_cancelled``'s does not.

    Interleaving: two loads wait for k1's read (``_prepare_two_waiting``); ``cancel(load13)`` is interrupted after
    ``_deliver.append`` (at ``core.cancel``'s call): load13 PENDING in ``_deliver``; ``poll()`` applies k1's read:
    the pass leases the entry to load13, queues its copy and is interrupted at ``mover.submit``'s return; the engine
    retries ``cancel(load13)``: not "waiting" (its copy is queued), so ``core.cancel`` only (CANCELLING, fenced); the
    next poll: the pass again skips the CANCELLING load (its ``_waiters`` still ``[p1]``), then
    ``_deliver_cancelled`` abandons it.  (Here the interrupted poll never reached its ``mover.flush()``, so the copy,
    cancelled, is answered without running and only its report of no job shows; had the copy been started -- the
    same order inside a ``wait()``, or a flush between -- the slot and row would be freed under a running copy.)

    Proposed fix: in ``_deliver_cancelled`` use the same predicate as ``_cancel`` (``job._waiters and not
    _copy_queued(job)``) for "still waiting", so a load whose copy is queued takes the third branch (cancelled,
    fenced until its copy's report); and/or clear ``w._waiters`` for a CANCELLING load whose copy is queued in
    ``_promote_reported``."""
    from test_review_round29_sweep import World, check_disk
    from disk_helpers import metric_sum
    import tiered_kv.manager as manager

    monkeypatch.setattr(manager, "CLOSE_TIMEOUT_S", 0.5)
    w = World(31, str(tmp_path / "disk"))
    m = w.mgr
    try:
        _prepare_two_waiting(w)
        load13 = w.held[-1]
        core = m._core
        real_cancel = core.cancel

        def cancel_interrupted(job: Any, reason: Any) -> None:   # the interrupt at _deliver.append's return
            core.cancel = real_cancel
            raise _Boom()

        core.cancel = cancel_interrupted
        with pytest.raises(KeyboardInterrupt):
            m.cancel(load13)
        del core.cancel
        assert any(d is load13 for d in m._deliver) and load13.state.value == "pending"
        fired = _raise_after(m._mover, "submit", lambda t: list(t.rows) == [13])
        with pytest.raises(KeyboardInterrupt):
            w.take(m.poll())
        assert fired
        m.cancel(load13)   # the engine retries its cancel
        # (the interrupted poll never reached its mover.flush(): the copy starts at the next poll, after
        # _deliver_cancelled -- no settling of copies here, so that order is fixed)
        check_disk(w, "a retried cancel between the passes of k1's read")
        unknown = metric_sum(m, "tiered_kv_stale_callbacks_total", reason="unknown_token")
        assert unknown == 0, f"{unknown} copy reports found no job: a load given up while its copy was queued"
    finally:
        m.close()
