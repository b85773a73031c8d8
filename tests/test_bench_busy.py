"""``tiered-kv bench --sections busy``: the section runs, its result has its shape, bytes really moved.

One in-process ``--quick`` run of the section alone (about 15 s: six store rows of 1.5 s and the
promote loads) is shared by the tests; one more test runs the ``smoke`` plan with
``disk_io="process"`` made to fail, to show that such a failure is recorded, not raised.  Nothing
here asserts a timing or whether a target was met: only the shape, the counts' bookkeeping and
the bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import tiered_kv.bench.busy as bench_busy
from tiered_kv.bench import report
from tiered_kv.tools.cli import main

FIGURE_KEYS = {"id", "section", "name", "unit", "better", "value", "baseline", "baseline_name", "vs", "ratio",
               "target", "target_on", "target_op", "target_threshold", "met", "stats", "source", "note", "skipped"}
ENGINES = [e[0] for e in bench_busy.ENGINES]


def _strict_load(path: Path) -> Any:
    def no_constant(name: str) -> Any:
        raise AssertionError(f"non-standard JSON constant {name} in {path}")
    return json.loads(path.read_text(encoding="utf-8"), parse_constant=no_constant)


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("bench-busy")
    out = tmp / "r.json"
    rc = main(["bench", "--quick", "--sections", "busy", "--seed", "5", "--dir", str(tmp / "scratch"),
               "--json", str(out), "--no-details"])
    return {"rc": rc, "tmp": tmp, "result": _strict_load(out)}


def _check_row(x: dict[str, Any], plan: dict[str, Any], per_step: int) -> None:
    """A store row that ran: every store is accounted for, spills were published, CPU samples kept."""
    assert x["error"] is None
    assert x["steps"] > plan["warmup_steps"]
    assert x["stores_done"] + x["stores_refused"] == x["steps"] * per_step
    assert x["stores_done"] > 0
    # every store that was done started a spill that was published, or was shed, failed or cancelled
    assert x["published"] + x["shed"] + x["spills_failed"] + x["spills_cancelled"] == x["stores_done"]
    assert x["shed"] == sum(x["shed_by_reason"].values())
    assert x["published"] > 0 and x["written_mb_s"] > 0 and x["disk_blocks_at_end"] > 0
    assert 0.0 < x["published_fraction"] <= 1.0
    assert x["published_fraction"] == pytest.approx(x["published"] / x["stores_done"])
    assert x["flush_ok"] is True and x["spills_failed"] == 0
    assert x["engine_cpu_us"]["n"] == x["steps"] - plan["warmup_steps"]
    assert x["engine_cpu_us"]["mean"] > 0
    if x["engine_kind"] == "busy":
        assert x["busy_rounds_per_ms"] > 0
    else:
        assert x["busy_rounds_per_ms"] is None


def _check_promote(p: dict[str, Any]) -> None:
    """The promote part that ran: every load was a promote from disk that landed the stored bytes."""
    assert p["error"] is None
    assert p["fill_flush_ok"] is True and p["fill_spills_shed"] == 0
    assert p["fill_spills_published"] == p["keys_stored"]
    assert p["misses"] == p["failed"] == p["bad_rows"] == p["already_in_host"] == 0
    n_idle, n_busy = p["idle"]["after_us"]["n"], p["busy"]["after_us"]["n"]
    assert n_idle == n_busy == p["loads_tried"] // 2 > 0
    assert p["idle"]["total_us"]["n"] == n_idle and p["busy"]["total_us"]["n"] == n_busy
    assert p["promotes_ok"] >= n_idle + n_busy
    # the total (load .. wait) holds the engine's own 5 ms; what follows it is part of the total
    for s in ("idle", "busy"):
        assert p[s]["total_us"]["min"] >= bench_busy.PROMOTE_ENGINE_MS * 1e3
        assert p[s]["after_us"]["median"] < p[s]["total_us"]["median"]


def test_the_quick_run_exits_zero_with_the_busy_section_only(quick: dict[str, Any]) -> None:
    r = quick["result"]
    assert quick["rc"] == 0
    assert r["sections_run"] == ["busy"] and set(r["sections"]) == {"busy"}
    assert r["problems"]["wrong_bytes"] == []
    assert not any((quick["tmp"] / "scratch").glob("tkv-bench-busy-*"))   # its scratch directory is removed


def test_every_row_and_both_disk_io_modes_ran_or_say_why(quick: dict[str, Any]) -> None:
    b = quick["result"]["sections"]["busy"]
    plan = bench_busy.PLANS["quick"]
    assert b["mode"] == "quick" and b["duration_s"] == plan["duration_s"]
    assert b["row_bytes"] == 64 << 10 and b["stores_per_step"] == 16 and b["durability"] == "batch"
    assert b["disk_slots"] == 2 * b["host_slots"]
    got = sorted((x["disk_io"], x["engine"]) for x in b["rows"])
    assert got == sorted((io, e) for io in bench_busy.DISK_IO for e in ENGINES)
    for x in b["rows"]:
        if x["disk_io"] == "process" and x["error"]:
            assert isinstance(x["error"], str) and x["error"]   # being built: the error is recorded, not raised
            continue
        _check_row(x, plan, b["stores_per_step"])
    assert set(b["promote"]) == set(bench_busy.DISK_IO)
    for io, p in b["promote"].items():
        if io == "process" and p["error"]:
            continue
        _check_promote(p)


def test_the_figures_have_their_schema_and_targets(quick: dict[str, Any]) -> None:
    figs = {f["id"]: f for f in quick["result"]["figures"]}
    expected = ({f"busy.published_fraction.{io}.{e}" for io in bench_busy.DISK_IO for e in ("busy5", "busy20")}
                | {f"busy.engine_cpu_us.{e}" for e in ENGINES}
                | {f"busy.promote_{s}.{io}" for s in ("p50", "p99") for io in bench_busy.DISK_IO})
    assert set(figs) == expected
    for f in figs.values():
        assert FIGURE_KEYS <= set(f), f
        assert f["section"] == "busy engine" and f["baseline_name"] and f["vs"]
        if f["skipped"]:
            assert f["met"] is None and "did not run" in f["skipped"]
        elif f["target"] is not None:
            assert isinstance(f["met"], bool), f["id"]
    thread = figs["busy.published_fraction.thread.busy5"]
    assert thread["target_on"] == "value" and thread["target_op"] == ">=" and thread["target_threshold"] == 0.99
    assert thread["skipped"] is None and thread["baseline"] is not None
    cpu = figs["busy.engine_cpu_us.busy20"]
    assert cpu["target_on"] == "ratio" and cpu["target_op"] == "<=" and cpu["target_threshold"] == 1.05
    assert cpu["vs"] == "disk_io=thread"
    for s in ("p50", "p99"):
        assert figs[f"busy.promote_{s}.process"]["target_threshold"] == 1.5
        today = figs[f"busy.promote_{s}.thread"]
        assert today["target"] is None and today["met"] is None and today["value"] is not None


def test_a_process_mode_that_cannot_start_is_recorded_not_raised(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    real = bench_busy.TierManager

    def manager(cfg: Any, *a: Any, **k: Any) -> Any:
        if cfg.disk_io == "process":
            raise RuntimeError("disk I/O process not built yet")
        return real(cfg, *a, **k)

    monkeypatch.setattr(bench_busy, "TierManager", manager)
    b = bench_busy.bench_busy("smoke", 1, str(tmp_path))
    plan = bench_busy.PLANS["smoke"]
    for x in b["rows"]:
        if x["disk_io"] == "process":
            assert x["error"] == "RuntimeError: disk I/O process not built yet" and x["engine"] in ENGINES
        else:
            _check_row(x, plan, b["stores_per_step"])
    assert b["promote"]["process"]["error"] == "RuntimeError: disk I/O process not built yet"
    _check_promote(b["promote"]["thread"])
    result = {"sections": {"busy": b}}
    figs = {f["id"]: f for f in report.collect_figures(result)}
    assert "did not run" in figs["busy.engine_cpu_us.busy5"]["skipped"]
    assert "did not run" in figs["busy.promote_p50.process"]["skipped"]
    assert figs["busy.published_fraction.thread.busy5"]["skipped"] is None
    assert figs["busy.promote_p50.thread"]["value"] is not None
    other = report.problems(result)["other"]
    assert any("busy process busy5: did not run: RuntimeError" in p for p in other)
    assert "error: RuntimeError" in bench_busy.format_busy(b)
    assert not list(tmp_path.iterdir())   # its scratch directory is removed
