"""The same behaviours through both front ends of the tier core.

``TierManager`` (device rows, its own mover) and the vLLM adapter's scheduler side
(``SlabScheduler``: key-set jobs, a shared slab whose rings a stand-in worker marks)
run on one :class:`~tiered_kv.core.TierCore`.  Each test here runs once per front
end and checks what a user of either would see: write-through and write-back,
evict-ahead, ``max_inflight_jobs`` shedding, durability levels, stale reasons,
tombstones, restart from disk.  A config field means the same under both.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry

from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.jobs import JobKind
from tiered_kv.integrations.scheduler import Lookup, SlabScheduler
from tiered_kv.integrations.slab import SharedSlab
from tiered_kv.metrics import Metrics, sample_total
from tiered_kv.movers import Report

ROW = 64          # bytes per block
ROWS = 32         # device rows of the TierManager front end (the last one is for reads)


def payload(key: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(hashlib.shake_128(key).digest(ROW)), dtype=torch.uint8)


def keys(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


class ManagerFront:
    """TierManager on a CPU KV tensor with its real copy workers."""

    name = "TierManager"

    def __init__(self, cfg: TieredKVConfig, tmp: Path) -> None:
        self.cfg = cfg
        self.kv = torch.zeros(ROWS, ROW, dtype=torch.uint8)
        self._next = 0
        self.open()

    def open(self) -> None:
        self.mgr = TierManager(self.cfg, self.kv, registry=CollectorRegistry())
        self.metrics = self.mgr.metrics

    def start_store(self, ks: list[bytes]) -> Any:
        rows = []
        for k in ks:
            r = self._next
            self._next = (self._next + 1) % (ROWS - 1)
            self.kv[r] = payload(k)
            rows.append(r)
        return self.mgr.store_many(ks, rows)

    def finish_store(self, job: Any) -> None:
        self.mgr.wait([job])
        for b in job.blocks:
            assert self.mgr.free_block(b)

    def cancel_then_late_report(self, job: Any) -> None:
        """Cancel a store whose copy has not run, then let its (late) report arrive."""
        self.mgr.cancel(job)
        self.mgr.wait()

    def unknown_report(self) -> None:
        # a worker answering a token this manager never issued (or already applied)
        self.mgr._completions.put(Report(uuid.uuid4(), JobKind.STORE, True))
        self.mgr.poll()

    def step(self) -> None:
        self.mgr.poll()

    def ready(self, key: bytes) -> bool:
        return self.mgr.lookup([key]) == 1

    def read(self, key: bytes) -> Optional[torch.Tensor]:
        job = self.mgr.load(key, ROWS - 1)
        if job is None:
            return None
        self.mgr.wait([job])
        out = self.kv[ROWS - 1].clone() if job.state.value == "done" else None
        assert self.mgr.free_block(ROWS - 1)
        return out

    def forget(self, ks: list[bytes]) -> None:
        for k in ks:
            self.mgr.invalidate(k)

    def flush(self) -> bool:
        return self.mgr.flush(timeout=30)

    def close(self) -> None:
        self.mgr.close()

    @property
    def disk_blocks(self) -> int:
        return self.mgr.disk_blocks

    @property
    def host_used_slots(self) -> int:
        return self.mgr.host_used_slots


class SchedulerFront:
    """SlabScheduler on a shared slab; the test plays vLLM's worker (copy, mark the ring) and engine."""

    name = "SlabScheduler"

    def __init__(self, cfg: TieredKVConfig, tmp: Path) -> None:
        self.cfg = cfg
        self.tmp = tmp
        self.n = 0
        self.open()

    def open(self) -> None:
        self.n += 1
        self.slab = SharedSlab.open(self.tmp / f"slab{self.n}", self.cfg.host_capacity_bytes // ROW, ROW, 1)
        self.metrics = Metrics(registry=CollectorRegistry(), namespace=self.cfg.namespace)
        self.s = SlabScheduler(self.cfg, self.slab, metrics=self.metrics)

    def start_store(self, ks: list[bytes]) -> Any:
        p = self.s.prepare_store(ks)
        return p if p.keys else None

    def finish_store(self, p: Any) -> None:
        for k, slot in zip(p.keys, p.slots):
            self.slab.rows[slot] = payload(k)
        self.slab.mark_done(0, p.seq)
        self.s.complete_store(p.keys)
        self.s.tick()

    def cancel_then_late_report(self, p: Any) -> None:
        self.s.reset()
        self.slab.mark_done(0, p.seq)
        self.s.complete_store(p.keys)
        self.s.tick()

    def unknown_report(self) -> None:
        self.s.complete_store([b"never-prepared"])
        self.s.tick()

    def step(self) -> None:
        self.s.tick()

    def _settled(self, key: bytes) -> Lookup:
        deadline = time.monotonic() + 30
        state = self.s.lookup(key)
        while state is Lookup.PENDING:   # a reader thread reads it back from disk: wait for it, never order
            assert time.monotonic() < deadline, "read-back from disk never finished"
            time.sleep(0.002)
            self.s.tick()
            state = self.s.lookup(key)
        return state

    def ready(self, key: bytes) -> bool:
        return self.s.lookup(key) is not Lookup.MISS

    def read(self, key: bytes) -> Optional[torch.Tensor]:
        if self._settled(key) is not Lookup.HIT:
            return None
        p = self.s.prepare_load([key])
        out = self.slab.rows[p.slots[0]].clone()
        self.slab.mark_done(0, p.seq)
        self.s.complete_load([key])
        self.s.tick()
        return out

    def forget(self, ks: list[bytes]) -> None:
        self.s.reset()

    def flush(self) -> bool:
        return self.s.flush(timeout=30)

    def close(self) -> None:
        self.s.close()
        self.slab.unlink()
        self.slab.close()

    @property
    def disk_blocks(self) -> int:
        return self.s.disk_blocks

    @property
    def host_used_slots(self) -> int:
        return self.s.core.index.used_slots


FRONTS = {"manager": ManagerFront, "scheduler": SchedulerFront}


@pytest.fixture(params=sorted(FRONTS))
def open_front(request, tmp_path):
    opened: list[Any] = []

    def make(host_slots: int = 16, disk_slots: int = 0, **kw: Any) -> Any:
        cfg = TieredKVConfig(namespace="front-ends", host_capacity_bytes=host_slots * ROW,
                             disk_path=tmp_path / "disk" if disk_slots else None,
                             disk_capacity_bytes=disk_slots * ROW, **kw)
        f = FRONTS[request.param](cfg, tmp_path)
        opened.append(f)
        return f

    yield make
    for f in opened:
        try:
            f.close()
        except Exception:  # noqa: BLE001 - a test may have closed it already
            pass


def metric(front: Any, name: str, **labels: str) -> float:
    front.metrics.flush()
    return sample_total(front.metrics.registry, name, **labels)


def store_all(front: Any, ks: list[bytes]) -> None:
    job = front.start_store(ks)
    assert job is not None
    front.finish_store(job)


def reopen(front: Any) -> None:
    front.close()
    front.open()


# --------------------------------------------------------------------------- write policies and durability
@pytest.mark.parametrize("durability", ["sync", "batch", "none"])
def test_write_through_spills_every_stored_block_and_a_restart_serves_its_bytes(open_front, durability):
    f = open_front(host_slots=16, disk_slots=64, durability=durability)
    ks = keys(6)
    store_all(f, ks[:3])
    store_all(f, ks[3:])
    assert f.flush()
    assert f.disk_blocks == 6
    assert metric(f, "tiered_kv_jobs_total", kind="spill", outcome="ok") == 6
    reopen(f)
    assert f.host_used_slots == 0 and f.disk_blocks == 6
    for k in ks:
        got = f.read(k)
        assert got is not None and torch.equal(got, payload(k)), k


def test_write_back_spills_only_once_the_host_fills_and_each_block_once(open_front):
    f = open_front(host_slots=32, disk_slots=64, write_mode="back", host_evict_ahead_blocks=0)
    ks = keys(32)
    for k in ks[:20]:                     # 20 of 32 slots: below the write-back threshold (3/4)
        store_all(f, [k])
    f.step()
    assert f.flush() and f.disk_blocks == 0
    for k in ks[20:28]:                   # 28 of 32: write-back spills the coldest at the next steps
        store_all(f, [k])
    for _ in range(3):
        f.step()
    assert f.flush()
    spilled = f.disk_blocks
    assert spilled > 0
    for _ in range(3):                    # steps spill nothing twice
        f.step()
    assert f.flush() and f.disk_blocks == spilled
    assert metric(f, "tiered_kv_jobs_total", kind="spill", outcome="ok") == spilled


def test_write_back_with_a_disk_tier_smaller_than_the_host_spills_each_residency_once(open_front):
    # every spill evicts a disk block whose key is still on the host: "spill what is not on disk"
    # would rewrite the same blocks at every step
    f = open_front(host_slots=8, disk_slots=4, write_mode="back", host_evict_ahead_blocks=0)
    for k in keys(7):
        store_all(f, [k])
    for _ in range(4):
        f.step()
        assert f.flush()
    spilled = metric(f, "tiered_kv_jobs_total", kind="spill", outcome="ok")
    assert 4 <= spilled <= 7 and f.disk_blocks == 4
    for _ in range(4):
        f.step()
        assert f.flush()
    assert metric(f, "tiered_kv_jobs_total", kind="spill", outcome="ok") == spilled


def test_write_through_sheds_spills_with_the_writer_queue_full_and_counts_them(open_front):
    f = open_front(host_slots=16, disk_slots=64, writer_queue_blocks=1, writer_batch_seconds=60.0)
    store_all(f, keys(4))                  # the writer holds its batch open: the queue is full after one
    assert metric(f, "tiered_kv_shed_total", kind="spill", reason="backpressure") >= 1
    assert f.flush()


# --------------------------------------------------------------------------- host tier
def test_evict_ahead_leaves_that_many_slots_free_after_each_step(open_front):
    f = open_front(host_slots=8, host_evict_ahead_blocks=3)
    for k in keys(12):
        store_all(f, [k])
        f.step()
        assert f.host_used_slots <= 8 - 3
    assert metric(f, "tiered_kv_evictions_total", tier="host") >= 12 - 5
    assert f.ready(b"k-11") and not f.ready(b"k-0")   # least recently used went first


def test_max_inflight_jobs_sheds_stores_beyond_the_bound(open_front):
    f = open_front(host_slots=16, max_inflight_jobs=2)
    a, b = f.start_store([b"a"]), f.start_store([b"b"])
    assert a is not None and b is not None
    assert f.start_store([b"c"]) is None
    assert metric(f, "tiered_kv_shed_total", kind="store", reason="inflight_limit") == 1
    f.finish_store(a)
    f.finish_store(b)
    assert f.start_store([b"c"]) is not None   # room again once the reports were applied


def test_a_store_of_several_keys_skips_the_ones_already_stored(open_front):
    f = open_front(host_slots=16)
    store_all(f, [b"a", b"b"])
    job = f.start_store([b"a", b"c", b"b", b"d"])
    assert list(job.keys) == [b"c", b"d"]
    f.finish_store(job)
    for k in (b"a", b"b", b"c", b"d"):
        assert torch.equal(f.read(k), payload(k)), k


# --------------------------------------------------------------------------- stale reports
def test_a_cancelled_stores_late_report_is_counted_stale_and_never_published(open_front):
    f = open_front(host_slots=4)
    job = f.start_store([b"a", b"b"])
    f.cancel_then_late_report(job)
    assert metric(f, "tiered_kv_stale_callbacks_total", kind="store", reason="cancelled") == 1
    assert metric(f, "tiered_kv_jobs_total", kind="store", outcome="cancelled") == 1
    assert not f.ready(b"a") and not f.ready(b"b")
    assert f.host_used_slots == 0                        # the slots came back once the copy was over


def test_a_report_for_no_live_job_is_counted_unknown_token(open_front):
    f = open_front(host_slots=4)
    f.unknown_report()
    assert metric(f, "tiered_kv_stale_callbacks_total", kind="store", reason="unknown_token") == 1


# --------------------------------------------------------------------------- tombstones
def test_a_forgotten_key_is_never_served_again_even_after_a_restart(open_front):
    f = open_front(host_slots=16, disk_slots=64)
    store_all(f, [b"a", b"b"])
    assert f.flush() and f.disk_blocks == 2
    f.forget([b"a", b"b"])
    assert not f.ready(b"a") and not f.ready(b"b")
    assert f.flush()
    reopen(f)
    assert f.disk_blocks == 0 and f.read(b"a") is None and f.read(b"b") is None


def test_a_spill_cancelled_in_the_writers_batch_is_counted_and_never_lands(open_front):
    # a batch deadline no test reaches: the spills wait in the writer's batch until the flush
    f = open_front(host_slots=16, disk_slots=64, writer_batch_seconds=60.0)
    store_all(f, [b"a", b"b"])
    f.forget([b"a", b"b"])
    f.flush()
    f.step()
    assert metric(f, "tiered_kv_jobs_total", kind="spill", outcome="cancelled") == 2
    assert metric(f, "tiered_kv_orphaned_writes_prevented_total") == 2
    reopen(f)
    assert f.disk_blocks == 0 and f.read(b"a") is None


def test_a_block_only_on_disk_is_read_back_with_its_bytes(open_front):
    f = open_front(host_slots=4, disk_slots=64, host_evict_ahead_blocks=0)
    ks = keys(8)
    for k in ks:
        store_all(f, [k])
        assert f.flush()                                 # a spill leases its host slot until it is written
    assert f.disk_blocks == 8
    got = f.read(ks[0])                                  # evicted from the host long ago
    assert got is not None and torch.equal(got, payload(ks[0]))
    assert metric(f, "tiered_kv_jobs_total", kind="promote", outcome="ok") >= 1
