"""The remote tier's store: what the owner-side core drives, and the two I/O threads behind it.

Every method the owner calls only queues work (under a short lock) and returns: the writer thread
(:mod:`.writer`: puts, cancels, invalidations, deletes of corrupt values) and the reader thread
(:mod:`.reader`: fetches) each own a connection and answer with :class:`~tiered_kv.reports.Report`
objects on the owner's :class:`~tiered_kv.reports.CompletionQueue`.  Faults never raise into the
owner: each op fails with its error kind (``on_error``), and the circuit breaker (:mod:`.breaker`)
turns a server that does not answer into immediate ``remote_down`` answers until a probe succeeds.

The server-side data model and the scripts are in :mod:`.keys`; the url forms in :mod:`.url`.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from typing import Any, Callable, Optional

from ..config import check_namespace
from ..errors import ConfigError, InvalidBufferError, InvalidKeyError
from ..reports import CompletionQueue
from .breaker import Breaker
from .conn import Conn, error_kind, import_redis
from .iothread import IOThread
from .keys import KeyNames
from .reader import Reader
from .records import REMOTE_ERROR_KINDS, RemoteOptions, tomb_ttl_problem
from .url import parse_url, redact_url
from .writer import Writer

__all__ = ["RemoteStore", "USE_EVALSHA"]

log = logging.getLogger(__name__)

# How long close() waits for an I/O thread once it shut the thread's sockets.  Past a shut, the thread fails its
# trip at once and makes no connection, but it may be inside a redis-py call on a connection of its client's own
# pool (a cluster's slot table reload, a redirection, a ping), bounded by timeout_s per connect and per read; it
# touches no host slot once shut, so this bounds only how long close() waits for it to let go and exit.
SHUT_JOIN_S = 30.0

# EVALSHA (scripts cached on the server, reloaded on NOSCRIPT) or EVAL (the script's text every time):
# measured with benchmarks/remote_raw.py, see its docstring.
USE_EVALSHA = True


def _guarded(name: str, cb: Callable[..., None]) -> Callable[..., None]:
    """``cb`` called from an I/O thread: an exception in it is logged, never kills the thread."""
    def call(*args: Any) -> None:
        try:
            cb(*args)
        except Exception:  # noqa: BLE001 - the owner's callback; the I/O thread goes on
            log.exception("remote store: the %s callback raised", name)
    return call


class RemoteStore:
    """A Redis/Valkey tier (standalone, unix socket, TLS, cluster) behind non-blocking owner-side calls.

    Construction contacts the server once (bounded by ``timeout_s``): a server that does not answer
    leaves the breaker open and the store recovers by itself.  Raises
    :class:`~tiered_kv.errors.ConfigError` for a malformed url (named with its password redacted),
    bad options, or a missing ``redis`` package.
    """

    def __init__(self, opts: RemoteOptions, completions: CompletionQueue, *,
                 on_error: Callable[[str, str], None] = lambda kind, msg: None,
                 on_refused: Callable[[str], None] = lambda reason: None,
                 on_corrupt: Callable[[str], None] = lambda reason: None,
                 client_factory: Optional[Callable[[], Any]] = None,
                 use_evalsha: Optional[bool] = None) -> None:
        """``client_factory``: tests only, builds each I/O thread's redis client (default: from ``opts.url``).
        ``use_evalsha``: benchmarks only (default :data:`USE_EVALSHA`)."""
        _check(opts)
        target = parse_url(opts.url)
        import_redis()
        self.opts = opts
        self.url = target.redacted
        self.names = KeyNames(opts.namespace)
        name = f"remote {target.redacted}"
        self._closed = False
        self._closing = False
        self._writer: Optional[Writer] = None
        self._reader: Optional[Reader] = None
        err = _guarded("on_error", on_error)
        self._on_error = err
        self.breaker = Breaker(opts.breaker_failures, opts.breaker_backoff_min_s, opts.breaker_backoff_max_s,
                               on_open=lambda msg: err("breaker_open", msg), on_change=self._wake_all, name=name)
        evalsha = USE_EVALSHA if use_evalsha is None else use_evalsha
        wconn = Conn(target, opts.timeout_s, evalsha, client_factory, name=name + " writer")
        rconn = Conn(target, opts.timeout_s, evalsha, client_factory, name=name + " reader")
        try:
            wconn.ping()
        except Exception as e:  # noqa: BLE001 - unreachable: start with the breaker open
            kind, msg = error_kind(e), f"{type(e).__name__}: {e}"
            log.warning("%s: not reachable at start (%s)", name, msg)
            err(kind, msg)
            wconn.reset()
            self.breaker.trip(f"not reachable at start: {msg}")
        self._writer = Writer(opts, self.names, wconn, self.breaker, completions, err,
                              _guarded("on_refused", on_refused), name=name)
        self._reader = Reader(opts, self.names, rconn, self.breaker, completions, err,
                              _guarded("on_corrupt", on_corrupt), self._writer.drop, name=name)
        log.info("%s: remote store open (namespace id %s)", name, self.names.ns_id)

    # ------------------------------------------------------------ owner thread, non-blocking
    def put_room(self) -> int:
        """How many more put parts fit now (0 while the breaker is open or the store is closed)."""
        return self._w.room()

    def submit_puts(self, tokens: list[uuid.UUID], keys: list[bytes], views: list[memoryview]) -> bool:
        """Queue one put job: part ``i`` publishes ``keys[i]`` under ``tokens[i]`` from ``views[i]`` (read until
        the job is answered).  False, nothing queued, when the parts do not fit."""
        n = len(keys)
        if not n or len(tokens) != n or len(views) != n:
            raise InvalidBufferError(f"submit_puts: {len(tokens)} tokens, {n} keys, {len(views)} views")
        return self._w.submit(tokens, keys, [self._bytes_view(v) for v in views])

    @property
    def puts_accepted(self) -> int:
        """How many put jobs were queued, counted in the step that queued each (the owner reads back how far a start
        an interrupt broke off went: ``TierCore._put_start_broken``)."""
        return self._w.accepted

    def take_fetch_room(self, n: int) -> bool:
        """Hold room for a fetch of ``n`` parts, before the owner reserves (and may evict for) its host slots;
        False when it would be refused now.  The fetch then goes in with ``submit_fetch(..., room_taken=True)``."""
        return self._r.take_room(n)

    @property
    def fetch_room_held(self) -> int:
        """Room :meth:`take_fetch_room` holds that no :meth:`submit_fetch` used and :meth:`give_fetch_room` did not
        give back (the owner's: it reads back how far a start an interrupt broke off went)."""
        return self._r.room_held

    @property
    def reads_accepted(self) -> int:
        """How many probe and fetch jobs were queued, moved in the same step that queued each (as above)."""
        return self._r.accepted

    def give_fetch_room(self, n: int) -> None:
        """Give back room :meth:`take_fetch_room` held for parts that will not be fetched."""
        self._r.give_room(n)

    def submit_fetch(self, token: uuid.UUID, keys: list[bytes], views: list[memoryview],
                     room_taken: bool = False) -> bool:
        """Queue one fetch job (``keys[i]`` into ``views[i]``).  A part answered ok holds verified bytes; a part
        that failed may have been written with unverified ones (a value read into its view before it failed
        verification, or cut off by a timeout or a lost connection), so the owner must not publish a failed
        part's view (the core frees that host slot).  False when not queued: breaker open, store closed, or
        too many fetch parts queued."""
        n = len(keys)
        if not n or len(views) != n:
            raise InvalidBufferError(f"submit_fetch: {n} keys, {len(views)} views")
        return self._r.submit(token, keys, [self._bytes_view(v, writable=True) for v in views], room_taken=room_taken)

    def submit_probe(self, token: uuid.UUID, keys: list[bytes]) -> bool:
        """Queue one probe job: does the server hold a value of each of ``keys``?  Answered like a fetch
        (``failed[i]`` is ``miss`` for a key it does not hold), with nothing copied: the owner reserves
        host slots only for the keys held, and fetches those.  False when not queued (as :meth:`submit_fetch`)."""
        if not keys:
            raise InvalidKeyError("submit_probe: no keys")
        return self._r.submit(token, keys, [], probe=True)

    def cancel(self, token: uuid.UUID, key: bytes) -> None:
        """The put of ``key`` under ``token`` never becomes visible: dropped if unsent, refused by a token tombstone
        if late, deleted (token-matched) if it landed."""
        self._w.cancel(token, key)

    def invalidate(self, key: bytes) -> None:
        """A key tombstone refusing every machine's writes of ``key`` for ``tomb_ttl_seconds``, and its value deleted
        (one script); this store's unsent puts of ``key`` are dropped."""
        self._w.invalidate(key)

    def invalidating(self, key: bytes) -> bool:
        """An INVALIDATE of ``key`` has not run on the server yet (queued, in flight, or waiting to be sent
        again), or never will (dropped) and a value written before it may not have expired there: the server
        may still hold its old value.  Reads of the writer's maps without its lock (a dict lookup each:
        atomic under the GIL)."""
        w = self._w
        if key in w.invalidating:
            return True
        # lost before lost_all_until: an overflow sets the second before it clears the first
        until = w.lost.get(key) if w.lost else None
        if until is not None or w.lost_all_until:
            now = time.monotonic()
            return now < w.lost_all_until or (until is not None and now < until)
        return False

    def kick(self) -> None:
        """End of the owner's step: send what was queued during it."""
        self._w.kick()
        self._r.kick()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (for up to ``timeout``), answer the rest ``remote_down``, stop the threads.
        Idempotent: each step can run again, and a close an interrupt broke off is finished by the next one."""
        if self._closed or self._writer is None or self._reader is None:
            return
        self._closing = True   # (takes no more work; _closed once every step is done)
        deadline = time.monotonic() + max(0.0, timeout)
        self._writer.begin_close(deadline)
        self._reader.begin_close(deadline)
        grace = deadline + self.opts.timeout_s * 2   # a round trip under way when the deadline passes
        threads: list[IOThread] = [self._writer, self._reader]
        stuck = [t for t in threads if not t.join(grace - time.monotonic())]
        # A round trip is not bounded by timeout_s (that bounds each send and recv of a chunk; a cluster trip adds a
        # slot table reload and redirections), and a stuck one would touch host slots after close() returned --
        # the owner frees them then.  Shut its sockets: its trip fails at once, it makes no new connection, and
        # it touches no slot once shut (Conn.guard).  Each thread closes its own connection as it exits.
        for t in stuck:
            log.warning("%s: the remote %s thread did not stop within %.1f s: shutting its connection", self.url,
                        t.role, grace - deadline + timeout)
            t.conn.shut()
        for t in stuck:
            if not t.join(SHUT_JOIN_S):
                log.error("%s: the remote %s thread did not stop %.0f s after its connection was shut", self.url,
                          t.role, SHUT_JOIN_S)
        self._closed = True
        log.info("%s: remote store closed", self.url)

    @property
    def available(self) -> bool:
        """The breaker is closed (the server answers) and the store takes work."""
        return self.breaker.closed and self.healthy and not self._closing

    @property
    def queue_depth(self) -> int:
        """Put parts queued and not answered yet."""
        return self._w.puts_pending

    @property
    def healthy(self) -> bool:
        """False once an I/O thread died more often than it is restarted: the store refuses all work."""
        return self._w.healthy and self._r.healthy

    # ------------------------------------------------------------ tests, benchmarks, tools
    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until everything queued so far was sent and answered (kicks both threads); False on timeout, and
        at once while the breaker holds tombstone ops back or a thread is gone for good.  Not for the owner's hot
        path: tests, benchmarks and shutdown."""
        end = time.monotonic() + timeout
        return self._w.wait_idle(timeout) and self._r.wait_idle(max(0.0, end - time.monotonic()))

    def wait_writes(self, timeout: float = 10.0) -> bool:
        """Block until every write op queued so far -- puts, cancels, invalidations -- was sent and answered (kicks
        the writer); False on timeout or while the breaker holds tombstone ops back.  For a blocking ``flush()``:
        waiting for the put jobs' reports alone does not cover a cancel or an invalidate, which have none."""
        return self._w.wait_idle(timeout)

    def set_test_hook(self, hook: Optional[Callable[[str], None]]) -> None:
        """Tests: ``hook("write")`` / ``hook("read")`` runs on the I/O thread between taking a batch and sending it."""
        self._w.hook = hook
        self._r.hook = hook

    @property
    def tombs_dropped(self) -> int:
        """Tombstone ops given up (close while the server was away, overflow, refused too often)."""
        return self._w.tombs_dropped

    # ------------------------------------------------------------ internals
    @property
    def _w(self) -> Writer:
        assert self._writer is not None
        return self._writer

    @property
    def _r(self) -> Reader:
        assert self._reader is not None
        return self._reader

    def _bytes_view(self, v: Any, writable: bool = False) -> memoryview:
        """``v`` as a flat byte view, checked here: the I/O threads hash it and read into it in place."""
        try:
            mv = v if isinstance(v, memoryview) else memoryview(v)
        except TypeError:
            raise InvalidBufferError(f"a block's buffer must support the buffer protocol, got "
                                     f"{type(v).__name__}: {v!r:.80}") from None
        if not mv.c_contiguous:   # (before the cast: it refuses one)
            raise InvalidBufferError(f"a block's buffer must be C-contiguous, got a view of shape {mv.shape}, "
                                     f"strides {mv.strides}")
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        if mv.nbytes != self.opts.block_bytes:
            raise InvalidBufferError(f"a view of {mv.nbytes} bytes, the remote tier's blocks are "
                                     f"{self.opts.block_bytes}")
        if writable and mv.readonly:
            raise InvalidBufferError("a fetch needs writable views, got a read-only one")
        return mv

    def _wake_all(self) -> None:
        for t in (self._writer, self._reader):
            if t is not None:
                t.wake()

    def __repr__(self) -> str:
        return f"RemoteStore({self.url}, available={self.available}, queue_depth={self.queue_depth})"


def _check(opts: RemoteOptions) -> None:
    def bad(what: str) -> ConfigError:
        return ConfigError(f"remote tier ({redact_url(opts.url)}): {what}")
    try:   # the namespaces TieredKVConfig accepts: short enough for every entry header (the writer's pack_header)
        check_namespace(opts.namespace)
    except ConfigError as e:
        raise bad(str(e)) from None
    for name in ("block_bytes", "queue_blocks", "batch_blocks", "tomb_ttl_seconds", "breaker_failures"):
        v = getattr(opts, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise bad(f"{name} must be a positive int, got {v!r}")
    if opts.ttl_seconds is not None and (not isinstance(opts.ttl_seconds, int) or opts.ttl_seconds <= 0):
        raise bad(f"ttl_seconds must be a positive int or None, got {opts.ttl_seconds!r}")
    for name in ("timeout_s", "write_deadline_s", "breaker_backoff_min_s", "breaker_backoff_max_s"):
        v = getattr(opts, name)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not (0 < v < math.inf):
            raise bad(f"{name} must be a positive finite number, got {v!r}")
    problem = tomb_ttl_problem(opts.tomb_ttl_seconds, opts.write_deadline_s, opts.timeout_s)
    if problem is not None:
        raise bad(f"tomb_ttl_seconds={opts.tomb_ttl_seconds} {problem}")
    assert "breaker_open" in REMOTE_ERROR_KINDS
