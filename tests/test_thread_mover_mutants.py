"""The CPU mover's batched copy paths, pinned where a mutation campaign on ``tiered_kv/movers/thread.py``
found them loose: how a flush cuts the queue into batches of at most ``BATCH_BYTES``, how much one
``help_one()`` takes (``HELP_BYTES``), which queued batches a flush counts as behind (``catch_up_s``, on
a fake clock), the copy time a batched copy reports per transfer (on a fake clock), that
``batch_copy`` stages a stage-full of rows per pass without resizing its stage, that each plane has
a stage of its own, that an interrupt among a batch's reports answers no transfer twice, and which
planes get a wide view.  No worker threads (``num_workers=0``): every copy is made by ``help_one()`` on the
test's thread, and no test sleeps or measures time."""

from __future__ import annotations

import types
from typing import Any, Callable

import pytest
import torch

from tiered_kv.jobs import JobKind
from tiered_kv.movers import CompletionQueue, ThreadMover, Transfer
from tiered_kv.movers import thread as thread_mod
from tiered_kv.movers.thread import wide_planes, batch_copy

_STORE, _LOAD = JobKind.STORE, JobKind.LOAD
WIDTH = 64   # bytes per row: a transfer of n rows is n * 64 bytes


def _random_rows(n: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, width), generator=g, dtype=torch.uint8)


def _mover(**kw: Any) -> tuple[torch.Tensor, torch.Tensor, CompletionQueue, ThreadMover]:
    dev = _random_rows(32, WIDTH, 11)
    host = torch.zeros((32, WIDTH), dtype=torch.uint8)
    q = CompletionQueue()
    return dev, host, q, ThreadMover([(dev, host)], q, num_workers=0, batch_max=64, **kw)


def _fake_time(monkeypatch: pytest.MonkeyPatch, monotonic: Callable[[], float] = lambda: 0.0,
               perf_counter: Callable[[], float] = lambda: 0.0) -> None:
    """The mover module's clock, replaced (only there: ``thread.time``)."""
    monkeypatch.setattr(thread_mod, "time", types.SimpleNamespace(monotonic=monotonic, perf_counter=perf_counter))


def _help_rounds(m: ThreadMover, q: CompletionQueue) -> list[list[Any]]:
    """Call ``help_one()`` until it has nothing left: the tokens each call answered."""
    rounds = []
    while m.help_one():
        rounds.append([r.token for r in q.drain()])
    return rounds


# ---------------------------------------------------------------------------- flush: batches of BATCH_BYTES
def test_a_flush_cuts_its_transfers_into_batches_of_at_most_batch_bytes(monkeypatch):
    """A batch takes transfers while they fit in ``BATCH_BYTES`` (a batch filled exactly is not cut
    before its last transfer); the next transfer starts a new one, counted from zero."""
    monkeypatch.setattr(thread_mod, "BATCH_BYTES", 4 * WIDTH)
    dev, host, q, m = _mover()
    try:
        sizes = {"a": 2, "b": 2, "c": 1, "d": 3, "e": 1}        # rows: 4 | 4 | 1
        r0 = 0
        for name, n in sizes.items():
            m.submit(Transfer(name, _STORE, list(range(r0, r0 + n)), list(range(r0, r0 + n))))
            r0 += n
        m.flush()
        assert m._q.qsize() == 3
        assert _help_rounds(m, q) == [["a", "b"], ["c", "d"], ["e"]]
        assert torch.equal(host[:r0], dev[:r0])
    finally:
        m.close()


