"""Reads of blocks the page cache holds, on the owner's thread while it blocks anyway.

A blocked ``TierManager.wait()`` would otherwise hand a promote to the disk reader (a pipe write, a
wake-up of the disk I/O process, a frame back, a wake-up of this process's receiver thread and then
of the owner: most of a lone 256 KiB read's time on a small VM).  When the owner knows where the block
lies and what its record says (``Entry.where``: the spill's report, or recovery, gave it), it reads
the slot itself with ``preadv2(..., RWF_NOWAIT)``: the kernel copies the bytes when the page cache
holds all of them and refuses (``EAGAIN``) instead of starting I/O otherwise, so the owner's thread
never waits on a disk.

Invariants:

* a read is served here only when the whole block came from the page cache and its stored checksum
  verifies over the fields the owner knows (namespace, key, the writer token it expects, length) and
  its copy of the record's (sequence number, checksum) and the bytes read (``slot_payload_verifies``,
  the check :func:`verify_entry` makes of the same record): a slot reused by another write since
  (the record the owner holds is stale) or damaged bytes fail it;
* anything else (not cached, partly cached, a short read, a failed check, an error) is not an
  answer: the read goes to the disk I/O side as it would have, which re-reads it and alone decides
  about corruption and removal (the bytes written into the host slot meanwhile are overwritten by
  that read, and the slot is not published before its report);
* a block is asked about first (``mincore`` over a mapping of the slot file that is never touched,
  :class:`~tiered_kv.pages.FileResidency`): a refused ``RWF_NOWAIT`` read starts the readahead of the
  block on this file description, beside the disk reader's own read of it; where residency cannot
  be asked, ``RWF_NOWAIT`` alone decides;
* after the first block the page cache did not hold, the rest of the batch goes to the disk I/O side
  (a cold batch costs one question, not one per block);
* no read starts past the blocked call's deadline;
* a file system or kernel that does not take ``RWF_NOWAIT`` (``EOPNOTSUPP``, ``ENOSYS``) turns this
  off for the store's life, logged once;
* a pass reads at most :data:`CHUNK_BYTES` of blocks (:meth:`CachedReads.read_chunk`); while every read so far
  was served here, the reads after them stay held for the owner's next pass, which it makes at once:
  between two passes it applies the chunk's reports, so the copies of the blocks read so far run on the
  mover's threads while it reads the next chunk (a batch's reads and copies overlap instead of following
  one another).  A read not served hands the chunk's others and all after it to the disk I/O side.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path
from typing import Optional

from ..jobs import JobKind
from ..pages import FileResidency
from ..reports import Report
from .format import SLOTS_NAME, slot_bytes_for, slot_payload_verifies, where_slot
from .records import Promote

__all__ = ["CachedReads"]

log = logging.getLogger(__name__)

_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
_PREADV = getattr(os, "preadv", None)
_PROMOTE = JobKind.PROMOTE

CHUNK_BYTES = 2 << 20
"""A blocked owner reads at most this many bytes of blocks from the page cache per pass (at least one block).
On the reference VM a warm batch of 2 MiB blocks loaded 0.58x as fast as ``pread`` + ``copy_`` by hand with
every read made first, 0.87x read a block per pass (medians of 3 interleaved runs of the bench's promote
section, quick mode: ``docs/benchmarks.md``); at 256 KiB it made no difference beyond the run-to-run spread."""


class CachedReads:
    """The owner's page-cache reads of one disk tier's slot file (see the module docstring)."""

    def __init__(self, path: Path, namespace: str, block_bytes: int) -> None:
        self._file = Path(path).absolute() / SLOTS_NAME   # opened later: not relative to a later working dir
        self._ns = namespace.encode()
        self._slot_bytes = slot_bytes_for(block_bytes)
        self._fd = -1
        self._resident: Optional[FileResidency] = None
        self.enabled = bool(_NOWAIT) and _PREADV is not None
        self.served = 0       # reads answered here (counted by the store that queues their reports)
        self.passed = 0       # reads with a known record handed on (not cached, or a check failed)
        self.chunk_ops = max(1, CHUNK_BYTES // max(1, block_bytes))   # reads per pass (read_chunk)

    def read_chunk(self, ops: list[Promote], until: Optional[float] = None
                   ) -> tuple[list[Report], list[Promote], list[Promote]]:
        """:meth:`read` of this pass's chunk of ``ops`` (the first :attr:`chunk_ops`): (their reports, the ops for
        the disk I/O side, the ops held for the owner's next pass).  Once one of the chunk's reads is not served
        here (not cached, no record, a failed check, past the deadline), every op after it goes to the disk I/O
        side and none is held; those are counted handed on where the chunk's were looked at (not where nothing
        was: the reads off, the slot file not open, no record in the chunk), as :meth:`read` counts the rest of
        a batch after its first block not cached."""
        k = self.chunk_ops
        if len(ops) <= k:
            served, rest = self.read(ops, until)
            return served, rest, []
        later = ops[k:]
        before = self.passed
        served, rest = self.read(ops[:k], until)
        if not rest:
            return served, rest, later
        if served or self.passed != before:
            self.passed += sum(1 for op in later if op.where)
        return served, rest + later, []

    def read(self, ops: list[Promote], until: Optional[float] = None) -> tuple[list[Report], list[Promote]]:
        """Serve what the page cache holds of ``ops``, in order: (their reports, the ops left for the disk
        I/O side, in their order).  ``until``: the blocked call's deadline (``time.monotonic``); no read
        starts past it (a ``wait(timeout=...)`` returns on time), the rest go to the disk I/O side."""
        if not self.enabled or not any(op.where for op in ops):
            return [], ops
        fd = self._open()
        if fd < 0:
            return [], ops
        served: list[Report] = []
        rest: list[Promote] = []
        ns, sb = self._ns, self._slot_bytes
        resident = self._resident
        pc, mono = time.perf_counter, time.monotonic
        cold = False
        for op in ops:
            w = op.where
            if not w or cold or (until is not None and mono() >= until):
                rest.append(op)
                continue
            t0 = pc()
            dst = op.dst
            n = len(dst)
            off = where_slot(w) * sb
            if resident is not None and resident.cached(off, n) is False:   # asked first: no readahead started
                cold = True
                rest.append(op)
                continue
            try:
                got = _PREADV(fd, [dst], off, _NOWAIT)   # type: ignore[misc]
            except BlockingIOError:   # not (all) in the page cache: the disk I/O side reads it, and the rest
                got = -1
            except NotImplementedError as exc:   # this Python has no preadv2 with flags
                self._off(exc)
                got = -1
            except OSError as exc:
                if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    self._off(exc)
                else:
                    log.debug("disk tier %s: a page-cache read failed (%r): read by the disk I/O side",
                              self._file.parent, exc)
                got = -1
            if got != n:
                cold = True
                rest.append(op)
                continue
            if not slot_payload_verifies(ns, op.key, op.expect, w, dst):
                rest.append(op)   # a stale record (the slot reused) or damage: the disk I/O side decides
                continue
            served.append(Report(op.token, _PROMOTE, True, None, n, pc() - t0))
        self.passed += sum(1 for op in rest if op.where)
        return served, rest   # (``served`` is counted by the caller, in the step that keeps their reports)

    def _off(self, exc: BaseException) -> None:
        self.enabled = False
        log.info("disk tier %s: this file system or kernel does not read with RWF_NOWAIT (%r): every read goes "
                 "to the disk I/O side", self._file.parent, exc)

    def _open(self) -> int:
        if self._fd < 0:
            try:
                self._fd = os.open(self._file, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:   # not made yet, or gone: nothing is served here this time
                log.debug("disk tier %s: slot file not open for page-cache reads: %r", self._file.parent, exc)
                return -1
            self._resident = FileResidency(self._fd)
        return self._fd

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        resident, self._resident = self._resident, None
        if resident is not None:
            resident.close()
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:   # a store dropped without close() (a failed open): no fd left behind
        try:
            self.close()
        except Exception:   # noqa: BLE001 - interpreter shutdown
            pass

