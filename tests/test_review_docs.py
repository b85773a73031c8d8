"""Adversarial review of the user-facing documentation against the software's behaviour: README.md,
docs/architecture.md, docs/observability.md (metrics, alerts, dashboard, deploy/), docs/operations.md,
docs/policies.md, docs/vllm.md, docs/remote.md and the public docstrings of tiered_kv's exports.

What it proved wrong, each pinned by a test that failed before its fix (the side changed: the README,
the Makefile, docs/observability.md twice, ``TierManager.cancel`` (it returns quietly after ``close()``) and
``TierManager.wait``'s docstring):

* README "Metrics": "Serve them with ``tiered_kv.metrics.serve_metrics(port)``" serves prometheus_client's
  global REGISTRY, while a TierManager's metrics live on a private registry: the endpoint has no tiered_kv_ metric.
* README: ``make TORCH="torch==2.13.0 --index-url .../cu128" test`` cannot work: the Makefile passes
  ``"$(TORCH)"`` quoted, so pip gets one argument and refuses it as an invalid requirement.
* docs/observability.md, Kubernetes "without it [the Operator]": ``kubectl apply -f deployment.yaml -f
  service.yaml`` leaves out redis.yaml, whose Service (tiered-kv-redis) the Deployment's --remote-url names.
* ``TierManager.cancel`` docstring: "idempotent, valid in any state at any time"; after ``close()`` it raises
  ManagerClosedError (every job is terminal by then, so a cleanup path's cancel crashes for nothing).
* ``TierManager.wait()`` docstring: with no jobs it blocks until "every worker report applied"; it returns
  with spill (and remote put) reports still unapplied (``jobs_in_flight`` > 0): those are flush()'s.
* docs/observability.md, Kubernetes "Plain Prometheus with annotation discovery": its scrape job
  (``kubernetes-service-endpoints``, job not relabelled) gives ``up`` a job label that TieredKVTargetDown's
  ``up{job=~"tiered-kv.*"}`` never matches: with the documented setup a dead endpoint never alerts.

Plain tests pin statements checked and found to hold, each written to fail if the doc or code drifts:
every metric of docs/observability.md's table exists with its documented labels; the error kinds the docs
name are exported; the defaults tables of docs/remote.md and docs/vllm.md equal TieredKVConfig's; the
constants docs/architecture.md quotes equal the code's; the README's evict-ahead default; one manager per
disk path (DiskInUseError); the observability doc's Prometheus rewrite passes promtool; the README example's
calls behave as its comments say; ``tiered-kv demo --help`` lists the options the README names.

Deterministic: tmp_path directories, no sleeps, no timing asserts (a writer gate holds the disk writer).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from disk_helpers import WriterGate
from tiered_kv import TieredKVConfig, TierManager, errors
from tiered_kv.metrics import ERROR_KINDS, Metrics

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
OBS = (REPO / "docs" / "observability.md").read_text()
ARCH = (REPO / "docs" / "architecture.md").read_text()
REMOTE_MD = (REPO / "docs" / "remote.md").read_text()
VLLM_MD = (REPO / "docs" / "vllm.md").read_text()

ROW = 1024


def _kv(rows: int = 16, row: int = ROW) -> torch.Tensor:
    return torch.zeros((rows, row), dtype=torch.uint8)


def _table_rows(text: str, header_start: str) -> list[list[str]]:
    """The body rows of the markdown table whose header line starts with ``header_start``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(header_start):
            rows = []
            for body in lines[i + 2:]:
                if not body.startswith("|"):
                    break
                # split on | not inside backticks (\| escapes in cells)
                cells = [c.strip() for c in re.split(r"(?<!\\)\|", body.strip().strip("|"))]
                rows.append(cells)
            return rows
    raise AssertionError(f"no table starting {header_start!r}")


# ============================================================================ findings (strict xfails)
def test_readme_serve_metrics_port_serves_the_managers_metrics() -> None:
    m = re.search(r"Serve them with\s+`tiered_kv\.metrics\.serve_metrics\(port(?P<rest>[^)]*)\)`", README)
    assert m, "the README's serve_metrics call moved"
    from tiered_kv.metrics import serve_metrics

    with TierManager(TieredKVConfig(namespace="readme", host_capacity_bytes=4 * ROW), _kv()) as mgr:
        job = mgr.store(b"k", 0)
        mgr.wait([job])
        srv = eval(f"serve_metrics(0{m.group('rest')})", {"serve_metrics": serve_metrics, "mgr": mgr})  # noqa: S307
        try:
            body = urllib.request.urlopen(srv.url, timeout=30).read().decode()
        finally:
            srv.close()
    assert "tiered_kv_jobs_total" in body


