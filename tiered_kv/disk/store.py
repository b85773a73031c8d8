"""The disk tier's I/O side behind one facade: :class:`DiskStore` wires the parts and keeps the API.

:class:`DiskStore` owns every LMDB transaction of its path; the tier core (tiered_kv.core) owns the policy (which keys
live on disk, leases, LRU, capacity) and talks to the store only through messages, exactly like
the copy movers:

* ``submit_spills`` / ``cancel`` / ``submit_delete`` / ``submit_touch`` / ``submit_flush`` queue an
  op for the writer thread (writer.py) and never block.  Spill ops are bounded (``queue_blocks``):
  a full queue sheds the spills.
* ``queue_promote`` holds a read in the caller's thread until ``start_reads`` hands everything held
  over to the reader threads (readers.py) as batches (a front end's ``load()``/``lookup()`` holds,
  its ``poll()``/``tick()`` hands over: no reader is woken inside the engine's call).
* Each op is answered by one :class:`~tiered_kv.movers.Report` (a job's spills together, promotes) or
  :class:`~tiered_kv.disk.records.FlushDone` on the manager's completion queue.

The parts: lock.py (one store per path), env.py (LMDB environment, map growth), slots.py (the
slot file holding the payloads), tombs.py (cancellations), recovery.py (on open, before the first
read), writer.py, readers.py.  Invariant of the facade: open takes the path lock, then the
environment, the slot file and recovery, then starts the writer and the readers, in that order, and
releases all of it (the threads already started end first) if any step fails; a fault there (an
LMDB or I/O error, sizes LMDB cannot map, a thread that cannot start) is raised as
:class:`DiskTierError`, as the disk I/O process reports it; ``close()`` drains the writer and the
readers before it releases anything.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Optional

import lmdb

from ..errors import DiskInUseError, DiskTierError
from ..reports import CompletionQueue
from . import lock
from .cached import CachedReads
from .env import DiskEnv
from .readers import Readers
from .records import Delete, DiskOptions, Flush, Promote, StoredEntry, Tomb, Touch
from .recovery import RecoveryReport, recover
from .slots import SlotFile
from .tombs import Tombs
from .writer import Writer

log = logging.getLogger(__name__)

CLOSE_JOIN_S = 120.0
"""``close()`` waits this long for the reader threads, then the writer, to finish what was queued (the
disk I/O process is given as long, ``proc._CLOSE_TIMEOUT_S``)."""

__all__ = ["DiskStore", "take_path"]


def take_path(path: Path) -> int:
    """Make ``path`` if needed, check that it is writable and take its lock; returns the lock's fd.

    Raises :class:`DiskInUseError` (naming the holder's pid) when another owner holds it, and
    :class:`DiskTierError` when it cannot be made, written or locked."""
    top = None   # the topmost directory made here
    p = path.absolute()
    while not p.exists() and p.parent != p:
        top, p = p, p.parent
    try:
        path.mkdir(parents=True, exist_ok=True)
        if top is not None:   # each directory made: its entry in its parent synced (the files in it: DiskStore)
            lock.sync_dirs(path.absolute().parent, top.parent)
    except OSError as exc:
        raise DiskTierError(f"disk_path {str(path)!r} cannot be created: {exc}") from exc
    if not os.access(path, os.W_OK):
        raise DiskTierError(f"disk_path {str(path)!r} is not writable")
    try:
        return lock.take(path)
    except lock.LockHeld as held:
        raise DiskInUseError(f"disk_path {str(path)!r} is in use by another owner (a TierManager, a vLLM engine or a writing operator tool; pid {held.holder}); "
                             f"one manager per path") from None
    except OSError as exc:
        raise DiskTierError(f"disk_path {str(path)!r}: cannot open lock file: {exc}") from exc


class DiskStore:
    """One LMDB environment per path, held exclusively by one store (file lock)."""

    def __init__(self, opts: DiskOptions, completions: CompletionQueue,
                 on_error: Callable[[str, str], None] = lambda kind, msg: None,
                 on_prevented: Callable[[], None] = lambda: None,
                 on_corrupt: Callable[[str], None] = lambda reason: None, lock_fd: int = -1) -> None:
        self.opts = opts
        # the path lock: taken here, or (the disk I/O process, proc.py) taken by the owner and shared,
        # in which case it is never unlocked here (flock belongs to the shared open file)
        self._lock_fd = -1
        self._dirs: list[int] = []   # the locked directory, open while the store is (its files are opened through it)
        self._lock_shared = lock_fd >= 0
        if self._lock_shared:
            self._lock_fd = lock_fd
        self.db: Optional[DiskEnv] = None
        self.slots: Optional[SlotFile] = None
        self.recovery = RecoveryReport()
        self.entries: list[StoredEntry] = []
        seq = self._open(on_error)
        assert self.db is not None and self.slots is not None
        self.tombs = Tombs(self.db, self.slots)
        writer: Optional[Writer] = None
        try:   # the open's last step: its threads (Readers ends those it started if one cannot start)
            writer = Writer(opts, completions, self.db, self.slots, self.tombs, seq, on_error, on_prevented)
            self.readers = Readers(opts, completions, self.db, self.slots, writer.push, on_error, on_corrupt)
        except BaseException as exc:
            if writer is not None:   # nothing queued: it ends at once
                writer.begin_close()
                writer.join()
            self._release()
            if isinstance(exc, RuntimeError) and not isinstance(exc, DiskTierError):   # can't start new thread
                raise DiskTierError(f"disk_path {str(opts.path)!r}: cannot start its threads: {exc}") from exc
            raise
        self.writer = writer
        self.cached = CachedReads(opts.path, opts.namespace, opts.block_bytes)   # a blocked owner's own reads
        self._closed = False
        self._reaper: Optional[threading.Thread] = None   # the thread a close that left threads running made

    # ------------------------------------------------------------ open / close
    def _open(self, on_error: Callable[[str, str], None]) -> int:
        """Take the path, open the environment and the slot file, recover; the highest sequence number."""
        o = self.opts
        if not self._lock_shared:
            self._lock_fd = take_path(o.path)
        try:
            ns = o.namespace.encode()
            # the directory itself, checked to hold the lock and then opened through its descriptor: a name that
            # moves to another directory meanwhile (moved aside and made again, mounted over) changes nothing here
            if not lock.pin(self._lock_fd, o.path, self._dirs):
                raise DiskTierError(f"disk_path {str(o.path)!r} no longer names the directory locked when the tier "
                                    f"opened (moved, replaced or mounted over since): not opened")
            at = lock.pinned_path(self._dirs[0])
            self.db = DiskEnv(o.path if at is None else at, ns, o.block_bytes, o.durability, o.map_size_bytes,
                              o.target_slots(), o.num_readers, on_error, name=o.path)
            self.slots = SlotFile(o.path if at is None else at, o.block_bytes, o.target_slots(), o.durability,
                                  o.batch_blocks, name=o.path)
            if at is None:   # opened by name (no /proc): the name did not move to another directory meanwhile
                self._check_lock()
            self.entries, seq, self.recovery = recover(self.db, self.slots, ns, o.block_bytes)
            if o.durability != "none":   # the files' names survive a crash with their contents
                lock.fsync_path(self._dirs[0], directory=True)
            return seq
        except lmdb.Error as exc:
            msg = f"disk_path {str(o.path)!r} is damaged: {self._named(exc)}"
            self._release()
            raise DiskTierError(msg) from exc
        except (OverflowError, ValueError) as exc:   # sizes LMDB cannot map: a tier that cannot open
            self._release()
            raise DiskTierError(f"disk_path {str(o.path)!r} cannot be opened with these sizes: {exc}") from exc
        except OSError as exc:   # an I/O error (the directory's fsync, a stat of data.mdb): a tier that cannot open
            msg = f"disk_path {str(o.path)!r} cannot be opened: {self._named(exc)}"
            self._release()
            raise DiskTierError(msg) from exc
        except BaseException:
            self._release()
            raise

    def _named(self, exc: BaseException) -> str:
        """An error's text with the pinned path the files were opened through given as the configured one."""
        text = str(exc)
        for fd in self._dirs:
            text = lock.as_named(text, lock.fd_path(fd), self.opts.path)
        return text

    def _check_lock(self) -> None:
        """Where the files were opened by name (no ``/proc``): the name must still name the directory whose lock
        this store holds, not one that replaced it since (moved aside, made again, mounted over, a link
        repointed), whose lock this store does not hold and which another owner may."""
        if not lock.locks(self._lock_fd, self.opts.path):
            raise DiskTierError(f"disk_path {str(self.opts.path)!r} no longer names the directory locked when the "
                                f"tier opened (moved, replaced or mounted over since): not opened")

    def close(self) -> None:
        """Finish queued ops, sync, stop threads, release the path.  Idempotent.  Bounded by
        :data:`CLOSE_JOIN_S`: a thread still running then (hung in the kernel on a dead disk) is left
        behind, logged, and nothing it may still use is released until it ends (a reaper thread then
        releases the files and the path lock), as ``disk_io="process"`` leaves a child it could not stop."""
        if self._closed:
            return
        if self._reaper is not None:   # a close an interrupt broke off as it started its reaper
            self._start_reaper()
            return
        # each step below can run again: a close an interrupt broke off is finished by the next one
        # (``_closed`` is set once the path is released, or left to the reaper)
        self.cached.close()
        deadline = time.monotonic() + CLOSE_JOIN_S
        # the readers first: a read close() lets finish may find a corrupt entry and queue its removal
        # with the writer, which must still be there to commit it
        self.readers.stop()
        readers_done = self.readers.join(CLOSE_JOIN_S)
        self.writer.begin_close()
        writer_done = self.writer.join(max(0.0, deadline - time.monotonic()))
        if writer_done:
            self.writer.settle_orphans()
        if readers_done and writer_done:
            self._release()
            self._closed = True
            return
        log.error("disk tier %s: the disk %s did not finish within %.0f s of close (hung on the disk?); left "
                  "running, its files and the path lock kept until it ends", self.opts.path,
                  "writer" if readers_done else "readers" if writer_done else "readers and writer", CLOSE_JOIN_S)
        self._reaper = threading.Thread(target=self._release_late, args=(writer_done,), name="tiered-kv-disk-reaper",
                                        daemon=True)
        self._start_reaper()

    def _start_reaper(self) -> None:
        """Start the reaper close() made (a thread runs once: one reaper releases the path, never two)."""
        assert self._reaper is not None
        try:
            self._reaper.start()
        except RuntimeError:   # started already (a close run again), or no thread: the path stays locked until
            pass               # the process ends
        self._closed = True

    def _release_late(self, writer_done: bool) -> None:
        """After a close that left threads running: once they end, what ``close()`` skipped (the removals
        left for the writer -- a reader left running may queue one after the writer ended --, then the
        files and the path lock)."""
        self.readers.join()
        if not writer_done:
            self.writer.join()
        self.writer.settle_orphans()
        self._release()
        log.warning("disk tier %s: the threads close() left behind have ended; the path is released", self.opts.path)

    def _release(self) -> None:
        if self.db is not None:
            self.db.close()
        if self.slots is not None:
            self.slots.close()
        try:   # each taken off and closed in one chain of C calls (never closed twice, none left by an interrupt)
            collections.deque(map(os.close, iter(self._dirs.pop, None)), maxlen=0)
        except IndexError:   # none left
            pass
        if self._lock_fd >= 0:
            if self._lock_shared:   # (marked first: a number closed twice may be another file's by then)
                fd, self._lock_fd = self._lock_fd, -1
                os.close(fd)
            else:   # (released first: lock.release of this lock released already does nothing, even once
                lock.release(self._lock_fd)   # its number is another lock's, so a close run again loses nothing)
                self._lock_fd = -1

    # ------------------------------------------------------------ owner-side API (never blocks on I/O)
    def submit_spill(self, token: uuid.UUID, key: bytes, src: memoryview) -> bool:
        """Queue a write of ``src`` (a leased host slot) under ``key``; False when the queue is full."""
        return self.writer.submit_spills([token], [key], [src])

    def submit_spills(self, tokens: list[uuid.UUID], keys: list[bytes], slots: list[int],
                      view: Callable[[int], memoryview]) -> bool:
        """Queue the writes of one owner job, each under its own token, from the leased host slots
        ``slots`` (``view(slot)``: a slot's bytes); all or none: False when the queue has no room for
        them all.  Answered by one report under ``tokens[0]`` whose ``failed`` names the parts that
        failed (:class:`~tiered_kv.disk.records.SpillGroup`)."""
        return self.writer.submit_spills(tokens, keys, [view(s) for s in slots])

    @property
    def spills_accepted(self) -> int:
        """How many :meth:`submit_spills` calls queued their spills so far: counted in the step that queues them,
        so that an owner whose call an interrupt broke off tells whether it did (``TierCore.start_spills``)."""
        return self.writer.spill_jobs

    def cancel(self, token: uuid.UUID, key: bytes) -> None:
        """Cancel the spill ``token``: never published; removed if it already was (token must match)."""
        self.tombs.cancel(token)
        self.writer.push(Tomb(token, key), front=True)

    def submit_delete(self, token: uuid.UUID, key: bytes) -> None:
        """Remove ``key``'s committed entry if it was written by ``token`` (eviction, invalidation)."""
        self.writer.push(Delete(token, key), front=True)

    def submit_touch(self, key: bytes) -> None:
        self.writer.push(Touch(key))

    def submit_flush(self, token: uuid.UUID) -> None:
        self.writer.push(Flush(token, self.writer.failures))

    def queue_promote(self, token: uuid.UUID, key: bytes, expect: uuid.UUID, dst: memoryview, where: int = 0) -> None:
        """Hold a read in the caller's thread until :meth:`start_reads` (a list append: no lock, no wake-up).
        ``where``: the owner's copy of the entry's record (``format.where_of``), 0 if it has none."""
        self.readers.hold(Promote(token, key, expect, dst, where))

    def holds_read(self, token: uuid.UUID) -> bool:
        """A read :meth:`queue_promote` queued under ``token`` is held, not yet handed on (an owner whose promote
        an interrupt broke off asks, before it queues it again)."""
        return any(op.token is token for op in self.readers._held_reads)

    def start_reads(self, lone_here: bool = False, cached_here: bool = False, until: Optional[float] = None) -> None:
        """Hand the reads held by :meth:`queue_promote` to the readers (see :meth:`Readers.start`).
        ``cached_here``: the owner blocks anyway: what the page cache holds of them is read on its
        thread first (:class:`~tiered_kv.disk.cached.CachedReads`; ``until``: its call's deadline), a chunk
        per pass: while every read so far was served, those after the chunk stay held for the next pass."""
        if cached_here and self.cached.enabled and self.readers.serve_cached(self.cached, until):
            return
        self.readers.start(lone_here)

    @property
    def reads_held(self) -> bool:
        """Reads :meth:`queue_promote` queued are held, not handed on yet: a blocked owner's page-cache reads
        stopped after a chunk, the rest left to its next pass (:meth:`start_reads`)."""
        return bool(self.readers._held_reads)

    def kick(self) -> None:
        """The end of an owner's pass: nothing to do here (ops went to the threads as they came);
        :class:`~tiered_kv.disk.proc.ProcessDiskStore` sends the pass's ops to its process."""

    backlogged = False
    """Ops wait to be handed on (the process mode's pipe; here every op goes to its thread at once)."""

    @property
    def queue_depth(self) -> int:
        return self.writer.spills_queued

    def spill_room(self) -> int:
        """How many spills :meth:`submit_spills` would take now.  Asked by the owner before it makes room
        on disk for them: only the owner adds spills, so the room seen here can only grow until its
        ``submit_spills`` (unless the writer dies meanwhile)."""
        return self.writer.room()

    def writer_alive(self) -> bool:
        return self.writer.alive()

    @property
    def healthy(self) -> bool:
        return self.writer.healthy

    @property
    def writer_error(self) -> Optional[BaseException]:
        return self.writer.writer_error

    @property
    def tombstones(self) -> int:
        """Durable tombs in the ``tombs`` sub-database after the last commit."""
        return self.writer.tombstones

    @property
    def map_size(self) -> int:
        return self.db.map_size if self.db is not None else 0

    @property
    def fault_hook(self) -> Optional[Callable[[str], None]]:
        """Tests: called by the writer at a named point ("commit"); it may raise or block."""
        return self.writer.fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: Optional[Callable[[str], None]]) -> None:
        self.writer.fault_hook = hook

    def file_bytes(self) -> int:
        """Size of LMDB's data.mdb (the index)."""
        return self.db.file_bytes() if self.db is not None else 0

    def slot_file_bytes(self) -> int:
        return self.slots.file_bytes() if self.slots is not None else 0

    def disk_bytes(self) -> int:
        """What the tier takes on disk: the slot file and the index."""
        return self.file_bytes() + self.slot_file_bytes()

    @property
    def slot_bytes(self) -> int:
        assert self.slots is not None
        return self.slots.slot_bytes

    @property
    def slots_in_use(self) -> int:
        assert self.slots is not None
        return self.slots.in_use
