"""Adversarial review of the CPU copy mover (``tiered_kv/movers/thread.py``) and how the manager drives it.

Each test forces one interleaving with Events, gated/failing injected ``batch_fn`` or a trace hook
(never a sleep for ordering).  Each failed before the fix it pins; its docstring says what went wrong
then: transfers left unanswered by ``close()`` when a copy thread died during it or just before it, a
dying worker answering a new batch with the last one's count, and malformed transfers on the
row-by-row path copied (in part) instead of failing before any copy."""

from __future__ import annotations

import inspect
import os
import sys
import threading
import uuid
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from fakes import fill_row, make_config, make_kv
from tiered_kv import TierManager
from tiered_kv.jobs import JobKind
from tiered_kv.movers import CompletionQueue, ThreadMover, Transfer
from tiered_kv.movers.thread import batch_copy

_STORE, _LOAD = JobKind.STORE, JobKind.LOAD
WAIT_S = 30


class _Dies(BaseException):
    """Kills a copy thread (not an ``Exception``: the batched copy's fallback does not catch it)."""


def _random_rows(n: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, width), generator=g, dtype=torch.uint8)


class _ClosingMover(ThreadMover):
    """A ThreadMover whose ``_closed`` fires an Event when ``close()`` sets it (nothing else changes)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        self.closing = threading.Event()
        super().__init__(*a, **kw)

    @property
    def _closed(self) -> bool:   # type: ignore[override]
        return self.__dict__.get("_c", False)

    @_closed.setter
    def _closed(self, v: bool) -> None:
        self.__dict__["_c"] = v
        if v:
            self.closing.set()


class _DieAfterCloseBegins:
    """batch_fn: the first batch blocks until ``close()`` has set ``_closed``, then kills its copy thread;
    later batches are copied normally."""

    def __init__(self) -> None:
        self.mover: Any = None
        self.entered = threading.Event()
        self.calls = 0

    def __call__(self, dst, dst_rows, src, src_rows, stage) -> None:
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            assert self.mover.closing.wait(WAIT_S)
            raise _Dies("copy thread killed while close() runs")
        batch_copy(dst, dst_rows, src, src_rows, stage)


# ---------------------------------------------------------------------------- close() vs a dying worker
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_close_answers_the_batches_queued_behind_a_worker_that_dies_during_it():
    """One copy thread (the vLLM copier's configuration; the manager's two die the same way): it is in
    batch X when close() starts, batch Y is queued.  close() sets _closed, queues one stop sentinel and
    joins; the thread dies in X, answers X, and (closed) is not replaced.  Y is never copied nor
    answered, yet close() returns."""
    fn = _DieAfterCloseBegins()
    dev, host = _random_rows(16, 64, 1), torch.zeros((16, 64), dtype=torch.uint8)
    q = CompletionQueue()
    m = _ClosingMover([(dev, host)], q, num_workers=1, batch_max=64, batch_fn=fn)
    fn.mover = m
    m.submit(Transfer("X", _STORE, [0, 1, 2], [0, 1, 2]))
    m.flush()
    assert fn.entered.wait(WAIT_S)
    m.submit(Transfer("Y", _STORE, [3, 4, 5], [3, 4, 5]))
    m.flush()                                   # Y queued behind X, for the one (busy) worker
    m.close()                                   # the worker dies in X once _closed is set
    answered = sorted(r.token for r in q.drain())
    assert answered == ["X", "Y"], f"answered after close(): {answered}"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_manager_close_reports_a_store_queued_behind_a_copy_thread_that_dies_during_it():
    """The same through a TierManager: a store whose batch was queued behind the dying worker's is
    never reported (still PENDING after close()), breaking invariant 1."""
    fn = _DieAfterCloseBegins()
    kv = make_kv(16)

    def factory(d, h, q):
        m = _ClosingMover([(d, h)], q, num_workers=1, batch_max=64, batch_fn=fn)
        fn.mover = m
        return m

    mgr = TierManager(make_config(host_slots=16), kv, registry=CollectorRegistry(), mover_factory=factory)
    keys = [b"k%d" % i for i in range(6)]
    for i, k in enumerate(keys):
        fill_row(kv, i, k)
    first = mgr.store_many(keys[:3], [0, 1, 2])
    mgr.poll()                                  # its batch goes to the worker, which blocks in it
    assert fn.entered.wait(WAIT_S)
    second = mgr.store_many(keys[3:], [3, 4, 5])
    mgr.poll()                                  # queued behind it
    mgr.close()
    assert first.state.terminal
    assert second.state.terminal, f"store never reported by close(): {second.state}"


class _SignalLock:
    """Stands in for ``ThreadMover._lock``: sets ``by_owner`` when the owner thread takes it (close()'s
    snapshot of the worker list)."""

    def __init__(self, owner: threading.Thread) -> None:
        self._l = threading.Lock()
        self.owner = owner
        self.by_owner = threading.Event()

    def __enter__(self) -> "_SignalLock":
        self._l.acquire()
        if threading.current_thread() is self.owner:
            self.by_owner.set()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._l.release()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_close_joins_a_replacement_worker_spawned_while_it_runs():
    """A worker dies just before close(): it reads _closed (False) and goes to spawn its replacement,
    but close() takes the worker list first.  close() joins only the dead worker; the replacement
    takes batch Y (gated here) and answers it after close() returned."""
    calls = [0]
    entered, die, replacement_in_y, release_y = (threading.Event() for _ in range(4))

    def fn(dst, dst_rows, src, src_rows, stage) -> None:
        calls[0] += 1
        if calls[0] == 1:
            entered.set()
            assert die.wait(WAIT_S)
            raise _Dies("copy thread killed")
        replacement_in_y.set()
        release_y.wait(1)                       # on a fixed close() this only delays close() by 1 s
        batch_copy(dst, dst_rows, src, src_rows, stage)

    dev, host = _random_rows(16, 64, 2), torch.zeros((16, 64), dtype=torch.uint8)
    q = CompletionQueue()
    m = ThreadMover([(dev, host)], q, num_workers=1, batch_max=64, batch_fn=fn)
    lock = m._lock = _SignalLock(threading.current_thread())
    in_spawn = threading.Event()
    spawn = m._spawn

    def late_spawn() -> None:                   # the dying worker, between its _closed check and the lock
        in_spawn.set()
        assert lock.by_owner.wait(WAIT_S)
        spawn()

    m._spawn = late_spawn
    try:
        m.submit(Transfer("X", _STORE, [0, 1, 2], [0, 1, 2]))
        m.flush()
        assert entered.wait(WAIT_S)
        m.submit(Transfer("Y", _STORE, [3, 4, 5], [3, 4, 5]))
        m.flush()
        die.set()
        assert in_spawn.wait(WAIT_S)
        m.close()
        answered = sorted(r.token for r in q.drain())
        assert answered == ["X", "Y"], f"answered when close() returned: {answered}"
    finally:
        release_y.set()


# ---------------------------------------------------------------------------- a worker killed between batches
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def _running(cls: type, name: str) -> Any:
    """The function a call of ``cls.name`` runs, for a test that traces its code: the method itself, or
    under ``make mutate`` the copy mutmut's trampoline calls instead (the mutant under test when it is
    one of this method's, else the unmutated copy)."""
    table = getattr(sys.modules[cls.__module__], f"mutants_xǁ{cls.__name__}ǁ{name}__mutmut", None)
    if table is None:
        return getattr(cls, name)
    return table.get(os.environ.get("MUTANT_UNDER_TEST", "").rpartition(".")[2], table["_mutmut_orig"])


