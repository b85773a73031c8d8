"""``CudaMover``'s batched calls on the simulated device (tests/fake_cuda.py): a chunk's blocks go to the
device as one call per run of consecutive host slots -- a straight ``copy_`` when the device rows are
consecutive too, else a gather into (stores) or scatter from (loads) the stream's staging rows.

Each test names the calls it expects on the stream and checks the bytes once the device has run them;
failures are injected into one call at a time (``FakeGPU.copy_error`` / ``index_error``) and must fail
exactly the transfers with a block in that call, answered at the chunk's end event, once.  The last
test drives random batches, failures and stream interleavings against the properties every batch keeps.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fake_cuda import FakeGPU, FakeStream
from tiered_kv.jobs import JobKind
from tiered_kv.movers import CompletionQueue, CudaMover, Report, Transfer
from tiered_kv.movers import cuda as cuda_mod

STORE, LOAD = JobKind.STORE, JobKind.LOAD


def bare(rows: int = 8, slots: int = 8, streams: int = 1, **kw: Any) -> tuple[FakeGPU, CompletionQueue,
                                                                                torch.Tensor, torch.Tensor, CudaMover]:
    """A batched CudaMover alone: ``rows`` device rows of 8 distinct bytes each, ``slots`` host rows of 8
    other distinct bytes each (a load's bytes are told from a store's)."""
    gpu, out = FakeGPU(), CompletionQueue()
    dev = torch.arange(rows * 8, dtype=torch.uint8).view(rows, 8)
    host = (torch.arange(slots * 8, dtype=torch.int64) + 128).to(torch.uint8).view(slots, 8)
    return gpu, out, dev, host, CudaMover([(dev, host)], out, streams, runtime=gpu, **kw)


def tr(kind: JobKind, rows: list[int], slots: list[int]) -> Transfer:
    return Transfer(uuid.uuid4(), kind, rows, slots)


def kinds(stream: FakeStream) -> list[str]:
    return [op[0] for op in stream.ops]


def done(gpu: FakeGPU, mover: CudaMover, out: CompletionQueue) -> dict[Any, Report]:
    gpu.run_all()
    mover.harvest()
    reps = out.drain()
    assert len({r.token for r in reps}) == len(reps), "a transfer answered twice"
    return {r.token: r for r in reps}


# ----------------------------------------------------------------------------- the calls a chunk makes
def test_stores_of_scattered_rows_into_consecutive_slots_are_one_gather_and_one_copy() -> None:
    gpu, out, dev, host, mover = bare()
    t = tr(STORE, [5, 2, 7], [0, 1, 2])
    mover.submit(t)
    mover.flush()
    (side,) = gpu.side
    assert kinds(side) == ["wait", "event", "gather", "copy", "event"]
    assert gpu.calls == 3                         # the row numbers' upload, the gather, the copy
    (r,) = done(gpu, mover, out).values()
    assert r.ok and r.nbytes == 24
    assert torch.equal(host[:3], dev[[5, 2, 7]])


def test_loads_from_consecutive_slots_into_scattered_rows_are_one_copy_and_one_scatter() -> None:
    gpu, out, dev, host, mover = bare()
    want = host[4:7].clone()
    t = tr(LOAD, [6, 1, 3], [4, 5, 6])
    mover.submit(t)
    mover.flush()
    (side,) = gpu.side
    assert kinds(side) == ["wait", "event", "copy", "scatter", "event"]
    (r,) = done(gpu, mover, out).values()
    assert r.ok and torch.equal(dev[[6, 1, 3]], want)
    assert torch.equal(dev[0], torch.arange(8, dtype=torch.uint8))   # rows not loaded are untouched


@pytest.mark.parametrize("row_bytes,n,first_slot", [(8, 4, 2), (64 << 10, 64, 0), (2 << 20, 32, 0)])
def test_a_steps_transfers_with_consecutive_rows_and_slots_are_one_copy(row_bytes: int, n: int,
                                                                        first_slot: int) -> None:
    """One-block stores of consecutive rows into consecutive slots are one copy of one range to another and one
    end event, up to ``EVENT_BYTES`` (the default): a step of 64 stores of 64 KiB rows, or 32 of 2 MiB, is not
    cut into more.  (On an H200 host, a chunk per 2 MiB made a step of 64 x 2 MiB cost the engine thread
    2.5 ms: 64 copy calls and 64 events; in chunks of 64 MiB it cost 0.3 ms.)"""
    assert n * row_bytes <= cuda_mod.EVENT_BYTES
    gpu, out = FakeGPU(), CompletionQueue()
    dev = torch.randint(0, 255, (n, row_bytes), dtype=torch.uint8)
    host = torch.zeros((first_slot + n, row_bytes), dtype=torch.uint8)
    mover = CudaMover([(dev, host)], out, 1, runtime=gpu)
    ts = [tr(STORE, [r], [first_slot + r]) for r in range(n)]
    for t in ts:
        mover.submit(t)
    mover.flush()
    (side,) = gpu.side
    assert kinds(side) == ["wait", "event", "copy", "event"] and gpu.calls == 1
    reps = done(gpu, mover, out)
    assert all(reps[t.token].ok for t in ts) and torch.equal(host[first_slot:], dev)


def test_scattered_slots_are_a_call_per_run_of_slots() -> None:
    """Slots 5 | 2 3 | 0 1: three runs, each with consecutive rows -- three copies, no gather."""
    gpu, out, dev, host, mover = bare()
    t = tr(STORE, [0, 1, 2, 3, 4], [5, 2, 3, 0, 1])
    mover.submit(t)
    mover.flush()
    (side,) = gpu.side
    assert kinds(side) == ["wait", "event", "copy", "copy", "copy", "event"] and gpu.calls == 3
    assert done(gpu, mover, out)[t.token].ok
    assert torch.equal(host[[5, 2, 3, 0, 1]], dev[:5])


def test_a_run_longer_than_the_staging_rows_is_gathered_a_stage_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_mod, "STAGE_BYTES", 16)      # two rows of 8 bytes
    gpu, out, dev, host, mover = bare()
    t = tr(STORE, [7, 5, 3, 1, 0], [1, 2, 3, 4, 5])
    u = tr(LOAD, [2, 4, 6], [6, 7, 0])                     # slots 6 7 | 0: a scatter of two rows, a copy of one
    want = host[[6, 7, 0]].clone()
    mover.submit(t)
    mover.submit(u)
    mover.flush()
    (side,) = gpu.side
    assert kinds(side) == ["wait", "event"] + ["gather", "copy"] * 3 + ["event"] + \
        ["wait", "event", "copy", "scatter", "copy", "event"]
    reps = done(gpu, mover, out)
    assert reps[t.token].ok and reps[u.token].ok
    assert torch.equal(host[1:6], dev[[7, 5, 3, 1, 0]]) and torch.equal(dev[[2, 4, 6]], want)


def test_stage_bytes_bounds_the_staging_rows_instead_of_the_module_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CudaMover(stage_bytes=...)`` (the bench's A/B of the staging size) sizes the staging rows: five
    scattered rows fit in 40 bytes, one gather and one copy, where the module's 16 would make three of each."""
    monkeypatch.setattr(cuda_mod, "STAGE_BYTES", 16)
    gpu, out, dev, host, mover = bare(stage_bytes=40)
    t = tr(STORE, [7, 5, 3, 1, 0], [1, 2, 3, 4, 5])
    mover.submit(t)
    mover.flush()
    (side,) = gpu.side
    assert kinds(side) == ["wait", "event", "gather", "copy", "event"]
    assert done(gpu, mover, out)[t.token].ok and torch.equal(host[1:6], dev[[7, 5, 3, 1, 0]])
    with pytest.raises(ValueError, match="stage_bytes"):
        CudaMover([(dev, host)], out, 1, runtime=gpu, stage_bytes=0)


