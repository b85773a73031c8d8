"""Adversarial review of the benchmark harness, second pass (``bench/busy.py``, ``bench/step.py``,
``bench/report.py``, ``bench/common.py``, ``bench/cli.py``, ``disk._after_reopen`` and
``benchmarks/breakdown.py``).  Deterministic: hand-made result dicts, fakes, fake clocks, or tiny runs whose
timings are never asserted; the plain tests pin guarantees checked that hold.

What it proved wrong (each pinned by a test that failed before its fix), one line each:

1. busy._promote_run sizes its disk tier as keys + 64 blocks, ignoring the two write batches the disk tier
   keeps inside its capacity: in the full plan the first 56 of the 600 "only on disk" keys are evicted from
   disk, so every full run loses 56 of its loads (misses; the committed run n lists them in its problems).
2. busy._promote_run never clears a load's destination row: rows src_n.. are reused every 16 loads by keys
   holding the same bytes, so from the 17th load on the byte check passes whether or not the load wrote it.
3. report._disk_figures skips the "spill until flush()" figure when spills were shed, but still gives the
   "spill vs diskcache" figure built from the same partial rate a met/MISSED verdict.
4. report.format_markdown's "Ratio, 2nd run" column prints the ratio of a figure the second run skipped
   (e.g. spills shed), with no mark, so the table of record reads it as a valid, same-verdict figure.
5. report.problems never looks at the copy step: the copies that failed there (``copy_failed``, recorded by
   step._copy_run) are not listed, and the step's figures get their verdict as if every copy was made.
6. step.bench_copy_step never checks the rows its loads filled (the docs: "every benchmark checks the rows
   it loaded", exit status 1 on wrong bytes): loads landing in the wrong rows leave the run at exit 0.
7. disk._after_reopen (through _tkv_load_set) counts a load that missed as a row with wrong bytes: a reopen
   whose recovery lost entries (allowed: a cache may lose writes, never serve wrong ones) exits 1 "WRONG BYTES".
8. disk._after_reopen's GB/s (through _tkv_load_set) divides every key's bytes by the time, loaded or
   missed: a reopen whose loads all miss prints a positive promote rate and ratio for bytes never read.
9. benchmarks/breakdown.py batched crashes (InvalidBlockError) when the pass is not a multiple of 64 blocks
   (e.g. ``--block-kib 48 --pass-mib 8``): the last store_many gets fewer keys than rows.
10. benchmarks/breakdown.py promote crashes (StatisticsError) with ``--loads`` <= 4: every key is still in
    the 4-slot host tier, no load is a promote, and the medians of no samples are taken.
11. benchmarks/breakdown.py step divides each call's CPU, summed over warm-up and timed steps, by all steps,
    while the whole step's CPU beside it is the mean over the timed steps only.
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import torch

import tiered_kv.bench.busy as bench_busy
import tiered_kv.bench.disk as bench_disk
import tiered_kv.bench.step as bench_step
from tiered_kv import TierManager
from tiered_kv.bench import report
from tiered_kv.bench.common import KiB, MiB, percentile, ratio, summarize

pytestmark = pytest.mark.timeout(120)

BREAKDOWN = Path(__file__).resolve().parent.parent / "benchmarks" / "breakdown.py"


def _figs(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["id"]: f for f in report.collect_figures(result)}


# ----------------------------------------------------------------------------- 1, 2: busy promote
def test_every_key_the_busy_promote_loads_is_still_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The full plan's 300 samples per state (600 keys only on disk); the engine's 5 ms of work is skipped
    (it is not what is checked), so this runs in a few seconds."""
    monkeypatch.setattr(bench_busy, "_engine_work", lambda kind, ms, sched: 0)
    samples = bench_busy.PLANS["full"]["promote_samples"]
    r = bench_busy._promote_run("thread", samples, 0, tmp_path / "d")
    assert r["fill_spills_shed"] == 0 and r["fill_spills_published"] == r["keys_stored"], r
    assert r["misses"] == 0, (f"{r['misses']} of the {r['keys_only_on_disk']} keys meant to be only on disk "
                              f"were gone from the disk tier")


