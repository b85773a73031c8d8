"""Static checks of grafana/ and deploy/ (no server needed).

The dashboard: no hard-coded datasource uid (a ``datasource`` template
variable instead), a unit on every panel, ``$__rate_interval`` in every
rate, the panels issue 4 asks for, the remote tier's row, and only metric
names tiered_kv exports.  deploy/: the provisioning, compose file and
Kubernetes example agree with each other and with the CLI (the demo's remote
tier included: a Redis/Valkey service, no password in any url).  Running every query against a real Prometheus
is tests/test_prometheus_e2e.py's job; the helpers here are shared with it.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

REPO = Path(__file__).resolve().parents[1]
GRAFANA = REPO / "grafana"
DEPLOY = REPO / "deploy"
DASHBOARDS = sorted(GRAFANA.glob("*.json"))

# Values the tests give Grafana's variables (Grafana itself would compute them)
TEST_RATE_INTERVAL = "10s"
TEST_RANGE = "1m"
_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
_METRIC = re.compile(r"\btiered_kv_[a-z0-9_]+\b")
REMOTE_ROW = "Remote tier (Redis/Valkey)"   # the dashboard's row of the remote tier
_RANGE_FUNCS = re.compile(r"\b(rate|irate|increase|delta|idelta|deriv|changes|resets|[a-z]+_over_time)\s*\(")


# ----------------------------------------------------------------------------- helpers (also used by the e2e test)
def load_dashboard(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def iter_panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those inside (collapsed) rows."""
    for p in dash.get("panels", []):
        yield p
        yield from p.get("panels", [])


def panel_queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """``(panel title / refId, raw expr)`` for every query of every panel."""
    out = []
    for p in iter_panels(dash):
        for t in p.get("targets", []):
            if t.get("expr"):
                out.append((f"{p['title']} / {t.get('refId', '?')}", t["expr"]))
    return out


def row_panels(dash: dict[str, Any], title: str) -> list[dict[str, Any]]:
    """The panels under the row ``title`` (an expanded row: those below it, up to the next row)."""
    top = dash["panels"]
    (i,) = [n for n, p in enumerate(top) if p["type"] == "row" and p["title"] == title]
    if top[i].get("collapsed"):
        return list(top[i]["panels"])
    out = []
    for p in top[i + 1:]:
        if p["type"] == "row":
            break
        out.append(p)
    return out


def template_vars(dash: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dash.get("templating", {}).get("list", [])}


def substitute(expr: str, dash: dict[str, Any]) -> str:
    """The expression as Grafana would send it with every multi-value variable on "All"."""
    tvars = template_vars(dash)

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name == "__rate_interval":
            return TEST_RATE_INTERVAL
        if name == "__range":
            return TEST_RANGE
        v = tvars.get(name)
        if v is None:
            raise AssertionError(f"unknown variable ${name} in {expr!r}")
        if v["type"] == "query":
            return str(v.get("allValue") or ".*")
        raise AssertionError(f"variable ${name} of type {v['type']} used in a query: {expr!r}")

    return _VAR.sub(repl, expr)


def variable_queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """``label_values(expr, label)`` of each query variable as a plain PromQL expression."""
    out = []
    for v in template_vars(dash).values():
        if v["type"] != "query":
            continue
        q = v.get("definition") or (v["query"]["query"] if isinstance(v["query"], dict) else v["query"])
        m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\)\s*", q)
        assert m, f"variable {v['name']}: only label_values(expr, label) is supported, got {q!r}"
        out.append((f"variable {v['name']}", f"count by ({m.group(2)}) ({substitute(m.group(1), dash)})"))
    return out


