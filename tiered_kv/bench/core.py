"""Benchmark of the tiered_kv core, each figure beside a baseline measured in the same run.

Measurement code, not runtime (nothing here is imported by ``import tiered_kv``); long because
each section carries its baseline and its own checks that the bytes really moved.

    tiered-kv bench --sections lifecycles,store_latency,host,cuda

Sections (each a function returning a JSON-ready dict):

1. ``bench_lifecycles`` -- job lifecycles per second of the control path on one
   core: (a) store -> worker report -> poll applied, (b) store -> cancel -> late
   report -> poll.  The mover is an in-process stub that answers each Transfer
   at once without copying, so only bookkeeping is timed.  Baseline: a
   plain-dict version of the unsafe original (vLLM 0.21 style, no tokens,
   leases, tombstones or metrics) doing the same operations.  (c) the batched
   API: ``store_many`` of 32 keys -> report -> poll, in blocks per second.
   Each variant runs with a poll after every store (``poll/N = 1``) and with
   a poll after every 32 stores, as an engine step would (``poll/N = 32``).
   The engine thread is pinned to one CPU; rates are lifecycles per CPU second
   of that thread (``time.thread_time``), so other processes on a shared
   machine do not inflate them; wall-clock rates are reported beside.
2. ``bench_store_latency`` -- the wall time of each ``store()`` call with the
   real default mover (ThreadMover without CUDA, 2 workers copying 2 MiB rows
   meanwhile), the engine calling ``poll()`` every 16 stores and then
   "computing" for 10 ms.  Baseline: the unsafe original's store() feeding
   its own ThreadMover with the same rows, same pacing.
3. ``bench_host_throughput`` -- host tier store and load GB/s for 256 KiB,
   2 MiB and 8 MiB blocks (default mover, num_copy_workers=2): store a pass
   of blocks then wait(); load them into other rows then wait().  Baseline: a
   raw per-block ``Tensor.copy_`` of the same rows into preallocated memory on
   one thread (``torch.set_num_threads(1)``); the same raw copy with torch's
   default intra-op threads is reported as a note.
4. ``bench_cuda_copy`` -- only with CUDA: device->host (store) and host->device
   (load) GB/s through the CudaMover beside torch's own ``copy_`` of the same
   bytes between the same device rows and the same pinned host slab, on one
   side stream; and section 2's store() latency loop on a CUDA KV tensor,
   beside the unsafe original queuing the same barrier, copy and event.
   Without CUDA it returns a "skipped: no CUDA" record (tests run it on a
   simulated device: ``runtime=``).

Method: seeded; warm-up repeats discarded; tiered_kv and baseline alternate
repeat by repeat (their order flips each repeat) so drift hits both; objects
alive after start-up are moved to the permanent GC generation (``gc.freeze()``,
as serving engines do), the collector stays on while timing (its cost is part
of the per-job cost) and is run before each timed repeat.  Distributions are over repeats (throughput) or over
calls (latency) and report median/p90/p99/max.  Each section records how much
CPU other processes used while it ran (``background_load``).  Nothing here
asserts a timing; :mod:`.report` applies the targets.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import os
import random
import statistics
import time
from collections import OrderedDict
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch

from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.jobs import JobKind
from tiered_kv.metrics import sample_total
from tiered_kv.movers import EVENT_BYTES, CompletionQueue, ImmediateMover, Report, ThreadMover, Transfer
from tiered_kv.movers.cuda import STAGE_BYTES

from .common import GiB, KiB, LoadMonitor, MiB, as_mode, summarize
from .common import ratio as _ratio

__all__ = [
    "UnsafeDictOffloader", "ImmediateMover", "bench_lifecycles", "bench_store_latency", "bench_host_throughput",
    "bench_cuda_copy", "run_all", "format_report", "SECTIONS", "PLANS",
]

_STORE = JobKind.STORE

SECTIONS = ("lifecycles", "store_latency", "host_throughput", "cuda_copy")

PLANS: dict[str, dict[str, Any]] = {
    # lifecycles: (lifecycles per repeat, repeats, warm-up repeats)
    # store_latency: (timed stores per side, segments, warm-up stores, device rows, row bytes)
    # host_throughput: (bytes per pass, passes, warm-up passes, min blocks per pass)
    # cuda_copy: (bytes per pass, passes, warm-up passes)
    "full": {"lifecycles": (10000, 21, 2), "store_latency": (24000, 4, 480, 512, 2 * MiB),
             "host_throughput": (512 * MiB, 7, 1, 8), "cuda_copy": (1 * GiB, 9, 2)},
    "quick": {"lifecycles": (3000, 5, 1), "store_latency": (2400, 2, 160, 256, 2 * MiB),
              "host_throughput": (128 * MiB, 3, 1, 8), "cuda_copy": (256 * MiB, 3, 1)},
    "smoke": {"lifecycles": (300, 2, 1), "store_latency": (192, 2, 32, 32, 256 * KiB),
              "host_throughput": (4 * MiB, 1, 1, 2), "cuda_copy": (16 * MiB, 1, 1)},
}


@contextlib.contextmanager
def _one_core() -> Iterator[Optional[int]]:
    """Pin the calling thread to one CPU for the duration (Linux), restoring afterwards."""
    if not hasattr(os, "sched_setaffinity"):
        yield None
        return
    old = os.sched_getaffinity(0)
    cpu = max(old)
    os.sched_setaffinity(0, {cpu})
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, old)


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _keys(rng: random.Random, n: int) -> list[bytes]:
    """n distinct 16-byte keys (the size of an xxh3-128 prefix-chain hash)."""
    getrandbits = rng.getrandbits
    return [getrandbits(128).to_bytes(16, "little") for _ in range(n)]


# ----------------------------------------------------------------------------- baseline
class UnsafeDictOffloader:
    """The unsafe original, vLLM 0.21 style, as plain dicts -- the baseline.

    ``pending[block_id] = job_id`` (keyed by a *location*), ``jobs[job_id] =
    (key, block, slot)``, an LRU ``OrderedDict`` key -> host slot with a free
    list, and a set of finished job ids that ``poll()`` hands to the engine.
    No tokens, no leases, no tombstones, no state machine,
    no metrics, no input validation.  ``cancel`` forgets the pending record
    and reports the job finished at once; the late report then publishes the
    block anyway.  The original did ``del pending[bid]`` on completion, which
    raises KeyError after a cancel; ``pending.pop(bid, None)`` is the minimal
    patch that lets it run -- and it still drops a newer job's record when the
    block was reused (the ABA bug tiered_kv fixes).
    """

    def __init__(self, num_slots: int, submit: Optional[Callable[[int, int, int], None]] = None) -> None:
        self.pending: dict[int, int] = {}
        self.jobs: dict[int, tuple[bytes, int, int]] = {}
        self.storing: dict[bytes, int] = {}
        self.loading: dict[int, int] = {}   # job id -> device row, of loads (host slot -> row)
        self.host: OrderedDict[bytes, int] = OrderedDict()
        self.free = list(range(num_slots))
        self.finished: set[int] = set()
        self.queue = CompletionQueue()
        self._next = 0
        put = self.queue.put
        # default mover: answers at once, (job_id, success) as the original's workers did
        self._submit = submit if submit is not None else (lambda job_id, block, slot: put((job_id, True)))

    def store(self, key: bytes, block: int) -> Optional[int]:
        host = self.host
        if key in host:
            host.move_to_end(key)
            return None
        if key in self.storing:
            return None
        if self.free:
            slot = self.free.pop()
        elif host:
            slot = host.popitem(last=False)[1]
        else:
            return None  # every slot is being written: shed
        job_id = self._next
        self._next = job_id + 1
        self.pending[block] = job_id
        self.jobs[job_id] = (key, block, slot)
        self.storing[key] = job_id
        self._submit(job_id, block, slot)
        return job_id

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are in the host tier."""
        host = self.host
        n = 0
        for k in keys:
            if k not in host:
                break
            n += 1
        return n

    def load(self, key: bytes, block: int) -> Optional[int]:
        """Copy ``key``'s host slot into device row ``block``; None when it is not in the host tier."""
        slot = self.host.get(key)
        if slot is None:
            return None
        self.host.move_to_end(key)
        job_id = self._next
        self._next = job_id + 1
        self.pending[block] = job_id
        self.loading[job_id] = block
        self._submit(job_id, block, slot)
        return job_id

    def cancel(self, job_id: int) -> None:
        block = self.jobs[job_id][1]
        del self.pending[block]
        self.finished.add(job_id)

    def _complete(self, job_id: int, ok: bool) -> None:
        lb = self.loading.pop(job_id, None)
        if lb is not None:
            self.pending.pop(lb, None)
            self.finished.add(job_id)
            return
        key, block, slot = self.jobs.pop(job_id)
        self.pending.pop(block, None)  # original: del self.pending[block]
        del self.storing[key]
        if ok:
            self.host[key] = slot
        else:
            self.free.append(slot)
        self.finished.add(job_id)

    def poll(self) -> set[int]:
        """Apply ``(job_id, ok)`` tuples; return the job ids finished since the last poll."""
        complete = self._complete
        for job_id, ok in self.queue.drain():
            complete(job_id, ok)
        done, self.finished = self.finished, set()
        return done

    def poll_reports(self) -> set[int]:
        """Same, for tiered_kv ``Report`` objects (when driving a real ThreadMover)."""
        complete = self._complete
        for r in self.queue.drain():
            complete(r.token, r.ok)
        done, self.finished = self.finished, set()
        return done


# ----------------------------------------------------------------------------- 1. lifecycles
_LC_ROW_BYTES = 64        # rows are never copied here; small keeps the slab tiny
_LC_ROWS = 1024
_LC_SLOTS = 4096          # < lifecycles per repeat: the host tier is full and evicts (steady state)


