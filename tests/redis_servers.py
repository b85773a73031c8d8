"""Real Redis servers for the remote tier's tests: standalone, a 3-master cluster, a replicated cluster.

Every server is a ``redis-server`` child on a free loopback port with its own temporary directory,
no persistence (``--save "" --appendonly no``) and the DEBUG command enabled (fault tests use
``DEBUG SLEEP``).  Nothing waits with a fixed sleep: readiness and cluster agreement are polled
with a deadline.

Fixtures (register the module with ``pytest_plugins = ["redis_servers"]`` in tests/conftest.py,
whose ``sys.path`` insert makes ``tests/`` importable):

* ``redis_server`` (session): one standalone :class:`RedisServer` shared by the session.
* ``redis_url`` (function): ``redis_server``'s url, the server up, unpaused, default config, empty.
* ``fresh_redis`` (function): a private standalone server the test may kill, restart, pause, reconfigure.
* ``redis_server_factory`` (function): ``make(*args, start=True)`` -> a private :class:`RedisServer`
  with extra ``redis-server`` arguments (e.g. ``"--maxmemory", "2mb"``), stopped at teardown.
* ``redis_cluster`` (session): a :class:`RedisCluster` of 3 masters, no replicas.
* ``redis_cluster_url`` (function): ``redis_cluster``'s url, the cluster flushed and stable.
* ``redis_cluster_replicated`` (function): 3 masters + 3 replicas, ``cluster-node-timeout`` 1000 ms,
  for failover tests (:meth:`RedisCluster.kill_master`, :meth:`RedisCluster.failover`).

Helpers: :func:`tls_args` (a TLS port with a throw-away CA, for ``redis_server_factory``),
:meth:`RedisCluster.begin_migration` / :meth:`~RedisCluster.move_keys` / :meth:`~RedisCluster.finish_migration`
(a slot migration in steps: ASK while it runs, MOVED after), :meth:`RedisServer.pause` (``CLIENT PAUSE``)
and :meth:`RedisServer.sleep` (``DEBUG SLEEP``).

Without ``redis-server`` on PATH the fixtures skip, except when the environment variable ``CI`` is
set: CI installs it (ci/install_redis.sh), so there it is a failure.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable, Optional

import pytest

logger = logging.getLogger(__name__)

__all__ = ["RedisServer", "RedisCluster", "require_redis", "free_port", "tls_args", "REDIS_SERVER", "REDIS_CLI",
           "redis_server", "redis_url", "fresh_redis", "redis_server_factory", "redis_cluster",
           "redis_cluster_url", "redis_cluster_replicated"]

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
READY_S = 15.0          # deadline for a server to answer PING / a cluster to agree
STOP_S = 5.0            # SIGTERM, then SIGKILL after this long

_LIVE: set["RedisServer"] = set()   # stopped at exit if a teardown never ran (an interrupted session)


def require_redis() -> None:
    """Skip (or, under ``CI``, fail) when the redis binaries are missing."""
    if REDIS_SERVER and REDIS_CLI:
        return
    msg = ("redis-server / redis-cli are not on PATH (Debian: apt-get install redis-server; "
           "CI installs them with ci/install_redis.sh)")
    if os.environ.get("CI"):
        pytest.fail(msg + " -- and CI is set, so this is a failure", pytrace=False)
    pytest.skip(msg)


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (the server retries another if it is taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tls_args(workdir: str) -> tuple[list[str], str, int]:
    """``redis-server`` arguments for a TLS port beside the plain one (a CA and a server certificate for
    127.0.0.1 made with ``openssl`` in ``workdir``): (arguments, the CA file, the TLS port).  Skips
    without ``openssl``."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not on PATH")
    ca_key, ca, key, csr, crt = (os.path.join(workdir, n)
                                 for n in ("ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem"))
    ext = os.path.join(workdir, "san.ext")
    with open(ext, "w", encoding="ascii") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, timeout=60)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "2",
        "-subj", "/CN=tiered-kv test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", crt, "-days", "2",
        "-extfile", ext)
    port = free_port()
    return (["--tls-port", str(port), "--tls-cert-file", crt, "--tls-key-file", key, "--tls-ca-cert-file", ca,
             "--tls-auth-clients", "no"], ca, port)


