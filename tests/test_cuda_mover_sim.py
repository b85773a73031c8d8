"""``CudaMover`` and the manager on a simulated device (tests/fake_cuda.py): the CUDA path's logic in CI.

The simulated device runs each queued operation only when the test says so,
so every ordering question is forced, not hoped for: a copy queued behind the
engine's work cannot run before it; a test runs one stream and not another; a
seeded scheduler runs the streams in random interleavings.  A copy moves the
bytes when it runs, so a copy that ran too early is seen as wrong bytes.
``tests/test_cuda.py`` runs the same questions on a real GPU where there is one.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Any, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry

from fake_cuda import FakeGPU
from fakes import ROW_BYTES, content, fill_row, host_matches, make_config, make_kv, mgr_metric, reported, row_matches
from tiered_kv import TierManager
from random_engine import random_engine
from tiered_kv.jobs import JobKind
from tiered_kv.movers import EVENT_BYTES, CompletionQueue, CudaMover, Transfer

STALE = "tiered_kv_stale_callbacks_total"
A, B, C = b"key-A", b"key-B", b"key-C"


def make(rows: int = 32, slots: int = 16, streams: int = 2, rng: Optional[random.Random] = None,
         progress: bool = False, batch: int = 64, event_bytes: int = EVENT_BYTES,
         batched: bool = True) -> tuple[TierManager, torch.Tensor, FakeGPU, CudaMover]:
    """The manager on the simulated device.  Its rows are 128 bytes, so by default a batch's copies share
    one end event; ``event_bytes=1`` gives each copy its own."""
    gpu = FakeGPU(rng, progress_on_query=progress)
    made: list[CudaMover] = []

    def factory(dev: torch.Tensor, host: torch.Tensor, out: Any) -> CudaMover:
        made.append(CudaMover([(dev, host)], out, streams, runtime=gpu, batch_max=batch, event_bytes=event_bytes,
                              batched=batched))
        return made[0]

    kv = make_kv(rows)
    mgr = TierManager(make_config(host_slots=slots), kv, registry=CollectorRegistry(), mover_factory=factory)
    return mgr, kv, gpu, made[0]


def bare(rows: int, streams: int = 1, **kw: Any) -> tuple[FakeGPU, CompletionQueue, torch.Tensor, torch.Tensor,
                                                           CudaMover]:
    """A CudaMover alone on the simulated device: ``rows`` device rows of 8 distinct bytes each, as many
    zeroed host slots; ``kw`` goes to the mover."""
    gpu, out = FakeGPU(), CompletionQueue()
    dev = torch.arange(rows * 8, dtype=torch.uint8).view(rows, 8)
    host = torch.zeros((rows, 8), dtype=torch.uint8)
    return gpu, out, dev, host, CudaMover([(dev, host)], out, streams, runtime=gpu, **kw)


def stores(n: int) -> list[Transfer]:
    """Stores of rows 0..n-1 into slots 0..n-1."""
    return [Transfer(uuid.uuid4(), JobKind.STORE, [r], [r]) for r in range(n)]


def in_host(mgr: TierManager, gpu: FakeGPU, kv: torch.Tensor, key: bytes, row: int) -> None:
    """``key`` computed into ``row`` (already on the device) and stored; the device left idle."""
    fill_row(kv, row, key)
    job = mgr.store(key, row)
    assert job is not None
    assert reported(mgr.poll(), job) == []   # on the device now
    gpu.run_all()
    (c,) = reported(mgr.poll(), job)
    assert c.ok


# ----------------------------------------------------------------------------- ordering
def test_store_copy_waits_for_the_engines_queued_write() -> None:
    mgr, kv, gpu, _ = make()
    gpu.kernel(lambda: fill_row(kv, 3, A))   # the engine's write of row 3, not run yet
    job = mgr.store(A, 3)
    assert job is not None
    assert reported(mgr.poll(), job) == []   # the poll puts the copy on the device
    assert sum(len(s.ops) for s in gpu.side) == 4   # wait, start event, copy, end event
    assert all(gpu.run(s) == 0 for s in gpu.side)   # the copy cannot start before the write
    gpu.run(gpu.compute)
    gpu.run_all()
    (c,) = reported(mgr.poll(), job)
    assert c.ok
    assert host_matches(mgr, A, kv) is True
    mgr.close()


def test_load_copy_waits_for_the_engines_queued_read() -> None:
    mgr, kv, gpu, _ = make()
    in_host(mgr, gpu, kv, A, 0)
    fill_row(kv, 6, B)
    out = torch.empty_like(kv[6])
    gpu.kernel(lambda: out.copy_(kv[6]))     # queued before the engine gave row 6 up: reads B
    assert mgr.free_block(6) is True
    job = mgr.load(A, 6)
    assert job is not None
    assert reported(mgr.poll(), job) == []
    assert sum(len(s.ops) for s in gpu.side) == 4
    assert all(gpu.run(s) == 0 for s in gpu.side)   # the load cannot overwrite the row under the read
    gpu.run_all()
    assert torch.equal(out, content(B))
    assert row_matches(kv, 6, A)
    (c,) = reported(mgr.poll(), job)
    assert c.ok
    mgr.close()


def test_cancelled_load_is_reported_only_after_its_copy_ran() -> None:
    mgr, kv, gpu, _ = make()
    in_host(mgr, gpu, kv, A, 0)
    gpu.kernel(lambda: None)                 # engine work the copy queues behind
    job = mgr.load(A, 9)
    assert job is not None
    assert reported(mgr.poll(), job) == []   # its copy is on the device now
    mgr.cancel(job)
    assert mgr.free_block(9) is False
    assert reported(mgr.poll(), job) == []
    gpu.run(gpu.compute)
    assert reported(mgr.poll(), job) == []   # its copy has not run: the row can still be written
    assert mgr.free_block(9) is False
    gpu.run_all()
    (c,) = reported(mgr.poll(), job)
    assert not c.ok and (c.error or "").startswith("cancelled")
    assert mgr.free_block(9) is True
    assert mgr_metric(mgr, STALE, kind="load", reason="cancelled") == 1
    assert mgr.jobs_in_flight == 0
    mgr.close()


def test_each_stream_reports_in_order_and_streams_report_independently() -> None:
    mgr, kv, gpu, mover = make(streams=2, batch=1)   # each copy on the device in its own call
    for row, key in enumerate((A, B, C)):
        fill_row(kv, row, key)
    ja, jb, jc = (mgr.store(k, r) for r, k in enumerate((A, B, C)))   # A, C on stream 0; B on stream 1
    s0, s1 = gpu.side
    gpu.run(s1)
    assert [c.job for c in mgr.poll()] == [jb]
    for _ in range(4):                      # stream 0: wait, start event, copy, end event of A
        assert gpu.step(s0)
    assert [c.job for c in mgr.poll()] == [ja]
    gpu.run_all()
    assert [c.job for c in mgr.poll()] == [jc]
    assert all(host_matches(mgr, k, kv) for k in (A, B, C))
    mgr.close()


def test_events_are_recycled_and_a_recycled_event_is_not_reported_early() -> None:
    mgr, kv, gpu, mover = make(streams=1, batch=1)
    in_host(mgr, gpu, kv, A, 0)
    assert len(gpu.events) == 2
    fill_row(kv, 1, B)
    jb = mgr.store(B, 1)                     # takes both recycled events
    assert jb is not None and len(gpu.events) == 2
    assert reported(mgr.poll(), jb) == []    # re-recorded: not complete until the device reaches them
    gpu.run_all()
    (c,) = reported(mgr.poll(), jb)
    assert c.ok and host_matches(mgr, B, kv) is True
    for i in range(100):                     # 4 in flight at most: never more than 8 events made
        keys = [f"r{i}-{j}".encode() for j in range(4)]
        for j, k in enumerate(keys):
            fill_row(kv, 2 + j, k)
            assert mgr.store(k, 2 + j) is not None
        gpu.run_all()
        assert len(mgr.poll()) == 4
    assert len(gpu.events) <= 8
    assert mover.in_flight() == 0
    mgr.close()


def test_a_transfer_cancelled_before_submit_is_answered_without_a_copy() -> None:
    """The Mover protocol's hint: a transfer already marked cancelled queues nothing on the device."""
    gpu, out, _, host, mover = bare(2)
    t = Transfer(uuid.uuid4(), JobKind.STORE, [0], [0], cancelled=True)
    mover.submit(t)
    assert out.drain() == [] and mover.in_flight() == 1
    mover.harvest()
    (r,) = out.drain()
    assert r.token == t.token and not r.ok and "cancelled" in (r.error or "")
    assert gpu.idle and mover.in_flight() == 0 and gpu.events == [] and not host.any()   # no copy made


