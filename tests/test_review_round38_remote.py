"""Round 38 adversarial review of the remote tier: ``tiered_kv/remote/conn.py`` (first review), ``resp.py``,
``reader.py``, ``writer.py``, ``breaker.py``, ``iothread.py``, ``store.py`` and the core's use of fetch reports.

What it proved wrong (each test failed on the reviewed tree, main at 9c7cf94; all fixed since: ``Replies.read``
refuses with ``InvalidResponse`` a GET answered by anything but a bulk string, nil or an error, a bulk over
``READ_BUFFER`` to any other command, a line over ``MAX_LINE`` and arrays nested over ``MAX_DEPTH``;
``Reader._fetch`` counts any other value a GET gets a ``wrong_type`` corrupt part; ``RemoteStore`` refuses a
strided view and mismatched lists with ``InvalidBufferError``):

1. ``test_a_get_answered_with_another_reply_type_is_a_failed_part_not_a_reader_thread_death``: a GET answered
   with a well-formed reply that is not a bulk string (an integer, an array -- a garbling proxy, a foreign
   service on the port) is handed by ``Replies.read`` / ``_Link.read`` to ``Reader._fetch`` as an ``int`` /
   ``list``; its "arrived whole" branch calls ``memoryview(value)`` and the ``TypeError`` kills the reader
   thread.  Each such reply costs one of the three restarts; the fourth turns the remote tier off for good
   (``healthy`` False, every later lookup misses the server) -- four bad replies, and no corrupt value is
   counted.
2. ``test_a_reply_never_sizes_an_allocation_here``: ``resp.py`` says "what the server sends never sizes an
   allocation here", but ``Replies.read`` allocates ``bytearray(n)`` for any bulk reply that is not a
   ``GetInto``'s -- among them a bulk nested in an array answering a ``GetInto`` -- with ``n`` read off the
   wire (up to 2**63), before a byte of it arrived; and ``Replies._fill`` grows its buffer without bound (and
   rescans it from the start on every fill) for a line with no CRLF.  A garbled or foreign peer makes the
   reader allocate what it says: 64 MiB from an 11-byte reply here.
3. ``test_a_non_contiguous_view_is_refused_at_submit_not_by_the_writer_threads_death`` (lower severity: the
   public ``RemoteStore`` only, the core passes slab slices): ``RemoteStore._bytes_view`` accepts a strided
   view of the block's size; the writer thread dies hashing it (``BufferError``), a restart spent; the
   boundary's other bad inputs raise plain ``ValueError``, not a ``tiered_kv.errors`` exception.

Where the fault comes from a peer that is not a well-behaved Redis (a proxy, a foreign service), the design's
rule still holds: "the store is shared and untrusted ... faults degrade to misses" (/work/shared/DESIGN.md).

Checked and found right (no test kept): the link protocol state after a timeout, a cut or a shut socket mid-value
(dropped, never reused; the next trip's replies match its commands); ``_stale`` before each trip; ``_follow``'s
ASK / MOVED handling; NOSCRIPT redo order; a lost cluster node's resend (the scripts' tombstones keep a resent
put from landing after an invalidation or cancel); ``verify_split`` refusing every other layout of the same
total length; ``Conn.guard`` around every slot write after a trip; the breaker's open / probe / close cycle and
its counting across both threads; the core's fetch report application against invalidate / store-supersede.

Deterministic: a loopback RESP2 fake server that answers each command at once (no timing involved) and an
in-process fake socket; no sleep orders anything.
"""

from __future__ import annotations

import hashlib
import socket
import threading
import tracemalloc
import uuid
from collections.abc import Iterator
from typing import Callable, Optional

import pytest

pytest.importorskip("redis", reason="the remote tier needs the redis package (pip install redis hiredis)")

from test_remote_resp import replies  # noqa: E402
from test_remote_store import Rig, rig  # noqa: E402,F401  (rig: the fixture)
from tiered_kv.remote.resp import READ_BUFFER, GetInto  # noqa: E402
from tiered_kv.remote.records import FETCH_CORRUPT  # noqa: E402
from tiered_kv.remote.writer import MAX_RESTARTS  # noqa: E402


