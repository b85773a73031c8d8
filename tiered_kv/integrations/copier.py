"""The worker side of the vLLM adapter: copies between the engine's KV tensors and this rank's part of
the shared slab, on top of the movers (no vLLM import).

Each KV tensor (an int8 view ``(num_blocks, page_bytes)`` per layer group) is one plane of the mover,
mapped onto consecutive byte regions of this rank's part of a slab row; a vLLM job is one
:class:`~tiered_kv.movers.Transfer` of its blocks over every plane.  CPU tensors get a
:class:`~tiered_kv.movers.ThreadMover`, CUDA tensors a :class:`~tiered_kv.movers.CudaMover` (copies
ordered by events, found finished by ``query()`` in :meth:`SlabCopier.finished`, no synchronize on
the engine's path).

Invariants (the slab-ring protocol, see :mod:`.slab`):

* a job is marked done in the rank's ring (``slab.mark_done(rank, seq, ok)``) only after all its
  copies completed -- the mover's report says so -- and before its result is returned to vLLM;
* jobs run one after another in submission order: one copy worker (CPU) or one copy stream (CUDA),
  so two jobs touching the same slot or block never overlap.  (The ring protocol alone would not
  cover a store and a load of one device block in flight together; the order does.)  A batch (see
  below) keeps the order too: the CUDA mover puts a batch's stores on the stream before its loads,
  so a store submitted after a load first starts the copies queued before it.

``batch_max`` (``copy_batch_max`` of the config, as under ``TierManager``): submitted jobs are
queued and started together at the next point where the engine asks for results --
:meth:`SlabCopier.finished` (vLLM's ``get_finished``) or :meth:`SlabCopier.wait` -- or once
``batch_max`` are queued; ``1`` starts each job at its ``submit``.  vLLM 0.32's worker submits a
step's deferred stores and its loads right after launching the forward pass and asks for results
right after, so a step's copies start together once the engine made its calls: on CUDA behind one
ordering barrier, on the CPU without waking the copy thread for each call.

Pinning follows ``TierManager``'s rule (:func:`tiered_kv.checks.pin_decision`): with CUDA KV tensors (or
``pin=True``) this process's mapping of the slab rows is registered as pinned memory
(:meth:`SharedSlab.pin`) and unregistered at :meth:`SlabCopier.close`.
"""

from __future__ import annotations

import collections
import logging
import queue
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..checks import pin_decision, plain_alias
from ..errors import ConfigError
from ..hostmem import prepare_host_memory
from ..jobs import JobKind, StaleReason
from ..metrics import Metrics
from ..movers import CompletionQueue, CudaMover, Mover, Plane, Report, ThreadMover, Transfer
from ..reports import drain_into, get_within
from .slab import SharedSlab

__all__ = ["SlabCopier", "CopyResult"]

log = logging.getLogger(__name__)

_STORE, _LOAD = JobKind.STORE, JobKind.LOAD


@dataclass
class CopyResult:
    job_id: int
    ok: bool
    nbytes: int
    seconds: float
    store: bool = False   # a device->host copy (whose failure the scheduler side handles as a miss)


class _CopyJob:
    """One vLLM job: the token the mover carries (its report names this record, never a map key).
    ``marked``: its first report was posted, its ring entry written (a report answered again after that,
    after an interrupt, is posted unmarked and discarded by the owner)."""

    __slots__ = ("job_id", "token", "seq", "store", "nblocks", "marked")

    def __init__(self, job_id: int, token: bytes, seq: int, store: bool, nblocks: int) -> None:
        self.job_id = job_id
        self.token = token
        self.seq = seq
        self.store = store
        self.nblocks = nblocks
        self.marked = False