# ----------------------------------------------------------------------------- batches
def test_store_and_load_queue_nothing_on_the_device_until_a_poll() -> None:
    """store()/load() make no CUDA call; the poll puts the batch on the device behind one barrier."""
    mgr, kv, gpu, mover = make(streams=2, event_bytes=1)
    in_host(mgr, gpu, kv, A, 0)
    n_events, n_batches = len(gpu.events), len(gpu.batches)
    keys = [f"b{i}".encode() for i in range(5)]
    for i, k in enumerate(keys):
        gpu.kernel(lambda i=i, k=k: fill_row(kv, 1 + i, k))
        assert mgr.store(k, 1 + i) is not None
    assert mgr.free_block(20) is True
    jl = mgr.load(A, 20)
    assert jl is not None
    assert gpu.idle is False and all(not s.ops for s in gpu.side)   # only the engine's kernels
    assert len(gpu.events) == n_events and mover.in_flight() == 6
    assert mgr.poll() == []
    s_store, s_load = gpu.batches[n_batches:]          # stores on one stream, loads on the other
    assert s_store is not s_load
    assert [op[0] for op in s_store.ops] == ["wait", "event"] + ["copy", "event"] * 5
    assert [op[0] for op in s_load.ops] == ["wait", "event", "copy", "event"]
    assert len(gpu.events) == n_events + 6            # two recycled, six new: 1 + 5 and 1 + 1
    gpu.run_all()
    comps = mgr.poll()
    assert sorted(c.job.key for c in comps) == sorted(keys + [A]) and all(c.ok for c in comps)
    assert all(host_matches(mgr, k, kv) for k in keys) and row_matches(kv, 20, A)
    assert mover.in_flight() == 0
    mgr.close()


def test_batch_max_puts_the_batch_on_the_device_from_submit() -> None:
    mgr, kv, gpu, mover = make(streams=1, batch=3, event_bytes=1)
    for i in range(3):
        fill_row(kv, i, f"m{i}".encode())
        assert mgr.store(f"m{i}".encode(), i) is not None
        assert len(gpu.batches) == (1 if i == 2 else 0)
    (side,) = gpu.side
    assert [op[0] for op in side.ops] == ["wait", "event"] + ["copy", "event"] * 3
    gpu.run_all()
    assert len(mgr.poll()) == 3
    mgr.close()