# --------------------------------------------------------------------------- a server speaking just enough RESP
class FakeRedis:
    """A loopback server that answers what redis-py's handshake and the store send (HELLO, CLIENT, PING,
    SCRIPT LOAD, EVALSHA, EXISTS, SET, GET) at once; ``answer(args)`` may replace any reply (None: the default)."""

    def __init__(self, answer: Optional[Callable[[list[bytes]], Optional[bytes]]] = None) -> None:
        self.answer = answer or (lambda args: None)
        self.lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(16)
        self.port = self.lsock.getsockname()[1]
        self.seen: list[list[bytes]] = []
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._serve, name="test-fake-redis", daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            self._socks.append(c)
            threading.Thread(target=self._conn, args=(c,), daemon=True).start()

    def _conn(self, c: socket.socket) -> None:
        f = c.makefile("rb")
        try:
            while True:
                line = f.readline()
                if not line:
                    return
                args = []
                for _ in range(int(line[1:])):
                    n = int(f.readline()[1:])
                    args.append(f.read(n))
                    f.read(2)
                self.seen.append(args)
                out = self.answer(args)
                c.sendall(self.default(args) if out is None else out)
        except (OSError, ValueError):
            return

    @staticmethod
    def default(args: list[bytes]) -> bytes:
        cmd = args[0].upper()
        if cmd == b"PING":
            return b"+PONG\r\n"
        if cmd == b"HELLO":   # redis-py 8's clients default to RESP3 (the store's links speak RESP2)
            proto = args[1] if len(args) > 1 else b"2"
            return (b"%3\r\n$6\r\nserver\r\n$5\r\nredis\r\n$7\r\nversion\r\n$5\r\n7.0.0\r\n"
                    b"$5\r\nproto\r\n:" + proto + b"\r\n")
        if cmd == b"SCRIPT":
            sha = hashlib.sha1(args[2]).hexdigest().encode()
            return b"$%d\r\n%s\r\n" % (len(sha), sha)
        if cmd == b"EXISTS":
            return b":1\r\n"
        if cmd in (b"EVALSHA", b"EVAL"):
            return b":0\r\n"
        if cmd == b"GET":
            return b"$-1\r\n"
        return b"+OK\r\n"

    def close(self) -> None:
        self.lsock.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass


@pytest.fixture
def fake_server() -> Iterator[list[FakeRedis]]:
    made: list[FakeRedis] = []
    try:
        yield made
    finally:
        for s in made:
            s.close()


# =========================================================================== 1
@pytest.mark.parametrize("reply", [b":7\r\n", b"*1\r\n:1\r\n"], ids=["integer", "array"])
def test_a_get_answered_with_another_reply_type_is_a_failed_part_not_a_reader_thread_death(
        rig: Rig, fake_server: list[FakeRedis], reply: bytes) -> None:  # noqa: F811
    """WRONG: tiered_kv/remote/reader.py:Reader._fetch (fed by resp.py:Replies.read via conn.py:_Link.read).

    A GET's reply reaches ``_fetch`` as whatever ``Replies.read`` parsed: ``None``, ``Landed``, ``Drained``, an
    error reply's exception -- or, for a well-formed reply of another type, an ``int`` or a ``list``.  The
    "arrived whole" branch (meant for the ``bytes`` of a redirection redis-py read) then runs
    ``memoryview(value)[verify_entry(value, ...)...]``: ``TypeError``, which is not ``CorruptEntry``, so it leaves
    ``_fetch`` and kills the reader thread.  ``_died`` answers the batch ``remote_down`` and restarts the thread
    -- three times; the fourth such reply leaves the store unhealthy for good (``tiered_kv_healthy{tier=
    "remote"}`` 0, the tier off until the process restarts), although the server answered every command and
    nothing in the process failed.  A garbled reply is a fault of one part (or of the link), never of the
    thread.

    FIX: in ``Replies.read(into)`` answer a ``GetInto`` whose reply is neither a bulk string, nil nor an error
    reply with ``InvalidResponse`` (raised: ``_Link.read`` then drops the link, whose stream is suspect, and
    each part fails ``server_error``); and/or in ``_fetch`` treat any value that is not ``bytes`` /
    ``Landed`` / ``Drained`` as a corrupt part (``reason="wrong_type"``) instead of calling ``memoryview`` on it.
    """
    srv = FakeRedis(lambda args: reply if args[0].upper() == b"GET" else None)
    fake_server.append(srv)
    h = rig.open(srv.url, timeout_s=2.0)
    assert h.store.healthy and h.store.breaker.closed
    answers = []
    for i in range(MAX_RESTARTS + 1):
        token, _ = h.fetch_async([b"key-%d" % i])
        r = h.report()
        assert r.token == token
        answers.append(r.failed)
    assert all(f is not None and 0 in f for f in answers), answers   # never a hit, whatever happens
    restarts = h.store._r.restarts
    assert restarts == 0 and h.store.healthy, (
        f"{MAX_RESTARTS + 1} GETs answered {reply!r} killed the reader thread {restarts} times "
        f"(healthy={h.store.healthy}): the remote tier is off for good; parts answered {answers}")


