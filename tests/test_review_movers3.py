"""Adversarial review, second pass, of the movers: ``tiered_kv/movers/cuda.py`` (on the simulated device of
``tests/fake_cuda.py``), ``tiered_kv/movers/native.py`` and the vLLM worker's copier
(``tiered_kv/integrations/copier.py`` over ``integrations/slab.py``).

What it proved wrong, each pinned by a test that failed before its fix, one a line (1-4 are fixed by one
handler in ``_queue_on_stream`` that, whatever point an exception reaches, waits for the stream once a copy may
be on it, keeps every chunk with an end event exactly once and answers every transfer in none of them):

1. cuda.py:CudaMover.flush/_queue_on_stream: an interrupt at _queue_on_stream's entry, in order_after/the start record, or in its broken-context log write answered none of that direction's transfers.
2. cuda.py:CudaMover._queue_on_stream: its failure handler logged before it synchronized, answered and pended `last`: an interrupt in that log write lost the open chunk's and the last closed chunk's transfers.
3. cuda.py:CudaMover._queue_on_stream.close cleared `dirty` before the closed chunk was kept: an interrupt there lost the chunk, pended the previous one twice and failed a spanning load while its copy was queued.
4. cuda.py:CudaMover.harvest popped a reached chunk before putting its reports: an interrupt in between lost every report of the chunk.
5. native.py:NativeMover._start appended the batch to _inflight outside its try: an interrupt right after left an unlaunched batch never answered, and close() spun for ever.
6. cuda.py:CudaMover._queue_copies failed a whole staged run when a later stage's call failed: transfers wholly in earlier stages, whose copies land, were answered failed.
7. cuda.py:CudaMover (per-block path) copied planes with copy_ between different element types (no byte view, or batched=False): values converted (bf16/fp8 -> int16/int8), reported ok; such a plane is refused now, as ThreadMover refuses it (``base.byte_rows``, shared).
8. CudaMover's gathered run truncated a row 1.5 in its index upload (``torch.tensor``): row 1's bytes copied, reported ok; the
   upload now goes through ``array("q")``, which refuses it (the call is not queued: its transfers fail).  The rows' types
   are not checked per transfer on the engine thread's path (it cost 1-9 us a transfer).
9. thread.py:screen/native.py:NativeMover: a transfer whose rows are not ints made flush() raise TypeError (or failed the launch) and failed every good transfer of the flush; now it is answered alone (a refused launch starts each transfer again alone).
10. copier.py:SlabCopier.close set _closed before closing the mover: after an interrupted close, a retried close() returned with the copy still queued and its ring unmarked.

Also pinned here (plain tests, guarantees checked and found to hold): byte-exact copies of bf16/fp8 rows with
NaN payloads where a byte view fits; the CUDA copier over two KV tensors at unaligned byte regions of rank 1,
with jobs spanning chunks, run in a seeded random device order, marks each job once and only after its copies
landed; a job whose copy fails on one plane only is marked failed while the rest of its batch is ok.

Interleavings are forced by the fake device's controls, injected faults and interrupts at chosen calls (the
moment CPython raises a pending KeyboardInterrupt: once a C call returns or a Python function is entered);
no sleeps, no timing asserts.
"""

from __future__ import annotations

import collections
import logging
import random
import uuid
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry

from fake_cuda import FakeGPU, FakeStream
from test_cuda_batched_edges import addrs as _addrs   # the byte addresses a tensor covers
from test_native_mover import _Deferred, _rows
from tiered_kv.integrations import copier as copier_mod
from tiered_kv.integrations.copier import SlabCopier
from tiered_kv.integrations.slab import SharedSlab
from tiered_kv.jobs import JobKind
from tiered_kv.metrics import Metrics
from tiered_kv.movers import CompletionQueue, CudaMover, NativeMover, Report, ThreadMover, Transfer
from tiered_kv.movers import cuda as cuda_mod

pytestmark = pytest.mark.timeout(120)

STORE, LOAD = JobKind.STORE, JobKind.LOAD
ERR = RuntimeError("CUDA error: injected")


# ----------------------------------------------------------------------------- helpers
def tr(kind: JobKind, rows: list[Any], slots: list[Any]) -> Transfer:
    return Transfer(uuid.uuid4(), kind, list(rows), list(slots))


