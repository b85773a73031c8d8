"""grafana/ and deploy/ against a real Prometheus scraping the real demo.

Starts a ``redis-server`` (tests/redis_servers.py) and ``tiered-kv demo
--metrics-port P --disk-path DIR --remote-url redis://...`` (a subprocess: the
demo with its remote tier, so that the remote panels have series), then
``prometheus`` with deploy/prometheus.yml rewritten to scrape it every second
(and deploy/alerts.yml loaded), waits for scrapes and rule evaluations, and
runs through Prometheus' HTTP API (/api/v1/query):

* every query of every dashboard panel and every template variable, with
  Grafana's variables substituted (``$__rate_interval`` -> 10s, ``$__range``
  -> 1m, multi-value variables -> their "All" value): each must parse and
  return at least one series;
* every alert rule: the whole expression must parse and evaluate, Prometheus
  must report the rule healthy, and the left-hand side of its one top-level
  threshold comparison (the signal without the threshold) must return at least
  one series;
* every alert rule's *state* (``/api/v1/rules``), per instance: all inactive
  while nothing is wrong, then -- once a second process (``FAULTS``: a real
  TierManager with a disk tier, serving its metrics with
  :func:`tiered_kv.exposition.serve_metrics`) has been driven through a
  stale-callback burst, a corrupt block, shed spills, an I/O error and a dead
  disk writer, its second TierManager (host and remote tiers, its own metrics
  endpoint) has lost its redis-server (killed by the harness: its writes fail,
  its circuit breaker opens), and a third target has gone down -- exactly the
  expected alerts active: ``pending`` for the rules of deploy/alerts.yml with a
  ``for:`` (1 to 15 minutes: none can fire within the test) and ``firing`` for
  those without.
  To see those with a ``for:`` fire too, the harness also loads a copy of
  deploy/alerts.yml whose ``for:`` durations are rewritten to ``0s`` (group
  ``tiered_kv_for_0s``, label ``harness="for-0s"``, see :func:`_rules_with_zero_for`),
  written into the test's temporary config directory; deploy/ is never changed.

``promtool check config``, ``check rules`` and ``check metrics`` (on the
demo's exposition) must pass.  Skipped when the ``prometheus`` binary is
absent (CI installs Debian's package with ci/install_prometheus.sh) or, as
every test with a real server, when ``redis-server`` is (a failure under
``CI``: ci/install_redis.sh).  No sleep orders anything: every wait polls the
API (or reads a line from a child) for a condition, with a deadline.
"""

from __future__ import annotations

import datetime
import http.server
import json
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest
import yaml

from redis_servers import RedisServer, require_redis
from test_dashboard import (
    DASHBOARDS,
    DEPLOY,
    REMOTE_ROW,
    REPO,
    load_dashboard,
    panel_queries,
    row_panels,
    split_comparison,
    substitute,
    variable_queries,
)

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="the prometheus binary is not on PATH (CI installs Debian's prometheus package: ci/install_prometheus.sh)")

DEMO_SECONDS = 180        # longer than the test; the demo is stopped at teardown
MIN_SCRAPES = 8           # scrapes of the demo (1 s apart) before querying
JOB = "tiered-kv"
FAULT_JOB = "tiered-kv-faults"   # the harness's second job: the FAULTS process and a target that goes down
FAST_RULES = "alerts_for_0s.yml"  # the harness's copy of deploy/alerts.yml with every `for:` set to 0s
HARNESS_LABELS = {"alertname", "job", "instance", "severity", "harness"}
STALE_BURST = 6000        # stale callbacks the FAULTS process makes at once (see _expected_alerts)

