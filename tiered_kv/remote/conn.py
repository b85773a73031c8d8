"""One I/O thread's connection to the remote store: pipelined round trips, scripts, error kinds.

Each I/O thread of a :class:`~tiered_kv.remote.store.RemoteStore` owns one :class:`Conn` (its own
sockets: a big put batch never delays a fetch).  A round trip is one pipeline (``transaction=False``)
whose answer is one result per command -- the value, or the exception that command got -- so every
part of a batch fails or succeeds on its own; a failure of the whole trip raises.

redis-py does no retrying of its own here (``Retry(NoBackoff(), 0)``): the store's breaker decides.
On a cluster, the pipeline is sent with ``allow_redirections=False`` and the store follows MOVED / ASK
/ TRYAGAIN itself, one command at a time through the cluster client (which sends ``ASKING`` and
updates its slot table), while a timed-out node's commands simply fail: redis-py's own follow-up
would retry each of them, one read timeout apiece, stalling the thread for ``batch_blocks`` timeouts.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from ..errors import ConfigError
from .keys import SCRIPTS, sha1hex
from .url import RemoteTarget

__all__ = ["Conn", "error_kind", "BREAKER_KINDS", "import_redis"]

log = logging.getLogger(__name__)

BREAKER_KINDS = frozenset({"connection", "timeout", "cluster"})   # the server is unreachable (not: it said no)


def import_redis() -> Any:
    try:
        import redis
        import redis.backoff
        import redis.cluster
        import redis.retry
    except ImportError as e:   # pragma: no cover - the remote extra is not installed
        raise ConfigError("the remote tier needs the 'redis' package (pip install 'redis>=5' hiredis)") from e
    return redis


def error_kind(exc: BaseException) -> str:
    """The ``REMOTE_ERROR_KINDS`` label of a failure (``tiered_kv_errors_total{tier="remote", error=...}``)."""
    from redis import exceptions as E
    if isinstance(exc, E.TimeoutError):
        return "timeout"
    if isinstance(exc, (E.ClusterError, E.RedisClusterException, E.AskError, E.TryAgainError,
                        E.ClusterCrossSlotError, E.ReadOnlyError)):
        return "cluster"    # CLUSTERDOWN, MOVED/ASK exhausted, a failed-over master that is a replica now
    if isinstance(exc, E.ConnectionError):
        return "connection"
    if isinstance(exc, E.ResponseError):
        text = str(exc)
        if isinstance(exc, E.OutOfMemoryError) or text.startswith("OOM") or "OOM command not allowed" in text:
            return "oom"
        if text.startswith(("CLUSTERDOWN", "MOVED", "ASK", "TRYAGAIN", "READONLY", "MASTERDOWN")):
            return "cluster"
        if isinstance(exc, E.NoScriptError) or "script" in text.lower():
            return "script"
        return "server_error"
    if isinstance(exc, (OSError, EOFError)):
        return "connection"
    return "server_error"


def _redirect_errors() -> tuple[type, ...]:
    from redis import exceptions as E
    return (E.AskError, E.TryAgainError)   # MovedError derives from AskError


class Conn:
    """A client (``redis.Redis`` or ``redis.RedisCluster``) built lazily -- a cluster client connects when
    built -- plus the scripts.  ``use_evalsha``: send ``EVALSHA`` (loading the scripts again when a
    server answers NOSCRIPT: restarted empty, failed over) instead of the whole script with ``EVAL``."""

    def __init__(self, target: RemoteTarget, timeout_s: float, use_evalsha: bool = True,
                 factory: Optional[Callable[[], Any]] = None, name: str = "remote") -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.use_evalsha = use_evalsha
        self.name = name
        self._factory = factory
        self._client: Any = None
        self._redis = import_redis()
        self.shas = {name: sha1hex(src.encode()) for name, src in SCRIPTS.items()}
        self.cluster = target.cluster

    # ------------------------------------------------------------------ client
    def client(self) -> Any:
        if self._client is None:
            self._client = self._factory() if self._factory is not None else self._build()
            self.cluster = isinstance(self._client, self._redis.RedisCluster)
        return self._client

    def _build(self) -> Any:
        r = self._redis
        t = self.target
        common: dict[str, Any] = dict(username=t.username, password=t.password, socket_timeout=self.timeout_s,
                                      socket_connect_timeout=self.timeout_s,
                                      retry=r.retry.Retry(r.backoff.NoBackoff(), 0))
        if t.tls:
            common["ssl"] = True
            opts = dict(t.tls_options)
            if "ssl_cert_reqs" in opts:
                common["ssl_cert_reqs"] = opts.pop("ssl_cert_reqs")
            common.update(opts)
        if t.cluster:
            nodes = [r.cluster.ClusterNode(h, p) for h, p in t.hosts]
            return r.RedisCluster(startup_nodes=nodes, **common)
        if t.unix_path is not None:
            common.pop("socket_connect_timeout")
            common.pop("ssl", None)
            return r.Redis(unix_socket_path=t.unix_path, db=t.db, health_check_interval=0, **common)
        host, port = t.hosts[0]
        return r.Redis(host=host, port=port, db=t.db, health_check_interval=0, **common)

    def reset(self) -> None:
        """Drop the client (its sockets) after a failed trip: the next one reconnects (a cluster: rediscovers)."""
        c, self._client = self._client, None
        if c is not None:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - closing a broken client
                log.debug("%s: closing the client failed", self.name, exc_info=True)

    close = reset

    # ------------------------------------------------------------------ commands
    def script(self, name: str, keys: list[Any], args: list[Any]) -> tuple[Any, ...]:
        """The command that runs script ``name``."""
        if self.use_evalsha:
            return ("EVALSHA", self.shas[name], len(keys), *keys, *args)
        return ("EVAL", SCRIPTS[name], len(keys), *keys, *args)

    def load_scripts(self) -> None:
        c = self.client()
        for name, src in SCRIPTS.items():
            sha = c.script_load(src)
            if sha != self.shas[name]:   # pragma: no cover - a server that hashes differently
                raise RuntimeError(f"SCRIPT LOAD of {name} answered {sha}, expected {self.shas[name]}")

    def ping(self) -> None:
        """One PING (a cluster: every primary), scripts loaded; raises when the server does not answer."""
        c = self.client()
        if self.cluster:
            c.ping(target_nodes=c.PRIMARIES)
        else:
            c.ping()
        if self.use_evalsha:
            self.load_scripts()

    def round_trip(self, cmds: list[tuple[Any, ...]]) -> list[Any]:
        """Send ``cmds`` in one pipeline; a result or an exception per command.  Raises when the whole trip fails."""
        self.client()   # built first: it says whether this is a cluster
        results = self._cluster_trip(cmds) if self.cluster else self._plain_trip(cmds)
        if self.use_evalsha:
            from redis.exceptions import NoScriptError
            again = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
            if again:   # restarted empty, failed over, SCRIPT FLUSH: load and send those once more, in order
                log.info("%s: the server lost its scripts (NOSCRIPT): loading them again", self.name)
                self.load_scripts()
                redo = [cmds[i] for i in again]
                for i, r in zip(again, self._cluster_trip(redo) if self.cluster else self._plain_trip(redo)):
                    results[i] = r
        return results

    def _plain_trip(self, cmds: list[tuple[Any, ...]]) -> list[Any]:
        pipe = self.client().pipeline(transaction=False)
        for c in cmds:
            pipe.execute_command(*c)
        return list(pipe.execute(raise_on_error=False))

    def _cluster_trip(self, cmds: list[tuple[Any, ...]]) -> list[Any]:
        from redis.cluster import PipelineCommand
        rc = self.client()
        stack = [PipelineCommand(c, {}, i) for i, c in enumerate(cmds)]
        # ClusterPipeline.evalsha is blocked as a method, not as a queued command: routed by its first key
        results = list(rc.pipeline().send_cluster_commands(stack, raise_on_error=False, allow_redirections=False))
        redirect = _redirect_errors()
        lost = False
        from redis.exceptions import ConnectionError, TimeoutError
        for i, r in enumerate(results):
            if isinstance(r, redirect):     # MOVED / ASK / TRYAGAIN: follow it, in submission order
                try:
                    results[i] = rc.execute_command(*cmds[i])
                except Exception as e:  # noqa: BLE001 - the command's own failure
                    results[i] = e
            elif isinstance(r, (ConnectionError, TimeoutError)):
                lost = True
        if lost:   # a node died or failed over: learn the new slot table before the next trip
            try:
                rc.nodes_manager.initialize()
            except Exception:  # noqa: BLE001 - the next trip fails and counts
                log.debug("%s: refreshing the cluster's slot table failed", self.name, exc_info=True)
        return results
