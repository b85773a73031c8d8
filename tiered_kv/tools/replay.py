"""``tiered-kv replay TRACE``: capacity planning from a real trace, through the real core.

A Mooncake-format JSONL trace (``timestamp``, ``input_length``, ``output_length``, ``hash_ids``; one id
per 512-token block, equal ids are shared prefix blocks) is replayed through a ``TierManager`` with
tiny rows -- the engine loop of ``tiered-kv bench``'s trace section: per request ``lookup``, the hits
loaded, the misses stored, one request a step (each sees what the one before stored, as the
simulations do) -- under the chosen policies and admission filters,
host tier (and disk tier when ``--disk`` is given) at the chosen sizes.  Beside it, at the same sizes,
the offline simulations of :mod:`tiered_kv.tools.tracetools`: the same policies (what the replay should
reach when nothing is shed), LRU, and Belady's offline bound, and what an unbounded cache would hit
(every reuse in the trace: "the possible hits").  ``--model`` turns blocks into bytes, so the report
reads "host N GiB + disk M GiB reach X% of the possible hits", and bytes written per tier (SSD wear).

``--sweep PNG`` draws hit-ratio curves per policy and Belady's over host sizes (simulated: a sweep of
the real core would take minutes per point); ``--json PATH`` writes every figure.  A malformed trace
line is an error naming the file and the line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import Any, Optional, Sequence

from .cli import HelpFormatter, check_output_file, nonempty

__all__ = ["add_replay_command", "replay", "parse_size", "parse_model"]

ROW_BYTES = 64            # the replay's rows: the control path, not the copies
PER_STEP = 1              # requests per engine step: each request sees the blocks the one before stored
DEFAULT_SWEEP = (0.01, 0.02, 0.05, 0.10)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tib": 1 << 40, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4}


def parse_size(text: str, distinct: int, block_bytes: int) -> int:
    """A tier size in blocks: ``"4096"`` (blocks), ``"2%"`` (of the trace's distinct blocks) or ``"8GiB"``
    (bytes of the model's blocks).  Raises ValueError naming the text."""
    t = text.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", t)
    if m:   # exact arithmetic: 29% of 100 is 29 (0.29 * 100 in floats is 28.999...)
        blocks = math.floor(Fraction(m.group(1)) * distinct / 100)
    else:
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)", t)
        if not m:
            raise ValueError(f"size {text!r}: expected blocks (4096), a share of the distinct blocks (2%) or bytes (8GiB)")
        num, unit = Fraction(m.group(1)), m.group(2).lower()
        if unit in ("", "blocks"):
            if num.denominator != 1:
                raise ValueError(f"size {text!r}: a block count must be whole")
            blocks = int(num)
        elif unit in _UNITS:
            blocks = math.floor(num * _UNITS[unit]) // block_bytes
        else:
            raise ValueError(f"size {text!r}: unknown unit {m.group(2)!r} (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    if blocks < 1:
        raise ValueError(f"size {text!r} is less than one block ({block_bytes} bytes, {distinct} distinct blocks)")
    return blocks


def parse_model(spec: Optional[str], dtype: Optional[str], tokens_per_block: int) -> tuple[int, str]:
    """(bytes per block, a description): ``LAYERS,KV_HEADS,HEAD_DIM[,DTYPE]`` or a Hugging Face
    ``config.json`` path; None: Llama-3-8B's shape in bf16."""
    from .tracetools import model_block_bytes, model_from_hf_config

    if spec is None:
        b = model_block_bytes(32, 8, 128, dtype or "bfloat16", tokens_per_block)
        return b, f"Llama-3-8B shape (32 layers, 8 KV heads, head dim 128, {dtype or 'bfloat16'}), default"
    parts = spec.split(",")
    if len(parts) in (3, 4) and all(p.strip().isdigit() for p in parts[:3]):
        layers, heads, hd = (int(p) for p in parts[:3])
        dt = dtype or (parts[3].strip() if len(parts) == 4 else "bfloat16")
        return (model_block_bytes(layers, heads, hd, dt, tokens_per_block),
                f"{layers} layers, {heads} KV heads, head dim {hd}, {dt}")
    shape = model_from_hf_config(spec, dtype=dtype, tokens_per_block=tokens_per_block)
    return shape.block_bytes, (f"{spec}: {shape.layers} layers, {shape.kv_heads} KV heads, head dim {shape.head_dim}, "
                               f"{shape.dtype}")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PiB"   # pragma: no cover


def replay(requests: Sequence[Any], host_blocks: int, disk_blocks: int, *, host_policy: str = "lru",
           disk_policy: str = "lru", host_admission: str = "all", disk_admission: str = "all",
           write_mode: str = "through", scratch: Optional[str] = None, tokens_per_block: int = 512) -> dict[str, Any]:
    """Replay ``requests`` (:class:`~tiered_kv.tools.tracetools.Request`) through a ``TierManager`` with
    ``host_blocks`` host slots and, when ``disk_blocks`` > 0, a disk tier of that many blocks in a scratch
    directory (removed after).  Returns counts (references, hits per tier, prefill tokens saved -- a hit
    block's ``tokens_per_block``, a prompt's last block only its own tokens --, blocks written per tier,
    shed, refused, evicted)."""
    import torch
    from prometheus_client import CollectorRegistry

    from .. import TieredKVConfig, TierManager
    from ..bench.trace import keys_of, replay_engine
    from ..core.disk_tier import capacity_for
    from ..metrics import sample_total
    from ..movers import ImmediateMover
    from .tracetools import hit_tokens

    reqs = keys_of([list(r.hash_ids) for r in requests])
    rows = PER_STEP * max(1, max(len(k) for k in reqs))   # a trace of no block references: one idle row
    tmp = tempfile.mkdtemp(prefix="tkv-replay-", dir=scratch) if disk_blocks else None
    try:
        cfg = TieredKVConfig(namespace="tiered-kv/replay", host_capacity_bytes=host_blocks * ROW_BYTES,
                             write_mode=write_mode,  # type: ignore[arg-type]
                             host_policy=host_policy, disk_policy=disk_policy, host_admission=host_admission,
                             disk_admission=disk_admission, host_evict_ahead_blocks=0, durability="none",
                             max_inflight_jobs=max(4096, 4 * rows), writer_queue_blocks=max(256, rows))
        if tmp is not None:   # a tier that holds disk_blocks blocks: its write batches' room on top
            cfg = cfg.replace(disk_path=str(Path(tmp) / "disk"),
                              disk_capacity_bytes=capacity_for(cfg, ROW_BYTES, disk_blocks))
        mgr = TierManager(cfg, torch.zeros(rows, ROW_BYTES, dtype=torch.uint8), registry=CollectorRegistry(),
                          mover_factory=ImmediateMover)
        try:
            held = mgr._core.dindex.num_slots if mgr._core.dindex is not None else disk_blocks
            assert held == disk_blocks, (held, disk_blocks)
            per_request: list[int] = []
            # with a disk tier, each step waits until its spills were written (no fsync: durability "none"),
            # so that no hit is lost to a spill shed because the replay outran the writer
            r = replay_engine(mgr, reqs, PER_STEP, per_request,
                              after_step=None if tmp is None else lambda: mgr.flush(timeout=60))
            mgr.flush(timeout=60)
            mgr.poll()
            reg = mgr.metrics.registry

            def total(name: str, **labels: str) -> int:
                return int(sample_total(reg, name, **labels))

            out = {
                # hits: the blocks loads brought in; host_hits + disk_hits: what the lookups found, which is hits
                # and the blocks of loads refused or failed (load_refused: computed again by the engine)
                "refs": r["refs"], "hits": r["hits"], "load_refused": r["load_refused"], "wall_s": r["wall_s"],
                "refs_per_s": r["refs_per_s"],
                "tokens_saved": sum(hit_tokens(q, n, tokens_per_block) for n, q in zip(per_request, requests)),
                "input_tokens": sum(q.input_length for q in requests),
                "host_hits": total("tiered_kv_lookup_hits_total", tier="host"),
                "disk_hits": total("tiered_kv_lookup_hits_total", tier="disk"),
                "host_blocks_written": total("tiered_kv_transfer_bytes_total", src="device", dst="host") // ROW_BYTES
                + total("tiered_kv_transfer_bytes_total", src="disk", dst="host") // ROW_BYTES,
                "disk_blocks_written": total("tiered_kv_transfer_bytes_total", src="host", dst="disk") // ROW_BYTES,
                "stores_shed": total("tiered_kv_shed_total", kind="store"),
                "spills_shed": total("tiered_kv_shed_total", kind="spill"),
                "host_refused": total("tiered_kv_admission_refused_total", tier="host"),
                "disk_refused": total("tiered_kv_admission_refused_total", tier="disk"),
                "host_evictions": total("tiered_kv_evictions_total", tier="host"),
                "disk_evictions": total("tiered_kv_evictions_total", tier="disk"),
            }
        finally:
            mgr.close()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    out["hit_ratio"] = out["hits"] / out["refs"] if out["refs"] else float("nan")
    return out


# options that act only with another one: given without it they would be accepted and do nothing
_NEEDS = (("--sweep-sizes", "sweep_sizes", "--sweep", "sweep"), ("--disk-policy", "disk_policy", "--disk", "disk"),
          ("--disk-admission", "disk_admission", "--disk", "disk"), ("--write-mode", "write_mode", "--disk", "disk"))


def _run(args: argparse.Namespace) -> int:
    from ..core.policy import ADMISSIONS, POLICIES
    from .tracetools import TraceError, belady, read_trace, simulate, simulate_tiers, trace_stats

    try:
        if args.requests is not None and args.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {args.requests}")
        for opt, dest, needed, needed_dest in _NEEDS:
            if getattr(args, dest) is not None and getattr(args, needed_dest) is None:
                raise ValueError(f"{opt} needs {needed}")
        if args.sweep:   # found before the run, not after it
            from ..bench.plots import matplotlib_missing

            why = matplotlib_missing()
            if why is not None:
                raise ValueError(f"--sweep needs matplotlib (pip install 'tiered-kv[bench]'): {why}")
        requests = read_trace(args.trace, limit=args.requests)
        block_bytes, model = parse_model(args.model, args.dtype, args.tokens_per_block)
        stats = trace_stats(requests)
        distinct = int(stats["distinct_blocks"])
        host = parse_size(args.host, distinct, block_bytes)
        disk = parse_size(args.disk, distinct, block_bytes) if args.disk is not None else 0
        sweep_caps = [parse_size(x, distinct, block_bytes) for x in args.sweep_sizes.split(",")] \
            if args.sweep_sizes is not None else None
        # the places written at the end of a long run, checked before it
        check_output_file("--json", args.json)
        check_output_file("--sweep", args.sweep)
        if args.scratch is not None and not (Path(args.scratch).is_dir() and os.access(args.scratch, os.W_OK)):
            raise ValueError(f"--scratch: {args.scratch!r} is not a writable directory")
    except (TraceError, ValueError, OSError) as exc:
        print(f"tiered-kv replay: {exc}", file=sys.stderr)
        return 2
    # the disk tier's settings, their defaults applied (given without --disk they were refused above)
    disk_policy = args.disk_policy if args.disk_policy is not None else args.policy
    disk_admission = args.disk_admission if args.disk_admission is not None else "all"
    write_mode = args.write_mode if args.write_mode is not None else "through"
    for name, value, known in (("--policy", args.policy, POLICIES),
                               ("--disk-policy", disk_policy, POLICIES),
                               ("--host-admission", args.host_admission, ADMISSIONS),
                               ("--disk-admission", disk_admission, ADMISSIONS)):
        if value not in known:
            print(f"tiered-kv replay: {name} {value!r}: known: {', '.join(sorted(known))}", file=sys.stderr)
            return 2
    refs = int(stats["block_refs"])
    say = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr))
    say(f"trace {args.trace}: {len(requests)} requests, {refs} block references, {distinct} distinct blocks")
    out: dict[str, Any] = {"trace": str(args.trace), "requests": len(requests), "block_refs": refs,
                           "distinct_blocks": distinct, "block_bytes": block_bytes, "model": model,
                           "host_blocks": host, "disk_blocks": disk, "host_policy": args.policy,
                           "host_admission": args.host_admission,
                           # no disk tier: no disk settings (null), not defaults that read as used
                           "disk_policy": disk_policy if disk else None,
                           "disk_admission": disk_admission if disk else None,
                           "write_mode": write_mode if disk else None}
    t0 = time.perf_counter()
    say(f"replaying through the core: host {host} blocks" + (f", disk {disk} blocks" if disk else "") + " ...")
    core = replay(requests, host, disk, host_policy=args.policy, disk_policy=disk_policy,
                  host_admission=args.host_admission, disk_admission=disk_admission,
                  write_mode=write_mode, scratch=args.scratch, tokens_per_block=args.tokens_per_block)
    out["core"] = core
    say(f"  {core['refs_per_s']:,.0f} block references/s ({time.perf_counter() - t0:.1f} s)")
    say("simulating the same sizes: this policy, LRU, Belady, an unbounded cache ...")
    tpb = args.tokens_per_block
    if disk:
        sim = simulate_tiers(requests, host, disk, args.policy, disk_policy, disk_admission,
                             host_admission=args.host_admission, block_bytes=block_bytes, write_mode=write_mode,
                             tokens_per_block=tpb)
        lru = simulate_tiers(requests, host, disk, "lru", "lru", "all", block_bytes=block_bytes,
                             write_mode=write_mode, tokens_per_block=tpb)
        out["simulated"] = sim.as_dict()
        out["lru"] = lru.as_dict()
    else:
        s1 = simulate(requests, host, args.policy, args.host_admission, block_bytes=block_bytes, tokens_per_block=tpb)
        l1 = simulate(requests, host, "lru", "all", block_bytes=block_bytes, tokens_per_block=tpb)
        out["simulated"] = s1.as_dict()
        out["lru"] = l1.as_dict()
    bound = belady(requests, host + disk, block_bytes=block_bytes, tokens_per_block=tpb)
    unbounded = simulate(requests, max(distinct, 1), "lru", "all", block_bytes=block_bytes, tokens_per_block=tpb)
    out["belady"] = bound.as_dict()
    if bound.hits > unbounded.hits:
        # ids that are no prefix tree: Belady counts blocks found cached behind a miss, which no prefix lookup
        # hits; the unbounded cache's prefix hits bound every policy too, and are the tighter bound then
        out["belady"].update(hits=unbounded.hits, hit_ratio=unbounded.hit_ratio, tokens_saved=unbounded.tokens_saved,
                             capped_at_unbounded=True, uncapped_hit_ratio=bound.hit_ratio)
        say("the trace's block ids are no prefix tree: Belady's bound is capped at the unbounded cache's hits")
    out["possible"] = unbounded.as_dict()
    possible = unbounded.hits
    out["share_of_possible"] = core["hits"] / possible if possible else float("nan")
    if args.sweep:
        from .tracetools import sweep

        caps = sweep_caps or [max(1, int(f * distinct)) for f in DEFAULT_SWEEP]
        say(f"sweeping {len(caps)} host sizes x {len(POLICIES)} policies + Belady ...")
        curves = sweep(requests, caps, list(POLICIES), admission=args.host_admission)
        out["sweep"] = curves
        _plot_sweep(curves, block_bytes, Path(args.sweep), str(args.trace))
        say(f"wrote {args.sweep}")
    _print(out)
    if args.json is not None:
        from ..bench.report import clean

        with open(args.json, "w", encoding="utf-8") as f:   # strict JSON: a figure of no denominator is null
            json.dump(clean(out), f, indent=2, sort_keys=True, default=str, allow_nan=False)
    return 0


