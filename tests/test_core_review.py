"""Review of the tier core rewrite (TierCore + TierManager + SlabScheduler): forced interleavings.

Two pin bugs a review found (each failed before its fix): every cancelled part of a store counted
under its own stale reason; ``SlabScheduler.flush`` covering a spill that failed before it was
asked for.  The others pin interleavings checked to be right that no other test forces: per-part cancellation of ``store_many`` and the slot leases it
keeps, ``load_many`` waiting on several reads from disk (a read shared by two loads, one read
failing after another landed, a key invalidated while it is read back), and a ``reset`` under
the scheduler while a read-back is in flight.

Reads from disk are held by :class:`HeldReads` (the core queues them; the test starts or fails
each one when it says), so which read lands first is never left to the reader threads; a read
that is started is waited for with a deadline, as tests/test_batched_api.py does.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from disk_helpers import fail_first_batch
from fakes import (fake_disk_manager, fill_row, host_matches, make_config, make_fake_manager, mgr_metric, on_disk_only,
                   row_matches)
from tiered_kv import TieredKVConfig
from tiered_kv.integrations.scheduler import Lookup, SlabScheduler
from tiered_kv.integrations.slab import SharedSlab
from tiered_kv.jobs import JobKind, JobState
from tiered_kv.metrics import Metrics, sample_total
from tiered_kv.movers import Report

K = [f"key-{i}".encode() for i in range(8)]


def stale(mgr, kind, reason):
    return mgr_metric(mgr, "tiered_kv_stale_callbacks_total", kind=kind, reason=reason)


def outcome(mgr, kind, what):
    return mgr_metric(mgr, "tiered_kv_jobs_total", kind=kind, outcome=what)


def in_flight(mgr, kind):
    return mgr_metric(mgr, "tiered_kv_jobs_in_flight", kind=kind)


# =========================================================================== store_many: per-part cancellation
def test_each_cancelled_part_is_counted_stale_under_its_own_reason(fake, kv):
    mgr, mover = fake
    for i in range(3):
        fill_row(kv, i, K[i])
    job = mgr.store_many(K[:3], [0, 1, 2])
    assert mgr.free_block(0)            # part 0: its row is reused -> source_reused
    mgr.invalidate(K[1])                # part 1: its key is invalidated -> superseded
    mover.complete(job)
    out = mgr.poll()
    assert [(c.job, c.ok) for c in out] == [(job, True)]
    assert host_matches(mgr, K[2], kv) and mgr.lookup([K[0]]) == 0 and mgr.lookup([K[1]]) == 0
    assert stale(mgr, "store", "source_reused") == 1
    assert stale(mgr, "store", "superseded") == 1


def test_a_cancelled_parts_slot_stays_leased_until_the_report(kv, registry):
    """free_block() of one row of a pending store_many: the key goes at once, but its slot is written
    by the copy in flight, so a full host tier sheds a new store instead of handing that slot out."""
    mgr, mover = make_fake_manager(make_config(host_slots=2, host_evict_ahead_blocks=0), kv, registry)
    try:
        for i in range(2):
            fill_row(kv, i, K[i])
        job = mgr.store_many(K[:2], [0, 1])
        assert mgr.free_block(0) and mgr.lookup([K[0]]) == 0
        fill_row(kv, 5, K[5])
        assert mgr.store(K[5], 5) is None                # no free slot: K0's is leased to the copy
        assert mgr_metric(mgr, "tiered_kv_shed_total", kind="store", reason="host_full") == 1
        fill_row(kv, 0, b"the engine's next block")      # the engine reuses row 0 before the copy ran
        mover.complete(job)
        assert [(c.job, c.ok) for c in mgr.poll()] == [(job, True)]
        assert mgr.host_used_slots == 1 and host_matches(mgr, K[1], kv)
        s = mgr.store(K[5], 5)                            # K0's slot came back with the report
        assert s is not None
        mover.complete(s)
        mgr.poll()
        assert host_matches(mgr, K[5], kv) and host_matches(mgr, K[1], kv)
    finally:
        mgr.close()


def test_an_invalidated_parts_late_copy_never_overwrites_the_key_stored_again(fake, kv):
    """invalidate() of one key of a pending store_many, the key stored again from another row with
    other bytes, and only then the old job's report: the key keeps the new bytes."""
    mgr, mover = fake
    for i in range(2):
        fill_row(kv, i, K[i])
    old = mgr.store_many(K[:2], [0, 1])
    mgr.invalidate(K[0])
    fill_row(kv, 7, b"K0, version 2")
    new = mgr.store(K[0], 7)
    assert new is not None
    mover.complete(new)
    mgr.poll()
    mover.complete(old)                   # copies row 0 (K0, version 1) into the dead part's own slot
    out = mgr.poll()
    assert [(c.job, c.ok) for c in out] == [(old, True)]
    want = kv[7].reshape(-1).view(torch.uint8)
    assert torch.equal(mgr.host_bytes(K[0]).reshape(-1), want)
    assert host_matches(mgr, K[1], kv)
    assert stale(mgr, "store", "superseded") == 1
    assert mgr.host_used_slots == 2 == mgr.host_blocks


