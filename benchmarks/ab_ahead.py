"""A/B of the work poll() does for the next engine step, in one process.

``poll()`` evicts host blocks ahead (``host_evict_ahead_blocks``) and refills a pool of
tokens, so that ``store()`` takes a free slot and a ready token instead of evicting and
building a UUID in the engine's call; and it starts the copies the step's calls queued
(``copy_batch_max``), so that no copy thread is woken while the engine makes them.  This runs
section 2's engine loop (``store()`` x16, ``poll()``, a 10 ms "forward pass"; the host tier
full, so every store needs a slot) on two managers over the same device rows, segments
alternating, the default configuration against one without the piece ``--compare`` names:

* ``--compare ahead``: ``inline`` = ``host_evict_ahead_blocks=0`` and no token pool;
* ``--compare batch``: ``inline`` = ``copy_batch_max=1`` (each copy handed to a worker in its store).

``--mover thread`` (default) copies on the CPU mover's two worker threads, as section 2;
``--mover none`` answers each store at the next poll without copying (the call's own cost).
Prints, per side, us: ``store()`` p50/p99, the first ``store()`` of each step (p50), ``poll()``
p50/p99, and the engine thread's time in the library per step (stores + poll, mean): what
moves from ``store()`` into ``poll()`` shows up in the last column.

    python benchmarks/ab_ahead.py --segments 8 --mover thread --compare ahead
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys

import torch

from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.benchmarking.common import summarize
from tiered_kv.benchmarking.core import DeferredMover, _keys, _latency_loop

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--segments", type=int, default=8, help="timed segments per side (alternating)")
    ap.add_argument("--steps", type=int, default=60, help="engine steps per segment")
    ap.add_argument("--rows", type=int, default=512, help="device rows = host slots")
    ap.add_argument("--row-mib", type=float, default=2.0)
    ap.add_argument("--per-step", type=int, default=16)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--mover", choices=("thread", "none"), default="thread")
    ap.add_argument("--compare", choices=("ahead", "batch"), default="ahead")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    row_bytes = int(a.row_mib * MiB) if a.mover == "thread" else 64
    kv = torch.empty((a.rows, row_bytes), dtype=torch.uint8)
    kv.copy_((torch.arange(a.rows) % 251).to(torch.uint8).unsqueeze(1).expand(a.rows, row_bytes))
    factory = DeferredMover if a.mover == "none" else None
    cfg = TieredKVConfig(namespace="ab|u8|ahead", host_capacity_bytes=a.rows * row_bytes)
    if a.compare == "ahead":
        sides = {"ahead": TierManager(cfg, kv, mover_factory=factory),
                 "inline": TierManager(cfg.replace(host_evict_ahead_blocks=0), kv, mover_factory=factory)}
        sides["inline"]._refill_tokens = lambda: None  # type: ignore[method-assign]  # no token pool either
    else:
        sides = {"ahead": TierManager(cfg, kv, mover_factory=factory),
                 "inline": TierManager(cfg.replace(copy_batch_max=1), kv, mover_factory=factory)}
    rng = random.Random(a.seed)
    step_s = a.step_ms / 1e3
    got: dict[str, dict[str, list[int]]] = {n: {"ok": [], "none": [], "poll": [], "first": []} for n in sides}
    for name, mgr in sides.items():  # warm-up: the tier full and evicting, slab faulted in
        _latency_loop(mgr.store, mgr.poll, _keys(rng, 2 * a.rows), 0, a.rows, a.per_step, step_s, [], [], [])
        mgr.wait()
    n = a.steps * a.per_step
    for seg in range(a.segments):
        keys = _keys(rng, n)
        for name in (("ahead", "inline") if seg % 2 == 0 else ("inline", "ahead")):
            mgr, g = sides[name], got[name]
            gc.collect()
            _latency_loop(mgr.store, mgr.poll, keys, seg * n, a.rows, a.per_step, step_s,
                          g["ok"], g["none"], g["poll"], g["first"])
            mgr.wait()
    what = "evicting and making tokens ahead" if a.compare == "ahead" else "copies started at poll()"
    print(f"A/B of {what} ('ahead' = default, 'inline' = without): {a.segments} segments x {a.steps} steps x {a.per_step} "
          f"stores, {row_bytes} B rows, host tier {a.rows} slots (full), mover {a.mover}, step {a.step_ms} ms")
    print(f"{'side':8s} {'store p50':>10s} {'store p99':>10s} {'first p50':>10s} {'poll p50':>9s} {'poll p99':>9s} "
          f"{'per step':>9s}   (us)")
    for name, g in got.items():
        st = summarize([x / 1e3 for x in g["ok"] + g["none"]], "us")
        po = summarize([x / 1e3 for x in g["poll"]], "us")
        per_step = (st["mean"] * st["n"] + po["mean"] * po["n"]) / po["n"]
        print(f"{name:8s} {st['median']:10.1f} {st['p99']:10.1f} "
              f"{statistics.median(x / 1e3 for x in g['first']):10.1f} {po['median']:9.1f} "
              f"{po['p99']:9.1f} {per_step:9.1f}   stores returning None: {len(g['none'])}")
    for mgr in sides.values():
        mgr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