def test_a_worker_killed_just_after_taking_a_batch_answers_every_transfer_of_it():
    """``_run`` resets ``answered`` only after ``current = self._q.get()``: an exception landing between
    the two (an asynchronous exception; forced here by a trace hook raising at the line after the take)
    answers ``current[answered:]`` with the previous batch's count, so the new batch's first transfers
    are never answered."""
    run = _running(ThreadMover, "_run")
    code = run.__code__
    lines, first = inspect.getsourcelines(run)
    target = first + next(i for i, s in enumerate(lines) if "current = self._q.get()" in s) + 1   # the line after the take
    fired = threading.Event()

    def local(frame, event, arg):
        if (event == "line" and frame.f_lineno == target and not fired.is_set()
                and isinstance(frame.f_locals.get("current"), list) and frame.f_locals["current"][0].token == "b0"):
            fired.set()
            raise _Dies("killed after taking a batch")
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code is code else None

    dev, host = _random_rows(16, 64, 3), torch.zeros((16, 64), dtype=torch.uint8)
    q = CompletionQueue()
    threading.settrace(tracer)
    try:
        m = ThreadMover([(dev, host)], q, num_workers=1, batch_max=64)
    finally:
        threading.settrace(None)   # type: ignore[arg-type]
    try:
        worker = m._threads[0]
        for i in range(2):
            m.submit(Transfer(f"a{i}", _STORE, [2 * i, 2 * i + 1, 8], [2 * i, 2 * i + 1, 8 + i]))
        m.flush()
        got = [q.get(WAIT_S) for _ in range(2)]
        assert sorted(r.token for r in got) == ["a0", "a1"]
        for i in range(3):
            m.submit(Transfer(f"b{i}", _LOAD, [10 + i], [i]))
        m.flush()
        worker.join(WAIT_S)
        assert fired.is_set() and not worker.is_alive()
        answered = sorted(r.token for r in q.drain())
        assert answered == ["b0", "b1", "b2"], f"answered by the dying worker: {answered}"
    finally:
        m.close()


# ---------------------------------------------------------------------------- malformed transfers on the row-by-row path
def test_an_out_of_range_transfer_on_the_row_by_row_path_fails_before_any_copy():
    """A lone transfer of two rows goes row by row (memmove); its second row is out of range.  It is
    reported failed, but its first row was already written: 'fails alone, before any copy'
    (base.transfer_error, architecture invariant 1) holds only on the batched path."""
    dev, host = _random_rows(8, 64, 4), _random_rows(4, 64, 5)
    before = dev.clone()
    q = CompletionQueue()
    m = ThreadMover([(dev, host)], q, num_workers=0, batch_max=64)
    try:
        m.submit(Transfer("bad", _LOAD, [1, 99], [0, 1]))
        m.flush()
        assert m.help_one()
        (r,) = q.drain()
        assert not r.ok and "out of range" in r.error
        assert torch.equal(dev, before), "a failed load overwrote device row 1"
    finally:
        m.close()


def test_a_negative_row_on_the_per_row_copy_path_fails_before_any_copy():
    """Rows no wide view or memmove fits (strided bytes) are copied with tensor indexing, where -1 is
    the last row: a load naming row -1 overwrites row 7 and is reported ok, instead of failing before
    any copy."""
    base = _random_rows(8, 128, 6)
    dev = base[:, ::2]                          # 64 bytes per row, 2 apart: no memmove, no wide view
    host = _random_rows(4, 64, 7)
    before = base.clone()
    q = CompletionQueue()
    m = ThreadMover([(dev, host)], q, num_workers=0, batch_max=64)
    try:
        assert m._fast is None and m._wide is None
        m.submit(Transfer("neg", _LOAD, [-1], [0]))
        m.flush()
        assert m.help_one()
        (r,) = q.drain()
        assert torch.equal(base, before) and not r.ok, f"row -1 written, report ok={r.ok}"
    finally:
        m.close()
