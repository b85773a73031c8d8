"""Third adversarial review of the remote tier (tiered_kv/remote/*, core/remote_tier.py and its use in core/tiers.py).

What it proved wrong, each pinned by a test that failed before its fix:

1. a put whose round trip timed out (answered failed) was still delivered and run by the server later: it was
   published after the tombstone of an invalidation made after that answer expired (the invalidated value was back); the publish script now refuses a put past a deadline half a
   tombstone's lifetime after its send (``keys.LATE_CHECK``);
2. close() returned while an I/O thread was still in a round trip: that thread then wrote a fetched value into the
   host slab after TierManager.close() returned (the slab is freed with the manager: a use after free), and its
   connection was never closed;
3. a remote-fetched block evicted before any lookup found it kept its "landed" mark: the engine's own later store
   of the key was counted as a remote hit;
4. a fetch the reader refused after its probe (full, or the breaker opened meanwhile) had already evicted host blocks
   for its reservations, and was neither counted as shed nor said anywhere; the reader's room is now taken first
   (``take_fetch_room``);
5. both I/O threads queued a report before releasing the room its parts held: an owner that applies it at once sees
   the put queue / the reader still full and sheds;
6. RemoteStore accepted a namespace no entry header can hold (> 65535 bytes) or that is not UTF-8: every put then
   killed the writer thread, and the fourth turned the tier off;
7. the url parser took "1_0" as database 10, "+1" as 1, and the last of a repeated db parameter silently (the
   port check refuses such digits);
8. a url's password for the default user ('redis://:pw@host') was sent as the environment's user name's.

The plain test at the end pins a guarantee checked here that holds (a token tombstone refuses the same late
delivery).  Orderings are forced with a monkeypatched round trip or report queue, or a relay that holds bytes --
never by sleeping; finding 1 polls the server until a tombstone's TTL ran out.
"""

from __future__ import annotations

import socket
import threading
import uuid
from typing import Any, Optional

import pytest

from test_remote_resp_faults import Proxy
from test_remote_store import WAIT_S, blocks, poll, rig  # noqa: F401  (rig: the fixture)
from test_remote_tier import DEADLINE_S, NS, ROW, managers, remote_config, store_all, until  # noqa: F401
from tiered_kv.errors import ConfigError
from tiered_kv.jobs import JobKind

pytest.importorskip("redis", reason="the remote tier needs the redis package (pip install redis hiredis)")

import redis.exceptions as RE  # noqa: E402

pytestmark = pytest.mark.timeout(180)

SET_CMD = b"$3\r\nSET\r\n"   # how a put's staging SET travels in RESP


def settled(mgr: Any) -> bool:
    core = mgr._core
    return core.n_in_flight[JobKind.FETCH] == 0 and core.remote.want_token is None


# --------------------------------------------------------------------------- a relay that holds a write
class HoldingRelay(Proxy):
    """``127.0.0.1:port`` relaying to a server.  :meth:`arm`: the next client->server chunk holding ``trigger``,
    and everything after it on that connection, is held (not forwarded) -- the network delaying a write -- until
    :meth:`deliver` forwards it, lets the server answer and waits until the server closed that connection."""

    def __init__(self, upstream_port: int) -> None:
        self._trigger: Optional[bytes] = None
        self.caught = threading.Event()
        self._held: Optional[dict[str, Any]] = None
        super().__init__(upstream_port)   # the listening socket, url and close() of test_remote_resp_faults' Proxy

    def arm(self, trigger: bytes) -> None:
        with self._lock:
            self._trigger = trigger

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
            up.settimeout(None)
            self._socks += [c, up]
            st: dict[str, Any] = {"buf": bytearray(), "holding": False, "down": None, "up": up, "tail": b""}
            down = threading.Thread(target=self._s2c, args=(c, up), daemon=True)
            st["down"] = down
            threading.Thread(target=self._c2s, args=(c, up, st), daemon=True).start()
            down.start()

    def _c2s(self, c: socket.socket, up: socket.socket, st: dict[str, Any]) -> None:
        try:
            while True:
                data = c.recv(1 << 16)
                if not data:
                    break
                window, st["tail"] = st["tail"] + data, data[-16:]   # a trigger split over two chunks
                with self._lock:
                    if not st["holding"] and self._trigger is not None and self._trigger in window:
                        self._trigger = None
                        st["holding"] = True
                        self._held = st
                        self.caught.set()
                    if st["holding"]:
                        st["buf"] += data
                        continue
                up.sendall(data)
        except OSError:
            pass
        with self._lock:
            if st["holding"]:
                return   # the client gave up: its bytes are still on their way (held)
        try:
            up.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    @staticmethod
    def _s2c(c: socket.socket, up: socket.socket) -> None:
        client_gone = False
        try:
            while True:
                data = up.recv(1 << 16)
                if not data:
                    break
                if not client_gone:
                    try:
                        c.sendall(data)
                    except OSError:
                        client_gone = True
        except OSError:
            pass
        try:
            c.close()
        except OSError:
            pass

    def deliver(self) -> None:
        """Forward the held bytes, end that connection's writes, and wait until the server answered them and
        closed it (it runs what it read before it sees the end of the stream)."""
        st = self._held
        assert st is not None, "nothing held"
        up: socket.socket = st["up"]
        up.sendall(bytes(st["buf"]))
        up.shutdown(socket.SHUT_WR)
        st["down"].join(WAIT_S)
        assert not st["down"].is_alive(), "the server did not answer the held bytes"