def test_each_copy_is_timed_from_the_event_before_it() -> None:
    """One end event per copy, each timed from the previous one of its batch: a copy's seconds are its own."""
    gpu, out, dev, host, mover = bare(4, event_bytes=1)
    ts = [Transfer(uuid.uuid4(), JobKind.STORE, [r], [3 - r]) for r in range(4)]
    for t in ts:
        mover.submit(t)
    mover.flush()
    gpu.run_all()
    mover.harvest()
    reps = out.drain()
    assert [r.token for r in reps] == [t.token for t in ts] and all(r.ok for r in reps)
    assert [round(r.seconds * 1e6) for r in reps] == [2, 2, 2, 2]   # its copy and its end event (1 us per op)
    assert torch.equal(host, dev.flip(0))
    assert len(gpu.events) == 5 and mover.in_flight() == 0
    for t in ts:                              # the next batch reuses all five events
        t.token = uuid.uuid4()
        mover.submit(t)
    mover.flush()
    assert len(gpu.events) == 5
    gpu.run_all()
    mover.harvest()
    assert len(out.drain()) == 4


@pytest.mark.parametrize("failing", [None, 1, 4])
def test_copies_share_an_end_event_per_event_bytes(failing: Optional[int]) -> None:
    """Rows of 8 bytes, an end event per 16 bytes, a copy per block: 5 copies -> events after copies 2, 4 and 5;
    the copies between two events are reported together, each timed as its share.  ``failing``: that copy
    cannot be queued: its transfer keeps its place in its chunk and is answered failed at the chunk's end
    event, after the chunk's copies; the rest of the batch goes on."""
    gpu, out, dev, host, mover = bare(8, event_bytes=16, batched=False)
    ts = stores(5)
    for t in ts:
        mover.submit(t)
    if failing is not None:
        gpu.copy_error, gpu.copy_error_skip = RuntimeError("CUDA error: injected"), failing
    mover.flush()
    (side,) = gpu.side
    chunks = [ts[0:2], ts[2:4], ts[4:5]]
    layout = ["wait", "event"]
    for c in chunks:
        layout += ["copy"] * sum(failing is None or t is not ts[failing] for t in c) + ["event"]
    assert [op[0] for op in side.ops] == layout
    assert out.drain() == [] and mover.in_flight() == 5   # nothing answered before its chunk's end event
    gpu.step(side)
    gpu.step(side)                            # the barrier and the start event
    for c in chunks:
        copied = [t for t in c if failing is None or t is not ts[failing]]
        for _ in copied:                      # the chunk's copies ran, not yet its end event: nothing reported
            gpu.step(side)
            mover.harvest()
            assert out.drain() == []
        gpu.step(side)                        # its end event
        mover.harvest()
        reps = out.drain()
        assert [r.token for r in reps] == [t.token for t in copied] + [t.token for t in c if t not in copied]
        assert [r.ok for r in reps] == [True] * len(copied) + [False] * (len(c) - len(copied))
        if failing is None:                   # copies and end event over the chunk's copies: 1.5 us, 2 us alone
            assert [round(r.seconds * 1e6, 6) for r in reps] == [1.5 if len(c) == 2 else 2.0] * len(c)
    assert all(torch.equal(host[t.slots[0]], dev[t.rows[0]]) for t in ts if failing is None or t is not ts[failing])
    assert failing is None or not host[ts[failing].slots[0]].any()
    assert mover.in_flight() == 0 and gpu.idle
    assert len(gpu.events) == 4
    for t in ts:                              # the next batch (5 copies: 4 events) reuses those
        t.token = uuid.uuid4()
        mover.submit(t)
    mover.flush()
    assert len(gpu.events) == 4



def test_an_end_event_that_cannot_be_recorded_answers_every_transfer_once() -> None:
    """Recording an end event fails mid-batch (a broken context): the copies before the last event that
    was recorded are reported when the device reaches it; those of the failed chunk, already queued, are
    answered failed once the stream has been synchronized (their copies have landed, or the context is
    broken and nothing runs), the rest of the batch at once -- every transfer exactly once, none raised."""
    gpu, out, dev, host, mover = bare(8, event_bytes=16)
    ts = stores(5)
    for t in ts:
        mover.submit(t)
    gpu.record_error, gpu.record_error_skip = RuntimeError("CUDA error: launch failure"), 2  # start, 1st end
    mover.flush()
    failed = out.drain()
    assert [r.token for r in failed] == [t.token for t in ts[2:]] and not any(r.ok for r in failed)
    assert mover.in_flight() == 2
    gpu.run_all()
    mover.harvest()
    done = out.drain()
    assert [r.token for r in done] == [t.token for t in ts[:2]] and all(r.ok for r in done)
    assert torch.equal(host[:2], dev[:2]) and mover.in_flight() == 0
    for t in ts:                              # the next batch goes through
        t.token = uuid.uuid4()
        mover.submit(t)
    mover.flush()
    gpu.run_all()
    mover.harvest()
    assert [r.ok for r in out.drain()] == [True] * 5 and torch.equal(host[:5], dev[:5])


