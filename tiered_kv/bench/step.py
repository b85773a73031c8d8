"""A realistic engine step through the batched API, with the disk tier on: the engine thread's cost.

Owns one measurement, ``bench_step``.  Each engine step makes the calls a prefix-caching
scheduler makes for a batch of requests:

* 32 ``lookup()`` calls of 16 keys each (one per request of the batch: how much of its prefix
  is cached);
* one ``load_many()`` of 64 keys (the cached blocks of the requests that hit) into device rows;
  some are in the host tier, some only on disk (a promote starts);
* one ``store_many()`` of 64 keys (the blocks the engine computed this step);
* one ``poll()``;

then the engine "computes" for ``compute_s`` (a sleep: in a serving engine the forward pass runs
on the GPU with the GIL released).  Rows are tiny (``ROW_BYTES``), so the figure is the control
path's cost, not the copies'; the default mover copies and the disk writer spills every stored
block (write-through) in their own threads meanwhile.

The keys: requests are chains of 16 keys.  Each step stores four new chains (64 keys); lookups
pick chains by a Zipf-like popularity over every chain stored so far, so popular old chains hit,
and once the host tier has turned over, many hit only on disk.  The step's ``load_many`` takes
the keys of the looked-up chains that are fully cached, 64 of them; its rows rotate over
``LOAD_GROUPS`` groups, and a step whose group is still busy with an earlier load skips its load
(counted).

Figure: the engine thread's CPU time per step (``time.thread_time``: what the calls cost the
scheduler, not time waiting for the GIL or a core), mean over the steps, with the wall time
beside.  A step's keys are made before its clocks are read (``_Workload.prepare``), and the garbage
collector's runs on the engine thread during the timed steps are timed (:class:`.common.GcClock`):
part of the figure, given apart in its note.  Baseline: the same step's calls on the unsafe plain-dict original
(:class:`.core.UnsafeDictOffloader`: no tokens, leases, fences, tombstones, metrics or disk tier,
answers at once without copying) -- the bookkeeping floor.  Nothing here asserts a timing;
:mod:`.report` applies the target.
"""

from __future__ import annotations

import collections
import gc
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from prometheus_client import CollectorRegistry

from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.metrics import sample_total

from .common import GcClock, LoadMonitor, as_mode, summarize
from .core import UnsafeDictOffloader

__all__ = ["bench_step", "format_step", "bench_copy_step", "format_copy_step", "gc_note", "PLANS", "ROW_BYTES", "LOOKUPS", "KEYS_PER_LOOKUP", "STORES", "LOADS"]

ROW_BYTES = 256
LOOKUPS, KEYS_PER_LOOKUP, STORES, LOADS = 32, 16, 64, 64
LOAD_GROUPS = 4
HOST_SLOTS = 4096            # 64 steps of stores: older chains are only on disk
DISK_SLOTS = 16 * HOST_SLOTS

PLANS: dict[str, dict[str, Any]] = {
    # steps timed, steps discarded first (the host tier fills, the disk tier starts writing), compute per step
    "full": {"steps": 3000, "warmup": 200, "repeats": 3, "compute_s": 0.002},
    "quick": {"steps": 600, "warmup": 100, "repeats": 1, "compute_s": 0.002},
    "smoke": {"steps": 40, "warmup": 10, "repeats": 1, "compute_s": 0.0005},
}


