"""The slot file (``slots.tkv``) and its allocator: payloads live in fixed-size slots of one file.

Owns the file descriptor, the free list (a heap: lowest first, so a fresh file fills front to back),
growth by ``fallocate`` in chunks up to the capacity, and the writes (``pwritev`` straight from the
host slots, writeback started by ``sync_file_range`` as they go, ``fdatasync`` per batch).
Invariants:

* a slot is referenced by at most one committed entry; it is handed to a new write only after the
  transaction that dropped its old entry is durable (``durability="batch"``: one commit later, like
  LMDB's own page reuse), so after a crash no committed entry points at bytes of another write;
* a slot whose write was cancelled or failed before publication is free at once (:meth:`give_back`:
  nothing committed ever referenced it).

Allocation and growth run on the writer thread; ``lock`` guards the free list against the owner's
:attr:`SlotFile.in_use` and the writer's frees.
"""

from __future__ import annotations

import ctypes
import errno
import heapq
import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import DiskTierError
from .format import SLOTS_NAME, CorruptEntry, parse_header, slot_bytes_for

__all__ = ["SlotFile", "SlotsExhausted"]

log = logging.getLogger(__name__)

WRITEBACK_CHUNK = 2 << 20   # bytes written between two sync_file_range(WRITE) calls: one per slot costs more
GROW_CHUNK_BYTES = 64 << 20  # the file grows by at least this much: few allocations, and it stays as large as used
_NO_WB = 1 << 62            # "nothing written since the last writeback" (the low end of an empty range)


class SlotsExhausted(Exception):
    """No free slot in the data file (the owner's accounting should make this impossible)."""


