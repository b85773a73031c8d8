"""``torch.inference_mode()`` is per thread, and torch refuses an in-place write to a tensor made under it
(an inference tensor) once outside it.  A serving loop may build the tiers inside it, call them inside or
outside it, and hand over KV tensors made inside it; the copy threads run outside it.  Whatever the mix,
every copy lands: the tiers' own tensors are made outside inference mode, and the engine's rows are written
through a normal alias of the same memory (``tiered_kv.checks.plain_alias``)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry

from fake_cuda import FakeGPU
from fakes import FakeMover, make_config
from tiered_kv import TierManager
from tiered_kv.checks import plain_alias
from tiered_kv.integrations.copier import SlabCopier
from tiered_kv.integrations.slab import SharedSlab
from tiered_kv.jobs import JobKind
from tiered_kv.metrics import Metrics
from tiered_kv.movers import CompletionQueue, CudaMover, Transfer

ROW = 256
# (KV tensor made inside, tiers built inside, tiers called inside)
MODES = {
    "none": (False, False, False),
    "built-inside-called-outside": (False, True, False),
    "built-and-called-inside": (False, True, True),
    "kv-made-inside": (True, False, False),
    "kv-made-inside-called-inside": (True, False, True),
    "all-made-inside-called-outside": (True, True, False),
    "all-inside": (True, True, True),
}


def _kv(rows: int, seed: int, inside: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode(inside):
        kv = torch.randint(0, 256, (rows, ROW), generator=g, dtype=torch.uint8)
    assert kv.is_inference() == inside
    return kv


@contextlib.contextmanager
def _engine(kv: torch.Tensor) -> Iterator[None]:
    """Where the test itself writes the KV rows: inside inference mode when they are inference tensors."""
    with torch.inference_mode(kv.is_inference()):
        yield


def _no_failed_copies(reg: Optional[CollectorRegistry], caplog: pytest.LogCaptureFixture) -> None:
    """Nothing counted as failed, and nothing logged: a batched copy that raised is copied again one row at a
    time (through raw addresses, where torch's checks do not reach), which would hide the failure."""
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not warned, warned
    if reg is not None:
        bad = [(s.name, s.labels, s.value) for m in reg.collect() for s in m.samples
               if s.value and (s.name == "tiered_kv_errors_total"
                               or (s.name == "tiered_kv_jobs_total" and s.labels.get("outcome") == "failed"))]
        assert not bad, bad


@pytest.mark.parametrize("cpu_mover", ["native", "threads"])
@pytest.mark.parametrize("disk_io", [None, "thread", "process"])
@pytest.mark.parametrize("mode", list(MODES))
def test_the_tiers_copy_whatever_inference_mode_made_or_calls_them(tmp_path: Path, cpu_mover: str, disk_io: Any,
                                                                   mode: str, caplog: pytest.LogCaptureFixture) -> None:
    kv_inside, built_inside, called_inside = MODES[mode]
    kv = _kv(16, 1, kv_inside)
    disk = {} if disk_io is None else dict(disk_path=str(tmp_path / "d"), disk_capacity_bytes=1 << 22,
                                           disk_io=disk_io)
    # with a disk tier, four host slots for eight blocks: the loads promote from disk
    cfg = make_config(host_slots=8 if disk_io is None else 4, row_bytes=ROW, cpu_mover=cpu_mover, **disk)
    reg = CollectorRegistry()
    with torch.inference_mode(built_inside):
        mgr = TierManager(cfg, kv, registry=reg)
    try:
        keys = [b"k%d" % i for i in range(8)]
        src = [0, 5, 2, 7, 4, 3, 1, 6]
        dst = [8, 9, 15, 11, 12, 10, 14, 13]
        want = kv[src].clone()
        with torch.inference_mode(called_inside):
            for lo, hi in ((0, 1), (1, 4), (4, 8)):   # a lone copy, then batches; each on disk before the next
                job = mgr.store_many(keys[lo:hi], src[lo:hi])
                assert job is not None and all(c.ok for c in mgr.wait([job]))
                assert mgr.flush(timeout=30)
            with _engine(kv):
                kv[:8].zero_()
            assert mgr.lookup(keys) == 8
            for lo, hi in ((0, 1), (1, 4), (4, 8)):
                job = mgr.load_many(keys[lo:hi], dst[lo:hi])
                assert job is not None and all(c.ok for c in mgr.wait([job]))
        assert torch.equal(kv[dst], want)
        if disk_io is not None:
            assert mgr.disk_blocks == 8
        _no_failed_copies(reg, caplog)
    finally:
        mgr.close()


@pytest.mark.parametrize("mode", list(MODES))
def test_the_vllm_workers_copier_copies_whatever_inference_mode_made_or_calls_it(tmp_path: Path, mode: str,
                                                                                caplog: pytest.LogCaptureFixture) -> None:
    kv_inside, built_inside, called_inside = MODES[mode]
    a = _kv(16, 2, kv_inside)
    with torch.inference_mode(built_inside):
        slab = SharedSlab.open(tmp_path / "c.slab", 8, 2 * ROW, 1)
        c = SlabCopier(slab, 0, [a, _kv(16, 3, kv_inside)], metrics=Metrics(registry=CollectorRegistry(), namespace="t"))
    try:
        rows, slots = [4, 1, 3, 9, 12, 6], [2, 0, 3, 7, 5, 1]   # scattered both sides: gathered and scattered
        want = a[rows].clone()
        with torch.inference_mode(called_inside):
            assert c.submit(1, b"s" * 16, 1, True, rows, slots)
            c.wait([1])
            with _engine(a):
                a.zero_()
            assert c.submit(2, b"l" * 16, 2, False, rows[::-1], slots)
            c.wait([2])
            results = c.finished()
        assert [(r.job_id, r.ok) for r in results] == [(1, True), (2, True)]
        assert torch.equal(a[rows[::-1]], want)
        _no_failed_copies(None, caplog)
    finally:
        c.close()
        slab.close()


@pytest.mark.parametrize("planes", [1, 2])
def test_the_cuda_movers_staging_rows_made_inside_inference_mode_serve_copies_outside_it(
        caplog: pytest.LogCaptureFixture, planes: int) -> None:
    """On the simulated device: the staging rows are made at the first scattered copy, in the caller's mode,
    and written by every later one, in whatever mode the caller is in then.  Two planes side by side in one host
    row (the vLLM copier's layout) have staging rows of their own (a group's)."""
    gpu = FakeGPU()
    devs = [_kv(8, 4 + p, False) for p in range(planes)]
    host = torch.zeros((8, planes * ROW), dtype=torch.uint8)
    out = CompletionQueue()
    m = CudaMover([(d, host[:, p * ROW:(p + 1) * ROW]) for p, d in enumerate(devs)], out, 1, runtime=gpu, batch_max=64)
    stages = m._stages[0] if planes == 1 else m._gstages[0]
    try:
        assert len(m._groups) == planes - 1
        for i, inside in enumerate((True, False)):
            rows, slots = ([6, 1, 4], [0, 1, 2]) if i == 0 else ([2, 7, 0], [3, 4, 5])   # gathered through the stage
            with torch.inference_mode(inside):
                m.submit(Transfer(f"t{i}", JobKind.STORE, rows, slots))
                m.flush()
            assert stages[0] is not None
            gpu.run_all()
            m.harvest()
            (r,) = out.drain()
            assert r.ok, r.error
            for p, d in enumerate(devs):
                assert torch.equal(host[slots, p * ROW:(p + 1) * ROW], d[rows])
        _no_failed_copies(None, caplog)
    finally:
        m.close()


def test_plain_alias_is_the_tensor_itself_or_a_normal_tensor_over_its_memory() -> None:
    normal = torch.arange(12, dtype=torch.float16).view(3, 4)
    assert plain_alias(normal) is normal
    with torch.inference_mode():
        inf = torch.arange(12, dtype=torch.float16).view(3, 4)[1:]   # a view with an offset
    alias = plain_alias(inf)
    assert not alias.is_inference()
    assert (alias.data_ptr(), alias.shape, alias.stride(), alias.dtype) == (inf.data_ptr(), inf.shape, inf.stride(),
                                                                          inf.dtype)
    alias[0].fill_(-1)          # outside inference mode: lands in the inference tensor's memory
    assert inf[0].tolist() == [-1.0] * 4


@pytest.mark.parametrize("mode", list(MODES))
def test_the_manager_hands_its_mover_normal_tensors_over_the_same_memory(mode: str) -> None:
    """What the movers are handed: never an inference tensor, and the engine's own memory, whatever dtype."""
    kv_inside, built_inside, _ = MODES[mode]
    with torch.inference_mode(kv_inside):
        kv = torch.zeros((4, 2, 8), dtype=torch.float16)
    handed: list[torch.Tensor] = []

    def factory(dev: torch.Tensor, host: torch.Tensor, out: CompletionQueue) -> Any:
        handed.extend((dev, host))
        return FakeMover(dev, host, out)

    with torch.inference_mode(built_inside):
        mgr = TierManager(make_config(host_slots=2, row_bytes=32), kv, registry=CollectorRegistry(),
                          mover_factory=factory)
    try:
        dev, host = handed
        assert not dev.is_inference() and not host.is_inference()
        assert dev.data_ptr() == kv.data_ptr() and dev.shape == (4, 32)
    finally:
        mgr.close()


def test_a_slab_opened_inside_inference_mode_has_normal_rows(tmp_path: Path) -> None:
    with torch.inference_mode():
        slab = SharedSlab.open(tmp_path / "s.slab", 2, 64, 1)
    try:
        assert not slab.rows.is_inference()
        slab.rows[1].fill_(7)   # outside inference mode, as the copy threads write it
        assert slab.rows[1].tolist() == [7] * 64
    finally:
        slab.close()
