"""Page advice for a mapping (``madvise``), without torch: the host slab's owner
(:mod:`.hostmem`) and the disk I/O process (:mod:`.disk.child`, which imports no torch) use it.

A mapping of the shared host slab is only address space in each process that maps it: the owner's
populated mapping does not give another process's mapping its page table entries.  The disk I/O
process's first read into a slot it never touched takes one page fault per 4 KiB page: every promote
into a slot the child had not mapped yet paid it, so a restarted server's first reloads ran at a
fraction of their later speed (``tiered-kv bench --sections promote``, "promote right after a
reopen").  :func:`populate_read` fills the page table of a mapping
of pages that exist already (``MADV_POPULATE_READ``, Linux 5.14+), a chunk at a time: a shared
memory page faulted in by a read is mapped writable (shared memory keeps no dirty accounting), and
a file-backed page is not dirtied by it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import sys
import time
from typing import Callable, Optional

__all__ = ["PAGE", "HUGE", "MADV_HUGEPAGE", "MADV_POPULATE_READ", "MADV_POPULATE_WRITE", "libc", "madvise",
           "populate_read", "FileResidency"]

PAGE = mmap.PAGESIZE
HUGE = 2 << 20
MADV_HUGEPAGE = 14            # linux/mman.h
MADV_POPULATE_READ = 22       # linux/mman.h, Linux 5.14+
MADV_POPULATE_WRITE = 23      # linux/mman.h, Linux 5.14+
POPULATE_CHUNK = 64 << 20     # bytes per populate call: a stop request waits for one chunk at most


def libc() -> Optional[ctypes.CDLL]:
    """The C library with ``madvise`` typed, or None off Linux (or where it cannot be loaded)."""
    if not sys.platform.startswith("linux"):
        return None
    try:   # glibc's soname first: find_library runs ldconfig (milliseconds, on a blocked owner's first read)
        lib = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        except OSError:
            return None
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.madvise.restype = ctypes.c_int
    return lib


def madvise(lib: Optional[ctypes.CDLL], addr: int, length: int, advice: int) -> bool:
    """``madvise(addr, length, advice)``; False when refused (``ctypes.get_errno()`` says why) or no libc."""
    return lib is not None and length > 0 and lib.madvise(addr, length, advice) == 0


def populate_read(addr: int, nbytes: int, stop: Callable[[], bool] = lambda: False,
                  lib: Optional[ctypes.CDLL] = None, chunk: int = POPULATE_CHUNK) -> tuple[int, float, Optional[str]]:
    """Map every page of ``[addr, addr + nbytes)`` into this process's page table (``MADV_POPULATE_READ``),
    ``chunk`` bytes per call, until done or ``stop()``.  Returns (bytes populated, seconds, why it
    stopped early: an errno name such as ``EINVAL`` for a kernel before 5.14, ``"stopped"``, ``"no libc"``;
    None when all were).  Never raises for a refusal: the pages then fault in as they are first touched."""
    t0 = time.perf_counter()
    lib = lib if lib is not None else libc()
    if lib is None:
        return 0, 0.0, "no libc"
    start = addr // PAGE * PAGE
    end = addr + nbytes
    chunk = max(PAGE, -(-chunk // PAGE) * PAGE)   # each call starts on a page: the kernel refuses one that does not
    done = start
    while done < end:
        if stop():
            return done - start, time.perf_counter() - t0, "stopped"
        n = min(chunk, end - done)
        if not madvise(lib, done, n, MADV_POPULATE_READ):
            err = ctypes.get_errno()
            return done - start, time.perf_counter() - t0, errno.errorcode.get(err, str(err))
        done += n
    return done - start, time.perf_counter() - t0, None


class FileResidency:
    """Which pages of a file the page cache holds, asked without reading them: ``mincore`` over a
    read-only shared mapping of the file that is never touched (no page of it is ever faulted in,
    so the mapping costs address space only).  A read with ``RWF_NOWAIT`` of a block that is not
    cached starts the readahead of it as it refuses; asked first, a block that is not cached is not
    read at all (``disk/cached.py``).  The mapping follows the file's growth (mapped again, longer,
    when a range past its end is asked).  ``None`` answers "unknown" (no libc, the mapping or the
    call refused): the caller then reads with ``RWF_NOWAIT`` alone."""

    def __init__(self, fd: int, lib: Optional[ctypes.CDLL] = None) -> None:
        self._fd = fd
        self._lib = lib if lib is not None else libc()
        if self._lib is not None:
            self._lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                       ctypes.c_long]
            self._lib.mmap.restype = ctypes.c_void_p
            self._lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            self._lib.munmap.restype = ctypes.c_int
            self._lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            self._lib.mincore.restype = ctypes.c_int
        self._addr = 0
        self._len = 0
        self._vec = ctypes.create_string_buffer(0)
        self.broken = self._lib is None   # a refusal that will not change: stop asking

    def cached(self, offset: int, nbytes: int) -> Optional[bool]:
        """True when every page of ``[offset, offset + nbytes)`` is in the page cache, False when one is
        not (or the range lies past the file's end), None when it cannot be told."""
        if self.broken or nbytes <= 0:
            return None
        end = offset + nbytes
        if end > self._len and not self._map(end):
            return None if self.broken else False
        start = offset // PAGE * PAGE
        pages = -(-(end - start) // PAGE)
        if len(self._vec) < pages:
            self._vec = ctypes.create_string_buffer(pages)
        assert self._lib is not None
        if self._lib.mincore(self._addr + start, pages * PAGE, self._vec) != 0:
            return None
        return b"\x00" not in self._vec.raw[:pages]

    def _map(self, need: int) -> bool:
        """Map the file as long as it is now; False when ``need`` lies past its end (or it cannot be mapped)."""
        try:
            size = os.fstat(self._fd).st_size
        except OSError:
            return False
        if size < need:
            return False
        lib = self._lib
        assert lib is not None
        self.close()
        addr = lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, self._fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            self.broken = True
            return False
        self._addr, self._len = addr, size
        return True

    def close(self) -> None:
        if self._len and self._lib is not None:
            self._lib.munmap(self._addr, self._len)
        self._addr = self._len = 0
