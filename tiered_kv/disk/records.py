"""What crosses between the owner and the disk tier's threads: options, queued ops, answers.

Owns the plain records only (no I/O, no locks).  Invariants: an op is created on the owner's
thread and answered exactly once, by a :class:`~tiered_kv.movers.Report` (spills, promotes) or a
:class:`FlushDone`; a spill report whose error is :data:`SPILL_PREVENTED` was stopped by a tomb,
not by a fault.
"""

from __future__ import annotations

import ctypes
import errno
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import lmdb

from ..jobs import JobKind
from ..reports import Report

__all__ = ["DiskOptions", "FlushDone", "StoredEntry", "SpillGroup", "SPILL_PREVENTED", "NOT_READ", "writable_view", "error_kind"]

SPILL_PREVENTED = "cancelled before publish"   # a spill report's error: stopped by a tomb, not a fault
CORRUPT, READ_FAILED = "miss: corrupt", "miss: read failed"   # promote report errors the reader acts on
# a promote answered without reaching the disk (its I/O process died, or its read transaction could not
# begin): the entry stays
NOT_READ = "miss: not read"


@dataclass(frozen=True)
class DiskOptions:
    path: Path
    namespace: str
    block_bytes: int
    capacity_bytes: int
    durability: str = "batch"
    map_size_bytes: int = 0
    queue_blocks: int = 256
    batch_blocks: int = 64
    batch_bytes: int = 64 << 20
    batch_seconds: float = 0.005
    num_readers: int = 2
    slots: int = 0             # slots in the data file (0: capacity_bytes // block_bytes)
    hash_offload_bytes: int = 1 << 20  # a batch with this many payload bytes is checksummed on a helper thread
    read_batch_bytes: int = 64 << 20   # a reader takes queued reads up to this many bytes (256 reads), in file order
    read_run_bytes: int = 4 << 20      # neighbouring slots read by one preadv, at most
    read_first_run_slots: int = 1      # a batch's first run, in slots (0: as long as any run); see readers.py

    def target_slots(self) -> int:
        """Slots the data file may grow to (at least one)."""
        return max(1, self.slots or self.capacity_bytes // self.block_bytes)


@dataclass(frozen=True)
class FlushDone:
    token: uuid.UUID
    ok: bool
    error: Optional[str] = None


@dataclass(frozen=True)
class StoredEntry:
    """An entry recovery found on disk: its key, its writer's token, its recency (write or touch), and
    where its payload lies with what its record says (``format.where_of``; 0 for an inline entry)."""
    key: bytes
    token: uuid.UUID
    seq: int
    where: int = 0


def writable_view(t: Any) -> memoryview:
    """A writable byte memoryview over a contiguous CPU tensor's storage (no numpy needed)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


# ---- ops queued to the writer (spill, tomb, delete, touch, flush) and the readers (promote)
@dataclass
class Spill:
    token: uuid.UUID
    key: bytes
    src: memoryview
    nbytes: int
    slot: int = -1         # the data-file slot holding the payload (writer thread)
    seq: int = 0           # the entry's sequence number (writer thread)
    entry: bytes = b""     # the index record to publish
    group: Optional["SpillGroup"] = None   # the owner's job of several spills this one is part ``part`` of
    part: int = 0


class SpillGroup:
    """The spills of one owner job, each under its own token, answered as one :class:`Report` under
    the first part's token once every part is answered (``Report.failed`` names the parts that failed).

    One report per group instead of one per block: the owner applies, counts and frees a step's
    write-through spills in one pass.  Writer thread only (each part is answered there once)."""

    __slots__ = ("token", "left", "nbytes", "seconds", "failed", "where")

    def __init__(self, token: uuid.UUID, parts: int) -> None:
        self.token = token
        self.left = parts
        self.nbytes = 0
        self.seconds = 0.0
        self.failed: Optional[dict[int, str]] = None
        self.where = [0] * parts

    def answer(self, part: int, r: Report) -> Optional[Report]:
        """Record part ``part``'s report; the group's report once it was the last one, else None."""
        self.left -= 1
        if r.ok:
            self.nbytes += r.nbytes
            self.seconds += r.seconds
            if r.where:
                self.where[part] = r.where[0]
        else:
            if self.failed is None:
                self.failed = {}
            self.failed[part] = r.error or "failed"
        if self.left:
            return None
        failed = self.failed
        first = None if failed is None else next(iter(failed.values()))
        return Report(self.token, JobKind.SPILL, failed is None, first, self.nbytes, self.seconds, failed, self.where)


@dataclass
class Tomb:
    token: uuid.UUID
    key: bytes


@dataclass
class Delete:
    token: uuid.UUID
    key: bytes
    found_corrupt: bool = False   # a reader's removal of a corrupt read: dropped even with no header, its slot found by a scan


@dataclass
class Touch:
    key: bytes


@dataclass
class Flush:
    token: uuid.UUID
    failures_before: int = 0


@dataclass
class Promote:
    token: uuid.UUID
    key: bytes
    expect: uuid.UUID
    dst: memoryview
    where: int = 0   # the owner's copy of the record (``format.where_of``): it may read a cached block itself


def error_kind(exc: BaseException) -> str:
    """The metric label of an LMDB or I/O error."""
    if isinstance(exc, lmdb.MapFullError):
        return "map_full"
    err = getattr(exc, "errno", None)
    text = str(exc)
    if err in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or "No space left" in text:
        return "disk_full"   # no room: the disk, the user's quota, or the largest file allowed
    if err in (errno.EROFS, errno.EACCES, errno.EPERM) or "Read-only" in text or "Permission denied" in text:
        return "read_only"
    if err == errno.EIO or "Input/output" in text:
        return "io_error"
    return "lmdb_error"
