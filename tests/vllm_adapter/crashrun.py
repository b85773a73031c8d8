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

from prometheus_client.multiprocess import MultiProcessCollector

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
    spills_in_flight: float = 0.0   # the adapter's spill jobs in flight at the kill, as its last step published them
    error: str = ""         # why no kill happened (the harness ended or stalled first), else empty


def _slabs() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("tiered_kv_*.slab")} if shm.is_dir() else set()


def _lines(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


def _spills_in_flight(prom: Path) -> float:
    """The adapter's spill jobs started and not yet answered, as its last engine step published them.

    Reads the gauge files only: merging every file of the directory (vLLM's histograms among them) took 4 ms
    on an idle 2-core machine and 200 ms beside a busy engine, CPU the disk I/O process then lacked, and
    prompts finished meanwhile.  After the kill the files hold what each process last published."""
    try:
        fams = MultiProcessCollector.merge([str(f) for f in prom.glob("gauge_*.db")], accumulate=False)
        return sum(s.value for fam in fams if fam.name == "tiered_kv_jobs_in_flight"
                   for s in fam.samples if s.labels.get("kind") == "spill")
    except Exception:   # noqa: BLE001 - a file read while its process grows it: not known this time, asked again
        return 0.0


def kill_mid_write(workdir: Path, name: str, disk: Path, args: list[str], timeout_s: float = 300.0) -> Killed:
    """Start ``harness.py --scenario crash`` in a session of its own, wait until its first prompt is on disk and two
    more prompts finished, then -- with the tiered_kv adapter -- until its engine has spill jobs in flight (at most
    two more prompts), and SIGKILL the session: the front end, the EngineCore and worker processes and a disk
    I/O process all at once.  ``args``: the harness's other arguments (``--offload``, ``--spec``, sizes)."""
    done, ready = workdir / f"{name}-done.jsonl", workdir / f"{name}-ready"
    for p in (done, ready):
        p.unlink(missing_ok=True)
    prom = workdir / f"prom-{name}"
    prom.mkdir(parents=True, exist_ok=True)
    for f in prom.iterdir():
        f.unlink()
    before = _slabs()
    log = workdir / f"{name}.stderr"   # a file, not a pipe: nothing is read from it until the harness is gone
    with open(log, "w") as err_f:
        proc = subprocess.Popen([sys.executable, str(HARNESS), "--workdir", str(workdir), "--json",
                                 str(workdir / f"{name}.json"), "--scenario", "crash", "--disk-path", str(disk),
                                 "--done-file", str(done), "--ready-file", str(ready), *args],
                                env=dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(prom)), stdout=subprocess.DEVNULL,
                                stderr=err_f, start_new_session=True)
    error = ""
    deadline = time.monotonic() + timeout_s
    adapter = "--spec" not in args or args[args.index("--spec") + 1] == "tiered_kv"
    try:
        first = None
        while True:   # polling files another process writes (not ordering threads)
            if first is None and ready.exists():
                first = int(ready.read_text())
            if first is not None and _lines(done) >= first + 3:
                if not adapter or _lines(done) >= first + 5:
                    break
                if _spills_in_flight(prom):
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
        proc.wait(60)
    if error:
        error += ": " + log.read_text(errors="replace")[-3000:]
    finished = _lines(done)   # A, B0 .. B(finished - 2); B(finished - 1) may have been in flight
    in_flight = _spills_in_flight(prom)   # as the killed processes last published it, not as seen before the kill
    seeds = [PROMPT_A_SEED] + [CRASH_SEED0 + i for i in range(finished)]
    return Killed(proc.returncode, finished, seeds, done, _slabs() - before, in_flight, error)