def test_a_load_whose_end_event_cannot_be_recorded_is_fenced_until_its_queued_copy_has_landed() -> None:
    """The end event of a load's chunk fails to record after its copy was queued (a fault that is not
    sticky: later records work).  Answering the load at once would lift the row's fence while the copy
    can still land: the engine would write B into the row and the late copy would overwrite it with A.
    The mover synchronizes the stream before it answers, so the copy has landed first."""
    mgr, kv, gpu, mover = make()
    try:
        in_host(mgr, gpu, kv, b"A", 0)
        job = mgr.load(b"A", 5)
        assert job is not None
        gpu.record_error, gpu.record_error_skip = RuntimeError("CUDA error: injected"), 1   # start ok, end fails
        (c,) = reported(mgr.poll(), job)
        assert not c.ok and "injected" in c.error
        assert row_matches(kv, 5, b"A")            # the queued copy landed before the answer
        assert mgr.free_block(5) is True
        fill_row(kv, 5, b"B")                      # the engine reuses the row ...
        gpu.run_all()
        assert row_matches(kv, 5, b"B")            # ... and nothing of the failed load comes after
        assert mover.in_flight() == 0
    finally:
        mgr.close()


def test_a_store_whose_end_event_cannot_be_recorded_frees_its_slot_only_once_its_copy_has_landed() -> None:
    """The store variant: the failed store's slot is freed when it is answered and taken by the next store
    (B), whose copy goes to the other stream.  Had the failed copy still been queued, it would overwrite
    B's slot after B was published: B served with A's bytes."""
    mgr, kv, gpu, mover = make(streams=2)
    try:
        fill_row(kv, 1, b"A")
        ja = mgr.store(b"A", 1)
        assert ja is not None
        slot_a = mgr._index.get(b"A").slot
        gpu.record_error, gpu.record_error_skip = RuntimeError("CUDA error: injected"), 1
        (c,) = reported(mgr.poll(), ja)
        assert not c.ok
        fill_row(kv, 2, b"B")
        jb = mgr.store(b"B", 2)
        assert jb is not None and mgr._index.get(b"B").slot == slot_a
        mgr.poll()                                 # B's batch goes to the other stream
        gpu.run(gpu.compute)
        gpu.run(gpu.side[1])
        (cb,) = reported(mgr.poll(), jb)
        assert cb.ok and host_matches(mgr, b"B", kv) is True
        gpu.run_all()
        assert host_matches(mgr, b"B", kv) is True
    finally:
        mgr.close()


def test_a_record_failure_with_a_broken_context_answers_at_once() -> None:
    """When the stream cannot be synchronized either (a sticky error: nothing queued runs any more), the
    failed chunk is still answered, failed, in the same flush: the fault path never hangs."""
    gpu, out, dev, host, mover = bare(4)
    ts = stores(2)
    for t in ts:
        mover.submit(t)
    gpu.record_error, gpu.record_error_skip = RuntimeError("CUDA error: launch failure"), 1
    stream = mover._streams[0]

    def broken() -> None:
        raise RuntimeError("CUDA error: launch failure")
    stream.synchronize = broken                    # type: ignore[method-assign]
    mover.flush()
    got = out.drain()
    assert [r.token for r in got] == [t.token for t in ts] and not any(r.ok for r in got)
    assert mover.in_flight() == 0


def test_an_error_at_a_shared_event_fails_every_copy_behind_it() -> None:
    mgr, kv, gpu, mover = make(streams=1, event_bytes=2 * ROW_BYTES)
    keys = [f"e{i}".encode() for i in range(3)]
    for i, k in enumerate(keys):
        fill_row(kv, i, k)
    jobs = [mgr.store(k, i) for i, k in enumerate(keys)]
    assert mgr.poll() == []
    (first, second) = mover._pending[0]
    assert [t.rows for t in first.ended] == [[0], [1]] and [t.rows for t in second.ended] == [[2]]
    first.end.fail = RuntimeError("CUDA error: an illegal memory access was encountered")
    gpu.run_all()
    comps = mgr.poll()
    assert [c.job for c in comps] == jobs
    assert [c.ok for c in comps] == [False, False, True]
    assert mgr.lookup([keys[2]]) == 1 and mover.in_flight() == 0
    mgr.close()


def test_a_store_cancelled_while_queued_makes_no_copy() -> None:
    mgr, kv, gpu, mover = make()
    fill_row(kv, 4, A)
    job = mgr.store(A, 4)
    assert job is not None
    assert mgr.free_block(4) is True          # the engine reuses the row before any poll
    (c,) = reported(mgr.poll(), job)
    assert not c.ok and "source_reused" in (c.error or "")
    assert all(not s.ops for s in gpu.side) and mover.in_flight() == 0
    assert mgr_metric(mgr, STALE, kind="store", reason="source_reused") == 1
    assert mgr.lookup([A]) == 0 and mgr.debug_sizes()["host_used_slots"] == 0
    mgr.close()


def test_a_load_cancelled_while_queued_frees_its_row_at_the_next_poll() -> None:
    mgr, kv, gpu, mover = make()
    in_host(mgr, gpu, kv, A, 0)
    fill_row(kv, 9, B)
    job = mgr.load(A, 9)
    assert job is not None
    mgr.cancel(job)
    assert mgr.free_block(9) is False         # fenced until the mover has answered
    (c,) = reported(mgr.poll(), job)          # answered at the flush: no copy was made
    assert not c.ok and (c.error or "").startswith("cancelled")
    assert mgr.free_block(9) is True and row_matches(kv, 9, B)
    assert all(not s.ops for s in gpu.side)
    assert mgr_metric(mgr, STALE, kind="load", reason="cancelled") == 1
    mgr.close()