def matching_paren(s: str, open_idx: int) -> int:
    depth = 0
    for i in range(open_idx, len(s)):
        if s[i] == "(":
            depth += 1
        elif s[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise AssertionError(f"unbalanced parentheses in {s!r}")


def range_selectors(expr: str) -> list[tuple[str, str]]:
    """``(function, range)`` for each range-vector function call in ``expr``."""
    out = []
    for m in _RANGE_FUNCS.finditer(expr):
        end = matching_paren(expr, m.end() - 1)
        for r in re.findall(r"\[([^\]]+)\]", expr[m.end():end]):
            out.append((m.group(1), r.split(":")[0].strip()))
    return out


def split_comparison(expr: str) -> tuple[str, str, str]:
    """Split ``lhs OP rhs`` at its one top-level comparison operator (outside (), [], {} and strings)."""
    depth, i, found = 0, 0, []
    quote = ""
    while i < len(expr):
        c = expr[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"'`":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            two = expr[i:i + 2]
            if two in ("==", "!=", ">=", "<="):
                found.append((i, two))
                i += 1
            elif c in "<>":
                found.append((i, c))
        i += 1
    assert len(found) == 1, f"expected one top-level comparison in {expr!r}, found {[op for _, op in found]}"
    pos, op = found[0]
    rhs = expr[pos + len(op):].strip()
    if rhs.startswith("bool "):
        rhs = rhs[5:]
    return expr[:pos].strip(), op, rhs.strip()


def exported_metric_names() -> set[str]:
    """Every sample name tiered_kv's Metrics can export (also labelled ones not incremented yet)."""
    from tiered_kv.metrics import Metrics

    reg = CollectorRegistry()
    m = Metrics(reg, namespace="names")
    m.enable_disk_health(True)
    m.enable_remote_health(True)
    names: set[str] = set()
    for fam in reg.collect():
        if fam.type == "counter":
            names |= {fam.name + "_total", fam.name + "_created"}
        elif fam.type == "histogram":
            names |= {fam.name + s for s in ("_bucket", "_count", "_sum", "_created")}
        else:
            names.add(fam.name)
    return names


# ----------------------------------------------------------------------------- the dashboard
def test_there_is_a_dashboard() -> None:
    assert [p.name for p in DASHBOARDS] == ["tiered_kv.json"]


@pytest.fixture(params=DASHBOARDS, ids=lambda p: p.name)
def dash(request: pytest.FixtureRequest) -> dict[str, Any]:
    return load_dashboard(request.param)


def _walk(node: Any, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield f"{path}.{k}", k, v
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")


def test_no_hard_coded_datasource_uid(dash: dict[str, Any]) -> None:
    tvars = template_vars(dash)
    ds_vars = {n for n, v in tvars.items() if v["type"] == "datasource"}
    assert ds_vars, "no datasource template variable"
    for n in ds_vars:
        assert tvars[n]["query"] == "prometheus"
        assert not tvars[n].get("current"), "the datasource variable must not pin a current datasource"
    refs = 0
    for path, key, value in _walk(dash):
        if key == "datasource":
            uid = value.get("uid") if isinstance(value, dict) else value
            if isinstance(value, dict):
                assert value.get("type") == "prometheus", f"{path}: {value!r}"
            m = re.fullmatch(r"\$\{(\w+)\}|\$(\w+)", str(uid))
            assert m and (m.group(1) or m.group(2)) in ds_vars, f"{path}: hard-coded datasource {value!r}"
            refs += 1
        elif key == "uid":
            assert path in (".uid",) or path.endswith(".datasource.uid"), f"{path}: unexpected uid {value!r}"
    assert "__inputs" not in dash and "__requires" not in dash
    assert refs >= len(panel_queries(dash))


def test_every_panel_has_a_unit(dash: dict[str, Any]) -> None:
    for p in iter_panels(dash):
        if p["type"] == "row":
            continue
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit")
        assert unit, f"panel {p['title']!r} has no unit"
        assert p.get("targets"), f"panel {p['title']!r} has no query"


def test_every_rate_uses_rate_interval(dash: dict[str, Any]) -> None:
    seen = 0
    for where, expr in panel_queries(dash):
        for func, rng in range_selectors(expr):
            seen += 1
            if func in ("rate", "irate"):
                assert rng == "$__rate_interval", f"{where}: {func}() over [{rng}] in {expr!r}"
            else:  # increase() over the dashboard's range is allowed in stat panels
                assert rng in ("$__rate_interval", "$__range"), f"{where}: {func}() over [{rng}] in {expr!r}"
    assert seen >= 10


def test_queries_use_known_metrics_and_variables(dash: dict[str, Any]) -> None:
    known = exported_metric_names()
    for where, expr in panel_queries(dash) + variable_queries(dash):
        substitute(expr, dash)  # no unknown variable
        for name in _METRIC.findall(expr):
            assert name in known, f"{where}: {name} is not exported by tiered_kv.metrics"
        if "tiered_kv_" in expr and "job=~" not in expr and not where.startswith("variable"):
            pytest.fail(f"{where}: query does not filter on $job/$instance: {expr!r}")


def test_issue_panels_present(dash: dict[str, Any]) -> None:
    panels = [p for p in iter_panels(dash) if p["type"] != "row"]
    exprs = " ".join(e for _, e in panel_queries(dash))
    # the headline panel: stale callbacks per second by reason, at the top left
    head = min(panels, key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    assert "stale callbacks" in head["title"].lower()
    assert re.search(r"sum by \(reason\) \(rate\(tiered_kv_stale_callbacks_total\{", head["targets"][0]["expr"])
    assert head["fieldConfig"]["defaults"]["unit"] in ("cps", "ops", "reqps")
    for needle in ("tiered_kv_orphaned_writes_prevented_total", "tiered_kv_orphaned_writes_purged_total",
                   "tiered_kv_jobs_total", "tiered_kv_tier_used_bytes", "tiered_kv_tier_capacity_bytes",
                   "tiered_kv_lookup_hits_total", "tiered_kv_lookup_keys_total", "tiered_kv_transfer_bytes_total",
                   "histogram_quantile(0.5, sum by (le, src, dst) (rate(tiered_kv_transfer_seconds_bucket",
                   "histogram_quantile(0.99, sum by (le, src, dst) (rate(tiered_kv_transfer_seconds_bucket",
                   "tiered_kv_writer_queue_blocks", "tiered_kv_shed_total", "tiered_kv_corrupt_blocks_total",
                   "tiered_kv_errors_total", "tiered_kv_healthy"):
        assert needle in exprs, f"no panel queries {needle}"
    units = {p["title"]: p["fieldConfig"]["defaults"]["unit"] for p in panels}
    assert units["Throughput per link"] == "Bps"
    assert units["Transfer latency p50 / p99 per link"] == "s"
    assert units["Tier occupancy"] == units["Prefix hit rate by tier"] == "percentunit"


def test_remote_tier_row(dash: dict[str, Any]) -> None:
    panels = row_panels(dash, REMOTE_ROW)
    row_y = next(p["gridPos"]["y"] for p in dash["panels"] if p.get("title") == REMOTE_ROW)
    assert panels and all(p["gridPos"]["y"] > row_y for p in panels)
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in panels}
    units = {p["title"]: p["fieldConfig"]["defaults"]["unit"] for p in panels}
    everything = " ".join(exprs.values())
    sel = 'job=~"$job", instance=~"$instance"'
    for needle in (
            # hit rate: remote hits / lookup keys, beside host and disk
            f'tiered_kv_lookup_hits_total{{{sel}, tier="remote"}}', 'tier=~"host|disk"', "tiered_kv_lookup_keys_total",
            # bytes both ways, latency p50/p99 from the histogram of the same links
            f'tiered_kv_transfer_bytes_total{{{sel}, src="host", dst="remote"}}',
            f'tiered_kv_transfer_bytes_total{{{sel}, src="remote", dst="host"}}',
            "histogram_quantile(0.5, sum by (le, src, dst) (rate(tiered_kv_transfer_seconds_bucket",
            "histogram_quantile(0.99, sum by (le, src, dst) (rate(tiered_kv_transfer_seconds_bucket",
            # errors by kind, refused writes by reason, stale put/fetch callbacks, corrupt values
            f'sum by (error) (rate(tiered_kv_errors_total{{{sel}, tier="remote"}}',
            "sum by (reason) (rate(tiered_kv_remote_refused_writes_total",
            f'tiered_kv_stale_callbacks_total{{{sel}, kind=~"put|fetch"}}',
            "tiered_kv_remote_corrupt_values_total",
            # the jobs and their shedding, the queue, the health
            f'tiered_kv_jobs_total{{{sel}, kind=~"put|fetch"}}', f'tiered_kv_shed_total{{{sel}, kind="put"}}',
            "tiered_kv_remote_queue_blocks", f'tiered_kv_healthy{{{sel}, tier="remote"}}'):
        assert needle in everything, f"no panel of the remote row queries {needle}"
    assert units["Remote hit rate"] == "percentunit"
    assert units["Remote throughput"] == "Bps"
    assert units["Remote latency p50 / p99"] == "s"
    assert units["Remote tier health"] == "bool_yes_no"
    assert units["Remote errors /s by kind"] == units["Remote refused writes and stale callbacks /s"] == "ops"
    # every remote-only metric is shown in this row, and only here
    remote_only = {"tiered_kv_remote_refused_writes_total", "tiered_kv_remote_corrupt_values_total",
                   "tiered_kv_remote_queue_blocks"}
    assert remote_only <= set(_METRIC.findall(everything))
    outside = " ".join(e for w, e in panel_queries(dash) if w.split(" / ")[0] not in exprs)
    assert not remote_only & set(_METRIC.findall(outside))


def test_layout(dash: dict[str, Any]) -> None:
    ids = [p["id"] for p in iter_panels(dash)]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for p in iter_panels(dash):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]


def test_helpers() -> None:
    assert split_comparison('sum(rate(x{a=">"}[5m])) > 10 + 3 * y') == ('sum(rate(x{a=">"}[5m]))', ">", "10 + 3 * y")
    assert split_comparison("min by (t) (h) == 0") == ("min by (t) (h)", "==", "0")
    with pytest.raises(AssertionError):
        split_comparison("a > b < c")
    assert range_selectors("sum(rate(a[5m])) / sum(increase(b[$__range]))") == [("rate", "5m"), ("increase", "$__range")]


# ----------------------------------------------------------------------------- provisioning and deploy/
try:
    import yaml
except ImportError:  # pragma: no cover - PyYAML is in the test extra
    yaml = None

needs_yaml = pytest.mark.skipif(yaml is None, reason="PyYAML is needed to parse the YAML under grafana/ and deploy/")


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _compose() -> dict[str, Any]:
    return _yaml(DEPLOY / "docker-compose.yml")


def _container_path(volume: str) -> tuple[str, str]:
    src, dst = volume.split(":")[:2]
    return src, dst


@needs_yaml
def test_grafana_provisioning_matches_compose_and_prometheus() -> None:
    compose = _compose()
    ds = _yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True
    prom_port = compose["services"]["prometheus"]["ports"][0].rsplit(":", 1)[1]
    assert source["url"] == f"http://prometheus:{prom_port}"
    prom = _yaml(DEPLOY / "prometheus.yml")
    assert source["jsonData"]["timeInterval"] == prom["global"]["scrape_interval"]

    prov = _yaml(GRAFANA / "provisioning" / "dashboards" / "tiered_kv.yml")
    (provider,) = prov["providers"]
    mounts = dict(_container_path(v) for v in compose["services"]["grafana"]["volumes"])
    by_dst = {dst: src for src, dst in mounts.items()}
    assert (DEPLOY / by_dst[provider["options"]["path"]]).resolve() == GRAFANA
    assert (DEPLOY / by_dst["/etc/grafana/provisioning"]).resolve() == GRAFANA / "provisioning"
    home = compose["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == provider["options"]["path"] + "/" + DASHBOARDS[0].name


def _parse_demo_args(args: list[str]) -> Any:
    from tiered_kv.tools.cli import _parser

    ns = _parser().parse_args(args)
    assert ns.cmd == "demo"
    return ns


def _remote_args(args: list[str]) -> tuple[list[str], list[str]]:
    """``args`` without ``--remote-url URL``, and those two."""
    i = args.index("--remote-url")
    return args[:i] + args[i + 2:], args[i:i + 2]


def _check_cache_server(argv: list[str]) -> None:
    """A Redis/Valkey server run as a cache: a memory bound, LRU eviction, no persistence.
    ``argv``: the server's, or ``sh -c SCRIPT`` (the script is split as the shell would)."""
    if argv[:2] == ["sh", "-c"]:
        argv = shlex.split(" ".join(argv[2:]))
    opts = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
    assert opts.get("--maxmemory") and opts.get("--maxmemory-policy") == "allkeys-lru", argv
    assert opts.get("--save") == "" and opts.get("--appendonly") == "no", argv


@needs_yaml
def test_compose_file() -> None:
    compose = _compose()
    services = compose["services"]
    assert set(services) == {"demo", "redis", "prometheus", "grafana"}
    demo = services["demo"]
    assert (DEPLOY / demo["build"]["context"] / demo["build"]["dockerfile"]).is_file()
    ns = _parse_demo_args(demo["command"])
    assert ns.metrics_addr == "0.0.0.0" and ns.metrics_port is not None
    # the remote tier: the redis service, on its default port, without a password in the url
    assert ns.remote_url == "redis://redis:6379/0"
    assert "redis" in demo["depends_on"]
    redis = services["redis"]
    assert re.fullmatch(r"(valkey/valkey:8|redis:7)(\.[\d.]+)?(-\w+)?", redis["image"]), redis["image"]
    assert redis["command"][0] in ("valkey-server", "redis-server")
    _check_cache_server(redis["command"])
    assert "ports" not in redis, "the cache needs no port on the host"
    prom = _yaml(DEPLOY / "prometheus.yml")
    (job,) = prom["scrape_configs"]
    assert job["static_configs"][0]["targets"] == [f"demo:{ns.metrics_port}"]
    for src, dst in (_container_path(v) for v in services["prometheus"]["volumes"]):
        if src.startswith("."):
            assert (DEPLOY / src).exists(), src
            if dst.startswith("/etc/prometheus/"):
                assert Path(dst).name in ("prometheus.yml", *prom["rule_files"])
    # the image's default command is the compose command without the remote tier (it needs no server)
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    cmd = json.loads(re.search(r"^CMD (\[.*?\])", dockerfile, re.M | re.S).group(1).replace("\\\n", ""))  # type: ignore[union-attr]
    assert cmd == _remote_args(demo["command"])[0]
    assert _parse_demo_args(cmd).remote_url is None
    # ... and the image has the redis client the remote tier needs
    assert re.search(r"^RUN pip install [^\n]*(\"redis[>=]|\.\[[^\]]*remote)", dockerfile, re.M), "no redis in the image"
    assert f"EXPOSE {ns.metrics_port}" in dockerfile


def test_compose_config_with_docker_if_available() -> None:
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no `docker compose` client here; test_compose_file parses the file instead")
    r = subprocess.run([docker, "compose", "-f", str(DEPLOY / "docker-compose.yml"), "config", "-q"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


REDIS_K8S = "tiered-kv-redis"   # deploy/k8s/redis.yaml's Deployment and Service


def _k8s() -> dict[str, dict[str, Any]]:
    """kind -> the demo's document of that kind; the remote tier's (``REDIS_K8S``) under "redis " + kind."""
    docs: dict[str, dict[str, Any]] = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            key = doc["kind"]
            if doc.get("metadata", {}).get("name") == REDIS_K8S:
                key = "redis " + key
            assert key not in docs, f"two {key} documents under deploy/k8s"
            docs[key] = doc
    return docs


@needs_yaml
def test_kubernetes_example() -> None:
    k = _k8s()
    assert {"Deployment", "Service", "ServiceMonitor", "PrometheusRule", "Kustomization"} <= set(k)
    dep, svc, mon = k["Deployment"], k["Service"], k["ServiceMonitor"]
    pod = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    ns = _parse_demo_args(container["args"])
    assert ns.metrics_addr == "0.0.0.0"
    (cport,) = container["ports"]
    assert cport["containerPort"] == ns.metrics_port
    # Service: selects the pod, exposes the named port, carries the scrape annotations
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (sport,) = svc["spec"]["ports"]
    assert sport["targetPort"] == cport["name"] and sport["name"] == "metrics"
    ann = svc["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/port"] == str(ns.metrics_port) and ann["prometheus.io/path"] == "/metrics"
    # ServiceMonitor: selects the Service by label, scrapes its named port
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert mon["spec"]["endpoints"][0]["port"] == sport["name"]
    # PrometheusRule: the same groups as deploy/alerts.yml
    assert k["PrometheusRule"]["spec"]["groups"] == _yaml(DEPLOY / "alerts.yml")["groups"]
    listed = set(k["Kustomization"]["resources"])
    assert listed == {p.name for p in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}


@needs_yaml
def test_kubernetes_remote_tier() -> None:
    """The demo's remote tier: redis.yaml's Service, its url in the demo's args, the password from a Secret."""
    k = _k8s()
    rdep, rsvc = k["redis Deployment"], k["redis Service"]
    pod = rdep["spec"]["template"]
    assert rdep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert rsvc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert re.fullmatch(r"(valkey/valkey:8|redis:7)(\.[\d.]+)?(-\w+)?", container["image"]), container["image"]
    _check_cache_server(container.get("command", []) + container.get("args", []))
    (cport,) = container["ports"]
    (sport,) = rsvc["spec"]["ports"]
    assert sport["targetPort"] == cport["name"]
    limit = container["resources"]["limits"]["memory"]
    assert limit.endswith("Mi") and int(limit[:-2]) > 1024, "the memory limit must exceed --maxmemory 1gb"
    # the demo points at the Service; the password comes from a Secret, never from the url
    (demo,) = k["Deployment"]["spec"]["template"]["spec"]["containers"]
    ns = _parse_demo_args(demo["args"])
    assert ns.remote_url == f"redis://{rsvc['metadata']['name']}:{sport['port']}/0"
    env = {e["name"]: e for e in demo.get("env", [])}
    assert "secretKeyRef" in env["TIERED_KV_REMOTE_PASSWORD"]["valueFrom"]


@needs_yaml
def test_no_password_in_any_url_under_deploy() -> None:
    from tiered_kv.remote.url import redact_url

    for path in sorted(DEPLOY.rglob("*")):
        if path.is_file():
            for url in re.findall(r"\b(?:redis|rediss|valkey)(?:\+cluster)?://[^\s\"',\]]+", path.read_text()):
                assert redact_url(url) == url, f"{path}: a password in {redact_url(url)}"


@needs_yaml
def test_alert_rules_shape() -> None:
    rules = [r for g in _yaml(DEPLOY / "alerts.yml")["groups"] for r in g["rules"]]
    names = {r["alert"] for r in rules}
    assert {"TieredKVStaleCallbackSpike", "TieredKVSpillsShed", "TieredKVDiskErrors", "TieredKVTierUnhealthy",
            "TieredKVRemoteTierDegraded", "TieredKVRemoteErrors"} <= names
    known = exported_metric_names()
    for r in rules:
        lhs, _, _ = split_comparison(r["expr"])  # one top-level threshold comparison each
        assert lhs
        assert r["labels"]["severity"] in ("info", "warning", "critical")
        assert r["annotations"]["summary"] and r["annotations"]["description"]
        for name in _METRIC.findall(r["expr"]):
            assert name in known, f"{r['alert']}: {name} is not exported by tiered_kv.metrics"


@needs_yaml
def test_prometheus_config_shape() -> None:
    prom = _yaml(DEPLOY / "prometheus.yml")
    assert prom["rule_files"] == ["alerts.yml"]
    (job,) = prom["scrape_configs"]
    assert job["job_name"] == "tiered-kv"
    # TieredKVTargetDown matches this job (and the Kubernetes Service name, the job label there)
    m = re.search(r'up\{job=~"([^"]+)"\}', (DEPLOY / "alerts.yml").read_text())
    assert m and re.fullmatch(m.group(1), job["job_name"]) and re.fullmatch(m.group(1), "tiered-kv-demo")
    text = (DEPLOY / "prometheus.yml").read_text()
    # the e2e test rewrites these by text: keep them on one line each
    assert len(re.findall(r"^\s*scrape_interval: \S+", text, re.M)) == 1
    assert len(re.findall(r"^\s*evaluation_interval: \S+", text, re.M)) == 1
    assert len(re.findall(r"^\s*- targets: \[[^\]]*\]$", text, re.M)) == 1
