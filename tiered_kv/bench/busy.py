"""The disk tier beside a busy engine thread (issue 26): does the disk keep up while the engine runs Python?

Owns one measurement, ``bench_busy``, in two parts, each run once per ``TieredKVConfig.disk_io``
(``"thread"``: the writer and readers are threads of the engine's process; ``"process"``: they
run in a child process).  Everything goes through the public API (``TierManager``,
``TieredKVConfig``), on 64 KiB rows of seeded random bytes in a CPU "device" tensor.

1. **Stores** (``rows``).  Each engine step: 16 ``store()`` calls from the device tensor, one
   ``wait(jobs)`` for them, ``free_block`` of the 16 rows, then the engine's own work for
   ``engine_ms``, then one ``poll()``.  The engine's work is either a ``time.sleep`` (a forward
   pass on a GPU releases the GIL: the *idle* engine thread) or busy Python (``_Scheduler``: a
   deterministic loop of dict and list operations until ``perf_counter`` passes the deadline, as
   a scheduler's bookkeeping holds the GIL).  Levels: sleep 5 ms, busy 5 ms, busy 20 ms.  A row
   runs for a fixed time (``duration_s``), write-through, ``durability="batch"``, a host tier of
   ``HOST_SLOTS`` and a disk tier twice that, a fresh directory per row; then ``flush()`` (with
   a timeout) and the counters are read from the manager's own registry: stores done, spills
   published (``tiered_kv_jobs_total{kind="spill",outcome="ok"}``), spills shed
   (``tiered_kv_shed_total{kind="spill"}``, in all and by reason), spills failed.  Per row:
   published / stores, MB/s published (bytes of the published spills over the time from the
   first store until ``flush()`` returned), and the engine thread's CPU time per step
   (``time.thread_time`` around the step's library calls only -- the stores, the wait, the
   frees and the poll, never the busy loop), mean and p99 over the steps after the plan's warm-up.
2. **Promotes** (``promote``).  A manager with a small host tier (``PROMOTE_HOST_SLOTS``) stores
   ``2 * samples`` keys followed by enough keys to push them all out of the host tier, and
   flushes: those keys are only on disk (page cache warm: the figure is about the GIL, not the
   device).  Then, per sample, ``load(key, row)`` and ``poll()`` (the end of the engine's step:
   the read starts at the next ``poll()``/``wait()``), the engine's work for 5 ms (sleep:
   *idle*; busy Python: *busy*), and ``wait([job])``.  Timed: ``after_us``, from the end of
   the sleep or busy phase until ``wait`` returns (what the engine waits for once its own work
   is done), and ``total_us``, from ``load`` until ``wait`` returns.  Idle and busy samples
   alternate (ABBA).  Every loaded row is compared with the bytes stored under its key.

When a manager with ``disk_io="process"`` cannot be made (or its run raises), the part records
the error string for that mode and goes on; ``disk_io="thread"`` errors propagate.  Each run also
records the child processes and threads its manager started (``/proc``), so a ``"process"`` run
that started no process is visible.  Nothing here asserts a timing; :mod:`.report` applies the
targets (``common.TARGETS``, the ``busy_*`` entries).
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from prometheus_client import CollectorRegistry

from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.core.disk_tier import capacity_for
from tiered_kv.metrics import SHED_REASONS, sample_total

from .common import KiB, LoadMonitor, as_mode, summarize

__all__ = ["bench_busy", "format_busy", "find_row", "PLANS", "ROW_BYTES", "STORES_PER_STEP", "HOST_SLOTS",
           "DISK_SLOTS", "ENGINES", "DISK_IO", "PROMOTE_ENGINE_MS"]

ROW_BYTES = 64 * KiB
STORES_PER_STEP = 16
HOST_SLOTS = 2048                 # 128 MiB of host tier
DISK_SLOTS = 2 * HOST_SLOTS       # 256 MiB of disk tier: it fills within seconds and then evicts
FLUSH_TIMEOUT_S = 60.0
PROMOTE_HOST_SLOTS = 256
PROMOTE_ENGINE_MS = 5.0
DISK_IO = ("thread", "process")
# (label, what the engine thread does between its calls, for how long)
ENGINES: tuple[tuple[str, str, float], ...] = (("sleep5", "sleep", 5.0), ("busy5", "busy", 5.0),
                                               ("busy20", "busy", 20.0))


PLANS: dict[str, dict[str, Any]] = {
    # seconds per store row, its first steps whose engine CPU time is not kept (their counts are),
    # promote samples per engine state (idle, busy) and disk_io mode
    "full": {"duration_s": 8.0, "warmup_steps": 20, "promote_samples": 300},
    "quick": {"duration_s": 1.5, "warmup_steps": 10, "promote_samples": 60},
    "smoke": {"duration_s": 0.3, "warmup_steps": 2, "promote_samples": 8},
}


# ----------------------------------------------------------------------------- the engine's own work
class _Scheduler:
    """Busy Python standing in for a scheduler's bookkeeping: deterministic dict and list work.

    ``run(seconds)`` works until ``perf_counter`` passes the deadline and returns how many
    rounds of 32 operations it made (the work done: fewer when the thread got less of the GIL)."""

    def __init__(self, seed: int) -> None:
        self.table: dict[int, int] = {}
        self.queue: list[tuple[int, int]] = []
        self.x = (seed * 2654435761 + 1) & 0x7FFFFFFF

    def run(self, seconds: float) -> int:
        pc = time.perf_counter
        deadline = pc() + seconds
        t, q, x = self.table, self.queue, self.x
        n = 0
        while pc() < deadline:
            for _ in range(32):
                x = (x * 1103515245 + 12345) & 0x7FFFFFFF
                k = x & 1023
                t[k] = t.get(k, 0) + 1
                q.append((k, x))
            if len(q) > 2048:
                q.sort()
                del q[:1024]
            n += 1
        self.x = x
        return n


def _engine_work(kind: str, ms: float, sched: _Scheduler) -> int:
    if kind == "sleep":
        time.sleep(ms / 1e3)
        return 0
    return sched.run(ms / 1e3)


# ----------------------------------------------------------------------------- what a manager started
def _child_pids() -> Optional[set[int]]:
    """This process's child processes (Linux ``/proc``; None elsewhere)."""
    out: set[int] = set()
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children", encoding="ascii") as f:
                out.update(int(p) for p in f.read().split())
    except (OSError, ValueError):
        return None
    return out


