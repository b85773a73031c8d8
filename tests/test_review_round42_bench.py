"""Adversarial review, round 42: the benchmark's bookkeeping (``bench/report.py``, ``bench/common.py`` and how
``bench/e2e.py``, ``bench/trace.py`` and ``bench/remote.py`` turn measurements into figures).

Every test here failed on the code under review (main at bfe481d), each docstring saying what is wrong, where, and
a fix; all fixed since: the remote figures get no verdict when a run's puts or fetch did not move every block; the
trace replay counts a request's hits only when its load was accepted and reported ok (``load_refused`` the rest);
e2e's steps/s times the step loop alone (``run_workload``'s ``loop_seconds``); a figure whose baseline was not
measured gets no verdict.
Deterministic and fast: hand-made result dicts, fake managers, or a 60-step demo run whose timing is
only compared with a 0.5 s delay it is given.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from tiered_kv.bench import e2e as bench_e2e
from tiered_kv.bench import remote as bench_remote
from tiered_kv.bench import report
from tiered_kv.bench import trace as bench_trace
from tiered_kv.bench.common import KiB, MiB, summarize


# ----------------------------------------------------------------------------- remote: bytes never written
def _remote_row(problems: list[str], tkv_put: float = 5.0, raw_put: float = 1.0) -> dict[str, Any]:
    bb, n = 2 * MiB, 64
    assert bb in bench_remote.TARGET_SIZES
    return {"block_bytes": bb, "blocks": n, "bytes": bb * n, "batch_blocks": 32, "repeats": 1, "bad_rows": 0,
            "raw_bad_values": 0, "problems": problems,
            "put": {"tkv": summarize([tkv_put], "GB/s"), "raw": summarize([raw_put], "GB/s"), "paired_ratios": [5.0]},
            "get": {"tkv": summarize([tkv_put], "GB/s"), "raw": summarize([raw_put], "GB/s"), "paired_ratios": [5.0]},
            "runs": {"tkv": [{"puts_ok": 0, "puts_shed": 64, "puts_failed": 0, "stores_refused": 0,
                              "flush_ok": False, "fetch_landed": False, "held_after_fetch": 0}], "raw": []}}


def test_a_remote_put_whose_puts_were_shed_gets_no_verdict() -> None:
    """report._remote_figures (with remote._size_row) gives the remote put/get GB/s a met/MISSED verdict even
    when the run's puts were shed, failed or refused and its fetch never landed: remote._size_row divides the
    whole working set's bytes (``total = n * bb``) by ``put_s``/``get_s`` whatever ``puts_ok``/``put_bytes``/
    ``held_after_fetch`` say, so a put path that sheds everything (fast) reads as a high rate, "met".  The disk
    tier's spill figure was fixed for exactly this (report._disk_figures skips it when spills were shed); the
    remote figures were not.  Fix: in _remote_figures, set ``skipped`` (e.g. "N puts shed/failed: the figure is
    not the whole working set's") when any tkv run's puts_ok != blocks / stores_refused / puts_shed / a fetch
    that did not land (or carry that flag in the row from _size_row), or compute GB/s from put_bytes/get_bytes."""
    r = {"batch_blocks": 32, "sizes": [_remote_row(["run 1: 0 of 64 puts ok (stores refused 0, puts shed 64, "
                                                    "failed 0, cancelled 0)",
                                                    "run 1: the fetch had not landed after 30 s"])]}
    figs = {f["id"]: f for f in report._remote_figures(r)}
    put = figs[f"remote.put.{2 * MiB}"]
    get = figs[f"remote.get.{2 * MiB}"]
    assert put["met"] is not True and put["skipped"], put
    assert get["met"] is not True and get["skipped"], get


# ----------------------------------------------------------------------------- trace: a refused load is a hit
class _RefusingManager:
    """Every key is "cached" (lookup finds it) but every load_many is refused (returns None)."""

    def lookup(self, keys: list[bytes]) -> int:
        return len(keys)

    def load_many(self, keys: list[bytes], rows: list[int]) -> Any:
        return None

    def store_many(self, keys: list[bytes], rows: list[int]) -> Any:
        return None

    def wait(self, jobs: Any, timeout: Any = None) -> list[Any]:
        return []

    def free_block(self, row: int) -> None:
        pass


def test_the_trace_replay_does_not_count_a_refused_load_as_a_hit() -> None:
    """trace.replay_engine adds ``lookup(keys)`` to ``hits`` (and to ``hits_out``, which ``tiered-kv replay``
    turns into prefill tokens saved) before it knows whether load_many was accepted: a load_many that returns
    None (refused: rows busy, too many jobs in flight) or whose job fails brought nothing into the request's
    rows, the engine recomputes those blocks, yet the trace section's "hit ratio" (report note and
    format_trace) counts them as hits -- a miss counted as a hit.  Fix: count ``n`` as hits only when the
    load_many job was accepted and, after ``wait(jobs)``, completed ok (count refused/failed loads apart, and
    append the served count, not the lookup's, to ``hits_out``)."""
    reqs = [[b"k%d" % i for i in range(4)] for _ in range(8)]
    hits_out: list[int] = []
    r = bench_trace.replay_engine(_RefusingManager(), reqs, 4, hits_out)   # type: ignore[arg-type]
    assert r["refs"] == 32
    assert r["hits"] == 0, f"{r['hits']} of {r['refs']} references counted as hits, no load was accepted"
    assert sum(hits_out) == 0


class _FailingLoadManager(_RefusingManager):
    """Every load_many is accepted, and its job reported failed by the step's wait (a read from disk that failed)."""

    def load_many(self, keys: list[bytes], rows: list[int]) -> Any:
        return object()

    def wait(self, jobs: Any, timeout: Any = None) -> list[Any]:
        from types import SimpleNamespace
        return [SimpleNamespace(job=j, ok=False) for j in jobs]


def test_the_trace_replay_does_not_count_a_failed_load_as_a_hit() -> None:
    """The other half of the fix above: a load accepted and then reported failed brought nothing in either."""
    hits_out: list[int] = []
    r = bench_trace.replay_engine(_FailingLoadManager(), [[b"a", b"b"]] * 3, 1, hits_out)   # type: ignore[arg-type]
    assert (r["refs"], r["hits"], r["load_refused"], hits_out) == (6, 0, 6, [0, 0, 0])


# ----------------------------------------------------------------------------- e2e: start-up timed as steps
def test_e2e_steps_per_s_does_not_time_the_manager_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """e2e._one divides the engine steps by the wall time around the whole ``run_workload`` call, which for the
    host and host+disk modes includes making the TierManager (slab allocation and prefault, the disk tier's
    LMDB open and its disk I/O process start), the drain, ``flush(timeout=30)`` and ``close()``; the "no
    offload" baseline has none of these.  So "engine steps/s, host+disk ... vs no offload" charges start-up and
    teardown to the steps (a fixed cost: the shorter the plan, the worse the ratio -- quick/smoke plans
    understate it most).  Here a TierManager that takes 0.5 s longer to start moves host-only steps/s of a
    60-step run by far more than 2x.  Fix: time the step loop only (run_workload already keeps ``t0`` after
    the manager is made: return the loop's seconds, e.g. ``loop_seconds``, before the drain/flush/close, and
    use it in e2e._one)."""
    from tiered_kv.tools import demo

    real = demo.TierManager
    fast = bench_e2e._one("host", 60, 0)["steps_per_s"]

    class SlowStart(real):   # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, **k: Any) -> None:
            time.sleep(0.5)
            super().__init__(*a, **k)

    monkeypatch.setattr(demo, "TierManager", SlowStart)
    slow = bench_e2e._one("host", 60, 0)["steps_per_s"]
    assert math.isfinite(fast) and math.isfinite(slow)
    assert slow > fast / 2, f"steps/s {fast:,.0f} -> {slow:,.0f} by a slower manager start alone"


# ----------------------------------------------------------------------------- value targets without a baseline
def test_a_value_target_gets_no_verdict_without_its_baseline() -> None:
    """report._fig decides a ``target_on="value"`` figure from the value alone: a figure whose baseline was
    not measured (None/NaN: a failed or missing baseline run) is still "met", although the module's own rule
    is "No absolute figure is reported without its baseline: each figure carries both" and the table's
    promise is every figure beside a baseline of the same run.  E.g. _trace_figures takes ``t.get("dict", {})``
    (a missing baseline is tolerated) and still says met.  Fix: in _fig, leave ``met`` None (or set
    ``skipped="baseline not measured"``) when the baseline is None, whatever ``target_on``."""
    t = {"block_refs": 1000, "row_bytes": 256,
         "host": {"refs_per_s": summarize([500_000.0], "refs/s"), "refs_per_cpu_s": summarize([600_000.0], "refs/s"),
                  "hit_ratio": 0.4},
         "disk": {"refs_per_s": summarize([80_000.0], "refs/s"), "refs_per_cpu_s": summarize([90_000.0], "refs/s"),
                  "hit_ratio": 0.5},
         "dict": {"refs_per_s": summarize([], "refs/s"), "refs_per_cpu_s": summarize([], "refs/s"),
                  "hit_ratio": float("nan")}}
    figs = report._trace_figures(t)
    for f in figs:
        assert f["baseline"] is None
        assert f["met"] is None or f["skipped"], f"{f['id']}: met={f['met']} with no baseline measured"
