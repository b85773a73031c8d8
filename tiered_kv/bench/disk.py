"""Benchmark of the tiered_kv disk tier, each figure beside a baseline and a peer measured in the same run.

Measurement code, not runtime (nothing here is imported by ``import tiered_kv``); long because
each section carries its baseline, its peer and its own checks that the bytes really moved.

    tiered-kv bench [--quick]                 # every section, with the core and end to end
    tiered-kv bench --sections spill,promote,evicting,latency [--dir DIR]

python-diskcache (the peer) is an optional dependency (the ``bench`` extra),
imported on first use; without it the peer's figures are reported as
"not installed" and everything else runs.

Everything runs in one process, on the same blocks (seeded random bytes in a
"device" tensor, an ordinary CPU tensor here), in one temporary directory
under ``--dir`` (default: a fresh directory under the system temp dir), so
every system writes to the same filesystem.  Sections (each a function
returning a JSON-ready dict, for ``tiered-kv bench``; ``run_all`` runs them
all):

1. ``bench_spill`` -- sustained spill GB/s through the real ``TierManager``
   (write-through: ``store()`` every block from the device tensor, ``wait()``,
   then ``flush()``; timed from the first ``store`` until ``flush`` returns),
   for 2 MiB and 256 KiB blocks, ``durability="batch"`` and ``"sync"``, a fresh
   disk directory per repeat.  The engine loop keeps at most
   ``writer_queue_blocks`` jobs in flight so that no spill is shed (sheds are
   counted; a figure with sheds would be invalid).  Baselines on the same
   bytes: ``raw_fresh`` -- ``os.write`` of each block's buffer into a fresh
   file, ``os.fsync`` after every batch of the writer's nominal batch size
   (``core.disk_tier.writer_limits``) and at the end;
   ``raw_overwrite`` -- the same with ``os.pwrite`` in place into a pre-written
   file.  The target compares with ``raw_fresh`` (both fill a fresh file).
   Peer: python-diskcache ``Cache(dir).set(key, bytes)`` (values prebuilt as
   ``bytes`` outside the timer); ``diskcache`` adds one ``syncfs()`` after the
   last ``set`` so that its data is durable like ``flush()`` (diskcache never
   fsyncs its value files), ``diskcache_set`` is without it.
2. ``bench_promote`` -- promote GB/s: ``load()`` of every key of a working set
   that is only on disk (not in the host tier) into distinct device rows, then
   ``wait()``; cold (``echo 3 > /proc/sys/vm/drop_caches`` before each timed
   repeat of every system; whether it worked is in the output) and warm.
   Baseline: ``readinto`` of the same bytes from a file, block by block, into
   preallocated rows.  Peer: ``diskcache.Cache(dir).get(key)``.  The host tier
   is made cold by eviction, not by a reopen: the reopen's recovery scan reads
   every stored byte, and ``drop_caches`` cannot drop pages a process has
   mapped (see ``bench_promote``).  The cold reopen itself is measured apart
   (``reopen_cold``: recovery seconds for a known amount of data).
3. ``bench_evicting`` -- the spill measurement with the tier full and evicting
   continuously (capacity 256 MiB, 2 GiB written; quick: 64 MiB / 320 MiB):
   per-window GB/s from the writer's commit timeline (windows of the first
   fill are warm-up, discarded), slot file + ``data.mdb`` size / capacity at the end and
   its peak, LMDB's page accounting.  Baseline: ``raw_circular`` -- the same
   bytes written in place, round robin, into a pre-written file of the
   capacity's size (the raw analogue of a full tier), fsync per batch.  Peer:
   diskcache with ``size_limit`` = capacity (durable as above).
4. ``bench_engine_latency`` -- wall time (and this thread's CPU time) of each
   ``store()``, ``lookup()``, ``load()`` and ``poll()`` call on the engine
   thread while the disk writer is saturated: each step stores new 2 MiB
   blocks faster than the disk takes them, looks up 8 keys, loads a key that
   is only on disk (a promote), polls, then "computes" (sleeps) 1 ms.  The
   writer's busy fraction and queue depth show the saturation.  Baseline: the
   same loop on a manager without a disk tier, in segments that alternate
   with the saturated run's (each after its own warm-up; the writer's queue
   drains before a baseline segment starts).

Method: seeded; one warm-up repeat per figure, discarded; systems alternate
(order rotated each repeat); before each timed repeat ``gc.collect()``,
``os.sync()`` and a "hot memory" step (``_quiesce``): this VM hands freed
memory back to its host after a few seconds and faulting it in again costs tens of
microseconds per page, so every system gets the same recently freed pages
before its timer starts.  The host slab is faulted in before timing (pinned,
resident memory under CUDA).  Distributions are over repeats (throughput) or
calls (latency) and report median/p90/p99/max; ratios are of medians.
Nothing here asserts a timing; :mod:`.report` applies the targets.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as _dt
import gc
import math
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from prometheus_client import CollectorRegistry

from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.core.disk_tier import writer_limits
from tiered_kv.disk.format import SLOTS_NAME
from tiered_kv.errors import BlockBusyError
from tiered_kv.metrics import sample_total

from .common import GiB, KiB, MiB, as_mode, filesystem_of, summarize
from .common import gbs as _gbs
from .common import ratio as _ratio
from .core import ImmediateMover, _torch_threads

__all__ = [
    "drop_caches", "diskcache_module", "DISKCACHE_MISSING", "bench_spill", "bench_promote", "bench_evicting",
    "bench_engine_latency", "run_all", "format_report", "SECTIONS", "PLANS",
]

_DEFAULTS = TieredKVConfig(namespace="defaults", host_capacity_bytes=1)
_ANY_TIER = 1 << 40   # blocks: a tier large enough that its size does not cap the write batch
DISKCACHE_MISSING = "not installed (pip install 'tiered-kv[bench]')"
_UNSET: Any = object()
_diskcache: Any = _UNSET


def diskcache_module() -> Any:
    """python-diskcache, imported on first use (an optional ``bench`` extra); None when not installed."""
    global _diskcache
    if _diskcache is _UNSET:
        try:
            import diskcache  # type: ignore[import-untyped]
        except ImportError:
            diskcache = None
        _diskcache = diskcache
    return _diskcache


# ----------------------------------------------------------------------------- machine
_DROP_ALLOWED = [True]
_HOT_ALLOWED = [True]  # the hot-memory step of _quiesce (off in smoke runs: it costs time before every timer)


def _drop() -> bool:
    """drop_caches() unless the plan forbids it (smoke runs: a test must not flush a shared machine's cache)."""
    return drop_caches() if _DROP_ALLOWED[0] else False


def drop_caches() -> bool:
    """Write back dirty pages and drop the page cache (needs root); False when not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


_libc = ctypes.CDLL(None, use_errno=True)


def syncfs(path: Path) -> None:
    """``syncfs(2)`` of the filesystem holding ``path`` (falls back to ``sync``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if getattr(_libc, "syncfs", None) is None or _libc.syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


_HOT_TOUCH_GBPS: list[float] = []


def _touch_free(nbytes: int) -> float:
    """Touch ``nbytes`` of fresh anonymous memory page by page, then free it; the page-touch rate in GB/s."""
    t0 = time.perf_counter()
    try:  # numpy's buffer is plain malloc memory, as the page cache and LMDB's dirty pages will be
        import numpy as np
        a: Any = np.empty(nbytes, dtype=np.uint8)
    except ImportError:  # numpy is optional here (torch's allocator may back large tensors with huge pages)
        a = torch.empty(nbytes, dtype=torch.uint8)
    a[::4096] = 1
    del a
    return _gbs(nbytes, time.perf_counter() - t0)


def _quiesce(hot_bytes: int = 0) -> None:
    """Before a timer starts: collect garbage, write back dirty pages, and leave ``hot_bytes`` of hot free memory.

    This VM (Firecracker, nested virtualization, free page reporting) hands free memory back to its host
    about 2 s after it is freed; touching such a page again costs tens of microseconds.  Without this step
    every write path would time the VM's page faults for its page cache and buffers instead of the disk,
    and whichever system ran after a long pause would lose.  Touching and freeing ``hot_bytes`` (untimed)
    right before each timed repeat of every system gives each the same recently freed, host-backed pages,
    as on bare metal.  The touch rates are kept in ``_HOT_TOUCH_GBPS`` for the report.
    """
    gc.collect()
    os.sync()
    if hot_bytes and _HOT_ALLOWED[0]:
        _HOT_TOUCH_GBPS.append(_touch_free(hot_bytes))


def _hot_for(nbytes: int) -> int:
    """Hot free memory to leave before timing a run that writes/reads ``nbytes`` (page cache + buffers).

    Twice the bytes and 512 MiB more, up to 2 GiB: the pages a run takes are not the last ones freed (the
    allocator's per-CPU lists, the disk I/O process's own allocations), and with only ``nbytes`` + 96 MiB
    about half the 2 MiB spill runs through the disk I/O process still met host-cold pages in their first
    commit (each 2 MiB ``pwrite`` 4.7 ms instead of 0.3 ms: 80-90 ms added to a 100 ms run)."""
    return min(2 * nbytes + 512 * MiB, 2 * GiB)


def _touch_host_slab(mgr: TierManager) -> None:
    """Fault in the manager's host slab before timing (pinned, resident memory in a CUDA deployment)."""
    rows = getattr(mgr, "_host_rows", None)
    if isinstance(rows, torch.Tensor):
        rows.fill_(0)


# ----------------------------------------------------------------------------- workload
class _Blocks:
    """A "device" tensor of seeded random rows, with per-row views for the baselines."""

    def __init__(self, block_bytes: int, n_rows: int, seed: int) -> None:
        raw, self._mv = _seeded_rows(n_rows, block_bytes, seed * 1_000_003 + block_bytes)
        self.block_bytes = block_bytes
        self.n_rows = n_rows
        self.dev = raw.view(torch.float16).view(n_rows, block_bytes // 2)  # what an engine would hand over
        self.rows = raw  # [n_rows, block_bytes] uint8, same storage
        self.views = _row_views(self._mv, n_rows, block_bytes)
        self._blobs: Optional[list[bytes]] = None

    def blobs(self) -> list[bytes]:
        """The rows as ``bytes`` (diskcache's input), built once, outside every timer."""
        if self._blobs is None:
            self._blobs = [bytes(v) for v in self.views]
        return self._blobs


Blocks = _Blocks


def _seeded_rows(n_rows: int, block_bytes: int, seed: int) -> tuple[torch.Tensor, memoryview]:
    """Seeded random bytes in a [n_rows, block_bytes] uint8 tensor, and a memoryview over its memory.

    The memory is a torch allocation (64-byte aligned, like an engine's KV tensor), not a bytearray: on this
    machine a kernel copy to or from a buffer 16 bytes past a page boundary (where a large bytearray's data
    starts) runs up to 4x slower, which would handicap whichever side used it.
    """
    rng = random.Random(seed)
    total = n_rows * block_bytes
    t = torch.empty(total, dtype=torch.uint8)
    mv = _tensor_bytes(t)
    chunk = 16 * MiB  # randbytes() of more than 256 MiB overflows
    for off in range(0, total, chunk):
        mv[off:off + min(chunk, total - off)] = rng.randbytes(min(chunk, total - off))
    return t.view(n_rows, block_bytes), mv


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes (no numpy needed; keep ``t`` alive)."""
    assert t.is_contiguous() and t.device.type == "cpu"
    buf = (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())
    return memoryview(buf).cast("B")


def _row_views(mv: memoryview, n_rows: int, block_bytes: int) -> list[memoryview]:
    """One memoryview per row (what os.write / readinto take)."""
    return [mv[i * block_bytes:(i + 1) * block_bytes] for i in range(n_rows)]


def _keys(rng: random.Random, tag: str, n: int) -> list[bytes]:
    salt = rng.getrandbits(64)
    return [f"{tag}:{salt:016x}:{i:08d}".encode() for i in range(n)]


def _nominal_batch(block_bytes: int) -> int:
    """The default config's disk write batch for blocks of ``block_bytes`` (the library's own rule)."""
    return writer_limits(_DEFAULTS, block_bytes, _ANY_TIER)[0]


def _default_queue(block_bytes: int) -> int:
    """The default config's writer queue bound for blocks of ``block_bytes``."""
    return writer_limits(_DEFAULTS, block_bytes, _ANY_TIER)[1]




class _WriterProbe:
    """Times the disk writer's commits (instance-level wraps; no library edit).

    Threads (``disk_io="thread"``): the writer's ``_commit``/``_sync``.  The disk I/O process
    (the default): each frame of reports as the owner's receiver gets it -- a commit's spill reports
    travel in one frame, and their ``seconds`` shares add up to the commit's time; syncs are not
    seen from the owner's side (``syncs`` stays 0)."""

    def __init__(self, mgr: TierManager) -> None:
        disk = mgr.disk
        assert disk is not None, "disk tier failed to open"
        self.commits: list[tuple[float, float, int]] = []  # (end time, duration, spills committed ok)
        self.syncs: list[float] = []
        commits, syncs = self.commits, self.syncs
        if not hasattr(disk, "writer"):
            orig_dispatch = disk._dispatch

            def dispatch(items: list[Any]) -> bool:
                spills = [it for it in items if it[0] == "r" and it[2] == "spill" and it[3]]
                if spills:
                    commits.append((time.perf_counter(), sum(it[6] for it in spills), len(spills)))
                return bool(orig_dispatch(items))

            disk._dispatch = dispatch
            return
        orig_commit, orig_sync = disk.writer._commit, disk.writer._sync

        def commit(batch: list[Any]) -> Any:
            t = time.perf_counter()
            res = orig_commit(batch)
            t1 = time.perf_counter()
            commits.append((t1, t1 - t, sum(1 for _, r in res[0] if r.ok)))   # ((op, report) pairs, fault)
            return res

        def sync() -> None:
            t = time.perf_counter()
            orig_sync()
            syncs.append(time.perf_counter() - t)

        disk.writer._commit = commit  # type: ignore[method-assign]
        disk.writer._sync = sync  # type: ignore[method-assign]

    def summary(self, t0: float, t1: float) -> dict[str, Any]:
        return self.summary_windows([(t0, t1)])

    def summary_windows(self, windows: Sequence[tuple[float, float]]) -> dict[str, Any]:
        """The commits that ended inside any of ``windows`` ((start, end) perf_counter times)."""
        inside = [c for c in self.commits if any(t0 <= c[0] <= t1 for t0, t1 in windows)]
        span = sum(t1 - t0 for t0, t1 in windows)
        busy = sum(c[1] for c in inside)
        sizes = [c[2] for c in inside if c[2]]
        return {
            "commits": len(inside),
            "spills_per_commit": summarize(sizes, "blocks") if sizes else None,
            "commit_seconds": summarize([c[1] for c in inside], "s") if inside else None,
            "writer_busy_fraction": busy / span if span > 0 else float("nan"),
            "syncs": len(self.syncs),
            "sync_seconds_total": sum(self.syncs),
        }


def _manager(path: Path, blocks: _Blocks, *, capacity: int, host_bytes: int, durability: str = "batch",
             dev: Optional[torch.Tensor] = None, mover_factory: Any = None,
             **extra: Any) -> tuple[TierManager, CollectorRegistry]:
    reg = CollectorRegistry()
    cfg = TieredKVConfig(namespace=f"bench-disk|{blocks.block_bytes}", host_capacity_bytes=host_bytes,
                         disk_path=str(path), disk_capacity_bytes=capacity, durability=durability, **extra)  # type: ignore[arg-type]
    mgr = TierManager(cfg, blocks.dev if dev is None else dev, registry=reg, mover_factory=mover_factory)
    _touch_host_slab(mgr)
    return mgr, reg


def _spill_loop(mgr: TierManager, keys: Sequence[bytes], rows: Sequence[int], limit: int) -> tuple[float, bool, int]:
    """Store every key from its row, keeping <= ``limit`` jobs in flight; wait(); flush().  (t0, flushed, waits)."""
    waits = 0
    limit = max(1, min(limit, mgr.num_host_slots))  # a store or spill in flight leases a host slot
    t0 = time.perf_counter()
    for i, k in enumerate(keys):
        while mgr.jobs_in_flight >= limit:
            waits += 1
            time.sleep(0.0002)
            mgr.poll()
        mgr.store(k, rows[i])
        if (i & 7) == 7:
            mgr.poll()
    mgr.wait()
    ok = mgr.flush()
    return t0, ok, waits


def _tkv_spill(path: Path, blocks: _Blocks, keys: Sequence[bytes], *, durability: str, capacity: int,
               host_bytes: int, limit: Optional[int] = None) -> dict[str, Any]:
    mgr, reg = _manager(path, blocks, capacity=capacity, host_bytes=host_bytes, durability=durability)
    try:
        probe = _WriterProbe(mgr)
        lim = limit or _default_queue(blocks.block_bytes)
        rows = [i % blocks.n_rows for i in range(len(keys))]
        _quiesce(_hot_for(len(keys) * blocks.block_bytes))
        t0, ok, waits = _spill_loop(mgr, keys, rows, lim)
        t1 = time.perf_counter()
        shed = sample_total(reg, "tiered_kv_shed_total", kind="spill")
        spilled = sample_total(reg, "tiered_kv_jobs_total", kind="spill", outcome="ok")
        nbytes = int(spilled) * blocks.block_bytes   # what was written: a shed spill's bytes are not
        return {
            "seconds": t1 - t0, "gbps": _gbs(nbytes, t1 - t0), "bytes": nbytes,
            "bytes_offered": len(keys) * blocks.block_bytes, "flush_ok": ok,
            "spills_ok": int(spilled), "spills_shed": int(shed), "pacing_waits": waits,
            "disk_blocks": mgr.disk_blocks, "file_bytes": mgr.disk.disk_bytes() if mgr.disk else 0,
            "writer": probe.summary(t0, t1), "_probe": probe, "_t0": t0,
        }
    finally:
        mgr.close()


def _raw_write(path: Path, views: Sequence[memoryview], order: Sequence[int], batch: int, mode: str,
               file_blocks: Optional[int] = None) -> float:
    """os.write/os.pwrite of ``views[order[i]]``, fsync per ``batch`` blocks and at the end; seconds.

    mode "fresh": a new file, appended.  "overwrite"/"circular": a file of ``file_blocks`` blocks written
    and fsynced before the timer, then overwritten in place (wrapping around when longer).
    """
    bsz = len(views[0])
    if mode == "fresh":
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    else:
        nfb = file_blocks or len(order)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if os.fstat(fd).st_size != nfb * bsz:
            os.ftruncate(fd, 0)
            for i in range(nfb):
                os.write(fd, views[i % len(views)])
            os.fsync(fd)
    try:
        _quiesce(_hot_for(len(order) * bsz if mode == "fresh" else (file_blocks or len(order)) * bsz))
        t0 = time.perf_counter()
        if mode == "fresh":
            for n, i in enumerate(order, 1):
                os.write(fd, views[i])
                if n % batch == 0:
                    os.fsync(fd)
        else:
            nfb = file_blocks or len(order)
            for n, i in enumerate(order, 1):
                os.pwrite(fd, views[i], ((n - 1) % nfb) * bsz)
                if n % batch == 0:
                    os.fsync(fd)
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def _dc_write(path: Path, keys: Sequence[bytes], blobs: Sequence[bytes], order: Sequence[int],
              size_limit: int) -> tuple[float, float]:
    """diskcache set() of every key; (seconds until the last set returns, seconds until syncfs returns)."""
    dc = diskcache_module()
    assert dc is not None
    cache = dc.Cache(str(path), size_limit=size_limit)
    try:
        _quiesce(_hot_for(min(len(keys) * len(blobs[0]), size_limit)))
        t0 = time.perf_counter()
        for k, i in zip(keys, order):
            cache.set(k, blobs[i])
        t1 = time.perf_counter()
        syncfs(path)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t0
    finally:
        cache.close()


def _rmtree(p: Path) -> None:
    shutil.rmtree(p, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        if p.is_file():
            p.unlink()


def _fig(samples: Sequence[float], unit: str = "GB/s") -> dict[str, Any]:
    return summarize(samples, unit)


# ----------------------------------------------------------------------------- 1. spill
def bench_spill(base: Path, blocks: _Blocks, *, durability: str = "batch", n_blocks: Optional[int] = None,
                repeats: int = 5, warmup: int = 1, seed: int = 0, with_diskcache: bool = True) -> dict[str, Any]:
    """Sustained spill GB/s (store ... wait(); flush()) beside raw write+fsync and diskcache, one block size."""
    rng = random.Random(seed)
    n = n_blocks or blocks.n_rows
    bb = blocks.block_bytes
    batch = _nominal_batch(bb)
    order = [i % blocks.n_rows for i in range(n)]
    systems = ["tkv", "raw_fresh", "raw_overwrite"] + (["diskcache"] if with_diskcache and diskcache_module() else [])
    res: dict[str, list[float]] = {s: [] for s in systems + ["diskcache_set"]}
    detail: list[dict[str, Any]] = []
    over = base / f"raw-overwrite-{bb}.bin"
    for rep in range(warmup + repeats):
        rot = rep % len(systems)
        for sysname in systems[rot:] + systems[:rot]:
            if sysname == "tkv":
                d = base / f"tkv-spill-{bb}-{durability}-{rep}"
                r = _tkv_spill(d, blocks, _keys(rng, "spill", n), durability=durability,
                               capacity=max(2 * n * bb, 64 * MiB), host_bytes=(n + 16) * bb)
                _rmtree(d)
                if rep >= warmup:
                    res["tkv"].append(r["gbps"])
                    r.pop("_probe"), r.pop("_t0")
                    detail.append(r)
            elif sysname == "raw_fresh":
                f = base / f"raw-fresh-{bb}.bin"
                s = _raw_write(f, blocks.views, order, batch, "fresh")
                f.unlink()
                if rep >= warmup:
                    res["raw_fresh"].append(_gbs(n * bb, s))
            elif sysname == "raw_overwrite":
                s = _raw_write(over, blocks.views, order, batch, "overwrite", file_blocks=n)
                if rep >= warmup:
                    res["raw_overwrite"].append(_gbs(n * bb, s))
            else:
                d = base / f"dc-spill-{bb}-{rep}"
                s_set, s_dur = _dc_write(d, _keys(rng, "dc", n), blocks.blobs(), order, size_limit=1 << 40)
                _rmtree(d)
                if rep >= warmup:
                    res["diskcache"].append(_gbs(n * bb, s_dur))
                    res["diskcache_set"].append(_gbs(n * bb, s_set))
    with contextlib.suppress(FileNotFoundError):
        over.unlink()
    out: dict[str, Any] = {
        "block_bytes": bb, "durability": durability, "blocks_per_repeat": n, "bytes_per_repeat": n * bb,
        "repeats": repeats, "warmup_discarded": warmup, "raw_fsync_every_blocks": batch,
        "raw_note": (f"raw_fresh: os.write into a fresh file, os.fsync every {batch} blocks "
                     f"({batch * bb // MiB} MiB = the writer's nominal batch) and at the end; raw_overwrite: same, "
                     f"os.pwrite in place into a pre-written file of the same size"),
        "diskcache_note": ("diskcache: Cache.set(key, bytes) per block, then one syncfs() so that the data is "
                           "durable like flush(); diskcache_set: the same without syncfs (not durable)"),
        "figures": {k: _fig(v) for k, v in res.items() if v},
        "tkv_runs": detail,
    }
    med = {k: out["figures"][k]["median"] for k in out["figures"]}
    raw_best = max(med.get("raw_fresh", float("nan")), med.get("raw_overwrite", float("nan")))
    out["ratios"] = {
        "tkv_vs_raw_fresh": _ratio(med["tkv"], med["raw_fresh"]),
        "tkv_vs_raw_overwrite": _ratio(med["tkv"], med["raw_overwrite"]),
        "tkv_vs_raw_best": _ratio(med["tkv"], raw_best),
        "tkv_vs_diskcache": _ratio(med["tkv"], med["diskcache"]) if "diskcache" in med else None,
        "tkv_vs_diskcache_set": _ratio(med["tkv"], med["diskcache_set"]) if "diskcache_set" in med else None,
    }
    out["spills_shed_total"] = sum(r["spills_shed"] for r in detail)
    return out


# ----------------------------------------------------------------------------- 2. promote
def _read_through(path: Path, chunk: int = 8 * MiB) -> None:
    """Read a whole file once (into the page cache)."""
    buf = bytearray(chunk)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def _tkv_load_set(mgr: TierManager, dest: Optional[torch.Tensor], blocks: _Blocks, keys: Sequence[bytes],
                  cold: bool) -> tuple[float, dict[str, Any]]:
    """load() every key (on disk, not in the host tier) into row i, wait(); seconds and checks.

    ``dest``: the manager's device rows, checked afterwards; None for a manager whose host->row
    copies are answered without copying (``ImmediateMover``: the disk->host link alone), whose
    host tier's bytes are checked instead.
    """
    n = len(keys)
    if dest is not None:
        dest.zero_()
    in_host = sum(1 for k in keys if mgr.host_bytes(k) is not None)   # would be host loads, not promotes
    dropped = _drop() if cold else False
    _quiesce(_hot_for(n * blocks.block_bytes))
    misses = 0
    jobs: list[Any] = [None] * n
    t0 = time.perf_counter()
    for i, k in enumerate(keys):
        j = jobs[i] = mgr.load(k, i)
        if j is None:
            misses += 1
    comps = mgr.wait()
    t1 = time.perf_counter()
    failed = sum(1 for c in comps if not c.ok)
    ok = {id(c.job) for c in comps if c.ok}
    served = [i for i, j in enumerate(jobs) if j is not None and id(j) in ok]   # a miss or failure served nothing
    gone = 0
    # check the bytes (outside the timer): a wrong byte would make every figure meaningless
    if dest is not None:
        got = dest.view(torch.uint8).view(dest.shape[0], -1)
        bad = sum(1 for i in served[::max(1, len(served) // 16)] if not torch.equal(got[i], blocks.rows[i]))
    else:
        bad = 0
        # the last keys loaded, those still in the host tier: evicting ahead frees the least recently used
        # slot, which need not be the first key loaded (promotes are published as their reads land)
        for i in range(n - 1, max(-1, n - 17), -1):
            h = mgr.host_bytes(keys[i])
            if h is None:
                gone += 1
            else:
                bad += not torch.equal(h.view(torch.uint8).view(-1), blocks.rows[i])
    return t1 - t0, {"misses": misses, "failed": failed, "dropped": dropped, "bad_rows_checked": bad,
                     "in_host_before": in_host, "evicted_before_check": gone, "loaded": len(served)}


def _reopen_cold(base: Path, blocks: _Blocks, nbytes: int, rng: random.Random) -> dict[str, Any]:
    """Open a TierManager on a directory holding ``nbytes`` of blocks right after drop_caches: recovery time."""
    bb = blocks.block_bytes
    n = max(1, nbytes // bb)
    d = base / f"tkv-reopen-{bb}"
    mgr, _ = _manager(d, blocks, capacity=2 * n * bb + 64 * MiB, host_bytes=min(n, blocks.n_rows) * bb + bb)
    try:
        _spill_loop(mgr, _keys(rng, "reopen", n), [i % blocks.n_rows for i in range(n)], _default_queue(bb))
    finally:
        mgr.close()
    out: dict[str, Any] = {"dropped": _drop()}
    t0 = time.perf_counter()
    mgr, _ = _manager(d, blocks, capacity=2 * n * bb + 64 * MiB, host_bytes=bb)
    out["open_seconds"] = time.perf_counter() - t0
    rec = mgr.disk.recovery.as_dict() if mgr.disk is not None else {}
    mgr.close()
    # the same open again, page cache warm
    t0 = time.perf_counter()
    mgr, _ = _manager(d, blocks, capacity=2 * n * bb + 64 * MiB, host_bytes=bb)
    out["open_seconds_warm"] = time.perf_counter() - t0
    rec_warm = mgr.disk.recovery.as_dict() if mgr.disk is not None else {}
    mgr.close()
    _rmtree(d)
    out.update({"recovery_seconds": rec.get("seconds"), "recovery_seconds_warm": rec_warm.get("seconds"),
                "entries": rec.get("entries"), "bytes_on_disk": (rec.get("entries") or 0) * bb,
                "recovery_gbps": _gbs((rec.get("entries") or 0) * bb, rec.get("seconds") or 0.0),
                "note": "TierManager(...) on a directory right after drop_caches (then again, warm); the recovery "
                        "scan reads every stored byte: py-lmdb prefaults each value the cursor returns, page by "
                        "page, with the environment's readahead setting as DiskStore opens it"})
    return out


def _one_at_a_time(mgr: TierManager, dest: torch.Tensor, blocks: _Blocks, sets: Sequence[Sequence[bytes]],
                   tdir: Path, n_one: int, raw: Callable[[bool, Sequence[int]], list[float]],
                   rawf: Path) -> dict[str, Any]:
    """One load from disk at a time, page cache warm: ``load(key, row)`` then ``wait([job])`` per block,
    beside one ``pread`` + ``copy_`` per block; two rounds each, alternating, every sample kept."""
    bb = blocks.block_bytes
    # a set none of whose keys is in the host tier (each set loaded pushed the one before out)
    ks = next((s for s in sets if all(mgr.host_bytes(k) is None for k in s)), None)
    if ks is None:
        return {"skipped": "every set had keys in the host tier"}
    idx = list(range(min(n_one, len(ks))))
    _read_through(tdir / SLOTS_NAME)
    _read_through(rawf)
    tkv_s: list[float] = []
    raw_s: list[float] = []
    misses = failed = bad = 0
    pc = time.perf_counter
    rows = dest.view(torch.uint8).view(dest.shape[0], -1)
    for rnd in range(2):
        if rnd == 1:   # the second round reloads the same keys: push them out of the host tier first
            other = next(s for s in sets if s is not ks)
            for i, k in enumerate(other[:mgr.num_host_slots]):
                mgr.load(k, i % dest.shape[0])
            mgr.wait()
            if any(mgr.host_bytes(ks[i]) is not None for i in idx):
                break
        raw_first = rnd == 1
        if raw_first:
            raw_s += raw(False, idx)
        for i in idx:   # the rows the timed loads fill, cleared first (and before the quiesce, so they are not hot)
            rows[i].zero_()
        _quiesce()
        for i in idx:
            t0 = pc()
            job = mgr.load(ks[i], i)
            if job is None:
                misses += 1
                continue
            got = mgr.wait([job])
            t1 = pc()
            tkv_s.append(t1 - t0)
            failed += sum(1 for c in got if c.job is job and not c.ok)
            bad += not torch.equal(rows[i], blocks.rows[i])
        if not raw_first:
            raw_s += raw(False, idx)
    return {"blocks": len(idx), "block_bytes": bb, "misses": misses, "failed": failed, "bad_rows": bad,
            "tkv_us": summarize([x * 1e6 for x in tkv_s], "us"), "raw_us": summarize([x * 1e6 for x in raw_s], "us"),
            "ratio_median": _ratio(statistics.median(tkv_s), statistics.median(raw_s)) if tkv_s and raw_s else None}


def _after_reopen(open_mgr: Callable[[], TierManager], dest: torch.Tensor, blocks: _Blocks, keys: Sequence[bytes],
                  tdir: Path, raw: Callable[[bool, Sequence[int]], list[float]], rounds: int) -> dict[str, Any]:
    """A working set loaded right after the manager is reopened (what a restarted server meets: a new
    disk I/O process, which had mapped nothing of the host slab yet; an empty host tier), page cache
    warm, beside the same blocks' ``pread`` + ``copy_``; rounds alternating, the open not timed."""
    tkv: list[float] = []
    base: list[float] = []
    checks: list[dict[str, Any]] = []
    order = list(range(len(keys)))
    for rnd in range(rounds):
        if rnd % 2:
            base.append(_gbs(len(keys) * blocks.block_bytes, sum(raw(False, order))))
        _read_through(tdir / SLOTS_NAME)
        mgr = open_mgr()
        try:
            sec, chk = _tkv_load_set(mgr, dest, blocks, keys, False)
        finally:
            mgr.close()
        tkv.append(_gbs(chk["loaded"] * blocks.block_bytes, sec))   # the blocks it served, not those it missed
        checks.append(chk)
        if not rnd % 2:
            base.append(_gbs(len(keys) * blocks.block_bytes, sum(raw(False, order))))
    return {"rounds": rounds, "tkv": _fig(tkv), "raw_copy": _fig(base),
            "misses": sum(c["misses"] for c in checks), "failed": sum(c["failed"] for c in checks),
            "bad_rows": sum(c["bad_rows_checked"] for c in checks),
            "in_host_before": sum(c["in_host_before"] for c in checks),
            "ratio": _ratio(statistics.median(tkv), statistics.median(base))}


def bench_promote(base: Path, blocks: _Blocks, *, n_blocks: Optional[int] = None, repeats: int = 5, warmup: int = 1,
                  seed: int = 0, with_diskcache: bool = True, warm_repeats: int = 3,
                  recovery_bytes: int = 0, with_link: bool = True, one_blocks: int = 32,
                  reopen_rounds: int = 3) -> dict[str, Any]:
    """Promote GB/s (keys only on disk, host tier cold) beside a raw file read and diskcache get, one block size.

    How the host tier is made cold: one manager (host tier of exactly one working set) spills
    ``warmup + repeats + 1`` working sets; each later set pushes the earlier ones out of the host tier;
    their pages were written with ``pwrite`` into the slot file and never mapped, so ``drop_caches``
    drops them.  Repeat r loads set r.  Warm repeats reload the first sets after reading the slot file
    once (untimed): the cold repeats' ``drop_caches`` had dropped them.  The reopen is measured apart
    (``recovery_*``: cold open of the directory holding every set), and so are ``reopen_rounds`` loads of
    a set right after a reopen of the same directory (:func:`_after_reopen`).
    """
    rng = random.Random(seed + 1)
    n = min(n_blocks or blocks.n_rows, blocks.n_rows)
    bb = blocks.block_bytes
    order = list(range(n))
    n_sets = warmup + repeats + 1
    sets = [_keys(rng, f"promote{k}", n) for k in range(n_sets)]
    # --- the working sets in each system (untimed)
    tdir = base / f"tkv-promote-{bb}"
    dest_dev = blocks.dev[:n].clone()  # the manager's device rows: the stores read them, the loads overwrite them
    mgr, reg = _manager(tdir, blocks, capacity=(n_sets + 1) * n * bb, host_bytes=n * bb, dev=dest_dev)
    rawf = base / f"raw-promote-{bb}.bin"
    ddir = base / f"dc-promote-{bb}"
    ldir = base / f"tkv-promote-link-{bb}"
    lmgr: Optional[TierManager] = None
    use_dc = with_diskcache and diskcache_module() is not None
    results: dict[str, Any] = {"dropped": []}
    figs: dict[str, dict[str, list[float]]] = {"cold": {}, "warm": {}}
    checks: list[dict[str, Any]] = []
    link_checks: list[dict[str, Any]] = []
    try:
        for ks in sets:
            _spill_loop(mgr, ks, order, _default_queue(bb))
        on_disk = mgr.disk_blocks
        if with_link:
            # the same sets in a second directory, reopened with device copies answered without copying:
            # its loads time the disk->host link alone (on this CPU-only "device" the host->row copy
            # of a real load is a second memcpy, which a GPU's copy engine would do instead)
            pm, _ = _manager(ldir, blocks, capacity=(n_sets + 1) * n * bb, host_bytes=n * bb, dev=dest_dev)
            try:
                for ks in sets:
                    _spill_loop(pm, ks, order, _default_queue(bb))
            finally:
                pm.close()
            lmgr, _ = _manager(ldir, blocks, capacity=(n_sets + 1) * n * bb, host_bytes=n * bb,
                               dev=dest_dev.clone(), mover_factory=ImmediateMover)
        in_host = sum(1 for k in sets[0] if mgr.host_bytes(k) is not None)
        _raw_write(rawf, blocks.views, order, _nominal_batch(bb), "fresh")
        if use_dc:
            _dc_write(ddir, sets[0], blocks.blobs(), order, size_limit=1 << 40)
        dest = torch.zeros(n * bb, dtype=torch.uint8)  # raw reads land in preallocated, faulted-in rows too
        dviews = _row_views(_tensor_bytes(dest), n, bb)

        def raw_read(cold: bool) -> float:
            if cold:
                results["dropped"].append(_drop())
            fd = os.open(rawf, os.O_RDONLY)
            try:
                _quiesce(_hot_for(n * bb))
                t0 = time.perf_counter()
                with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
                    for i in order:
                        f.readinto(dviews[i])
                return time.perf_counter() - t0
            finally:
                os.close(fd)

        # the fair baseline of a promote: what an unverified hand-written path does -- pread each block
        # into a buffer, then copy_ it into its device row (here rows of the same shape and dtype)
        rdev = torch.zeros_like(dest_dev)
        rrows = rdev.view(torch.uint8).view(n, bb)
        stage = torch.empty(bb, dtype=torch.uint8)
        stage_mv = _tensor_bytes(stage)

        def raw_pread_copy(cold: bool, which: Sequence[int]) -> list[float]:
            """Seconds of each block's pread + copy_ (the batch: their sum, no other work between)."""
            if cold:
                results["dropped"].append(_drop())
            fd = os.open(rawf, os.O_RDONLY)
            pc = time.perf_counter
            out_s = []
            try:
                _quiesce(_hot_for(n * bb))
                with _torch_threads(1):   # one thread, as each of tiered_kv's copies (and the host bench's baseline)
                    for i in which:
                        t0 = pc()
                        os.preadv(fd, [stage_mv], i * bb)
                        rrows[i].copy_(stage)
                        out_s.append(pc() - t0)
            finally:
                os.close(fd)
            for i in which[:: max(1, len(which) // 8)]:   # outside the timer: the rows hold the blocks
                if not torch.equal(rrows[i], blocks.rows[i]):
                    results.setdefault("raw_bad_rows", 0)
                    results["raw_bad_rows"] += 1
            return out_s

        def dc_read(cold: bool) -> float:
            dc = diskcache_module()
            assert dc is not None
            cache = dc.Cache(str(ddir))
            try:
                if cold:
                    results["dropped"].append(_drop())
                _quiesce(_hot_for(n * bb))
                t0 = time.perf_counter()
                for k in sets[0]:
                    v = cache.get(k)
                    assert v is not None
                return time.perf_counter() - t0
            finally:
                cache.close()

        systems = ["tkv", "raw", "raw_copy", "diskcache"] if use_dc else ["tkv", "raw", "raw_copy"]
        # tiered_kv's systems: (manager, its device rows to check or None, directory, checks)
        managers: dict[str, tuple[TierManager, Optional[torch.Tensor], Path, list[dict[str, Any]]]] = {
            "tkv": (mgr, dest_dev, tdir, checks)}
        if lmgr is not None:
            systems.append("link")
            managers["link"] = (lmgr, None, ldir, link_checks)
        loaded = {s: 0 for s in managers}   # sets each has loaded in this cache state
        # the host tier holds one set: each load pushes the one before out.  Warm loads cycle over every
        # set but the last cold one (still resident), so none loads the resident set, however many rounds
        warm_pool = [k for k in range(n_sets) if k != warmup + repeats - 1]
        # warm: one untimed round first, since the cold rounds' drop_caches dropped the raw file's and
        # diskcache's pages too (before 2026-11-29 session 3 their first warm sample was a cold read)
        for cache_state, reps, wu in (("cold", repeats, warmup), ("warm", warm_repeats, 1)):
            cold = cache_state == "cold"
            if not cold:   # sets loaded once already: pages warm, host tier pushed them out again
                loaded = {s: 0 for s in managers}
            for rep in range(wu + reps):
                rot = rep % len(systems)
                for s in systems[rot:] + systems[:rot]:
                    if s in managers:
                        m, rows, d, chks = managers[s]
                        if not cold:
                            # the cold repeats' drop_caches dropped the earlier sets' pages: read them back
                            # (untimed), as the raw file and diskcache are warm from their previous read
                            _read_through(d / SLOTS_NAME)
                        k = loaded[s]
                        sec, chk = _tkv_load_set(m, rows, blocks, sets[k if cold else warm_pool[k % len(warm_pool)]],
                                                 cold)
                        loaded[s] += 1
                        served = chk["loaded"] * bb   # the blocks it served, not those it missed
                        if cold:
                            results["dropped"].append(chk["dropped"])
                        chks.append(chk)
                    elif s == "raw":
                        sec, served = raw_read(cold), n * bb
                    elif s == "raw_copy":
                        sec, served = sum(raw_pread_copy(cold, order)), n * bb
                    else:
                        sec, served = dc_read(cold), n * bb
                    if rep >= wu:
                        figs[cache_state].setdefault(s, []).append(_gbs(served, sec))
        one = _one_at_a_time(mgr, dest_dev, blocks, sets, tdir, one_blocks, raw_pread_copy, rawf) if one_blocks else None
    finally:
        mgr.close()
        if lmgr is not None:
            lmgr.close()
    after_reopen = None
    if reopen_rounds:
        after_reopen = _after_reopen(
            lambda: _manager(tdir, blocks, capacity=(n_sets + 1) * n * bb, host_bytes=n * bb, dev=dest_dev)[0],
            dest_dev, blocks, sets[0], tdir, raw_pread_copy, reopen_rounds)
    _rmtree(tdir), _rmtree(ddir), _rmtree(ldir), rawf.unlink()
    reopen = _reopen_cold(base, blocks, recovery_bytes, rng) if recovery_bytes else None
    dropped = results["dropped"]
    out: dict[str, Any] = {
        "block_bytes": bb, "blocks_per_repeat": n, "bytes_per_repeat": n * bb, "repeats": repeats,
        "warmup_discarded": warmup, "blocks_on_disk": on_disk, "first_set_blocks_in_host_before": in_host,
        "drop_caches_worked": bool(dropped) and all(dropped),
        "raw_note": "raw: readinto() of each block from a file holding the same bytes, sequential, one thread, "
                    "into preallocated rows (unbuffered FileIO)",
        "raw_copy_note": "raw_copy: pread() of each block from that file into one buffer, then copy_ into its row "
                         "(rows of the device tensor's shape and dtype); no checksum",
        "raw_copy_bad_rows": results.get("raw_bad_rows", 0),
        "one_at_a_time": {"warm": one} if one else {},
        "after_reopen": {"warm": after_reopen} if after_reopen else {},
        "diskcache_note": "diskcache: Cache.get(key) of every key (returns bytes)",
        "tkv_note": "tkv: load(key, row) of every key of a working set that is only on disk (pushed out of the "
                    "host tier by later sets, never read since it was written), then wait(); cold: page cache "
                    "dropped first; warm: sets loaded once before",
        "figures": {st: {k: _fig(v) for k, v in d.items()} for st, d in figs.items()},
        "tkv_misses": sum(c["misses"] for c in checks), "tkv_failed": sum(c["failed"] for c in checks),
        "tkv_loads_already_in_host": sum(c["in_host_before"] for c in checks),
        "tkv_bad_rows": sum(c["bad_rows_checked"] for c in checks),
        "reopen_cold": reopen,
    }
    if link_checks:
        out["link_note"] = ("link: the same load() rounds on a second directory holding the same sets, its manager "
                            "built with ImmediateMover (host->row copies answered without copying): the disk->host "
                            "link alone; checked on the host tier's bytes")
        out["link_misses"] = sum(c["misses"] for c in link_checks)
        out["link_failed"] = sum(c["failed"] for c in link_checks)
        out["link_bad_blocks"] = sum(c["bad_rows_checked"] for c in link_checks)
        out["link_evicted_before_check"] = sum(c.get("evicted_before_check", 0) for c in link_checks)
        out["link_loads_already_in_host"] = sum(c["in_host_before"] for c in link_checks)
    out["ratios"] = {}
    for st in ("cold", "warm"):
        f = out["figures"][st]
        out["ratios"][st] = {
            "tkv_vs_raw": _ratio(f["tkv"]["median"], f["raw"]["median"]),
            "tkv_vs_raw_pread_copy": _ratio(f["tkv"]["median"], f["raw_copy"]["median"]),
            "tkv_vs_diskcache": _ratio(f["tkv"]["median"], f["diskcache"]["median"]) if "diskcache" in f else None,
            "link_vs_raw": _ratio(f["link"]["median"], f["raw"]["median"]) if "link" in f else None,
        }
    return out


# ----------------------------------------------------------------------------- 3. full and evicting
def _lmdb_pages(disk: Any) -> dict[str, Any]:
    """Pages in use by each sub-database vs pages in the file (the rest is LMDB's freelist or never reused)."""
    env = getattr(disk, "_env", None)
    if env is None:
        return {}
    out: dict[str, Any] = {}
    used = 0
    with env.begin() as txn:
        for name in ("_blocks", "_tombs", "_touch", "_meta"):
            db = getattr(disk, name, None)
            if db is None:
                continue
            st = txn.stat(db)
            n = st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
            out[name.strip("_") + "_pages"] = n
            used += n
        st = txn.stat()
        used += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
    last = env.info()["last_pgno"] + 1
    out.update({"used_pages": used, "file_pages": last, "free_or_unused_pages": last - used,
                "free_fraction_of_file": (last - used) / last if last else float("nan")})
    return out


def _tkv_evicting(d: Path, blocks: _Blocks, keys: Sequence[bytes], order: Sequence[int], *, capacity: int,
                  limit: int, window: int) -> dict[str, Any]:
    """One tiered_kv run of the full-and-evicting spill, with the data file sampled meanwhile."""
    bb = blocks.block_bytes
    n = len(keys)
    cap_blocks = capacity // bb
    sizes: list[tuple[float, int]] = []
    stop = threading.Event()

    def sampler() -> None:
        files = (d / "data.mdb", d / SLOTS_NAME)
        while not stop.wait(0.05):
            with contextlib.suppress(OSError):
                sizes.append((time.perf_counter(), sum(f.stat().st_size for f in files if f.exists())))

    mgr, reg = _manager(d, blocks, capacity=capacity, host_bytes=(limit + 64) * bb)
    th = threading.Thread(target=sampler, daemon=True)
    try:
        probe = _WriterProbe(mgr)
        _quiesce(_hot_for(capacity))
        th.start()
        t0, ok, waits = _spill_loop(mgr, keys, order, limit)
        t1 = time.perf_counter()
        stop.set()
        th.join()
        disk = mgr.disk
        assert disk is not None
        file_end = disk.disk_bytes()   # slot file + LMDB index
        db = getattr(disk, "db", None)   # LMDB's own accounting: only seen in-process (disk_io="thread")
        env = db.env if db is not None else None
        info = env.info() if env is not None else {}
        stat = env.stat() if env is not None else {}
        pages = _lmdb_pages(disk)
        spills_ok = int(sample_total(reg, "tiered_kv_jobs_total", kind="spill", outcome="ok"))
        tkv = {
            "seconds": t1 - t0, "gbps": _gbs(spills_ok * bb, t1 - t0), "flush_ok": ok, "pacing_waits": waits,
            "spills_ok": spills_ok,   # the rate counts these: a shed spill's bytes were not written
            "spills_shed": int(sample_total(reg, "tiered_kv_shed_total", kind="spill")),
            "evictions": int(sample_total(reg, "tiered_kv_evictions_total", tier="disk")),
            "disk_blocks_end": mgr.disk_blocks, "file_bytes_end": file_end,
            "file_bytes_peak": max([s for _, s in sizes] + [file_end]),
            "map_size_end": disk.map_size, "lmdb_last_pgno": info.get("last_pgno"), "lmdb_psize": stat.get("psize"),
            "lmdb_pages": pages,
            "writer": probe.summary(t0, t1),
        }
        # per-window throughput from the commit timeline; the first fill (capacity) is warm-up
        commits = [c for c in probe.commits if c[0] >= t0]
        wins: list[float] = []
        done_blocks, w_start, w_blocks = 0, t0, 0
        for end, _dur, k in commits:
            done_blocks += k
            w_blocks += k
            if w_blocks >= window:
                if done_blocks > cap_blocks + window:  # windows entirely past the first fill
                    wins.append(_gbs(w_blocks * bb, end - w_start))
                w_start, w_blocks = end, 0
        tkv["window_gbps"] = _fig(wins)
        tkv["steady_gbps_median"] = tkv["window_gbps"]["median"]
        tkv["file_vs_capacity_end"] = file_end / capacity
        tkv["file_vs_capacity_peak"] = tkv["file_bytes_peak"] / capacity
        tkv["file_samples"] = [(round(t - t0, 3), s) for t, s in sizes[:: max(1, len(sizes) // 40)]]
        return tkv
    finally:
        stop.set()
        mgr.close()
        _rmtree(d)


def bench_evicting(base: Path, blocks: _Blocks, *, capacity: int, total: int, seed: int = 0,
                   with_diskcache: bool = True, window_bytes: Optional[int] = None,
                   repeats: int = 1) -> dict[str, Any]:
    """Spill with the tier full and evicting: windows of GB/s, file size / capacity, beside raw in-place writes.

    ``repeats`` runs of each (tiered_kv and the raw circular writes alternate, the order rotated each
    repeat): one run of each was one sample of a figure that moved 0.6-0.9x between whole benchmark
    runs.  ``tkv`` holds the run with the median steady rate; the ratios are of medians over runs, with
    each repeat's own pair in ``ratios["..._runs"]``; the file size figures are the largest of any run.
    diskcache runs once (its target is met several times over).
    """
    rng = random.Random(seed + 2)
    bb = blocks.block_bytes
    n = total // bb
    cap_blocks = capacity // bb
    order = [i % blocks.n_rows for i in range(n)]
    batch = _nominal_batch(bb)
    window = max(1, (window_bytes or capacity // 2) // bb)
    # in flight: below the queue bound and well below the disk capacity (in-flight spills cannot be evicted)
    limit = max(2, min(_default_queue(bb), cap_blocks * 3 // 4))
    out: dict[str, Any] = {"block_bytes": bb, "capacity_bytes": capacity, "bytes_written": n * bb,
                           "blocks_written": n, "inflight_limit": limit, "window_blocks": window,
                           "repeats": repeats}
    runs: list[dict[str, Any]] = []
    raw_gbps: list[float] = []
    rawf = base / f"raw-evict-{bb}.bin"
    try:
        for rep in range(max(1, repeats)):
            for which in (("tkv", "raw") if rep % 2 == 0 else ("raw", "tkv")):
                if which == "tkv":
                    runs.append(_tkv_evicting(base / f"tkv-evict-{bb}-{rep}", blocks, _keys(rng, "evict", n), order,
                                              capacity=capacity, limit=limit, window=window))
                else:
                    # the same bytes written in place, round robin over a capacity-sized pre-written file
                    raw_gbps.append(_gbs(n * bb, _raw_write(rawf, blocks.views, order, batch, "circular",
                                                            file_blocks=cap_blocks)))
    finally:
        with contextlib.suppress(FileNotFoundError):
            rawf.unlink()
    steady = [r["steady_gbps_median"] for r in runs]
    tkv = dict(runs[sorted(range(len(runs)), key=lambda i: steady[i])[(len(runs) - 1) // 2]])
    # the file figures of the worst run, each ratio with the byte count it was computed from
    for which in ("end", "peak"):
        worst = max(runs, key=lambda r: r[f"file_vs_capacity_{which}"])
        tkv[f"file_bytes_{which}"] = worst[f"file_bytes_{which}"]
        tkv[f"file_vs_capacity_{which}"] = worst[f"file_vs_capacity_{which}"]
    out["tkv"] = tkv
    out["tkv_runs"] = [{k: r[k] for k in ("gbps", "steady_gbps_median", "file_vs_capacity_end",
                                          "file_vs_capacity_peak", "evictions", "spills_shed")} for r in runs]
    out["raw_circular"] = {"gbps": _fig(raw_gbps)["median"], "runs": raw_gbps,
                           "note": f"os.pwrite in place, round robin over a pre-written {capacity // MiB} MiB file, "
                                   f"fsync every {batch} blocks"}
    if with_diskcache and diskcache_module() is not None:
        dd = base / f"dc-evict-{bb}"
        s_set, s_dur = _dc_write(dd, _keys(rng, "dce", n), blocks.blobs(), order, size_limit=capacity)
        size = sum(p.stat().st_size for p in dd.rglob("*") if p.is_file())
        _rmtree(dd)
        out["diskcache"] = {"seconds": s_dur, "gbps": _gbs(n * bb, s_dur), "gbps_set_only": _gbs(n * bb, s_set),
                            "dir_bytes_end": size, "dir_vs_capacity_end": size / capacity,
                            "note": "diskcache.Cache(size_limit=capacity).set(), then syncfs()"}
    overall = _fig([r["gbps"] for r in runs])["median"]
    out["tkv_overall_gbps_median"] = overall   # the overall figures' value: the median of the runs' overall rates
    out["ratios"] = {
        "tkv_steady_vs_raw_circular": _ratio(_fig(steady)["median"], out["raw_circular"]["gbps"]),
        "tkv_overall_vs_raw_circular": _ratio(overall, out["raw_circular"]["gbps"]),
        "tkv_overall_vs_diskcache": _ratio(overall, out["diskcache"]["gbps"]) if "diskcache" in out else None,
        "tkv_steady_vs_raw_circular_runs": [_ratio(a, b) for a, b in zip(steady, raw_gbps)],
    }
    return out


# ----------------------------------------------------------------------------- 4. engine-thread latency
_SLOW_CALL_US = 50.0   # a call slower than this is "slow": the report says what made such calls slow


def _call_stats(rows: list[tuple[float, float, float]], slow_us: float) -> dict[str, Any]:
    """Wall/CPU/GC summaries of (wall us, thread CPU us, GC us overlapping) rows, and what made slow calls slow."""
    slow = [r for r in rows if r[0] > slow_us]
    out: dict[str, Any] = {
        "wall_us": summarize([r[0] for r in rows], "us"),
        "cpu_us": summarize([r[1] for r in rows], "us"),
        "slow_threshold_us": slow_us,
        "slow_calls": len(slow),
        "slow_fraction": len(slow) / len(rows) if rows else float("nan"),
    }
    if slow:
        out["slow_waiting_fraction"] = sum(1 for w, c, _ in slow if c < 0.5 * w) / len(slow)
        out["slow_with_gc_fraction"] = sum(1 for _, _, g in slow if g > 0) / len(slow)
        out["slow_cpu_us"] = summarize([c for _, c, _ in slow], "us")
        out["slow_wait_us"] = summarize([max(0.0, w - c) for w, c, _ in slow], "us")
    return out


class _LatencyLoop:
    """The engine loop of :func:`bench_engine_latency`, run in segments that add to one set of samples.

    ``disk_keys``: keys to load (cycled); None: load a key stored 16 steps ago.  Each call is timed with
    perf_counter_ns (wall) and thread_time_ns (this thread's CPU time); a call whose wall time is mostly
    not CPU time was waiting (for the GIL, a lock, or a core).  GC pauses overlapping a call are measured
    with gc.callbacks.
    """

    def __init__(self, mgr: TierManager, blocks: _Blocks, rng: random.Random, disk_keys: Optional[Sequence[bytes]],
                 stores_per_step: int, step_sleep_s: float, load_every: int, probe: Optional[_WriterProbe]) -> None:
        self.mgr, self.blocks, self.probe = mgr, blocks, probe
        self.stores_per_step, self.step_sleep_s, self.load_every = stores_per_step, step_sleep_s, load_every
        n_rows = blocks.n_rows
        self.store_rows = list(range(n_rows // 2))
        self.load_rows = list(range(n_rows // 2, n_rows))
        self.rows: dict[str, list[tuple[float, float, float]]] = {"store": [], "lookup": [], "load": [], "poll": []}
        self.depth: list[int] = []
        self.salt = rng.getrandbits(64)
        self.recent: list[bytes] = []
        self.dk = list(disk_keys or ())
        rng.shuffle(self.dk)
        self.n_loads = self.busy_rows = self.load_none = self.step = self.n_stored = 0
        self.windows: list[tuple[float, float]] = []   # the measured part of each segment
        self.seconds = 0.0                               # wall time of the segments, warm-ups included
        self.warmup_s = 0.0

    def run(self, seconds: float, warmup_s: float) -> None:
        """One segment: ``warmup_s`` of steps not recorded, then ``seconds`` recorded; then wait for every job
        and ``flush()`` (with a disk tier: the writer's queue drains, so the next segment of the other side
        runs beside a quiet disk tier)."""
        mgr, rows, recent, dk = self.mgr, self.rows, self.recent, self.dk
        self.warmup_s = warmup_s
        disk = mgr.disk
        pc, tt = time.perf_counter_ns, time.thread_time_ns
        BlockBusy = BlockBusyError
        gc_ns = [0, 0]

        def gc_cb(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                gc_ns[1] = pc()
            else:
                gc_ns[0] += pc() - gc_ns[1]

        recording = [False]

        def call(kind: str, fn: Callable[..., Any], *args: Any) -> Any:
            g0 = gc_ns[0]
            c0 = tt()
            a = pc()
            try:
                res = fn(*args)
            except BlockBusy:
                res = BlockBusy
            b = pc()
            c1 = tt()
            if recording[0]:
                rows[kind].append(((b - a) / 1e3, (c1 - c0) / 1e3, (gc_ns[0] - g0) / 1e3))
            return res

        _quiesce(_hot_for(self.blocks.n_rows * self.blocks.block_bytes + 512 * MiB))
        gc.callbacks.append(gc_cb)
        t_start = time.perf_counter()
        t_measure = t_start + warmup_s
        t_end = t_measure + seconds
        sps, load_every = self.stores_per_step, self.load_every
        try:
            while True:
                now = time.perf_counter()
                if now >= t_end:
                    break
                recording[0] = now >= t_measure
                for _ in range(sps):
                    k = b"lat:%016x:%09d" % (self.salt, self.n_stored)
                    row = self.store_rows[self.n_stored % len(self.store_rows)]
                    self.n_stored += 1
                    call("store", mgr.store, k, row)
                    recent.append(k)
                n_loads = self.n_loads
                probe_keys = recent[-4:] + (dk[max(0, n_loads - 4):n_loads] if n_loads and dk else recent[-8:-4])
                call("lookup", mgr.lookup, probe_keys)
                if self.step % load_every == 0 and (dk or len(recent) > 16 * sps):
                    k = dk[n_loads % len(dk)] if dk else recent[-16 * sps]
                    row = self.load_rows[n_loads % len(self.load_rows)]
                    self.n_loads += 1
                    job = call("load", mgr.load, k, row)
                    self.busy_rows += job is BlockBusy
                    self.load_none += job is None
                call("poll", mgr.poll)
                if recording[0] and disk is not None:
                    self.depth.append(disk.queue_depth)
                if len(recent) > 256:
                    del recent[:-128]
                self.step += 1
                time.sleep(self.step_sleep_s)
        finally:
            gc.callbacks.remove(gc_cb)
        self.windows.append((t_measure, t_end))
        mgr.wait(timeout=60)
        mgr.flush(timeout=60)   # the spills too (wait() leaves them to flush())
        self.seconds += time.perf_counter() - t_start

    def result(self) -> dict[str, Any]:
        rows = self.rows
        out: dict[str, Any] = {
            "steps": self.step, "segments": len(self.windows),
            "measured_seconds": sum(b - a for a, b in self.windows), "warmup_seconds_per_segment": self.warmup_s,
            "stores_per_step": self.stores_per_step, "step_sleep_s": self.step_sleep_s,
            "load_every_steps": self.load_every,
            "calls_us": {k: summarize([r[0] for r in v], "us") for k, v in rows.items() if v},
            "calls": {k: _call_stats(v, _SLOW_CALL_US) for k, v in rows.items() if v},
            "loads": self.n_loads, "loads_returning_none": self.load_none, "load_row_busy": self.busy_rows,
            "offered_store_gbps": (self.n_stored * self.blocks.block_bytes / self.seconds / 1e9
                                   if self.seconds else float("nan")),
        }
        if self.depth:
            out["writer_queue_depth"] = summarize(self.depth, "blocks")
            out["writer_queue_nonempty_fraction"] = sum(1 for d in self.depth if d > 0) / len(self.depth)
        if self.probe is not None:
            out["writer"] = self.probe.summary_windows(self.windows)
        return out


_LAT_LOADS = 600   # load() calls wanted in a latency run (see bench_engine_latency)


def bench_engine_latency(base: Path, blocks: _Blocks, *, seconds: float = 8.0, warmup_s: float = 1.0, seed: int = 0,
                         stores_per_step: int = 2, step_sleep_s: float = 0.001, n_disk_keys: int = 192,
                         idle_seconds: Optional[float] = None, writer_queue_blocks: Optional[int] = None,
                         segments: int = 3) -> dict[str, Any]:
    """store()/lookup()/load() wall time on the engine thread while the disk writer is saturated.

    ``segments``: the measured time of each side is cut into this many parts, each after its own warm-up,
    the saturated run's and the baseline's alternating.

    ``writer_queue_blocks``: the writer queue bound (default: the writer's own for the block size); the host tier is sized
    to hold the queue, so a smaller queue makes a cheaper run (smoke runs).
    """
    bb = blocks.block_bytes
    queue = writer_queue_blocks or _default_queue(bb)
    rng = random.Random(seed + 3)
    d = base / f"tkv-latency-{bb}"
    disk_keys = _keys(rng, "latdisk", n_disk_keys)
    host_bytes = (blocks.n_rows + queue + 64) * bb
    capacity = 8 * GiB  # no disk eviction: every disk key stays loadable
    # one load() of a key only on disk every load_every steps (a step takes ~ step_sleep + ~1 ms of calls):
    # about _LAT_LOADS in the run, so that its p99 is not the second-worst of ~150 calls.  Keys are cycled;
    # one comes back only after the stores have turned the host tier over twice, so it is only on disk
    # again (write-through kept it there) and each load starts a promote
    est_steps = (seconds + warmup_s) / (step_sleep_s + 0.001)
    turnover_steps = host_bytes // bb / max(1, stores_per_step)
    load_every = max(1, int(est_steps // _LAT_LOADS), math.ceil(2 * turnover_steps / n_disk_keys))
    # pre-populate the disk tier (untimed): after the reopen those keys are only on disk
    mgr, _ = _manager(d, blocks, capacity=capacity, host_bytes=(blocks.n_rows + 64) * bb)
    try:
        _spill_loop(mgr, disk_keys, [i % blocks.n_rows for i in range(n_disk_keys)], _default_queue(bb))
    finally:
        mgr.close()
    # the same loop without a disk tier (no writer; loads copy a host-resident key) is the baseline: the two
    # managers' segments alternate, the order flipped each time, so that both sides meet the same hours of
    # this VM (measured one after the other, the baseline's own p99 moved between 10 and 23 us from run to run)
    idle_s = idle_seconds if idle_seconds is not None else seconds / 2
    segments = max(1, segments)
    mgr, reg = _manager(d, blocks, capacity=capacity, host_bytes=host_bytes, writer_queue_blocks=queue)
    try:
        cfg = TieredKVConfig(namespace=f"bench-disk-idle|{bb}", host_capacity_bytes=(blocks.n_rows + 64) * bb)
        m2 = TierManager(cfg, blocks.dev, registry=CollectorRegistry())
        try:
            sat_loop = _LatencyLoop(mgr, blocks, rng, disk_keys, stores_per_step, step_sleep_s, load_every,
                                    _WriterProbe(mgr))
            idle_loop = _LatencyLoop(m2, blocks, rng, None, stores_per_step, step_sleep_s, load_every, None)
            for seg in range(segments):
                sides = [(sat_loop, seconds), (idle_loop, idle_s)]
                for loop, secs in (sides if seg % 2 == 0 else sides[::-1]):
                    loop.run(secs / segments, warmup_s)
            idle = idle_loop.result()
        finally:
            m2.close()
        sat = sat_loop.result()
        sat["spills_shed_backpressure"] = int(sample_total(reg, "tiered_kv_shed_total", kind="spill",
                                                           reason="backpressure"))
        sat["spills_ok"] = int(sample_total(reg, "tiered_kv_jobs_total", kind="spill", outcome="ok"))
        sat["promotes_ok"] = int(sample_total(reg, "tiered_kv_jobs_total", kind="promote", outcome="ok"))
        sat["stores_shed"] = int(sample_total(reg, "tiered_kv_shed_total", kind="store"))
        sat["loads_shed"] = int(sample_total(reg, "tiered_kv_shed_total", kind="load"))
    finally:
        mgr.close()
    _rmtree(d)
    return {"block_bytes": bb, "saturated": sat, "no_disk_tier": idle, "disk_keys": n_disk_keys,
            "note": "each engine step: store() x stores_per_step new blocks, lookup() of 8 keys (recent host "
                    "keys + keys loaded from disk), every load_every steps one load() of a key only on disk "
                    "(starts a promote; host-resident once loaded, cycled), poll(), then sleep(step_sleep_s) as "
                    "the engine's compute; only the calls' durations are timed"}


# ----------------------------------------------------------------------------- diagnostics
# ----------------------------------------------------------------------------- all
PLANS: dict[str, dict[str, Any]] = {
    # spill: (block bytes, durability, repeats, with diskcache, working set bytes);
    # promote: (block bytes, repeats, warm repeats, bytes for the cold-reopen measurement); promote_reopen_rounds:
    # loads of a set right after a reopen (_after_reopen)
    "full": {"spill_bytes": 256 * MiB,
             # odd repeats: the median drops a run that met one of this VM's slow-disk spells (several times slower
             # for a second or so, seen in the raw baseline too)
             "spill": [(2 * MiB, "batch", 5, True, 256 * MiB), (2 * MiB, "sync", 3, True, 256 * MiB),
                       (256 * KiB, "batch", 3, True, 128 * MiB), (256 * KiB, "sync", 3, False, 128 * MiB)],
             "promote_bytes": 64 * MiB, "promote": [(2 * MiB, 5, 5, 64 * MiB), (256 * KiB, 3, 5, 0)],
             "promote_reopen_rounds": 3,
             "evict_capacity": 256 * MiB, "evict_total": 2 * GiB, "evict_repeats": 3,
             "lat_seconds": 6.0, "lat_warmup": 1.0, "lat_idle_seconds": 3.0, "lat_disk_keys": 160,
             "sizes": [2 * MiB, 256 * KiB], "drop_caches": True},
    "quick": {"spill_bytes": 64 * MiB,
              "spill": [(2 * MiB, "batch", 2, True, 64 * MiB), (2 * MiB, "sync", 1, True, 64 * MiB),
                        (256 * KiB, "batch", 2, False, 32 * MiB)],
              "promote_bytes": 32 * MiB, "promote": [(2 * MiB, 2, 1, 32 * MiB)], "promote_reopen_rounds": 2,
              "evict_capacity": 64 * MiB, "evict_total": 320 * MiB,
              "lat_seconds": 1.0, "lat_warmup": 0.5, "lat_idle_seconds": 0.5, "lat_disk_keys": 48,
              "sizes": [2 * MiB, 256 * KiB], "drop_caches": True},
    # a few seconds, for the tests: tiny sets, no drop_caches (the machine's page cache is shared)
    "smoke": {"spill_bytes": 16 * MiB,
              "spill": [(2 * MiB, "batch", 1, True, 16 * MiB)],
              "promote_bytes": 8 * MiB, "promote": [(2 * MiB, 1, 1, 0)], "promote_reopen_rounds": 1,
              "evict_capacity": 8 * MiB, "evict_total": 24 * MiB, "evict_repeats": 2,
              "lat_seconds": 0.4, "lat_warmup": 0.1, "lat_idle_seconds": 0.2, "lat_disk_keys": 8, "lat_queue": 32,
              "sizes": [2 * MiB], "drop_caches": False, "hot_memory": False},
}


def _plan(quick: Any) -> dict[str, Any]:
    """Working sets and repeats of a mode (``quick``: bool or a mode name); see ``PLANS``."""
    return PLANS[as_mode(quick)]


SECTIONS = ("spill", "promote", "evicting", "latency")


def run_all(quick: Any = False, seed: int = 0, base_dir: Optional[str] = None,
            sections: Sequence[str] = SECTIONS, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The sections named, in one process on one filesystem; returns the JSON-ready result.

    ``quick``: False/"full", True/"quick" or "smoke" (see ``PLANS``).
    """
    mode = as_mode(quick)
    bad = set(sections) - set(SECTIONS)
    if bad:
        raise ValueError(f"unknown disk sections {sorted(bad)}; known: {SECTIONS}")
    plan = _plan(mode)
    parent = Path(base_dir) if base_dir else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="tkv-bench-disk-", dir=parent))
    t_all = time.perf_counter()
    r: dict[str, Any] = {"benchmark": "disk", "mode": mode, "quick": mode != "full", "seed": seed, "plan": plan,
                         "started": _dt.datetime.now().isoformat(timespec="seconds"),
                         "filesystem": filesystem_of(base), "work_dir": str(base), "step_seconds": {}}
    r["diskcache"] = DISKCACHE_MISSING if diskcache_module() is None else "installed"
    random.seed(seed)
    torch.manual_seed(seed)
    _HOT_TOUCH_GBPS.clear()
    _DROP_ALLOWED[0] = bool(plan["drop_caches"])
    _HOT_ALLOWED[0] = bool(plan.get("hot_memory", True))

    @contextlib.contextmanager
    def step(name: str) -> Iterator[None]:
        log(f"{name} ...")
        t = time.perf_counter()
        yield
        r["step_seconds"][name] = round(time.perf_counter() - t, 2)
        log(f"{name}: {r['step_seconds'][name]:.1f} s")

    try:
        with step("setup: seeded blocks"):
            blocks = {bb: _Blocks(bb, max(8, plan["spill_bytes"] // bb), seed) for bb in plan["sizes"]}
        if "spill" in sections:
            r["spill"] = []
            for bb, dur, reps, dc, ws in plan["spill"]:
                with step(f"spill {bb // KiB} KiB {dur}"):
                    r["spill"].append(bench_spill(base, blocks[bb], durability=dur, repeats=reps, seed=seed,
                                                  n_blocks=ws // bb, with_diskcache=dc))
        if "promote" in sections:
            r["promote"] = []
            for bb, reps, warm, rec in plan["promote"]:
                with step(f"promote {bb // KiB} KiB"):
                    r["promote"].append(bench_promote(base, blocks[bb], n_blocks=plan["promote_bytes"] // bb,
                                                      repeats=reps, warm_repeats=warm, seed=seed, recovery_bytes=rec,
                                                      reopen_rounds=plan.get("promote_reopen_rounds", 3)))
        if "evicting" in sections:
            with step(f"evicting: capacity {plan['evict_capacity'] // MiB} MiB, {plan['evict_total'] // MiB} MiB written"):
                r["evicting"] = bench_evicting(base, blocks[2 * MiB], capacity=plan["evict_capacity"],
                                               total=plan["evict_total"], seed=seed,
                                               repeats=plan.get("evict_repeats", 1))
        if "latency" in sections:
            with step("engine-thread latency"):
                r["latency"] = bench_engine_latency(base, blocks[2 * MiB], seconds=plan["lat_seconds"],
                                                    warmup_s=plan["lat_warmup"], n_disk_keys=plan["lat_disk_keys"],
                                                    idle_seconds=plan["lat_idle_seconds"], seed=seed,
                                                    writer_queue_blocks=plan.get("lat_queue"))
    finally:
        _DROP_ALLOWED[0] = _HOT_ALLOWED[0] = True
        _rmtree(base)
    r["seconds_total"] = time.perf_counter() - t_all
    r["hot_memory_touch_gbps"] = summarize(_HOT_TOUCH_GBPS, "GB/s") if _HOT_TOUCH_GBPS else None
    with contextlib.suppress(OSError):
        r["loadavg_at_end"] = os.getloadavg()
    return r


# ----------------------------------------------------------------------------- report
def _size(b: int) -> str:
    return f"{b // MiB} MiB" if b >= MiB else f"{b // KiB} KiB"


def _f(x: Any, spec: str = ".2f") -> str:
    if x is None:
        return "-"
    try:
        return format(x, spec)
    except (TypeError, ValueError):
        return str(x)


def _dist(f: Optional[dict[str, Any]], spec: str = ".3f") -> str:
    if not f:
        return "-"
    return f"{_f(f['median'], spec)} / {_f(f['p90'], spec)} / {_f(f['p99'], spec)} / {_f(f['max'], spec)}"


def format_report(r: dict[str, Any]) -> str:
    fs = r.get("filesystem") or {}
    lines = [f"tiered_kv disk-tier sections ({r.get('mode') or ('quick' if r['quick'] else 'full')}, seed {r['seed']}, "
             f"{r['seconds_total']:.0f} s, {r['started']})",
             f"filesystem: {fs.get('type')} on {fs.get('device')} (rotational={fs.get('rotational')}, "
             f"{fs.get('options')}), dir {r['work_dir']}", ""]
    if r.get("spill"):
        lines.append("1. spill GB/s (store ... wait(); flush()), median / p90 / p99 / max over repeats")
        for s in r["spill"]:
            f = s["figures"]
            w = s["tkv_runs"][0]["writer"] if s["tkv_runs"] else {}
            lines.append(f"  {_size(s['block_bytes']):>7} {s['durability']:5}  x{s['blocks_per_repeat']} "
                         f"({s['bytes_per_repeat'] // MiB} MiB), {s['repeats']} repeats, shed {s['spills_shed_total']}, "
                         f"spills/commit {_f((w.get('spills_per_commit') or {}).get('median'), '.0f')}, "
                         f"raw fsync every {s['raw_fsync_every_blocks']} blocks")
            for k in ("tkv", "raw_fresh", "raw_overwrite", "diskcache", "diskcache_set"):
                if k in f:
                    lines.append(f"      {k:15} {_dist(f[k])}")
            ra = s["ratios"]
            lines.append(f"      ratio tkv/raw_fresh {_f(ra['tkv_vs_raw_fresh'])}  tkv/raw_overwrite "
                         f"{_f(ra['tkv_vs_raw_overwrite'])}  tkv/diskcache {_f(ra['tkv_vs_diskcache'])} "
                         f"(vs set only {_f(ra['tkv_vs_diskcache_set'])})")
        lines.append("")
    if r.get("promote"):
        lines.append("2. promote GB/s (reopen, load() keys only on disk, wait()), median / p90 / p99 / max")
        for p in r["promote"]:
            lines.append(f"  {_size(p['block_bytes']):>7} x{p['blocks_per_repeat']} ({p['bytes_per_repeat'] // MiB} MiB), "
                         f"drop_caches worked: {p['drop_caches_worked']}, misses {p['tkv_misses']}, "
                         f"failed {p['tkv_failed']}, loads already in the host tier "
                         f"{p.get('tkv_loads_already_in_host', 'n/a')}")
            for st in ("cold", "warm"):
                for k, v in p["figures"][st].items():
                    lines.append(f"      {st:4} {k:10} {_dist(v)}")
                ra = p["ratios"][st]
                lines.append(f"      {st:4} ratio tkv/raw {_f(ra['tkv_vs_raw'])}  tkv/raw_copy "
                             f"{_f(ra.get('tkv_vs_raw_pread_copy'))}  tkv/diskcache {_f(ra['tkv_vs_diskcache'])}")
            for st, one in (p.get("one_at_a_time") or {}).items():
                if one.get("skipped"):
                    lines.append(f"      {st:4} one at a time: skipped ({one['skipped']})")
                    continue
                lines.append(f"      {st:4} one at a time, us per block ({one['blocks']} blocks x 2 rounds): "
                             f"load+wait {_dist(one['tkv_us'], '.0f')}; pread+copy_ {_dist(one['raw_us'], '.0f')}; "
                             f"ratio of medians {_f(one['ratio_median'])}")
            for st, ar in (p.get("after_reopen") or {}).items():
                lines.append(f"      {st:4} right after a reopen ({ar['rounds']} rounds, a new disk I/O process each): "
                             f"tkv {_dist(ar['tkv'])}; pread+copy_ {_dist(ar['raw_copy'])}; ratio of medians "
                             f"{_f(ar['ratio'])}; misses {ar['misses']}, failed {ar['failed']}, wrong rows {ar['bad_rows']}")
            ro = p.get("reopen_cold")
            if ro:
                lines.append(f"      reopen on a cold page cache: open {_f(ro['open_seconds'])} s, recovery "
                             f"{_f(ro['recovery_seconds'])} s for {ro['entries']} entries "
                             f"({(ro['bytes_on_disk'] or 0) / MiB:.0f} MiB; {_f(ro['recovery_gbps'], '.3f')} GB/s of "
                             f"stored bytes); warm: recovery {_f(ro['recovery_seconds_warm'], '.3f')} s")
        lines.append("")
    e = r.get("evicting")
    if e:
        t = e["tkv"]
        lines.append(f"3. full and evicting: {_size(e['block_bytes'])} blocks, capacity {e['capacity_bytes'] // MiB} MiB, "
                     f"{e['bytes_written'] // MiB} MiB written, in flight <= {e['inflight_limit']}")
        lines.append(f"      tkv overall {_f(t['gbps'], '.3f')} GB/s; steady windows ({e['window_blocks']} blocks) "
                     f"{_dist(t['window_gbps'])}; shed {t['spills_shed']}, evictions {t['evictions']}")
        if len(e.get("tkv_runs", ())) > 1:
            lines.append(f"      {e['repeats']} runs each, alternating: tkv steady "
                         + " / ".join(_f(x['steady_gbps_median'], '.3f') for x in e['tkv_runs'])
                         + "; raw_circular " + " / ".join(_f(x, '.3f') for x in e['raw_circular']['runs'])
                         + "; pairs " + " / ".join(_f(x) for x in e['ratios']['tkv_steady_vs_raw_circular_runs'])
                         + "; the lines below: the median run, file sizes the largest of any run")
        lines.append(f"      raw_circular {_f(e['raw_circular']['gbps'], '.3f')} GB/s"
                     + (f"; diskcache {_f(e['diskcache']['gbps'], '.3f')} GB/s (set only "
                        f"{_f(e['diskcache']['gbps_set_only'], '.3f')}), dir/capacity "
                        f"{_f(e['diskcache']['dir_vs_capacity_end'])}" if "diskcache" in e else ""))
        pg = t.get("lmdb_pages") or {}
        if pg:
            lines.append(f"      LMDB pages at the end: {pg['used_pages']} in use, {pg['free_or_unused_pages']} free "
                         f"({100 * pg['free_fraction_of_file']:.0f}% of the {pg['file_pages']} pages in the file)")
        lines.append(f"      slots.tkv + data.mdb end {t['file_bytes_end'] / MiB:.0f} MiB = {_f(t['file_vs_capacity_end'])}x capacity, "
                     f"peak {_f(t['file_vs_capacity_peak'])}x; map {t['map_size_end'] / MiB:.0f} MiB; "
                     f"writer busy {_f(t['writer']['writer_busy_fraction'])}")
        ra = e["ratios"]
        lines.append(f"      ratio steady/raw_circular {_f(ra['tkv_steady_vs_raw_circular'])}  overall/raw_circular "
                     f"{_f(ra['tkv_overall_vs_raw_circular'])}  overall/diskcache {_f(ra['tkv_overall_vs_diskcache'])}")
        lines.append("")
    lat = r.get("latency")
    if lat:
        s = lat["saturated"]
        lines.append(f"4. engine-thread call latency (us), p50 / p90 / p99 / max; {_size(lat['block_bytes'])} blocks, "
                     f"{s['stores_per_step']} stores + lookup + load + poll per step, {s['step_sleep_s'] * 1e3:.1f} ms compute")
        w = s.get("writer", {})
        lines.append(f"      writer saturated: busy {_f(w.get('writer_busy_fraction'))}, queue non-empty "
                     f"{_f(s.get('writer_queue_nonempty_fraction'))}, queue depth median "
                     f"{_f((s.get('writer_queue_depth') or {}).get('median'), '.0f')}, spills ok {s['spills_ok']}, "
                     f"spills shed (backpressure) {s['spills_shed_backpressure']}")
        lines.append(f"      loads: one every {s['load_every_steps']} steps, {s['loads']} in all (warm-up included), "
                     f"promotes ok {s.get('promotes_ok', '?')}, none returned {s['loads_returning_none']}")
        for call in ("store", "lookup", "load", "poll"):
            a = s["calls_us"].get(call)
            b = lat["no_disk_tier"]["calls_us"].get(call)
            lines.append(f"      {call:7} saturated {_dist(a, '.1f')}    no disk tier {_dist(b, '.1f')}")
        for call in ("store", "lookup", "load", "poll"):
            c = s.get("calls", {}).get(call)
            c0 = lat["no_disk_tier"].get("calls", {}).get(call)
            if c:
                lines.append(f"      {call:7} CPU p50/p99 {_f(c['cpu_us']['median'], '.1f')}/{_f(c['cpu_us']['p99'], '.1f')} us; "
                             f"calls > {c['slow_threshold_us']:.0f} us: {100 * c['slow_fraction']:.1f}% "
                             f"(no disk tier {100 * c0['slow_fraction']:.1f}%)"
                             + (f", of which mostly waiting (CPU < wall/2) {100 * c['slow_waiting_fraction']:.0f}%, "
                                f"with a GC pause {100 * c['slow_with_gc_fraction']:.0f}%" if c.get("slow_calls") else "")
                             if c0 else "")
        lines.append("")
    if r.get("hot_memory_touch_gbps"):
        h = r["hot_memory_touch_gbps"]
        lines.append(f"      hot-memory step before each timer: touch rate median {_f(h['median'])} GB/s, min "
                     f"{_f(h['min'])} ({_f(4096 / (h['min'] * 1e3))} us/page at worst), n={h['n']}")
    return "\n".join(lines)


