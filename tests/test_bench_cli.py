"""``tiered-kv bench``: the command runs, its JSON has the schema, --plot writes PNGs.

One in-process run with the hidden ``--smoke`` configuration (tiny sets, one
repeat, no page-cache drop: a few seconds) is shared by the tests.  Nothing
here asserts a timing or whether a target was met: the figures of a smoke run
on a shared machine mean nothing, only their shape does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

import tiered_kv.bench.common as bench_common
import tiered_kv.bench.disk as bench_disk
import tiered_kv.bench.plots as bench_plots
import tiered_kv.bench.trace as bench_trace
from tiered_kv.tools.cli import main

FIGURE_KEYS = {"id", "section", "name", "unit", "better", "value", "baseline", "baseline_name", "vs", "ratio",
               "target", "target_on", "target_op", "target_threshold", "met", "stats", "source", "note", "skipped"}


def _has_matplotlib() -> bool:
    return bench_plots.matplotlib_missing() is None


def _strict_load(path: Path) -> Any:
    def no_constant(name: str) -> Any:
        raise AssertionError(f"non-standard JSON constant {name} in {path}")
    return json.loads(path.read_text(encoding="utf-8"), parse_constant=no_constant)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("bench")
    argv = ["bench", "--smoke", "--seed", "3", "--dir", str(tmp / "scratch"), "--json", str(tmp / "out" / "r.json"),
            "--no-details"]
    if _has_matplotlib():
        argv += ["--plot", str(tmp / "img")]
    rc = main(argv)
    return {"rc": rc, "tmp": tmp, "json": tmp / "out" / "r.json", "img": tmp / "img"}


def test_smoke_run_exits_zero_and_writes_strict_json(smoke: dict[str, Any]) -> None:
    assert smoke["rc"] == 0
    r = _strict_load(smoke["json"])
    assert r["benchmark"] == "tiered-kv bench" and r["mode"] == "smoke" and r["seed"] == 3
    assert set(r["sections"]) == {"core", "disk", "e2e", "trace", "step", "copy_step"}
    assert r["problems"]["wrong_bytes"] == []
    # the scratch directory is removed afterwards
    assert not any((smoke["tmp"] / "scratch").glob("tkv-bench-disk-*"))


def test_every_promote_load_is_a_promote(smoke: dict[str, Any]) -> None:
    """Cold and warm promote loads all find their key only on disk: a key still in the host tier
    would measure a host load (the warm rounds cycle over the sets the host tier no longer holds)."""
    promotes = _strict_load(smoke["json"])["sections"]["disk"]["promote"]
    assert promotes
    for p in promotes:
        assert p["tkv_loads_already_in_host"] == 0, p["block_bytes"]
        assert p["tkv_misses"] == 0 and p["tkv_failed"] == 0


def test_the_promote_baselines_and_one_at_a_time_loads_checked_their_bytes(smoke: dict[str, Any]) -> None:
    """The fair baseline (pread + copy_ into rows) left every row right, and the loads made one at a
    time were all promotes that landed the right bytes."""
    for p in _strict_load(smoke["json"])["sections"]["disk"]["promote"]:
        assert p["raw_copy_bad_rows"] == 0
        assert p["figures"]["cold"]["raw_copy"]["n"] >= 1 and p["figures"]["warm"]["raw_copy"]["n"] >= 1
        one = p["one_at_a_time"]["warm"]
        assert one["blocks"] >= 1 and one["misses"] == 0 and one["failed"] == 0 and one["bad_rows"] == 0
        assert one["tkv_us"]["n"] == 2 * one["blocks"] and one["raw_us"]["n"] == 2 * one["blocks"]
        ar = p["after_reopen"]["warm"]   # loads right after a reopen: every one a promote that landed its bytes
        assert ar["tkv"]["n"] == ar["raw_copy"]["n"] == ar["rounds"] >= 1
        assert ar["misses"] == ar["failed"] == ar["bad_rows"] == ar["in_host_before"] == 0


def test_the_engine_step_drives_both_systems_through_the_same_workload(smoke: dict[str, Any]) -> None:
    """Each step of each system made its lookups, one batched load and one batched store; tiered_kv's
    stores were all accepted and spilled through the disk tier, and no load failed."""
    st = _strict_load(smoke["json"])["sections"]["step"]
    steps = st["steps"]
    for t, b in zip(st["runs"]["tkv"], st["runs"]["dict"]):
        assert t["counts"]["stores"] == b["counts"]["stores"] == steps and t["counts"]["stores_none"] == 0
        assert t["counts"]["loads"] + t["counts"]["loads_skipped_busy"] + t["counts"]["loads_too_few_hits"] \
            + t["counts"]["loads_none"] == steps
        assert t["counts"]["loads"] > 0 and t["loads_failed"] == 0
        assert t["spills_ok"] + t["spills_shed"] > 0
        assert t["cpu_us"]["n"] == b["cpu_us"]["n"] == steps
        assert set(t["gc"]) == set(b["gc"]) == {"us_per_step", "gen0", "gen1", "gen2"}
    note = {f["id"]: f for f in _strict_load(smoke["json"])["figures"]}["step.engine_cpu_us"]["note"]
    assert "of which the garbage collector" in note and "dict original: of which the garbage collector" in note


def test_the_copy_step_runs_each_api_and_the_baseline_with_real_copies(smoke: dict[str, Any]) -> None:
    """Issue 25's step: each mode made every step's stores and loads (or counted why not), no copy failed,
    and the figures carry the issue's targets."""
    r = _strict_load(smoke["json"])
    cs = r["sections"]["copy_step"]
    steps = cs["steps"]
    for compute in ("sleep", "busy"):
        for mode in ("batched", "per_block", "dict"):
            for run in cs["runs"][compute][mode]:
                c = run["counts"]
                assert run["cpu_us"]["n"] == steps
                per = 1 if mode == "batched" else cs["stores"]
                assert c["stores"] + c["stores_none"] == steps * per
                assert c["loads"] + c["loads_none"] == (steps - c["loads_skipped_busy"]) * per, (mode, c)
                assert run.get("copy_failed", 0) == 0
    ids = {f["id"]: f for f in r["figures"]}
    for compute in ("sleep", "busy"):
        f = ids[f"copy_step.engine_cpu_us.{compute}"]
        assert f["target"] == "<= 200 us" and f["value"] > 0 and f["baseline"] > 0 and f["source"] == "issue 25"
    for d in ("store", "load"):
        for size, target in ((65536, True), (262144, True), (2097152, False)):
            f = ids[f"host.batched.{d}.{size}"]
            assert (f["target"] is not None) is target and f["ratio"] > 0
            assert ids[f"host.batched_scattered.{d}.{size}"]["target"] is None


