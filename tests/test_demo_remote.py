"""``tiered-kv demo --remote-url``: the demo with the shared remote tier, against a real redis-server.

Without the flag nothing changes (no server, no remote rows, no ``remote`` in the summary); with it
the demo's manager writes to the server, a second run with the same seed (another "machine" of the
same namespace) finds the first one's blocks there, and the url is never printed with its password.
The demo runs in-process (``cli.main``) with a few hundred steps.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

import pytest

from redis_servers import RedisServer
from tiered_kv.tools.cli import main
from tiered_kv.tools.demo import WorkloadConfig, remote_url_for_display

STEPS = "300"
PASSWORD = "s3cret-Pa55word"


def _demo(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str, name: str = "run") -> tuple[dict[str, Any], str]:
    """One in-process demo run: (its JSON summary, everything it printed)."""
    out = tmp_path / f"{name}.json"
    rc = main(["demo", "--steps", STEPS, "--no-progress", "--json", str(out), *extra])
    printed = capsys.readouterr()
    text = printed.err + printed.out   # the table (stdout) last
    assert rc == 0, text
    return json.loads(out.read_text()), text


def test_without_remote_url_nothing_changes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary, text = _demo(tmp_path, capsys)
    assert "remote" not in summary
    assert "remote" not in text
    assert summary["loads_ok"] > 0 and summary["corrupt_loads"] == 0


def test_demo_with_remote_tier(redis_url: str, redis_server: RedisServer, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    first, text = _demo(tmp_path, capsys, "--remote-url", redis_url, name="first")
    r = first["remote"]
    assert r["healthy"] == 1.0 and r["errors"] == {} and r["corrupt_values"] == 0, r
    assert r["puts"]["ok"] > 0 and r["bytes_written"] == r["puts"]["ok"] * first["block_bytes"], r
    assert first["corrupt_loads"] == 0 and first["errors"] == 0
    assert redis_server.command("DBSIZE") > 0
    for row in ("hits on remote", "host->remote", "remote->host", "remote writes refused", "remote tier healthy"):
        assert row in text, f"no {row!r} row in\n{text}"
    assert f"remote tier at {redis_url}" in text
    # another machine of the same namespace (same seed, a fresh local disk): the server holds its prefixes
    second, text = _demo(tmp_path, capsys, "--remote-url", redis_url, name="second")
    r2 = second["remote"]
    assert r2["hits"] > 0 and r2["bytes_read"] > 0 and r2["fetches"]["ok"] > 0, r2
    assert second["corrupt_loads"] == 0 and second["errors"] == 0 and r2["corrupt_values"] == 0


def test_compare_adds_a_remote_run(redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summaries, text = _demo(tmp_path, capsys, "--compare", "--remote-url", redis_url)
    assert set(summaries) == {"no offload", "host", "host+disk", "host+disk+remote"}
    assert [n for n, s in summaries.items() if "remote" in s] == ["host+disk+remote"]
    header = text.splitlines()[[i for i, line in enumerate(text.splitlines()) if "host+disk+remote" in line][-1]]
    assert header.split() == ["no", "offload", "host", "host+disk", "host+disk+remote"]
    hits = [line for line in text.splitlines() if line.strip().startswith("hits on remote")]
    assert len(hits) == 1 and hits[0].split()[3:6] == ["-", "-", "-"], hits


def test_the_password_is_never_printed(redis_server_factory: Callable[..., RedisServer], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    server = redis_server_factory("--requirepass", PASSWORD)
    url = f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
    caplog.set_level(logging.DEBUG, logger="tiered_kv")
    summary, text = _demo(tmp_path, capsys, "--remote-url", url)
    assert summary["remote"]["puts"]["ok"] > 0 and summary["remote"]["errors"] == {}, summary["remote"]
    assert PASSWORD not in text + caplog.text and PASSWORD not in json.dumps(summary)
    assert f"redis://:***@127.0.0.1:{server.port}/0" in text
    # the server gone: its errors are logged, still without the password
    server.stop()
    caplog.clear()
    summary, text = _demo(tmp_path, capsys, "--remote-url", url, name="down")
    assert summary["remote"]["healthy"] == 0.0 and summary["remote"]["errors"], summary["remote"]
    assert "remote" in caplog.text and PASSWORD not in text + caplog.text


def test_workload_config() -> None:
    url = f"redis://user:{PASSWORD}@cache:6379/0"
    cfg = WorkloadConfig(steps=1, remote_url=url)
    assert PASSWORD not in repr(cfg)
    assert remote_url_for_display(url) == "redis://user:***@cache:6379/0"
    with pytest.raises(ValueError, match="offload"):
        WorkloadConfig(steps=1, offload="none", remote_url=url)
    with pytest.raises(ValueError) as exc:
        WorkloadConfig(steps=1, users=0, remote_url=url)
    assert PASSWORD not in str(exc.value)
