"""The remote store's own RESP2 code (``tiered_kv.remote.resp``) and the split verification of a value read
straight into a host slot (``tiered_kv.disk.format.verify_split``).

Replies are parsed from a fake socket that hands out the stream in chunks a property test chooses (one
byte at a time, across every boundary), and checked against a model; the encoding is checked against
redis-py's own packer and against a real ``redis-server`` through :class:`~tiered_kv.remote.conn.Conn`.
"""

from __future__ import annotations

import hashlib
import os
import socket
import uuid
from typing import Any, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("redis")

from redis.exceptions import ConnectionError, MovedError, NoScriptError, ResponseError, TimeoutError  # noqa: E402

from tiered_kv.disk.format import HEADER_SIZE, CorruptEntry, pack_header, verify_entry, verify_split  # noqa: E402
from tiered_kv.remote.conn import Conn, plain, route_key  # noqa: E402
from tiered_kv.remote.resp import LARGE, READ_BUFFER, Drained, GetInto, Landed, Parts, Replies, pack  # noqa: E402
from tiered_kv.remote.url import parse_url  # noqa: E402


class FakeSocket:
    """recv_into hands out ``data`` in the given chunk sizes (cycled); then ``end``: b"" (closed) or a timeout."""

    def __init__(self, data: bytes, chunks: tuple[int, ...] = (1 << 30,), end: str = "closed") -> None:
        self.data = memoryview(data)
        self.chunks = chunks
        self.at = 0
        self.calls = 0
        self.end = end

    def recv_into(self, view: memoryview) -> int:
        if self.at >= len(self.data):
            if self.end == "timeout":
                raise socket.timeout("timed out")
            return 0
        n = min(len(view), self.chunks[self.calls % len(self.chunks)], len(self.data) - self.at)
        self.calls += 1
        view[:n] = self.data[self.at:self.at + n]
        self.at += n
        return n


def _parse_error(text: str) -> Exception:
    from redis._parsers import BaseParser
    return BaseParser.parse_error(text)


def replies(data: bytes, chunks: tuple[int, ...] = (1 << 30,), end: str = "closed") -> Replies:
    return Replies(FakeSocket(data, chunks, end), _parse_error)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- encoding
def test_pack_matches_redis_py_and_sends_large_buffers_in_place() -> None:
    from redis.connection import PythonRespSerializer

    payload = memoryview(os.urandom(LARGE + 5))
    head = b"H" * 60
    cmds = [("SET", "tkv:{a}:s:1", Parts(head, payload), "EX", 60), ("GET", "k"), ("EXISTS", b"k2"),
            GetInto("tkv:{a}:v", 7, memoryview(bytearray(3))), ("EVALSHA", "ab" * 20, 1, "key", 3.5, -2)]
    bufs = pack(cmds)
    assert any(b is payload for b in bufs), "the slot's payload was copied, not sent in place"
    want = PythonRespSerializer(6000, lambda a: a if isinstance(a, bytes) else str(a).encode()).pack
    expect = b"".join(b"".join(want(*plain(c))) for c in cmds)
    assert b"".join(bytes(b) for b in bufs) == expect
    small = pack([("GET", "a"), ("GET", "b")])
    assert len(small) == 1, "small commands are coalesced into one buffer"


def test_pack_refuses_what_is_not_an_argument() -> None:
    with pytest.raises(TypeError, match="bool"):
        pack([("SET", "k", True)])
    with pytest.raises(TypeError, match="dict"):
        pack([("SET", "k", {})])


def test_route_key_and_plain() -> None:
    assert route_key(("EVALSHA", "sha", 2, "tkv:{x}:v", "tkv:{x}:t", 5)) == "tkv:{x}:v"
    assert route_key(("SET", "tkv:{y}:s:1", b"v")) == "tkv:{y}:s:1"
    assert route_key(GetInto("tkv:{z}:v", 3, memoryview(bytearray(1)))) == "tkv:{z}:v"
    assert plain(GetInto("n", 3, memoryview(bytearray(1)))) == ("GET", "n")
    assert plain(("SET", "n", Parts(b"ab", b"cd"), "EX", 5)) == ("SET", "n", b"abcd", "EX", 5)


# --------------------------------------------------------------------------- replies
# a model reply: (wire bytes, what read() returns, the GetInto to read it with or None)
def _bulk(v: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(v), v)


