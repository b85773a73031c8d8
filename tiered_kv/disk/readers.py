"""The disk reader threads: promotes, read in file order and verified before they are answered.

Owns the read queue, the reads held by :meth:`Readers.hold` until :meth:`Readers.start`, and the
reader threads.  A reader takes the reads queued behind the first (up to ``read_batch_bytes``),
looks them up in one read transaction and reads them in file order, runs of neighbouring slots by
one ``preadv`` straight into the host slots: the kernel's readahead then sees a stream.
Invariants:

* each read is answered exactly once (also when the read path raises);
* a read that finds its entry corrupt, or fails with an I/O error, also queues the entry's removal
  with the writer (re-verified, resp. token-matched, there): the owner only forgets the key;
* a read whose transaction cannot begin (LMDB's reader table full -- it is shared with the read-only
  operator tools --, the map resized, a stale reader slot) learnt nothing about its entry: it is
  answered ``NOT_READ`` (counted), and the entry stays, on disk and in the owner's index;
* a reader thread that dies (a ``BaseException`` in its read path, after it answered what it took)
  starts its replacement first, as a copy worker does (movers/thread.py): the reads queued behind it
  are still read, and :meth:`Readers.join` joins the replacements too.  A replacement that cannot
  start (a thread or memory limit) is counted; when no reader is left, the dying one answers the
  reads queued ``NOT_READ``, and so is every later read until :meth:`Readers.start` can start a
  reader again (it tries at each pass): no read waits for a reader that never comes;
* a reader that finds a slot's bytes changed under it (the entry was dropped and the slot reused
  meanwhile) reports a miss, not corruption: it re-reads the index before blaming the bytes;
* every read transaction runs under the environment's ``rw`` lock, shared (see env.py).

Longer than the project's usual 500 lines: the held reads, the reports of the reads the owner served
(``_served``), the queue and the threads that replace a dead reader all move reads between the same
lists under one lock, in steps an interrupt must not split; split, each part would reach into the others'.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
import uuid
from typing import Any, Callable, Iterator, Optional, Union

import lmdb

from ..jobs import JobKind
from ..reports import CompletionQueue, Report
from .cached import CachedReads
from .env import DiskEnv
from .format import CorruptEntry, EntryHeader, lmdb_key, parse_header, verify_entry
from .records import CORRUPT, NOT_READ, READ_FAILED, Delete, DiskOptions, Promote, error_kind
from .slots import SlotFile

__all__ = ["Readers", "READ_BATCH_MAX"]

log = logging.getLogger(__name__)

_OFFSET_MAX = (1 << 63) - 1   # the largest file offset: a damaged record's slot may name one past it

READ_BATCH_MAX = 256   # reads a reader takes at once, at most: small blocks' lookups all come before the first read
IOV_MAX_SLOTS = 1024 // 2   # slots per preadv, at most: IOV_MAX is 1024 and each slot after the first takes a pad too

_Queued = Union[Promote, "list[Promote]", None]


def _same_name(h: EntryHeader, op: Promote) -> None:
    """Another writer's record found under ``op.key``'s index name: it must be indexed under that name itself (the
    key written again, or a long key's digest name shared with a short key), else it is damage (a record copied
    under another name) -- :class:`CorruptEntry`, as recovery's ``lmdb_key_mismatch``."""
    if lmdb_key(h.key) != lmdb_key(op.key):
        raise CorruptEntry("wrong_key", f"a record of key {h.key[:32]!r} under another key's name")


class _NotBegun(Exception):
    """A read transaction that could not begin (``lmdb.Error`` from ``env.begin``): nothing was read."""

    def __init__(self, cause: lmdb.Error) -> None:
        super().__init__(str(cause))
        self.cause = cause


