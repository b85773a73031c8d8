"""Review round 28: a50a072 (``SlabCopier.wait`` leaves a report at ``_kept[0]`` until ``_take`` kept its result,
``get_within(..., leave=True)``, ``_MarkThenPost.put`` flags ``marked`` after the ring write) and d8f954c (three
tests made fast).

What it proved wrong (all fixed; each test fails on the tree before its fix and passes now; the third, an interrupt swept over every call return of ``finished()``/``wait()``, was added while reading the whole change once more):

1. ``test_a_wait_a_signal_handler_runs_inside_finished_loses_no_report`` -- ``finished()`` and ``wait()`` both
   "take ``_kept[0]``, then ``popleft()``", assuming the front of ``_kept`` is still the report they took.  A
   signal handler that runs inside ``_take`` (after the result was appended: ``m.count``/``m.observe``/``m.error``
   are Python calls, so the eval loop runs pending handlers at their entry) and calls ``wait()`` (a drain on
   SIGTERM, say) consumes the front of ``_kept`` itself -- and stops as soon as its own jobs are in, leaving the
   reports behind them.  The outer ``popleft()`` then removes a report nobody recorded: that job is never named
   by ``finished()`` (vLLM's ``pending_count`` never reaches 0, its slots stay leased).
2. ``test_wait_does_not_raise_index_error_when_a_signal_handler_calls_finished`` -- the same blind pop in
   ``wait()`` (new in a50a072: before it, wait() popped first) raises ``IndexError`` out of vLLM's ``wait`` when a
   handler's ``finished()`` emptied ``_kept`` meanwhile (nothing lost: the handler's call returned the results).

Fixed as suggested, for both: pop only the report taken -- ``if kept and kept[0] is report: kept.popleft()`` in
``finished()`` (copier.py:258) and ``wait()`` (copier.py:308).  A Report object put twice (cuda.py ``_put_all``
re-puts the same object after an interrupt) is then popped once per take, the second copy taken as stale, as now.

Checked, found sound (within the stated model: a handler that raises between two bytecodes):

* wait(): an exception before ``_take`` leaves the report at ``_kept[0]``; between ``_take`` and ``popleft`` the
  re-take is counted stale once (a false stale, as round 27 noted for finished()); ``pending.discard`` after the
  pop only matters for a normal return.  ``get_within`` is called with ``_kept`` empty only; its timed path leaves
  the item in ``kept`` before signals are let in and returns ``kept[0]`` with ``leave``.
  ``CompletionQueue.get`` (reports.py:76-83) passes no ``leave``: unchanged (``_into``'s default pops).
* ``_MarkThenPost.put``: on CPython 3.11 (the venv's) no eval-breaker check lies between ``mark_done``'s write
  and its return (one STORE_SUBSCR), nor between ``job.marked = True`` (STORE_ATTR on a slot) and the C call
  ``SimpleQueue.put`` (the check comes after that call returns), so the first report posted is the last that
  wrote the ring, with the same ``ok``.  CUDA (cuda.py ``_put_all`` then ``pend.popleft()``): an interrupt before
  the write re-puts the *same* Report object (same ``ok``); after the post, the re-answers are posted unmarked
  and discarded.  ThreadMover's owner help (thread.py ``_help``) re-answers with a *new* failed report: consistent
  too, because ``marked`` is set only after the write.
* d8f954c (part B of the brief), each test run in a scratch copy with the line it guards broken:
  - test_spill_groups.py::test_a_cancelled_spill_whose_write_landed_is_counted_stale_not_published: ``live and``
    dropped from tiers.py:730 (the clean-report shortcut) -> FAILS (stale count 0, expected 2).
  - test_review_round12_disk.py::test_a_starter_thread_still_bootstrapping_is_not_taken_for_one_that_never_started:
    ``and abandon()`` dropped from disk_tier.py:379 -> FAILS (a second ProcessDiskStore holds the path lock after
    close()).  (The late starter's own abandoned checks, disk_tier.py:455 and :463, back each other up: breaking
    either alone passes, before and after d8f954c.)
  - test_review_remote3.py::test_no_io_thread_touches_the_host_slab_after_close_returned: ``t.conn.shut()``
    removed from remote/store.py:198 -> FAILS (reader alive, slab written after close()).  Not guarded, before
    or after d8f954c: ``Conn.shut`` not setting ``closed`` (conn.py:172) or ``Link.shut`` not shutting the socket
    (conn.py:376) -- the test's ``shut`` hook releases the held trip itself.

Suspected, not shown
====================

* ``TieredKVOffloadingWorker.get_finished`` (vllm.py:479-482) turns ``copier.finished()``'s list into
  TransferResults in a list comprehension: once ``finished()`` returned, ``_finished`` is empty, and a
  ``KeyboardInterrupt`` at the comprehension's entry or in a ``TransferResult(...)`` call drops every result
  of that call.  vLLM's own caller has the same window after the return, so the library can only narrow it
  (build the TransferResults inside the copier before ``_finished`` is swapped out).
* A ``submit`` interrupted after ``self._jobs[token] = job`` (copier.py:203) and before the mover holds the transfer
  (``_start()``/``mover.submit``), or inside ``_sink.put`` on the no-tensor/foreign paths before the post, leaves
  a job in ``_jobs`` nobody answers; a caller that retries the submit with the same token is then refused as a
  duplicate (answered failed) while the orphan is never answered.  The submit raised, so vLLM was arguably never
  told it was accepted.
* A false stale count after every interrupt between ``_take`` and ``popleft`` (metrics only).
"""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tiered_kv.integrations.copier import SlabCopier
from tiered_kv.integrations.slab import SharedSlab
from tiered_kv.metrics import Metrics

