"""Adversarial review of the vLLM adapter's shared pieces: the shared slab and its rings
(tiered_kv.integrations.slab), the worker-side SlabCopier (integrations.copier) and the scheduler side
(integrations.scheduler).  No vLLM import: the scheduler is driven by hand, the worker is either played
by the test (``mark``) or a real SlabCopier over CPU tensors.

What it proved wrong, each pinned by a test that failed before its fix: a creator that failed after
sizing the slab left the file (and its memory) in /dev/shm; a path that exists but cannot be attached
raised a bare OSError; ``mark_done`` took rank -1 as the last rank; a load every ring records as failed
was counted ok; the copier observed one copy time per job instead of per block, reported a failed copy's
bytes as moved, and counted a failed load as a host error (TierManager: device).  The others guard
tricky behaviours that are correct and would fail if they broke.  Every slab lives under
``tmp_path``; interleavings are forced by call order, never by sleeps.
"""

from __future__ import annotations

import errno
import hashlib
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry

from tiered_kv import TieredKVConfig
from tiered_kv.errors import ConfigError, TieredKVError
from tiered_kv.integrations import slab as slab_mod
from tiered_kv.integrations.copier import SlabCopier
from tiered_kv.integrations.scheduler import Lookup, SlabScheduler
from tiered_kv.integrations.slab import SharedSlab
from tiered_kv.metrics import Metrics

HIT, MISS = Lookup.HIT, Lookup.MISS
JOBS = "tiered_kv_jobs_total"
A, B, C, D = b"rv-A", b"rv-B", b"rv-C", b"rv-D"


# =========================================================================== helpers
def _metrics() -> Metrics:
    return Metrics(registry=CollectorRegistry(), namespace="t")


def metric(m: Metrics, name: str, **labels: str) -> float:
    m.flush()
    v = m.registry.get_sample_value(name, labels)
    return 0.0 if v is None else float(v)


def pattern(key: bytes, tag: str, n: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(hashlib.shake_128(tag.encode() + b"|" + key).digest(n)), dtype=torch.uint8)


def kv(rows: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, width), generator=g, dtype=torch.uint8)


class Rig:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.slabs: list[SharedSlab] = []
        self.tiers: list[SlabScheduler] = []
        self.copiers: list[SlabCopier] = []

    def slab(self, num_slots: int = 4, row_bytes: int = 32, world_size: int = 1, name: str = "r.slab") -> SharedSlab:
        s = SharedSlab.open(self.tmp_path / name, num_slots, row_bytes, world_size)
        self.slabs.append(s)
        return s

    def open(self, slab: SharedSlab) -> SlabScheduler:
        cfg = TieredKVConfig(namespace="t", host_capacity_bytes=slab.num_slots * slab.row_bytes)
        t = SlabScheduler(cfg, slab, metrics=_metrics())
        self.tiers.append(t)
        return t

    def copier(self, slab: SharedSlab, rank: int, tensors: list[torch.Tensor], **kw: Any) -> SlabCopier:
        c = SlabCopier(slab, rank, tensors, metrics=_metrics(), **kw)
        self.copiers.append(c)
        return c

    def close(self) -> None:
        for c in self.copiers:
            c.close()
        for t in self.tiers:
            t.close()
        for s in self.slabs:
            s.close()


@pytest.fixture
def rig(tmp_path: Path):
    r = Rig(tmp_path)
    yield r
    r.close()


def mark(slab: SharedSlab, seq: int, ranks: Optional[list[int]] = None, ok: bool = True) -> None:
    for r in (range(slab.world_size) if ranks is None else ranks):
        slab.mark_done(r, seq, ok)


def worker_store(slab: SharedSlab, keys: list[bytes], slots: list[int], seq: int, tag: str = "v1") -> None:
    for k, s in zip(keys, slots):
        slab.rows[s] = pattern(k, tag, slab.row_bytes)
    mark(slab, seq)


def store_ready(tiers: SlabScheduler, keys: list[bytes]) -> list[int]:
    p = tiers.prepare_store(keys)
    assert p.keys == keys
    worker_store(tiers.slab, p.keys, p.slots, p.seq)
    tiers.complete_store(p.keys)
    assert [tiers.lookup(k) for k in keys] == [HIT] * len(keys)
    return p.slots