class _Started:
    """Child processes and threads that appeared while a manager was made."""

    def __enter__(self) -> "_Started":
        self.kids0, self.threads0 = _child_pids(), threading.active_count()
        return self

    def __exit__(self, *exc: Any) -> None:
        kids = _child_pids()
        self.child_processes = (len(kids - self.kids0) if kids is not None and self.kids0 is not None else None)
        self.threads = threading.active_count() - self.threads0


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _rows(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, ROW_BYTES), dtype=torch.uint8, generator=g)


def _spill_counts(reg: CollectorRegistry) -> dict[str, Any]:
    by = {r: sample_total(reg, "tiered_kv_shed_total", kind="spill", reason=r) for r in SHED_REASONS}
    return {
        "stores_done": sample_total(reg, "tiered_kv_jobs_total", kind="store", outcome="ok"),
        "stores_shed": sample_total(reg, "tiered_kv_shed_total", kind="store"),
        "stores_shed_by_reason": {r: v for r in SHED_REASONS
                                  if (v := sample_total(reg, "tiered_kv_shed_total", kind="store", reason=r))},
        "published": sample_total(reg, "tiered_kv_jobs_total", kind="spill", outcome="ok"),
        "spills_failed": sample_total(reg, "tiered_kv_jobs_total", kind="spill", outcome="failed"),
        "spills_cancelled": sample_total(reg, "tiered_kv_jobs_total", kind="spill", outcome="cancelled"),
        "shed": sample_total(reg, "tiered_kv_shed_total", kind="spill"),
        "shed_by_reason": {r: v for r, v in by.items() if v},
        "disk_evictions": sample_total(reg, "tiered_kv_evictions_total", tier="disk"),
        "disk_errors": sample_total(reg, "tiered_kv_errors_total", tier="disk"),
    }