def test_the_busy_promote_byte_check_sees_a_load_that_landed_elsewhere(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_busy, "_engine_work", lambda kind, ms, sched: 0)
    n = bench_busy.STORES_PER_STEP
    orig = TierManager.load
    calls = [0]

    def load(self: TierManager, key: bytes, row: int) -> Any:
        calls[0] += 1
        if calls[0] > n:      # after the first 16: into the source row (the same bytes: nothing is corrupted)
            row -= n
        return orig(self, key, row)

    monkeypatch.setattr(TierManager, "load", load)
    r = bench_busy._promote_run("thread", n, 0, tmp_path / "d")      # 2 * 16 loads
    assert calls[0] == 2 * n and r["misses"] == r["failed"] == 0 and r["promotes_ok"] == 2 * n, r
    assert r["bad_rows"] > 0, "16 loads never wrote their row, yet 0 wrong rows were reported"


def test_the_busy_promote_figures_are_busy_over_idle_lower_is_better() -> None:
    """Holds: the busy promote figures take the busy loads' time after the work over the idle loads', as a
    lower-is-better ratio with an upper bound (target only for disk_io=process)."""
    def p(idle: float, busy: float) -> dict[str, Any]:
        s = {st: {"after_us": summarize([v] * 4, "us"), "total_us": summarize([v + 5000.0] * 4, "us")}
             for st, v in (("idle", idle), ("busy", busy))}
        return {"error": None, "child_processes_started": 1, "misses": 0, "failed": 0, "bad_rows": 0,
                "already_in_host": 0, **s}
    r = {"rows": [], "promote": {"process": p(100.0, 200.0), "thread": p(100.0, 120.0)},
         "promote_engine_ms": 5.0, "stores_per_step": 16}
    figs = _figs({"sections": {"busy": r}})
    f = figs["busy.promote_p50.process"]
    assert (f["value"], f["baseline"], f["ratio"], f["better"]) == (200.0, 100.0, 2.0, "lower")
    assert f["target_op"] == "<=" and f["met"] is False
    g = figs["busy.promote_p50.thread"]
    assert g["ratio"] == pytest.approx(1.2) and g["met"] is None and g["target"] is None


# ----------------------------------------------------------------------------- 3, 4, 5: report
def _spill(shed: int, tkv: float = 0.8) -> dict[str, Any]:
    return {"block_bytes": 2 * MiB, "durability": "batch", "raw_fsync_every_blocks": 32,
            "figures": {"tkv": summarize([tkv], "GB/s"), "raw_fresh": summarize([0.85], "GB/s"),
                        "diskcache": summarize([0.5], "GB/s")},
            "ratios": {"tkv_vs_raw_overwrite": 0.9, "tkv_vs_diskcache_set": 1.0},
            "spills_shed_total": shed, "tkv_runs": []}


def test_a_spill_with_shed_spills_gets_no_verdict_against_diskcache_either() -> None:
    figs = _figs({"sections": {"disk": {"spill": [_spill(shed=40)]}}})
    assert figs["disk.spill.2097152.batch"]["skipped"]          # the raw figure: no verdict (holds)
    f = figs["disk.spill_vs_diskcache.2097152.batch"]
    assert f["met"] is None and f["skipped"], (f["ratio"], f["met"], f["skipped"])


def test_the_second_run_column_does_not_show_a_skipped_figure_as_valid() -> None:
    first = {"sections": {"disk": {"spill": [_spill(shed=0)]}}}
    second = {"sections": {"disk": {"spill": [_spill(shed=40)]}}}
    row = next(ln for ln in report.format_markdown(first, second).splitlines() if ln.startswith("| spill until"))
    last = row.rstrip(" |").rsplit("|", 1)[-1].strip()
    assert "0.94x" not in last, row


