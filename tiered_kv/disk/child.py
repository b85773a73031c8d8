"""The disk I/O process itself: what runs in the child that :class:`~tiered_kv.disk.proc.ProcessDiskStore` starts.

``child_main`` maps the host slab, opens the same :class:`~tiered_kv.disk.store.DiskStore` the
threads mode uses (writer, readers, tombs, recovery) and pumps messages: ops from the owner's
pipe onto the store, the store's answers back in frames.  Imported by the child without the
package's ``__init__`` (no torch; see ``proc._BOOT``).  Invariants:

* every answer the store gives is sent, in the order it was given: taking the queued answers and
  writing their frame happen under one lock (``_Outbox.send``);
* the status (queue, health, tombs, sizes) travels with every frame that carries anything but
  promote answers, and at least every ``_STATUS_S`` otherwise;
* the child's mapping of the host slab gets its page table filled in the background at start
  (:func:`_populate`, unless ``prefault_host_memory`` is off): a promote's read into a slot this process
  never touched would otherwise take a page fault per 4 KiB page;
* the child dies with its owner (``PR_SET_PDEATHSIG``, checked against the owner's pid after it
  is armed); ``SIGINT`` is the engine's, not ours: only ``close()`` (the ``X`` op) or the owner's
  end stops the store.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import mmap
import os
import signal
import sys
import threading
import time
import uuid
from typing import Any, Callable, Optional, Sequence

from ..errors import DiskInUseError, DiskTierError
from ..jobs import JobKind
from ..pages import populate_read
from ..reports import CompletionQueue, Report
from .pipes import _frame, _Frames
from .proc import _PR_SET_PDEATHSIG, _STATUS_S
from .records import FlushDone

__all__ = ["child_main"]


class _Forward(logging.Handler):
    """The child's log records, sent to the owner to be logged there."""

    def __init__(self, send: Callable[[tuple[Any, ...]], None]) -> None:
        super().__init__()
        self._send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = self.format(record)
        except Exception:  # pragma: no cover - a broken record: drop it, never kill the writer
            return
        self._send(("l", record.name, record.levelno, msg))


class _Outbox(CompletionQueue):
    """The child's completion queue: what its writer and readers answer, sent to the owner in frames.

    Taking the queued items and writing their frame happen under one lock (``_sending``), so frames
    leave in the order their items were put (a flush's answer never overtakes the spill reports
    it covers).  The sender thread sends whatever is queued (waking at least every ``_STATUS_S``
    with a status); a reader that answers promotes (a run's, together: :meth:`put_many`) sends
    them at once itself when no other frame is being written, saving the owner's read a thread
    hand-off."""

    def __init__(self, write: Callable[[bytes], None]) -> None:
        super().__init__()
        self._write = write
        self._items: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._sending = threading.Lock()
        self.status: Callable[[], dict[str, Any]] = dict
        self.inline = False   # readers send their promote answers themselves (once the store is open)
        self.status_at = 0.0  # when the last status was sent (monotonic)

    def put(self, item: Any) -> None:
        self.put_many((item,))

    def put_many(self, items: Sequence[Any]) -> None:
        """Queue ``items``; promote answers (a reader's run of them) leave at once, in one frame."""
        inline = self.inline and all(type(it) is Report and it.kind is JobKind.PROMOTE for it in items)
        with self._cond:
            self._items.extend(items)
            if not inline:   # the reader sends its own answers: waking the sender would only contend
                self._cond.notify()
        if inline:
            if not self.send(block=False):   # another frame is being written: the sender takes these
                with self._cond:
                    self._cond.notify()

    def drain(self) -> list[Any]:
        with self._cond:
            items = list(self._items)
            self._items.clear()
        return items

    def wait(self, timeout: float) -> None:
        with self._cond:
            if not self._items:
                self._cond.wait(timeout)

    def pending(self) -> bool:
        return bool(self._items)

    def send(self, block: bool, last: Optional[list[Any]] = None) -> bool:
        """Write one frame of everything queued (and ``last``), with a status; False when another
        thread is writing one and ``block`` is False (that thread, or the sender, takes these)."""
        if not self._sending.acquire(blocking=block):
            return False
        try:
            out: list[Any] = []
            reads_only = True   # only promote answers: the status need not come with them (it costs ~10 us)
            for it in self.drain():
                if type(it) is Report:
                    out.append(("r", it.token.int, it.kind.value, it.ok, it.error, it.nbytes, it.seconds, it.failed,
                                it.where))
                    reads_only = reads_only and it.kind is JobKind.PROMOTE
                elif type(it) is FlushDone:
                    out.append(("f", it.token.int, it.ok, it.error))
                    reads_only = False
                else:
                    out.append(it)
                    reads_only = False
            now = time.monotonic()
            if not (reads_only and out and last is None and now - self.status_at < _STATUS_S):
                out.append(("s", self.status()))
                self.status_at = now
            self._write(_frame(out + (last or [])))
        finally:
            self._sending.release()
        return True


def _status(store: Any) -> dict[str, Any]:
    w = store.writer
    err = store.writer_error
    return {"queue_depth": store.queue_depth, "healthy": store.healthy, "writer_alive": store.writer_alive(),
            "accepting": w.accepting, "writer_error": None if err is None else repr(err),
            "tombstones": store.tombstones, "map_size": store.map_size, "file_bytes": store.file_bytes(),
            "slot_file_bytes": store.slot_file_bytes(), "slot_bytes": store.slot_bytes,
            "slots_in_use": store.slots_in_use}