def test_staging_rows_of_one_block_give_a_copy_per_range_of_consecutive_rows_and_slots() -> None:
    """Staging rows that hold one block: rows 4 5 | 0 1 into slots 0..3 are two copies of two blocks each
    (no index upload, no gather); a copy that cannot be queued fails only the transfers it carries."""
    gpu, out, dev, host, mover = bare(stage_bytes=8)
    t, u = tr(STORE, [4, 5], [0, 1]), tr(STORE, [0, 1], [2, 3])
    mover.submit(t)
    mover.submit(u)
    mover.flush()
    (side,) = gpu.side
    assert kinds(side) == ["wait", "event", "copy", "copy", "event"] and gpu.calls == 2
    reps = done(gpu, mover, out)
    assert reps[t.token].ok and reps[u.token].ok and torch.equal(host[:4], dev[[4, 5, 0, 1]])
    gpu, out, dev, host, mover = bare(stage_bytes=8)
    t, u = tr(STORE, [4, 5], [0, 1]), tr(STORE, [0, 1], [2, 3])
    gpu.copy_error, gpu.copy_error_skip = RuntimeError("CUDA error: injected"), 1
    mover.submit(t)
    mover.submit(u)
    mover.flush()
    reps = done(gpu, mover, out)
    assert reps[t.token].ok and not reps[u.token].ok and torch.equal(host[:2], dev[[4, 5]])


