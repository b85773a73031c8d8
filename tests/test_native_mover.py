"""NativeMover: a step's CPU copies as torch index ops in torch's inter-op threads (no GIL), answered
by the owner at ``harvest()``; every transfer exactly once, whatever fails or finishes first."""

from __future__ import annotations

import sys
import time
import uuid
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from mover_protocol import MoverProtocolMachine
from tiered_kv.jobs import JobKind
from tiered_kv.movers import CompletionQueue, NativeMover, Transfer
from tiered_kv.movers import rowcopy as native_mod

_STORE, _LOAD = JobKind.STORE, JobKind.LOAD


def _rows(n: int, width: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, width), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def _answers(m: NativeMover, q: CompletionQueue, n: int) -> list[Any]:
    """Harvest until ``n`` reports arrived (each wait is on a copy in flight: bounded)."""
    out: list[Any] = []
    while len(out) < n:
        out += q.drain()
        if len(out) < n and not m.help_one():
            out += q.drain()
            assert len(out) >= n, f"{len(out)} of {n} reports, nothing in flight"
    assert not q.drain(), "more reports than transfers"
    return out


class _Deferred:
    """A launcher whose copies run when the test says (``finish(i)``), in any order, or fail."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, torch.futures.Future]] = []
        self.fail: set[int] = set()          # calls whose copy raises when finished
        self.errors: list[Exception] = []    # copies that raised on their own

    def __call__(self, *args: Any) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        self.calls.append((args, fut))
        return fut

    def finish(self, i: int) -> None:
        args, fut = self.calls[i]
        if i in self.fail:
            fut.set_exception(RuntimeError(f"injected failure of call {i}"))
            return
        try:   # what the launcher forks, on the launcher's arguments (the planes it holds, then the rest)
            n = native_mod.compiled().copy_groups(args[0].wait(), *args[1:])
        except Exception as exc:   # as the real fork does: the future carries the copy's error
            self.errors.append(exc)
            fut.set_exception(exc)
        else:
            fut.set_result(n)

    def pending(self) -> list[int]:
        return [i for i, (_, f) in enumerate(self.calls) if not f.done()]

    def close(self, m: NativeMover) -> None:
        """Finish what is left (a failed assertion leaves copies pending: close() would wait for them), then close."""
        m.flush()
        while self.pending():
            for i in self.pending():
                self.finish(i)
            m.harvest()
        m.close()


# ---------------------------------------------------------------------------- the copies
@pytest.mark.parametrize("kind", [_STORE, _LOAD])
@pytest.mark.parametrize("rows,slots", [
    ([2, 3, 4], [5, 6, 7]),            # both ranges: one copy_
    ([7, 1, 4], [0, 1, 2]),            # destination range (store) / source range (load)
    ([0, 1, 2], [6, 2, 4]),            # the other way round
    ([7, 1, 4, 6, 0], [5, 2, 0, 3, 7]),  # neither: gathered and scattered through staging rows
], ids=["ranges", "rows-scattered", "slots-scattered", "both-scattered"])
def test_every_index_path_copies_the_right_bytes_over_two_planes(kind, rows, slots):
    """Two planes of different widths (16- and 8-byte views), staging rows forced to two per pass so the
    scattered case takes several passes; nothing outside the destinations changes."""
    dev_a, dev_b = _rows(8, 48, 1), _rows(8, 24, 2)
    slab = _rows(8, 80, 3)   # 8 bytes of padding per row: never written
    q = CompletionQueue()
    m = NativeMover([(dev_a, slab[:, :48]), (dev_b, slab[:, 48:72])], q, batch_max=64)
    try:
        assert [v.dtype for v in m._host] == [torch.complex128, torch.int64]
        m._stage_rows = [2, 2]
        before = dev_a.clone(), dev_b.clone(), slab.clone()
        m.submit(Transfer("t", kind, rows, slots))
        assert not m._inflight, "queued until flush"
        m.flush()
        (r,) = _answers(m, q, 1)
        assert r.ok and r.token == "t" and r.nbytes == len(rows) * 72
        if kind is _STORE:
            assert torch.equal(slab[slots, :48], dev_a[rows]) and torch.equal(slab[slots, 48:72], dev_b[rows])
            assert torch.equal(slab[:, 72:], before[2][:, 72:])
            others = [s for s in range(8) if s not in slots]
            assert torch.equal(slab[others], before[2][others])
            assert torch.equal(dev_a, before[0]) and torch.equal(dev_b, before[1])
        else:
            assert torch.equal(dev_a[rows], before[2][slots, :48])
            assert torch.equal(dev_b[rows], before[2][slots, 48:72])
            others = [i for i in range(8) if i not in rows]
            assert torch.equal(dev_a[others], before[0][others]) and torch.equal(dev_b[others], before[1][others])
            assert torch.equal(slab, before[2])
    finally:
        m.close()


def test_a_flush_is_one_launch_and_each_transfer_gets_its_own_report():
    dev, host = _rows(16, 32, 4), torch.zeros((16, 32), dtype=torch.uint8)
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=64)
    try:
        m.submit(Transfer("s1", _STORE, [3, 4], [0, 1]))
        m.submit(Transfer("s2", _STORE, [9], [2]))
        m.flush()
        assert m.batches == 1
        _answers(m, q, 2)
        m.submit(Transfer("l1", _LOAD, [10, 11], [0, 1]))
        m.submit(Transfer("s3", _STORE, [5], [3]))
        m.submit(Transfer("l2", _LOAD, [12], [2]))
        m.flush()
        assert m.batches == 2   # this flush's stores, then its loads, in one launch
        reps = {r.token: r for r in _answers(m, q, 3)}
        assert all(r.ok for r in reps.values()) and reps["l1"].nbytes == 64 and reps["l2"].nbytes == 32
        assert torch.equal(dev[[10, 11, 12]], dev[[3, 4, 9]]) and torch.equal(host[3], dev[5])
    finally:
        m.close()


def test_batch_max_starts_the_copies_in_submit():
    dev, host = _rows(4, 16, 5), torch.zeros((4, 16), dtype=torch.uint8)
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=2)
    try:
        m.submit(Transfer("a", _STORE, [0], [0]))
        assert not m._inflight
        m.submit(Transfer("b", _STORE, [1], [1]))
        assert len(m._inflight) == 1 and not m._held
        _answers(m, q, 2)
    finally:
        m.close()


def test_transfers_that_need_no_copy_are_answered_at_flush_without_a_launch():
    launch = _Deferred()
    dev, host = _rows(4, 16, 6), torch.zeros((2, 16), dtype=torch.uint8)
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=64, launch_fn=launch)
    try:
        cancelled = Transfer("c", _STORE, [0], [0], cancelled=True)
        m.submit(cancelled)
        m.submit(Transfer("oor", _STORE, [0], [2]))          # slot past the slab
        m.submit(Transfer("neg", _LOAD, [-1], [0]))          # negative row
        m.submit(Transfer("len", _STORE, [0, 1], [0]))       # rows and slots of different lengths
        m.submit(Transfer("empty", _LOAD, [], []))
        m.flush()
        assert launch.calls == [] and not m._inflight
        reps = {r.token: r for r in q.drain()}
        assert set(reps) == {"c", "oor", "neg", "len", "empty"}
        assert not reps["c"].ok and reps["c"].error == "cancelled before copy"
        assert all(not reps[k].ok for k in ("oor", "neg", "len")) and "out of range" in reps["oor"].error
        assert "1 slots" in reps["len"].error
        assert reps["empty"].ok and reps["empty"].nbytes == 0
        assert torch.equal(host, torch.zeros_like(host))
    finally:
        launch.close(m)


def test_batches_finishing_out_of_order_are_answered_as_they_finish_and_only_then():
    launch = _Deferred()
    dev, host = _rows(8, 16, 7), torch.zeros((8, 16), dtype=torch.uint8)
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=1, launch_fn=launch)
    try:
        for i in range(3):
            m.submit(Transfer(f"t{i}", _STORE, [i], [i]))
        assert len(launch.calls) == 3
        m.harvest()
        assert q.drain() == [] and not host.any(), "nothing answered before its copy finished"
        launch.finish(2)
        m.harvest()
        (r,) = q.drain()
        assert r.token == "t2" and r.ok and torch.equal(host[2], dev[2])
        launch.finish(0)
        launch.finish(1)
        m.harvest()
        assert sorted(r.token for r in q.drain()) == ["t0", "t1"] and not m._inflight
    finally:
        launch.close(m)


def test_a_failed_batch_is_copied_again_transfer_by_transfer_each_answered_by_its_own_outcome():
    launch = _Deferred()
    dev, host = _rows(8, 16, 8), torch.zeros((8, 16), dtype=torch.uint8)
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=64, launch_fn=launch)
    try:
        for i in range(3):
            m.submit(Transfer(f"t{i}", _STORE, [i], [i + 4]))
        m.flush()
        launch.fail.add(0)
        launch.finish(0)
        m.harvest()
        assert q.drain() == [] and m.retried == 3 and len(launch.calls) == 4   # three alone
        launch.fail.add(2)                   # the second transfer's own copy fails
        for i in (1, 2, 3):
            launch.finish(i)
        m.harvest()
        reps = {r.token: r for r in q.drain()}
        assert set(reps) == {"t0", "t1", "t2"} and not m._inflight
        assert reps["t0"].ok and reps["t2"].ok and not reps["t1"].ok
        assert reps["t1"].error == "copy failed: RuntimeError: injected failure of call 2"
        assert all(r.kind is _STORE for r in reps.values())
        assert torch.equal(host[[4, 6]], dev[[0, 2]]) and not host[5].any()
    finally:
        launch.close(m)


def test_an_interrupt_while_a_failed_batch_starts_again_answers_only_what_is_not_in_flight():
    launch = _Deferred()
    calls = [0]

    def interrupting(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:   # the batch, its first transfer again, then the second: interrupted
            raise KeyboardInterrupt
        return launch(*args)

    dev, host = _rows(8, 16, 15), torch.zeros((8, 16), dtype=torch.uint8)
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=64, launch_fn=interrupting)
    try:
        for i in range(3):
            m.submit(Transfer(f"t{i}", _STORE, [i], [i]))
        m.flush()
        launch.fail.add(0)
        launch.finish(0)
        with pytest.raises(KeyboardInterrupt):
            m.harvest()
        early = {r.token: r for r in q.drain()}
        assert set(early) == {"t1", "t2"} and not any(r.ok for r in early.values())
        assert {r.error for r in early.values()} == {"copy failed: RuntimeError: injected failure of call 0"}
        assert all(r.kind is _STORE for r in early.values())
        launch.finish(1)
        m.harvest()
        (r,) = q.drain()
        assert r.token == "t0" and r.ok and torch.equal(host[0], dev[0])
    finally:
        launch.close(m)


@pytest.mark.parametrize("exc,text", [
    (RuntimeError("The following operation failed in the TorchScript interpreter.\nTraceback of TorchScript code:\n"
                  "  File \"<copy>\", line 9\nRuntimeError: index 99 is out of bounds for dimension 0 with size 8\n"),
     "copy failed: RuntimeError: RuntimeError: index 99 is out of bounds for dimension 0 with size 8"),
    (RuntimeError(), "copy failed: RuntimeError: "),
    (IndexError("  \n"), "copy failed: IndexError: "),
])
def test_a_failed_copy_is_answered_with_the_last_line_of_its_error(exc: Exception, text: str):
    """A TorchScript error's message is the script's traceback, then the error: the report keeps the type
    and the last line.  A message with no line at all still gives a report (and the owner a job error)."""
    def launch(*args: Any) -> Any:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_exception(exc)
        return fut

    dev, host = _rows(4, 16, 21), torch.zeros((4, 16), dtype=torch.uint8)
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=64, launch_fn=launch)
    try:
        m.submit(Transfer("a", _LOAD, [0], [1]))
        m.flush()
        m.harvest()
        (r,) = q.drain()
        assert (r.token, r.kind, r.ok, r.error) == ("a", _LOAD, False, text)
    finally:
        m.close()


def test_a_copy_the_blocking_owner_makes_itself_that_raises_is_answered_like_a_launched_one():
    """help_one copies what it holds on the calling thread (``run_fn``); when that copy raises, its
    transfers are answered by its error as a launched batch's would be: a lone one failed at once, two
    started again one by one (here in the inter-op threads: ``launch_fn``), each by its own outcome."""
    launch = _Deferred()
    runs = [0]

    def run(*args: Any) -> int:
        runs[0] += 1
        raise RuntimeError(f"owner copy {runs[0]} failed")

    dev, host = _rows(8, 4096, 22), torch.zeros((8, 4096), dtype=torch.uint8)
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=64, launch_fn=launch, run_fn=run)
    try:
        m.hold(True)
        m.submit(Transfer("lone", _STORE, [0, 1, 2], [0, 1, 2]))    # more rows than memmove takes
        assert m.help_one() is True
        (r,) = q.drain()
        assert (r.token, r.kind, r.ok, r.error) == ("lone", _STORE, False, "copy failed: RuntimeError: owner copy 1 failed")
        m.submit(Transfer("a", _LOAD, [3, 4, 5], [3, 4, 5]))
        m.submit(Transfer("b", _LOAD, [6, 7, 0], [6, 7, 0]))
        assert m.help_one() is True
        assert q.drain() == [] and m.retried == 2 and len(launch.calls) == 2
        launch.finish(0)
        launch.finish(1)
        m.harvest()
        reps = {r.token: r for r in q.drain()}
        assert set(reps) == {"a", "b"} and all(r.ok and r.kind is _LOAD for r in reps.values())
        assert torch.equal(dev[[3, 4, 5, 6, 7, 0]], host[[3, 4, 5, 6, 7, 0]])
    finally:
        m.hold(False)
        launch.close(m)


def test_a_batchs_copy_time_is_shared_by_its_rows(monkeypatch: pytest.MonkeyPatch):
    """Each transfer's report carries the batch's time from launch to answer, shared by rows (the copy-time
    histogram is per block): on a fake clock, 0.8 s over 1 + 3 rows, and 0.5 s for a lone row."""
    from tiered_kv.movers import native as native_mover_mod
    now = [100.0]
    monkeypatch.setattr(native_mover_mod.time, "perf_counter", lambda: now[0])
    launch = _Deferred()
    dev, host = _rows(8, 16, 23), torch.zeros((8, 16), dtype=torch.uint8)
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=64, launch_fn=launch)
    try:
        m.submit(Transfer("one", _STORE, [0], [0]))
        m.submit(Transfer("three", _STORE, [1, 2, 3], [1, 2, 3]))
        m.flush()
        now[0] += 0.8
        launch.finish(0)
        m.harvest()
        reps = {r.token: r for r in q.drain()}
        assert reps["one"].seconds == pytest.approx(0.2) and reps["three"].seconds == pytest.approx(0.6)
        assert (reps["one"].nbytes, reps["three"].nbytes) == (16, 48)
        m.submit(Transfer("lone", _LOAD, [5], [0]))
        m.flush()
        now[0] += 0.5
        launch.finish(1)
        m.harvest()
        (r,) = q.drain()
        assert r.seconds == pytest.approx(0.5) and r.nbytes == 16
    finally:
        launch.close(m)


def test_a_launch_that_raises_fails_its_transfers():
    def launch(*args: Any) -> Any:
        raise RuntimeError("no threads")

    dev, host = _rows(4, 16, 9), torch.zeros((4, 16), dtype=torch.uint8)
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=64, launch_fn=launch)
    try:
        m.submit(Transfer("a", _STORE, [0], [0]))
        m.submit(Transfer("b", _STORE, [1], [1]))
        m.flush()
        reps = q.drain()
        assert sorted(r.token for r in reps) == ["a", "b"]
        assert all(r.ok is False and r.kind is _STORE and r.error == "copy failed to start: RuntimeError('no threads')"
                   for r in reps)
    finally:
        m.close()


def test_an_interrupt_during_flush_leaves_no_transfer_unanswered_and_none_answered_twice():
    """A KeyboardInterrupt raised by the second flush's launch: the first flush's transfers are answered
    by their copy, the second's failed at once; the interrupt propagates."""
    launch = _Deferred()
    calls = [0]

    def interrupting(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return launch(*args)

    dev, host = _rows(8, 16, 10), torch.zeros((8, 16), dtype=torch.uint8)
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=64, launch_fn=interrupting)
    try:
        m.submit(Transfer("s", _STORE, [0], [0]))
        m.flush()
        m.submit(Transfer("l1", _LOAD, [5], [1]))
        m.submit(Transfer("l2", _LOAD, [6], [2]))
        with pytest.raises(KeyboardInterrupt):
            m.flush()
        early = {r.token: r for r in q.drain()}
        assert set(early) == {"l1", "l2"} and not any(r.ok for r in early.values())
        assert {r.error for r in early.values()} == {"copy not started: KeyboardInterrupt()"}
        assert all(r.kind is _LOAD for r in early.values())
        launch.finish(0)
        m.harvest()
        (r,) = q.drain()
        assert r.token == "s" and r.ok
    finally:
        launch.close(m)


