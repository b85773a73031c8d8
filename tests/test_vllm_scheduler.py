"""The engine-independent core of the vLLM offloading adapter (tiered_kv.integrations.offload).

``SlabScheduler`` (scheduler side) is driven by hand: a test plays the worker by
writing bytes into ``slab.rows[slot]`` and calling ``slab.mark_done(rank, seq)``
in whatever order it wants, and plays the engine by calling ``complete_store``
/ ``complete_load`` in whatever order it wants -- that is how every race below
is forced deterministically.  ``SlabCopier`` (worker side) is exercised with
real CPU int8/uint8 KV tensors.  A hypothesis state machine at the end mixes
all of it.

Block bytes are derived from (key, tag) (:func:`pattern`), so every check is
byte for byte and a block written by the wrong job is told apart.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from hypothesis import Phase
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from prometheus_client import CollectorRegistry

from disk_helpers import WriterGate, flip, payload_offset, raw_blocks, rewrite_value
from fakes import sm_settings
from tiered_kv import TieredKVConfig
from tiered_kv.disk.format import lmdb_key
from tiered_kv.errors import ConfigError, InvalidKeyError
from tiered_kv.integrations.copier import SlabCopier
from tiered_kv.integrations.scheduler import Lookup, SlabScheduler
from tiered_kv.integrations.slab import SharedSlab
from tiered_kv.metrics import Metrics

HIT, MISS, PENDING = Lookup.HIT, Lookup.MISS, Lookup.PENDING
STALE = "tiered_kv_stale_callbacks_total"
JOBS = "tiered_kv_jobs_total"
SHED = "tiered_kv_shed_total"
A, B, C, D, E, F = (b"key-" + c for c in (b"A", b"B", b"C", b"D", b"E", b"F"))


# =========================================================================== helpers
def pattern(key: bytes, tag: str, n: int) -> torch.Tensor:
    """``n`` bytes that only (key, tag) produces."""
    return torch.frombuffer(bytearray(hashlib.shake_128(tag.encode() + b"|" + key).digest(n)), dtype=torch.uint8)


def metric(m: Metrics, name: str, **labels: str) -> float:
    m.flush()  # SlabScheduler batches counts until its next tick(); read what it counted so far
    v = m.registry.get_sample_value(name, labels)
    return 0.0 if v is None else float(v)


def stale_total(m: Metrics) -> float:
    m.flush()
    return sum(s.value for fam in m.stale_callbacks.collect() for s in fam.samples if s.name == STALE)


class Rig:
    """Slabs, metrics and SlabScheduler of one test; everything is closed at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.disk = tmp_path / "disk"
        self.slabs: list[SharedSlab] = []
        self.tiers: list[SlabScheduler] = []
        self.copiers: list[SlabCopier] = []

    def slab(self, num_slots: int = 4, row_bytes: int = 64, world_size: int = 1, name: str = "x.slab",
             **kw: Any) -> SharedSlab:
        s = SharedSlab.open(self.tmp_path / name, num_slots, row_bytes, world_size, **kw)
        self.slabs.append(s)
        return s

    def open(self, slab: SharedSlab, disk: bool = False, disk_blocks: int = 64, **kw: Any) -> SlabScheduler:
        cfg = TieredKVConfig(namespace="t", host_capacity_bytes=slab.num_slots * slab.row_bytes,
                             disk_path=self.disk if disk else None,
                             disk_capacity_bytes=disk_blocks * slab.row_bytes if disk else 0,
                             writer_batch_seconds=0.0, **kw)
        t = SlabScheduler(cfg, slab, metrics=Metrics(registry=CollectorRegistry(), namespace="t"))
        self.tiers.append(t)
        return t

    def copier(self, slab: SharedSlab, rank: int, tensors: list[torch.Tensor]) -> SlabCopier:
        c = SlabCopier(slab, rank, tensors, metrics=Metrics(registry=CollectorRegistry(), namespace="t"))
        self.copiers.append(c)
        return c

    def close(self) -> None:
        for c in self.copiers:
            c.close()
        for t in self.tiers:
            if t.disk is not None and getattr(t.disk, "fault_hook", None) is not None:
                hook = t.disk.fault_hook
                if isinstance(hook, WriterGate):
                    hook.raise_at.clear()
                    hook.open()
            t.close()
        for s in self.slabs:
            s.close()


@pytest.fixture
def rig(tmp_path: Path):
    r = Rig(tmp_path)
    yield r
    r.close()


def worker_store(slab: SharedSlab, keys, slots, seq: Optional[int], tag: str = "v1",
                 ranks: Optional[list[int]] = None) -> None:
    """Play the worker of a store job: copy each key's bytes into its slot, then mark ``seq`` done."""
    ranks = list(range(slab.world_size)) if ranks is None else ranks
    rb = slab.rank_bytes
    for r in ranks:
        for k, s in zip(keys, slots):
            slab.rows[s, r * rb:(r + 1) * rb] = pattern(k, tag, slab.row_bytes)[r * rb:(r + 1) * rb]
        if seq is not None:
            slab.mark_done(r, seq)


def mark(slab: SharedSlab, seq: int, ranks: Optional[list[int]] = None, ok: bool = True) -> None:
    for r in (range(slab.world_size) if ranks is None else ranks):
        slab.mark_done(r, seq, ok)


def store_ready(tiers: SlabScheduler, keys, tag: str = "v1") -> list[int]:
    """prepare_store -> worker copies -> complete_store: the keys end READY (asserted without a lookup, which
    would count and protect them as a request's hits)."""
    p = tiers.prepare_store(list(keys))
    assert p.keys == list(keys), p
    worker_store(tiers.slab, p.keys, p.slots, p.seq, tag)
    tiers.complete_store(p.keys)
    for k in keys:
        assert tiers.state_of(k)[0] == "ready", k
    return p.slots


def slot_bytes_of(tiers: SlabScheduler, key: bytes) -> torch.Tensor:
    """The bytes a load of ``key`` would copy (through prepare_load/complete_load, slot leased meanwhile)."""
    pl = tiers.prepare_load([key])
    out = tiers.slab.rows[pl.slots[0]].clone()
    mark(tiers.slab, pl.seq)
    tiers.complete_load([key])
    return out


def wait_promotes(tiers: SlabScheduler, timeout: float = 20.0) -> None:
    """Step until no disk read-back is in flight (a reader thread answers it; waits, never orders)."""
    deadline = time.monotonic() + timeout
    tiers.tick()
    while tiers.pending_work:
        if time.monotonic() > deadline:
            raise AssertionError(f"promotes still in flight after {timeout} s: {tiers.debug_sizes()}")
        time.sleep(0.002)
        tiers.tick()


