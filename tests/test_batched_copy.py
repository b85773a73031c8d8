"""The CPU mover's batched copies: ``batch_copy`` byte for byte in each of its cases, a batch's
transfers each answered by its own outcome (cancelled, out of range, a failing batch copied again one
by one, a worker dying mid-batch), a state machine against a model, and, through a TierManager, the
fences and stale counts of jobs whose batch is in flight."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule
from prometheus_client import CollectorRegistry

from fakes import fill_row, make_config, make_kv, reports as _reports, row_matches
from mover_protocol import MoverProtocolMachine, random_rows as _random_rows
from tiered_kv import TierManager
from tiered_kv.jobs import JobKind
from tiered_kv.metrics import sample_total
from tiered_kv.movers import CompletionQueue, ThreadMover, Transfer
from tiered_kv.movers.thread import batch_copy

_STORE, _LOAD = JobKind.STORE, JobKind.LOAD



# ---------------------------------------------------------------------------- batch_copy
@pytest.mark.parametrize("dtype", [torch.complex128, torch.int64])
@pytest.mark.parametrize("case", ["both-runs", "dst-run", "src-run", "scattered", "scattered-multipass",
                                  "wider-than-stage"])
def test_batch_copy_moves_every_row_byte_for_byte(dtype, case):
    width = 64
    src_u8, dst_u8 = _random_rows(12, width, 1), _random_rows(10, width, 2)
    keep = dst_u8.clone()
    src, dst = src_u8.view(dtype), dst_u8.view(dtype)
    elems = int(src.shape[1])
    stage_rows = {"scattered-multipass": 2, "wider-than-stage": 0}.get(case, 8)
    stage = torch.empty((stage_rows, elems), dtype=dtype)
    d_rows, s_rows = {
        "both-runs": ([2, 3, 4, 5], [7, 8, 9, 10]),      # one range to another: one copy_
        "dst-run": ([3, 4, 5, 6], [11, 0, 7, 7]),        # a source row twice: both copies land
        "src-run": ([9, 1, 5], [4, 5, 6]),
        "scattered": ([8, 2, 6, 0], [10, 3, 1, 9]),
        "scattered-multipass": ([8, 2, 6, 0, 4], [10, 3, 1, 9, 5]),
        "wider-than-stage": ([7, 1], [2, 11]),
    }[case]
    batch_copy(dst, d_rows, src, s_rows, stage)
    for d, s in zip(d_rows, s_rows):
        assert torch.equal(dst_u8[d], src_u8[s]), (case, d, s)
    others = [i for i in range(10) if i not in d_rows]
    assert torch.equal(dst_u8[others], keep[others])


def test_batch_copy_into_consecutive_rows_that_are_not_contiguous_scatters_them():
    """A slab's byte region (a plane of the vLLM copier): consecutive rows are not one block of memory."""
    slab = torch.zeros((6, 48), dtype=torch.uint8)
    region = slab[:, 16:48].view(torch.complex128)        # rows 48 bytes apart
    src_u8 = _random_rows(4, 32, 5)
    batch_copy(region, [1, 2, 3], src_u8.view(torch.complex128), [3, 0, 2],
               torch.empty((4, 2), dtype=torch.complex128))
    assert torch.equal(slab[1:4, 16:], src_u8[[3, 0, 2]])
    assert not slab[:, :16].any() and not slab[[0, 4, 5]].any()


# ---------------------------------------------------------------------------- the mover's batches
def _mover(workers: int = 1, rows: int = 16, slots: int = 16, width: int = 64, **kw: Any):
    dev = _random_rows(rows, width, 7)
    host = torch.zeros((slots, width), dtype=torch.uint8)
    q = CompletionQueue()
    return dev, host, q, ThreadMover([(dev, host)], q, num_workers=workers, batch_max=64, **kw)