def _tkv_lifecycle_manager() -> TierManager:
    cfg = TieredKVConfig(namespace="bench|u8|lifecycle", host_capacity_bytes=_LC_SLOTS * _LC_ROW_BYTES)
    kv = torch.zeros((_LC_ROWS, _LC_ROW_BYTES), dtype=torch.uint8)
    return TierManager(cfg, kv, mover_factory=ImmediateMover)


def _run_lifecycles(mgr: Any, keys: list[bytes], blocks: list[int], batch: int,
                    cancel: bool) -> tuple[float, float, int, int]:
    """The same loop for tiered_kv and the unsafe baseline (both have store/poll/cancel).

    Returns (wall s, this thread's CPU s, completions, stores that returned None).
    """
    store, poll, cancel_job = mgr.store, mgr.poll, mgr.cancel
    n = len(keys)
    done = shed = 0
    c0 = time.thread_time()
    t0 = time.perf_counter()
    if cancel:
        for i in range(0, n, batch):
            for j in range(i, min(i + batch, n)):
                job = store(keys[j], blocks[j])
                if job is None:
                    shed += 1
                else:
                    cancel_job(job)
            done += len(poll())
    else:
        for i in range(0, n, batch):
            for j in range(i, min(i + batch, n)):
                if store(keys[j], blocks[j]) is None:
                    shed += 1
            done += len(poll())
    return time.perf_counter() - t0, time.thread_time() - c0, done, shed



_run_tkv = _run_base = _run_lifecycles


def _run_store_many(mgr: Any, keys: list[bytes], blocks: list[int], batch: int,
                    cancel: bool) -> tuple[float, float, int, int]:
    """tiered_kv's batched API: one ``store_many`` of ``batch`` keys, then one ``poll()``, per engine step.

    Returns (wall s, CPU s, blocks reported, blocks not stored) like :func:`_run_lifecycles`, counted
    per block so the two loops compare blocks per second."""
    store_many, poll = mgr.store_many, mgr.poll
    n = len(keys)
    done = shed = 0
    c0 = time.thread_time()
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        job = store_many(keys[i:i + batch], blocks[i:i + batch])
        want = min(batch, n - i)
        if job is None:
            shed += want
        else:
            shed += want - len(job.keys)
        for c in poll():
            done += len(c.job.keys)
    return time.perf_counter() - t0, time.thread_time() - c0, done, shed


def _lifecycle_variant(name: str, cancel: bool, batch: int, n: int, repeats: int, warmup: int,
                       rng: random.Random, batched: bool = False) -> dict[str, Any]:
    mgr = _tkv_lifecycle_manager()
    base = UnsafeDictOffloader(_LC_SLOTS)
    blocks = [i % _LC_ROWS for i in range(n)]
    wall: dict[str, list[float]] = {"tkv": [], "base": []}
    cpu: dict[str, list[float]] = {"tkv": [], "base": []}
    problems: list[str] = []
    for rep in range(warmup + repeats):
        keys = _keys(rng, n)
        order = ("tkv", "base") if rep % 2 == 0 else ("base", "tkv")
        for side in order:
            gc.collect()
            if side == "tkv":
                dt, ct, done, shed = (_run_store_many if batched else _run_tkv)(mgr, keys, blocks, batch, cancel)
            else:
                dt, ct, done, shed = _run_base(base, keys, blocks, batch, cancel)
            if done != n or shed:
                problems.append(f"{side} repeat {rep}: {done} completions for {n} stores, {shed} shed")
            if rep >= warmup:
                wall[side].append(dt / n * 1e6)
                cpu[side].append(ct / n * 1e6)
    sizes = mgr.debug_sizes() if hasattr(mgr, "debug_sizes") else None
    mgr.close()

    def side(k: str) -> dict[str, Any]:
        c, w = summarize(cpu[k], "cpu us/lifecycle"), summarize(wall[k], "wall us/lifecycle")
        return {"lifecycles_per_cpu_s": 1e6 / c["median"], "lifecycles_per_wall_s": 1e6 / w["median"],
                "lifecycles_per_cpu_s_best": 1e6 / c["min"], "cpu_us_per_lifecycle": c, "wall_us_per_lifecycle": w}

    t, b = side("tkv"), side("base")
    if sizes is not None:
        t["internal_sizes_after"] = sizes
    rate_t, rate_b = t["lifecycles_per_cpu_s"], b["lifecycles_per_cpu_s"]
    return {
        "name": name,
        "sequence": ("store -> cancel -> late report -> poll" if cancel else
                     f"store_many({batch} keys) -> report -> poll" if batched else "store -> worker report -> poll applied"),
        "batched": batched,
        "poll_every_n_stores": batch,
        "lifecycles_per_repeat": n,
        "repeats": repeats,
        "warmup_repeats_discarded": warmup,
        "tiered_kv": t,
        "baseline": b,
        "ratio_tiered_kv_over_baseline": _ratio(rate_t, rate_b),
        "ratio_wall_tiered_kv_over_baseline": _ratio(t["lifecycles_per_wall_s"], b["lifecycles_per_wall_s"]),
        "problems": problems,
    }


def bench_lifecycles(quick: Union[bool, str] = False, seed: int = 0) -> dict[str, Any]:
    """Section 1: job lifecycles/s on one core, tiered_kv vs the unsafe plain-dict original.

    ``quick``: False/"full", True/"quick" or "smoke" (see ``PLANS``).
    """
    n, repeats, warmup = PLANS[as_mode(quick)]["lifecycles"]
    rng = random.Random(seed * 1000 + 1)
    variants = []
    with _one_core() as cpu:
        for cancel in (False, True):
            for batch in (1, 32):
                name = f"{'store_cancel_late_report' if cancel else 'store_report_poll'}_poll_every_{batch}"
                variants.append(_lifecycle_variant(name, cancel, batch, n, repeats, warmup, rng))
        # the batched API: one job of 32 keys per engine step (per block, against the baseline's 32 stores)
        variants.append(_lifecycle_variant("store_many_32_report_poll", False, 32, n, repeats, warmup, rng,
                                           batched=True))
    return {
        "section": "lifecycles",
        "pinned_cpu": cpu,
        "mover": "ImmediateMover: Report(token, kind, True, None, nbytes, 0.0) on the CompletionQueue at submit, no copy",
        "rate_basis": ("lifecycles per CPU second of the one (pinned) engine thread, median over repeats "
                       "(time.thread_time: immune to other processes on a shared machine); wall-clock rates beside"),
        "baseline": "UnsafeDictOffloader: plain-dict vLLM-0.21-style bookkeeping, same queue class, same operations",
        "host_slots": _LC_SLOTS,
        "device_rows": _LC_ROWS,
        "variants": variants,
    }


# ----------------------------------------------------------------------------- 2. store() latency
def _latency_loop(store: Callable[[bytes, int], Any], poll: Callable[[], Any], keys: list[bytes], start: int,
                  n_rows: int, per_step: int, step_s: float, lat_ok: list[int], lat_none: list[int],
                  poll_ns: list[int], first_of_step: Optional[list[int]] = None) -> None:
    """The engine loop: ``per_step`` store() calls (each timed), one poll() (timed), a "forward pass".

    ``first_of_step`` (optional) also gets the latency of each step's first store().
    """
    clock = time.perf_counter_ns
    sleep = time.sleep
    n = len(keys)
    for i in range(0, n, per_step):
        for j in range(i, min(i + per_step, n)):
            k = keys[j]
            b = (start + j) % n_rows
            t0 = clock()
            r = store(k, b)
            t1 = clock()
            (lat_none if r is None else lat_ok).append(t1 - t0)
            if j == i and first_of_step is not None:
                first_of_step.append(t1 - t0)
        t0 = clock()
        poll()
        poll_ns.append(clock() - t0)
        sleep(step_s)  # the engine's forward pass: the copy workers run meanwhile


def _store_latency_sides(mgr: TierManager, base: UnsafeDictOffloader, base_poll: Callable[[], Any],
                         base_settle: Callable[[], None], rng: random.Random, n_stores: int, segments: int,
                         warmup_stores: int, n_rows: int, per_step: int, step_s: float) -> dict[str, dict[str, Any]]:
    """Section 2's measurement, run by its CUDA variant too: each side's store() timed in the engine loop.

    Warm-up (discarded): one store per row then wait (``base_settle`` waits for the baseline's), so the
    host slab is faulted in and full and the timed stores evict like a long-running engine; then
    ``warmup_stores`` stores in engine steps.  Then ``segments`` timed segments, tiered_kv and the
    baseline alternating, their order flipped each segment.  Each side holds its samples (ns):
    ``ok``/``none`` (store returned a job / None), ``first`` (each step's first call), ``poll_ns``,
    and ``seconds`` spent in its timed segments.
    """
    sides: dict[str, dict[str, Any]] = {
        name: {"store": store, "poll": poll, "ok": [], "none": [], "poll_ns": [], "first": [], "at": 0,
               "seconds": 0.0}
        for name, store, poll in (("tkv", mgr.store, mgr.poll), ("base", base.store, base_poll))}
    mgr.wait([j for j in (mgr.store(k, i) for i, k in enumerate(_keys(rng, n_rows))) if j is not None], timeout=120)
    for i, k in enumerate(_keys(rng, n_rows)):
        base.store(k, i)
    base_settle()
    for s in sides.values():
        _latency_loop(s["store"], s["poll"], _keys(rng, warmup_stores), 0, n_rows, per_step, step_s, [], [], [])
        s["at"] = warmup_stores
    seg_n = n_stores // segments
    for seg in range(segments):
        keys = _keys(rng, seg_n)
        for name in (("tkv", "base") if seg % 2 == 0 else ("base", "tkv")):
            s = sides[name]
            gc.collect()
            t0 = time.perf_counter()
            _latency_loop(s["store"], s["poll"], keys, s["at"], n_rows, per_step, step_s,
                          s["ok"], s["none"], s["poll_ns"], s["first"])
            s["seconds"] += time.perf_counter() - t0
            s["at"] += seg_n
    return sides


