"""The owner's page-cache reads (``disk_read_cached_in_wait``) on and off, side by side in one run.

    .venv/bin/python benchmarks/cached_reads_ab.py promote [--mode full|quick|smoke] [--rounds 2]
    .venv/bin/python benchmarks/cached_reads_ab.py cold [--block-kib 256] [--mib 64] [--rounds 9]

``promote``: ``tiered-kv bench``'s promote section (its loads of keys only on disk, batched and one at
a time, warm and cold, each beside its raw ``pread`` + ``copy_``), run with the option on and off in
turn, ``--rounds`` times each; prints each run's ratios, one line per figure.

``cold``: one set of blocks written once, then loaded (``load()`` each, one ``wait()``) by a new
manager each time right after ``drop_caches``, with the option on, off, and on with the owner's read
replaced by one that reads nothing (what the path costs when it serves nothing), interleaved; GB/s
per round and the median.  Needs root for ``/proc/sys/vm/drop_caches``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tiered_kv import TieredKVConfig, TierManager  # noqa: E402
from tiered_kv.disk import cached  # noqa: E402


def _forced(flag: bool) -> Any:
    """TierManager.__init__ with every manager's ``disk_read_cached_in_wait`` set to ``flag``."""
    orig = TierManager.__init__

    def init(self: TierManager, config: TieredKVConfig, *a: Any, **k: Any) -> None:
        orig(self, dataclasses.replace(config, disk_read_cached_in_wait=flag), *a, **k)
    return orig, init


def promote(mode: str, rounds: int) -> None:
    from tiered_kv.bench import disk

    rows: dict[str, dict[str, list[str]]] = {}
    for r in range(rounds):
        for flag in ((True, False) if r % 2 == 0 else (False, True)):
            orig, init = _forced(flag)
            TierManager.__init__ = init   # type: ignore[method-assign]
            try:
                res = disk.run_all(quick=mode, sections=["promote"])
            finally:
                TierManager.__init__ = orig   # type: ignore[method-assign]
            for p in res["promote"]:
                size = f"{p['block_bytes'] >> 10} KiB"
                for name, value in _figures(p):
                    rows.setdefault(f"{size}: {name}", {"on": [], "off": []})["on" if flag else "off"].append(value)
    print(f"promote section, mode {mode}, {rounds} round(s) each, alternating (option on | off):")
    for name, v in rows.items():
        print(f"  {name:58s} on {', '.join(v['on']):>22s} | off {', '.join(v['off'])}")


def _figures(p: dict[str, Any]) -> list[tuple[str, str]]:
    """The ratios of one block size's promote result worth comparing."""
    out: list[tuple[str, str]] = []
    for temp in ("warm", "cold"):
        r = (p.get("ratios") or {}).get(temp) or {}
        if r.get("tkv_vs_raw_pread_copy"):
            out.append((f"{temp}, batched, vs pread+copy_", f"{r['tkv_vs_raw_pread_copy']:.2f}x"))
    one = (p.get("one_at_a_time") or {}).get("warm") or {}
    if one.get("tkv_us"):
        out.append(("one at a time, warm, us (vs pread+copy_)",
                    f"{one['tkv_us']['median']:.0f} ({one.get('ratio_median') or 0:.2f}x)"))
    return out


def cold(block: int, total: int, rounds: int) -> None:
    n = max(1, total // block)
    base = Path(tempfile.mkdtemp(prefix="tkv-cold-ab-"))
    dev = torch.randint(0, 255, (n, block), dtype=torch.uint8)
    orig = dev.clone()
    real_read = cached.CachedReads.read

    def nothing(self: cached.CachedReads, ops: list[Any], until: Any = None) -> tuple[list[Any], list[Any]]:
        return [], ops

    def manager(mode: str) -> TierManager:
        cached.CachedReads.read = real_read if mode == "on" else nothing   # type: ignore[method-assign]
        cfg = TieredKVConfig(namespace="cold-ab", host_capacity_bytes=n * block, disk_path=str(base / "kv"),
                             disk_capacity_bytes=4 * n * block, disk_read_cached_in_wait=mode != "off")
        return TierManager(cfg, dev, registry=CollectorRegistry())

    modes = ["on", "off", "reads nothing"]
    res: dict[str, list[float]] = {m: [] for m in modes}
    try:
        m = manager("off")
        keys = [os.urandom(16) for _ in range(n)]
        for i, k in enumerate(keys):
            m.store(k, i)
        m.wait()
        assert m.flush()
        m.close()
        for r in range(rounds):
            for mode in modes[r % 3:] + modes[:r % 3]:
                mg = manager(mode)   # a new manager: its host tier empty, every key only on disk
                try:
                    dev.zero_()   # the loads put every block back: checked below
                    os.sync()
                    with open("/proc/sys/vm/drop_caches", "w") as f:
                        f.write("3")
                    t = time.perf_counter()
                    jobs = [mg.load(k, i) for i, k in enumerate(keys)]
                    mg.wait(jobs)
                    dt = time.perf_counter() - t
                    assert all(j is not None and j.state.name == "DONE" for j in jobs)
                    assert torch.equal(dev, orig), "a load put wrong bytes into its row"
                finally:
                    mg.close()
                res[mode].append(n * block / dt / 1e9)
    finally:
        cached.CachedReads.read = real_read   # type: ignore[method-assign]
        shutil.rmtree(base, ignore_errors=True)
    print(f"cold batched promotes, {n} x {block >> 10} KiB, a new manager and drop_caches each round, GB/s:")
    for mode in modes:
        print(f"  {mode:14s} {' '.join(f'{x:.2f}' for x in res[mode])}   median {statistics.median(res[mode]):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("promote")
    p.add_argument("--mode", default="full", choices=["full", "quick", "smoke"])
    p.add_argument("--rounds", type=int, default=2)
    c = sub.add_parser("cold")
    c.add_argument("--block-kib", type=int, default=256)
    c.add_argument("--mib", type=int, default=64)
    c.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    if a.what == "promote":
        promote(a.mode, a.rounds)
    else:
        cold(a.block_kib << 10, a.mib << 20, a.rounds)


if __name__ == "__main__":
    main()