def test_an_interrupt_right_after_a_launch_does_not_answer_the_batch_in_flight():
    """The interrupt lands after the launch, before the flush counts the batch as started (here: in the
    ``batches`` counter's update): the batch is in flight and its copy answers it; a failed answer too
    would release a load's row fence while its copy may still land."""
    launch = _Deferred()

    class Interrupted(NativeMover):
        _n = 0

        @property
        def batches(self) -> int:
            return self._n

        @batches.setter
        def batches(self, v: int) -> None:
            self._n = v
            if v == 1:
                raise KeyboardInterrupt

    dev, host = _rows(8, 16, 14), torch.zeros((8, 16), dtype=torch.uint8)
    q = CompletionQueue()
    m = Interrupted([(dev, host)], q, batch_max=64, launch_fn=launch)
    try:
        m.submit(Transfer("s", _STORE, [0], [0]))
        m.submit(Transfer("l", _LOAD, [5], [1]))
        with pytest.raises(KeyboardInterrupt):
            m.flush()
        assert q.drain() == []
        launch.finish(0)
        m.harvest()
        reps = {r.token: r for r in q.drain()}
        assert set(reps) == {"s", "l"} and all(r.ok for r in reps.values()) and torch.equal(host[0], dev[0])
    finally:
        launch.close(m)