def _stale_callbacks(mgr: TierManager) -> dict[str, float]:
    """``kind/reason`` -> count of the stale reports the manager discarded (from its registry)."""
    out: dict[str, float] = {}
    for metric in mgr.metrics.registry.collect():
        for smp in metric.samples:
            if smp.name == "tiered_kv_stale_callbacks_total" and smp.value:
                out[f"{smp.labels['kind']}/{smp.labels['reason']}"] = smp.value
    return out


def _us(xs: list[int]) -> list[float]:
    return [x / 1e3 for x in xs]


def _latency_side(s: dict[str, Any], row_bytes: int) -> dict[str, Any]:
    """One side of :func:`_store_latency_sides`, summarized (us)."""
    n_ok = len(s["ok"])
    rest = sorted(s["ok"] + s["none"])
    for x in s["first"]:  # the same samples minus each step's first call
        del rest[bisect.bisect_left(rest, x)]
    return {"store_all_calls": summarize(_us(s["ok"] + s["none"]), "us/call"),
            "store_first_of_step": summarize(_us(s["first"]), "us/call"),
            "store_rest_of_step": summarize(_us(rest), "us/call"),
            "store_accepted": summarize(_us(s["ok"]), "us/call"),
            "store_returned_none": summarize(_us(s["none"]), "us/call") if s["none"] else None,
            "calls": n_ok + len(s["none"]), "accepted": n_ok, "returned_none": len(s["none"]),
            "poll": summarize(_us(s["poll_ns"]), "us/call"),
            # everything the engine thread spent in tiered_kv per step: its stores and its poll
            "engine_us_per_step_mean": ((sum(_us(s["ok"] + s["none"])) + sum(_us(s["poll_ns"]))) / len(s["poll_ns"])
                                        if s["poll_ns"] else None),
            "copy_gb_per_s_requested": n_ok * row_bytes / s["seconds"] / 1e9 if s["seconds"] else None}


def bench_store_latency(quick: Union[bool, str] = False, seed: int = 0, row_bytes: Optional[int] = None,
                        n_rows: Optional[int] = None, per_step: int = 16, step_s: float = 0.010) -> dict[str, Any]:
    """Section 2: store() wall time per call with the real default mover, poll() every ``per_step`` stores.

    Defaults: 2 MiB rows (one vLLM block of a Llama-3-8B-class model, all
    layers), 16 stores per engine step, a 10 ms step: a copy rate below what
    the two copy workers sustain, so the workers are busy
    most of the time while store() is called.  Host tier = device rows, so
    after the warm-up every store evicts.
    """
    n_stores, segments, warmup_stores, plan_rows, plan_bytes = PLANS[as_mode(quick)]["store_latency"]
    n_rows = n_rows or plan_rows
    row_bytes = row_bytes or plan_bytes
    rng = random.Random(seed * 1000 + 2)
    kv = torch.empty((n_rows, row_bytes), dtype=torch.uint8)
    kv.copy_((torch.arange(n_rows) % 251).to(torch.uint8).unsqueeze(1).expand(n_rows, row_bytes))
    cfg = TieredKVConfig(namespace="bench|u8|latency", host_capacity_bytes=n_rows * row_bytes)
    mgr = TierManager(cfg, kv)  # default mover: ThreadMover (no CUDA), num_copy_workers=2
    mover_name = type(getattr(mgr, "_mover", None)).__name__
    base = UnsafeDictOffloader(n_rows)
    host_b = torch.empty((n_rows, row_bytes), dtype=torch.uint8)  # faulted in by the warm-up, like the tier's slab
    base_mover = ThreadMover([(kv, host_b)], base.queue, cfg.num_copy_workers)
    base._submit = lambda job_id, block, slot: base_mover.submit(Transfer(job_id, _STORE, [block], [slot]))

    def base_settle() -> None:
        deadline = time.monotonic() + 120
        while base.jobs and time.monotonic() < deadline:
            base.poll_reports()
            time.sleep(0.001)

    sides = _store_latency_sides(mgr, base, base.poll_reports, base_settle, rng, n_stores, segments, warmup_stores,
                                 n_rows, per_step, step_s)
    mgr.wait(timeout=60)
    base_mover.close()
    base.poll_reports()
    stale = _stale_callbacks(mgr)
    mgr.close()
    del kv, host_b
    gc.collect()
    t, b = _latency_side(sides["tkv"], row_bytes), _latency_side(sides["base"], row_bytes)
    t["stale_callbacks"] = stale
    st, sb = t["store_all_calls"], b["store_all_calls"]
    return {
        "section": "store_latency",
        "mover": mover_name,
        "num_copy_workers": cfg.num_copy_workers,
        "row_bytes": row_bytes,
        "device_rows": n_rows,
        "host_slots": n_rows,
        "stores_per_poll": per_step,
        "engine_step_sleep_s": step_s,
        "timed_stores_per_side": n_stores,
        "warmup_stores_discarded": warmup_stores,
        "baseline": "UnsafeDictOffloader.store() with its own ThreadMover (same worker count) copying the same rows",
        "tiered_kv": t,
        "baseline_figures": b,
        "ratio_p50_tiered_kv_over_baseline": _ratio(st["median"], sb["median"]),
        "ratio_p99_tiered_kv_over_baseline": _ratio(st["p99"], sb["p99"]),
        "ratio_max_tiered_kv_over_baseline": _ratio(st["max"], sb["max"]),
    }


# ----------------------------------------------------------------------------- 3. host tier GB/s
STEP_BLOCKS = 64
"""Blocks per ``store_many``/``load_many`` call in the batched host passes (an engine step's stores)."""


def _pass_config(namespace: str, n: int, block: int) -> TieredKVConfig:
    """A tier that holds exactly a pass's ``n`` blocks (none evicted ahead between passes) and takes all of
    them in flight at once: a pass stores every block, then waits (the default ``max_inflight_jobs`` would
    shed the stores past it at small blocks)."""
    return TieredKVConfig(namespace=namespace, host_capacity_bytes=n * block, host_evict_ahead_blocks=0,
                          max_inflight_jobs=max(TieredKVConfig.max_inflight_jobs, n))


