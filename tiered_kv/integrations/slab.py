"""A host slab shared by the processes of one serving engine (no vLLM import).

vLLM splits an engine into an EngineCore process (the scheduler, where the
offloading *manager* answers lookups) and one process per worker (where the
KV caches and the copies live).  A load that vLLM has been promised can never
fail (vLLM 0.32's worker asserts ``success``), so a block that is only on
disk must be read back into host memory *before* lookup says HIT.  That read
has to be driven by the process that answers lookup, while the copy to the
device runs in the worker: both need the same host memory.  This module
provides it: one file in ``/dev/shm`` mapped by every process of the engine.

Layout (all offsets page aligned)::

    header  (4 KiB)  magic, version, num_slots, row_bytes, world_size, ring_size; at OWNER_OFFSET the
                     token prefix of the scheduler that owns the slab (zero until one attached)
    rings   world_size x ring_size int64   -- per worker rank: ring[seq % ring_size] = seq
                                              once that rank has finished the job numbered seq
    rows    num_slots x row_bytes          -- slot s of rank r at s * row_bytes + r * rank_bytes

The rings are the cross-process half of the token protocol: the scheduler
side hands each job a sequence number (the counter half of its token) and
never lets a slot go to another job until every rank's ring shows that the
job which last used the slot has finished, even when vLLM no longer reports
that job (after ``reset_cache``).  An entry holds ``2 * seq + failed``, so
the rings also say whether every rank's copy succeeded: that, not the
engine's report, decides whether a store is published.  A ring entry is an aligned 8-byte store
made after the copy completed, so on x86-64 a reader sees either the old or
the new value, never a torn one, and sees it only after the copied bytes.

The owner field ties the jobs to this mapping: the scheduler writes its token prefix there
(:meth:`SharedSlab.set_owner`) and a worker copies a job only where the job's token starts with it
(:meth:`SharedSlab.owns`).  A worker process that starts again after the scheduler dropped the slab's
name would create a new, empty slab of the same geometry; the slots the scheduler hands out name rows
of the old one, so the new worker fails those jobs instead of copying zeros into the engine's KV.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import stat
import struct
import time
from pathlib import Path
from typing import Any, Optional

import torch
import xxhash

from ..errors import ConfigError

__all__ = ["SharedSlab", "slab_path", "RING_SIZE"]

log = logging.getLogger(__name__)

MAGIC = b"TKVSLAB1"
VERSION = 1
RING_SIZE = 1 << 16
_HEADER = struct.Struct("<8sIQQII")  # magic, version, num_slots, row_bytes, world_size, ring_size
_PAGE = mmap.PAGESIZE
OWNER_OFFSET = 64    # in the header page, after the header
OWNER_BYTES = 10     # a token's prefix: the 80 bits above its 48-bit counter (jobs.TokenFactory)


_NAME_MAX_ID = 96   # characters of the engine id kept in the file name


def slab_path(engine_id: str, shm_dir: str = "/dev/shm") -> Path:
    """Where the slab of the engine ``engine_id`` lives.  An id of letters, digits and ``-_.`` (vLLM's own: a
    UUID) names it as it is; any other, or a longer one, is written with ``_`` for each other character, cut
    to :data:`_NAME_MAX_ID` characters, and followed by a digest of the whole id, so two engines with
    different ids never share a slab (``e:1``, ``e/1`` and ``e_1`` would all read ``e_1``)."""
    safe = "".join(c if c.isalnum() and c.isascii() or c in "-_." else "_" for c in engine_id)
    if safe != engine_id or len(safe) > _NAME_MAX_ID:
        digest = xxhash.xxh3_64_hexdigest(engine_id.encode("utf-8", "surrogatepass"))
        safe = f"{safe[:_NAME_MAX_ID]}-{digest}"
    return Path(shm_dir) / f"tiered_kv_{safe}.slab"


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class SharedSlab:
    """One mapping of the engine's shared slab (create or attach, see :meth:`open`)."""

    def __init__(self, path: Path, mm: mmap.mmap, num_slots: int, row_bytes: int, world_size: int,
                 ring_size: int, created: bool) -> None:
        self.path = path
        self.num_slots = num_slots
        self.row_bytes = row_bytes
        self.world_size = world_size
        self.rank_bytes = row_bytes // world_size
        self.ring_size = ring_size
        self.created = created
        self._mm: Optional[mmap.mmap] = mm
        rings_off = _PAGE
        rows_off = _round_up(rings_off + world_size * ring_size * 8, _PAGE)
        self._rings = [(ctypes.c_int64 * ring_size).from_buffer(mm, rings_off + r * ring_size * 8)
                       for r in range(world_size)]
        #: the rows as one uint8 tensor, shape (num_slots, row_bytes), sharing the mapping
        with torch.inference_mode(False):   # never an inference tensor: the copy threads write it (plain_alias)
            self.rows = torch.frombuffer(mm, dtype=torch.uint8, count=num_slots * row_bytes,
                                         offset=rows_off).view(num_slots, row_bytes)
        self._rows_addr = ctypes.addressof(ctypes.c_char.from_buffer(mm, rows_off))
        #: where the rows start in the file (the disk I/O process maps them from there)
        self.rows_offset = rows_off
        self.unlinked = False
        self._pinned_by: Optional[Any] = None  # the CUDA runtime that registered the rows (pin())

    # ------------------------------------------------------------ open / close
    @classmethod
    def total_bytes(cls, num_slots: int, row_bytes: int, world_size: int, ring_size: int = RING_SIZE) -> int:
        return _round_up(_PAGE + world_size * ring_size * 8, _PAGE) + num_slots * row_bytes

    @classmethod
    def open(cls, path: Path, num_slots: int, row_bytes: int, world_size: int, *,
             ring_size: int = RING_SIZE, timeout: float = 120.0) -> "SharedSlab":
        """Create the slab at ``path``, or attach to it if another process of the engine did.

        Whichever process comes first creates and sizes the file (``O_EXCL``);
        the others wait (up to ``timeout`` seconds, at start-up only) for its
        header and check that it describes the same slab.
        """
        for name, v in (("num_slots", num_slots), ("row_bytes", row_bytes), ("world_size", world_size),
                        ("ring_size", ring_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive int, got {v!r}")
        if row_bytes % world_size:
            raise ConfigError(f"row_bytes={row_bytes} is not divisible by world_size={world_size}")
        total = cls.total_bytes(num_slots, row_bytes, world_size, ring_size)
        header = _HEADER.pack(MAGIC, VERSION, num_slots, row_bytes, world_size, ring_size)
        created = False
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            created = True
        except FileExistsError:
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            except OSError as exc:   # another user's slab, a directory, a link ...
                raise ConfigError(f"cannot attach to the shared host slab {str(path)!r}: {exc}") from exc
            try:
                cls._check_ours(fd, path)
            except BaseException:
                os.close(fd)
                raise
        except OSError as exc:
            raise ConfigError(f"cannot create the shared host slab {str(path)!r}: {exc}") from exc
        mm: Optional[mmap.mmap] = None
        try:
            try:
                mm = cls._size_or_wait(fd, path, total, header, created, timeout,
                                       (num_slots, row_bytes, world_size, ring_size))
            finally:
                os.close(fd)
            slab = cls(path, mm, num_slots, row_bytes, world_size, ring_size, created)
        except BaseException as exc:
            # a file this process created and could not finish is removed: nobody else would (the engine's
            # cleanup runs only once open() returned), and each failed start would leak a slab's memory
            if created:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            if mm is not None:
                mm.close()
            if isinstance(exc, OSError):
                raise ConfigError(f"shared host slab {str(path)!r}: {exc}") from exc
            raise
        log.info("tiered_kv shared slab %s: %s, %d slots x %d bytes, %d ranks",
                 path, "created" if created else "attached", num_slots, row_bytes, world_size)
        return slab

    @staticmethod
    def _check_ours(fd: int, path: Path) -> None:
        """An existing slab file is attached to only if this engine's processes could have made it: a regular
        file of this user that no other user can read or write (the creator makes it ``0o600``).  ``/dev/shm``
        is writable by every local user, and the slab's rows are the engine's KV bytes, loaded with no
        checksum: a file another user placed under the engine's name would read or feed them."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"the shared host slab {str(path)!r} is not a regular file; refused")
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            raise ConfigError(f"the shared host slab {str(path)!r} belongs to uid {st.st_uid}, not to this process's "
                              f"{os.geteuid()}: another user's file under this engine's name; refused (remove it, or "
                              f"give the engine another engine_id)")
        if st.st_mode & 0o077:
            raise ConfigError(f"the shared host slab {str(path)!r} has mode {stat.S_IMODE(st.st_mode):04o}: other users "
                              f"may read or write it (this engine makes it 0600); refused (remove it, or give the "
                              f"engine another engine_id)")

    @staticmethod
    def _size_or_wait(fd: int, path: Path, total: int, header: bytes, created: bool, timeout: float,
                      shape: tuple[int, int, int, int]) -> mmap.mmap:
        """The creator sizes the file and writes its header last; an attacher waits for the header
        (up to ``timeout`` seconds) and checks it.  Returns the file mapped."""
        if created:
            try:
                os.posix_fallocate(fd, 0, total)  # fail now, not with SIGBUS on first touch
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise ConfigError(f"shared host slab {str(path)!r}: cannot reserve {total} bytes: {exc} "
                                      f"(is /dev/shm large enough?)") from exc
                os.ftruncate(fd, total)
            os.pwrite(fd, header, 0)  # written last: attachers wait for it
        else:
            deadline = time.monotonic() + timeout
            while os.pread(fd, _HEADER.size, 0) != header:
                got = os.pread(fd, _HEADER.size, 0)
                if len(got) == _HEADER.size and got[:8] == MAGIC:
                    raise ConfigError(f"shared host slab {str(path)!r} describes another slab "
                                      f"{_HEADER.unpack(got)[2:]} than (num_slots, row_bytes, world_size, "
                                      f"ring_size)={shape}")
                if os.fstat(fd).st_nlink == 0 or time.monotonic() > deadline:
                    raise ConfigError(f"shared host slab {str(path)!r} was not initialised by its creator "
                                      f"within {timeout} s")
                time.sleep(0.01)  # start-up only: waiting for another process to size the file
        return mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def set_owner(self, prefix: bytes) -> None:
        """Scheduler side: the jobs of the scheduler whose tokens start with ``prefix`` (its first
        ``OWNER_BYTES`` bytes) are this slab's; a scheduler started again on the slab takes it over."""
        if self._mm is None:
            raise ConfigError(f"shared host slab {str(self.path)!r} is closed")
        self._mm[OWNER_OFFSET:OWNER_OFFSET + OWNER_BYTES] = bytes(prefix[:OWNER_BYTES]).ljust(OWNER_BYTES, b"\0")

    def owns(self, token: bytes) -> bool:
        """Worker side: was the job with ``token`` made by the scheduler that owns this slab?  False for every
        job while no scheduler ever attached to this mapping."""
        mm = self._mm
        if mm is None:
            return False
        owner = mm[OWNER_OFFSET:OWNER_OFFSET + OWNER_BYTES]
        return owner != bytes(OWNER_BYTES) and token[:OWNER_BYTES] == owner

    def unlink(self) -> None:
        """Remove the file name; the memory lives until the last process unmaps it.  Idempotent."""
        if not self.unlinked:
            self.unlinked = True
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Drop this process's mapping (tensors made from :attr:`rows` must be gone); unpins first."""
        self.unpin()
        mm, self._mm = self._mm, None
        if mm is None:
            return
        self._rings = []
        self.rows = torch.empty(0, dtype=torch.uint8)
        try:
            mm.close()
        except BufferError:  # a view is still alive somewhere: the OS unmaps at exit
            log.debug("shared slab %s still has views; left mapped until exit", self.path)

    # ------------------------------------------------------------ pinning (one process's mapping)
    @property
    def pinned(self) -> bool:
        return self._pinned_by is not None

    def pin(self, cudart: Optional[Any] = None) -> None:
        """Register this process's mapping of the rows with CUDA as pinned memory (``cudaHostRegister``),
        so that copies between them and a CUDA device are asynchronous DMA.  ``cudart``: the runtime
        (default ``torch.cuda.cudart()``; tests pass a stand-in).  Undone by :meth:`unpin` and
        :meth:`close`.  Idempotent; a failure raises :class:`ConfigError` with CUDA's error."""
        if self._pinned_by is not None or self._mm is None:
            return
        rt = cudart if cudart is not None else torch.cuda.cudart()
        n = self.num_slots * self.row_bytes
        rc = rt.cudaHostRegister(self._rows_addr, n, 0)
        if int(rc) != 0:
            raise ConfigError(f"pin_host_memory: cudaHostRegister of the shared host slab {str(self.path)!r} "
                              f"({n} bytes) failed with CUDA error {rc!r}")
        self._pinned_by = rt

    def unpin(self) -> None:
        """Unregister what :meth:`pin` registered (a failure is logged: the mapping goes away anyway)."""
        rt, self._pinned_by = self._pinned_by, None
        if rt is None:
            return
        rc = rt.cudaHostUnregister(self._rows_addr)
        if int(rc) != 0:
            log.warning("cudaHostUnregister of the shared host slab %s failed with CUDA error %r", self.path, rc)

    # ------------------------------------------------------------ rings
    def mark_done(self, rank: int, seq: int, ok: bool = True) -> None:
        """Worker side: the job numbered ``seq`` has finished on ``rank`` (after its copies completed)."""
        if not 0 <= rank < self.world_size:   # -1 would mark the last rank's ring
            raise ConfigError(f"rank {rank!r} out of range [0, {self.world_size})")
        self._rings[rank][seq % self.ring_size] = 2 * seq + (0 if ok else 1)

    def done(self, seq: int) -> bool:
        """Scheduler side: has every rank finished the job numbered ``seq``?

        A larger value in the ring entry means a job ``ring_size`` numbers
        later finished there; a rank runs its jobs in submission order
        (``copier.py``), which follows their numbers but for a store vLLM
        defers to the next step (it runs after the loads of its own step,
        numbered after it), so while a step makes fewer than ``ring_size``
        jobs (65,536; vLLM makes about one per request) that counts as
        finished too.  Whether it succeeded is then unknown: :meth:`ok`.
        """
        i, want = seq % self.ring_size, 2 * seq
        for ring in self._rings:
            if ring[i] < want:
                return False
        return True

    def ok(self, seq: int) -> bool:
        """Scheduler side, once :meth:`done`: did every rank record a successful copy of job ``seq``?  An
        entry a later job overwrote (a job ``ring_size`` numbers on finished before this one was applied)
        no longer says: that counts as failed (a store not published, a miss), never as ok."""
        i, want = seq % self.ring_size, 2 * seq
        return all(ring[i] == want for ring in self._rings)

    def max_seq(self) -> int:
        """The highest job number any rank has marked (a new scheduler numbers its jobs above it)."""
        return max((max(ring) for ring in self._rings), default=0) // 2

    def row_address(self, slot: int) -> int:
        return self._rows_addr + slot * self.row_bytes
