"""The CUDA path: ``TierManager`` on a CUDA KV tensor, with the real ``CudaMover`` and a pinned slab.

Skipped without CUDA (CI has none); run on a GPU machine with
``python -m pytest tests/test_cuda.py``.

Interleavings are forced on the GPU, not with host sleeps: ``busy()`` queues
a spinning kernel (``torch.cuda._sleep``, tens of milliseconds) on the
engine's stream, so whatever the engine queues after it on that stream
runs later than anything the host does meanwhile.  The two ordering tests
each run a control beside the real thing: the same copy made the naive way
(a side stream that does not wait for the engine's stream) sees the other
bytes, so the forced interleaving is real and the test can fail.
"""

from __future__ import annotations

import contextlib
import logging
import random
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry

from fakes import content, content_u8, host_matches, mgr_metric, reported
from random_engine import random_engine
from tiered_kv import TieredKVConfig, TierManager

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPE = (2, 16, 8, 64)       # one block of 2 x 16 tokens x 8 heads x 64 dims
DTYPE = torch.bfloat16
ROW_BYTES = 2 * 16 * 8 * 64 * 2  # 32 KiB
STALE = "tiered_kv_stale_callbacks_total"
BUSY_CYCLES = 100_000_000    # about 50 ms at the H100/H200 boost clock, longer at lower clocks
A, B = b"key-A", b"key-B"


def busy() -> None:
    """Queue a spinning kernel on the current (engine) stream."""
    torch.cuda._sleep(BUSY_CYCLES)


def dev_content(key: bytes) -> torch.Tensor:
    """``key``'s bytes on the device, queued on the current stream.  From pinned memory and
    non-blocking: a plain ``.to("cuda")`` waits for the stream, i.e. for a ``busy()`` queued before
    it, and the interleaving a test sets up would be gone by the time it returns."""
    return content(key, SHAPE, DTYPE).pin_memory().to("cuda", non_blocking=True)


def fill(kv: torch.Tensor, row: int, key: bytes) -> None:
    """The engine computes ``key`` into ``row`` (queued on its stream, behind whatever is there)."""
    kv[row].copy_(dev_content(key), non_blocking=True)


def row_is(kv: torch.Tensor, row: int, key: bytes) -> bool:
    return torch.equal(kv[row].cpu().reshape(-1).view(torch.uint8), content_u8(key, SHAPE, DTYPE))


def make(rows: int = 64, slots: int = 32, disk: Optional[Path] = None, **kw: Any) -> tuple[TierManager, torch.Tensor]:
    kv = torch.zeros((rows, *SHAPE), dtype=DTYPE, device="cuda")
    cfg = TieredKVConfig(namespace="cuda-test|bf16|tp0", host_capacity_bytes=slots * ROW_BYTES,
                         disk_path=str(disk) if disk is not None else None,
                         disk_capacity_bytes=(256 * ROW_BYTES) if disk is not None else 0, **kw)
    return TierManager(cfg, kv, registry=CollectorRegistry()), kv


def store_ok(mgr: TierManager, kv: torch.Tensor, key: bytes, row: int) -> None:
    fill(kv, row, key)
    job = mgr.store(key, row)
    assert job is not None
    (c,) = reported(mgr.wait([job], timeout=30), job)
    assert c.ok, c


@pytest.fixture(autouse=True)
def _quiet_gpu() -> Any:
    yield
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------- basics
def test_cuda_kv_gets_the_cuda_mover_and_a_pinned_slab() -> None:
    from tiered_kv.movers import CudaMover
    mgr, _ = make()
    with mgr:
        assert isinstance(mgr._mover, CudaMover)
        assert mgr._host_rows.is_pinned()