from test_review_round26_worker import WAIT_S, slab  # noqa: F401  (slab: the fixture, one 8-slot slab)


def _copier(slab: SharedSlab) -> SlabCopier:
    # no KV tensor: each job is answered (ring marked, report posted) at its submit, in submission order
    return SlabCopier(slab, 0, [], metrics=Metrics(registry=CollectorRegistry(), namespace="r28"))


def _handler_at_next_count(c: SlabCopier, handler: Any) -> None:
    """A pending signal whose Python handler the eval loop runs at the entry of the next ``Metrics.count`` call
    (``_take`` calls it right after appending the result); the handler returns normally."""
    real = c.metrics.count
    armed = [True]

    def count(child: Any, n: float = 1) -> None:
        if armed[0]:
            armed[0] = False
            handler()
        real(child, n)

    c.metrics.count = count  # type: ignore[method-assign]


def test_a_wait_a_signal_handler_runs_inside_finished_loses_no_report(slab: SharedSlab) -> None:
    """Contract: every job ``submit`` accepted is named exactly once by ``finished()`` (vLLM's ``get_finished``),
    whatever a signal handler does between two bytecodes -- here it calls ``wait()`` for one job (a drain on
    SIGTERM) and returns.

    Set-up: jobs 1, 2, 3 answered; ``finished()`` moves their reports into ``_kept`` = [R1, R2, R3]; while it
    takes R1 (result appended, inside ``m.count``) the handler runs ``wait({2})``: it takes R1 again (stale) and
    pops it, takes R2 and pops it, and returns -- job 2 is in -- leaving ``_kept`` = [R3].

    What was wrong (before the fix): copier.py:258 (``kept.popleft()`` after ``self._take(kept[0], ...)``) pops R3, never taken:
    job 3 is never answered (``in_flight`` stays 1).  The same blind pop is at copier.py:308 in ``wait()``.

    Fixed as suggested: pop only the report taken: ``if kept and kept[0] is report: kept.popleft()``."""
    c = _copier(slab)
    try:
        for j in (1, 2, 3):
            assert c.submit(j, bytes([j]) * 16, j, True, [], [])
        _handler_at_next_count(c, lambda: c.wait({2}, timeout=WAIT_S))
        got = [r.job_id for r in c.finished()]
        got += [r.job_id for r in c.finished()]
        assert sorted(got) == [1, 2, 3], f"answered {got}; still in flight: {c.in_flight}"
    finally:
        c.close()


