"""Adversarial review of ``tiered-kv demo`` (tiered_kv/tools/demo.py) and its command line (tools/cli.py).

What it proved wrong, each pinned by a test that failed before its fix: a request re-hashed its user's
whole history (its cost grew with the rounds of a long run); ``--steps`` alone stopped at 20 s;
``--compare``'s runs saw different requests (the invalidation draw only with a manager) and the remote
run started on the host+disk run's LMDB; a ``--disk-path`` that cannot be opened ran without a disk
tier and exited 0; ``--json``, ``--remote-url``, ``--metrics-port`` and ``--linger`` are checked before
any run; sizes that cannot be allocated are one-line errors.  The other tests pin guarantees the other
suites do not cover.
Runs are in-process (``cli.main``), seeded, with a few engine steps; nothing here asserts on timing.
"""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
import threading
import types
from pathlib import Path
from typing import Any

import pytest

import tiered_kv.tools.demo as demo
from tiered_kv.jobs import JobKind
from tiered_kv.manager import TierManager
from tiered_kv.tools.cli import main


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``main(argv)`` in-process: (exit status, stdout, stderr); an exception that escapes fails the test."""
    try:
        rc = main(list(argv))
    except SystemExit as exc:   # argparse
        rc = int(exc.code or 0)
    except BaseException as exc:   # noqa: BLE001 -- a traceback is the finding
        pytest.fail(f"traceback, exit 1: {type(exc).__name__}: {exc}"[:400])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The offload mode of every ``run_workload`` the CLI starts, in order (the runs still happen)."""
    seen: list[str] = []
    real = demo.run_workload

    def recording(cfg: Any, *a: Any, **kw: Any) -> dict[str, Any]:
        seen.append(cfg.offload)
        return real(cfg, *a, **kw)

    monkeypatch.setattr(demo, "run_workload", recording)
    return seen


# ======================================================================= findings


def test_a_requests_hashing_does_not_grow_with_the_users_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each request recomputes ``chain_keys`` over every earlier round of its user (to reach the parent
    of the 3-round window), so a request costs O(rounds).  At the default ~850 requests/s over 48
    users a user gains ~18 rounds/s: ~1.4 ms per request after 10 minutes, ~11 ms after an hour
    (measured), so the documented long runs (``--seconds 3600``, the 24 h docker demo) slow to a crawl
    and their /metrics rates decay for a reason that is the simulator's, not the library's."""
    import torch

    cfg = demo.WorkloadConfig(steps=1, users=1)
    kv = torch.zeros((cfg.device_blocks, *cfg.row_shape), dtype=torch.float16)
    eng = demo._Engine(cfg, None, kv)
    hashed = [0]
    real = demo.chain_keys

    def counting(parent: bytes, parts: list[bytes]) -> list[bytes]:
        hashed[0] += len(parts)
        return real(parent, parts)

    monkeypatch.setattr(demo, "chain_keys", counting)
    worst = 0
    for _ in range(200):   # one user's 200 rounds
        hashed[0] = 0
        eng._new_request()
        worst = max(worst, hashed[0])
    per_request = cfg.system_prompt_blocks + 3 + cfg.max_new_blocks   # the blocks a request holds, at most
    assert worst <= 2 * per_request, f"one request hashed {worst} blocks (it holds at most {per_request})"


def test_steps_alone_runs_that_many_steps(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    """``--steps N`` ("stop after this many engine steps instead") is passed with ``seconds=20.0``, the
    default of ``--seconds``, and the loop stops at whichever comes first: on a machine (or a clock)
    where N steps take over 20 s the run silently ends short.  A clock that advances 30 s per reading
    stands in for a slow machine; only the demo's own clock is replaced."""
    clock = [0.0]

    def slow_clock() -> float:
        clock[0] += 30.0
        return clock[0]

    monkeypatch.setattr(demo, "time", types.SimpleNamespace(perf_counter=slow_clock))
    out = tmp_path / "s.json"
    rc, _, err = _cli(capsys, "demo", "--steps", "5", "--no-progress", "--json", str(out))
    assert rc == 0, err
    assert json.loads(out.read_text())["steps"] == 5