# =========================================================================== round trip
def test_round_trip_through_copiers_two_tensors_two_ranks(rig):
    """Two ranks, each with two KV tensors (int8 and uint8): store 3 blocks, load them into other blocks."""
    widths = (24, 40)
    slab = rig.slab(num_slots=6, row_bytes=2 * sum(widths), world_size=2)
    tiers = rig.open(slab)
    g = torch.Generator().manual_seed(2024)
    kv = {r: [torch.randint(-128, 128, (16, widths[0]), generator=g, dtype=torch.int8),
              torch.randint(0, 256, (16, widths[1]), generator=g, dtype=torch.uint8)] for r in (0, 1)}
    orig = {r: [t.clone() for t in ts] for r, ts in kv.items()}
    copiers = [rig.copier(slab, r, kv[r]) for r in (0, 1)]
    assert copiers[0].block_bytes == sum(widths)

    keys, src, dst = [A, B, C], [3, 9, 14], [0, 1, 2]
    p = tiers.prepare_store(keys)
    assert p.keys == keys and len(set(p.slots)) == 3 and p.evicted == []
    assert [tiers.lookup(k) for k in keys] == [MISS] * 3          # being stored: not offloaded yet
    for c in copiers:
        assert c.submit(1, p.token, p.seq, True, src, p.slots)
    for c in copiers:
        c.wait([1])
    res = [c.finished() for c in copiers]
    assert [[(x.job_id, x.ok, x.nbytes) for x in r] for r in res] == [[(1, True, 3 * sum(widths))]] * 2
    assert slab.done(p.seq)
    # the slab layout: rank r's tensors side by side in its half of the row
    for r in (0, 1):
        base = r * slab.rank_bytes
        for i, s in enumerate(p.slots):
            assert torch.equal(slab.rows[s, base:base + widths[0]], orig[r][0][src[i]].view(torch.uint8))
            assert torch.equal(slab.rows[s, base + widths[0]:base + sum(widths)], orig[r][1][src[i]])
    tiers.complete_store(p.keys)
    assert [tiers.lookup(k) for k in keys] == [HIT] * 3

    pl = tiers.prepare_load(keys)
    assert sorted(pl.slots) == sorted(p.slots)
    for c in copiers:
        assert c.submit(2, pl.token, pl.seq, False, dst, pl.slots)
        c.wait([2])
        assert [(x.job_id, x.ok) for x in c.finished()] == [(2, True)]
    tiers.complete_load(keys)
    for r in (0, 1):
        for t, o in zip(kv[r], orig[r]):
            assert torch.equal(t[dst], o[src]), f"rank {r}: loaded bytes differ"
            assert torch.equal(t[3:], o[3:])                     # nothing else was touched
    s = tiers.debug_sizes()
    assert (s["live_stores"], s["live_loads"], s["awaiting"], s["quarantine"]) == (0, 0, 0, 0)
    assert s["host_entries"] == s["host_used_slots"] == 3
    for c in copiers:                                # the worker side counts bytes; outcomes are the scheduler's
        assert metric(c.metrics, "tiered_kv_transfer_bytes_total", src="device", dst="host") == 3 * sum(widths)
        assert metric(c.metrics, "tiered_kv_transfer_bytes_total", src="host", dst="device") == 3 * sum(widths)
        assert metric(c.metrics, "tiered_kv_errors_total", tier="host", error="copy_failed") == 0
    assert metric(tiers.metrics, JOBS, kind="store", outcome="ok") == 1
    assert metric(tiers.metrics, JOBS, kind="load", outcome="ok") == 1
    assert stale_total(tiers.metrics) == 0


def test_store_is_published_only_when_every_rank_marked_it(rig):
    slab = rig.slab(num_slots=2, row_bytes=32, world_size=2)
    tiers = rig.open(slab)
    p = tiers.prepare_store([A])
    tiers.complete_store([A])            # the engine's report overtakes the ring
    assert tiers.lookup(A) == MISS
    tiers.tick()
    assert tiers.lookup(A) == MISS and tiers.debug_sizes()["awaiting"] == 1
    worker_store(slab, [A], p.slots, p.seq, ranks=[1])
    tiers.tick()
    assert tiers.lookup(A) == MISS       # rank 0 has not finished
    worker_store(slab, [A], p.slots, p.seq, ranks=[0])
    assert tiers.lookup(A) == MISS       # applied at the next step, not before
    tiers.tick()
    assert tiers.lookup(A) == HIT
    assert torch.equal(slot_bytes_of(tiers, A), pattern(A, "v1", 32))
    assert tiers.debug_sizes()["awaiting"] == 0 and stale_total(tiers.metrics) == 0


def test_prepare_store_skips_present_and_duplicate_keys_and_validates(rig):
    tiers = rig.open(rig.slab(num_slots=4))
    store_ready(tiers, [A])
    p = tiers.prepare_store([A, B, B, C])
    assert p.keys == [B, C] and len(set(p.slots)) == 2
    assert tiers.prepare_store([A, B]).keys == []     # A ready, B being stored
    for bad in ("str", b"", 5, None, b"x" * 2000):
        with pytest.raises(InvalidKeyError):
            tiers.prepare_store([bad])
        with pytest.raises(InvalidKeyError):
            tiers.lookup(bad)
    with pytest.raises(InvalidKeyError):
        tiers.prepare_load([B])           # not a hit: the engine must not ask for it
    assert tiers.debug_sizes()["live_stores"] == 1 and tiers.debug_sizes()["live_loads"] == 0


# =========================================================================== token races
def test_a_late_completion_of_store_cancelled_by_reset(rig):
    """(a) stale 'cancelled', never published, the slot out of the free list until the ring shows the copy done."""
    slab = rig.slab(num_slots=1, row_bytes=32)
    tiers = rig.open(slab)
    p = tiers.prepare_store([A])
    assert p.slots == [0]
    tiers.reset()
    assert tiers.debug_sizes()["quarantine"] == 1
    tiers.complete_store([A])                       # the engine reports the cancelled job
    assert metric(tiers.metrics, STALE, kind="store", reason="cancelled") == 1
    assert stale_total(tiers.metrics) == 1
    assert tiers.lookup(A) == MISS and tiers.state_of(A) == (None, None)
    for _ in range(3):
        tiers.tick()
        q = tiers.prepare_store([B])               # the only slot is still the worker's
        assert q.keys == [] and q.slots == []
    assert metric(tiers.metrics, SHED, kind="store", reason="host_full") == 3
    assert tiers.lookup(A) == MISS
    worker_store(slab, [A], p.slots, p.seq)        # the late copy lands, then the ring shows it
    assert tiers.prepare_store([B]).keys == []     # released at the next step, not before
    tiers.tick()
    assert tiers.debug_sizes()["quarantine"] == 0 and tiers.debug_sizes()["host_used_slots"] == 0
    assert tiers.lookup(A) == MISS                 # ... and still never published
    q = tiers.prepare_store([B])
    assert q.keys == [B] and q.slots == [0]
    tiers.complete_store([A])                      # one more late duplicate: stale, harmless
    assert tiers.lookup(A) == MISS
    assert stale_total(tiers.metrics) == 2


def test_b_old_jobs_late_completion_does_not_publish_the_new_job_early(rig):
    """(b) reset, the same key stored again; the OLD job's report arrives first."""
    slab = rig.slab(num_slots=2, row_bytes=32)
    tiers = rig.open(slab)
    p1 = tiers.prepare_store([A])
    tiers.reset()
    p2 = tiers.prepare_store([A])
    assert p2.keys == [A] and p2.slots != p1.slots  # the old slot is quarantined
    worker_store(slab, [A], p2.slots, None, tag="new")  # the new copy is under way, not marked
    tiers.complete_store([A])                        # the old job's late report
    assert tiers.lookup(A) == MISS
    tiers.tick()
    assert tiers.lookup(A) == MISS
    worker_store(slab, [A], p1.slots, p1.seq, tag="old")  # the old copy finishes
    tiers.tick()
    assert tiers.lookup(A) == MISS
    mark(slab, p2.seq)                               # the new copy finishes
    tiers.complete_store([A])                        # ... and is reported
    tiers.tick()
    assert tiers.lookup(A) == HIT
    got = slot_bytes_of(tiers, A)
    assert torch.equal(got, pattern(A, "new", 32)), "A served with the cancelled job's bytes"
    assert stale_total(tiers.metrics) == 1           # one of the two reports was stale
    s = tiers.debug_sizes()
    assert (s["live_stores"], s["awaiting"], s["quarantine"], s["host_used_slots"]) == (0, 0, 0, 1)


