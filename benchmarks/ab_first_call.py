"""A/B of the engine thread's calls after a pause: a git revision of ``tiered_kv`` against the working tree.

On a shared VM the first calls after a pause (the engine's forward pass) run about ten times
slower than warm ones (docs/benchmarks.md), and they set the p99 of ``store()`` and ``lookup()``.
This imports the revision as ``tiered_kv_base`` beside the tree (as ``ab_lifecycles.py``) and runs
one engine loop on a manager of each, steps alternating: sleep ``--pause-ms``, ``lookup()`` of 8
keys (4 stored a step ago, then a miss), ``--per-step`` ``store()`` calls, ``poll()``.  No copies
run (each store is answered at the next poll) and the host tier is full, so every step's stores
need slots.  Prints us per call: ``lookup()`` (the first call after the pause), the first
``store()``, the other stores, ``poll()``, and the engine thread's time per step (all calls).

    python benchmarks/ab_first_call.py c90c8e8 --steps 600
"""

from __future__ import annotations

import argparse
import gc
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_lifecycles import _import_revision  # noqa: E402
from tiered_kv.benchmarking.common import percentile  # noqa: E402

ROW_BYTES = 64


def _manager(pkg: Any, slots: int) -> Any:
    """A manager of that revision on its own DeferredMover (answers at the next poll, copies nothing)."""
    mover = importlib.import_module(pkg.__name__ + ".benchmarking.core").DeferredMover
    cfg = pkg.TieredKVConfig(namespace="bench|u8|ab-first", host_capacity_bytes=slots * ROW_BYTES)
    return pkg.TierManager(cfg, torch.zeros((1024, ROW_BYTES), dtype=torch.uint8), mover_factory=mover)


def _pct(xs: list[float], q: float) -> float:
    return percentile(sorted(xs), 100 * q)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", help="the git revision to compare the working tree with (e.g. c90c8e8)")
    ap.add_argument("--steps", type=int, default=600, help="timed steps per side")
    ap.add_argument("--per-step", type=int, default=16)
    ap.add_argument("--pause-ms", type=float, default=10.0)
    ap.add_argument("--slots", type=int, default=512)
    args = ap.parse_args(argv)
    import tiered_kv
    clock = time.perf_counter_ns
    with tempfile.TemporaryDirectory(prefix="tkv-ab-") as tmp:
        pkgs = {"base": _import_revision(args.rev, Path(tmp)), "head": tiered_kv}
        mgrs = {side: _manager(pkg, args.slots) for side, pkg in pkgs.items()}
        got: dict[str, dict[str, list[float]]] = {s: {"lookup": [], "first": [], "rest": [], "poll": [], "step": []}
                                                  for s in mgrs}
        n = {s: 0 for s in mgrs}
        warmup = 2 * args.slots // args.per_step + 8   # the tier fills and starts evicting
        gc.disable()  # a collection would land in one side's call: leave it to the pause
        try:
            for step in range(warmup + args.steps):
                for side in (("base", "head") if step % 2 == 0 else ("head", "base")):
                    mgr, g, i0 = mgrs[side], got[side], n[side]
                    keys = [b"ab:%s:%09d" % (side.encode(), i0 + j) for j in range(args.per_step)]
                    probe = [b"ab:%s:%09d" % (side.encode(), max(0, i0 - 1 - j)) for j in range(4)] + [b"miss"] * 4
                    gc.collect()
                    time.sleep(args.pause_ms / 1e3)
                    t = [clock()]
                    hits = mgr.lookup(probe)
                    t.append(clock())
                    for j, k in enumerate(keys):
                        if mgr.store(k, (i0 + j) % 1024) is None:
                            raise SystemExit(f"{side}: store of a new key returned None")
                        t.append(clock())
                    mgr.poll()
                    t.append(clock())
                    n[side] += args.per_step
                    if step < warmup:
                        continue
                    if i0 and hits != 4:
                        raise SystemExit(f"{side}: lookup found {hits} of the 4 keys stored a step ago")
                    d = [(b - a) / 1e3 for a, b in zip(t, t[1:])]
                    g["lookup"].append(d[0])
                    g["first"].append(d[1])
                    g["rest"].extend(d[2:-1])
                    g["poll"].append(d[-1])
                    g["step"].append(sum(d))
        finally:
            gc.enable()
        for m in mgrs.values():
            m.close()
    print(f"us per call, {args.steps} steps per side, alternating; each step: sleep {args.pause_ms} ms, lookup() "
          f"of 8 keys, {args.per_step} store(), poll(); host tier {args.slots} slots, full; base = {args.rev}, "
          f"head = working tree")
    print(f"{'side':5s} {'lookup p50/p99':>15s} {'1st store p50/p99':>18s} {'stores 2.. p50/p99':>19s} "
          f"{'all stores p99':>15s} {'poll p50':>9s} {'per step':>9s}")
    for side, g in got.items():
        stores = g["first"] + g["rest"]
        print(f"{side:5s} {statistics.median(g['lookup']):7.1f}/{_pct(g['lookup'], .99):<7.1f} "
              f"{statistics.median(g['first']):9.1f}/{_pct(g['first'], .99):<8.1f} "
              f"{statistics.median(g['rest']):9.2f}/{_pct(g['rest'], .99):<9.1f} {_pct(stores, .99):15.1f} "
              f"{statistics.median(g['poll']):9.1f} {statistics.mean(g['step']):9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
