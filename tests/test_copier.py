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
from tiered_kv.movers import CudaMover


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
    (r,) = c.finished()
    assert not r.ok and slab.done(4) and not slab.ok(4) and not slab.rows.any()
    c.close()
