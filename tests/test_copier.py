"""SlabCopier (the vLLM worker side) on the movers: the ring is marked only after a job's copies ran and
before its result is returned; jobs run in submission order.  The CUDA path runs on the simulated device
(tests/fake_cuda.py).  ``tests/test_offload_core.py`` covers the copier against the scheduler side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from fake_cuda import FakeGPU
from tiered_kv.integrations import copier as copier_mod
from tiered_kv.integrations.copier import SlabCopier
from tiered_kv.integrations.slab import SharedSlab
from tiered_kv.metrics import Metrics
from tiered_kv.movers import CudaMover, ThreadMover


@pytest.fixture
def slab(tmp_path: Path):
    s = SharedSlab.open(tmp_path / "c.slab", 4, 64, 1)
    yield s
    s.close()


def _kv(rows: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (rows, width), generator=g, dtype=torch.int8)


def _watch_marks(slab: SharedSlab, check: Any) -> list[tuple[int, bool]]:
    """Record each mark_done; ``check(seq)`` runs just before the ring is written."""
    marks: list[tuple[int, bool]] = []
    real = slab.mark_done

    def mark(rank: int, seq: int, ok: bool = True) -> None:
        check(seq)
        marks.append((seq, ok))
        real(rank, seq, ok)

    slab.mark_done = mark  # type: ignore[method-assign]
    return marks


def test_cpu_job_over_two_tensors_marks_the_ring_after_its_copies(slab):
    a, b = _kv(6, 24, 1), _kv(6, 40, 2)
    c = SlabCopier(slab, 0, [a, b], metrics=Metrics(registry=CollectorRegistry(), namespace="t"))
    try:
        seen = []
        marks = _watch_marks(slab, lambda seq: seen.append(
            torch.equal(slab.rows[[2, 0], :24], a[[4, 1]].view(torch.uint8))
            and torch.equal(slab.rows[[2, 0], 24:64], b[[4, 1]].view(torch.uint8))))
        assert c.submit(7, b"j" * 16, 3, True, [4, 1], [2, 0])
        c.wait([7])
        assert marks == [(3, True)] and seen == [True]          # the copies had landed when the ring was marked
        (r,) = c.finished()
        assert (r.job_id, r.ok, r.nbytes, r.store) == (7, True, 2 * 64, True) and slab.done(3)
    finally:
        c.close()


def _sim_copier(slab: SharedSlab, tensors: list[torch.Tensor], monkeypatch) -> tuple[SlabCopier, FakeGPU]:
    gpu = FakeGPU()
    monkeypatch.setattr(copier_mod, "_copy_mover",
                        lambda planes, out, batch_max: CudaMover(planes, out, num_streams=1, runtime=gpu, batch_max=batch_max))
    return SlabCopier(slab, 0, tensors, metrics=Metrics(registry=CollectorRegistry(), namespace="t")), gpu


def test_cuda_job_is_marked_and_returned_only_after_its_end_event(slab, monkeypatch):
    kv = _kv(8, 64, 3)
    c, gpu = _sim_copier(slab, [kv], monkeypatch)
    seen = []
    marks = _watch_marks(slab, lambda seq: seen.append(torch.equal(slab.rows[[1, 3]], kv[[5, 6]].view(torch.uint8))))
    gpu.kernel(lambda: kv[5].fill_(9))                   # the engine's queued write of block 5
    assert c.submit(1, b"s" * 16, 11, True, [5, 6], [1, 3])
    assert c.finished() == [] and marks == [] and not slab.done(11)
    (side,) = gpu.side
    gpu.run(side)                                         # waits for the engine's stream: nothing ran
    assert c.finished() == [] and not slab.rows.any()
    gpu.run(gpu.compute)
    for _ in range(4):
        gpu.step(side)                                    # the wait, the start event, both copies; not the end event
    assert c.finished() == [] and marks == [] and not slab.done(11) and c.in_flight == 1
    gpu.step(side)
    (r,) = c.finished()
    assert (r.job_id, r.ok, r.nbytes) == (1, True, 128) and marks == [(11, True)] and seen == [True]
    assert bool((slab.rows[1] == 9).all()) and c.in_flight == 0
    c.close()


def test_cuda_jobs_run_in_submission_order_and_wait_blocks_for_them(slab, monkeypatch):
    """A store into slot 0, then a load of slot 0 into block 2: one stream, in order, so the load reads the
    stored bytes.  wait() blocks on the copy stream (the caller asked), then finished() returns both."""
    kv = _kv(4, 64, 4)
    c, gpu = _sim_copier(slab, [kv], monkeypatch)
    marks = _watch_marks(slab, lambda seq: None)
    assert c.submit(1, b"a" * 16, 1, True, [0], [0])
    assert c.submit(2, b"b" * 16, 2, False, [2], [0])
    c.wait([2])
    assert marks == [(1, True), (2, True)] and torch.equal(kv[2], kv[0])
    assert [(r.job_id, r.ok) for r in c.finished()] == [(1, True), (2, True)]
    c.close()


def test_cuda_copy_that_cannot_be_queued_fails_the_job_and_still_marks_it(slab, monkeypatch):
    kv = _kv(4, 64, 5)
    c, gpu = _sim_copier(slab, [kv], monkeypatch)
    gpu.copy_error = RuntimeError("CUDA error: injected")
    assert c.submit(1, b"f" * 16, 4, True, [1], [2])
    assert c.finished() == [] and not slab.done(4)   # answered at its chunk's end event
    gpu.run_all()
    (r,) = c.finished()
    assert not r.ok and slab.done(4) and not slab.ok(4) and not slab.rows.any()
    c.close()


# ----------------------------------------------------------------------------- copy_batch_max
def _metrics() -> Metrics:
    return Metrics(registry=CollectorRegistry(), namespace="t")


def _cpu_copier(slab: SharedSlab, kv: torch.Tensor, batch_max: int) -> tuple[SlabCopier, ThreadMover]:
    c = SlabCopier(slab, 0, [kv], metrics=_metrics(), batch_max=batch_max)
    assert isinstance(c._mover, ThreadMover)
    return c, c._mover


def _handed(m: ThreadMover) -> int:
    """Transfers given to the copy thread so far and not taken yet (the thread may have taken some)."""
    return m._q.qsize()


def test_cpu_copy_batch_max_queues_jobs_until_the_engine_asks_for_results(slab):
    """copy_batch_max=3: two submits wake no copy thread (both stay queued with the owner); get_finished
    (finished()) hands them over together, in order."""
    kv = _kv(6, 64, 6)
    c, m = _cpu_copier(slab, kv, 3)
    marks = _watch_marks(slab, lambda seq: None)
    try:
        assert c.submit(1, b"a" * 16, 1, True, [0], [0]) and c.submit(2, b"b" * 16, 2, True, [1], [1])
        assert len(m._held) == 2 and _handed(m) == 0 and marks == []   # nothing reached the copy thread
        c.finished()                                                  # the engine asks: both start
        assert len(m._held) == 0
        c.wait([1, 2])
        assert marks == [(1, True), (2, True)] and torch.equal(slab.rows[:2], kv[:2].view(torch.uint8))
    finally:
        c.close()


def test_cpu_copy_batch_max_starts_the_queue_once_that_many_are_queued(slab):
    kv = _kv(6, 64, 7)
    c, m = _cpu_copier(slab, kv, 3)
    marks = _watch_marks(slab, lambda seq: None)
    try:
        for i in range(3):
            assert c.submit(10 + i, bytes([i]) * 16, 1 + i, True, [i], [i])
        assert len(m._held) == 0      # the third submit handed all three over, without a finished()
        c.wait([10, 11, 12])
        assert marks == [(1, True), (2, True), (3, True)]
        assert [r.job_id for r in c.finished()] == [10, 11, 12]
    finally:
        c.close()


def test_cpu_copy_batch_max_1_starts_each_job_at_its_submit(slab):
    c, m = _cpu_copier(slab, _kv(6, 64, 8), 1)
    try:
        assert c.submit(1, b"a" * 16, 1, True, [0], [0])
        assert len(m._held) == 0      # handed to the copy thread in submit
        c.wait([1])
        assert [r.job_id for r in c.finished()] == [1]
    finally:
        c.close()


def test_wait_starts_queued_jobs_so_it_never_waits_for_a_copy_nobody_started(slab):
    c, m = _cpu_copier(slab, _kv(6, 64, 9), 64)
    try:
        assert c.submit(1, b"a" * 16, 1, False, [3], [0])
        assert len(m._held) == 1
        c.wait([1], timeout=30)       # starts it, then waits: returns with the job done
        assert [(r.job_id, r.ok) for r in c.finished()] == [(1, True)] and slab.done(1)
    finally:
        c.close()


def _sim_batch_copier(slab: SharedSlab, kv: torch.Tensor, batch_max: int, monkeypatch) -> tuple[SlabCopier, FakeGPU]:
    gpu = FakeGPU()
    monkeypatch.setattr(copier_mod, "_copy_mover",
                        lambda planes, out, b: CudaMover(planes, out, num_streams=1, runtime=gpu, batch_max=b))
    return SlabCopier(slab, 0, [kv], metrics=_metrics(), batch_max=batch_max), gpu


def test_cuda_copy_batch_max_puts_a_step_of_jobs_on_the_stream_behind_one_barrier(slab, monkeypatch):
    kv = _kv(8, 64, 10)
    c, gpu = _sim_batch_copier(slab, kv, 8, monkeypatch)
    for i in range(3):
        assert c.submit(i, bytes([i]) * 16, 1 + i, True, [i], [i])
    (side,) = gpu.side
    assert side.queued == 0                                  # queued in the copier: no CUDA call yet
    assert c.finished() == []                                # the engine asks: the batch goes on the stream
    assert sum(1 for op in side.ops if op[0] == "wait") == 1  # one ordering barrier for the three jobs
    gpu.run_all()
    assert [r.job_id for r in c.finished()] == [0, 1, 2]
    assert torch.equal(slab.rows[:3], kv[:3].view(torch.uint8))
    c.close()


def test_cuda_batch_keeps_submission_order_when_a_store_follows_a_load(slab, monkeypatch):
    """A load of slot 0 into block 2, then a store of block 2 into slot 1, in one batch: the CUDA mover
    queues a batch's stores before its loads, so the copier starts the load first; the store then
    reads the loaded bytes (in the other order slot 1 would get block 2's old bytes)."""
    kv = _kv(4, 64, 11)
    slab.rows[0] = 7
    c, gpu = _sim_batch_copier(slab, kv, 8, monkeypatch)
    marks = _watch_marks(slab, lambda seq: None)
    assert c.submit(1, b"l" * 16, 1, False, [2], [0])
    assert c.submit(2, b"s" * 16, 2, True, [2], [1])
    c.wait([1, 2])
    assert marks == [(1, True), (2, True)]
    assert bool((slab.rows[1] == 7).all()) and bool((kv[2].view(torch.uint8) == 7).all())
    c.close()


# ----------------------------------------------------------------------------- pin_host_memory
class _Cudart:
    """Stands in for torch.cuda.cudart(): records (un)registrations, answers ``rc``."""

    def __init__(self, rc: int = 0) -> None:
        self.rc = rc
        self.calls: list[tuple] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size, flags))
        return self.rc

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0