def test_a_flush_is_one_batched_copy_per_direction_and_one_report_per_transfer():
    dev, host, q, m = _mover()
    try:
        assert m._wide is not None
        stores = [Transfer(uuid.uuid4(), _STORE, [r, r + 1], [r // 2, r // 2 + 8]) for r in (0, 4, 8)]
        for t in stores:
            m.submit(t)
        m.flush()
        reps = {r.token: r for r in _reports(q, 3)}
        assert all(reps[t.token].ok and reps[t.token].nbytes == 2 * 64 for t in stores)
        for t in stores:
            assert torch.equal(host[t.slots], dev[t.rows])
        loads = [Transfer(uuid.uuid4(), _LOAD, [12 + i], [s]) for i, s in enumerate([0, 8, 2])]
        for t in loads:
            m.submit(t)
        m.flush()
        assert all(r.ok for r in _reports(q, 3))
        assert torch.equal(dev[12:15], dev[[0, 1, 4]])
        assert m.batches == 2 and q.get(0) is None
    finally:
        m.close()


def test_cancelled_and_out_of_range_transfers_fail_alone_and_the_rest_of_the_batch_lands():
    dev, host, q, m = _mover(workers=0)
    try:
        good = Transfer("good", _STORE, [1, 2], [1, 2])
        cancelled = Transfer("cancelled", _STORE, [3], [3])
        outside = Transfer("outside", _STORE, [4, 99], [4, 5])
        just_past = Transfer("just_past", _STORE, [16], [8])      # 16 rows: row 16 is the first past the end
        slot_past = Transfer("slot_past", _STORE, [8], [16])      # and 16 slots
        mismatched = Transfer("mismatched", _STORE, [6, 7], [6])
        empty = Transfer("empty", _STORE, [], [])
        for t in (good, cancelled, outside, just_past, slot_past, mismatched, empty):
            m.submit(t)
        cancelled.cancelled = True
        m.flush()
        assert m.help_one() and not m.help_one()
        reps = {r.token: r for r in q.drain()}
        assert reps["good"].ok and torch.equal(host[1:3], dev[1:3])
        assert not reps["cancelled"].ok and "cancelled before copy" in reps["cancelled"].error
        assert not reps["outside"].ok and "out of range" in reps["outside"].error
        assert not reps["just_past"].ok and "out of range" in reps["just_past"].error
        assert not reps["slot_past"].ok and "out of range" in reps["slot_past"].error
        assert m.batches == 1                            # refused before the batched copy, which then ran once
        assert not reps["mismatched"].ok and "2 rows for 1 slots" in reps["mismatched"].error
        assert reps["empty"].ok and reps["empty"].nbytes == 0
        assert not host[3:].any()                        # none of the failed ones wrote anything
    finally:
        m.close()


def test_a_failing_batched_copy_is_copied_again_one_by_one_each_with_its_own_outcome():
    """A partial failure inside a batch: the batched copy raises, the transfers are copied row by row,
    and only the one whose row copy fails is reported failed."""
    calls: list[int] = []

    def broken_batch(dst, dst_rows, src, src_rows, stage):
        calls.append(len(dst_rows))
        raise RuntimeError("injected: the batched copy failed")

    def copy(dst, src):
        if int(src[0]) == 0xEE:
            raise OSError("injected: this row cannot be read")
        dst.copy_(src)

    dev, host, q, m = _mover(workers=0, batch_fn=broken_batch, copy_fn=copy)
    dev[5].fill_(0xEE)
    try:
        ts = [Transfer(f"t{r}", _STORE, [r], [r]) for r in (3, 5, 9)]
        for t in ts:
            m.submit(t)
        m.flush()
        assert m.help_one()
        reps = {r.token: r for r in q.drain()}
        assert calls == [3] and m.batches == 0
        assert reps["t3"].ok and reps["t9"].ok and torch.equal(host[[3, 9]], dev[[3, 9]])
        assert not reps["t5"].ok and "cannot be read" in reps["t5"].error and len(reps) == 3
    finally:
        m.close()


class _Dies(BaseException):
    pass


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_worker_dying_mid_batch_answers_each_of_its_transfers_once_and_is_replaced():
    died = threading.Event()

    def dying(dst, dst_rows, src, src_rows, stage):
        if not died.is_set():
            died.set()
            raise _Dies("the copy thread is killed")
        batch_copy(dst, dst_rows, src, src_rows, stage)

    dev, host, q, m = _mover(workers=1, batch_fn=dying)
    try:
        ts = [Transfer(f"a{i}", _STORE, [i], [i]) for i in range(3)]
        for t in ts:
            m.submit(t)
        m.flush()
        reps = _reports(q, 3)
        assert sorted(r.token for r in reps) == ["a0", "a1", "a2"]
        assert all(not r.ok and "worker died" in r.error for r in reps)
        t = Transfer("after", _STORE, [4], [4])
        m.submit(t)
        m.flush()
        (r,) = _reports(q, 1)
        assert r.token == "after" and r.ok and torch.equal(host[4], dev[4])
        assert q.get(0) is None
    finally:
        m.close()


# ---------------------------------------------------------------------------- a state machine
class BatchedMoverMachine(MoverProtocolMachine):
    """The owner's protocol (``mover_protocol``) on a ThreadMover with no worker: every copy is made by
    ``help_one`` at a point the machine chooses, some batches failing as a whole and some rows failing
    alone, transfers held and released; a failed or cancelled-before-copy one may have written only
    its own destinations."""

    @initialize(seed=st.integers(0, 2**16))
    def setup(self, seed: int) -> None:
        self.start(seed)
        self.fail_next_batch = False
        self.bad_rows: set[int] = set()   # (source byte 0) rows whose row-by-row copy fails

        def batch_fn(dst, dst_rows, src, src_rows, stage):
            if self.fail_next_batch:
                self.fail_next_batch = False
                raise RuntimeError("injected batch failure")
            batch_copy(dst, dst_rows, src, src_rows, stage)

        def copy(dst, src):
            if int(src[0]) in self.bad_rows:
                raise OSError("injected row failure")
            dst.copy_(src)

        self.m = ThreadMover([(self.dev, self.host)], self.q, num_workers=0, batch_max=8,
                             batch_fn=batch_fn, copy_fn=copy)

    @rule(on=st.booleans())
    def hold(self, on: bool) -> None:
        self.m.hold(on)

    @rule()
    def fail_a_batch(self) -> None:
        self.fail_next_batch = True

    @rule(data=st.data())
    def poison_a_source(self, data: Any) -> None:
        """The row-by-row copy of sources starting with this byte fails (after a failed batch)."""
        self.bad_rows.add(data.draw(st.integers(0, 255)))

    @rule()
    def help(self) -> None:
        self.m.help_one()
        self.collect()

    def check_report(self, t: Transfer, ok: bool, error: Any) -> None:
        if t.cancelled:   # cancelled between two helps: before the batch that took it started
            assert not ok and "cancelled before copy" in error

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        self.m.hold(False)
        self.m.flush()
        self.fail_next_batch = False
        while self.m.help_one():
            self.collect()
        self.collect()
        assert not self.pending, f"never answered: {sorted(self.pending)}"
        self.m.close()


BatchedMoverMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                                 suppress_health_check=[HealthCheck.too_slow])
test_batched_mover_machine = BatchedMoverMachine.TestCase


# ---------------------------------------------------------------------------- through a TierManager
class Gate:
    """A batch_fn that blocks in the copy thread until the test opens it."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.open = threading.Event()
        self.batches = 0

    def __call__(self, dst, dst_rows, src, src_rows, stage) -> None:
        self.batches += 1
        self.entered.set()
        assert self.open.wait(30), "the test never opened the gate"
        batch_copy(dst, dst_rows, src, src_rows, stage)


@pytest.fixture
def gated():
    kv = make_kv(16)
    gate = Gate()
    mgr = TierManager(make_config(host_slots=16), kv, registry=CollectorRegistry(),
                      mover_factory=lambda d, h, q: ThreadMover([(d, h)], q, num_workers=1, batch_max=64,
                                                                batch_fn=gate))
    try:
        yield kv, mgr, gate
    finally:
        gate.open.set()
        mgr.close()


def _stale(mgr: TierManager, kind: str, reason: str) -> float:
    return sample_total(mgr.metrics.registry, "tiered_kv_stale_callbacks_total", kind=kind, reason=reason)


def test_a_row_freed_while_its_batch_is_in_flight_stays_fenced_until_the_report(gated):
    kv, mgr, gate = gated
    keys = [b"k%d" % i for i in range(4)]
    for i, k in enumerate(keys):
        fill_row(kv, i, k)
    gate.open.set()
    mgr.wait([mgr.store_many(keys, [0, 1, 2, 3])])
    gate.open.clear()
    gate.entered.clear()
    job = mgr.load_many(keys, [8, 9, 10, 11])
    mgr.poll()                                   # the batch goes to the worker, which blocks in the copy
    assert gate.entered.wait(30)
    assert mgr.free_block(9) is False            # cancelled, but its bytes may still land: fenced
    assert mgr.free_block(9) is False
    gate.open.set()
    done = mgr.wait([job])
    assert [c.ok for c in done] == [False] and "cancelled" in done[0].error
    assert _stale(mgr, "load", "cancelled") == 1
    assert mgr.free_block(9) is True and mgr.free_block(8) is True


def test_a_store_given_up_before_its_batch_starts_is_copied_by_no_one_and_counted(gated):
    kv, mgr, gate = gated
    gate.open.set()
    for i in range(3):
        fill_row(kv, i, b"s%d" % i)
    assert mgr.store_many([b"s0", b"s1", b"s2"], [0, 1, 2]) is not None
    assert mgr.store(b"solo", 3) is not None
    assert mgr.free_block(3) is True             # before the flush: the solo store is cancelled
    assert mgr.free_block(1) is True             # one part of the batch job
    done = {c.job.key: c for c in mgr.wait()}
    assert done[b"s0"].ok and not done[b"solo"].ok
    assert _stale(mgr, "store", "source_reused") == 2
    assert mgr.lookup([b"s0"]) == 1 and mgr.lookup([b"s1"]) == 0 and mgr.lookup([b"solo"]) == 0
    assert mgr.lookup([b"s2"]) == 1
    out = mgr.load_many([b"s0", b"s2"], [12, 13])
    assert mgr.wait([out])[0].ok and row_matches(kv, 12, b"s0") and row_matches(kv, 13, b"s2")
    assert gate.batches >= 1                       # the stores went as one batch (the load of 2 rows: memmove)


def test_a_lone_transfer_of_one_or_two_rows_is_copied_row_by_row():
    """copy_batch_max=1 hands each store() to the workers alone: a memmove beats building index tensors."""
    dev, host, q, m = _mover(workers=0)
    try:
        for rows in ([3], [4, 9], [5, 6, 7]):
            m.submit(Transfer(str(rows), _STORE, rows, rows))
            m.flush()
            assert m.help_one()
        reps = {r.token: r for r in q.drain()}
        assert all(r.ok for r in reps.values()) and len(reps) == 3
        assert torch.equal(host[[3, 4, 9, 5, 6, 7]], dev[[3, 4, 9, 5, 6, 7]])
        assert m.batches == 1                            # only the transfer of three rows went batched
    finally:
        m.close()


def test_a_flush_copies_on_the_owner_what_the_workers_left_from_an_earlier_flush():
    """catch_up_s: batches the workers have not taken (starved of the GIL by a busy owner) are copied by
    the owner at its next flush, oldest first; what that flush hands over stays for the workers."""
    dev, host, q, m = _mover(workers=0, catch_up_s=0.0)   # no worker: nothing is ever taken but by the owner
    try:
        m.submit(Transfer("a", _STORE, [0, 1, 2], [0, 1, 2]))
        m.flush()                                        # a queued; nothing older to copy
        assert m.caught_up == 0 and q.drain() == [] and m._q.qsize() == 1
        m.submit(Transfer("b", _LOAD, [10, 11, 12], [0, 1, 2]))
        m.flush()                                        # a is copied here, b queued
        assert m.caught_up == 1 and [r.token for r in q.drain()] == ["a"] and m._q.qsize() == 1
        assert torch.equal(host[:3], dev[:3])
        m.flush()                                        # nothing new: b is copied
        assert m.caught_up == 2 and [(r.token, r.ok) for r in q.drain()] == [("b", True)]
        assert torch.equal(dev[10:13], dev[:3]) and m._q.qsize() == 0
    finally:
        m.close()


def test_without_catch_up_or_before_its_delay_a_flush_copies_nothing():
    for kw in ({}, {"catch_up_s": 60.0}):
        dev, host, q, m = _mover(workers=0, **kw)
        try:
            for i in range(3):
                m.submit(Transfer(i, _STORE, [i, i + 4], [i, i + 4]))
                m.flush()
            assert m.caught_up == 0 and q.drain() == [] and m._q.qsize() == 3
            while m.help_one():
                pass
            assert len(q.drain()) == 3
        finally:
            m.close()


def test_the_managers_cpu_mover_catches_up_and_the_vllm_copier_does_not():
    """The copier runs a rank's jobs one after another on one worker (a store after a load of the same
    block relies on it): a batch copied by the owner could run beside the worker's.  The managers'
    default CPU mover is the native one (no GIL, nothing to catch up); with ``cpu_mover="threads"``, or
    rows its views do not fit (3-byte rows), it is a ThreadMover that catches up."""
    from tiered_kv.integrations.copier import _copy_mover
    from tiered_kv.movers import CATCH_UP_S, NativeMover, ThreadMover, make_mover
    dev, host = torch.zeros((4, 32), dtype=torch.uint8), torch.zeros((4, 32), dtype=torch.uint8)
    odd = (torch.zeros((4, 3), dtype=torch.uint8), torch.zeros((4, 3), dtype=torch.uint8))
    n = make_mover([(dev, host)], CompletionQueue(), 1, 1, 64)
    a = make_mover([(dev, host)], CompletionQueue(), 1, 1, 64, "threads")
    c = make_mover([odd], CompletionQueue(), 1, 1, 64)
    b = _copy_mover([(dev, host)], CompletionQueue(), 64)
    try:
        assert type(n) is NativeMover and type(a) is ThreadMover and type(c) is ThreadMover
        assert a._catch_up_s == CATCH_UP_S and c._catch_up_s == CATCH_UP_S and b._catch_up_s is None
    finally:
        for m in (n, a, b, c):
            m.close()


def test_transfers_handed_over_at_submit_are_caught_up_too():
    dev, host, q, m = _mover(workers=0, catch_up_s=0.0)
    m._batch_max = 1                                     # each submit hands its transfer over at once
    try:
        m.submit(Transfer("a", _STORE, [0, 1, 2], [0, 1, 2]))
        m.submit(Transfer("b", _STORE, [4, 5, 6], [4, 5, 6]))
        assert m._q.qsize() == 2
        m.flush()
        assert m.caught_up == 2 and sorted(r.token for r in q.drain()) == ["a", "b"]
    finally:
        m.close()


def test_a_backlog_longer_than_the_stamps_kept_is_caught_up_whole():
    import collections
    dev, host, q, m = _mover(workers=0, catch_up_s=0.0)
    m._put_at = collections.deque(maxlen=2)              # keeps the last two stamps only
    try:
        for i in range(4):                               # four batches handed over long ago
            m._q.put([Transfer(i, _STORE, [i, i + 8], [i, i + 8])])
            m._put_at.append(0.0)
        assert m._q.qsize() == 4 and len(m._put_at) == 2
        m.flush()
        assert m.caught_up == 4 and sorted(r.token for r in q.drain()) == [0, 1, 2, 3]
    finally:
        m.close()


def test_a_process_forked_after_a_native_mover_ran_copies_on_python_threads(monkeypatch, caplog):
    """torch's inter-op threads do not survive fork(): in a process forked from one whose native mover started
    them, the first torch.jit.fork waits for ever.  There make_mover picks the Python threads (and says why,
    once); in the process that started them, the native mover."""
    import os

    from tiered_kv.movers import NativeMover, ThreadMover, make_mover, rowcopy
    dev, host = torch.zeros((4, 32), dtype=torch.uint8), torch.zeros((4, 32), dtype=torch.uint8)
    monkeypatch.setattr(rowcopy, "_fork_logged", False)
    monkeypatch.setattr(rowcopy, "_pool_pid", os.getpid())
    here = make_mover([(dev, host)], CompletionQueue(), 1, 1, 64)
    monkeypatch.setattr(rowcopy, "_pool_pid", os.getpid() + 1)   # as a forked child sees its parent's pid
    with caplog.at_level("WARNING", logger="tiered_kv.movers.rowcopy"):
        forked = [make_mover([(dev, host)], CompletionQueue(), 1, 1, 64) for _ in range(2)]
    try:
        assert type(here) is NativeMover and [type(m) for m in forked] == [ThreadMover, ThreadMover]
        assert sum("fork" in r.getMessage() for r in caplog.records) == 1
    finally:
        for m in [here] + forked:
            m.close()
