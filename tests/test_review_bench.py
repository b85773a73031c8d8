"""Adversarial review of the benchmark harness (``tiered_kv/bench``): each test pins a defect that makes a
printed figure, verdict or exit status dishonest.  Deterministic: hand-made result dicts, fakes, or tiny runs
whose timings are never asserted."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

import tiered_kv.bench.common as bench_common
import tiered_kv.bench.core as bench_core
import tiered_kv.bench.disk as bench_disk
from tiered_kv import TierManager
from tiered_kv.bench import report
from tiered_kv.bench.common import KiB, summarize
from tiered_kv.tools.cli import main


# ----------------------------------------------------------------------------- wrong bytes and the exit status
def test_a_wrong_block_in_the_batched_host_pass_counts_as_wrong_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched host pass's byte check once worded its failure "holds the wrong block" (no "!="), and
    report.problems sorts host problems into wrong_bytes only when they contain "!=": a run whose
    batched loads landed in the wrong rows exited 0.  Here load_many swaps the rows of every timed load."""
    block, ws = 64 * KiB, 1 << 20
    orig = TierManager.load_many

    def load_many(self: TierManager, keys: Any, rows: Any) -> Any:
        return orig(self, keys, list(rows)[::-1])   # each key into another row of the step

    monkeypatch.setattr(TierManager, "load_many", load_many)
    out = bench_core._host_size(block, ws, passes=1, warmup=1, rng=random.Random(0), min_blocks=2)
    pr = report.problems({"sections": {"core": {"host_throughput": {"sizes": [out]}}}})
    assert pr["wrong_bytes"], pr


def test_the_timed_host_passes_check_the_rows_they_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """core._host_size never resets the destination rows kv[n:] before a side's loads (the CUDA section does:
    ``kv[n:].fill_(255)`` after each check).  Only the first side of the first (warm-up, discarded) pass finds
    them at 255; later the side before has already left kv[n+i] == kv[i] (tkv runs last in a reversed pass,
    after tkvB), so the per-block loads of the timed pass are checked against bytes that are already right:
    here every timed load() goes to its source row instead, and no problem is reported."""
    block, ws = 64 * KiB, 1 << 20
    n = ws // block
    orig = TierManager.load
    calls = [0]

    def load(self: TierManager, key: bytes, row: int) -> Any:
        calls[0] += 1
        if calls[0] > n:                      # the timed pass (the warm-up pass made the first n loads)
            row -= n                          # lands in the source row (identical bytes); row n+i untouched
        return orig(self, key, row)

    monkeypatch.setattr(TierManager, "load", load)
    out = bench_core._host_size(block, ws, passes=1, warmup=1, rng=random.Random(0), min_blocks=2)
    assert calls[0] == 2 * n
    assert out["problems"], "no timed load() landed in rows n..2n-1, yet the bytes check saw nothing wrong"


def test_one_load_at_a_time_notices_a_load_that_lands_elsewhere(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """disk._one_at_a_time compares rows[i] with blocks.rows[i] without clearing the row first; every working
    set holds row i's bytes at index i and the batched rounds just loaded them into row i, so the check is
    vacuous: a tiny real bench_promote whose one-at-a-time loads go to another row reports 0 wrong rows."""
    monkeypatch.setattr(bench_disk, "_DROP_ALLOWED", [False])   # never drop the shared machine's page cache
    monkeypatch.setattr(bench_disk, "_HOT_ALLOWED", [False])
    n, one = 8, 3
    orig = bench_disk._one_at_a_time

    class Misrouted:
        """The real manager, except that loads of the chosen set land in row n-1-i instead of row i."""

        def __init__(self, mgr: TierManager, ks: set[bytes]) -> None:
            self._m, self._ks = mgr, ks

        def load(self, key: bytes, row: int) -> Any:
            return self._m.load(key, n - 1 - row if key in self._ks else row)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._m, name)

    def wrapped(mgr: TierManager, dest: torch.Tensor, blocks: Any, sets: Any, *a: Any) -> Any:
        ks = next(s for s in sets if all(mgr.host_bytes(k) is None for k in s))
        return orig(Misrouted(mgr, set(ks)), dest, blocks, sets, *a)   # type: ignore[arg-type]

    monkeypatch.setattr(bench_disk, "_one_at_a_time", wrapped)
    blocks = bench_disk._Blocks(64 * KiB, n, 0)
    out = bench_disk.bench_promote(tmp_path, blocks, n_blocks=n, repeats=1, warmup=1, warm_repeats=1,
                                   with_diskcache=False, with_link=False, one_blocks=one)
    o = out["one_at_a_time"]["warm"]
    assert o["misses"] == 0 and o["failed"] == 0 and o["tkv_us"]["n"] == 2 * one   # every load ran and finished
    assert o["bad_rows"] > 0, "no one-at-a-time load reached its row, yet 0 wrong rows were reported"