def test_a_batch_whose_stream_cannot_be_made_current_is_answered_failed() -> None:
    mgr, kv, gpu, mover = make(streams=1)
    keys = [f"f{i}".encode() for i in range(3)]
    for i, k in enumerate(keys):
        fill_row(kv, i, k)
        assert mgr.store(k, i) is not None
    gpu.switch_error = RuntimeError("CUDA error: invalid resource handle")
    comps = mgr.poll()
    assert sorted(c.job.key for c in comps) == keys and not any(c.ok for c in comps)
    assert all("invalid resource handle" in (c.error or "") for c in comps)
    assert mover.in_flight() == 0 and mgr.lookup(keys) == 0
    gpu.run_all()                             # the barrier and start event queued before the switch
    in_host(mgr, gpu, kv, keys[0], 0)         # the next batch works
    mgr.close()


def test_a_load_behind_a_promote_goes_to_the_device_in_the_same_poll(tmp_path: Any) -> None:
    """Loads submitted while reports are applied (behind a disk promote) are flushed at the end of
    that poll, not a step later."""
    gpu = FakeGPU()
    made: list[CudaMover] = []

    def factory(dev: torch.Tensor, host: torch.Tensor, out: Any) -> CudaMover:
        made.append(CudaMover([(dev, host)], out, 1, runtime=gpu))
        return made[0]

    kv = make_kv(8)
    cfg = make_config(host_slots=2, disk_path=str(tmp_path / "d"), disk_capacity_bytes=16 * ROW_BYTES)
    mgr = TierManager(cfg, kv, registry=CollectorRegistry(), mover_factory=factory)
    for i, k in enumerate((A, B, C)):         # A is evicted from the 2-slot host tier, kept on disk
        in_host(mgr, gpu, kv, k, i)
        mgr.flush(timeout=30)                 # its spill is durable: its slot can be evicted
    assert mgr.host_bytes(A) is None and mgr.lookup([A]) == 1
    assert mgr.free_block(5) is True
    job = mgr.load(A, 5)
    assert job is not None
    for _ in range(20_000):                   # until the disk reader's report is applied by a poll
        assert reported(mgr.poll(), job) == []
        assert made[0]._queued == []          # what that poll submitted, it put on the device
        if any(s.ops for s in gpu.side):
            break
        time.sleep(0.001)                     # waiting for the reader thread, not ordering anything
    assert any(s.ops for s in gpu.side), "the load behind the promote never reached the device"
    gpu.run_all()
    comps = mgr.wait([job], timeout=30)
    (c,) = reported(comps, job)
    assert c.ok and row_matches(kv, 5, A)
    mgr.close()


# ----------------------------------------------------------------------------- failures
@pytest.mark.parametrize("batched", [False, True])
def test_a_copy_that_cannot_be_queued_is_reported_failed(batched: bool) -> None:
    """A store's copy cannot be queued: the store fails at its chunk's end event (not before: nothing is
    answered while a copy of its chunk may still land), counted; the rest of the batch goes on -- the next
    copy call per block, the next run of slots batched (rows 1 and 2 are one run, row 9 another)."""
    mgr, kv, gpu, _ = make(batched=batched)
    fill_row(kv, 1, A)
    fill_row(kv, 2, B)
    fill_row(kv, 9, C)
    gpu.copy_error = RuntimeError("CUDA error: out of memory")
    job = mgr.store(A, 1)                    # no exception reaches the engine
    jb = mgr.store(B, 2)
    assert mgr.store(b"filler", 5) is not None and mgr.free_block(5)   # its slot is skipped: C's is no run with B's
    jc = mgr.store(C, 9)
    assert job is not None and jb is not None and jc is not None
    assert reported(mgr.poll(), job) == []
    gpu.run_all()
    comps = mgr.poll()
    (c,) = reported(comps, job)
    assert not c.ok and "copy failed" in (c.error or "") and "out of memory" in (c.error or "")
    assert mgr.lookup([A]) == 0
    (cb,) = reported(comps, jb)
    assert cb.ok is not batched              # per block its own copy; batched, in the failed call with A's
    assert host_matches(mgr, B, kv) is (True if cb.ok else None)
    (cc,) = reported(comps, jc)              # the rest of the batch went on
    assert cc.ok and host_matches(mgr, C, kv) is True
    assert mgr_metric(mgr, "tiered_kv_errors_total", tier="host", error="copy_failed") == 1 + batched
    in_host(mgr, gpu, kv, A, 1)              # the next copy works
    assert host_matches(mgr, A, kv) is True
    mgr.close()


def test_an_error_surfacing_at_the_event_query_is_reported_failed() -> None:
    mgr, kv, gpu, mover = make(streams=1, event_bytes=1)
    fill_row(kv, 2, A)
    fill_row(kv, 3, B)
    ja, jb = mgr.store(A, 2), mgr.store(B, 3)
    assert mgr.poll() == []
    end_of_a = mover._pending[0][0].end
    end_of_a.fail = RuntimeError("CUDA error: an illegal memory access was encountered")
    gpu.run_all()
    comps = mgr.poll()
    (ca,) = reported(comps, ja)
    (cb,) = reported(comps, jb)
    assert not ca.ok and "illegal memory access" in (ca.error or "")
    assert cb.ok and host_matches(mgr, B, kv) is True
    assert mgr.lookup([A]) == 0 and mover.in_flight() == 0
    mgr.close()