def _print(o: dict[str, Any]) -> None:
    bb = o["block_bytes"]
    core, sim, lru, bel, pos = o["core"], o["simulated"], o["lru"], o["belady"], o["possible"]
    refs = o["block_refs"]
    disk = o["disk_blocks"]
    print(f"trace: {o['trace']} -- {o['requests']} requests, {refs} block references, "
          f"{o['distinct_blocks']} distinct blocks")
    print(f"model: {o['model']}: {_human(bb)} per block")
    print(f"tiers: host {o['host_blocks']} blocks ({_human(o['host_blocks'] * bb)}, {o['host_policy']}, admission "
          f"{o['host_admission']})" + (f", disk {disk} blocks ({_human(disk * bb)}, {o['disk_policy']}, admission "
                                       f"{o['disk_admission']}, write-{o['write_mode']})" if disk else ", no disk tier"))
    print()
    rows = [("block hit ratio, all tiers", *(_ratio(x["hit_ratio"]) for x in (core, sim, lru, bel, pos)))]
    if disk:
        rows.append(("  host", _share(core["host_hits"], refs), _ratio(sim["host_hit_ratio"]),
                     _ratio(lru["host_hit_ratio"]), "", ""))
        rows.append(("  disk", _share(core["disk_hits"], refs), _ratio(sim["disk_hit_ratio"]),
                     _ratio(lru["disk_hit_ratio"]), "", ""))
        rows.append(("bytes written to disk", _human(core["disk_blocks_written"] * bb),
                     _human(sim["disk_bytes_written"]), _human(lru["disk_bytes_written"]), "", ""))
    rows.append(("prefill tokens saved", *(_share(x["tokens_saved"], x["input_tokens"]) for x in (core, sim, lru, bel, pos))))
    rows.append(("bytes written to host", _human(core["host_blocks_written"] * bb),
                 _human(sim.get("host_bytes_written", sim.get("bytes_written", 0))),
                 _human(lru.get("host_bytes_written", lru.get("bytes_written", 0))), "", ""))
    head = ("", "replay (core)", "simulated", "LRU", "Belady", "unbounded")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(str(c).ljust(widths[0]) if i == 0 else str(c).rjust(widths[i]) for i, c in enumerate(r)))
    print()
    print(f"host {_human(o['host_blocks'] * bb)}" + (f" + disk {_human(disk * bb)}" if disk else "") +
          f" reach {_percent(o['share_of_possible'])} of the possible hits "
          f"(an unbounded cache hits {_percent(pos['hit_ratio'])} of block references; Belady at this size "
          f"{_percent(bel['hit_ratio'])})")
    ratio = core["hit_ratio"] / sim["hit_ratio"] if sim["hit_ratio"] else float("nan")
    print(f"replay / simulated hit ratio: {_ratio(ratio, 3)} (stores shed {core['stores_shed']}, spills shed "
          f"{core['spills_shed']}, blocks found but their loads refused or failed {core['load_refused']}); "
          f"replay speed {core['refs_per_s']:,.0f} block references/s")