def test_readme_cuda_torch_make_command_gives_pip_a_valid_requirement(tmp_path: Path) -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    from packaging.requirements import InvalidRequirement, Requirement

    m = re.search(r'make TORCH="([^"]+)" test', README)
    assert m, "the README's CUDA make command moved"
    torch_value = m.group(1)
    venv = tmp_path / "venv"
    out = subprocess.run(["make", "-n", "-C", str(REPO), f"TORCH={torch_value}", f"VENV={venv}",
                          f"{venv}/bin/activate"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if "pip install" in ln and "torch==" in ln)
    argv = shlex.split(line)
    args = argv[argv.index("install") + 1:]
    reqs = [a for a in args if not a.startswith("-")]
    assert "--index-url" in args, f"pip gets {args!r}: the index URL is not an option"
    for r in reqs[:1]:   # the first positional is the requirement; the URL follows --index-url
        try:
            Requirement(r)
        except InvalidRequirement as exc:
            pytest.fail(f"pip would refuse {r!r}: {exc}")


def test_observability_plain_kubectl_command_applies_what_the_deployment_needs() -> None:
    yaml = pytest.importorskip("yaml")
    line = next(ln for ln in OBS.splitlines() if ln.startswith("kubectl apply -f") and "without it" in ln)
    files = re.findall(r"-f (\S+)", line)
    assert files, line
    docs = [d for f in files for d in yaml.safe_load_all((REPO / f).read_text()) if d]
    services = {d["metadata"]["name"] for d in docs if d.get("kind") == "Service"}
    needed = set()
    for d in docs:
        if d.get("kind") != "Deployment":
            continue
        for c in d["spec"]["template"]["spec"]["containers"]:
            args = c.get("args", [])
            for i, a in enumerate(args):
                if a == "--remote-url":
                    needed.add(urllib.parse.urlsplit(args[i + 1]).hostname)
    assert needed, "the deployment no longer names a remote tier"
    assert needed <= services, f"{sorted(needed - services)} named by the Deployment, defined by none of {files}"


def test_cancel_is_valid_at_any_time_even_after_close() -> None:
    mgr = TierManager(TieredKVConfig(namespace="cancel", host_capacity_bytes=4 * ROW), _kv(),
                      registry=CollectorRegistry())
    job = mgr.store(b"k", 0)
    assert job is not None
    mgr.close()
    assert job.done   # close() reported it
    mgr.cancel(job)   # "valid in any state at any time"


def test_wait_none_applies_every_worker_report(tmp_path: Path) -> None:
    cfg = TieredKVConfig(namespace="wait", host_capacity_bytes=8 * ROW, disk_path=tmp_path / "disk",
                         disk_capacity_bytes=64 * ROW, disk_io="thread")
    mgr = TierManager(cfg, _kv(), registry=CollectorRegistry())
    gate = WriterGate()   # holds the disk writer: the spill cannot be answered until opened
    mgr.disk.fault_hook = gate
    try:
        job = mgr.store(b"k", 0)
        mgr.wait([job])
        assert job.done
        mgr.wait()   # copies and reads: applied; the spill is flush()'s, as the docstring now says
        held = mgr.jobs_in_flight
        gate.open()
        assert mgr.flush(timeout=30)
        after_flush = mgr.jobs_in_flight
    finally:
        gate.open()
        mgr.close()
    doc = " ".join((TierManager.wait.__doc__ or "").split())
    assert "Spills and remote writes are ``flush()``'s" in doc, doc
    assert held == 1 and after_flush == 0, (held, after_flush)


# ============================================================================ statements that hold
def test_readme_example_calls_behave_as_its_comments_say() -> None:
    """README 'Use': store() None when already there; lookup counts leading keys ready below; free_block False
    while a load lands; the completions carry job.kind/key, ok, error."""
    kv = torch.zeros(64, 2, 4, 8, dtype=torch.bfloat16)
    cfg = TieredKVConfig(namespace="llama-3.1-8b|bf16|tp0", host_capacity_bytes=32 * kv[0].numel() * 2)
    with TierManager(cfg, device_blocks=kv, registry=CollectorRegistry()) as mgr:
        job = mgr.store(b"prefix-hash-1", 37)
        assert job is not None
        assert mgr.store(b"prefix-hash-1", 38) is None   # "None if already there"
        done = mgr.wait([job])
        assert [(c.job.kind, c.job.key, c.ok, c.error) for c in done] == [("store", b"prefix-hash-1", True, None)]
        assert mgr.lookup([b"prefix-hash-1", b"prefix-hash-2"]) == 1
        load = mgr.load(b"prefix-hash-1", 42)
        assert load is not None
        assert mgr.free_block(42) is False   # "False while a load lands"
        mgr.wait([load])
        assert load.done and mgr.free_block(42) is True


def test_readme_evict_ahead_default_is_min_64_slots_over_32() -> None:
    assert "default\n`min(64, host slots // 32)`" in README or "`min(64, host slots // 32)`" in README
    for slots in (64, 320, 4000):
        cfg = TieredKVConfig(namespace="ea", host_capacity_bytes=slots * 64)
        with TierManager(cfg, _kv(128, 64), registry=CollectorRegistry()) as mgr:
            for i in range(slots + 40):
                mgr.store(b"k%d" % i, i % 128)
                if i % 100 == 99:
                    mgr.wait()
            mgr.wait()
            mgr.poll()
            assert slots - mgr.host_used_slots == min(64, slots // 32), slots


def test_readme_one_manager_per_disk_path(tmp_path: Path) -> None:
    assert "One manager per disk path:\na second one gets `DiskInUseError`" in README
    cfg = TieredKVConfig(namespace="one", host_capacity_bytes=8 * ROW, disk_path=tmp_path / "d",
                         disk_capacity_bytes=64 * ROW)
    with TierManager(cfg, _kv(), registry=CollectorRegistry()):
        with pytest.raises(errors.DiskInUseError):
            TierManager(cfg, _kv(), registry=CollectorRegistry())


def test_every_metric_in_the_observability_table_is_exported_with_its_labels() -> None:
    reg = CollectorRegistry()
    m = Metrics(reg, "ns")
    m.enable_disk_health(True)     # what a manager with a disk and a remote tier exports
    m.enable_remote_health(True)
    families = {m.name: m for m in reg.collect()}
    label_sets: dict[str, set[str]] = {}
    for m in reg.collect():
        for s in m.samples:
            label_sets.setdefault(m.name, set()).update(k for k in s.labels if k != "le")
    rows = _table_rows(OBS, "| metric | labels | meaning |")
    assert len(rows) >= 15
    for cells in rows:
        names = re.findall(r"`(tiered_kv_[a-z_]+)`", cells[0])
        labels = [x.strip() for x in cells[1].split(",")]
        assert names, cells
        for i, name in enumerate(names):
            family = name[:-len("_total")] if name.endswith("_total") else name
            assert family in families, f"{name} (docs/observability.md) is not exported"
            per_name = len(names) > 1 and len(labels) == len(names) and any(x in ("–", "-") for x in labels)
            wants = [labels[i]] if per_name else labels
            want_set = {w for w in wants if w not in ("", "–", "-")}
            assert label_sets.get(family, set()) == want_set, (name, label_sets.get(family), want_set)


def test_error_kinds_the_docs_name_are_exported() -> None:
    from tiered_kv.remote.records import REMOTE_ERROR_KINDS

    disk = {e for t, e in ERROR_KINDS if t == "disk"}
    row = next(ln for ln in OBS.splitlines() if ln.startswith("| `tiered_kv_errors_total`"))
    for err in ("io_error", "disk_full", "map_full", "writer_died", "io_process_died", "io_process_restart_failed",
                "io_process_start_failed"):
        assert f"`{err}`" in row and err in disk, err
    for text in (OBS, REMOTE_MD):
        m = re.search(r"\(`connection`, `timeout`[^)]*?`tomb_dropped`", text) or \
            re.search(r"faults: (`connection`.*?`tomb_dropped`)", text)
        assert m, "the remote error list moved"
        named = re.findall(r"`([a-z_]+)`", m.group(0))
        assert set(named) == set(REMOTE_ERROR_KINDS), (named, REMOTE_ERROR_KINDS)


def _default(cell: str) -> Any:
    cell = cell.strip().strip("`")
    m = re.match(r"^(\d+) MiB$", cell)
    if m:
        return int(m.group(1)) << 20
    return {"None": None, "True": True, "False": False}.get(cell, cell)


def test_remote_md_options_defaults_equal_the_config() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(TieredKVConfig)}
    rows = _table_rows(REMOTE_MD, "| field (`TieredKVConfig`")
    assert len(rows) == 9
    for cells in rows:
        name = cells[0].strip("`")
        doc = _default(cells[1])
        code = fields[name]
        assert (code is None and doc is None) or str(code) == str(doc).strip('"'), (name, doc, code)


def test_vllm_md_options_defaults_equal_the_config() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(TieredKVConfig)}
    rows = _table_rows(VLLM_MD, "| key | default | meaning |")
    checked = 0
    for cells in rows:
        names = re.findall(r"`([a-z_]+)`", cells[0])
        if not names or names[0] not in fields or names[0] == "namespace":
            continue
        doc = cells[1]
        for name in names:
            code = fields[name]
            if code is None:
                assert doc.startswith("`None`"), (name, doc)
            else:
                d = _default(doc.split(" ")[0] if "MiB" not in doc else doc)
                assert str(code) == str(d).strip('"'), (name, doc, code)
            checked += 1
    assert checked >= 20


