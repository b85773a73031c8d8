"""``tiered-kv bench --sections remote``: the section runs against a real server, its result has its
shape, the bytes it moved were checked, and a wrong byte fails the command.

One in-process ``--smoke`` run of the section alone against the tests' session ``redis-server``
(given with ``--remote-url``: the section then deletes only its own keys) is shared by the tests;
a few more run smaller plans to show that a wrong byte is exit 1 and that a missing or unreachable
server skips the section, saying why.  Nothing here asserts a timing or whether a target was met.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import tiered_kv.bench.remote as bench_remote
from redis_servers import RedisServer, free_port, require_redis
from tiered_kv.bench import report
from tiered_kv.bench.cli import DEFAULT_SECTIONS, run_bench
from tiered_kv.tools.cli import main

FIGURE_KEYS = {"id", "section", "name", "unit", "better", "value", "baseline", "baseline_name", "vs", "ratio",
               "target", "target_on", "target_op", "target_threshold", "met", "stats", "source", "note", "skipped"}
TINY = {"sizes": ((4096, 8),), "repeats": 1, "requests": 12}


def _strict_load(path: Path) -> Any:
    def no_constant(name: str) -> Any:
        raise AssertionError(f"non-standard JSON constant {name} in {path}")
    return json.loads(path.read_text(encoding="utf-8"), parse_constant=no_constant)


@pytest.fixture(scope="module")
def smoke(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    redis_server.reset()
    tmp = tmp_path_factory.mktemp("bench-remote")
    out = tmp / "r.json"
    rc = main(["bench", "--smoke", "--sections", "remote", "--remote-url", redis_server.url, "--seed", "4",
               "--json", str(out), "--no-details"])
    return {"rc": rc, "result": _strict_load(out), "keys_left": redis_server.client().dbsize()}


def test_the_section_runs_and_checks_its_bytes(smoke: dict[str, Any]) -> None:
    assert smoke["rc"] == 0
    r = smoke["result"]
    assert set(r["sections"]) == {"remote"}
    assert r["problems"] == {"wrong_bytes": [], "other": []}
    x = r["sections"]["remote"]
    assert x["skipped"] is None
    assert x["server"]["private"] is False and x["server"]["version"]
    plan = bench_remote.PLANS["smoke"]
    assert [(z["block_bytes"], z["blocks"]) for z in x["sizes"]] == [tuple(s) for s in plan["sizes"]]
    for z in x["sizes"]:
        n, bb = z["blocks"], z["block_bytes"]
        assert z["bytes"] == n * bb and z["bad_rows"] == 0 and z["raw_bad_values"] == 0 and z["problems"] == []
        for op in ("put", "get"):
            assert z[op]["tkv"]["n"] == z[op]["raw"]["n"] == plan["repeats"]
            assert z[op]["tkv"]["median"] > 0 and z[op]["raw"]["median"] > 0
        for run in z["runs"]["tkv"]:
            # every block went to the server and came back through the other manager, verified
            assert run["flush_ok"] is True and run["puts_ok"] == n and run["puts_shed"] == 0
            assert run["put_bytes"] == n * bb and run["get_bytes"] == n * bb
            assert run["local_before_fetch"] == 0 and run["held_after_fetch"] == n and run["remote_hits"] == n
            assert run["read_back_failed"] is False and run["corrupt_values"] == 0
        assert all(run["bad_values"] == 0 for run in z["runs"]["raw"])


def test_the_two_machines_replay_the_same_requests_with_and_without_the_remote_tier(smoke: dict[str, Any]) -> None:
    t = smoke["result"]["sections"]["remote"]["trace"]
    assert t["requests"] == bench_remote.PLANS["smoke"]["requests"]
    assert t["host_slots"] >= 2 * t["longest_request"]
    for key in ("remote", "host_only"):
        x = t[key]
        a, b = x["a"], x["b"]
        assert a["requests"] + b["requests"] == t["requests"] and a["requests"] - b["requests"] in (0, 1)
        assert a["refs"] + b["refs"] == x["pair"]["refs"] == t["block_refs"]
        for m in (a, b):
            assert 0 <= m["hits"] <= m["refs"]
            assert m["hits"] == m["hits_local"] + m["hits_after_fetch"]
            assert m["wait_timeouts"] == m["stores_refused"] == m["flush_failed"] == 0
    ho = t["host_only"]
    assert ho["a"]["remote_hits"] == ho["b"]["remote_hits"] == ho["pair"]["hits_after_fetch"] == 0
    rm = t["remote"]
    # B's requests share prefixes with A's: some of its blocks came from the server A wrote them to
    assert rm["b"]["remote_hits"] > 0 and rm["b"]["hits_after_fetch"] > 0
    assert rm["a"]["puts_ok"] > 0 and rm["a"]["puts_shed"] == rm["a"]["puts_failed"] == 0


def test_figures_have_their_shape_and_targets(smoke: dict[str, Any]) -> None:
    figs = {f["id"]: f for f in smoke["result"]["figures"]}
    sizes = [bb for bb, _ in bench_remote.PLANS["smoke"]["sizes"]]
    want = {f"remote.{op}.{bb}" for op in ("put", "get") for bb in sizes} | {"remote.hit_ratio.b",
                                                                             "remote.hit_ratio.pair"}
    assert set(figs) == want
    for f in figs.values():
        assert set(f) == FIGURE_KEYS
        assert f["section"] == "remote tier" and f["skipped"] is None
        assert f["value"] is not None and f["baseline"] is not None
    for bb in sizes:
        for op in ("put", "get"):
            f = figs[f"remote.{op}.{bb}"]
            assert f["unit"] == "GB/s" and f["ratio"] is not None
            if bb in bench_remote.TARGET_SIZES:
                assert f["target_on"] == "ratio" and f["target_threshold"] == bench_remote.TARGET_VS_RAW
                assert f["met"] in (True, False)
            else:
                assert f["target"] is None and f["met"] is None
    assert figs["remote.hit_ratio.b"]["target"] is None and figs["remote.hit_ratio.b"]["vs"] == "host only"
    assert "remote tier:" in report.format_details(smoke["result"])


def test_only_the_sections_keys_are_deleted_and_all_of_them(smoke: dict[str, Any]) -> None:
    """With --remote-url the section never runs FLUSHALL, and it leaves none of its keys behind."""
    assert smoke["keys_left"] == 0


def test_a_foreign_key_on_a_given_server_survives(redis_url: str, redis_server: RedisServer,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    redis_server.client().set(b"someone-elses", b"value")
    monkeypatch.setitem(bench_remote.PLANS, "smoke", TINY)
    r = bench_remote.bench_remote("smoke", remote_url=redis_url)
    assert r["skipped"] is None
    assert redis_server.client().get(b"someone-elses") == b"value"
    assert redis_server.client().dbsize() == 1


def test_a_wrong_byte_after_the_fetch_is_exit_1(redis_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(bench_remote.PLANS, "smoke", TINY)
    real = bench_remote._read_back

    def flipped(mgr: Any, dev: torch.Tensor, keys: list[bytes]) -> Any:
        got = real(mgr, dev, keys)
        assert got is not None
        got[len(keys) // 2, 7] ^= 0x01      # one bit of one row, as a wrong copy would leave it
        return got

    monkeypatch.setattr(bench_remote, "_read_back", flipped)
    out = tmp_path / "r.json"
    rc = main(["bench", "--smoke", "--sections", "remote", "--remote-url", redis_url, "--json", str(out),
               "--no-details"])
    assert rc == 1
    r = _strict_load(out)
    assert r["sections"]["remote"]["sizes"][0]["bad_rows"] == 1
    assert r["problems"]["wrong_bytes"] == ["remote 4 KiB: 1 rows with wrong bytes after the put and the fetch"]
    assert "WRONG BYTES remote 4 KiB" in capsys.readouterr().out


def test_without_a_server_the_section_is_skipped_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_remote.shutil, "which", lambda name: None)
    r = run_bench("smoke", sections=["remote"])
    x = r["sections"]["remote"]
    assert x["skipped"] == bench_remote.SERVER_MISSING
    figs = [f for f in r["figures"] if f["section"] == "remote tier"]
    assert figs and all(f["skipped"] == bench_remote.SERVER_MISSING for f in figs)
    assert r["problems"] == {"wrong_bytes": [], "other": []}
    assert "skip" in report.format_table(r) and "remote tier: skipped" in report.format_details(r)


def test_an_unreachable_server_skips_the_section() -> None:
    r = bench_remote.bench_remote("smoke", remote_url=f"redis://127.0.0.1:{free_port()}/0")
    assert r["skipped"].startswith("cannot reach redis://127.0.0.1:")


def test_a_malformed_remote_url_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--smoke", "--sections", "remote", "--remote-url", "http://x"]) == 2
    assert "--remote-url" in capsys.readouterr().err


def test_the_private_server_starts_answers_and_is_gone_after_stop() -> None:
    require_redis()
    s = bench_remote.PrivateServer().start()
    try:
        assert s.url.startswith("redis://127.0.0.1:")
        assert s._answers()
        d, proc = s.dir, s.proc
        assert d is not None and os.path.isdir(d) and proc is not None
    finally:
        s.stop()
    assert proc.poll() is not None and not os.path.exists(d)
    s.stop()   # idempotent


def test_smoke_leaves_the_section_out() -> None:
    """The tests' shared smoke run (tests/test_bench_cli.py) starts no server; this file runs the section."""
    assert "remote" not in DEFAULT_SECTIONS["smoke"] and "remote" in DEFAULT_SECTIONS["full"]