def test_store_then_load_round_trips_the_bytes() -> None:
    mgr, kv = make(rows=64, slots=32)
    keys = [f"rt-{i}".encode() for i in range(16)]
    with mgr:
        for i, k in enumerate(keys):
            fill(kv, i, k)
        jobs = [mgr.store(k, i) for i, k in enumerate(keys)]
        assert all(j is not None for j in jobs)
        comps = mgr.wait(timeout=30)
        assert len(comps) == 16 and all(c.ok for c in comps)
        assert all(host_matches(mgr, k, kv) for k in keys)
        assert mgr.lookup(keys) == 16
        loads = [mgr.load(k, 32 + i) for i, k in enumerate(keys)]
        assert all(j is not None for j in loads)
        comps = mgr.wait(timeout=30)
        assert len(comps) == 16 and all(c.ok for c in comps)
        for i, k in enumerate(keys):
            assert row_is(kv, 32 + i, k)
        assert mgr_metric(mgr, "tiered_kv_transfer_bytes_total", src="device", dst="host") == 16 * ROW_BYTES
        assert mgr_metric(mgr, "tiered_kv_transfer_bytes_total", src="host", dst="device") == 16 * ROW_BYTES


def test_a_steps_rows_out_of_order_are_gathered_and_scattered_behind_the_engines_writes() -> None:
    """store_many/load_many of rows out of order: one gather (index_select into the stream's staging rows)
    and one copy per run of slots, behind the engine's queued writes (a spinning kernel first), then one
    copy and one scatter (index_copy_) into other rows out of order; every byte lands where it belongs."""
    mgr, kv = make(rows=64, slots=32)
    rows = [9, 3, 17, 5, 30, 1, 12, 7]
    dst = [40, 33, 50, 36, 61, 34, 45, 38]
    keys = [f"g-{i}".encode() for i in range(len(rows))]
    with mgr:
        busy()
        for r, k in zip(rows, keys):
            fill(kv, r, k)            # queued behind busy(): not written when store_many() returns
        assert mgr.store_many(keys, rows) is not None
        comps = mgr.wait(timeout=30)
        assert comps and all(c.ok for c in comps)
        assert all(host_matches(mgr, k, kv) for k in keys)
        busy()
        assert mgr.load_many(keys, dst) is not None
        comps = mgr.wait(timeout=30)
        assert comps and all(c.ok for c in comps)
        for r, k in zip(dst, keys):
            assert row_is(kv, r, k), r


# ----------------------------------------------------------------------------- ordering on the GPU
def test_store_reads_the_row_only_after_the_engines_queued_writes() -> None:
    mgr, kv = make()
    with mgr:
        busy()
        fill(kv, 3, A)            # queued behind busy(): not written yet when store() returns
        job = mgr.store(A, 3)
        assert job is not None
        (c,) = reported(mgr.wait([job], timeout=30), job)
        assert c.ok
        assert host_matches(mgr, A, kv) is True

        # control: the same copy on a side stream that does not wait reads the row before the engine wrote it
        side = torch.cuda.Stream()
        dst = torch.empty(ROW_BYTES, dtype=torch.uint8, pin_memory=True)
        busy()
        fill(kv, 4, B)
        with torch.cuda.stream(side):
            dst.copy_(kv[4].reshape(-1).view(torch.uint8), non_blocking=True)
        side.synchronize()
        assert not torch.equal(dst, content_u8(B, SHAPE, DTYPE))


def test_load_writes_the_row_only_after_the_engines_queued_reads() -> None:
    mgr, kv = make()
    with mgr:
        store_ok(mgr, kv, A, 5)
        fill(kv, 6, B)
        torch.cuda.synchronize()
        out = torch.empty_like(kv[6])
        busy()
        out.copy_(kv[6], non_blocking=True)   # a kernel queued before the engine gave row 6 up reads it
        assert mgr.free_block(6) is True
        job = mgr.load(A, 6)
        assert job is not None
        (c,) = reported(mgr.wait([job], timeout=30), job)
        assert c.ok
        torch.cuda.synchronize()
        assert torch.equal(out, dev_content(B))   # the queued read saw the row's old bytes
        assert row_is(kv, 6, A)

        # control: a host->device copy on a side stream that does not wait overwrites the row under the read
        fill(kv, 7, B)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        src = content(A, SHAPE, DTYPE).pin_memory()
        busy()
        out.copy_(kv[7], non_blocking=True)
        with torch.cuda.stream(side):
            kv[7].copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(out, dev_content(A))