def test_every_part_dead_by_different_paths_reports_the_job_cancelled_once(fake, kv):
    """A row freed, then the last live key invalidated: the whole job is cancelled (reported once, at
    the next poll), nothing is published by its late report, and its slots come back only then."""
    mgr, mover = fake
    for i in range(2):
        fill_row(kv, i, K[i])
    job = mgr.store_many(K[:2], [0, 1])
    assert mgr.free_block(0)
    mgr.invalidate(K[1])
    out = mgr.poll()
    assert [(c.job, c.ok, c.error) for c in out] == [(job, False, "cancelled (superseded)")]
    assert mgr.host_used_slots == 2 and mgr.host_blocks == 0
    mover.complete(job)
    mover.duplicate(job)
    assert mgr.poll() == []
    assert mgr.host_used_slots == 0 and mgr.lookup(K[:2]) == 0
    assert outcome(mgr, "store", "cancelled") == 1 and outcome(mgr, "store", "ok") == 0
    assert stale(mgr, "store", "unknown_token") == 1
    assert in_flight(mgr, "store") == 0 and mgr.jobs_in_flight == 0


# =========================================================================== load_many: several reads from disk
class HeldReads:
    """Holds the reads from disk the core queues; the test starts (``land``) or fails (``fail``) each."""

    def __init__(self, mgr: Any) -> None:
        self.mgr = mgr
        self.store = mgr._core.disk.store
        self.held: dict[bytes, tuple[Any, ...]] = {}
        self._queue = self.store.queue_promote
        self.store.queue_promote = self._hold   # the instance attribute shadows the method

    def _hold(self, token: uuid.UUID, key: bytes, expect: uuid.UUID, dst: memoryview, where: int = 0) -> None:
        self.held[key] = (token, key, expect, dst, where)

    def land(self, key: bytes) -> None:
        """Let a reader thread read ``key`` for real, and apply its report."""
        args = self.held.pop(key)
        self._queue(*args)
        self.store.start_reads()
        deadline = time.monotonic() + 30
        while args[0].int in self.mgr._core.jobs:
            assert time.monotonic() < deadline, f"the read of {key!r} never landed"
            self.mgr.poll()
            time.sleep(0.001)

    def fail(self, key: bytes, error: str = "miss: injected") -> None:
        """The read of ``key`` fails (as a reader reports a gone or corrupt entry); applied at the next poll."""
        token = self.held.pop(key)[0]
        self.mgr._completions.put(Report(token, JobKind.PROMOTE, False, error))



@pytest.fixture
def disk_mgr(tmp_path):
    mgr, mover, kv = fake_disk_manager(tmp_path / "d")
    yield mgr, mover, kv
    mgr.close()

def test_a_read_shared_by_two_loads_failing_after_the_other_read_of_one_landed(disk_mgr):
    """Load A waits for K0's read; load B for K0's (the same read) and K1's.  A is cancelled, K1's read
    lands (B leases it), then K0's read fails: B fails once, A was cancelled once, nothing stays
    leased or fenced, and K1 stays on the host as a prefetch."""
    mgr, mover, kv = disk_mgr
    on_disk_only(mgr, mover, kv, K[:2])
    held = HeldReads(mgr)
    a = mgr.load(K[0], 20)
    b = mgr.load_many([K[0], K[1]], [21, 22])
    assert a is not None and b is not None and set(held.held) == {K[0], K[1]}   # one read of K0
    mgr.cancel(a)
    assert [(c.job, c.ok) for c in mgr.poll()] == [(a, False)]
    held.land(K[1])
    assert not b.done and not mover.is_outstanding(b)
    held.fail(K[0])
    assert [(c.job, c.ok) for c in mgr.poll()] == [(b, False)] and b.state is JobState.FAILED
    assert not mover.is_outstanding(b) and all(mgr.free_block(r) for r in (20, 21, 22))
    assert outcome(mgr, "load", "failed") == 1 and outcome(mgr, "load", "cancelled") == 1
    assert outcome(mgr, "promote", "failed") == 1 and outcome(mgr, "promote", "ok") == 1
    assert mgr.jobs_in_flight == 0 and in_flight(mgr, "load") == 0 and in_flight(mgr, "promote") == 0
    assert mgr.host_used_slots == mgr.host_blocks             # no slot held by a lease
    j = mgr.load(K[1], 23)
    mover.complete(j)
    mgr.poll()
    assert row_matches(kv, 23, K[1])