def test_planes_whose_host_rows_are_not_one_range_are_copied_block_by_block() -> None:
    """Two planes: one with its own host tensor (rows one range: batched), one a byte region of slab rows
    (the vLLM worker's layout: a copy per block), in one chunk."""
    gpu, out = FakeGPU(), CompletionQueue()
    dev_a = torch.arange(4 * 8, dtype=torch.uint8).view(4, 8)
    dev_b = torch.arange(100, 100 + 4 * 16, dtype=torch.uint8).view(4, 16)
    host_a = torch.zeros((4, 8), dtype=torch.uint8)
    slab = torch.zeros((4, 24), dtype=torch.uint8)
    mover = CudaMover([(dev_a, host_a), (dev_b, slab[:, 8:])], out, 1, runtime=gpu)
    t = tr(STORE, [3, 1], [0, 1])
    mover.submit(t)
    mover.flush()
    (side,) = gpu.side
    assert kinds(side) == ["wait", "event", "gather", "copy", "copy", "copy", "event"]
    (r,) = done(gpu, mover, out).values()
    assert r.ok and r.nbytes == 2 * 24
    assert torch.equal(host_a[:2], dev_a[[3, 1]]) and torch.equal(slab[:2, 8:], dev_b[[3, 1]])
    assert not slab[:, :8].any() and not slab[2:].any()


def test_each_stream_stages_in_its_own_rows() -> None:
    """Stores gathered on one stream, loads staged on the other, run interleaved: the loads' copy into their
    staging rows lands between the stores' gather and copy.  Staging rows shared by the streams would hand
    the stores the loads' bytes."""
    gpu, out, dev, host, mover = bare(streams=2)
    s0, s1 = gpu.side
    st = tr(STORE, [6, 4], [0, 1])
    ld = tr(LOAD, [1, 3], [4, 5])
    want_host, want_dev = dev[[6, 4]].clone(), host[4:6].clone()
    mover.submit(st)
    mover.submit(ld)
    mover.flush()
    assert kinds(s0) == ["wait", "event", "gather", "copy", "event"]
    assert kinds(s1) == ["wait", "event", "copy", "scatter", "event"]
    for _ in range(3):
        gpu.step(s0)                          # barrier, start, gather
    for _ in range(3):
        gpu.step(s1)                          # barrier, start, the loads' copy into staging rows
    reps = done(gpu, mover, out)
    assert reps[st.token].ok and reps[ld.token].ok
    assert torch.equal(host[:2], want_host) and torch.equal(dev[[1, 3]], want_dev)


