"""Adversarial review of the CPU native mover (``tiered_kv/movers/native.py``) and how ``TierManager`` drives it.

Findings (each proven by a test below that failed before its fix; the fixes follow each):

1. **A failed batch's reports are lost when an interrupt lands before its retries start.**
   ``NativeMover.harvest`` takes a failed batch out of ``_inflight`` *before* calling ``_failed``, and
   ``_failed`` logs (``log.warning``) and builds its first report outside the ``try`` that answers for an
   interrupt.  A ``KeyboardInterrupt`` there (here: raised by a logging handler, as a Ctrl-C during the log
   write would) leaves every transfer of the batch unanswered for good: the jobs are never reported, a
   load's rows stay fenced and its slots leased, ``wait(jobs)`` can only time out.  The thread mover answers
   each transfer of the same batch.  (``test_an_interrupt_while_a_failed_batch_is_logged_answers_every_transfer``)
   Fixed: ``_failed`` takes the batch out of ``_inflight`` and logs inside its ``try``.
2. **A transfer is answered failed while its launched copy is still running.**  In ``NativeMover._start``
   the batch is recorded in ``_inflight`` only after ``self._launch(...)`` returned, in a separate statement
   (``_Batch(...)`` is Python code, where a signal handler runs).  An interrupt between the two makes
   ``_start_held``'s handler (``_answer_unstarted``) answer the transfers "copy not started" although the copy
   is in flight: the manager reports the load failed and lifts its row fence, the engine writes the row, and
   the copy lands on top of it afterwards (invariants 1 and 4).
   Fixed: the batch is in ``_inflight`` before the launch, and the launch's future is put into it by C
   (``list.extend`` of the launcher's result), so no interrupt falls between the launch returning and the
   batch knowing it; one before the launch returned leaves it out, answered "copy not started", and
   nothing was launched.  The tests interrupt at both points: ``_Batch``'s construction (before the
   launch now; where the review's interrupt fell) and the count after it (the copy in flight).
   (``test_an_interrupt_before_the_launch_answers_the_transfer_and_launches_nothing``,
   ``test_an_interrupt_right_after_the_launch_returns_does_not_answer_the_copy_in_flight``,
   ``test_a_load_interrupted_around_its_launch_never_overwrites_the_row_the_engine_reused``)
3. **``wait(timeout=...)`` does not return on time while a native copy is in flight.**
   ``NativeMover.help_one`` blocks on ``self._inflight[0].future.wait()`` with no bound, and the manager's
   ``_block_until`` calls it whatever its deadline: a ``wait(jobs, timeout=0.05)`` returns only when the
   oldest batch's copy is done (a flush's copies are one batch, ``_NO_CUT``; a copy queued behind other work
   in torch's inter-op pool waits for it too).  With ``cpu_mover="threads"`` the same wait returns at its
   timeout.  (``test_wait_returns_at_its_timeout_while_a_copy_in_flight_is_slower``)
   Fixed: ``help_one`` waits at most ``HELP_WAIT_S`` (1 ms) for the oldest copy, on an event its future's
   done-callback sets; ``close()`` still waits for every copy.

Checked and found to hold (passing tests here where they add coverage):

* bytes through a manager for rows of 6, 8, 16 and 24 bytes, views with storage offsets (16-byte views
  where aligned, 8-byte where not, the thread mover where neither fits), native and threads movers landing
  the same bytes (``test_native_and_thread_movers_land_the_same_bytes_for_every_layout``);
* a load whose row is freed while its launched copy runs stays fenced until the copy's report; a store whose
  row is freed and rewritten while its copy runs is discarded and counted ``source_reused``, never
  published (``test_fences_hold_while_a_launched_copy_runs``);
* ``close()`` answers batches still in flight, and one whose real (TorchScript) copy raised inside the forked
  task (a failed report, no crash) (``test_close_answers_a_batch_in_flight_and_one_whose_real_copy_raised``).

Also checked without a new test (already covered or not a bug): every index path and two planes of
different widths, ``copy_batch_max`` flushes in ``submit``, out-of-order finishing batches, failed batches
copied again one by one, interrupts in ``flush`` and right after ``_inflight.append``, ``hold``/``help_one``
(inline copy up to ``HELP_BYTES``, memmove of a lone small transfer), inference-mode tensors
(``tests/test_inference_mode.py``), ``PYTORCH_JIT=0`` (the compiled copy still runs), row lists copied at the
API boundary (``checks._as_list``).  A second answer after an interrupt is documented and discarded by the
owner as an unknown token.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import pytest
import torch
from prometheus_client import CollectorRegistry

from fakes import fill_row, make_config, make_kv, mgr_metric, row_matches
from test_native_mover import _Deferred, _rows   # the native mover tests' launcher double and rows
from tiered_kv import TierManager
from tiered_kv.errors import BlockBusyError
from tiered_kv.jobs import JobKind, JobState
from tiered_kv.movers import CompletionQueue, NativeMover, ThreadMover, Transfer
from tiered_kv.movers import native as native_mod
from tiered_kv.movers import thread as thread_mod
from tiered_kv.movers.rowcopy import compiled
from tiered_kv.movers.thread import batch_copy

_STORE, _LOAD = JobKind.STORE, JobKind.LOAD
WAIT_S = 30.0


class _InterruptingHandler(logging.Handler):
    """A log handler whose write is interrupted (a Ctrl-C while a warning is written to the terminal)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.fired = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.fired += 1
        raise KeyboardInterrupt