def test_cancelled_load_keeps_the_row_fenced_until_its_copy_is_done() -> None:
    mgr, kv = make()
    with mgr:
        store_ok(mgr, kv, A, 0)
        busy()                      # the load's copy is queued behind it
        job = mgr.load(A, 9)
        assert job is not None
        assert reported(mgr.poll(), job) == []     # the poll puts the copy on the device, behind busy()
        mgr.cancel(job)
        assert mgr.free_block(9) is False
        assert reported(mgr.poll(), job) == []     # its copy can still land: not reported
        assert mgr.free_block(9) is False
        torch.cuda.synchronize()
        (c,) = reported(mgr.poll(), job)
        assert not c.ok and c.error is not None and c.error.startswith("cancelled")
        assert mgr.free_block(9) is True
        assert mgr_metric(mgr, STALE, kind="load", reason="cancelled") == 1
        assert mgr.jobs_in_flight == 0


@pytest.mark.parametrize("batch", [1, 64])
def test_store_whose_row_is_freed_in_flight_is_discarded(batch: int) -> None:
    """copy_batch_max=1: the copy is on the device, behind busy(), when the row is freed; 64: it is still
    queued in the mover and is never made."""
    mgr, kv = make(copy_batch_max=batch)
    with mgr:
        busy()
        fill(kv, 8, A)
        job = mgr.store(A, 8)
        assert job is not None
        assert mgr.free_block(8) is True    # stores never fence a row
        fill(kv, 8, B)                      # the engine reuses it at once
        comps = mgr.wait([job], timeout=30)
        (c,) = reported(comps, job)
        assert not c.ok and "source_reused" in (c.error or "")
        assert mgr.lookup([A]) == 0 and mgr.host_bytes(A) is None
        mgr.wait(timeout=30)                # the cancelled job is reported at once; its copy's report comes later
        assert mgr_metric(mgr, STALE, kind="store", reason="source_reused") == 1
        assert mgr.load(A, 10) is None
        assert mgr._mover.in_flight() == 0


def test_a_load_cancelled_before_a_poll_makes_no_copy() -> None:
    mgr, kv = make()
    with mgr:
        store_ok(mgr, kv, A, 0)
        fill(kv, 9, B)
        torch.cuda.synchronize()
        job = mgr.load(A, 9)
        assert job is not None
        mgr.cancel(job)
        assert mgr.free_block(9) is False          # fenced until the mover has answered
        (c,) = reported(mgr.poll(), job)           # answered at the poll: its copy was never queued
        assert not c.ok and (c.error or "").startswith("cancelled")
        assert mgr.free_block(9) is True
        torch.cuda.synchronize()
        assert row_is(kv, 9, B)
        assert mgr._mover.in_flight() == 0


def test_poll_and_wait_never_synchronize(monkeypatch: pytest.MonkeyPatch) -> None:
    mgr, kv = make()
    with mgr:
        keys = [f"ns-{i}".encode() for i in range(8)]
        for i, k in enumerate(keys):
            fill(kv, i, k)
        torch.cuda.synchronize()

        def boom(*a: Any, **k: Any) -> None:
            raise AssertionError("a blocking synchronize on the engine thread")

        monkeypatch.setattr(torch.cuda, "synchronize", boom)
        monkeypatch.setattr(torch.cuda.Stream, "synchronize", boom)
        monkeypatch.setattr(torch.cuda.Event, "synchronize", boom)
        busy()
        jobs = [mgr.store(k, i) for i, k in enumerate(keys)]
        assert all(j is not None for j in jobs)
        assert mgr.poll() == []                 # behind busy(): nothing done, and poll() did not wait
        comps = mgr.wait(timeout=30)
        assert sorted(c.job.key for c in comps) == sorted(keys) and all(c.ok for c in comps)
        monkeypatch.undo()
        assert all(host_matches(mgr, k, kv) for k in keys)


