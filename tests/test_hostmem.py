"""The host slab made resident at start (``prefault_host_memory``, tiered_kv.hostmem).

Residency is read from the kernel (``mincore`` over the slab's pages), so these tests check what the
call did to the memory, not how long it took."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import sys

import pytest
import torch
from prometheus_client import CollectorRegistry

from fakes import ROW_BYTES, make_config, make_kv
from tiered_kv import TierManager
from tiered_kv import hostmem
from tiered_kv.errors import ConfigError
from tiered_kv.hostmem import prepare_host_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux memory advice")

PAGE = mmap.PAGESIZE


def resident_fraction(t: torch.Tensor) -> float:
    """The share of ``t``'s pages the kernel has mapped in (``mincore``)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    addr = t.data_ptr()
    start = addr // PAGE * PAGE
    length = addr + t.numel() * t.element_size() - start
    pages = -(-length // PAGE)
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, length, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) / pages


FRESH = 64 << 20


def fresh(nbytes: int = FRESH) -> torch.Tensor:
    """``nbytes`` of memory no one has touched: an anonymous mapping of its own (``torch.empty`` of
    this size is usually one too, but the allocator may hand out recycled, already resident memory)."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(mm, dtype=torch.uint8)   # holds the mapping for as long as the tensor lives
    assert resident_fraction(t) == 0.0
    return t


def test_a_fresh_slab_is_resident_after_prepare():
    t = fresh()
    r = prepare_host_memory(t)
    assert r.populated in ("madvise", "touch") and r.nbytes == FRESH and r.seconds >= 0
    assert resident_fraction(t) == 1.0


def test_the_fallback_touches_every_page_of_an_unaligned_slab(monkeypatch):
    """Where MADV_POPULATE_WRITE is unknown (kernels before 5.14 answer EINVAL), one byte of each page
    is written, the partial first and last pages included."""
    real = hostmem._madvise

    def old_kernel(lib, a, n, adv):  # type: ignore[no-untyped-def]
        if adv == hostmem.MADV_POPULATE_WRITE:
            ctypes.set_errno(errno.EINVAL)
            return False
        return real(lib, a, n, adv)

    monkeypatch.setattr(hostmem, "_madvise", old_kernel)
    base = fresh()
    t = base[PAGE // 2 + 3: PAGE // 2 + 3 + 31 * PAGE]     # starts and ends inside a page
    assert prepare_host_memory(t).populated == "touch"
    assert resident_fraction(t) == 1.0


def test_the_fallback_keeps_what_the_slab_holds(monkeypatch):
    """A slab another process filled already (a vLLM worker attaching to the shared one): the touch writes
    every byte back as it was, never a zero."""
    monkeypatch.setattr(hostmem, "_madvise", lambda lib, a, n, adv: (ctypes.set_errno(errno.EINVAL), False)[1]
                        if adv == hostmem.MADV_POPULATE_WRITE else False)
    t = torch.randint(1, 256, (9 * PAGE + 5,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))[3:]
    before = t.clone()
    assert prepare_host_memory(t).populated == "touch"
    assert torch.equal(t, before)


def test_nothing_is_populated_when_not_asked_or_pinned():
    t = fresh()
    assert prepare_host_memory(t, populate=False).populated == "no"
    assert prepare_host_memory(t, pinned=True) == hostmem.HostMemory(FRESH, False, "no", 0.0)
    assert resident_fraction(t) < 0.5


def test_a_manager_prefaults_its_slab_by_default_and_not_when_told():
    kv = make_kv(8)
    for prefault, want in ((True, 1.0), (False, 0.0)):
        mgr = TierManager(make_config(FRESH // ROW_BYTES, prefault_host_memory=prefault), kv,
                          registry=CollectorRegistry())
        try:
            got = resident_fraction(mgr._host_rows)
            assert (got == 1.0) if want else got < 0.5, (prefault, got)
            assert (mgr.host_memory.populated != "no") is prefault
        finally:
            mgr.close()


@pytest.mark.parametrize("bad", [1, None, "yes"])
def test_prefault_host_memory_must_be_a_bool(bad):
    with pytest.raises(ConfigError, match="prefault_host_memory"):
        make_config(8, prefault_host_memory=bad)


class _FakeCudart:
    """Records cudaHostRegister/Unregister calls; answers ``rc``."""

    def __init__(self, rc: int = 0) -> None:
        self.rc = rc
        self.calls: list[tuple] = []

    def cudaHostRegister(self, addr: int, n: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
        self.calls.append(("register", addr, n, flags))
        return self.rc

    def cudaHostUnregister(self, addr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", addr))
        return self.rc


def test_a_shared_slab_is_pinned_in_place_and_unpinned_at_the_same_address() -> None:
    """The disk I/O process needs the slab in shared memory, so it is registered with CUDA where it
    lies instead of being allocated pinned (tiered_kv.hostmem.register_pinned)."""
    from tiered_kv.hostmem import register_pinned, unregister_pinned

    rows = torch.empty((4, 4096), dtype=torch.uint8)
    rt = _FakeCudart()
    register_pinned(rows, rt)
    unregister_pinned(rows, rt)
    assert rt.calls == [("register", rows.data_ptr(), 4 * 4096, 0), ("unregister", rows.data_ptr())]


def test_a_refused_registration_names_cudas_error(caplog: pytest.LogCaptureFixture) -> None:
    from tiered_kv.errors import ConfigError
    from tiered_kv.hostmem import register_pinned, unregister_pinned

    rows = torch.empty((2, 4096), dtype=torch.uint8)
    with pytest.raises(ConfigError, match=r"cudaHostRegister of the host slab \(8192 bytes\) failed with CUDA error 2"):
        register_pinned(rows, _FakeCudart(rc=2))
    with caplog.at_level(logging.WARNING, logger="tiered_kv"):
        unregister_pinned(rows, _FakeCudart(rc=1))
    assert any("cudaHostUnregister" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- another process's mapping
def mapped_bytes(addr: int, pid: str = "self") -> int:
    """Bytes of the mapping holding ``addr`` that ``pid``'s page table maps (its ``Rss`` in smaps): what
    ``mincore`` cannot tell for shared memory, whose pages are resident whoever maps them."""
    rss = None
    with open(f"/proc/{pid}/smaps") as f:
        inside = False
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                rss = int(line.split()[1]) * 1024
                break
    assert rss is not None, f"no mapping holds {addr:#x}"
    return rss


def _second_mapping(nbytes: int) -> tuple[mmap.mmap, mmap.mmap, int]:
    """A shared memory file of ``nbytes`` written through one mapping (its pages exist) and mapped a second
    time, as the disk I/O process maps the owner's slab: (first, second, the second's address)."""
    import os
    fd = os.memfd_create("tkv-test-slab")
    try:
        os.ftruncate(fd, nbytes)
        a = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        b = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    a.write(b"\x01" * nbytes)
    buf = ctypes.c_char.from_buffer(b)
    addr = ctypes.addressof(buf)
    del buf
    return a, b, addr


def test_populate_read_fills_a_second_mappings_page_table_without_changing_a_byte():
    from tiered_kv.pages import populate_read
    n = 8 << 20
    a, b, addr = _second_mapping(n)
    assert mapped_bytes(addr) == 0          # a's writes made the pages, not b's page table entries
    done, secs, why = populate_read(addr, n)
    if why == "EINVAL":
        pytest.skip("kernel before 5.14: no MADV_POPULATE_READ")
    assert (done, why) == (n, None) and secs >= 0
    assert mapped_bytes(addr) == n
    assert b[:] == b"\x01" * n


def test_populate_read_stops_between_chunks_when_told():
    from tiered_kv.pages import populate_read
    n, chunk = 8 << 20, 1 << 20
    a, b, addr = _second_mapping(n)
    asked = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 3

    done, _, why = populate_read(addr + 100, n - 100, stop, chunk=chunk)   # an unaligned start: its page too
    if why == "EINVAL":
        pytest.skip("kernel before 5.14: no MADV_POPULATE_READ")
    assert (done, why) == (3 * chunk, "stopped")
    assert 3 * chunk <= mapped_bytes(addr) <= 4 * chunk   # the kernel may map a few neighbours (fault-around)


def test_populate_read_reports_a_refusal_by_its_errno_and_never_raises():
    from tiered_kv.pages import populate_read

    class Refusing:
        def madvise(self, addr: int, n: int, advice: int) -> int:
            ctypes.set_errno(errno.EINVAL)
            return -1
    assert populate_read(4096, 1 << 20, lib=Refusing())[::2] == (0, "EINVAL")   # type: ignore[arg-type]