def _with_interrupting_log(logger: logging.Logger, fn: Callable[[], Any]) -> int:
    """Run ``fn`` with an interrupting handler on ``logger``; the KeyboardInterrupt it raises is expected."""
    h = _InterruptingHandler()
    old = logger.level
    logger.setLevel(logging.WARNING)
    logger.addHandler(h)
    try:
        with pytest.raises(KeyboardInterrupt):
            fn()
    finally:
        logger.removeHandler(h)
        logger.setLevel(old)
    return h.fired


def _failing_batch(*args: Any) -> None:
    raise RuntimeError("injected batched copy failure")


# ---------------------------------------------------------------------------- 1: lost reports
@pytest.mark.parametrize("kind", ["native", "threads"])
def test_an_interrupt_while_a_failed_batch_is_logged_answers_every_transfer(kind: str):
    """Two transfers copied as one batch whose batched copy raises; the warning the mover logs about it is
    interrupted.  Whatever happens to the copies, each transfer must be answered: the owner never hears of a
    transfer that is not, and its job's rows and slots stay leased for ever."""
    dev, host = _rows(8, 64, 31), torch.zeros((8, 64), dtype=torch.uint8)
    q = CompletionQueue()
    ts = [Transfer("a", _STORE, [0, 1, 2], [0, 1, 2]), Transfer("b", _STORE, [3, 4, 5], [3, 4, 5])]
    if kind == "native":
        launch = _Deferred()
        m: Any = NativeMover([(dev, host)], q, batch_max=64, launch_fn=launch)
        for t in ts:
            m.submit(t)
        m.flush()
        launch.fail.add(0)
        launch.finish(0)                       # the batched copy raised
        fired = _with_interrupting_log(native_mod.log, m.harvest)
        launch.close(m)                        # finish whatever was started again, harvest, close
    else:
        m = ThreadMover([(dev, host)], q, num_workers=1, batch_max=64, batch_fn=_failing_batch)
        m.hold(True)                           # the owner's help_one copies the batch
        for t in ts:
            m.submit(t)
        fired = _with_interrupting_log(thread_mod.log, m.help_one)
        m.hold(False)
        m.close()
    assert fired == 1
    answered = [r.token for r in q.drain()]
    assert sorted(set(answered)) == ["a", "b"], f"answered: {answered}"


# ---------------------------------------------------------------------------- 2: answered while in flight
class _InterruptOnce:
    """Stands in for ``native._Batch``: the first batch made is interrupted (a signal handler running in its
    Python code).  The batch is made before the launch: nothing is launched then."""

    def __init__(self) -> None:
        self.armed = True

    def __call__(self, *args: Any) -> Any:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return native_mod._Batch(*args)


