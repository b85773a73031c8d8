"""A/B of the job-lifecycle loop: a git revision of ``tiered_kv`` against the working tree, in one process.

Machine-to-machine and minute-to-minute noise on a shared VM is larger than most single changes to
the control path, so two separate ``tiered-kv bench`` runs cannot show them. This script imports
the old revision as ``tiered_kv_base`` (extracted with ``git archive`` into a temporary directory)
beside the working tree's ``tiered_kv`` and runs the section-1 loop (``_run_lifecycles``, the
``ImmediateMover`` stand-in, a full host tier) on both, interleaved repeat by repeat, and prints CPU
microseconds per lifecycle (median, best) and the median of the paired differences.

    python benchmarks/ab_lifecycles.py 29b7018 --repeats 31
"""

from __future__ import annotations

import argparse
import gc
import importlib
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from tiered_kv.benchmarking.core import _LC_ROW_BYTES, _LC_ROWS, _LC_SLOTS, _keys, _run_lifecycles

ROOT = Path(__file__).resolve().parent.parent


def _import_revision(rev: str, into: Path) -> Any:
    """``tiered_kv`` as of ``rev``, importable as ``tiered_kv_base`` (its imports are relative)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "tiered_kv"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    shutil.move(str(into / "tiered_kv"), str(into / "tiered_kv_base"))
    sys.path.insert(0, str(into))
    return importlib.import_module("tiered_kv_base")


def _manager(pkg: Any) -> Any:
    movers = importlib.import_module(pkg.__name__ + ".movers")

    class Immediate:  # benchmarking.core.ImmediateMover, built on that revision's Report
        polled = False

        def __init__(self, device_rows: torch.Tensor, host_rows: torch.Tensor, completions: Any) -> None:
            self._put, self._n = completions.put, int(host_rows.shape[1])

        def submit(self, t: Any) -> None:
            self._put(movers.Report(t.token, t.kind, True, None, self._n, 0.0))

        def harvest(self) -> None:
            return None

        def close(self) -> None:
            return None

    cfg = pkg.TieredKVConfig(namespace="bench|u8|ab", host_capacity_bytes=_LC_SLOTS * _LC_ROW_BYTES)
    return pkg.TierManager(cfg, torch.zeros((_LC_ROWS, _LC_ROW_BYTES), dtype=torch.uint8), mover_factory=Immediate)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", help="the git revision to compare the working tree with (e.g. HEAD~3)")
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("-n", type=int, default=3000, help="lifecycles per repeat")
    args = ap.parse_args()
    import tiered_kv
    with tempfile.TemporaryDirectory(prefix="tkv-ab-") as tmp:
        base = _import_revision(args.rev, Path(tmp))
        rng = random.Random(1)
        blocks = [i % _LC_ROWS for i in range(args.n)]
        print(f"CPU us per lifecycle, {args.repeats} interleaved repeats of {args.n} (first discarded); "
              f"base = {args.rev}, head = working tree")
        for cancel in (False, True):
            for batch in (1, 32):
                mgrs = {"base": _manager(base), "head": _manager(tiered_kv)}
                us: dict[str, list[float]] = {"base": [], "head": []}
                for rep in range(args.repeats + 1):
                    keys = _keys(rng, args.n)
                    for side in (("base", "head") if rep % 2 == 0 else ("head", "base")):
                        gc.collect()
                        _, cpu, done, shed = _run_lifecycles(mgrs[side], keys, blocks, batch, cancel)
                        if done != args.n or shed:
                            raise SystemExit(f"{side}: {done} completions for {args.n} stores, {shed} shed")
                        if rep:
                            us[side].append(cpu / args.n * 1e6)
                for m in mgrs.values():
                    m.close()
                saved = statistics.median(b - h for b, h in zip(us["base"], us["head"]))
                mb, mh = statistics.median(us["base"]), statistics.median(us["head"])
                print(f"  {'store->cancel->late report' if cancel else 'store->report'}, poll every {batch:>2}: "
                      f"base {mb:6.2f} (best {min(us['base']):6.2f})  head {mh:6.2f} (best {min(us['head']):6.2f})"
                      f"  paired saving {saved:5.2f} us  -> head {1e6 / mh:,.0f}/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
