"""Review round 21: the thread mover's exit stop and owner copies (4f63025), the pinned tier directory (23c9192,
ec5653d) and the SIGKILL row's in-flight figure (d513e97).

What it proved wrong (both fixed; each test fails on 4f63025 and passes now):

1. ``test_a_worker_that_dies_while_close_joins_it_leaves_no_batch_unanswered`` -- ``close()`` checked for a live
   worker once, before its join; a worker that died after the check (its replacement could not start) left the
   batch ``close()`` itself queued behind it unanswered for ever.  Fixed: ``close()`` copies what is still queued
   once its join loop finds no thread left (``_help``: ``help_one``'s copy, also once closed), whatever left it.
2. ``test_a_copier_job_submitted_after_its_worker_died_unreplaced_is_copied`` -- ``flush()`` copied on the owner
   only once ``_ended``; a mover left without a worker by such a death never copied again before ``close()``, and
   ``SlabCopier.wait()`` (no timeout in vLLM) blocked for ever.  Fixed: a worker whose replacement cannot start
   marks the mover stranded, and ``flush()`` of a stranded mover copies on the owner (``_copy_here``).

Checked and found to hold (no test)
===================================

* ``_copy_here``'s bound ``range(qsize() + 1)``: each round either empties the queue of batches or moves at least one
  sentinel that was ahead of a batch behind it; sentinels added meanwhile (``_end`` on another thread) go behind
  the batches, and a worker still stopping only removes items, so k sentinels ahead of batches need at most k + 1
  rounds (traced for [S, S, B], [S, B, S, B], a worker that dies during ``_end`` leaving an extra sentinel).
* A worker that dies after ``_end`` returned (past the deadline) spawns a replacement that takes the sentinel its
  predecessor never took, so it stops too; ``close()`` on an ended mover drops leftover sentinels but then puts one
  per listed thread, so no join waits for ever; ``close()`` racing ``_end`` on another thread only adds sentinels.
* Interrupts: ``close()``'s drain is one chain of C calls; what ``help_one`` leaves in ``_held`` is queued again by
  the retried ``close()``/``flush()`` and copied by ``_copy_here``.  A sentinel put back by ``help_one`` can be lost
  to an interrupt between ``if not held`` and ``self._q.put(None)``, but the only worker it concerns is one still
  copying after the exit deadline, and ``close()`` sends fresh ones: no hang, no lost transfer.
* ``DiskStore._release``: ``iter(self._dirs.pop, None)`` ends by ``IndexError`` (caught) once the list is empty; each
  number is popped before it is closed, so a second ``_release`` (reaper, retry) closes nothing twice.
  ``as_named``/``_named`` replace ``/proc/self/fd/N`` where N is the store's own pinned descriptor, and every text
  they see names only that path (LMDB's ``"<path>: MDB_..."``, ``OSError`` filenames under it), so a prefix of
  another descriptor's number (``/proc/self/fd/1`` in ``/proc/self/fd/13``) never occurs there.
* ``crashrun._spills_in_flight``: ``tiered_kv_jobs_in_flight`` is ``livesum``; ``MultiProcessCollector.merge`` sums it
  over the pid files with the pid label dropped (``accumulate`` only concerns histograms), and the directory is
  emptied before each run, so after the SIGKILL the figure is the sum of what each killed process last published.
  Only a process that exited during the run with spills still counted would be counted too (``live`` modes rely on
  ``mark_process_dead``); none was shown to do so without vLLM.
"""

from __future__ import annotations

import threading

import pytest
import torch

from test_review_round17 import _planes
from test_review_round19 import dies_in_close_unreplaced, first_batch_kills_its_worker, no_thread_to_be_had
from tiered_kv.jobs import JobKind
from tiered_kv.movers import CompletionQueue, ThreadMover, Transfer

_STORE = JobKind.STORE
WAIT_S = 10.0


