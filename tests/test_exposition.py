"""tiered_kv.exposition: the WSGI/ASGI apps, the standalone endpoint, multiprocess mode.

The apps are called directly (no web framework); the endpoint is fetched over
loopback with urllib; multiprocess mode runs two real worker processes, each
with its own TierManager, and a third process that serves the merged values.
"""

from __future__ import annotations

import asyncio
import gzip
import multiprocessing as mp
import os
import socket
import urllib.request
from typing import Any, Optional

import pytest
import torch
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.exposition import (
    MetricsServer,
    make_asgi_app,
    make_wsgi_app,
    multiprocess_dir,
    scrape_registry,
    serve_metrics,
)
from tiered_kv.metrics import Metrics

ROW_FLOATS = 64  # float32 -> 256 bytes per row
ROW_BYTES = ROW_FLOATS * 4


@pytest.fixture(autouse=True)
def _no_multiprocess_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test decides about multiprocess mode itself."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv("prometheus_multiproc_dir", raising=False)


def _metrics_registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    m = Metrics(reg, namespace="test|exposition")
    m.stale[next(iter(m.stale))].inc(3)
    m.lookups.inc(7)
    return reg


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _total(text: str, name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in _samples(text).items()
               if n == name and all(dict(lab).get(k) == want for k, want in labels.items()))


# ----------------------------------------------------------------------------- WSGI
def _call_wsgi(app: Any, headers: Optional[dict[str, str]] = None, query: str = "") -> tuple[str, dict[str, str], bytes]:
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/metrics", "QUERY_STRING": query,
               "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "0", "wsgi.url_scheme": "http"}
    for k, v in (headers or {}).items():
        environ["HTTP_" + k.upper().replace("-", "_")] = v
    got: dict[str, Any] = {}

    def start_response(status: str, hdrs: list[tuple[str, str]], exc_info: Any = None) -> None:
        got["status"], got["headers"] = status, dict(hdrs)

    body = b"".join(app(environ, start_response))
    return got["status"], got["headers"], body


def test_wsgi_app_serves_the_given_registry() -> None:
    status, headers, body = _call_wsgi(make_wsgi_app(_metrics_registry()))
    assert status.startswith("200")
    assert headers["Content-Type"].startswith("text/plain")
    text = body.decode()
    assert _total(text, "tiered_kv_stale_callbacks_total") == 3
    assert _total(text, "tiered_kv_lookup_keys_total") == 7
    assert _total(text, "tiered_kv_info", namespace="test|exposition") == 1
    assert "python_info" not in text  # the given registry only, not the global one


def test_wsgi_app_openmetrics_gzip_and_name_filter() -> None:
    app = make_wsgi_app(_metrics_registry())
    _, headers, body = _call_wsgi(app, {"Accept": "application/openmetrics-text; version=1.0.0"})
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")
    _, headers, body = _call_wsgi(app, {"Accept-Encoding": "gzip"})
    assert headers.get("Content-Encoding") == "gzip"
    assert b"tiered_kv_lookup_keys_total" in gzip.decompress(body)
    _, _, body = _call_wsgi(app, query="name[]=tiered_kv_lookup_keys_total")
    names = {n for (n, _) in _samples(body.decode())}
    assert names == {"tiered_kv_lookup_keys_total"}


def test_default_registry_is_the_global_one() -> None:
    assert multiprocess_dir() is None
    assert scrape_registry() is REGISTRY
    _, _, body = _call_wsgi(make_wsgi_app())
    assert b"python_info" in body