class _MarkThenPost(CompletionQueue):
    """The mover's completion queue: marks each finished job in the rank's ring, then posts its report.

    ``put`` runs where the mover answers: on the copy worker (CPU), or in ``harvest()`` on the
    owner thread once the job's end event was reached (CUDA) -- after the copies, either way."""

    def __init__(self, slab: SharedSlab, rank: int, done: "queue.SimpleQueue[Report]") -> None:
        super().__init__()
        self._slab, self._rank, self._done = slab, rank, done

    def put(self, item: Report) -> None:
        job: _CopyJob = item.token
        if job.marked:   # a transfer answered again after its first report was posted (an interrupt right
            self._done.put(item)   # after that put): the first one's mark stands; the owner discards this one
            return
        if not item.ok:
            log.error("slab copy of job %d failed: %s", job.job_id, item.error)
        try:
            self._slab.mark_done(self._rank, job.seq, item.ok)  # after the copies: the scheduler may reuse the slots
        except Exception:  # noqa: BLE001 - unmarked, the job's slots stay quarantined: safe, counted
            log.exception("marking job %d done in the slab failed", job.job_id)
            item.ok = False
        # the flag and the post with no call between them (no signal handler runs in between): a report answered
        # again after an interrupt before this point writes the ring again, with the outcome the owner will see
        job.marked = True
        self._done.put(item)



def _on_cuda(tensors: Sequence[torch.Tensor]) -> bool:
    return any(t.is_cuda for t in tensors)


def _copy_mover(planes: Sequence[Plane], out: CompletionQueue, batch_max: int) -> Mover:
    """One worker or one stream: jobs run in submission order."""
    if planes and planes[0][0].is_cuda:  # pragma: no cover - needs CUDA (the simulated device in the tests)
        return CudaMover(planes, out, num_streams=1, batch_max=batch_max)
    return ThreadMover(planes, out, num_workers=1, batch_max=batch_max)