def test_a_copy_that_cannot_be_queued_is_reported_failed_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy call the device refuses (a CUDA error at queue time) fails its transfer, counted; the next works."""
    mgr, kv = make()
    with mgr:
        mover = mgr._mover
        real = mover._copies_on

        class Refusing:  # the batch's calls on its stream, with copy_ raising as a CUDA error would
            def __init__(self, ops: Any) -> None:
                self._ops = ops

            def __getattr__(self, name: str) -> Any:
                return getattr(self._ops, name)

            def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
                raise RuntimeError("CUDA error: an injected launch failure")

        @contextlib.contextmanager
        def refusing(stream: Any) -> Iterator[Refusing]:
            with real(stream) as ops:
                yield Refusing(ops)

        monkeypatch.setattr(mover, "_copies_on", refusing)
        fill(kv, 1, A)
        job = mgr.store(A, 1)
        assert job is not None
        (c,) = reported(mgr.wait([job], timeout=30), job)
        monkeypatch.undo()
        assert not c.ok and "copy failed" in (c.error or "")
        assert mgr.lookup([A]) == 0
        assert mgr_metric(mgr, "tiered_kv_errors_total", tier="host", error="copy_failed") == 1
        store_ok(mgr, kv, A, 1)                  # the next copy works
        assert host_matches(mgr, A, kv) is True


def test_pageable_slab_with_cuda_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tiered_kv.manager"):
        mgr, kv = make(pin_host_memory=False)
    with mgr:
        assert not mgr._host_rows.is_pinned()
        assert any("synchronous" in r.getMessage() for r in caplog.records)
        store_ok(mgr, kv, A, 2)
        assert host_matches(mgr, A, kv) is True


# ----------------------------------------------------------------------------- with the disk tier
def test_disk_round_trip_through_the_gpu(tmp_path: Path) -> None:
    mgr, kv = make(rows=64, slots=4, disk=tmp_path / "tier")
    keys = [f"dk-{i}".encode() for i in range(12)]
    with mgr:
        for i, k in enumerate(keys):
            store_ok(mgr, kv, k, i)
            assert mgr.flush(timeout=30)
        assert mgr.lookup(keys) == 12
        for i, k in enumerate(keys):       # 8 of them only on disk now: promote, then host -> device
            job = mgr.load(k, 32 + i)
            assert job is not None, k
            (c,) = reported(mgr.wait([job], timeout=30), job)
            assert c.ok, c
            assert row_is(kv, 32 + i, k)
        assert mgr_metric(mgr, "tiered_kv_transfer_bytes_total", src="disk", dst="host") >= 8 * ROW_BYTES


# ----------------------------------------------------------------------------- a random engine
def test_random_engine_never_sees_wrong_bytes() -> None:
    """Seeded engine loop on the real mover (tests/random_engine.py): compute+store, load, free,
    cancel, invalidate, poll, and GPU stalls of 1-10 M cycles on the engine's stream."""
    mgr, kv = make(rows=48, slots=24)
    with mgr:
        ok_loads, ok_stores = random_engine(
            mgr, random.Random(20261129), 48, 1500, (0.30, 0.25, 0.10, 0.07, 0.04, 0.04),
            compute=lambda row, key: fill(kv, row, key), row_holds=lambda row, key: row_is(kv, row, key),
            host_holds=lambda key: host_matches(mgr, key, kv),
            device_tick=lambda rng: torch.cuda._sleep(rng.randrange(1_000_000, 10_000_000)))
    assert ok_loads > 20 and ok_stores > 50