@pytest.fixture
def relay(redis_server: Any) -> Any:
    r = HoldingRelay(redis_server.port)
    yield r
    r.close()


# =========================================================================== findings
# --------------------------------------------------------------------------- 1. a late put outlives its tombstone
def test_a_put_answered_failed_is_not_published_after_a_later_invalidations_tomb_expired(
        rig: Any, relay: HoldingRelay, redis_url: str, redis_server: Any) -> None:  # noqa: F811
    opts = dict(timeout_s=0.3, write_deadline_s=0.3, tomb_ttl_seconds=2)   # 2 > 2 x (0.3 + 2 x 0.3): the bound holds
    a = rig.open(relay.url, **opts)             # machine A, its link to the server delays the write
    b = rig.open(redis_url, **opts)             # machine B, next to the server
    keys, data = blocks(1)
    relay.arm(SET_CMD)
    a.put_async(keys, data)
    r = a.report()
    assert relay.caught.is_set() and not r.ok and r.error == "timeout", r   # A: the write failed, nothing landed
    raw = redis_server.client()
    value, tomb = a.names.value(keys[0]), a.names.tomb(keys[0])
    assert raw.exists(value) == 0
    b.store.invalidate(keys[0])                 # after A's write was answered: it must never come back
    assert b.store.wait_writes(WAIT_S)
    assert raw.exists(tomb) == 1
    poll("the tombstone's ttl ran out", lambda: raw.exists(tomb) == 0)
    relay.deliver()                             # the network delivers A's old bytes
    r, got = b.fetch(keys)
    assert r.failed == {0: "miss"} and got == [None], (
        "a write answered failed before the key was invalidated was published afterwards and is served")


