"""The slot file (``slots.tkv``) and its allocator: payloads live in fixed-size slots of one file.

Owns the file descriptor, the free list (a heap: lowest first, so a fresh file fills front to back),
growth by ``fallocate`` in chunks up to the capacity, and the writes (``pwritev`` straight from the
host slots, writeback started by ``sync_file_range`` as they go, ``fdatasync`` per batch).
Invariants:

* a slot is referenced by at most one committed entry; it is handed to a new write only after the
  transaction that dropped its old entry is durable (``durability="batch"``: one commit later, like
  LMDB's own page reuse), so after a crash no committed entry points at bytes of another write;
* a slot whose write was cancelled or failed before publication is free at once (:meth:`give_back`:
  nothing committed ever referenced it);
* a removal frees only a slot that holds the removed key's record: the writer keeps, per slot, a print
  of the index key whose record names it (:meth:`hold`, at the write; :meth:`recovered`, at open), and
  a slot number that names a slot the key does not hold -- a damaged one: the checksum does not cover
  it -- frees nothing (:meth:`drop`, :meth:`holds`; the slot the record really used is found by the
  writer's scan, ``Writer._reclaim``); a dropped slot waiting for its commit to be durable holds no key
  (:meth:`dropped`), and only such a slot is freed when it is, never one free already or taken meanwhile
  (8 bytes per slot of the file, in the writer's process).

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
from array import array
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Optional

import xxhash

from ..errors import DiskTierError
from .format import SLOTS_NAME, CorruptEntry, EntryHeader, parse_header, slot_bytes_for
from .lock import as_named

__all__ = ["SlotFile", "SlotsExhausted"]

log = logging.getLogger(__name__)

WRITEBACK_CHUNK = 2 << 20   # bytes written between two sync_file_range(WRITE) calls: one per slot costs more
GROW_CHUNK_BYTES = 64 << 20  # the file grows by at least this much: few allocations, and it stays as large as used
_NO_WB = 1 << 62            # "nothing written since the last writeback" (the low end of an empty range)
# a slot's holder, when no record names it: on the free list; taken by a write whose record is not put yet; its
# record dropped by a commit not durable yet (freed once it is)
_FREE, _PLACED, _PENDING = 0, 1, 2


def key_print(lk: bytes) -> int:
    """The holder mark of an index key: 64 bits of its hash, never one of the marks above."""
    return xxhash.xxh3_64_intdigest(lk) | 4


class SlotsExhausted(Exception):
    """No free slot in the data file (the owner's accounting should make this impossible)."""


class SlotFile:
    def __init__(self, directory: Path, block_bytes: int, target_slots: int, durability: str,
                 batch_blocks: int, name: Optional[Path] = None) -> None:
        self.slot_bytes = slot_bytes_for(block_bytes)
        self._durable = durability != "none"
        self._batch_durability = durability == "batch"
        self._batch_blocks = batch_blocks
        try:
            self.fd = os.open(directory / SLOTS_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            name = directory if name is None else name
            raise DiskTierError(f"disk_path {str(name)!r}: cannot open {SLOTS_NAME}: "
                                f"{as_named(str(exc), directory, name)}") from exc
        self.lock = threading.Lock()
        self.free: list[int] = []            # heap of free slot numbers
        # a slot cut short (a truncated file) still counts: an entry in it may have survived recovery
        self.length = -(-os.fstat(self.fd).st_size // self.slot_bytes)   # slots the file holds
        # per slot: _FREE, _PLACED, _PENDING, or the key_print of the index key whose record names it (writer thread)
        self._holder = array("Q", [_PLACED]) * self.length   # not known until recovered()
        self.double_frees = 0                # frees refused: a slot free already, or no longer pending (a bug if > 0)
        # a file longer than the configured capacity (it shrank) keeps its slots until compacted
        self.max = max(target_slots, self.length)
        self.freed_unsynced: list[tuple[int, int]] = []  # (txn id, slot) dropped by a commit not yet durable
        self._start_writeback = _libc_sync_file_range() or (lambda fd, off, n: None)
        self._wb_lo, self._wb_hi, self._wb_bytes = _NO_WB, 0, 0   # written, writeback not started yet

    def recovered(self, owners: Mapping[int, bytes]) -> int:
        """Recovery found each slot of ``owners`` named by the record of that index key: every other slot is
        free.  Returns how many slots are free, counting those the file may still grow by."""
        holder = self._holder
        self.free = []
        for i in range(self.length):
            lk = owners.get(i)
            if lk is None:
                holder[i] = _FREE
                self.free.append(i)
            else:
                holder[i] = key_print(lk)
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
        fd, self.fd = self.fd, -1   # (marked first: a number closed twice may be another file's by then)
        if fd >= 0:
            os.close(fd)

    # ------------------------------------------------------------ writer thread
    def alloc(self) -> int:
        """The lowest free slot, growing the file by a chunk when none is free."""
        with self.lock:
            if self.free:
                i = heapq.heappop(self.free)
                self._holder[i] = _PLACED
                return i
        self._grow()
        with self.lock:
            i = heapq.heappop(self.free)
            self._holder[i] = _PLACED
            return i

    def hold(self, slot: int, lk: bytes) -> None:
        """The record of index key ``lk`` naming ``slot`` is being put (writer thread, inside the transaction:
        one that aborts gives the slot back, :meth:`give_back`)."""
        self._holder[slot] = key_print(lk)

    def holds(self, slot: int, lk: bytes) -> bool:
        """Whether ``slot`` holds the record of index key ``lk`` (a slot number read from that record is to be
        trusted)."""
        return 0 <= slot < len(self._holder) and self._holder[slot] == key_print(lk)

    def drop(self, value: Any, lk: bytes, frees: list[int], header: Optional[EntryHeader] = None) -> bool:
        """The record ``value`` (or its parsed ``header``: a buffer of a record deleted meanwhile shows other
        bytes) of index key ``lk`` is being deleted or replaced: note its slot in ``frees`` (freed once the
        commit is durable, :meth:`dropped`) when that slot holds it.  False when its slot cannot be told --
        a header that does not parse, or a slot number that names a slot ``lk`` does not hold (damage: the
        checksum does not cover it; freeing it would hand another entry's slot, or a free one, to the next
        write) --: the caller has the writer's scan find it (``Writer._reclaim``)."""
        h = header
        if h is None:
            try:
                h = parse_header(value)
            except CorruptEntry:
                return False
        if not h.in_slot:
            return True
        if not self.holds(h.slot, lk):
            log.error("disk tier: the index record of a removed entry names slot %d, which holds another "
                      "record or none (a damaged record): not freed; its own slot is found by a scan", h.slot)
            return False
        frees.append(h.slot)
        return True

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
            self._holder.extend(array("Q", [_PLACED]) * (start + chunk - len(self._holder)))
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
            holder = self._holder
            for i in slots:   # no record names them now: a removal that names one frees nothing (holds())
                if 0 <= i < len(holder) and holder[i] != _FREE:
                    holder[i] = _PENDING
            self.freed_unsynced.extend((txn_id, i) for i in slots)

    def synced(self, txn_id: int) -> None:
        """Every commit up to ``txn_id`` is durable (an explicit sync)."""
        with self.lock:
            self._free_durable_locked(txn_id)

    def reclaim(self, referenced: Any, txn_id: int) -> int:
        """Free every slot that no committed entry references (``referenced``: the slots of the index's
        readable records), that is not free and that no commit has yet to free: the slot of a dropped
        record whose slot number could not be trusted.  Writer thread, right after a commit (no slot is
        then placed and uncommitted); ``txn_id``: the last committed transaction, which dropped them: they
        are freed as its other drops are, once it is durable (:meth:`dropped`).  Returns how many."""
        with self.lock:
            holder = self._holder
            lost = [i for i in range(self.length) if holder[i] not in (_FREE, _PENDING) and i not in referenced]
        self.dropped(lost, txn_id)
        return len(lost)

    @staticmethod
    def named_slot(value: Any, out: list[int]) -> None:
        """Append the slot a readable record names to ``out`` (how the writer collects the slots the index's
        records name, ``Writer._reclaim``)."""
        try:
            h = parse_header(value)
        except CorruptEntry:
            return
        if h.in_slot:
            out.append(h.slot)

    def _free_durable_locked(self, txn_id: int) -> None:
        """Free the dropped slots whose commit is ``txn_id`` or older (``lock`` held); one that does not wait any
        more (freed or taken meanwhile: a second drop of it) is not freed again."""
        holder = self._holder
        due = [i for t, i in self.freed_unsynced if t <= txn_id]
        self.freed_unsynced = [(t, i) for t, i in self.freed_unsynced if t > txn_id]
        ready = [i for i in due if 0 <= i < len(holder) and holder[i] == _PENDING]
        if len(ready) != len(due):
            self.double_frees += len(due) - len(ready)
            log.error("disk tier: %d slot(s) dropped twice (freed or taken meanwhile): not freed again",
                      len(due) - len(ready))
        self._free_locked(ready)

    def _free_locked(self, slots: list[int]) -> None:
        holder = self._holder
        for i in slots:
            if not 0 <= i < len(holder) or holder[i] == _FREE:   # on the list already: twice would give it
                self.double_frees += 1                          # to two writes
                log.error("disk tier: slot %d freed twice (or out of range): not freed again", i)
                continue
            holder[i] = _FREE
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