def _host_size(block: int, ws: int, passes: int, warmup: int, rng: random.Random,
               min_blocks: int = 8) -> dict[str, Any]:
    n = max(ws // block, min_blocks)
    nbytes = n * block
    kv = torch.empty((2 * n, block), dtype=torch.uint8)
    kv[:n].copy_((torch.arange(n) % 251).to(torch.uint8).unsqueeze(1).expand(n, block))
    kv[n:].fill_(255)
    raw_dst = torch.zeros((n, block), dtype=torch.uint8)  # preallocated and faulted in
    cfg = _pass_config(f"bench|u8|host{block}", n, block)
    mgr = TierManager(cfg, kv)  # default mover, default num_copy_workers
    mover_name = type(mgr._mover).__name__
    store, load, wait = mgr.store, mgr.load, mgr.wait
    store_many, load_many, poll = mgr.store_many, mgr.load_many, mgr.poll
    sides = ("tkv", "tkvB", "tkvS", "raw1", "rawN", "rawL")
    secs: dict[str, list[float]] = {f"{side}_{d}": [] for side in sides for d in ("store", "load")}
    shuffled = list(range(n))
    rng.shuffle(shuffled)
    problems: list[str] = []
    check_rows = sorted(rng.sample(range(n), min(8, n)))

    def tkv_pass(keys: list[bytes]) -> tuple[float, float]:
        t0 = time.perf_counter()
        jobs = [store(keys[i], i) for i in range(n)]
        done = wait()
        t1 = time.perf_counter()
        if any(j is None for j in jobs) or len(done) != n or not all(c.ok for c in done):
            problems.append(f"store pass: {sum(j is None for j in jobs)} None, {len(done)} completions")
        t2 = time.perf_counter()
        jobs = [load(keys[i], n + i) for i in range(n)]
        done = wait()
        t3 = time.perf_counter()
        if any(j is None for j in jobs) or len(done) != n or not all(c.ok for c in done):
            problems.append(f"load pass: {sum(j is None for j in jobs)} None, {len(done)} completions")
        for r in check_rows:  # untimed: the bytes really landed
            if not torch.equal(kv[n + r], kv[r]):
                problems.append(f"row {n + r} != row {r} after load")
        return t1 - t0, t3 - t2

    def steps(what: str, call: Any, keys: list[bytes], rows: list[int]) -> float:
        """``call`` (store_many or load_many) of STEP_BLOCKS keys then poll(), step after step, then
        wait(): the seconds it took; a job refused or failed is noted in ``problems``."""
        jobs: list[Any] = []
        done: list[Any] = []
        t0 = time.perf_counter()
        for i in range(0, n, STEP_BLOCKS):
            jobs.append(call(keys[i:i + STEP_BLOCKS], rows[i:i + STEP_BLOCKS]))
            done += poll()
        done += wait()
        t1 = time.perf_counter()
        if any(j is None for j in jobs) or not all(c.ok for c in done) or sum(len(c.job.keys) for c in done) != n:
            problems.append(f"batched {what} pass: {sum(j is None for j in jobs)} None, {len(done)} completions")
        return t1 - t0

    def batched_pass(keys: list[bytes], scatter: bool) -> tuple[float, float]:
        """The engine's steps: store_many of STEP_BLOCKS rows, poll(), ...; then the loads likewise.
        ``scatter``: rows in a shuffled order, and the keys loaded in another (scattered slots)."""
        rows = shuffled if scatter else list(range(n))
        st = steps("store", store_many, keys, rows)
        order = rows[::-1] if scatter else list(range(n))
        ld = steps("load", load_many, [keys[i] for i in order], [n + r for r in rows])
        for i in check_rows:  # untimed: the bytes really landed (load i put key order[i] into row n + rows[i])
            if not torch.equal(kv[n + rows[i]], kv[rows[order[i]]]):
                problems.append(f"batched pass: row {n + rows[i]} != row {rows[order[i]]} after load")   # '!=': wrong bytes
        return st, ld

    def large_pass() -> tuple[float, float]:
        src, dst = kv[:n].view(-1), raw_dst.view(-1)
        t0 = time.perf_counter()
        dst.copy_(src)
        t1 = time.perf_counter()
        kv[n:].view(-1).copy_(dst)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    def raw_pass() -> tuple[float, float]:
        t0 = time.perf_counter()
        for i in range(n):
            raw_dst[i].copy_(kv[i])
        t1 = time.perf_counter()
        for i in range(n):
            kv[n + i].copy_(raw_dst[i])
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    for p in range(warmup + passes):
        keys = _keys(rng, n)
        order = sides if p % 2 == 0 else sides[::-1]
        for side in order:
            gc.collect()
            kv[n:].fill_(255)   # untimed: each side's loads must land for its check to pass, not the last side's
            if side == "tkv":
                st, ld = tkv_pass(keys)
            elif side in ("tkvB", "tkvS"):
                st, ld = batched_pass(_keys(rng, n), side == "tkvS")   # keys of its own: none stored yet
            elif side == "rawL":
                st, ld = large_pass()
            elif side == "raw1":
                with _torch_threads(1):
                    st, ld = raw_pass()
            else:
                st, ld = raw_pass()
            if p >= warmup:
                secs[f"{side}_store"].append(st)
                secs[f"{side}_load"].append(ld)
    evictions = int(sample_total(mgr.metrics.registry, "tiered_kv_evictions_total", tier="host"))
    mgr.close()
    del kv, raw_dst, mgr
    gc.collect()

    def gbps(key: str) -> dict[str, Any]:
        s = summarize(secs[key], "s/pass")
        return {"seconds_per_pass": s, "gb_per_s": nbytes / s["median"] / 1e9,
                "gb_per_s_best": nbytes / s["min"] / 1e9, "gb_per_s_worst": nbytes / s["max"] / 1e9}

    out: dict[str, Any] = {"block_bytes": block, "blocks_per_pass": n, "bytes_per_pass": nbytes,
                           "passes": passes, "warmup_passes_discarded": warmup, "mover": mover_name,
                           "num_copy_workers": cfg.num_copy_workers, "host_evictions": evictions,
                           "problems": problems}
    for d in ("store", "load"):
        t, r1, rn = gbps(f"tkv_{d}"), gbps(f"raw1_{d}"), gbps(f"rawN_{d}")
        tb, ts, rl = gbps(f"tkvB_{d}"), gbps(f"tkvS_{d}"), gbps(f"rawL_{d}")
        out[d] = {
            "tiered_kv": t,
            "baseline_raw_copy_1_thread": r1,
            "note_raw_copy_default_threads": rn,
            "ratio_tiered_kv_over_baseline": _ratio(t["gb_per_s"], r1["gb_per_s"]),
            "ratio_tiered_kv_over_raw_default_threads": _ratio(t["gb_per_s"], rn["gb_per_s"]),
            # issue 25: a step's blocks as one call each way, against the memory's speed (one large copy_)
            "tiered_kv_batched": tb,
            "tiered_kv_batched_scattered": ts,
            "baseline_one_large_copy": rl,
            "ratio_batched_over_large_copy": _ratio(tb["gb_per_s"], rl["gb_per_s"]),
            "ratio_batched_scattered_over_large_copy": _ratio(ts["gb_per_s"], rl["gb_per_s"]),
            "ratio_per_block_over_large_copy": _ratio(t["gb_per_s"], rl["gb_per_s"]),
        }
    return out


def _fresh_slab(block: int, ws: int, repeats: int) -> dict[str, Any]:
    """The first pass of stores into a new manager's slab, as an engine's first steps meet it.

    Each repeat builds a new TierManager (its slab a fresh allocation, never touched) and times its
    construction and then one store() of every block and wait(); once with ``prefault_host_memory``
    (the default) and once without, beside a raw one-thread copy_ of the same rows into memory that
    was faulted in beforehand.  Sides alternate repeat by repeat."""
    n = max(ws // block, 8)
    nbytes = n * block
    kv = torch.empty((n, block), dtype=torch.uint8)
    kv.copy_((torch.arange(n) % 251).to(torch.uint8).unsqueeze(1).expand(n, block))
    raw_dst = torch.zeros((n, block), dtype=torch.uint8)   # faulted in
    secs: dict[str, list[float]] = {k: [] for k in ("prefault_start", "prefault_pass", "lazy_start", "lazy_pass", "raw")}
    problems: list[str] = []
    populated = ""

    def tkv(prefault: bool) -> tuple[float, float]:
        nonlocal populated
        cfg = TieredKVConfig(namespace=f"bench|u8|fresh{block}", host_capacity_bytes=nbytes,
                             host_evict_ahead_blocks=0, prefault_host_memory=prefault)
        gc.collect()
        t0 = time.perf_counter()
        mgr = TierManager(cfg, kv)
        t1 = time.perf_counter()
        jobs = [mgr.store(b"fresh-%d" % i, i) for i in range(n)]
        done = mgr.wait()
        t2 = time.perf_counter()
        if any(j is None for j in jobs) or len(done) != n or not all(c.ok for c in done):
            problems.append(f"first pass (prefault={prefault}): {len(done)} completions of {n}")
        if prefault:
            populated = mgr.host_memory.populated
        mgr.close()
        del mgr
        return t1 - t0, t2 - t1

    def raw() -> float:
        with _torch_threads(1):
            t0 = time.perf_counter()
            for i in range(n):
                raw_dst[i].copy_(kv[i])
            return time.perf_counter() - t0

    for r in range(repeats):
        for side in (("prefault", "lazy", "raw") if r % 2 == 0 else ("raw", "lazy", "prefault")):
            if side == "raw":
                gc.collect()
                secs["raw"].append(raw())
            else:
                st, ps = tkv(side == "prefault")
                secs[f"{side}_start"].append(st)
                secs[f"{side}_pass"].append(ps)
    del kv, raw_dst
    gc.collect()
    med = {k: summarize(v, "s") for k, v in secs.items()}
    gbps = {k: nbytes / med[k]["median"] / 1e9 for k in ("prefault_pass", "lazy_pass", "raw")}
    return {"block_bytes": block, "blocks": n, "bytes": nbytes, "repeats": repeats, "populated": populated,
            "seconds": med, "gb_per_s": gbps,
            "start_seconds_per_gib": {k: med[f"{k}_start"]["median"] * GiB / nbytes for k in ("prefault", "lazy")},
            "ratio_first_pass_over_raw": _ratio(gbps["prefault_pass"], gbps["raw"]),
            "ratio_first_pass_without_prefault_over_raw": _ratio(gbps["lazy_pass"], gbps["raw"]),
            "problems": problems}


def bench_host_throughput(quick: Union[bool, str] = False, seed: int = 0,
                          block_sizes: Sequence[int] = (64 * KiB, 256 * KiB, 2 * MiB, 8 * MiB)) -> dict[str, Any]:
    """Section 3: host tier store/load GB/s vs a raw single-thread ``copy_`` of the same bytes, and a step's
    blocks as one ``store_many``/``load_many`` (then ``poll()``) vs one large ``copy_`` of the same bytes."""
    ws, passes, warmup, min_blocks = PLANS[as_mode(quick)]["host_throughput"]
    rng = random.Random(seed * 1000 + 3)
    return {
        "section": "host_throughput",
        "working_set_bytes_per_pass": ws,
        "method": ("tiered_kv: store() every block then wait(); load() each into another row then wait(). "
                   "baseline: per-block Tensor.copy_ of the same rows into a preallocated buffer and back, "
                   "one thread (torch.set_num_threads(1)); note: the same with torch's default threads. "
                   f"batched: store_many() of {STEP_BLOCKS} rows then poll(), step after step, then wait(); the "
                   "loads likewise into other rows (scattered: rows in a shuffled order, keys loaded in another); "
                   "its baseline: one copy_ of the whole pass's bytes between two contiguous tensors, torch's "
                   "default threads (the memory's speed). GB = 1e9 bytes; GB/s from the median pass."),
        "step_blocks": STEP_BLOCKS,
        "torch_default_threads": torch.get_num_threads(),
        "sizes": [_host_size(b, ws, passes, warmup, rng, min_blocks) for b in block_sizes],
        "fresh_slab": _fresh_slab(2 * MiB, ws // 2, max(passes // 2, 1)),
    }


# ----------------------------------------------------------------------------- 4. CUDA links
NO_CUDA = "skipped: no CUDA (torch.cuda.is_available() is False)"


class _Device:
    """Where section 4 runs: a CUDA device through ``TorchCuda``, or (tests) a simulated one.

    ``runtime`` is ``CudaMover``'s runtime (``new_stream``, ``new_event``,
    ``current_stream``, ``copies_on``) plus ``copy`` and ``synchronize(device)``
    for the baselines; with a simulated runtime the tensors live on the CPU and
    the slab is not pinned.
    """

    def __init__(self, runtime: Optional[Any] = None) -> None:
        from tiered_kv.movers import TorchCuda
        self.simulated = runtime is not None
        self.rt = runtime if runtime is not None else TorchCuda()
        self.dev = torch.device("cpu") if self.simulated else torch.device("cuda", torch.cuda.current_device())

    def manager(self, cfg: TieredKVConfig, kv: torch.Tensor, event_bytes: int = EVENT_BYTES,
                batched: bool = True, stage_bytes: Optional[int] = None) -> TierManager:
        """A manager whose CudaMover runs on this device (``cfg``'s streams and batch size, ``event_bytes``,
        ``batched``, ``stage_bytes``); on a CUDA device its host slab is pinned, as the default mover's."""
        from tiered_kv.movers import CudaMover
        rt = self.rt
        return TierManager(cfg, kv, mover_factory=lambda d, h, c: CudaMover([(d, h)], c, cfg.num_copy_streams,
                                                                           runtime=rt, batch_max=cfg.copy_batch_max,
                                                                           event_bytes=event_bytes, batched=batched,
                                                                           stage_bytes=stage_bytes))

    def host(self, shape: tuple[int, int]) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.uint8, pin_memory=not self.simulated)

    def sync(self) -> None:
        self.rt.synchronize(self.dev)

    def release(self) -> None:
        if not self.simulated:  # pragma: no cover - needs CUDA
            torch.cuda.empty_cache()


def _cuda_size(block: int, ws: int, passes: int, warmup: int, rng: random.Random, d: _Device) -> dict[str, Any]:
    """One block size: tiered_kv store/load through the CudaMover vs torch ``copy_`` on the same buffers."""
    dev, rt = d.dev, d.rt
    n = max(ws // block, 8)
    nbytes = n * block
    kv = torch.empty((2 * n, block), dtype=torch.uint8, device=dev)
    kv[:n].copy_((torch.arange(n, device=dev) % 251).to(torch.uint8).unsqueeze(1).expand(n, block))
    kv[n:].fill_(255)
    cfg = _pass_config(f"bench|u8|cuda{block}", n, block)
    # the sides through tiered_kv: the default; each copy on the device inside its own call; and, where the
    # default shares end events between copies, the batched mover with an end event after every copy
    per_copy_events = block < EVENT_BYTES
    mgrs = {"tkv": d.manager(cfg, kv), "tkv1": d.manager(cfg.replace(copy_batch_max=1), kv),
            "tkvP": d.manager(cfg, kv, batched=False)}   # the batched API on the per-block copies
    if per_copy_events:
        mgrs["tkve"] = d.manager(cfg, kv, event_bytes=1)
    mgr = mgrs["tkv"]
    host = getattr(mgr, "_host_rows", None)
    same_slab = isinstance(host, torch.Tensor) and host.shape[0] >= n and (d.simulated or host.is_pinned())
    if not same_slab:  # the slab is private: copy between a pinned buffer of the same shape instead
        host = d.host((n, block))
    assert host is not None
    host[:n].fill_(0)  # faulted in, like the tier's slab
    side = rt.new_stream(dev)
    secs: dict[str, list[float]] = {k: [] for k in ("tkv_store", "tkv_load", "tkv1_store", "tkv1_load",
                                                    "tkve_store", "tkve_load", "raw_store", "raw_load",
                                                    "tkvB_store", "tkvB_load", "large_store", "large_load",
                                                    "tkvS_store", "tkvS_load", "tkvP_store", "tkvP_load")}
    # engine-thread CPU per step of the batched API: batched copies (B), rows out of order (S), per block (P)
    step_cpu: dict[str, list[float]] = {f"{w}_{d_}": [] for w in ("tkvB", "tkvS", "tkvP") for d_ in ("store", "load")}
    problems: list[str] = []
    check = sorted(rng.sample(range(n), min(8, n)))

    def tkv_pass(m: TierManager, keys: list[bytes]) -> tuple[float, float]:
        d.sync()
        t0 = time.perf_counter()
        jobs = [m.store(keys[i], i) for i in range(n)]
        done = m.wait()
        t1 = time.perf_counter()
        if any(j is None for j in jobs) or len(done) != n or not all(c.ok for c in done):
            problems.append(f"store pass: {sum(j is None for j in jobs)} None, {len(done)} completions")
        t2 = time.perf_counter()
        jobs = [m.load(keys[i], n + i) for i in range(n)]
        done = m.wait()
        t3 = time.perf_counter()
        if any(j is None for j in jobs) or len(done) != n or not all(c.ok for c in done):
            problems.append(f"load pass: {sum(j is None for j in jobs)} None, {len(done)} completions")
        for r in check:  # untimed: the bytes really landed
            if not torch.equal(kv[n + r], kv[r]):
                problems.append(f"row {n + r} != row {r} after load")
        kv[n:].fill_(255)
        d.sync()
        return t1 - t0, t3 - t2

    def batched_pass(m: TierManager, keys: list[bytes], timed: str) -> tuple[float, float]:
        """store_many of STEP_BLOCKS rows then poll(), step after step, then wait(); the loads likewise.
        ``timed``: the pass's name, its steps' engine CPU recorded (empty: a warm-up); ``tkvS``: each step's
        rows in a shuffled order (the slots stay in order: the gathered and scattered runs)."""
        out = []
        for what, call, base in (("store", m.store_many, 0), ("load", m.load_many, n)):
            d.sync()
            jobs: list[Any] = []
            done: list[Any] = []
            steps = [list(range(base + i, base + min(n, i + STEP_BLOCKS))) for i in range(0, n, STEP_BLOCKS)]
            if timed == "tkvS":
                for rows in steps:
                    random.Random(len(rows)).shuffle(rows)
            t0 = time.perf_counter()
            for i, rows in zip(range(0, n, STEP_BLOCKS), steps):
                c0 = time.thread_time()
                jobs.append(call([keys[r - base] for r in rows], rows))
                done += m.poll()
                if timed:
                    step_cpu[f"{timed}_{what}"].append(time.thread_time() - c0)
            done += m.wait()
            out.append(time.perf_counter() - t0)
            if any(j is None for j in jobs) or not all(c.ok for c in done) or sum(len(c.job.keys) for c in done) != n:
                problems.append(f"batched {what} pass: {sum(j is None for j in jobs)} None, {len(done)} completions")
        for r in check:
            if not torch.equal(kv[n + r], kv[r]):
                problems.append(f"batched: row {n + r} != row {r} after load")
        kv[n:].fill_(255)
        d.sync()
        return out[0], out[1]

    def large_pass() -> tuple[float, float]:
        """One copy_ of the pass's bytes each way: the link's speed."""
        d.sync()
        t0 = time.perf_counter()
        rt.copy(host[:n], kv[:n], side)
        side.synchronize()
        t1 = time.perf_counter()
        rt.copy(kv[n:], host[:n], side)
        side.synchronize()
        t2 = time.perf_counter()
        kv[n:].fill_(255)
        d.sync()
        return t1 - t0, t2 - t1

    def raw_pass() -> tuple[float, float]:
        d.sync()
        t0 = time.perf_counter()
        for i in range(n):
            rt.copy(host[i], kv[i], side)
        side.synchronize()
        t1 = time.perf_counter()
        for i in range(n):
            rt.copy(kv[n + i], host[i], side)
        side.synchronize()
        t2 = time.perf_counter()
        for r in check:
            if not torch.equal(kv[n + r], kv[r]):
                problems.append(f"baseline: row {n + r} != row {r} after its copy")
        kv[n:].fill_(255)
        d.sync()
        return t1 - t0, t2 - t1

    names = ["tkv", "raw", "tkv1", "tkve", "tkvB", "large", "tkvS", "tkvP"]
    for p in range(warmup + passes):
        keys = _keys(rng, n)
        order = names[p % len(names):] + names[:p % len(names)]   # each pass first and last in turn
        if p % 2:
            order.reverse()
        for which in (w for w in order if w in ("raw", "large", "tkvB", "tkvS") or w in mgrs):
            gc.collect()
            if which == "raw":
                st, ld = raw_pass()
            elif which == "large":
                st, ld = large_pass()
            elif which in ("tkvB", "tkvS", "tkvP"):   # keys of its own: none stored yet
                st, ld = batched_pass(mgrs["tkvP"] if which == "tkvP" else mgr, _keys(rng, n),
                                      which if p >= warmup else "")
            else:
                st, ld = tkv_pass(mgrs[which], keys)
            if p >= warmup:
                secs[f"{which}_store"].append(st)
                secs[f"{which}_load"].append(ld)
    mover = type(getattr(mgr, "_mover", None)).__name__
    for m in mgrs.values():
        m.close()
    del kv, host, mgr, mgrs
    d.release()

    def gbps(key: str) -> dict[str, Any]:
        s_ = summarize(secs[key], "s/pass")
        return {"seconds_per_pass": s_, "gb_per_s": nbytes / s_["median"] / 1e9,
                "gb_per_s_best": nbytes / s_["min"] / 1e9, "gb_per_s_worst": nbytes / s_["max"] / 1e9}

    out: dict[str, Any] = {"block_bytes": block, "blocks_per_pass": n, "bytes_per_pass": nbytes, "passes": passes,
                           "warmup_passes_discarded": warmup, "mover": mover, "baseline_on_tier_slab": same_slab,
                           "copy_batch_max": cfg.copy_batch_max, "problems": problems}
    for d_, link in (("store", "device->host"), ("load", "host->device")):
        t, r, t1 = gbps(f"tkv_{d_}"), gbps(f"raw_{d_}"), gbps(f"tkv1_{d_}")
        rt_ = _ratio(t["gb_per_s"], r["gb_per_s"])
        out[d_] = {"link": link, "tiered_kv": t, "baseline_torch_copy": r, "ratio_tiered_kv_over_baseline": rt_,
                   "tiered_kv_copy_batch_max_1": t1,
                   "ratio_batch_max_1_over_baseline": _ratio(t1["gb_per_s"], r["gb_per_s"])}
        if per_copy_events:
            te = gbps(f"tkve_{d_}")
            out[d_]["tiered_kv_event_per_copy"] = te
            out[d_]["ratio_event_per_copy_over_baseline"] = _ratio(te["gb_per_s"], r["gb_per_s"])
        # issue 25: a step's blocks as one store_many/load_many, against one large copy_ of the same bytes:
        # batched copies with the step's rows in order (B) and shuffled (S), and on the per-block copies (P)
        lg = gbps(f"large_{d_}")
        out[d_]["baseline_one_large_copy"] = lg
        for w, name in (("tkvB", "batched"), ("tkvS", "batched_scattered"), ("tkvP", "batched_per_block")):
            tb = gbps(f"{w}_{d_}")
            out[d_][f"tiered_kv_{name}"] = tb
            out[d_][f"ratio_{name}_over_large_copy"] = _ratio(tb["gb_per_s"], lg["gb_per_s"])
            out[d_][f"engine_cpu_us_per_step_{name}" if w != "tkvB" else "engine_cpu_us_per_step"] = \
                summarize([x * 1e6 for x in step_cpu[f"{w}_{d_}"]], "us")
    for suffix in ("", "_batched_scattered", "_batched_per_block"):
        st_, ld_ = out["store"][f"engine_cpu_us_per_step{suffix}"], out["load"][f"engine_cpu_us_per_step{suffix}"]
        out[f"engine_cpu_us_per_step_of_stores_and_loads{suffix}"] = st_["mean"] + ld_["mean"]
    return out


class _RawCudaCopies:
    """The baseline's mover on CUDA: per store the same barrier, side-stream copy and event, no bookkeeping."""

    def __init__(self, dev_rows: torch.Tensor, host_rows: torch.Tensor, out: CompletionQueue, rt: Any) -> None:
        self._dev, self._host, self._out, self._rt = dev_rows, host_rows, out, rt
        self._stream = rt.new_stream(dev_rows.device)
        self._pending: list[tuple[int, Any]] = []

    def submit(self, job_id: int, block: int, slot: int) -> None:
        rt, s = self._rt, self._stream
        s.wait_stream(rt.current_stream(self._dev.device))
        rt.copy(self._host[slot], self._dev[block], s)
        ev = rt.new_event()
        ev.record(s)
        self._pending.append((job_id, ev))

    def harvest(self) -> None:
        p, put = self._pending, self._out.put
        i = 0
        while i < len(p) and p[i][1].query():
            put(Report(p[i][0], _STORE, True))  # type: ignore[arg-type]
            i += 1
        del p[:i]


def _cuda_store_latency(quick: Union[bool, str], rng: random.Random, d: _Device, per_step: int = 16,
                        step_s: float = 0.010, batch_max: Optional[int] = None,
                        stage_bytes: Optional[int] = None) -> dict[str, Any]:
    """store() wall time per call on a CUDA KV tensor (CudaMover, pinned slab), the engine loop of section 2.
    ``batch_max``: the config's ``copy_batch_max`` (None: the default); ``stage_bytes``: the mover's staging
    bound (None: ``STAGE_BYTES``)."""
    n_stores, segments, warmup_stores, n_rows, row_bytes = PLANS[as_mode(quick)]["store_latency"]
    dev = d.dev
    kv = torch.empty((n_rows, row_bytes), dtype=torch.uint8, device=dev)
    kv.copy_((torch.arange(n_rows, device=dev) % 251).to(torch.uint8).unsqueeze(1).expand(n_rows, row_bytes))
    cfg = TieredKVConfig(namespace="bench|u8|cuda-latency", host_capacity_bytes=n_rows * row_bytes)
    if batch_max is not None:
        cfg = cfg.replace(copy_batch_max=batch_max)
    mgr = d.manager(cfg, kv, stage_bytes=stage_bytes)
    base = UnsafeDictOffloader(n_rows)
    host_b = d.host((n_rows, row_bytes))
    raw = _RawCudaCopies(kv, host_b, base.queue, d.rt)
    base._submit = raw.submit

    def base_poll() -> set[int]:
        raw.harvest()
        return base.poll_reports()

    def base_settle() -> None:
        d.sync()
        base_poll()

    sides = _store_latency_sides(mgr, base, base_poll, base_settle, rng, n_stores, segments, warmup_stores,
                                 n_rows, per_step, step_s)
    d.sync()
    mgr.wait(timeout=60)
    base_poll()
    mover = type(getattr(mgr, "_mover", None)).__name__
    slab = getattr(mgr, "_host_rows", None)
    pinned = bool(slab.is_pinned()) if isinstance(slab, torch.Tensor) else None
    mgr.close()
    del kv, host_b, mgr
    d.release()

    t, b = _latency_side(sides["tkv"], row_bytes), _latency_side(sides["base"], row_bytes)
    st, sb = t["store_all_calls"], b["store_all_calls"]
    return {
        "mover": mover, "copy_batch_max": cfg.copy_batch_max, "stage_bytes": stage_bytes or STAGE_BYTES,
        "host_slab_pinned": pinned, "row_bytes": row_bytes,
        "device_rows": n_rows,
        "stores_per_poll": per_step, "engine_step_sleep_s": step_s, "timed_stores_per_side": n_stores,
        "warmup_stores_discarded": warmup_stores,
        "baseline": ("UnsafeDictOffloader.store() whose copy is the same wait_stream + side-stream copy_ + event, "
                     "polled by querying the events; same rows and pacing"),
        "tiered_kv": t, "baseline_figures": b,
        "ratio_p99_tiered_kv_over_baseline": _ratio(st["p99"], sb["p99"]),
    }


def _cuda_call_costs(d: _Device, n: int = 2000, rounds: int = 5) -> dict[str, float]:
    """The engine thread's CPU per CUDA call on this host, us (median of ``rounds`` rounds of ``n`` calls): an
    end event's record then query, and one ``copy_(non_blocking=True)`` of 64 bytes from pinned memory to the
    device on a copy stream -- what a step's batch pays per chunk and per copy call, beside its bookkeeping."""
    rt, dev = d.rt, d.dev
    stream, ev = rt.new_stream(dev), rt.new_event()
    src, dst = d.host((1, 64)), torch.empty((1, 64), dtype=torch.uint8, device=dev)
    rec: list[float] = []
    cp: list[float] = []
    for _ in range(rounds):
        t = time.thread_time()
        for _ in range(n):
            ev.record(stream)
            ev.query()
        rec.append((time.thread_time() - t) / n * 1e6)
        d.sync()
        with rt.copies_on(stream) as ops:
            t = time.thread_time()
            for _ in range(n):
                ops.copy(dst, src)
            cp.append((time.thread_time() - t) / n * 1e6)
        d.sync()
    return {"event_record_and_query_us": sorted(rec)[rounds // 2], "copy_call_us": sorted(cp)[rounds // 2],
            "calls_per_round": n, "rounds": rounds}


class _NoGroups:
    """A CUDA runtime whose probe refuses index ops on column slices: ``CudaMover`` then copies planes side by side
    in one host row block by block, as it did before it grouped them (the A/B of :func:`_cuda_worker_layout`)."""

    def __init__(self, rt: Any) -> None:
        self._rt = rt

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rt, name)

    @staticmethod
    def strided_index_ops(device: Any) -> bool:
        return False


WORKER_STEPS = {"full": 40, "quick": 10, "smoke": 2}


def _cuda_worker_layout(quick: Union[bool, str], rng: random.Random, d: _Device, planes: int = 32,
                        plane_bytes: int = 16 * KiB) -> dict[str, Any]:
    """The vLLM worker's layout (``SlabCopier``): ``planes`` KV tensors, a block of ``plane_bytes`` each, side by side
    in the rows of one pinned slab; a ``CudaMover`` on one stream, as the copier makes it.  Per step one job of
    ``STEP_BLOCKS`` blocks: stores of random device rows into consecutive slots (as the scheduler hands them out),
    then a pass of loads of those slots into other random rows.  Through the staging rows (the default) and block by
    block (the probe refused: before planes were grouped), beside one ``copy_`` of a step's bytes each way between
    a contiguous device buffer and the slab; GB/s of the whole pass and the engine thread's CPU per step."""
    from tiered_kv.movers import CudaMover
    dev, rt = d.dev, d.rt
    n, steps = STEP_BLOCKS, WORKER_STEPS[as_mode(quick)]
    kvs = [torch.empty((2 * n, plane_bytes), dtype=torch.uint8, device=dev) for _ in range(planes)]
    cols = torch.arange(plane_bytes, device=dev)
    for i, t in enumerate(kvs):   # bytes that differ along a row, from row to row and from tensor to tensor
        t.copy_(((torch.arange(2 * n, device=dev) * 7 + i * 13).unsqueeze(1) + cols) % 251)
    slab = d.host((n, planes * plane_bytes))
    step_bytes = n * planes * plane_bytes
    out: dict[str, Any] = {"kv_tensors": planes, "plane_bytes": plane_bytes, "blocks_per_step": n, "steps": steps,
                           "step_bytes": step_bytes}
    flat = torch.empty((n, planes * plane_bytes), dtype=torch.uint8, device=dev)
    stream = rt.new_stream(dev)
    for direction in ("store", "load"):
        times = []
        for _ in range(steps + 1):
            d.sync()
            t = time.perf_counter()
            rt.copy(slab, flat, stream) if direction == "store" else rt.copy(flat, slab, stream)
            d.sync()
            times.append(time.perf_counter() - t)
        out[f"baseline_one_copy_{direction}_gb_per_s"] = step_bytes / statistics.median(times[1:]) / 1e9
    quiet = logging.getLogger("tiered_kv.movers.cuda")
    for mode, runtime in (("grouped", rt), ("per_block", _NoGroups(rt))):
        q = CompletionQueue()
        level = quiet.level
        quiet.setLevel(logging.ERROR)   # the per-block side's probe refusal is this A/B's doing, not the device's
        try:
            m = CudaMover([(k, slab[:, i * plane_bytes:(i + 1) * plane_bytes]) for i, k in enumerate(kvs)], q,
                          num_streams=1, runtime=runtime)
        finally:
            quiet.setLevel(level)
        side: dict[str, Any] = {"groups": len(m._groups)}
        bad = 0
        stored: list[int] = []
        for direction, kind in (("store", JobKind.STORE), ("load", JobKind.LOAD)):
            cpu: list[float] = []
            d.sync()
            t0 = time.perf_counter()
            rows: list[int] = []
            for _ in range(steps):
                rows = rng.sample(range(n), n) if kind is JobKind.STORE else rng.sample(range(n, 2 * n), n)
                c = time.thread_time()
                m.submit(Transfer(os.urandom(16), kind, rows, list(range(n))))
                m.flush()
                m.harvest()
                cpu.append((time.thread_time() - c) * 1e6)
            d.sync()
            m.harvest()
            wall = time.perf_counter() - t0
            got = q.drain()
            bad += sum(not r.ok for r in got) + (steps - len(got))
            # the last step's bytes: slot i holds device row rows[i]'s blocks (stores); the load's row rows[i] holds
            # what slot i held, the last store step's row stored[i] (loads)
            for i in range(n):
                want = torch.cat([k[rows[i] if kind is JobKind.STORE else stored[i]].cpu() for k in kvs])
                have = slab[i] if kind is JobKind.STORE else torch.cat([k[rows[i]].cpu() for k in kvs])
                bad += not torch.equal(want, have)
            stored = rows
            side[direction] = {"gb_per_s": steps * step_bytes / wall / 1e9, "engine_cpu_us_per_step": summarize(cpu, "us")}
        m.close()
        side["problems"] = bad   # failed or missing reports, and rows with wrong bytes
        out[mode] = side
    for direction in ("store", "load"):
        base = out[f"baseline_one_copy_{direction}_gb_per_s"]
        for mode in ("grouped", "per_block"):
            out[mode][direction]["ratio_over_one_copy"] = _ratio(out[mode][direction]["gb_per_s"], base)
    del kvs, slab, flat
    d.release()
    return out


def bench_cuda_copy(quick: Union[bool, str] = False, seed: int = 0,
                    block_sizes: Sequence[int] = (64 * KiB, 256 * KiB, 2 * MiB, 8 * MiB),
                    runtime: Optional[Any] = None) -> dict[str, Any]:
    """Section 4: device->host and host->device GB/s through tiered_kv vs torch ``copy_``, and store()
    latency on a CUDA KV tensor (CUDA only; ``runtime``: a simulated device, for tests)."""
    if runtime is None and not torch.cuda.is_available():
        return {"section": "cuda_copy", "skipped": NO_CUDA, "sizes": []}
    d = _Device(runtime)
    ws, passes, warmup = PLANS[as_mode(quick)]["cuda_copy"]
    rng = random.Random(seed * 1000 + 4)
    return {
        "section": "cuda_copy",
        "skipped": None,
        "simulated": d.simulated,
        "device": "simulated" if d.simulated else torch.cuda.get_device_name(),
        "working_set_bytes_per_pass": ws,
        "method": ("tiered_kv: store() every row of a CUDA KV tensor then wait() (device->host), load() each into "
                   "another row then wait() (host->device), CudaMover streams and events, pinned host slab. "
                   "baseline: torch Tensor.copy_(non_blocking=True) of the same rows between the same device "
                   "tensor and the same pinned slab, one side stream, then synchronize. batched: store_many() of "
                   f"{STEP_BLOCKS} rows then poll(), step after step, then wait(), the loads likewise -- the rows "
                   "in order, shuffled within each step (gathered/scattered on the device), and through the "
                   "per-block copies (CudaMover(batched=False)); its baseline: one copy_ of the pass's bytes "
                   "each way (the link's speed). GB = 1e9 bytes."),
        "call_costs": _cuda_call_costs(d),
        "sizes": [_cuda_size(b, ws, passes, warmup, rng, d) for b in block_sizes],
        "store_latency": _cuda_store_latency(quick, rng, d),
        # the same with every copy put on the device inside its own store() (before batching): an A/B in one run
        "store_latency_copy_batch_max_1": _cuda_store_latency(quick, rng, d, batch_max=1),
        # the same with 4x the staging rows (a step's 16 scattered rows of 2 MiB: one gather and one copy
        # instead of four of each): whether fewer, larger calls pay for the device memory
        "store_latency_stage_32MiB": _cuda_store_latency(quick, rng, d, stage_bytes=32 * MiB),
        # the vLLM worker's copier layout: KV tensors side by side in a slab row, through staging rows and block by block
        "worker_layout": _cuda_worker_layout(quick, rng, d),
    }


# ----------------------------------------------------------------------------- driver and report
def run_all(quick: Union[bool, str] = False, seed: int = 0, log: Callable[[str], None] = lambda s: None,
            sections: Sequence[str] = SECTIONS) -> dict[str, Any]:
    """The sections named (default: all); the dict that ``--json`` writes.  ``quick``: bool or a mode name."""
    mode = as_mode(quick)
    bad = set(sections) - set(SECTIONS)
    if bad:
        raise ValueError(f"unknown core sections {sorted(bad)}; known: {SECTIONS}")
    t0 = time.perf_counter()
    # objects alive after imports (torch's many) go to the permanent generation, as serving engines do
    # after start-up: gc.collect() before each repeat is then cheap and gen-2 passes do not scan them
    was_frozen = gc.get_freeze_count() > 0
    gc.collect()
    gc.freeze()
    out: dict[str, Any] = {"benchmark": "tiered_kv core", "mode": mode, "seed": seed,
                           "gc": "gc.freeze() after imports; gc enabled while timing"}
    table: list[tuple[str, str, Callable[[Union[bool, str], int], dict[str, Any]]]] = [
        ("lifecycles", "job lifecycles (one core)", bench_lifecycles),
        ("store_latency", "store() latency with the default mover", bench_store_latency),
        ("host_throughput", "host tier throughput", bench_host_throughput),
        ("cuda_copy", "device<->host copies (CUDA only)", bench_cuda_copy),
    ]
    chosen = [row for row in table if row[0] in sections]
    for i, (key, title, fn) in enumerate(chosen, 1):
        log(f"core {i}/{len(chosen)} {title} ...")
        with LoadMonitor() as lm:
            out[key] = fn(mode, seed)
        out[key]["background_load"] = lm.result
        log(f"    {lm.result['wall_s']:.1f} s, other processes used {lm.result.get('foreign_cpu_s', float('nan')):.1f} "
            f"CPU s ({lm.result.get('foreign_share', float('nan')):.0%} of the machine)")
    out["wall_seconds"] = time.perf_counter() - t0
    if not was_frozen:  # a caller that froze first (tiered-kv bench) unfreezes itself
        gc.unfreeze()
    return out


def _size(b: int) -> str:
    return f"{b // MiB} MiB" if b >= MiB else f"{b // KiB} KiB"


def _load_line(sec: dict[str, Any]) -> str:
    bl = sec.get("background_load") or {}
    if "foreign_cpu_s" not in bl:
        return ""
    warn = "  (machine shared: figures noisier than usual)" if bl["foreign_share"] > 0.05 else ""
    return (f"   [{bl['wall_s']:.1f} s; other processes used {bl['foreign_cpu_s']:.1f} CPU s = "
            f"{bl['foreign_share']:.0%} of the machine; steal {bl['steal_s']:.1f} s]{warn}")


def format_report(r: dict[str, Any]) -> str:
    """Each core section's distributions, as text (the machine and the targets are in the summary table)."""
    lines = [f"tiered_kv core sections ({r['mode']}, seed {r['seed']})"]
    for key, fmt in (("lifecycles", _fmt_lifecycles), ("store_latency", _fmt_store_latency),
                     ("host_throughput", _fmt_host), ("cuda_copy", _fmt_cuda)):
        if r.get(key):
            lines += fmt(r[key])
    lines.append(f"\nwall time {r['wall_seconds']:.1f} s")
    return "\n".join(x for x in lines if x is not None)


def _fmt_lifecycles(lc: dict[str, Any]) -> list[str]:
    lines = [
        "1. job lifecycles per second on one core (ImmediateMover: no copy; baseline: unsafe plain-dict original)",
        "   rates per CPU second of the pinned engine thread (median of repeats); wall-clock rates in brackets",
        f"   {'sequence':<40}{'poll/N':>7}{'tiered_kv /s':>14}{'baseline /s':>13}{'ratio':>8}"
        f"   {'tkv CPU us/lifecycle p50/p90/p99/max':<38}",
    ]
    for v in lc["variants"]:
        t_, b_ = v["tiered_kv"], v["baseline"]
        s = t_["cpu_us_per_lifecycle"]
        lines.append(f"   {v['sequence']:<40}{v['poll_every_n_stores']:>7}{t_['lifecycles_per_cpu_s']:>14,.0f}"
                     f"{b_['lifecycles_per_cpu_s']:>13,.0f}{v['ratio_tiered_kv_over_baseline']:>8.3f}"
                     f"   {s['median']:.2f}/{s['p90']:.2f}/{s['p99']:.2f}/{s['max']:.2f}")
        lines.append(f"   {'':<47}{'[' + format(t_['lifecycles_per_wall_s'], ',.0f') + ']':>14}"
                     f"{'[' + format(b_['lifecycles_per_wall_s'], ',.0f') + ']':>13}"
                     f"{'[' + format(v['ratio_wall_tiered_kv_over_baseline'], '.3f') + ']':>8}")
        if v["problems"]:
            lines.append(f"     problems: {v['problems'][:3]}")
    lines.append(_load_line(lc))
    return lines


def _fmt_store_latency(sl: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    tk, bs = sl["tiered_kv"], sl["baseline_figures"]

    def row(label: str, s: Optional[dict[str, Any]], extra: str = "") -> str:
        if not s:
            return f"   {label:<30}{'-':>9}"
        return (f"   {label:<30}{s['median']:>9.2f}{s['p90']:>9.2f}{s['p99']:>9.2f}{s['max']:>10.1f}{s['n']:>8}{extra}")

    lines += [
        "",
        f"2. store() latency in us ({sl['mover']}, {sl['num_copy_workers']} workers copying {_size(sl['row_bytes'])} rows; "
        f"poll() every {sl['stores_per_poll']} stores, then a {sl['engine_step_sleep_s'] * 1e3:g} ms step; "
        f"host tier full, every store evicts)",
        f"   {'':<30}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>10}{'calls':>8}",
        row("tiered_kv store(), all calls", tk["store_all_calls"]),
        row("  returned a Job", tk["store_accepted"]),
        row("  returned None (shed)", tk["store_returned_none"]),
        row("baseline store(), all calls", bs["store_all_calls"]),
        row("  returned a job id", bs["store_accepted"]),
        row("  returned None (shed)", bs["store_returned_none"]),
        f"   {'ratio tiered_kv / baseline':<30}{sl['ratio_p50_tiered_kv_over_baseline']:>9.2f}{'':>9}"
        f"{sl['ratio_p99_tiered_kv_over_baseline']:>9.2f}{sl['ratio_max_tiered_kv_over_baseline']:>10.2f}",
        row("tiered_kv poll()", tk["poll"]),
        row("baseline poll()", bs["poll"]),
    ]
    if "store_first_of_step" in tk:
        lines += [
            row("tiered_kv, 1st store of a step", tk["store_first_of_step"]),
            row("tiered_kv, stores 2.. of a step", tk["store_rest_of_step"]),
            row("baseline, 1st store of a step", bs["store_first_of_step"]),
            row("baseline, stores 2.. of a step", bs["store_rest_of_step"]),
        ]
    lines += [
        f"   copies requested: tiered_kv {tk['copy_gb_per_s_requested'] or 0:.2f} GB/s, baseline "
        f"{bs['copy_gb_per_s_requested'] or 0:.2f} GB/s",
        _load_line(sl),
    ]
    return lines


def _fmt_host(h: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    s0 = h["sizes"][0]
    lines += [
        "",
        f"3. host tier GB/s ({s0['mover']}, {s0['num_copy_workers']} copy workers; "
        f"{h['working_set_bytes_per_pass'] / MiB:.0f} MiB per pass, {s0['passes']} passes; "
        "baseline: raw per-block copy_ on one thread)",
        f"   {'block':<9}{'dir':<7}{'tiered_kv':>10}{'raw 1 thr':>11}{'ratio':>8}{'note: raw dflt thr':>20}"
        f"{'ratio':>8}   {'tkv GB/s worst..best':<22}",
    ]
    for s in h["sizes"]:
        for d in ("store", "load"):
            x = s[d]
            lines.append(f"   {_size(s['block_bytes']):<9}{d:<7}{x['tiered_kv']['gb_per_s']:>10.2f}"
                         f"{x['baseline_raw_copy_1_thread']['gb_per_s']:>11.2f}{x['ratio_tiered_kv_over_baseline']:>8.3f}"
                         f"{x['note_raw_copy_default_threads']['gb_per_s']:>20.2f}"
                         f"{x['ratio_tiered_kv_over_raw_default_threads']:>8.3f}   "
                         f"{x['tiered_kv']['gb_per_s_worst']:.2f}..{x['tiered_kv']['gb_per_s_best']:.2f}")
        if s["problems"]:
            lines.append(f"     problems: {s['problems'][:3]}")
    fs = h.get("fresh_slab")
    if fs:
        g, ps = fs["gb_per_s"], fs["start_seconds_per_gib"]
        lines.append(f"   first pass into a new manager's slab ({_size(fs['block_bytes'])} blocks, "
                     f"{fs['bytes'] / MiB:.0f} MiB, median of {fs['repeats']}): {g['prefault_pass']:.2f} GB/s with "
                     f"prefault_host_memory ({fs['ratio_first_pass_over_raw']:.3f}x raw copy_ {g['raw']:.2f}); "
                     f"without it (huge pages still advised) {g['lazy_pass']:.2f} GB/s "
                     f"({fs['ratio_first_pass_without_prefault_over_raw']:.3f}x); manager start {ps['prefault']:.3f} "
                     f"s/GiB with, {ps['lazy']:.3f} without")
        if fs["problems"]:
            lines.append(f"     problems: {fs['problems'][:3]}")
    lines.append(_load_line(h))
    return lines


def _fmt_cuda(c: dict[str, Any]) -> list[str]:
    if c.get("skipped"):
        return ["", f"4. device<->host GB/s: {c['skipped']}"]
    lines = ["", f"4. device<->host GB/s on {c['device']} (CudaMover, pinned slab; baseline: torch copy_ between the same "
                 "buffers on one side stream)",
             f"   {'block':<9}{'link':<14}{'tiered_kv':>10}{'torch copy_':>13}{'ratio':>8}   {'tkv GB/s worst..best':<22}"
             f"{'batch=1':>9}{'ratio':>8}{'ev/copy':>9}{'ratio':>8}"]
    for s in c["sizes"]:
        for d in ("store", "load"):
            x = s[d]
            b1 = x.get("tiered_kv_copy_batch_max_1")
            lines.append(f"   {_size(s['block_bytes']):<9}{x['link']:<14}{x['tiered_kv']['gb_per_s']:>10.2f}"
                         f"{x['baseline_torch_copy']['gb_per_s']:>13.2f}{x['ratio_tiered_kv_over_baseline']:>8.3f}   "
                         + f"{x['tiered_kv']['gb_per_s_worst']:.2f}..{x['tiered_kv']['gb_per_s_best']:.2f}".ljust(22)
                         + (f"{b1['gb_per_s']:>9.2f}{x['ratio_batch_max_1_over_baseline']:>8.3f}" if b1 else "")
                         + (f"{x['tiered_kv_event_per_copy']['gb_per_s']:>9.2f}"
                            f"{x['ratio_event_per_copy_over_baseline']:>8.3f}" if "tiered_kv_event_per_copy" in x else ""))
        if s["problems"]:
            lines.append(f"     problems: {s['problems'][:3]}")
    cc = c.get("call_costs")
    if cc:
        lines.append(f"   engine-thread CPU per CUDA call on this host: an event's record + query "
                     f"{cc['event_record_and_query_us']:.1f} us, a copy_ of 64 bytes {cc['copy_call_us']:.1f} us")
    batched = [s for s in c["sizes"] if "tiered_kv_batched_per_block" in s["store"]]
    if batched:
        lines.append(f"   a step's blocks as one store_many/load_many of {STEP_BLOCKS}, GB/s and ratio to one large copy_ "
                     "of the same bytes; engine-thread CPU us per step (mean):")
        lines.append(f"   {'block':<9}{'link':<14}{'one copy_':>10}{'batched':>9}{'ratio':>7}{'shuffled':>10}{'ratio':>7}"
                     f"{'per-block':>11}{'ratio':>7}   {'cpu/step batched/shuffled/per-block'}")
        for s in batched:
            for d in ("store", "load"):
                x = s[d]
                row = f"   {_size(s['block_bytes']):<9}{x['link']:<14}{x['baseline_one_large_copy']['gb_per_s']:>10.2f}"
                for name in ("batched", "batched_scattered", "batched_per_block"):
                    row += f"{x[f'tiered_kv_{name}']['gb_per_s']:>{9 if name == 'batched' else 10 if name == 'batched_scattered' else 11}.2f}"
                    row += f"{x[f'ratio_{name}_over_large_copy']:>7.3f}"
                cpu = [x[k]["mean"] for k in ("engine_cpu_us_per_step", "engine_cpu_us_per_step_batched_scattered",
                                              "engine_cpu_us_per_step_batched_per_block")]
                lines.append(row + "   " + "/".join(f"{v:.0f}" for v in cpu))
    w = c.get("worker_layout")
    if w:
        lines.append(f"   the vLLM worker's layout: {w['kv_tensors']} KV tensors of {_size(w['plane_bytes'])} blocks side by "
                     f"side in a slab row, steps of {w['blocks_per_step']} blocks (random rows, consecutive slots); "
                     "GB/s, ratio to one copy_ of a step's bytes, engine-thread CPU us per step (mean):")
        for direction in ("store", "load"):
            row = f"     {direction:<6} one copy_ {w[f'baseline_one_copy_{direction}_gb_per_s']:.2f}"
            for mode in ("grouped", "per_block"):
                x = w[mode][direction]
                row += (f"   {mode.replace('_', '-')} {x['gb_per_s']:.2f} ({x['ratio_over_one_copy']:.3f}x, "
                        f"{x['engine_cpu_us_per_step']['mean']:.0f} us)")
            lines.append(row)
        lines.append(f"     failed, missing or wrong: grouped {w['grouped']['problems']}, "
                     f"per-block {w['per_block']['problems']}")
    cl = c.get("store_latency")
    if cl:
        lines.append(f"   store() on the CUDA KV tensor ({cl['mover']}, {_size(cl['row_bytes'])} rows, "
                     f"{cl['stores_per_poll']} stores then poll() then {cl['engine_step_sleep_s'] * 1e3:g} ms; "
                     "baseline: the unsafe original queuing the same copy), us p50/p90/p99/max, poll() p50/p99, "
                     "engine thread per step (mean):")
        rows = [(f"tiered_kv (copy_batch_max={cl.get('copy_batch_max', '?')})", cl["tiered_kv"]),
                ("baseline", cl["baseline_figures"])]
        c1 = c.get("store_latency_copy_batch_max_1")
        if c1:
            rows.insert(1, ("tiered_kv (copy_batch_max=1)", c1["tiered_kv"]))
            rows.append(("baseline (beside batch=1)", c1["baseline_figures"]))
        cs = c.get("store_latency_stage_32MiB")
        if cs:
            rows.insert(1, ("tiered_kv (32 MiB staging)", cs["tiered_kv"]))
            rows.append(("baseline (beside 32 MiB)", cs["baseline_figures"]))
        for name, side in rows:
            x, po, per = side["store_all_calls"], side["poll"], side.get("engine_us_per_step_mean")
            lines.append(f"     {name:<30} {x['median']:.1f}/{x['p90']:.1f}/{x['p99']:.1f}/{x['max']:.0f}"
                         f"   poll() {po['median']:.1f}/{po['p99']:.1f}"
                         + (f"   per step {per:.0f}" if per is not None else ""))
    return lines


