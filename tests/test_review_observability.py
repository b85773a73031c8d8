"""Second adversarial review of observability: tiered_kv/metrics.py, tiered_kv/exposition.py,
grafana/tiered_kv.json, deploy/alerts.yml (+ deploy/k8s/prometheusrule.yaml) and docs/observability.md.

What it proved wrong, each pinned by a test that failed before its fix: the docs said a closed manager
takes its metrics off the registry (it keeps its final counts); the device tier's used bytes and blocks
were exported and never set (the occupancy panels showed it empty for ever); the copy-time histogram's
smallest bucket (25 us) could not resolve a batched copy's few microseconds per block; corruption that
recovery found at open never raised TieredKVCorruptBlocks on a target first scraped after it; no code
counted errors_total{tier="remote",error="corrupt"}; a block the remote tier fetched counted as two
lookup hits (remote, then host); a refused probe counted one shed fetch whatever its keys; the docs'
alert table left out two rules and quoted an old expression.  The plain tests pin behaviours checked to
be right, each one written so that it fails if the behaviour breaks.
Where PromQL semantics matter, the rules are evaluated by ``promtool test rules`` on series taken from a
real manager's registry (skipped without promtool; CI installs it with ci/install_prometheus.sh).
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from disk_helpers import disk_config, flip, keys, make_kv, rewrite_value, store_seq
from fakes import fill_row, make_config, make_fake_manager, sample
from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.jobs import JobKind
from tiered_kv.metrics import Metrics

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "observability.md"
ALERTS = REPO / "deploy" / "alerts.yml"
DASHBOARD = REPO / "grafana" / "tiered_kv.json"
PKG = REPO / "tiered_kv"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not on PATH (ci/install_prometheus.sh)")

JOB, INSTANCE = "tiered-kv", "node-a:9477"


# ----------------------------------------------------------------------------- helpers
def _rules() -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"]}


def _norm(s: str) -> str:
    return " ".join(s.split())


def _series(reg: CollectorRegistry) -> dict[str, float]:
    """Every sample of ``reg`` (no ``_created``) as a promtool series string, labelled with a job and instance
    the way Prometheus labels a scrape."""
    out = {}
    for fam in reg.collect():
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            labels = dict(s.labels, job=JOB, instance=INSTANCE)
            body = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            out[f"{s.name}{{{body}}}"] = float(s.value)
    return out


def _promtool_test(tmp_path: Path, input_series: list[dict[str, str]],
                   alert_tests: list[dict[str, Any]]) -> subprocess.CompletedProcess:
    """``promtool test rules`` of deploy/alerts.yml's rules as shipped, less their annotations (promtool
    compares those too; what is tested here is each rule's expression, ``for:`` and labels)."""
    doc = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    for g in doc["groups"]:
        for r in g["rules"]:
            r.pop("annotations", None)
    rules = tmp_path / "alerts_no_annotations.yml"
    rules.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    spec = {"rule_files": [str(rules)], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": input_series, "alert_rule_test": alert_tests}]}
    path = tmp_path / "promtool_test.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)


def _prom_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile over cumulative ``(le, count)`` buckets (promql/quantile.go:
    linear interpolation inside the bucket holding the rank, the first bucket starting at 0)."""
    buckets = sorted(buckets)
    total = buckets[-1][1]
    rank = q * total
    i = next(i for i, (_, c) in enumerate(buckets) if c >= rank)
    if i == len(buckets) - 1:
        return buckets[-2][0]
    start, prev = (0.0, 0.0) if i == 0 else buckets[i - 1]
    end, count = buckets[i]
    return start + (end - start) * (rank - prev) / (count - prev)


def _corrupt_at_open(tmp_path: Path) -> TierManager:
    """A manager opened on an LMDB holding one entry that recovery finds unparseable (a flipped flags byte:
    tests/test_disk_integrity.py's "flags" case), so recovery counts it before the manager is returned."""
    kv = make_kv(8)
    path = tmp_path / "disk"
    cfg = disk_config(path, host_slots=2, row_bytes=int(kv.shape[1]), disk_io="thread")
    mgr = TierManager(cfg, kv, registry=CollectorRegistry())
    ks = keys(3)
    store_seq(mgr, kv, ks)
    mgr.close()
    rewrite_value(path, ks[0], flip(6))
    return TierManager(cfg, kv, registry=CollectorRegistry())


# ============================================================================= defects
def test_docs_describe_what_close_does_to_the_registry(kv):
    """docs/observability.md, "Serving the metrics": a TierManager "takes them off it at close() ...: a
    closed manager exports nothing, and a new one may register on the same registry".  The code
    (manager.close -> Metrics.closed, commit 167c656) keeps every metric on the registry with health 0, and
    a second manager on that registry is refused until ``metrics.close()``.  Whichever is meant, the docs
    and the code must say the same."""
    reg = CollectorRegistry()
    mgr, _ = make_fake_manager(make_config(8), kv, reg)
    mgr.close()
    exported = [f.name for f in reg.collect()]
    text = _norm(DOCS.read_text(encoding="utf-8"))
    promised_empty = "a closed manager exports nothing" in text
    assert not (promised_empty and exported), (
        f"the docs promise an empty registry after close(), it still holds {len(exported)} families")


def test_device_tier_occupancy_is_not_a_constant_zero(kv):
    """metrics.py binds ``used``/``blocks`` for every tier of TIERS (device included) and the manager sets
    ``capacity["device"]`` (manager.py:230), but nothing ever sets ``used["device"]`` or ``blocks["device"]``:
    grafana's "Tier occupancy" (used / capacity by tier) and "Tier used bytes" draw a device line stuck at
    0 beside a full capacity, whatever the engine does with its rows.  Either the series is not exported
    or it moves with the rows in use."""
    reg = CollectorRegistry()
    mgr, mover = make_fake_manager(make_config(16), kv, reg)
    try:
        ks = [b"dev-%d" % i for i in range(8)]
        for i, k in enumerate(ks):
            fill_row(kv, i, k)
        job = mgr.store_many(ks, list(range(8)))
        mover.complete(job)
        mgr.poll()
        load = mgr.load_many(ks[:4], list(range(8, 12)))
        assert load is not None
        mover.complete(load)
        mgr.poll()
        assert sample(reg, "tiered_kv_tier_capacity_bytes", tier="device") > 0
        assert sample(reg, "tiered_kv_tier_used_bytes", tier="host") == 8 * 128
        for name in ("tiered_kv_tier_used_bytes", "tiered_kv_tier_blocks"):
            v = reg.get_sample_value(name, {"tier": "device"})
            assert v is None or v > 0, f"{name}{{tier=\"device\"}} is exported as a constant {v}"
    finally:
        mgr.close()


def test_latency_buckets_resolve_a_device_host_block_copy(kv):
    """tiered_kv_transfer_seconds observes one block's share of a job's copy time (docs).  A store_many of
    64 blocks copied in 100 us (FakeMover's report: 1.56 us a block; the real thread mover on this
    machine's CPU measures 2.3 us a block for 64 KiB rows, and docs/benchmarks.md reports 22-39 GB/s
    copies) puts every sample into the first bucket (le=25e-6).  histogram_quantile, as the dashboard's
    "Transfer latency p50 / p99 per link" panel runs it, then answers 12.5 us for p50 and 24.75 us for
    p99, whatever the real time: 8x and 16x off.  Buckets must reach below a block copy."""
    reg = CollectorRegistry()
    mgr, mover = make_fake_manager(make_config(128), kv, reg)
    try:
        ks = [b"lat-%d" % i for i in range(64)]
        for i, k in enumerate(ks):
            fill_row(kv, i, k)
        job = mgr.store_many(ks, list(range(64)))
        mover.complete(job)
        mgr.poll()
        labels = {"src": "device", "dst": "host"}
        count = sample(reg, "tiered_kv_transfer_seconds_count", **labels)
        per_block = sample(reg, "tiered_kv_transfer_seconds_sum", **labels) / count
        assert count == 64 and per_block == pytest.approx(1e-4 / 64)
        buckets = []
        for fam in reg.collect():
            for s in fam.samples:
                if s.name == "tiered_kv_transfer_seconds_bucket" and s.labels["src"] == "device" \
                        and s.labels["dst"] == "host":
                    buckets.append((float(s.labels["le"]), s.value))
        for q in (0.5, 0.99):
            est = _prom_quantile(q, buckets)
            assert 0.5 <= est / per_block <= 2.0, (
                f"p{int(q * 100)} reads {est * 1e6:.2f} us for blocks that took {per_block * 1e6:.2f} us")
    finally:
        mgr.close()


@needs_promtool
def test_corrupt_entries_found_by_recovery_at_open_raise_the_alert(tmp_path):
    """DiskTier.open -> _export_recovery (core/disk_tier.py) increments
    ``tiered_kv_corrupt_blocks_total{reason="recovery"|"foreign"}`` inside TierManager's constructor, before
    any endpoint can serve it.  A target Prometheus has not scraped before (a new pod, a rescheduled one:
    a new instance label) is first seen with the value N, and ``increase(...[10m]) > 0``
    (TieredKVCorruptBlocks) -- like the dashboard's "Corrupt blocks in range" -- sees no increase: the
    corruption a crash left, found at the restart that recovers from it, never alerts.  Here the real
    manager's exposition at open is the target's first scrape, unchanged for 15 minutes (no new damage)."""
    mgr = _corrupt_at_open(tmp_path)
    try:
        assert mgr.metrics.registry.get_sample_value("tiered_kv_corrupt_blocks_total", {"reason": "recovery"}) == 1
        series = _series(mgr.metrics.registry)
    finally:
        mgr.close()
    inputs = [{"series": s, "values": f"{v:g}x15"} for s, v in series.items()]
    want = {"severity": "warning", "job": JOB, "instance": INSTANCE, "reason": "recovery"}
    r = _promtool_test(tmp_path, inputs, [
        {"eval_time": t, "alertname": "TieredKVCorruptBlocks", "exp_alerts": [{"exp_labels": want}]}
        for t in ("2m", "5m")])
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_corrupt_remote_value_reaches_an_alert(redis_url, redis_server):
    """docs/remote.md and docs/observability.md list ``corrupt`` among tiered_kv_errors_total{tier="remote"}'s
    errors, REMOTE_ERROR_KINDS exports it at 0, and TieredKVRemoteErrors' comment says it covers "corrupt
    values".  But the reader reports a corrupt value only through ``on_corrupt`` (core/remote_tier.py:93,
    tiered_kv_remote_corrupt_values_total), which no alert rule reads: the series stays 0 for ever."""
    ns = "obsrev-corrupt|u8|tp0"
    row = 4096

    def make() -> TierManager:
        cfg = TieredKVConfig(namespace=ns, host_capacity_bytes=8 * row, remote_url=redis_url,
                             remote_miss_ttl_seconds=60.0)
        return TierManager(cfg, make_kv(8, row), registry=CollectorRegistry())

    a = make()
    try:
        job = a.store(b"to-corrupt", 0)
        assert job is not None
        a.wait([job], timeout=15)
        assert a.flush(timeout=15)
    finally:
        a.close()
    client = redis_server.client()
    (name,) = [n for n in client.keys("tkv:*") if n.endswith(b":v")]
    value = bytearray(client.get(name))
    value[-1] ^= 0xFF
    client.set(name, bytes(value))
    b = make()
    try:
        assert b.lookup([b"to-corrupt"]) == 0
        deadline = time.monotonic() + 15
        while b.metrics.registry.get_sample_value("tiered_kv_remote_corrupt_values_total",
                                                  {"reason": "checksum"}) != 1:
            assert time.monotonic() < deadline, "the corrupt value was never read"
            b.poll()
            time.sleep(0.002)
        b.metrics.flush()
        counted = b.metrics.registry.get_sample_value("tiered_kv_errors_total",
                                                      {"tier": "remote", "error": "corrupt"})
    finally:
        b.close()
    watched = any("tiered_kv_remote_corrupt_values_total" in r["expr"] for r in _rules().values())
    assert counted == 1 or watched, (f"errors_total{{tier=remote,error=corrupt}} = {counted}, and no alert "
                                     "reads tiered_kv_remote_corrupt_values_total")


def _remote_manager(url: str, ns: str, **kw: Any) -> TierManager:
    cfg = TieredKVConfig(namespace=ns, host_capacity_bytes=16 * 4096, remote_url=url,
                         remote_miss_ttl_seconds=0.0, **kw)
    return TierManager(cfg, make_kv(8, 4096), registry=CollectorRegistry())


def _settle_remote(mgr: TierManager) -> None:
    deadline = time.monotonic() + 15
    while mgr._core.n_in_flight[JobKind.FETCH] or mgr._core.remote.want_token is not None:
        assert time.monotonic() < deadline, "the probe and the fetch never finished"
        mgr.poll()
        time.sleep(0.002)


def test_lookup_hits_sum_to_the_hits_lookup_returned(redis_url):
    """``tiered_kv_lookup_hits_total`` is "Keys found ready by lookup(), by tier" and the dashboard divides its
    per-tier rates by ``tiered_kv_lookup_keys_total`` ("Prefix hit rate by tier", "Remote hit rate").
    TierCore._apply_fetch counts hits{tier="remote"} when a fetch lands (no lookup involved), and the next
    lookup of the key counts it again as hits{tier="host"}: one block that one lookup found is two hits,
    and the tiers' hit rates add up to more than the real one (here 2 hits for 2 keys asked, 1 found)."""
    ns = "obsrev-hits|u8|tp0"
    a = _remote_manager(redis_url, ns)
    b = _remote_manager(redis_url, ns)
    try:
        job = a.store(b"shared", 0)
        assert job is not None
        a.wait([job], timeout=15)
        assert a.flush(timeout=15)
        found = b.lookup([b"shared"])          # not local: asked from the server
        _settle_remote(b)
        found += b.lookup([b"shared"])         # landed: a host hit
        b.metrics.flush()
        reg = b.metrics.registry
        assert found == 1
        assert sample(reg, "tiered_kv_lookup_keys_total") == 2
        hits = {t: sample(reg, "tiered_kv_lookup_hits_total", tier=t) for t in ("host", "disk", "remote")}
        assert sum(hits.values()) == found, f"{hits} for {found} key(s) lookup() found"
    finally:
        a.close()
        b.close()


def test_a_shed_fetch_probe_counts_its_blocks(redis_url, monkeypatch):
    """docs/observability.md: ``tiered_kv_shed_total`` -- "spill, put and fetch count blocks", and
    ``tiered_kv_jobs_total{kind="fetch",outcome="failed"}`` does count a probe's keys one by one
    (TierCore._apply_fetch).  A probe the reader cannot queue (its queue full, or the server away) is
    counted by ``TierCore._start_probe`` as ``self.shed(_FETCH, got)``: one, for any number of keys."""
    b = _remote_manager(redis_url, "obsrev-shed|u8|tp0")
    try:
        store = b._core.remote.store
        assert store.available
        monkeypatch.setattr(store, "submit_probe", lambda token, ks: False)   # the reader's queue is full
        ks = [b"nowhere-%d" % i for i in range(4)]
        assert b.lookup(ks) == 0
        b.poll()
        b.metrics.flush()
        reg = b.metrics.registry
        assert sample(reg, "tiered_kv_shed_total", kind="fetch", reason="backpressure") == len(ks)
        assert sample(reg, "tiered_kv_jobs_total", kind="fetch", outcome="shed") == len(ks)
    finally:
        b.close()


def test_docs_alert_table_matches_alerts_yml():
    """The table under "Prometheus and the alert rules" is the operator's summary of deploy/alerts.yml:
    every rule in it, with the ``for:`` it has, and an expression it quotes as code equal to the rule's."""
    text = DOCS.read_text(encoding="utf-8")
    section = text.split("## Prometheus and the alert rules", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(TieredKV\w+)` \| (.*?) \| (.*?) \| (\w+) \|$", section, re.M)
    rules = _rules()
    assert rows, "no alert table"
    problems = []
    documented = {name for name, *_ in rows}
    problems += [f"{n}: not in the docs' table" for n in sorted(set(rules) - documented)]
    problems += [f"{n}: in the docs, not in alerts.yml" for n in sorted(documented - set(rules))]
    for name, expr, for_, severity in rows:
        r = rules.get(name)
        if r is None:
            continue
        if for_ != str(r.get("for", "–")):
            problems.append(f"{name}: for {for_!r} in the docs, {r.get('for')!r} in alerts.yml")
        if severity != r["labels"]["severity"]:
            problems.append(f"{name}: severity {severity!r} in the docs, {r['labels']['severity']!r}")
        m = re.fullmatch(r"`([^`]+)`", expr.strip())
        if m and _norm(m.group(1)) != _norm(r["expr"]):
            problems.append(f"{name}: the docs quote `{m.group(1)}`, the rule is `{_norm(r['expr'])}`")
    assert not problems, "\n".join(problems)


# ============================================================================= checked and right
def _literal_returns(path: Path, func: str) -> set[str]:
    """The string constants ``func`` (a function or method in ``path``) returns (``a if c else b`` too), also as
    the first argument of a call it returns (``Refused("why", n)``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == func:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Return) and sub.value is not None:
                    v = sub.value.args[0] if isinstance(sub.value, ast.Call) and sub.value.args else sub.value
                    values = [v.body, v.orelse] if isinstance(v, ast.IfExp) else [v]
                    out |= {v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)}
    assert out, f"{path.name}: no literal returned by {func}()"
    return out


def _literals(paths: list[Path], pattern: str) -> set[str]:
    return {m for p in paths for m in re.findall(pattern, p.read_text(encoding="utf-8"))}


def test_every_label_value_the_code_emits_on_an_alerted_counter_is_exported_at_zero():
    """TieredKVDiskErrors, TieredKVCorruptBlocks, TieredKVSpillsShed and TieredKVRemoteErrors alert on
    ``increase``/``rate`` > 0: a label value whose series first appears at 1 is never seen to increase.
    Every error kind, corrupt reason and shed reason the source can emit (string literals at the call
    sites, and the classifiers' returns) must exist at 0 in a fresh Metrics with disk and remote tiers."""
    disk = sorted((PKG / "disk").glob("*.py")) + [PKG / "core" / "disk_tier.py", PKG / "core" / "tiers.py"]
    remote = sorted((PKG / "remote").glob("*.py")) + [PKG / "core" / "remote_tier.py"]
    call = r'(?:\bon_error|_on_error|_degrade|\berr)\(\s*"(\w+)"'
    disk_errors = (_literals(disk, call) | _literals(disk, r'error\(\s*"disk",\s*"(\w+)"')
                   | _literals(disk, r'_host_call\(\s*self\._on_error,\s*"(\w+)"')   # a guarded call
                   | _literal_returns(PKG / "disk" / "records.py", "error_kind")
                   | _literal_returns(PKG / "disk" / "writer.py", "_classify") | {"copy_failed"})
    remote_errors = _literals(remote, call) | _literal_returns(PKG / "remote" / "conn.py", "error_kind")
    corrupt = _literals([PKG / "disk" / "format.py"], r'CorruptEntry\(\s*"(\w+)"') | {"recovery", "foreign"}
    shed = (_literals([PKG / "core" / "tiers.py"], r'self\.shed\(\s*_?\w+,\s*"(\w+)"')
            | _literals([PKG / "core" / "disk_tier.py"], r'"(backpressure|disk_down|disk_full)"')
            | _literal_returns(PKG / "core" / "remote_tier.py", "take_wanted"))
    assert {"io_process_died", "writer_died", "map_full", "slots_exhausted"} <= disk_errors
    assert {"connection", "timeout", "breaker_open", "tomb_dropped"} <= remote_errors
    assert {"checksum", "bad_magic", "slot_entry"} <= corrupt
    assert {"evicted_unwritten", "host_full", "backpressure", "disk_down", "remote_down"} <= shed

    reg = CollectorRegistry()
    m = Metrics(reg, namespace="labels")
    m.enable_disk_health(True)
    m.enable_remote_health(True)
    missing = []
    for tier, errors in (("disk", disk_errors), ("remote", remote_errors), ("device", {"copy_failed"}),
                         ("host", {"copy_failed"})):
        missing += [f"errors {tier}/{e}" for e in sorted(errors)
                    if reg.get_sample_value("tiered_kv_errors_total", {"tier": tier, "error": e}) != 0]
    missing += [f"corrupt {r}" for r in sorted(corrupt)
                if reg.get_sample_value("tiered_kv_corrupt_blocks_total", {"reason": r}) != 0]
    missing += [f"remote corrupt {r}" for r in sorted(corrupt - {"recovery", "foreign"})
                if reg.get_sample_value("tiered_kv_remote_corrupt_values_total", {"reason": r}) != 0]
    missing += [f"shed {k.value}/{r}" for k in JobKind for r in sorted(shed)
                if reg.get_sample_value("tiered_kv_shed_total", {"kind": k.value, "reason": r}) != 0]
    assert not missing, missing


def _exported_labels() -> dict[str, dict[str, set[str]]]:
    """sample name -> label name -> the values a manager with disk and remote tiers exports from the start."""
    reg = CollectorRegistry()
    m = Metrics(reg, namespace="labels")
    m.enable_disk_health(True)
    m.enable_remote_health(True)
    out: dict[str, dict[str, set[str]]] = {}
    for fam in reg.collect():
        for s in fam.samples:
            d = out.setdefault(s.name, {})
            for k, v in s.labels.items():
                d.setdefault(k, set()).add(v)
    return out


_SELECTOR = re.compile(r"\b(tiered_kv_[a-z0-9_]+)(?:\{([^}]*)\})?")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
_GROUPING = re.compile(r"\b(?:by|without|ignoring|on)\s*\(([^)]*)\)")


def _check_expr(where: str, expr: str, exported: dict[str, dict[str, set[str]]]) -> list[str]:
    problems = []
    scrape = {"job", "instance"}
    seen: set[str] = set()
    for name, body in _SELECTOR.findall(expr):
        labels = exported.get(name)
        if labels is None:
            problems.append(f"{where}: {name} is not exported")
            continue
        seen |= set(labels)
        for label, op, value in _MATCHER.findall(body or ""):
            if label in scrape:
                continue
            if label not in labels:
                problems.append(f"{where}: {name} has no label {label!r}")
            elif op == "=" and value not in labels[label]:
                problems.append(f"{where}: {name}{{{label}={value!r}}} is never exported")
            elif op == "=~" and re.fullmatch(r"[\w|]+", value):
                problems += [f"{where}: {name}{{{label}=~{alt!r}}} is never exported"
                             for alt in value.split("|") if alt not in labels[label]]
    for group in _GROUPING.findall(expr):
        for label in (x.strip() for x in group.split(",") if x.strip()):
            if label not in seen | scrape:
                problems.append(f"{where}: groups by {label!r}, which none of its metrics has")
    return problems


def test_every_label_a_query_or_rule_uses_exists_on_its_metric():
    """PromQL with a label a metric does not have, or a label value it never exports, returns nothing (or
    aggregates everything into one series) without an error.  Every matcher and every by/ignoring label of
    every dashboard query and alert rule is checked against a manager's real series; every legend's
    ``{{label}}`` is a label the query keeps, and every ``$labels.x`` of an alert's annotations is one its
    expression keeps (or the notification shows an empty string)."""
    exported = _exported_labels()
    exported["up"] = {}
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    problems: list[str] = []
    panels = [p for top in dash["panels"] for p in (top, *top.get("panels", []))]
    n = 0
    for p in panels:
        for t in p.get("targets", []):
            expr = t["expr"]
            where = f"panel {p['title']!r}/{t.get('refId')}"
            problems += _check_expr(where, expr, exported)
            kept = set(re.findall(r"\bby\s*\(([^)]*)\)", expr))
            kept_labels = {x.strip() for g in kept for x in g.split(",")}
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")):
                if label not in kept_labels:
                    problems.append(f"{where}: legend uses {{{{{label}}}}}, the query keeps {sorted(kept_labels)}")
            n += 1
    for name, r in _rules().items():
        problems += _check_expr(f"alert {name}", r["expr"], exported)
        top = re.match(r"\s*\w+\s+by\s*\(([^)]*)\)", r["expr"])
        kept_labels = {x.strip() for x in top.group(1).split(",")} if top else {"job", "instance"}
        for text in r["annotations"].values():
            for label in re.findall(r"\$labels\.(\w+)", text):
                if label not in kept_labels:
                    problems.append(f"alert {name}: an annotation uses $labels.{label}, the expression keeps "
                                    f"{sorted(kept_labels)}")
    assert n >= 30
    assert not problems, "\n".join(problems)


@needs_promtool
def test_stale_callback_spike_is_relative_to_the_baseline(tmp_path):
    """TieredKVStaleCallbackSpike: a high but steady rate (an engine that aborts a lot, always) never
    fires; a jump to many times the previous hour's rate is pending at once and fires after its 10m
    ``for:``.  Evaluated by promtool on the rule as shipped (it would fail for a rule that always or never
    fires, or that compares rates of different label sets)."""
    series = f'tiered_kv_stale_callbacks_total{{job="{JOB}",instance="{INSTANCE}",kind="store",reason="cancelled"}}'
    # 120 minutes at 50/s (3000 a minute), then 30 minutes at 1000/s (60000 a minute)
    values = "0+3000x120 360000+60000x30"
    labels = {"severity": "warning", "job": JOB, "instance": INSTANCE}
    r = _promtool_test(tmp_path, [{"series": series, "values": values}], [
        {"eval_time": "110m", "alertname": "TieredKVStaleCallbackSpike", "exp_alerts": []},
        {"eval_time": "126m", "alertname": "TieredKVStaleCallbackSpike", "exp_alerts": []},   # pending
        {"eval_time": "135m", "alertname": "TieredKVStaleCallbackSpike", "exp_alerts": [{"exp_labels": labels}]},
    ])
    assert r.returncode == 0, r.stdout + r.stderr
    # and the steady rate alone, for the whole run: never
    r = _promtool_test(tmp_path, [{"series": series, "values": "0+3000x150"}], [
        {"eval_time": f"{t}m", "alertname": "TieredKVStaleCallbackSpike", "exp_alerts": []}
        for t in (10, 70, 130, 150)])
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_a_fault_after_the_first_scrape_raises_the_disk_alerts(tmp_path):
    """The other side of the recovery finding: a fault that happens after the target was first scraped
    is seen.  The real manager's exposition at open (disk tier, series at 0) is scraped, then one
    ``io_process_died`` and one ``checksum`` corruption are counted: TieredKVDiskErrors and
    TieredKVCorruptBlocks fire for exactly those labels (and only those)."""
    kv = make_kv(8)
    cfg = disk_config(tmp_path / "disk", host_slots=2, row_bytes=int(kv.shape[1]), disk_io="thread")
    mgr = TierManager(cfg, kv, registry=CollectorRegistry())
    try:
        before = _series(mgr.metrics.registry)
        mgr.metrics.error("disk", "io_process_died")
        mgr.metrics.corrupt_blocks.labels(reason="checksum").inc()
        after = _series(mgr.metrics.registry)
    finally:
        mgr.close()
    changed = {s for s in after if after[s] != before.get(s)}
    assert len(changed) == 2, changed
    # a series missing from the first scrape is absent there ("_"), as Prometheus would see it
    inputs = [{"series": s, "values": (f"{before[s]:g}" if s in before else "_") + f"x3 {after[s]:g}x10"}
              for s in after]
    base = {"job": JOB, "instance": INSTANCE}
    r = _promtool_test(tmp_path, inputs, [
        {"eval_time": "6m", "alertname": "TieredKVDiskErrors",
         "exp_alerts": [{"exp_labels": dict(base, severity="critical", error="io_process_died")}]},
        {"eval_time": "6m", "alertname": "TieredKVCorruptBlocks",
         "exp_alerts": [{"exp_labels": dict(base, severity="warning", reason="checksum")}]},
        {"eval_time": "2m", "alertname": "TieredKVDiskErrors", "exp_alerts": []},
        {"eval_time": "6m", "alertname": "TieredKVTierUnhealthy", "exp_alerts": []},
    ])
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_closed_manager_reports_its_disk_tier_unhealthy_too(tmp_path):
    """Metrics.closed() sets every health gauge the manager exports to 0, the disk tier's included (bound
    by enable_disk_health after the constructor's device/host ones): a closed manager whose registry is
    still served must not say its disk tier serves."""
    kv = make_kv(8)
    cfg = disk_config(tmp_path / "disk", host_slots=2, row_bytes=int(kv.shape[1]), disk_io="thread")
    mgr = TierManager(cfg, kv, registry=CollectorRegistry())
    reg = mgr.metrics.registry
    assert reg.get_sample_value("tiered_kv_healthy", {"tier": "disk"}) == 1
    store_seq(mgr, kv, keys(2))
    mgr.close()
    assert {t: reg.get_sample_value("tiered_kv_healthy", {"tier": t}) for t in ("device", "host", "disk")} == \
        {"device": 0, "host": 0, "disk": 0}