def _poll(what: str, cond: Callable[[], bool], deadline_s: float = READY_S, every: float = 0.02) -> None:
    """Call ``cond`` until it is true; fail with ``what`` after ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            if cond():
                return
        except Exception as e:   # a server not up yet: keep polling
            last: Optional[BaseException] = e
        else:
            last = None
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not within {deadline_s} s (last error: {last!r})")
        time.sleep(every)


class RedisServer:
    """One ``redis-server`` child process on ``127.0.0.1:port``.

    ``stop()`` kills it (SIGKILL: a crash, nothing flushed), ``start()`` brings it back on the same port,
    empty; ``terminate()`` is the orderly end.  ``pause()`` / ``sleep()`` make it unresponsive for a while.
    """

    def __init__(self, workdir: str, *extra: str, port: Optional[int] = None, cluster: bool = False,
                 node_timeout_ms: int = 5000) -> None:
        self.workdir = workdir
        self.extra = tuple(extra)
        self.cluster = cluster
        self.node_timeout_ms = node_timeout_ms
        self.port = port or free_port()
        self.bus_port = free_port() if cluster else 0
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self._fixed_port = port is not None
        self._sleeper: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir, f"redis-{self.port}.log")

    def _argv(self) -> list[str]:
        assert REDIS_SERVER is not None
        argv = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self.workdir, "--daemonize", "no", "--logfile", self.log_path,
                "--enable-debug-command", "yes", "--protected-mode", "no"]
        if self.cluster:
            argv += ["--cluster-enabled", "yes", "--cluster-config-file", os.path.join(self.workdir, "nodes.conf"),
                     "--cluster-node-timeout", str(self.node_timeout_ms), "--cluster-port", str(self.bus_port)]
        return argv + list(self.extra)

    def start(self) -> "RedisServer":
        """Start (again, on the same port after a ``stop()``: empty) and wait until it answers PING."""
        if self.alive:
            return self
        for attempt in range(5):
            if self.cluster:   # a restarted cluster node must not reload its old identity
                try:
                    os.unlink(os.path.join(self.workdir, "nodes.conf"))
                except FileNotFoundError:
                    pass
            self.proc = subprocess.Popen(self._argv(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)
            _LIVE.add(self)
            try:
                _poll(f"redis-server on {self.addr}", self._ready)
                return self
            except TimeoutError:
                self.stop()
                if self._fixed_port or attempt == 4:
                    raise RuntimeError(f"redis-server on {self.addr} did not start: {self._log_tail()}") from None
                logger.info("redis-server on %s did not start (port taken?), trying another port", self.addr)
                self.port = free_port()   # taken between free_port() and bind: another one
                if self.cluster:
                    self.bus_port = free_port()
        raise AssertionError("unreachable")

    def _ready(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise TimeoutError("exited")   # not worth waiting for: retry on another port at once
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))   # up (a --requirepass server says NOAUTH)

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-10:])
        except OSError:
            return "(no log)"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGKILL (a crash) and reap; idempotent."""
        p = self.proc
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(STOP_S)
        _LIVE.discard(self)

    def terminate(self) -> None:
        """SIGTERM, wait, SIGKILL after ``STOP_S``; idempotent."""
        p = self.proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(STOP_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(STOP_S)
        if self._sleeper is not None:
            self._sleeper.join(STOP_S)
        _LIVE.discard(self)

    def restart(self) -> "RedisServer":
        """Kill and start again on the same port: the server comes back empty (no script cache either)."""
        self.stop()
        return self.start()

    def client(self, **kw: Any) -> Any:
        import redis
        kw.setdefault("socket_timeout", 5.0)
        kw.setdefault("socket_connect_timeout", 5.0)
        return redis.Redis(host="127.0.0.1", port=self.port, **kw)

    def command(self, *args: Any) -> Any:
        """One command on a short-lived connection."""
        c = self.client()
        try:
            return c.execute_command(*args)
        finally:
            c.close()

    def flush(self) -> None:
        self.command("FLUSHALL")

    def pause(self, seconds: float, mode: str = "ALL") -> None:
        """``CLIENT PAUSE``: every client's commands (``mode="WRITE"``: writes and scripts) wait ``seconds``.

        Returns at once; the server holds the replies, connections stay open (a read timeout, not a
        refusal).  In ``ALL`` mode a new connection's handshake and ``CLIENT UNPAUSE`` itself wait too
        (Redis 7.0): choose a ``seconds`` the test can wait out."""
        self.command("CLIENT", "PAUSE", int(seconds * 1000), mode)

    def unpause(self) -> None:
        """``CLIENT UNPAUSE`` (a ``WRITE`` pause; an ``ALL`` pause holds this command too, until it ends)."""
        self.command("CLIENT", "UNPAUSE")

    def sleep(self, seconds: float) -> threading.Event:
        """``DEBUG SLEEP`` from a helper thread: the whole server blocks ``seconds`` (PING too).

        Returns an event set once the server is blocked (the command was sent and the server stopped
        answering another connection's PING) -- no sleep orders the test."""
        started = threading.Event()

        def run() -> None:
            c = self.client(socket_timeout=seconds + 10)
            try:
                c.execute_command("DEBUG", "SLEEP", seconds)
            except Exception:  # noqa: BLE001 - killed meanwhile
                pass
            finally:
                c.close()

        self._sleeper = threading.Thread(target=run, name=f"redis-sleep-{self.port}", daemon=True)
        self._sleeper.start()

        def blocked() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.settimeout(0.2)
                    s.sendall(b"PING\r\n")
                    s.recv(16)
                    return False
            except (socket.timeout, TimeoutError):
                return True
        _poll(f"DEBUG SLEEP on {self.addr}", blocked, deadline_s=min(READY_S, seconds))
        started.set()
        return started

    def reset(self) -> None:
        """Back to the session defaults: up, unpaused, no memory limit, empty."""
        if not self.alive:
            self.start()
        if self._sleeper is not None:
            self._sleeper.join(READY_S)
            self._sleeper = None
        c = self.client()
        try:
            c.execute_command("CLIENT", "UNPAUSE")
            c.config_set("maxmemory", 0)
            c.config_set("maxmemory-policy", "noeviction")
            c.execute_command("SCRIPT", "FLUSH")
            c.flushall()
        finally:
            c.close()

    def __repr__(self) -> str:
        return f"RedisServer({self.addr}, alive={self.alive})"


class RedisCluster:
    """A Redis Cluster of ``masters`` masters (and ``replicas`` replicas each) made by ``redis-cli --cluster create``.

    ``url`` is the store's form (``redis+cluster://h1:p1,h2:p2,...``, the masters as seeds).
    """

    def __init__(self, workdir: str, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 5000) -> None:
        self.workdir = workdir
        self.n_masters = masters
        self.n_replicas = replicas
        self.nodes: list[RedisServer] = []
        for i in range(masters * (1 + replicas)):
            d = os.path.join(workdir, f"node{i}")
            os.makedirs(d, exist_ok=True)
            self.nodes.append(RedisServer(d, cluster=True, node_timeout_ms=node_timeout_ms))

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(n.addr for n in self.nodes[:self.n_masters])

    @property
    def seeds(self) -> list[RedisServer]:
        return self.nodes[:self.n_masters]

    def start(self) -> "RedisCluster":
        for n in self.nodes:
            n.start()
        assert REDIS_CLI is not None
        argv = [REDIS_CLI, "--cluster", "create", *[n.addr for n in self.nodes],
                "--cluster-replicas", str(self.n_replicas), "--cluster-yes"]
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {r.stdout[-2000:]!r} {r.stderr[-2000:]!r}")
        self.wait_stable()
        return self

    # -- state --------------------------------------------------------------------------------------------

    def live_nodes(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.alive]

    def _view(self, node: RedisServer) -> list[list[str]]:
        raw = node.command("CLUSTER", "NODES")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return [line.split() for line in text.splitlines() if line.strip()]

    def masters(self) -> list[RedisServer]:
        """The live nodes that are masters with slots (as the first live node sees it)."""
        by_port = {n.port: n for n in self.nodes}
        out = []
        for f in self._view(self.live_nodes()[0]):
            port = int(f[1].split("@")[0].rsplit(":", 1)[1])
            if "master" in f[2] and "fail" not in f[2] and len(f) > 8 and port in by_port and by_port[port].alive:
                out.append(by_port[port])
        return out

    def node_id(self, node: RedisServer) -> str:
        return str(node.command("CLUSTER", "MYID").decode())

    def replica_of(self, master: RedisServer) -> RedisServer:
        mid = self.node_id(master)
        by_port = {n.port: n for n in self.nodes}
        for f in self._view(master):
            if "slave" in f[2] and f[3] == mid:
                return by_port[int(f[1].split("@")[0].rsplit(":", 1)[1])]
        raise LookupError(f"{master} has no replica")

    def master_of_slot(self, slot: int) -> RedisServer:
        by_port = {n.port: n for n in self.nodes}
        for lo, hi, master, *_ in self.live_nodes()[0].command("CLUSTER", "SLOTS"):
            if lo <= slot <= hi:
                return by_port[int(master[1])]
        raise LookupError(f"slot {slot} is not served")

    def wait_stable(self, deadline_s: float = READY_S) -> None:
        """Until every live node says ``cluster_state:ok`` and all agree on who serves every slot
        (and, with replicas, each master has a replica in sync)."""
        def ok() -> bool:
            live = self.live_nodes()
            views = set()
            for n in live:
                info = n.command("CLUSTER", "INFO").decode()
                if "cluster_state:ok" not in info:
                    return False
                views.add(tuple(sorted((int(lo), int(hi), int(m[1])) for lo, hi, m, *_ in
                                       n.command("CLUSTER", "SLOTS"))))
            if len(views) != 1:
                return False
            if sum(hi - lo + 1 for lo, hi, _ in next(iter(views))) != 16384:
                return False
            if self.n_replicas:
                for n in live:
                    role = n.command("ROLE")
                    if role[0] == b"slave" and role[3] != b"connected":
                        return False
            return True
        _poll(f"cluster of {len(self.nodes)} nodes stable", ok, deadline_s, every=0.05)

    # -- faults -------------------------------------------------------------------------------------------

    def kill_master(self, master: RedisServer) -> RedisServer:
        """SIGKILL ``master``; its replica takes over on its own after ``cluster-node-timeout``
        (``failover()`` forces it at once).  Returns the replica."""
        replica = self.replica_of(master)
        master.stop()
        return replica

    def failover(self, replica: RedisServer, takeover: bool = True) -> None:
        """Make ``replica`` the master of its slots: ``CLUSTER FAILOVER TAKEOVER`` (its master is dead) or a
        coordinated ``CLUSTER FAILOVER`` (alive); wait until the cluster agrees."""
        if takeover:
            replica.command("CLUSTER", "FAILOVER", "TAKEOVER")
        else:
            replica.command("CLUSTER", "FAILOVER")
        _poll(f"{replica} promoted", lambda: replica.command("ROLE")[0] == b"master")
        self._wait_agree()

    def _wait_agree(self) -> None:
        def agree() -> bool:
            views = set()
            for n in self.live_nodes():
                if "cluster_state:ok" not in n.command("CLUSTER", "INFO").decode():
                    return False
                views.add(tuple(sorted((int(lo), int(hi), int(m[1])) for lo, hi, m, *_ in
                                       n.command("CLUSTER", "SLOTS"))))
            return len(views) == 1
        _poll("cluster agrees after failover", agree, every=0.05)

    # -- slot migration (forces MOVED / ASK) ----------------------------------------------------------------

    def begin_migration(self, slot: int, src: RedisServer, dst: RedisServer) -> None:
        """``dst`` IMPORTING, ``src`` MIGRATING ``slot``: keys already moved answer ASK, new keys too."""
        dst.command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(src))
        src.command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(dst))

    def move_keys(self, slot: int, src: RedisServer, dst: RedisServer, count: int = 1000) -> int:
        """MIGRATE up to ``count`` of ``slot``'s keys from ``src`` to ``dst``; how many moved."""
        keys = src.command("CLUSTER", "GETKEYSINSLOT", slot, count)
        if keys:
            src.command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "REPLACE", "KEYS", *keys)
        return len(keys)

    def finish_migration(self, slot: int, dst: RedisServer) -> None:
        """Assign ``slot`` to ``dst`` everywhere (after its keys moved): clients get MOVED from then on."""
        did = self.node_id(dst)
        for n in self.live_nodes():
            n.command("CLUSTER", "SETSLOT", slot, "NODE", did)
        self._wait_agree()

    def migrate_slot(self, slot: int, dst: RedisServer) -> RedisServer:
        """The whole migration of ``slot`` to ``dst``; returns the old owner."""
        src = self.master_of_slot(slot)
        if src is dst:
            return src
        self.begin_migration(slot, src, dst)
        while self.move_keys(slot, src, dst):
            pass
        self.finish_migration(slot, dst)
        return src

    @staticmethod
    def keyslot(key: bytes) -> int:
        from redis.crc import key_slot
        return int(key_slot(key))

    # -- clients ------------------------------------------------------------------------------------------

    def client(self, **kw: Any) -> Any:
        import redis
        from redis.cluster import ClusterNode
        kw.setdefault("socket_timeout", 5.0)
        kw.setdefault("socket_connect_timeout", 5.0)
        return redis.RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in self.live_nodes()], **kw)

    def flush(self) -> None:
        """FLUSHALL (and SCRIPT FLUSH) on every live master."""
        for n in self.masters():
            n.command("FLUSHALL")
            n.command("SCRIPT", "FLUSH")

    def stop(self) -> None:
        for n in self.nodes:
            n.terminate()

    def __repr__(self) -> str:
        return f"RedisCluster({self.url}, replicas={self.n_replicas})"


