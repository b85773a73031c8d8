"""The remote store's reader thread: fetch jobs, batched into pipelines of GETs, verified before copying.

A fetched value's payload is read from the socket straight into the owner's view (the host slot the
core reserved for it, fenced until this part is answered), then verified there with
:func:`~tiered_kv.disk.format.verify_split` (magic, version, namespace, key, length, checksum): a value
that fails is a miss -- the core frees the slot, whose bytes were never published -- is reported to
``on_corrupt`` and is deleted by the writer thread only if the server still holds the same bytes
(its sha1), never a good value written since.  A value of another length is never a block's: it is
drained from the socket with only its first bytes kept (:class:`~.resp.Drained`: the server's length
never sizes an allocation) and answered corrupt, with the reason its verification gives; a GET a cluster
redirects is sent again on the link of the node named (:meth:`.conn.Conn._follow`), its value read the same
way.  One that arrives whole (redis-py read it: a redirection followed through the cluster client, where the
node was not known or redirected it again) is verified with :func:`~tiered_kv.disk.format.verify_entry`
before it is copied.  Invariant: every fetch job is answered
exactly once; while the breaker is open, queued fetches are answered ``remote_down`` at once.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from typing import Callable, Optional

from ..disk.format import HEADER_SIZE, CorruptEntry, verify_entry, verify_split
from ..reports import CompletionQueue, Report
from .breaker import Breaker
from .iothread import IDLE_WAKE_S, IOThread
from .conn import Conn, error_kind, unreachable as server_unreachable
from .keys import KeyNames, sha1hex
from .ops import FetchJob
from .resp import Drained, GetInto, Landed
from .records import FETCH_CORRUPT, FETCH_MISS, REMOTE_DOWN, RemoteOptions
from .writer import FALLBACK_WAKE_S, MAX_RESTARTS

__all__ = ["Reader"]

log = logging.getLogger(__name__)


class Reader(IOThread):
    role = "reader"
    point = "read"

    def __init__(self, opts: RemoteOptions, names: KeyNames, conn: Conn, breaker: Breaker, out: CompletionQueue,
                 on_error: Callable[[str, str], None], on_corrupt: Callable[[str], None],
                 drop: Callable[[bytes, str], None], name: str = "remote") -> None:
        super().__init__(name)
        self.opts = opts
        self.names = names
        self.conn = conn
        self.breaker = breaker
        self._out = out
        self._on_error = on_error
        self._on_corrupt = on_corrupt
        self._drop = drop
        self.limit = max(opts.queue_blocks, opts.batch_blocks)   # fetch parts queued and unanswered
        self._jobs: collections.deque[FetchJob] = collections.deque()
        self._inflight: list[tuple[FetchJob, int]] = []
        self._answered = 0        # parts of _inflight answered so far (a thread dying mid-batch answers the rest)
        self._ready: list[Report] = []   # reports of jobs that batch completed, queued once its room is free
        self.parts_pending = 0
        # the owner's side only, each moved in the same step as the queue or count it goes with, so that a start the
        # owner's interrupt broke off can read back how far it went (TierCore._fetch_start_broken)
        self.room_held = 0   # room take_room holds that no submit used and give_room did not give back
        self.accepted = 0    # jobs submit queued
        self._thread = self._start()

    # ------------------------------------------------------------ any thread, never blocks on I/O
    def take_room(self, n: int) -> bool:
        """Hold room for a job of ``n`` parts (its :meth:`submit` with ``room_taken``); False when it does not
        fit now (breaker open, store closing, queue full)."""
        with self._lock:   # (the owner's thread: the raw lock, see iothread)
            if not self.accepting or not self.breaker.closed or self.parts_pending + n > self.limit:
                return False
            self.parts_pending += n
            self.room_held += n
        return True

    def give_room(self, n: int) -> None:
        """Give back room :meth:`take_room` held and no job will use."""
        with self._lock:
            self.parts_pending -= n
            self.room_held -= n

    def submit(self, token: uuid.UUID, keys: list[bytes], views: list[memoryview], probe: bool = False,
               room_taken: bool = False) -> bool:
        """Queue a job; False, nothing queued, when it does not fit.  ``room_taken``: :meth:`take_room` held its
        room, so it is refused only when the store is closing (the room is given back then)."""
        n = len(keys)
        with self._lock:   # (the owner's thread: the raw lock, see iothread)
            if room_taken:
                if not self.accepting:
                    self.parts_pending -= n
                    self.room_held -= n
                    return False
                add, used = 0, n
            elif not self.accepting or not self.breaker.closed or self.parts_pending + n > self.limit:
                return False
            else:
                add, used = n, 0
            job = FetchJob(token, keys, views, probe)
            # one step, no call (no signal handler runs in between): the job queued with its room
            self._jobs += (job,)
            self.parts_pending += add
            self.room_held -= used
            self.accepted += 1
            if self.parts_pending >= self.opts.batch_blocks:
                self._notify()
        return True

    def _queued(self) -> bool:
        return bool(self._jobs)

    # ------------------------------------------------------------ reader thread
    def _main(self) -> None:
        while True:
            batch, down = self._next()
            for job in down:
                self._out.put(job.report())
            if not self._run_batch(batch, self._fetch):
                return

    def _next(self) -> tuple[Optional[list[tuple[FetchJob, int]]], list[FetchJob]]:
        """Wait for work: (parts to fetch or None to exit, jobs answered remote_down)."""
        with self._cond:
            self._busy = True
            while True:
                self._inflight = []
                now = time.monotonic()
                if not self.breaker.closed or (self._closing and now > self._close_deadline):
                    down = self._take_all(REMOTE_DOWN)
                    if self._closing:
                        return None, down
                    if down:
                        return [], down
                elif self._jobs and (self._wake or self._closing):
                    return self._take(), []
                elif self._closing:
                    return None, []
                if not self._jobs:
                    self._wake = False
                    self._busy = False
                    self._cond.notify_all()   # wait_idle()
                    self._cond.wait(IDLE_WAKE_S)   # (timed: a wake-up an interrupt cut off)
                    self._busy = True
                elif not self._cond.wait(FALLBACK_WAKE_S):
                    self._wake = True

    def _take(self) -> list[tuple[FetchJob, int]]:
        batch: list[tuple[FetchJob, int]] = []
        limit, jobs = self.opts.batch_blocks, self._jobs
        while jobs and len(batch) < limit:
            job = jobs[0]
            take = min(limit - len(batch), len(job.keys) - job.next)
            batch.extend((job, i) for i in range(job.next, job.next + take))
            job.next += take
            if job.next == len(job.keys):
                jobs.popleft()
        if not jobs:
            self._wake = False
        self._inflight = batch
        self._answered = 0
        return batch

    def _take_all(self, reason: str) -> list[FetchJob]:
        """Answer every queued part ``reason`` (under the lock); the jobs now complete."""
        done = []
        for job in self._jobs:
            for i in range(job.next, len(job.keys)):
                job.answer(i, reason)
            self.parts_pending -= len(job.keys) - job.next
            job.next = len(job.keys)
            if not job.left:
                done.append(job)
        self._jobs.clear()
        return done

    def _fetch(self, batch: list[tuple[FetchJob, int]]) -> None:
        names = self.names
        head = HEADER_SIZE + len(names.ns_bytes)   # + the key: what precedes the payload in a value
        cmds = [("EXISTS", names.value(job.keys[i])) if job.probe else
                GetInto(names.value(job.keys[i]), head + len(job.keys[i]), job.views[i]) for job, i in batch]
        now = time.monotonic()
        for job, _ in batch:
            if not job.sent_at:
                job.sent_at = now
        try:
            results = self.conn.round_trip(cmds)
        except Exception as e:  # noqa: BLE001 - the whole trip failed: every part fails with its kind
            results = [e] * len(batch)
            self.conn.reset()
        unreachable = 0
        first_error = ""
        ns, length = names.ns_bytes, self.opts.block_bytes
        for (job, i), value in zip(batch, results):
            nbytes = 0
            if value is None or (job.probe and value == 0):
                reason: Optional[str] = FETCH_MISS
            elif job.probe and not isinstance(value, BaseException):
                reason = None   # held (its bytes are verified when it is fetched)
            elif isinstance(value, BaseException) and not job.probe and str(value).startswith("WRONGTYPE"):
                # a value of another type under a block's name (anything else sharing the server): a foreign
                # value, a counted miss, deleted if it is still not a string (DROP_IF_SAME with no sha)
                reason = FETCH_CORRUPT
                log.warning("%s: a value of another type under a block's name: a miss, deleted", self.name)
                self._on_corrupt("wrong_type")
                self._drop(job.keys[i], "")
            elif isinstance(value, BaseException):
                reason = error_kind(value)
                msg = f"{type(value).__name__}: {value}"
                first_error = first_error or msg
                unreachable += server_unreachable(value)
                self._on_error(reason, msg)
            else:
                key, view = job.keys[i], job.views[i]
                corrupt: Optional[tuple[CorruptEntry, str]] = None   # and the sha1 of the bytes read
                # close() shuts the conn under this lock once its grace ran out, and the owner may free the slot the
                # moment close() returns: the slot is read or written only under it, and never once it is shut
                with self.conn.guard:
                    if self.conn.closed:
                        reason = REMOTE_DOWN
                    else:
                        try:
                            if isinstance(value, Landed):    # the payload is in the slot already
                                verify_split(value.head, view, ns, key, length)
                            elif isinstance(value, Drained):   # another length: its first bytes say why
                                verify_entry(value.prefix, ns, key, length=length)
                                raise CorruptEntry("truncated", f"{value.n} bytes, not a {length}-byte block's value")
                            elif isinstance(value, (bytes, bytearray)):   # read whole (redis-py's fallback)
                                view[:] = memoryview(value)[verify_entry(value, ns, key,
                                                                         length=length).payload_offset:]
                            else:   # a reply no GET gets from a Redis (an int, an array): a foreign value
                                raise CorruptEntry("wrong_type", f"a GET answered a {type(value).__name__}")
                        except CorruptEntry as e:
                            reason = FETCH_CORRUPT
                            corrupt = e, (sha1hex(value.head, view) if isinstance(value, Landed) else
                                          value.sha if isinstance(value, Drained) else
                                          sha1hex(value) if isinstance(value, (bytes, bytearray)) else "")
                        else:
                            reason, nbytes = None, length
                if corrupt is not None:
                    log.warning("%s: corrupt value for a key (%s): a miss, deleted if unchanged", self.name, corrupt[0])
                    self._on_corrupt(corrupt[0].reason)
                    self._drop(key, corrupt[1])
            r = job.answer(i, reason, nbytes)
            self._answered += 1
            if r is not None:
                job.views = []   # the owner's slots: not written after the answer
                self._ready.append(r)
        with self._cond:
            self.parts_pending -= len(batch)
            self._inflight = []
            reports, self._ready = self._ready, []
        for r in reports:   # after the room is free: an owner applying a report at once may submit again
            self._out.put(r)
        if unreachable and unreachable == len(batch):
            self.breaker.failure(first_error)
        else:
            self.breaker.success()

    def _died(self, e: BaseException) -> None:
        self.conn.reset()
        self._on_error("server_error", f"remote reader thread died: {type(e).__name__}: {e}")
        with self._cond:
            inflight, self._inflight = self._inflight, []
            done = []
            for job, i in inflight[self._answered:]:
                if job.answer(i, REMOTE_DOWN) is not None:
                    done.append(job)
            self.parts_pending -= len(inflight)
            done_before, self._ready = self._ready, []   # completed by the batch before it died, not queued yet
            restart = self.restarts < MAX_RESTARTS and not self._closing
            if restart:
                self.restarts += 1
            else:
                self.accepting = False
                self.healthy = False
                done += self._take_all(REMOTE_DOWN)
                self._busy = False   # gone for good (a restarted thread is busy until idle: its reports are put
            self._cond.notify_all()   # below, after the lock)
        for r in done_before:
            self._out.put(r)
        for job in done:
            self._out.put(job.report())
        if restart:
            log.warning("%s: restarting the remote reader thread (%d of %d)", self.name, self.restarts, MAX_RESTARTS)
            self._thread = self._start()
        else:
            log.error("%s: the remote reader thread is gone: the remote tier is off", self.name)