# ----------------------------------------------------------------------------- figures vs what was measured
def _spill_section(shed: int) -> dict[str, Any]:
    g = summarize([0.8], "GB/s")
    return {"block_bytes": 2 << 20, "durability": "batch", "raw_fsync_every_blocks": 32,
            "figures": {"tkv": g, "raw_fresh": summarize([0.85], "GB/s")},
            "ratios": {"tkv_vs_raw_overwrite": 0.9}, "spills_shed_total": shed, "tkv_runs": []}


def test_a_spill_figure_with_shed_spills_gets_no_verdict() -> None:
    """disk._tkv_spill divides every store's bytes by the time although shed spills were never written (its
    docstring: "a figure with sheds would be invalid"); the report still prints "met" for it."""
    figs = {f["id"]: f for f in report.collect_figures({"sections": {"disk": {"spill": [_spill_section(shed=40)]}}})}
    f = figs["disk.spill.2097152.batch"]
    assert f["met"] is None, (f["value"], f["ratio"], f["met"], f["note"])


def test_the_spill_rate_counts_only_the_bytes_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """_tkv_spill's gbps is len(keys) * block_bytes / seconds whatever the registry says was shed."""
    monkeypatch.setattr(bench_disk, "_HOT_ALLOWED", [False])
    blocks = bench_disk._Blocks(64 * KiB, 8, 0)
    real = bench_disk.sample_total

    def sample_total(reg: Any, name: str, **labels: Any) -> float:
        if name == "tiered_kv_shed_total" and labels.get("kind") == "spill":
            return 3.0                                  # as if the writer's queue had shed 3 of the 8 spills
        if name == "tiered_kv_jobs_total" and labels.get("kind") == "spill":
            return 5.0
        return real(reg, name, **labels)

    monkeypatch.setattr(bench_disk, "sample_total", sample_total)
    r = bench_disk._tkv_spill(tmp_path / "d", blocks, [b"k%d" % i for i in range(8)], durability="batch",
                              capacity=64 << 20, host_bytes=24 * 64 * KiB)
    written = r["spills_ok"] * blocks.block_bytes
    assert r["gbps"] * 1e9 * r["seconds"] == pytest.approx(written), (r["bytes"], written)