# ----------------------------------------------------------------------------- part 1: stores
def _store_row(disk_io: str, engine: str, kind: str, ms: float, duration_s: float, warmup: int, seed: int,
               disk_dir: Path) -> dict[str, Any]:
    """One row of part 1; raises what making or running the manager raised."""
    dev = _rows(seed, STORES_PER_STEP)
    cfg = TieredKVConfig(namespace="bench/busy", host_capacity_bytes=HOST_SLOTS * ROW_BYTES, disk_path=disk_dir,
                         disk_capacity_bytes=DISK_SLOTS * ROW_BYTES, durability="batch", write_mode="through",
                         disk_io=disk_io)
    with _Started() as started:
        mgr = TierManager(cfg, dev, registry=CollectorRegistry())
    sched = _Scheduler(seed)
    tt, pc = time.thread_time_ns, time.perf_counter_ns
    cpu_us: list[float] = []
    wall_us: list[float] = []
    refused = steps = busy_rounds = 0
    busy_ns = 0
    rows = list(range(STORES_PER_STEP))
    flush_ok: Optional[bool] = None
    try:
        gc.collect()
        t_start = pc()
        end = t_start + int(duration_s * 1e9)
        n = 0
        while pc() < end:
            c0, w0 = tt(), pc()
            jobs = []
            for r in rows:
                j = mgr.store(b"busy:%d:%010d" % (seed, n), r)
                n += 1
                if j is None:
                    refused += 1
                else:
                    jobs.append(j)
            if jobs:
                mgr.wait(jobs)
            for r in rows:
                mgr.free_block(r)
            c1, w1 = tt(), pc()
            busy_rounds += _engine_work(kind, ms, sched)
            w2 = pc()
            busy_ns += w2 - w1
            c2 = tt()
            mgr.poll()
            c3, w3 = tt(), pc()
            if steps >= warmup:
                cpu_us.append((c1 - c0 + c3 - c2) / 1e3)
                wall_us.append((w1 - w0 + w3 - w2) / 1e3)
            steps += 1
        t_run = pc()
        flush_ok = mgr.flush(timeout=FLUSH_TIMEOUT_S)
        t_flush = pc()
        counts = _spill_counts(mgr.metrics.registry)
        disk_blocks = mgr.disk_blocks
    finally:
        mgr.close()
    stores = counts["stores_done"]
    out: dict[str, Any] = {
        "disk_io": disk_io, "engine": engine, "engine_kind": kind, "engine_ms": ms, "error": None,
        "child_processes_started": started.child_processes, "threads_started": started.threads,
        "steps": steps, "stores_refused": refused, "run_s": (t_run - t_start) / 1e9,
        "flush_s": (t_flush - t_run) / 1e9, "flush_ok": flush_ok, "disk_blocks_at_end": disk_blocks, **counts,
        "published_fraction": counts["published"] / stores if stores else float("nan"),
        "offered_mb_s": stores * ROW_BYTES / 1e6 / ((t_run - t_start) / 1e9),
        "written_mb_s": counts["published"] * ROW_BYTES / 1e6 / ((t_flush - t_start) / 1e9),
        "engine_cpu_us": summarize(cpu_us, "us"), "engine_wall_us": summarize(wall_us, "us"),
        "engine_work_ms_mean": busy_ns / 1e6 / steps if steps else float("nan"),
        "busy_rounds_per_ms": busy_rounds / (busy_ns / 1e6) if kind == "busy" and busy_ns else None,
    }
    return out