# ---------------------------------------------------------------------------------------------------- finding 1
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # the worker's own death
def test_a_worker_that_dies_while_close_joins_it_leaves_no_batch_unanswered(monkeypatch):
    """4f63025 made ``close()`` copy what is queued itself when no worker is alive (round 19's finding 4: a worker
    whose replacement cannot start).  But ``live`` is computed once, *before* the join (``thread.py``,
    ``ThreadMover.close``: ``with self._lock: live = any(t.is_alive() for t in self._threads)`` then
    ``if self._ended or not live: ... while self.help_one(): pass`` then ``self._closed = True`` and the join loop).
    A worker alive at that check -- still copying the batch before -- that dies afterwards (the same death as round
    19's: a ``BaseException`` in its copy, and ``_spawn`` cannot start a replacement, "can't start new thread")
    answers its own batch failed, but the batch ``close()``'s own ``flush()`` queued behind it (and the stop
    sentinel) stay in the queue: the join loop joins the dead worker, finds no thread left and returns.  The
    queued transfer is never answered, and never can be (``_closed`` is set: ``help_one`` returns False), so its
    owner's job never ends.  Here: worker gated inside batch 1, ``close()`` queues batch 2 and checks ``live``
    (True), the worker dies once ``close()`` joins it, the replacement cannot start.  Proposed fix: after the join
    loop (no worker left), take what is still queued (``filter(None, iter(self._q.get_nowait, _NEVER))`` into
    ``_held``, as the ``not live`` branch does) and copy it on the calling thread (a ``help_one`` that ignores
    ``_closed`` for this drain, or ``self._do_batch`` directly), or at least answer it failed ("closed: no worker");
    equivalently, loop ``check live / join`` until the queue holds nothing but sentinels."""
    dev, host = _planes()
    q = CompletionQueue()
    m = ThreadMover([(dev, host)], q, num_workers=1, batch_max=64)
    release = dies_in_close_unreplaced(m, monkeypatch, 0)
    m.submit(Transfer("second", _STORE, [1], [1]))   # queued by close()'s flush, behind the batch being copied
    try:
        m.close()
    finally:
        release()
    got = {r.token: r.ok for r in q.drain()}
    assert "second" in got, f"a transfer queued before close() was never answered: {got}"


# ---------------------------------------------------------------------------------------------------- finding 2
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # the worker's own death
def test_a_copier_job_submitted_after_its_worker_died_unreplaced_is_copied(tmp_path, monkeypatch):
    """4f63025 answers round 19's finding 4 (a worker that dies and whose replacement cannot start) only in
    ``close()`` (``if self._ended or not live: ... while self.help_one()``), and makes ``flush()`` copy on the
    owner only after the exit stop (``thread.py``, ``ThreadMover.flush``: ``if self._ended: self._copy_here()``).
    A mover left with no worker by that death is in the very state ``_copy_here`` is for ("no worker takes from
    the queue"), but is not ``_ended``: every later batch waits in the queue for a worker that will never come,
    until ``close()``.  ``SlabCopier`` (integrations/copier.py) relies on the worker alone: ``finished()`` only
    flushes, ``wait(job_ids)`` only blocks on the report queue, and vLLM's ``TieredKVOffloadingHandler.wait``
    calls it without a timeout -- the engine hangs for ever on the job (here: ``wait(timeout=0.5)`` returns with
    the job not done, and ``finished()`` never returns it).  Proposed fix: in ``flush()``, copy here also when no
    listed worker is alive (``if self._ended or not self._live(): self._copy_here()``, ``_live`` computed under
    ``self._lock`` as ``close()`` does); or have ``_run`` that fails to ``_spawn`` its replacement mark the mover
    so (e.g. set ``_ended``, whose meaning is "no worker: the owner copies")."""
    from prometheus_client import CollectorRegistry

    from tiered_kv.integrations.copier import SlabCopier
    from tiered_kv.integrations.slab import SharedSlab
    from tiered_kv.metrics import Metrics

    slab = SharedSlab.open(tmp_path / "c.slab", 4, 64, 1)
    kv = torch.randint(-128, 128, (6, 64), generator=torch.Generator().manual_seed(1), dtype=torch.int8)
    c = SlabCopier(slab, 0, [kv], metrics=Metrics(registry=CollectorRegistry(), namespace="t"))
    try:
        m = c._mover
        assert isinstance(m, ThreadMover)
        worker = m._threads[0]
        first_batch_kills_its_worker(m)
        real_start = threading.Thread.start
        no_thread_to_be_had(monkeypatch)   # the replacement cannot start
        assert c.submit(1, b"a" * 16, 0, True, [0], [0])
        c.wait([1], timeout=WAIT_S)      # answered failed by the dying worker
        worker.join(WAIT_S)
        assert not worker.is_alive() and not any(t.is_alive() for t in m._threads)
        monkeypatch.setattr(threading.Thread, "start", real_start)
        assert [(r.job_id, r.ok) for r in c.finished()] == [(1, False)]
        assert c.submit(2, b"b" * 16, 3, True, [4, 1], [2, 0])   # the engine stores another block ...
        c.wait([2], timeout=0.5)                                   # ... and waits for it (vLLM: no timeout)
        done = c.finished()
        assert [r.job_id for r in done] == [2], f"a job submitted after the worker died was never copied: {done}"
    finally:
        c.close()
        slab.close()