def test_compare_modes_see_the_same_arrivals(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """``step()`` draws ``rng.random()`` for an invalidation only when there is a manager, so from the
    second step on the no-offload run draws a different request stream from the same seed than the
    host and host+disk runs: ``--compare`` (and ``tiered-kv bench``'s e2e section, whose docstring says
    each mode "sees the same arrival process until completions ... make the runs diverge") sets the
    offload modes beside a baseline serving other users and prompts.  The first three steps' arrivals do
    not depend on timing in any mode (no request can finish before step 2's end), so they must agree."""
    made: dict[str, list[list[bytes]]] = {}
    real = demo._Engine._new_request

    def recording(self: Any) -> Any:
        req = real(self)
        made.setdefault(self.cfg.offload, []).append(req.keys)
        return req

    monkeypatch.setattr(demo._Engine, "_new_request", recording)
    rc, _, err = _cli(capsys, "demo", "--compare", "--steps", "3", "--seed", "0", "--no-progress")
    assert rc == 0, err
    assert made["host"] == made["disk"]   # both have a manager: the same draws
    assert made["none"] == made["host"], {m: len(v) for m, v in made.items()}


def test_compare_remote_run_does_not_start_on_the_previous_runs_disk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """With ``--compare --remote-url URL --disk-path DIR`` the "host+disk" and "host+disk+remote" runs get
    the same ``DIR``: the fourth run recovers every block the third one spilled and counts them as
    disk hits (measured: 83 disk hits and 173 hits in all against 0 and 76 for host+disk, 30 steps),
    so the table credits the remote tier with hits that are the previous run's disk.  The fourth run
    is stopped at its start (Ctrl-C); nothing connects to the URL."""
    starts: list[tuple[str, bool, bool]] = []
    real = demo.run_workload

    def recording(cfg: Any, *a: Any, **kw: Any) -> dict[str, Any]:
        warm = cfg.disk_path is not None and (Path(cfg.disk_path) / "data.mdb").exists()
        starts.append((cfg.offload, cfg.remote_url is not None, warm))
        if cfg.remote_url is not None:
            raise KeyboardInterrupt
        return real(cfg, *a, **kw)

    monkeypatch.setattr(demo, "run_workload", recording)
    rc, _, err = _cli(capsys, "demo", "--compare", "--steps", "30", "--no-progress", "--disk-path",
                      str(tmp_path / "lmdb"), "--remote-url", "redis://127.0.0.1:1/0")
    assert rc == 130 and starts[-1][1], (rc, starts, err)
    assert [warm for _, _, warm in starts] == [False] * 4, starts


def test_a_disk_path_that_cannot_be_opened_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--disk-path`` naming a regular file: the manager absorbs the open failure (counted, disk tier
    missing, as the library should for an engine), and the demo then runs host-only, prints its
    "host+disk" table with zero disk traffic and exits 0 -- the user asked for a disk tier and was not
    told it is not there (only one ERROR log line, and ``errors 1`` in the table)."""
    path = tmp_path / "not-a-dir"
    path.write_bytes(b"x")
    rc, _, err = _cli(capsys, "demo", "--steps", "2", "--no-progress", "--disk-path", str(path))
    assert rc == 2 and err.startswith("tiered-kv demo") and str(path) in err, (rc, err)


@pytest.mark.parametrize("argv", [
    ["--json", "{tmp}/no-such-dir/out.json"],
    ["--compare", "--remote-url", "http://cache:6379/0"],
    ["--compare", "--metrics-port", "{busy}"],
], ids=["json-dir-missing", "compare-bad-remote-url", "compare-port-in-use"])
def test_an_unusable_option_is_refused_before_any_run(argv: list[str], runs: list[str], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``--json`` is opened after the whole run (a 20 s run, or three with --compare, then exit 2 and no
    JSON); with ``--compare`` a bad ``--remote-url`` is parsed only by the fourth run's manager (after
    three full runs), and a ``--metrics-port`` in use is bound only by the second run.  Each is known
    before anything runs."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        args = [a.format(tmp=tmp_path, busy=busy.getsockname()[1]) for a in argv]
        rc, _, err = _cli(capsys, "demo", "--steps", "2", "--no-progress", *args)
    assert rc == 2 and "tiered-kv demo: error" in err, (rc, err)
    assert runs == [], f"ran {runs} before refusing"


@pytest.mark.parametrize("argv", [
    ["--device-blocks", "1000000000000"],             # torch.zeros: RuntimeError (DefaultCPUAllocator)
    ["--host-blocks", "1000000000000000"],            # hostmem.make_shared_rows: os.ftruncate OverflowError
    ["--metrics-port", "0", "--linger", "inf"],       # time.sleep(inf) after the run: OverflowError, table lost
], ids=["device-blocks-huge", "host-blocks-huge", "linger-inf"])
def test_demo_bad_sizes_exit_2_without_a_traceback(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """``main`` turns TieredKVError, ValueError and OSError into one line and exit 2; a device pool torch
    cannot allocate (RuntimeError), a host tier too large for ``ftruncate`` (OverflowError; the
    config's own capacity check lets it through under ``disk_io="process"``) and ``--linger inf``
    (OverflowError from ``time.sleep`` once the run is over, its table never printed) escape as
    tracebacks.  ``--disk-blocks`` of the same size is a one-line error already."""
    rc, _, err = _cli(capsys, "demo", "--steps", "2", "--no-progress", *argv)
    assert rc == 2 and err.startswith("tiered-kv demo"), (rc, err)


# ======================================================================= guarantees pinned


def _children() -> set[int]:
    out: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            out.update(int(p) for p in (task / "children").read_text().split())
        except OSError:
            pass
    return out


def _live_children() -> set[int]:
    live = set()
    for pid in _children():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            live.add(pid)
    return live


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")
def test_ctrl_c_mid_run_exits_130_and_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """KeyboardInterrupt in the engine loop (the demo on its default temporary disk tier, /metrics up):
    exit 130, the temporary directory removed, the disk I/O child gone, the manager's and the
    /metrics server's threads joined."""
    made: list[str] = []

    def mkdtemp(prefix: str = "") -> str:
        made.append(tempfile.mkdtemp(prefix=prefix, dir=tmp_path))
        return made[-1]

    monkeypatch.setattr(demo, "tempfile", types.SimpleNamespace(mkdtemp=mkdtemp))
    real_step = demo._Engine.step
    during: list[set[int]] = []

    def step(self: Any) -> None:
        if self.stats["steps"] == 20:
            during.append(_live_children())
            raise KeyboardInterrupt
        real_step(self)

    monkeypatch.setattr(demo._Engine, "step", step)
    threads_before = {t.ident for t in threading.enumerate()}
    children_before = _live_children()
    rc, out, err = _cli(capsys, "demo", "--steps", "1000", "--no-progress", "--metrics-port", "0")
    assert rc == 130, err
    assert made and not os.path.exists(made[0]), made
    assert during and during[0] - children_before, "the disk I/O child was not seen during the run"
    assert _live_children() <= children_before
    left = [t.name for t in threading.enumerate() if t.ident not in threads_before and t.is_alive()
            and t.name != "tiered-kv-disk-spawner"]
    assert left == [], left


def test_the_correctness_check_can_fail(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The demo's own check (every completed load compared with the key's bytes) is not vacuous: a
    manager whose loads land one ulp off makes every verified load corrupt, the JSON says so and the
    run exits 1 with FAILED."""
    class Scribbling(TierManager):
        def __init__(self, cfg: Any, kv: Any, **kw: Any) -> None:
            super().__init__(cfg, kv, **kw)
            self._review_kv = kv

        def poll(self) -> Any:
            out = super().poll()
            for c in out:
                if c.job.kind is JobKind.LOAD and c.ok:
                    self._review_kv[c.job.block].view(-1)[0] += 1
            return out

    monkeypatch.setattr(demo, "TierManager", Scribbling)
    out = tmp_path / "s.json"
    rc, _, err = _cli(capsys, "demo", "--steps", "150", "--no-progress", "--json", str(out))
    s = json.loads(out.read_text())
    assert rc == 1 and "FAILED" in err, (rc, err)
    assert s["loads_ok"] > 0 and s["corrupt_loads"] > 0, s


def test_json_figures_agree_with_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The table and ``--json`` carry the same run: hit counts, loads verified, steps, and the hit
    rate computed from the engine's own lookup counts agrees with the manager's per-tier hit metrics."""
    out = tmp_path / "s.json"
    rc, table, err = _cli(capsys, "demo", "--steps", "150", "--seed", "3", "--no-progress", "--json", str(out))
    assert rc == 0, err
    s = json.loads(out.read_text())
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in table.splitlines()[2:] if line.strip())
    assert rows["engine steps"] == f"{s['steps']:,}" == "150"
    assert rows["loads verified"] == f"{s['loads_ok']:,}"
    assert rows["hits in host"] == f"{s['hits_by_tier']['host']:,}"
    assert s["lookup_hits"] == sum(s["hits_by_tier"].values())
    assert s["blocks_computed"] >= s["blocks_needed"] - s["lookup_hits"]
    assert s["recompute_avoided_tokens"] == s["loads_ok"] * s["tokens_per_block"]


# ======================================================================= Ctrl-C and --linger
@pytest.fixture
def servers(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every /metrics server the CLI starts, with whether it was closed (``closed`` attribute list)."""
    import tiered_kv.exposition as expo

    made: list[Any] = []
    real = expo.serve_metrics

    def recording(*a: Any, **kw: Any) -> Any:
        s = real(*a, **kw)
        made.append(s)
        return s

    monkeypatch.setattr(expo, "serve_metrics", recording)
    return made


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


def test_ctrl_c_during_the_run_stops_at_once_and_closes_metrics_without_lingering(monkeypatch, capsys, servers):
    """A Ctrl-C is the user asking to stop: the run's /metrics is not kept up for --linger seconds."""
    import tiered_kv.tools.cli as cli

    slept: list[float] = []
    monkeypatch.setattr(cli.time, "sleep", slept.append)

    def interrupted(cfg: Any, *a: Any, on_manager: Any = None, **kw: Any) -> dict[str, Any]:
        on_manager(None)
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "run_workload", interrupted)
    rc, _, err = _cli(capsys, "demo", "--metrics-port", "0", "--linger", "600", "--no-progress")
    assert rc == 130 and slept == [] and "keeping /metrics up" not in err
    assert len(servers) == 1 and not _port_open(servers[0].port)


def test_a_second_ctrl_c_while_lingering_still_closes_metrics(monkeypatch, capsys, servers):
    import tiered_kv.tools.cli as cli

    def second_ctrl_c(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.time, "sleep", second_ctrl_c)

    def finished(cfg: Any, *a: Any, on_manager: Any = None, **kw: Any) -> dict[str, Any]:
        on_manager(None)
        return {}

    monkeypatch.setattr(demo, "run_workload", finished)
    rc, _, err = _cli(capsys, "demo", "--metrics-port", "0", "--linger", "600", "--no-progress")
    assert rc == 130 and "keeping /metrics up for 600 s" in err
    assert len(servers) == 1 and not _port_open(servers[0].port)
