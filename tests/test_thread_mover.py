"""ThreadMover: its default copy (memmove between row addresses computed from the tensors' strides),
and ``batch_max``: transfers queued until ``flush()`` (the manager's poll) starts them."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch
from prometheus_client import CollectorRegistry

from fakes import fill_row, make_config, make_kv, reports as _reports
from tiered_kv import TierManager
from tiered_kv.jobs import JobKind
from tiered_kv.movers import CompletionQueue, ThreadMover, Transfer


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "rows-with-gaps"])
def test_rows_are_copied_byte_for_byte_both_ways(padded):
    g = torch.Generator().manual_seed(3)
    base = torch.randint(0, 256, (6, 96 if padded else 64), generator=g, dtype=torch.uint8)
    dev = base[:, :64]                   # rows contiguous, 96 bytes apart when padded
    host = torch.zeros((4, 64), dtype=torch.uint8)
    q = CompletionQueue()
    m = ThreadMover([(dev, host)], q, num_workers=2)
    try:
        assert m._fast
        m.submit(Transfer(uuid.uuid4(), JobKind.STORE, [5], [2]))
        (r,) = _reports(q, 1)
        assert r.ok and r.nbytes == 64 and torch.equal(host[2], dev[5])
        keep = base.clone()
        m.submit(Transfer(uuid.uuid4(), JobKind.LOAD, [1], [2]))
        (r,) = _reports(q, 1)
        assert r.ok and torch.equal(dev[1], dev[5])
        if padded:                       # the gap bytes between rows were not touched
            assert torch.equal(base[:, 64:], keep[:, 64:])
        others = [i for i in range(6) if i != 1]
        assert torch.equal(base[others], keep[others])
    finally:
        m.close()


def test_out_of_range_transfer_fails_its_report_and_writes_nothing():
    dev = torch.arange(4 * 32, dtype=torch.uint8).view(4, 32)
    host = torch.zeros((2, 32), dtype=torch.uint8)
    before = dev.clone(), host.clone()
    q = CompletionQueue()
    m = ThreadMover([(dev, host)], q, num_workers=1)
    try:
        toks = [uuid.uuid4() for _ in range(3)]
        m.submit(Transfer(toks[0], JobKind.STORE, [0], [2]))     # slot past the slab
        m.submit(Transfer(toks[1], JobKind.LOAD, [4], [0]))      # row past the tensor
        m.submit(Transfer(toks[2], JobKind.STORE, [-1], [0]))    # negative row
        reps = _reports(q, 3)
        assert [r.token for r in reps] == toks
        assert all(not r.ok and "out of range" in (r.error or "") for r in reps), reps
        assert torch.equal(dev, before[0]) and torch.equal(host, before[1])
    finally:
        m.close()


def test_an_injected_copy_function_replaces_the_memmove():
    calls = []

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        calls.append(1)
        dst.copy_(src)

    dev = torch.ones((2, 16), dtype=torch.uint8)
    host = torch.zeros((2, 16), dtype=torch.uint8)
    q = CompletionQueue()
    m = ThreadMover([(dev, host)], q, num_workers=1, copy_fn=copy)
    try:
        assert not m._fast
        m.submit(Transfer(uuid.uuid4(), JobKind.STORE, [1], [0]))
        (r,) = _reports(q, 1)
        assert r.ok and calls == [1] and torch.equal(host[0], dev[1])
    finally:
        m.close()


def test_help_one_leaves_a_stop_sentinel_to_the_workers_and_copies_nothing_once_closed():
    """help_one() runs on the owner thread; the two guards it has for close() are pinned here:
    a worker's stop sentinel it finds goes back to the queue (a worker must still find it), and a
    closed mover's help_one() takes nothing, however much is queued."""
    dev = torch.arange(4 * 64, dtype=torch.int64).remainder(251).to(torch.uint8).view(4, 64)
    host = torch.zeros((4, 64), dtype=torch.uint8)
    q = CompletionQueue()
    m = ThreadMover([(dev, host)], q, num_workers=0)       # no worker: the queue holds what is put in it
    m._q.put(None)
    assert m.help_one() is False
    assert m._q.get_nowait() is None and m._q.empty()
    t = Transfer(uuid.uuid4(), JobKind.STORE, [1], [1])
    m.submit(t)
    assert m.help_one() is True and m.helped == 1
    (r,) = _reports(q, 1)
    assert r.ok and r.token == t.token and torch.equal(host[1], dev[1])
    m.close()
    m.submit(Transfer(uuid.uuid4(), JobKind.STORE, [2], [2]))
    assert m.help_one() is False and m.helped == 1 and not torch.equal(host[2], dev[2])