def test_evicting_runs_alternate_and_report_each_pair(smoke: dict[str, Any]) -> None:
    e = _strict_load(smoke["json"])["sections"]["disk"]["evicting"]
    assert e["repeats"] == 2 and len(e["tkv_runs"]) == 2 and len(e["raw_circular"]["runs"]) == 2
    pairs = e["ratios"]["tkv_steady_vs_raw_circular_runs"]
    assert len(pairs) == 2 and all(p > 0 for p in pairs)
    # the file size figures are the worst run's, never a better one's
    assert e["tkv"]["file_vs_capacity_peak"] == max(r["file_vs_capacity_peak"] for r in e["tkv_runs"])
    assert e["tkv"]["file_vs_capacity_end"] == max(r["file_vs_capacity_end"] for r in e["tkv_runs"])
    # ... each ratio beside the byte count it came from
    for which in ("end", "peak"):
        assert e["tkv"][f"file_bytes_{which}"] == pytest.approx(e["tkv"][f"file_vs_capacity_{which}"] * e["capacity_bytes"])
    # the detailed run is one of the runs (the lower median of two)
    steady = sorted(r["steady_gbps_median"] for r in e["tkv_runs"])
    assert e["tkv"]["steady_gbps_median"] == steady[0]
    assert all(r["spills_shed"] == 0 for r in e["tkv_runs"])


def test_machine_facts(smoke: dict[str, Any]) -> None:
    m = _strict_load(smoke["json"])["machine"]
    assert m["cores"] >= 1
    assert m["torch"]
    assert isinstance(m["cuda"], bool)
    assert m["filesystem"]["type"]
    assert m["filesystem"]["statvfs"]["total_bytes"] > 0