def test_b2_old_jobs_late_success_must_not_publish_the_new_jobs_failed_copy(rig):
    """BUG: a late success report of a job cancelled by reset is matched, by key set, to the new
    live job storing the same key.  The new copy then fails (the worker marks the ring anyway and
    the engine reports success=False), but that real report is discarded as stale and the new job
    is published from the old job's success: lookup says HIT for a slot that holds no copy of A."""
    slab = rig.slab(num_slots=2, row_bytes=32)
    tiers = rig.open(slab)
    tiers.prepare_store([A])
    tiers.reset()
    p2 = tiers.prepare_store([A])
    slab.rows[p2.slots[0]].fill_(0xEE)              # whatever the slot held before: not A's bytes
    tiers.complete_store([A], success=True)          # the OLD (cancelled) job's late report
    mark(slab, p2.seq, ok=False)                     # the new copy failed: the worker marks it failed
    tiers.complete_store([A], success=False)         # the engine reports the failure
    tiers.tick()
    assert tiers.lookup(A) == MISS, "a store whose copy failed was published (wrong bytes would be served)"


def test_b3_old_jobs_late_failure_costs_at_most_a_miss_never_wrong_bytes(rig):
    """The cancelled job's late *failure* report is matched, by key set, to the new live job.

    A failure reported before the rings show the copy finished cancels the job: an engine
    may report a store it never ran (its slots must not leak waiting for a mark that never
    comes).  So a stale failure can cost the new store (a miss), but never serve wrong bytes,
    never raise, and never leak the slot.  vLLM 0.32 never reports failures at all."""
    slab = rig.slab(num_slots=2, row_bytes=32)
    tiers = rig.open(slab)
    tiers.prepare_store([A])
    tiers.reset()
    p2 = tiers.prepare_store([A])
    tiers.complete_store([A], success=False)         # the OLD (cancelled) job's late report
    worker_store(slab, [A], p2.slots, p2.seq, tag="new")
    tiers.complete_store([A], success=True)          # the new job's own report: now stale
    tiers.tick()
    state = tiers.lookup(A)
    assert state in (HIT, MISS)
    if state == HIT:
        assert torch.equal(slot_bytes_of(tiers, A), pattern(A, "new", 32))
    mark(slab, 1)                                    # the old job's copy finished too
    tiers.tick()
    s = tiers.debug_sizes()
    assert (s["live_stores"], s["awaiting"], s["quarantine"]) == (0, 0, 0)
    assert s["host_used_slots"] == (1 if state == HIT else 0)


@pytest.mark.parametrize("finished_first", [0, 1])
def test_report_for_a_key_set_with_two_live_loads_completes_a_finished_one(rig, finished_first):
    """Two loads of the same key in flight, only one copy finished: a report releases that one;
    the other stays leased until its own ring entry shows it finished."""
    slab = rig.slab(num_slots=2, row_bytes=32)
    tiers = rig.open(slab)
    store_ready(tiers, [A])
    loads = [tiers.prepare_load([A]), tiers.prepare_load([A])]
    mark(slab, loads[finished_first].seq)
    tiers.complete_load([A])
    s = tiers.debug_sizes()
    assert (s["live_loads"], s["awaiting"]) == (1, 0), s
    tiers.complete_load([A])                         # the other one: reported before its ring entry
    assert tiers.debug_sizes()["awaiting"] == 1
    store_ready(tiers, [B])
    p = tiers.prepare_store([C])                     # A is leased: B is the only evictable entry
    assert p.keys == [C] and p.evicted == [B]
    assert tiers.prepare_store([D]).keys == []       # A leased, C being written: nothing to evict
    tiers.tick()
    assert tiers.debug_sizes()["awaiting"] == 1
    mark(slab, loads[1 - finished_first].seq)
    tiers.tick()
    assert tiers.debug_sizes()["awaiting"] == 0
    assert stale_total(tiers.metrics) == 0


def _snapshot(tiers: SlabScheduler) -> tuple:
    return (tiers.debug_sizes(), {k: tiers.state_of(k) for k in (A, B, C, D, E, F)})


@pytest.mark.parametrize("success", [True, False])
def test_c_unknown_and_duplicate_completions_are_counted_and_change_nothing(rig, success):
    slab = rig.slab(num_slots=4, row_bytes=32)
    tiers = rig.open(slab)
    store_ready(tiers, [A])
    tiers.complete_store([A], success)               # duplicate of a store already applied
    pb = tiers.prepare_store([B])                    # a store in flight (not reported)
    pc = tiers.prepare_store([C])
    tiers.complete_store([C])                        # reported before the ring: awaiting
    pl = tiers.prepare_load([A])                     # a load in flight
    pl2 = tiers.prepare_load([A])
    mark(slab, pl2.seq)
    tiers.complete_load([A])                         # applied (the ring-finished one is picked)
    tiers.complete_load([A])                         # second load: reported, ring not yet: awaiting
    tiers.tick()
    before = _snapshot(tiers)
    stale_before = stale_total(tiers.metrics)
    assert stale_before == 1 and metric(tiers.metrics, STALE, kind="store", reason="unknown_token") == 1

    tiers.complete_store([D], success)               # never issued
    tiers.complete_store([A, B], success)            # a key set no job has
    tiers.complete_store([], success)
    tiers.complete_store([C], success)               # duplicate of the awaiting store
    tiers.complete_load([D])
    tiers.complete_load([A, B])
    tiers.complete_load([A])                         # both loads already reported
    tiers.complete_load([])
    assert metric(tiers.metrics, STALE, kind="store", reason="unknown_token") == 5
    assert metric(tiers.metrics, STALE, kind="load", reason="unknown_token") == 4
    assert stale_total(tiers.metrics) == stale_before + 8
    assert _snapshot(tiers) == before
    tiers.tick()
    assert _snapshot(tiers) == before

    # and the jobs in flight still settle normally afterwards
    worker_store(slab, [B], pb.slots, pb.seq)
    worker_store(slab, [C], pc.slots, pc.seq)
    mark(slab, pl.seq)
    tiers.complete_store([B])
    tiers.tick()
    assert [tiers.lookup(k) for k in (A, B, C)] == [HIT, HIT, HIT]
    s = tiers.debug_sizes()
    assert (s["live_stores"], s["live_loads"], s["awaiting"], s["quarantine"]) == (0, 0, 0, 0)
    assert s["host_used_slots"] == s["host_entries"] == 3


def test_d_load_in_flight_during_reset_keeps_its_slot_until_marked(rig):
    slab = rig.slab(num_slots=2, row_bytes=32)
    tiers = rig.open(slab)
    sa, sb = store_ready(tiers, [A, B])
    pl = tiers.prepare_load([A])
    assert pl.slots == [sa]
    tiers.reset()
    assert tiers.lookup(A) == MISS and tiers.lookup(B) == MISS
    q = tiers.prepare_store([C, D])                  # B's slot is free, A's is still being read
    assert q.keys == [C] and q.slots == [sb]
    assert metric(tiers.metrics, SHED, kind="store", reason="host_full") == 1
    tiers.complete_load([A])                         # the engine reports the cancelled load
    assert metric(tiers.metrics, STALE, kind="load", reason="cancelled") == 1
    tiers.tick()
    assert tiers.prepare_store([D]).keys == []
    # the worker reads the slot only now: it still holds A's bytes
    assert torch.equal(slab.rows[sa], pattern(A, "v1", 32))
    mark(slab, pl.seq)
    tiers.tick()
    q2 = tiers.prepare_store([D])
    assert q2.keys == [D] and q2.slots == [sa]


def test_d2_load_reported_before_ring_then_reset_keeps_its_slot(rig):
    slab = rig.slab(num_slots=1, row_bytes=32)
    tiers = rig.open(slab)
    store_ready(tiers, [A])
    pl = tiers.prepare_load([A])
    tiers.complete_load([A])                         # the engine's report overtakes the ring
    tiers.reset()
    tiers.tick()
    assert tiers.prepare_store([B]).keys == []       # the copy may still be reading slot 0
    mark(slab, pl.seq)
    tiers.tick()
    assert tiers.prepare_store([B]).slots == [0]