def _reply() -> st.SearchStrategy[tuple[bytes, Any, Optional[tuple[int, int]]]]:
    value = st.binary(max_size=300)
    return st.one_of(
        value.map(lambda v: (_bulk(v), v, None)),
        st.just((b"$-1\r\n", None, None)),
        st.integers(-2**63, 2**63 - 1).map(lambda i: (b":%d\r\n" % i, i, None)),
        st.sampled_from([b"OK", b"QUEUED", b""]).map(lambda s: (b"+" + s + b"\r\n", s, None)),
        st.lists(value, max_size=4).map(lambda vs: (b"*%d\r\n" % len(vs) + b"".join(map(_bulk, vs)), vs, None)),
        st.just((b"*-1\r\n", None, None)),
        # a value read into a view: the expected length lands (head returned, payload in the view) ...
        st.tuples(st.integers(0, 40), st.integers(0, 300)).flatmap(
            lambda hp: st.binary(min_size=sum(hp), max_size=sum(hp)).map(
                lambda v: (_bulk(v), Landed(v[:hp[0]]), hp))),
        # ... any other length is drained: its first bytes, its length and sha1 (and the view left alone)
        st.binary(min_size=1, max_size=50).map(lambda v: (_bulk(v), Drained(v, len(v), hashlib.sha1(v).hexdigest()),
                                                           (len(v) + 1, 0))),
    )


@pytest.mark.parametrize("chunk", [1000, 65536 + 7, 1 << 20])
def test_a_value_far_longer_than_expected_is_drained_keeping_only_its_first_bytes(chunk: int) -> None:
    """A :class:`GetInto` answered with a value far longer than a block's (a foreign or hostile one) keeps the
    expected length and one reply buffer of it, hashes all of it, and leaves the stream at the next reply."""
    big = os.urandom(3 * READ_BUFFER + 11)
    r = replies(_bulk(big) + b":7\r\n", (chunk,))
    view = memoryview(bytearray(b"\xee" * 100))
    got = r.read(GetInto("k", 20, view))
    assert got == Drained(big[:120 + READ_BUFFER], len(big), hashlib.sha1(big).hexdigest())
    assert bytes(view) == b"\xee" * 100
    assert r.read() == 7


@settings(max_examples=300, deadline=None)
@given(st.lists(_reply(), min_size=1, max_size=12), st.lists(st.integers(1, 70), min_size=1, max_size=5))
def test_replies_parse_any_chunking_like_the_model(seq: list[Any], chunks: list[int]) -> None:
    wire = b"".join(w for w, _, _ in seq)
    r = replies(wire, tuple(chunks))
    for w, want, into in seq:
        view = None
        if into is not None:
            head, size = into
            view = memoryview(bytearray(b"\xee" * size))
            got = r.read(GetInto("k", head, view))
        else:
            got = r.read()
        assert got == want
        if isinstance(want, Landed):
            assert bytes(view) == w[w.index(b"\r\n") + 2 + len(want.head):-2]   # type: ignore[arg-type]
        elif view is not None:
            assert bytes(view) == b"\xee" * len(view), "a value of another length wrote the view"


def test_error_replies_are_returned_as_redis_py_exceptions_and_the_stream_goes_on() -> None:
    r = replies(b"-MOVED 3999 127.0.0.1:6381\r\n-NOSCRIPT No matching script\r\n-ERR odd\r\n:1\r\n")
    moved = r.read()
    assert isinstance(moved, MovedError) and moved.slot_id == 3999 and moved.port == 6381
    assert isinstance(r.read(), NoScriptError)
    err = r.read()
    assert type(err) is ResponseError and str(err) == "odd"
    assert r.read() == 1


def test_a_line_longer_than_the_buffer_grows_it() -> None:
    text = b"E" * (200 << 10)
    assert str(replies(b"-ERR " + text + b"\r\n+OK\r\n", (4096,)).read()) == text.decode()


def test_a_closed_connection_or_a_timeout_mid_value_raises_redis_py_errors() -> None:
    half = b"$10\r\n12345"
    with pytest.raises(ConnectionError, match="closed"):
        replies(half).read()
    with pytest.raises(TimeoutError):
        replies(half, end="timeout").read(GetInto("k", 2, memoryview(bytearray(8))))
    with pytest.raises(ConnectionError):
        replies(b"").read()