# =========================================================================== defects, fixed
def test_a_creator_that_fails_after_sizing_the_slab_removes_its_file(tmp_path, monkeypatch):
    """The creator sizes the file (posix_fallocate: the /dev/shm pages are reserved) and writes the header,
    then mmap fails (ENOMEM: RLIMIT_AS, vm.max_map_count, a container's limits).  Only the fallocate failure
    unlinks; here the file stays, fully reserved and with a valid header, in /dev/shm for ever: the engine
    failed to start, nobody maps or unlinks it (the worker's and the manager's cleanup run only when
    open() returned), and every retry with a fresh engine_id leaks host_bytes of shared memory more."""
    p = tmp_path / "leak.slab"

    def no_memory(*a: Any, **kw: Any) -> Any:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(slab_mod.mmap, "mmap", no_memory)
    with pytest.raises((OSError, TieredKVError)):
        SharedSlab.open(p, 4, 4096, 1)
    monkeypatch.undo()
    assert not p.exists(), (f"the failed creator left {p.name} behind ({p.stat().st_size} bytes reserved, "
                            f"header written)")


def test_an_existing_path_that_cannot_be_attached_raises_config_error_naming_it(tmp_path):
    """The create path wraps its OSError in a ConfigError naming the path; the attach path (``O_EXCL`` found
    something at the name) does not: a leftover entry the process cannot open -- another user's slab
    (EACCES), or, as here, a directory -- escapes as a bare OSError from ``os.open``."""
    p = tmp_path / "taken.slab"
    p.mkdir()
    with pytest.raises(ConfigError) as ei:
        SharedSlab.open(p, 2, 32, 1, timeout=1)
    assert str(p) in str(ei.value)


@pytest.mark.parametrize("rank", [-1, 2])
def test_mark_done_rejects_a_rank_out_of_range(tmp_path, rank):
    """With two ranks, ``mark_done(-1, seq)`` writes rank 1's ring: the job then reads as finished on rank 1
    while rank 1's copy may still run (once rank 0 marks it, ``done()`` lets the scheduler reuse the slot).
    Expected: a TieredKVError naming the rank, and no ring touched."""
    s = SharedSlab.open(tmp_path / "r.slab", 2, 32, 2)
    try:
        with pytest.raises(TieredKVError, match=str(rank)):
            s.mark_done(rank, 5)
        s.mark_done(0, 5)
        assert not s.done(5), "rank 1 never finished job 5, yet the rings say every rank did"
    finally:
        s.close()


@pytest.mark.parametrize("ring_first", [True, False], ids=["ring-then-report", "report-then-ring"])
def test_a_load_whose_copy_failed_is_counted_failed_not_ok(rig, ring_first):
    """Job outcomes are the scheduler side's to count (the worker counts bytes and copy times only); stores
    consult ``slab.ok(seq)``, loads do not: ``_apply_load`` counts every load ``ok``.  A load whose copy the
    worker recorded as failed (ring entry ``2*seq+1``) that the engine reports complete is counted as a
    successful load, and ``tiered_kv_jobs_total{kind="load",outcome="failed"}`` stays 0 under vLLM."""
    slab = rig.slab(num_slots=2)
    tiers = rig.open(slab)
    store_ready(tiers, [A])
    pl = tiers.prepare_load([A])
    if ring_first:
        mark(slab, pl.seq, ok=False)
        tiers.complete_load([A])
    else:
        tiers.complete_load([A])                    # awaiting the rings
        mark(slab, pl.seq, ok=False)
    tiers.tick()
    assert tiers.debug_sizes()["live_loads"] == tiers.debug_sizes()["awaiting"] == 0   # the lease was released
    m = tiers.metrics
    assert (metric(m, JOBS, kind="load", outcome="ok"), metric(m, JOBS, kind="load", outcome="failed")) == (0, 1)