def test_help_one_waits_for_the_oldest_copy_and_close_answers_everything():
    dev, host = _rows(64, 4096, 11), torch.zeros((64, 4096), dtype=torch.uint8)
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=64)
    assert m.help_one() is False   # nothing in flight
    m.submit(Transfer("a", _STORE, list(range(32)), list(range(32))))
    assert m.help_one() is True    # starts it, waits for it, answers it
    (r,) = q.drain()
    assert r.ok and torch.equal(host[:32], dev[:32])
    m.submit(Transfer("b", _STORE, list(range(32, 64)), list(range(32, 64))))
    m.close()
    (r,) = q.drain()
    assert r.token == "b" and r.ok and torch.equal(host, dev)
    m.close()   # twice: nothing more


def test_a_blocking_owner_copies_what_it_holds_itself_and_hands_more_than_help_bytes_to_the_threads():
    """hold(True): what is queued, before the hold too, stays held and flush() starts nothing; help_one
    copies up to HELP_BYTES on the calling thread (no launch), more than that goes to a launch;
    hold(False) starts what is left."""
    from tiered_kv.movers.thread import HELP_BYTES
    launch = _Deferred()
    ran: list[int] = []

    def run(*args: Any) -> int:
        ran.append(len(args[6]))
        return native_mod.compiled().copy_groups(*args)

    rows = HELP_BYTES // 4096      # 4 KiB rows: HELP_BYTES is this many
    dev, host = _rows(rows + 2, 4096, 16), torch.zeros((rows + 2, 4096), dtype=torch.uint8)
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=1 << 16, launch_fn=launch, run_fn=run)
    try:
        m.submit(Transfer("small", _STORE, list(range(rows)), list(range(rows))))   # HELP_BYTES exactly
        m.hold(True)      # queued before the hold: kept for the owner too
        m.flush()
        assert launch.calls == [] and len(m._held) == 1
        assert m.help_one() is True
        assert ran == [1] and launch.calls == []
        (r,) = q.drain()
        assert r.token == "small" and r.ok and torch.equal(host[:rows], dev[:rows])
        m.submit(Transfer("big", _LOAD, list(range(rows + 1)), list(range(rows + 1))))
        m.submit(Transfer("late", _STORE, [rows + 1], [rows + 1]))
        assert launch.calls == []

        def launch_and_finish(*args: Any) -> Any:   # the wait that follows returns at once
            fut = launch(*args)
            launch.finish(len(launch.calls) - 1)
            return fut

        m._launch = launch_and_finish   # more than HELP_BYTES held: launched, then waited for
        assert m.help_one() is True
        assert ran == [1] and len(launch.calls) == 1
        assert sorted(r.token for r in q.drain()) == ["big", "late"]
        m.submit(Transfer("after", _STORE, [3], [3]))
        m.hold(False)
        assert not m._held and len(m._inflight) == 1
    finally:
        launch.close(m)