# ---------------------------------------------------------------------------- batch_max: copies start at flush()
def _batched(batch_max: int, workers: int, copy_fn=None) -> tuple[torch.Tensor, torch.Tensor, CompletionQueue,
                                                                    ThreadMover]:
    """Rows 0..7 filled with their index, an empty slab, and a ThreadMover queueing ``batch_max``."""
    dev = torch.arange(8, dtype=torch.uint8).unsqueeze(1).expand(8, 16).contiguous()
    host = torch.zeros((8, 16), dtype=torch.uint8)
    q = CompletionQueue()
    return dev, host, q, ThreadMover([(dev, host)], q, num_workers=workers, copy_fn=copy_fn, batch_max=batch_max)


def _recording(record: list):
    """A copy function that records the first byte of each source row it copies."""
    def copy(dst, src):
        record.append(int(src[0]))
        dst.copy_(src)
    return copy


def test_batched_transfers_reach_no_worker_before_flush_then_all_in_order():
    copied: list[int] = []
    dev, host, q, m = _batched(4, 2, _recording(copied))
    try:
        toks = [uuid.uuid4() for _ in range(3)]
        for i, t in enumerate(toks):
            m.submit(Transfer(t, JobKind.STORE, [i], [i]))
        assert len(m._held) == 3 and m._q.qsize() == 0   # nothing a worker could take
        assert q.get(0) is None and copied == []
        m.flush()
        assert not m._held
        reps = _reports(q, 3)
        assert sorted(r.token.int for r in reps) == sorted(t.int for t in toks) and all(r.ok for r in reps)
        assert torch.equal(host[:3], dev[:3])
        m.flush()                                            # nothing queued: a no-op
        assert q.get(0) is None
    finally:
        m.close()


def test_a_full_batch_goes_to_the_workers_in_the_submit_that_fills_it():
    dev, host, q, m = _batched(2, 1)
    try:
        m.submit(Transfer(uuid.uuid4(), JobKind.STORE, [1], [1]))
        assert len(m._held) == 1
        m.submit(Transfer(uuid.uuid4(), JobKind.STORE, [2], [2]))
        assert not m._held
        assert all(r.ok for r in _reports(q, 2)) and torch.equal(host[1:3], dev[1:3])
    finally:
        m.close()


def test_close_copies_what_is_still_queued_and_answers_each_once():
    dev, host, q, m = _batched(64, 2)
    toks = [uuid.uuid4() for _ in range(5)]
    for i, t in enumerate(toks):
        m.submit(Transfer(t, JobKind.STORE, [i], [i]))
    cancelled = Transfer(uuid.uuid4(), JobKind.LOAD, [6], [6])
    cancelled.cancelled = True
    m.submit(cancelled)
    m.close()
    reps = q.drain()
    assert sorted(r.token.int for r in reps) == sorted([t.int for t in toks] + [cancelled.token.int])
    assert [r.ok for r in reps if r.token == cancelled.token] == [False]
    assert torch.equal(host[:5], dev[:5]) and not host[6].any()


def test_a_hold_gives_what_was_queued_before_to_the_workers_and_keeps_what_comes_after():
    """wait() holds: the step's queued copies must still reach the workers (the owner alone would copy
    them one by one), while a copy submitted during the wait stays with the owner through flush()."""
    gate = threading.Event()
    copied: list[tuple[str, int]] = []

    def copy(dst, src):
        name = threading.current_thread().name
        if name.startswith("tiered-kv-copy"):
            assert gate.wait(30), "the test never opened the gate"
        copied.append((name, int(src[0])))
        dst.copy_(src)

    dev, host, q, m = _batched(64, 1, copy)
    try:
        for i in range(3):
            m.submit(Transfer(uuid.uuid4(), JobKind.STORE, [i], [i]))
        m.hold(True)
        assert not m._held                                   # rows 0-2 went to the worker's queue
        m.submit(Transfer(uuid.uuid4(), JobKind.STORE, [5], [5]))
        m.flush()
        assert len(m._held) == 1                             # held: flush() keeps it for the owner
        assert m.help_one()                                  # the owner copies row 5 while the worker waits
        assert copied == [(threading.current_thread().name, 5)]
        m.hold(False)
        gate.set()
        assert all(r.ok for r in _reports(q, 4))
        assert sorted(i for n, i in copied if n.startswith("tiered-kv-copy")) == [0, 1, 2]
        assert torch.equal(host[[0, 1, 2, 5]], dev[[0, 1, 2, 5]])
    finally:
        gate.set()
        m.close()


def test_held_transfers_bypass_the_batch_queue():
    dev, host, q, m = _batched(64, 1)
    try:
        m.hold(True)
        m.submit(Transfer(uuid.uuid4(), JobKind.STORE, [0], [0]))
        m.flush()
        assert len(m._held) == 1 and m._q.qsize() == 0       # flush() leaves a held transfer to the owner
        assert m.help_one() and q.get(5).ok
        m.hold(False)
    finally:
        m.close()