def queued_writes(gpu: FakeGPU) -> set[int]:
    """Byte addresses that operations still queued on a copy stream will write (a scatter: its rows)."""
    out: set[int] = set()
    for s in gpu.side:
        for op in s.ops:
            if op[0] in ("copy", "gather"):
                out |= _addrs(op[1])
            elif op[0] == "scatter":
                for r in op[2].tolist():
                    out |= _addrs(op[1][r])
    return out


class LoggedQueue(CompletionQueue):
    """Records each report with the addresses the device still had queued to write when it was put."""

    def __init__(self, gpu: FakeGPU) -> None:
        super().__init__()
        self.gpu = gpu
        self.log: list[tuple[Report, set[int]]] = []

    def put(self, item: Any) -> None:
        self.log.append((item, queued_writes(self.gpu)))
        super().put(item)

    def answers(self) -> dict[Any, list[Report]]:
        out: dict[Any, list[Report]] = {}
        for r, _ in self.log:
            out.setdefault(r.token, []).append(r)
        return out


def rig(gpu: FakeGPU, rows: int = 8, streams: int = 1, **kw: Any) -> tuple[LoggedQueue, torch.Tensor, torch.Tensor,
                                                                             CudaMover]:
    out = LoggedQueue(gpu)
    dev = torch.arange(rows * 8, dtype=torch.uint8).view(rows, 8)
    host = (torch.arange(rows * 8, dtype=torch.int64) + 128).to(torch.uint8).view(rows, 8)
    return out, dev, host, CudaMover([(dev, host)], out, streams, runtime=gpu, **kw)


def settle(gpu: FakeGPU, mover: CudaMover) -> None:
    """The owner goes on after an interrupt: the device finishes, it harvests, then closes the mover."""
    for _ in range(3):
        gpu.run_all()
        mover.harvest()
    mover.close()


def dst(t: Transfer, dev: torch.Tensor, host: torch.Tensor) -> set[int]:
    out: set[int] = set()
    for r, s in zip(t.rows, t.slots):
        out |= _addrs(host[s] if t.kind is STORE else dev[r])
    return out


def assert_each_answered_once_after_its_copies(out: LoggedQueue, dev: torch.Tensor, host: torch.Tensor,
                                               ts: list[Transfer]) -> None:
    got = out.answers()
    missing = [i for i, t in enumerate(ts) if t.token not in got]
    assert missing == [], f"transfers never answered: {missing}"
    twice = [i for i, t in enumerate(ts) if len(got[t.token]) > 1]
    assert twice == [], f"transfers answered more than once: {twice}"
    for i, t in enumerate(ts):
        for r, pending in out.log:
            if r.token == t.token:
                assert not (dst(t, dev, host) & pending), f"transfer {i} answered while a copy into it was queued"


