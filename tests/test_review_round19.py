"""Review round 19: the thread mover's stop at exit (``_close_at_exit``/``_end``, 42dab1e, 4a5e095, ab1f5c1) and the
native mover's timed wait (dad140d .. 96de828, ab1f5c1).

What it proved wrong (each test fails without its fix, verified against the tree before it):

1. ``test_the_exit_stop_waits_for_the_workers_of_a_close_that_was_interrupted`` -- ``ThreadMover._end`` returned at
   once for a mover whose ``close()`` set ``_closed`` but had not joined its workers (interrupted in its join, or
   still running on another thread): the workers still copied while the interpreter finalized.  Fixed: ``_end``
   skips only a mover with no live worker; a closing one's workers are stopped and waited for too (it is not
   marked ended: it is closing).
2. ``test_a_copier_job_submitted_after_the_exit_stop_is_copied_by_wait`` -- after ``_end`` a ThreadMover has no
   worker; ``SlabCopier.wait()``/``finished()`` never copied on the owner, so a job submitted then never ended
   (only ``TierManager`` kept ``_end``'s promise, through ``help_one``).  Fixed: once ended, ``flush()`` copies
   what is queued on the calling thread (``_copy_here``), so every owner's poll, wait and finished progress.
3. ``test_a_mover_met_after_the_exit_deadline_passed_still_stops_its_workers`` (suspected by the review, shown
   here) -- the movers open at exit share one deadline, and ``_end`` sent no stop at all once it had passed.
   Fixed: each live worker is sent its stop; only the wait is bounded.
4. ``test_a_worker_that_cannot_be_replaced_leaves_a_mover_that_closes_and_answers_everything`` (suspected by the
   review, shown here) -- a replacement worker that could not start stayed listed (``close()`` raised "cannot join
   thread before it is started") and a batch queued after the death was never answered.  Fixed: ``_spawn`` takes
   a thread that never started off the list; ``close()`` of a mover with no live worker copies what is queued.

Checked and found to hold (no test)
===================================

* ``NativeMover``: a seeded fuzz (simulated clock and launcher, random completion order, 15 % failed launches,
  10 % failed inline copies, cancelled transfers, hold on/off, help_one/harvest/flush interleaved, 100 seeds)
  answered every transfer exactly once and kept ``_row_s`` finite and >= 0.  No batch with an empty ``futs`` can
  stay in ``_inflight`` (both handlers of ``_start`` remove it; the append of the launch's future is in C), so
  neither ``close()`` nor a blocked wait can spin on one.
* ``ThreadMover._end`` racing a daemon owner that submits, flushes, holds and helps (seeded stress, 60 seeds,
  1-3 workers, ``batch_max`` 1-10), followed by ``close()``: every transfer answered once.
* ``Writer._lost`` (expiry order, ``move_to_end``, overflow sets ``lost_all_until`` before ``clear``) against the
  lock-free reader in ``RemoteStore``; ``_renumbering`` (order kept, duplicates kept equal, the second scan's
  lower bound covers every number that can move); ``removed_why`` as recovery, ``verify`` and export apply it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from prometheus_client import CollectorRegistry

from test_review_round17 import _planes
from tiered_kv.integrations.copier import SlabCopier
from tiered_kv.integrations.slab import SharedSlab
from tiered_kv.jobs import JobKind
from tiered_kv.metrics import Metrics
from tiered_kv.movers import CompletionQueue, ThreadMover, Transfer
from tiered_kv.movers.thread import batch_copy

_STORE = JobKind.STORE
WAIT_S = 10.0


# ---------------------------------------------------------------------------------------------------- finding 1
def test_the_exit_stop_waits_for_the_workers_of_a_close_that_was_interrupted():
    """``ThreadMover._end`` (thread.py, its first line: ``if self._closed or self._ended: return``) takes
    ``_closed`` to mean "no worker left", but ``close()`` sets ``self._closed = True`` *before* its join loop: from
    then on until the workers have taken their sentinels -- behind every batch queued before -- they are still
    copying.  A ``close()`` broken off in that join (Ctrl-C while ``TierManager.close()`` waits for the copies:
    ``Thread.join`` is interruptible; the interrupt then ends the program), or one still running on another thread
    (a daemon thread closing its manager while the main thread exits), leaves a mover that the atexit handler
    (``_close_open_movers`` -> ``_end``) skips at once: it returns while a copy worker is inside a torch op, and the
    interpreter finalizes under it -- the abort 42dab1e was made for ("terminate called without an active
    exception").  Here: a batch whose copy is held by a gate, ``close()`` interrupted in its join, then ``_end``
    returns at once with the worker still copying.  Fix: let ``_end`` skip only a close that *finished* (a flag set
    at the end of ``close()``, or no live thread in ``_threads``); for a mover closed or closing, join its live
    workers up to the deadline without putting more sentinels (``close()`` put them)."""
    entered, gate = threading.Event(), threading.Event()

    def gated(*args: Any) -> None:
        entered.set()
        gate.wait(WAIT_S)
        batch_copy(*args)

    dev, host = _planes()
    q = CompletionQueue()
    m = ThreadMover([(dev, host)], q, num_workers=1, batch_max=64, batch_fn=gated)
    worker = m._threads[0]
    ender = None
    try:
        for i in range(3):
            m.submit(Transfer(f"a{i}", _STORE, [i], [i]))
        m.flush()
        assert entered.wait(WAIT_S), "the worker took the batch"
        real_join = worker.join
        interrupted: list[int] = []

        def join(timeout: Any = None) -> None:   # Ctrl-C while close() waits for the worker (once)
            if not interrupted:
                interrupted.append(1)
                raise KeyboardInterrupt("Ctrl-C during close()")
            real_join(timeout)

        worker.join = join   # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            m.close()
        assert worker.is_alive(), "the worker is still copying the batch queued before close()"
        ender = threading.Thread(target=m._end, args=(time.monotonic() + WAIT_S,), daemon=True)
        ender.start()              # the interpreter's exit: the atexit handler
        ender.join(1.0)
        assert ender.is_alive() or not worker.is_alive(), \
            "the exit stop returned while the mover's copy worker is still inside a copy"
    finally:
        gate.set()
        if ender is not None:
            ender.join(WAIT_S)
        worker.join(WAIT_S)


# ---------------------------------------------------------------------------------------------------- finding 2
def test_a_copier_job_submitted_after_the_exit_stop_is_copied_by_wait(tmp_path: Path):
    """``ThreadMover._end``'s docstring: "The mover stays open: what is submitted later (an exit handler that runs
    after this one) is copied by the owner, in ``wait()`` and in :meth:`close`."  That holds for ``TierManager``
    (its ``_block_until`` calls ``help_one``), not for the library's other ThreadMover owner, the vLLM worker's
    ``SlabCopier`` (integrations/copier.py: ``_copy_mover`` makes ``ThreadMover(num_workers=1, batch_max=...)``
    without ``catch_up_s``): its ``wait()`` only blocks on the report queue (``get_within(self._done, ...)``) and
    its ``finished()`` only flushes (``ThreadMover.flush`` copies on the owner only what ``catch_up_s`` makes
    overdue -- never, here).  After the exit stop no worker is left, so a job submitted then (an exit handler that
    ran after tiered_kv's -- one registered before the first mover, e.g. a framework's shutdown hook -- or a daemon
    thread still driving the engine) is never copied: ``wait(job_ids)`` without a timeout -- as
    ``TieredKVOffloadingHandler.wait`` calls it -- blocks for ever, and ``finished()`` never returns the job; only
    ``close()`` copies it.  Fix: once ``_ended``, have ``ThreadMover.flush()`` copy what is queued on the calling
    thread (``while self.help_one(): pass``, as ``close()`` does), so every owner's flush/poll/wait makes progress;
    or make ``SlabCopier.wait`` help (``self._mover.help_one()`` between waits, as ``TierManager._block_until``
    does)."""
    slab = SharedSlab.open(tmp_path / "c.slab", 4, 64, 1)
    kv = torch.randint(-128, 128, (6, 64), generator=torch.Generator().manual_seed(1), dtype=torch.int8)
    c = SlabCopier(slab, 0, [kv], metrics=Metrics(registry=CollectorRegistry(), namespace="t"))
    try:
        assert isinstance(c._mover, ThreadMover)
        c._mover._end(time.monotonic() + WAIT_S)         # the interpreter's exit: the atexit handler
        assert c.submit(7, b"j" * 16, 3, True, [4, 1], [2, 0])   # an exit handler after it stores a block ...
        c.wait([7], timeout=0.5)                          # ... and waits for it (vLLM's wait() has no timeout)
        done = c.finished()
        assert [r.job_id for r in done] == [7], f"the job submitted after the exit stop never ended: {done}"
        assert slab.done(3)
    finally:
        c.close()
        slab.close()


class WorkerDies(BaseException):
    """Ends a copy worker's thread (not an ``Exception``: the worker does not take it as a failed copy)."""


