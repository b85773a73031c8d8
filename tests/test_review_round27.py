"""Review round 27: the fixes of d82ffc0 (SlabCopier), 9632302/e046d25 (slab_path, SharedSlab.open's attach
check), 1b3e5c0 (test) and a88dd42 (TierIndex.reserve_absent dedupe).

What it proved wrong (both fixed; each test fails on the tree before the fix and passes now):

1. ``test_wait_keeps_a_report_it_took_when_interrupted_before_taking_it`` -- ``SlabCopier.wait`` pops a report
   off ``_kept`` (or gets it from ``get_within``, which pops it off ``_kept`` too) *before* ``_take`` records it;
   a signal handler's exception in between drops it: the job stays in ``_jobs`` for ever and vLLM never sees it
   in ``get_finished``.  ``finished()`` got the "take ``kept[0]``, then ``popleft()``" treatment in d82ffc0;
   ``wait()`` did not.
2. ``test_an_ok_result_is_never_returned_for_a_job_whose_ring_entry_was_not_written`` -- ``_MarkThenPost.put``
   sets ``job.marked`` *before* ``slab.mark_done``.  On the CUDA path (``CudaMover.harvest`` puts on the owner
   thread and answers a transfer again after an interrupt inside the put) an interrupt between the two leaves
   the ring unwritten, and the re-answered report -- posted "unmarked" -- is the first one the owner sees, so
   ``_take`` accepts it: vLLM is told the copy succeeded while the ring never says so.  The scheduler then
   keeps the job in ``_awaiting`` for ever (scheduler.py complete_store/complete_load -> ``slab.done`` False;
   ``tick`` never finishes it): a store never published and its slots leased for ever, a load's slots
   likewise.  The comment "the entry stays unwritten (quarantined)" holds only for a job the owner then drops.

Fixed: ``wait()`` leaves a report at the front of ``_kept`` until its result is kept
(``get_within(..., leave=True)``), then pops it; ``_MarkThenPost.put`` sets ``marked`` after the ring write,
right before the post with no call between them, so a report answered again after an interrupt before the
post writes the ring again with the outcome the owner sees.

Checked, found sound:

* finished(): ``kept.extend(iter(get_nowait, None))`` keeps every item taken before ``queue.Empty`` (deque.extend
  appends as it goes); the re-take after an interrupt between ``_take`` and ``popleft`` is counted stale once
  (a false stale, harmless: the result was already in ``_finished``); ``_take`` deletes and appends with no
  call between.
* A duplicate of a job that already finished is a new job (token no longer in ``_jobs``); its old reports
  are still told apart by record identity.  A duplicate whose seq equals the live job's does not write the ring
  (correct: the entry is the live job's).  ``wait()`` never waits for a refused duplicate (not in ``_jobs``)
  and its result is already in ``_finished``.
* slab_path is a pure function of the engine id (xxh3 is deterministic), same in EngineCore and worker; the
  creator makes the file with ``O_EXCL`` and mode 0600 atomically, so a mid-initialisation file already passes
  ``_check_ours``; the check is ``fstat`` on the opened fd (no TOCTOU on the path); refusals are ConfigErrors
  naming the path.  crashrun.py and the docs do not build slab names themselves.
* a88dd42: ``got`` was already deduplicated before the change (the second occurrence found the key reserved),
  so begin_store / prepare_store return the same keys and slots as before; ``policy.link`` on the
  un-deduped list only relinks a key to itself/neighbours in order.

Suspected, not shown
====================

* vLLM (offloading/scheduler.py ~1746-1775) selects its source blocks by ``offload_key in set(keys_to_store)``
  over its own list, while the store spec has one slot per *distinct* key: a key repeated in one
  prepare_store would give the worker more blocks than slots and ``SlabCopier.submit`` raises ConfigError
  on the engine's path (unchanged by a88dd42; block hashes are chained, so only a hash collision repeats one).
  Refusing or collapsing repeats in ``SlabScheduler.prepare_store`` (or padding slots) would be safer than a
  worker crash.
* ``_refuse_duplicate`` marks the duplicate's ``seq`` failed when it differs from the live job's; if that seq
  belongs to another job still copying (only possible with a corrupt token/seq pairing) the scheduler would
  free its slots early.  The seq is derived from the token, so only a broken caller hits it.
* A resubmission with the same job_id and token is answered twice (failed at once, then the live job's
  result): vLLM's job ids are unique, so only a buggy engine sees the double answer.
* ``_check_ours`` refuses a slab created by another euid even for root (before, root attached to anything);
  a container running the EngineCore and workers under different uids, or a creator with umask that drops
  the owner's write bit (0o2xx), is now refused with a clear ConfigError (the latter was refused before too).
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tiered_kv.integrations.copier import SlabCopier
from tiered_kv.integrations.slab import SharedSlab
from tiered_kv.metrics import Metrics
from tiered_kv.movers import Report

from test_review_round26_worker import WAIT_S, slab  # noqa: F401  (slab: the fixture, one 8-slot slab)


def _metrics() -> Metrics:
    return Metrics(registry=CollectorRegistry(), namespace="r27")


class _OwnerAnsweringMover:
    """A stand-in for ``CudaMover`` as the copier sees it: transfers are answered on the owner thread in
    ``harvest()``, each one put *before* it leaves the pending queue (cuda.py harvest: "answered before it
    leaves the queue: an interrupt in between answers it again at the next harvest")."""

    polled = True

    def __init__(self, put: Any) -> None:
        self._put = put
        self._pending: collections.deque = collections.deque()

    def submit(self, t: Any) -> None:
        self._pending.append(t)

    def flush(self) -> None:
        return None

    def harvest(self) -> None:
        while self._pending:
            t = self._pending[0]
            self._put(Report(t.token, t.kind, True, None, len(t.rows) * 64, 0.001))
            self._pending.popleft()

    def close(self) -> None:
        self._pending.clear()


def test_wait_keeps_a_report_it_took_when_interrupted_before_taking_it(slab: SharedSlab) -> None:
    """Contract: every job submit accepted is answered exactly once by ``finished()`` (vLLM's ``get_finished``),
    even when a signal handler raises inside ``wait()`` (reports.get_within: the ``_kept`` deque exists so that
    "an exception from a handler leaves it in ``kept`` for the consumer's next call"; finished()'s docstring).

    Here the report of job 5 is already in ``_done``; ``wait({5})`` takes it (get_within moves it through
    ``_kept`` and pops it) and a ``KeyboardInterrupt`` lands as ``_take`` is entered (the eval loop runs
    pending signal handlers at a function's start), before it does anything.

    What was wrong (before the fix): copier.py:302 (``report = self._kept.popleft() if self._kept else get_within(...)``) removes
    the report from ``_kept`` before copier.py:306 (``self._take(report, self._finished)``) records it; an
    exception in between loses it: ``finished()`` never names job 5, ``in_flight`` stays 1 for ever, vLLM's
    ``pending_count`` for the job never reaches 0.

    Fixed as suggested: as in ``finished()``: leave the report at ``_kept[0]`` (``get_within`` could return without
    popping, or wait() appends it back with ``appendleft`` in an ``except BaseException``), call ``_take`` on
    it, then ``popleft()`` (a re-take after an interrupt is counted stale, as in finished())."""
    c = SlabCopier(slab, 0, [], metrics=_metrics())   # no KV tensor: a job is answered (marked, posted) at submit
    try:
        assert c.submit(5, b"\x27" * 16, 5, True, [], [])
        assert c._done.qsize() == 1

        real_take = c._take
        armed = [True]

        def take_interrupted(r: Report, out: list) -> None:
            if armed[0]:
                armed[0] = False
                raise KeyboardInterrupt   # a signal handler's exception at _take's entry
            real_take(r, out)

        c._take = take_interrupted  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            c.wait({5}, timeout=WAIT_S)
        got = [r.job_id for r in c.finished()] + [r.job_id for r in c.finished()]
        assert got == [5], f"job 5 was accepted and never answered (answered: {got}, in flight: {c.in_flight})"
    finally:
        c.close()


def test_an_ok_result_is_never_returned_for_a_job_whose_ring_entry_was_not_written(slab: SharedSlab) -> None:
    """Contract (copier.py module docstring): "a job is marked done in the rank's ring only after all its copies
    completed -- the mover's report says so -- and before its result is returned to vLLM".  The scheduler side
    (scheduler.py complete_store/complete_load, tick) finishes a job only once ``slab.done(seq)``; an entry
    never written keeps it in ``_awaiting`` for ever (a store never published, its slots and a load's slots
    leased for ever).

    Set-up: the CUDA path -- the mover answers on the owner thread in ``harvest()`` and answers a transfer
    again after an interrupt inside its put (cuda.py harvest: put, then popleft).  A signal handler's
    ``KeyboardInterrupt`` lands at the entry of ``slab.mark_done`` (before it writes), inside the first put.

    What was wrong (before the fix): copier.py:102 sets ``job.marked = True`` before copier.py:106 writes the ring; the
    interrupted first put never posted, so the re-answered report -- posted unmarked by copier.py:99-101 -- is
    the first the owner sees and ``_take`` (copier.py:263-270) accepts it: vLLM is told the job succeeded
    while its ring entry was never written.

    Fixed as suggested: set ``marked`` only after the write (``mark_done`` then ``job.marked = True``): an
    interrupt before the write lets the re-answer write it; the window after it only rewrites the same
    outcome.  Or: on a second report of a job not yet posted (a ``posted`` flag set after ``_done.put``),
    mark it as the first would have."""
    c = SlabCopier(slab, 0, [], metrics=_metrics())
    mover = _OwnerAnsweringMover(c._sink.put)
    c._mover = mover   # type: ignore[assignment]
    real_mark = slab.mark_done
    armed = [True]

    def mark_interrupted(rank: int, seq: int, ok: bool = True) -> None:
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt   # a signal handler's exception at mark_done's entry: nothing written
        real_mark(rank, seq, ok)

    slab.mark_done = mark_interrupted  # type: ignore[method-assign]
    try:
        assert c.submit(9, b"\x28" * 16, 9, True, [1], [2])
        with pytest.raises(KeyboardInterrupt):
            c.finished()                 # harvest -> put -> marked = True -> mark_done interrupted
        results = [(r.job_id, r.ok) for r in c.finished()] + [(r.job_id, r.ok) for r in c.finished()]
        assert len(results) == 1 and results[0][0] == 9   # answered once
        if results[0][1]:
            assert slab.done(9), ("job 9 was returned ok to vLLM but its ring entry was never written: the "
                                  "scheduler keeps it in _awaiting for ever")
    finally:
        slab.mark_done = real_mark  # type: ignore[method-assign]
        c.close()