def test_failed_copies_in_the_copy_step_are_listed_as_problems() -> None:
    run = {"cpu_us": summarize([150.0], "us"), "counts": {"stores": 10, "stores_none": 0, "loads": 10,
                                                          "loads_none": 0, "loads_skipped_busy": 0},
           "gc": {"us_per_step": 0.0}, "mover": "NativeMover", "copy_failed": 640.0}
    res = {"sections": {"copy_step": {"runs": {"sleep": {"batched": [run]}, "busy": {"batched": [run]}}}}}
    pr = report.problems(res)
    assert any("copy" in p for p in pr["other"] + pr["wrong_bytes"]), pr


def test_a_lower_is_better_ratio_is_value_over_baseline_and_misses_above_the_bound() -> None:
    """Holds: report._fig keeps ratio = value / baseline for lower-is-better figures (never inverted) and the
    '<=' target is met only at or under the bound; a figure without a baseline has no ratio and no verdict."""
    f = report._fig("s", "x", "n", "us", 30.0, 20.0, "b", "b", better="lower", target_on="ratio", op="<=",
                    threshold=1.5)
    assert f["ratio"] == pytest.approx(1.5) and f["met"] is True
    f = report._fig("s", "x", "n", "us", 31.0, 20.0, "b", "b", better="lower", target_on="ratio", op="<=",
                    threshold=1.5)
    assert f["ratio"] == pytest.approx(1.55) and f["met"] is False
    f = report._fig("s", "x", "n", "us", 31.0, None, "b", "b", better="lower", target_on="ratio", op="<=",
                    threshold=1.5)
    assert f["ratio"] is None and f["met"] is None


def test_percentiles_interpolate_linearly_over_sorted_samples() -> None:
    """Holds: summarize sorts before taking percentiles (numpy's default 'linear' method), ratio is a / b."""
    xs = list(range(100, 0, -1))                       # 1..100, unsorted
    s = summarize(xs, "us")
    assert (s["n"], s["min"], s["max"], s["median"]) == (100, 1.0, 100.0, 50.5)
    assert s["p90"] == pytest.approx(90.1) and s["p99"] == pytest.approx(99.01)
    assert s["mean"] == pytest.approx(50.5)
    assert percentile([3.0], 99) == 3.0
    assert ratio(3.0, 2.0) == 1.5 and ratio(1.0, 0.0) != ratio(1.0, 0.0)   # NaN without a baseline


# ----------------------------------------------------------------------------- 6: copy step bytes
def test_the_copy_step_notices_loads_that_land_in_the_wrong_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(bench_step.COPY_PLANS, "smoke", {"steps": 8, "warmup": 8, "repeats": 1, "compute_s": 0.0005})
    orig = TierManager.load_many

    def load_many(self: TierManager, keys: Any, rows: Any) -> Any:
        return orig(self, keys, list(rows)[::-1])        # each key into another row of the group

    monkeypatch.setattr(TierManager, "load_many", load_many)
    r = bench_step.bench_copy_step("smoke", 0)
    c = r["runs"]["sleep"]["batched"][0]["counts"]
    assert c["loads"] > 0 and r["runs"]["sleep"]["batched"][0]["copy_failed"] == 0, c   # loads ran and "worked"
    pr = report.problems({"sections": {"copy_step": r}})
    assert pr["wrong_bytes"], pr