class _InterruptedAfterLaunch(NativeMover):
    """Once armed, the next launch that returned is interrupted at the next Python line (the batches
    count): its copy is in flight."""

    armed = False
    _count = 0

    @property
    def batches(self) -> int:   # type: ignore[override]
        return self._count

    @batches.setter
    def batches(self, n: int) -> None:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        self._count = n


def test_an_interrupt_before_the_launch_answers_the_transfer_and_launches_nothing(monkeypatch):
    launch = _Deferred()
    dev, host = _rows(8, 16, 32), _rows(8, 16, 33)
    before = dev[5].clone()
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=64, launch_fn=launch)
    monkeypatch.setattr(native_mod, "_Batch", _InterruptOnce())
    try:
        m.submit(Transfer("l", _LOAD, [5], [1]))
        with pytest.raises(KeyboardInterrupt):
            m.flush()
        assert launch.pending() == [], "nothing was launched"
        (r,) = q.drain()
        assert r.token == "l" and not r.ok and "not started" in (r.error or "")
        assert not m._inflight and torch.equal(dev[5], before)
    finally:
        launch.close(m)


def test_an_interrupt_right_after_the_launch_returns_does_not_answer_the_copy_in_flight():
    launch = _Deferred()
    dev, host = _rows(8, 16, 32), _rows(8, 16, 33)
    q = CompletionQueue()
    m = _InterruptedAfterLaunch([(dev, host)], q, batch_max=64, launch_fn=launch)
    m.armed = True
    try:
        m.submit(Transfer("l", _LOAD, [5], [1]))
        with pytest.raises(KeyboardInterrupt):
            m.flush()
        assert launch.pending() == [0], "the copy was launched"
        early = q.drain()
        assert early == [], f"answered while its copy is in flight: {early}"
        launch.finish(0)
        m.harvest()
        (r,) = q.drain()
        assert r.token == "l" and r.ok and torch.equal(dev[5], host[1])
    finally:
        launch.close(m)


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_load_interrupted_around_its_launch_never_overwrites_the_row_the_engine_reused(monkeypatch, where):
    """Invariant 4 end to end: once ``poll()`` reported the load and ``free_block`` said the row is free, the
    engine writes the row; nothing of the load may land on it later.  Interrupted before its launch, the load
    is reported failed and nothing was launched; after it, the load is in flight and its row stays fenced."""
    launch = _Deferred()
    kv = make_kv(16)
    mgr = TierManager(make_config(host_slots=16), kv, registry=CollectorRegistry(),
                      mover_factory=lambda d, h, q: _InterruptedAfterLaunch([(d, h)], q, batch_max=64,
                                                                            launch_fn=launch))
    mover = mgr._mover
    try:
        fill_row(kv, 0, b"cached")
        st = mgr.store(b"cached", 0)
        mgr.poll()                      # launched
        launch.finish(0)
        mgr.poll()
        assert st.state is JobState.DONE
        job = mgr.load(b"cached", 5)
        if where == "before":
            monkeypatch.setattr(native_mod, "_Batch", _InterruptOnce())
        else:
            mover.armed = True
        with pytest.raises(KeyboardInterrupt):
            mgr.poll()                  # the flush launches the load's copy, interrupted before or after
        assert launch.pending() == ([] if where == "before" else [1])
        mgr.poll()
        assert job.state.terminal == (where == "before")
        if job.state.terminal:          # reported: the engine takes its row back and writes it
            assert mgr.free_block(5)
            fill_row(kv, 5, b"engine")
        while launch.pending():         # the copy lands
            launch.finish(launch.pending()[0])
        mgr.poll()
        assert job.state.terminal
        if job.state is JobState.DONE:
            assert row_matches(kv, 5, b"cached")
        else:
            assert row_matches(kv, 5, b"engine"), "the failed load's copy overwrote the reused row"
    finally:
        while launch.pending():
            launch.finish(launch.pending()[0])
        mover.harvest()
        mgr.close()


# ---------------------------------------------------------------------------- 3: wait(timeout)
GATE_S = 1.0   # how long a gated copy waits at most for the test to release it (bounds the test, not its order)