@pytest.mark.parametrize("doc_text, value", [
    ("`TOKEN_POOL` = 64", ("tiered_kv.core.tiers", "TOKEN_POOL", 64)),
    ("`DIRTY_SYNC_S` = 0.5 s", ("tiered_kv.disk.writer", "DIRTY_SYNC_S", 0.5)),
    ("`MAP_FULL_ATTEMPTS` = 4", ("tiered_kv.disk.writer", "MAP_FULL_ATTEMPTS", 4)),
    ("`CLOSE_RETRIES` = 3", ("tiered_kv.disk.writer", "CLOSE_RETRIES", 3)),
    ("`IDLE_WAKE_S` =\n1 s", ("tiered_kv.disk.writer", "IDLE_WAKE_S", 1.0)),
    ("`READ_BATCH_MAX` = 256", ("tiered_kv.disk.readers", "READ_BATCH_MAX", 256)),
    ("`EVENT_BYTES` = 64 MiB", ("tiered_kv.movers.cuda", "EVENT_BYTES", 64 << 20)),
    ("`RING_SIZE` = 65,536", ("tiered_kv.integrations.slab", "RING_SIZE", 65536)),
    ("`WRITEBACK_AHEAD` (4)", ("tiered_kv.core.tiers", "WRITEBACK_AHEAD", 4)),
    ("entry header (52 bytes)", ("tiered_kv.disk.format", "HEADER_SIZE", 52)),
])
def test_constants_quoted_by_the_architecture_doc(doc_text: str, value: tuple[str, str, Any]) -> None:
    import importlib

    assert doc_text in ARCH, f"docs/architecture.md no longer says {doc_text!r}"
    mod, name, want = value
    assert getattr(importlib.import_module(mod), name) == want