def _cuda(monkeypatch, available: bool, kv_on_cuda: bool = False) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(copier_mod, "_on_cuda", lambda tensors: kv_on_cuda)


@pytest.mark.parametrize(("pin", "available", "kv_on_cuda", "pinned"), [
    (None, True, True, True),      # the default with CUDA KV tensors: pinned, as TierManager pins its slab
    (True, True, False, True),     # asked for, CUDA available
    (None, True, False, False),    # CPU KV tensors: nothing to pin for
    (None, False, False, False),
    (False, True, True, False),    # asked not to (a warning says the copies will be synchronous)
])
def test_pinning_decision_registers_the_slab_rows_and_close_unregisters(slab, monkeypatch, pin, available,
                                                                         kv_on_cuda, pinned):
    _cuda(monkeypatch, available, kv_on_cuda)
    gpu = FakeGPU()
    monkeypatch.setattr(copier_mod, "_copy_mover",
                        lambda planes, out, b: CudaMover(planes, out, num_streams=1, runtime=gpu, batch_max=b))
    rt = _Cudart()
    c = SlabCopier(slab, 0, [_kv(4, 64, 12)], metrics=_metrics(), pin=pin, cudart=rt)
    addr = slab.rows.data_ptr()
    assert slab.pinned is pinned
    assert rt.calls == ([("register", addr, slab.num_slots * slab.row_bytes, 0)] if pinned else [])
    c.close()
    assert not slab.pinned
    assert rt.calls[1:] == ([("unregister", addr)] if pinned else [])