# ---------------------------------------------------------------------------- help_one: HELP_BYTES per call
@pytest.mark.parametrize("help_bytes, rounds", [
    (4 * WIDTH, [["a", "b"], ["c", "d"], ["e"]]),          # stops once it holds HELP_BYTES
    (4 * WIDTH + 1, [["a", "b", "c"], ["d", "e"]]),        # one byte short of it: takes one more
])
def test_help_one_takes_held_transfers_until_it_holds_help_bytes(monkeypatch, help_bytes, rounds):
    monkeypatch.setattr(thread_mod, "HELP_BYTES", help_bytes)
    dev, host, q, m = _mover()
    try:
        m.hold(True)
        r0 = 0
        for name, n in {"a": 2, "b": 2, "c": 1, "d": 3, "e": 1}.items():
            m.submit(Transfer(name, _STORE, list(range(r0, r0 + n)), list(range(r0, r0 + n))))
            r0 += n
        assert len(m._held) == 5 and m._q.qsize() == 0
        assert _help_rounds(m, q) == rounds
        assert torch.equal(host[:r0], dev[:r0])
    finally:
        m.hold(False)
        m.close()


# ---------------------------------------------------------------------------- _behind: which batches are old
def _queue_batches(m: ThreadMover, stamps: list[float]) -> None:
    """Batches handed to the workers at these times (one transfer of three rows each, tokens 0, 1, ...)."""
    for i, at in enumerate(stamps):
        m._q.put([Transfer(i, _STORE, [3 * i, 3 * i + 1, 3 * i + 2], [3 * i, 3 * i + 1, 3 * i + 2])])
        m._put_at.append(at)


def test_a_flush_catches_up_exactly_the_batches_handed_over_at_least_catch_up_s_ago(monkeypatch):
    """At t=10 with catch_up_s=5: a batch put at 0 or at exactly 5 is behind, those put at 6 and 7
    are not; the owner copies the two old ones, oldest first, and leaves the young ones queued."""
    _fake_time(monkeypatch, monotonic=lambda: 10.0)
    dev, host, q, m = _mover(catch_up_s=5.0)
    try:
        _queue_batches(m, [0.0, 5.0, 6.0, 7.0])
        assert m._behind() == 2
        m.flush()
        assert m.caught_up == 2 and [r.token for r in q.drain()] == [0, 1] and m._q.qsize() == 2
        assert torch.equal(host[:6], dev[:6]) and not host[6:].any()
    finally:
        m.close()


def test_a_backlog_longer_than_the_stamps_kept_is_old_even_when_every_stamp_is_young(monkeypatch):
    import collections
    _fake_time(monkeypatch, monotonic=lambda: 10.0)
    dev, host, q, m = _mover(catch_up_s=5.0)
    m._put_at = collections.deque(maxlen=2)                # keeps the last two stamps only
    try:
        _queue_batches(m, [9.0, 9.0, 9.0])                  # three batches, two stamps, both young
        assert len(m._put_at) == 2 and m._behind() == 1
        m.flush()
        assert m.caught_up == 1 and [r.token for r in q.drain()] == [0] and m._q.qsize() == 2
    finally:
        m.close()


# ---------------------------------------------------------------------------- the reports of a batched copy
def test_a_batched_copy_reports_each_transfer_its_bytes_and_its_share_of_the_copy_time(monkeypatch):
    """The copy of a batch (two perf_counter readings 6 s apart on a fake clock, 3 rows) is shared out
    per row: 2 s per row; a transfer of no rows in the same batch took no time and moved nothing."""
    clock = iter([100.0, 106.0])
    _fake_time(monkeypatch, perf_counter=lambda: next(clock))
    dev, host, q, m = _mover()
    try:
        ts = [Transfer("one", _STORE, [5], [9]), Transfer("two", _STORE, [1, 7], [2, 4]),
              Transfer("none", _STORE, [], [])]
        for t in ts:
            m.submit(t)
        m.flush()
        assert m.help_one() and not m.help_one()
        reps = {r.token: r for r in q.drain()}
        assert m.batches == 1
        assert (reps["one"].ok, reps["one"].nbytes, reps["one"].seconds) == (True, WIDTH, 2.0)
        assert (reps["two"].ok, reps["two"].nbytes, reps["two"].seconds) == (True, 2 * WIDTH, 4.0)
        assert (reps["none"].ok, reps["none"].nbytes, reps["none"].seconds) == (True, 0, 0.0)
        assert all(r.kind is _STORE for r in reps.values())
        assert torch.equal(host[[9, 2, 4]], dev[[5, 1, 7]])
    finally:
        m.close()