def test_every_figure_has_value_baseline_ratio_target_met(smoke: dict[str, Any]) -> None:
    figs = _strict_load(smoke["json"])["figures"]
    assert figs
    for f in figs:
        assert FIGURE_KEYS <= set(f), f
        for k in ("value", "baseline", "ratio", "target_threshold"):
            assert f[k] is None or isinstance(f[k], (int, float)), (f["id"], k)
        assert f["met"] in (True, False, None)
        if f["skipped"]:
            assert f["met"] is None
        elif f["target"] is not None and f["value"] is not None and \
                (f["target_on"] == "value" or f["ratio"] is not None):
            assert isinstance(f["met"], bool), f["id"]
        if f["target"] is None:
            assert f["met"] is None
        if f["ratio"] is not None and f["value"] is not None and f["baseline"]:
            assert math.isclose(f["ratio"], f["value"] / f["baseline"], rel_tol=1e-9), f["id"]
        if not f["skipped"]:
            assert f["baseline_name"] and f["vs"], f["id"]  # never a figure without its baseline
    ids = {f["id"] for f in figs}
    expected = {"control.store_p99", "disk.evicting.spill", "disk.evicting.file_vs_capacity",
                "latency.store", "latency.lookup", "latency.load", "e2e.hit_rate.host", "e2e.hit_rate.disk",
                "e2e.recompute_avoided.host", "e2e.recompute_avoided.disk"}
    assert expected <= ids, expected - ids
    assert {f"host.{d}.{b}" for d in ("store", "load") for b in (256 << 10, 2 << 20, 8 << 20)} <= ids
    assert any(i.startswith("control.lifecycles.") for i in ids)
    assert any(i.startswith("disk.spill.") for i in ids) and any(i.startswith("disk.promote.") for i in ids)
    assert any(i.startswith("disk.spill_vs_diskcache.") for i in ids)
    assert any(i.startswith("cuda.") for i in ids)
    assert {"trace.refs_per_s.host", "trace.refs_per_s.disk", "step.engine_cpu_us", "disk.promote_one.2097152.warm",
            "disk.promote_reopen.2097152.warm"} <= ids


def test_cuda_row_is_skipped_without_cuda(smoke: dict[str, Any]) -> None:
    import torch
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the CUDA figures are measured")
    figs = {f["id"]: f for f in _strict_load(smoke["json"])["figures"]}
    assert "no CUDA" in figs["cuda.copy"]["skipped"]


def test_plot_writes_pngs(smoke: dict[str, Any]) -> None:
    if not _has_matplotlib():
        pytest.skip("matplotlib not installed")
    names = {p.name for p in smoke["img"].glob("*.png")}
    assert {"throughput-host.png", "throughput-disk.png", "latency-under-load.png", "end-to-end.png"} <= names
    for p in smoke["img"].glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert p.stat().st_size > 10_000


