"""The host slab's memory, made ready at start instead of by the engine's first stores.

A CPU slab from ``torch.empty`` (or a fresh ``mmap``) is only address space: each 4 KiB page is
faulted in by the first copy that touches it, and on a VM that runs a first pass of stores at a
tenth of ``copy_`` speed.  :func:`prepare_host_memory` asks for transparent huge pages where the
kernel gives them on request (``MADV_HUGEPAGE``: 512 times fewer faults, here and in later passes)
and then populates the range in one call (``MADV_POPULATE_WRITE``, Linux 5.14+), or by writing one
byte per page where that call is missing.  Pinned (CUDA host) memory is resident already and is left
alone.  Used by :class:`~tiered_kv.TierManager` for its slab and by the vLLM adapter's shared slab,
under the config's ``prefault_host_memory``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import logging
import mmap
import os
import time
from typing import Any, Optional

import torch

from .errors import ConfigError
from .pages import HUGE, MADV_HUGEPAGE, MADV_POPULATE_WRITE, PAGE, libc, madvise

__all__ = ["HostMemory", "prepare_host_memory", "make_shared_rows", "register_pinned", "unregister_pinned"]

log = logging.getLogger(__name__)

_PAGE, _HUGE = PAGE, HUGE


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """What :func:`prepare_host_memory` did to a slab of ``nbytes``."""
    nbytes: int
    huge_pages: bool      # MADV_HUGEPAGE was accepted for the slab's 2 MiB-aligned interior
    populated: str        # "madvise", "touch" (one write per page), or "no" (not asked, pinned, empty)
    seconds: float


_libc, _madvise = libc, madvise   # module globals: the tests replace them


def prepare_host_memory(rows: torch.Tensor, populate: bool = True, pinned: bool = False) -> HostMemory:
    """Make the CPU tensor ``rows`` (contiguous, any contents) ready for copies at full speed.

    Its contents are kept (the fallback writes one byte per page back as it was read: a slab another
    process already filled, as a vLLM worker attaching to the shared one, loses nothing).  Never raises for an advice the kernel refuses: the slab then works as before, only slower
    on its first pass."""
    t0 = time.perf_counter()
    nbytes = rows.numel() * rows.element_size()
    if pinned or nbytes == 0 or rows.device.type != "cpu":
        return HostMemory(nbytes, False, "no", 0.0)
    if not rows.is_contiguous():
        raise ValueError("prepare_host_memory needs a contiguous tensor")
    lib = _libc()
    addr = rows.data_ptr()
    hstart = -(-addr // _HUGE) * _HUGE
    hend = (addr + nbytes) // _HUGE * _HUGE
    huge = _madvise(lib, hstart, hend - hstart, MADV_HUGEPAGE)
    how = "no"
    if populate:
        pstart = addr // _PAGE * _PAGE
        if _madvise(lib, pstart, addr + nbytes - pstart, MADV_POPULATE_WRITE):
            how = "madvise"
        elif lib is not None and ctypes.get_errno() != errno.EINVAL:
            # the kernel knows the advice and could not do it (ENOMEM: the memory is not there): touching
            # every page would get the process OOM-killed or, on a shared slab, SIGBUS; the pages fault
            # in as the first stores write them instead
            log.warning("host slab of %d bytes not made resident at start: madvise(MADV_POPULATE_WRITE) failed "
                        "with %s", nbytes, errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno()))
        else:   # a kernel before 5.14 (EINVAL: no such advice), or no libc: one write per page
            flat = rows.reshape(-1).view(torch.uint8)
            for first in (flat[(-addr) % _PAGE::_PAGE], flat[:1]):   # the first byte of every page the tensor
                first.copy_(first.clone())                           # starts a page in, and of the one it begins in
            how = "touch"
    dt = time.perf_counter() - t0
    log.debug("host memory of %d bytes: huge pages %s, populated %s in %.3f s", nbytes, huge, how, dt)
    return HostMemory(nbytes, huge, how, dt)


def register_pinned(rows: torch.Tensor, cudart: Optional[Any] = None) -> None:
    """Pin a CPU tensor's existing memory (``cudaHostRegister``): a shared slab cannot come from
    ``pin_memory=True``, which allocates memory of its own.  Undone by :func:`unregister_pinned`.
    A failure raises :class:`~tiered_kv.errors.ConfigError` with CUDA's error."""
    rt = cudart if cudart is not None else torch.cuda.cudart()
    n = rows.numel() * rows.element_size()
    rc = rt.cudaHostRegister(rows.data_ptr(), n, 0)
    if int(rc) != 0:
        raise ConfigError(f"pin_host_memory: cudaHostRegister of the host slab ({n} bytes) failed with CUDA error {rc!r}")


def unregister_pinned(rows: torch.Tensor, cudart: Optional[Any] = None) -> None:
    """Undo :func:`register_pinned` (a failure is logged: the memory goes away anyway)."""
    rt = cudart if cudart is not None else torch.cuda.cudart()
    rc = rt.cudaHostUnregister(rows.data_ptr())
    if int(rc) != 0:
        log.warning("cudaHostUnregister of the host slab failed with CUDA error %r", rc)


def make_shared_rows(num_slots: int, row_bytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous shared memory file (memfd) of ``num_slots * row_bytes`` bytes, mapped here;
    returns the mapping and the file's descriptor (the caller closes both)."""
    n = num_slots * row_bytes
    fd = os.memfd_create("tiered_kv-host-slab", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, n)
        mm = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return mm, fd
