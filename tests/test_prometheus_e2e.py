"""grafana/ and deploy/ against a real Prometheus scraping the real demo.

Starts ``tiered-kv demo --metrics-port P --disk-path DIR`` (a subprocess),
then ``prometheus`` with deploy/prometheus.yml rewritten to scrape it every
second (and deploy/alerts.yml loaded), waits for scrapes and rule
evaluations, and runs through Prometheus' HTTP API (/api/v1/query):

* every query of every dashboard panel and every template variable, with
  Grafana's variables substituted (``$__rate_interval`` -> 10s, ``$__range``
  -> 1m, multi-value variables -> their "All" value): each must parse and
  return at least one series;
* every alert rule: the whole expression must parse and evaluate (it is
  normally empty: the demo is healthy), Prometheus must report the rule
  healthy, and the left-hand side of its one top-level threshold comparison
  (the signal without the threshold) must return at least one series.

``promtool check config``, ``check rules`` and ``check metrics`` (on the
demo's exposition) must pass.  Skipped only when the ``prometheus`` binary is
absent; CI installs Debian's package with ci/install_prometheus.sh.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from test_dashboard import (
    DASHBOARDS,
    DEPLOY,
    REPO,
    load_dashboard,
    panel_queries,
    split_comparison,
    substitute,
    variable_queries,
)

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="the prometheus binary is not on PATH (CI installs Debian's prometheus package: ci/install_prometheus.sh)")

DEMO_SECONDS = 120        # longer than the test; the demo is stopped at teardown
MIN_SCRAPES = 8           # scrapes of the demo (1 s apart) before querying
JOB = "tiered-kv"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read()  # type: ignore[no-any-return]


def _promtool(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None, "promtool is missing (it comes with Debian's prometheus package)"
    return subprocess.run([PROMTOOL, *args], input=None if stdin is None else stdin.decode(),
                          capture_output=True, text=True, timeout=60)


def _stop(proc: subprocess.Popen[bytes], sig: int, grace: float) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@dataclass
class Stack:
    demo: subprocess.Popen[bytes]
    prometheus: subprocess.Popen[bytes]
    demo_url: str
    prom_url: str
    exposition: bytes
    config: Path
    logs: Path

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.prom_url}{path}" + (("?" + urllib.parse.urlencode(params)) if params else "")
        try:
            body = _get(url, timeout=10)
        except urllib.error.HTTPError as exc:  # 400 bad_data / 422 execution: the JSON says why
            body = exc.read()
        return json.loads(body)

    def query(self, expr: str) -> tuple[bool, Any]:
        """(ok, result list or error text) of an instant query."""
        r = self.api("/api/v1/query", query=expr)
        if r.get("status") != "success":
            return False, f"{r.get('errorType')}: {r.get('error')}"
        data = r["data"]
        if data["resultType"] in ("scalar", "string"):
            return True, [data["result"]]
        return True, data["result"]

    def diagnostics(self) -> str:
        out = []
        for name in ("demo.err", "prometheus.err"):
            p = self.logs / name
            if p.exists():
                out.append(f"--- {name} (tail)\n" + "\n".join(p.read_text(errors="replace").splitlines()[-20:]))
        return "\n".join(out)


def _rewrite_config(text: str, target: str) -> str:
    """deploy/prometheus.yml, pointed at ``target`` and scraping/evaluating every second."""
    subs = [(r"(?m)^(\s*scrape_interval:) \S+", r"\1 1s"),
            (r"(?m)^(\s*evaluation_interval:) \S+", r"\1 1s"),
            (r"(?m)^(\s*scrape_timeout:) \S+", r"\1 1s"),
            (r"(?m)^(\s*- targets:) \[[^\]]*\]$", rf'\1 ["{target}"]')]
    for pattern, repl in subs:
        text, n = re.subn(pattern, repl, text)
        assert n == 1, f"deploy/prometheus.yml changed shape: {pattern!r} matched {n} times"
    return text


def _wait(what: str, cond: Any, timeout: float, stack_or_logs: Any = None) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = cond()
            if last:
                return last
        except (OSError, ValueError, KeyError) as exc:
            last = exc
        time.sleep(0.25)
    extra = stack_or_logs() if callable(stack_or_logs) else ""
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})\n{extra}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("prometheus-e2e")
    logs = tmp / "logs"
    logs.mkdir()

    def tails() -> str:
        return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-20:])
                         for p in sorted(logs.iterdir()))

    demo_port, prom_port = _free_port(), _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    demo_cmd = [sys.executable, "-m", "tiered_kv.tools.cli", "demo", "--seconds", str(DEMO_SECONDS), "--no-progress",
                "--metrics-port", str(demo_port), "--disk-path", str(tmp / "lmdb")]
    demo = subprocess.Popen(demo_cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                            stdout=open(logs / "demo.out", "wb"), stderr=open(logs / "demo.err", "wb"))
    prom: subprocess.Popen[bytes] | None = None
    try:
        demo_url = f"http://127.0.0.1:{demo_port}/metrics"

        def demo_up() -> bool:
            if demo.poll() is not None:
                pytest.fail(f"the demo exited with {demo.returncode} before serving /metrics: "
                            f"{' '.join(demo_cmd)}\n{tails()}")
            return b"tiered_kv_info" in _get(demo_url)

        _wait("the demo's /metrics", demo_up, 60, tails)

        config_dir = tmp / "config"
        config_dir.mkdir()
        config = config_dir / "prometheus.yml"
        config.write_text(_rewrite_config((DEPLOY / "prometheus.yml").read_text(), f"127.0.0.1:{demo_port}"))
        shutil.copy(DEPLOY / "alerts.yml", config_dir / "alerts.yml")

        prom = subprocess.Popen(
            [str(PROMETHEUS), f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
            cwd=tmp, stdin=subprocess.DEVNULL, stdout=open(logs / "prometheus.out", "wb"),
            stderr=open(logs / "prometheus.err", "wb"))
        prom_url = f"http://127.0.0.1:{prom_port}"

        def prom_ready() -> bool:
            if prom.poll() is not None:
                pytest.fail(f"prometheus exited with {prom.returncode}\n{tails()}")
            return b"ready" in _get(f"{prom_url}/-/ready").lower()

        _wait("prometheus to be ready", prom_ready, 30, tails)
        st = Stack(demo, prom, demo_url, prom_url, b"", config, logs)

        def scraped() -> bool:
            ok, res = st.query(f'count_over_time(up{{job="{JOB}"}}[1m])')
            up_ok, up = st.query(f'up{{job="{JOB}"}}')
            return (ok and up_ok and bool(res) and float(res[0]["value"][1]) >= MIN_SCRAPES
                    and bool(up) and up[0]["value"][1] == "1")

        _wait(f"{MIN_SCRAPES} successful scrapes of the demo", scraped, 45, tails)

        def rules_evaluated() -> bool:
            groups = st.api("/api/v1/rules")["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            return bool(rules) and all(not r["lastEvaluation"].startswith("0001") for r in rules)

        _wait("a first evaluation of every rule", rules_evaluated, 20, tails)
        st.exposition = _get(demo_url)
        assert demo.poll() is None, f"the demo ended during the test\n{tails()}"
        yield st
    finally:
        if prom is not None:
            _stop(prom, signal.SIGTERM, 10)
        _stop(demo, signal.SIGINT, 15)


# ----------------------------------------------------------------------------- promtool
def test_promtool_check_config_and_rules() -> None:
    r = _promtool("check", "config", str(DEPLOY / "prometheus.yml"))  # also checks the rule files it names
    assert r.returncode == 0, r.stdout + r.stderr
    r = _promtool("check", "rules", str(DEPLOY / "alerts.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def test_promtool_check_rewritten_config(stack: Stack) -> None:
    r = _promtool("check", "config", str(stack.config))
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_check_metrics(stack: Stack) -> None:
    assert b"tiered_kv_stale_callbacks_total" in stack.exposition
    r = _promtool("check", "metrics", stdin=stack.exposition)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


# ----------------------------------------------------------------------------- the dashboard
@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_dashboard_query_returns_series(stack: Stack, path: Path) -> None:
    dash = load_dashboard(path)
    queries = [(w, substitute(e, dash)) for w, e in panel_queries(dash)] + variable_queries(dash)
    assert len(queries) >= 20
    failures = []
    for where, expr in queries:
        ok, res = stack.query(expr)
        if not ok:
            failures.append(f"{where}: does not evaluate: {res}\n    {expr}")
        elif not res:
            failures.append(f"{where}: no series\n    {expr}")
    assert not failures, _explain(stack, failures, len(queries))


def test_headline_panel_shows_stale_callbacks(stack: Stack) -> None:
    """The demo's aborts and preemptions make real stale callbacks: the headline panel is not flat."""
    dash = load_dashboard(DASHBOARDS[0])
    where, expr = panel_queries(dash)[0]
    assert "tiered_kv_stale_callbacks_total" in expr, where

    def moving() -> bool:
        ok, res = stack.query(substitute(expr, dash))
        return ok and any(float(s["value"][1]) > 0 for s in res)

    _wait(f"a non-zero rate on {where}", moving, 20, stack.diagnostics)