def _gated_launch(gate: threading.Event) -> Callable[..., Any]:
    """A launcher whose copy runs on a thread of its own once ``gate`` is set (a slow copy, or one queued
    behind other work in torch's inter-op pool)."""
    def launch(planes: Any, *args: Any) -> Any:
        fut: torch.futures.Future = torch.futures.Future()

        def run() -> None:
            gate.wait(GATE_S)
            fut.set_result(compiled().copy_groups(planes.wait(), *args))

        threading.Thread(target=run, daemon=True).start()
        return fut
    return launch


@pytest.mark.parametrize("kind", ["native", "threads"])
def test_wait_returns_at_its_timeout_while_a_copy_in_flight_is_slower(kind: str):
    """A store's copy is under way (launched / taken by a copy thread) and takes longer than the wait's
    timeout: ``wait([job], timeout=0.05)`` returns with the job still pending; the copy then finishes and a
    later wait reports it."""
    gate, entered = threading.Event(), threading.Event()
    kv = make_kv(16)
    if kind == "native":
        factory: Any = lambda d, h, q: NativeMover([(d, h)], q, batch_max=64, launch_fn=_gated_launch(gate))
    else:
        def slow(*a: Any) -> None:
            entered.set()
            gate.wait(GATE_S)
            batch_copy(*a)
        factory = lambda d, h, q: ThreadMover([(d, h)], q, num_workers=1, batch_max=64, batch_fn=slow)
    mgr = TierManager(make_config(host_slots=16), kv, registry=CollectorRegistry(), mover_factory=factory)
    try:
        keys = [b"a", b"b", b"c"]   # three rows: the thread mover's batched copy (batch_fn), not its memmove
        for i, k in enumerate(keys):
            fill_row(kv, i, k)
        job = mgr.store_many(keys, [0, 1, 2])
        mgr.poll()                  # the copy starts
        if kind == "threads":
            assert entered.wait(WAIT_S), "the copy thread took the batch"
        mgr.wait([job], timeout=0.05)
        pending = not job.state.terminal
        gate.set()
        mgr.wait([job], timeout=WAIT_S)
        assert job.state is JobState.DONE
        assert pending, "wait(timeout=0.05) returned only once the copy was done"
    finally:
        gate.set()
        mgr.close()


# ---------------------------------------------------------------------------- what holds
@pytest.mark.parametrize("row_shape,dtype,offset,native", [
    ((4,), torch.float16, 0, True),       # 8-byte rows: int64 view
    ((2, 4), torch.float16, 0, True),     # 16 bytes: complex128 view
    ((12,), torch.float16, 0, True),      # 24 bytes: int64 view
    ((1,), torch.float64, 1, True),       # 8-byte rows at an 8-byte offset: int64 view
    ((2, 4), torch.float16, 4, True),     # 16-byte rows at an 8-byte offset: int64, not complex128
    ((2, 4), torch.float16, 1, False),    # a 2-byte offset: no wide view, the thread mover
    ((3,), torch.float16, 0, False),      # 6-byte rows: the thread mover
])
def test_native_and_thread_movers_land_the_same_bytes_for_every_layout(row_shape, dtype, offset, native):
    """Rows stored, the tiers then loaded back into other rows: both CPU movers land every byte, and
    ``cpu_mover="native"`` picks the native mover exactly where an 8/16-byte view fits."""
    per = int(torch.tensor(row_shape).prod())
    results = {}
    for mover in ("native", "threads"):
        base = make_kv(1, seed=7, shape=(offset + 16 * per,), dtype=dtype)
        kv = base.view(-1)[offset:offset + 16 * per].view(16, *row_shape)
        assert kv.storage_offset() == offset
        rb = kv[0].numel() * kv.element_size()
        mgr = TierManager(make_config(host_slots=16, row_bytes=rb, cpu_mover=mover, copy_batch_max=3), kv,
                          registry=CollectorRegistry())
        try:
            assert isinstance(mgr._mover, NativeMover) is (native and mover == "native")
            keys = [f"k{i}".encode() for i in range(8)]
            for i, k in enumerate(keys):
                fill_row(kv, i, k)
            stores = [mgr.store(k, i) for i, k in enumerate(keys[:5])] + [mgr.store_many(keys[5:], [5, 6, 7])]
            mgr.wait()
            assert all(j.state is JobState.DONE for j in stores)
            loads = [mgr.load(keys[0], 8), mgr.load_many(keys[1:], list(range(15, 8, -1)))]
            mgr.wait()
            assert all(j.state is JobState.DONE for j in loads)
            assert row_matches(kv, 8, keys[0]) and all(row_matches(kv, 16 - i, k) for i, k in enumerate(keys) if i)
            results[mover] = base.clone().view(torch.uint8) if dtype != torch.uint8 else base.clone()
        finally:
            mgr.close()
    assert torch.equal(results["native"], results["threads"])