def test_a_value_of_no_bytes_type_reaching_the_reader_is_a_corrupt_part(
        rig: Rig, fake_server: list[FakeRedis]) -> None:  # noqa: F811
    """The reader's own guard behind the one above: a GET's value that is neither ``Landed``, ``Drained`` nor
    bytes (what redis-py's client, which the store falls back on for a redirection it does not follow itself,
    may hand back for a reply of another type) is a corrupt part counted ``wrong_type``, never a ``TypeError``
    that kills the reader thread."""
    srv = FakeRedis()
    fake_server.append(srv)
    h = rig.open(srv.url, timeout_s=2.0)
    h.store._r.conn.round_trip = lambda cmds: [7, [b"x"]][:len(cmds)]   # as a fallback's execute_command would
    token, _ = h.fetch_async([b"key-a", b"key-b"])
    r = h.report()
    assert r.token == token and r.failed == {0: FETCH_CORRUPT, 1: FETCH_CORRUPT}, r
    assert h.corrupt == ["wrong_type", "wrong_type"] and h.store._r.restarts == 0 and h.store.healthy


# =========================================================================== 2
_BIG = 64 << 20


@pytest.mark.parametrize("wire,into", [
    (b"$%d\r\n" % _BIG, None),                                       # a bulk answering a script / EXISTS / ASKING
    (b"*1\r\n$%d\r\n" % _BIG, GetInto("k", 60, memoryview(bytearray(256)))),   # a GET answered with an array
    (b"+" + b"x" * (8 << 20), None),                                  # a line that never ends
], ids=["bulk", "bulk_in_array_for_a_get", "endless_line"])
def test_a_reply_never_sizes_an_allocation_here(wire: bytes, into: Optional[GetInto]) -> None:
    """WRONG: tiered_kv/remote/resp.py:Replies.read and Replies._fill.

    The module promises "what the server sends never sizes an allocation here" (a GET's value of another
    length is drained in pieces of one reply buffer).  But any other bulk reply is read with
    ``value = bytearray(n)``, ``n`` straight off the wire -- including a bulk nested in an array that answers a
    ``GetInto`` (``[self.read() for ...]`` drops ``into``) -- allocated and zeroed before one byte of it
    arrived; ``$9223372036854775807`` asks for 8 EiB (MemoryError), ``$20000000000`` for 20 GB that Linux may
    grant and the memset then faults in (the host process OOM-killed).  ``_fill`` grows the buffer by doubling
    for as long as a line has no CRLF (and ``_line`` rescans it from its start after every recv: quadratic),
    with no limit.  None of the store's commands can get a bulk or a long line from a real Redis (its scripts
    and EXISTS answer integers, ASKING +OK), so a bound costs nothing; here 11 bytes from a garbled or
    foreign peer make the reader allocate 64 MiB
    (an 8 MiB line: 24 MiB).

    FIX: bound what a reply may size: a bulk reply to a command that is not a ``GetInto`` (and any bulk inside
    an array) longer than a small limit (e.g. ``READ_BUFFER``) is drained with ``_drain`` (or refused with
    ``InvalidResponse``, the link dropped); a line longer than a limit (e.g. 1 MiB: Redis's error texts are
    short) raises ``InvalidResponse``; ``_line`` resumes its CRLF search where the last one stopped.
    """
    r = replies(wire, (READ_BUFFER,), end="timeout")   # the rest of the reply never comes: the read times out
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        with pytest.raises(Exception):   # (redis-py's TimeoutError today; InvalidResponse once bounded)
            r.read(into)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    what = ("a line with no CRLF grew the reply buffer without bound" if wire[:1] == b"+" else
            "a bulk length read off the wire sized the allocation before its bytes arrived")
    assert peak < 4 << 20, f"a {len(wire)}-byte reply made Replies.read allocate {peak / (1 << 20):.0f} MiB: {what}"