def test_the_copy_runs_while_the_owner_holds_the_gil():
    """With a switch interval of 30 s the owner, spinning in Python, gives the GIL up to no other thread:
    the copy must finish without it (a tensor Python holds, dropped on the inter-op thread, would need it:
    the launcher detaches them).  The deadline only bounds the test; a correct copy takes microseconds."""
    dev, host = _rows(1024, 65536, 12), torch.zeros((1024, 65536), dtype=torch.uint8)   # 64 MiB each
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=64)
    m.submit(Transfer("warm", _STORE, [0], [0]))
    _answers(m, q, 1)   # compiled and the inter-op threads started, before the GIL is held
    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        # scattered rows, 16 MiB (one batch): the copy outlasts the launch, so the inter-op thread drops the
        # last references to the index tensors the owner made for it
        rows = list(range(1, 512, 2))
        m.submit(Transfer("t", _STORE, rows, rows[::-1]))
        m.flush()
        fut = m._inflight[0].future
        deadline = time.monotonic() + 10.0
        while not fut.done() and time.monotonic() < deadline:
            pass
        done = fut.done()
    finally:
        sys.setswitchinterval(old)
    try:
        assert done, "the copy waited for the GIL"
        (r,) = _answers(m, q, 1)
        assert r.ok and torch.equal(host[rows[::-1]], dev[rows])
    finally:
        m.close()