def test_fences_hold_while_a_launched_copy_runs():
    """Invariants 4 and 5 with the native mover, copies launched and not finished: a load's row, freed, stays
    fenced until its copy's report; a store whose row is freed and rewritten meanwhile is discarded
    (``source_reused``) and its key never published with the engine's new bytes."""
    launch = _Deferred()
    kv = make_kv(16)
    mgr = TierManager(make_config(host_slots=16), kv, registry=CollectorRegistry(),
                      mover_factory=lambda d, h, q: NativeMover([(d, h)], q, batch_max=64, launch_fn=launch))
    mover = mgr._mover
    try:
        fill_row(kv, 0, b"old")
        st = mgr.store(b"old", 0)
        mgr.poll()
        launch.finish(0)
        mgr.poll()
        assert st.state is JobState.DONE
        fill_row(kv, 1, b"fresh")
        ld = mgr.load(b"old", 4)
        st2 = mgr.store(b"fresh", 1)
        mgr.poll()                                   # both launched, one batch
        assert launch.pending() == [1]
        assert mgr.free_block(4) is False            # the load's copy may still land
        with pytest.raises(BlockBusyError):
            mgr.store(b"x", 4)
        assert mgr.free_block(1) is True             # the store is given up; the engine reuses its row
        fill_row(kv, 1, b"other")
        mgr.poll()
        assert ld.state is JobState.CANCELLING and 4 in mgr._row_load
        assert st2.state is JobState.CANCELLED       # delivered at once; its slot stays leased
        launch.finish(1)
        mgr.poll()
        assert ld.state is JobState.CANCELLED and mgr.free_block(4) is True
        assert mgr.host_bytes(b"fresh") is None and mgr.lookup([b"fresh"]) == 0
        assert mgr_metric(mgr, "tiered_kv_stale_callbacks_total", kind="store", reason="source_reused") == 1
        assert mgr.debug_sizes()["jobs"] == 0 and mgr.host_used_slots == 1
    finally:
        while launch.pending():
            launch.finish(launch.pending()[0])
        mover.harvest()
        mgr.close()


def test_close_answers_a_batch_in_flight_and_one_whose_real_copy_raised():
    """``close()`` with copies in flight: one batch copied by the compiled launcher, and one whose real
    TorchScript copy raises (its host plane shrunk under the mover: an error inside the forked task, not a
    crash) -- every transfer answered once, the good one with its bytes."""
    dev, host = _rows(8, 64, 34), torch.zeros((8, 64), dtype=torch.uint8)
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=64)
    m.submit(Transfer("good", _STORE, [0, 1, 2], [0, 1, 2]))
    m.flush()
    real = m._launch

    def bad_planes(planes: Any, to_host: Any, *rest: Any) -> Any:   # the same launch over a 2-slot host plane
        held = compiled().hold_planes(m._dev, [h.narrow(0, 0, 2) for h in m._host])
        held.wait()
        return real(held, to_host, *rest)

    m._launch = bad_planes
    m.submit(Transfer("bad", _LOAD, [4, 5, 6], [5, 6, 7]))   # past the shrunk plane: the fork raises
    m.flush()
    m.close()
    reps = {r.token: r for r in q.drain()}
    assert set(reps) == {"good", "bad"} and reps["good"].ok and not reps["bad"].ok
    assert reps["bad"].error.startswith("copy failed: ")
    assert torch.equal(host[:3], dev[:3])