def test_d3_store_reported_before_ring_then_reset_is_never_published(rig):
    slab = rig.slab(num_slots=1, row_bytes=32)
    tiers = rig.open(slab)
    p = tiers.prepare_store([A])
    tiers.complete_store([A])                        # reported, ring not yet: awaiting
    tiers.reset()
    tiers.tick()
    assert tiers.prepare_store([B]).keys == []       # the copy may still be writing slot 0
    worker_store(slab, [A], p.slots, p.seq)
    tiers.tick()
    assert tiers.lookup(A) == MISS and tiers.state_of(A) == (None, None)
    assert tiers.prepare_store([B]).slots == [0]


def test_prepare_store_takes_a_repeated_key_once(rig):
    slab = rig.slab(num_slots=4, row_bytes=32)
    tiers = rig.open(slab)
    p = tiers.prepare_store([A, A, B, A])
    assert p.keys == [A, B] and len(set(p.slots)) == 2
    assert tiers.debug_sizes()["host_used_slots"] == 2


@pytest.mark.parametrize("ring_first", [True, False])
def test_e_failed_store_aborts_its_keys(rig, ring_first):
    slab = rig.slab(num_slots=2, row_bytes=32)
    tiers = rig.open(slab)
    p = tiers.prepare_store([A, B])
    if ring_first:
        mark(slab, p.seq)
    tiers.complete_store([A, B], success=False)
    assert tiers.lookup(A) == MISS and tiers.lookup(B) == MISS
    assert tiers.state_of(A) == tiers.state_of(B) == (None, None)
    if not ring_first:
        # the failed copy may still be running: both slots stay out of the free list
        tiers.tick()
        assert tiers.prepare_store([C]).keys == []
        mark(slab, p.seq)
        tiers.tick()
    tiers.complete_store([A, B], success=True)       # a late duplicate cannot revive them
    tiers.tick()
    assert tiers.lookup(A) == MISS and tiers.lookup(B) == MISS
    assert stale_total(tiers.metrics) == 1
    q = tiers.prepare_store([C, D])
    assert q.keys == [C, D] and sorted(q.slots) == sorted(p.slots)
    s = tiers.debug_sizes()
    assert (s["quarantine"], s["awaiting"]) == (0, 0)
    m = tiers.metrics
    assert metric(m, JOBS, kind="store", outcome="ok") == 0
    assert metric(m, JOBS, kind="store", outcome="failed") + metric(m, JOBS, kind="store", outcome="cancelled") == 1


def test_new_tiers_on_a_used_slab_does_not_trust_old_ring_entries(rig):
    """BUG: a SlabScheduler opened over a slab whose rings already hold sequence numbers (a scheduler
    restarted while the workers keep the slab, or an attach to a slab file a crashed engine left
    behind with the same engine_id and geometry) numbers its jobs from 1 again, so the rings report
    its new jobs finished before any worker touched them: a slot quarantined by reset() is handed
    to another job while the worker may still be copying into it."""
    slab = rig.slab(num_slots=1, row_bytes=32)
    first = rig.open(slab)
    for k in (A, B, C):
        p = first.prepare_store([k])
        worker_store(slab, [k], p.slots, p.seq)
        first.complete_store([k])
        first.tick()
        first.reset()
        first.tick()
    first.close()

    tiers = rig.open(slab)
    p = tiers.prepare_store([D])
    assert p.slots == [0]
    assert not slab.done(p.seq), f"job {p.seq} reads as finished before any worker ran it"
    tiers.reset()
    tiers.tick()
    q = tiers.prepare_store([E])
    assert q.keys == [], "slot 0 handed to a new job while the cancelled store may still write it"


# =========================================================================== eviction
def test_full_slab_evicts_lru_ready_entries_never_leased_or_writing(rig):
    slab = rig.slab(num_slots=3, row_bytes=32)
    tiers = rig.open(slab)
    slots = dict(zip([A, B, C], store_ready(tiers, [A, B, C])))
    tiers.touch([A])                                 # LRU order now: B, C, A
    pl = tiers.prepare_load([B])                     # B leased to a load
    p = tiers.prepare_store([D])
    assert p.keys == [D] and p.evicted == [C] and p.slots == [slots[C]]
    assert tiers.state_of(C) == (None, None) and tiers.state_of(B)[0] == "ready"
    p2 = tiers.prepare_store([E])
    assert p2.keys == [E] and p2.evicted == [A] and p2.slots == [slots[A]]
    # B leased, D and E being written: nothing evictable
    p3 = tiers.prepare_store([F])
    assert p3.keys == [] and p3.evicted == []
    assert metric(tiers.metrics, SHED, kind="store", reason="host_full") == 1
    assert tiers.state_of(B)[0] == "ready"
    assert torch.equal(slab.rows[slots[B]], pattern(B, "v1", 32))
    mark(slab, pl.seq)
    tiers.complete_load([B])                         # B becomes evictable again
    p4 = tiers.prepare_store([F])
    assert p4.keys == [F] and p4.evicted == [B] and p4.slots == [slots[B]]
    tiers.tick()                                     # evictions are published with the step's gauges
    assert metric(tiers.metrics, "tiered_kv_evictions_total", tier="host") == 3


def test_eviction_never_takes_a_key_of_the_same_call(rig):
    slab = rig.slab(num_slots=2, row_bytes=32)
    tiers = rig.open(slab)
    store_ready(tiers, [A, B])                       # A is the LRU entry
    p = tiers.prepare_store([A, C])                  # A skipped (present) and protected
    assert p.keys == [C] and p.evicted == [B]
    assert tiers.lookup(A) == HIT


def _durable_storer(tiers: SlabScheduler, slab: SharedSlab, reported: list[bytes]) -> Callable[[bytes], None]:
    """A store of one key played through to the disk (prepare, worker copy, complete, flush), noting the
    keys each prepare_store reports evicted in ``reported``."""
    def store(k: bytes) -> None:
        p = tiers.prepare_store([k])
        assert p.keys == [k]
        reported.extend(p.evicted)
        worker_store(slab, [k], p.slots, p.seq)
        tiers.complete_store([k])
        assert tiers.flush(timeout=30)
    return store


def test_evicted_keys_reported_only_when_offloaded_nowhere(rig):
    """With the disk tier (write-through): a host eviction of a key on disk is not reported; the key
    is reported (once) when it leaves the disk too, by a later prepare_store."""
    slab = rig.slab(num_slots=2, row_bytes=256)
    tiers = rig.open(slab, disk=True, disk_blocks=2)
    assert tiers.disk is not None
    reported: list[bytes] = []
    store = _durable_storer(tiers, slab, reported)
    store(A)
    store(B)
    assert tiers.state_of(A) == tiers.state_of(B) == ("ready", "ready")
    store(C)                     # host evicts A (still on disk); C's spill evicts A from disk
    assert tiers.state_of(A) == (None, None)
    store(D)
    store(E)
    reported.extend(tiers.prepare_store([]).evicted)
    gone = [k for k in (A, B, C, D, E) if tiers.state_of(k) == (None, None)]
    assert gone == [A, B, C]
    assert reported == gone, f"keys gone from every tier {gone}, reported as evicted {reported}"
    # a host eviction whose key stays on disk is never reported, and lookup brings it back
    assert tiers.state_of(D) == ("ready", "ready")
    assert tiers.prepare_store([]).evicted == []


def test_a_host_eviction_of_a_key_the_disk_already_dropped_is_reported(rig):
    """The disk tier may drop a key first (its one block taken by a later spill) while the key stays on
    the host; the host eviction that follows is the key's last copy going, and must be reported."""
    slab = rig.slab(num_slots=2, row_bytes=256)
    tiers = rig.open(slab, disk=True, disk_blocks=1)
    reported: list[bytes] = []
    store = _durable_storer(tiers, slab, reported)
    store(A)
    store(B)                     # B's spill takes the disk's one block: A is on the host only
    assert tiers.state_of(A) == ("ready", None) and reported == []
    store(C)                     # the host evicts A, its last copy
    assert tiers.state_of(A) == (None, None)
    reported.extend(tiers.prepare_store([]).evicted)
    assert reported == [A]


