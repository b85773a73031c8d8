"""Soak: many store/cancel/free cycles with the real ThreadMover leave memory flat.

Job records and tombstones are dropped once the worker's report has arrived,
so debug_sizes() stays bounded and the memory traced by tracemalloc does not
grow with the number of cycles: the growth over the second half of the run is
compared with a small absolute allowance (a leak of even a few bytes per cycle
exceeds it).

``TIERED_KV_SOAK_CYCLES`` sets the number of cycles of test_soak_memory_is_flat
(default 60,000: about 15 s on 2 cores); test_soak_one_million_cycles runs only
when it is set to 1000000 (or more).

test_disk_soak_collects_tombstones_and_stays_flat runs the same kind of churn over a disk tier (a
``disk_path`` under ``tmp_path``, host and disk tiers small enough that both evict all the time),
with unique keys, cancels, freed rows and invalidations, one of them per cycle of a spill the writer
has queued but not committed: its tomb is made durable, and collected once the write is prevented.
A writer gate (a ``DiskStore.fault_hook`` that holds the writer at the transaction of one chosen
spill) orders the writer against the engine without sleeps, so the tombstone count is seen to go up
to exactly 1 and back to 0 in every cycle.  ``TIERED_KV_DISK_SOAK_CYCLES`` sets its cycles (default
DISK_DEFAULT_CYCLES, a few seconds on 2 cores).
"""

from __future__ import annotations

import gc
import hashlib
import os
import random
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry

from fakes import fill_row, make_config, make_kv, mgr_metric
from tiered_kv import TierManager
from tiered_kv.disk.records import Spill

ROWS = 64
STORE_ROWS = 48
HOST_SLOTS = 32
MAX_INFLIGHT = 4096
DEFAULT_CYCLES = 60_000
CYCLES = int(os.environ.get("TIERED_KV_SOAK_CYCLES", DEFAULT_CYCLES))
# allowed growth of traced memory over the second half of the run, bytes
ALLOWANCE = 256 << 10


def _settle(mgr: TierManager) -> int:
    """Wait until every job is reported: the memory samples then compare like states.  On a loaded machine
    the copy workers fall behind the churn, and the jobs in flight at a sample (up to the loop's limit of
    512, some hundreds of kilobytes with their reports) would read as growth."""
    n = 0
    while mgr.jobs_in_flight:
        n += len(mgr.wait(timeout=5))
    return n + len(mgr.poll())