@pytest.mark.parametrize("wire,what", [
    (b"*1\r\n" * 5000, "nested"),          # arrays in arrays: a RecursionError before the bound
    (b":12x\r\n", "not an integer"),        # a length or integer that is not one: ValueError before
    (b"*1\r\n$3\r\nabc\r\n", "a GET answered"),   # (into set below) a GET answered with an array
])
def test_a_reply_no_redis_sends_is_an_invalid_response(wire: bytes, what: str) -> None:
    """What the bounds above raise, and where a malformed length or deep nesting raised something else: every
    reply no Redis sends the store's commands is redis-py's ``InvalidResponse`` (the link then dropped)."""
    from redis.exceptions import InvalidResponse
    into = GetInto("k", 1, memoryview(bytearray(2))) if what == "a GET answered" else None
    with pytest.raises(InvalidResponse, match=what):
        replies(wire).read(into)


# =========================================================================== 3
def test_a_non_contiguous_view_is_refused_at_submit_not_by_the_writer_threads_death(
        rig: Rig, fake_server: list[FakeRedis]) -> None:  # noqa: F811
    """WRONG: tiered_kv/remote/store.py:RemoteStore._bytes_view (submit_puts / submit_fetch).  Lower severity:
    ``RemoteStore`` is public (``tiered_kv.remote.__all__``, driven directly by benchmarks/remote_raw.py), but
    the core only ever passes contiguous slab slices.

    ``_bytes_view`` checks a view's format, dimensions, size and writability, not that it is contiguous:
    ``memoryview(bytearray(512))[::2]`` (format "B", 1-D, 256 bytes) is accepted and queued.  The writer thread
    then hashes it (``pack_header`` -> xxh3 ``update``): ``BufferError: underlying buffer is not C-contiguous``
    kills the thread (one of its three restarts; the put answered ``remote_down``); a fetch into such a view
    would fail the same way inside ``recv_into``.  Bad input at the boundary should raise there, as a
    ``tiered_kv.errors`` exception naming the value -- ``submit_puts`` / ``submit_fetch`` / ``submit_probe`` raise
    plain ``ValueError`` for their other bad inputs (mismatched lengths, wrong size) too.

    FIX: in ``_bytes_view`` refuse ``not mv.c_contiguous`` (and raise ``InvalidBlockError`` / a ``TieredKVError``
    subclass for every bad view or length mismatch, naming it), before anything is queued.
    """
    from tiered_kv.errors import TieredKVError
    srv = FakeRedis()
    fake_server.append(srv)
    h = rig.open(srv.url, timeout_s=2.0)
    strided = memoryview(bytearray(2 * h.opts.block_bytes))[::2]
    assert strided.nbytes == h.opts.block_bytes and strided.format == "B" and strided.ndim == 1
    died = None
    try:
        h.store.submit_puts([uuid.uuid4()], [b"key"], [strided])
    except TieredKVError:
        pass
    else:
        h.store.kick()
        r = h.report()
        died = (r.failed, h.store._w.restarts)
    assert died is None, (f"a non-contiguous view was accepted by submit_puts; the writer thread died on it "
                          f"(part answered {died[0]}, writer restarts={died[1]})")
    with pytest.raises(TieredKVError):
        h.store.submit_puts([uuid.uuid4()], [b"a", b"b"], [memoryview(bytearray(h.opts.block_bytes))])