class SlabCopier:
    """Worker-side copies between the engine's KV tensors and this rank's part of the slab.

    Jobs run in submission order (see the module docstring); each is marked done in the rank's
    ring after its copies completed, then its report is posted; the owner thread (the engine's,
    in :meth:`finished`) maps reports back to the engine's job ids.  A report it does not know (a
    duplicate or one after :meth:`close`) is discarded and counted, never raised, and never writes the
    ring; a submit that reuses the token of a job in flight is counted the same way and answered
    failed at once (never copied: its slots are the scheduler's, and its token is not its own).

    ``batch_max``: jobs queued before they start (module docstring); ``pin``: ``pin_host_memory``
    (:func:`tiered_kv.checks.pin_decision`), ``cudart`` the CUDA runtime that pins (default ``torch.cuda.cudart()``);
    ``prefault``: ``prefault_host_memory`` (:mod:`tiered_kv.hostmem`), for this process's mapping of an
    unpinned slab.  ``owned``: copy only the jobs of the scheduler that owns this mapping of the slab
    (:meth:`SharedSlab.owns`); any other job is answered failed at once (the vLLM worker's setting).
    """

    def __init__(self, slab: SharedSlab, rank: int, tensors: Sequence[torch.Tensor], *, metrics: Metrics,
                 on_stale: Optional[Callable[[JobKind], None]] = None, batch_max: int = 1,
                 pin: Optional[bool] = False, cudart: Optional[Any] = None, prefault: bool = False,
                 owned: bool = False) -> None:
        if not 0 <= rank < slab.world_size:
            raise ConfigError(f"rank {rank} out of range [0, {slab.world_size})")
        if isinstance(batch_max, bool) or not isinstance(batch_max, int) or batch_max < 1:
            raise ConfigError(f"copy_batch_max must be an int >= 1, got {batch_max!r}")
        widths = []
        for i, t in enumerate(tensors):
            if t.dim() != 2 or t.dtype not in (torch.int8, torch.uint8):
                raise ConfigError(f"KV tensor {i} must be a 2-D int8/uint8 (num_blocks, page_bytes) view, "
                                  f"got {t.dtype} {tuple(t.shape)}")
            widths.append(int(t.shape[1]))
        if sum(widths) > slab.rank_bytes:
            raise ConfigError(f"a block of this worker is {sum(widths)} bytes; the slab gives each rank "
                              f"{slab.rank_bytes}")
        self.slab = slab
        self.rank = rank
        self.metrics = metrics
        self._on_stale = on_stale
        planes: list[Plane] = []  # (engine tensor as uint8, its region of the slab rows)
        off = base = rank * slab.rank_bytes
        with torch.inference_mode(False):   # the planes and the mover's views of them: never inference tensors
            for t, w in zip(tensors, widths):
                planes.append((plain_alias(t).view(torch.uint8), slab.rows[:, off:off + w]))
                off += w
        self.block_bytes = off - base
        self._jobs: dict[bytes, _CopyJob] = {}          # token -> job, owner thread only
        self._done: "queue.SimpleQueue[Report]" = queue.SimpleQueue()
        self._kept: "collections.deque[Report]" = collections.deque()   # see reports.get_within
        self._finished: list[CopyResult] = []
        self._closed = False       # submits refused (set as close() starts)
        self._close_done = False   # close() finished: the mover closed and the slab unpinned
        self._loads_queued = False  # a load was submitted since the copies were last started
        self._owned = owned
        self._foreign_logged = False
        pinned = pin_decision(pin, _on_cuda(tensors))
        if pinned:
            slab.pin(cudart)
        self.host_memory = prepare_host_memory(slab.rows, prefault, pinned)
        self._sink = _MarkThenPost(slab, rank, self._done)
        with torch.inference_mode(False):
            self._mover: Optional[Mover] = _copy_mover(planes, self._sink, batch_max) if planes else None

    def submit(self, job_id: int, token: bytes, seq: int, store: bool, blocks: Sequence[int],
               slots: Sequence[int]) -> bool:
        if self._closed:
            return False
        if len(blocks) != len(slots):
            raise ConfigError(f"job {job_id}: {len(blocks)} device blocks for {len(slots)} slab slots; "
                              f"tiered_kv stores one device block per key (blocks_per_chunk=1)")
        live = self._jobs.get(token)
        if live is not None:
            self._refuse_duplicate(job_id, live, seq, store)
            return True
        # (a sequence or a numpy array: vLLM's block ids arrive as int32 arrays, converted once here)
        rows, where = list(map(int, blocks)), list(map(int, slots))
        job = _CopyJob(job_id, token, seq, store, len(rows))
        self._jobs[token] = job
        if self._owned and not self.slab.owns(token):
            # its slots name rows of a slab this mapping is not (slab.py: the owner): copying would move zeros
            # or another slab's rows into the engine's KV as a successful load.  Failed, and never copied
            if not self._foreign_logged:
                self._foreign_logged = True
                log.error("job %d was made by a scheduler that does not own this worker's slab %s (a worker started "
                          "again after the scheduler dropped the slab's name?): its copies fail; further such jobs "
                          "are counted, not logged", job_id, self.slab.path)
            self._sink.put(Report(job, _STORE if store else _LOAD, False, "job of another slab's scheduler"))
            return True
        if self._mover is None:  # no KV tensor: nothing to copy, the job is done
            self._sink.put(Report(job, _STORE if store else _LOAD, True))
            return True
        if store and self._loads_queued:
            self._start()  # a batch's stores run before its loads (CUDA): keep the submission order
        self._loads_queued |= not store
        self._mover.submit(Transfer(job, _STORE if store else _LOAD, rows, where))
        return True

    def _refuse_duplicate(self, job_id: int, live: _CopyJob, seq: int, store: bool) -> None:
        """A submit carrying the token of job ``live``, in flight: counted, its ring entry marked failed (unless
        it is ``live``'s own), and answered failed at the next :meth:`finished` -- vLLM was told it was taken,
        and completes a job only once ``get_finished`` names it."""
        self._stale(_STORE if store else _LOAD)
        log.warning("job %d reuses the token of job %d, in flight: answered failed, not copied", job_id, live.job_id)
        if seq != live.seq:
            try:
                self.slab.mark_done(self.rank, seq, False)
            except Exception:  # noqa: BLE001 - unmarked, its slots stay quarantined: safe
                log.exception("marking job %d failed in the slab failed", job_id)
        self._finished.append(CopyResult(job_id, False, 0, 0.0, store))

    def _start(self) -> None:
        """Start the queued copies (the engine asks for results, or a store follows a load)."""
        self._loads_queued = False
        if self._mover is not None:
            self._mover.flush()

    def finished(self) -> list[CopyResult]:
        """Owner thread: the jobs finished since the last call; starts the copies queued since then.

        Each report goes from the queue into ``_kept`` in C, and its result into ``_finished`` before it
        leaves ``_kept``; the results leave ``_finished`` only as this returns.  So an exception a signal
        handler raises anywhere in here leaves every report or result for the next call."""
        self._start()
        if self._mover is not None:
            self._mover.harvest()  # CUDA: answers (and marks) the jobs whose end event was reached
        kept = self._kept   # (and what a wait() a signal handler's exception broke off took)
        drain_into(kept, self._done)
        while kept:
            self._take_front(kept[0])
        self.metrics.flush()
        out, self._finished = self._finished, []
        return out

    def _take_front(self, report: Report) -> None:
        """Take ``report``, the front of ``_kept``, into ``_finished``, then pop it: after its result is kept
        (interrupted in between, it is taken again, and counted stale), and only if it is still the front (a
        signal handler that called :meth:`wait` or :meth:`finished` meanwhile took it already)."""
        self._take(report, self._finished)
        kept = self._kept
        if kept and kept[0] is report:
            kept.popleft()

    def _take(self, r: Report, out: list[CopyResult]) -> None:
        job: _CopyJob = r.token
        if self._jobs.get(job.token) is not job:
            self._stale(r.kind)
            return
        n = job.nblocks * self.block_bytes
        result = CopyResult(job.job_id, r.ok, n if r.ok else 0, r.seconds, job.store)
        del self._jobs[job.token]   # then the append, with no call between them: no signal handler runs in
        out.append(result)          # between, so the job's result is never lost once it left _jobs
        m = self.metrics
        # bytes and copy times are counted here, job outcomes by the scheduler side (once per job); a copy
        # time per block, as TierManager observes it; a failed copy moved no bytes, and is counted on the
        # tier it was to write (a failed load: the device's), as TierManager counts it
        if not r.ok:
            m.error("host" if job.store else "device", "copy_failed")
        else:
            link = ("device", "host") if job.store else ("host", "device")
            m.count(m.link_bytes[link], n)
            m.observe(m.link_seconds[link], r.seconds / max(1, job.nblocks), max(1, job.nblocks))

    def _stale(self, kind: JobKind) -> None:
        self.metrics.count(self.metrics.stale[(kind, StaleReason.UNKNOWN_TOKEN)])
        if self._on_stale is not None:
            self._on_stale(kind)

    def wait(self, job_ids: Iterable[int], timeout: Optional[float] = None) -> None:
        """Block until the jobs ``job_ids`` have finished (their results stay for :meth:`finished`).

        CUDA: waits for the copy stream (the caller asked to block), without a timeout."""
        want = set(job_ids)
        pending = {j for j in self._jobs.values() if j.job_id in want}
        if pending:
            self._start()
        if pending and isinstance(self._mover, CudaMover):
            self._mover.synchronize()
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return
            try:   # left at the front of _kept until its result is kept (as finished() takes them)
                report = self._kept[0] if self._kept else get_within(self._done, remaining, self._kept, leave=True)
            except queue.Empty:
                return
            self._take_front(report)
            pending.discard(report.token)
            if pending and self._mover is not None:   # a mover whose worker died unreplaced copies here (its
                self._mover.flush()                     # flush), woken by the dead worker's answers

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def close(self) -> None:
        """Finish queued copies, stop the copy worker and unpin the slab.  Idempotent."""
        if self._close_done:
            return
        self._closed = True   # from the start: no submit while the copies are finished
        if self._mover is not None:
            self._mover.close()
        self.slab.unpin()  # after the copies: none reads or writes the rows any more
        # only now: a close interrupted before this is finished by a retry, not skipped with copies queued
        self._close_done = True
        self.metrics.flush()