def no_thread_to_be_had(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on no thread can be started ("can't start new thread"): a dead worker is not replaced."""
    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)


def dies_when_joined(worker: threading.Thread, gate: threading.Event) -> None:
    """``worker`` waits on ``gate`` inside its copy; it goes on (and dies) only once someone joins it."""
    real_join = worker.join

    def join(timeout: Any = None) -> None:
        gate.set()
        real_join(WAIT_S if timeout is None else timeout)

    worker.join = join   # type: ignore[method-assign]


def first_batch_kills_its_worker(m: ThreadMover, entered: Any = None, gate: Any = None) -> None:
    """The first batch a worker of ``m`` copies ends that worker's thread (after ``entered`` is set and ``gate``
    opened, when given); later batches are copied."""
    real = m._do_batch
    deaths: list[int] = []

    def dies_once(ts: list[Transfer]) -> Any:
        if not deaths:
            deaths.append(1)
            if entered is not None:
                entered.set()
                gate.wait(WAIT_S)
            raise WorkerDies("the worker's thread ends")
        return real(ts)

    m._do_batch = dies_once   # type: ignore[method-assign]


def dies_in_close_unreplaced(m: ThreadMover, monkeypatch: pytest.MonkeyPatch, row: int) -> Callable[[], None]:
    """``m``'s one worker takes a store of ``row`` ("first") and holds it until someone joins it (``close()``), then
    dies, and no thread can replace it.  Returns what lets it go and waits for it (for a ``finally``)."""
    entered, gate = threading.Event(), threading.Event()
    first_batch_kills_its_worker(m, entered, gate)
    worker = m._threads[0]
    real_join = worker.join
    m.submit(Transfer("first", _STORE, [row], [row]))
    m.flush()
    assert entered.wait(WAIT_S), "the worker took the first batch"
    no_thread_to_be_had(monkeypatch)
    dies_when_joined(worker, gate)

    def release() -> None:
        gate.set()
        real_join(WAIT_S)
        assert not worker.is_alive()

    return release


# ---------------------------------------------------------------------------------------------------- finding 3
def test_a_mover_met_after_the_exit_deadline_passed_still_stops_its_workers():
    """What it proved wrong (the reviewer's suspicion, shown here): every mover open at exit shares one deadline
    (``_close_open_movers``); ``_end`` looped ``while time.monotonic() < deadline``, so a mover reached after an
    earlier one used the deadline up was marked ended with no stop sent: its workers went on taking batches
    through the interpreter's finalization (the abort the handler is for).  Fixed: each live worker is sent its
    stop at least once; only the wait for it is bounded by the deadline."""
    dev, host = _planes()
    m = ThreadMover([(dev, host)], CompletionQueue(), num_workers=1, batch_max=64)
    worker = m._threads[0]
    try:
        m._end(time.monotonic() - 1.0)   # the deadline passed on an earlier mover
        worker.join(WAIT_S)
        assert not worker.is_alive(), "a worker of a mover ended after the deadline was never sent its stop"
    finally:
        m.close()


# ---------------------------------------------------------------------------------------------------- finding 4
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # the worker's own death
def test_a_worker_that_cannot_be_replaced_leaves_a_mover_that_closes_and_answers_everything(monkeypatch):
    """What it proved wrong (the reviewer's suspicion, shown here): a worker that dies is replaced by ``_spawn``,
    which listed the new thread before starting it; when no thread can be started ("can't start new thread"), the
    unstarted one stayed listed and ``close()`` raised "cannot join thread before it is started", and a batch
    queued after the death had no worker to copy it: never answered.  Fixed: a thread that never started is taken
    off the list, and ``close()`` of a mover with no live worker copies what is queued itself."""
    dev, host = _planes()
    q = CompletionQueue()
    m = ThreadMover([(dev, host)], q, num_workers=1, batch_max=64)
    first_batch_kills_its_worker(m)
    worker = m._threads[0]
    real_start = threading.Thread.start
    no_thread_to_be_had(monkeypatch)   # the replacement cannot start
    m.submit(Transfer("first", _STORE, [0], [0]))
    m.flush()
    worker.join(WAIT_S)
    assert not worker.is_alive()
    monkeypatch.setattr(threading.Thread, "start", real_start)
    m.submit(Transfer("after", _STORE, [1], [1]))
    m.flush()
    m.close()   # raised RuntimeError("cannot join thread before it is started")
    got = {r.token: r.ok for r in q.drain()}
    assert got == {"first": False, "after": True}, got
