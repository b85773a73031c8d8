"""Shared pieces of the benchmarks: run modes, statistics, machine facts, background-load monitor.

Owns no measurement.  Invariants: every distribution is summarized the same way
(median/p90/p99/max, plus n/min/mean) and every ratio is ``a / b`` of two
figures measured in the same process, ``nan`` when the baseline is zero.
"""

from __future__ import annotations

import datetime as _dt
import gc
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

import tiered_kv

__all__ = [
    "KiB", "MiB", "GiB", "MODES", "as_mode", "percentile", "summarize", "ratio", "gbs",
    "machine_facts", "filesystem_of", "LoadMonitor", "GcClock", "git", "TARGETS",
]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

MODES = ("full", "quick", "smoke")
"""full: the committed report (<= 10 min here); quick: <= 60 s here; smoke: seconds, for the tests."""


def as_mode(quick: Union[bool, str, None]) -> str:
    """Map the historical ``quick: bool`` argument, or a mode name, to a mode name."""
    if isinstance(quick, str):
        if quick not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {quick!r}")
        return quick
    return "quick" if quick else "full"


TARGETS: dict[str, float] = {
    # the one table of targets (issue 2 section 8, issue 3 section 9), each named by what it measures;
    # :mod:`.report` applies them to the figures
    "lifecycles_per_cpu_s": 100_000,                # job lifecycles per CPU second of the one engine thread
    "store_many_blocks_per_cpu_s": 500_000,         # blocks per CPU second through store_many(32 keys) -> poll
    "store_p99_vs_unsafe_copies_running": 1.1,      # store() p99 while copy workers move rows / the dict original's (<=)
    "host_copy_vs_raw_copy": 0.9,                   # host tier GB/s / a raw one-thread copy_ of the same rows
    "cuda_copy_vs_torch_copy": 0.9,                 # device<->host GB/s / torch's copy_ between the same buffers
    "spill_vs_raw_write_fsync": 0.85,               # spill GB/s until flush() / raw write+fsync (also when evicting)
    "spill_vs_diskcache": 1.2,                      # spill GB/s / diskcache set()+syncfs(), 2 MiB blocks
    "promote_vs_raw_pread_copy": 0.8,               # promote GB/s / raw pread into a buffer + copy_ into the row
    "one_promote_vs_raw_pread_copy": 1.5,           # one load from disk, load+wait, time / one raw pread + copy_ (<=)
    "promote_vs_diskcache": 2.0,                    # promote GB/s / diskcache get(), 2 MiB blocks
    "engine_call_p99_vs_no_disk": 1.2,              # store()/lookup()/load() p99, writer saturated / no disk tier (<=)
    "disk_files_vs_capacity": 1.15,                 # slot file + data.mdb size / capacity, tier full and evicting
    "trace_refs_per_s_host": 100_000,               # Mooncake trace replay through the public API, host tier only
    "trace_refs_per_s_disk": 50_000,                # ... with the disk tier on
    "step_engine_cpu_us": 200.0,                    # engine-thread CPU per step: 32 lookups x 16, 64 stores, 64 loads
    # issue 25: a step's copies as one batch
    "host_batched_vs_large_copy": 0.9,              # store_many/load_many of 64 x 64/256 KiB GB/s / one large copy_
    "copy_step_engine_cpu_us": 200.0,               # engine-thread CPU per step of 64 stores + 64 loads, copies on
    "cuda_batched_vs_large_copy": 0.9,              # CUDA d2h/h2d of store_many/load_many of 64 blocks / one copy_
    # issue 26: the disk tier beside an engine thread busy in Python (bench/busy.py)
    "busy_published_fraction": 0.99,               # spills published / stores, engine busy 5 and 20 ms (>=)
    "busy_engine_cpu_process_vs_thread": 1.05,     # engine-thread CPU per step, disk_io=process / thread (<=)
    "busy_promote_busy_vs_idle": 1.5,              # one load from disk, busy engine / idle engine, p50 and p99 (<=)
}