# A TierManager with a disk tier and one with a remote tier (host + remote, on the redis-server whose
# url is argv[3]), each serving its metrics on a free port ("ready PORT RPORT"), driven through faults
# on the command "faults" ("done {counters}"); the harness kills that redis-server just before.  Each
# step waits for its effect (wait/flush/poll/until), so "done" comes once the registries hold every
# count; the writer gate is an Event, not a sleep.
FAULTS = r"""
import json, os, sys, threading, time
import torch
from prometheus_client import CollectorRegistry
from tiered_kv import TierManager, TieredKVConfig
from tiered_kv.disk.format import SLOTS_NAME
from tiered_kv.exposition import serve_metrics

path, burst, remote_url = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ROW = 256
kv = torch.zeros((64, ROW), dtype=torch.uint8)
cfg = TieredKVConfig(namespace="alerts|u8|tp0", host_capacity_bytes=16 * ROW, disk_path=path,
                     disk_capacity_bytes=256 * ROW, writer_queue_blocks=2, host_evict_ahead_blocks=0,
                     disk_io="thread")       # its fault hook runs inside the in-process writer
mgr = TierManager(cfg, kv, registry=CollectorRegistry())
reg = mgr.metrics.registry
server = serve_metrics(0, registry=reg)
n = 0

def store(row):
    global n
    n += 1
    kv[row].fill_(n % 251)
    job = mgr.store(b"key%08d" % n, row)
    assert job is not None, f"store {n} was shed"
    return job

def stored(row):                         # stored, and its spill durable
    job = store(row)
    assert [c.ok for c in mgr.wait([job], timeout=30) if c.job is job] == [True]
    assert mgr.flush(timeout=30) is True
    return job.key

mode = {"hook": None}
held, release = threading.Event(), threading.Event()

def hook(point):                         # DiskStore.fault_hook: runs in the writer, before each commit
    what = mode["hook"]
    if what == "hold":
        held.set()
        assert release.wait(60)
    elif what == "eio":
        mode["hook"] = None
        raise OSError(5, "Input/output error")
    elif what == "die":
        raise SystemExit("disk writer killed by tests/test_prometheus_e2e.py")

mgr.disk.fault_hook = hook

# the remote tier's manager: its first writes reach the server (it is healthy while nothing is wrong)
rkv = torch.zeros((16, ROW), dtype=torch.uint8)
rcfg = TieredKVConfig(namespace="alerts-remote|u8|tp0", host_capacity_bytes=64 * ROW, remote_url=remote_url,
                      remote_timeout_seconds=0.5)
rmgr = TierManager(rcfg, rkv, registry=CollectorRegistry())
rreg = rmgr.metrics.registry
rserver = serve_metrics(0, registry=rreg)
rn = 0

def rstores():                           # 16 stores (one remote write job of 16 keys once they are in host)
    global rn
    jobs = []
    for row in range(16):
        rn += 1
        rkv[row].fill_(rn % 251)
        job = rmgr.store(b"rkey%08d" % rn, row)
        assert job is not None, f"remote manager's store {rn} was shed"
        jobs.append(job)
    assert all(c.ok for c in rmgr.wait(jobs, timeout=30))
    for row in range(16):
        assert rmgr.free_block(row)

def remote_healthy():
    return rreg.get_sample_value("tiered_kv_healthy", {"tier": "remote"})

rstores()
assert rmgr.flush(timeout=30) is True, "the remote manager's first writes did not reach the server"
rmgr.poll()
assert remote_healthy() == 1

def remote_faults():
    # 6. the server is gone (the harness killed it): each write job fails (connection, 16 parts a round
    #    trip) until 3 failed round trips in a row open the breaker: the remote tier is unhealthy
    for _ in range(10):
        rstores()
        rmgr.flush(timeout=30)           # False: the writes failed
        rmgr.poll()
        if remote_healthy() == 0:
            break
    assert remote_healthy() == 0, "the remote tier's breaker never opened"
    until(lambda: counts("tiered_kv_errors_total", "error", registry=rreg, tier="remote").get("breaker_open") == 1,
          "the breaker_open count")

def faults():
    # 1. stale callbacks: stores whose device row is given up before their copy is applied
    for i in range(burst):
        store(i % 64)
        assert mgr.free_block(i % 64)
        if i % 8 == 7:
            mgr.wait(timeout=30)
    mgr.wait(timeout=30)
    # 2. a corrupt block: only on disk, a payload byte of every slot flipped, then loaded
    victim = stored(0)
    for i in range(20):                  # evict it from the 16-slot host tier
        stored(1 + i % 32)
    assert mgr.host_bytes(victim) is None and mgr.lookup([victim]) == 1
    fd = os.open(os.path.join(path, SLOTS_NAME), os.O_RDWR)
    for off in range(0, os.fstat(fd).st_size, 4096):
        os.pwrite(fd, bytes([os.pread(fd, 1, off + 7)[0] ^ 0xFF]), off + 7)
    os.close(fd)
    job = mgr.load(victim, 40)
    got = [c for c in mgr.wait([job], timeout=30) if c.job is job]
    assert len(got) == 1 and not got[0].ok and "corrupt" in got[0].error, got
    assert mgr.flush(timeout=30) is True     # the removal of the corrupt entry is committed: the queue is empty
    # 3. shed spills: the writer held inside the commit of one spill, then 8 more: 2 fill its queue,
    #    6 are shed (backpressure)
    mode["hook"] = "hold"
    mgr.wait([store(1)], timeout=30)
    assert held.wait(30), "the writer never started the held commit"
    mgr.wait([store(2 + i) for i in range(8)], timeout=30)
    mode["hook"] = None
    release.set()
    assert mgr.flush(timeout=30) is True
    # 4. an I/O error: the next commit fails (no flush is waiting: only io_error is counted)
    mode["hook"] = "eio"
    mgr.wait([store(2)], timeout=30)
    until(lambda: disk_errors().get("io_error") == 1, "the io_error count")
    mgr.poll()
    # 5. the disk writer dies at its next commit: the tier is unhealthy, later spills are shed (disk_down)
    mode["hook"] = "die"
    mgr.wait([store(3)], timeout=30)
    until(lambda: not mgr.disk.writer_alive(), "the writer's death")
    mgr.poll()
    mgr.wait([store(4 + i) for i in range(3)], timeout=30)
    mgr.poll()
    remote_faults()

def until(cond, what, timeout=30.0):     # a bounded wait on a condition of another thread
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)

def disk_errors():
    return counts("tiered_kv_errors_total", "error", tier="disk")

def counts(name, label, registry=reg, **match):
    out = {}
    for fam in registry.collect():
        for smp in fam.samples:
            if smp.name == name and smp.value and all(smp.labels.get(k) == v for k, v in match.items()):
                key = smp.labels.get(label, "") if label else ""
                out[key] = out.get(key, 0) + smp.value
    return out

print("ready", server.port, rserver.port, flush=True)
for line in sys.stdin:
    if line.strip() == "faults":
        faults()
        print("done", json.dumps({
            "stale": counts("tiered_kv_stale_callbacks_total", None).get("", 0),
            "disk_errors": disk_errors(),
            "spills_shed": counts("tiered_kv_shed_total", "reason", kind="spill"),
            "corrupt": counts("tiered_kv_corrupt_blocks_total", "reason"),
            "healthy": {t: reg.get_sample_value("tiered_kv_healthy", {"tier": t}) for t in ("device", "host", "disk")},
            "remote_errors": counts("tiered_kv_errors_total", "error", registry=rreg, tier="remote"),
            "remote_healthy": {t: rreg.get_sample_value("tiered_kv_healthy", {"tier": t})
                               for t in ("device", "host", "remote")},
        }), flush=True)
server.close()
rserver.close()
mgr.close()
rmgr.close()
"""


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