def test_a_recycled_event_whose_old_record_is_still_queued_reports_nothing_early() -> None:
    """A group with no copy to queue gives its start event back while that event's
    record is still queued on the stream; reused as another copy's end event, only its latest record
    counts (as with cudaEventRecord), so the copy is not reported before it ran.  Found by the state
    machine's random sweep (the simulated device then let any record complete the event)."""
    gpu, out, dev, host, mover = bare(4, streams=2, batch_max=1)
    s0, s1 = gpu.side
    gpu.kernel(lambda: None)
    t1 = Transfer(uuid.uuid4(), JobKind.LOAD, [0], [0, 1])
    mover.submit(t1)                          # s0: wait, start record; no copy (2 slots for 1 row): the start event is free
    t2 = Transfer(uuid.uuid4(), JobKind.STORE, [1], [1])
    mover.submit(t2)                          # s1: wait, start (the same event), copy, end
    gpu.run(gpu.compute)
    gpu.run(s1)
    mover.harvest()
    assert {r.token: r.ok for r in out.drain()} == {t1.token: False, t2.token: True}
    gpu.kernel(lambda: None)
    dev[2].fill_(7)
    t3 = Transfer(uuid.uuid4(), JobKind.STORE, [2], [2])
    mover.submit(t3)                          # s0 now: wait, old record, wait, start, copy, end
    gpu.run(s0)                               # runs the old record, stops at the second wait
    mover.harvest()
    assert out.drain() == [] and mover.in_flight() == 1 and host[2].sum() == 0
    gpu.run_all()
    mover.harvest()
    (r,) = out.drain()
    assert r.token == t3.token and r.ok and torch.equal(host[2], dev[2])


# ----------------------------------------------------------------------------- blocking calls
def test_wait_sees_the_device_advance_without_synchronizing() -> None:
    mgr, kv, gpu, _ = make(progress=True)
    for s in gpu.streams:
        s.synchronize = None  # type: ignore[assignment]  # wait() must not call it
    keys = [f"w{i}".encode() for i in range(8)]
    for i, k in enumerate(keys):
        gpu.kernel(lambda i=i, k=k: fill_row(kv, i, k))
        assert mgr.store(k, i) is not None
    comps = mgr.wait(timeout=30)
    assert sorted(c.job.key for c in comps) == sorted(keys) and all(c.ok for c in comps)
    assert all(host_matches(mgr, k, kv) for k in keys)
    for s in gpu.streams:
        del s.synchronize  # the class's again, for close()
    mgr.close()


def test_close_lets_queued_copies_finish() -> None:
    mgr, kv, gpu, _ = make()
    for i in range(6):
        fill_row(kv, i, f"c{i}".encode())
        assert mgr.store(f"c{i}".encode(), i) is not None
    mgr.close()
    assert gpu.idle


def test_close_with_a_broken_device_does_not_raise() -> None:
    mgr, kv, gpu, mover = make(streams=1)
    fill_row(kv, 0, A)
    assert mgr.store(A, 0) is not None
    assert mgr.poll() == []
    err = RuntimeError("CUDA error: an illegal memory access was encountered")

    def broken(*a: Any) -> None:
        raise err

    for s in gpu.side:
        s.synchronize = broken  # type: ignore[method-assign]
    mover._pending[0][0].end.fail = err
    mgr.close()                              # logged, answered as failed, not raised
    assert mover.in_flight() == 0


# ----------------------------------------------------------------------------- a random engine
@pytest.mark.parametrize("seed", range(8))
def test_random_engine_on_a_randomly_scheduled_device(seed: int) -> None:
    """The seeded engine of tests/random_engine.py, interleaved with device steps that run the streams
    in random order (1-16 operations at a time)."""
    mgr, kv, gpu, mover = make(rows=64, slots=24, streams=1 + seed % 3, rng=random.Random(seed + 100),
                               batch=(1, 3, 64)[seed % 3 if seed < 6 else seed % 2])

    def device_tick(rng: random.Random) -> None:
        for _ in range(rng.randrange(1, 17)):
            gpu.step()

    ok_loads, ok_stores = random_engine(
        mgr, random.Random(seed), 64, 800, (0.25, 0.20, 0.04, 0.03, 0.03, 0.30),
        compute=lambda row, key: gpu.kernel(lambda: fill_row(kv, row, key)),
        row_holds=lambda row, key: row_matches(kv, row, key), host_holds=lambda key: host_matches(mgr, key, kv),
        device_tick=device_tick, before_wait=lambda: (mover.flush(), gpu.run_all()), prefix=f"s{seed}")
    assert mover.in_flight() == 0
    assert ok_loads > 20 and ok_stores > 60
    mgr.close()