# ----------------------------------------------------------------------------- part 2: promotes
def _promote_run(disk_io: str, samples: int, seed: int, disk_dir: Path) -> dict[str, Any]:
    """Part 2 for one ``disk_io``; raises what making or running the manager raised."""
    src_n = STORES_PER_STEP
    dev = torch.zeros(2 * src_n, ROW_BYTES, dtype=torch.uint8)
    dev[:src_n] = _rows(seed + 7, src_n)
    src = dev[:src_n].clone()          # what each key holds: key i holds source row i % src_n
    cold = 2 * samples
    total = cold + PROMOTE_HOST_SLOTS + 2 * src_n
    total += -total % src_n
    cfg = TieredKVConfig(namespace="bench/busy-promote", host_capacity_bytes=PROMOTE_HOST_SLOTS * ROW_BYTES,
                         durability="batch", write_mode="through", disk_io=disk_io)
    # a disk tier that holds every key stored (its write batches' room on top): none is evicted before its load
    cfg = cfg.replace(disk_path=disk_dir, disk_capacity_bytes=capacity_for(cfg, ROW_BYTES, total))
    keys = [b"busy-promote:%d:%08d" % (seed, i) for i in range(total)]
    with _Started() as started:
        mgr = TierManager(cfg, dev, registry=CollectorRegistry())
    sched = _Scheduler(seed + 1)
    pc = time.perf_counter_ns
    res: dict[str, dict[str, list[float]]] = {s: {"after_us": [], "total_us": []} for s in ("idle", "busy")}
    misses = failed = bad = in_host = 0
    try:
        # fill: every key stored and spilled; the first ``cold`` keys then live only on disk
        rows = list(range(src_n))
        for step in range(total // src_n):
            jobs = [j for r in rows if (j := mgr.store(keys[step * src_n + r], r)) is not None]
            mgr.wait(jobs)
            for r in rows:
                mgr.free_block(r)
            mgr.poll()
            if step % 8 == 7:          # keep the writer's queue (writer_queue_blocks) from shedding
                mgr.flush(timeout=FLUSH_TIMEOUT_S)
        fill_flush_ok = mgr.flush(timeout=FLUSH_TIMEOUT_S)
        fill = _spill_counts(mgr.metrics.registry)
        gc.collect()
        for i in range(cold):
            state = "idle" if (i % 4) in (0, 3) else "busy"     # ABBA
            key = keys[i]
            if mgr.host_bytes(key) is not None:
                in_host += 1
                continue
            row = src_n + i % src_n
            dev[row].zero_()           # untimed: a load that never lands here is a wrong row below
            t0 = pc()
            job = mgr.load(key, row)
            if job is None:
                misses += 1
                continue
            mgr.poll()
            _engine_work("sleep" if state == "idle" else "busy", PROMOTE_ENGINE_MS, sched)
            t1 = pc()
            got = mgr.wait([job], timeout=FLUSH_TIMEOUT_S)
            t2 = pc()
            if not job.done or any(c.job is job and not c.ok for c in got):
                failed += 1
                continue
            res[state]["after_us"].append((t2 - t1) / 1e3)
            res[state]["total_us"].append((t2 - t0) / 1e3)
            bad += not torch.equal(dev[row], src[i % src_n])
        promotes = sample_total(mgr.metrics.registry, "tiered_kv_jobs_total", kind="promote", outcome="ok")
    finally:
        mgr.close()
    out: dict[str, Any] = {
        "disk_io": disk_io, "error": None, "child_processes_started": started.child_processes,
        "threads_started": started.threads, "keys_stored": total, "keys_only_on_disk": cold,
        "fill_flush_ok": fill_flush_ok, "fill_spills_published": fill["published"], "fill_spills_shed": fill["shed"],
        "loads_tried": cold, "misses": misses, "failed": failed, "bad_rows": bad, "already_in_host": in_host,
        "promotes_ok": promotes,
    }
    for s in ("idle", "busy"):
        out[s] = {k: summarize(v, "us") for k, v in res[s].items()}
    for stat, q in (("p50", "median"), ("p99", "p99")):
        i, b = out["idle"]["after_us"][q], out["busy"]["after_us"][q]
        out[f"after_ratio_{stat}"] = b / i if i and i == i and b == b else float("nan")
        i, b = out["idle"]["total_us"][q], out["busy"]["total_us"][q]
        out[f"total_ratio_{stat}"] = b / i if i and i == i and b == b else float("nan")
    return out


# ----------------------------------------------------------------------------- the section
def _guarded(disk_io: str, fn: Callable[[], dict[str, Any]], what: dict[str, Any]) -> dict[str, Any]:
    """``fn()``; for ``disk_io="process"`` an exception becomes ``what`` with its error string."""
    if disk_io != "process":
        return fn()
    try:
        return fn()
    except Exception as exc:   # the process mode is being built: record why, measure the rest
        return {**what, "disk_io": disk_io, "error": _error(exc)}


def bench_busy(quick: Union[bool, str] = False, seed: int = 0, base_dir: Optional[str] = None,
               log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Parts 1 and 2 of the module doc, for ``disk_io`` "thread" and "process"."""
    mode = as_mode(quick)
    plan = PLANS[mode]
    scratch = Path(tempfile.mkdtemp(prefix="tkv-bench-busy-", dir=base_dir))
    rows: list[dict[str, Any]] = []
    promote: dict[str, dict[str, Any]] = {}
    try:
        with LoadMonitor() as lm:
            for li, (engine, kind, ms) in enumerate(ENGINES):
                for io in (DISK_IO if li % 2 == 0 else DISK_IO[::-1]):
                    d = scratch / f"{io}-{engine}"

                    def one() -> dict[str, Any]:
                        return _store_row(io, engine, kind, ms, plan["duration_s"], plan["warmup_steps"], seed + li, d)

                    r = _guarded(io, one, {"engine": engine, "engine_kind": kind, "engine_ms": ms})
                    shutil.rmtree(d, ignore_errors=True)
                    rows.append(r)
                    log(f"{io} {engine}: " + (f"error {r['error']}" if r.get("error") else
                                              f"{r['published']:,.0f} of {r['stores_done']:,.0f} stores published, "
                                              f"{r['shed']:,.0f} shed, engine CPU "
                                              f"{r['engine_cpu_us']['mean']:.0f} us/step"))
            for io in DISK_IO:
                d = scratch / f"{io}-promote"

                def prom() -> dict[str, Any]:
                    return _promote_run(io, plan["promote_samples"], seed, d)

                p = _guarded(io, prom, {})
                shutil.rmtree(d, ignore_errors=True)
                promote[io] = p
                log(f"{io} promote: " + (f"error {p['error']}" if p.get("error") else
                                         f"after busy/sleep p50 {p['busy']['after_us']['median']:.0f} / "
                                         f"{p['idle']['after_us']['median']:.0f} us"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "mode": mode, "row_bytes": ROW_BYTES, "stores_per_step": STORES_PER_STEP, "host_slots": HOST_SLOTS,
        "disk_slots": DISK_SLOTS, "durability": "batch", "duration_s": plan["duration_s"],
        "warmup_steps": plan["warmup_steps"], "promote_host_slots": PROMOTE_HOST_SLOTS,
        "promote_engine_ms": PROMOTE_ENGINE_MS, "promote_samples": plan["promote_samples"],
        "rows": rows, "promote": promote, "background_load": lm.result,
    }


def find_row(r: dict[str, Any], disk_io: str, engine: str) -> Optional[dict[str, Any]]:
    """The row of part 1 for ``disk_io`` and ``engine`` (a label of ``ENGINES``), or None."""
    return next((x for x in r.get("rows", []) if x.get("disk_io") == disk_io and x.get("engine") == engine), None)


def format_busy(r: dict[str, Any]) -> str:
    """The section's own report (``tiered-kv bench`` details)."""
    lines = [f"busy engine: {r['stores_per_step']} store() of {r['row_bytes'] // KiB} KiB + wait + free_block, the "
             f"engine's work (sleep or busy Python), poll(); host {r['host_slots']} slots + disk {r['disk_slots']} "
             f"slots, durability={r['durability']}, {r['duration_s']:g} s per row",
             f"  {'disk_io':8s}{'engine':8s}{'steps':>7}{'stores':>9}{'published':>11}{'shed':>7}{'fraction':>10}"
             f"{'MB/s':>8}{'CPU us/step':>13}{'p99':>8}{'children':>10}"]
    for x in r["rows"]:
        if x.get("error"):
            lines.append(f"  {x['disk_io']:8s}{x['engine']:8s}  error: {x['error']}")
            continue
        lines.append(f"  {x['disk_io']:8s}{x['engine']:8s}{x['steps']:7d}{x['stores_done']:9,.0f}"
                     f"{x['published']:11,.0f}{x['shed']:7,.0f}{x['published_fraction']:10.3f}{x['written_mb_s']:8.0f}"
                     f"{x['engine_cpu_us']['mean']:13.0f}{x['engine_cpu_us']['p99']:8.0f}"
                     f"{str(x['child_processes_started']):>10}")
        extra = []
        if x["shed_by_reason"]:
            extra.append("spills shed by reason " + ", ".join(f"{k} {v:,.0f}" for k, v in x["shed_by_reason"].items()))
        if x["stores_refused"]:
            extra.append(f"stores refused {x['stores_refused']} ({x['stores_shed_by_reason']})")
        if x["spills_failed"] or x["disk_errors"]:
            extra.append(f"spills failed {x['spills_failed']:,.0f}, disk errors {x['disk_errors']:,.0f}")
        if not x["flush_ok"]:
            extra.append(f"flush() did not finish within {FLUSH_TIMEOUT_S:g} s")
        if x.get("busy_rounds_per_ms") is not None:
            extra.append(f"busy loop {x['busy_rounds_per_ms']:.0f} rounds/ms")
        extra.append(f"flush {x['flush_s'] * 1e3:.0f} ms, disk evictions {x['disk_evictions']:,.0f}")
        lines.append("  " + " " * 16 + "; ".join(extra))
    lines.append(f"  one load from disk: load + poll, {r['promote_engine_ms']:g} ms sleep (idle) or busy Python, "
                 f"wait; {r['promote_samples']} loads each, host tier {r['promote_host_slots']} slots, page cache warm")
    for io, p in r["promote"].items():
        if p.get("error"):
            lines.append(f"  {io:8s}error: {p['error']}")
            continue
        for s in ("idle", "busy"):
            a, t = p[s]["after_us"], p[s]["total_us"]
            lines.append(f"  {io:8s}{s:6s} after the work us p50 {a['median']:7.0f}  p99 {a['p99']:7.0f}   "
                         f"load..wait us p50 {t['median']:7.0f}  p99 {t['p99']:7.0f}   (n {a['n']})")
        lines.append(f"  {io:8s}busy/idle after the work: p50 {p['after_ratio_p50']:.2f}x, "
                     f"p99 {p['after_ratio_p99']:.2f}x; "
                     f"misses {p['misses']}, failed {p['failed']}, wrong rows {p['bad_rows']}, already in host "
                     f"{p['already_in_host']}, children {p['child_processes_started']}")
    return "\n".join(lines)