# --------------------------------------------------------------------------- 2. an I/O thread outlives close()
def test_no_io_thread_touches_the_host_slab_after_close_returned(
        redis_url: str, managers: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    from tiered_kv.core import tiers
    from tiered_kv.remote import store as remote_store_mod
    a = managers(remote_config(redis_url))
    b = managers(remote_config(redis_url, remote_timeout_seconds=0.2))
    k = b"review3-fetch-across-close"
    store_all(a, [k])
    assert a.flush(timeout=DEADLINE_S)
    store = b._core.remote.store
    reader = store._r
    real = reader.conn.round_trip
    gate, entered = threading.Event(), threading.Event()
    real_shut = reader.conn.shut

    def shut() -> None:   # what shutting a socket does to a read blocked on it: the read returns at once
        real_shut()
        gate.set()

    def round_trip(cmds: list[Any]) -> list[Any]:
        if any(type(c).__name__ == "GetInto" for c in cmds):   # the fetch (not the probe) is held on the wire
            client = reader.conn._client
            entered.set()
            gate.wait(WAIT_S)
            if reader.conn._client is not client:   # its sockets were shut under it meanwhile: the read fails
                raise RE.ConnectionError("the connection was closed under the round trip (test)")
        return real(cmds)

    monkeypatch.setattr(reader.conn, "round_trip", round_trip)
    monkeypatch.setattr(reader.conn, "shut", shut)
    monkeypatch.setattr(tiers, "CLOSE_TIMEOUT_S", 0.2)                 # shorter bounds, same code path
    monkeypatch.setattr(remote_store_mod, "SHUT_JOIN_S", 1.0)          # (the held trip outlasts it unless shut)
    real_close = store.close
    monkeypatch.setattr(store, "close", lambda timeout=5.0: real_close(timeout=0.1))
    assert b.lookup([k]) == 0
    until(lambda: entered.is_set(), b, "the fetch on the wire")
    slot = next(e.slot for e in b._core.index.entries() if e.key == k)
    host = b._host_rows                 # kept alive here; the manager's own reference may go at any time
    b.close()
    alive = reader._thread.is_alive()
    before = bytes(host[slot].numpy())
    gate.set()
    reader._thread.join(WAIT_S)
    after = bytes(host[slot].numpy())
    open_links = [n for n, link in reader.conn._links.items() if getattr(link.conn, "_sock", None) is not None]
    assert not alive and after == before and not open_links, (
        f"close() returned with the reader alive={alive}; it then wrote into the host slab "
        f"(changed={after != before}) and left {len(open_links)} link(s) open")


# --------------------------------------------------------------------------- 3. a stale landed mark miscounts hits
def test_a_block_the_engine_stored_itself_is_not_counted_as_a_remote_hit(redis_url: str, managers: Any) -> None:
    from disk_helpers import keys as make_keys, metric
    a = managers(remote_config(redis_url))
    b = managers(remote_config(redis_url, host_slots=4))
    k = b"review3-landed-then-evicted"
    store_all(a, [k])
    assert a.flush(timeout=DEADLINE_S)
    assert b.lookup([k]) == 0
    until(lambda: b._core.index.ready(k) is not None and settled(b), b, "the prefetch landed")
    store_all(b, make_keys(4, "review3-evictor"))      # b's own blocks fill its host tier: the fetched one goes
    assert b.flush(timeout=DEADLINE_S)
    assert b._core.index.get(k) is None
    store_all(b, [k])                                  # the engine computed the block again and stores it
    assert b.lookup([k]) == 1
    b.poll()                                           # the step's counts applied
    assert metric(b, "tiered_kv_lookup_hits_total", tier="remote") == 0, "b's own block counted as a remote hit"
    assert metric(b, "tiered_kv_lookup_hits_total", tier="host") == 1


# --------------------------------------------------------------------------- 4. a refused fetch evicts for nothing
def test_a_fetch_the_reader_refuses_evicts_nothing_and_is_counted(redis_url: str, managers: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from disk_helpers import keys as make_keys
    from tiered_kv.metrics import sample_total
    a = managers(remote_config(redis_url))
    b = managers(remote_config(redis_url, host_slots=2))
    k = b"review3-refused-fetch"
    store_all(a, [k])
    assert a.flush(timeout=DEADLINE_S)
    mine = make_keys(2, "review3-held")
    store_all(b, mine)                                 # b's host tier: full of its own READY blocks
    assert b.flush(timeout=DEADLINE_S)
    # the reader refuses the fetch (full, or the breaker opened since the probe): asked before any slot is reserved
    monkeypatch.setattr(b._core.remote.store, "take_fetch_room", lambda n: False)
    assert b.lookup([k]) == 0
    until(lambda: settled(b), b, "the probe's answer")
    reg = b.metrics.registry
    kept = [m for m in mine if b._core.index.ready(m) is not None]
    shed = sample_total(reg, "tiered_kv_shed_total", kind="fetch")
    assert kept == mine and shed == 1, f"kept {len(kept)} of 2 host blocks for a fetch never sent; shed={shed}"


# --------------------------------------------------------------------------- 5. a report before its room is free
class _Tap:
    """A completion queue that runs ``on_report(r)`` on the I/O thread just before it queues ``r``: an owner
    thread applying each report the moment it arrives (as wait()/flush() do)."""

    def __init__(self, q: Any, on_report: Any) -> None:
        self.q, self.on_report = q, on_report

    def put(self, r: Any) -> None:
        self.on_report(r)
        self.q.put(r)


def test_a_report_is_queued_only_after_the_room_its_parts_held_is_free(rig: Any, redis_url: str,  # noqa: F811
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    h = rig.open(redis_url, queue_blocks=4, batch_blocks=4)
    store, seen = h.store, {}
    keys, data = blocks(4)
    monkeypatch.setattr(store._w, "_out", _Tap(h.q, lambda r: seen.setdefault("put_room", store.put_room())))
    assert h.put(keys, data)[1].ok
    monkeypatch.setattr(store._r, "_out", _Tap(h.q, lambda r: seen.setdefault(
        "probe_taken", store.submit_probe(uuid.uuid4(), keys))))
    assert store.submit_probe(uuid.uuid4(), keys)
    store.kick()
    h.report()
    assert seen == {"put_room": 4, "probe_taken": True}, seen


# --------------------------------------------------------------------------- 6. a namespace no header holds
@pytest.mark.parametrize("namespace", ["n" * 70_000, "bad\udc80surrogate"])
def test_a_namespace_no_entry_header_can_hold_is_refused(namespace: str) -> None:
    from tiered_kv.remote import RemoteOptions, RemoteStore
    from tiered_kv.reports import CompletionQueue
    opts = RemoteOptions(url="redis://127.0.0.1:1/0", namespace=namespace, block_bytes=ROW, timeout_s=0.2)
    with pytest.raises(ConfigError):
        store = RemoteStore(opts, CompletionQueue())
        store.close(timeout=0.1)


# --------------------------------------------------------------------------- 7. database numbers
@pytest.mark.parametrize("url", ["redis://cache:6379/1_0", "redis://cache:6379/+1", "redis://cache:6379?db=1&db=2",
                                 "unix:///run/redis.sock?db=1&db=2"])
def test_a_malformed_or_repeated_database_is_refused(url: str) -> None:
    from tiered_kv.remote.url import parse_url
    with pytest.raises(ConfigError):
        t = parse_url(url)
        print(f"{url!r} parsed as db {t.db}")


# --------------------------------------------------------------------------- 8. the url's default user
def test_a_urls_password_for_the_default_user_is_not_paired_with_the_environments_user_name(
        rig: Any, redis_server_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    from tiered_kv.remote.url import ENV_PASSWORD, ENV_USERNAME
    s = redis_server_factory("--requirepass", "default-pw")
    monkeypatch.setenv(ENV_USERNAME, "svc")          # set for other tools of the host, say
    monkeypatch.setenv(ENV_PASSWORD, "svc-pw")
    h = rig.open(f"redis://:default-pw@127.0.0.1:{s.port}/0", breaker_backoff_min_s=5.0)
    assert h.store.available, f"the url's default-user credentials were not used: {h.error_kinds()}"
    keys, data = blocks(1)
    assert h.put(keys, data)[1].ok


# =========================================================================== right (plain tests)
def test_a_cancel_refuses_a_late_put_of_its_token_even_after_the_put_was_answered_failed(
        rig: Any, relay: HoldingRelay, redis_server: Any) -> None:  # noqa: F811
    """The same held delivery as finding 1, but cancelled while its token tomb lives: the late SET+PUBLISH is
    refused by the token tombstone and its staged copy deleted (the script's order holds on a late delivery)."""
    h = rig.open(relay.url, timeout_s=0.5, write_deadline_s=0.5, tomb_ttl_seconds=30)
    keys, data = blocks(1)
    relay.arm(SET_CMD)
    tokens = h.put_async(keys, data)
    r = h.report()
    assert relay.caught.is_set() and not r.ok and r.error == "timeout", r
    h.store.cancel(tokens[0], keys[0])
    assert h.store.wait_writes(WAIT_S)
    relay.deliver()
    raw = redis_server.client()
    assert raw.exists(h.names.value(keys[0])) == 0 and raw.exists(h.names.staged(keys[0], tokens[0])) == 0
    assert raw.exists(h.names.token_tomb(keys[0], tokens[0])) == 1