def test_copier_observes_copy_latency_once_per_block(rig):
    """docs/observability.md: the histogram observes one block's copy (a job of many blocks: its time shared
    by its blocks, one sample each); TierManager calls ``metrics.moved(..., blocks=n)``.  SlabCopier calls
    ``observe()`` once with the per-block share, so under vLLM ``_count`` counts jobs and ``_sum`` is 1/n of
    the copy time: a 4-block job gives 1 sample."""
    slab = rig.slab(num_slots=8, row_bytes=64)
    c = rig.copier(slab, 0, [kv(16, 64, 1)])
    assert c.submit(1, b"s" * 16, 1, True, [0, 1, 2, 3], [4, 5, 6, 7])
    c.wait([1])
    assert [(r.job_id, r.ok) for r in c.finished()] == [(1, True)]
    assert metric(c.metrics, "tiered_kv_transfer_seconds_count", src="device", dst="host") == 4


def test_copier_reports_no_bytes_for_a_failed_copy(rig):
    """A failed store is answered to vLLM as ``success=True`` (its assert would kill the engine) with
    ``transfer_size=r.nbytes`` (integrations/vllm.py ``get_finished``); ``CopyResult.nbytes`` is
    ``nblocks * block_bytes`` whether or not the copy ran, so vLLM's own offload metrics count the bytes of
    a store that copied nothing (here slot 0 stays zero)."""
    slab = rig.slab(num_slots=4, row_bytes=64)
    c = rig.copier(slab, 0, [kv(8, 64, 2)])
    assert c.submit(1, b"f" * 16, 1, True, [99, 1], [0, 1])     # device block 99 does not exist
    c.wait([1])
    (r,) = c.finished()
    assert not r.ok and slab.done(1) and not slab.ok(1) and not slab.rows.any()
    assert r.nbytes == 0, f"a failed copy reported {r.nbytes} bytes moved"


def test_copier_counts_a_failed_load_as_a_device_error_as_tiermanager_does(rig):
    """TierManager: a failed store is ``errors_total{tier="host",error="copy_failed"}``, a failed load
    ``{tier="device"}`` (tests/test_metrics_core.py).  SlabCopier counts both as ``tier="host"``, so the
    dashboard's errors by tier blame the host slab for device-side load faults under vLLM only."""
    slab = rig.slab(num_slots=4, row_bytes=64)
    c = rig.copier(slab, 0, [kv(8, 64, 3)])
    assert c.submit(1, b"l" * 16, 1, False, [99], [0])          # load into a device block out of range
    c.wait([1])
    assert [(r.job_id, r.ok) for r in c.finished()] == [(1, False)]
    m = c.metrics
    assert metric(m, "tiered_kv_errors_total", tier="device", error="copy_failed") == 1
    assert metric(m, "tiered_kv_errors_total", tier="host", error="copy_failed") == 0


# =========================================================================== guards (correct today)
def test_a_store_failed_on_one_rank_only_is_never_published_and_frees_its_slot(rig):
    """Two ranks: rank 0's copy succeeded, rank 1's failed; the engine reports success (the adapter answers
    a failed store as finished).  ``ok()`` must look at every rank: the key stays a miss, the slot is free
    again, the job is counted failed."""
    slab = rig.slab(num_slots=1, row_bytes=32, world_size=2)
    tiers = rig.open(slab)
    p = tiers.prepare_store([A])
    mark(slab, p.seq, ranks=[0], ok=True)
    mark(slab, p.seq, ranks=[1], ok=False)
    tiers.complete_store([A], success=True)
    tiers.tick()
    assert tiers.lookup(A) == MISS and tiers.state_of(A) == (None, None)
    assert tiers.prepare_store([B]).slots == p.slots               # the slot came back
    m = tiers.metrics
    assert (metric(m, JOBS, kind="store", outcome="failed"), metric(m, JOBS, kind="store", outcome="ok")) == (1, 0)


def test_a_quarantined_store_keeps_its_slot_until_every_rank_marked_it(rig):
    """reset() while a two-rank store is in flight: rank 0 finished, rank 1 still copies.  The slot must
    not go to another job until rank 1's ring shows its copy done, and the store is never published."""
    slab = rig.slab(num_slots=1, row_bytes=32, world_size=2)
    tiers = rig.open(slab)
    p = tiers.prepare_store([A])
    tiers.complete_store([A])                      # the engine's report overtakes the rings
    tiers.reset()
    mark(slab, p.seq, ranks=[0])
    for _ in range(2):
        tiers.tick()
        assert tiers.prepare_store([B]).keys == [], "slot handed out while rank 1 may still write it"
    mark(slab, p.seq, ranks=[1])
    tiers.tick()
    assert tiers.lookup(A) == MISS
    q = tiers.prepare_store([B])
    assert q.keys == [B] and q.slots == p.slots
    assert tiers.debug_sizes()["quarantine"] == 0


