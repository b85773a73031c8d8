"""The disk store in a process of its own: the engine's GIL never stands between the disk and its work.

A serving engine's scheduler thread runs Python nearly all the time.  With the writer and the
readers as threads of that process, every LMDB call, ``pwrite`` and ``fdatasync`` gives the GIL
up and must win it back from the engine thread, which costs up to the interpreter's switch
interval (5 ms) each time: a busy engine left the writer a few hundred commits' worth of GIL per
second and most spills were shed.  :class:`ProcessDiskStore` runs the same :class:`DiskStore`
(writer, readers, tombs, recovery: one implementation) in a child process (:mod:`.child`) that maps the host
slab (shared memory) and exchanges messages with the owner over two pipes:

* owner -> child: the ops of :class:`DiskStore`'s owner-side API, each naming host slots by
  number; they are buffered on the owner thread and written once per pass of ``poll()``
  (:meth:`kick`, and at once by a flush or close) with a non-blocking write: a child that does not
  read never blocks the engine (what cannot be written waits in a backlog for the next pass);
* child -> owner: reports, flush answers, fault/corruption/prevented-write counts, log records and
  a status snapshot (queue depth, health, tombs, map and file sizes), one frame per batch of them;
  a receiver thread in the owner's process puts them on the owner's completion queue (one GIL
  round trip per frame, not per op or per I/O call).

Invariants:

* every op sent is answered exactly once: by the child, or -- when the child dies -- by the
  receiver thread, which answers every op still outstanding as failed (spills and promotes by a
  failed :class:`Report`, flushes by a failed :class:`FlushDone`) before it marks the store down;
* an op submitted to a store that is down is answered at once (promotes, flushes) or refused
  (spills); tombs and deletes sent to a dead child are lost with it, and the tier's restart
  (:meth:`tiered_kv.core.disk_tier.DiskTier.restart`) reconciles what the new child recovered
  with the index: nothing the owner dropped comes back;
* the owner never waits on the child except in :meth:`close` and at open (recovery), and
  never holds a lock around I/O;
* the child dies with its owner (``PR_SET_PDEATHSIG``, armed from a thread that lives as long as
  the owner's process, :func:`.pipes._spawn`); the path lock is taken by the owner and
  shared with the child, so it is free only once both are gone (:func:`.lock.take` waits for the
  child of an owner that is already dead).

Longer than the project's usual 500 lines: the start, the receiver, the answers owed when the child
dies and the bounded close all read and change one record of the ops in flight under one lock
(``_outstanding``, ``_down``); split, each part would reach into the others' state.  The frames and
the spawner live in :mod:`.pipes`, the child's side in :mod:`.child`.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import DiskInUseError, DiskTierError
from ..jobs import JobKind, uuid_from_int
from ..reports import CompletionQueue, Report
from . import lock
from .cached import CachedReads
from .pipes import _bigger_pipe, _frame, _Frames, _spawn
from .records import NOT_READ, DiskOptions, FlushDone, Promote, StoredEntry
from .recovery import RecoveryReport
from .store import take_path

__all__ = ["SharedHost", "ProcessDiskStore", "ProcessStartError", "CHILD_DIED"]

log = logging.getLogger(__name__)

_STATUS_S = 0.25               # an idle child sends its status this often
_OPEN_TIMEOUT_S = 600.0        # recovery of a large tier reads every index record
_KINDS = {k.value: k for k in JobKind}   # a report's kind from its value: a dict lookup, not an enum call
_TOUCH_BATCH = 64              # a frame of recency touches alone goes once this many are queued ...
_TOUCH_HOLD_S = 1.0            # ... or the first of them is this old (at the owner's next pass)
_ZERO = (0,)
_drain = collections.deque(maxlen=0).extend   # runs a chain of maps to its end, in C
_CLOSE_TIMEOUT_S = 120.0       # close() waits this long for the child to drain, then kills it
_KILLED_EXIT_S = 5.0           # ... and this long for the killed child to be gone (also at an open that failed)
_PR_SET_PDEATHSIG = 1
CHILD_DIED = "disk I/O process died"
_PKG_DIR = str(Path(__file__).resolve().parent.parent)
# the child imports tiered_kv.disk without the package's __init__ (which imports torch and the manager)
_BOOT = ("import sys, types; p = types.ModuleType('tiered_kv'); p.__path__ = [{pkg!r}]; "
         "sys.modules['tiered_kv'] = p; from tiered_kv.disk.child import child_main; child_main()")


class ProcessStartError(DiskTierError):
    """The disk I/O process could not be started, or exited before it said why (a Python that cannot
    run it, an import error); a disk tier that the child opened and found unusable raises
    :class:`DiskTierError` itself."""


@dataclass(frozen=True)
class SharedHost:
    """Where the host slab lives for another process: an open file (a memfd, or the vLLM adapter's
    ``/dev/shm`` file) holding ``num_slots`` rows of ``row_bytes`` from ``offset`` on, and the
    address of row 0 in this process (to turn a slot's memoryview into its number).  ``populate``:
    the other process fills its page table for the rows at start (``prefault_host_memory``; off, it
    would allocate a slab the owner was told to leave unfaulted)."""
    fd: int
    offset: int
    num_slots: int
    row_bytes: int
    base_addr: int
    populate: bool = True


_sigpipe_logged = False


def _check_sigpipe() -> None:
    """Warn (once) when this process does not ignore SIGPIPE: the owner writes to the disk I/O process's pipe, and
    a write after the child died must fail with ``EPIPE`` (answered, counted, the child restarted), which it
    does only where SIGPIPE is ignored -- CPython's own start-up ignores it; an embedding host, or one that
    restored ``SIG_DFL``, would be killed by it instead (use ``disk_io="thread"`` there)."""
    global _sigpipe_logged
    sig = getattr(signal, "SIGPIPE", None)
    if sig is None or _sigpipe_logged:
        return
    try:
        ignored = signal.getsignal(sig) == signal.SIG_IGN
    except (ValueError, OSError):   # not determinable here
        return
    if not ignored:
        _sigpipe_logged = True
        log.warning("SIGPIPE is not ignored in this process: if the disk I/O process dies, the next write to it "
                    "kills this process instead of failing (CPython ignores SIGPIPE at start; restore that with "
                    "signal.signal(signal.SIGPIPE, signal.SIG_IGN), or use disk_io='thread')")


# ---------------------------------------------------------------------------- the owner's side
class ProcessDiskStore:
    """The owner's handle on a :class:`DiskStore` running in a child process; the same owner-side API.

    Raises like :class:`DiskStore` at open: :class:`DiskInUseError` when the path is held,
    :class:`DiskTierError` when it cannot be opened (or the child cannot start).

    ``lock_fd``: a share (:func:`.lock.share`) of the path's lock that its holder -- the disk tier, which
    replaces a child that died -- keeps beside this store: the store uses it instead of taking the lock, and
    closes it without unlocking (at its close, or when its start fails), so the path is never free while
    the holder lives."""

    def __init__(self, opts: DiskOptions, completions: CompletionQueue, host: SharedHost,
                 on_error: Callable[[str, str], None] = lambda kind, msg: None,
                 on_prevented: Callable[[], None] = lambda: None,
                 on_corrupt: Callable[[str], None] = lambda reason: None,
                 lock_fd: Optional[lock.LockFd] = None) -> None:
        self.opts = opts
        self._out = completions
        self._host = host
        self._on_error = on_error
        self._on_prevented = on_prevented
        self._on_corrupt = on_corrupt
        self._cmds: list[tuple[Any, ...]] = []
        self._touches = 0                 # how many of _cmds are touches (a frame of touches alone waits: kick())
        self._touch_since = 0.0           # when the first of them was queued (time.monotonic)
        self._held: list[Promote] = []    # promotes queued since the last start_reads()
        self._exit_queued = False         # close() queued the child's exit
        # reports of reads served on the owner's thread, not queued yet: ``[report]``, then ``[report, op]`` once
        # its op left _outstanding (None: the child's death answered it)
        self._served: list[list[Any]] = []
        self.cached = CachedReads(opts.path, opts.namespace, opts.block_bytes)   # a blocked owner's own reads
        self._backlog = bytearray()
        self._lock = threading.Lock()     # guards _outstanding and _dead between the owner and the receiver
        # token.int -> (kind, token, spills) of every spill group, promote and flush sent and not yet answered
        self._outstanding: dict[int, tuple[str, uuid.UUID, int]] = {}
        self._dead = False                # the child is gone: no op is recorded from here on
        self._down = False                # ... and every op it had was answered (set after those answers)
        self._closing = False
        self._release_late = False        # close() left the pipes and the path lock to the receiver
        self._spills_sent = 0             # owner thread only
        self.spills_accepted = 0          # submit_spills calls that queued their op (DiskStore.spills_accepted)
        self._spills_answered = 0         # receiver thread only
        self.status: dict[str, Any] = {}
        self.exit_code: Optional[int] = None
        self.recovery = RecoveryReport()
        self.entries: list[StoredEntry] = []
        self._child_left = False          # an open that failed killed the child, which did not exit (yet)
        self._killed = False              # close() killed the child for outlasting its deadline
        self.died = False                 # the child ended without closing, and close() did not kill it
        self._lock_shared = lock_fd is not None   # a share of its holder's lock: closed, never unlocked
        _check_sigpipe()
        self._lock_fd = take_path(opts.path) if lock_fd is None else lock_fd
        try:
            self._start()
        except BaseException:
            if self._child_left or self._lock_shared:   # the lock stays with the other shares: the child's (free
                lock.leave(self._lock_fd)                # once it is gone), the holder's
            else:
                lock.release(self._lock_fd)
            self._lock_fd = -1
            raise

    def _start(self) -> None:
        h = self._host
        fds: list[int] = []
        try:   # an OSError (out of descriptors, of processes) or a spawner thread that cannot start: a start that failed
            cmd_r, cmd_w = os.pipe()
            fds += (cmd_r, cmd_w)
            rep_r, rep_w = os.pipe()
            fds += (rep_r, rep_w)
            for fd in (cmd_r, rep_w):
                _bigger_pipe(fd)
            self._proc = _spawn(
                [sys.executable, "-c", _BOOT.format(pkg=_PKG_DIR), str(cmd_r), str(rep_w), str(h.fd),
                 str(self._lock_fd), str(os.getpid())], (cmd_r, rep_w, h.fd, self._lock_fd))
        except BaseException as exc:
            for fd in fds:
                os.close(fd)
            if not isinstance(exc, (OSError, RuntimeError)) or isinstance(exc, DiskTierError):
                raise
            raise ProcessStartError(f"disk_path {str(self.opts.path)!r}: cannot start the disk I/O process: {exc}") from exc
        os.close(cmd_r)
        os.close(rep_w)
        self._cmd_w, self._rep_r = cmd_w, rep_r
        self.pid = self._proc.pid
        frames = _Frames(rep_r)
        try:
            os.write(cmd_w, _frame((self.opts, h.offset, h.num_slots, h.row_bytes,
                                    logging.getLogger("tiered_kv").getEffectiveLevel(), h.populate)))
            first = self._first_frame(frames)
        except OSError as exc:   # the child died at once (EPIPE)
            self._kill()
            raise ProcessStartError(f"disk_path {str(self.opts.path)!r}: the disk I/O process did not take its "
                                    f"options: {exc}") from exc
        except BaseException:
            self._kill()
            raise
        os.set_blocking(cmd_w, False)   # from here on the owner never waits for the child to read
        self.recovery = first[2]
        self.entries = [StoredEntry(k, uuid.UUID(int=t), s, w) for k, t, s, w in first[1]]
        self.status = first[3]
        self._receiver = threading.Thread(target=self._receive, args=(frames,), name="tiered-kv-disk-receiver",
                                          daemon=True)
        try:
            self._receiver.start()
        except BaseException as exc:   # the child is open and would run on unanswered, the path unlocked
            self._kill()
            if isinstance(exc, RuntimeError):   # can't start new thread: a tier that cannot open
                raise DiskTierError(f"disk_path {str(self.opts.path)!r}: cannot start the disk I/O process's "
                                    f"receiver thread: {exc}") from exc
            raise

    def _first_frame(self, frames: _Frames) -> Any:
        """The child's answer to its open: ``("ready", ...)``; its log records before it are re-logged."""
        deadline = time.monotonic() + _OPEN_TIMEOUT_S
        while True:
            try:
                items = frames.next(deadline)
            except TimeoutError:   # stopped, or stuck on a hung disk: the caller kills it
                raise ProcessStartError(f"disk_path {str(self.opts.path)!r}: the disk I/O process did not answer "
                                        f"its open within {_OPEN_TIMEOUT_S:.0f} s") from None
            except EOFError:
                try:
                    rc: Any = self._proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:   # its pipe closed, yet it lives on: the caller kills it
                    rc = "unknown: it did not exit"
                raise ProcessStartError(f"disk_path {str(self.opts.path)!r}: the disk I/O process exited at open "
                                        f"(status {rc})") from None
            for msg in items:
                if msg[0] == "ready":
                    return msg
                if msg[0] == "fail":
                    cls = DiskInUseError if msg[1] == "in_use" else DiskTierError
                    raise cls(msg[2])
                self._dispatch([msg])

    def _kill(self) -> None:
        """An open that failed: kill the child, wait ``_KILLED_EXIT_S`` for it to be gone, close the pipes.
        A child still there (in uninterruptible sleep on a hung disk) sets ``_child_left``: the caller then
        leaves the path lock to it (:func:`.lock.leave`), free once it is gone; it is never waited for here."""
        try:
            self._proc.kill()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=_KILLED_EXIT_S)
        except subprocess.TimeoutExpired:
            self._child_left = True
            log.error("disk tier %s: the disk I/O process (pid %d) did not exit when killed at a failed open; the "
                      "path stays held until it does", self.opts.path, self._proc.pid)
        for fd in (getattr(self, "_cmd_w", -1), getattr(self, "_rep_r", -1)):
            if fd >= 0:
                os.close(fd)
        self._cmd_w = self._rep_r = -1

    # ------------------------------------------------------------ the receiver thread
    def _receive(self, frames: _Frames) -> None:
        closed = ended = False
        try:
            while True:
                try:
                    items = frames.next()
                except (EOFError, OSError):
                    ended = True
                    break
                if self._dispatch(items):
                    closed = True
                    break
        finally:
            if not (closed or ended):
                # a frame this thread could not apply (the exception follows): the child's answers would go
                # unread from here on, so it goes now, and its ops are answered as failed
                log.error("disk tier %s: the disk I/O process's reports could not be read; killing it", self.opts.path)
                try:
                    self._proc.kill()
                except OSError:
                    pass
            self._gone(closed)

    def _dispatch(self, items: list[Any]) -> bool:
        """Apply one frame of the child's messages; True at its last (``closed``).

        The answered ops leave ``_outstanding`` under one hold of ``_lock`` per frame (a dict pop each),
        then their answers are made and queued in the frame's order outside it: this thread holds the
        GIL the engine's thread needs back after each of its own system calls, so each answer is made
        with as little Python as it takes (``uuid_from_int``, the kind from a dict)."""
        put = self._out.put
        answered = [it[1] for it in items if it[0] == "r" or it[0] == "f"]
        ops: list[Any] = []
        if answered:
            with self._lock:
                pop = self._outstanding.pop
                ops = [pop(t, None) for t in answered]
        nth = 0   # the ops whose answers this frame made so far (the rest are answered failed if it fails)
        try:
            for it in items:
                tag = it[0]
                if tag == "r":
                    _, t, kind, ok, err, nbytes, secs, failed, where = it
                    report = Report(uuid_from_int(t), _KINDS[kind], ok, err, nbytes, secs, failed, where)
                    op = ops[nth]
                    nth += 1
                    if kind == "spill":   # before the owner can see the report: its room counts it free
                        self._spills_answered += 1 if op is None else op[2]
                    put(report)
                elif tag == "f":
                    _, t, ok, err = it
                    done = FlushDone(uuid_from_int(t), ok, err)
                    nth += 1
                    put(done)
                elif tag == "s":
                    self.status = it[1]
                elif tag == "e":
                    self._host_call(self._on_error, it[1], it[2])
                elif tag == "p":
                    self._host_call(self._on_prevented)
                elif tag == "c":
                    self._host_call(self._on_corrupt, it[1])
                elif tag == "l":
                    logging.getLogger(it[1]).log(it[2], "%s", it[3])
                elif tag == "closed":
                    return True
        except BaseException:
            # the frame could not be applied (the receiver kills the child, and _gone answers what is still
            # outstanding): the ops it took out of _outstanding and did not answer are answered here, failed
            self._answer_failed([op for op in ops[nth:] if op is not None])
            raise
        return False

    def _host_call(self, fn: Callable[..., Any], *args: Any) -> None:
        """A host callback (a count, a log line), on the receiver thread: one that raises is logged and
        ends nothing (the answers after it in the frame, and the child's later ones, are still applied)."""
        try:
            fn(*args)
        except Exception:   # noqa: BLE001 - the host's own error: logged, the protocol goes on
            log.exception("disk tier %s: a callback of the host raised", self.opts.path)

    def _gone(self, closed: bool) -> None:
        """The child's reports end: answer everything outstanding as failed, then mark the store down.
        ``closed``: it said so (a clean close); else it died, counted also while the owner closes."""
        try:
            self.exit_code = self._proc.wait(timeout=_CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:   # its pipe closed but it lives on: make sure it is gone
            self._proc.kill()
            self.exit_code = self._proc.wait()
        with self._lock:
            rest, self._outstanding = self._outstanding, {}
            self._dead = True
        if not closed:
            self.died = not self._killed
            log.error("disk tier %s: the disk I/O process (pid %d) exited with status %s; %d op(s) in flight "
                      "answered as failed", self.opts.path, self.pid, self.exit_code, len(rest))
            self._host_call(self._on_error, "io_process_died", f"pid {self.pid} exited with status {self.exit_code}")
        self._answer_failed(rest.values())
        with self._lock:   # with close()'s look at it: one of the two releases the path, never neither
            self._down = True   # only now: a restart's reconciliation needs these answers applied first
            late = self._release_late
        if late:   # close() returned before the killed child was gone
            self._release()

    def _answer_failed(self, ops: Any) -> None:
        put = self._out.put
        for what, token, parts in ops:
            if what == "spill":
                self._spills_answered += parts
                put(Report(token, JobKind.SPILL, False, CHILD_DIED))
            elif what == "promote":
                put(Report(token, JobKind.PROMOTE, False, f"{NOT_READ} ({CHILD_DIED})"))
            else:
                put(FlushDone(token, False, CHILD_DIED))

    # ------------------------------------------------------------ owner side (never blocks on I/O)
    def _track(self, what: str, token: uuid.UUID, parts: int = 1) -> bool:
        """Record an op to be answered (``parts`` spills under ``token``); False when the child is gone."""
        with self._lock:
            if self._dead:
                return False
            self._outstanding[token.int] = (what, token, parts)
            return True

    def _slot(self, view: memoryview) -> int:
        h = self._host
        return (ctypes.addressof(ctypes.c_char.from_buffer(view)) - h.base_addr) // h.row_bytes

    def submit_spill(self, token: uuid.UUID, key: bytes, src: memoryview) -> bool:
        return self.submit_spills([token], [key], [self._slot(src)], None)

    def submit_spills(self, tokens: list[uuid.UUID], keys: list[bytes], slots: list[int],
                      view: Optional[Callable[[int], memoryview]]) -> bool:
        """As :meth:`DiskStore.submit_spills`: one op for the child (which maps the same slots), one
        report back."""
        n = len(tokens)
        if self.spill_room() < n:
            return False
        cmd = ("S", [t.int for t in tokens], keys, slots)
        op = ("spill", tokens[0], n)
        tok = tokens[0].int
        with self._lock:   # (as _track)
            if self._dead:
                return False
            # one step, no call: tracked, counted and queued together -- an interrupt leaves all of it or none
            # (spills_accepted: see DiskStore.spills_accepted)
            self._outstanding[tok] = op
            self._spills_sent += n
            self.spills_accepted += 1
            self._cmds += (cmd,)
        return True

    def cancel(self, token: uuid.UUID, key: bytes) -> None:
        self._cmds.append(("C", token.int, key))

    def submit_delete(self, token: uuid.UUID, key: bytes) -> None:
        self._cmds.append(("D", token.int, key))

    def submit_touch(self, key: bytes) -> None:
        """Queue a recency touch (one per promote).  It rides with the next frame that goes anyway; a frame of
        touches alone waits until ``_TOUCH_BATCH`` of them are queued or the first is ``_TOUCH_HOLD_S`` old
        (:meth:`kick`): a frame each would wake the child once per lone load, beside the owner's copy.  While the
        pipe is backed up (a child that does not read) touches stay out of the backlog, and one past
        ``_TOUCH_BATCH`` held is dropped: a touch is a recency hint, and the owner's queue stays bounded."""
        if self._touches >= _TOUCH_BATCH and self._backlog:
            return
        if not self._touches:
            self._touch_since = time.monotonic()
        self._cmds.append(("T", key))
        self._touches += 1

    def submit_flush(self, token: uuid.UUID) -> None:
        if not self._track("flush", token):
            self._out.put(FlushDone(token, False, CHILD_DIED))
            return
        self._cmds.append(("F", token.int))
        self.kick()

    def queue_promote(self, token: uuid.UUID, key: bytes, expect: uuid.UUID, dst: memoryview, where: int = 0) -> None:
        if not self._track("promote", token):
            self._answer_failed([("promote", token, 1)])
            return
        self._held.append(Promote(token, key, expect, dst, where))

    def holds_read(self, token: uuid.UUID) -> bool:
        """As :meth:`DiskStore.holds_read`."""
        return any(op.token is token for op in self._held)

    @property
    def reads_held(self) -> bool:
        """As :attr:`DiskStore.reads_held`."""
        return bool(self._held)

    def start_reads(self, cached_here: bool = False, until: Optional[float] = None) -> None:
        """Hand the held reads to the readers: the child starts them when this pass's frame arrives
        (a pass with none held sends nothing).  ``cached_here``: the owner blocks anyway, so what the
        page cache holds of them is read on its thread first (:class:`~tiered_kv.disk.cached.CachedReads`;
        ``until``: its call's deadline), a chunk per pass (``CachedReads.read_chunk``: while every read so far
        was served, those after the chunk stay held for the next pass), the rest go to the child.  The reads
        stay held until they are served or their ops queued: an interrupt in the page-cache reads loses none
        (the next pass serves or sends them); a read served leaves them at once, and its report is queued by
        this pass or, after an interrupt, by the next (:meth:`_queue_served`)."""
        if self._served:
            self._queue_served()
        held = self._held
        if not held:
            return
        later: list[Promote] = []   # held for the owner's next pass (a chunk per pass: CachedReads.read_chunk)
        if cached_here and self.cached.enabled and not self._closing and not self._dead:
            # (a dead child answered every held read failed already: none is read, or counted, here)
            cached = self.cached
            passed = cached.passed   # (read_chunk counts what it hands on)
            served, rest, later = cached.read_chunk(held, until)
            if served:
                entries, n = [[r] for r in served], len(served)
                # one step (no call between the stores, so no signal handler runs there): the served reads
                # leave the held ones, never to run again (a second read would write a host slot that the first
                # report may have given back), their reports wait to be queued, and they are counted served
                self._held, self._served = rest + later, entries
                cached.served += n
                self._queue_served()
            if self._dead:   # it died during the reads: what it answered failed was not handed on either (nor held)
                cached.passed = passed
                rest, later = rest + later, []
            held = rest
        if held:
            slot = self._slot
            cmds = [("P", op.token.int, op.key, op.expect.int, slot(op.dst)) for op in held]
            cmds.append(("R",))
            self._cmds += cmds   # (no call between these two lines)
            self._held = later
            self.kick()
        else:
            self._held = later

    def _queue_served(self) -> None:
        """Queue the reports of the reads served on the owner's thread (``_served``), each of whose op first
        leaves ``_outstanding`` (answered here, not by the child); one the child's death answered already
        (failed) is dropped.  An interrupt anywhere leaves the rest to the owner's next pass
        (``start_reads``): an op taken out is recorded with its entry in the same C call, a report queued
        twice is counted stale, none is lost, and no read runs twice."""
        pending = self._served
        lock = self._lock
        for e in pending:
            if len(e) == 1:
                with lock:
                    e.extend(map(self._outstanding.pop, (e[0].token.int,), (None,)))
        reports = [e[0] for e in pending if e[1] is not None]
        if reports:
            self._out.put_many(reports)
        self.cached.served -= len(pending) - len(reports)   # the counter's "served": reads that answered a load
        self._served = []

    def kick(self) -> None:
        """Write the ops buffered since the last call as one frame, without waiting: what the pipe
        does not take now stays in the backlog for the next call."""
        if self._down:   # answered already (spills, promotes, flushes) or lost with the child, and so is
            self._cmds = []   # what the pipe held back: nothing is held back for a store that is down
            self._touches = 0
            self._backlog.clear()
            return
        cmds = self._cmds
        backlog = self._backlog
        # a frame of touches alone waits for a batch or an age, and for the frames before it to be taken
        if cmds and (len(cmds) > self._touches or (not backlog and (
                self._touches >= _TOUCH_BATCH or time.monotonic() - self._touch_since >= _TOUCH_HOLD_S))):
            frame = _frame(cmds)   # first: an interrupt while it is made leaves the ops queued for the next call
            backlog += frame   # (no call between these lines: no interrupt either)
            self._cmds = []
            self._touches = 0
        fd = self._cmd_w
        while backlog and fd >= 0:
            try:
                # the write and the removal of what it wrote in one chain of C calls: no signal handler runs
                # between them (an interrupt as os.write returned would leave its bytes queued, sent twice)
                _drain(map(backlog.__delitem__, map(slice, _ZERO, map(os.write, (fd,), (backlog,)))))
            except BlockingIOError:
                return
            except OSError:     # the child is gone: the receiver answers what was outstanding
                backlog.clear()
                return

    @property
    def backlogged(self) -> bool:
        """Ops wait for room in the pipe to the child (:meth:`kick` sends more); never once it is down or
        closed (they cannot be sent)."""
        return bool(self._backlog) and not self._down and self._cmd_w >= 0

    @property
    def queue_depth(self) -> int:
        """Spills sent and not yet answered (queued in the child, or in its writer's batch)."""
        return self._spills_sent - self._spills_answered

    def spill_room(self) -> int:
        if self._down or not self.status.get("accepting", True):
            return 0
        return max(0, self.opts.queue_blocks - self.queue_depth)

    def writer_alive(self) -> bool:
        return not self._dead and bool(self.status.get("writer_alive", True))

    @property
    def dead(self) -> bool:
        """The child is gone; the answers to its ops may still be on their way (see :attr:`down`)."""
        return self._dead

    @property
    def down(self) -> bool:
        """The child is gone and every op it had was answered (the tier may start a new one)."""
        return self._down

    @property
    def healthy(self) -> bool:
        return not self._down and bool(self.status.get("healthy", True))

    @property
    def writer_error(self) -> Optional[str]:
        return CHILD_DIED if self._down and not self._closing else self.status.get("writer_error")

    @property
    def tombstones(self) -> int:
        return int(self.status.get("tombstones", 0))

    @property
    def map_size(self) -> int:
        return int(self.status.get("map_size", 0))

    def file_bytes(self) -> int:
        return int(self.status.get("file_bytes", 0))

    def slot_file_bytes(self) -> int:
        return int(self.status.get("slot_file_bytes", 0))

    def disk_bytes(self) -> int:
        return self.file_bytes() + self.slot_file_bytes()

    @property
    def slot_bytes(self) -> int:
        return int(self.status["slot_bytes"])

    @property
    def slots_in_use(self) -> int:
        return int(self.status.get("slots_in_use", 0))

    def close(self) -> None:
        """Let the child finish what was sent, answer it, and exit; release the path.  Idempotent; a close
        an interrupt broke off is finished by the next one."""
        if self._lock_fd < 0 or self._release_late:   # released, or left to the receiver
            return
        if not self._exit_queued:   # (until then a close an interrupt broke off starts it again)
            self._closing = True
            self.start_reads()   # reads still held: the child answers them before it exits
            self._cmds += [("X",)]   # (no call between these two: queued, and known to be)
            self._exit_queued = True
        deadline = time.monotonic() + _CLOSE_TIMEOUT_S
        try:   # the backlog goes as the child reads it, until the deadline: a child that stopped reading is killed
            self.kick()
            if self._backlog and self._cmd_w >= 0:
                writable = select.poll()   # not select.select: a serving process's descriptors pass 1024
                writable.register(self._cmd_w, select.POLLOUT)
                while self._backlog and self._cmd_w >= 0 and self._receiver.is_alive():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    writable.poll(min(left, 1.0) * 1e3)
                    self.kick()
        except Exception:
            self._finish_close(deadline)
            raise
        # an interrupt (Ctrl-C) leaves the child running: what close() queued is still queued or sent (kick()
        # loses nothing to one), and the next close() finishes; waiting here, the child never told to exit,
        # would hold the interrupted host for the whole deadline and then kill the child with its writes
        self._finish_close(deadline)

    def _finish_close(self, deadline: float) -> None:
        """close()'s end: wait (until ``deadline``) for the child to answer all and exit, else kill it; release."""
        self._receiver.join(max(0.0, deadline - time.monotonic()))
        if self._receiver.is_alive():   # the child does not finish: stop it (its ops are answered by _gone)
            log.error("disk tier %s: the disk I/O process did not close within %.0f s; killed",
                      self.opts.path, _CLOSE_TIMEOUT_S)
            self._killed = True
            self._proc.kill()
            self._receiver.join(_KILLED_EXIT_S)
        if self._receiver.is_alive():
            # killed, and still not gone (a thread of it in uninterruptible sleep on a hung disk): the
            # host's shutdown does not wait for it; the receiver releases the descriptors and the path
            # once the child is finally gone
            with self._lock:
                if not self._down:   # else the receiver finished meanwhile, and released nothing
                    self._release_late = True
            if self._release_late:
                log.error("disk tier %s: the disk I/O process (pid %d) did not exit when killed; the path stays "
                          "held until it does", self.opts.path, self.pid)
        if not self._release_late:
            self._release()

    def _release(self) -> None:
        """The pipes and the path lock go (once: close(), or the receiver after a child that outlived it)."""
        self.cached.close()
        with self._lock:
            fds, self._cmd_w, self._rep_r = (self._cmd_w, self._rep_r), -1, -1
        # each is closed whatever happens to the one before (an interrupt after a close): the pipes, marked
        # closed above, are closed by no later call (never twice: a number may be another file's by then); the
        # path lock is marked released only once it is (a second release of it does nothing), so a close an
        # interrupt broke off before that is finished by the next
        try:
            if fds[0] >= 0:
                os.close(fds[0])
        finally:
            try:
                if fds[1] >= 0:
                    os.close(fds[1])
            finally:
                lock_fd = self._lock_fd
                if lock_fd >= 0:
                    (lock.leave if self._lock_shared else lock.release)(lock_fd)
                    self._lock_fd = -1

    def kill_for_test(self, sig: int = signal.SIGKILL) -> None:
        """Tests: send ``sig`` to the child (a crash of the I/O process)."""
        os.kill(self.pid, sig)