# ----------------------------------------------------------------------------- statistics
def percentile(sorted_vals: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of already sorted values."""
    if not sorted_vals:
        return float("nan")
    if len(sorted_vals) == 1:
        return float(sorted_vals[0])
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return float(sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo))


def summarize(samples: Sequence[float], unit: str) -> dict[str, Any]:
    """median/p90/p99/max (plus n, min, mean) of ``samples``."""
    s = sorted(samples)
    return {
        "unit": unit,
        "n": len(s),
        "min": float(s[0]) if s else float("nan"),
        "median": percentile(s, 50),
        "p90": percentile(s, 90),
        "p99": percentile(s, 99),
        "max": float(s[-1]) if s else float("nan"),
        "mean": float(sum(s) / len(s)) if s else float("nan"),
    }


def ratio(a: Optional[float], b: Optional[float]) -> float:
    if a is None or b is None or not b:
        return float("nan")
    return float(a / b)


def gbs(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


# ----------------------------------------------------------------------------- machine facts
def git(*args: str) -> Optional[str]:
    """``git ARGS`` in the checkout that holds the imported tiered_kv (None when not a checkout)."""
    try:
        out = subprocess.run(["git", *args], cwd=Path(tiered_kv.__file__).resolve().parents[1],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_model() -> Optional[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _mem_total_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def filesystem_of(path: Path) -> dict[str, Any]:
    """Filesystem type, device and options of ``path`` from /proc/mounts (longest matching mount), plus statvfs."""
    best: dict[str, Any] = {}
    try:
        real = str(Path(path).resolve())
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                dev, mnt, fstype, opts = line.split()[:4]
                mnt = mnt.replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best.get("mount", "")):
                    best = {"device": dev, "mount": mnt, "type": fstype, "options": opts}
    except OSError:
        pass
    dev = best.get("device", "")
    if dev.startswith("/dev/"):
        rot = Path(f"/sys/block/{dev[5:]}/queue/rotational")
        if rot.exists():
            best["rotational"] = rot.read_text().strip() == "1"
    try:
        st = os.statvfs(path)
        best["statvfs"] = {"block_size": st.f_frsize, "total_bytes": st.f_blocks * st.f_frsize,
                           "free_bytes": st.f_bavail * st.f_frsize, "name_max": st.f_namemax}
        best["free_bytes"] = st.f_bavail * st.f_frsize
    except OSError:
        pass
    best.setdefault("type", "unknown (no /proc/mounts)")
    return best


def _cache_sizes() -> dict[str, str]:
    out: dict[str, str] = {}
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for idx in sorted(base.glob("index*")):
            level = (idx / "level").read_text().strip()
            kind = (idx / "type").read_text().strip()
            size = (idx / "size").read_text().strip()
            out[f"L{level}{'' if kind == 'Unified' else kind[0].lower()}"] = size
    except OSError:
        pass
    return out


def _sources_hash() -> str:
    """sha256 over the imported tiered_kv's runtime sources (the bench excluded): names the exact code measured."""
    import hashlib
    h = hashlib.sha256()
    pkg = Path(tiered_kv.__file__).resolve().parent
    for f in sorted(pkg.rglob("*.py")):
        rel = f.relative_to(pkg)
        if rel.parts[0] != "bench":
            h.update(str(rel).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _version(mod: str) -> Optional[str]:
    """Version of an optional module without importing it when it is absent."""
    try:
        from importlib import metadata
        return metadata.version(mod)
    except Exception:
        return None


def machine_facts(bench_dir: Optional[Path] = None) -> dict[str, Any]:
    """Cores, CPU, memory, Python, torch, CUDA, libraries and the bench directory's filesystem."""
    cuda = bool(torch.cuda.is_available())
    try:
        import lmdb
        lmdb_v: Optional[str] = f"py-lmdb {lmdb.__version__}, liblmdb {'.'.join(map(str, lmdb.version()))}"
    except Exception:  # pragma: no cover
        lmdb_v = None
    try:
        load: Optional[tuple[float, float, float]] = os.getloadavg()
    except (OSError, AttributeError):
        load = None
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "cpu_affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "cpu_caches_cpu0": _cache_sizes(),
        "mem_total_bytes": _mem_total_bytes(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "torch_parallel_info": torch.__config__.parallel_info().splitlines()[:6],
        "cuda": cuda,
        "cuda_device": torch.cuda.get_device_name(0) if cuda else None,
        "cuda_runtime": torch.version.cuda,
        "tiered_kv": tiered_kv.__version__,
        "lmdb": lmdb_v,
        "xxhash": _version("xxhash"),
        "diskcache": _version("diskcache"),
        "matplotlib": _version("matplotlib"),
        "bench_dir": str(bench_dir) if bench_dir is not None else None,
        "filesystem": filesystem_of(bench_dir) if bench_dir is not None else None,
        "loadavg_at_start": load,
        "git_commit": git("rev-parse", "HEAD"),
        "git_tiered_kv_dirty": bool(git("status", "--porcelain", "--", "tiered_kv")),
        "tiered_kv_sources_sha256": _sources_hash(),
        "gc_thresholds": list(gc.get_threshold()),
        "switch_interval_s": sys.getswitchinterval(),
    }


# ----------------------------------------------------------------------------- background load
def _proc_stat_cpu() -> Optional[tuple[float, float]]:
    """(busy seconds, steal seconds) of the whole machine since boot, from /proc/stat."""
    try:
        with open("/proc/stat", encoding="utf-8") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / hz, steal / hz


class LoadMonitor:
    """CPU used by *other* processes while a section ran (the machine may be shared).

    ``foreign_cpu_s`` = machine busy CPU seconds - this process's CPU seconds (its reaped children's
    included: the disk I/O process a section's managers started and closed is not foreign);
    ``foreign_share`` = that over (wall seconds x cores).  A figure measured
    with a large foreign share is noisier than its repeats suggest.
    """

    def __enter__(self) -> "LoadMonitor":
        self.t0 = time.perf_counter()
        self.own0 = sum(os.times()[:4])
        self.stat0 = _proc_stat_cpu()
        self.load0 = os.getloadavg() if hasattr(os, "getloadavg") else None
        return self

    def __exit__(self, *exc: Any) -> None:
        wall = time.perf_counter() - self.t0
        own = sum(os.times()[:4]) - self.own0
        stat1 = _proc_stat_cpu()
        self.result: dict[str, Any] = {"wall_s": wall, "own_cpu_s": own,
                                       "loadavg_start": self.load0,
                                       "loadavg_end": os.getloadavg() if hasattr(os, "getloadavg") else None}
        if self.stat0 is not None and stat1 is not None:
            foreign = max(0.0, (stat1[0] - self.stat0[0]) - own)
            self.result.update({"foreign_cpu_s": foreign, "steal_s": stat1[1] - self.stat0[1],
                                "foreign_share": foreign / (wall * (os.cpu_count() or 1)) if wall else 0.0})


class GcClock:
    """The cyclic garbage collector's runs on the thread that made this clock, while :attr:`on`: each
    run's generation and CPU time (``time.thread_time``).  A run is timed by the thread whose allocation
    started it, inside whatever call made that allocation, so a step's CPU time includes its share.

    ``with GcClock() as clock:``, then ``clock.on = True`` around the timed part; :meth:`summary` after.
    """

    def __init__(self) -> None:
        self.on = False
        self.runs: list[tuple[int, int]] = []   # (generation, thread CPU ns)
        self._ident = threading.get_ident()
        self._t0 = 0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if threading.get_ident() != self._ident:
            return
        if phase == "start":
            self._t0 = time.thread_time_ns() if self.on else 0
        elif self._t0:
            self.runs.append((int(info["generation"]), time.thread_time_ns() - self._t0))
            self._t0 = 0

    def __enter__(self) -> "GcClock":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.on = False
        gc.callbacks.remove(self._callback)

    def summary(self, steps: int) -> dict[str, Any]:
        """CPU microseconds per step in all runs; per generation the runs' count, mean and longest."""
        out: dict[str, Any] = {"us_per_step": sum(ns for _, ns in self.runs) / 1e3 / steps if steps else float("nan")}
        for g in range(3):
            ns = [t for gen, t in self.runs if gen == g]
            out[f"gen{g}"] = {"runs": len(ns), "mean_us": sum(ns) / 1e3 / len(ns) if ns else 0.0,
                              "max_us": max(ns) / 1e3 if ns else 0.0}
        return out