@pytest.mark.parametrize("disk_io", ["thread", "process"])
def test_the_writer_probe_times_every_commit_without_breaking_the_writer(tmp_path: Path, disk_io: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """_WriterProbe wraps the writer's ``_commit`` (threads) or the owner's dispatch (process).  The writer's
    ``_commit`` returns (op, report) pairs: a probe that read them as reports made every commit raise, so that
    with ``disk_io="thread"`` no spill was ever written."""
    monkeypatch.setattr(bench_disk, "_HOT_ALLOWED", [False])
    blocks = bench_disk._Blocks(64 * KiB, 8, 0)
    orig = bench_disk._manager
    monkeypatch.setattr(bench_disk, "_manager", lambda *a, **k: orig(*a, **k, disk_io=disk_io))
    r = bench_disk._tkv_spill(tmp_path / "d", blocks, [b"k%d" % i for i in range(8)], durability="batch",
                              capacity=64 << 20, host_bytes=24 * 64 * KiB)
    assert r["spills_ok"] == 8 and r["flush_ok"], r
    commits = r["_probe"].commits
    assert commits and sum(n for _, _, n in commits) == 8, commits


def test_the_evicting_vs_diskcache_figure_is_the_median_overall_rate(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_evicting keeps as ``tkv`` the run with the median *steady* rate; report takes that run's overall
    ``gbps`` as the "spill vs diskcache, full and evicting" figure, while the section's own ratio (and the
    figure's note) use the median of the overall rates: another field's median."""
    runs = iter([
        {"gbps": 1.0, "steady_gbps_median": 2.0},
        {"gbps": 3.0, "steady_gbps_median": 1.0},
        {"gbps": 2.0, "steady_gbps_median": 3.0},
    ])
    common = {"file_bytes_end": 100, "file_bytes_peak": 100, "file_vs_capacity_end": 1.0,
              "file_vs_capacity_peak": 1.0, "evictions": 1, "spills_shed": 0, "window_gbps": summarize([1.0], "GB/s")}
    monkeypatch.setattr(bench_disk, "_tkv_evicting", lambda *a, **k: {**common, **next(runs)})
    monkeypatch.setattr(bench_disk, "_raw_write", lambda *a, **k: 1.0)
    monkeypatch.setattr(bench_disk, "diskcache_module", lambda: object())
    monkeypatch.setattr(bench_disk, "_dc_write", lambda *a, **k: (0.5, 1.0))

    class _Blk:
        block_bytes, n_rows, views = 10, 4, [b"x" * 10] * 4

        def blobs(self) -> list[bytes]:
            return list(self.views)

    e = bench_disk.bench_evicting(tmp_path, _Blk(), capacity=100, total=40, repeats=3)  # type: ignore[arg-type]
    figs = {f["id"]: f for f in report.collect_figures({"sections": {"disk": {"evicting": e}}})}
    f = figs["disk.evicting.vs_diskcache"]
    assert f["value"] == 2.0, f["value"]                                  # median of the runs' overall rates
    assert f["ratio"] == pytest.approx(e["ratios"]["tkv_overall_vs_diskcache"])


# ----------------------------------------------------------------------------- --from-json
def _one_at_a_time_result(tkv_us: list[float]) -> dict[str, Any]:
    raw = summarize([300.0, 310.0], "us")
    one = {"blocks": 2, "block_bytes": 2 << 20, "misses": 2 - len(tkv_us), "failed": 0, "bad_rows": 0,
           "tkv_us": summarize(tkv_us, "us"), "raw_us": raw, "ratio_median": None}
    promote = {"block_bytes": 2 << 20, "figures": {"warm": {"tkv": summarize([3.0], "GB/s"), "raw_copy": summarize([4.0], "GB/s")}},
               "one_at_a_time": {"warm": one},
               "tkv_misses": 0, "tkv_failed": 0, "tkv_bad_rows": 0}
    return {"benchmark": "tiered-kv bench", "mode": "smoke", "seed": 0, "wall_seconds": 1.0,
            "machine": {"date_utc": "x", "cores": 2, "cpu_model": "x", "mem_total_bytes": 1, "python": "3",
                        "torch": "2", "cuda": False, "cuda_device": None, "diskcache": "5", "bench_dir": "/tmp",
                        "filesystem": {}, "git_commit": None},
            "sections": {"disk": {"promote": [promote]}}, "problems": {"wrong_bytes": [], "other": []}}


def test_from_json_reprints_a_run_whose_distribution_was_empty(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A run whose one-at-a-time loads all missed prints its table (NaN formats as "nan" in the notes) and
    writes strict JSON (NaN -> null); --from-json then recomputes the figures from that JSON and the notes'
    format specs (":.0f" of None) raise TypeError: the saved result cannot be re-printed."""
    live = _one_at_a_time_result([])
    live["figures"] = report.collect_figures(live)
    report.format_table(live)                                  # the run itself prints fine
    p = tmp_path / "r.json"
    p.write_text(json.dumps(report.clean(live), allow_nan=False))
    assert main(["bench", "--from-json", str(p)]) == 0
    assert "one load from disk at a time" in capsys.readouterr().out


# ----------------------------------------------------------------------------- background load
def test_the_load_monitor_does_not_count_the_bench_s_own_children_as_other_processes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """LoadMonitor takes its own CPU as os.times()[:2] (this process only): the CPU of the child processes it
    started and reaped (the disk I/O process of disk_io="process", the default) is reported as "other
    processes" (the committed run bench-2026-12-03-f: trace 26%, step 22%, the whole run 10%)."""
    times = iter([os.times_result((1.0, 1.0, 0.0, 0.0, 0.0)),      # type: ignore[attr-defined]
                  os.times_result((2.0, 2.0, 3.0, 3.0, 0.0))])     # type: ignore[attr-defined]
    stat = iter([(100.0, 0.0), (108.0, 0.0)])       # the machine: 8 CPU s busy = own 2 + reaped children 6
    monkeypatch.setattr(bench_common.os, "times", lambda: next(times))
    monkeypatch.setattr(bench_common, "_proc_stat_cpu", lambda: next(stat))
    with bench_common.LoadMonitor() as lm:
        pass
    assert lm.result["foreign_cpu_s"] == pytest.approx(0.0), lm.result


def test_revive_brings_back_nan_only_where_the_bench_measured() -> None:
    """--from-json's ``revive``: a saved ``null`` is NaN again in a summary, a ratio or a rate, but a
    ``skipped`` of None (not skipped) stays None, also under a measured key (NaN would read as skipped)."""
    import math
    r = report.revive({"ratios": {"a_vs_b": None}, "tkv_us": {"n": 0, "median": None, "skipped": None},
                       "gbps_runs": [None, 1.0], "skipped": None, "diskcache": None})
    assert math.isnan(r["ratios"]["a_vs_b"]) and math.isnan(r["tkv_us"]["median"]) and math.isnan(r["gbps_runs"][0])
    assert r["tkv_us"]["skipped"] is None and r["skipped"] is None and r["diskcache"] is None


def test_the_latency_baseline_alternates_with_the_saturated_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_engine_latency's two sides are measured in alternating segments (order flipped each time), each
    side's samples adding up over its segments: measured one after the other, the baseline's own p99 moved
    between 10 and 23 us from run to run on the reference VM, and the ratio with it."""
    monkeypatch.setattr(bench_disk, "_HOT_ALLOWED", [False])
    order: list[str] = []
    depth_before_baseline: list[int] = []
    saturated: list[TierManager] = []
    real_run = bench_disk._LatencyLoop.run

    def run(self: Any, seconds: float, warmup_s: float) -> None:
        order.append("disk" if self.mgr.disk is not None else "none")
        if self.mgr.disk is not None:
            saturated[:] = [self.mgr]
        elif saturated:    # the saturated run's spills are all written before a baseline segment
            depth_before_baseline.append(saturated[0].disk.queue_depth)
        real_run(self, seconds, warmup_s)

    monkeypatch.setattr(bench_disk._LatencyLoop, "run", run)
    blocks = bench_disk._Blocks(64 * KiB, 16, 0)
    r = bench_disk.bench_engine_latency(tmp_path, blocks, seconds=0.09, warmup_s=0.01, n_disk_keys=8,
                                        idle_seconds=0.06, writer_queue_blocks=8, segments=3)
    assert order == ["disk", "none", "none", "disk", "disk", "none"], order
    assert depth_before_baseline == [0, 0, 0], depth_before_baseline
    for side in ("saturated", "no_disk_tier"):
        res = r[side]
        assert res["segments"] == 3, res
        assert res["calls_us"]["store"]["n"] > 0 and res["calls_us"]["lookup"]["n"] > 0, res["calls_us"]
    assert r["saturated"]["measured_seconds"] == pytest.approx(0.09)   # the planned windows, not a timing
    assert r["no_disk_tier"]["measured_seconds"] == pytest.approx(0.06)