def test_a_transfer_spanning_chunks_is_batched_in_each_and_reported_once_after_the_last() -> None:
    gpu, out, dev, host, mover = bare(event_bytes=16)     # two blocks per chunk
    t = tr(STORE, [4, 1, 6], [0, 1, 2])
    mover.submit(t)
    mover.flush()
    (side,) = gpu.side
    assert kinds(side) == ["wait", "event", "gather", "copy", "event", "copy", "event"]
    for _ in range(5):
        gpu.step(side)                        # up to the first end event
    mover.harvest()
    assert out.drain() == [] and mover.in_flight() == 1
    (r,) = done(gpu, mover, out).values()
    assert r.ok and r.nbytes == 24 and torch.equal(host[:3], dev[[4, 1, 6]])


def test_a_transfer_that_fails_in_one_chunk_takes_no_copies_in_the_next() -> None:
    gpu, out, dev, host, mover = bare(event_bytes=16)
    before = host.clone()
    t = tr(STORE, [4, 1, 6], [0, 1, 2])
    u = tr(STORE, [7], [5])
    gpu.copy_error = RuntimeError("CUDA error: injected")  # the first chunk's gather
    mover.submit(t)
    mover.submit(u)
    mover.flush()
    (side,) = gpu.side
    assert kinds(side) == ["wait", "event", "event", "copy", "event"]   # t's last block not copied; u's is
    gpu.step(side)
    gpu.step(side)
    gpu.step(side)                            # the first end event: t is answered there
    mover.harvest()
    (r,) = out.drain()
    assert r.token == t.token and not r.ok and "injected" in (r.error or "")
    reps = done(gpu, mover, out)
    assert reps[u.token].ok and set(reps) == {u.token}
    assert torch.equal(host[5], dev[7]) and torch.equal(host[:3], before[:3])   # t's slots untouched