def test_planes_no_wide_view_fits_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="use ThreadMover"):
        NativeMover([(torch.zeros((2, 3), dtype=torch.uint8), torch.zeros((2, 3), dtype=torch.uint8))],
                    CompletionQueue())
    with pytest.raises(ValueError, match="batch_max must be >= 1, got 0"):
        NativeMover([(torch.zeros((2, 16), dtype=torch.uint8), torch.zeros((2, 16), dtype=torch.uint8))],
                    CompletionQueue(), batch_max=0)


# ---------------------------------------------------------------------------- a state machine
class NativeMoverMachine(MoverProtocolMachine):
    """The owner's protocol (``mover_protocol``) on a NativeMover whose copies finish in an order the
    machine picks (the launcher defers each copy until then), some failing; a failed batch starts again
    transfer by transfer."""

    @initialize(seed=st.integers(0, 2**16), batch_max=st.sampled_from([1, 3, 64]))
    def setup(self, seed: int, batch_max: int) -> None:
        self.start(seed)
        self.launch = _Deferred()
        self.m = NativeMover([(self.dev, self.host)], self.q, batch_max=batch_max, launch_fn=self.launch)
        self.m._stage_rows = [2]

    @rule(data=st.data(), fail=st.booleans())
    def finish_a_copy(self, data: Any, fail: bool) -> None:
        pending = self.launch.pending()
        if pending:
            i = data.draw(st.sampled_from(pending))
            if fail:
                self.launch.fail.add(i)
            self.launch.finish(i)

    @rule()
    def harvest(self) -> None:
        self.m.harvest()

    def check_state(self) -> None:
        assert not self.launch.errors, self.launch.errors

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        self.m.flush()
        self.m.harvest()   # copies finished but not harvested yet: failed ones start again, deferred
        while self.launch.pending():
            self.launch.finish(self.launch.pending()[0])
            self.m.harvest()
        assert not self.m._inflight
        self.m.close()
        self.collect()
        assert not self.pending, f"never answered: {sorted(self.pending)}"


