"""A/B of when a load() from disk hands its read to a disk reader, in one process.

``TierManager.load()`` of a key only on disk holds its read in the owner thread
(``DiskStore.queue_promote``) and the next ``poll()``/``wait()`` hands the step's reads to
the readers as one batch (``start_reads``).  The other side, ``at_once``, is the behaviour
before: each ``load()`` puts its read on the readers' queue itself (``submit_promote``),
waking a reader inside the engine's call.  Both sides use one manager on one disk tier;
the side is switched between steps (latency) or rounds (throughput), alternating.

* ``latency``: each step sleeps ``--step-ms`` (the engine's forward pass), then one
  ``load()`` of a key only on disk (timed), ``lookup()`` of it and ``poll()``, then
  ``wait()`` so that the next step starts with nothing in flight.  Prints ``load()``
  p50/p90/p99 per side, us.
* ``throughput``: ``load()`` of every key of a working set only on disk, then ``wait()``;
  page cache dropped first (``--cold``, needs root; else the slot file is read once
  before, warm).  Prints GB/s per side (median over rounds).

    python benchmarks/ab_held_reads.py --steps 800 --rounds 7 --block-kib 256
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.benchmarking import disk as bd
from tiered_kv.benchmarking.common import summarize

MiB, KiB = 1 << 20, 1 << 10
SIDES = ("held", "at_once")


def _side(mgr: TierManager, side: str) -> None:
    disk: Any = mgr.disk
    if side == "held":
        disk.__dict__.pop("queue_promote", None)       # the class's method: hold until start_reads()
    else:
        disk.queue_promote = disk.submit_promote       # the behaviour before: queue for a reader at once


def latency(base: Path, block: int, steps: int, step_ms: float, seed: int) -> None:
    rows = 64
    blocks = bd.Blocks(block, rows, seed)
    keys = bd._keys(random.Random(seed + 1), "lat", steps)

    def open_(host_blocks: int) -> TierManager:
        cfg = TieredKVConfig(namespace=f"ab-held|{block}", host_capacity_bytes=host_blocks * block,
                             disk_path=str(base / "lat"), disk_capacity_bytes=2 * steps * block)
        return TierManager(cfg, blocks.dev, registry=CollectorRegistry())

    mgr = open_(rows)
    bd._spill_loop(mgr, keys, [i % rows for i in range(steps)], 256)
    mgr.close()
    mgr = open_(256)                    # reopened: every key only on disk
    got: dict[str, list[float]] = {s: [] for s in SIDES}
    bad = 0
    try:
        for i, k in enumerate(keys):
            side = SIDES[(i // 2) % 2]
            _side(mgr, side)
            time.sleep(step_ms / 1e3)
            t0 = time.perf_counter_ns()
            job = mgr.load(k, i % rows)
            t1 = time.perf_counter_ns()
            mgr.lookup([k])
            mgr.poll()
            done = mgr.wait(timeout=60)
            bad += job is None or not all(c.ok for c in done)
            if i >= 20:
                got[side].append((t1 - t0) / 1e3)
    finally:
        mgr.close()
    print(f"load() of a key only on disk after a {step_ms:g} ms pause, {bd._size(block)} blocks, us:")
    for side, xs in got.items():
        d = summarize(xs, "us")
        print(f"  {side:8s} n={d['n']:4d}  p50 {d['median']:7.1f}  p90 {d['p90']:7.1f}  p99 {d['p99']:7.1f}")
    print(f"  loads not ok: {bad}")


def throughput(base: Path, block: int, rounds: int, set_mib: int, cold: bool, seed: int) -> None:
    n = max(2, set_mib * MiB // block)
    blocks = bd.Blocks(block, n, seed)
    rng = random.Random(seed + 2)
    n_sets = 2 * len(SIDES) + 1
    sets = [bd._keys(rng, f"tp{s}", n) for s in range(n_sets)]
    cfg = TieredKVConfig(namespace=f"ab-held|{block}", host_capacity_bytes=n * block, disk_path=str(base / "tp"),
                         disk_capacity_bytes=(n_sets + 2) * n * block)
    mgr = TierManager(cfg, blocks.dev[:n].clone(), registry=CollectorRegistry())
    got: dict[str, list[float]] = {s: [] for s in SIDES}
    dropped: list[bool] = []
    bad = 0
    try:
        bd._touch_host_slab(mgr)
        for ks in sets:      # each set pushes the one before out of the host tier (it holds one set)
            bd._spill_loop(mgr, ks, list(range(n)), 256)
        k = 0
        for r in range(rounds + 1):
            for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                _side(mgr, side)
                ks = sets[k % (n_sets - 1)]     # never the set still in the host tier
                k += 1
                if cold:
                    dropped.append(bd.drop_caches())
                else:
                    bd._read_through(base / "tp" / bd.SLOTS_NAME)
                t0 = time.perf_counter()
                jobs = [mgr.load(key, i) for i, key in enumerate(ks)]
                done = mgr.wait(timeout=120)
                dt = time.perf_counter() - t0
                bad += sum(j is None for j in jobs) + sum(not c.ok for c in done)
                if r:            # round 0 warms both sides up
                    got[side].append(n * block / dt / 1e9)
    finally:
        mgr.close()
    state = "page cache dropped" if cold else "page cache warm"
    if cold and not all(dropped):
        state = "page cache NOT dropped (needs root): warm"
    print(f"load() of {n} keys only on disk then wait(), {bd._size(block)} blocks, {state}, GB/s:")
    for side, xs in got.items():
        print(f"  {side:8s} median {statistics.median(xs):5.2f}  rounds {' '.join(f'{x:.2f}' for x in xs)}")
    print(f"  loads not ok: {bad}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-kib", type=int, default=256)
    ap.add_argument("--steps", type=int, default=800, help="latency: steps (one load each); 0 skips it")
    ap.add_argument("--step-ms", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=7, help="throughput: timed rounds per side; 0 skips it")
    ap.add_argument("--set-mib", type=int, default=64, help="throughput: working set per round")
    ap.add_argument("--warm", action="store_true", help="throughput with the page cache warm (default: dropped)")
    ap.add_argument("--dir", type=Path, default=None, help="parent of the scratch directory")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    block = a.block_kib * KiB
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        if a.steps:
            latency(Path(d), block, a.steps, a.step_ms, a.seed)
        if a.rounds:
            throughput(Path(d), block, a.rounds, a.set_mib, not a.warm, a.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