def test_evicted_key_stored_again_is_reported_evicted_by_the_call_that_stores_it(rig):
    """A key gone from every tier that the engine stores again is listed as evicted by that
    prepare_store: it is in no tier until the new store publishes (which reports it stored again),
    and if that store fails, no tier holds it.  (The adapter records the stores published before
    the call first, so the events keep their order: tests/vllm_adapter/test_review_adapter.py.)"""
    slab = rig.slab(num_slots=2, row_bytes=256)
    tiers = rig.open(slab, disk=True, disk_blocks=2)

    def store(k: bytes):
        p = tiers.prepare_store([k])
        worker_store(slab, p.keys, p.slots, p.seq)
        tiers.complete_store(p.keys)
        assert tiers.flush(timeout=30)
        return p

    for k in (A, B, C):
        store(k)
    assert tiers.state_of(A) == (None, None)         # gone from both tiers, not reported yet
    p = tiers.prepare_store([A])
    assert p.keys == [A]
    assert A in p.evicted, p


# =========================================================================== disk tier
def test_spilled_blocks_survive_a_restart_and_promote_with_their_bytes(rig):
    slab = rig.slab(num_slots=4, row_bytes=256)
    first = rig.open(slab, disk=True)
    store_ready(first, [A, B], tag="disk")
    assert first.flush(timeout=30) is True
    assert first.state_of(A) == first.state_of(B) == ("ready", "ready")
    first.close()

    slab2 = rig.slab(num_slots=4, row_bytes=256, name="y.slab")   # a fresh, zeroed slab
    tiers = rig.open(slab2, disk=True)
    assert tiers.disk_blocks == 2 and tiers.host_blocks == 0
    assert tiers.lookup(A) == PENDING
    assert tiers.pending_work
    with pytest.raises(InvalidKeyError):
        tiers.prepare_load([A])                       # not a hit yet
    wait_promotes(tiers)
    assert tiers.lookup(A) == HIT
    assert tiers.lookup(B) == PENDING                # B is promoted on demand
    wait_promotes(tiers)
    assert tiers.lookup(B) == HIT
    for k in (A, B):
        assert torch.equal(slot_bytes_of(tiers, k), pattern(k, "disk", 256)), k
    m = tiers.metrics
    assert metric(m, JOBS, kind="promote", outcome="ok") == 2
    assert metric(m, "tiered_kv_lookup_hits_total", tier="disk") >= 2
    assert stale_total(m) == 0


def test_reset_tombstones_disk_entries(rig):
    slab = rig.slab(num_slots=4, row_bytes=256)
    first = rig.open(slab, disk=True)
    store_ready(first, [A, B])
    assert first.flush(timeout=30)
    assert first.state_of(A) == ("ready", "ready")
    first.reset()
    assert first.lookup(A) == MISS and first.disk_blocks == 0
    assert first.flush(timeout=30)
    first.close()
    assert raw_blocks(rig.disk) == {}

    tiers = rig.open(rig.slab(num_slots=4, row_bytes=256, name="y.slab"), disk=True)
    assert tiers.disk_blocks == 0
    assert tiers.lookup(A) == MISS and tiers.lookup(B) == MISS


def test_reset_during_a_spill_never_publishes_it(rig):
    slab = rig.slab(num_slots=4, row_bytes=256)
    first = rig.open(slab, disk=True, disk_io="thread")   # its writer gate needs the in-process writer
    assert first.disk is not None
    gate = WriterGate(block_from=1)
    first.disk.fault_hook = gate
    store_ready(first, [A])                          # its spill is queued; the writer is held
    gate.entered(1)
    first.reset()
    gate.open()
    assert first.flush(timeout=30)
    first.tick()
    assert first.debug_sizes()["disk_jobs"] == 0 and first.debug_sizes()["host_used_slots"] == 0
    first.close()
    assert lmdb_key(A) not in raw_blocks(rig.disk)
    tiers = rig.open(rig.slab(num_slots=4, row_bytes=256, name="y.slab"), disk=True)
    assert tiers.disk_blocks == 0 and tiers.lookup(A) == MISS


def test_corrupt_disk_entry_fails_the_promote_into_a_miss(rig):
    slab = rig.slab(num_slots=4, row_bytes=256)
    first = rig.open(slab, disk=True)
    store_ready(first, [A, B], tag="disk")
    assert first.flush(timeout=30)
    first.close()
    off = payload_offset(raw_blocks(rig.disk)[lmdb_key(A)])
    rewrite_value(rig.disk, A, flip(off + 17))       # one payload byte: only the checksum tells

    tiers = rig.open(rig.slab(num_slots=4, row_bytes=256, name="y.slab"), disk=True)
    assert tiers.disk_blocks == 2
    assert tiers.lookup(A) == PENDING
    wait_promotes(tiers)
    assert tiers.lookup(A) == MISS
    assert tiers.state_of(A) == (None, None)
    m = tiers.metrics
    assert metric(m, "tiered_kv_corrupt_blocks_total", reason="checksum") == 1
    assert metric(m, JOBS, kind="promote", outcome="failed") == 1
    assert tiers.debug_sizes()["host_used_slots"] == 0   # the slot went back to the free list
    # the intact neighbour still promotes, with its bytes
    assert tiers.lookup(B) == PENDING
    wait_promotes(tiers)
    assert tiers.lookup(B) == HIT
    assert torch.equal(slot_bytes_of(tiers, B), pattern(B, "disk", 256))
    assert tiers.flush(timeout=30)
    tiers.close()
    assert lmdb_key(A) not in raw_blocks(rig.disk)   # the corrupt entry was deleted


def test_reset_during_a_promote_never_publishes_it(rig):
    slab = rig.slab(num_slots=4, row_bytes=256)
    first = rig.open(slab, disk=True)
    store_ready(first, [A], tag="disk")
    assert first.flush(timeout=30)
    first.close()
    tiers = rig.open(rig.slab(num_slots=4, row_bytes=256, name="y.slab"), disk=True)
    assert tiers.lookup(A) == PENDING
    tiers.reset()
    wait_promotes(tiers)
    assert tiers.lookup(A) == MISS and tiers.state_of(A) == (None, None)
    s = tiers.debug_sizes()
    assert (s["disk_jobs"], s["host_used_slots"], s["disk_entries"]) == (0, 0, 0)


# =========================================================================== SlabCopier
def _kv(rows: int, width: int, seed: int, dtype=torch.uint8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-128, 128) if dtype is torch.int8 else (0, 256)
    return torch.randint(lo, hi, (rows, width), generator=g, dtype=dtype)


class _SignalingQueue:
    """Wraps the copier's result queue: ``on_block()`` runs whenever the owner blocks in ``get``."""

    def __init__(self, q, on_block) -> None:
        self._q, self._on_block = q, on_block

    def put(self, item) -> None:
        self._q.put(item)

    def get_nowait(self):
        return self._q.get_nowait()

    def get(self, block: bool = True, timeout: Optional[float] = None):
        self._on_block()
        return self._q.get(block, timeout)