def soak(cycles: int, checkpoints: int = 20) -> dict:
    """Run ``cycles`` store/cancel/free cycles; return sizes and traced memory."""
    kv = make_kv(ROWS, seed=42)
    for r in range(ROWS):
        fill_row(kv, r, b"row-content-%d" % r)
    reg = CollectorRegistry()
    mgr = TierManager(make_config(host_slots=HOST_SLOTS, max_inflight_jobs=MAX_INFLIGHT), kv, registry=reg)
    warmup = min(max(cycles // 10, 1000), 20_000)
    total = warmup + cycles
    every = max(cycles // checkpoints, 1)
    samples: list[tuple[int, int]] = []
    max_sizes: dict[str, int] = {}
    reported = 0
    issued = 0
    recent_ok: list[bytes] = []
    t0 = time.perf_counter()
    traced_from = None
    try:
        for i in range(total):
            if i == warmup:
                gc.collect()
                tracemalloc.start()
                traced_from = i
                t_traced = time.perf_counter()
            row = i % STORE_ROWS
            key = b"soak/%d" % i
            job = mgr.store(key, row)
            if job is not None:
                issued += 1
            what = i % 8
            if job is not None:
                if what in (0, 1, 2):
                    mgr.cancel(job)                    # abort mid-store
                elif what in (3, 4):
                    mgr.free_block(row)                # preemption: the row is reused
                elif what == 5:
                    mgr.invalidate(key)                # superseded
                else:
                    recent_ok.append(key)              # let it complete
                    if len(recent_ok) > 8:
                        recent_ok.pop(0)
            if what == 7 and recent_ok:                # an occasional prefix hit, aborted half the time
                lr = STORE_ROWS + (i // 8) % (ROWS - STORE_ROWS)  # loads land in rows no store reads
                lj = mgr.load(recent_ok[0], lr) if mgr.free_block(lr) else None
                if lj is not None:
                    issued += 1
                    if i % 16 == 7:
                        mgr.free_block(lr)
            reported += len(mgr.poll())
            if mgr.jobs_in_flight > 512:               # the engine would slow down too
                while mgr.jobs_in_flight > 64:
                    reported += len(mgr.wait(timeout=0.01))
                    time.sleep(0)
            if traced_from is not None and (i - traced_from) % every == 0:
                for k, v in mgr.debug_sizes().items():
                    max_sizes[k] = max(max_sizes.get(k, 0), v)
                reported += _settle(mgr)   # each sample at rest: a backlog is not a leak
                samples.append((i - traced_from, tracemalloc.get_traced_memory()[0]))
        reported += _settle(mgr)
        current, peak = tracemalloc.get_traced_memory()
        samples.append((cycles, current))
        elapsed = time.perf_counter() - t0
        traced_elapsed = time.perf_counter() - t_traced
    finally:
        tracemalloc.stop()
        mgr.close()
    final_sizes = mgr.debug_sizes()
    return dict(cycles=cycles, warmup=warmup, seconds=elapsed, traced_seconds=traced_elapsed,
                cycles_per_s=cycles / traced_elapsed, samples=samples, current=current, peak=peak,
                max_sizes=max_sizes, final_sizes=final_sizes, issued=issued, reported=reported)


def _check(res: dict) -> None:
    samples = res["samples"]
    mid = samples[len(samples) // 2][1]
    start = samples[0][1]
    end = samples[-1][1]
    first_half, second_half = mid - start, end - mid
    report = (f"soak {res['cycles']} cycles in {res['traced_seconds']:.1f}s traced ({res['cycles_per_s']:.0f} cycles/s); "
              f"traced memory start={start} mid={mid} end={end} peak={res['peak']} "
              f"(growth 1st half {first_half:+d} B, 2nd half {second_half:+d} B); max sizes {res['max_sizes']}; "
              f"final sizes {res['final_sizes']}")
    print(report, file=sys.stderr)
    s = res["max_sizes"]
    assert s["jobs"] <= 600, report
    assert s["deliver"] <= s["jobs"] or s["deliver"] <= 600, report
    assert s["outbox"] == 0, report
    assert s["row_stores"] <= ROWS and s["row_load"] <= ROWS and s["key_loads"] <= ROWS, report
    assert s["host_entries"] <= HOST_SLOTS and s["host_used_slots"] <= HOST_SLOTS, report
    assert second_half < ALLOWANCE, f"traced memory keeps growing: {report}"
    assert end - start < 2 * ALLOWANCE, f"traced memory keeps growing: {report}"
    f = res["final_sizes"]
    assert f["jobs"] == f["deliver"] == f["row_stores"] == f["row_load"] == f["key_loads"] == 0, report
    assert f["host_used_slots"] == f["host_entries"], report


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_soak_memory_is_flat():
    """Store/cancel/free/invalidate/load churn on the host tier leaves traced memory and every internal
    table flat (no per-job leak) and nothing in flight at the end."""
    _check(soak(CYCLES))


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.skipif(CYCLES < 1_000_000, reason="set TIERED_KV_SOAK_CYCLES=1000000 to run the million-cycle soak")
def test_soak_one_million_cycles():
    """The host-tier soak at a million cycles (opt-in): still flat."""
    res = soak(CYCLES, checkpoints=50)
    _check(res)
    assert res["cycles"] >= 1_000_000


# ============================================================================ with a disk tier
DISK_DEFAULT_CYCLES = 1000
DISK_CYCLES = int(os.environ.get("TIERED_KV_DISK_SOAK_CYCLES", DISK_DEFAULT_CYCLES))
DISK_HOST_SLOTS = 8
DISK_BLOCKS = 16          # disk capacity in blocks: every cycle's spill evicts an older entry once full
DISK_ROWS = 8
# allowed growth over the second half of the run: traced memory (a leak of 64 bytes per cycle exceeds
# it at the default size), and the tier directory's apparent bytes (a few LMDB pages)
DISK_ALLOWANCE = 32 << 10
DIR_ALLOWANCE = 64 << 10
# traced blocks this large are counted apart: CPython's small-object allocator callocs a block of its own
# bookkeeping (0.4-4 MiB, once) when its arenas reach a new address range -- seen after about a thousand
# cycles of this soak, and in a bare LMDB loop -- which is a step, not a leak; a leak is many small blocks
BIG_BLOCK = 128 << 10
MAX_BIG_BLOCKS = 4


class SpillGate:
    """A ``DiskStore.fault_hook``: holds the writer thread at the start of the write transaction that
    carries the spill of one chosen key (every other transaction passes), until released.

    The writer takes one op per transaction here (``writer_batch_blocks=1``), so holding it at a
    spill's transaction orders everything queued behind that spill after the test's next step.
    """

    def __init__(self, writer: Any, max_hold: float = 60.0) -> None:
        self._writer = writer          # the hook reads the batch the writer is committing (Writer._batch)
        self._cond = threading.Condition()
        self._key: Optional[bytes] = None
        self._held: Optional[bytes] = None
        self.max_hold = max_hold

    def __call__(self, point: str) -> None:
        batch = self._writer._batch
        with self._cond:
            key = self._key
            if key is None or not any(type(op) is Spill and op.key == key for op in batch):
                return
            self._held = key
            self._cond.notify_all()
            deadline = time.monotonic() + self.max_hold
            while self._held is not None and self._key == key:
                left = deadline - time.monotonic()
                if left <= 0:
                    break   # never hang a test run: let the writer go (the test's checks then fail)
                self._cond.wait(left)

    def hold(self, key: Optional[bytes]) -> None:
        """Hold the writer at ``key``'s spill from now on (None: hold nothing); releases what is held."""
        with self._cond:
            self._key, self._held = key, None
            self._cond.notify_all()

    def wait_held(self, key: bytes, timeout: float = 30.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._held == key, timeout):
                raise AssertionError(f"the writer never reached the spill of {key!r}")


def _traced() -> tuple[int, int]:
    """Traced bytes in blocks under BIG_BLOCK, and how many blocks are at least that large."""
    small = big = 0
    for t in tracemalloc.take_snapshot().traces:
        if t.size >= BIG_BLOCK:
            big += 1
        else:
            small += t.size
    return small, big


def _dir_bytes(path: Path) -> int:
    """Apparent size of every file of the tier directory."""
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def _block(key: bytes, nbytes: int) -> bytes:
    """Block bytes derived from the key, computed afresh (fakes.content caches every key it saw: with
    unique keys that cache would be the leak this soak measures)."""
    out = b""
    while len(out) < nbytes:
        out += hashlib.blake2b(key + b"/%d" % len(out), digest_size=64).digest()
    return out[:nbytes]


def _fill(kv: Any, row: int, key: bytes) -> None:
    """The engine computes block ``key`` into device row ``row``."""
    u8 = kv[row].view(-1).view(torch.uint8)
    u8.copy_(torch.frombuffer(bytearray(_block(key, u8.numel())), dtype=torch.uint8))


def _holds(kv: Any, row: int, key: bytes) -> bool:
    u8 = kv[row].view(-1).view(torch.uint8)
    return bytes(u8.numpy()) == _block(key, u8.numel())


def _stored(mgr: TierManager, kv: Any, key: bytes, row: int) -> None:
    """The engine computes ``key`` into ``row`` and stores it; the store is reported ok."""
    assert mgr.free_block(row)
    _fill(kv, row, key)
    job = mgr.store(key, row)
    assert job is not None, f"store of {key!r} not started"
    done = [c for c in mgr.wait([job], timeout=30) if c.job is job]
    assert len(done) == 1 and done[0].ok, done


def disk_soak(cycles: int, path: Path, checkpoints: int = 10) -> dict:
    """Run ``cycles`` cycles over a host+disk tier at ``path``; return sizes, traced memory, directory
    sizes and tombstone counts (see test_disk_soak_collects_tombstones_and_stays_flat)."""
    kv = make_kv(DISK_ROWS, seed=43)
    cfg = make_config(host_slots=DISK_HOST_SLOTS, disk_path=path, disk_capacity_bytes=DISK_BLOCKS * 128,
                      writer_batch_blocks=1, writer_batch_seconds=0.0, durability="none", max_inflight_jobs=64)
    mgr = TierManager(cfg, kv, registry=CollectorRegistry())
    assert mgr.disk is not None and mgr.disk_healthy
    tombs = mgr.disk.tombs                  # tiered_kv/disk/tombs.py's in-memory sets: renamed -> fails here
    assert isinstance(tombs.cancelled, set) and isinstance(tombs.unsettled, set)
    gate = SpillGate(mgr.disk.writer)
    mgr.disk.fault_hook = gate
    warmup = max(cycles // 10, 2 * DISK_BLOCKS)
    total = warmup + cycles
    every = max(cycles // checkpoints, 1)
    samples: list[tuple[int, int, int, int]] = []   # (cycle, traced small-block bytes, big blocks, directory bytes)
    max_sizes: dict[str, int] = {}
    tombs_up = tombs_down = loads_ok = 0
    rng = random.Random(20261202)
    try:
        for i in range(total):
            if i == warmup:
                gc.collect()
                tracemalloc.start()
            hold, victim, cancelled, freed = (b"disk-soak/%d/%s" % (i, w) for w in (b"h", b"v", b"c", b"f"))
            # 1. the writer takes this cycle's first spill and is held there
            gate.hold(hold)
            _stored(mgr, kv, hold, 0)
            gate.wait_held(hold)
            # 2. a second spill queues behind it; invalidated now, its tomb guards a write still to come
            _stored(mgr, kv, victim, 1)
            mgr.invalidate(victim)
            # 3. a store cancelled, a store whose row is freed: neither ever reaches the disk
            assert mgr.free_block(2)
            _fill(kv, 2, cancelled)
            job = mgr.store(cancelled, 2)
            assert job is not None
            mgr.cancel(job)
            assert mgr.free_block(3)
            _fill(kv, 3, freed)
            job2 = mgr.store(freed, 3)
            assert job2 is not None
            assert mgr.free_block(3)
            # 4. every third cycle an older key is invalidated once committed (a token-matched delete, no
            #    durable tomb), so both tiers fill up and evict; and an older key is loaded, from the
            #    host or read back from disk (a promote, and its recency touch for the writer)
            if i >= 2 and i % 3 == 0:
                gone = b"disk-soak/%d/h" % (i - 2)
                mgr.invalidate(gone)
                assert mgr.lookup([gone]) == 0
            if i >= 3:
                old = b"disk-soak/%d/h" % rng.randrange(max(0, i - 3 * DISK_BLOCKS), i - 2)
                row = 4 + i % 4
                if mgr.free_block(row) and (lj := mgr.load(old, row)) is not None:
                    got = [c for c in mgr.wait([lj], timeout=30) if c.job is lj]
                    assert len(got) == 1, got
                    if got[0].ok:
                        loads_ok += 1
                        assert _holds(kv, row, old), f"load of {old!r}: wrong bytes"
            # 5. the writer commits the held spill and the tomb (queued in front), and is held at the
            #    victim's spill: the tomb is durable now -- the count went up
            gate.hold(victim)
            gate.wait_held(victim)
            sizes = mgr.debug_sizes()
            n = sizes["disk_tombstones"]
            assert n == 1, f"cycle {i}: {n} durable tombstones while the victim's spill is queued, expected 1"
            tombs_up += 1
            for k, v in sizes.items():
                max_sizes[k] = max(max_sizes.get(k, 0), v)
            # 6. the victim's write is prevented and its tomb collected: back to 0
            gate.hold(None)
            assert mgr.flush(timeout=30) is True
            mgr.poll()
            sizes = mgr.debug_sizes()
            assert sizes["disk_tombstones"] == 0, f"cycle {i}: tomb not collected: {sizes}"
            tombs_down += 1
            assert not tombs.cancelled and not tombs.unsettled, (i, len(tombs.cancelled), len(tombs.unsettled))
            assert mgr.lookup([victim]) == 0 and mgr.lookup([cancelled]) == 0 and mgr.lookup([freed]) == 0
            for k, v in sizes.items():
                max_sizes[k] = max(max_sizes.get(k, 0), v)
            if i >= warmup and (i - warmup) % every == 0:
                samples.append((i - warmup, *_traced(), _dir_bytes(path)))
        samples.append((cycles, *_traced(), _dir_bytes(path)))
        prevented = mgr_metric(mgr, "tiered_kv_orphaned_writes_prevented_total")
        spill_shed = sum(mgr_metric(mgr, "tiered_kv_shed_total", kind="spill", reason=r)
                         for r in ("backpressure", "disk_full", "disk_down"))
        evicted = (mgr_metric(mgr, "tiered_kv_evictions_total", tier="host"),
                   mgr_metric(mgr, "tiered_kv_evictions_total", tier="disk"))
    finally:
        tracemalloc.stop()
        gate.hold(None)
        mgr.close()
    return dict(cycles=cycles, total=total, samples=samples, max_sizes=max_sizes, final_sizes=mgr.debug_sizes(),
                tombs_up=tombs_up, tombs_down=tombs_down, prevented=prevented, spill_shed=spill_shed,
                evicted=evicted, loads_ok=loads_ok)


@pytest.mark.disk_threads
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_disk_soak_collects_tombstones_and_stays_flat(tmp_path):
    """Guards invariants 6 and 7 over a long run with a disk tier: durable tombstones are written for
    cancelled queued spills and collected (the count goes up to 1 and back to 0 in every cycle, every
    guarded write is prevented, none is left on disk at close); the in-memory tomb sets, every internal
    table, the traced memory and the tier directory's size stay flat while both tiers evict."""
    res = disk_soak(DISK_CYCLES, tmp_path / "disk")
    samples = res["samples"]
    mem = [m for _, m, _, _ in samples]
    big = [b for _, _, b, _ in samples]
    dirs = [d for _, _, _, d in samples]
    mid = len(samples) // 2
    report = (f"disk soak {res['cycles']} cycles (+{res['total'] - res['cycles']} warm-up): traced memory "
              f"{mem[0]} -> {mem[mid]} -> {mem[-1]} (+ big blocks {big}); tier dir bytes {dirs}; max sizes {res['max_sizes']}; "
              f"tombs up {res['tombs_up']} down {res['tombs_down']}; prevented {res['prevented']:.0f}; "
              f"evictions host/disk {res['evicted']}; spills shed {res['spill_shed']:.0f}; loads ok {res['loads_ok']}")
    print(report, file=sys.stderr)
    s = res["max_sizes"]
    assert res["tombs_up"] == res["tombs_down"] == res["total"], report
    assert res["prevented"] == res["total"], f"every victim's write is prevented: {report}"
    assert res["spill_shed"] == 0, report
    assert res["evicted"][0] > 0 and res["evicted"][1] > 0, f"both tiers must evict: {report}"
    assert res["loads_ok"] > 0, report
    assert s["disk_tombstones"] == 1 and s["flushes"] == 0 and s["outbox"] == 0 and s["deliver"] <= 2, report
    assert s["jobs"] <= 8 and s["row_stores"] <= DISK_ROWS and s["row_load"] <= DISK_ROWS, report
    assert s["host_entries"] <= DISK_HOST_SLOTS and s["disk_entries"] <= DISK_BLOCKS, report
    assert mem[-1] - mem[mid] < DISK_ALLOWANCE, f"traced memory keeps growing: {report}"
    assert max(big) <= MAX_BIG_BLOCKS, f"large traced blocks keep appearing: {report}"
    assert max(dirs[mid:]) - dirs[mid] <= DIR_ALLOWANCE, f"the tier directory keeps growing: {report}"
    f = res["final_sizes"]
    assert f["jobs"] == f["deliver"] == f["row_stores"] == f["row_load"] == f["key_loads"] == 0, report
    from disk_helpers import raw_tombs
    assert raw_tombs(tmp_path / "disk") == {}, "durable tombs left on disk after close"