# ----------------------------------------------------------------------------- the vLLM adapter's copier
def test_slab_copier_orders_its_copies_after_the_engines_queued_work(tmp_path: Path) -> None:
    """The vLLM adapter's worker-side copier on CUDA KV: a store reads the block after the engine's
    queued write, a load overwrites it after the engine's queued read."""
    from tiered_kv.integrations.copier import SlabCopier
    from tiered_kv.integrations.slab import SharedSlab
    from tiered_kv.metrics import Metrics

    width = 4096
    slab = SharedSlab.open(tmp_path / "x.slab", 4, width, 1)
    kv = torch.zeros((8, width), dtype=torch.uint8, device="cuda")
    copier = SlabCopier(slab, 0, [kv], metrics=Metrics(registry=CollectorRegistry(), namespace="t"))
    pattern = (torch.arange(width) % 251).to(torch.uint8)
    on_device = pattern.to("cuda")                            # before busy(): .to() waits for the stream
    try:
        busy()
        kv[2].copy_(on_device, non_blocking=True)             # the engine's write, queued behind busy()
        assert copier.submit(1, b"s" * 16, 1, True, [2], [0])
        copier.wait([1], timeout=30)
        assert torch.equal(slab.rows[0], pattern)

        kv[5].fill_(7)
        torch.cuda.synchronize()
        out = torch.empty_like(kv[5])
        busy()
        out.copy_(kv[5], non_blocking=True)                     # a read queued before the row was given up
        assert copier.submit(2, b"l" * 16, 2, False, [5], [0])
        copier.wait([2], timeout=30)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), torch.full((width,), 7, dtype=torch.uint8))
        assert torch.equal(kv[5].cpu(), pattern)
        res = copier.finished()
        assert [r.job_id for r in res] == [1, 2] and all(r.ok for r in res)
    finally:
        copier.close()
        slab.close()


# ----------------------------------------------------------------------------- planes side by side in a host row
def test_the_device_does_index_ops_on_column_slices_right() -> None:
    """The probe ``CudaMover`` runs at start before it groups planes (movers/torch_cuda.py)."""
    from tiered_kv.movers import TorchCuda
    assert TorchCuda().strided_index_ops(torch.device("cuda"))


def test_a_copier_over_several_kv_tensors_round_trips_a_step_through_the_staging_rows(tmp_path: Path) -> None:
    """The vLLM worker's layout on a real device: 4 KV tensors side by side in each slab row, one group; a store of
    scattered rows into consecutive slots and a load back into other rows land every byte."""
    from tiered_kv.integrations.copier import SlabCopier
    from tiered_kv.integrations.slab import SharedSlab
    from tiered_kv.metrics import Metrics

    widths = (4096, 1024, 2048, 512)
    slab = SharedSlab.open(tmp_path / "g.slab", 16, sum(widths), 1)
    g = torch.Generator().manual_seed(7)
    kv = [torch.randint(0, 256, (32, w), dtype=torch.uint8, generator=g).to("cuda") for w in widths]
    copier = SlabCopier(slab, 0, kv, metrics=Metrics(registry=CollectorRegistry(), namespace="t"), batch_max=8)
    try:
        assert len(copier._mover._groups) == 1                      # type: ignore[union-attr]
        rows = [9, 3, 30, 17, 4, 22]
        assert copier.submit(1, b"s" * 16, 1, True, rows, [2, 3, 4, 5, 10, 11])
        copier.wait([1], timeout=30)
        for r, s in zip(rows, [2, 3, 4, 5, 10, 11]):
            assert torch.equal(slab.rows[s], torch.cat([t[r].cpu() for t in kv]))
        back = [0, 1, 2, 5, 6, 7]
        assert copier.submit(2, b"l" * 16, 2, False, back, [2, 3, 4, 5, 10, 11])
        copier.wait([2], timeout=30)
        for b, r in zip(back, rows):
            for t in kv:
                assert torch.equal(t[b], t[r])
    finally:
        copier.close()
        slab.close()
