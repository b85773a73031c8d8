"""The remote store's writer thread: puts and tombstone ops, in submission order, batched into pipelines.

One queue holds both put parts and tombstone ops, so a cancel queued after a put of the same key is
sent after it (in the same pipeline or a later one; a cluster keeps a key's commands on one node, in
order, and follows its redirections in order).  Invariants:

* every put part is answered exactly once (its job by one report): published, refused by a tombstone,
  cancelled or expired before it was sent, failed with its error kind, or ``remote_down``;
* a tombstone op is never shed while the server is reachable: one the server could not run is sent
  again after a back-off of its own (the queue behind it goes on: a slot being migrated holds up only
  its own ops); only an op the server keeps refusing (``TOMB_ATTEMPTS``) or, while the breaker is open,
  the oldest beyond ``TOMB_CAP`` are dropped (each reported to ``on_error`` as ``"tomb_dropped"``: counted,
  logged once per kind by the owner's callback);
* ``invalidating`` counts, per key, the INVALIDATE ops not yet run by the server (queued, in flight or
  waiting to be sent again): the owner asks the server for no such key, which may still hold its old
  value; one that will never run (dropped, or made once the thread is gone for good) leaves its key in
  ``lost`` until a value written before it has expired on the server (``ttl_seconds``; for good without
  one), asked for by no one either -- past ``LOST_MAX`` such keys, no key is (``lost_all_until``);
* while the breaker is open, queued puts are answered ``remote_down`` at once and this thread probes;
  ``wait_idle()`` answers False at once while it holds tombstone ops back (:meth:`Writer._held`).

Longer than the project's usual 500 lines: the put parts, the tombstone ops with their back-off and their drops,
the keys whose invalidation was lost, and the answers owed when the thread dies all read and change one queue
under one lock (``_lock``, with the condition ``_cond`` over it); split, each part would reach into the
others' state.
"""

from __future__ import annotations

import collections
import logging
import math
import time
import uuid
from typing import Any, Callable, Optional

from ..disk.format import pack_header
from ..reports import CompletionQueue, Report
from .breaker import Breaker
from .iothread import IDLE_WAKE_S, IOThread
from .conn import BREAKER_KINDS, Conn, error_kind, unreachable as server_unreachable
from .keys import NOT_STAGED, PUBLISHED, REFUSED_LATE, REFUSED_TOKEN, REFUSED_TOMB, STAGE_TTL_S, KeyNames
from .ops import CANCEL, CANCELLED, DONE, DROP, INVALIDATE, QUEUED, TAKEN, PutGroup, PutPart, TombOp
from .resp import Parts
from .records import PUT_CANCELLED, PUT_EXPIRED, PUT_REFUSED_TOKEN, PUT_REFUSED_TOMB, REMOTE_DOWN, RemoteOptions

__all__ = ["Writer", "TOMB_CAP", "TOMB_ATTEMPTS", "FALLBACK_WAKE_S", "MAX_RESTARTS", "LOST_MAX"]

log = logging.getLogger(__name__)

TOMB_CAP = 100_000        # tombstone ops kept while the breaker is open (a few hundred bytes each)
TOMB_ATTEMPTS = 5         # a tombstone op the server refuses (OOM, script error) this often is dropped
FALLBACK_WAKE_S = 0.05    # queued work nobody kick()ed is sent after this long anyway
MAX_RESTARTS = 3          # an I/O thread that dies is restarted this often, then the store is unhealthy
LOST_MAX = 100_000        # keys whose INVALIDATE will never run, each asked for by no one; past it, none is