def test_missed_targets_do_not_fail_the_command(smoke: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    # re-render the smoke result with an unreachable target: the exit status does not depend on timings
    monkeypatch.setitem(bench_common.TARGETS, "lifecycles_per_cpu_s", float("inf"))
    capsys.readouterr()
    assert main(["bench", "--from-json", str(smoke["json"])]) == 0
    out = capsys.readouterr().out
    assert "MISSED" in out and "targets met:" in out


def test_plot_without_matplotlib_is_a_clear_error(smoke: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.setattr(bench_plots, "matplotlib_missing", lambda: "ModuleNotFoundError: No module named 'matplotlib'")
    rc = main(["bench", "--from-json", str(smoke["json"]), "--plot", str(tmp_path / "img")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "tiered-kv[bench]" in err
    assert not (tmp_path / "img").exists()


def test_without_diskcache_the_peer_rows_say_not_installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench_disk, "_diskcache", None)  # as if the import had failed
    out = tmp_path / "r.json"
    assert main(["bench", "--smoke", "--sections", "spill", "--dir", str(tmp_path), "--json", str(out),
                 "--no-details"]) == 0
    r = _strict_load(out)
    peer = [f for f in r["figures"] if f["id"].startswith("disk.spill_vs_diskcache.")]
    assert peer and all("not installed" in f["skipped"] for f in peer)
    assert all(f["met"] is None for f in peer)
    assert "not installed" in r["machine"]["diskcache"]
    assert "not installed" in capsys.readouterr().out


def test_unknown_section_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--smoke", "--sections", "spill,nope"]) == 2
    assert "unknown sections ['nope']" in capsys.readouterr().err


def test_evicting_aggregates_pairs_and_keeps_each_file_ratio_with_its_bytes(monkeypatch, tmp_path):
    """bench_evicting's summary over runs, on made-up runs (no disk I/O): the median run's rates, the
    worst run's file figures (each ratio with its byte count), one pair per repeat."""
    cap = 100
    fake = iter([
        {"gbps": 1.0, "steady_gbps_median": 2.0, "file_bytes_end": 100, "file_bytes_peak": 130,
         "file_vs_capacity_end": 1.00, "file_vs_capacity_peak": 1.30, "evictions": 1, "spills_shed": 0},
        {"gbps": 3.0, "steady_gbps_median": 1.0, "file_bytes_end": 110, "file_bytes_peak": 110,
         "file_vs_capacity_end": 1.10, "file_vs_capacity_peak": 1.10, "evictions": 1, "spills_shed": 0},
        {"gbps": 2.0, "steady_gbps_median": 3.0, "file_bytes_end": 105, "file_bytes_peak": 120,
         "file_vs_capacity_end": 1.05, "file_vs_capacity_peak": 1.20, "evictions": 1, "spills_shed": 0},
    ])
    monkeypatch.setattr(bench_disk, "_tkv_evicting", lambda *a, **k: dict(next(fake)))
    raw_seconds = iter([1.0, 2.0, 4.0])
    monkeypatch.setattr(bench_disk, "_raw_write", lambda *a, **k: next(raw_seconds))

    class _Blk:
        block_bytes, n_rows, views = 10, 4, [b"x" * 10] * 4

    e = bench_disk.bench_evicting(tmp_path, _Blk(), capacity=cap, total=40, with_diskcache=False,  # type: ignore[arg-type]
                                  repeats=3)
    t = e["tkv"]
    assert t["steady_gbps_median"] == 2.0 and t["gbps"] == 1.0                      # the median run (2.0)
    assert (t["file_bytes_end"], t["file_vs_capacity_end"]) == (110, 1.10)           # worst end: run 2
    assert (t["file_bytes_peak"], t["file_vs_capacity_peak"]) == (130, 1.30)         # worst peak: run 1
    raw = [40 / s / 1e9 for s in (1.0, 2.0, 4.0)]
    assert e["raw_circular"]["runs"] == raw
    assert e["ratios"]["tkv_steady_vs_raw_circular_runs"] == pytest.approx([2.0 / raw[0], 1.0 / raw[1], 3.0 / raw[2]])
    assert e["ratios"]["tkv_steady_vs_raw_circular"] == pytest.approx(2.0 / raw[1])  # ratio of the medians


def test_the_trace_replay_gives_every_system_the_same_references(smoke: dict[str, Any]) -> None:
    t = _strict_load(smoke["json"])["sections"]["trace"]
    assert t["requests"] == 60 and t["block_refs"] == sum(len(r) for r in bench_trace.load_trace(t["trace"], 60))
    for s in ("host", "disk", "dict"):
        (run,) = t["runs"][s]
        assert run["refs"] == t["block_refs"] and 0 < run["hits"] < run["refs"], s
    # the host tier alone is an LRU of the baseline's size with no key shed: the same hits
    host = t["runs"]["host"][0]
    assert host["stores_shed"] == 0 and host["hits"] == t["runs"]["dict"][0]["hits"]
    assert host["hits_host"] == host["hits"] and host["hits_disk"] == 0


def test_a_malformed_trace_is_refused_naming_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"hash_ids": [1, 2]}\n\n{"hash_ids": [3, -1]}\n')
    with pytest.raises(bench_trace.TraceError, match=r"t\.jsonl:3: 'hash_ids' must be non-negative, got -1"):
        bench_trace.load_trace(bad)
    bad.write_text('{"hash_ids": [1]}\nnot json\n')
    with pytest.raises(bench_trace.TraceError, match=r"t\.jsonl:2: not JSON"):
        bench_trace.load_trace(bad)
    assert bench_trace.load_trace(bad, limit=1) == [[1]]
    assert main(["bench", "--smoke", "--sections", "trace", "--trace", str(bad), "--no-details"]) == 2
    assert "t.jsonl:2: not JSON" in capsys.readouterr().err
    assert main(["bench", "--smoke", "--sections", "trace", "--trace", str(tmp_path / "none.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