def test_observability_prometheus_rewrite_passes_promtool(tmp_path: Path) -> None:
    """docs/observability.md: sed the target, copy alerts.yml beside it: a config Prometheus accepts."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not on PATH")
    m = re.search(r"sed '(s/[^']+)' deploy/prometheus.yml", OBS)
    assert m
    pat = re.fullmatch(r's/(.*)/(.*)/', m.group(1))
    assert pat
    text = (REPO / "deploy" / "prometheus.yml").read_text()
    assert pat.group(1) in text
    (tmp_path / "prometheus.yml").write_text(text.replace(pat.group(1), pat.group(2)))
    shutil.copy(REPO / "deploy" / "alerts.yml", tmp_path / "alerts.yml")
    out = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "127.0.0.1:9477" in (tmp_path / "prometheus.yml").read_text()


def test_target_down_alert_matches_the_documented_annotation_scrape_job() -> None:
    yaml = pytest.importorskip("yaml")
    m = re.search(r"```yaml\n(\s*- job_name: kubernetes-service-endpoints\n.*?)```", OBS, re.S)
    assert m, "the annotation-discovery snippet moved"
    job = yaml.safe_load(m.group(1))[0]
    rules = yaml.safe_load((REPO / "deploy" / "alerts.yml").read_text())["groups"][0]["rules"]
    expr = next(r["expr"] for r in rules if r["alert"] == "TieredKVTargetDown")
    regex = re.search(r'job=~"([^"]+)"', expr).group(1)
    assert "`up{job=~\"tiered-kv.*\"} == 0`" in OBS
    job_label = job["job_name"]
    for rule in job.get("relabel_configs", []):
        if rule.get("target_label") == "job":
            rep = str(rule.get("replacement", "$1"))
            job_label = "tiered-kv-demo" if "$" in rep else rep   # relabelled from the Service's name
    assert re.fullmatch(regex, job_label), f"up{{job={job_label!r}}} does not match job=~{regex!r}"


def test_demo_help_lists_the_options_the_readme_names() -> None:
    out = subprocess.run([sys.executable, "-m", "tiered_kv.tools.cli", "demo", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    m = re.search(r"`tiered-kv demo --help` lists the demo's options \(([^)]*)", README)
    assert m
    for opt in re.findall(r"`(--[a-z-]+)`", m.group(1)):
        assert opt in out.stdout, opt
    for opt in ("--abort-rate", "--preempt-rate", "--device-blocks", "--host-blocks", "--metrics-addr"):
        assert opt in out.stdout, opt