TestNativeMoverMachine = NativeMoverMachine.TestCase
TestNativeMoverMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])


def test_a_stale_uuid_token_is_just_data():
    """Tokens are opaque: a UUID comes back as given."""
    dev, host = _rows(2, 16, 13), torch.zeros((2, 16), dtype=torch.uint8)
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q)
    try:
        tok = uuid.uuid4()
        m.submit(Transfer(tok, _STORE, [1], [0]))
        (r,) = _answers(m, q, 1)
        assert r.token is tok
    finally:
        m.close()


def test_an_interrupt_inside_the_owners_memmove_answers_the_transfer_once_and_propagates(monkeypatch: pytest.MonkeyPatch):
    """A KeyboardInterrupt while the blocking owner copies a lone transfer with memmove: the transfer is
    off the queue (never copied twice) and answered failed, by token and kind, saying why; the
    interrupt reaches the caller."""
    from tiered_kv.movers import native as native_mover_mod

    def interrupted(planes: Any, t: Transfer) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(native_mover_mod, "memmove_rows", interrupted)
    launch = _Deferred()
    dev, host = _rows(8, 64, 24), torch.zeros((8, 64), dtype=torch.uint8)
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=64, launch_fn=launch)
    try:
        m.hold(True)
        m.submit(Transfer("lone", _LOAD, [3], [4]))
        with pytest.raises(KeyboardInterrupt):
            m.help_one()
        assert not m._held and launch.calls == []
        (r,) = q.drain()
        assert (r.token, r.kind, r.ok, r.error) == ("lone", _LOAD, False, "copy interrupted: KeyboardInterrupt()")
    finally:
        m.hold(False)
        launch.close(m)