def test_copier_wait_returns_only_after_the_jobs_are_done(rig):
    slab = rig.slab(num_slots=4, row_bytes=32)
    kv = _kv(8, 32, seed=5)
    copier = rig.copier(slab, 0, [kv])
    log: list[str] = []
    release = threading.Event()
    entered = threading.Event()
    waiting = threading.Event()
    real_mark = slab.mark_done

    def gated_mark(rank: int, seq: int, ok: bool = True) -> None:       # runs on the copy thread, after the copies
        entered.set()
        assert release.wait(30), "test never released the copy thread"
        log.append(f"marked {seq}")
        real_mark(rank, seq, ok)

    slab.mark_done = gated_mark                        # type: ignore[method-assign]
    copier._done = _SignalingQueue(copier._done, waiting.set)

    def releaser() -> None:
        assert waiting.wait(30) and entered.wait(30)   # the owner blocks in wait(), the copy is held
        log.append("release")
        release.set()

    th = threading.Thread(target=releaser, daemon=True)
    assert copier.submit(1, b"t" * 16, 11, True, [2, 5], [0, 3])
    assert copier.in_flight == 1
    th.start()
    copier.wait([1], timeout=60)
    log.append("wait returned")
    th.join(30)
    assert log == ["release", "marked 11", "wait returned"]
    assert slab.done(11)
    res = copier.finished()
    assert [(r.job_id, r.ok, r.nbytes) for r in res] == [(1, True, 64)]
    assert torch.equal(slab.rows[[0, 3]], kv[[2, 5]])
    assert copier.in_flight == 0 and copier.finished() == []


def _gate_marks(slab: SharedSlab, hold: Callable[[int], bool] = lambda seq: True) -> threading.Event:
    """Hold the copy thread before it marks a held ``seq`` done (after its copies); returns the release."""
    release = threading.Event()
    real_mark = slab.mark_done

    def gated_mark(rank: int, seq: int, ok: bool = True) -> None:     # runs on the copy thread
        if hold(seq):
            assert release.wait(30), "test never released the copy thread"
        real_mark(rank, seq, ok)

    slab.mark_done = gated_mark                        # type: ignore[method-assign]
    return release


def test_copier_wait_keeps_other_results_and_honours_timeout(rig):
    slab = rig.slab(num_slots=4, row_bytes=16)
    kv = _kv(8, 16, seed=6)
    copier = rig.copier(slab, 0, [kv])
    release = _gate_marks(slab, hold=lambda seq: seq == 3)
    copier.submit(10, b"a" * 16, 1, True, [0], [0])
    copier.submit(20, b"b" * 16, 2, True, [1], [1])
    copier.submit(30, b"c" * 16, 3, True, [2], [2])
    copier.wait([20])                                  # 10 finishes first: kept for finished()
    copier.wait([999])                                 # unknown job: returns at once
    copier.wait([30], timeout=0.05)                    # held: returns at the timeout, nothing lost
    assert not slab.done(3)
    release.set()
    copier.wait([30])
    assert [r.job_id for r in copier.finished()] == [10, 20, 30]
    assert all(slab.done(s) for s in (1, 2, 3))
    copier.wait([10, 20, 30])                          # all reported already: returns at once
    assert copier.finished() == []


def test_copier_failure_is_reported_counted_and_the_thread_keeps_serving(rig):
    slab = rig.slab(num_slots=4, row_bytes=32)
    kv = _kv(8, 32, seed=7)
    copier = rig.copier(slab, 0, [kv])
    copier.submit(1, b"1" * 16, 1, True, [99], [0])       # device block out of range
    copier.submit(2, b"2" * 16, 2, True, [1], [7])        # slab slot out of range
    copier.submit(3, b"3" * 16, 3, False, [0], [42])      # load from a slot out of range
    copier.submit(4, b"4" * 16, 4, True, [6], [1])        # fine
    copier.submit(5, b"5" * 16, 5, False, [3], [1])       # fine: block 3 <- slot 1 (block 6's bytes)
    copier.wait([1, 2, 3, 4, 5])
    res = {r.job_id: r.ok for r in copier.finished()}
    assert res == {1: False, 2: False, 3: False, 4: True, 5: True}
    assert all(slab.done(s) for s in range(1, 6))         # failed jobs are marked too: slots can be reused
    assert torch.equal(slab.rows[1], kv[6]) and torch.equal(kv[3], kv[6])
    assert int(slab.rows[0].sum()) == 0                    # the failed store wrote nothing
    m = copier.metrics
    # the failed stores on the host tier, the failed load on the device's (as TierManager counts them)
    assert metric(m, "tiered_kv_errors_total", tier="host", error="copy_failed") == 2
    assert metric(m, "tiered_kv_errors_total", tier="device", error="copy_failed") == 1
    assert metric(m, "tiered_kv_transfer_bytes_total", src="device", dst="host") == 32   # the ok store only
    assert metric(m, "tiered_kv_transfer_bytes_total", src="host", dst="device") == 32   # the ok load only


def test_copier_duplicate_token_counted_and_close_is_clean(rig):
    slab = rig.slab(num_slots=2, row_bytes=16)
    kv = _kv(4, 16, seed=8)
    copier = rig.copier(slab, 0, [kv])
    release = _gate_marks(slab, lambda seq: seq == 1)   # job 1 stays in flight
    assert copier.submit(1, b"x" * 16, 1, True, [0], [0])
    assert copier.submit(2, b"x" * 16, 2, True, [1], [1])   # same token while in flight: counted, never copied,
    assert metric(copier.metrics, STALE, kind="store", reason="unknown_token") == 1   # answered failed
    assert copier.in_flight == 1
    assert slab.done(2) and not slab.ok(2)
    release.set()
    copier.close()                                     # finishes queued copies, then stops
    copier.close()
    assert copier.submit(3, b"y" * 16, 3, True, [2], [0]) is False
    assert [(r.job_id, r.ok) for r in copier.finished()] == [(2, False), (1, True)]
    assert copier.finished() == []
    copier.wait([1, 3])                                # nothing in flight: returns
    assert slab.done(1) and slab.ok(1)
    assert torch.equal(slab.rows[1], torch.zeros(16, dtype=torch.uint8))   # job 2's slot: never written


def test_copier_rejects_bad_configuration(rig):
    slab = rig.slab(num_slots=2, row_bytes=32, world_size=2)
    ok = _kv(4, 16, seed=1)
    for rank in (-1, 2):
        with pytest.raises(ConfigError, match="rank"):
            SlabCopier(slab, rank, [ok], metrics=Metrics(registry=CollectorRegistry()))
    for bad in (torch.zeros(4, 16, dtype=torch.float16), torch.zeros(64, dtype=torch.uint8),
                torch.zeros(2, 4, 4, dtype=torch.uint8)):
        with pytest.raises(ConfigError, match="KV tensor 0"):
            SlabCopier(slab, 0, [bad], metrics=Metrics(registry=CollectorRegistry()))
    with pytest.raises(ConfigError, match="16"):
        SlabCopier(slab, 1, [ok, _kv(4, 1, seed=2)], metrics=Metrics(registry=CollectorRegistry()))
    c = rig.copier(slab, 1, [ok])
    with pytest.raises(ConfigError, match="blocks_per_chunk"):
        c.submit(1, b"z" * 16, 1, True, [0, 1], [0])
    assert c.in_flight == 0


# =========================================================================== state machine
KEYS = [b"sm-%d" % i for i in range(5)]
FOREIGN = [b"zz-%d" % i for i in range(3)]        # never stored: reports for them match nothing
SLOTS, WORLD, ROW = 3, 2, 16                 # fewer slots than keys: evictions and host_full sheds
RB = ROW // WORLD


class _WJob:
    """The fake worker's (and engine's) view of one job SlabScheduler prepared."""

    def __init__(self, n: int, kind: str, keys: list[bytes], slots: list[int], seq: int, fail: bool) -> None:
        self.n, self.kind, self.keys, self.slots, self.seq, self.fail = n, kind, keys, slots, seq, fail
        self.marked: set[int] = set()
        self.reports = 0
        self.expect: dict[bytes, "_WJob"] = {}     # loads: key -> the store job whose bytes it must read

    @property
    def copied(self) -> bool:
        return len(self.marked) == WORLD

    def __repr__(self) -> str:
        return (f"{self.kind}#{self.n}(seq={self.seq}, keys={[k.decode() for k in self.keys]}, slots={self.slots}, "
                f"marked={sorted(self.marked)}, reports={self.reports}, fail={self.fail})")


