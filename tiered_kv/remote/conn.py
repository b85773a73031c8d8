"""One I/O thread's connection to the remote store: pipelined round trips, scripts, error kinds.

Each I/O thread of a :class:`~tiered_kv.remote.store.RemoteStore` owns one :class:`Conn` (its own
sockets: a big put batch never delays a fetch).  A round trip is one pipeline whose answer is one
result per command -- the value, or the exception that command got -- so every part of a batch fails
or succeeds on its own.  The trips run on links: connections that redis-py builds and connects (TLS,
credentials, db, timeouts) but whose commands and replies :mod:`.resp` writes and reads, so that a
block's payload goes out of and into its host slot without a copy (why: :mod:`.resp`).  Scripts are
loaded and servers pinged through the redis-py client itself.

redis-py does no retrying of its own here (``Retry(NoBackoff(), 0)``): the store's breaker decides.
On a cluster, each node's commands go down that node's link, and the store follows MOVED / ASK /
TRYAGAIN itself, one command at a time: a GET on the link of the node the redirection names
(``ASKING`` first for an ASK), so that its value is read into its slot or drained like any other
(never read whole: a foreign value may be hundreds of MiB), the others through the cluster client
(which sends ``ASKING`` and updates its slot table), while a timed-out node's commands simply fail:
following up each of them would cost one read timeout apiece, stalling the thread for
``batch_blocks`` timeouts.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any, Callable, Optional, Union

from ..errors import ConfigError
from .keys import SCRIPTS, sha1hex
from .resp import GetInto, Parts, Replies, pack
from .url import RemoteTarget

Cmd = Union[tuple[Any, ...], GetInto]   # a command: its arguments (a Parts among them), or a GET into a view

__all__ = ["Conn", "Cmd", "error_kind", "unreachable", "BREAKER_KINDS", "import_redis", "route_key", "plain"]

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


def unreachable(exc: BaseException) -> bool:
    """Whether a command's failure says the server is unreachable (what the circuit breaker counts): a
    connection or timeout error, or a cluster without a serving master -- not a slot being migrated
    (TRYAGAIN, ASK, or redis-py's redirects exhausted on one), where the server answered and the
    other slots work."""
    if error_kind(exc) not in BREAKER_KINDS:
        return False
    from redis import exceptions as E
    if isinstance(exc, (E.TryAgainError, E.AskError)):   # MovedError is an AskError
        return False
    text = str(exc)
    return not (text.startswith(("TRYAGAIN", "ASK", "MOVED"))
                or (isinstance(exc, E.ClusterError) and "TTL exhausted" in text))


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
        self._links: dict[str, _Link] = {}   # node name ("" standalone) -> the link its trips use
        self._redis = import_redis()
        self.shas = {name: sha1hex(src.encode()) for name, src in SCRIPTS.items()}
        self.cluster = target.cluster
        # ``closed``: set by close() (the owning thread, as it exits) or shut() (another thread, while the owner may
        # be mid trip); no connection is made after it.  ``guard``: shut() sets it under this lock, a link checks it
        # under this lock once connected, and the reader holds it while it touches a host slot after a trip.
        self.guard = threading.Lock()
        self.closed = False

    # ------------------------------------------------------------------ client
    def client(self) -> Any:
        self.check_open()
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
        """Drop the client and the links (their sockets) after a failed trip: the next one reconnects (a
        cluster: rediscovers)."""
        links, self._links = self._links, {}
        for link in links.values():
            link.close()
        c, self._client = self._client, None
        if c is not None:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - closing a broken client
                log.debug("%s: closing the client failed", self.name, exc_info=True)

    def close(self) -> None:
        """The owning thread's last call: drop the client and links, and make no connection again."""
        with self.guard:
            self.closed = True
        self.reset()

    def shut(self) -> None:
        """From another thread, while the owning one may be inside a round trip (store close: its grace ran
        out): no connection is made from now on, and the links' sockets are shut down -- not closed, so that
        redis-py does not reconnect them -- which makes a blocking send or read on them fail at once.  The
        owning thread drops them (and closes the conn as it exits)."""
        with self.guard:
            self.closed = True
            for link in list(self._links.values()):
                link.shut()

    def check_open(self) -> None:
        if self.closed:
            from redis.exceptions import ConnectionError
            raise ConnectionError(f"{self.name}: the connection to the remote store was closed")

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

    def round_trip(self, cmds: list[Cmd]) -> list[Any]:
        """Send ``cmds`` in one pipeline (a cluster: one per node); a result or an exception per command
        (after a lost connection, that failure for each command not answered).  Raises only when the
        client cannot be built (a cluster none of whose seeds answers)."""
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

    def _link(self, pool: Any, name: str) -> "_Link":
        link = self._links.get(name)
        if link is None:
            link = self._links[name] = _Link(pool, self)
        return link

    def _plain_trip(self, cmds: list[Cmd]) -> list[Any]:
        link = self._link(self.client().connection_pool, "")
        link.send(cmds)
        return link.read(cmds)

    def _cluster_trip(self, cmds: list[Cmd]) -> list[Any]:
        """Each node's commands in one pipeline on its own link (all sent, then all read); MOVED / ASK /
        TRYAGAIN followed one command at a time through the cluster client, in submission order.  After a
        lost node the slot table is learnt again, and the commands whose slot another node serves now (a
        failover) are sent there once more: every command the store sends may run twice."""
        rc = self.client()
        results: list[Any] = [None] * len(cmds)
        nodes = self._node_trips(rc, cmds, range(len(cmds)), results)
        from redis.exceptions import ConnectionError, TimeoutError
        lost = [i for i, r in enumerate(results) if isinstance(r, (ConnectionError, TimeoutError))]
        if lost and not self.closed:   # a node died or failed over: learn the new slot table, resend there
            try:
                rc.nodes_manager.initialize()
            except Exception:  # noqa: BLE001 - they keep their failure; the next trip fails and counts
                log.debug("%s: refreshing the cluster's slot table failed", self.name, exc_info=True)
            else:
                moved = [i for i in lost if self._node_of(rc, cmds[i]) not in (None, nodes.get(i))]
                self._node_trips(rc, cmds, moved, results)
        redirect = _redirect_errors()
        from redis.exceptions import AskError
        for i, r in enumerate(results):
            if isinstance(r, redirect):     # MOVED / ASK / TRYAGAIN: follow it, in submission order
                try:
                    self.check_open()          # shut: the store is closing, every command left fails at once
                    cmd = cmds[i]
                    got: Any = None
                    if isinstance(cmd, GetInto) and isinstance(r, AskError):   # (MovedError is an AskError)
                        got = self._follow(rc, cmd, r, nodes.get(i))
                    results[i] = rc.execute_command(*plain(cmd)) if got is None else got
                except Exception as e:  # noqa: BLE001 - the command's own failure
                    results[i] = e
        return results

    def _follow(self, rc: Any, cmd: GetInto, err: Any, origin: Optional[str]) -> Any:
        """A GET a MOVED or an ASK sent elsewhere, sent again on this store's own link to the node it names
        (``ASKING`` first for an ASK; a MOVED patches the client's slot table, as redis-py's own handling does):
        its value is read as every GET's is (:mod:`.resp`: into the part's view, or drained in pieces), never
        whole.  None where the client does not know that node, or the node redirects the GET again (TRYAGAIN, a
        second MOVED): the caller follows it through the cluster client then (its refresh and redirect limit)."""
        from redis.exceptions import MovedError
        nm = rc.nodes_manager
        host, port = err.host, err.port
        if not host and origin:   # a node with no announced endpoint: the one the GET went to (as redis-py does)
            host = origin.rsplit(":", 1)[0]
            err.host, err.node_addr = host, (host, port)   # (move_slot below reads the error's address)
        if not host:
            return None
        moved = isinstance(err, MovedError)
        if moved and hasattr(nm, "move_slot"):
            nm.move_slot(err)   # the slot's owner from now on (and a node not known yet joins the client's cache)
        remap = getattr(nm, "remap_host_port", None)
        if remap is not None:
            host, port = remap(host, port)
        node = nm.get_node(host=host, port=port)
        if node is None:
            return None
        link = self._link(rc.get_redis_connection(node).connection_pool, node.name)
        seq: list[Cmd] = [cmd] if moved else [("ASKING",), cmd]
        link.send(seq)
        reply = link.read(seq)[-1]
        return None if isinstance(reply, _redirect_errors()) else reply

    @staticmethod
    def _node_of(rc: Any, cmd: Cmd) -> Optional[str]:
        try:
            return str(rc.nodes_manager.get_node_from_slot(rc.keyslot(route_key(cmd))).name)
        except Exception:  # noqa: BLE001 - no node serves the slot
            return None

    def _node_trips(self, rc: Any, cmds: list[Cmd], which: Any, results: list[Any]) -> dict[int, str]:
        """Send the commands ``which`` (indices), grouped by node, and store their replies in ``results``;
        the node each went to."""
        groups: dict[str, tuple[_Link, list[int]]] = {}
        sent_to: dict[int, str] = {}
        for i in which:
            try:
                node = rc.nodes_manager.get_node_from_slot(rc.keyslot(route_key(cmds[i])))
                link = self._link(rc.get_redis_connection(node).connection_pool, node.name)
            except Exception as e:  # noqa: BLE001 - a slot no node serves (CLUSTERDOWN): this command fails
                results[i] = e
                continue
            groups.setdefault(node.name, (link, []))[1].append(i)
            sent_to[i] = node.name
        for link, idx in groups.values():
            link.send([cmds[i] for i in idx])
        for link, idx in groups.values():
            for i, r in zip(idx, link.read([cmds[i] for i in idx])):
                results[i] = r
        return sent_to


def route_key(cmd: Cmd) -> Any:
    """The key a command is routed by on a cluster (every key of one of the store's commands shares its slot)."""
    if isinstance(cmd, GetInto):
        return cmd.name
    return cmd[3] if cmd[0] in ("EVALSHA", "EVAL") else cmd[1]


def plain(cmd: Cmd) -> tuple[Any, ...]:
    """``cmd`` as redis-py's ``execute_command`` takes it (a :class:`Parts` joined, a :class:`GetInto` a plain GET)."""
    if isinstance(cmd, GetInto):
        return ("GET", cmd.name)
    return tuple(a.join() if isinstance(a, Parts) else a for a in cmd)


class _Link:
    """One connection whose replies only :mod:`.resp` reads: built from a client's pool settings (host,
    TLS, credentials, db, timeouts; ``connect`` is redis-py's), never returned to the pool.  A failed
    send or read drops it (the stream is mid-reply); the next trip connects again."""

    def __init__(self, pool: Any, owner: Conn) -> None:
        self.owner = owner
        kw = dict(pool.connection_kwargs)
        kw["protocol"] = 2   # what .resp speaks (redis-py may default to RESP3: HELLO 3)
        self.conn = pool.connection_class(**kw)
        self.replies: Optional[Replies] = None
        self.failed: Optional[BaseException] = None

    def send(self, cmds: list[Cmd]) -> None:
        self.failed = None
        try:
            if self._stale():
                self.close()   # the server closed it while idle (its timeout, a proxy, a restart): reconnect
            if getattr(self.conn, "_sock", None) is None:
                self.conn.connect()
                with self.owner.guard:   # Conn.shut() ran while connecting: it did not see this socket
                    self.owner.check_open()
            self.conn.send_packed_command(pack(cmds), check_health=False)
        except Exception as e:  # noqa: BLE001 - every command of this trip fails with it
            self._drop(e)

    def read(self, cmds: list[Cmd]) -> list[Any]:
        """A reply per command sent (an error reply as its exception); after a failure, the failure."""
        out: list[Any] = []
        if self.failed is None:
            try:
                r = self._replies()
                for c in cmds:
                    out.append(r.read(c if isinstance(c, GetInto) else None))
            except Exception as e:  # noqa: BLE001 - this command and the ones after it fail with it
                self._drop(e)
        if len(out) < len(cmds):
            out.extend([self.failed] * (len(cmds) - len(out)))
        return out

    def _stale(self) -> bool:
        """An idle link whose socket has something to read -- EOF, or bytes no command asked for -- or whose
        reply buffer is not empty cannot carry the next trip (what redis-py's pool checks before lending a
        connection: ``can_read``, one poll without waiting)."""
        if getattr(self.conn, "_sock", None) is None:
            return False
        if self.replies is not None and self.replies.buffered:
            return True
        try:
            return bool(self.conn.can_read(timeout=0))
        except Exception:  # noqa: BLE001 - a closed or broken socket: reconnect
            return True

    def _replies(self) -> Replies:
        sock = getattr(self.conn, "_sock", None)   # redis-py's connected socket (plain, unix or TLS)
        if sock is None:
            from redis.exceptions import ConnectionError
            raise ConnectionError("the connection to the remote store is closed")
        if self.replies is None or self.replies.sock is not sock:
            from redis._parsers import BaseParser
            self.replies = Replies(sock, BaseParser.parse_error)
        return self.replies

    def _drop(self, e: BaseException) -> None:
        self.failed = e
        self.close()

    def shut(self) -> None:
        """From another thread (Conn.shut): a blocking call on the socket returns; the owning thread drops it."""
        sock = getattr(self.conn, "_sock", None)
        if sock is not None:
            try:
                socket.socket.shutdown(sock, socket.SHUT_RDWR)   # the plain socket's (TLS: no SSL state touched)
            except OSError:
                pass   # closed meanwhile by its thread, or never connected

    def close(self) -> None:
        self.replies = None
        try:
            self.conn.disconnect()
        except Exception:  # noqa: BLE001 - closing a broken connection
            log.debug("closing a remote store connection failed", exc_info=True)
