"""RESP2 on one connection of the remote store, without a copy or an allocation per block.

redis-py hands every reply to Python as a new ``bytes`` object and takes every argument whole.  For a
remote tier that moves 256 KiB - 2 MiB blocks that costs, per block, a joined ``header + payload`` on
the way out, a fresh reply object on the way in, and the copy of that object into its host slot; and
glibc returns those short-lived large buffers to the kernel between batches (a trimmed heap top, an
unmapped chunk), so each one is faulted in again, page by page.  Measured on the bench machine
(`benchmarks/remote_raw.py`): the store's fetches ran at 0.36x of redis-py's own pipelined ``GET``,
with about 55 page faults per 256 KiB value.

So the store's I/O threads speak the protocol themselves, on connections that redis-py builds,
authenticates and configures (TLS, ``AUTH``, ``SELECT``, timeouts: :class:`redis.Connection`'s own
``connect``), and whose replies only this module reads:

* :func:`pack` writes commands as RESP2 arrays, small arguments coalesced into one buffer, and large
  ones -- a host slot's payload -- passed through as views (``sendall`` reads them in place); a
  :class:`Parts` argument is one bulk string sent as several buffers (the entry header, then the slot);
* :class:`Replies` parses replies from the socket into one reusable buffer; a :class:`GetInto`
  command's value is read with its head (header, namespace, key) into a small buffer and its payload
  straight into the caller's view (the reserved host slot), then verified there by the reader; a value of
  another length (never a block's: a foreign or damaged one) is read off the socket in bounded pieces,
  hashed as it goes, and only its first bytes kept (:class:`Drained`): what the server sends never
  sizes an allocation here: any other bulk reply longer than a reply buffer, a line longer than
  :data:`MAX_LINE`, arrays nested deeper than :data:`MAX_DEPTH`, or a :class:`GetInto` answered with
  anything but a bulk string, nil or an error (none of which the store's commands get from a Redis) raise
  ``InvalidResponse``, and the caller drops the connection.

Error replies become the exceptions redis-py would raise (``MOVED`` -> ``MovedError``, ``NOSCRIPT`` ->
``NoScriptError``, ...), returned in the command's place, never raised; a socket timeout or a closed
connection raises redis-py's ``TimeoutError`` / ``ConnectionError`` and leaves the stream unusable
(the caller disconnects).
"""

from __future__ import annotations

import hashlib
import socket
from typing import Any, NamedTuple, Optional, Sequence, Union

__all__ = ["Parts", "GetInto", "Landed", "Drained", "pack", "Replies", "LARGE"]

Buffer = Union[bytes, bytearray, memoryview]
LARGE = 16 << 10          # an argument at least this big is sent in place, not copied into the command buffer
READ_BUFFER = 64 << 10    # the reply buffer (lines, small values, the part of a value read ahead)
MAX_LINE = 1 << 20        # a reply's line (an error text) longer than this is not Redis's: InvalidResponse
MAX_DEPTH = 4             # arrays nested deeper than this (the store's commands get none nested): InvalidResponse
_CRLF = b"\r\n"


class Parts:
    """One bulk-string argument sent as several buffers (never joined)."""

    __slots__ = ("bufs", "size")

    def __init__(self, *bufs: Buffer) -> None:
        self.bufs = bufs
        self.size = sum(len(b) for b in bufs)

    def join(self) -> bytes:
        return b"".join(self.bufs)


class GetInto(NamedTuple):
    """``GET name`` whose value, when it is ``head`` + ``len(view)`` bytes long, is read with its first
    ``head`` bytes into a new small buffer and the rest straight into ``view``."""

    name: str
    head: int
    view: memoryview


class Landed(NamedTuple):
    """The answer to a :class:`GetInto` whose value had the expected length: its head (the payload is
    in the command's view now, not verified yet)."""

    head: bytes


class Drained(NamedTuple):
    """The answer to a :class:`GetInto` whose value had another length: its first bytes (at most the
    expected length and one reply buffer more), its whole length, and the sha1 (hex, as Lua's
    ``redis.sha1hex``) of all of it.  The rest was read off the socket and not kept."""

    prefix: bytes
    n: int
    sha: str


def _arg(a: Any) -> Buffer:
    if isinstance(a, (bytes, bytearray, memoryview)):
        return a
    if isinstance(a, str):
        return a.encode()
    if isinstance(a, bool):
        raise TypeError("a bool is not a RESP argument")
    if isinstance(a, int):
        return b"%d" % a
    if isinstance(a, float):
        return repr(a).encode()
    raise TypeError(f"cannot send a {type(a).__name__} as a RESP argument")


def pack(cmds: Sequence[Union[tuple[Any, ...], GetInto]]) -> list[Buffer]:
    """The RESP2 encoding of ``cmds``, as buffers to send in order: small pieces coalesced, large
    arguments (and each large buffer of a :class:`Parts`) as they are."""
    out: list[Buffer] = []
    cur = bytearray()
    for cmd in cmds:
        args = ("GET", cmd.name) if isinstance(cmd, GetInto) else cmd
        cur += b"*%d\r\n" % len(args)
        for a in args:
            bufs = a.bufs if isinstance(a, Parts) else (_arg(a),)
            size = a.size if isinstance(a, Parts) else len(bufs[0])
            cur += b"$%d\r\n" % size
            for b in bufs:
                if len(b) >= LARGE:
                    if cur:
                        out.append(bytes(cur))
                        cur.clear()
                    out.append(b)
                else:
                    cur += b
            cur += _CRLF
    if cur:
        out.append(bytes(cur))
    return out