def test_invalidating_a_key_while_it_is_read_back_for_a_waiting_load(disk_mgr):
    """load_many waits for two reads; one landed (leased to it), then the other key is invalidated:
    the load is reported cancelled (superseded) at once, its rows are free, the late read is
    discarded and counted, and the invalidated key is never served again."""
    mgr, mover, kv = disk_mgr
    on_disk_only(mgr, mover, kv, K[:2])
    held = HeldReads(mgr)
    b = mgr.load_many([K[0], K[1]], [21, 22])
    held.land(K[1])
    mgr.invalidate(K[0])
    assert [(c.job, c.ok, c.error) for c in mgr.poll()] == [(b, False, "cancelled (superseded)")]
    assert mgr.free_block(21) and mgr.free_block(22)
    held.land(K[0])                                           # the read was already running
    assert mgr.lookup([K[0]]) == 0 and mgr.host_bytes(K[0]) is None and mgr.load(K[0], 23) is None
    assert stale(mgr, "promote", "superseded") == 1 and outcome(mgr, "promote", "cancelled") == 1
    assert outcome(mgr, "load", "cancelled") == 1
    assert mgr.jobs_in_flight == 0 and in_flight(mgr, "promote") == 0 and in_flight(mgr, "load") == 0
    assert mgr.host_used_slots == mgr.host_blocks
    j = mgr.load(K[1], 23)
    mover.complete(j)
    mgr.poll()
    assert row_matches(kv, 23, K[1])


# =========================================================================== SlabScheduler
ROW = 64


def payload(key: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(hashlib.shake_128(key).digest(ROW)), dtype=torch.uint8)


@pytest.fixture
def sched(tmp_path):
    opened = []

    def make(host_slots: int = 16, **kw: Any) -> tuple[SlabScheduler, SharedSlab]:
        cfg = TieredKVConfig(namespace="review", host_capacity_bytes=host_slots * ROW,
                             disk_path=tmp_path / "disk", disk_capacity_bytes=64 * ROW, **kw)
        slab = SharedSlab.open(tmp_path / "slab", host_slots, ROW, 1)
        s = SlabScheduler(cfg, slab, metrics=Metrics(registry=CollectorRegistry(), namespace="review"))
        opened.append((s, slab))
        return s, slab

    yield make
    for s, slab in opened:
        s.close()
        slab.unlink()
        slab.close()


def smetric(s: SlabScheduler, name: str, **labels: str) -> float:
    s.metrics.flush()
    return sample_total(s.metrics.registry, name, **labels)


def sched_store(s: SlabScheduler, slab: SharedSlab, keys: list[bytes]) -> None:
    p = s.prepare_store(keys)
    for k, slot in zip(p.keys, p.slots):
        slab.rows[slot] = payload(k)
    slab.mark_done(0, p.seq)
    s.complete_store(p.keys)
    s.tick()


def test_scheduler_flush_is_false_when_a_spill_failed_before_it_was_asked_for(sched):
    s, slab = sched(disk_io="thread")   # fail_first_batch patches the writer
    failed = fail_first_batch(s.disk)
    sched_store(s, slab, [b"k"])         # published; write-through queues its spill
    assert failed.wait(30)               # its batch failed (report queued) before flush() is called
    flushed = s.flush(timeout=30)
    assert s.disk_blocks == 0            # the block stored before flush() is not on disk
    assert flushed is False


def test_scheduler_reset_while_a_read_back_is_in_flight(sched):
    """lookup() started a read from disk (PENDING); reset() before it landed: the read's report is
    discarded and counted, its host slot comes back, nothing waits on it, and the key is a miss."""
    s, slab = sched(host_slots=4, host_evict_ahead_blocks=0)
    for k in (b"a", b"f0", b"f1", b"f2", b"f3"):
        sched_store(s, slab, [k])
        assert s.flush(timeout=30)       # a spill leases its host slot until it is written
    assert s.state_of(b"a") == (None, "ready")
    assert s.lookup(b"a") is Lookup.PENDING and s.pending_work
    used = s.core.index.used_slots
    s.reset()
    assert s.state_of(b"a") == (None, None)
    deadline = time.monotonic() + 30
    while s.pending_work:                # the reader thread answers: wait for it, never order by time
        assert time.monotonic() < deadline, "the read never reported"
        time.sleep(0.001)
        s.tick()
    assert smetric(s, "tiered_kv_stale_callbacks_total", kind="promote", reason="superseded") == 1
    assert smetric(s, "tiered_kv_jobs_total", kind="promote", outcome="cancelled") == 1
    assert s.core.index.used_slots == 0 < used
    assert s.lookup(b"a") is Lookup.MISS
