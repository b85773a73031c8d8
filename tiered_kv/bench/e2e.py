"""End to end: the demo's simulated serving engine with no offload, host only, and host+disk.

Owns one measurement, ``bench_e2e``: :func:`tiered_kv.tools.demo.run_workload`
for a fixed number of engine steps with the same seed in each mode (so each
mode sees the same arrival process until completions, which depend on timing,
make the runs diverge), repeated with seeds ``seed, seed+1, ...`` and the
modes' order rotated each repeat.  Reported per mode: prefix hit rate,
recompute avoided (tokens loaded instead of recomputed), tokens recomputed
per token needed, and engine steps per second.  The baseline of every figure
is the no-offload run of the same seed.  Nothing here is a timing target.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Callable, Optional, Union

from prometheus_client import CollectorRegistry

from tiered_kv.tools.demo import WorkloadConfig, run_workload

from .common import as_mode, summarize

__all__ = ["bench_e2e", "MODES", "PLANS"]

MODES = (("none", "no offload"), ("host", "host only"), ("disk", "host+disk"))

PLANS: dict[str, dict[str, int]] = {
    "full": {"steps": 3000, "repeats": 3},
    "quick": {"steps": 600, "repeats": 1},
    "smoke": {"steps": 60, "repeats": 1},
}

_KEEP = ("steps", "requests_started", "requests_finished", "requests_aborted", "preemptions", "lookup_keys",
         "lookup_hits", "loads_ok", "loads_failed", "loads_cancelled", "corrupt_loads", "stores_ok",
         "blocks_computed", "blocks_needed", "errors", "tier_errors", "hits_by_tier", "bytes_by_link",
         "stale_callbacks", "orphaned_writes_prevented", "shed", "prefix_hit_rate", "recompute_avoided_tokens",
         "recompute_tokens", "tokens_per_block", "block_bytes", "seconds")


def _one(offload: str, steps: int, seed: int) -> dict[str, Any]:
    cfg = WorkloadConfig(seconds=None, steps=steps, seed=seed, offload=offload)
    gc.collect()
    t0 = time.perf_counter()
    s = run_workload(cfg, registry=CollectorRegistry())
    wall = time.perf_counter() - t0
    out = {k: s[k] for k in _KEEP if k in s}
    needed = max(1, s["blocks_needed"])
    loop = s["loop_seconds"]   # the steps alone: not the manager's start (slab, disk tier) or its drain and close
    out.update(wall_seconds=wall, loop_seconds=loop, steps_per_s=s["steps"] / loop if loop > 0 else float("nan"),
               recomputed_fraction=s["blocks_computed"] / needed)
    return out


def bench_e2e(quick: Union[bool, str] = False, seed: int = 0, steps: Optional[int] = None,
              repeats: Optional[int] = None, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The demo workload in each offload mode, same seed per repeat; figures per mode and their medians."""
    plan = PLANS[as_mode(quick)]
    steps = steps or plan["steps"]
    repeats = repeats or plan["repeats"]
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m, _ in MODES}
    for rep in range(repeats):
        order = list(MODES[rep % len(MODES):] + MODES[:rep % len(MODES)])
        for mode, label in order:
            log(f"e2e repeat {rep + 1}/{repeats}: {label}, {steps} steps, seed {seed + rep}")
            runs[mode].append(_one(mode, steps, seed + rep))
    modes: dict[str, Any] = {}
    for mode, label in MODES:
        rs = runs[mode]
        modes[mode] = {
            "label": label,
            "prefix_hit_rate": summarize([r["prefix_hit_rate"] for r in rs], "fraction"),
            "recompute_avoided_tokens": summarize([r["recompute_avoided_tokens"] for r in rs], "tokens"),
            "recompute_tokens": summarize([r["recompute_tokens"] for r in rs], "tokens"),
            "recomputed_fraction": summarize([r["recomputed_fraction"] for r in rs], "fraction"),
            "steps_per_s": summarize([r["steps_per_s"] for r in rs], "steps/s"),
            "corrupt_loads": sum(r["corrupt_loads"] for r in rs),
            "errors": sum(r["errors"] + r.get("tier_errors", 0) for r in rs),
            "runs": rs,
        }
    return {
        "section": "e2e",
        "steps_per_run": steps,
        "repeats": repeats,
        "seeds": [seed + r for r in range(repeats)],
        "method": ("tiered_kv.tools.demo.run_workload(WorkloadConfig(offload=MODE, steps=N, seed=S)) with the demo's "
                   "defaults (96 device rows, 160 host slots, 4096 disk blocks, 32 KiB blocks of 16 tokens); the "
                   "three modes run with the same seed, order rotated each repeat; medians over repeats.  Hit rate = "
                   "leading keys found in a lower tier / keys looked up; recompute avoided = loaded blocks x 16 tokens."),
        "modes": modes,
    }