def test_an_unknown_reply_type_is_an_invalid_response() -> None:
    from redis.exceptions import InvalidResponse
    with pytest.raises(InvalidResponse, match="unexpected reply"):
        replies(b"_\r\n").read()     # RESP3's null: the links speak RESP2 only


# --------------------------------------------------------------------------- verify_split
NS, KEY, BLOCK = b"model-a", b"key-1", 4096


def _value(ns: bytes = NS, key: bytes = KEY, payload: Optional[bytes] = None) -> tuple[bytes, bytes]:
    payload = os.urandom(BLOCK) if payload is None else payload
    head = pack_header(ns, key, uuid.uuid4(), payload, 0)
    return head, payload


def test_verify_split_accepts_what_verify_entry_accepts() -> None:
    head, payload = _value()
    assert len(head) == HEADER_SIZE + len(NS) + len(KEY)
    a = verify_split(head, memoryview(bytearray(payload)), NS, KEY, BLOCK)
    b = verify_entry(head + payload, NS, KEY, BLOCK)
    assert a == b and a.payload_offset == len(head)


@pytest.mark.parametrize("case,reason", [
    ("payload_byte", "checksum"), ("header_byte", "checksum"), ("other_ns", "wrong_namespace"),
    ("longer_key", "wrong_length"), ("shorter_key", "wrong_key"), ("short_payload", "truncated"),
    ("magic", "bad_magic")])
def test_verify_split_refuses_every_kind_of_bad_value(case: str, reason: str) -> None:
    head, payload = _value()
    if case == "payload_byte":
        payload = payload[:-1] + bytes([payload[-1] ^ 1])
    elif case == "header_byte":
        head = head[:20] + bytes([head[20] ^ 1]) + head[21:]     # seq: covered by the checksum
    elif case == "other_ns":
        head, payload = _value(ns=b"model-b", payload=payload)
    elif case in ("longer_key", "shorter_key"):
        # another writer's key of another length and a payload that makes up the difference: the same total
        # length, so it landed split at the wrong place (a longer key's slice even reads as this key)
        other = KEY + b"x" if case == "longer_key" else KEY[:-1]
        h2, p2 = _value(key=other, payload=os.urandom(BLOCK + len(KEY) - len(other)))
        whole = h2 + p2
        head, payload = whole[:len(head)], whole[len(head):]
    elif case == "short_payload":
        payload = payload[:-1]
    elif case == "magic":
        head = b"XXXX" + head[4:]
    with pytest.raises(CorruptEntry) as e:
        verify_split(head, payload, NS, KEY, BLOCK)
    assert e.value.reason == reason


# --------------------------------------------------------------------------- on a real server
def test_a_round_trip_on_a_real_server_reads_values_into_views(redis_url: str, redis_server: Any) -> None:
    c = Conn(parse_url(redis_url), 2.0)
    try:
        head, payload = b"h" * 5, os.urandom(LARGE * 3)
        view = memoryview(bytearray(len(payload)))
        other = memoryview(bytearray(7))
        out = c.round_trip([("SET", "resp:a", Parts(head, memoryview(payload)), "EX", 60), ("GET", "resp:a"),
                            GetInto("resp:a", len(head), view), GetInto("resp:a", 1, other),
                            GetInto("resp:none", 1, other), ("EXISTS", "resp:a", "resp:none"), ("HGET", "resp:a", "f")])
        assert out[:2] == [b"OK", head + payload]
        assert out[2] == Landed(head) and bytes(view) == payload
        whole = head + payload   # another length than 1 + 7: drained, its first 8 bytes and a reply buffer kept
        assert out[3] == Drained(whole[:8 + READ_BUFFER], len(whole), hashlib.sha1(whole).hexdigest())
        assert bytes(other) == bytes(7)
        assert out[4] is None and out[5] == 1
        assert isinstance(out[6], ResponseError) and "WRONGTYPE" in str(out[6])
        # the link is dropped when the server closes it; the next trip connects again
        redis_server.client().client_kill_filter(_type="normal", skipme=True)
        lost = c.round_trip([("GET", "resp:a")])
        assert isinstance(lost[0], ConnectionError) or lost[0] == head + payload
        assert c.round_trip([("GET", "resp:a")]) == [head + payload]
    finally:
        c.close()
