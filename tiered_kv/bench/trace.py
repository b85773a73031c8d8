"""Trace replay: the control path through the public API, on a production-style prefix-sharing trace.

Owns one measurement, ``bench_trace``, and the trace reader ``load_trace`` (Mooncake's JSONL
format: ``hash_ids`` per request, one id per 512-token block, equal ids are shared prefix blocks).

The engine model: requests arrive in trace order, ``per_step`` of them per engine step.  Per
request, ``lookup(keys)`` gives the cached prefix; ``load_many`` brings those blocks into the
request's device rows and ``store_many`` offloads the rest (the blocks the engine computed).  At the
end of the step the engine ``wait()``s for the step's jobs and ``free_block``s every row it used.
Rows are tiny (``ROW_BYTES``) so the figure is the control path's cost, not the copies'; the default
mover does the copies, as users run it.  Two managers: host tier only, and host + disk tier (LMDB
in a scratch directory, write-through), each fresh per repeat (cold caches, empty disk tier).

Baseline: the same request sequence against a plain ``OrderedDict`` LRU of the host tier's size
(prefix lookup, touch of the hits, insert of the misses, no copies, no jobs): the least Python work
a prefix cache can do per block reference.  Reported: block references per second of wall time
(the figure), per CPU second of the engine thread, hit ratios per tier beside the baseline's.
Nothing here asserts a timing; :mod:`.report` applies the targets.
"""

from __future__ import annotations

import gc
import shutil
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Optional, Union

from prometheus_client import CollectorRegistry

from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.metrics import sample_total

from ..tools.tracetools import TRACE_ENV as _TRACE_ENV
from ..tools.tracetools import TRACE_NAME as _TRACE_NAME
from ..tools.tracetools import TraceError, block_key, default_trace, read_trace
from .common import LoadMonitor, as_mode, summarize

__all__ = ["bench_trace", "load_trace", "default_trace", "TraceError", "PLANS", "ROW_BYTES", "keys_of",
           "replay_engine"]

ROW_BYTES = 256
HOST_SLOTS = 4096        # about 9% of the Mooncake trace's 43,924 distinct blocks
DISK_SLOTS = 4 * HOST_SLOTS
PER_STEP = 4             # requests per engine step

PLANS: dict[str, dict[str, Optional[int]]] = {
    "full": {"requests": None, "repeats": 3},
    "quick": {"requests": 1000, "repeats": 1},
    "smoke": {"requests": 60, "repeats": 1},
}


def load_trace(path: Union[str, Path], limit: Optional[int] = None) -> list[list[int]]:
    """The ``hash_ids`` of each request of a Mooncake-format JSONL trace (the first ``limit``): the one
    reader, :func:`tiered_kv.tools.tracetools.read_trace`, needing only that field.

    Raises :class:`TraceError` naming the line of a malformed record."""
    return [list(r.hash_ids) for r in read_trace(path, limit, ids_only=True)]


def keys_of(requests: list[list[int]]) -> list[list[bytes]]:
    """One key per hash id (:func:`~tiered_kv.tools.tracetools.block_key`: 16 bytes, the size of an xxh3-128
    prefix-chain hash), the same bytes object for every reference to it."""
    cache: dict[int, bytes] = {}
    out = []
    for ids in requests:
        row = []
        for h in ids:
            k = cache.get(h)
            if k is None:
                k = cache[h] = block_key(h)
            row.append(k)
        out.append(row)
    return out