# ----------------------------------------------------------------------------- 7, 8: _after_reopen
def _reopen_of_an_empty_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], Any]:
    """_after_reopen on a directory whose recovery found nothing (as after losing its entries): every load
    misses.  The raw baseline is a fake (1 ms per block): no timing is asserted."""
    monkeypatch.setattr(bench_disk, "_DROP_ALLOWED", [False])
    monkeypatch.setattr(bench_disk, "_HOT_ALLOWED", [False])
    n, bb = 8, 64 * KiB
    blocks = bench_disk._Blocks(bb, n, 0)
    dest = blocks.dev.clone()
    tdir = tmp_path / "t"

    def open_mgr() -> TierManager:
        return bench_disk._manager(tdir, blocks, capacity=64 * n * bb, host_bytes=n * bb, dev=dest)[0]

    open_mgr().close()                                    # the directory and its slot file exist, empty
    keys = [b"reopen:%04d" % i for i in range(n)]         # never stored
    r = bench_disk._after_reopen(open_mgr, dest, blocks, keys, tdir, lambda cold, which: [1e-3] * len(which), 1)
    return r, blocks


def test_a_reopen_whose_loads_miss_is_not_reported_as_wrong_bytes(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    r, _ = _reopen_of_an_empty_directory(tmp_path, monkeypatch)
    assert r["misses"] == 8 and r["failed"] == 0, r
    promote = {"block_bytes": 64 * KiB, "tkv_bad_rows": 0, "tkv_misses": 0, "tkv_failed": 0,
               "after_reopen": {"warm": r}, "figures": {}}
    pr = report.problems({"sections": {"disk": {"promote": [promote]}}})
    assert not pr["wrong_bytes"], pr                       # a miss serves no bytes: not wrong bytes
    assert any("misses" in p for p in pr["other"]), pr     # (holds: the misses are listed)


def test_the_reopen_rate_counts_only_the_blocks_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r, _ = _reopen_of_an_empty_directory(tmp_path, monkeypatch)
    assert r["misses"] == 8
    promote = {"block_bytes": 64 * KiB, "tkv_bad_rows": 0, "tkv_misses": 0, "tkv_failed": 0,
               "one_at_a_time": {}, "after_reopen": {"warm": r},
               "figures": {"warm": {"tkv": summarize([3.0], "GB/s"), "raw_copy": summarize([4.0], "GB/s")}}}
    f = _figs({"sections": {"disk": {"promote": [promote]}}})[f"disk.promote_reopen.{64 * KiB}.warm"]
    assert f["skipped"] or f["value"] == 0, (f["value"], f["ratio"], f["note"])


def test_the_reopen_rounds_alternate_with_their_baseline_and_do_not_time_the_open(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Holds: _after_reopen alternates tiered_kv and pread+copy_ round by round (tkv first, then raw first), opens
    a new manager per round outside the timed load, closes it, and its ratio is of the medians."""
    log: list[str] = []
    monkeypatch.setattr(bench_disk, "_read_through", lambda p: None)

    class Mgr:
        def close(self) -> None:
            log.append("close")

    def open_mgr() -> Any:
        log.append("open")
        return Mgr()

    secs = iter([1.0, 2.0, 4.0])

    def load_set(mgr: Any, dest: Any, blocks: Any, keys: Any, cold: bool) -> Any:
        log.append("tkv")
        return next(secs), {"misses": 0, "failed": 0, "bad_rows_checked": 0, "in_host_before": 0, "loaded": 4}

    def raw(cold: bool, which: Any) -> list[float]:
        log.append("raw")
        return [0.5 / len(which)] * len(which)

    monkeypatch.setattr(bench_disk, "_tkv_load_set", load_set)

    class B:
        block_bytes = 1_000_000

    r = bench_disk._after_reopen(open_mgr, None, B(), [b"a"] * 4, tmp_path, raw, 3)  # type: ignore[arg-type]
    assert log == ["open", "tkv", "close", "raw", "raw", "open", "tkv", "close", "open", "tkv", "close", "raw"]
    assert r["tkv"]["median"] == pytest.approx(0.002) and r["raw_copy"]["median"] == pytest.approx(0.008)
    assert r["ratio"] == pytest.approx(0.25)


# ----------------------------------------------------------------------------- 9, 10, 11: breakdown.py
def _script(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(BREAKDOWN), *args], capture_output=True, text=True, timeout=110,
                          env=env, cwd=str(BREAKDOWN.parent.parent))


def test_breakdown_batched_runs_a_pass_that_is_not_a_multiple_of_64_blocks() -> None:
    p = _script("batched", "--block-kib", "48", "--pass-mib", "8")        # 170 blocks per pass
    assert p.returncode == 0, p.stderr[-600:]
    assert "pass 3:" in p.stdout


def test_breakdown_promote_with_few_loads_does_not_crash() -> None:
    p = _script("promote", "--block-kib", "64", "--loads", "4")
    assert p.returncode == 0, p.stderr[-600:]


def _load_breakdown() -> Any:
    spec = importlib.util.spec_from_file_location("_review_breakdown", BREAKDOWN)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_breakdown_step_parts_are_per_timed_step(monkeypatch: pytest.MonkeyPatch) -> None:
    bd = _load_breakdown()
    clock = [0]
    cost = [0]
    monkeypatch.setattr(time, "thread_time_ns", lambda: clock[0])
    monkeypatch.setattr(bench_step, "DISK_SLOTS", bench_step.DISK_SLOTS)     # breakdown sets it to 0: restore it

    def fake_call(self: Any, *a: Any, **k: Any) -> None:
        clock[0] += cost[0]

    for name in ("lookup", "load_many", "store_many", "poll"):       # restored afterwards (breakdown wraps them)
        monkeypatch.setattr(TierManager, name, fake_call)

    def fake_run(system: str, seed: int, steps: int, warmup: int, compute_s: float, d: Any) -> dict[str, Any]:
        timed = []
        for s in range(warmup + steps):
            cost[0] = 10_000 if s < warmup else 1_000     # a warm-up poll: 10 us; a timed one: 1 us
            c0 = clock[0]
            TierManager.poll(None)                        # type: ignore[arg-type]
            if s >= warmup:
                timed.append((clock[0] - c0) / 1e3)
        return {"cpu_us": summarize(timed, "us"), "gc": {"us_per_step": 0.0}}

    monkeypatch.setattr(bench_step, "_run", fake_run)
    out = io.StringIO()
    with redirect_stdout(out):
        bd.step(100)
    line = next(ln for ln in out.getvalue().splitlines() if ln.startswith("engine step, host + disk"))
    whole = float(re.search(r"CPU\s+([\d.]+) us per step", line).group(1))   # type: ignore[union-attr]
    poll = float(re.search(r"poll ([\d.]+)", line).group(1))                 # type: ignore[union-attr]
    assert whole == 1.0
    assert poll == whole, line          # the step is all poll: its part must be the whole


# ----------------------------------------------------------------------------- cli
def test_the_table_counts_the_verdicts_the_json_carries(capsys: pytest.CaptureFixture[str]) -> None:
    """Holds: format_table's 'targets met: X of Y' counts the figures' met values (skipped ones excluded), and a
    skipped figure prints '-' and 'skip', never a ratio."""
    res = {"benchmark": "tiered-kv bench", "mode": "smoke", "seed": 0, "wall_seconds": 1.0,
           "machine": {"date_utc": "x", "cores": 2, "cpu_model": "x", "mem_total_bytes": 1, "python": "3",
                       "torch": "2", "cuda": False, "cuda_device": None, "diskcache": "5", "bench_dir": "/tmp",
                       "filesystem": {}, "git_commit": None},
           "sections": {"disk": {"spill": [_spill(shed=0), {**_spill(shed=3, tkv=0.2), "block_bytes": 256 * KiB}]}}}
    res["figures"] = report.collect_figures(res)
    text = report.format_table(res)
    met = [f["met"] for f in res["figures"] if f["met"] is not None]
    assert f"targets met: {sum(met)} of {len(met)}" in text
    skipped = next(ln for ln in text.splitlines() if "256 KiB, durability=batch" in ln and "until flush" in ln)
    assert "skip" in skipped and "x " not in skipped.split("raw write+fsync")[1][:8]
