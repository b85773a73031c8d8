"""Serving tiered_kv's metrics to Prometheus.

Three ways, all thin wrappers over :mod:`prometheus_client`:

* :func:`make_wsgi_app` / :func:`make_asgi_app`: an app for the host's own
  HTTP server to mount (e.g. at ``/metrics``);
* :func:`serve_metrics`: a standalone endpoint on a daemon thread, bound to
  ``127.0.0.1`` unless the caller passes another address.

Which registry is served:

* the one passed in (usually ``manager.metrics.registry``, or the registry
  the host gave to :class:`~tiered_kv.TierManager`);
* with no registry and ``PROMETHEUS_MULTIPROC_DIR`` set (prometheus_client's
  multiprocess mode): a fresh registry holding a
  :class:`~prometheus_client.multiprocess.MultiProcessCollector`, i.e. the
  sum over every process writing to that directory;
* with no registry otherwise: prometheus_client's global ``REGISTRY``.

Multiprocess mode (gunicorn-style workers, one manager per process): set
``PROMETHEUS_MULTIPROC_DIR`` to an empty directory in the environment *before*
the processes start (prometheus_client picks its value store when it is first
imported).  Managers then write their values to that directory whatever
registry they were given; create them **without** passing the scrape registry
(a metric registered on a registry that also holds the collector would be
exported twice), and serve with ``registry=None``.  See docs/observability.md.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from socketserver import ThreadingMixIn
from typing import Any, NamedTuple, Optional
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import prometheus_client
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.registry import Collector

from .errors import ConfigError

__all__ = [
    "make_wsgi_app",
    "make_asgi_app",
    "serve_metrics",
    "MetricsServer",
    "multiprocess_dir",
    "scrape_registry",
    "WSGIApp",
    "ASGIApp",
]

# Typing of the two app kinds, without depending on a web framework.
StartResponse = Callable[..., Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def multiprocess_dir() -> Optional[str]:
    """The multiprocess-mode directory from the environment, or ``None``.

    Honours prometheus_client's deprecated lower-case spelling too.
    """
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")
    return path or None


def scrape_registry(registry: Optional[Collector] = None) -> Collector:
    """The registry an app or endpoint serves: ``registry``, else a multiprocess one, else ``REGISTRY``.

    Raises :class:`~tiered_kv.errors.ConfigError` (a :class:`ValueError`) when ``registry`` is not a
    collector (no callable ``collect``: every scrape would fail), or when multiprocess mode is asked for
    but its directory does not exist.
    """
    if registry is not None:
        if not callable(getattr(registry, "collect", None)):
            raise ConfigError(f"registry must be None or a prometheus_client collector (a CollectorRegistry), got "
                              f"{type(registry).__name__}: {registry!r:.80}")
        return registry
    path = multiprocess_dir()
    if path is None:
        return REGISTRY
    if not os.path.isdir(path):
        raise ConfigError(f"PROMETHEUS_MULTIPROC_DIR={path!r} is not a directory")
    from prometheus_client.multiprocess import MultiProcessCollector

    fresh = CollectorRegistry()
    MultiProcessCollector(fresh, path=path)
    return fresh


def make_wsgi_app(registry: Optional[Collector] = None, *, disable_compression: bool = False) -> WSGIApp:
    """A WSGI app serving ``registry`` (see :func:`scrape_registry`) in the text or OpenMetrics format.

    It answers every path; mount it where the host wants (``/metrics``).
    ``?name[]=...`` restricts the output; gzip is used when the client accepts it.
    """
    app: WSGIApp = prometheus_client.make_wsgi_app(scrape_registry(registry), disable_compression=disable_compression)
    return app


def make_asgi_app(registry: Optional[Collector] = None, *, disable_compression: bool = False) -> ASGIApp:
    """An ASGI app serving ``registry`` (see :func:`scrape_registry`).

    HTTP requests go to prometheus_client's app; a ``lifespan`` scope (sent by
    servers when the app is mounted at the root) is acknowledged instead of
    failing.
    """
    inner = prometheus_client.make_asgi_app(scrape_registry(registry), disable_compression=disable_compression)

    async def tiered_kv_metrics_app(scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind == "lifespan":
            while True:
                message = await receive()
                if message.get("type") == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message.get("type") == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if kind != "http":
            raise ValueError(f"tiered_kv metrics app: unsupported ASGI scope type {kind!r}")
        await inner(scope, receive, send)

    return tiered_kv_metrics_app


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base class signature
        """Scrapes are not logged."""


class MetricsServer(NamedTuple):
    """A running endpoint: unpacks as ``server, thread``; ``.port`` is the bound port."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def addr(self) -> str:
        return str(self.server.server_address[0])

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def url(self) -> str:
        host = self.addr
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/metrics"

    def close(self, timeout: Optional[float] = 5.0) -> None:
        """Stop serving, release the port and join the thread (idempotent)."""
        if self.thread.is_alive():
            self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout)

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_metrics(port: int, addr: str = "127.0.0.1", registry: Optional[Collector] = None) -> MetricsServer:
    """Serve ``registry`` (see :func:`scrape_registry`) over HTTP on ``addr:port`` from a daemon thread.

    Bound to the loopback interface unless ``addr`` says otherwise (``"0.0.0.0"``
    or ``"::"`` to be scraped from another host or container).  ``port=0``
    picks a free port; read it back from ``.port``.  Returns a
    :class:`MetricsServer` (``server, thread = serve_metrics(...)`` works too);
    call ``.close()`` to stop it.  A bad ``port``, ``addr`` (also one that resolves to no address) or
    ``registry`` raises :class:`~tiered_kv.errors.ConfigError`, naming it; a port in use, ``OSError``.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"port must be an int in [0, 65535], got {port!r}")
    if not isinstance(addr, str) or not addr:
        raise ConfigError(f"addr must be a non-empty str (a host name or an IP address), got {addr!r}")
    app = make_wsgi_app(registry)
    server_class = _ThreadingServer6 if ":" in addr else _ThreadingServer
    try:
        server = make_server(addr, port, app, server_class=server_class, handler_class=_QuietHandler)
    except socket.gaierror as exc:   # not an address (a port in use stays an OSError: not a value to fix here)
        raise ConfigError(f"addr {addr!r} is not an address to serve on: {exc}") from exc
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                              name=f"tiered-kv-metrics:{server.server_address[1]}", daemon=True)
    thread.start()
    return MetricsServer(server, thread)
