"""A hypothesis state machine: the manager with the real ``CudaMover`` on the simulated device, against a model.

The mover is :class:`tiered_kv.movers.CudaMover` running on :class:`fake_cuda.FakeGPU`
(``tests/fake_cuda.py``): its streams are queues of operations that run only when a
rule says so, and *which* runnable stream runs next is an index drawn by hypothesis,
so hypothesis controls (and shrinks) the device interleaving.  A copy moves bytes when
it runs, so a copy that runs too early is seen as wrong bytes.

The mover batches, with ``batch_max`` drawn per example from (1, 2, 3, 64): 1 puts each
transfer on the device inside its own store()/load(); 64 (more than MAX_INFLIGHT) only
at a poll.  ``submit`` only queues a transfer; the queue is flushed by the submit that
fills it to ``batch_max``, at the start of every harvest (each poll(), and each
internal poll of wait()) and at the end of every poll (a no-op here: without a disk
nothing is submitted while reports are applied).  A flush answers the transfers
cancelled while queued at once (no copy: a cancelled load is reported, and unfenced,
at that poll; a cancelled store's stale report is counted then), then puts the stores
as one group on side stream ``next`` and the loads as one group on the stream after
it (round robin over the side streams, one step per group), each group as
``wait(compute stream as it is at the FLUSH), start event``, then per chunk of up to
``per_event`` copies (drawn from 1, 2, 3 and given to the mover as ``event_bytes``
that round up to it) ``copy * k, one end event``: the copies of a chunk are harvested
together, once the device reaches that event.
A copy that meets the injected ``FakeGPU.copy_error`` (armed by a store/load drawn to
fail, it hits the next copy queued, at whichever flush that is: the first store of a
batch, else its first load) keeps its transfer's place in the chunk, which is
answered failed at the chunk's end event; the rest of the batch goes on.

Each example also draws whether the mover batches (``CudaMover(batched=...)``).  Per block,
the check is the exact layout above.  Batched, a chunk's calls are one per run of
consecutive host slots (a copy, or a gather/scatter through the staging rows): the check
reads the device rows each chunk's calls copy off the stream and requires exactly the
chunk's rows; the armed copy error fails the first run of the flush's first chunk --
the transfers missing from its calls, which must be a prefix of that chunk.  The
``engine_step`` and ``engine_load_step`` rules give flushes several transfers whose rows
are out of order, so runs are gathered and scattered.

The engine is modelled as the real one behaves: it computes blocks into rows with
kernels queued on the compute stream (a FRESH key each time, so any stale or early
copy is detectable) and mostly stores them, loads ready keys into rows it gave up
with ``free_block`` (only when that returned True) -- sometimes right after queuing
a last read of, or write into, the row -- reads rows it owns with kernels queued on
the compute stream, cancels, invalidates and looks keys up.  It never writes a row
with a load in flight or a store not cancelled (queued or on the device) reading it:
every write follows ``free_block`` (asserted), so the engine work queued between a
submit and its flush, which the batch's barrier waits for too, never touches a row
of the batch.  The device rules offer the side streams before the compute stream, so
hypothesis tries (and shrinks towards) copies running ahead of the engine's queued
work: the hazards.

The model is plain Python (tests/host_model.py, shared with tests/test_state_machine.py, written
from the spec rather than the code): which keys the host tier holds and which are readable, the
jobs not yet answered and their states, cancelled stores awaiting delivery and the counters (slots
in use, fences, evictable keys and table sizes derived from those); here also the engine's view
of each row, the mover (its queue, round robin, the armed copy error, the reports
answered at a flush) and where each job's copy sits on the simulated device: its
side stream and the position of its end event there (so the model knows exactly
when, and in which order, its report is harvested).  Checked:

* no exception ever, except ``BlockBusyError`` exactly when the engine touches a
  row with a load in flight (asserted to be raised);
* store/load/free_block/lookup answers equal the model's; ``free_block(row)`` is
  False exactly while the model has an unreported load into the row;
* every manager call puts on the side streams exactly the operations the model
  predicts (none but at a flush): per group its stream, the barrier on the compute
  stream as it is at the flush, a start event, each copy (of the right device row,
  in submit order) with its own end event; never an event still needed by a copy
  not yet harvested; ``FakeGPU.batches`` names the groups' streams;
* each poll()/wait() reports exactly the jobs whose end event the device has
  reached or that a flush answered (plus cancelled stores due for delivery), in
  the order the mover reports them: nothing early, nothing late, each job exactly
  once over the whole run, with the right ok/error/state; a job cancelled by the
  test (only unreported ones are) is reported "cancelled (...)", never ok; a
  cancelled load only once its copy ran or was dropped from the queue;
* an ok load's row holds exactly its key's bytes at report time; an ok store's
  key, while READY, holds the right bytes -- and every READY key always does;
  every engine read queued on the compute stream sees the bytes the engine
  expects (a load's copy waits for reads queued before it: write after read),
  and every row the engine owns holds what it expects once its own queued
  writes ran (a load's copy waits for writes queued before it);
* the manager's tables (debug_sizes), jobs_in_flight, the mover's in_flight()
  (queued + on the device) and the armed copy error equal the model's;
* after every poll/wait: jobs_total{kind,outcome}, stale_callbacks_total{kind,reason},
  shed_total{kind,reason}, errors_total{tier,error="copy_failed"}, evictions,
  lookup keys and hits equal the model's counters (all samples at teardown);
* teardown: a poll flushes the queue, the device runs everything, ``wait()``
  reports the rest, nothing is live, ``jobs_in_flight == 0``,
  ``mover.in_flight() == 0``, the device is idle.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from prometheus_client import CollectorRegistry

from fake_cuda import FakeGPU, FakeStream
from fakes import ROW_BYTES, fill_row, host_matches, make_config, make_kv, metric_samples, row_matches, sm_settings
from host_model import Copy, Expected, MJob, Model
from tiered_kv import Completion, Job, TierManager
from tiered_kv.errors import BlockBusyError
from tiered_kv.movers import CompletionQueue, CudaMover

ROWS = 6
CAPACITY = 4        # host slots: eviction and host_full shedding happen often
MAX_INFLIGHT = 4    # inflight_limit shedding happens too
BATCH_MAX = (1, 2, 3, 64)   # 1: every transfer at its own submit; 64 > MAX_INFLIGHT: only at a poll
KINDS = ("store", "load")
OUTCOMES = ("ok", "failed", "cancelled", "shed")
REASONS = ("unknown_token", "cancelled", "superseded", "source_reused")
SHED = ("inflight_limit", "host_full")


# ============================================================================ the model
@dataclass(eq=False)
class DJob(MJob):
    """A job of the model, with where its transfer is in the mover."""

    where: str = "queued"         # queued (in the mover's queue) | stream (on ``stream``) | answered (at a flush)
    stream: Any = None            # on the device: the side stream of its copy ...
    end: int = 0                  # ... and its end event is operation number ``end`` of ``stream``
    copy_ok: bool = True          # the report's ok (False: answered at a flush, cancelled or failed)
    ev_start: Any = None          # on the stream: the event recorded before its copy ...
    ev_end: Any = None            # ... and its own end event


@dataclass
class Group:
    """What one flush puts on one side stream: the transfers of one direction, in submit order."""

    stream: int                   # index into the side streams
    mark: int                     # the compute stream's length at the flush: the barrier
    transfers: list[DJob]
    copies: list[DJob]            # those put in a chunk (the one that met the copy error too: failed at its end)
    chunks: list[int] = dataclasses.field(default_factory=list)   # transfers per end event, in order


class DeviceModel(Model):
    """The shared model (tests/host_model.py), plus the CudaMover: its queue of transfers, the flush
    (cancelled ones answered, stores then loads as groups on the side streams, round robin, the
    armed copy error consumed by the first copy), and where each copy sits on the simulated device:
    its report is harvested once the device has run its end event, or at once when a flush answered it."""

    def attach(self, gpu: FakeGPU, batch_max: int, per_event: int, batched: bool) -> None:
        self.gpu = gpu
        self.batched = batched              # the mover's batched calls: which, and how many, the check reads off
        self.side = gpu.side
        self.batch_max = batch_max
        self.per_event = per_event          # copies per end event (event_bytes = per_event rows)
        self.queued: list[DJob] = []        # submitted, not flushed (the mover's queue)
        self.answered: list[DJob] = []      # answered at a flush, in completion queue order, not harvested
        self.next = 0                       # the side stream of the next group
        self.pushed = [s.queued for s in self.side]   # operations queued on each side stream
        self.batches: list[int] = []        # the stream of each group, in order
        self.armed = False                  # FakeGPU.copy_error is set: the next copy fails

    def submit(self, mj: DJob) -> list[Group]:
        """CudaMover.submit: queued; the submit that fills the queue to batch_max flushes it."""
        self.queued.append(mj)
        return self.flush() if len(self.queued) >= self.batch_max else []

    def _answer(self, mj: DJob) -> None:
        mj.where, mj.copy_ok = "answered", False
        self.answered.append(mj)

    def flush(self) -> list[Group]:
        """CudaMover.flush: the groups it queues on the side streams (and what it answers at once)."""
        batch, self.queued = self.queued, []
        stores: list[DJob] = []
        loads: list[DJob] = []
        for mj in batch:
            if mj.state != "pending":       # cancelled while queued: answered, no copy
                self._answer(mj)
            else:
                (stores if mj.kind == "store" else loads).append(mj)
        groups = []
        for ts in (stores, loads):
            if not ts:
                continue
            i, self.next = self.next, (self.next + 1) % len(self.side)
            g = Group(i, self.gpu.compute.queued, ts, [])
            self.pushed[i] += 2             # wait, start event
            chunk: list[DJob] = []          # copies queued since the last end event
            for mj in ts:
                mj.where, mj.stream = "stream", self.side[i]
                if self.batched:            # its call(s), the failed ones too: read off the stream by the check
                    pass
                elif self.armed:            # FakeGPU.copy_error: raised by this copy, failed at the chunk's end
                    self.armed = False
                    mj.copy_ok = False
                else:
                    self.pushed[i] += 1     # its copy
                g.copies.append(mj)
                chunk.append(mj)
                if len(chunk) == self.per_event:
                    self._close(i, chunk, g)
                    chunk = []
            if chunk:
                self._close(i, chunk, g)
            self.batches.append(i)
            groups.append(g)
        return groups

    def _close(self, i: int, chunk: list[DJob], g: Group) -> None:
        """An end event after ``chunk``: its copies are harvested together once the device reaches it."""
        g.chunks.append(len(chunk))
        if self.batched:                    # its calls and end event are read off the stream by the check
            return
        self.pushed[i] += 1
        for mj in chunk:
            mj.end = self.pushed[i]

    def on_device(self) -> list[DJob]:
        return [mj for mj in self.jobs.values() if isinstance(mj, DJob) and mj.where == "stream"]

    def harvest(self) -> list[DJob]:
        """CudaMover.harvest (after its flush): the reports it puts on the completion queue, in order --
        those answered at flushes, then per side stream the copies whose end event has run (per end event,
        those copied, then those that met the copy error)."""
        out, self.answered = self.answered, []
        for s in self.side:
            out += sorted((mj for mj in self.on_device() if mj.stream is s and s.ran >= mj.end),
                          key=lambda mj: (mj.end, not mj.copy_ok))
        return out

    def in_flight(self) -> int:
        return len(self.queued) + len(self.on_device())

    def apply_report(self, mj: DJob) -> Optional[Expected]:
        """The mover's report for ``mj`` applied."""
        return self.apply(mj, mj.copy_ok)