# ---------------------------------------------------------------------------- batch_copy's stage
@pytest.mark.parametrize("n", [5, 6])
def test_batch_copy_stages_through_the_rows_of_its_stage_and_never_resizes_it(n, monkeypatch):
    """Scattered rows on both sides, a stage of 2 rows of 4 elements: one gather per stage-full of rows
    (ceil(n / 2) passes), each into the stage itself (a stage resized by an ``out=`` of another shape
    would reallocate the thread's staging buffer; torch warns when it does)."""
    import warnings
    gathers: list[int] = []
    index_select = torch.index_select

    def counting(*args: Any, **kw: Any) -> torch.Tensor:
        gathers.append(len(args[2]))
        return index_select(*args, **kw)
    monkeypatch.setattr(torch, "index_select", counting)
    src_u8, dst_u8 = _random_rows(12, WIDTH, 31), _random_rows(12, WIDTH, 32)
    keep = dst_u8.clone()
    src, dst = src_u8.view(torch.complex128), dst_u8.view(torch.complex128)
    stage = torch.empty((2, WIDTH // 16), dtype=torch.complex128)
    ptr, nbytes = stage.data_ptr(), stage.untyped_storage().nbytes()
    d_rows, s_rows = [8, 2, 6, 0, 4, 10][:n], [11, 3, 1, 9, 5, 7][:n]
    with warnings.catch_warnings():
        warnings.simplefilter("error")               # "An output with one or more elements was resized"
        batch_copy(dst, d_rows, src, s_rows, stage)
    assert stage.data_ptr() == ptr and stage.untyped_storage().nbytes() == nbytes and stage.shape == (2, 4)
    assert gathers == [2] * (n // 2) + [1] * (n % 2)
    assert torch.equal(dst_u8[d_rows], src_u8[s_rows])
    others = [i for i in range(12) if i not in d_rows]
    assert torch.equal(dst_u8[others], keep[others])


# ---------------------------------------------------------------------------- wide_planes
class _CudaLooking(torch.Tensor):
    """A CPU tensor that says it is on a CUDA device (no GPU needed to ask the question)."""

    @property
    def is_cuda(self) -> bool:   # type: ignore[override]
        return True


def test_no_wide_view_when_either_side_of_a_plane_is_on_a_cuda_device():
    cpu = torch.zeros((4, WIDTH), dtype=torch.uint8)
    assert wide_planes([(cpu, cpu.clone())]) is not None
    assert wide_planes([(torch.zeros((4, WIDTH), dtype=torch.uint8).as_subclass(_CudaLooking), cpu)]) is None
    assert wide_planes([(cpu, torch.zeros((4, WIDTH), dtype=torch.uint8).as_subclass(_CudaLooking))]) is None


def test_no_wide_view_when_the_two_sides_rows_differ_in_bytes():
    assert wide_planes([(torch.zeros((4, 32), dtype=torch.uint8), torch.zeros((4, 64), dtype=torch.uint8))]) is None


def test_no_wide_view_when_one_sides_rows_cannot_be_viewed_as_byte_rows():
    unviewable = torch.zeros((4, 16, 4), dtype=torch.uint8).transpose(1, 2)     # rows not one run of bytes
    assert wide_planes([(unviewable, torch.zeros((4, 64), dtype=torch.uint8))]) is None
    assert wide_planes([(torch.zeros((4, 64), dtype=torch.uint8), unviewable)]) is None


def test_both_sides_of_a_plane_get_the_widest_element_that_fits_both():
    """Device rows 64 bytes apart fit 16-byte elements; host rows 72 bytes apart fit only 8-byte ones:
    both sides are viewed as int64, and a batched copy over them is byte for byte."""
    dev = _random_rows(6, WIDTH, 3)
    host_buf = torch.zeros((6, 72), dtype=torch.uint8)
    host = host_buf[:, :WIDTH]
    (wd, wh), = wide_planes([(dev, host)])
    assert wd.dtype == wh.dtype == torch.int64 and wd.shape == wh.shape == (6, WIDTH // 8)
    q = CompletionQueue()
    m = ThreadMover([(dev, host)], q, num_workers=0, batch_max=64)
    try:
        for i, (rows, slots) in enumerate([([0, 3, 5], [4, 1, 2]), ([1], [5])]):
            m.submit(Transfer(i, _STORE, rows, slots))
        m.flush()
        assert m.help_one() and all(r.ok for r in q.drain()) and m.batches == 1
        assert torch.equal(host[[4, 1, 2, 5]], dev[[0, 3, 5, 1]]) and not host_buf[:, WIDTH:].any()
    finally:
        m.close()


def test_each_plane_stages_its_rows_in_a_buffer_of_its_own_element_and_width():
    """Two planes whose rows fit different wide elements (64-byte rows: 16-byte elements; 24-byte rows:
    8-byte ones), copied by one batched copy each way, neither side's rows consecutive (the staged
    case): every plane byte for byte, in one batched copy per direction (none falls back to rows)."""
    dev0, dev1 = _random_rows(8, 64, 21), _random_rows(8, 24, 22)
    host0, host1 = torch.zeros((8, 64), dtype=torch.uint8), torch.zeros((8, 24), dtype=torch.uint8)
    q = CompletionQueue()
    m = ThreadMover([(dev0, host0), (dev1, host1)], q, num_workers=0, batch_max=64)
    try:
        assert [w.dtype for w, _ in m._wide] == [torch.complex128, torch.int64]
        m.submit(Transfer("s", _STORE, [6, 1, 4], [2, 7, 0]))
        m.flush()
        assert m.help_one() and [r.ok for r in q.drain()] == [True] and m.batches == 1
        m.submit(Transfer("l", _LOAD, [0, 5, 3], [7, 0, 2]))
        m.flush()
        assert m.help_one() and [(r.token, r.kind, r.ok) for r in q.drain()] == [("l", _LOAD, True)]
        assert m.batches == 2
        for dev, host in ((dev0, host0), (dev1, host1)):
            assert torch.equal(host[[2, 7, 0]], dev[[6, 1, 4]]) and not host[[1, 3, 4, 5, 6]].any()
            assert torch.equal(dev[[0, 5, 3]], dev[[1, 4, 6]])
    finally:
        m.close()


class _InterruptAtPut:
    """A completion queue whose ``n``-th put raises KeyboardInterrupt before queueing (as a signal
    handler does at the eval-breaker check around a call)."""

    def __init__(self, q: CompletionQueue, n: int) -> None:
        self.q, self.n = q, n

    def put(self, item: Any) -> None:
        self.n -= 1
        if self.n == 0:
            raise KeyboardInterrupt
        self.q.put(item)


def test_an_interrupt_at_the_third_report_of_an_owner_batch_answers_each_transfer_once():
    """help_one() copies a batch of three; the interrupt comes as the third report is put: the first
    two stay answered ok, the third is answered failed, and none is answered twice."""
    dev, host, q, m = _mover()
    try:
        for i in range(3):
            m.submit(Transfer(f"t{i}", _STORE, [3 * i, 3 * i + 1, 3 * i + 2], [3 * i, 3 * i + 1, 3 * i + 2]))
        m.flush()
        m._out = _InterruptAtPut(q, 3)
        with pytest.raises(KeyboardInterrupt):
            m.help_one()
        reps = [(r.token, r.ok) for r in q.drain()]
        assert reps == [("t0", True), ("t1", True), ("t2", False)]
    finally:
        m._out = q
        m.close()
