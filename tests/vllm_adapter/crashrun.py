"""SIGKILL an engine mid-write (``harness.py --scenario crash``), for the end-to-end test and the benchmark.

Not a test module: ``tests/vllm_adapter/test_vllm_e2e.py`` and ``benchmarks/vllm_e2e.py`` both call
:func:`kill_mid_write`, then replay what it returns with ``harness.py --scenario replay`` on the same disk path.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Killed", "kill_mid_write", "HARNESS"]

HARNESS = Path(__file__).with_name("harness.py")
PROMPT_A_SEED, CRASH_SEED0 = 1, 1000   # harness.PROMPT_A_SEED, harness.CRASH_SEED0 (not imported: that sets env)


@dataclass
class Killed:
    rc: int                 # the killed harness's exit status (-SIGKILL unless it ended first)
    finished: int           # prompts the killed engine finished (A, then B0, B1, ...)
    seeds: list[int]        # what to replay: those, and the one that may have been in flight
    done_file: Path         # their outputs, one JSON line each
    slabs_left: set[str] = field(default_factory=set)   # shared slab files the kill left in /dev/shm
    error: str = ""         # why no kill happened (the harness ended or stalled first), else empty


def _slabs() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("tiered_kv_*.slab")} if shm.is_dir() else set()


def _lines(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


def kill_mid_write(workdir: Path, name: str, disk: Path, args: list[str], timeout_s: float = 300.0) -> Killed:
    """Start ``harness.py --scenario crash`` in a session of its own, wait until its first prompt is on disk and two
    more prompts finished (later prompts' blocks are then being stored and spilled), and SIGKILL the session: the
    front end, the EngineCore and worker processes and a disk I/O process all at once.  ``args``: the harness's
    other arguments (``--offload``, ``--spec``, sizes)."""
    done, ready = workdir / f"{name}-done.jsonl", workdir / f"{name}-ready"
    for p in (done, ready):
        p.unlink(missing_ok=True)
    prom = workdir / f"prom-{name}"
    prom.mkdir(parents=True, exist_ok=True)
    for f in prom.iterdir():
        f.unlink()
    before = _slabs()
    proc = subprocess.Popen([sys.executable, str(HARNESS), "--workdir", str(workdir), "--json",
                             str(workdir / f"{name}.json"), "--scenario", "crash", "--disk-path", str(disk),
                             "--done-file", str(done), "--ready-file", str(ready), *args],
                            env=dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(prom)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    error = ""
    deadline = time.monotonic() + timeout_s
    try:
        first = None
        while True:   # polling files another process writes (not ordering threads)
            if first is None and ready.exists():
                first = int(ready.read_text())
            if first is not None and _lines(done) >= first + 3:
                break
            if proc.poll() is not None:
                error = f"the crash harness ended first (rc={proc.returncode})"
                break
            if time.monotonic() > deadline:
                error = f"no kill point within {timeout_s:.0f} s (ready: {first is not None})"
                break
            time.sleep(0.002)   # short: the kill lands soon after a prompt ends, as its last blocks are spilled
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    if error:
        error += ": " + (err or "")[-3000:]
    finished = _lines(done)   # A, B0 .. B(finished - 2); B(finished - 1) may have been in flight
    seeds = [PROMPT_A_SEED] + [CRASH_SEED0 + i for i in range(finished)]
    return Killed(proc.returncode, finished, seeds, done, _slabs() - before, error)