# ----------------------------------------------------------------------------- the CUDA bench section
def test_the_cuda_bench_section_runs_on_the_simulated_device() -> None:
    """Section 4 of the bench (GB/s beside torch's copy, store() latency) runs its code on a simulated
    device: a GPU machine is lent rarely and briefly, and its one run must not be spent on a typo."""
    from tiered_kv.bench import core, report
    gpu = FakeGPU(random.Random(3), progress_on_query=True)
    r = core.bench_cuda_copy("smoke", 0, block_sizes=(64 << 10,), runtime=gpu)
    assert r["simulated"] and r["skipped"] is None
    assert r["call_costs"]["event_record_and_query_us"] > 0 and r["call_costs"]["copy_call_us"] > 0
    (s,) = r["sizes"]
    assert s["problems"] == [] and s["mover"] == "CudaMover" and s["baseline_on_tier_slab"]
    for d in ("store", "load"):
        assert s[d]["tiered_kv"]["gb_per_s"] > 0 and s[d]["baseline_torch_copy"]["gb_per_s"] > 0
        assert s[d]["tiered_kv_copy_batch_max_1"]["gb_per_s"] > 0
        assert s[d]["tiered_kv_event_per_copy"]["gb_per_s"] > 0   # 64 KiB blocks share end events by default
        assert s[d]["tiered_kv_batched"]["gb_per_s"] > 0 and s[d]["baseline_one_large_copy"]["gb_per_s"] > 0
        assert s[d]["tiered_kv_batched_scattered"]["gb_per_s"] > 0 and s[d]["tiered_kv_batched_per_block"]["gb_per_s"] > 0
        for suffix in ("", "_batched_scattered", "_batched_per_block"):
            assert s[d][f"engine_cpu_us_per_step{suffix}"]["n"] > 0
    cl, c1, cs = r["store_latency"], r["store_latency_copy_batch_max_1"], r["store_latency_stage_32MiB"]
    assert (cl["copy_batch_max"], c1["copy_batch_max"]) == (64, 1)
    assert (cl["stage_bytes"], cs["stage_bytes"]) == (8 << 20, 32 << 20)
    for c in (cl, c1, cs):
        assert c["mover"] == "CudaMover" and c["tiered_kv"]["calls"] == c["baseline_figures"]["calls"] > 0
        assert c["tiered_kv"]["accepted"] > 0 and c["baseline_figures"]["accepted"] > 0
        assert c["tiered_kv"]["engine_us_per_step_mean"] > 0
    ids = {f["id"] for f in report._core_figures({"cuda_copy": r})}
    assert {"cuda.store.65536", "cuda.load.65536", "cuda.store_p99", "cuda.batched.store.65536",
            "cuda.batched.load.65536", "cuda.batched_scattered.store.65536", "cuda.batched_scattered.load.65536",
            "cuda.step_cpu.65536"} <= ids
    (b,) = [f for f in report._core_figures({"cuda_copy": r}) if f["id"] == "cuda.batched.store.65536"]
    assert b["target"] == ">= 0.9x one large copy_" and b["source"] == "issue 25"
    text = "\n".join(core._fmt_cuda(r))
    assert "store() on the CUDA KV tensor" in text and "copy_batch_max=1" in text and "ev/copy" in text
    assert "a step's blocks as one store_many/load_many" in text and "per-block" in text
    assert "tiered_kv (32 MiB staging)" in text and "engine-thread CPU per CUDA call" in text
    (fig,) = [f for f in report._core_figures({"cuda_copy": r}) if f["id"] == "cuda.store_p99"]
    assert "engine thread per step" in fig["note"]
    w = r["worker_layout"]
    assert (w["grouped"]["groups"], w["per_block"]["groups"]) == (1, 0)
    assert w["grouped"]["problems"] == 0 and w["per_block"]["problems"] == 0
    for d in ("store", "load"):
        assert w["grouped"][d]["gb_per_s"] > 0 and w["per_block"][d]["engine_cpu_us_per_step"]["n"] == w["steps"]
    assert "the vLLM worker's layout" in text and "per-block" in text
    figs = {f["id"]: f for f in report._core_figures({"cuda_copy": r})}
    assert figs["cuda.worker_layout.store"]["value"] == w["grouped"]["store"]["gb_per_s"]
    assert "block by block" in figs["cuda.worker_layout.load"]["note"]
    assert gpu.idle


# ----------------------------------------------------------------------------- transfers of several blocks
def test_a_transfer_spanning_two_event_chunks_is_reported_once_after_its_last_copy() -> None:
    """Rows of 8 bytes, an end event per 16 bytes: A = [row 0], B = [rows 1, 2, 3].  B's copies span both
    chunks; it is reported at the second end event, never at the first, and once."""
    gpu, out, dev, host, mover = bare(4, event_bytes=16, batched=False)
    a = Transfer(uuid.uuid4(), JobKind.STORE, [0], [0])
    b = Transfer(uuid.uuid4(), JobKind.STORE, [1, 2, 3], [1, 2, 3])
    mover.submit(a)
    mover.submit(b)
    mover.flush()
    (side,) = gpu.side
    assert [op[0] for op in side.ops] == ["wait", "event", "copy", "copy", "event", "copy", "copy", "event"]
    assert mover.in_flight() == 2
    for _ in range(5):
        gpu.step(side)                        # up to the first end event (A's copy and B's first)
    mover.harvest()
    (ra,) = out.drain()
    assert ra.token == a.token and ra.ok and ra.nbytes == 8 and mover.in_flight() == 1
    gpu.step(side)
    gpu.step(side)                            # B's last copies ran, its end event not yet reached
    mover.harvest()
    assert out.drain() == [] and torch.equal(host, dev)
    gpu.step(side)
    mover.harvest()
    (rb,) = out.drain()
    assert rb.token == b.token and rb.ok and rb.nbytes == 24
    assert round(rb.seconds * 1e6, 6) == 4.5  # its 3 copies at its last chunk's rate: 1.5 us per copy
    gpu.run_all()
    mover.harvest()
    assert out.drain() == [] and mover.in_flight() == 0


