"""Review of the CUDA mover (``tiered_kv/movers/cuda.py``) and how ``TierManager`` drives it, on the simulated
device of ``tests/fake_cuda.py``.

What it proved wrong, each pinned by a test that failed before its fix: a KeyboardInterrupt inside
``flush()`` left most of the batch never answered (jobs hung, rows fenced, slots leased for good), and
one between two reports of a finished chunk lost the rest of the chunk's; a transfer whose rows are not
ints was never answered; ``num_streams=0`` was accepted; a promote that outlasted ``close()``'s wait
handed its load to the closed mover, whose copy reached the device after ``close()`` returned and was
never reported.  The other tests pin tricky behaviours that are correct and would fail if they broke.  Every ordering
is forced with the fake device's controls (no sleeps decide an interleaving).
"""

from __future__ import annotations

import uuid
from typing import Any, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry

import tiered_kv.manager as manager_mod
from fake_cuda import FakeGPU, FakeStream
from fakes import ROW_BYTES, fill_row, make_config, make_kv, mgr_metric, reported, row_matches
from tiered_kv import TierManager
from tiered_kv.jobs import JobKind
from tiered_kv.movers import CompletionQueue, CudaMover, Report, Transfer

STORE, LOAD = JobKind.STORE, JobKind.LOAD
A, B, C = b"key-A", b"key-B", b"key-C"


# ----------------------------------------------------------------------------- helpers
class CheckedQueue(CompletionQueue):
    """Records every report as the mover puts it, and what the device still had queued to write then."""

    def __init__(self, gpu: FakeGPU) -> None:
        super().__init__()
        self.gpu = gpu
        self.log: list[tuple[Report, set[int]]] = []   # (report, addresses queued ops still write)
        self.interrupt_after: Optional[int] = None      # raise KeyboardInterrupt once, after this many more puts

    def put(self, item: Any) -> None:
        self.log.append((item, queued_writes(self.gpu)))
        super().put(item)
        if self.interrupt_after is not None:
            if self.interrupt_after <= 1:
                self.interrupt_after = None
                raise KeyboardInterrupt   # a signal handled right after the report was queued
            self.interrupt_after -= 1

    def answered(self) -> dict[Any, list[Report]]:
        out: dict[Any, list[Report]] = {}
        for r, _ in self.log:
            out.setdefault(r.token, []).append(r)
        return out


def _addrs(t: torch.Tensor) -> set[int]:
    """Byte addresses of a tensor (any strides)."""
    base, es = t.data_ptr(), t.element_size()
    if t.numel() == 0:
        return set()
    idx = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        idx = idx.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    out: set[int] = set()
    for e in idx.reshape(-1).tolist():
        out.update(range(base + e * es, base + (e + 1) * es))
    return out


def queued_writes(gpu: FakeGPU) -> set[int]:
    """Addresses a copy/gather/scatter still queued on a side stream will write (a scatter: its whole target)."""
    out: set[int] = set()
    for s in gpu.side:
        for op in s.ops:
            if op[0] in ("copy", "gather", "scatter"):
                out |= _addrs(op[1])
    return out


def dst_addrs(t: Transfer, dev: torch.Tensor, host: torch.Tensor) -> set[int]:
    out: set[int] = set()
    for r, s in zip(t.rows, t.slots):
        out |= _addrs(host[s] if t.kind is STORE else dev[r])
    return out