def replay_engine(mgr: TierManager, reqs: list[list[bytes]], per_step: int,
                  hits_out: Optional[list[int]] = None, after_step: Optional[Callable[[], Any]] = None) -> dict[str, Any]:
    """The engine loop of the module doc; the engine thread's wall and CPU time around it.  ``hits_out``:
    each request's hits are appended (``tiered-kv replay`` counts the prefill tokens saved); a request's hits
    are the blocks its load brought in: the lookup's answer when the load was accepted and reported ok, else
    0 (``load_refused``: the engine computes them again).  ``after_step()`` runs after each step's ``wait()``
    (``tiered-kv replay``: a ``flush()``).  One implementation for the bench's trace section and
    ``tiered-kv replay``."""
    lookup, load_many, store_many, wait, free = mgr.lookup, mgr.load_many, mgr.store_many, mgr.wait, mgr.free_block
    refs = hits = refused = 0
    out = hits_out if hits_out is not None else []
    t0, c0 = time.perf_counter(), time.thread_time()
    for s in range(0, len(reqs), per_step):
        jobs = []
        loads: list[tuple[Any, int]] = []   # (a load's job, its request's place in ``out``)
        row = 0
        for keys in reqs[s:s + per_step]:
            n = found = lookup(keys)
            end = row + len(keys)
            if n:
                j = load_many(keys[:n], list(range(row, row + n)))
                if j is not None:
                    jobs.append(j)
                    loads.append((j, len(out)))
                else:
                    refused += n
                    found = 0
            out.append(found)
            if n < len(keys):
                j = store_many(keys[n:], list(range(row + n, end)))
                if j is not None:
                    jobs.append(j)
            row = end
            refs += len(keys)
            hits += found
        done = wait(jobs)
        if loads:
            ok = {id(c.job) for c in done if c.ok}
            for j, i in loads:
                if id(j) not in ok:   # failed, or not reported by the wait: nothing brought in
                    refused += out[i]
                    hits -= out[i]
                    out[i] = 0
        if after_step is not None:
            after_step()
        for r in range(row):
            free(r)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    return {"refs": refs, "hits": hits, "load_refused": refused, "wall_s": wall, "cpu_s": cpu,
            "refs_per_s": refs / wall if wall > 0 else float("nan"),
            "refs_per_cpu_s": refs / cpu if cpu > 0 else float("nan")}


def _dict_replay(reqs: list[list[bytes]], slots: int) -> dict[str, Any]:
    """The baseline: a plain OrderedDict LRU of ``slots`` blocks, the same lookups and inserts."""
    lru: OrderedDict[bytes, None] = OrderedDict()
    move, pop = lru.move_to_end, lru.popitem
    refs = hits = 0
    t0, c0 = time.perf_counter(), time.thread_time()
    for keys in reqs:
        n = 0
        for k in keys:
            if k not in lru:
                break
            n += 1
        for k in keys[:n]:
            move(k)
        for k in keys[n:]:
            if k in lru:
                move(k)
                continue
            if len(lru) >= slots:
                pop(last=False)
            lru[k] = None
        refs += len(keys)
        hits += n
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    return {"refs": refs, "hits": hits, "wall_s": wall, "cpu_s": cpu,
            "refs_per_s": refs / wall if wall > 0 else float("nan"),
            "refs_per_cpu_s": refs / cpu if cpu > 0 else float("nan")}


def _manager(rows: int, disk_path: Optional[Path]) -> TierManager:
    import torch

    cfg = TieredKVConfig(namespace="bench/trace", host_capacity_bytes=HOST_SLOTS * ROW_BYTES,
                         disk_path=disk_path, disk_capacity_bytes=DISK_SLOTS * ROW_BYTES if disk_path else 0)
    return TierManager(cfg, torch.zeros(rows, ROW_BYTES, dtype=torch.uint8), registry=CollectorRegistry())


def _tkv_run(reqs: list[list[bytes]], rows: int, disk_dir: Optional[Path]) -> dict[str, Any]:
    mgr = _manager(rows, disk_dir)
    try:
        gc.collect()
        r = replay_engine(mgr, reqs, PER_STEP)
        reg = mgr.metrics.registry
        r["hits_host"] = sample_total(reg, "tiered_kv_lookup_hits_total", tier="host")
        r["hits_disk"] = sample_total(reg, "tiered_kv_lookup_hits_total", tier="disk")
        r["stores_shed"] = sample_total(reg, "tiered_kv_shed_total", kind="store")
        r["spills_shed"] = sample_total(reg, "tiered_kv_shed_total", kind="spill")
        r["disk_blocks_end"] = mgr.disk_blocks
    finally:
        mgr.close()
    return r