def test_a_copy_that_cannot_be_queued_fails_its_transfer_once_after_its_queued_copies_landed() -> None:
    """The second copy of a 3-block transfer cannot be queued: its other copies are on the stream, so the
    transfer is answered failed only once they can no longer land (at the end event), and once; the next
    transfer of the batch goes on."""
    gpu, out, dev, host, mover = bare(6, batched=False)
    t = Transfer(uuid.uuid4(), JobKind.STORE, [0, 1, 2], [0, 1, 2])
    u = Transfer(uuid.uuid4(), JobKind.STORE, [3], [3])
    mover.submit(t)
    mover.submit(u)
    gpu.copy_error, gpu.copy_error_skip = RuntimeError("CUDA error: injected"), 1
    mover.flush()
    assert out.drain() == [] and mover.in_flight() == 2
    (side,) = gpu.side
    assert [op[0] for op in side.ops] == ["wait", "event", "copy", "copy", "copy", "event"]
    gpu.run(side)
    gpu.step(side, )
    mover.harvest()
    reps = {r.token: r for r in out.drain()}
    assert set(reps) == {t.token, u.token}
    assert not reps[t.token].ok and "injected" in (reps[t.token].error or "") and reps[u.token].ok
    assert torch.equal(host[0], dev[0]) and not host[1].any() and torch.equal(host[2:4], dev[2:4])
    gpu.run_all()
    mover.harvest()
    assert out.drain() == [] and mover.in_flight() == 0


def test_a_transfer_whose_only_call_cannot_be_queued_is_answered_at_its_chunks_end_event() -> None:
    """Its one call (two consecutive rows, one copy) fails: nothing of it is on the stream, and it is answered
    failed at the end event all the same -- one rule for every failed transfer -- and once."""
    gpu, out, dev, host, mover = bare(4)
    t = Transfer(uuid.uuid4(), JobKind.LOAD, [0, 1], [0, 1])
    mover.submit(t)
    gpu.copy_error = RuntimeError("CUDA error: injected")
    mover.flush()
    (side,) = gpu.side
    assert [op[0] for op in side.ops] == ["wait", "event", "event"]
    assert out.drain() == [] and mover.in_flight() == 1
    gpu.run_all()
    mover.harvest()
    (r,) = out.drain()
    assert r.token == t.token and not r.ok and mover.in_flight() == 0
    gpu.run_all()
    mover.harvest()
    assert out.drain() == []


def test_every_copy_goes_over_every_plane() -> None:
    """Two planes side by side in one slab row (the vLLM worker's layout) go through staging rows together: per
    chunk a gather into each plane's columns, then one copy of the staging rows to the slab."""
    gpu, out = FakeGPU(), CompletionQueue()
    dev_a = torch.arange(4 * 8, dtype=torch.uint8).view(4, 8)
    dev_b = torch.arange(100, 100 + 4 * 16, dtype=torch.uint8).view(4, 16)
    slab = torch.zeros((4, 24), dtype=torch.uint8)
    mover = CudaMover([(dev_a, slab[:, :8]), (dev_b, slab[:, 8:])], out, 1, runtime=gpu, event_bytes=24)
    t = Transfer(uuid.uuid4(), JobKind.STORE, [2, 3], [0, 1])
    mover.submit(t)
    mover.flush()
    (side,) = gpu.side
    assert [op[0] for op in side.ops] == ["wait", "event", "gather", "gather", "copy", "event", "gather", "gather",
                                          "copy", "event"]
    gpu.run_all()
    mover.harvest()
    (r,) = out.drain()
    assert r.ok and r.nbytes == 2 * 24
    assert torch.equal(slab[:2, :8], dev_a[2:]) and torch.equal(slab[:2, 8:], dev_b[2:]) and not slab[2:].any()


def test_the_bench_passes_take_every_block_in_flight() -> None:
    """A throughput pass (host and CUDA sections) stores every block of its working set, then waits: past
    ``max_inflight_jobs`` (default 4096) blocks its stores must not be shed (the H200's first run at 64 KiB
    blocks shed 12,288 of 16,384 and reported the rest as the tier's speed)."""
    from tiered_kv.bench import core
    n, block = 5000, 64
    cfg = core._pass_config("pass-test|u8", n, block)
    kv = torch.zeros((n, block), dtype=torch.uint8)
    with TierManager(cfg, kv, registry=CollectorRegistry()) as mgr:
        jobs = [mgr.store(f"k{i}".encode(), i) for i in range(n)]
        assert sum(j is None for j in jobs) == 0
        done = mgr.wait(timeout=60)
        assert len(done) == n and all(c.ok for c in done)
        assert mgr.lookup([f"k{i}".encode() for i in range(n)]) == n


def test_the_cuda_only_tests_import_what_exists() -> None:
    """tests/test_cuda.py runs only on a GPU machine, so a module it imports can move without any CI run
    noticing (one did: its first run after that spent a lent GPU on an ImportError).  Every name it imports
    from tiered_kv, at the top or inside a test, resolves."""
    import ast
    import importlib
    from pathlib import Path

    tree = ast.parse((Path(__file__).parent / "test_cuda.py").read_text())
    names = [(node.module, a.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and node.module is not None and node.module.startswith("tiered_kv") for a in node.names]
    assert len(names) >= 5
    missing = []
    for module, name in names:
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{module}: {exc}")
            continue
        if not hasattr(mod, name):
            missing.append(f"{module}.{name}")
    assert missing == []
