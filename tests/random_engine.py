"""A seeded random engine driving a ``TierManager``, for the CUDA tests on a real and a simulated device.

The engine computes fresh keys into rows and stores them, loads stored keys
into rows it gave up (``free_block`` returned True), frees rows, cancels,
invalidates, polls, and lets the device run (the caller's ``device_tick``).
Every key is computed once, so a row or host slot holding another key's
bytes is caught: at each ok load (the row) and each ok store (the host slot).
Each job must be reported exactly once.
"""

from __future__ import annotations

import itertools
import random
import uuid
from collections.abc import Callable, Sequence
from typing import Optional

from tiered_kv import Completion, Job, TierManager
from tiered_kv.jobs import JobKind

OPS = ("store", "load", "free", "cancel", "invalidate", "device", "wait")   # anything else (the rest): poll


def random_engine(mgr: TierManager, rng: random.Random, rows: int, steps: int, odds: Sequence[float], *,
                  compute: Callable[[int, bytes], None], row_holds: Callable[[int, bytes], bool],
                  host_holds: Callable[[bytes], Optional[bool]], device_tick: Callable[[random.Random], None],
                  before_wait: Callable[[], None] = lambda: None, prefix: str = "rk",
                  after_wait: Callable[[], object] = lambda: None) -> tuple[int, int]:
    """Run ``steps`` engine operations, the chance of each of ``OPS`` given by ``odds`` (in that order, as
    many as given; the rest is a poll), then ``before_wait()``, a final ``wait()`` and ``after_wait()`` (with a disk tier:
    a ``flush()``, for the spills the last stores started).  Returns (ok loads, ok stores)."""
    bounds = list(itertools.accumulate(odds))
    loading: dict[int, Job] = {}                 # row -> its load in flight
    live: dict[uuid.UUID, Job] = {}              # issued, not reported
    stored: list[bytes] = []
    seen: set[uuid.UUID] = set()
    n_key = ok_loads = 0

    def apply(comps: list[Completion]) -> None:
        nonlocal ok_loads
        for c in comps:
            tok = c.job.token
            assert tok not in seen, f"reported twice: {c.job}"
            seen.add(tok)
            live.pop(tok, None)
            if c.job.kind is JobKind.LOAD:
                assert loading.pop(c.job.block) is c.job
                if c.ok:
                    assert row_holds(c.job.block, c.job.key), f"row {c.job.block} does not hold {c.job.key!r}"
                    ok_loads += 1
            elif c.ok:
                assert host_holds(c.job.key) in (True, None), f"host tier holds wrong bytes for {c.job.key!r}"
                stored.append(c.job.key)

    for _ in range(steps):
        x = rng.random()
        op = next((name for name, b in zip(OPS, bounds) if x < b), "poll")
        row = rng.randrange(rows)
        if op == "store":                        # compute a new block and store it
            if row in loading or not mgr.free_block(row):
                continue
            n_key += 1
            key = f"{prefix}-{n_key}".encode()
            compute(row, key)
            job = mgr.store(key, row)
            if job is not None:
                live[job.token] = job
        elif op == "load" and stored:            # a prefix hit: load into a row given up
            if row in loading or not mgr.free_block(row):
                continue
            job = mgr.load(rng.choice(stored), row)
            if job is not None:
                live[job.token] = job
                loading[row] = job
        elif op == "free":
            mgr.free_block(row)
        elif op == "cancel" and live:
            mgr.cancel(rng.choice(list(live.values())))
        elif op == "invalidate" and stored:
            mgr.invalidate(rng.choice(stored))
        elif op == "device":
            device_tick(rng)
        elif op == "wait":                       # the engine waits for everything in flight
            apply(mgr.wait(timeout=60))
        elif op == "poll":
            apply(mgr.poll())
    before_wait()
    apply(mgr.wait(timeout=60))
    after_wait()
    assert not live and not loading
    assert mgr.jobs_in_flight == 0
    return ok_loads, len(stored)