def test_batch_max_below_one_is_refused():
    with pytest.raises(ValueError, match="batch_max must be >= 1, got 0"):
        ThreadMover([(torch.zeros((2, 4), dtype=torch.uint8), torch.zeros((2, 4), dtype=torch.uint8))],
                    CompletionQueue(), batch_max=0)


@pytest.mark.parametrize("cpu_mover", ["native", "threads"])
def test_the_managers_cpu_copies_start_at_poll_and_batch_one_starts_them_in_store(cpu_mover):
    """The CPU movers queue a step's copies and poll() starts them; copy_batch_max=1 does not queue."""
    from tiered_kv.movers import NativeMover
    kv = make_kv(8)
    for batch in (64, 1):
        cfg = make_config(host_slots=16, copy_batch_max=batch, cpu_mover=cpu_mover)
        with TierManager(cfg, kv, registry=CollectorRegistry()) as mgr:
            mover = mgr._mover
            assert type(mover) is (NativeMover if cpu_mover == "native" else ThreadMover)
            jobs = []
            for i in range(3):
                fill_row(kv, i, b"k%d-%d" % (batch, i))
                jobs.append(mgr.store(b"k%d-%d" % (batch, i), i))
            assert len(mover._held) == (3 if batch > 1 else 0)
            mgr.poll()
            assert not mover._held
            mgr.wait(jobs)
            assert all(j.done and j.state.value == "done" for j in jobs)


# ---------------------------------------------------------------------------- transfers of several blocks, planes
@pytest.mark.parametrize("fast", [True, False], ids=["memmove", "copy_fn"])
def test_a_transfer_of_several_blocks_over_two_planes_is_one_report(fast):
    """Two planes (two KV tensors side by side in the slab rows): every (row, slot) pair is copied over
    both; one report for the transfer, its nbytes all bytes moved."""
    g = torch.Generator().manual_seed(11)
    dev_a = torch.randint(0, 256, (6, 24), generator=g, dtype=torch.uint8)
    dev_b = torch.randint(0, 256, (6, 40), generator=g, dtype=torch.uint8)
    slab = torch.zeros((4, 64), dtype=torch.uint8)
    q = CompletionQueue()
    m = ThreadMover([(dev_a, slab[:, :24]), (dev_b, slab[:, 24:])], q, num_workers=1,
                    copy_fn=None if fast else _copy_fn())
    try:
        assert bool(m._fast) is fast
        t = Transfer(uuid.uuid4(), JobKind.STORE, [5, 0, 3], [1, 3, 0])
        m.submit(t)
        (r,) = _reports(q, 1)
        assert r.token == t.token and r.ok and r.nbytes == 3 * 64
        assert torch.equal(slab[[1, 3, 0], :24], dev_a[[5, 0, 3]])
        assert torch.equal(slab[[1, 3, 0], 24:], dev_b[[5, 0, 3]])
        assert not slab[2].any()
        keep_a, keep_b = dev_a.clone(), dev_b.clone()
        m.submit(Transfer(uuid.uuid4(), JobKind.LOAD, [2, 4], [3, 1]))
        (r,) = _reports(q, 1)
        assert r.ok and r.nbytes == 2 * 64
        assert torch.equal(dev_a[[2, 4]], keep_a[[0, 5]]) and torch.equal(dev_b[[2, 4]], keep_b[[0, 5]])
        others = [0, 1, 3, 5]
        assert torch.equal(dev_a[others], keep_a[others]) and torch.equal(dev_b[others], keep_b[others])
        assert q.get(0) is None                     # exactly one report per transfer
    finally:
        m.close()


def _copy_fn():
    def copy(dst, src):
        dst.copy_(src)
    return copy


def test_one_failing_copy_fails_the_whole_transfer_once():
    dev = torch.arange(4 * 16, dtype=torch.uint8).view(4, 16)
    host = torch.zeros((4, 16), dtype=torch.uint8)
    q = CompletionQueue()
    m = ThreadMover([(dev, host)], q, num_workers=1)
    try:
        t = Transfer(uuid.uuid4(), JobKind.STORE, [0, 9, 2], [0, 1, 2])   # row 9 is past the tensor
        m.submit(t)
        (r,) = _reports(q, 1)
        assert r.token == t.token and not r.ok and "out of range" in (r.error or "")
        assert not host[1:].any()                   # the copies after the bad one were not made
        m.submit(Transfer(uuid.uuid4(), JobKind.STORE, [1, 2], [1]))      # rows and slots differ in length
        (r,) = _reports(q, 1)
        assert not r.ok and q.get(0) is None
    finally:
        m.close()