@atexit.register
def _kill_leftovers() -> None:
    for s in list(_LIVE):
        s.stop()


# -- fixtures -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    require_redis()
    s = RedisServer(str(tmp_path_factory.mktemp("redis"))).start()
    try:
        yield s
    finally:
        s.terminate()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session server's url; up, unpaused, default memory config, empty, no cached scripts."""
    redis_server.reset()
    return redis_server.url


@pytest.fixture
def redis_server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., RedisServer]]:
    """``make(*redis_server_args, start=True)``: private servers, all stopped when the test ends."""
    require_redis()
    made: list[RedisServer] = []

    def make(*extra: str, start: bool = True) -> RedisServer:
        s = RedisServer(str(tmp_path_factory.mktemp("redis-private")), *extra)
        made.append(s)
        return s.start() if start else s

    try:
        yield make
    finally:
        for s in made:
            s.terminate()


@pytest.fixture
def fresh_redis(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    """A private standalone server, started; the test may kill / restart / pause it."""
    return redis_server_factory()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    require_redis()
    c = RedisCluster(str(tmp_path_factory.mktemp("redis-cluster")))
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture
def redis_cluster_url(redis_cluster: RedisCluster) -> str:
    """The session cluster's url, flushed; all nodes up and agreeing."""
    for n in redis_cluster.nodes:
        if not n.alive:   # a test killed one: the session cluster can't heal that
            pytest.fail(f"{n} of the session cluster is dead: tests that kill nodes use redis_cluster_replicated")
    redis_cluster.flush()
    redis_cluster.wait_stable()
    return redis_cluster.url


@pytest.fixture
def redis_cluster_replicated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """3 masters + 3 replicas, ``cluster-node-timeout`` 1000 ms: the test may kill masters."""
    require_redis()
    c = RedisCluster(str(tmp_path_factory.mktemp("redis-cluster-rep")), replicas=1, node_timeout_ms=1000)
    try:
        c.start()
        yield c
    finally:
        c.stop()