class SlotFile:
    def __init__(self, directory: Path, block_bytes: int, target_slots: int, durability: str,
                 batch_blocks: int) -> None:
        self.slot_bytes = slot_bytes_for(block_bytes)
        self._durable = durability != "none"
        self._batch_durability = durability == "batch"
        self._batch_blocks = batch_blocks
        try:
            self.fd = os.open(directory / SLOTS_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise DiskTierError(f"disk_path {str(directory)!r}: cannot open {SLOTS_NAME}: {exc}") from exc
        self.lock = threading.Lock()
        self.free: list[int] = []            # heap of free slot numbers
        # a slot cut short (a truncated file) still counts: an entry in it may have survived recovery
        self.length = -(-os.fstat(self.fd).st_size // self.slot_bytes)   # slots the file holds
        # a file longer than the configured capacity (it shrank) keeps its slots until compacted
        self.max = max(target_slots, self.length)
        self.freed_unsynced: list[tuple[int, int]] = []  # (txn id, slot) dropped by a commit not yet durable
        self._start_writeback = _libc_sync_file_range() or (lambda fd, off, n: None)
        self._wb_lo, self._wb_hi, self._wb_bytes = _NO_WB, 0, 0   # written, writeback not started yet

    def recovered(self, used: Any) -> int:
        """Recovery found the slots in ``used`` referenced: every other one is free.  Returns how many
        slots are free, counting those the file may still grow by."""
        self.free = [i for i in range(self.length) if i not in used]
        heapq.heapify(self.free)
        return len(self.free) + self.max - self.length

    @property
    def in_use(self) -> int:
        with self.lock:
            return self.length - len(self.free)

    def file_bytes(self) -> int:
        try:
            return os.fstat(self.fd).st_size if self.fd >= 0 else 0
        except OSError:
            return 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # ------------------------------------------------------------ writer thread
    def alloc(self) -> int:
        """The lowest free slot, growing the file by a chunk when none is free."""
        with self.lock:
            if self.free:
                return heapq.heappop(self.free)
        self._grow()
        with self.lock:
            return heapq.heappop(self.free)

    def _grow(self) -> None:
        if self.length >= self.max:
            raise SlotsExhausted(f"all {self.max} slots of {SLOTS_NAME} are in use")
        sb = self.slot_bytes
        chunk = min(self.max - self.length, max(self._batch_blocks, -(-GROW_CHUNK_BYTES // sb)))
        start = self.length
        try:
            os.posix_fallocate(self.fd, start * sb, chunk * sb)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                # a filesystem without fallocate: a sparse file (a full disk then shows up as a write error)
                os.ftruncate(self.fd, max(os.fstat(self.fd).st_size, (start + chunk) * sb))
            elif exc.errno != errno.ENOSPC or chunk == 1:
                raise
            else:
                # a nearly full disk: take the one slot needed now (ENOSPC again fails the batch)
                chunk = 1
                os.posix_fallocate(self.fd, start * sb, sb)
        with self.lock:
            self.length = start + chunk
            self._free_locked(list(range(start, start + chunk)))
        log.debug("disk tier: slot file grown to %d slots", self.length)

    def pwrite(self, slot: int, src: memoryview) -> None:
        off = slot * self.slot_bytes
        view = src
        while len(view):
            n = os.pwritev(self.fd, [view], off)
            view = view[n:]
            off += n
        if self._durable:
            # start the writeback of what this batch wrote, every few MiB, so that the batch's
            # fdatasync finds most of it done
            start = slot * self.slot_bytes
            self._wb_lo = min(self._wb_lo, start)
            self._wb_hi = max(self._wb_hi, start + len(src))
            self._wb_bytes += len(src)
            if self._wb_bytes >= WRITEBACK_CHUNK:
                self._start_writeback(self.fd, self._wb_lo, self._wb_hi - self._wb_lo)
                self._wb_lo, self._wb_hi, self._wb_bytes = _NO_WB, 0, 0

    def sync(self) -> None:
        """The bytes written so far are durable (before any index record points at them)."""
        os.fdatasync(self.fd)
        self._wb_lo, self._wb_hi, self._wb_bytes = _NO_WB, 0, 0

    def give_back(self, slots: list[int]) -> None:
        """Slots no committed entry references: free at once."""
        if slots:
            with self.lock:
                self._free_locked(slots)

    def dropped(self, slots: list[int], txn_id: int) -> None:
        """A commit dropped the entries of ``slots``; ``txn_id`` is the last committed transaction
        (that one or a later one).  Free the slots once it is durable.

        With ``durability="batch"`` a commit is durable once a later one is
        (LMDB syncs the meta page lazily: commit ``L``'s fdatasync covers meta
        page ``L-1``), so slots wait one real commit; the other modes free them
        at once ("sync": the commit is durable; "none": only a process crash is
        covered, and the page cache outlives it).
        """
        with self.lock:
            if not self._batch_durability:
                self._free_locked(slots)
                return
            self._free_durable_locked(txn_id - 1)   # a commit after theirs: those are durable now
            self.freed_unsynced.extend((txn_id, i) for i in slots)

    def synced(self, txn_id: int) -> None:
        """Every commit up to ``txn_id`` is durable (an explicit sync)."""
        with self.lock:
            self._free_durable_locked(txn_id)

    def reclaim(self, referenced: Any) -> int:
        """Free every slot that no committed entry references (``referenced``: the slots of the index's
        readable records), that is not free and that no commit has yet to free: the slot of a dropped
        record whose header could not be parsed.  Writer thread, right after a commit (no slot is then
        placed and uncommitted).  Returns how many slots it freed."""
        with self.lock:
            pending = {i for _, i in self.freed_unsynced}
            free = set(self.free)
            lost = [i for i in range(self.length) if i not in referenced and i not in pending and i not in free]
            self._free_locked(lost)
        return len(lost)

    @staticmethod
    def note_dropped(value: Any, frees: list[int]) -> None:
        """An entry is being deleted or replaced: remember its slot (if it had a readable one).  Also how the
        writer collects the slots the index's readable records name (``Writer._reclaim``)."""
        try:
            h = parse_header(value)
        except CorruptEntry:
            return
        if h.in_slot:
            frees.append(h.slot)

    def _free_durable_locked(self, txn_id: int) -> None:
        """Free the dropped slots whose commit is ``txn_id`` or older (``lock`` held)."""
        self._free_locked([i for t, i in self.freed_unsynced if t <= txn_id])
        self.freed_unsynced = [(t, i) for t, i in self.freed_unsynced if t > txn_id]

    def _free_locked(self, slots: list[int]) -> None:
        for i in slots:
            heapq.heappush(self.free, i)


def _libc_sync_file_range() -> Optional[Callable[[int, int, int], None]]:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    write = 2  # SYNC_FILE_RANGE_WRITE: start writeback of the dirty pages, do not wait

    def start(fd: int, offset: int, nbytes: int) -> None:
        fn(fd, offset, nbytes, write)   # advisory: an error here shows up in the fdatasync that follows
    return start
