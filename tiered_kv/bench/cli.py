"""``tiered-kv bench``: every tier beside its baseline, in one process, as a table, JSON and plots.

``run_bench`` runs the sections (core, CUDA links, disk tier, end to end) and
returns one JSON-ready dict: ``machine`` facts, ``figures`` (see
:mod:`tiered_kv.bench.report` for their schema), ``problems`` and each
section's raw result under ``sections``.  ``add_bench_command`` registers the
subcommand on the ``tiered-kv`` parser.  Exit status: 0, also when targets are
missed (they are figures, not failures); 1 when a measurement saw wrong bytes;
2 on bad arguments or when ``--plot`` is asked for without matplotlib.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

__all__ = ["add_bench_command", "run_bench", "SECTIONS", "DEFAULT_SECTIONS"]

# section name -> (part, name inside the part)
_PARTS: dict[str, tuple[str, str]] = {
    "lifecycles": ("core", "lifecycles"),
    "store_latency": ("core", "store_latency"),
    "host": ("core", "host_throughput"),
    "cuda": ("core", "cuda_copy"),
    "spill": ("disk", "spill"),
    "promote": ("disk", "promote"),
    "evicting": ("disk", "evicting"),
    "latency": ("disk", "latency"),
    "e2e": ("e2e", "e2e"),
    "trace": ("trace", "trace"),
    "step": ("step", "step"),
    "copy_step": ("copy_step", "copy_step"),
    "busy": ("busy", "busy"),
    "remote": ("remote", "remote"),
}
SECTIONS = tuple(_PARTS)
# smoke (the tests' one shared run) leaves out busy: it runs for fixed seconds per row (tests/test_bench_busy.py runs
# it); and remote: it starts a redis-server of its own (tests/test_bench_remote.py runs it against the tests' server)
DEFAULT_SECTIONS = {"full": SECTIONS, "quick": SECTIONS,
                    "smoke": tuple(s for s in SECTIONS if s not in ("busy", "remote"))}
_FORMAT_VERSION = 1


def run_bench(mode: str = "full", seed: int = 0, bench_dir: Optional[str] = None,
              sections: Optional[Sequence[str]] = None,
              log: Callable[[str], None] = lambda s: None, trace: Optional[str] = None,
              remote_url: Optional[str] = None) -> dict[str, Any]:
    """Run the sections named (default: those of the mode) and return the whole result.

    ``remote_url``: the server of the remote section (default: a private ``redis-server`` it starts).

    The result may hold NaN where a figure could not be computed; ``report.clean`` makes it strict JSON.
    """
    import gc

    from . import core, disk, e2e, report
    from . import busy as busy_part
    from . import remote as remote_part
    from . import step as step_part
    from . import trace as trace_part
    from .common import LoadMonitor, as_mode, machine_facts

    mode = as_mode(mode)
    chosen = list(sections if sections is not None else DEFAULT_SECTIONS[mode])
    bad = set(chosen) - set(SECTIONS)
    if bad:
        raise ValueError(f"unknown sections {sorted(bad)}; known: {', '.join(SECTIONS)}")
    parent = Path(bench_dir) if bench_dir else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "tiered-kv bench", "format_version": _FORMAT_VERSION, "mode": mode, "seed": seed,
        "sections_run": chosen, "started_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_facts(parent), "section_seconds": {}, "sections": {},
    }
    dc = disk.diskcache_module()  # optional: the peer's rows say "not installed" without it
    result["machine"]["diskcache"] = getattr(dc, "__version__", "installed") if dc is not None else disk.DISKCACHE_MISSING

    def part(name: str) -> list[str]:
        return [_PARTS[s][1] for s in chosen if _PARTS[s][0] == name]

    def _settle() -> None:
        # what earlier sections left alive (their samples, results) joins the permanent generation too,
        # so that a later section's gen-2 collections do not scan it: each section starts as it would alone
        gc.collect()
        gc.freeze()

    # objects alive after imports (torch's many) go to the permanent generation, as serving engines do after
    # start-up: gc.collect() before each timed repeat is then cheap and gen-2 passes do not scan them
    gc.collect()
    gc.freeze()
    try:
        with LoadMonitor() as whole:
            if part("core"):
                _settle()
                t = time.perf_counter()
                result["sections"]["core"] = core.run_all(mode, seed, log=log, sections=part("core"))
                result["section_seconds"]["core"] = time.perf_counter() - t
            if part("disk"):
                _settle()
                t = time.perf_counter()
                result["sections"]["disk"] = disk.run_all(mode, seed, base_dir=str(parent), sections=part("disk"),
                                                          log=lambda s: log(f"disk: {s}"))
                result["section_seconds"]["disk"] = time.perf_counter() - t
            if part("e2e"):
                _settle()
                t = time.perf_counter()
                gc.collect()
                with LoadMonitor() as lm:
                    result["sections"]["e2e"] = e2e.bench_e2e(mode, seed, log=log)
                result["sections"]["e2e"]["background_load"] = lm.result
                result["section_seconds"]["e2e"] = time.perf_counter() - t
            if part("trace"):
                _settle()
                t = time.perf_counter()
                result["sections"]["trace"] = trace_part.bench_trace(mode, seed, trace, str(parent),
                                                                     log=lambda s: log(f"trace: {s}"))
                result["section_seconds"]["trace"] = time.perf_counter() - t
            if part("step"):
                _settle()
                t = time.perf_counter()
                result["sections"]["step"] = step_part.bench_step(mode, seed, str(parent),
                                                                  log=lambda s: log(f"step: {s}"))
                result["section_seconds"]["step"] = time.perf_counter() - t
            if part("copy_step"):
                _settle()
                t = time.perf_counter()
                result["sections"]["copy_step"] = step_part.bench_copy_step(mode, seed,
                                                                            log=lambda s: log(f"copy step: {s}"))
                result["section_seconds"]["copy_step"] = time.perf_counter() - t
            if part("busy"):
                _settle()
                t = time.perf_counter()
                result["sections"]["busy"] = busy_part.bench_busy(mode, seed, str(parent),
                                                                  log=lambda s: log(f"busy: {s}"))
                result["section_seconds"]["busy"] = time.perf_counter() - t
            if part("remote"):
                _settle()
                t = time.perf_counter()
                result["sections"]["remote"] = remote_part.bench_remote(mode, seed, remote_url, trace,
                                                                        log=lambda s: log(f"remote: {s}"))
                result["section_seconds"]["remote"] = time.perf_counter() - t
    finally:
        gc.unfreeze()
    result["background_load"] = whole.result
    result["wall_seconds"] = time.perf_counter() - t0
    result["figures"] = report.collect_figures(result)
    with_target = [f for f in result["figures"] if f["met"] is not None]
    result["targets_met"] = sum(1 for f in with_target if f["met"])
    result["targets_total"] = len(with_target)
    result["problems"] = report.problems(result)
    return result


def add_bench_command(sub: Any) -> None:
    """Register ``bench`` on the ``tiered-kv`` parser's subparsers."""
    p = sub.add_parser(
        "bench", help="measure every tier beside its baseline (table, --json, --plot)",
        description="Runs, in one process, each figure beside its baseline measured in the same run "
                    "(seeded, warm-up discarded, interleaved, median/p90/p99/max): control-path lifecycles vs "
                    "the unsafe plain-dict original; host tier GB/s vs raw torch copy_; disk spill/promote vs "
                    "raw write+fsync, raw pread+copy_ and python-diskcache, also full and evicting, and one load from disk "
                    "at a time; engine-thread latency with the disk writer saturated vs no disk tier; the demo "
                    "workload with no offload, host, host+disk; a production trace replayed through the public API "
                    "beside a plain dict LRU; a realistic engine step (32 lookups, 64 loads, 64 stores, disk on) "
                    "beside the unsafe dict original; the disk tier beside an engine thread busy in Python "
                    "(spills published, engine CPU per step, one load from disk) with its I/O in a child process vs in "
                    "threads; the remote tier (Redis/Valkey) put and get GB/s vs the same client's pipelined SET "
                    "and GET+xxh3 of the same bytes, and two machines' hit ratio on the trace sharing one server vs "
                    "host tiers only; and, "
                    "with CUDA, device<->host GB/s vs torch's copy and store() latency on a CUDA KV tensor.  "
                    "Missed targets do not fail the command.",
    )
    p.add_argument("--quick", action="store_true", help="smaller sets and fewer repeats (about a minute)")
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # seconds: the tests' configuration
    p.add_argument("--json", metavar="PATH", help="write every figure, baseline, ratio, target and machine facts")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR (needs matplotlib: the 'bench' extra)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", metavar="DIR", default=None,
                   help="parent of the disk benchmarks' scratch directory; its filesystem is the one measured "
                        "(default: the system temp dir)")
    p.add_argument("--trace", metavar="PATH", default=None,
                   help="Mooncake-format JSONL trace for the trace section (default: $TIERED_KV_TRACE, else "
                        "benchmarks/traces/mooncake_synthetic_trace.jsonl of a source checkout)")
    p.add_argument("--remote-url", metavar="URL", default=None,
                   help="Redis/Valkey server of the remote section (redis://HOST:PORT/DB, redis+cluster://...); only "
                        "the keys the bench writes are deleted there (default: a private redis-server from PATH, "
                        "else the section is skipped)")
    p.add_argument("--sections", metavar="LIST", default=None,
                   help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    p.add_argument("--from-json", metavar="PATH", default=None,
                   help="measure nothing: print the table of a result written by --json (and --plot it)")
    p.add_argument("--no-details", action="store_true", help="print only the summary table")
    p.set_defaults(func=_bench)


def _err(msg: str) -> int:
    print(f"tiered-kv bench: error: {msg}", file=sys.stderr)
    return 2


def _bench(args: argparse.Namespace) -> int:
    from . import report
    from .trace import TraceError

    if args.plot:
        from .plots import matplotlib_missing

        why = matplotlib_missing()
        if why:
            return _err(f"--plot needs matplotlib, which is not importable ({why}); "
                        "pip install 'tiered-kv[bench]' or drop --plot")
    if args.quick and args.smoke:
        return _err("--quick and --smoke exclude each other")
    if args.from_json:
        try:
            with open(args.from_json, encoding="utf-8") as f:
                result = json.load(f)
        except (OSError, ValueError) as exc:
            return _err(f"cannot read {args.from_json}: {exc}")
        if not isinstance(result, dict) or result.get("benchmark") != "tiered-kv bench":
            return _err(f"{args.from_json} is not a 'tiered-kv bench' result")
        try:
            result = report.revive(result)   # NaN the run measured, saved as null
            result["figures"] = report.collect_figures(result)  # figures follow the current report code
            table = report.format_table(result)
        except (KeyError, TypeError, AttributeError, ValueError, IndexError) as exc:   # a truncated or edited file
            return _err(f"{args.from_json} is not a complete 'tiered-kv bench' result: {type(exc).__name__}: {exc}")
    else:
        sections = None
        if args.sections is not None:
            sections = [s.strip() for s in args.sections.split(",") if s.strip()]
            unknown = sorted(set(sections) - set(SECTIONS))
            if unknown:
                return _err(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
            if not sections:
                return _err(f"--sections {args.sections!r} names no section; known: {', '.join(SECTIONS)}")
        mode = "smoke" if args.smoke else ("quick" if args.quick else "full")
        if args.trace is not None and not Path(args.trace).is_file():
            return _err(f"--trace {args.trace}: no such file")
        if args.remote_url is not None:
            from ..config import TieredKVConfig
            from ..errors import ConfigError

            try:
                TieredKVConfig(namespace="bench", host_capacity_bytes=1, remote_url=args.remote_url)
            except ConfigError as exc:
                return _err(f"--remote-url: {exc}")
        try:
            result = run_bench(mode, args.seed, args.dir, sections,
                               log=lambda s: print(f"[bench] {s}", file=sys.stderr, flush=True), trace=args.trace,
                               remote_url=args.remote_url)
        except TraceError as exc:
            return _err(str(exc))
        table = report.format_table(result)
    print(table)
    if not args.no_details and not args.from_json:
        print("\n\n==== details (median / p90 / p99 / max; each section's own report) ====\n")
        print(report.format_details(result))
    if args.json and not args.from_json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(report.clean(result), f, indent=1, allow_nan=False)
            f.write("\n")
        print(f"\nwrote {path}", file=sys.stderr)
    if args.plot:
        from .plots import write_plots

        for png in write_plots(result, args.plot):
            print(f"wrote {png}", file=sys.stderr)
    return 1 if (result.get("problems") or {}).get("wrong_bytes") else 0