# ============================================================================ the machine
rows = st.integers(0, ROWS - 1)
# about one store/load in twelve arms FakeGPU.copy_error: the next copy queued (at a flush) cannot be queued
inject_failure = st.integers(0, 11).map(lambda n: n == 0)


class CudaMoverMachine(RuleBasedStateMachine):
    """Guards the TierManager with the real CudaMover on a simulated device: the protocol against the spec's
    model, and the copies' ordering against the engine's stream (see the module docstring)."""

    gpu: FakeGPU        # made by the initialize rule ``build``, with the manager
    mover: CudaMover

    def __init__(self) -> None:
        super().__init__()
        self.mgr: Optional[TierManager] = None
        self.broken = False            # set while a step runs; left set if it raised
        self.kv = make_kv(ROWS, seed=7)
        self.model = DeviceModel(CAPACITY, MAX_INFLIGHT, fail_error="failed: copy failed")
        self.view: list[Optional[bytes]] = [None] * ROWS   # the key the engine may read in each row
        self.keys: list[bytes] = []    # every key computed so far
        self.mjobs: dict[uuid.UUID, DJob] = {}
        self.live: dict[uuid.UUID, Job] = {}               # issued, not reported
        self.reported: Counter[uuid.UUID] = Counter()
        self.pending_writes = [0] * ROWS   # engine writes queued on the compute stream, not run yet
        self.bad_reads: list[str] = []
        self.reads = 0

    # -- plumbing ------------------------------------------------------------
    @contextmanager
    def _step(self) -> Iterator[None]:
        """Marks the machine broken while a step runs (teardown then leaves the failure alone); nests."""
        outer, self.broken = self.broken, True
        yield
        self.broken = outer

    @property
    def m(self) -> TierManager:
        assert self.mgr is not None
        return self.mgr

    def _fresh_key(self) -> bytes:
        key = b"key-%d" % len(self.keys)
        self.keys.append(key)
        return key

    def _engine_write(self, row: int, key: bytes) -> None:
        """Runs on the compute stream: the engine computes ``key`` into ``row``."""
        fill_row(self.kv, row, key)
        self.pending_writes[row] -= 1

    def _engine_read(self, row: int, key: bytes) -> None:
        """Runs on the compute stream: the engine reads ``row``, which must hold ``key``."""
        self.reads += 1
        if not row_matches(self.kv, row, key):
            self.bad_reads.append(f"engine read of row {row} did not see {key!r}")

    def _runnable(self) -> list[FakeStream]:
        """The runnable streams, side streams first: hypothesis favours (and shrinks towards) the first
        choices, so copies running ahead of the engine's queued work -- the hazards -- are tried most."""
        ready = self.gpu.runnable()
        return [s for s in ready if s is not self.gpu.compute] + [s for s in ready if s is self.gpu.compute]

    def _queue_write(self, row: int, key: bytes) -> None:
        """The engine (owning ``row``: given up by free_block, which returned True) queues a write of ``key``."""
        # the protocol: no load into the row in flight, no store reading it that free_block did not cancel
        # (queued in the mover or on the device) -- the flush's barrier waits for this write too
        assert not self.model.fenced(row)
        assert not [mj for mj in self.model.jobs.values()
                    if mj.kind == "store" and mj.row == row and mj.state == "pending"], "engine protocol violation"
        self.pending_writes[row] += 1
        self.gpu.kernel(lambda: self._engine_write(row, key))
        self.view[row] = key

    def _queue_read(self, row: int) -> None:
        """The engine queues a read of ``row`` if it owns it (no load in flight) and knows what it holds."""
        key = self.view[row]
        if key is not None and not self.model.fenced(row):
            self.gpu.kernel(lambda: self._engine_read(row, key))

    def _snapshot(self) -> tuple[list[int], int]:
        return [s.queued for s in self.model.side], len(self.gpu.batches)

    def _rows_moved(self, data: list[tuple[Any, ...]], store: bool) -> list[int]:
        """The device rows a chunk's batched calls copy from (stores) or into (loads): ranges copied straight,
        rows gathered into or scattered from the staging rows."""
        kv = self.kv
        base, end = kv.data_ptr(), kv.data_ptr() + kv.numel() * kv.element_size()

        def rows_of(t: torch.Tensor) -> Optional[list[int]]:
            p = t.data_ptr()
            if not base <= p < end:
                return None
            assert (p - base) % ROW_BYTES == 0 and t.numel() * t.element_size() % ROW_BYTES == 0, "not whole rows"
            r0 = (p - base) // ROW_BYTES
            return list(range(r0, r0 + t.numel() * t.element_size() // ROW_BYTES))

        moved: list[int] = []
        for op in data:
            if op[0] == "copy":
                dev, other = (op[2], op[1]) if store else (op[1], op[2])
                assert rows_of(other) is None, f"a {'store' if store else 'load'} copy in the wrong direction: {op}"
                moved += rows_of(dev) or []
            elif op[0] == "gather":
                assert store and op[2].data_ptr() == base, op
                moved += op[3].tolist()
            else:
                assert op[0] == "scatter" and not store and op[1].data_ptr() == base, op
                moved += op[2].tolist()
        return moved

    def _check_batched(self, queued: list[int], groups: list[Group]) -> None:
        """The batched mover's calls: per group, on its stream, ``wait(compute as it is now), start event``, then
        per chunk any calls that copy exactly the rows of its transfers, an end event.  The armed copy error
        fails the first run of the flush's first chunk: transfers missing from its calls, a prefix of it."""
        model, side = self.model, self.model.side
        needed = {e for mj in model.on_device() if mj.ev_end is not None for e in (mj.ev_start, mj.ev_end)}
        pos = {i: queued[i] for i in range(len(side))}   # operations of each side stream accounted for
        first = True
        for g in groups:
            stream = side[g.stream]
            ops = list(stream.ops)[len(stream.ops) - (stream.queued - pos[g.stream]):]
            assert ops[0][0] == "wait" and ops[0][1] is self.gpu.compute and ops[0][2] == g.mark, ops[0]
            assert ops[1][0] == "event", ops[1]
            events, k, members = [ops[1][1]], 2, iter(g.copies)
            for size in g.chunks:
                chunk = [next(members) for _ in range(size)]
                j = k
                while ops[j][0] != "event":
                    j += 1
                moved = self._rows_moved(ops[k:j], g.transfers[0].kind == "store")
                assert len({mj.row for mj in chunk}) == len(chunk)
                if first and model.armed:
                    failed = [mj for mj in chunk if mj.row not in moved]
                    assert failed and failed == chunk[:len(failed)], ("the failed call is the first run", failed)
                    for mj in failed:
                        mj.copy_ok = False
                    model.armed = False
                first = False
                assert sorted(moved) == sorted(mj.row for mj in chunk if mj.copy_ok), (moved, chunk)
                for mj in chunk:
                    mj.end = pos[g.stream] + j + 1
                    mj.ev_start, mj.ev_end = events[-1], ops[j][1]
                events.append(ops[j][1])
                k = j + 1
            pos[g.stream] += k
            assert len({id(e) for e in events}) == len(events), "an event recorded twice in one group"
            assert not [e for e in events if e in needed], "an event recorded again while a copy still needs it"
        assert [s.queued for s in side] == [pos[i] for i in range(len(side))], "operations no group accounts for"
        model.pushed = [s.queued for s in side]

    def _check_flushed(self, before: tuple[list[int], int], groups: list[Group]) -> None:
        """The operations one manager call queued on the side streams are exactly the flush's ``groups``:
        per group, on its stream, ``wait(compute as it is now), start event``, then per chunk of up to
        ``per_event`` copies, ``copy * k, end event`` (batched: :meth:`_check_batched`)."""
        model, (queued, nbatches) = self.model, before
        side = model.side
        if model.batched:
            assert [side.index(s) for s in self.gpu.batches[nbatches:]] == [g.stream for g in groups]
            self._check_batched(queued, groups)
            return
        assert [s.queued for s in side] == model.pushed, ("side stream lengths", [s.queued for s in side],
                                                         model.pushed)
        assert [side.index(s) for s in self.gpu.batches[nbatches:]] == [g.stream for g in groups], \
            "one batch of copies per group, on the round-robin stream"
        assert model.batches == [side.index(s) for s in self.gpu.batches]
        needed = {e for mj in model.on_device() if mj.ev_end is not None for e in (mj.ev_start, mj.ev_end)}
        new_ops = {i: list(s.ops)[len(s.ops) - (s.queued - queued[i]):] for i, s in enumerate(side)}
        for g in groups:
            ops = new_ops[g.stream]
            assert sum(g.chunks) == len(g.copies)
            n = 2 + sum(mj.copy_ok for mj in g.copies) + len(g.chunks)
            mine, new_ops[g.stream] = ops[:n], ops[n:]
            assert len(mine) == n, f"group {g}: {mine}"
            assert mine[0][0] == "wait" and mine[0][1] is self.gpu.compute and mine[0][2] == g.mark, \
                f"the barrier waits for the compute stream as it is at the flush ({g.mark}): {mine[0]}"
            assert mine[1][0] == "event", mine[1]
            events = [mine[1][1]]
            pos, copies = 2, iter(g.copies)
            for size in g.chunks:         # each chunk: its copies, then one end event they share
                chunk = [next(copies) for _ in range(size)]
                live = [mj for mj in chunk if mj.copy_ok]   # the one that met the copy error has no copy
                end = mine[pos + len(live)]
                assert end[0] == "event", (mine[pos:pos + len(live) + 1], g.chunks)
                for k, mj in enumerate(live):
                    copy = mine[pos + k]
                    assert copy[0] == "copy", (copy, g.chunks)
                    dev = copy[2] if mj.kind == "store" else copy[1]
                    host = copy[1] if mj.kind == "store" else copy[2]
                    assert dev.data_ptr() == self.kv[mj.row].data_ptr(), f"{mj.kind} of row {mj.row}: wrong device row"
                    assert host.data_ptr() != self.kv[mj.row].data_ptr()
                for mj in chunk:
                    mj.ev_start, mj.ev_end = events[-1], end[1]
                pos += len(live) + 1
                events.append(end[1])
            assert len({id(e) for e in events}) == len(events), "an event recorded twice in one group"
            reused = [e for e in events if e in needed]
            assert not reused, "an event recorded again while a copy not yet harvested still needs it"
        assert not any(new_ops.values()), f"operations no group accounts for: {new_ops}"

    def _issue(self, kind: str, key: bytes, row: int, fail: bool) -> None:
        """``store``/``load`` of ``key`` into/from ``row`` (no load in flight there), checked against the model:
        the transfer is queued, and flushed when it fills the queue to batch_max."""
        model = self.model
        expected = model.store(key, row) if kind == "store" else model.load(key, row)
        assert expected != "busy"
        if fail and not model.armed:   # the next copy queued fails, whichever it is and whenever it is
            model.armed = True
            self.gpu.copy_error = RuntimeError("CUDA error: injected")
        before = self._snapshot()
        job = self.m.store(key, row) if kind == "store" else self.m.load(key, row)
        if not isinstance(expected, Copy):
            assert job is None, f"{kind}({key!r}, {row}) returned {job!r}; the model expected None"
            self._check_flushed(before, [])
            return
        assert job is not None, f"{kind}({key!r}, {row}) returned None; the model expected a job"
        assert job.kind.value == kind and job.key == key and job.block == row
        mj = DJob(job, kind, key, row, expected)
        model.add(mj)
        self.mjobs[job.token] = mj
        self.live[job.token] = job
        if kind == "load":
            self.view[row] = None   # the engine may not read it before the load is reported ok
        self._check_flushed(before, model.submit(mj))

    def _polled(self, call: Callable[[], list[Completion]]) -> None:
        """poll() or wait(): the mover flushes its queue first, then harvests; checked against the model."""
        before = self._snapshot()
        got = call()
        self._check_flushed(before, self.model.flush())
        self._check_completions(got)

    def _check_completions(self, got: list[Completion]) -> None:
        """``got`` (one poll()/wait(), its flushes modelled) against the model, which applies the same reports."""
        model = self.model
        tokens = [c.job.token for c in got]
        twice = [c.job for c in got if self.reported[c.job.token] or tokens.count(c.job.token) > 1]
        assert not twice, f"reported twice: {twice}"
        harvested = model.harvest()
        due = [mj.job.token for mj in harvested if mj.kind == "load" or mj.state == "pending"]  # a cancelled store's
        due += [mj.job.token for mj in model.deliver]     # report is stale: it was reported by the delivery
        early = [c.job for c in got if c.job.token not in due]
        late = [self.mjobs[t].job for t in due if t not in tokens]
        assert not early, f"reported before its copy ran (or should not be reported now): {early}"
        assert not late, f"not reported although due: {late}"
        assert tokens == due, "reported in another order than the mover's reports"
        outcome: dict[uuid.UUID, Expected] = {}
        for mj in harvested:
            r = model.apply_report(mj)
            if r is not None:
                outcome[mj.job.token] = r
        for mj, r in model.take_deliver():
            outcome[mj.job.token] = r
        model.evict_ahead()
        for c in got:
            mj = self.mjobs[c.job.token]
            ok, err = outcome[c.job.token]
            self.reported[c.job.token] += 1
            del self.live[c.job.token]
            assert c.job is mj.job and c.job.done and c.job.state.value == mj.state, (c, mj.state)
            assert c.ok is ok, f"{c} expected ok={ok} ({err})"
            if ok:
                assert c.error is None
                if mj.kind == "load":
                    assert row_matches(self.kv, mj.row, mj.key), f"ok load of {mj.key!r} into row {mj.row}: wrong bytes"
                    self.view[mj.row] = mj.key
                else:
                    hm = host_matches(self.m, mj.key, self.kv)
                    assert hm in (True, None), f"ok store of {mj.key!r}: wrong bytes in the host tier"
                    assert (hm is True) == model.ready(mj.key)
            else:
                assert err is not None and c.error is not None and c.error.startswith(err), (c.error, err)
                if mj.kind == "load":
                    self.view[mj.row] = None
        self._metrics_agree()

    def _metrics_agree(self, full: bool = False) -> None:
        """Counters equal the model's (right after poll()/wait(): counts are batched until then)."""
        mx = self.m.metrics
        if full:
            samples = metric_samples(mx.registry)
        else:
            samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for fam in (mx.jobs, mx.stale_callbacks, mx.evictions, mx.lookup_hits, mx.lookups,
                                   mx.shed_total, mx.errors)
                       for metric in fam.collect() for s in metric.samples}

        def get(name: str, **labels: str) -> float:
            return samples.get((name, tuple(sorted(labels.items()))), 0.0)

        m = self.model
        for kind in KINDS:
            for outcome in OUTCOMES:
                assert get("tiered_kv_jobs_total", kind=kind, outcome=outcome) == m.jobs_total[(kind, outcome)], \
                    (kind, outcome, m.jobs_total)
            for reason in REASONS:
                assert get("tiered_kv_stale_callbacks_total", kind=kind, reason=reason) == m.stale[(kind, reason)], \
                    (kind, reason, m.stale)
            for why in SHED:
                assert get("tiered_kv_shed_total", kind=kind, reason=why) == m.shed[(kind, why)], (kind, why)
        for tier in ("host", "device"):
            assert get("tiered_kv_errors_total", tier=tier, error="copy_failed") == m.errors[tier], tier
        assert get("tiered_kv_evictions_total", tier="host") == m.evictions
        assert get("tiered_kv_lookup_hits_total", tier="host") == m.hits
        assert get("tiered_kv_lookup_keys_total") == m.asked

    # -- rules ---------------------------------------------------------------
    @initialize(streams=st.integers(1, 3), warm=st.integers(0, CAPACITY), batch_max=st.sampled_from(BATCH_MAX),
                per_event=st.sampled_from((1, 2, 3, 8)), ahead=st.integers(0, 2), batched=st.booleans())
    def build(self, streams: int, warm: int, batch_max: int, per_event: int, ahead: int, batched: bool) -> None:
        """The manager, its CudaMover (``batch_max``; an end event per ``per_event`` copies, given as bytes
        that round up to it) on ``streams`` side streams of a fresh simulated device,
        and ``warm`` keys already READY in the host tier (so loads, hits and evictions happen early), less
        those evicted to leave ``ahead`` slots free at the end of each poll (``host_evict_ahead_blocks``)."""
        self.gpu = FakeGPU()
        made: list[CudaMover] = []

        def factory(dev: torch.Tensor, host: torch.Tensor, out: CompletionQueue) -> CudaMover:
            made.append(CudaMover([(dev, host)], out, streams, runtime=self.gpu, batch_max=batch_max,
                                  event_bytes=per_event * ROW_BYTES - (ROW_BYTES // 2 if per_event > 1 else 0),
                                  batched=batched))
            return made[0]

        self.mgr = TierManager(make_config(host_slots=CAPACITY, max_inflight_jobs=MAX_INFLIGHT,
                                           host_evict_ahead_blocks=ahead), self.kv,
                               registry=CollectorRegistry(), mover_factory=factory)
        self.model.ahead = ahead
        self.mover = made[0]
        assert len(self.gpu.side) == streams
        self.model.attach(self.gpu, batch_max, per_event, batched)
        with self._step():
            for row in range(warm):
                self.compute_and_store(row, False)
            self._polled(self.m.poll)   # what is still queued goes to the device
            self.gpu.run_all()
            self._polled(self.m.poll)
            assert len(self.model.ready_keys()) == min(warm, CAPACITY - ahead)

    @rule(row=rows, fail=inject_failure, store=st.integers(0, 3).map(bool))
    def compute_and_store(self, row: int, fail: bool, store: bool = True) -> None:
        """The engine gives ``row`` up, computes a fresh key into it (a queued kernel) and stores it --
        mostly: it also writes rows it does not store, so a load may follow a write with no store between."""
        with self._step():
            key = self._fresh_key()
            if self.model.fenced(row):   # the engine must not; store() refuses it
                with pytest.raises(BlockBusyError):
                    self.m.store(key, row)
                return
            assert self.model.free_block(row) is True
            assert self.m.free_block(row) is True
            self._queue_write(row, key)
            if store:
                self._issue("store", key, row, fail)

    @rule(order=st.permutations(range(ROWS)), n=st.integers(2, ROWS), fail=inject_failure)
    def engine_step(self, order: list[int], n: int, fail: bool) -> None:
        """A step's stores: the engine computes fresh keys into ``n`` rows in the order drawn and stores them
        all, so that a flush gets several transfers whose rows are out of order while their host slots are
        consecutive (the batched mover's gathered runs) or not."""
        for i, row in enumerate(order[:n]):
            self.compute_and_store(row, fail and i == 0)

    @precondition(lambda self: self.model.host)
    @rule(data=st.data(), row=rows)
    def store_again(self, data: st.DataObject, row: int) -> None:
        """A key stored or being stored is not stored twice (store() returns None and touches it)."""
        with self._step():
            key = data.draw(st.sampled_from(list(self.model.host)), label="key")
            if self.model.fenced(row):
                with pytest.raises(BlockBusyError):
                    self.m.store(key, row)
                return
            self._issue("store", key, row, False)

    @precondition(lambda self: self.keys)
    @rule(data=st.data(), row=rows, fail=inject_failure, last=st.sampled_from(("none", "read", "write")))
    def load(self, data: st.DataObject, row: int, fail: bool, last: str) -> None:
        """A key (mostly one the model has READY) loaded into a row the engine gave up -- maybe just after
        queuing a last ``read`` of the row's old content or a last ``write`` into it (a sequence preempted):
        the load's copy must overtake neither."""
        with self._step():
            ready = self.model.ready_keys()
            pool = ready if ready and data.draw(st.integers(0, 3), label="any key if 0") else self.keys
            key = data.draw(st.sampled_from(pool), label="key")
            if self.model.fenced(row):   # the engine must not; load() refuses it
                with pytest.raises(BlockBusyError):
                    self.m.load(key, row)
                return
            if last == "read":
                self._queue_read(row)
            elif last == "write":
                assert self.model.free_block(row) is True
                assert self.m.free_block(row) is True
                self._queue_write(row, self._fresh_key())
            assert self.model.free_block(row) is True
            assert self.m.free_block(row) is True
            self._issue("load", key, row, fail)

    @precondition(lambda self: len(self.model.ready_keys()) >= 2)
    @rule(data=st.data(), order=st.permutations(range(ROWS)))
    def engine_load_step(self, data: st.DataObject, order: list[int]) -> None:
        """A step's loads: READY keys, in the order the host tier holds them (often consecutive slots), loaded
        into rows the engine gave up, in the order drawn (the batched mover's scattered runs)."""
        keys = self.model.ready_keys()
        n = data.draw(st.integers(2, len(keys)), label="loads")
        rows_ = [r for r in order if not self.model.fenced(r)][:n]
        for key, row in zip(keys, rows_):
            with self._step():
                assert self.model.free_block(row) is True
                assert self.m.free_block(row) is True
                self._issue("load", key, row, False)

    @precondition(lambda self: self.model.ready_keys())
    @rule(data=st.data(), last=st.sampled_from(("read", "write")))
    def reuse_row_for_a_load(self, data: st.DataObject, last: str) -> None:
        """The hazard of ``load``, more often: the engine's last read of (or write into) a row it owns is
        still queued when it gives the row up for a load."""
        with self._step():
            candidates = [r for r in range(ROWS) if not self.model.fenced(r)
                          and (last == "write" or self.view[r] is not None)]
            if candidates:
                self.load(data, data.draw(st.sampled_from(candidates), label="row"), False, last)

    @rule(row=rows)
    def free_block(self, row: int) -> None:
        """False exactly while a load into the row is unreported (and that load is cancelled)."""
        with self._step():
            expected = self.model.free_block(row)
            assert self.m.free_block(row) is expected, f"free_block({row}): the model says {expected}"

    @rule(row=rows)
    def engine_reads(self, row: int) -> None:
        """The engine queues a kernel reading a row it owns: it must see the bytes it expects when it runs."""
        with self._step():
            self._queue_read(row)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        """Cancel a job not reported yet (so its completion must be a cancellation)."""
        with self._step():
            job = data.draw(st.sampled_from(list(self.live.values())), label="job")
            self.model.cancel(self.mjobs[job.token], "cancelled")
            self.m.cancel(job)

    @precondition(lambda self: self.keys)
    @rule(data=st.data())
    def invalidate(self, data: st.DataObject) -> None:
        with self._step():
            key = data.draw(st.sampled_from(self.keys), label="key")
            self.model.invalidate(key)
            self.m.invalidate(key)

    @precondition(lambda self: self.keys)
    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        with self._step():
            ks = data.draw(st.lists(st.sampled_from(self.keys), max_size=4), label="keys")
            assert self.m.lookup(ks) == self.model.lookup(ks)

    @rule(data=st.data(), n=st.integers(1, 16), then_poll=st.booleans())
    def device_steps(self, data: st.DataObject, n: int, then_poll: bool) -> None:
        """The device runs ``n`` operations, each of a runnable stream hypothesis picks; maybe the engine polls."""
        with self._step():
            for _ in range(n):
                ready = self._runnable()
                if not ready:
                    break
                i = data.draw(st.integers(0, len(ready) - 1), label="stream")
                assert self.gpu.step(ready[i])
            if then_poll:
                self._polled(self.m.poll)

    @rule(data=st.data())
    def device_runs_a_stream(self, data: st.DataObject) -> None:
        """One runnable stream runs as far as it can without any other."""
        with self._step():
            ready = self._runnable()
            if ready:
                self.gpu.run(data.draw(st.sampled_from(ready), label="stream"))

    @rule(use_wait=st.booleans())
    def poll(self, use_wait: bool) -> None:
        """poll(), or wait(timeout=0): two internal polls, the second finds nothing more (the device
        does not move meanwhile)."""
        with self._step():
            self._polled((lambda: self.m.wait(timeout=0)) if use_wait else self.m.poll)

    # -- invariants ----------------------------------------------------------
    @invariant()
    def tables_agree(self) -> None:
        if self.mgr is None:
            return
        m, s = self.model, self.mgr.debug_sizes()
        want = m.sizes()
        assert {k: s[k] for k in want} == want, f"debug_sizes {s}, the model says {want}"
        assert self.mgr.jobs_in_flight == want["jobs"] <= MAX_INFLIGHT
        assert self.mgr.host_blocks == want["host_entries"] <= CAPACITY
        assert self.mgr.host_used_slots == want["host_used_slots"] <= CAPACITY
        # harvest() runs only inside poll/wait: every transfer queued or on a stream is still the mover's
        assert self.mover.in_flight() == m.in_flight(), (self.mover.in_flight(), len(m.queued), len(m.on_device()))
        assert (self.gpu.copy_error is not None) == m.armed, "the injected copy error is not consumed as modelled"
        assert [s.queued for s in m.side] == m.pushed

    @invariant()
    def never_wrong_bytes(self) -> None:
        if self.mgr is None:
            return
        for key in self.model.host:
            hm = host_matches(self.mgr, key, self.kv)
            ready = self.model.ready(key)
            assert hm is (True if ready else None), f"host tier: {key!r} is {hm}, the model says ready={ready}"
        assert not self.bad_reads, self.bad_reads
        for row, key in enumerate(self.view):
            # a row the engine owns, with no write of its own still queued, holds what the engine expects
            if key is not None and not self.model.fenced(row) and not self.pending_writes[row]:
                assert row_matches(self.kv, row, key), f"row {row} does not hold {key!r}"

    def teardown(self) -> None:
        if self.mgr is None:
            return
        try:
            if self.broken:
                return   # a step raised: that is the failure to report
            self._polled(self.mgr.poll)   # the transfers still queued go to the device
            assert not self.model.queued and self.mover.in_flight() == len(self.model.on_device())
            self.gpu.run_all()
            assert self.gpu.idle, "the device cannot finish its queues"
            self._polled(lambda: self.m.wait(timeout=30))
            assert not self.live, f"never reported: {list(self.live.values())}"
            assert all(self.reported[t] == 1 for t in self.mjobs)
            assert self.mgr.jobs_in_flight == 0 and self.mover.in_flight() == 0
            s = self.mgr.debug_sizes()
            assert s["jobs"] == s["deliver"] == s["outbox"] == s["row_stores"] == s["row_load"] == s["key_loads"] == 0
            assert s["host_used_slots"] == s["host_entries"] == len(self.model.host)
            assert len(self.model.ready_keys()) == len(self.model.host)
            assert not self.model.unreported(list(self.mjobs.values()))
            self.never_wrong_bytes()
            self._metrics_agree(full=True)
        finally:
            self.mgr.close()


CudaMoverMachine.TestCase.settings = sm_settings(
    100, 50,
    report_multiple_bugs=False,  # one hazard shows up as several failures: shrink one, not each of them
)
TestCudaMoverStateMachine = CudaMoverMachine.TestCase