class Writer(IOThread):
    role = "writer"
    point = "write"

    def __init__(self, opts: RemoteOptions, names: KeyNames, conn: Conn, breaker: Breaker, out: CompletionQueue,
                 on_error: Callable[[str, str], None], on_refused: Callable[[str], None],
                 name: str = "remote") -> None:
        super().__init__(name)
        self.opts = opts
        self.names = names
        self.conn = conn
        self.breaker = breaker
        self._out = out
        self._on_error = on_error
        self._on_refused = on_refused
        self._ops: collections.deque[Any] = collections.deque()
        self._unsent: dict[bytes, list[PutPart]] = {}   # key -> its QUEUED parts (cancel / invalidate look here)
        self._inflight: list[Any] = []
        self._delayed: list[TombOp] = []   # tombstone ops to send again once their retry_at passed
        self.puts_pending = 0     # put parts submitted and not answered
        self.accepted = 0         # put jobs submit queued, counted in the step that queues each (the owner's side)
        self.tombs_queued = 0     # tombstone ops in _ops and _delayed
        self.tombs_dropped = 0
        self.invalidating: dict[bytes, int] = {}   # key -> its INVALIDATE ops the server has not run yet
        # key -> until when an INVALIDATE never run may leave its value, in expiry order
        self.lost: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self.lost_all_until = 0.0                  # ... for every key, once ``lost`` overflowed (time.monotonic)
        self._held_reports: list[Optional[Report]] = []   # _send's reports not yet put (see there)
        self._held_answered = 0                            # ... and its parts answered, their room not yet released
        self._ttl = int(opts.ttl_seconds or 0)
        self._tomb_ttl = max(1, int(opts.tomb_ttl_seconds))
        self._thread = self._start()

    # ------------------------------------------------------------ any thread, never blocks on I/O
    def room(self) -> int:
        if not self.accepting or not self.breaker.closed:
            return 0
        return max(0, self.opts.queue_blocks - self.puts_pending)

    def submit(self, tokens: list[uuid.UUID], keys: list[bytes], views: list[memoryview]) -> bool:
        """Queue one put job (all parts or none: see :mod:`~tiered_kv.remote.iothread` on interrupts)."""
        n = len(keys)
        now = time.monotonic()
        with self._lock:
            if not self.accepting or not self.breaker.closed or self.puts_pending + n > self.opts.queue_blocks:
                return False
            group = PutGroup(tokens[0], n)
            parts = [PutPart(group, i, tokens[i], keys[i], views[i], now) for i in range(n)]
            # one step, no call (no signal handler runs in between): the parts queued and counted together
            self._ops += parts
            self.puts_pending += n
            self.accepted += 1
            unsent = self._unsent
            for p in parts:   # an interrupt here leaves a part out of _unsent only: a cancel then does not drop it
                unsent.setdefault(p.key, []).append(p)   # unsent, and its tomb (queued after it) refuses or deletes it
            if len(self._ops) >= self.opts.batch_blocks:   # a full batch waits for no kick
                self._notify()
        return True

    def cancel(self, token: uuid.UUID, key: bytes) -> None:
        op = TombOp(CANCEL, key, token)
        with self._lock:
            for p in self._unsent.get(key, ()):
                if p.token == token and p.state == QUEUED:
                    p.state = CANCELLED
            self._push_tomb(op)

    def invalidate(self, key: bytes) -> None:
        op = TombOp(INVALIDATE, key)
        with self._lock:
            for p in self._unsent.get(key, ()):
                if p.state == QUEUED:
                    p.state = CANCELLED
            if self._tomb_room(op):
                inv = self.invalidating
                n = inv.get(key, 0) + 1
                # one step, no call: queued and counted (tombs_queued, invalidating) together
                self._ops += (op,)
                self.tombs_queued += 1
                inv[key] = n

    def _invalidate_done(self, op: TombOp) -> None:
        """``op`` left for good (run by the server, or dropped); under the lock."""
        if op.kind == INVALIDATE:
            inv = self.invalidating
            n = inv.get(op.key, 0) - 1
            if n > 0:
                inv[op.key] = n
            else:
                inv.pop(op.key, None)

    def drop(self, key: bytes, sha: str) -> None:
        """Delete the value of ``key`` if it still has sha1 ``sha`` (a reader found it corrupt)."""
        op = TombOp(DROP, key, sha=sha)
        with self._lock:
            self._push_tomb(op)
            self._notify()

    def _push_tomb(self, op: TombOp) -> bool:
        """Queue a tombstone op (under the lock): False when it may not be (:meth:`_tomb_room`)."""
        if not self._tomb_room(op):
            return False
        # one step, no call: queued and counted together
        self._ops += (op,)
        self.tombs_queued += 1
        return True

    def _tomb_room(self, op: TombOp) -> bool:
        """Whether tombstone op ``op`` may be queued now (under the lock; the caller queues and counts it in one
        step): False while closing, or once the thread is gone (then counted as dropped); at ``TOMB_CAP`` while the
        server is away the oldest one is dropped to make room."""
        if not self.healthy or self._closing:
            if not self._closing:   # gone for good: never sent, counted as one dropped later would be
                self._dropped(op, "the writer thread is gone")
            return False
        if self.tombs_queued >= TOMB_CAP and not self.breaker.closed:   # reachable: never shed, it drains
            self._drop_oldest_tomb()
        return True

    def _drop_oldest_tomb(self) -> None:
        delayed = self._delayed
        if delayed:   # waiting to be sent again: older than any still queued
            op = min(delayed, key=lambda o: o.retry_at)
            delayed.remove(op)
        else:
            op = next((o for o in self._ops if isinstance(o, TombOp)), None)
            if op is None:
                return
            self._ops.remove(op)
        self.tombs_queued -= 1
        self._dropped(op, f"{TOMB_CAP} tombstone ops queued while the server is away: dropped the oldest")

    def _dropped(self, op: TombOp, why: str) -> None:
        """``op`` will not be sent: counted, and reported to ``on_error`` (the owner's, which logs once per kind:
        an overflow drops one op per ``invalidate()`` while the server is away); under the lock."""
        self.tombs_dropped += 1
        if op.kind == INVALIDATE:   # first: a lock-free reader (RemoteStore.invalidating) finds it in one of the two
            self._lost(op.key)
        self._invalidate_done(op)
        self._on_error("tomb_dropped", f"{why} ({op.kind})")

    def _lost(self, key: bytes) -> None:
        """An INVALIDATE of ``key`` will never run: the server may hold its value until that expires -- one
        written by a write queued before the drop lands up to a tombstone's lifetime later (its deadline, half of
        it, on the writer's clock, which may be ahead of the server's by as much) --, and the owner asks for the
        key until then no more (:meth:`RemoteStore.invalidating`); under the lock.  ``lost`` is in expiry order
        (every key's window is as long), so the expired ones leave from its front; a key lost again moves to its
        end with its later expiry (``move_to_end``: never out of the map meanwhile, a reader holds no lock), so
        that no expired key stays behind it and counts toward ``LOST_MAX``."""
        now = time.monotonic()
        until = now + self._tomb_ttl + self._ttl if self._ttl else math.inf
        lost = self.lost
        while lost:
            first = next(iter(lost))
            if lost[first] > now:
                break
            del lost[first]
        if key not in lost and len(lost) >= LOST_MAX:   # too many to name: no key is asked for until the last expired
            self.lost_all_until = max(self.lost_all_until, until)
            lost.clear()
            log.warning("%s: more than %d invalidations could not be sent: no key is fetched from the server "
                        "until the values written before them expired", self.name, LOST_MAX)
            return
        lost[key] = until
        lost.move_to_end(key)

    def _held(self) -> bool:
        """The open breaker holds tombstone ops back (they wait for the server, however long it is away)."""
        return bool(self.tombs_queued) and not self.breaker.closed

    def _queued(self) -> bool:
        return bool(self._ops) or bool(self._delayed)

    def _release_due(self, now: float) -> Optional[float]:
        """Put the delayed tombstone ops whose back-off has passed back at the front of the queue; the time
        until the next one is due, or None when none waits.  Under the lock."""
        delayed = self._delayed
        if not delayed:
            return None
        due = [op for op in delayed if op.retry_at <= now]
        if due:
            self._delayed = delayed = [op for op in delayed if op.retry_at > now]
            self._ops.extendleft(reversed(due))
        return min((op.retry_at for op in delayed), default=now) - now if delayed else None

    # ------------------------------------------------------------ writer thread
    def _main(self) -> None:
        while True:
            batch, answers, probe = self._next()
            self._answer(answers)
            if probe:
                self._probe()
                continue
            if not self._run_batch(batch, self._send):
                return

    def _next(self) -> tuple[Optional[list[Any]], list[tuple[PutPart, str]], bool]:
        """Wait for work; (batch to send or None to exit, puts to answer unsent, probe now?)."""
        answers: list[tuple[PutPart, str]] = []
        with self._cond:
            self._busy = True
            while True:
                self._inflight = []
                if not self.breaker.closed:
                    self._take_all_puts(answers, REMOTE_DOWN)
                    if self._closing:
                        self._give_up_tombs("the store closed while the server was away")
                        return None, answers, False
                    wait = self.breaker.probe_in()
                    if wait <= 0:
                        return [], answers, True
                    if answers:
                        return [], answers, False
                    self._busy = bool(self._ops)   # tombstone ops wait for the server: not idle
                    self._cond.notify_all()
                    self._cond.wait(wait)
                    self._busy = True
                    continue
                now = time.monotonic()
                later = self._release_due(now)
                if self._closing and ((not self._ops and later is None) or now > self._close_deadline):
                    self._take_all_puts(answers, REMOTE_DOWN)
                    self._give_up_tombs("close() timed out")
                    return None, answers, False
                if not self._ops and later is not None:   # only ops waiting out their back-off: not idle
                    if answers:
                        return [], answers, False
                    self._cond.wait(later)
                    continue
                if self._ops and (self._wake or self._closing):
                    batch = self._take(answers)
                    if batch or answers:
                        return batch, answers, False
                    continue
                if not self._ops:
                    self._wake = False
                    if answers:
                        return [], answers, False
                    self._busy = False
                    self._cond.notify_all()   # wait_idle()
                    self._cond.wait(IDLE_WAKE_S)   # (timed: a wake-up an interrupt cut off)
                    self._busy = True
                elif not self._cond.wait(FALLBACK_WAKE_S):
                    self._wake = True   # queued, never kicked: send anyway

    def _take(self, answers: list[tuple[PutPart, str]]) -> list[Any]:
        """Up to ``batch_blocks`` ops from the front (under the lock); unsendable puts go to ``answers``."""
        ops, batch, limit = self._ops, [], self.opts.batch_blocks
        deadline = time.monotonic() - self.opts.write_deadline_s
        while ops and len(batch) < limit:
            op = ops.popleft()
            if isinstance(op, PutPart):
                self._forget(op)
                if op.state == CANCELLED:
                    answers.append((op, PUT_CANCELLED))
                    continue
                if op.queued_at < deadline:
                    answers.append((op, PUT_EXPIRED))
                    continue
                op.state = TAKEN
            else:
                self.tombs_queued -= 1
            batch.append(op)
        if not ops:
            self._wake = False
        self._inflight = batch
        return batch

    def _take_all_puts(self, answers: list[tuple[PutPart, str]], reason: str) -> None:
        keep: collections.deque[Any] = collections.deque()
        for op in self._ops:
            if isinstance(op, PutPart):
                self._forget(op)
                answers.append((op, PUT_CANCELLED if op.state == CANCELLED else reason))
            else:
                keep.append(op)
        self._ops = keep

    def _give_up_tombs(self, why: str) -> None:
        """Every tombstone op still to send is dropped (counted, logged once); the puts are answered already."""
        if self.tombs_queued:
            log.warning("%s: %s: %d tombstone ops not sent", self.name, why, self.tombs_queued)
            self.tombs_dropped += self.tombs_queued
            for _ in range(self.tombs_queued):
                self._on_error("tomb_dropped", why)
            for op in [*self._ops, *self._delayed]:
                if isinstance(op, TombOp) and op.kind == INVALIDATE:
                    self._lost(op.key)
        self._ops.clear()
        self._delayed.clear()
        self.invalidating.clear()
        self.tombs_queued = 0

    def _forget(self, p: PutPart) -> None:
        lst = self._unsent.get(p.key)
        if lst is not None:
            try:
                lst.remove(p)
            except ValueError:
                pass
            if not lst:
                del self._unsent[p.key]

    def _answer(self, answers: list[tuple[PutPart, str]]) -> None:
        if not answers:
            return
        reports = [self._answer_put(p, False, reason) for p, reason in answers]
        with self._cond:
            self.puts_pending -= len(answers)
        self._report(reports)

    def _answer_put(self, p: PutPart, ok: bool, reason: Optional[str], nbytes: int = 0) -> Optional[Report]:
        """The part's answer; its job's report once every part of it is answered (put by :meth:`_report`,
        after the room the parts held is released: an owner that applies the report at once sees that room)."""
        if p.state == DONE:
            return None
        p.state = DONE
        p.view = memoryview(b"")   # the owner's slot: not read after the answer
        return p.group.answer(p.part, ok, reason, nbytes)

    def _report(self, reports: list[Optional[Report]]) -> None:
        put = self._out.put
        for r in reports:
            if r is not None:
                put(r)

    def _commands(self, op: Any, out: list[tuple[Any, ...]]) -> None:
        """Append ``op``'s commands: a put's staging SET and publish script, a tombstone op's script."""
        names, key = self.names, op.key
        if isinstance(op, PutPart):
            view, token = op.view, op.token
            entry = Parts(pack_header(names.ns_bytes, key, token, view, 0), view)   # the slot is sent in place
            if not op.group.sent_at:
                op.group.sent_at = time.monotonic()
            tag, hexed = names.tag(key), token.hex     # one digest of the key for its four names
            staged = f"{tag}:s:{hexed}"
            out.append(("SET", staged, entry, "EX", STAGE_TTL_S))
            # a deadline half a tombstone's lifetime after the write was queued: a delivery later than that is
            # refused by the script, so a write queued before an invalidation never lands once its tomb expired
            # (however late in its write deadline it was sent)
            queued_wall = time.time() - (time.monotonic() - op.queued_at)
            deadline_ms = int((queued_wall + self._tomb_ttl / 2) * 1000)
            out.append(self.conn.script("publish", [staged, tag + ":v", tag + ":t", f"{tag}:x:{hexed}"],
                                        [self._ttl, deadline_ms]))
            return
        out.append(self._tomb_command(op))

    def _tomb_command(self, op: TombOp) -> tuple[Any, ...]:
        names, key = self.names, op.key
        if op.kind == CANCEL:
            return self.conn.script("cancel", [names.value(key), names.token_tomb(key, op.token)],
                                    [op.token.bytes, self._tomb_ttl])
        if op.kind == INVALIDATE:
            return self.conn.script("invalidate", [names.value(key), names.tomb(key)], [self._tomb_ttl])
        return self.conn.script("drop_if_same", [names.value(key)], [op.sha])

    def _send(self, batch: list[Any]) -> None:
        cmds: list[tuple[Any, ...]] = []
        for op in batch:
            self._commands(op, cmds)
        try:
            replies = self.conn.round_trip(cmds)
        except Exception as e:  # noqa: BLE001 - the whole trip failed: every part fails with its kind
            replies = [e] * len(cmds)
            self.conn.reset()
        # one result per op: a put's staging SET error if it failed, else its script's answer
        results: list[Any] = []
        at = 0
        for op in batch:
            if isinstance(op, PutPart):
                staged, published = replies[at], replies[at + 1]
                at += 2
                results.append(staged if isinstance(staged, BaseException) else published)
            else:
                results.append(replies[at])
                at += 1
        retry: list[TombOp] = []
        # the batch's reports, put once the room their parts held is released; kept on self, with the count of
        # parts answered, so that a thread that dies in between still puts them and gives the room back (_died)
        reports = self._held_reports = []
        left: list[TombOp] = []   # tombstone ops the server ran: an INVALIDATE's key may be asked for again
        dropped: list[tuple[TombOp, str]] = []
        unreachable = 0
        self._held_answered = 0
        first_error = ""
        for op, r in zip(batch, results):
            if isinstance(r, BaseException):
                kind = error_kind(r)
                msg = f"{type(r).__name__}: {r}"
                first_error = first_error or msg
                unreachable += server_unreachable(r)
                self._on_error(kind, msg)
                if isinstance(op, PutPart):
                    reports.append(self._answer_put(op, False, kind))
                    self._held_answered += 1
                else:
                    op.attempts += kind not in BREAKER_KINDS
                    if op.attempts < TOMB_ATTEMPTS:
                        retry.append(op)
                    else:
                        dropped.append((op, f"dropped after {op.attempts} refusals ({msg})"))
            elif isinstance(op, TombOp):
                left.append(op)
            elif isinstance(op, PutPart):
                ok, reason, nbytes = False, None, 0
                if r == PUBLISHED:
                    ok, nbytes = True, len(op.view)
                elif r in (REFUSED_TOMB, REFUSED_TOKEN):
                    reason = PUT_REFUSED_TOMB if r == REFUSED_TOMB else PUT_REFUSED_TOKEN
                    self._on_refused(reason)
                elif r == NOT_STAGED:   # the SET succeeded, the value was gone: evicted (maxmemory) before the script
                    self._on_error("oom", "the staged value was evicted before it was published")
                    reason = "oom"
                elif r == REFUSED_LATE:   # the script ran past the put's deadline (see keys.LATE_CHECK)
                    self._on_error("timeout", "a put reached the server after its deadline: not published")
                    reason = "timeout"
                else:   # pragma: no cover - a script that answers something else
                    self._on_error("script", f"publish answered {r!r}")
                    reason = "script"
                reports.append(self._answer_put(op, ok, reason, nbytes))
                self._held_answered += 1   # after its answer: a part not answered yet is _died's to answer
        with self._cond:
            self.puts_pending -= self._held_answered
            self._held_answered = 0
            self._held_reports = []
            for op in left:
                self._invalidate_done(op)
            for op, why in dropped:
                self._dropped(op, why)
            if retry:   # each waits out a back-off of its own: a node that is away is not spun on, and the
                # ops of the other nodes behind them go on
                now = time.monotonic()
                for op in retry:
                    op.pause = min(1.0, max(0.01, op.pause * 2))
                    op.retry_at = now + op.pause
                self._delayed += retry
                self.tombs_queued += len(retry)
            self._inflight = []
        self._report(reports)
        if unreachable and unreachable == len(batch):
            self.breaker.failure(first_error)
        else:
            self.breaker.success()

    def _probe(self) -> None:
        try:
            self.conn.ping()
        except Exception as e:  # noqa: BLE001 - still away
            log.debug("%s: probe failed: %s: %s", self.name, type(e).__name__, e)
            self.conn.reset()
            self.breaker.probe_failed()
        else:
            self.breaker.success()

    # ------------------------------------------------------------ a dead thread
    def _died(self, e: BaseException) -> None:
        self.conn.reset()
        self._on_error("server_error", f"remote writer thread died: {type(e).__name__}: {e}")
        with self._cond:
            inflight, self._inflight = self._inflight, []
            tombs = [op for op in inflight if isinstance(op, TombOp)]
            self._ops.extendleft(reversed(tombs))
            self.tombs_queued += len(tombs)
            puts = [op for op in inflight if isinstance(op, PutPart) and op.state != DONE]
            answers = [(p, REMOTE_DOWN) for p in puts]
            # parts the dead batch answered already: their room back, their jobs' reports put below
            self.puts_pending -= self._held_answered
            self._held_answered = 0
            held, self._held_reports = self._held_reports, []
            restart = self.restarts < MAX_RESTARTS and not self._closing
            if restart:
                self.restarts += 1
            else:
                self.accepting = False
                self.healthy = False
                self._take_all_puts(answers, REMOTE_DOWN)
                self._give_up_tombs("the writer thread is gone")
                self._busy = False   # gone for good: nothing will be taken any more (a restarted thread goes on
            self._cond.notify_all()   # with the batch answered below: busy until it is idle)
        self._report(held)
        self._answer(answers)
        if restart:
            log.warning("%s: restarting the remote writer thread (%d of %d)", self.name, self.restarts, MAX_RESTARTS)
            self._thread = self._start()
        else:
            log.error("%s: the remote writer thread is gone: the remote tier is off", self.name)
