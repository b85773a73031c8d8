"""The first call after a pause, on this machine: how much slower is the same small piece of Python?

    python benchmarks/cold_call.py [--steps 300] [--pause-ms 10] [--promotes]

Times six back-to-back calls of one small pure-Python function (50 loop
iterations) after each kind of pause, median over ``--steps`` rounds (us):

* ``none``       -- no pause: the warm cost, six times;
* ``sleep``      -- ``time.sleep(pause)``, as the store-latency benchmark's engine step;
* ``spin_clock`` -- the thread spins on ``time.perf_counter_ns()`` for the pause (never leaves the CPU);
* ``spin_same``  -- the thread spins calling the timed function itself for the pause.

If ``sleep`` and ``spin_clock`` both slow the first call and ``spin_same`` does not, the first
call pays for caches and predictors that other code (ours or the machine's) took over during the
pause -- not for a CPU waking from an idle state.  That is what sets the first ``store()`` of an
engine step apart from the rest (docs/benchmarks.md, "What limits the missed targets").

``--promotes`` also times ``TierManager.load()`` of keys only on disk (each starts a promote;
2 MiB blocks, a disk tier in a temp dir): CPU us of the first call of a burst of 16, after the
previous burst's ``wait()``, against the other calls of the burst.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

clock = time.perf_counter_ns


def work() -> int:
    x = 0
    for i in range(50):
        x += i * i
    return x


def rounds(pause: Callable[[], None], steps: int) -> list[float]:
    calls = 6
    res: list[list[float]] = [[] for _ in range(calls)]
    for _ in range(steps):
        pause()
        st = [0] * (calls + 1)
        st[0] = clock()
        for s in range(calls):
            work()
            st[s + 1] = clock()
        for s in range(calls):
            res[s].append((st[s + 1] - st[s]) / 1e3)
    return [statistics.median(r) for r in res]


def promotes(rounds_: int = 12) -> None:
    import tempfile

    import torch

    from tiered_kv import TieredKVConfig, TierManager

    row = 2 << 20
    with tempfile.TemporaryDirectory() as d:
        kv = torch.zeros((64, row), dtype=torch.uint8)
        cfg = TieredKVConfig(namespace="cold|u8|p", host_capacity_bytes=40 * row, disk_path=d,
                             disk_capacity_bytes=200 * row)
        with TierManager(cfg, kv) as mgr:
            keys = [f"k{i}".encode() for i in range(150)]
            for i, k in enumerate(keys):
                job = mgr.store(k, i % 64)
                mgr.wait([job] if job is not None else [])
                if i % 8 == 7:
                    mgr.flush()  # the writer's queue is bounded: unflushed spills would be shed
            mgr.flush()
            first: list[float] = []
            rest: list[float] = []
            for r in range(rounds_):
                burst = [k for k in keys[(r * 16) % 96:(r * 16) % 96 + 16] if mgr.lookup([k]) and
                         mgr.host_bytes(k) is None]
                cpu = []
                for i, k in enumerate(burst):
                    c0 = time.thread_time_ns()
                    mgr.load(k, 32 + i)
                    cpu.append((time.thread_time_ns() - c0) / 1e3)
                mgr.wait()
                if cpu:
                    first.append(cpu[0])
                    rest += cpu[1:]
                for i, k in enumerate(keys[110:150]):  # the host holds 40 blocks: the burst's keys leave it
                    job = mgr.load(k, 32 + i % 16)
                    mgr.wait([job] if job is not None else [])
    print(f"load() starting a promote, CPU us: first of a burst (each) {[round(x, 1) for x in first]}; "
          f"the rest p50 {statistics.median(rest):.1f} (n={len(rest)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--pause-ms", type=float, default=10.0)
    ap.add_argument("--promotes", action="store_true", help="also time load() calls that start a promote")
    a = ap.parse_args()
    ns = int(a.pause_ms * 1e6)

    def sleep() -> None:
        time.sleep(ns / 1e9)

    def spin_clock() -> None:
        end = clock() + ns
        while clock() < end:
            pass

    def spin_same() -> None:
        end = clock() + ns
        while clock() < end:
            work()

    print(f"median us of each of 6 back-to-back calls after the pause ({a.pause_ms:g} ms, {a.steps} rounds)")
    for name, pause in (("none", lambda: None), ("sleep", sleep), ("spin_clock", spin_clock), ("spin_same", spin_same)):
        med = rounds(pause, a.steps)
        print(f"  {name:<11}" + "".join(f"{m:8.2f}" for m in med) + f"   first/last {med[0] / med[-1]:5.1f}x")
    if a.promotes:
        promotes()


if __name__ == "__main__":
    main()