class InterruptingHandler(logging.Handler):
    """A log write interrupted once (a Ctrl-C while the error is written to the terminal)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.armed = True

    def emit(self, record: logging.LogRecord) -> None:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt


class interrupting_log:
    def __init__(self, name: str) -> None:
        self.logger = logging.getLogger(name)
        self.handler = InterruptingHandler()

    def __enter__(self) -> InterruptingHandler:
        self.level, self.disabled = self.logger.level, self.logger.disabled
        self.logger.setLevel(logging.ERROR)
        self.logger.disabled = False
        self.logger.addHandler(self.handler)
        return self.handler

    def __exit__(self, *exc: Any) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
        self.logger.disabled = self.disabled


def metrics() -> Metrics:
    return Metrics(registry=CollectorRegistry(), namespace="t")


# ============================================================================= 1
class InterruptInOrderAfter(FakeGPU):
    """``order_after`` (TorchCuda's: a dict lookup, an event record and a wait, all Python calls) interrupted
    once its ``which``-th call queued the wait."""

    def __init__(self, which: int) -> None:
        super().__init__()
        self.which = which
        self.n = 0

    def order_after(self, stream: FakeStream, other: FakeStream) -> None:
        super().order_after(stream, other)
        self.n += 1
        if self.n == self.which:
            raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["entry", "order_after", "log of a broken context"])
def test_an_interrupt_before_a_direction_reaches_its_stream_still_answers_it(where: str,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    gpu: FakeGPU = InterruptInOrderAfter(which=2) if where == "order_after" else FakeGPU()
    out, dev, host, mover = rig(gpu, streams=2)
    ts = [tr(STORE, [0], [0]), tr(STORE, [1], [1]), tr(LOAD, [5], [5])]
    for t in ts:
        mover.submit(t)
    if where == "entry":                   # the interrupt raised as the loads' _queue_on_stream is entered
        real = mover._queue_on_stream
        calls = [0]

        def entered(group: list[Transfer], store: bool) -> None:
            calls[0] += 1
            if calls[0] == 2:
                raise KeyboardInterrupt
            real(group, store)

        monkeypatch.setattr(mover, "_queue_on_stream", entered)
        with pytest.raises(KeyboardInterrupt):
            mover.flush()
        monkeypatch.setattr(mover, "_queue_on_stream", real)
    elif where == "order_after":           # the loads' barrier: the second order_after of the flush
        with pytest.raises(KeyboardInterrupt):
            mover.flush()
    else:                                  # a broken context: order_after raises, its log write is interrupted
        state = {"armed": True}
        real_order = mover._order_after

        def broken(stream: FakeStream, other: FakeStream) -> None:
            if state["armed"]:
                state["armed"] = False
                raise ERR
            real_order(stream, other)

        monkeypatch.setattr(mover, "_order_after", broken)     # the runtime's call, as the mover holds it
        with interrupting_log("tiered_kv.movers.cuda"), pytest.raises(KeyboardInterrupt):
            mover.flush()
    settle(gpu, mover)
    assert_each_answered_once_after_its_copies(out, dev, host, ts)


# ============================================================================= 2
def test_an_interrupt_while_a_failed_record_is_logged_loses_no_transfer() -> None:
    gpu = FakeGPU()
    out, dev, host, mover = rig(gpu, event_bytes=1)      # a chunk (end event) per block
    ts = [tr(STORE, [i], [i]) for i in range(3)]
    for t in ts:
        mover.submit(t)
    gpu.record_error, gpu.record_error_skip = ERR, 3     # start, end 1, end 2 recorded; end 3 fails
    with interrupting_log("tiered_kv.movers.cuda"), pytest.raises(KeyboardInterrupt):
        mover.flush()
    settle(gpu, mover)
    assert_each_answered_once_after_its_copies(out, dev, host, ts)


# ============================================================================= 3
class _ChunkInterrupted(cuda_mod._Chunk):
    """``_Chunk`` whose ``nth`` construction is interrupted on entry (where CPython raises a pending signal)."""

    __slots__ = ()
    nth = 0
    made = 0

    def __init__(self, start: Any) -> None:
        type(self).made += 1
        if type(self).made == type(self).nth:
            raise KeyboardInterrupt
        super().__init__(start)


@pytest.mark.parametrize("nth,kinds", [(2, "stores, one chunk"), (3, "loads over three chunks")])
def test_an_interrupt_as_a_closed_chunk_is_kept_loses_and_doubles_nothing(nth: int, kinds: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGPU()
    if nth == 2:
        out, dev, host, mover = rig(gpu)
        ts = [tr(STORE, [0], [0]), tr(STORE, [1], [1])]
    else:
        out, dev, host, mover = rig(gpu, event_bytes=1)
        ts = [tr(LOAD, [0], [0]), tr(LOAD, [1, 2], [1, 2])]    # the second spans chunks 2 and 3
    for t in ts:
        mover.submit(t)
    monkeypatch.setattr(_ChunkInterrupted, "nth", nth)
    monkeypatch.setattr(_ChunkInterrupted, "made", 0)
    monkeypatch.setattr(cuda_mod, "_Chunk", _ChunkInterrupted)
    with pytest.raises(KeyboardInterrupt):
        mover.flush()
    monkeypatch.setattr(cuda_mod, "_Chunk", _ChunkInterrupted.__mro__[1])
    settle(gpu, mover)
    assert_each_answered_once_after_its_copies(out, dev, host, ts)
    pool = [id(e) for e in mover._events]
    assert len(pool) == len(set(pool)), "an event is in the pool twice: two later chunks would share it"


# ============================================================================= 4
def test_an_interrupt_between_popping_a_reached_chunk_and_its_reports_loses_none(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGPU()
    out, dev, host, mover = rig(gpu)
    ts = [tr(STORE, [0], [0]), tr(LOAD, [4], [4])]
    for t in ts:
        mover.submit(t)
    mover.flush()
    gpu.run_all()
    real = cuda_mod._put_all
    state = {"armed": True}

    def entered(put: Any, reps: list[Report]) -> None:
        if state["armed"]:
            state["armed"] = False
            raise KeyboardInterrupt          # raised as _put_all is entered
        real(put, reps)

    monkeypatch.setattr(cuda_mod, "_put_all", entered)
    with pytest.raises(KeyboardInterrupt):
        mover.harvest()
    settle(gpu, mover)
    assert_each_answered_once_after_its_copies(out, dev, host, ts)


# ============================================================================= 5
class _AppendInterrupted(collections.deque):
    """``NativeMover._inflight`` whose next append is interrupted right after it returned."""

    armed = True

    def append(self, x: Any) -> None:
        super().append(x)
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt


def test_an_interrupt_right_after_the_batch_is_recorded_in_flight_still_answers_it() -> None:
    launch = _Deferred()
    dev, host = _rows(8, 16, 41), _rows(8, 16, 42)
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=64, launch_fn=launch)
    m._inflight = _AppendInterrupted(m._inflight)
    try:
        m.submit(Transfer("l", LOAD, [5], [1]))
        with pytest.raises(KeyboardInterrupt):
            m.flush()
        assert launch.pending() == [], "nothing was launched"
        for _ in range(3):
            m.harvest()
        answered = [r.token for r in q.drain()]
        stuck = [b for b in m._inflight if not b.futs]
        assert answered == ["l"] and stuck == [], (
            f"answered {answered}; {len(stuck)} unlaunched batch(es) left in flight: close() would never return")
    finally:
        m._inflight = collections.deque(b for b in m._inflight if b.futs)
        launch.close(m)


# ============================================================================= 6
@pytest.mark.parametrize("kind", [STORE, LOAD])
def test_a_call_failing_mid_run_fails_only_the_transfers_it_carries(kind: JobKind) -> None:
    gpu = FakeGPU()
    out, dev, host, mover = rig(gpu, stage_bytes=16)     # staging rows of 2 blocks (8-byte rows)
    t1, t2 = tr(kind, [5, 3], [0, 1]), tr(kind, [6, 1], [2, 3])   # one run of slots, rows gathered: 2 stages
    mover.submit(t1)
    mover.submit(t2)
    gpu.copy_error, gpu.copy_error_skip = ERR, 2        # the first stage's two calls go; the second's first fails
    mover.flush()
    assert gpu.copy_error is None
    settle(gpu, mover)
    got = out.answers()
    if kind is STORE:
        assert torch.equal(host[0:2], dev[[5, 3]]), "t1's copies landed"
    else:
        assert torch.equal(dev[[5, 3]], host[0:2]), "t1's copies landed"
    assert not got[t2.token][0].ok
    assert got[t1.token][0].ok, f"t1 had no block in the failed call: {got[t1.token][0].error}"


# ============================================================================= 7
@pytest.mark.parametrize("dtype,host_dtype", [(torch.bfloat16, torch.int16), (torch.float8_e4m3fn, torch.int8)])
@pytest.mark.parametrize("layout,batched", [("transposed", True), ("transposed", False), ("contiguous", False)])
def test_a_plane_that_cannot_be_copied_byte_for_byte_is_refused_not_converted(dtype: torch.dtype,
                                                                              host_dtype: torch.dtype,
                                                                              layout: str, batched: bool) -> None:
    """``transposed``: device rows (4, 2) of strides (8, 1, 4), no byte view: ThreadMover refuses the plane.
    ``contiguous`` with ``batched=False``: byte views fit (ThreadMover copies bytes), but the per-block path
    copies the planes as given, element by element."""
    base = (torch.arange(4 * 8, dtype=torch.float32).view(4, 2, 4) * 0.37 + 0.5).to(dtype)
    dev = base.transpose(1, 2) if layout == "transposed" else base.transpose(1, 2).contiguous()
    host = torch.zeros((4, 4, 2), dtype=host_dtype)
    if layout == "transposed":
        with pytest.raises(ValueError):
            ThreadMover([(dev, host)], CompletionQueue(), 1)     # the CPU mover refuses it
    gpu, out = FakeGPU(), CompletionQueue()
    try:
        mover = CudaMover([(dev, host)], out, 1, runtime=gpu, batched=batched)
    except ValueError:
        return                                 # refused as well: fixed
    t = tr(STORE, [1], [2])
    mover.submit(t)
    mover.flush()
    gpu.run_all()
    mover.harvest()
    (r,) = out.drain()
    same = torch.equal(host[2].contiguous().view(torch.uint8), dev[1].contiguous().view(torch.uint8))
    assert same or not r.ok, f"reported ok with converted values: {host[2].flatten().tolist()}"


# ============================================================================= 8
def test_a_row_that_is_not_an_int_is_never_copied_from_another_row() -> None:
    gpu = FakeGPU()
    out, dev, host, mover = rig(gpu)
    good, bad = tr(STORE, [5], [0]), tr(STORE, [1.5], [1])    # one run of slots 0, 1: rows 5, 1.5 gathered
    mover.submit(good)
    mover.submit(bad)
    mover.flush()
    settle(gpu, mover)
    got = out.answers()
    assert not got[bad.token][0].ok, "a transfer naming row 1.5 was copied from row 1 and reported ok"
    # the row numbers of the gathered call are refused (array("q")): the call is not queued, and the mover's
    # contract fails every transfer with a block in it -- never one reported ok over bytes it did not copy
    assert not got[good.token][0].ok or torch.equal(host[0], dev[5])


# ============================================================================= 9
@pytest.mark.parametrize("bad_rows", [[None], ["2"], [1.5]])
def test_a_malformed_transfer_is_answered_alone_by_the_native_mover(bad_rows: list[Any]) -> None:
    dev, host = _rows(8, 16, 51), _rows(8, 16, 52)
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=64)      # the compiled launcher (its argument types checked)
    ts = [Transfer("g1", STORE, [0], [0]), Transfer("bad", STORE, bad_rows, [1]), Transfer("g2", STORE, [2], [2])]
    raised: Optional[BaseException] = None
    try:
        for t in ts:
            m.submit(t)
        try:
            m.flush()
        except Exception as exc:   # noqa: BLE001 - the defect: the manager's poll would raise
            raised = exc
    finally:
        m.close()
    got = {r.token: r.ok for r in q.drain()}
    assert raised is None, f"flush() raised {raised!r}"
    assert got == {"g1": True, "bad": False, "g2": True}
    assert torch.equal(host[0], dev[0]) and torch.equal(host[2], dev[2])


# ============================================================================= 10
def _sim_copier(slab: SharedSlab, tensors: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch, rank: int = 0,
                event_bytes: int = cuda_mod.EVENT_BYTES, batch_max: int = 1,
                gpu: Optional[FakeGPU] = None) -> tuple[SlabCopier, FakeGPU]:
    gpu = gpu if gpu is not None else FakeGPU()
    monkeypatch.setattr(copier_mod, "_copy_mover", lambda planes, out, b: CudaMover(
        planes, out, num_streams=1, runtime=gpu, batch_max=b, event_bytes=event_bytes))
    return SlabCopier(slab, rank, tensors, metrics=metrics(), batch_max=batch_max), gpu


@pytest.fixture
def slab(tmp_path: Path):
    s = SharedSlab.open(tmp_path / "m3.slab", 8, 64, 1)
    yield s
    s.close()


def test_a_retried_copier_close_after_an_interrupt_lands_and_marks_the_copies(slab: SharedSlab,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    kv = torch.randint(-128, 127, (8, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(61))
    c, gpu = _sim_copier(slab, [kv], monkeypatch)
    assert c.submit(1, b"s" * 16, 5, True, [3], [2])
    assert c.finished() == []                          # started: on the copy stream, not run
    (side,) = gpu.side
    real = side.synchronize
    state = {"armed": True}

    def sync() -> None:
        if state["armed"]:
            state["armed"] = False
            raise KeyboardInterrupt                    # a Ctrl-C as the worker shuts down
        real()

    monkeypatch.setattr(side, "synchronize", sync)
    with pytest.raises(KeyboardInterrupt):
        c.close()
    try:
        c.close()                                      # the shutdown path closes again
        assert gpu.idle, "close() returned with the job's copy still queued on the device"
        assert slab.done(5) and slab.ok(5)
        assert torch.equal(slab.rows[2], kv[3].view(torch.uint8))
    finally:
        gpu.run_all()


# ============================================================================= guarantees that hold
def test_bf16_and_fp8_rows_with_nan_payloads_are_copied_byte_for_byte() -> None:
    """Where a byte view fits (contiguous rows), bf16 and fp8 device rows beside uint8 host rows move as bits:
    NaN payloads, -0.0 and subnormals come back unchanged through a store and a load, over two planes of
    different widths (bf16 rows of 6 bytes, fp8 rows of 5 bytes: byte views, not 8-byte words)."""
    gen = torch.Generator().manual_seed(71)
    bits16 = torch.randint(0, 1 << 16, (6, 3), generator=gen, dtype=torch.int32).to(torch.int16)
    bits16[0, 0] = 0x7FC1                        # a quiet NaN with a payload
    bits16[0, 1] = -0x8000                       # -0.0
    bits8 = torch.randint(0, 256, (6, 5), generator=gen, dtype=torch.int32).to(torch.uint8)
    bits8[0, 0] = 0x7F                           # fp8 e4m3fn NaN
    d16 = bits16.view(torch.bfloat16).clone()
    d8 = bits8.view(torch.float8_e4m3fn).clone()
    h16 = torch.zeros((6, 6), dtype=torch.uint8)
    h8 = torch.zeros((6, 5), dtype=torch.uint8)
    want16, want8 = d16.view(torch.uint8).clone(), d8.view(torch.uint8).clone()
    gpu, out = FakeGPU(), CompletionQueue()
    mover = CudaMover([(d16, h16), (d8, h8)], out, 2, runtime=gpu, event_bytes=16)
    s = tr(STORE, [4, 0, 2], [1, 2, 3])
    mover.submit(s)
    mover.flush()
    gpu.run_all()
    mover.harvest()
    d16.view(torch.uint8).zero_()
    d8.view(torch.uint8).zero_()
    ld = tr(LOAD, [5, 1, 3], [1, 2, 3])
    mover.submit(ld)
    mover.flush()
    gpu.run_all()
    mover.harvest()
    mover.close()
    assert [r.ok for r in out.drain()] == [True, True]
    assert torch.equal(d16.view(torch.uint8)[[5, 1, 3]], want16[[4, 0, 2]])
    assert torch.equal(d8.view(torch.uint8)[[5, 1, 3]], want8[[4, 0, 2]])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cuda_copier_marks_each_job_once_after_its_copies_on_unaligned_regions_of_rank_1(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Two KV tensors of 20 and 44 bytes a block at byte regions 64..84 and 84..128 of rank 1's part (not 8-byte
    aligned: byte views); a batch of stores and loads spanning chunks of 2 blocks, run in a seeded random device
    order: each job is marked once, only once its copies landed, returned once, the bytes right, rank 0's part
    untouched."""
    rng = random.Random(seed)
    slab = SharedSlab.open(tmp_path / "r1.slab", 8, 128, 2)
    try:
        gen = torch.Generator().manual_seed(seed)
        a = torch.randint(-128, 127, (8, 20), dtype=torch.int8, generator=gen)
        b = torch.randint(-128, 127, (8, 44), dtype=torch.int8, generator=gen)
        slab.rows.copy_(torch.randint(0, 256, slab.rows.shape, dtype=torch.uint8, generator=gen))
        rank0 = slab.rows[:, :64].clone()
        gpu = FakeGPU(rng=random.Random(seed))
        c, _ = _sim_copier(slab, [a, b], monkeypatch, rank=1, event_bytes=2 * 64, batch_max=16, gpu=gpu)
        assert c.block_bytes == 64

        def region(slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            return slab.rows[slots, 64:84], slab.rows[slots, 84:128]

        # stores of blocks 0..4 to slots 0..4 in scattered order; loads of slots 5..7 into blocks 5..7
        jobs: dict[int, tuple[bool, list[int], list[int]]] = {
            1: (True, [3, 0, 4], [0, 1, 2]), 2: (True, [1, 2], [4, 3]),
            3: (False, [7, 5, 6], [5, 6, 7])}
        src = {j: (a[r].clone(), b[r].clone()) if st else (slab.rows[s, 64:84].clone(), slab.rows[s, 84:128].clone())
               for j, (st, r, s) in jobs.items()}
        seq_of = {1: 11, 2: 12, 3: 13}
        landed: list[tuple[int, bool]] = []
        real_mark = slab.mark_done

        def mark(rank: int, seq: int, ok: bool = True) -> None:
            j = next(j for j, s in seq_of.items() if s == seq)
            st, r, s = jobs[j]
            if st:
                ra, rb = region(s)
                here = torch.equal(ra, a[r].view(torch.uint8)) and torch.equal(rb, b[r].view(torch.uint8))
            else:
                here = torch.equal(a[r].view(torch.uint8), src[j][0]) and torch.equal(b[r].view(torch.uint8), src[j][1])
            landed.append((seq, here))
            real_mark(rank, seq, ok)

        monkeypatch.setattr(slab, "mark_done", mark)
        for j, (st, r, s) in jobs.items():
            assert c.submit(j, bytes([j]) * 16, seq_of[j], st, r, s)
        results = c.finished()
        while not gpu.idle:
            for _ in range(rng.randint(1, 3)):
                gpu.step()
            results += c.finished()
        results += c.finished()
        assert sorted((r.job_id, r.ok) for r in results) == [(1, True), (2, True), (3, True)]
        assert sorted(landed) == [(11, True), (12, True), (13, True)]
        assert torch.equal(slab.rows[:, :64], rank0)
        c.close()
    finally:
        slab.close()


def test_a_copier_job_failing_on_one_plane_only_is_marked_failed_and_its_batch_neighbours_ok(
        slab: SharedSlab, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two KV tensors (two planes); the second plane's copy of job 2 cannot be queued: job 2 is marked failed in the
    ring (never published by the scheduler), jobs 1 and 3 of the same batch ok, each marked once after the end
    event; nothing is answered before it.  (The planes copied block by block: a device whose index ops on column
    slices of staging rows failed the mover's probe.  tests/test_cuda_groups.py has the same through the staging
    rows.)"""
    a = torch.randint(-128, 127, (8, 24), dtype=torch.int8, generator=torch.Generator().manual_seed(81))
    b = torch.randint(-128, 127, (8, 40), dtype=torch.int8, generator=torch.Generator().manual_seed(82))
    gpu = FakeGPU()
    gpu.strided_ok = False
    c, gpu = _sim_copier(slab, [a, b], monkeypatch, batch_max=8, gpu=gpu)
    marks: list[tuple[int, bool]] = []
    real = slab.mark_done
    monkeypatch.setattr(slab, "mark_done", lambda rank, seq, ok=True: (marks.append((seq, ok)), real(rank, seq, ok)))
    for j in (1, 2, 3):
        assert c.submit(j, bytes([j]) * 16, 20 + j, True, [j], [j])
    # per plane, block by block (the slab regions are not one range): plane 0 copies 3 blocks, then plane 1's
    gpu.copy_error, gpu.copy_error_skip = ERR, 4        # plane 1, block of job 2
    assert c.finished() == [] and marks == []
    assert gpu.copy_error is None
    gpu.run_all()
    got = sorted((r.job_id, r.ok) for r in c.finished())
    assert got == [(1, True), (2, False), (3, True)]
    assert sorted(marks) == [(21, True), (22, False), (23, True)]
    assert slab.done(22) and not slab.ok(22) and slab.ok(21) and slab.ok(23)
    for j in (1, 3):
        assert torch.equal(slab.rows[j, :24], a[j].view(torch.uint8))
        assert torch.equal(slab.rows[j, 24:64], b[j].view(torch.uint8))
    c.close()