def test_a_lone_small_transfer_held_by_a_blocking_owner_is_copied_with_memmove_not_launched():
    """One held transfer of at most FEW_ROWS rows: copied on the calling thread without the compiled
    copy or a launch (a lone load's row copy); a cancelled one is answered without a copy."""
    launch = _Deferred()

    def run(*args: Any) -> int:
        raise AssertionError("the compiled copy was used for a lone small transfer")

    dev, host = _rows(8, 64, 17), torch.zeros((8, 64), dtype=torch.uint8)
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=64, launch_fn=launch, run_fn=run)
    try:
        m.hold(True)
        m.submit(Transfer("two", _STORE, [5, 2], [1, 6]))
        assert m.help_one() is True and not m._held and launch.calls == []
        (r,) = q.drain()
        assert r.token == "two" and r.ok and r.nbytes == 128 and torch.equal(host[[1, 6]], dev[[5, 2]])
        m.submit(Transfer("gone", _LOAD, [0], [1], cancelled=True))
        assert m.help_one() is True
        (r,) = q.drain()
        assert r.token == "gone" and not r.ok and r.error == "cancelled before copy"
        assert not dev[0].equal(host[1])
        m.submit(Transfer("three", _STORE, [0, 1, 2], [0, 2, 3]))   # more than FEW_ROWS: not memmove
        m.hold(False)
        assert len(launch.calls) == 1
    finally:
        launch.close(m)


def test_the_launcher_is_handed_no_tensor_python_holds():
    """What crosses to the inter-op thread: the planes as the future made at start (detached there), every
    other argument lists of ints and bools; the row indexes become tensors in the inter-op thread.  A tensor
    made here would be dropped there, and take the GIL (``test_the_copy_runs_while_the_owner_holds_the_gil``)."""
    seen: list[tuple[Any, ...]] = []
    real = native_mod.compiled().launch

    def launch(*args: Any) -> Any:
        seen.append(args)
        return real(*args)

    dev, host = _rows(16, 64, 21), torch.zeros((16, 64), dtype=torch.uint8)
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=64, launch_fn=launch)
    try:
        m.submit(Transfer("scattered", _STORE, [3, 1, 7], [9, 2, 5]))
        m.submit(Transfer("run", _STORE, [10, 11], [12, 13]))
        m.submit(Transfer("back", _LOAD, [4, 6], [2, 9]))
        m.flush()
        assert all(r.ok for r in _answers(m, q, 3))
        (args,) = seen
        assert args[0] is m._planes_held and isinstance(args[0], torch._C.Future)

        def tensors(x: Any) -> int:
            return 1 if isinstance(x, torch.Tensor) else sum(map(tensors, x)) if isinstance(x, (list, tuple)) else 0

        assert tensors(args[1:]) == 0, args
        assert list(args[1]) == [True, False]                 # the stores' group, then the loads'
        assert list(args[2]) == [[9, 2, 5, 12, 13], [4, 6]] and list(args[3]) == [[3, 1, 7, 10, 11], [2, 9]]
        assert torch.equal(host[[9, 2, 5, 12, 13]], dev[[3, 1, 7, 10, 11]]) and torch.equal(dev[[4, 6]], host[[2, 9]])
    finally:
        m.close()


@pytest.mark.parametrize("dst,src,want", [
    ([4, 5, 6], [0, 1, 2], ([], [], 4, 0, 3, True, True)),
    ([4, 5, 6], [2, 0, 1], ([], [2, 0, 1], 4, 2, 3, True, False)),
    ([6, 5, 4], [0, 1, 2], ([6, 5, 4], [], 6, 0, 3, False, True)),
    ([7], [3], ([], [], 7, 3, 1, True, True)),
    ([1, 3], [2, 4], ([1, 3], [2, 4], 1, 2, 2, False, False)),
])
def test_list_args_pass_an_index_only_where_a_side_is_not_a_range(dst, src, want):
    assert native_mod.list_args(dst, src) == want