class _DownTarget:
    """A scrape target that answers (an empty exposition) until :meth:`go_down` closes its port."""

    def __init__(self) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the base class's name
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.instance = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    def go_down(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
            self.thread.join(10)
        self.server.server_close()


@dataclass
class Stack:
    demo: subprocess.Popen[bytes]
    prometheus: subprocess.Popen[bytes]
    demo_url: str
    prom_url: str
    exposition: bytes
    config: Path
    logs: Path
    demo_instance: str = ""
    faults: Optional[subprocess.Popen[str]] = None   # the FAULTS process (stdin/stdout: commands/answers)
    fault_instance: str = ""
    down: Optional[_DownTarget] = None
    remote_instance: str = ""                          # the FAULTS process's remote-tier manager
    remote_redis: Optional[RedisServer] = None         # its server, killed by the faults test

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
        for name in ("demo.err", "faults.err", "prometheus.err"):
            p = self.logs / name
            if p.exists():
                out.append(f"--- {name} (tail)\n" + "\n".join(p.read_text(errors="replace").splitlines()[-20:]))
        return "\n".join(out)


def _rules_with_zero_for(text: str) -> str:
    """The harness's copy of deploy/alerts.yml: the same rules with every ``for:`` set to 0s (so that
    the rules that wait 1 to 15 minutes fire within the test), in its own group and with the label
    ``harness="for-0s"`` (its ALERTS series stay apart from the real rules')."""
    doc = yaml.safe_load(text)
    (group,) = doc["groups"]
    group["name"] += "_for_0s"
    for rule in group["rules"]:
        rule["for"] = "0s"
        rule.setdefault("labels", {})["harness"] = "for-0s"
    return yaml.safe_dump(doc, sort_keys=False)


def _harness_config(text: str, demo_target: str, fault_targets: list[str]) -> str:
    """:func:`_rewrite_config`, plus the harness's rules copy and a second job scraping the FAULTS
    process and the target that goes down (``job=~"tiered-kv.*"``, as TieredKVTargetDown selects)."""
    doc = yaml.safe_load(_rewrite_config(text, demo_target))
    assert doc["rule_files"] == ["alerts.yml"], doc["rule_files"]
    doc["rule_files"].append(FAST_RULES)
    doc["scrape_configs"].append({"job_name": FAULT_JOB, "metrics_path": "/metrics", "scrape_timeout": "1s",
                                  "static_configs": [{"targets": fault_targets}]})
    return yaml.safe_dump(doc, sort_keys=False)


def _stale_history(instance: str, now: float) -> str:
    """An hour of stale-callback history of ``instance`` (OpenMetrics, for ``promtool tsdb
    create-blocks-from``): TieredKVStaleCallbackSpike compares the last 5 minutes with the hour
    before them (``[1h] offset 5m``), which a fresh Prometheus does not have -- without it the
    right-hand side is empty and the rule can never be true.  A steady 1 per 15 s, up to 6 minutes
    ago: the threshold becomes 10 + 3 * (1/15) per second."""
    series = f'tiered_kv_stale_callbacks_total{{instance="{instance}",job="{FAULT_JOB}",kind="store",reason="cancelled"}}'
    start, end = int(now) - 65 * 60, int(now) - 6 * 60
    lines = ["# TYPE tiered_kv_stale_callbacks counter"]
    lines += [f"{series} {i} {ts}" for i, ts in enumerate(range(start, end, 15))]
    return "\n".join(lines + ["# EOF", ""])


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


def _readline(proc: subprocess.Popen[str], timeout: float, tails: Any) -> str:
    """One line of ``proc``'s stdout within ``timeout`` s, else fail with the logs."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            pytest.fail(f"no line from the FAULTS process within {timeout:.0f} s\n{tails()}")
    line = proc.stdout.readline()
    if not line:
        pytest.fail(f"the FAULTS process exited with {proc.wait(10)}\n{tails()}")
    return line.rstrip("\n")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("prometheus-e2e")
    logs = tmp / "logs"
    logs.mkdir()

    def tails() -> str:
        return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-20:])
                         for p in sorted(logs.iterdir()))

    # the remote tiers' servers: the demo's, and the FAULTS process's (killed by the faults test)
    require_redis()
    servers: list[RedisServer] = []
    for name in ("redis-demo", "redis-faults"):
        (tmp / name).mkdir()
        servers.append(RedisServer(str(tmp / name)))
    demo_redis, fault_redis = servers
    try:
        for s in servers:
            s.start()
    except BaseException:
        for s in servers:
            s.stop()
        raise

    demo_port, prom_port = _free_port(), _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    for var in ("TIERED_KV_REMOTE_USERNAME", "TIERED_KV_REMOTE_PASSWORD"):   # the test's servers have no password
        env.pop(var, None)
    demo_cmd = [sys.executable, "-m", "tiered_kv.tools.cli", "demo", "--seconds", str(DEMO_SECONDS), "--no-progress",
                "--metrics-port", str(demo_port), "--disk-path", str(tmp / "lmdb"), "--remote-url", demo_redis.url]
    demo = subprocess.Popen(demo_cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                            stdout=open(logs / "demo.out", "wb"), stderr=open(logs / "demo.err", "wb"))
    prom: subprocess.Popen[bytes] | None = None
    faults: subprocess.Popen[str] | None = None
    down: _DownTarget | None = None
    try:
        demo_url = f"http://127.0.0.1:{demo_port}/metrics"

        def demo_up() -> bool:
            if demo.poll() is not None:
                pytest.fail(f"the demo exited with {demo.returncode} before serving /metrics: "
                            f"{' '.join(demo_cmd)}\n{tails()}")
            return b"tiered_kv_info" in _get(demo_url)

        _wait("the demo's /metrics", demo_up, 60, tails)

        faults = subprocess.Popen([sys.executable, "-c", FAULTS, str(tmp / "faults-lmdb"), str(STALE_BURST),
                                   fault_redis.url],
                                  cwd=REPO, env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=open(logs / "faults.err", "wb"))
        ready = _readline(faults, 60, tails)
        assert ready.startswith("ready "), ready
        fault_instance = f"127.0.0.1:{int(ready.split()[1])}"
        remote_instance = f"127.0.0.1:{int(ready.split()[2])}"
        down = _DownTarget()

        config_dir = tmp / "config"
        config_dir.mkdir()
        config = config_dir / "prometheus.yml"
        config.write_text(_harness_config((DEPLOY / "prometheus.yml").read_text(), f"127.0.0.1:{demo_port}",
                                          [fault_instance, remote_instance, down.instance]))
        shutil.copy(DEPLOY / "alerts.yml", config_dir / "alerts.yml")
        (config_dir / FAST_RULES).write_text(_rules_with_zero_for((DEPLOY / "alerts.yml").read_text()))
        history = tmp / "stale-history.om"
        history.write_text(_stale_history(fault_instance, time.time()))
        r = _promtool("tsdb", "create-blocks-from", "openmetrics", str(history), str(tmp / "tsdb"))
        assert r.returncode == 0, r.stdout + r.stderr

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
        st = Stack(demo, prom, demo_url, prom_url, b"", config, logs, f"127.0.0.1:{demo_port}", faults,
                   fault_instance, down, remote_instance, fault_redis)

        def scraped() -> bool:
            ok, res = st.query(f'count_over_time(up{{job="{JOB}"}}[1m])')
            up_ok, up = st.query(f'up{{job="{JOB}"}}')
            return (ok and up_ok and bool(res) and float(res[0]["value"][1]) >= MIN_SCRAPES
                    and bool(up) and up[0]["value"][1] == "1")

        _wait(f"{MIN_SCRAPES} successful scrapes of the demo", scraped, 45, tails)

        def faults_scraped() -> bool:       # both up, twice at least: increase() sees the faults' counts rise
            ok, res = st.query(f'sum_over_time(up{{job="{FAULT_JOB}"}}[1m]) >= 2')
            return ok and {s["metric"]["instance"] for s in res} == {fault_instance, remote_instance, down.instance}

        _wait(f"2 successful scrapes of each {FAULT_JOB} target", faults_scraped, 30, tails)

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
        if faults is not None:
            if faults.stdin is not None:
                faults.stdin.close()
            try:
                faults.wait(30)
            except subprocess.TimeoutExpired:
                faults.kill()
                faults.wait(10)
        if down is not None:
            down.go_down()
        _stop(demo, signal.SIGINT, 15)
        for s in servers:
            s.terminate()


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


def test_remote_row_shows_the_demo_traffic(stack: Stack) -> None:
    """The demo writes the blocks it stores to its redis-server too: the remote row's write throughput
    is not flat for it, and its remote tier is healthy."""
    dash = load_dashboard(DASHBOARDS[0])
    (panel,) = [p for p in row_panels(dash, REMOTE_ROW) if p["title"] == "Remote throughput"]
    (expr,) = [t["expr"] for t in panel["targets"] if 'dst="remote"' in t["expr"]]
    expr = substitute(expr, dash).replace('job=~".*"', f'job="{JOB}"')
    assert f'job="{JOB}"' in expr, expr

    def moving() -> bool:
        ok, res = stack.query(expr)
        return ok and any(float(s["value"][1]) > 0 for s in res)

    _wait(f"a non-zero rate of {expr}", moving, 20, stack.diagnostics)
    ok, res = stack.query(f'tiered_kv_healthy{{job="{JOB}", tier="remote"}}')
    assert ok and [s["value"][1] for s in res] == ["1"], res


# ----------------------------------------------------------------------------- alert rules
def _alert_names() -> set[str]:
    return set(re.findall(r"(?m)^\s*- alert: (\w+)\s*$", (DEPLOY / "alerts.yml").read_text()))


def _groups(stack: Stack, rules_file: str) -> list[dict[str, Any]]:
    """The rule groups Prometheus loaded from ``rules_file`` (alerts.yml: deploy/'s, FAST_RULES: the copy)."""
    groups = [g for g in stack.api("/api/v1/rules")["data"]["groups"] if Path(g["file"]).name == rules_file]
    assert groups, f"no rule group from {rules_file}"
    return groups


def test_every_alert_rule_evaluates_and_its_signal_returns_series(stack: Stack) -> None:
    rules = {r["name"]: r for g in _groups(stack, "alerts.yml") for r in g["rules"] if r["type"] == "alerting"}
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


def _alerts(stack: Stack, rules_file: str) -> dict[tuple[str, str, tuple[tuple[str, str], ...]], str]:
    """Every active alert of the rules of ``rules_file``: (alertname, instance, the labels its
    expression groups by besides job and instance) -> "pending" | "firing".  A rule without an
    entry for an instance is inactive for it."""
    out: dict[tuple[str, str, tuple[tuple[str, str], ...]], str] = {}
    for g in _groups(stack, rules_file):
        for rule in g["rules"]:
            assert rule["type"] == "alerting" and rule["health"] == "ok", rule
            for a in rule.get("alerts", []):
                labels = a["labels"]
                assert labels["alertname"] == rule["name"]
                assert labels["job"] in (JOB, FAULT_JOB), labels
                extra = tuple(sorted((k, v) for k, v in labels.items() if k not in HARNESS_LABELS))
                key = (labels["alertname"], labels["instance"], extra)
                assert key not in out, f"two alerts {key}"
                out[key] = a["state"]
    return out


def _last_evaluation(stack: Stack) -> float:
    """The oldest ``lastEvaluation`` (unix time) of the harness's two rule groups."""
    stamps = []
    for g in _groups(stack, "alerts.yml") + _groups(stack, FAST_RULES):
        m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", g["lastEvaluation"])
        assert m, g["lastEvaluation"]
        dt = datetime.datetime.fromisoformat(m.group(1) + ("+00:00" if m.group(3) == "Z" else m.group(3)))
        stamps.append(dt.timestamp() + float("0." + (m.group(2) or "0")))
    return min(stamps)


def _for_seconds() -> dict[str, float]:
    """alertname -> its ``for:`` in deploy/alerts.yml, in seconds (0 without one)."""
    units = {"s": 1, "m": 60, "h": 3600}
    out = {}
    for g in yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"]:
        for r in g["rules"]:
            m = re.fullmatch(r"(\d+)([smh])", str(r.get("for", "0s")))
            assert m, r.get("for")
            out[r["alert"]] = int(m.group(1)) * units[m.group(2)]
    return out


def _expected_alerts(stack: Stack, firing_after: dict[str, float]) -> dict[tuple[str, str, tuple[tuple[str, str], ...]], str]:
    """What must be active once the FAULTS process has run and the third target is down:
    pending while the rule's ``for:`` (``firing_after``) has not elapsed, firing once it has --
    the checks run within seconds of the faults, far below the shortest ``for:`` (1 minute).

    * a burst of STALE_BURST stale callbacks: rate[5m] >= STALE_BURST / 300 s = 20/s, above the
      threshold 10 + 3 * (1/15)/s the backfilled hour gives (:func:`_stale_history`);
    * spills shed while the writer was held with a full queue (backpressure), then after it died
      (disk_down);
    * disk errors: the failed commit (io_error), the writer's death (writer_died);
    * one corrupt block, found by the checksum of its read;
    * the disk tier unhealthy (its writer is dead);
    * the remote manager's tier degraded (its server was killed, its breaker is open), and its
      remote errors (connection: 16 write parts in each of the 3 failed round trips) above 0.01/s
      over 5 minutes;
    * the target that went down."""
    f, d = stack.fault_instance, stack.down.instance if stack.down else ""
    r = stack.remote_instance
    keys = [("TieredKVStaleCallbackSpike", f, ()),
            ("TieredKVSpillsShed", f, (("reason", "backpressure"),)),
            ("TieredKVSpillsShed", f, (("reason", "disk_down"),)),
            ("TieredKVDiskErrors", f, (("error", "io_error"),)),
            ("TieredKVDiskErrors", f, (("error", "writer_died"),)),
            ("TieredKVCorruptBlocks", f, (("reason", "checksum"),)),
            ("TieredKVTierUnhealthy", f, (("tier", "disk"),)),
            ("TieredKVRemoteTierDegraded", r, ()),
            ("TieredKVRemoteErrors", r, (("error", "connection"),)),
            ("TieredKVTargetDown", d, ())]
    assert {k[0] for k in keys} == _alert_names(), "an alert rule the faults do not drive"
    return {k: ("firing" if firing_after[k[0]] == 0 else "pending") for k in keys}


def test_alert_states_follow_the_faults(stack: Stack) -> None:
    """Every rule inactive for every instance while nothing is wrong; then, after the faults, exactly
    the expected alerts: deploy/alerts.yml's pending (a ``for:``) or firing (none), the for-0s copy's
    all firing -- and none for the healthy demo in either."""
    for_s = _for_seconds()
    # the premise of "pending" below: no `for:` elapses within the seconds the checks take (today
    # six rules wait 1 to 15 minutes, two have none)
    assert all(v == 0 or v >= 60 for v in for_s.values()), for_s
    assert sum(v > 0 for v in for_s.values()) >= 1, "no rule with a for: -- the for-0s copy checks nothing"
    assert stack.faults is not None and stack.faults.stdin is not None and stack.down is not None
    # 1. nothing wrong: wait for an evaluation of both groups after the FAULTS targets were scraped
    #    twice (the fixture waited for that), then every rule is inactive for every instance
    t0 = time.time()
    _wait("a rule evaluation after the FAULTS targets were scraped", lambda: _last_evaluation(stack) > t0, 20,
          stack.diagnostics)
    for rules_file in ("alerts.yml", FAST_RULES):
        active = _alerts(stack, rules_file)
        assert active == {}, f"{rules_file}: active while nothing is wrong: {active}\n{stack.diagnostics()}"

    # 2. the faults, each counted where the alerts look for it (the FAULTS process reads its registries);
    #    the remote manager's server dies first
    assert stack.remote_redis is not None
    stack.remote_redis.stop()
    stack.faults.stdin.write("faults\n")
    stack.faults.stdin.flush()
    done = _readline(stack.faults, 120, stack.diagnostics)
    assert done.startswith("done "), done
    counts = json.loads(done[len("done "):])
    assert counts["stale"] == STALE_BURST, counts
    assert counts["disk_errors"] == {"io_error": 1, "writer_died": 1}, counts
    assert counts["spills_shed"] == {"backpressure": 6, "disk_down": 3}, counts
    assert counts["corrupt"] == {"checksum": 1}, counts
    assert counts["healthy"] == {"device": 1, "host": 1, "disk": 0}, counts
    assert counts["remote_healthy"] == {"device": 1, "host": 1, "remote": 0}, counts
    remote_errors = dict(counts["remote_errors"])
    assert remote_errors.pop("breaker_open") == 1 and set(remote_errors) == {"connection"}, counts
    assert remote_errors["connection"] >= 30, f"too few to be sure of a rate above 0.01/s over 5m: {counts}"
    stack.down.go_down()

    # 3. the alerts: deploy/alerts.yml's rules pending or firing by their for:, the copy's all firing
    want_real = _expected_alerts(stack, for_s)
    want_fast = _expected_alerts(stack, dict.fromkeys(for_s, 0))
    seen: dict[str, Any] = {}

    def settled() -> bool:
        seen["real"], seen["fast"] = _alerts(stack, "alerts.yml"), _alerts(stack, FAST_RULES)
        return seen["real"] == want_real and seen["fast"] == want_fast

    deadline = time.monotonic() + 60
    while not settled() and time.monotonic() < deadline:
        time.sleep(0.25)
    for name, want in (("real", want_real), ("fast", want_fast)):
        got = seen[name]
        diff = {k: (got.get(k, "inactive"), want.get(k, "inactive")) for k in set(got) | set(want)
                if got.get(k) != want.get(k)}
        assert not diff, (f"{name} rules: alert states (got, want) differ after 60 s: {diff}\n"
                          f"{stack.diagnostics()}")


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
