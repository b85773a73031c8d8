"""The ``tiered-kv`` command line.  The only module that prints."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Optional, Sequence

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from .workload import WorkloadConfig, run_workload

    cfg = WorkloadConfig(steps=args.steps, seed=args.seed, abort_rate=args.abort_rate,
                         device_blocks=args.device_blocks, host_blocks=args.host_blocks)
    summary = run_workload(cfg)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
    print(f"tiered-kv demo: {summary['steps']} engine steps, seed {summary['seed']}")
    print(f"  requests served          {summary['requests_finished']} (aborted {summary['requests_aborted']})")
    print(f"  prefix blocks looked up  {summary['lookup_keys']}, hits in host tier {summary['host_hits']} "
          f"({summary['host_hit_rate']:.1%})")
    print(f"  blocks loaded            {summary['loads_ok']} verified, corrupt {summary['corrupt_loads']}")
    print(f"  blocks stored            {summary['stores_ok']} (cancelled {summary['stores_cancelled']}, "
          f"shed {summary['stores_shed']})")
    print(f"  bytes moved              device->host {summary['bytes_device_to_host']:,}  "
          f"host->device {summary['bytes_host_to_device']:,}")
    stale = ", ".join(f"{k}={v}" for k, v in sorted(summary["stale_callbacks"].items())) or "none"
    print(f"  stale callbacks          {stale}")
    print(f"  wall time                {summary['seconds']:.2f} s")
    return 1 if summary["corrupt_loads"] or summary["errors"] else 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tiered-kv", description="KV-cache tiering for LLM serving.")
    p.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run a seeded serving workload through the public API")
    d.add_argument("--steps", type=int, default=400, help="engine steps (default 400)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--abort-rate", type=float, default=0.15, help="chance a running request is aborted per step")
    d.add_argument("--device-blocks", type=int, default=96, help="rows in the device KV pool")
    d.add_argument("--host-blocks", type=int, default=256, help="slots in the host tier")
    d.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    d.set_defaults(func=_demo)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