class Readers:
    def __init__(self, opts: DiskOptions, out: CompletionQueue, db: DiskEnv, slots: SlotFile,
                 push: Callable[[Any], None], on_error: Callable[[str, str], None],
                 on_corrupt: Callable[[str], None]) -> None:
        self.opts = opts
        self._out = out
        self._db = db
        self._slots = slots
        self._push = push
        self._on_error = on_error
        self._on_corrupt = on_corrupt
        self._ns = opts.namespace.encode()
        self._reads: "queue.SimpleQueue[_Queued]" = queue.SimpleQueue()
        self._held_reads: list[Promote] = []   # hold(): handed to the readers by start()
        self._served: list[Report] = []        # reports of reads served on the owner's thread, not queued yet
        self._lock = threading.Lock()   # the list of reader threads (a dying reader adds its replacement)
        self._threads: list[threading.Thread] = []
        # no reader thread is left (the last that died could not start its replacement): the reads are
        # answered NOT_READ at once, until a reader starts again (start() tries); under _lock
        self._readerless = False
        try:
            for _ in range(opts.num_readers):
                self._spawn()
        except BaseException:   # a thread that cannot start: those started end before the open fails
            self.stop()
            self.join()
            raise

    def _spawn(self) -> None:
        t = threading.Thread(target=self._reader_main, name="tiered-kv-disk-reader", daemon=True)
        t.start()
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
            self._readerless = False

    # ------------------------------------------------------------ owner side
    def hold(self, op: Promote) -> None:
        """Hold a read in the caller's thread until :meth:`start` (a list append: no lock, no wake-up)."""
        self._held_reads.append(op)

    def serve_cached(self, cached: CachedReads, until: Optional[float] = None) -> bool:
        """Answer the held reads the page cache holds on the calling thread (the blocked owner's:
        :meth:`CachedReads.read` never waits on the disk; none starts past ``until``), a chunk per pass
        (:meth:`CachedReads.read_chunk`); the others stay held for :meth:`start`.  True when every read of the
        chunk was served and reads after it are left: the owner's next pass's, not the readers'."""
        if self._served:
            self._queue_served()
        held = self._held_reads
        if not held:
            return False
        served, rest, later = cached.read_chunk(held, until)
        if served:
            n = len(served)
            # one step (no call between the stores, so no signal handler runs there): the served reads
            # leave the held ones, never to run again (a second read would write a host slot that the first
            # report may have given back), their reports wait to be queued, and they are counted served
            self._held_reads, self._served = rest + later, served
            cached.served += n
            self._queue_served()
        return bool(later)

    def _queue_served(self) -> None:
        """Queue the reports of the reads served on the owner's thread.  An interrupt in the middle leaves them
        all to the owner's next pass (``serve_cached``, ``start``): a report queued twice is counted stale,
        none is lost."""
        self._out.put_many(self._served)
        self._served = []

    def start(self, lone_here: bool = False) -> None:
        """Hand the held reads to the readers, in batches of what one reader takes at once: one queue
        item (at most one wake-up) per batch, and the reader that takes it sees the whole batch, so it
        reads in file order from the start.  ``lone_here``: a lone held read runs in the calling
        thread instead (the disk I/O process's command thread: no hand-off; never the engine's
        thread, whose ``wait(timeout=...)`` must not wait on a disk)."""
        if self._served:   # (left by an interrupted pass)
            self._queue_served()
        held = self._held_reads
        if not held:
            return
        if lone_here and len(held) == 1:
            self._held_reads = []
            self._run(held)
            return
        if self._enqueue():
            return
        try:   # no reader is left: try to start one again (the thread limit may have eased)
            self._spawn()
        except Exception as exc:   # noqa: BLE001 - still none: these reads are answered, not left queued
            self._answer_unread(held, f"no disk reader thread could start ({exc!r})")
            return
        if not self._enqueue():   # pragma: no cover - the reader just started died before they were queued
            self._answer_unread(held, "no disk reader thread is left")

    def _answer_unread(self, held: list[Promote], why: str) -> None:
        """Answer the held reads ``held`` unread (no reader to take them).  Their answers are made first, and
        the reads leave the held ones in the same step as their reports join the ones still to queue (no call
        between the stores): an interrupt leaves them held, or answered, never lost."""
        reports = [r for _, r in self._unread(held, why)]
        self._held_reads, self._served = [], reports   # (start() queued what _served held before)
        self._queue_served()

    def _enqueue(self) -> bool:
        """Queue the held reads for the readers in batches and let them go; False (nothing queued, the reads
        still held) when no reader is left.  Under ``_lock``, so that a dying last reader, which takes what
        is queued (:meth:`_orphaned`), sees them.  The reads leave the held ones in the same step as they
        are queued (a store, then one C loop of puts made beforehand: no call, so no signal handler, in
        between), so an interrupt neither loses one nor queues one twice."""
        held = self._held_reads
        limit = self._read_limit()
        batches = [held[i:i + limit] for i in range(0, len(held), limit)]
        puts = map(self._reads.put, batches)   # (made before: the call that makes it may run a signal handler)
        with self._lock:
            if self._readerless:
                return False
            self._held_reads = []
            collections.deque(puts, 0)
        return True

    def _unread(self, ops: list[Promote], why: str) -> list[tuple[Promote, Report]]:
        """``ops`` answered without a read: misses whose entries stay (``NOT_READ``), counted once."""
        self._on_error("reader_error", why)
        return [(op, Report(op.token, JobKind.PROMOTE, False, f"{NOT_READ} ({why})")) for op in ops]

    def stop(self) -> None:
        """The readers finish the reads queued before their stop sentinel (held ones included), then end."""
        self.start()
        with self._lock:
            n = len(self._threads)
        for _ in range(n):
            self._reads.put(None)

    def join(self, timeout: Optional[float] = None) -> bool:
        """After :meth:`stop`: wait for the readers to end, the replacements of those that died on the way
        included (a dying reader adds its replacement before it ends, and leaves it the stop sentinel it
        took, if it took one: see :meth:`_reader_main`).  False when one still runs after ``timeout``
        seconds (None: no limit): a read hung in the kernel."""
        deadline = None if timeout is None else time.monotonic() + timeout
        joined: set[threading.Thread] = set()
        while True:
            with self._lock:
                threads = [t for t in self._threads if t not in joined]
            if not threads:
                return True
            for t in threads:
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
                if t.is_alive():
                    return False
            joined.update(threads)

    def _read_limit(self) -> int:
        return max(1, min(READ_BATCH_MAX, self.opts.read_batch_bytes // self.opts.block_bytes))

    # ------------------------------------------------------------ reader threads
    def _reader_main(self) -> None:
        stop = False   # this reader took its stop sentinel
        try:
            while True:
                item = self._reads.get()
                if item is None:
                    return
                ops, stop = self._take_queued(item)
                self._run(ops)
                if stop:   # this reader's stop sentinel came up behind the reads it took
                    return
        except BaseException as exc:
            # dying (``_run`` answered its reads and counted it: reader_error): the reads queued behind need a
            # reader, so a replacement starts before this one ends (join() joins it too, also while the store
            # closes), and gets the stop sentinel this one took: one sentinel per live reader, as stop() put
            log.debug("disk reader thread died (%r); starting another", exc)
            if stop:
                self._reads.put(None)
            try:
                self._spawn()
            except Exception as sexc:   # noqa: BLE001 - a thread or memory limit: answered, never left queued
                orphans = self._orphaned()
                log.error("disk tier %s: a disk reader thread died and its replacement could not start (%r); %s",
                          self.opts.path, sexc, "no reader is left: reads are answered as misses until one "
                          "starts" if orphans is not None else "the other readers go on")
                if orphans:
                    self._answer(self._unread(orphans, f"no disk reader thread could start ({sexc!r})"))
            raise

    def _orphaned(self) -> "list[Promote] | None":
        """A dying reader whose replacement could not start: None when another reader is alive (it takes the
        queued reads); else mark the readers gone and take every read queued (the caller answers them)."""
        me = threading.current_thread()
        with self._lock:
            self._threads = [x for x in self._threads if x is not me and x.is_alive()]
            if self._threads:
                return None
            self._readerless = True
            ops: list[Promote] = []
            while True:
                try:
                    item = self._reads.get_nowait()
                except queue.Empty:
                    return ops
                if isinstance(item, list):
                    ops += item
                elif item is not None:   # a stop sentinel: no reader is left to stop
                    ops.append(item)

    def _run(self, ops: list[Promote]) -> None:
        """Read, verify and answer ``ops`` (a reader thread's batch, or a lone read, see :meth:`start`)."""
        first = ops[0]
        answered: set[uuid.UUID] = set()
        try:
            # a lone read skips the batch machinery: less time per read, same outcomes
            for group in (self._read_many(ops) if len(ops) > 1 else [[(first, self._read(first))]]):
                self._answer(group)
                answered.update(op.token for op, _ in group)
        except BaseException as exc:
            # a bug or an interrupt inside the read path: every read taken is still answered
            # once (failed, its entry removed like any unreadable one), and the reader goes on
            self._on_error("reader_error", repr(exc))
            self._answer([(op, Report(op.token, JobKind.PROMOTE, False, f"{READ_FAILED} ({exc!r})"))
                          for op in ops if op.token not in answered])
            if not isinstance(exc, Exception):
                raise

    def _answer(self, group: list[tuple[Promote, Report]]) -> None:
        """Answer reads that leave together (a run's: one frame to the owner, one wake-up of its thread)."""
        for op, r in group:
            if not r.ok and r.error is not None:
                # a bad entry stays out of the owner's index from now on: remove it here, where the
                # reason is known, so that it holds no slot outside the capacity count
                # token-matched (never a newer write of the key), and never re-read by the writer: the
                # owner has forgotten the entry, so one kept because a second read found it good would
                # hold a slot outside the capacity count, and a record whose length field is damaged
                # would fail every later batch when the writer tried to read that many bytes
                if r.error.startswith(CORRUPT):
                    self._push(Delete(op.expect, op.key, found_corrupt=True))
                elif r.error.startswith(READ_FAILED):
                    self._push(Delete(op.expect, op.key))      # only if still the write that was read
        if group:
            self._out.put_many([r for _, r in group])

    def _take_queued(self, first: Union[Promote, list[Promote]]) -> tuple[list[Promote], bool]:
        """``first`` (a read, or a batch from :meth:`start`) and the reads queued behind it, up to
        ``read_batch_bytes`` and ``READ_BATCH_MAX`` reads, a queued batch taken whole; True if a stop
        sentinel came."""
        ops = list(first) if isinstance(first, list) else [first]
        limit = self._read_limit()
        while len(ops) < limit:
            try:
                nxt = self._reads.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                return ops, True
            if isinstance(nxt, list):
                ops += nxt
            else:
                ops.append(nxt)
        return ops, False

    def _read_many(self, ops: list[Promote]) -> Iterator[list[tuple[Promote, Report]]]:
        """The reads of a batch: index records in one read transaction, slots in file order, runs of
        neighbouring slots in one ``preadv``; reports in file order, each run's as soon as it is verified,
        in groups that leave together (a run's; those the lookups answered; a read done on its own).

        Why: a slot nobody read lately comes from the device, and slots are
        allocated in the writer's order, not the engine's.  In queue order the
        reads are a shuffle of block-sized synchronous requests; in file order
        on one descriptor the kernel's readahead sees a stream and keeps large
        requests in flight ahead of the reader.  One transaction and one read
        per run also take the GIL fewer times per block.  An LMDB error in the
        lookups, or an I/O error reading several slots at once, sends the reads
        concerned through :meth:`_read` one by one, which reports each its own
        way; a lone slot's I/O error is its read's answer.
        """
        n = self.opts.block_bytes
        sb = self._slots.slot_bytes
        fd = self._slots.fd
        # a run's reports get the reader's time since the report before (the first: since the batch began,
        # its lookups included); an inline entry's, the time of its own lookup and copy
        t_last = time.perf_counter()
        todo: list[tuple[int, Promote, bytes, EntryHeader]] = []   # (slot, op, index record, header)
        env = self._db.env
        if env is None:
            for op in ops:
                yield [(op, self._read(op))]
            return
        done: list[tuple[Promote, Report]] = []
        try:
            self._db.rw.acquire_shared()
            try:
                with self._begin(env) as txn:
                    for op in ops:
                        found = self._lookup(txn, op, time.perf_counter())
                        if isinstance(found, Report):
                            done.append((op, found))
                        else:
                            todo.append((found[1].slot, op, found[0], found[1]))
            finally:
                self._db.rw.release_shared()
        except _NotBegun as nb:   # nothing looked up: each read is a miss that keeps its entry
            yield self._not_read(ops, nb.cause)
            return
        except lmdb.Error:
            for op in ops:
                yield [(op, self._read(op))]
            return
        if done:
            yield done
        todo.sort(key=lambda x: x[0])
        pad = memoryview(bytearray(sb - n)) if sb > n else None
        most = max(1, min(IOV_MAX_SLOTS, self.opts.read_run_bytes // sb))
        # The batch's first run is short (one slot by default).  The kernel serves a first request at a
        # new offset as a standalone read (what was asked, no readahead); only the request after it,
        # found sequential, opens the readahead window.  A short first read returns soonest and gets
        # that second request out sooner (cold promotes got faster).  The price, once per batch: when
        # the first stretch of neighbouring slots is short, that window reads past it.
        first = min(most, self.opts.read_first_run_slots) or most
        runs: list[list[tuple[int, Promote, bytes, EntryHeader]]] = []
        for x in todo:
            last = runs[-1] if runs else None
            if (last is not None and len(last) < (first if len(runs) == 1 else most) and x[0] == last[-1][0] + 1
                    and x[3].length == n and last[0][3].length == n):
                last.append(x)
            else:
                runs.append([x])
        for run in runs:
            if run[0][3].length != n or (run[-1][0] + 1) * sb > _OFFSET_MAX:
                got = 0   # a record that says another length, or a slot past any file offset: corrupt, unread
            else:
                iov: list[memoryview] = []
                for k, (_, op, _, _) in enumerate(run):
                    if k and pad is not None:
                        iov.append(pad)
                    iov.append(op.dst)
                try:
                    got = os.preadv(fd, iov, run[0][0] * sb)   # straight into the host slots, no GIL
                except OSError as exc:
                    if len(run) == 1:   # that was the read: it failed
                        yield [(run[0][1], self._read_failed(run[0][1], exc))]
                    else:               # find which slots fail: each on its own
                        for _, op, _, _ in run:
                            yield [(op, self._read(op))]
                    t_last = time.perf_counter()
                    continue
            # the run's reports leave together (one frame): the owner wakes once per run, not once per block
            answers = []
            for k, (_, op, value, h) in enumerate(run):
                answers.append((op, self._verify(op, value, max(0, min(n, got - k * sb)), t_last, h)))
                t_last = time.perf_counter()
            yield answers

    def _lookup(self, txn: Any, op: Promote, t0: float) -> Union[Report, tuple[bytes, EntryHeader]]:
        """Inside a read transaction: the read's answer (a Report), or its index record and header to read."""
        n = self.opts.block_bytes
        v = txn.get(lmdb_key(op.key))
        if v is None:
            return Report(op.token, JobKind.PROMOTE, False, "miss: absent")
        h: Optional[EntryHeader] = None
        try:
            h = parse_header(v)
            if not h.in_slot:   # an inline entry (imported): verify and copy under the txn
                if h.token != op.expect:   # another writer's record (see _verify): checked against its own fields
                    verify_entry(v, self._ns, None, n, header=h)
                    _same_name(h, op)
                    return Report(op.token, JobKind.PROMOTE, False, "miss: superseded on disk")
                h = verify_entry(v, self._ns, op.key, n)
                op.dst[:] = v[h.payload_offset:h.payload_offset + n]
                return Report(op.token, JobKind.PROMOTE, True, None, n, time.perf_counter() - t0)
        except CorruptEntry as exc:
            self._corrupt_record(op, h)
            self._on_corrupt(exc.reason)
            return Report(op.token, JobKind.PROMOTE, False, f"{CORRUPT} ({exc})")
        # a slot record of another writer than expected is read and verified too (_verify), against its own
        # fields: a newer write of the key (invalidated and written again since this read was asked), or another
        # key's record under the same name (a long key's digest), verifies and is a miss; a record whose token
        # field was damaged does not, and is counted corrupt and removed
        return bytes(v), h   # the index record (small); the payload is read outside the txn

    def _corrupt_record(self, op: Promote, h: Optional[EntryHeader]) -> None:
        """A corrupt record whose writer token is not the one the owner expects (damaged, or unparsed): its
        removal names the token it carries, since :meth:`_answer`'s, by the expected one, would not match it."""
        if h is not None and h.token != op.expect:
            self._push(Delete(h.token, op.key, found_corrupt=True))

    def _verify(self, op: Promote, value: bytes, got: int, t0: float, h: EntryHeader) -> Report:
        """The answer for a slot read of ``got`` bytes into ``op.dst``, checked against its index record
        (``h``: the record's header, parsed by the lookup)."""
        n = self.opts.block_bytes
        mine = h.token == op.expect   # else another writer's record: its own key, the name it is found under
        try:
            verify_entry(value, self._ns, op.key if mine else None, n, op.dst if got == n else op.dst[:got], h)
            if not mine:
                _same_name(h, op)
        except CorruptEntry as exc:
            try:
                changed = self._index_changed(lmdb_key(op.key), value)
            except _NotBegun as nb:   # not known whether the entry changed: it stays, and is verified next time
                return self._not_read([op], nb.cause)[0][1]
            except lmdb.Error as lexc:
                return self._read_failed(op, lexc)
            if changed:
                # dropped and its slot reused while we read: the bytes are someone else's, not damaged
                return Report(op.token, JobKind.PROMOTE, False, "miss: superseded on disk")
            self._corrupt_record(op, h)
            self._on_corrupt(exc.reason)
            return Report(op.token, JobKind.PROMOTE, False, f"{CORRUPT} ({exc})")
        if not mine:   # an intact record of another write: not the block asked for
            return Report(op.token, JobKind.PROMOTE, False, "miss: superseded on disk")
        return Report(op.token, JobKind.PROMOTE, True, None, n, time.perf_counter() - t0)

    def _read(self, op: Promote) -> Report:
        """One read on its own (a lone read, or where a batch gives up): look up, ``preadv``, verify."""
        env = self._db.env
        t0 = time.perf_counter()
        n = self.opts.block_bytes
        if env is None:
            return Report(op.token, JobKind.PROMOTE, False, "miss: disk tier closed")
        try:
            self._db.rw.acquire_shared()
            try:
                with self._begin(env) as txn:
                    found = self._lookup(txn, op, t0)
            finally:
                self._db.rw.release_shared()
            if isinstance(found, Report):
                return found
            value, h = found
            # preadv straight into the host slot, without the GIL
            sb = self._slots.slot_bytes   # (another length, or a slot past any file offset: corrupt, unread)
            fits = h.length == n and (h.slot + 1) * sb <= _OFFSET_MAX
            got = os.preadv(self._slots.fd, [op.dst], h.slot * sb) if fits else 0
        except _NotBegun as nb:
            return self._not_read([op], nb.cause)[0][1]
        except (lmdb.Error, OSError) as exc:
            return self._read_failed(op, exc)
        return self._verify(op, value, got, t0, h)

    def _read_failed(self, op: Promote, exc: BaseException) -> Report:
        """An LMDB or I/O error reading ``op``: counted and logged (once per kind), a miss."""
        self._on_error(error_kind(exc), repr(exc))
        return Report(op.token, JobKind.PROMOTE, False, f"{READ_FAILED} ({exc})")

    def _not_read(self, ops: list[Promote], exc: lmdb.Error) -> list[tuple[Promote, Report]]:
        """``ops`` answered without a read (their transaction could not begin): counted and logged once
        (once per kind), misses whose entries stay (``NOT_READ``: neither the reader nor the owner drops them)."""
        self._on_error(error_kind(exc), repr(exc))
        return [(op, Report(op.token, JobKind.PROMOTE, False, f"{NOT_READ} ({exc})")) for op in ops]

    def _begin(self, env: Any) -> Any:
        """A read transaction on the blocks sub-database; :class:`_NotBegun` when LMDB refuses to begin one."""
        try:
            return env.begin(db=self._db.blocks, buffers=True)
        except lmdb.Error as exc:
            raise _NotBegun(exc) from exc

    def _index_changed(self, lk: bytes, value: bytes) -> bool:
        env = self._db.env
        assert env is not None
        self._db.rw.acquire_shared()
        try:
            with self._begin(env) as txn:
                now = txn.get(lk)
                return now is None or bytes(now) != value
        finally:
            self._db.rw.release_shared()