def _share(part: float, whole: float) -> str:
    """``part / whole`` to four places; "n/a" where there is no denominator (a trace of no prompt tokens,
    no block references)."""
    return _ratio(part / whole if whole else float("nan"))


def _ratio(x: float, places: int = 4) -> str:
    """A ratio to ``places`` places; "n/a" for one of no denominator (NaN: a trace without reuse, or of no
    block references), as the JSON's null -- never "nan"."""
    return f"{x:.{places}f}" if math.isfinite(x) else "n/a"


def _percent(x: float) -> str:
    """A ratio as a percentage to one place; "n/a" as :func:`_ratio`."""
    return f"{100 * x:.1f}%" if math.isfinite(x) else "n/a"


def _plot_sweep(curves: dict[str, Any], block_bytes: int, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = curves["capacities"]
    distinct = curves["distinct_blocks"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ratios in curves["hit_ratio"].items():
        ax.plot([100 * c / distinct for c in caps], ratios, marker="o",
                linestyle="--" if name == "belady" else "-", label=name)
    ax.set_xlabel(f"host tier, % of the trace's {distinct} distinct blocks")
    ax.set_ylabel("block hit ratio")
    ax.set_title(f"hit ratio by policy: {Path(title).name}")
    ax.grid(True, alpha=0.3)
    top = ax.secondary_xaxis("top", functions=(lambda p: p / 100 * distinct * block_bytes / (1 << 30),
                                               lambda g: g * (1 << 30) / block_bytes / distinct * 100))
    top.set_xlabel("GiB of host memory")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_replay_command(sub: Any) -> None:
    from ..core.policy import ADMISSIONS, POLICIES

    p = sub.add_parser("replay", help="replay a Mooncake-format trace through the core: hit ratio per tier beside "
                                      "LRU and Belady's bound, bytes written, what a host/disk size reaches",
                       formatter_class=HelpFormatter,
                       description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("trace", help="JSONL: timestamp, input_length, output_length, hash_ids (512-token blocks)")
    p.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--host", default="2%", help="host tier size: blocks (4096), share of distinct blocks (2%%), "
                                                "or bytes (8GiB, of --model's blocks)")
    p.add_argument("--disk", default=None, help="disk tier size, same forms (default: no disk tier)")
    p.add_argument("--policy", default="lru", help=f"host tier policy: {', '.join(POLICIES)}")
    # the disk tier's options default to None, their defaults applied in _run: given without --disk, refused
    p.add_argument("--disk-policy", default=None, help="with --disk: disk tier policy (default: --policy)")
    p.add_argument("--host-admission", default="all", help=f"host admission: {', '.join(ADMISSIONS)}")
    p.add_argument("--disk-admission", default=None,
                   help=f"with --disk: disk admission: {', '.join(ADMISSIONS)} (default: all)")
    p.add_argument("--write-mode", default=None, choices=("through", "back"),
                   help="with --disk: the disk tier's write mode in the replay (default: through)")
    p.add_argument("--model", default=None, help="LAYERS,KV_HEADS,HEAD_DIM[,DTYPE] or a Hugging Face config.json "
                                                 "(default: Llama-3-8B's shape, bf16)")
    p.add_argument("--dtype", default=None, help="the KV cache dtype (overrides the model's)")
    p.add_argument("--tokens-per-block", type=int, default=512)
    p.add_argument("--sweep", metavar="PNG", type=nonempty, default=None,
                   help="also draw hit ratio by host size per policy")
    p.add_argument("--sweep-sizes", default=None,
                   help="with --sweep: host sizes of the sweep, comma separated (default 1%%,2%%,5%%,10%%)")
    p.add_argument("--json", metavar="PATH", type=nonempty, default=None, help="also write every figure as JSON")
    p.add_argument("--scratch", type=nonempty, default=None, help="parent of the disk tier's scratch directory")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=_run)