class Replies:
    """Reads RESP2 replies from ``sock`` (a connected socket with its timeout set).

    ``parse_error(text)`` builds the exception of an error reply (redis-py's parser's).  After a
    :class:`~redis.exceptions.TimeoutError` or :class:`~redis.exceptions.ConnectionError` from
    :meth:`read` the stream is mid-reply: the caller must drop the connection.
    """

    def __init__(self, sock: socket.socket, parse_error: Any) -> None:
        self.sock = sock
        self._parse_error = parse_error
        self._buf = bytearray(READ_BUFFER)
        self._mv = memoryview(self._buf)
        self._start = 0
        self._end = 0

    @property
    def buffered(self) -> int:
        """Bytes read from the socket and not parsed yet (0 between trips, unless the stream is off)."""
        return self._end - self._start

    # ------------------------------------------------------------ the socket
    def _recv_into(self, view: memoryview) -> int:
        from redis.exceptions import ConnectionError, TimeoutError
        try:
            n = self.sock.recv_into(view)
        except socket.timeout as e:
            raise TimeoutError("Timeout reading from the remote store") from e
        except OSError as e:
            raise ConnectionError(f"Error while reading from the remote store: {e}") from e
        if n == 0:
            raise ConnectionError("the remote store closed the connection")
        return n

    def _fill(self) -> None:
        """Read more into the buffer (moving what is unread to its front first)."""
        start, end = self._start, self._end
        if start == end:
            self._start = self._end = start = end = 0
        elif end == len(self._buf):
            if start == 0:   # a line longer than the buffer: grow it (error texts, never values)
                self._mv.release()
                self._buf += bytes(len(self._buf))
                self._mv = memoryview(self._buf)
            else:
                self._buf[:end - start] = self._mv[start:end]
                self._start, self._end = 0, end - start
        self._end += self._recv_into(self._mv[self._end:])

    def _line(self) -> bytes:
        seen = 0   # bytes past _start searched already (less the last: a CR there may start the CRLF)
        while True:
            start = self._start
            i = self._buf.find(_CRLF, start + seen, self._end)
            if i >= 0:
                line = bytes(self._mv[start:i])
                self._start = i + 2
                return line
            unread = self._end - start
            if unread > MAX_LINE:
                raise _invalid(f"a reply line of over {MAX_LINE} bytes with no CRLF: "
                               f"{bytes(self._mv[start:start + 64])!r}")
            seen = max(0, unread - 1)
            self._fill()

    def _read_into(self, view: memoryview) -> None:
        """Exactly ``len(view)`` bytes of the stream into ``view``: what is buffered, then from the socket."""
        need = len(view)
        got = min(need, self._end - self._start)
        if got:
            view[:got] = self._mv[self._start:self._start + got]
            self._start += got
        while got < need:
            got += self._recv_into(view[got:])

    def _skip_crlf(self) -> None:
        while self._end - self._start < 2:
            self._fill()
        self._start += 2

    def _drain(self, n: int, keep: int) -> "Drained":
        """A bulk value of ``n`` bytes: its first ``keep`` kept, all of it hashed, the rest read in pieces of
        one reply buffer and dropped."""
        prefix = bytearray(min(n, keep))
        self._read_into(memoryview(prefix))
        h = hashlib.sha1(prefix)
        left = n - len(prefix)
        if left:
            piece = memoryview(bytearray(min(left, READ_BUFFER)))
            while left:
                m = min(left, len(piece))
                self._read_into(piece[:m])
                h.update(piece[:m])
                left -= m
        self._skip_crlf()
        return Drained(bytes(prefix), n, h.hexdigest())

    # ------------------------------------------------------------ replies
    def read(self, into: Optional[GetInto] = None, depth: int = 0) -> Any:
        """The next reply: bytes, int, None, a list, an exception instance (an error reply), or -- for
        ``into`` -- :class:`Landed` (a value of the expected length) or :class:`Drained` (of another).
        ``InvalidResponse`` for a reply no Redis sends the store's commands (see the module's docstring)."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if into is not None and kind not in (b"$", b"-"):   # a GET's reply is a bulk string, nil or an error
            raise _invalid(f"a GET answered {line[:64]!r}")
        if kind == b"$":
            n = _length(line)
            if n < 0:
                return None
            if into is not None:
                want = into.head + len(into.view)
                if n == want:
                    head = bytearray(into.head)
                    self._read_into(memoryview(head))
                    self._read_into(into.view)
                    self._skip_crlf()
                    return Landed(bytes(head))
                return self._drain(n, want + READ_BUFFER)
            if n > READ_BUFFER:   # the store's other commands get short bulks (a script's sha) if any
                raise _invalid(f"a {n}-byte bulk reply to a command that is not a block's GET")
            value = bytearray(n)
            self._read_into(memoryview(value))
            self._skip_crlf()
            return bytes(value)
        if kind == b":":
            return _length(line)
        if kind == b"+":
            return rest
        if kind == b"-":
            return self._parse_error(rest.decode("utf-8", "replace"))
        if kind == b"*":
            n = _length(line)
            if n >= 0 and depth >= MAX_DEPTH:
                raise _invalid(f"arrays nested over {MAX_DEPTH} deep")
            return None if n < 0 else [self.read(None, depth + 1) for _ in range(n)]
        raise _invalid(f"unexpected reply from the remote store: {line[:64]!r}")


def _invalid(text: str) -> Exception:
    """redis-py's ``InvalidResponse``: a reply no Redis sends here (the caller drops the connection)."""
    from redis.exceptions import InvalidResponse
    return InvalidResponse(text)


def _length(line: bytes) -> int:
    """The integer after a reply line's type byte; ``InvalidResponse`` where it is not one."""
    try:
        return int(line[1:])
    except ValueError:
        raise _invalid(f"not an integer in reply line {line[:64]!r}") from None