class _Workload:
    """The step's keys, the same for tiered_kv and the baseline (seeded).  :meth:`prepare` makes a
    step's keys before the step is timed: the figure is the calls' cost, not the bench's."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.chains: list[list[bytes]] = []
        self._n = 0
        self.picked: list[list[bytes]] = []   # this step's lookups, a chain each
        self.new: list[bytes] = []            # this step's stores: the keys of STORES // KEYS_PER_LOOKUP new chains

    def new_chains(self, n: int) -> list[list[bytes]]:
        out = []
        for _ in range(n):
            c = [b"step:%012d:%02d" % (self._n, i) for i in range(KEYS_PER_LOOKUP)]
            self._n += 1
            out.append(c)
        return out

    def pick(self, n: int) -> list[list[bytes]]:
        """``n`` chains stored at least two steps ago, popular ones (Zipf-like over their age rank) first."""
        chains = self.chains
        m = len(chains) - 8   # the pool: all but the last 8 chains
        if m <= 0:
            return []
        rnd = self.rng.random
        # rank r with probability ~ 1/(r+1): r = m**u - 1 for uniform u (a log-uniform rank)
        return [chains[m - int(m ** rnd())] for _ in range(n)]

    def prepare(self) -> None:
        """The next step's lookups and new keys (the new chains join the pool)."""
        self.picked = self.pick(LOOKUPS)
        new = self.new_chains(STORES // KEYS_PER_LOOKUP)
        self.new = [k for c in new for k in c]
        self.chains += new


def _tkv_step(mgr: TierManager, w: _Workload, step: int, load_jobs: list[Any], counts: dict[str, int]) -> None:
    lookup = mgr.lookup
    full: list[bytes] = []
    seen: set[int] = set()   # two requests of a batch may share a chain: load it once
    for c in w.picked:
        if lookup(c) == KEYS_PER_LOOKUP and len(full) < LOADS and id(c) not in seen:
            seen.add(id(c))
            full += c
    g = step % LOAD_GROUPS
    if len(full) >= LOADS:
        prev = load_jobs[g]
        if prev is not None and not prev.done:
            counts["loads_skipped_busy"] += 1
        else:
            base = STORES + g * LOADS
            job = mgr.load_many(full[:LOADS], list(range(base, base + LOADS)))
            load_jobs[g] = job
            counts["loads" if job is not None else "loads_none"] += 1
    else:
        counts["loads_too_few_hits"] += 1
    job = mgr.store_many(w.new, list(range(STORES)))
    counts["stores" if job is not None else "stores_none"] += 1
    mgr.poll()


def _base_step(base: UnsafeDictOffloader, w: _Workload, step: int, counts: dict[str, int]) -> None:
    full: list[bytes] = []
    seen: set[int] = set()
    for c in w.picked:
        if base.lookup(c) == KEYS_PER_LOOKUP and len(full) < LOADS and id(c) not in seen:
            seen.add(id(c))
            full += c
    if len(full) >= LOADS:
        g = step % LOAD_GROUPS
        b0 = STORES + g * LOADS
        for i, k in enumerate(full[:LOADS]):
            base.load(k, b0 + i)
        counts["loads"] += 1
    else:
        counts["loads_too_few_hits"] += 1
    for i, k in enumerate(w.new):
        base.store(k, i)
    counts["stores"] += 1
    base.poll()


def _timed_steps(one: Callable[[int], None], warmup: int, steps: int, counts: dict[str, int],
                 between: Callable[[], None], prepare: Optional[Callable[[], None]] = None
                 ) -> tuple[list[float], list[float], dict[str, Any]]:
    """``one(s)`` for ``warmup + steps`` steps, ``prepare()`` before each (untimed: the step's inputs),
    ``between()`` after each (the engine's compute); the engine thread's CPU and wall microseconds of each
    step after the warm-up (``counts`` zeroed then), and the garbage collector's runs on the engine
    thread during those steps (:meth:`.common.GcClock.summary`: included in the steps' times)."""
    cpu_us: list[float] = []
    wall_us: list[float] = []
    tt, pc = time.thread_time_ns, time.perf_counter_ns
    gc.collect()
    with GcClock() as clock:
        for s in range(warmup + steps):
            if s == warmup:
                for k in counts:
                    counts[k] = 0
            if prepare is not None:
                prepare()
            clock.on = s >= warmup
            c0, t0 = tt(), pc()
            one(s)
            c1, t1 = tt(), pc()
            clock.on = False
            if s >= warmup:
                cpu_us.append((c1 - c0) / 1e3)
                wall_us.append((t1 - t0) / 1e3)
            between()
    return cpu_us, wall_us, clock.summary(steps)


def _run(system: str, seed: int, steps: int, warmup: int, compute_s: float, disk_dir: Optional[Path]) -> dict[str, Any]:
    w = _Workload(seed)
    counts = {"loads": 0, "loads_none": 0, "loads_skipped_busy": 0, "loads_too_few_hits": 0,
              "stores": 0, "stores_none": 0}
    mgr: Optional[TierManager] = None
    if system == "tkv":
        cfg = TieredKVConfig(namespace="bench/step", host_capacity_bytes=HOST_SLOTS * ROW_BYTES,
                             disk_path=disk_dir, disk_capacity_bytes=DISK_SLOTS * ROW_BYTES)
        rows = STORES + LOAD_GROUPS * LOADS
        mgr = TierManager(cfg, torch.zeros(rows, ROW_BYTES, dtype=torch.uint8), registry=CollectorRegistry())
        load_jobs: list[Any] = [None] * LOAD_GROUPS

        def one(s: int) -> None:
            _tkv_step(mgr, w, s, load_jobs, counts)   # type: ignore[arg-type]
    else:
        base = UnsafeDictOffloader(HOST_SLOTS)

        def one(s: int) -> None:
            _base_step(base, w, s, counts)
    try:
        cpu_us, wall_us, gcs = _timed_steps(one, warmup, steps, counts, lambda: time.sleep(compute_s), w.prepare)
        out: dict[str, Any] = {"cpu_us": summarize(cpu_us, "us"), "wall_us": summarize(wall_us, "us"),
                               "counts": counts, "gc": gcs}
        if mgr is not None:
            mgr.wait(timeout=60)
            reg = mgr.metrics.registry
            out["hits_host"] = sample_total(reg, "tiered_kv_lookup_hits_total", tier="host")
            out["hits_disk"] = sample_total(reg, "tiered_kv_lookup_hits_total", tier="disk")
            out["promotes_ok"] = sample_total(reg, "tiered_kv_jobs_total", kind="promote", outcome="ok")
            out["spills_ok"] = sample_total(reg, "tiered_kv_jobs_total", kind="spill", outcome="ok")
            out["spills_shed"] = sample_total(reg, "tiered_kv_shed_total", kind="spill")
            out["loads_failed"] = sample_total(reg, "tiered_kv_jobs_total", kind="load", outcome="failed")
        return out
    finally:
        if mgr is not None:
            mgr.close()


def bench_step(quick: Union[bool, str] = False, seed: int = 0, base_dir: Optional[str] = None,
               log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The step of the module doc on tiered_kv (host + disk tier) and on the dict original, alternating."""
    plan = PLANS[as_mode(quick)]
    runs: dict[str, list[dict[str, Any]]] = {"tkv": [], "dict": []}
    scratch = Path(tempfile.mkdtemp(prefix="tkv-bench-step-", dir=base_dir))
    try:
        with LoadMonitor() as lm:
            for rep in range(plan["repeats"]):
                for s in (("tkv", "dict") if rep % 2 == 0 else ("dict", "tkv")):
                    d = scratch / f"disk-{rep}" if s == "tkv" else None
                    r = _run(s, seed + rep, plan["steps"], plan["warmup"], plan["compute_s"], d)
                    if d is not None:
                        shutil.rmtree(d, ignore_errors=True)
                    runs[s].append(r)
                    log(f"step {rep + 1}/{plan['repeats']} {s}: mean {r['cpu_us']['mean']:.1f} us CPU per step")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def med(s: str, what: str, stat: str) -> float:
        xs = sorted(r[what][stat] for r in runs[s])
        return xs[len(xs) // 2]

    out: dict[str, Any] = {
        "row_bytes": ROW_BYTES, "lookups": LOOKUPS, "keys_per_lookup": KEYS_PER_LOOKUP, "stores": STORES,
        "loads": LOADS, "host_slots": HOST_SLOTS, "disk_slots": DISK_SLOTS, "steps": plan["steps"],
        "warmup_steps": plan["warmup"], "repeats": plan["repeats"], "compute_s": plan["compute_s"],
        "runs": runs, "background_load": lm.result,
    }
    for s in runs:
        out[s] = {"cpu_us_mean": med(s, "cpu_us", "mean"), "cpu_us_p50": med(s, "cpu_us", "median"),
                  "cpu_us_p99": med(s, "cpu_us", "p99"), "wall_us_mean": med(s, "wall_us", "mean"),
                  "wall_us_p99": med(s, "wall_us", "p99"), **_gc_totals(runs[s])}
    return out


def _gc_totals(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The collector's share of the engine thread over a mode's runs: the median CPU us per step, and the
    full (generation 2) collections of all runs, counted, and the longest."""
    return {"gc_us_per_step": _median(r["gc"]["us_per_step"] for r in runs),
            "gc_full_runs": sum(r["gc"]["gen2"]["runs"] for r in runs),
            "gc_full_max_us": max(r["gc"]["gen2"]["max_us"] for r in runs)}


def format_step(r: dict[str, Any]) -> str:
    """The section's own report (``tiered-kv bench`` details)."""
    lines = [f"engine step: {r['lookups']} lookup() of {r['keys_per_lookup']} keys, load_many({r['loads']}), "
             f"store_many({r['stores']}), poll(); {r['row_bytes']}-byte rows, host {r['host_slots']} slots + disk "
             f"{r['disk_slots']} slots; {r['steps']} steps after {r['warmup_steps']} discarded, "
             f"{r['compute_s'] * 1e3:g} ms compute (sleep) per step, median of {r['repeats']} runs"]
    for s, name in (("tkv", "tiered_kv, host + disk"), ("dict", "dict original (baseline)")):
        x = r[s]
        lines.append(f"  {name:26s} CPU us/step mean {x['cpu_us_mean']:7.1f}  p50 {x['cpu_us_p50']:7.1f}  "
                     f"p99 {x['cpu_us_p99']:7.1f}   wall us/step mean {x['wall_us_mean']:7.1f}  p99 {x['wall_us_p99']:7.1f}"
                     f"{_gc_text(x)}")
    t = r["runs"]["tkv"][0]
    c = t["counts"]
    lines.append(f"  tiered_kv run 1: loads {c['loads']} (busy rows skipped {c['loads_skipped_busy']}, "
                 f"too few hits {c['loads_too_few_hits']}, refused {c['loads_none']}), stores {c['stores']} "
                 f"(refused {c['stores_none']}); lookup hits host {t['hits_host']:,.0f}, disk {t['hits_disk']:,.0f}; "
                 f"promotes {t['promotes_ok']:,.0f}; spills {t['spills_ok']:,.0f}, shed {t['spills_shed']:,.0f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- issue 25: a step's copies
COPY_ROW_BYTES = 64 * 1024
"""A 16-token block of one layer of an 8-KV-head, 128-dim bf16 model."""
COPY_LAG = 8                 # a step loads the keys stored this many steps before (their copies landed)
COPY_HOST_STEPS = 32         # the host tier holds this many steps of stores: it is full and evicts
COPY_MODES = ("batched", "threads", "per_block", "dict")
"""``batched``: store_many/load_many, the default CPU mover (native); ``threads``: the same on the Python copy
threads (``cpu_mover="threads"``); ``per_block``: store()/load() per block; ``dict``: the unsafe original."""
COPY_PLANS: dict[str, dict[str, Any]] = {
    "full": {"steps": 1500, "warmup": 150, "repeats": 3, "compute_s": 0.002},
    "quick": {"steps": 500, "warmup": 100, "repeats": 1, "compute_s": 0.002},
    "smoke": {"steps": 30, "warmup": 10, "repeats": 1, "compute_s": 0.0005},
}


def _spin(seconds: float, junk: list[int]) -> None:
    """Compute in Python for ``seconds``: the GIL held, the caches filled with other data."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(junk[::7])


def _copy_run(mode: str, seed: int, steps: int, warmup: int, compute_s: float, busy: bool) -> dict[str, Any]:
    """One run of the copy step: ``STORES`` stores and ``LOADS`` loads of ``COPY_ROW_BYTES`` rows per step."""
    from tiered_kv.movers import ThreadMover, Transfer
    from tiered_kv.jobs import JobKind

    rows = STORES + LOAD_GROUPS * LOADS
    kv = torch.zeros((rows, COPY_ROW_BYTES), dtype=torch.uint8)
    kv[:STORES].copy_((torch.arange(STORES) + 1).to(torch.uint8).unsqueeze(1).expand(STORES, COPY_ROW_BYTES))
    counts = {"stores": 0, "stores_none": 0, "loads": 0, "loads_none": 0, "loads_skipped_busy": 0}
    slots = COPY_HOST_STEPS * STORES
    mgr: Optional[TierManager] = None
    base: Optional[UnsafeDictOffloader] = None
    base_mover: Optional[ThreadMover] = None
    stored: collections.deque[list[bytes]] = collections.deque(maxlen=COPY_LAG)   # the last steps' keys
    pending: list[Any] = [None] * LOAD_GROUPS   # per group of load rows: its last load (job, or list of jobs)
    if mode == "dict":
        base = UnsafeDictOffloader(slots)
        base_mover = ThreadMover([(kv, torch.zeros((slots, COPY_ROW_BYTES), dtype=torch.uint8))], base.queue)
        b = base

        def submit(job_id: int, block: int, slot: int) -> None:
            kind = JobKind.LOAD if job_id in b.loading else JobKind.STORE
            base_mover.submit(Transfer(job_id, kind, [block], [slot]))   # type: ignore[union-attr]

        base._submit = submit
    else:
        cfg = TieredKVConfig(namespace="bench/copy-step", host_capacity_bytes=slots * COPY_ROW_BYTES,
                             cpu_mover="threads" if mode == "threads" else "native")
        mgr = TierManager(cfg, kv, registry=CollectorRegistry())
    # nothing finished is kept: a run holds what an engine would (kept jobs would feed the garbage collector)
    store: Callable[[bytes, int], Any]
    load: Callable[[bytes, int], Any]
    poll: Callable[[], Any]
    unreported: Callable[[Any], bool]   # a load not yet reported
    if base is not None:
        store, load, poll = base.store, base.load, base.poll_reports
        unreported = base.loading.__contains__
    else:
        assert mgr is not None
        store, load, poll = mgr.store, mgr.load, mgr.poll

        def unreported(j: Any) -> bool:
            return not j.done

    made: list[tuple[list[bytes], list[int]]] = []   # the step's keys and load rows, made before it is timed
    step = iter(range(1 << 62))

    def prepare() -> None:
        s = next(step)
        g = s % LOAD_GROUPS
        made[:] = [([b"c:%d:%d:%02d" % (seed, s, i) for i in range(STORES)],
                    list(range(STORES + g * LOADS, STORES + (g + 1) * LOADS)))]

    def one(s: int) -> None:
        (keys, dst), = made
        g = s % LOAD_GROUPS
        src = stored[0] if len(stored) == COPY_LAG else None
        prev = pending[g]
        busy_rows = prev is not None and (any(map(unreported, prev)) if type(prev) is list else unreported(prev))
        if mode in ("batched", "threads"):
            assert mgr is not None
            if src is not None and busy_rows:
                counts["loads_skipped_busy"] += 1
            elif src is not None:
                job = mgr.load_many(src, dst)
                pending[g] = job
                counts["loads" if job is not None else "loads_none"] += 1
            job = mgr.store_many(keys, list(range(STORES)))
            counts["stores" if job is not None else "stores_none"] += 1
            mgr.poll()
        else:   # one store() and load() per block, on tiered_kv or on the dict original
            if src is not None and busy_rows:
                counts["loads_skipped_busy"] += 1
            elif src is not None:
                jobs = [load(k, r) for k, r in zip(src, dst)]
                pending[g] = [j for j in jobs if j is not None]
                counts["loads"] += len(pending[g])
                counts["loads_none"] += len(jobs) - len(pending[g])
            for i, k in enumerate(keys):
                counts["stores" if store(k, i) is not None else "stores_none"] += 1
            poll()
        stored.append(keys)

    junk = list(range(200_000))
    try:
        cpu_us, _, gcs = _timed_steps(one, warmup, steps, counts,
                                      (lambda: _spin(compute_s, junk)) if busy else (lambda: time.sleep(compute_s)),
                                      prepare)
        out: dict[str, Any] = {"cpu_us": summarize(cpu_us, "us"), "counts": counts, "gc": gcs}
        if mgr is not None:
            out["mover"] = type(mgr._mover).__name__
            reg = mgr.metrics.registry
            out["copy_failed"] = sample_total(reg, "tiered_kv_jobs_total", outcome="failed")
            out["bad_rows"], out["rows_checked"] = _check_loads(mgr, kv, stored[-1], mode != "per_block")
        return out
    finally:
        if mgr is not None:
            mgr.close()
        if base_mover is not None:
            base_mover.close()


def _check_loads(mgr: TierManager, kv: torch.Tensor, keys: list[bytes], batched: bool) -> tuple[int, int]:
    """After a copy-step run, untimed: each load group's rows zeroed, ``keys`` (the last step's, key ``i``
    stored from row ``i``: every byte ``i + 1``) loaded into them the run's way and compared; (rows with
    wrong bytes, rows checked).  A load that missed or failed checks nothing (it is counted elsewhere)."""
    mgr.wait()
    bad = checked = 0
    for g in range(LOAD_GROUPS):
        first = STORES + g * LOADS
        n = min(LOADS, len(keys))
        kv[first:first + n].zero_()
        rows = list(range(first, first + n))
        asked: list[tuple[Any, list[int]]] = []   # (job, the rows this bench asked it to fill)
        if batched:
            one = mgr.load_many(keys[:n], rows)
            asked = [] if one is None else [(one, list(range(n)))]
        else:
            asked = [(j, [i]) for i, j in enumerate(mgr.load(k, r) for k, r in zip(keys[:n], rows)) if j is not None]
        ok = {id(c.job) for c in mgr.wait([j for j, _ in asked]) if c.ok}
        for j, idx in asked:
            if id(j) in ok:
                for i in idx:
                    checked += 1
                    bad += not bool((kv[rows[i]] == i + 1).all())
    return bad, checked


def bench_copy_step(quick: Union[bool, str] = False, seed: int = 0,
                    log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Issue 25: the engine thread's CPU per step of ``STORES`` stores and ``LOADS`` loads of 64 KiB rows,
    copies on, through the batched API (the default CPU mover, and the Python copy threads), the per-block
    API and the unsafe dict original (its own copy workers, one transfer per block), with the engine
    sleeping or busy in Python between steps; the modes alternate run by run."""
    plan = COPY_PLANS[as_mode(quick)]
    out: dict[str, Any] = {"row_bytes": COPY_ROW_BYTES, "stores": STORES, "loads": LOADS, "lag_steps": COPY_LAG,
                           "host_slots": COPY_HOST_STEPS * STORES, "steps": plan["steps"],
                           "warmup_steps": plan["warmup"], "repeats": plan["repeats"], "compute_s": plan["compute_s"],
                           "runs": {}}
    with LoadMonitor() as lm:
        for compute in ("sleep", "busy"):
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in COPY_MODES}
            for rep in range(plan["repeats"]):
                for m in (COPY_MODES if rep % 2 == 0 else COPY_MODES[::-1]):
                    r = _copy_run(m, seed + rep, plan["steps"], plan["warmup"], plan["compute_s"], compute == "busy")
                    runs[m].append(r)
                    log(f"copy step {compute} {rep + 1}/{plan['repeats']} {m}: mean {r['cpu_us']['mean']:.1f} us CPU")
            out["runs"][compute] = runs
            out[compute] = {m: {"cpu_us_mean": _median(r["cpu_us"]["mean"] for r in runs[m]),
                                "cpu_us_p50": _median(r["cpu_us"]["median"] for r in runs[m]),
                                "cpu_us_p99": _median(r["cpu_us"]["p99"] for r in runs[m]),
                                **_gc_totals(runs[m])} for m in COPY_MODES}
    out["background_load"] = lm.result
    return out