# ----------------------------------------------------------------------------- alert rules
def _alert_names() -> set[str]:
    return set(re.findall(r"(?m)^\s*- alert: (\w+)\s*$", (DEPLOY / "alerts.yml").read_text()))


def test_every_alert_rule_evaluates_and_its_signal_returns_series(stack: Stack) -> None:
    groups = stack.api("/api/v1/rules")["data"]["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"] if r["type"] == "alerting"}
    assert set(rules) == _alert_names()
    failures = []
    for name, rule in sorted(rules.items()):
        expr = rule["query"]
        if rule["health"] != "ok" or rule.get("lastError"):
            failures.append(f"{name}: health {rule['health']}: {rule.get('lastError')}")
        ok, res = stack.query(expr)
        if not ok:
            failures.append(f"{name}: does not evaluate: {res}\n    {expr}")
        lhs, op, rhs = split_comparison(expr)
        ok, res = stack.query(lhs)
        if not ok:
            failures.append(f"{name}: left of {op!r} does not evaluate: {res}\n    {lhs}")
        elif not res:
            failures.append(f"{name}: left of {op!r} returns no series\n    {lhs}")
        ok, res = stack.query(rhs)
        if not ok:
            failures.append(f"{name}: right of {op!r} does not evaluate: {res}\n    {rhs}")
    assert not failures, _explain(stack, failures, len(rules))


def test_no_alert_fires_for_the_healthy_demo(stack: Stack) -> None:
    ok, res = stack.query('ALERTS{alertstate="firing"}')
    assert ok and not [s["metric"]["alertname"] for s in res]


def _explain(stack: Stack, failures: list[str], total: int) -> str:
    text = stack.exposition.decode(errors="replace")
    declared = set(re.findall(r"(?m)^# TYPE (tiered_kv_\w+) ", text))
    sampled = {m.split("{")[0].split(" ")[0] for m in text.splitlines() if m.startswith("tiered_kv_")}
    empty = sorted(n for n in declared
                   if not any(s == n or s.startswith(n + "_") for s in sampled))
    msg = f"{len(failures)} of {total} expressions failed:\n" + "\n".join(failures)
    if empty:
        msg += ("\n\nMetrics the demo declares but exports no series for (a labelled metric has no series "
                "until its first labels() call; Metrics should create its known label values up front): "
                + ", ".join(empty))
    return msg