def test_a_new_scheduler_numbers_its_jobs_above_the_highest_mark_of_any_rank(rig):
    """max_seq() must scan every rank's ring: here only rank 1 ever marked a high number.  A scheduler that
    looked at rank 0 alone would hand out seq 41 again, and rank 1's old mark would make it finish early."""
    slab = rig.slab(num_slots=1, row_bytes=32, world_size=2)
    mark(slab, 3)
    slab.mark_done(1, 41, ok=False)                 # a failed mark, 2*41+1, on rank 1 only
    tiers = rig.open(slab)
    p = tiers.prepare_store([A])
    assert p.seq > 41
    slab.mark_done(0, p.seq)
    assert not slab.done(p.seq)
    tiers.complete_store([A])
    tiers.tick()
    assert tiers.lookup(A) == MISS                  # rank 1 has not copied it: not published
    mark(slab, p.seq, ranks=[1])
    tiers.tick()
    assert tiers.lookup(A) == HIT


def test_cpu_copier_batch_keeps_submission_order_when_a_store_follows_a_load(rig):
    """copy_batch_max > 1 on the CPU: the ThreadMover splits a flush into its stores, then its loads.  A
    load of slot 0 into block 2 followed by a store of block 2 into slot 1 must still run in that order
    (the copier starts the queue before the store), so slot 1 gets the loaded bytes, not block 2's old ones."""
    slab = rig.slab(num_slots=4, row_bytes=64)
    slab.rows[0] = 7
    dev = kv(4, 64, 4)
    c = rig.copier(slab, 0, [dev], batch_max=8)
    assert c.submit(1, b"l" * 16, 1, False, [2], [0])
    assert c.submit(2, b"s" * 16, 2, True, [2], [1])
    c.wait([1, 2])
    assert [(r.job_id, r.ok) for r in c.finished()] == [(1, True), (2, True)]
    assert bool((dev[2] == 7).all()) and bool((slab.rows[1] == 7).all())
    assert slab.done(1) and slab.done(2)


def test_copier_close_runs_and_marks_jobs_still_queued_for_a_batch(rig):
    """A worker shut down with copies queued (copy_batch_max > 1, no get_finished since): close() must run
    them and mark the rings, or the scheduler keeps their slots quarantined until the ring wraps."""
    slab = rig.slab(num_slots=4, row_bytes=64)
    dev = kv(4, 64, 5)
    c = rig.copier(slab, 0, [dev], batch_max=8)
    assert c.submit(1, b"a" * 16, 1, True, [0], [0])
    assert c.submit(2, b"b" * 16, 2, True, [1], [1])
    assert not slab.done(1) and not slab.done(2)    # queued, not started
    c.close()
    assert slab.done(1) and slab.ok(1) and slab.done(2) and slab.ok(2)
    assert torch.equal(slab.rows[:2], dev[:2])
    assert [r.job_id for r in c.finished()] == [1, 2]


def test_copier_mark_failure_reports_the_job_failed_and_leaves_the_ring_unmarked(rig):
    """If writing the ring mark raises, the job must be answered failed (never lost, never a dead copy
    thread) and the ring left unmarked: the scheduler then keeps the job's slots rather than trusting a
    mark that was never written."""
    slab = rig.slab(num_slots=4, row_bytes=64)
    c = rig.copier(slab, 0, [kv(4, 64, 6)])
    real = slab.mark_done

    def broken(rank: int, seq: int, ok: bool = True) -> None:
        if seq == 1:
            raise RuntimeError("ring write failed")
        real(rank, seq, ok)

    slab.mark_done = broken  # type: ignore[method-assign]
    assert c.submit(1, b"a" * 16, 1, True, [0], [0])
    assert c.submit(2, b"b" * 16, 2, True, [1], [1])
    c.wait([1, 2], timeout=10)
    assert [(r.job_id, r.ok) for r in c.finished()] == [(1, False), (2, True)]
    assert not slab.done(1) and slab.done(2)
