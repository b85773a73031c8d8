"""Review round 22: the thread mover's close() drain and stranded workers (4f63025, 2016f8a).

What it proved wrong (both fixed; each test fails on 2016f8a and passes now):

1. ``test_close_copies_what_no_worker_took_in_flush_order`` -- ``close()``'s drain after its join loop took *every*
   queued batch into ``_held`` at once, and ``_help`` copied up to ``HELP_BYTES`` of it as one batch, whose
   ``_do_batch`` copies all stores before all loads: batches the owner gave the workers in separate flushes (a load,
   then a store of the same row) were copied out of order, though the class promises "flushes in order" with one
   worker, and ``SlabCopier`` relies on it.  Fixed: ``close()`` copies what is left through ``_copy_here`` (a batch
   at a time, in the order queued; sentinels go back to the queue's end).
2. ``test_a_replacement_that_fails_with_memoryerror_leaves_a_mover_that_closes`` -- ``_spawn`` unlisted a thread that
   never started, and ``_run`` marked the mover stranded, only on ``RuntimeError``; ``Thread.start`` re-raises *any*
   ``Exception`` of ``_start_new_thread`` (``MemoryError`` from its allocations), and no thread exists either way.
   Fixed: both catch ``Exception`` (an interrupt in ``start()``'s wait, where the thread may run, stays listed).

Not filed (by design): a worker still copying after the exit deadline while the owner copies the next batch
(``_copy_here``) may reorder those two; ``_end`` does not wait for copies the owner itself makes at exit; a
``close()`` interrupted inside its copies leaves a mix of flushes in ``_held``, copied as one batch by the retry.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from test_review_round17 import _planes
from test_review_round19 import dies_in_close_unreplaced, first_batch_kills_its_worker
from tiered_kv.jobs import JobKind
from tiered_kv.movers import CompletionQueue, ThreadMover, Transfer

_STORE, _LOAD = JobKind.STORE, JobKind.LOAD
WAIT_S = 10.0


# ---------------------------------------------------------------------------------------------------- finding 1
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # the worker's own death
def test_close_copies_what_no_worker_took_in_flush_order(monkeypatch):
    """``ThreadMover``'s docstring: "with ``num_workers=1`` the stores of a flush are copied before its loads, and
    flushes in order"; ``SlabCopier`` (integrations/copier.py) relies on it: "jobs run one after another in submission
    order ... so two jobs touching the same slot or block never overlap" (it flushes before a store that follows a
    load, so the load and the store are separate batches of the queue).

    2016f8a's ``close()`` (thread.py, the end of ``ThreadMover.close``: ``self._held.extend(itertools.chain.
    from_iterable(filter(None, iter(self._q.get_nowait, _NEVER))))`` then ``while self._help(): pass``) flattens
    *every* batch still queued into ``_held``; ``_help`` takes up to ``HELP_BYTES`` of ``_held`` as one batch and
    ``_do_batch`` copies that batch's stores (``_copy_batch(ts, stores, True, out)``) before its loads.  So a load
    (flush 1) and a store of the same row (flush 2) left queued when close()'s join finds no worker (round 21's
    case: the worker dies while close() joins it and no thread can replace it) are copied store first: the store
    reads the row before the load wrote it, and reports success.  (The owner's other copies -- ``_copy_here``,
    ``help_one`` with nothing held -- take one queued batch at a time and keep the order.)

    Here: the worker is held inside a first batch and dies once close() joins it, the replacement cannot start;
    queued behind it: a load of slot 0 into row 0 (flush 1), then a store of row 0 into slot 1 (flush 2).  Slot 1
    must end up holding what the load brought.  Proposed fix: keep the batches apart in the drain -- take the
    queued batches (sentinels skipped) into a deque of batches with the same C chain (``self._left.extend(filter(
    None, iter(self._q.get_nowait, _NEVER)))``), then for each: move it into ``_held`` and copy it with ``_help``
    until ``_held`` is empty before the next; or have ``_help`` copy a ``_held`` of several flushes in order (its
    ``_do_batch`` only over a run of one kind)."""
    dev, host = _planes()
    host[0].fill_(0xAA)          # what the load brings into row 0
    before = dev[0].clone()      # what row 0 holds before the load
    q = CompletionQueue()
    m = ThreadMover([(dev, host)], q, num_workers=1, batch_max=64)
    assert m._wide is not None, "the batched copy (stores before loads within a batch) is on for these planes"
    release = dies_in_close_unreplaced(m, monkeypatch, 15)
    m.submit(Transfer("load", _LOAD, [0], [0]))    # flush 1: slot 0 -> row 0
    m.flush()
    m.submit(Transfer("store", _STORE, [0], [1]))  # flush 2: row 0 -> slot 1, after the load
    m.flush()
    try:
        m.close()
    finally:
        release()
        monkeypatch.undo()
    got = {r.token: r.ok for r in q.drain()}
    assert got == {"first": False, "load": True, "store": True}, got
    assert torch.equal(dev[0], host[0]), "the load was copied"
    assert not torch.equal(host[1], before), "the store of flush 2 was copied before the load of flush 1"
    assert torch.equal(host[1], host[0])


# ---------------------------------------------------------------------------------------------------- finding 2
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # the worker's own death
def test_a_replacement_that_fails_with_memoryerror_leaves_a_mover_that_closes(monkeypatch):
    """2016f8a narrowed ``_spawn``'s handler to ``except RuntimeError:`` ("can't start new thread", raised before
    any thread exists) and ``_run`` marks the mover stranded under the same ``except RuntimeError:``.  But
    ``Thread.start`` (CPython 3.11 threading.py) wraps ``_start_new_thread(self._bootstrap, ())`` in
    ``except Exception: del _limbo[self]; raise``: any ``Exception`` there means no thread was made, and
    ``_thread.start_new_thread`` raises ``MemoryError`` when its allocations fail (``PyMem_NEW(struct bootstate)``,
    the new thread state: ``PyErr_NoMemory()``) -- the very memory pressure that makes "can't start new thread".
    Then (thread.py ``_spawn``: ``except RuntimeError: ... unlist ...``; ``_run``: ``except RuntimeError:
    self._stranded = True``) the unstarted thread stays in ``_threads`` and the mover is not stranded: a batch
    queued after the death is never copied by ``flush()`` (``SlabCopier.wait`` without a timeout blocks for ever),
    and ``close()``'s join loop raises ``RuntimeError("cannot join thread before it is started")`` on every try,
    never reaching the drain that would copy it -- round 19's finding 4, through another exception.  Proposed fix:
    in ``_spawn``, ``except Exception:`` (what ``Thread.start`` itself takes for "no thread made"; an interrupt in
    ``_started.wait()`` is a ``BaseException`` and stays listed), and ``except Exception:`` in ``_run`` around
    ``self._spawn()`` for ``_stranded``."""
    dev, host = _planes()
    q = CompletionQueue()
    m = ThreadMover([(dev, host)], q, num_workers=1, batch_max=64)
    first_batch_kills_its_worker(m)
    worker = m._threads[0]

    def no_memory(*args: Any) -> None:
        raise MemoryError()   # _thread.start_new_thread when its allocations fail

    monkeypatch.setattr(threading, "_start_new_thread", no_memory)   # the replacement cannot start
    m.submit(Transfer("first", _STORE, [0], [0]))
    m.flush()
    worker.join(WAIT_S)
    assert not worker.is_alive()
    monkeypatch.undo()
    m.submit(Transfer("after", _STORE, [1], [1]))
    m.flush()   # a stranded mover copies here (round 21's finding 2)
    try:
        m.close()
    finally:
        got = {r.token: r.ok for r in q.drain()}
    assert got == {"first": False, "after": True}, got
    assert torch.equal(host[1], dev[1])
