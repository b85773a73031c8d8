"""Review round 26: the vLLM adapter's worker side -- ``SlabCopier`` (integrations/copier.py), the shared slab
(integrations/slab.py) and how ``TieredKVOffloadingWorker`` (integrations/vllm.py) maps vLLM's
``submit_store``/``submit_load``/``get_finished``/``wait`` onto them.

vLLM 0.32's ``OffloadingConnectorWorker`` (read in .venv-vllm) asserts that every ``submit_*`` returns True and
that every ``TransferResult`` it gets is a success; it counts a job done only when ``get_finished`` names its job
id (``mark_completed``), and after ``wait(jobs_to_flush)`` it reuses the blocks of those jobs.  So a job the
worker accepted and never names in ``get_finished`` leaves vLLM's ``_jobs[job_id].pending_count`` above 0 for
ever (the request's fenced blocks and its ``transfer_jobs`` are never released), and the slot the scheduler
leased to it stays quarantined until its ring entry is marked -- never.

What it proved wrong (all three fixed; each test fails on the tree before the fix and passes now):

1. ``test_a_job_submitted_with_the_token_of_a_job_in_flight_is_still_answered`` -- ``SlabCopier.submit`` counted a
   second job carrying a live token as stale and returned True (accepted) but never copied, marked or answered it:
   ``get_finished`` never named its job id, ``wait`` returned at once without it, and its ring entry was never
   written.  "Discarded and counted" is right for a *report*; for a *submit* vLLM was told the job was taken.
   (vLLM 0.32 never hands one spec to two jobs: this is the copier's own defence.)  Fixed: the duplicate is
   still counted stale and never copied, and is now answered failed at the next ``finished()``, its ring entry
   marked failed (``SlabCopier._refuse_duplicate``).
2. ``test_a_result_taken_by_finished_survives_an_exception_raised_inside_it`` -- ``finished()`` moved every
   result (the ones ``wait()`` kept for it included) into a local list before it published the metrics; an
   exception raised after that point (a signal handler's ``KeyboardInterrupt``, or a failing metrics write)
   dropped them all, and vLLM never completed those jobs.  Fixed: reports go from the queue into ``_kept`` in
   one C loop, each result into ``_finished`` before its report leaves ``_kept`` (the job's removal and the
   append with no call between them), and the results leave ``_finished`` only as ``finished()`` returns.
3. ``test_a_duplicate_report_the_copier_discards_never_rewrites_the_ring`` -- ``_MarkThenPost.put`` wrote the
   ring for *every* report before the copier decided whether it was stale.  The movers answer a transfer twice
   by design when an interrupt lands inside a put; the failed duplicate's mark overwrote the ok mark of a store
   whose bytes landed and which vLLM was told succeeded, so the scheduler never published it.  Fixed: a job's
   ring entry is written by its first report only (``_CopyJob.marked``); later ones are posted unmarked and
   discarded by the owner.

Suspected, not shown
====================

* ``slab_path`` (slab.py:364-367) maps distinct engine ids onto one file ("e:1" and "e_1", "e/1"); and two engines
  given the same explicit ``engine_id`` on one host attach to each other's live slab silently (same geometry):
  the second scheduler's ``set_owner`` makes the first engine's workers fail every job (its first load trips
  vLLM's ``assert transfer_result.success``), and both schedulers hand out the same rows.  A creation marker
  unique per engine start (pid/boot id in the header, refused unless matching) would catch it.
* ``SharedSlab.open`` (slab.py:427-431) attaches to any existing file whose header matches, without checking its
  owner or mode; ``/dev/shm`` is world-writable, so with an explicit (predictable) ``engine_id`` another local
  user can pre-create a 0666 slab and read or write the KV bytes every load copies (host-tier loads carry no
  checksum).  Checking ``st_uid == geteuid()`` and ``mode & 0o077 == 0`` on attach would refuse it.
* ``hostmem.prepare_host_memory``'s fallback (kernels without MADV_POPULATE_WRITE) rewrites one byte per page of
  the *whole* shared slab, every rank's part, as a read-then-write; a worker that attaches while another
  process already copies into those pages could put back a stale byte.  At start-up vLLM creates every worker
  before the scheduler, so no job runs yet; a worker restarted alone would race.
* A failed or foreign *load* is answered ``success=False`` (vllm.py:480); vLLM 0.32 asserts on it, so a worker
  whose slab is not the scheduler's (adapter3's case) brings the engine down at its first load.  Documented as
  intended ("its KV really is wrong"); listed because the brief's contract says "never crash".
* ``TieredKVOffloadingWorker.shutdown`` (vllm.py:487-489) closes the copier and unlinks the name but never
  ``slab.close()``s the mapping; harmless at process exit, a leak for an embedding that recreates workers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from test_review_round19 import first_batch_kills_its_worker, no_thread_to_be_had
from tiered_kv.integrations.copier import SlabCopier
from tiered_kv.integrations.slab import SharedSlab
from tiered_kv.metrics import Metrics

WAIT_S = 5.0   # a bound on wait(): a regression must fail, never hang


@pytest.fixture
def slab(tmp_path: Path):
    s = SharedSlab.open(tmp_path / "r26.slab", 8, 64, 1)
    yield s
    s.close()


def _kv(rows: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (rows, width), generator=g, dtype=torch.int8)


def _copier(slab: SharedSlab, kv: torch.Tensor, batch_max: int) -> SlabCopier:
    return SlabCopier(slab, 0, [kv], metrics=Metrics(registry=CollectorRegistry(), namespace="r26"),
                      batch_max=batch_max)


@pytest.mark.parametrize("batch_max", [1, 4])
def test_a_job_submitted_with_the_token_of_a_job_in_flight_is_still_answered(slab: SharedSlab, batch_max: int) -> None:
    """Contract: a job ``submit`` accepts (returns True) is answered by exactly one result in ``finished()``
    (vLLM's ``get_finished``) and is covered by ``wait()`` -- vLLM 0.32 asserts ``submit_*`` succeeded and
    completes a job only when ``get_finished`` names it; SlabCopier's docstring: a duplicate is "discarded and
    counted, never raised", and the OffloadingWorker contract still wants every accepted job answered.  The ring
    entry of its ``seq`` must also be written, or the scheduler never frees the slot it leased to it.

    What was wrong (before the fix): copier.py:186-189 -- on a token already in ``_jobs`` it counts a stale callback, logs, and
    returns True without registering, copying, marking or answering the job: ``wait({2})`` returns at once,
    ``finished()`` never names job 2, ``slab.done(seq 2)`` stays False (its slot quarantined for ever).

    Fixed as suggested: answer the duplicate at once instead of dropping it -- mark its ``seq`` failed in the ring
    (unless it equals the live job's) and append ``CopyResult(job_id, ok=False, 0, 0.0, store)`` to
    ``self._finished`` (a store is then reported finished to vLLM, a load failed), still counting it stale;
    or return False so that vLLM sees the refusal."""
    kv = _kv(6, 64, 26)
    c = _copier(slab, kv, batch_max)
    try:
        token = b"\x26" * 16
        assert c.submit(1, token, 1, True, [1], [1])
        accepted = c.submit(2, token, 2, True, [2], [2])   # same token, another vLLM job (own seq, block, slot)
        assert accepted is True                            # vLLM was told job 2 was taken
        c.wait({1, 2}, timeout=WAIT_S)
        got = {r.job_id for r in c.finished()}
        got |= {r.job_id for r in c.finished()}            # a second call: nothing is still on its way
        assert got == {1, 2}, f"vLLM's job 2 was accepted and never answered (answered: {sorted(got)})"
        assert slab.done(2), "job 2's ring entry was never written: the scheduler never frees its slot"
    finally:
        c.close()


def test_a_result_taken_by_finished_survives_an_exception_raised_inside_it(slab: SharedSlab) -> None:
    """Contract: ``wait()``'s results "stay for :meth:`finished`" (copier.py:260-261), and a report taken off the
    queue survives an exception a signal handler raises mid-call (copier.py:225 and ``reports.get_within``: the
    ``_kept`` deque exists so that "an exception from a handler leaves it ... for the consumer's next call").
    Every job vLLM submitted must reach ``get_finished`` once, or vLLM never completes it.

    What was wrong (before the fix): copier.py:224 -- ``out, self._finished = self._finished, []`` and the reports drained from
    ``_done`` (copier.py:227-232) live only in the local ``out`` until ``return out``; anything raised in
    between (here ``self.metrics.flush()`` at copier.py:233, standing in for a signal handler's
    ``KeyboardInterrupt`` between two bytecodes, or a failing multiprocess metrics write) drops them: the next
    ``finished()`` returns nothing for job 7, whose copy landed and whose ring entry says done.

    Fixed as suggested: keep taken results owned by the copier until the return -- append to ``self._finished``
    while taking and swap it out as the last statement (``out, self._finished = self._finished, []; return
    out``), or put ``out`` back in front of ``self._finished`` in an ``except BaseException: ...; raise``; and
    apply ``metrics.flush()`` in a ``finally`` after the swap."""
    kv = _kv(6, 64, 27)
    c = _copier(slab, kv, 1)
    real_flush = c.metrics.flush
    try:
        assert c.submit(7, b"\x27" * 16, 7, True, [3], [5])
        c.wait({7}, timeout=WAIT_S)                      # the result is now kept for finished()
        assert slab.done(7) and torch.equal(slab.rows[5], kv[3].view(torch.uint8))

        calls = []

        def flush_interrupted() -> None:                  # a signal handler raising inside finished()'s flush
            calls.append(1)
            if len(calls) == 1:
                raise KeyboardInterrupt
            real_flush()

        c.metrics.flush = flush_interrupted  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            c.finished()
        got = [r.job_id for r in c.finished()]
        assert got == [7], f"job 7's result was dropped by the interrupted finished() (next call: {got})"
    finally:
        c.metrics.flush = real_flush  # type: ignore[method-assign]
        c.close()


class _InterruptedAfterPost:
    """The copier's report queue as its sink sees it: each put lands, and the first one is followed by a signal
    handler's ``KeyboardInterrupt`` as ``put`` returns (between two bytecodes of the caller)."""

    def __init__(self, q: Any) -> None:
        self._q, self._armed = q, True

    def put(self, item: Any) -> None:
        self._q.put(item)
        if self._armed:
            self._armed = False
            raise KeyboardInterrupt


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # the worker's own death
def test_a_duplicate_report_the_copier_discards_never_rewrites_the_ring(slab: SharedSlab,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Contract: a job's ring entry records the outcome of its copies, once, after they completed (copier.py
    module docstring; slab.py: the rings, "not the engine's report, decide whether a store is published"); a
    report that is unknown or already applied is "discarded and counted" (copier.py:123-125) -- the movers rely
    on it: "one answered twice ... is discarded by the owner ...: never lost, never applied twice"
    (thread.py:442-444, cuda.py ``_put_all``).

    Set-up (as in rounds 19-23): the copy worker died and no thread could replace it, so the owner copies
    in ``finished()``'s flush (``ThreadMover._help``).  The ok report of job 2 is posted; a signal handler's
    ``KeyboardInterrupt`` lands as that put returns, before ``answered += 1``; ``_help``'s except answers the
    transfer again, failed.  The copier returns job 2 ok (its bytes are in the slab) and counts the second
    report stale -- but the ring says failed.

    What was wrong (before the fix): copier.py:94-103 (``_MarkThenPost.put``) calls ``slab.mark_done(rank, seq, ok)`` for every
    report, before ``_take`` (copier.py:238) finds it stale: the discarded duplicate's ``2*seq+1`` overwrites
    the ok mark, ``slab.ok(2)`` is False, so the scheduler never publishes a store vLLM was told succeeded (a
    miss, ``jobs_total{store,failed}``), or counts a load vLLM used as failed.

    Fixed as suggested: mark once per job record -- a ``marked`` slot on ``_CopyJob`` set by the first put; later
    reports for the same record are posted unmarked (and then counted stale by ``_take``)."""
    kv = _kv(6, 64, 28)
    c = _copier(slab, kv, 1)
    try:
        mover = c._mover
        first_batch_kills_its_worker(mover)     # the first batch ends the only worker ...
        no_thread_to_be_had(monkeypatch)        # ... and none replaces it: the owner copies from now on
        assert c.submit(1, b"\x28" * 16, 1, True, [0], [0])
        c.wait({1}, timeout=WAIT_S)
        (first,) = c.finished()
        assert first.job_id == 1 and not first.ok

        c._sink._done = _InterruptedAfterPost(c._done)   # type: ignore[assignment]
        assert c.submit(2, b"\x29" * 16, 2, True, [3], [5])
        with pytest.raises(KeyboardInterrupt):
            c.finished()                         # the owner copies job 2 in its flush; interrupted after the post
        results = [(r.job_id, r.ok) for r in c.finished()]
        assert results == [(2, True)]            # vLLM is told job 2 succeeded (the duplicate is discarded) ...
        assert torch.equal(slab.rows[5], kv[3].view(torch.uint8))   # ... and its bytes are in the slab
        assert slab.done(2)
        assert slab.ok(2), "the discarded duplicate rewrote job 2's ring entry as failed: never published"
    finally:
        monkeypatch.undo()
        c.close()