class InterruptAfterCopy(FakeGPU):
    """A device whose ``after``-th copy call (0-based) is queued, then a KeyboardInterrupt is raised: what a
    Ctrl-C arriving during ``copy_(non_blocking=True)`` does (CPython raises it once the C call returned)."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.kb_after: Optional[int] = after

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: FakeStream) -> None:
        super().copy(dst, src, stream)
        if self.kb_after is not None:
            if self.kb_after == 0:
                self.kb_after = None
                raise KeyboardInterrupt
            self.kb_after -= 1


def rig(gpu: FakeGPU, rows: int = 8, streams: int = 1, **kw: Any) -> tuple[CheckedQueue, torch.Tensor, torch.Tensor,
                                                                               CudaMover]:
    """A CudaMover alone on ``gpu``: ``rows`` device rows of 8 distinct bytes, as many host slots of others."""
    out = CheckedQueue(gpu)
    dev = torch.arange(rows * 8, dtype=torch.uint8).view(rows, 8)
    host = (torch.arange(rows * 8, dtype=torch.int64) + 128).to(torch.uint8).view(rows, 8)
    return out, dev, host, CudaMover([(dev, host)], out, streams, runtime=gpu, **kw)


def tr(kind: JobKind, rows: list[Any], slots: list[Any]) -> Transfer:
    return Transfer(uuid.uuid4(), kind, rows, slots)


def assert_none_early(out: CheckedQueue, dev: torch.Tensor, host: torch.Tensor, ts: list[Transfer]) -> None:
    """No transfer was answered while a queued operation still wrote its destination."""
    by_token = {t.token: t for t in ts}
    for r, pending in out.log:
        t = by_token.get(r.token)
        if t is not None:
            assert not (dst_addrs(t, dev, host) & pending), f"{t} answered while a copy of it was still queued"


def cuda_manager(rows: int = 16, slots: int = 8, streams: int = 2, event_bytes: int = 64 << 20,
                 **cfg: Any) -> tuple[TierManager, torch.Tensor, FakeGPU, CudaMover]:
    gpu = FakeGPU()
    made: list[CudaMover] = []

    def factory(dev: torch.Tensor, host: torch.Tensor, out: Any) -> CudaMover:
        made.append(CudaMover([(dev, host)], out, streams, runtime=gpu, event_bytes=event_bytes))
        return made[0]

    kv = make_kv(rows)
    mgr = TierManager(make_config(host_slots=slots, **cfg), kv, registry=CollectorRegistry(), mover_factory=factory)
    return mgr, kv, gpu, made[0]


def disk_manager_with_a_on_disk_only(tmp_path: Any) -> tuple[TierManager, torch.Tensor, FakeGPU, CudaMover]:
    """A manager on the fake device with a 2-slot host tier over a disk tier (in-process threads); A, B, C
    stored, A evicted from the host tier and ready on disk only."""
    mgr, kv, gpu, mover = cuda_manager(rows=8, slots=2, streams=1, disk_path=str(tmp_path / "d"),
                                       disk_capacity_bytes=16 * ROW_BYTES, disk_io="thread")
    for i, k in enumerate((A, B, C)):
        fill_row(kv, i, k)
        job = mgr.store(k, i)
        assert job is not None
        assert reported(mgr.poll(), job) == []
        gpu.run_all()
        (c,) = reported(mgr.poll(), job)
        assert c.ok
        assert mgr.flush(timeout=30)          # durable on disk: its host slot may be evicted
    assert mgr.host_bytes(A) is None and mgr.lookup([A]) == 1
    return mgr, kv, gpu, mover


# ============================================================================= defects, fixed
def test_an_interrupt_while_a_batch_is_queued_still_answers_every_transfer_once_after_its_copies() -> None:
    gpu = InterruptAfterCopy(after=2)                     # the third block copy is queued, then Ctrl-C
    out, dev, host, mover = rig(gpu, streams=2, event_bytes=1, batched=False)   # a chunk (end event) per block
    stores = [tr(STORE, [i], [i]) for i in range(4)]
    loads = [tr(LOAD, [4], [4]), tr(LOAD, [5], [5])]
    ts = stores + loads
    for t in ts:
        mover.submit(t)
    with pytest.raises(KeyboardInterrupt):
        mover.flush()
    # the owner goes on (the engine caught the interrupt, or close() runs): the device finishes, it harvests
    for _ in range(3):
        gpu.run_all()
        mover.harvest()
    mover.close()
    answered = out.answered()
    assert_none_early(out, dev, host, ts)
    missing = [i for i, t in enumerate(ts) if t.token not in answered]
    assert missing == [], f"transfers never answered: {missing}"
    assert all(len(v) == 1 for v in answered.values())
    assert mover.in_flight() == 0


def test_an_interrupt_between_two_reports_of_a_chunk_loses_none_of_them() -> None:
    gpu = FakeGPU()
    out, dev, host, mover = rig(gpu)
    ts = [tr(STORE, [i], [i]) for i in range(3)]      # one chunk, one end event
    for t in ts:
        mover.submit(t)
    mover.flush()
    gpu.run_all()
    out.interrupt_after = 1                            # Ctrl-C right after the chunk's first report was queued
    with pytest.raises(KeyboardInterrupt):
        mover.harvest()
    mover.harvest()
    mover.close()
    answered = out.answered()
    assert [t.token in answered for t in ts] == [True, True, True]
    assert all(torch.equal(host[i], dev[i]) for i in range(3))


def test_a_malformed_transfer_is_answered_failed_like_any_other() -> None:
    gpu = FakeGPU()
    out, dev, host, mover = rig(gpu)
    good1, bad, good2 = tr(STORE, [0], [0]), tr(STORE, [None], [1]), tr(STORE, [2], [2])
    for t in (good1, bad, good2):
        mover.submit(t)
    mover.flush()                                      # never raised (CudaMover's contract)
    gpu.run_all()
    mover.harvest()
    answered = out.answered()
    assert set(answered) == {good1.token, bad.token, good2.token}
    assert [len(answered[t.token]) for t in (good1, bad, good2)] == [1, 1, 1]
    assert not answered[bad.token][0].ok


def test_no_copy_stream_is_rejected_at_construction() -> None:
    gpu = FakeGPU()
    dev = torch.zeros((4, 8), dtype=torch.uint8)
    host = torch.zeros((4, 8), dtype=torch.uint8)
    with pytest.raises(ValueError, match="num_streams"):
        CudaMover([(dev, host)], CompletionQueue(), num_streams=0, runtime=gpu)


@pytest.mark.disk_threads
def test_close_never_returns_with_a_load_copy_still_to_land(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr, kv, gpu, mover = disk_manager_with_a_on_disk_only(tmp_path)
    mgr.disk.start_reads = lambda *a, **k: None        # a slow disk: the promote's read waits (readers.stop() runs it)
    assert mgr.free_block(5)
    job = mgr.load(A, 5)
    assert job is not None
    assert reported(mgr.poll(), job) == []
    # the disk is slower than close's bound on waiting for promotes (CLOSE_TIMEOUT_S, 30 s): shortened here
    monkeypatch.setattr(manager_mod, "CLOSE_TIMEOUT_S", 0.05)
    mgr.close()
    still = [op[0] for s in gpu.side for op in s.ops]
    assert still == [] and mover.in_flight() == 0, f"close() returned with {still} queued for row 5"
    assert job.state.terminal


# ============================================================================= correct behaviours (guards)
@pytest.mark.parametrize("where", ["query", "elapsed_time"])
def test_an_interrupt_in_the_event_query_leaves_the_chunk_to_the_next_harvest(where: str) -> None:
    """A KeyboardInterrupt from the end event's query (or the timing read) escapes harvest() with the chunk still
    pending: the next harvest answers each of its transfers exactly once, ok (popping it first would lose them)."""
    gpu = FakeGPU()
    out, dev, host, mover = rig(gpu, streams=2)
    ts = [tr(STORE, [0, 1], [3, 4]), tr(LOAD, [6], [6])]
    for t in ts:
        mover.submit(t)
    mover.flush()
    gpu.run_all()
    chunk = mover._pending[0][0]
    ev = chunk.end if where == "query" else chunk.start
    real = getattr(ev, where)
    calls = [0]

    def interrupted(*a: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt
        return real(*a)

    setattr(ev, where, interrupted)
    with pytest.raises(KeyboardInterrupt):
        mover.harvest()
    assert mover.in_flight() == 2
    mover.harvest()
    answered = out.answered()
    assert {t.token: [r.ok for r in answered.get(t.token, [])] for t in ts} == {ts[0].token: [True], ts[1].token: [True]}
    assert mover.in_flight() == 0
    assert torch.equal(host[3:5], dev[0:2]) and torch.equal(dev[6], host[6])


def test_a_store_reported_ok_across_chunks_and_streams_counts_its_bytes_once() -> None:
    """The manager's transfer_bytes_total: a store_many spanning three chunks (one event per block) and a
    load_many on the other stream count exactly their blocks' bytes, once each, whatever the chunking."""
    mgr, kv, gpu, mover = cuda_manager(event_bytes=1)
    keys = [b"s0", b"s1", b"s2"]
    for i, k in enumerate(keys):
        fill_row(kv, i, k)
    js = mgr.store_many(keys, [0, 1, 2])
    assert js is not None
    assert mgr.poll() == []
    gpu.run_all()
    (c,) = reported(mgr.poll(), js)
    assert c.ok
    assert mgr_metric(mgr, "tiered_kv_transfer_bytes_total", src="device", dst="host") == 3 * ROW_BYTES
    for r in (8, 9):
        assert mgr.free_block(r)
    jl = mgr.load_many(keys[:2], [9, 8])
    assert jl is not None
    assert mgr.poll() == []
    gpu.run_all()
    (c,) = reported(mgr.poll(), jl)
    assert c.ok and row_matches(kv, 9, b"s0") and row_matches(kv, 8, b"s1")
    assert mgr_metric(mgr, "tiered_kv_transfer_bytes_total", src="host", dst="device") == 2 * ROW_BYTES
    mgr.close()


