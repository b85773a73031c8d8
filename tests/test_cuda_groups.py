"""``CudaMover``'s planes side by side in one host row (tiered_kv/movers/cuda.py ``_Group``), on the simulated device.

The vLLM worker's copier makes one plane per KV tensor, each a byte region of the slab row
(``SlabCopier``).  Each such plane's host rows alone are not one range in memory, so plane by plane a block
took a copy per plane: B x L calls for a job of B blocks over L KV tensors.  As a group, a chunk goes through
staging rows laid out as the region of the host row: a gather (stores) or scatter (loads) per plane on the
device, and one copy per run of consecutive slots (a block each where the region is part of the row).

Checked here: which planes form a group; the calls a step makes; the bytes, against a per-block model, over
random layouts, batches, staging sizes and failures (hypothesis); which transfers a failing call fails; a chunk
that loads one row twice; a device that fails the probe; and the copier end to end on the simulated device.
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from hypothesis import given, settings, strategies as st
from prometheus_client import CollectorRegistry

from fake_cuda import FakeGPU
from test_cuda_batched import done as answers   # every report, each transfer once
from tiered_kv.integrations import copier as copier_mod
from tiered_kv.integrations.copier import SlabCopier
from tiered_kv.integrations.slab import SharedSlab
from tiered_kv.jobs import JobKind
from tiered_kv.metrics import Metrics
from tiered_kv.movers import CompletionQueue, CudaMover, Transfer

STORE, LOAD = JobKind.STORE, JobKind.LOAD
ERR = RuntimeError("CUDA error: injected")


def layout(widths: list[int], nrows: int = 8, nslots: int = 8, before: int = 0, after: int = 0, seed: int = 0,
           order: Optional[list[int]] = None) -> tuple[list[torch.Tensor], torch.Tensor, list[tuple[torch.Tensor,
                                                                                                  torch.Tensor]]]:
    """Device tensors of ``widths`` bytes per row (random bytes) and a slab whose rows hold them side by side
    after ``before`` bytes and before ``after`` (another rank's part, padding); the planes in ``order``."""
    g = torch.Generator().manual_seed(seed)
    devs = [torch.randint(0, 256, (nrows, w), dtype=torch.uint8, generator=g) for w in widths]
    slab = torch.randint(0, 256, (nslots, before + sum(widths) + after), dtype=torch.uint8, generator=g)
    planes, at = [], before
    for d, w in zip(devs, widths):
        planes.append((d, slab[:, at:at + w]))
        at += w
    if order is not None:
        planes = [planes[i] for i in order]
    return devs, slab, planes


def tr(kind: JobKind, rows: list[int], slots: list[int]) -> Transfer:
    return Transfer(uuid.uuid4(), kind, rows, slots)


def op_kinds(gpu: FakeGPU) -> list[str]:
    (side,) = gpu.side
    return [op[0] for op in side.ops if op[0] not in ("wait", "event")]


# ----------------------------------------------------------------------------- which planes form a group
def test_planes_side_by_side_in_one_row_form_one_group_in_memory_order_whatever_their_order() -> None:
    _, _, planes = layout([16, 8, 24], order=[2, 0, 1])
    m = CudaMover(planes, CompletionQueue(), 1, runtime=FakeGPU())
    (g,) = m._groups
    assert g.planes == [1, 2, 0] and g.one_range and m._solo == []
    assert g.host.dtype == torch.int64 and g.cols == [(0, 2), (2, 3), (3, 6)]   # 8-byte elements: every width fits


def test_a_region_that_is_part_of_the_row_is_a_group_but_not_one_range_and_odd_widths_stay_bytes() -> None:
    _, _, planes = layout([5, 11], before=3, after=7)
    m = CudaMover(planes, CompletionQueue(), 1, runtime=FakeGPU())
    (g,) = m._groups
    assert not g.one_range and g.host.dtype == torch.uint8 and g.cols == [(0, 5), (5, 16)]


def test_planes_with_a_gap_or_in_other_slabs_or_alone_are_not_grouped() -> None:
    gpu = FakeGPU()
    devs, slab, planes = layout([8, 8, 8, 8])
    gap = [planes[0], planes[2]]                                  # plane 1's bytes lie between them
    assert CudaMover(gap, CompletionQueue(), 1, runtime=gpu)._groups == []
    other = torch.zeros_like(slab)
    apart = [planes[0], (devs[1], other[:, 8:16])]                # adjacent offsets, another slab
    assert CudaMover(apart, CompletionQueue(), 1, runtime=gpu)._groups == []
    alone = [planes[1]]
    assert CudaMover(alone, CompletionQueue(), 1, runtime=gpu)._groups == []
    other = torch.zeros((8, 8), dtype=torch.uint8)
    whole = [(devs[2], other), planes[0], planes[1]]   # its own host rows are one range: solo
    m = CudaMover(whole, CompletionQueue(), 1, runtime=gpu)
    (g,) = m._groups
    assert g.planes == [1, 2] and m._solo == [0]
    aliased = [(devs[0], other), planes[0], planes[1]]   # a solo plane whose device rows are a member's
    assert CudaMover(aliased, CompletionQueue(), 1, runtime=gpu)._groups == []
    assert CudaMover(planes, CompletionQueue(), 1, runtime=gpu, batched=False)._groups == []


def test_a_device_that_fails_the_probe_gets_no_group_and_the_copies_go_block_by_block(
        caplog: pytest.LogCaptureFixture) -> None:
    gpu = FakeGPU()
    gpu.strided_ok = False
    devs, slab, planes = layout([8, 16])
    out = CompletionQueue()
    m = CudaMover(planes, out, 1, runtime=gpu)
    assert m._groups == [] and "block by block" in caplog.text
    t = tr(STORE, [1, 2], [3, 4])
    m.submit(t)
    m.flush()
    assert op_kinds(gpu) == ["copy"] * 4
    assert answers(gpu, m, out)[t.token].ok
    assert torch.equal(slab[3:5, :8], devs[0][1:3]) and torch.equal(slab[3:5, 8:24], devs[1][1:3])


def test_the_devices_probe_passes_where_index_ops_on_column_slices_work_and_fails_where_they_do_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``TorchCuda.strided_index_ops`` is plain torch: on the CPU, which does these ops right, it answers True; with
    an ``index_select`` that writes the whole staging row (or raises) it answers False, for either element size."""
    from tiered_kv.movers import TorchCuda
    cpu = torch.device("cpu")
    assert TorchCuda().strided_index_ops(cpu)
    real = torch.index_select

    def spills(src: torch.Tensor, dim: int, index: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        real(src, dim, index, out=out)   # right, and then a column beside the slice written too
        out.as_strided((out.shape[0], 1), (out.stride(0), 1), out.storage_offset() - 1).fill_(1)
        return out

    for dtype_hit in (torch.int64, torch.uint8):
        def wrong_for(src: torch.Tensor, dim: int, index: torch.Tensor, *, out: torch.Tensor,
                      _d: torch.dtype = dtype_hit) -> torch.Tensor:
            return spills(src, dim, index, out=out) if src.dtype == _d else real(src, dim, index, out=out)
        monkeypatch.setattr(torch, "index_select", wrong_for)
        assert not TorchCuda().strided_index_ops(cpu)

    def raises(*a: Any, **k: Any) -> Any:
        raise RuntimeError("no kernel for this layout")
    monkeypatch.setattr(torch, "index_select", raises)
    assert not TorchCuda().strided_index_ops(cpu)


# ----------------------------------------------------------------------------- the calls a step makes
def test_a_step_of_64_blocks_over_8_planes_is_an_index_8_gathers_and_a_copy_per_run_of_slots() -> None:
    gpu, out = FakeGPU(), CompletionQueue()
    devs, slab, planes = layout([64] * 8, nrows=128, nslots=256, seed=3)
    m = CudaMover(planes, out, 1, runtime=gpu)
    rows = random.Random(1).sample(range(128), 64)
    slots = list(range(10, 42)) + list(range(100, 132))           # two runs, as the host index hands them
    ts = [tr(STORE, rows[i:i + 4], slots[i:i + 4]) for i in range(0, 64, 4)]
    for t in ts:
        m.submit(t)
    gpu.calls = 0
    m.flush()
    assert op_kinds(gpu) == ["gather"] * 8 + ["copy"] * 2 and gpu.calls == 1 + 8 + 2   # 1: the index upload
    got = answers(gpu, m, out)
    assert all(got[t.token].ok for t in ts)
    for r, s in zip(rows, slots):
        assert torch.equal(slab[s], torch.cat([d[r] for d in devs]))
    # the same step plane by plane, block by block: 512 calls
    gpu2 = FakeGPU()
    gpu2.strided_ok = False
    m2 = CudaMover(planes, CompletionQueue(), 1, runtime=gpu2)
    for t in ts:
        m2.submit(tr(STORE, t.rows, t.slots))
    m2.flush()
    assert gpu2.calls == 64 * 8


def test_loads_copy_each_run_of_slots_into_the_staging_rows_then_scatter_each_plane() -> None:
    gpu, out = FakeGPU(), CompletionQueue()
    devs, slab, planes = layout([16, 8, 8], seed=4)
    m = CudaMover(planes, out, 1, runtime=gpu)
    t = tr(LOAD, [6, 0, 3, 5], [1, 2, 3, 7])
    m.submit(t)
    m.flush()
    assert op_kinds(gpu) == ["copy", "copy", "scatter", "scatter", "scatter"]
    assert answers(gpu, m, out)[t.token].ok
    for r, s in zip(t.rows, t.slots):
        assert torch.equal(torch.cat([d[r] for d in devs]), slab[s])


def test_a_region_that_is_part_of_the_row_copies_a_block_each_and_leaves_the_rest_of_the_row() -> None:
    gpu, out = FakeGPU(), CompletionQueue()
    devs, slab, planes = layout([8, 8], before=16, after=8, seed=5)
    keep = slab.clone()
    m = CudaMover(planes, out, 1, runtime=gpu)
    t = tr(STORE, [4, 1, 2], [0, 1, 2])
    m.submit(t)
    m.flush()
    assert op_kinds(gpu) == ["gather", "gather", "copy", "copy", "copy"]
    assert answers(gpu, m, out)[t.token].ok
    for r, s in zip(t.rows, t.slots):
        assert torch.equal(slab[s, 16:32], torch.cat([devs[0][r], devs[1][r]]))
    assert torch.equal(slab[:, :16], keep[:, :16]) and torch.equal(slab[:, 32:], keep[:, 32:])
    assert torch.equal(slab[3:], keep[3:])


def test_staging_rows_smaller_than_a_chunk_take_it_in_passes_the_last_one_short() -> None:
    gpu, out = FakeGPU(), CompletionQueue()
    devs, slab, planes = layout([8, 8], nslots=16, seed=6)
    m = CudaMover(planes, out, 1, runtime=gpu, stage_bytes=3 * 16)        # 3 blocks per pass
    t = tr(STORE, [7, 6, 5, 4, 3, 2, 1], [0, 1, 2, 3, 4, 5, 6])
    m.submit(t)
    m.flush()
    assert op_kinds(gpu) == ["gather", "gather", "copy"] * 3
    assert answers(gpu, m, out)[t.token].ok
    for r, s in zip(t.rows, t.slots):
        assert torch.equal(slab[s], torch.cat([devs[0][r], devs[1][r]]))


def test_a_chunk_that_loads_one_row_twice_copies_it_block_by_block_and_the_later_load_lands() -> None:
    gpu, out = FakeGPU(), CompletionQueue()
    devs, slab, planes = layout([8, 8], seed=7)
    m = CudaMover(planes, out, 1, runtime=gpu)
    first, second = tr(LOAD, [2, 5], [0, 1]), tr(LOAD, [5], [6])
    m.submit(first)
    m.submit(second)
    m.flush()
    assert op_kinds(gpu) == ["copy"] * 6                  # 3 blocks x 2 planes, in order
    got = answers(gpu, m, out)
    assert got[first.token].ok and got[second.token].ok
    assert torch.equal(torch.cat([devs[0][5], devs[1][5]]), slab[6])
    assert torch.equal(torch.cat([devs[0][2], devs[1][2]]), slab[0])


# ----------------------------------------------------------------------------- failures
def test_a_host_copy_that_cannot_be_queued_fails_only_the_transfers_with_a_block_in_it() -> None:
    gpu, out = FakeGPU(), CompletionQueue()
    devs, slab, planes = layout([8, 16], seed=8)
    m = CudaMover(planes, out, 1, runtime=gpu)
    a, b, c = tr(STORE, [1], [1]), tr(STORE, [2], [3]), tr(STORE, [3], [5])   # three runs of one slot
    for t in (a, b, c):
        m.submit(t)
    gpu.copy_error, gpu.copy_error_skip = ERR, 3       # two gathers and a's copy go through: b's copy fails
    m.flush()
    assert gpu.copy_error is None and out.drain() == []   # answered at the chunk's end event, not before
    got = answers(gpu, m, out)
    assert got[a.token].ok and not got[b.token].ok and got[c.token].ok
    assert "injected" in (got[b.token].error or "")
    for t in (a, c):
        assert torch.equal(slab[t.slots[0]], torch.cat([devs[0][t.rows[0]], devs[1][t.rows[0]]]))


def test_a_load_whose_host_copy_cannot_be_queued_leaves_its_rows_as_they_were_and_lands_the_others() -> None:
    """Round 29's suspicion: a load pass scattered every staging row, also those a failed host copy never filled,
    writing stale bytes into the failed transfer's device rows.  Now such a pass copies only the other blocks'
    rows (block by block, a fault path), and the failed transfer's rows keep their bytes."""
    gpu, out = FakeGPU(), CompletionQueue()
    devs, slab, planes = layout([8, 16], seed=12)
    m = CudaMover(planes, out, 1, runtime=gpu)
    keep = [d.clone() for d in devs]
    a, b, c = tr(LOAD, [1], [1]), tr(LOAD, [2], [3]), tr(LOAD, [3], [5])   # three runs of one slot
    for t in (a, b, c):
        m.submit(t)
    gpu.copy_error, gpu.copy_error_skip = ERR, 1       # a's host copy goes through, b's fails
    m.flush()
    got = answers(gpu, m, out)
    assert got[a.token].ok and not got[b.token].ok and got[c.token].ok
    for t in (a, c):
        assert torch.equal(torch.cat([devs[0][t.rows[0]], devs[1][t.rows[0]]]), slab[t.slots[0]])
    for d, k in zip(devs, keep):
        assert torch.equal(d[2], k[2]), "the failed load's row was written"


@pytest.mark.parametrize("kind", ["gather", "scatter", "index"])
def test_a_gather_scatter_or_index_that_cannot_be_queued_fails_the_transfers_of_its_pass_only(kind: str) -> None:
    """A gather or scatter fails its pass's transfers; an index upload that fails leaves the chunk to copies block by
    block, where each transfer meets its own outcome (here all land)."""
    gpu, out = FakeGPU(), CompletionQueue()
    devs, slab, planes = layout([8, 8], nslots=16, seed=9)
    m = CudaMover(planes, out, 1, runtime=gpu, stage_bytes=2 * 16)        # 2 blocks per pass
    k = STORE if kind != "scatter" else LOAD
    ts = [tr(k, [i], [i]) for i in range(4)]                              # passes: (t0, t1), (t2, t3)
    for t in ts:
        m.submit(t)
    if kind == "index":
        gpu.index_error = ERR
    elif kind == "gather":
        gpu.copy_error, gpu.copy_error_skip = ERR, 4   # pass 1: gather, gather, copy; pass 2: its second gather
    else:
        gpu.copy_error, gpu.copy_error_skip = ERR, 2   # pass 1: its copy, then its second scatter
    m.flush()
    got = answers(gpu, m, out)
    failed = [i for i, t in enumerate(ts) if not got[t.token].ok]
    assert failed == {"index": [], "gather": [2, 3], "scatter": [0, 1]}[kind]
    for i, t in enumerate(ts):
        if i not in failed:
            assert torch.equal(torch.cat([devs[0][i], devs[1][i]]), slab[i])


def test_staging_rows_that_cannot_be_made_leave_the_chunk_to_copies_block_by_block(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A device out of memory for the staging rows: the step still lands, a call per block per plane, logged once;
    the staging rows are made once memory is back."""
    gpu, out = FakeGPU(), CompletionQueue()
    devs, slab, planes = layout([8, 8], seed=10)
    m = CudaMover(planes, out, 1, runtime=gpu)
    real = CudaMover._group_stage

    def no_memory(self: CudaMover, *a: Any) -> Any:
        raise RuntimeError("CUDA out of memory (injected)")

    monkeypatch.setattr(CudaMover, "_group_stage", no_memory)
    for step in range(2):
        t = tr(STORE, [3 + step, 1], [2 * step, 2 * step + 1])
        m.submit(t)
        m.flush()
        assert op_kinds(gpu) == ["copy"] * 4
        assert answers(gpu, m, out)[t.token].ok
        for r, s in zip(t.rows, t.slots):
            assert torch.equal(slab[s], torch.cat([devs[0][r], devs[1][r]]))
    assert caplog.text.count("could not be made") == 1
    monkeypatch.setattr(CudaMover, "_group_stage", real)
    t = tr(STORE, [6, 7], [6, 7])
    m.submit(t)
    m.flush()
    assert op_kinds(gpu) == ["gather", "gather", "copy"]
    assert answers(gpu, m, out)[t.token].ok


# ----------------------------------------------------------------------------- random layouts and batches
@st.composite
def scenarios(draw: Any) -> dict[str, Any]:
    n_planes = draw(st.integers(2, 4))
    wide = draw(st.booleans())
    widths = [draw(st.sampled_from([8, 16, 24] if wide else [3, 5, 8, 13])) for _ in range(n_planes)]
    batches = []
    for _ in range(draw(st.integers(1, 4))):
        batch = []
        for _ in range(draw(st.integers(1, 6))):
            n = draw(st.integers(1, 4))
            rows = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n, unique=True))
            run = draw(st.booleans())
            if run:
                s0 = draw(st.integers(0, 12 - n))
                slots = list(range(s0, s0 + n))
            else:
                slots = draw(st.lists(st.integers(0, 11), min_size=n, max_size=n, unique=True))
            batch.append((draw(st.sampled_from([STORE, LOAD])), rows, slots))
        batches.append(batch)
    return {"widths": widths, "before": draw(st.sampled_from([0, 0, 8, 3])), "after": draw(st.sampled_from([0, 0, 8])),
            "order": draw(st.permutations(list(range(n_planes)))), "stage_blocks": draw(st.integers(1, 8)),
            "event_blocks": draw(st.integers(1, 10)), "batches": batches, "seed": draw(st.integers(0, 2**16)),
            "fail": draw(st.one_of(st.none(), st.tuples(st.sampled_from(["copy", "index"]), st.integers(0, 30))))}


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_random_batches_land_what_a_block_by_block_copy_lands(sc: dict[str, Any]) -> None:
    """Each flush is stores then loads, so the model applies a batch's stores, then its loads, block by block in
    submission order; a failed transfer leaves its targets unknown (not compared) until written again."""
    widths = sc["widths"]
    devs, slab, planes = layout(widths, nrows=10, nslots=12, before=sc["before"], after=sc["after"], seed=sc["seed"],
                                order=sc["order"])
    lo, hi = sc["before"], sc["before"] + sum(widths)
    dev_m = [torch.cat([d[r] for d in devs]) for r in range(10)]     # the model: each row, each slot region
    host_m = [slab[s, lo:hi].clone() for s in range(12)]
    outside = torch.cat([slab[:, :lo], slab[:, hi:]], 1).clone()
    dev_known, host_known = [True] * 10, [True] * 12
    gpu = FakeGPU(rng=random.Random(sc["seed"]))
    out = CompletionQueue()
    block = sum(widths)
    m = CudaMover(planes, out, 1, runtime=gpu, batch_max=1 << 10, event_bytes=sc["event_blocks"] * block,
                  stage_bytes=sc["stage_blocks"] * block)
    assert len(m._groups) == 1
    if sc["fail"] is not None:
        what, skip = sc["fail"]
        setattr(gpu, f"{what}_error", ERR)
        setattr(gpu, f"{what}_error_skip", skip)
    for batch in sc["batches"]:
        ts = [tr(k, rows, slots) for k, rows, slots in batch]
        for t in ts:
            m.submit(t)
        m.flush()
        got = answers(gpu, m, out)
        assert set(got) == {t.token for t in ts}
        for t in [t for t in ts if t.kind is STORE] + [t for t in ts if t.kind is LOAD]:
            ok = got[t.token].ok
            for r, s in zip(t.rows, t.slots):
                if t.kind is STORE:
                    host_m[s], host_known[s] = dev_m[r].clone(), ok and dev_known[r]
                else:
                    dev_m[r], dev_known[r] = host_m[s].clone(), ok and host_known[s]
        if sc["fail"] is None:
            assert all(r.ok for r in got.values())
        for r in range(10):
            if dev_known[r]:
                assert torch.equal(torch.cat([d[r] for d in devs]), dev_m[r]), f"device row {r}"
        for s in range(12):
            if host_known[s]:
                assert torch.equal(slab[s, lo:hi], host_m[s]), f"slot {s}"
        assert torch.equal(torch.cat([slab[:, :lo], slab[:, hi:]], 1), outside), "bytes outside the region"


# ----------------------------------------------------------------------------- the vLLM worker's copier
def test_the_copier_on_the_simulated_device_moves_a_step_through_the_staging_rows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks' copiers over one slab of 3 KV tensors each: each rank's region of the row is a group (not one
    range: the other rank's part lies beside it); a store then a load round trip the bytes, the ring marked."""
    gpu = FakeGPU()
    monkeypatch.setattr(copier_mod, "_copy_mover", lambda planes, out, b: CudaMover(
        planes, out, num_streams=1, runtime=gpu, batch_max=b))
    slab = SharedSlab.open(tmp_path / "groups.slab", 16, 96, 2)
    try:
        g = torch.Generator().manual_seed(11)
        kv = [[torch.randint(-128, 127, (8, w), dtype=torch.int8, generator=g) for w in (16, 8, 24)] for _ in range(2)]
        cs = [SlabCopier(slab, r, kv[r], metrics=Metrics(registry=CollectorRegistry(), namespace="grp"), batch_max=8)
              for r in range(2)]
        for c in cs:
            assert not c._mover._groups[0].one_range                      # type: ignore[union-attr]
        gpu.calls = 0
        for r, c in enumerate(cs):
            assert c.submit(1, bytes([r + 1]) * 16, 10, True, [5, 1, 6, 2], [3, 4, 5, 9])
        for c in cs:
            c.finished()
        assert gpu.calls == 2 * (1 + 3 + 4)            # per rank: the index, 3 gathers, a copy per block
        gpu.run_all()
        for r, c in enumerate(cs):
            assert [(x.job_id, x.ok) for x in c.finished()] == [(1, True)]
            for row, s in zip([5, 1, 6, 2], [3, 4, 5, 9]):
                want = torch.cat([t[row].view(torch.uint8) for t in kv[r]])
                assert torch.equal(slab.rows[s, r * 48:(r + 1) * 48], want)
        assert slab.ok(10)
        for r, c in enumerate(cs):
            for t in kv[r]:
                t[0].zero_()
            assert c.submit(2, bytes([r + 3]) * 16, 11, False, [0], [4])
            c.finished()
        gpu.run_all()
        for r, c in enumerate(cs):
            assert [(x.job_id, x.ok) for x in c.finished()] == [(2, True)]
            for t in kv[r]:
                assert torch.equal(t[0], t[1])            # slot 4 held row 1's bytes
        for c in cs:
            c.close()
    finally:
        slab.close()