def _pipe_writer(fd: int) -> Callable[[bytes], None]:
    """Write all of a frame to the owner.  Once the owner is gone (it exited without ``close()``: its end
    of the pipe is closed before it is killed with us), nobody reads what follows: it is dropped, not
    raised in the thread that sent it (which would print a traceback on the engine's terminal)."""
    gone = False

    def write(data: bytes) -> None:
        nonlocal gone
        view = memoryview(data)
        while view and not gone:
            try:
                view = view[os.write(fd, view):]
            except BrokenPipeError:
                gone = True
    return write


def _populate(mm: mmap.mmap, offset: int, nbytes: int, stop: threading.Event) -> None:
    """Fill this process's page table for the host slab's rows (:func:`tiered_kv.pages.populate_read`),
    at a lower priority than the reads and writes, which may run meanwhile (a slot not populated yet
    only faults in as before).  Stops at close."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (OSError, AttributeError):   # pragma: no cover - not Linux
        pass
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm)) + offset
    done, secs, why = populate_read(addr, nbytes, stop.is_set)
    log = logging.getLogger(__name__)
    if why is None:
        log.debug("disk I/O process: host slab mapped, %d bytes of page table filled in %.3f s", done, secs)
    elif why != "stopped":
        log.debug("disk I/O process: host slab's page table not filled past %d of %d bytes (%s): its pages "
                  "fault in as first read or written", done, nbytes, why)


def child_main() -> None:
    """The disk I/O process: ``argv`` = cmd fd, report fd, host slab fd, lock fd, owner pid."""
    cmd_fd, rep_fd, host_fd, lock_fd, owner = (int(a) for a in sys.argv[1:6])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != owner:    # the owner died before the line above
        os._exit(1)
    # the engine's Ctrl-C, and a stop signal sent to its whole process group (systemd's stop, a closed terminal),
    # are the engine's: its close() stops us after the spills queued here; PR_SET_PDEATHSIG ends us with it
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    from .store import DiskStore   # the disk package, imported here without torch (see _BOOT)

    frames = _Frames(cmd_fd)
    write = _pipe_writer(rep_fd)

    def send(items: list[Any]) -> None:
        write(_frame(items))

    opts, offset, num_slots, row_bytes, level, populate = frames.next()
    q = _Outbox(write)
    root = logging.getLogger("tiered_kv")
    root.setLevel(level)
    root.addHandler(_Forward(q.put))
    root.propagate = False
    mm = mmap.mmap(host_fd, offset + num_slots * row_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    rows = memoryview(mm)[offset:offset + num_slots * row_bytes]
    stopping = threading.Event()
    if populate:
        threading.Thread(target=_populate, args=(mm, offset, num_slots * row_bytes, stopping),
                         name="tiered-kv-disk-populate", daemon=True).start()
    else:
        logging.getLogger(__name__).debug("disk I/O process: host slab's page table left to fill as slots are first "
                                          "read or written (prefault_host_memory off)")

    def view(slot: int) -> memoryview:
        return rows[slot * row_bytes:(slot + 1) * row_bytes]

    try:
        store = DiskStore(opts, q, on_error=lambda kind, msg: q.put(("e", kind, msg)),
                          on_prevented=lambda: q.put(("p",)), on_corrupt=lambda reason: q.put(("c", reason)),
                          lock_fd=lock_fd)
    except DiskInUseError as exc:
        send(q.drain() + [("fail", "in_use", str(exc))])
        os._exit(2)
    except Exception as exc:
        send(q.drain() + [("fail", "tier", str(exc) if isinstance(exc, DiskTierError) else repr(exc))])
        os._exit(2)
    send(q.drain() + [("ready", [(e.key, e.token.int, e.seq, e.where) for e in store.entries], store.recovery,
                       _status(store))])
    q.status = lambda: _status(store)
    q.inline = True

    def sender() -> None:
        while not stopping.is_set():
            q.wait(_STATUS_S)
            if q.pending() or time.monotonic() - q.status_at >= _STATUS_S:   # not what a reader just sent
                q.send(block=True)
        q.send(block=True, last=[("closed",)])

    t = threading.Thread(target=sender, name="tiered-kv-disk-sender", daemon=True)
    t.start()
    UUID = uuid.UUID
    try:
        while True:
            try:
                cmds = frames.next()
            except EOFError:   # the owner is gone without close(): finish what was sent, then exit
                break
            for c in cmds:
                op = c[0]
                if op == "S":   # one owner job's spills: one report back
                    tokens = [UUID(int=t) for t in c[1]]
                    if not store.submit_spills(tokens, c[2], c[3], view):
                        q.put(Report(tokens[0], JobKind.SPILL, False, "disk writer is not accepting spills"))
                elif op == "P":
                    store.queue_promote(UUID(int=c[1]), c[2], UUID(int=c[3]), view(c[4]))
                elif op == "R":   # a lone read runs on this thread: one hand-off less for it
                    store.start_reads(lone_here=True)
                elif op == "C":
                    store.cancel(UUID(int=c[1]), c[2])
                elif op == "D":
                    store.submit_delete(UUID(int=c[1]), c[2])
                elif op == "T":
                    store.submit_touch(c[1])
                elif op == "F":
                    store.submit_flush(UUID(int=c[1]))
                elif op == "X":
                    raise StopIteration
    except StopIteration:
        pass
    store.close()
    stopping.set()
    with q._cond:
        q._cond.notify()
    t.join()
    os._exit(0)