def bench_trace(quick: Union[bool, str] = False, seed: int = 0, trace: Optional[Union[str, Path]] = None,
                base_dir: Optional[str] = None, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Replay ``trace`` (default: :func:`default_trace`) host only, host+disk, and through the dict baseline.

    ``seed`` is unused (the trace fixes the order); it is accepted like every section's.
    Without a trace the section is skipped, saying why."""
    mode = as_mode(quick)
    plan = PLANS[mode]
    path = Path(trace) if trace is not None else default_trace()
    if path is None:
        return {"skipped": f"no trace: pass --trace PATH or set {_TRACE_ENV} (benchmarks/traces/{_TRACE_NAME} "
                           f"in a source checkout)"}
    requests = load_trace(path, plan["requests"])
    reqs = keys_of(requests)
    rows = PER_STEP * max(len(r) for r in reqs)
    repeats = int(plan["repeats"] or 1)
    systems = ("host", "disk", "dict")
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    scratch = Path(tempfile.mkdtemp(prefix="tkv-bench-trace-", dir=base_dir))
    try:
        with LoadMonitor() as lm:
            for rep in range(repeats):
                order = systems[rep % 3:] + systems[:rep % 3]
                for s in order:
                    if s == "dict":
                        gc.collect()
                        r = _dict_replay(reqs, HOST_SLOTS)
                    else:
                        d = scratch / f"disk-{rep}" if s == "disk" else None
                        r = _tkv_run(reqs, rows, d)
                        if d is not None:
                            shutil.rmtree(d, ignore_errors=True)
                    runs[s].append(r)
                    log(f"trace {rep + 1}/{repeats} {s}: {r['refs_per_s']:,.0f} refs/s")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out: dict[str, Any] = {
        "trace": str(path), "requests": len(reqs), "block_refs": sum(map(len, reqs)),
        "distinct_blocks": len({k for r in reqs for k in r}), "row_bytes": ROW_BYTES, "host_slots": HOST_SLOTS,
        "disk_slots": DISK_SLOTS, "per_step": PER_STEP, "device_rows": rows, "repeats": repeats, "runs": runs,
        "background_load": lm.result,
    }
    for s in systems:
        rs = runs[s]
        out[s] = {"refs_per_s": summarize([r["refs_per_s"] for r in rs], "refs/s"),
                  "refs_per_cpu_s": summarize([r["refs_per_cpu_s"] for r in rs], "refs/s"),
                  "hit_ratio": rs[0]["hits"] / rs[0]["refs"] if rs[0]["refs"] else float("nan")}
        if s == "disk":
            out[s]["hit_ratio_disk"] = rs[0]["hits_disk"] / rs[0]["refs"] if rs[0]["refs"] else float("nan")
            out[s]["spills_shed"] = [r["spills_shed"] for r in rs]
    return out


def format_trace(t: dict[str, Any]) -> str:
    """The section's own report (``tiered-kv bench`` details)."""
    if t.get("skipped"):
        return f"trace replay: skipped ({t['skipped']})"
    lines = [f"trace replay: {t['requests']} requests, {t['block_refs']:,} block references "
             f"({t['distinct_blocks']:,} distinct) from {t['trace']}; {t['row_bytes']}-byte rows, "
             f"{t['host_slots']} host slots, {t['disk_slots']} disk slots, {t['per_step']} requests per step, "
             f"median of {t['repeats']}"]
    for s, name in (("host", "host only"), ("disk", "host + disk"), ("dict", "OrderedDict LRU (baseline)")):
        x = t[s]
        more = (f" (on disk {x['hit_ratio_disk']:.3f}), spills shed per run {x['spills_shed']}"
                if s == "disk" else "")
        lines.append(f"  {name:28s} {x['refs_per_s']['median']:>10,.0f} refs/s  "
                     f"{x['refs_per_cpu_s']['median']:>10,.0f} refs/CPU s  hit ratio {x['hit_ratio']:.3f}{more}")
    return "\n".join(lines)