def _median(xs: Any) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def format_copy_step(r: dict[str, Any]) -> str:
    lines = [f"engine step with copies: {r['stores']} stores + {r['loads']} loads of {r['row_bytes'] // 1024} KiB rows "
             f"(keys stored {r['lag_steps']} steps before), then poll(); host {r['host_slots']} slots (full, evicting); "
             f"{r['steps']} steps after {r['warmup_steps']} discarded, {r['compute_s'] * 1e3:g} ms compute per step, "
             f"median of {r['repeats']} runs"]
    names = {"batched": "tiered_kv store_many/load_many", "threads": "the same, cpu_mover=\"threads\"",
             "per_block": "tiered_kv store()/load() per block", "dict": "dict original (baseline)"}
    for compute in ("sleep", "busy"):
        for m in COPY_MODES:
            x = r[compute][m]
            c = r["runs"][compute][m][0]["counts"]
            lines.append(f"  {compute:5s} {names[m]:34s} CPU us/step mean {x['cpu_us_mean']:7.1f}  p50 "
                         f"{x['cpu_us_p50']:7.1f}  p99 {x['cpu_us_p99']:7.1f}   run 1: loads {c['loads']} "
                         f"(none {c['loads_none']}, rows busy {c['loads_skipped_busy']}), stores {c['stores']} "
                         f"(none {c['stores_none']}){_gc_text(x)}")
    return "\n".join(lines)


def gc_note(x: dict[str, Any]) -> str:
    """The collector's share of a mode's steps in words ('' for results made before it was measured)."""
    if "gc_us_per_step" not in x:
        return ""
    return (f"of which the garbage collector {x['gc_us_per_step']:.0f} us ({x['gc_full_runs']} full collections, "
            f"longest {x['gc_full_max_us'] / 1e3:.1f} ms)")


def _gc_text(x: dict[str, Any]) -> str:
    note = gc_note(x)
    return f"; {note}" if note else ""