# ----------------------------------------------------------------------------- ASGI
def _call_asgi(app: Any, scope: dict[str, Any], messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    incoming = list(messages)

    async def receive() -> dict[str, Any]:
        return incoming.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def _http_scope(headers: list[tuple[bytes, bytes]] = [], query: bytes = b"") -> dict[str, Any]:  # noqa: B006
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
            "scheme": "http", "path": "/metrics", "raw_path": b"/metrics", "query_string": query,
            "root_path": "", "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 0)}


def test_asgi_app_serves_the_given_registry() -> None:
    app = make_asgi_app(_metrics_registry())
    sent = _call_asgi(app, _http_scope(), [{"type": "http.request", "body": b"", "more_body": False}])
    start, body = sent
    assert start["type"] == "http.response.start" and start["status"] == 200
    headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    assert headers["content-type"].startswith("text/plain")
    assert body["type"] == "http.response.body"
    text = body["body"].decode()
    assert _total(text, "tiered_kv_stale_callbacks_total") == 3
    assert _total(text, "tiered_kv_lookup_keys_total") == 7


def test_asgi_app_openmetrics_and_lifespan() -> None:
    app = make_asgi_app(_metrics_registry())
    sent = _call_asgi(app, _http_scope([(b"accept", b"application/openmetrics-text; version=1.0.0")]),
                      [{"type": "http.request", "body": b"", "more_body": False}])
    assert sent[1]["body"].rstrip().endswith(b"# EOF")
    sent = _call_asgi(app, {"type": "lifespan", "asgi": {"version": "3.0"}},
                      [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    with pytest.raises(ValueError, match="websocket"):
        _call_asgi(app, {"type": "websocket"}, [])


# ----------------------------------------------------------------------------- standalone endpoint
def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode()


def test_serve_metrics_port_zero_on_loopback() -> None:
    kv = torch.zeros((16, ROW_FLOATS), dtype=torch.float32)
    cfg = TieredKVConfig(namespace="test|serve", host_capacity_bytes=16 * ROW_BYTES, pin_host_memory=False)
    with TierManager(cfg, kv) as mgr:
        jobs = [mgr.store(b"key%d" % i, i) for i in range(4)]
        mgr.wait([j for j in jobs if j is not None], timeout=10)
        assert mgr.lookup([b"key0", b"key1", b"nope"]) == 2
        mgr.poll()  # lookup counts are applied at the end of the next poll
        srv = serve_metrics(0, registry=mgr.metrics.registry)
        try:
            assert isinstance(srv, MetricsServer)
            server, thread = srv  # unpacks like prometheus_client's start_http_server
            assert thread.is_alive() and thread.daemon
            assert srv.addr == "127.0.0.1" and srv.port > 0
            assert srv.url == f"http://127.0.0.1:{srv.port}/metrics"
            text = _fetch(srv.url)
            assert _total(text, "tiered_kv_lookup_keys_total") == 3
            assert _total(text, "tiered_kv_lookup_hits_total", tier="host") == 2
            assert _total(text, "tiered_kv_jobs_total", kind="store", outcome="ok") == 4
            assert _total(text, "tiered_kv_transfer_bytes_total", src="device", dst="host") == 4 * ROW_BYTES
            # a second scrape sees live updates (as of the last poll)
            mgr.lookup([b"key2"])
            mgr.poll()
            assert _total(_fetch(srv.url), "tiered_kv_lookup_keys_total") == 4
        finally:
            srv.close()
    assert not thread.is_alive()
    srv.close()  # idempotent
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", srv.port), timeout=2).close()


def test_serve_metrics_rejects_bad_port() -> None:
    for bad in (-1, 65536, "9400", True):
        with pytest.raises(ValueError):
            serve_metrics(bad)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- multiprocess mode
# Run in spawned children: PROMETHEUS_MULTIPROC_DIR is in their environment from
# the start, so prometheus_client picks its mmap-backed value class on import.

def _mp_worker(idx: int, n: int, out: Any) -> None:
    import prometheus_client.values as values

    from tiered_kv import TieredKVConfig as Cfg, TierManager as Mgr

    assert values.ValueClass is not values.MutexValue, "child is not in multiprocess mode"
    kv = torch.arange(n * ROW_FLOATS, dtype=torch.float32).reshape(n, ROW_FLOATS) + idx
    cfg = Cfg(namespace=f"mp{idx}", host_capacity_bytes=n * ROW_BYTES, pin_host_memory=False)
    # the manager's own private registry: values still go to the mmap files
    with Mgr(cfg, kv) as mgr:
        jobs = [mgr.store(b"k%d" % i, i) for i in range(n)]
        done = mgr.wait([j for j in jobs if j is not None], timeout=30)
        hits = mgr.lookup([b"k%d" % i for i in range(n)] + [b"absent"])
        out.put({"idx": idx, "pid": os.getpid(), "stored": sum(c.ok for c in done), "lookup_keys": n + 1,
                 "hits": hits, "bytes": n * ROW_BYTES})


def _mp_scraper(out: Any, stop: Any) -> None:
    srv = serve_metrics(0)  # no registry: the multiprocess collector
    out.put(srv.port)
    stop.wait(120)
    srv.close()


def test_multiprocess_two_workers_summed_by_a_third(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    mpdir = tmp_path / "prom-mp"
    mpdir.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(mpdir))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    sizes = {0: 8, 1: 12}
    workers = [ctx.Process(target=_mp_worker, args=(i, n, q)) for i, n in sizes.items()]
    for p in workers:
        p.start()
    results = [q.get(timeout=120) for _ in workers]
    for p in workers:
        p.join(60)
        assert p.exitcode == 0
    assert {r["stored"] for r in results} == {8, 12}
    assert len(list(mpdir.glob("*.db"))) >= 2  # one set of files per worker pid

    stop = ctx.Event()
    scraper = ctx.Process(target=_mp_scraper, args=(q, stop))
    scraper.start()
    try:
        port = q.get(timeout=120)
        text = _fetch(f"http://127.0.0.1:{port}/metrics")
    finally:
        stop.set()
        scraper.join(30)
    assert scraper.exitcode == 0

    # counters and histograms: summed over both workers
    assert _total(text, "tiered_kv_lookup_keys_total") == sum(r["lookup_keys"] for r in results) == 22
    assert _total(text, "tiered_kv_lookup_hits_total", tier="host") == sum(r["hits"] for r in results) == 20
    assert _total(text, "tiered_kv_jobs_total", kind="store", outcome="ok") == 20
    assert _total(text, "tiered_kv_transfer_bytes_total", src="device", dst="host") == 20 * ROW_BYTES
    assert _total(text, "tiered_kv_transfer_seconds_count", src="device", dst="host") == 20
    assert _total(text, "tiered_kv_stale_callbacks_total") == 0
    # gauges: merged over the workers, no pid label (each gauge's live* mode, docs/observability.md);
    # the capacities summed
    assert _total(text, "tiered_kv_tier_capacity_bytes", tier="host") == 20 * ROW_BYTES
    for gauge in ("tiered_kv_tier_capacity_bytes", "tiered_kv_healthy", "tiered_kv_jobs_in_flight", "tiered_kv_info"):
        labels = [dict(lab) for (n, lab) in _samples(text) if n == gauge]
        assert labels and not any("pid" in lab for lab in labels), (gauge, labels)

    # the same merged view from this process, through the WSGI app with no registry
    _, _, body = _call_wsgi(make_wsgi_app())
    assert _total(body.decode(), "tiered_kv_lookup_keys_total") == 22


def test_multiprocess_dir_must_exist(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not a directory"):
        make_wsgi_app()
    # an explicit registry is served as given, multiprocess or not
    assert scrape_registry(reg := CollectorRegistry()) is reg