# ----------------------------------------------------------------------------- partial failures
# T1, T2: slots 0 1, rows 3 1 (one gathered run: index upload, gather, copy); T3: slots 4 5, rows 5 6 (a copy);
# T4: slot 7, row 7 (a copy).  Each case fails one call and names the transfers that call carries.
CASES = {
    "index": ("index_error", 0, {0, 1}),
    "gather": ("copy_error", 0, {0, 1}),
    "copy after gather": ("copy_error", 1, {0, 1}),
    "straight copy": ("copy_error", 2, {2}),
    "last copy": ("copy_error", 3, {3}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_call_that_cannot_be_queued_fails_exactly_the_transfers_it_carries(case: str) -> None:
    what, skip, failing = CASES[case]
    gpu, out, dev, host, mover = bare()
    before = host.clone()
    ts = [tr(STORE, [3], [0]), tr(STORE, [1], [1]), tr(STORE, [5, 6], [4, 5]), tr(STORE, [7], [7])]
    for t in ts:
        mover.submit(t)
    setattr(gpu, what, RuntimeError("CUDA error: injected"))
    setattr(gpu, f"{what}_skip", skip)
    mover.flush()
    assert getattr(gpu, what) is None, "the injected error was not met"
    assert out.drain() == [] and mover.in_flight() == 4   # every transfer waits for the end event
    reps = done(gpu, mover, out)
    assert set(reps) == {t.token for t in ts}
    for i, t in enumerate(ts):
        r = reps[t.token]
        assert r.ok is (i not in failing), (case, i, r)
        got, want = host[t.slots], (before if i in failing else dev)[t.slots if i in failing else t.rows]
        assert torch.equal(got, want), (case, i)
        if not r.ok:
            assert "injected" in (r.error or "")
    assert mover.in_flight() == 0


def test_a_failed_index_upload_fails_the_gathered_runs_and_the_next_chunk_tries_again() -> None:
    gpu, out, dev, host, mover = bare(event_bytes=16)
    a, b = tr(LOAD, [2, 0], [0, 1]), tr(LOAD, [5, 3], [2, 3])   # a chunk each, both gathered
    want = host[2:4].clone()
    gpu.index_error = RuntimeError("CUDA error: injected")
    mover.submit(a)
    mover.submit(b)
    mover.flush()
    reps = done(gpu, mover, out)
    assert not reps[a.token].ok and reps[b.token].ok and torch.equal(dev[[5, 3]], want)
    assert torch.equal(dev[[2, 0]], torch.arange(64, dtype=torch.uint8).view(8, 8)[[2, 0]])


# ----------------------------------------------------------------------------- random batches
def _writes(op: tuple[Any, ...], dev: torch.Tensor, host: torch.Tensor) -> set[tuple[str, int]]:
    """The rows (``("dev", r)``/``("host", s)``) a queued operation writes when it runs (staging rows: none)."""
    def rows_of(t: torch.Tensor) -> set[tuple[str, int]]:
        for name, base in (("dev", dev), ("host", host)):
            lo = base.data_ptr()
            if lo <= t.data_ptr() < lo + base.numel():
                r0 = (t.data_ptr() - lo) // 8
                return {(name, r) for r in range(r0, r0 + t.numel() * t.element_size() // 8)}
        return set()
    if op[0] == "copy":
        return rows_of(op[1])
    if op[0] == "scatter":
        return {("dev", int(r)) for r in op[2].tolist()}
    return set()


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(data=st.data(), streams=st.integers(1, 2), per_event=st.integers(1, 5), stage=st.integers(1, 4),
       seed=st.integers(0, 2 ** 16))
def test_random_batches_answer_every_transfer_once_after_its_copies_and_move_the_right_bytes(
        data: st.DataObject, streams: int, per_event: int, stage: int, seed: int) -> None:
    """Random stores and loads over distinct rows and slots (batched as they come: runs straight, gathered,
    scattered), a random call failing, the streams run in a random interleaving with harvests between:

    * every transfer is answered exactly once, and never while an operation that writes its destination
      is still queued (a fence lifted or a slot freed under a landing copy);
    * an ok store's slots hold its rows' bytes, an ok load's rows its slots' bytes; the bytes of rows and
      slots no transfer names never change;
    * the transfer carrying the failed call is answered failed."""
    rows_n = slots_n = 24
    old = cuda_mod.STAGE_BYTES
    cuda_mod.STAGE_BYTES = stage * 8
    try:
        gpu, out, dev, host, mover = bare(rows_n, slots_n, streams, event_bytes=per_event * 8)
        dev0, host0 = dev.clone(), host.clone()
        rows_left = data.draw(st.permutations(range(rows_n)), label="rows")
        slot_order = data.draw(st.sampled_from(("ascending", "random")), label="slots")
        slots_left = list(range(slots_n)) if slot_order == "ascending" else \
            data.draw(st.permutations(range(slots_n)), label="slot order")
        ts: list[Transfer] = []
        while rows_left and len(ts) < 8:
            n = data.draw(st.integers(1, min(4, len(rows_left))), label="blocks")
            kind = data.draw(st.sampled_from((STORE, LOAD)), label="kind")
            ts.append(tr(kind, rows_left[:n], slots_left[:n]))
            rows_left, slots_left = rows_left[n:], slots_left[n:]
        fail_at = data.draw(st.one_of(st.none(), st.integers(0, 6)), label="failing call")
        if fail_at is not None:
            gpu.copy_error, gpu.copy_error_skip = RuntimeError("CUDA error: injected"), fail_at
        for t in ts:
            mover.submit(t)
        mover.flush()
        met = fail_at is not None and gpu.copy_error is None
        rng = random.Random(seed)
        answered: dict[Any, Report] = {}
        while True:
            mover.harvest()
            for r in out.drain():
                assert r.token not in answered, "answered twice"
                answered[r.token] = r
                t = next(t for t in ts if t.token == r.token)
                dst = {("host", s) for s in t.slots} if t.kind is STORE else {("dev", r_) for r_ in t.rows}
                pending = set().union(*(_writes(op, dev, host) for s in gpu.side for op in s.ops))
                assert not dst & pending, f"{t} answered while a copy into it is still queued"
            ready = gpu.runnable()
            if not ready:
                break
            for _ in range(rng.randint(1, 4)):
                if not gpu.step(rng.choice(ready)):
                    break
        assert set(answered) == {t.token for t in ts} and mover.in_flight() == 0
        assert gpu.idle
        if met:
            assert any(not r.ok for r in answered.values()), "the failed call failed no transfer"
        else:
            assert all(r.ok for r in answered.values())
        named_rows = {r for t in ts for r in t.rows}
        named_slots = {s for t in ts for s in t.slots}
        for t in ts:
            if not answered[t.token].ok:
                continue
            if t.kind is STORE:
                assert torch.equal(host[t.slots], dev0[t.rows]), t
            else:
                assert torch.equal(dev[t.rows], host0[t.slots]), t
        untouched_rows = [r for r in range(rows_n) if r not in named_rows]
        untouched_slots = [s for s in range(slots_n) if s not in named_slots]
        assert torch.equal(dev[untouched_rows], dev0[untouched_rows])
        assert torch.equal(host[untouched_slots], host0[untouched_slots])
    finally:
        cuda_mod.STAGE_BYTES = old


def test_the_per_block_path_is_one_copy_per_block() -> None:
    """``batched=False`` (the benchmarks' per-block comparison): the same transfers, a copy each."""
    gpu, out, dev, host, mover = bare(batched=False)
    t = tr(STORE, [5, 2, 7], [0, 1, 2])
    mover.submit(t)
    mover.flush()
    (side,) = gpu.side
    assert kinds(side) == ["wait", "event", "copy", "copy", "copy", "event"]
    assert done(gpu, mover, out)[t.token].ok and torch.equal(host[:3], dev[[5, 2, 7]])


# ----------------------------------------------------------------------------- blocks the staging rows hold one of
def _big_rows(n: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(39)
    dev = torch.randint(0, 255, (n, row), dtype=torch.uint8, generator=gen)
    host = torch.randint(0, 255, (n, row), dtype=torch.uint8, generator=gen)
    return dev, host


@pytest.mark.parametrize("kind", [STORE, LOAD])
def test_blocks_over_half_a_stage_are_not_staged_a_row_at_a_time(kind: JobKind) -> None:
    """Blocks of 8 MiB (any block over STAGE_BYTES / 2) out of device order into consecutive slots, at the
    default EVENT_BYTES/STAGE_BYTES: a chunk holds 8 such blocks but the staging rows hold one, and a gather
    (or scatter) and a copy per block, serialized on that row, plus the index upload, would cost more calls
    than the per-block path.  Each block is one range on both sides: one direct copy each.  (Found by a
    review: with 64 MiB chunks these blocks went through the staging row, 3.6 ms of engine CPU per H200
    step of 64 shuffled 8 MiB stores.)"""
    row, n = 8 << 20, 4
    assert cuda_mod.STAGE_BYTES // row <= 1   # the staging rows hold one such block
    order = [3, 1, 0, 2]                                     # rows out of order, slots consecutive

    def run(batched: bool) -> tuple[int, list[str], torch.Tensor, torch.Tensor, bool]:
        dev, host = _big_rows(n, row)
        want_host, want_dev = host.clone(), dev.clone()
        if kind is STORE:
            want_host[0:n] = dev[order]
        else:
            want_dev[order] = host[0:n]
        gpu, out = FakeGPU(), CompletionQueue()
        mover = CudaMover([(dev, host)], out, 1, runtime=gpu, batched=batched)
        t = tr(kind, order, list(range(n)))
        mover.submit(t)
        mover.flush()
        (side,) = gpu.side
        ops = kinds(side)
        calls = gpu.calls
        reps = done(gpu, mover, out)
        ok = reps[t.token].ok and torch.equal(host, want_host) and torch.equal(dev, want_dev)
        return calls, ops, host, dev, ok

    per_block_calls, _, _, _, ok_pb = run(False)
    calls, ops, _, _, ok = run(True)
    assert ok_pb and ok
    assert per_block_calls == n
    assert calls <= per_block_calls and "gather" not in ops and "scatter" not in ops, \
        f"batched path: {calls} calls {ops} for {n} blocks of 8 MiB; the per-block path: {per_block_calls}"


# ----------------------------------------------------------------------------- TorchCuda's ordering event
class _CudaLikeEvent:
    """torch.cuda.Event as CUDA specifies it for order_after: ``record(s)`` captures ``s``'s work queued so far
    (overwriting the previous capture); a ``wait`` takes the capture current *at the call*, unaffected by a
    later record (cudaEventRecord / cudaStreamWaitEvent)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        self.capture: Any = None

    def record(self, stream: FakeStream) -> None:
        self.capture = (stream, stream.queued)


class _CudaLikeStream(FakeStream):
    def wait_event(self, ev: _CudaLikeEvent) -> None:
        other, upto = ev.capture
        self.push(("wait", other, upto))


class _GPUWithTorchOrdering(FakeGPU):
    """The simulated device, with ``order_after`` being TorchCuda's own (its cached, re-recorded event)."""

    def __init__(self, rng: Any) -> None:
        super().__init__(rng)
        from tiered_kv.movers.torch_cuda import TorchCuda
        self._tc = TorchCuda()

    def new_stream(self, device: Any) -> FakeStream:
        s = _CudaLikeStream(self, f"side{len(self.streams)}")
        self.streams.append(s)
        return s

    def order_after(self, stream: FakeStream, other: FakeStream) -> None:
        self._tc.order_after(stream, other)


@pytest.mark.parametrize("seed", range(4))
def test_torch_cudas_reused_ordering_event_orders_every_batch_after_the_engines_work(
        monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """TorchCuda.order_after (one event per copy stream, re-recorded per batch) under CUDA's event semantics:
    several batches flushed before the device runs anything, each behind engine work (a write before a store,
    a read before a load); whatever order the streams then run in, no store copies a row before the engine's
    write queued ahead of its flush, and no load lands before the engine's read queued ahead of its flush."""
    monkeypatch.setattr(torch.cuda, "Event", _CudaLikeEvent)
    rng = random.Random(seed)
    gpu = _GPUWithTorchOrdering(rng)
    out = CompletionQueue()
    n = 12
    dev = torch.zeros((n, 8), dtype=torch.uint8)
    host = torch.full((n, 8), 200, dtype=torch.uint8)
    mover = CudaMover([(dev, host)], out, 2, runtime=gpu, batch_max=64)
    reads: list[tuple[int, list[int]]] = []
    stores: list[tuple[Transfer, int]] = []
    for b in range(n // 2):
        r_store, r_load = 2 * b, 2 * b + 1

        def write(r: int = r_store, v: int = b + 1) -> None:
            dev[r].fill_(v)
        gpu.kernel(write)
        seen: list[int] = []

        def read(r: int = r_load, seen: list[int] = seen) -> None:
            seen.append(int(dev[r][0]))
        gpu.kernel(read)
        reads.append((r_load, seen))
        t = tr(STORE, [r_store], [r_store])
        stores.append((t, b + 1))
        mover.submit(t)
        mover.submit(tr(LOAD, [r_load], [r_load]))
        mover.flush()
    # the streams in a random order, the copy streams ahead of the engine's wherever they may go
    while gpu.step(next((s for s in gpu.side if s.runnable()), None)) or gpu.step():
        pass
    mover.harvest()
    reps = {r.token: r for r in out.drain()}
    assert len(reps) == n and all(r.ok for r in reps.values())
    for r, seen in reads:
        assert seen == [0], "a load landed before the engine's read queued ahead of its flush"
    for t, v in stores:
        assert int(host[t.slots[0]][0]) == v, "a store copied its row before the engine's write"