def test_a_freed_row_of_a_load_on_the_device_stays_fenced_until_its_event_even_when_another_stream_finishes_first() -> None:
    """Two batches on two streams; the later one (a store) completes first.  The load of the earlier batch, whose
    row was freed meanwhile, is reported only at its own end event: the row stays fenced (free_block False,
    store/load raise) across polls that apply the other stream's report."""
    from tiered_kv.errors import BlockBusyError
    mgr, kv, gpu, mover = cuda_manager(streams=2)
    fill_row(kv, 0, A)
    ja = mgr.store(A, 0)
    assert ja is not None
    mgr.poll()
    gpu.run_all()
    mgr.poll()
    assert mgr.free_block(4)
    jl = mgr.load(A, 4)                    # its own flush: stream 1
    assert jl is not None and mgr.poll() == []
    fill_row(kv, 1, B)
    jb = mgr.store(B, 1)                   # the next flush: stream 0
    assert jb is not None and mgr.poll() == []
    s0, s1 = gpu.side
    assert any(op[0] == "copy" for op in s1.ops) and any(op[0] == "copy" for op in s0.ops)
    assert mgr.free_block(4) is False      # cancels the load; its copy is on the device
    gpu.run(gpu.compute)
    gpu.run(s0)                            # the store's batch finishes first
    comps = mgr.poll()
    assert [c.job for c in comps] == [jb]
    assert mgr.free_block(4) is False
    with pytest.raises(BlockBusyError):
        mgr.store(C, 4)
    gpu.run(s1)
    (c,) = reported(mgr.poll(), jl)
    assert not c.ok and "cancelled" in (c.error or "")
    assert row_matches(kv, 4, A)           # the copy landed before the fence was lifted
    assert mgr.free_block(4) is True
    mgr.close()


@pytest.mark.disk_threads
def test_close_waits_for_a_promote_then_lands_its_load_before_returning(tmp_path: Any) -> None:
    """The in-bound twin of the xfail above: a load waiting for its promote at close() is copied and its copy has
    landed in the row when close() returns; nothing is left on the device."""
    mgr, kv, gpu, mover = disk_manager_with_a_on_disk_only(tmp_path)
    assert mgr.free_block(5)
    job = mgr.load(A, 5)                   # its promote is held until the next pass starts the reads
    assert job is not None
    mgr.close()
    assert gpu.idle and mover.in_flight() == 0
    assert job.state.terminal and job.error is None
    assert row_matches(kv, 5, A)