def _pat(key: bytes, n: int) -> torch.Tensor:
    return pattern(key, f"job{n}", ROW)


class SlabSchedulerMachine(RuleBasedStateMachine):
    """SlabScheduler with a fake worker that copies per rank out of order and an engine that reports
    in any order, early, late (after reset), twice, or for key sets nobody stored.

    Checked: a load copies exactly the bytes the store job that published the key wrote
    (per-job byte patterns, checked when the load is prepared and when its copy runs); no slot is
    used by two jobs whose copies have not finished (unless both only read it); a HIT never
    outlives a reset nor precedes its copy; no exception escapes; debug_sizes() stay bounded, and
    once every job is copied and reported everything settles with no leaked slot.
    """

    COPY_FAILURES = False
    RESET_GATE = 3      # a reset rule resets when it draws go >= RESET_GATE (of 0..3)

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="tkv-slab-sm-"))
        self.slab = SharedSlab.open(self.dir / "m.slab", SLOTS, ROW, WORLD, ring_size=4096)
        self.metrics = Metrics(registry=CollectorRegistry(), namespace="t")
        self.tiers = SlabScheduler(TieredKVConfig(namespace="t", host_capacity_bytes=SLOTS * ROW), self.slab,
                               metrics=self.metrics)
        self.jobs: list[_WJob] = []
        self.latest: dict[bytes, _WJob] = {}      # key -> the store job whose bytes a HIT must serve
        self.n = 0

    # -- helpers -------------------------------------------------------------
    def _new_job(self, kind: str, keys: list[bytes], slots: list[int], seq: int, fail: bool) -> _WJob:
        assert len(slots) == len(keys) and len(set(slots)) == len(slots), (keys, slots)
        assert all(0 <= s < SLOTS for s in slots), slots
        for other in self.jobs:
            if other.copied:
                continue
            shared = set(slots) & set(other.slots)
            assert not shared or (kind == "load" and other.kind == "load"), \
                f"slot(s) {shared} given to a new {kind} while {other} still copies"
        self.n += 1
        job = _WJob(self.n, kind, keys, slots, seq, fail)
        self.jobs.append(job)
        return job

    def _check_hit(self, k: bytes) -> _WJob:
        j = self.latest.get(k)
        assert j is not None, f"{k!r} is a HIT but no store of it since the last reset (or it was evicted)"
        assert j.copied, f"{k!r} is a HIT before its store {j} finished copying"
        assert not j.fail, f"{k!r} is a HIT although its store {j} failed"
        return j

    # -- rules ---------------------------------------------------------------
    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=2), fail=st.integers(0, 3))
    def store(self, keys: list[bytes], fail: int) -> None:
        p = self.tiers.prepare_store(keys)
        assert len(p.keys) == len(set(p.keys)) and set(p.keys) <= set(keys)
        for k in p.evicted:
            assert k not in p.keys and self.tiers.state_of(k) == (None, None), k
            self.latest.pop(k, None)
        if p.keys:
            job = self._new_job("store", p.keys, p.slots, p.seq, self.COPY_FAILURES and fail == 0)
            for k in p.keys:
                self.latest[k] = job

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=2), fail=st.integers(0, 3))
    def store_copied_and_reported(self, keys: list[bytes], fail: int) -> None:
        """The common case in one step: prepare, every rank copies, the engine reports."""
        n = len(self.jobs)
        self.store(keys, fail)
        if len(self.jobs) > n:
            job = self.jobs[-1]
            self._copy_all(job)
            self._report(job)

    def _copy(self, job: _WJob, r: int) -> None:
        part = slice(r * RB, (r + 1) * RB)
        for k, s in zip(job.keys, job.slots):
            if job.kind == "store":
                src = torch.full((ROW,), 0xEE, dtype=torch.uint8) if job.fail else _pat(k, job.n)
                self.slab.rows[s, part] = src[part]    # a failed copy leaves garbage behind
            else:
                want = _pat(k, job.expect[k].n)[part]
                assert torch.equal(self.slab.rows[s, part], want), \
                    f"{job} read slot {s} rank {r}: not the bytes of {job.expect[k]}"
        self.slab.mark_done(r, job.seq, not job.fail)   # a worker records its failed copy as failed
        job.marked.add(r)

    def _copy_all(self, job: _WJob) -> None:
        for r in sorted(set(range(WORLD)) - job.marked):
            self._copy(job, r)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
    def load(self, keys: list[bytes]) -> None:
        hits = [k for k in keys if self.tiers.lookup(k) == HIT]
        if not hits:
            return
        expect = {k: self._check_hit(k) for k in hits}
        pl = self.tiers.prepare_load(hits)
        job = self._new_job("load", hits, pl.slots, pl.seq, False)
        job.expect = expect
        for k, s in zip(hits, pl.slots):
            assert torch.equal(self.slab.rows[s], _pat(k, expect[k].n)), \
                f"load of {k!r} from slot {s}: not the bytes of {expect[k]}"

    @rule(k=st.sampled_from(KEYS))
    def lookup(self, k: bytes) -> None:
        r = self.tiers.lookup(k)
        assert r in (HIT, MISS)                      # no disk tier: never pending
        if r == HIT:
            self._check_hit(k)
            assert self.tiers.state_of(k) == ("ready", None)

    @precondition(lambda self: any(not j.copied for j in self.jobs))
    @rule(data=st.data())
    def worker_copies(self, data) -> None:
        """One rank runs one job (any job, any rank: out of order), then marks it in its ring."""
        job = data.draw(st.sampled_from([j for j in self.jobs if not j.copied]), label="job")
        r = data.draw(st.sampled_from(sorted(set(range(WORLD)) - job.marked)), label="rank")
        self._copy(job, r)

    @precondition(lambda self: any(j.reports == 0 for j in self.jobs))
    @rule(data=st.data())
    def engine_reports(self, data) -> None:
        """The engine reports a job (any order; maybe before its copies; maybe cancelled by reset)."""
        job = data.draw(st.sampled_from([j for j in self.jobs if j.reports == 0]), label="job")
        self._report(job)

    @precondition(lambda self: any(j.reports for j in self.jobs))
    @rule(data=st.data())
    def engine_reports_again(self, data) -> None:
        job = data.draw(st.sampled_from([j for j in self.jobs if j.reports]), label="job")
        self._report(job)

    def _report(self, job: _WJob) -> None:
        job.reports += 1
        if job.kind == "store" and job.fail:
            # reports are matched by key set: this failure may land on a newer live store of the
            # same keys and cancel it (a miss, never wrong bytes): that store may now be lost
            for k in job.keys:
                other = self.latest.get(k)
                if other is not None and other is not job and other.keys == job.keys:
                    other.maybe_lost = True
        if job.kind == "store":
            self.tiers.complete_store(list(job.keys), success=not job.fail)
        else:
            self.tiers.complete_load(list(job.keys))

    @rule(kind=st.sampled_from(["store", "load"]), keys=st.lists(st.sampled_from(FOREIGN), max_size=2),
          success=st.booleans())
    def engine_reports_unknown(self, kind: str, keys: list[bytes], success: bool) -> None:
        before = metric(self.metrics, STALE, kind=kind, reason="unknown_token")
        if kind == "store":
            self.tiers.complete_store(keys, success)
        else:
            self.tiers.complete_load(keys)
        assert metric(self.metrics, STALE, kind=kind, reason="unknown_token") == before + 1

    @rule(go=st.integers(0, 3))
    def reset_cache(self, go: int) -> None:
        if go >= self.RESET_GATE:                    # rarer than other steps: let state build up
            self.reset()

    def reset(self) -> None:
        ready = {k for k in KEYS if "ready" in self.tiers.state_of(k)}
        self.tiers.take_evicted()
        self.tiers.reset()
        gone = self.tiers.take_evicted()   # what vLLM's KV events are told at the reset: every block it held
        assert sorted(gone) == sorted(ready), (gone, ready)
        self.latest.clear()
        for k in KEYS:
            assert self.tiers.lookup(k) == MISS

    @precondition(lambda self: any(j.kind == "store" and j.reports == 0 for j in self.jobs))
    @rule(fails=st.lists(st.integers(0, 3), min_size=3, max_size=3), go=st.integers(0, 3))
    def reset_then_store_the_same_blocks_again(self, fails: list[int], go: int) -> None:
        """What an engine does after reset_cache: the running requests recompute and store the same
        blocks again while the cancelled stores' copies and reports are still on their way."""
        if go < self.RESET_GATE:
            return
        again = [list(j.keys) for j in self.jobs if j.kind == "store" and j.reports == 0][:3]
        self.reset()
        for keys, fail in zip(again, fails):
            self.store(keys, fail)

    @rule()
    def tick(self) -> None:
        self.tiers.tick()
        s = self.tiers.debug_sizes()
        # the in-flight gauges come from counters kept alongside the job tables: they must agree.  As under
        # TierManager, a job is in flight until its copies are known to be over: live, awaiting its rings,
        # or quarantined after a reset
        unsettled = self.tiers._awaiting + self.tiers._quarantine
        for kind, live in (("store", s["live_stores"]), ("load", s["live_loads"])):
            n = live + sum(1 for j in unsettled if j.kind.value == kind)
            assert metric(self.metrics, "tiered_kv_jobs_in_flight", kind=kind) == n, (kind, s)
        assert metric(self.metrics, "tiered_kv_tier_blocks", tier="host") == s["host_entries"], s
        unfinished = [j for j in self.jobs if not j.copied]
        assert s["quarantine"] + s["awaiting"] <= len(unfinished), (s, unfinished)

    @rule()
    def settle(self) -> None:
        """Every rank copies every job, the engine reports every job not reported yet, one step."""
        for job in self.jobs:
            self._copy_all(job)
        for job in self.jobs:
            if job.reports == 0:
                self._report(job)
        self.tiers.tick()
        s = self.tiers.debug_sizes()
        assert (s["live_stores"], s["live_loads"], s["quarantine"], s["awaiting"], s["disk_jobs"]) == (0, 0, 0, 0, 0), s
        assert s["host_used_slots"] == s["host_entries"], f"leaked slots: {s}"
        for k in KEYS:
            state = self.tiers.state_of(k)
            assert state in ((None, None), ("ready", None)), (k, state)
            j = self.latest.get(k)
            expected = HIT if j is not None and not j.fail else MISS
            got = self.tiers.lookup(k)
            if expected == HIT and got == MISS and getattr(j, "maybe_lost", False):
                continue  # cancelled by an older job's late failure report (see _report)
            assert got == expected, (k, j)
        # the settled jobs need no more checks; keep the list short
        self.jobs = []

    # -- invariants ------------------------------------------------------------
    @invariant()
    def bounded(self) -> None:
        s = self.tiers.debug_sizes()
        assert s["host_entries"] <= s["host_used_slots"] <= SLOTS, s
        live_model = sum(1 for j in self.jobs if j.reports == 0)
        assert s["live_stores"] + s["live_loads"] <= live_model, (s, self.jobs)
        assert s["disk_jobs"] == 0 and s["disk_entries"] == 0

    def teardown(self) -> None:
        try:
            if sys.exc_info()[0] is None:   # the run did not fail: finally everything must settle
                self.settle()
        finally:
            self._close()

    def _close(self) -> None:
        try:
            self.tiers.close()
        finally:
            self.slab.close()
            shutil.rmtree(self.dir, ignore_errors=True)


