"""The engine-step benches' method: what a step's timed window holds, and the collector's share of it.

Nothing here times anything: a fake clock and call logs stand in for the engine.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest

import tiered_kv.bench.step as st
from tiered_kv.bench.common import GcClock


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _collect_with_garbage() -> None:
    _Cycle()
    gc.collect()


def test_the_gc_clock_times_collections_on_its_thread_while_on() -> None:
    with GcClock() as clock:
        _collect_with_garbage()            # off: not counted
        clock.on = True
        _collect_with_garbage()            # counted, generation 2
        t = threading.Thread(target=_collect_with_garbage)
        t.start()
        t.join()                           # another thread's: not counted
        clock.on = False
    assert [g for g, _ in clock.runs] == [2]
    assert clock.runs[0][1] >= 0
    s = clock.summary(4)
    assert s["gen2"]["runs"] == 1 and s["gen0"]["runs"] == 0 and s["gen1"]["runs"] == 0
    assert s["us_per_step"] == pytest.approx(clock.runs[0][1] / 1e3 / 4)
    assert s["gen2"]["max_us"] == pytest.approx(clock.runs[0][1] / 1e3)
    assert clock._callback not in gc.callbacks   # removed on exit


def test_the_gc_clock_ignores_a_collection_that_began_before_it_was_on() -> None:
    with GcClock() as clock:
        clock._callback("start", {"generation": 0})    # began while off
        clock.on = True
        clock._callback("stop", {"generation": 0})
    assert clock.runs == []


def test_a_steps_inputs_are_made_before_its_timed_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """``prepare()`` runs before the clocks are read for a step, ``one(s)`` between them, ``between()``
    after: the bench's key making is not in the figure."""
    log: list[str] = []
    ticks = iter(range(10_000))

    def clock() -> int:
        log.append("clock")
        return next(ticks) * 1000

    monkeypatch.setattr(st.time, "thread_time_ns", clock)
    monkeypatch.setattr(st.time, "perf_counter_ns", lambda: 0)
    counts = {"n": 5}
    cpu, wall, gcs = st._timed_steps(lambda s: log.append(f"one{s}"), 1, 2, counts, lambda: log.append("between"),
                                     lambda: log.append("prepare"))
    assert log == [x for s in range(3) for x in ("prepare", "clock", f"one{s}", "clock", "between")]
    assert cpu == [1.0, 1.0] and len(wall) == 2 and counts == {"n": 0}
    assert set(gcs) == {"us_per_step", "gen0", "gen1", "gen2"}


def _old_pick(w: st._Workload, n: int) -> list[list[bytes]]:
    """The pick the bench made before it stopped copying the pool each step."""
    pool = w.chains[:-8]
    if not pool:
        return []
    rnd = w.rng.random
    m = len(pool)
    return [pool[m - int(m ** rnd())] for _ in range(n)]


def test_the_prepared_workload_is_the_one_the_steps_made_before() -> None:
    a, b = st._Workload(7), st._Workload(7)
    for _ in range(40):
        a.prepare()
        picked = _old_pick(b, st.LOOKUPS)
        new = b.new_chains(st.STORES // st.KEYS_PER_LOOKUP)
        assert a.picked == picked
        assert a.new == [k for c in new for k in c]
        b.chains += new
    assert a.chains == b.chains and len(a.chains) == 40 * st.STORES // st.KEYS_PER_LOOKUP
    assert any(a.picked)


def test_a_step_reads_the_prepared_keys() -> None:
    """The tiered_kv and dict steps make their calls with the prepared lookups and stores."""
    calls: list[tuple[str, Any]] = []

    class FakeMgr:
        def lookup(self, keys: list[bytes]) -> int:
            calls.append(("lookup", keys))
            return 0

        def store_many(self, keys: list[bytes], rows: list[int]) -> object:
            calls.append(("store_many", keys))
            return object()

        def poll(self) -> list[Any]:
            calls.append(("poll", None))
            return []

    w = st._Workload(3)
    for _ in range(12):
        w.prepare()
    counts = {"loads": 0, "loads_none": 0, "loads_skipped_busy": 0, "loads_too_few_hits": 0, "stores": 0,
              "stores_none": 0}
    st._tkv_step(FakeMgr(), w, 0, [None] * st.LOAD_GROUPS, counts)   # type: ignore[arg-type]
    assert [k for op, k in calls if op == "lookup"] == w.picked
    assert [k for op, k in calls if op == "store_many"] == [w.new]
    assert counts["stores"] == 1 and counts["loads_too_few_hits"] == 1