def test_pin_true_without_cuda_raises_the_config_error_tiermanager_raises(slab, monkeypatch):
    from fakes import make_config, make_kv
    from tiered_kv import TierManager
    from tiered_kv.errors import ConfigError

    _cuda(monkeypatch, False)
    with pytest.raises(ConfigError) as ours:
        SlabCopier(slab, 0, [_kv(4, 64, 13)], metrics=_metrics(), pin=True, cudart=_Cudart())
    with pytest.raises(ConfigError) as theirs:
        TierManager(make_config(8, pin_host_memory=True), make_kv(8), registry=CollectorRegistry())
    assert str(ours.value) == str(theirs.value) and "pin_host_memory=True needs CUDA" in str(ours.value)
    assert not slab.pinned


def test_failed_cuda_host_register_raises_config_error(slab, monkeypatch):
    from tiered_kv.errors import ConfigError

    _cuda(monkeypatch, True)
    with pytest.raises(ConfigError, match="pin_host_memory: cudaHostRegister"):
        SlabCopier(slab, 0, [_kv(4, 64, 14)], metrics=_metrics(), pin=True, cudart=_Cudart(rc=2))
    assert not slab.pinned


def test_slab_close_unpins_a_slab_left_pinned(slab):
    rt = _Cudart()
    slab.pin(rt)
    slab.pin(rt)                  # idempotent
    slab.close()
    assert [c[0] for c in rt.calls] == ["register", "unregister"] and not slab.pinned