def test_wait_does_not_raise_index_error_when_a_signal_handler_calls_finished(slab: SharedSlab) -> None:
    """Contract: ``wait()`` returns once its jobs are in (vLLM's ``wait`` then reuses their blocks); it raises
    only what a signal handler raised.  Here the handler calls ``finished()`` (and keeps its results) inside
    wait()'s ``_take`` of job 4's report.

    What was wrong (before the fix): copier.py:308 (``self._kept.popleft()``) assumes the report it took is still at the front;
    the handler's ``finished()`` took it again (counted stale) and emptied ``_kept``: ``IndexError`` out of
    ``wait()``.  (Before a50a072 wait() popped first and was immune.)

    Fixed as suggested: ``if self._kept and self._kept[0] is report: self._kept.popleft()``."""
    c = _copier(slab)
    seen: list[int] = []
    try:
        assert c.submit(4, b"\x04" * 16, 4, True, [], [])
        _handler_at_next_count(c, lambda: seen.extend(r.job_id for r in c.finished()))
        c.wait({4}, timeout=WAIT_S)
        seen.extend(r.job_id for r in c.finished())
        assert seen == [4]
    finally:
        c.close()


# --------------------------------------------------------------------------- every interrupt point, swept
_COPIER_FILE = SlabCopier.__init__.__code__.co_filename


def _interrupt_at(k: int) -> tuple[Any, list[int]]:
    """A profile hook raising ``KeyboardInterrupt`` at the ``k``-th return of a call made by the copier's own code
    -- where CPython runs a pending signal's handler (its eval-breaker check after each call) -- and the count of
    such points seen (one entry once it fired)."""
    seen = [0]
    fired: list[int] = []

    def hook(frame: Any, event: str, arg: Any) -> None:
        if fired:
            return
        if event == "c_return":
            caller = frame
        elif event == "return":
            caller = frame.f_back
        else:
            return
        if caller is None or caller.f_code.co_filename != _COPIER_FILE:
            return
        seen[0] += 1
        if seen[0] == k:
            fired.append(k)
            raise KeyboardInterrupt(f"interrupt at call return {k}")

    return hook, fired


@pytest.mark.parametrize("entry", ["finished", "wait"])
def test_an_interrupt_at_any_call_return_in_finished_or_wait_loses_and_doubles_no_result(
        slab: SharedSlab, entry: str) -> None:
    """What it proved wrong (fixed; the ``finished`` case fails on 55745b0): the claim of d82ffc0, a50a072 and
    cc90945 that no signal handler can drop or double a result did not hold at the first step: ``finished()``
    drained the queue with ``iter(get_nowait, None)``, whose sentinel comparison runs a :class:`Report`'s
    dataclass ``__eq__`` -- Python code between a take and its append -- and an interrupt there lost job 1 (call
    return 3 of the sweep).  ``reports._keep``, under every ``get_within`` of the project, had the same
    comparison.  Fixed: both take and append by C calls alone (``reports.drain_into``, ``_keep``).  The rest of
    the reasoning held: reports enter ``_kept`` in one C loop, a report leaves ``_kept`` only once its result is in
    ``_finished`` (``_take_front``), ``_take`` removes the job and appends its result with no call in between, and
    ``_finished`` is swapped out only as ``finished()`` returns.  Pinned here by sweeping the interrupt over every
    call return made from copier.py during one ``finished()`` / ``wait()`` of three answered jobs: however it is
    interrupted, the calls after it name each job exactly once, ok, and nothing stays in flight."""
    import sys

    k = 1
    while True:
        c = _copier(slab)
        try:
            for j in (1, 2, 3):
                assert c.submit(j, bytes([0x30 + j]) * 16, j, True, [], [])   # answered at once, ring marked
            hook, fired = _interrupt_at(k)
            got: list[int] = []
            sys.setprofile(hook)
            try:
                if entry == "finished":
                    got += [r.job_id for r in c.finished()]
                else:
                    c.wait({1, 2, 3}, timeout=WAIT_S)
            except KeyboardInterrupt:
                pass
            finally:
                sys.setprofile(None)
            for _ in range(3):
                got += [r.job_id for r in c.finished()]
            assert sorted(got) == [1, 2, 3], f"interrupted at call return {k}: results {sorted(got)}"
            assert c.in_flight == 0 and all(slab.done(j) and slab.ok(j) for j in (1, 2, 3))
        finally:
            c.close()
        if not fired:   # the sweep passed the last call return
            break
        k += 1
    assert k > 10, f"only {k - 1} interrupt points were swept: the hook did not see the copier's calls"
