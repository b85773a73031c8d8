"""The remote store against real Redis servers (tests/redis_servers.py): round trips, namespaces,
corruption, cancel / invalidate and their tombstones, bounds, configuration.

No fake client and no sleep orders anything: an I/O thread is held between taking a batch and sending
it by a :class:`Gate` (the store's test hook), and "it reached the server" is checked on the server.
Faults (down, killed, OOM, slow, cluster redirections) are in test_remote_store_faults.py, the model
test in test_remote_store_model.py; both import the helpers below.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any, Optional

import pytest

from disk_helpers import WriterGate
from redis_servers import RedisServer, tls_args
from tiered_kv.disk.format import pack_header, parse_header
from tiered_kv.errors import ConfigError
from tiered_kv.jobs import JobKind
from tiered_kv.remote import (FETCH_CORRUPT, FETCH_MISS, PUT_CANCELLED, PUT_EXPIRED, PUT_REFUSED_TOKEN,
                              PUT_REFUSED_TOMB, REMOTE_DOWN, RemoteOptions, RemoteStore, redact_url)
from tiered_kv.remote.keys import KeyNames
from tiered_kv.remote.url import ENV_PASSWORD, ENV_USERNAME, parse_url
from tiered_kv.reports import CompletionQueue, Report

pytest.importorskip("redis", reason="the remote tier needs the redis package (pip install redis hiredis)")

BLOCK = 256
NS = "test-ns"
WAIT_S = 15.0


# --------------------------------------------------------------------------- helpers (imported by the other files)
class Gate(WriterGate):
    """A store test hook that holds one I/O thread (``point`` "write" or "read") after it took a batch:
    the disk writer's gate (tests/disk_helpers.py), counting only the calls at ``point``.

    ``block_from``: the first call at ``point`` (1-based) that blocks; later ones block too until
    :meth:`open`.  ``raise_at``: ``{call: exception}`` raised by that call (kills the thread)."""

    def __init__(self, point: str = "write", block_from: Optional[int] = 1,
                 raise_at: Optional[dict[int, BaseException]] = None, max_hold: float = 30.0) -> None:
        super().__init__(block_from, raise_at, max_hold)
        self.point = point

    def __call__(self, point: str) -> None:
        if point == self.point:
            super().__call__(point)


class Handle:
    """A store, its completion queue, and what its callbacks saw."""

    def __init__(self, rig: "Rig", opts: RemoteOptions, **kw: Any) -> None:
        self.q = CompletionQueue()
        self.errors: list[tuple[str, str]] = []
        self.refused: list[str] = []
        self.corrupt: list[str] = []
        self.opts = opts
        self.names = KeyNames(opts.namespace)
        self.store = RemoteStore(opts, self.q, on_error=lambda k, m: self.errors.append((k, m)),
                                 on_refused=self.refused.append, on_corrupt=self.corrupt.append, **kw)

    def error_kinds(self) -> list[str]:
        return [k for k, _ in self.errors]

    def report(self, timeout: float = WAIT_S) -> Report:
        r = self.q.get(timeout)
        assert r is not None, "no report within the deadline"
        return r

    def put_async(self, keys: list[bytes], payloads: list[bytes], tokens: Optional[list[uuid.UUID]] = None,
                  kick: bool = True) -> list[uuid.UUID]:
        tokens = tokens or [uuid.uuid4() for _ in keys]
        assert self.store.submit_puts(tokens, keys, [memoryview(p) for p in payloads])
        if kick:
            self.store.kick()
        return tokens

    def put(self, keys: list[bytes], payloads: list[bytes],
            tokens: Optional[list[uuid.UUID]] = None) -> tuple[list[uuid.UUID], Report]:
        tokens = self.put_async(keys, payloads, tokens)
        r = self.report()
        assert r.kind == JobKind.PUT and r.token == tokens[0], r
        return tokens, r

    def fetch_async(self, keys: list[bytes], fill: int = 0xEE) -> tuple[uuid.UUID, list[bytearray]]:
        bufs = [bytearray([fill]) * self.opts.block_bytes for _ in keys]
        token = uuid.uuid4()
        assert self.store.submit_fetch(token, keys, [memoryview(b) for b in bufs])
        self.store.kick()
        return token, bufs

    def fetch(self, keys: list[bytes]) -> tuple[Report, list[Optional[bytes]]]:
        """The report, and each part's bytes (None for a part that failed).  A part that failed before its
        value was read (a miss, an error reply, the breaker) left its buffer untouched; a corrupt value
        of the block's length, or one cut off by a timeout or a lost connection, may have been read into
        it (the core frees that slot unpublished)."""
        token, bufs = self.fetch_async(keys)
        r = self.report()
        assert r.kind == JobKind.FETCH and r.token == token, r
        failed = r.failed or {}
        for i, reason in failed.items():
            if reason not in (FETCH_CORRUPT, "timeout", "connection"):
                assert bufs[i] == bytearray([0xEE]) * self.opts.block_bytes, f"failed part {i} wrote its buffer"
        return r, [None if i in failed else bytes(b) for i, b in enumerate(bufs)]

    def idle(self) -> None:
        assert self.store.wait_idle(WAIT_S), "the store did not go idle"


class Rig:
    def __init__(self) -> None:
        self.handles: list[Handle] = []

    def open(self, url: str, namespace: str = NS, block_bytes: int = BLOCK, **kw: Any) -> Handle:
        store_kw = {k: kw.pop(k) for k in ("client_factory", "use_evalsha") if k in kw}
        kw.setdefault("timeout_s", 2.0)
        kw.setdefault("batch_blocks", 8)
        h = Handle(self, RemoteOptions(url=url, namespace=namespace, block_bytes=block_bytes, **kw), **store_kw)
        self.handles.append(h)
        return h

    def close(self) -> None:
        for h in self.handles:
            h.store.close(timeout=2.0)


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    try:
        yield r
    finally:
        r.close()


def blocks(n: int, size: int = BLOCK) -> tuple[list[bytes], list[bytes]]:
    return [os.urandom(12) for _ in range(n)], [os.urandom(size) for _ in range(n)]


def entry(names: KeyNames, key: bytes, payload: bytes, token: Optional[uuid.UUID] = None) -> bytes:
    """A good value of ``key`` as another writer would publish it."""
    return pack_header(names.ns_bytes, key, token or uuid.uuid4(), payload, 0) + payload


def poll(what: str, cond: Any, deadline_s: float = WAIT_S) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {deadline_s} s")
        time.sleep(0.01)


# --------------------------------------------------------------------------- round trips
def test_round_trip_standalone(rig: Rig, redis_url: str, redis_server: RedisServer) -> None:
    h = rig.open(redis_url, ttl_seconds=600)
    keys, data = blocks(20)           # 20 parts of one job over 3 pipelines of 8
    tokens, r = h.put(keys, data)
    assert r.ok and r.failed is None and r.error is None and r.nbytes == 20 * BLOCK and r.seconds > 0
    assert h.store.queue_depth == 0 and h.store.put_room() == h.opts.queue_blocks
    raw = redis_server.client()
    for k, tok in zip(keys, tokens):   # each part under its own token, the header says whose
        v = raw.get(h.names.value(k))
        assert parse_header(v).token == tok and parse_header(v).key == k
        assert 590_000 < raw.pttl(h.names.value(k)) <= 600_000   # ttl_seconds, not the staging TTL
    assert raw.keys("*:s:*") == [], "staged values left behind"
    missing = os.urandom(12)
    r, got = h.fetch(keys + [missing])
    assert not r.ok and r.failed == {20: FETCH_MISS} and r.error == FETCH_MISS and r.nbytes == 20 * BLOCK
    assert got[:20] == data
    r, got = h.fetch(keys[3:5])
    assert r.ok and r.failed is None and got == data[3:5]
    assert h.errors == [] and h.corrupt == []


def test_probe_says_which_keys_are_held(rig: Rig, redis_url: str, redis_server: RedisServer) -> None:
    h = rig.open(redis_url)
    keys, data = blocks(3)
    assert h.put(keys[:2], data[:2])[1].ok
    redis_server.client().set(h.names.value(keys[1]), b"garbage")   # held (a probe does not read it)
    token = uuid.uuid4()
    assert h.store.submit_probe(token, keys)
    h.store.kick()
    r = h.report()
    assert r.token == token and r.kind == JobKind.FETCH and r.nbytes == 0
    assert not r.ok and r.failed == {2: FETCH_MISS}
    assert h.corrupt == [] and h.errors == []
    r, got = h.fetch(keys[:2])                     # the fetch verifies: the garbage is a miss there
    assert r.failed == {1: FETCH_CORRUPT} and got[0] == data[0]


def test_round_trip_cluster_spreads_over_masters(rig: Rig, redis_cluster_url: str, redis_cluster: Any) -> None:
    h = rig.open(redis_cluster_url, batch_blocks=16)
    keys, data = blocks(48)
    _, r = h.put(keys, data)
    assert r.ok, r
    sizes = [m.command("DBSIZE") for m in redis_cluster.masters()]
    assert len(sizes) == 3 and all(s > 0 for s in sizes), sizes
    r, got = h.fetch(keys)
    assert r.ok and got == data
    assert h.errors == []


def test_unix_socket_and_eval_mode(rig: Rig, redis_server_factory: Any, tmp_path: Any) -> None:
    sock = str(tmp_path / "r.sock")
    redis_server_factory("--unixsocket", sock, "--unixsocketperm", "700")
    h = rig.open(f"unix://{sock}?db=2", use_evalsha=False)
    keys, data = blocks(3)
    _, r = h.put(keys, data)
    assert r.ok
    assert h.fetch(keys)[1] == data


def test_tls(rig: Rig, redis_server_factory: Any, tmp_path: Any) -> None:
    args, ca, port = tls_args(str(tmp_path))
    redis_server_factory(*args)
    h = rig.open(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}")
    keys, data = blocks(3)
    assert h.put(keys, data)[1].ok
    assert h.fetch(keys)[1] == data
    assert h.store.available and h.errors == []
    untrusted = rig.open(f"rediss://127.0.0.1:{port}/0", breaker_backoff_min_s=5.0)   # the system's CAs only
    assert not untrusted.store.available and untrusted.error_kinds()[0] == "connection"


def test_noscript_after_script_flush_is_reloaded(rig: Rig, redis_url: str, redis_server: RedisServer) -> None:
    h = rig.open(redis_url)
    keys, data = blocks(2)
    redis_server.command("SCRIPT", "FLUSH")   # what a restart or a failover does to the script cache
    _, r = h.put(keys, data)
    assert r.ok, r
    redis_server.command("SCRIPT", "FLUSH")
    h.store.invalidate(keys[0])
    h.idle()
    assert redis_server.command("EXISTS", h.names.tomb(keys[0])) == 1
    assert h.errors == []


# --------------------------------------------------------------------------- namespaces and corruption
def test_namespaces_never_cross(rig: Rig, redis_url: str, redis_server: RedisServer) -> None:
    a = rig.open(redis_url, namespace="model-a")
    b = rig.open(redis_url, namespace="model-b")
    keys, data = blocks(2)
    assert a.put(keys, data)[1].ok
    r, _ = b.fetch(keys)
    assert r.failed == {0: FETCH_MISS, 1: FETCH_MISS}
    # a digest collision / a foreign writer: model-a's value under model-b's name is a miss, never a's bytes
    raw = redis_server.client()
    raw.set(b.names.value(keys[0]), raw.get(a.names.value(keys[0])))
    r, got = b.fetch(keys[:1])
    assert r.failed == {0: FETCH_CORRUPT} and got == [None]
    assert b.corrupt == ["wrong_namespace"]
    # and a's value stored under another key's name is wrong_key
    raw.set(a.names.value(keys[1]), raw.get(a.names.value(keys[0])))
    r, got = a.fetch(keys[1:2])
    assert r.failed == {0: FETCH_CORRUPT} and a.corrupt == ["wrong_key"]


def test_corrupt_value_is_a_miss_and_deleted(rig: Rig, redis_url: str, redis_server: RedisServer) -> None:
    h = rig.open(redis_url)
    keys, data = blocks(2)
    assert h.put(keys, data)[1].ok
    raw = redis_server.client()
    name = h.names.value(keys[0])
    raw.setrange(name, len(raw.get(name)) - 1, b"\x00" if data[0][-1:] != b"\x00" else b"\x01")   # one payload byte
    r, got = h.fetch(keys)
    assert r.failed == {0: FETCH_CORRUPT} and got[1] == data[1] and got[0] is None
    assert h.corrupt == ["checksum"]
    h.idle()
    assert raw.exists(name) == 0, "the corrupt value was not deleted"
    assert raw.exists(h.names.value(keys[1])) == 1
    raw.set(h.names.value(keys[1]), b"garbage")    # not even a header
    assert h.fetch(keys[1:])[0].failed == {0: FETCH_CORRUPT}
    assert h.corrupt[-1] == "truncated"


def test_corrupt_delete_spares_a_value_written_since(rig: Rig, redis_url: str, redis_server: RedisServer) -> None:
    h = rig.open(redis_url)
    keys, data = blocks(1)
    assert h.put(keys, data)[1].ok
    raw = redis_server.client()
    name = h.names.value(keys[0])
    raw.setrange(name, 60, b"\xff\xff")            # damage the stored key bytes
    gate = Gate("write")
    h.store.set_test_hook(gate)
    r, _ = h.fetch(keys)
    assert r.failed == {0: FETCH_CORRUPT}
    gate.entered(1)                                # the writer took the delete, has not sent it
    good = entry(h.names, keys[0], data[0])
    raw.set(name, good)                            # another machine publishes a good value meanwhile
    gate.open()
    h.idle()
    assert raw.get(name) == good, "the delete of a corrupt value removed a good value written since"
    r, got = h.fetch(keys)
    assert r.ok and got == data


# --------------------------------------------------------------------------- cancel, invalidate, tombstones
def test_cancel_before_send_is_never_sent(rig: Rig, redis_url: str, redis_server: RedisServer) -> None:
    h = rig.open(redis_url, tomb_ttl_seconds=60)
    gate = Gate("write")
    h.store.set_test_hook(gate)
    k0, d0 = blocks(1)
    h.put_async(k0, d0)
    gate.entered(1)                                # the writer holds the first batch
    keys, data = blocks(3)
    tokens = h.put_async(keys, data)
    h.store.cancel(tokens[1], keys[1])
    h.store.cancel(uuid.uuid4(), keys[2])          # another token's cancel drops nothing
    gate.open()
    assert h.report().ok
    r = h.report()
    assert r.token == tokens[0] and not r.ok and r.failed == {1: PUT_CANCELLED} and r.error == PUT_CANCELLED
    assert r.nbytes == 2 * BLOCK
    h.idle()
    raw = redis_server.client()
    assert raw.exists(h.names.value(keys[1])) == 0
    assert raw.exists(h.names.value(keys[0])) == raw.exists(h.names.value(keys[2])) == 1
    assert 0 < raw.pttl(h.names.token_tomb(keys[1], tokens[1])) <= 60_000


def test_cancel_after_landing_deletes_only_that_token(rig: Rig, redis_url: str, redis_server: RedisServer) -> None:
    h = rig.open(redis_url)
    keys, data = blocks(1)
    (t1,), r = h.put(keys, data)
    assert r.ok
    raw = redis_server.client()
    h.store.cancel(t1, keys[0])
    h.idle()
    assert raw.exists(h.names.value(keys[0])) == 0
    newer = os.urandom(BLOCK)
    (t2,), r = h.put(keys, [newer])
    assert r.ok
    h.store.cancel(t1, keys[0])                    # the old job's cancel again: t2's value stays
    h.idle()
    assert parse_header(raw.get(h.names.value(keys[0]))).token == t2
    assert h.fetch(keys)[1] == [newer]


def test_token_tomb_refuses_a_late_put(rig: Rig, redis_url: str, redis_server: RedisServer) -> None:
    a = rig.open(redis_url)
    b = rig.open(redis_url)                        # the cancel's script, run from another connection
    gate = Gate("write")
    a.store.set_test_hook(gate)
    keys, data = blocks(1)
    (tok,) = a.put_async(keys, data)
    gate.entered(1)                                # taken, not sent: a's cancel could no longer drop it
    b.store.cancel(tok, keys[0])
    b.idle()
    assert redis_server.command("EXISTS", a.names.token_tomb(keys[0], tok)) == 1
    gate.open()
    r = a.report()
    assert not r.ok and r.failed == {0: PUT_REFUSED_TOKEN}
    assert a.refused == [PUT_REFUSED_TOKEN]
    assert redis_server.command("EXISTS", a.names.value(keys[0])) == 0


def test_invalidate_on_another_machine(rig: Rig, redis_url: str, redis_server: RedisServer) -> None:
    a = rig.open(redis_url)
    b = rig.open(redis_url)
    keys, data = blocks(2)
    assert a.put(keys, data)[1].ok
    gate = Gate("write")
    a.store.set_test_hook(gate)
    late = a.put_async(keys[:1], [os.urandom(BLOCK)])
    gate.entered(1)
    b.store.invalidate(keys[0])
    b.idle()
    raw = redis_server.client()
    assert raw.exists(a.names.value(keys[0])) == 0, "invalidate left the landed value"
    gate.open()
    r = a.report()
    assert r.token == late[0] and r.failed == {0: PUT_REFUSED_TOMB} and a.refused == [PUT_REFUSED_TOMB]
    assert raw.keys("*:s:*") == [], "a refused put left its staged value"
    rf, got = a.fetch(keys)
    assert rf.failed == {0: FETCH_MISS} and got[1] == data[1]
    assert b.put(keys[:1], data[:1])[1].failed == {0: PUT_REFUSED_TOMB}   # every machine's writes


def test_wait_writes_covers_tombstone_ops(rig: Rig, redis_url: str, redis_server: RedisServer) -> None:
    h = rig.open(redis_url)
    gate = Gate("write")
    h.store.set_test_hook(gate)
    keys, _ = blocks(2)
    h.store.invalidate(keys[0])
    h.store.cancel(uuid.uuid4(), keys[1])
    assert not h.store.wait_writes(0.05)           # held: not sent yet
    gate.open()
    assert h.store.wait_writes(WAIT_S)
    raw = redis_server.client()
    assert raw.exists(h.names.tomb(keys[0])) == 1 and len(raw.keys("*:x:*")) == 1


def test_invalidate_drops_own_unsent_puts(rig: Rig, redis_url: str, redis_server: RedisServer) -> None:
    h = rig.open(redis_url)
    gate = Gate("write")
    h.store.set_test_hook(gate)
    h.put_async(*blocks(1))
    gate.entered(1)
    keys, data = blocks(2)
    h.put_async(keys, data)
    h.store.invalidate(keys[0])
    gate.open()
    assert h.report().ok
    r = h.report()
    assert r.failed == {0: PUT_CANCELLED}
    h.idle()
    raw = redis_server.client()
    assert raw.exists(h.names.tomb(keys[0])) == 1 and raw.exists(h.names.value(keys[0])) == 0
    assert raw.exists(h.names.value(keys[1])) == 1


def test_tombs_expire(rig: Rig, redis_url: str, redis_server: RedisServer) -> None:
    # a tomb of 1 s must outlive twice a write in flight: a deadline and timeouts shorter than half that
    h = rig.open(redis_url, tomb_ttl_seconds=1, ttl_seconds=None, write_deadline_s=0.05, timeout_s=0.2)
    keys, data = blocks(2)
    (tok, _), r = h.put(keys, data)
    raw = redis_server.client()
    assert raw.pttl(h.names.value(keys[0])) == -1            # ttl_seconds=None: no expiry
    h.store.invalidate(keys[0])
    h.store.cancel(tok, keys[0])
    h.idle()
    assert 0 < raw.pttl(h.names.tomb(keys[0])) <= 1000
    assert 0 < raw.pttl(h.names.token_tomb(keys[0], tok)) <= 1000
    assert h.put(keys[:1], data[:1])[1].failed == {0: PUT_REFUSED_TOMB}
    poll("the key tomb expired", lambda: raw.exists(h.names.tomb(keys[0])) == 0, 5.0)
    assert h.put(keys[:1], data[:1])[1].ok
    assert h.fetch(keys[:1])[1] == data[:1]


# --------------------------------------------------------------------------- bounds, deadlines, close
def test_put_room_and_fetch_bound(rig: Rig, redis_url: str) -> None:
    h = rig.open(redis_url, queue_blocks=4, batch_blocks=2)
    gate = Gate("write")
    h.store.set_test_hook(gate)
    keys, data = blocks(5)
    h.put_async(keys[:3], data[:3])
    gate.entered(1)
    assert h.store.put_room() == 1 and h.store.queue_depth == 3
    assert not h.store.submit_puts([uuid.uuid4()] * 2, keys[3:5], [memoryview(d) for d in data[3:5]])
    h.put_async(keys[3:4], data[3:4])
    assert h.store.put_room() == 0
    gate.open()
    assert h.report().ok and h.report().ok
    h.idle()
    assert h.store.put_room() == 4 and h.store.queue_depth == 0
    rgate = Gate("read")
    h.store.set_test_hook(rgate)
    bufs = [memoryview(bytearray(BLOCK)) for _ in range(5)]
    assert h.store.submit_fetch(uuid.uuid4(), keys[:4], bufs[:4])
    h.store.kick()
    rgate.entered(1)
    assert not h.store.submit_fetch(uuid.uuid4(), keys[4:5], bufs[4:5]), "fetches are not bounded"
    rgate.open()
    assert h.report().ok
    with pytest.raises(ValueError):
        h.store.submit_fetch(uuid.uuid4(), keys[:1], [memoryview(bytearray(BLOCK + 1))])


def test_put_past_its_deadline_is_not_sent(rig: Rig, redis_url: str, redis_server: RedisServer) -> None:
    h = rig.open(redis_url, write_deadline_s=0.05)
    gate = Gate("write")
    h.store.set_test_hook(gate)
    h.put_async(*blocks(1))
    gate.entered(1)
    keys, data = blocks(1)
    h.put_async(keys, data)
    t0 = time.monotonic()
    while time.monotonic() < t0 + 0.1:             # let the queued put's deadline pass (time, not ordering)
        time.sleep(0.01)
    gate.open()
    assert h.report().ok
    r = h.report()
    assert r.failed == {0: PUT_EXPIRED} and r.seconds == 0.0
    assert redis_server.command("EXISTS", h.names.value(keys[0])) == 0


def test_close_answers_everything_and_refuses_after(rig: Rig, redis_url: str) -> None:
    h = rig.open(redis_url)
    keys, data = blocks(4)
    tokens = h.put_async(keys, data, kick=False)
    h.store.close(timeout=5.0)
    r = h.report()
    assert r.token == tokens[0] and r.ok          # close sends what is queued
    h.store.close()                                # idempotent
    assert h.store.put_room() == 0 and not h.store.available
    assert not h.store.submit_puts([uuid.uuid4()], keys[:1], [memoryview(data[0])])
    assert not h.store.submit_fetch(uuid.uuid4(), keys[:1], [memoryview(bytearray(BLOCK))])
    h.store.cancel(tokens[0], keys[0])             # no raise after close
    h.store.invalidate(keys[0])
    h.store.kick()


def test_a_dying_io_thread_is_answered_and_restarted(rig: Rig, redis_url: str) -> None:
    h = rig.open(redis_url)
    gate = Gate("write", block_from=None, raise_at={1: RuntimeError("writer killed")})
    h.store.set_test_hook(gate)
    keys, data = blocks(2)
    _, r = h.put(keys, data)
    assert r.failed == {0: REMOTE_DOWN, 1: REMOTE_DOWN}
    assert "server_error" in h.error_kinds()
    assert h.put(keys, data)[1].ok                 # restarted
    rgate = Gate("read", block_from=None, raise_at={1: RuntimeError("reader killed")})
    h.store.set_test_hook(rgate)
    assert h.fetch(keys)[0].failed == {0: REMOTE_DOWN, 1: REMOTE_DOWN}
    assert h.fetch(keys)[1] == data
    # a thread that keeps dying: the store turns itself off, answering everything
    h.store.set_test_hook(Gate("write", block_from=None, raise_at={i: RuntimeError("again") for i in range(1, 9)}))
    for _ in range(4):
        if not h.store.submit_puts([uuid.uuid4()], keys[:1], [memoryview(data[0])]):
            break
        h.store.kick()
        assert h.report().failed == {0: REMOTE_DOWN}
    poll("the store is unhealthy", lambda: not h.store.healthy)
    assert not h.store.available and h.store.put_room() == 0


# --------------------------------------------------------------------------- configuration and credentials
def test_bad_urls_and_options_raise_config_error_redacted() -> None:
    q = CompletionQueue()
    for url in ("redis://user:hunter2@host:notaport/0", "http://user:hunter2@host", "redis://user:hunter2@a:1,b:2",
                "unix://relative?db=1", "redis+cluster://user:hunter2@a:1/3", "redis://user:hunter2@h:1/?bogus=1"):
        with pytest.raises(ConfigError) as ei:
            RemoteStore(RemoteOptions(url=url, namespace=NS, block_bytes=BLOCK), q)
        assert "hunter2" not in str(ei.value) and ("***" in str(ei.value)) == ("hunter2" in url), str(ei.value)
    for bad in (dict(block_bytes=0), dict(queue_blocks=0), dict(timeout_s=0), dict(namespace=""),
                dict(ttl_seconds=0)):
        kw: dict[str, Any] = dict(url="redis://127.0.0.1:1/0", namespace=NS, block_bytes=BLOCK)
        kw.update(bad)
        with pytest.raises(ConfigError):
            RemoteStore(RemoteOptions(**kw), q)
    assert redact_url("rediss://u:p@ss:w@h:1/0") == "rediss://u:***@h:1/0"
    assert redact_url("redis+cluster://:pw@a:1,b:2") == "redis+cluster://:***@a:1,b:2"
    t = parse_url("rediss+cluster://a:1,[::1]:2?ssl_cert_reqs=none")
    assert t.cluster and t.tls and t.hosts == (("a", 1), ("::1", 2)) and t.tls_options == (("ssl_cert_reqs", "none"),)


def test_credentials_from_env_url_wins_never_logged(rig: Rig, redis_server_factory: Any,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    s = redis_server_factory("--requirepass", "s3cret-pw")
    monkeypatch.setenv(ENV_PASSWORD, "s3cret-pw")
    h = rig.open(f"redis://127.0.0.1:{s.port}/0")
    keys, data = blocks(1)
    assert h.put(keys, data)[1].ok
    monkeypatch.setenv(ENV_PASSWORD, "wrong-env-pw")
    monkeypatch.setenv(ENV_USERNAME, "default")
    h2 = rig.open(f"redis://default:s3cret-pw@127.0.0.1:{s.port}/0")   # the url's password wins
    assert h2.fetch(keys)[1] == data
    h3 = rig.open(f"redis://default:wr0ng-url-pw@127.0.0.1:{s.port}/0", breaker_backoff_min_s=5.0)
    assert not h3.store.available and h3.store.put_room() == 0
    assert h3.error_kinds()[:1] == ["connection"] and "breaker_open" in h3.error_kinds()
    text = caplog.text + repr(h3.errors) + repr(h3.store)
    for secret in ("s3cret-pw", "wrong-env-pw", "wr0ng-url-pw"):
        assert secret not in text