class SlabSchedulerMachineWithCopyFailures(SlabSchedulerMachine):
    """The same, with store copies that fail on the worker (garbage left in the slot, ring marked,
    the engine reports success=False)."""

    COPY_FAILURES = True
    RESET_GATE = 0      # reset often: the reset/re-store/late-report interleavings are the point here


_SM_SETTINGS = sm_settings(
    150, 40,
    report_multiple_bugs=False,
    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),  # no slow "explain"
)
SlabSchedulerMachine.TestCase.settings = _SM_SETTINGS
SlabSchedulerMachineWithCopyFailures.TestCase.settings = _SM_SETTINGS
test_slab_tiers_state_machine = SlabSchedulerMachine.TestCase
test_slab_tiers_state_machine_with_copy_failures = SlabSchedulerMachineWithCopyFailures.TestCase


class _WriterDies(BaseException):
    """Raised in the writer thread: not an Exception, so the thread ends (a dying writer)."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_flush_answers_at_once_without_a_disk_tier_and_false_once_the_writer_died(rig):
    """``flush()`` through the scheduler front end: True at once with no disk tier (nothing to make
    durable), False once the disk writer died (nothing queued will be written)."""
    host_only = rig.open(rig.slab(name="h.slab"))
    assert host_only.disk is None and host_only.flush(timeout=0) is True
    slab = rig.slab(num_slots=4, row_bytes=256)
    tiers = rig.open(slab, disk=True, disk_io="thread")   # it kills the in-process writer
    assert tiers.disk is not None
    tiers.disk.fault_hook = WriterGate(block_from=None, raise_at={1: _WriterDies("writer killed")})
    p = tiers.prepare_store([A])
    worker_store(slab, [A], p.slots, p.seq)
    tiers.complete_store([A])                  # published, its spill (write-through) kills the writer
    tiers.disk.writer._thread.join(30)
    assert not tiers.disk.writer_alive()
    tiers.tick()                               # its failed spill is applied: this flush covers no failure
    assert tiers.flush(timeout=5) is False


def test_published_keys_are_collected_only_when_asked(rig):
    """``collect_published=True`` (vLLM's KV-cache events on): every key a store made READY is handed
    out once by ``take_published()``, in the order published; without it nothing is collected."""
    slab = rig.slab(num_slots=4, row_bytes=64)
    cfg = TieredKVConfig(namespace="t", host_capacity_bytes=4 * 64)
    tiers = SlabScheduler(cfg, slab, metrics=Metrics(registry=CollectorRegistry(), namespace="t"),
                          collect_published=True)
    rig.tiers.append(tiers)
    p = tiers.prepare_store([A, B])
    worker_store(slab, [A, B], p.slots, p.seq)
    tiers.complete_store([A, B])
    tiers.tick()
    assert tiers.take_published() == [A, B] and tiers.take_published() == []
    other_slab = rig.slab(name="o.slab")
    other = rig.open(other_slab)
    q = other.prepare_store([C])
    worker_store(other_slab, [C], q.slots, q.seq)
    other.complete_store([C])
    other.tick()
    assert other.take_published() == []


def test_evicting_ahead_as_many_blocks_as_the_host_tier_holds_is_refused(rig):
    """The core refuses ``host_evict_ahead_blocks`` not below the host tier's slots, naming both (the
    scheduler front end has no check of its own; the vLLM spec checks before its workers start)."""
    slab = rig.slab(num_slots=4, row_bytes=64)
    with pytest.raises(ConfigError, match=r"^host_evict_ahead_blocks=4 must be below the host tier's 4 slots "
                                          r"\(host_capacity_bytes=256 / 64-byte blocks\)$"):
        rig.open(slab, host_evict_ahead_blocks=4)
    assert rig.open(slab, host_evict_ahead_blocks=3).core.evict_ahead == 3
