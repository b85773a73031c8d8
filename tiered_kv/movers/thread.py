"""ThreadMover: copies on worker threads, for KV tensors without CUDA, a batch of transfers at a time.

The owner's ``flush()`` hands the transfers queued since the last one to the workers as batches
(stores, then loads, each batch at most :data:`BATCH_BYTES`).  A worker copies a batch's rows with
torch index ops over all of its transfers at once -- one ``index_select`` (and, when neither side's
rows are consecutive, one ``index_copy_`` per :data:`STAGE_BYTES` of rows) per plane, on a view of
the rows as 16-byte elements -- so that no Python runs per block, the GIL is released for the whole
copy, and torch's intra-op threads share it.  Transfers the batched copy cannot take (rows of a
width no wide view fits, an injected per-row ``copy_fn``) are copied row by row, with ``memmove``
between precomputed addresses (through ctypes, which releases the GIL).  A worker that dies is
replaced and the transfers of its batch are reported failed, so every transfer is answered exactly once.

Longer than most modules here (about 500 lines) because it also holds the row plans both CPU movers
share -- :func:`split_batches`, :func:`fast_planes`, :func:`wide_planes`, :func:`memmove_rows`,
:func:`copy_one` -- which :mod:`.native` imports: the ThreadMover is their reference user (the
per-row fallback and the batched copy run as Python here), and a module of them alone would only
move imports around.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Callable, Optional

import torch

from ..jobs import JobKind
from .base import (CompletionQueue, Mover, Plane, Report, Transfer, byte_rows, check_planes, rows_in_range,
                   rows_view, transfer_error, widen)
from .rowcopy import copy_rows, index_args

__all__ = ["ThreadMover", "CopyFn", "BatchFn", "batch_copy", "wide_planes", "fast_planes", "memmove_rows",
           "copy_one", "split_batches", "screen", "FEW_ROWS", "BATCH_BYTES",
           "STAGE_BYTES", "HELP_BYTES", "CATCH_UP_S"]

log = logging.getLogger(__name__)

_STORE = JobKind.STORE  # a module constant: cheaper than the class attribute, on every copy

CopyFn = Callable[[torch.Tensor, torch.Tensor], None]
BatchFn = Callable[[torch.Tensor, list[int], torch.Tensor, list[int], torch.Tensor], None]
"""``batch_fn(dst, dst_rows, src, src_rows, stage)``: ``dst[dst_rows[i]] = src[src_rows[i]]`` for every ``i``."""

BATCH_BYTES = 16 << 20
"""A batch a worker takes holds at most this many bytes (at least one transfer): a step's copies are
spread over the workers, and its first transfers are reported before its last ones are copied."""

STAGE_BYTES = 4 << 20
"""Rows gathered per pass when neither side's rows are consecutive: they are gathered into a staging
buffer of this size (per thread) and scattered from it while it is still in the CPU's cache."""

CATCH_UP_S = 0.005
"""The managers' CPU movers: a batch the workers have not taken this long after a flush gave it to them
is copied by the owner at its next flush (see :meth:`ThreadMover.flush`).  CPython's default switch
interval: a worker kept from the GIL by an owner running Python wins it within that; a batch older
than that is behind a backlog the workers are not clearing.  (A batch only a step's calls old is left
to them: the engine's compute after the step's ``poll()`` gives them the GIL.)"""

HELP_BYTES = 4 << 20
"""``help_one()`` copies at most this many bytes of held transfers per call (at least one transfer),
so that the owner checks what it waits for between calls."""

_WIDE = (torch.complex128, torch.int64)
"""Element types the batched copy views rows as, widest first: torch's ``index_copy_`` copies an element
at a time, so a byte row copies many times faster as 16-byte elements (narrower ones lose to ``memmove``
per row: rows no wide view fits are copied row by row).  A copy of these elements moves their bits
unchanged (no arithmetic touches them; the byte-for-byte tests use random rows)."""


FEW_ROWS = 2
"""A batch of one transfer of at most this many rows is copied row by row: a ``memmove`` call costs
less than building index tensors (the per-block API with ``copy_batch_max=1``)."""


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def batch_copy(dst: torch.Tensor, dst_rows: list[int], src: torch.Tensor, src_rows: list[int],
               stage: torch.Tensor) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` for every ``i`` with torch index ops, no Python per row:
    :func:`.rowcopy.copy_rows` on one plane, run as Python.

    ``dst`` and ``src`` are ``[rows, elements]`` of one dtype; ``stage`` is a contiguous buffer of the
    same dtype and row width (never resized; zero rows: rows are copied one ``copy_`` each where
    neither side's rows are consecutive).  The destination rows must be distinct (the owner's leases and
    fences see to it)."""
    args = index_args(dst_rows, src_rows, torch.empty(0, dtype=torch.int64))
    copy_rows([dst], [src], *args, [stage], [0])


def wide_planes(planes: list[Plane]) -> Optional[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per plane ``(device rows, host rows)`` viewed as the widest element of :data:`_WIDE` both fit, when
    every plane is two CPU tensors whose rows are byte ranges of equal size that one fits; else None."""
    out = []
    for dev, host in planes:
        if dev.is_cuda or host.is_cuda:
            return None
        d, h = rows_view(dev), rows_view(host)
        if d is None or h is None or d.shape[1] != h.shape[1]:
            return None
        for dtype in _WIDE:
            wd, wh = widen(d, dtype), widen(h, dtype)
            if wd is not None and wh is not None:
                out.append((wd, wh))
                break
        else:
            return None
    return out


def fast_planes(planes: list[Plane]) -> Optional[tuple[tuple[int, int, int, int, int], ...]]:
    """Per plane ``(device row 0, device row stride, host row 0, host row stride, row bytes)`` in bytes,
    when every plane is two CPU tensors with contiguous rows of equal size; else None."""
    out = []
    for dev, host in planes:
        n = host[0].numel() * host.element_size()   # a row's bytes, whatever its shape
        if dev.is_cuda or host.is_cuda or not (dev[0].is_contiguous() and host[0].is_contiguous()) \
                or dev[0].numel() * dev.element_size() != n:
            return None
        out.append((dev.data_ptr(), dev.stride(0) * dev.element_size(),
                    host.data_ptr(), host.stride(0) * host.element_size(), n))
    return tuple(out)


def rows_len(t: Transfer) -> int:
    """How many rows ``t`` names, for sizing batches before :func:`screen`: 0 where its rows are no sequence
    (None), so that the screen answers it alone instead of a ``len()`` failing a batch of others."""
    try:
        return len(t.rows)
    except TypeError:
        return 0


def split_batches(held: Sequence[Transfer], block_bytes: int, cap: int) -> list[list[Transfer]]:
    """``held`` as batches of at most ``cap`` bytes (at least one transfer each): its stores, then its
    loads, each in submission order."""
    stores = [t for t in held if t.kind is _STORE]
    loads = [t for t in held if t.kind is not _STORE] if len(stores) < len(held) else []
    out: list[list[Transfer]] = []
    for ts in (stores, loads):
        batch: list[Transfer] = []
        nbytes = 0
        for t in ts:
            size = rows_len(t) * block_bytes
            if batch and nbytes + size > cap:
                out.append(batch)
                batch, nbytes = [], 0
            batch.append(t)
            nbytes += size
        if batch:
            out.append(batch)
    return out


def screen(ts: Sequence[Transfer], nrows: int, nslots: int) -> list[tuple[Transfer, Optional[Report]]]:
    """Each transfer with its answer when it needs no copy (cancelled, rows or slots malformed, out of range or
    of different lengths: failed; no rows: done), else None."""
    out: list[tuple[Transfer, Optional[Report]]] = []
    for t in ts:
        if t.cancelled:
            out.append((t, Report(t.token, t.kind, False, "cancelled before copy")))
            continue
        try:
            error = transfer_error(t, nrows, nslots)
        except Exception as exc:   # noqa: BLE001 - rows or slots not sequences (None): answered alone, like
            #                        any bad transfer, instead of failing the flush of every other one
            error = f"copy failed: malformed transfer: {exc!r}"
        if error is not None:
            out.append((t, Report(t.token, t.kind, False, error)))
        elif not t.rows:
            out.append((t, Report(t.token, t.kind, True, None, 0, 0.0)))
        else:
            out.append((t, None))
    return out


def memmove_rows(planes: tuple[tuple[int, int, int, int, int], ...], t: Transfer) -> None:
    """Copy ``t`` row by row with ``memmove`` (ctypes releases the GIL) between the addresses of
    :func:`fast_planes`; ``t`` must have been checked in range (:func:`screen`)."""
    mm = ctypes.memmove
    store = t.kind is _STORE
    for r, s in zip(t.rows, t.slots, strict=True):
        for d0, ds, h0, hs, n in planes:
            if store:
                mm(h0 + s * hs, d0 + r * ds, n)
            else:
                mm(d0 + r * ds, h0 + s * hs, n)


def copy_one(t: Transfer, nrows: int, nslots: int, block_bytes: int, copy: Callable[[Transfer], None]) -> Report:
    """``t`` screened (:func:`screen`), then copied by ``copy(t)`` and answered by its outcome, timed."""
    (_, report), = screen([t], nrows, nslots)
    if report is not None:
        return report
    t0 = time.perf_counter()
    try:
        copy(t)
    except Exception as exc:
        return Report(t.token, t.kind, False, f"copy failed: {exc!r}", seconds=time.perf_counter() - t0)
    return Report(t.token, t.kind, True, None, len(t.rows) * block_bytes, time.perf_counter() - t0)


_open_at_exit: Optional["weakref.WeakSet[ThreadMover]"] = None   # made on first use (nothing at import)


def _close_at_exit(mover: "ThreadMover") -> None:
    """Stop ``mover``'s copy threads when the interpreter exits if it is still open then (:meth:`ThreadMover._end`).
    They run torch ops with the GIL released; one that returns from an op while the interpreter finalizes is
    ended inside torch's C++, and the process aborts ("terminate called without an active exception").
    ``atexit`` handlers run before that, every thread still alive: the copies in flight finish there and the
    threads end."""
    global _open_at_exit
    if _open_at_exit is None:
        _open_at_exit = weakref.WeakSet()
        atexit.register(_close_open_movers)
    _open_at_exit.add(mover)


EXIT_WAIT_S = 10.0   # how long the interpreter's exit waits at most for the copy threads of movers left open


def _close_open_movers() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    for m in list(_open_at_exit or ()):
        try:
            m._end(deadline)
        except Exception:   # noqa: BLE001 - at exit: said, and the next one ended
            log.exception("the copy threads of a mover could not be stopped at exit")


class ThreadMover(Mover):
    """Copies on worker threads, a batch of transfers at a time; reports through ``completions``.

    By default a batch's rows are copied with :func:`batch_copy` (``batch_fn`` replaces it: tests
    inject failing or gated batches); a batch whose batched copy raises is copied again transfer by
    transfer, each answered by its own outcome.  ``copy_fn(dst_row, src_row)`` replaces the copy of
    one row (tests inject torn or failing copies) and turns the batched copy off unless ``batch_fn``
    is given; the row-by-row copy is a ``memmove`` between row addresses.  A transfer that names a
    row or slot out of range, or rows and slots of different lengths, fails alone, before any copy.

    The owner keeps the transfers it submits in one queue (``_held``) and hands them to the
    workers at :meth:`flush`, as batches (a batch's stores, then its loads: with ``num_workers=1``
    the stores of a flush are copied before its loads, and flushes in order while the owner does not
    copy beside the workers; an owner that helps them, :meth:`help_one`, copies one batch while a worker
    copies the next, and what it leaves of a batch goes back with its next flush's transfers: the
    managers keep a row's store and a load into it apart by its fence), with two reasons to keep them:

    * ``batch_max`` > 1: the queue goes to the workers at :meth:`flush` (the manager's
      ``poll()``/``wait()``) or once ``batch_max`` are queued.  An engine step's ``store()``
      calls then wake no worker, and its copies are made together, during the step's forward pass,
      instead of competing with the engine thread for the GIL and the cores while it makes them.
      ``1``: each transfer goes to the workers in its ``submit``.
    * :meth:`hold`: while the owner blocks, what it submits stays with it for :meth:`help_one`
      and :meth:`flush` keeps it; what was queued before goes to the workers when the hold
      starts, what is left when it ends.
    """

    polled = False

    def __init__(self, planes: Sequence[Plane], completions: CompletionQueue, num_workers: int = 2,
                 copy_fn: Optional[CopyFn] = None, batch_max: int = 1,
                 batch_fn: Optional[BatchFn] = None, catch_up_s: Optional[float] = None) -> None:
        if batch_max < 1:
            raise ValueError(f"batch_max must be >= 1, got {batch_max}")
        self._planes, self._block_bytes = check_planes(planes)
        # what a copy row by row copies: each plane's rows as bytes, so that no dtype conversion can change them
        self._row_planes = [byte_rows(dev, host) for dev, host in self._planes]
        self._batch_max = batch_max
        self._fast = fast_planes(self._planes) if copy_fn is None else None
        self._wide = wide_planes(self._planes) if copy_fn is None or batch_fn is not None else None
        self._batch_fn: BatchFn = batch_fn or batch_copy
        # bounds of rows and slots valid in every plane: never copy out of bounds
        self._nrows, self._nslots = rows_in_range(self._planes)
        self._out = completions
        self._q: queue.SimpleQueue[Optional[list[Transfer]]] = queue.SimpleQueue()
        self._copy = copy_fn or _copy
        self._closed = False
        self._ended = False   # the interpreter's exit stopped the workers (_end)
        self._stranded = False   # a dead worker could not be replaced: the owner copies (flush)
        self.helped = 0  # transfers run by the owner in help_one()
        self.batches = 0  # batched copies made (one per direction of a batch)
        self.caught_up = 0   # help_one() calls a flush made for batches the workers had not taken (see flush)
        self._put_at: collections.deque[float] = collections.deque(maxlen=1024)   # when each batch was queued
        self._catch_up_s = catch_up_s
        self._holding = False
        # owner thread only: submitted, not yet given to the workers (batched, or held: see hold())
        self._held: collections.deque[Transfer] = collections.deque()
        # owner thread only: the rest of a batch it took from the workers' queue (help_one) and copies in parts:
        # older than anything held, so copied first; with no worker, never queued again (flushes stay in order)
        self._taken: collections.deque[Transfer] = collections.deque()
        self._local = threading.local()   # per thread: its staging buffer
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        for _ in range(num_workers):
            self._spawn()

    def _spawn(self) -> None:
        _close_at_exit(self)
        t = threading.Thread(target=self._run, name="tiered-kv-copy", daemon=True)
        with self._lock:   # listed before it starts: a close() from now on stops and joins it
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
        try:
            t.start()
        except Exception:   # "can't start new thread", a MemoryError (raised before any thread exists): not a
            with self._lock:   # worker, nothing for close() to join (an interrupt in start()'s wait: it may run)
                self._threads = [x for x in self._threads if x is not t]
            raise

    def submit(self, t: Transfer) -> None:
        if self._batch_max == 1 and not self._holding:
            # (Transfer.taken: queue.Queue.put is Python code, so an interrupt inside it before its append would
            # leave the transfer marked and not queued -- unanswered, never answered twice)
            t.taken = True
            self._q.put([t])
            self._put_at.append(time.monotonic())
            return
        held = self._held
        t.taken = True   # no call between this and the append (Transfer.taken)
        held.append(t)
        if len(held) >= self._batch_max:
            self.flush()  # keeps them while the owner holds them

    def flush(self) -> None:
        """Owner thread only: give the queued transfers to the workers as batches (stores, then loads,
        each in submission order), unless the owner holds them (:meth:`hold`).

        With ``catch_up_s`` (the managers' movers: :data:`CATCH_UP_S`), batches given to the workers
        at least that long ago that none has taken yet are copied here, on the calling thread, oldest
        first (``caught_up`` counts the calls): the workers are starved of the GIL by an owner busy in
        Python, which gives it up only when the interpreter forces a switch (every 5 ms).  Left to them, their backlog would grow step after
        step until stores are shed for want of a free slot and loads find their keys not stored yet;
        copied here, it stays within a few steps.  Workers that keep up (an owner that sleeps or waits
        on a device between steps) take a batch long before, and nothing is copied here."""
        if self._holding:
            return
        if self._taken:   # the rest of a batch the owner began (a wait that ended, an interrupt): older than anything
            if self._ended or self._stranded:   # no worker: copied here before anything else (flushes stay in order)
                while self._taken and self._help():
                    pass
            else:   # the workers copy it, with what goes now (not on the engine thread, past a wait's deadline);
                # each moved in C, with no comparison (Python code) between a pop and its add: none lost or doubled
                self._held.extendleft(map(collections.deque.pop, itertools.repeat(self._taken, len(self._taken))))
        behind = self._behind()
        if self._held:
            held, self._held = self._held, collections.deque()
            queued: list[None] = []
            batches: Optional[list[list[Transfer]]] = None
            try:
                batches = split_batches(held, self._block_bytes, BATCH_BYTES)
                now = time.monotonic()
                # every put and its record in C, no bytecode between them for an interrupt to land on: after
                # one, ``queued`` says exactly which batches the workers have (and will answer)
                collections.deque(map(queued.append, map(self._q.put, batches)), maxlen=0)
            except BaseException:
                # an interrupt: what is not queued goes back to the front of the held transfers, for the next
                # flush (never lost, never queued twice)
                rest = list(held) if batches is None else [t for b in batches[len(queued):] for t in b]
                self._held.extendleft(reversed(rest))
                raise
            self._put_at.extend([now] * len(queued))
        while behind > 0 or self._taken:   # help_one takes the oldest queued batch (part of it: the rest is taken)
            if not self._taken:
                behind -= 1
            if not self.help_one():
                break
            self.caught_up += 1
        if self._ended or self._stranded:   # no worker since the exit stop, or one could not be replaced: the
            self._copy_here()                # owner copies

    def _behind(self) -> int:
        """How many of the batches the workers have not taken were given to them at least ``catch_up_s``
        ago: all those left but the ones put since (the queue is FIFO, the stamps in put order; a
        backlog longer than the stamps kept is old); 0 without ``catch_up_s``."""
        if self._catch_up_s is None:
            return 0
        k = self._q.qsize()
        if not k:
            return 0
        stamps = self._put_at
        limit = time.monotonic() - self._catch_up_s
        young = 0
        for i in range(len(stamps) - 1, -1, -1):
            if stamps[i] <= limit:
                break
            young += 1
        return max(0, k - young)

    def hold(self, on: bool) -> None:
        """Owner thread only.  While on, transfers submitted stay with the owner for :meth:`help_one`
        instead of waking a worker; turning it on first hands the ones queued before to the
        workers, turning it off hands what is left to them."""
        self._holding = False
        self.flush()   # on: what was queued before goes now; off: what is left goes
        self._holding = on

    def help_one(self) -> bool:
        """Copy one batch on the calling thread: the rest of a queued batch it took before, then held transfers
        (see :meth:`hold`), then a batch queued for the workers (up to :data:`HELP_BYTES`, at least one
        transfer); False when there is none.

        The owner calls it while it blocks in ``wait()``: instead of sleeping until a worker wakes
        up for the copy (and then waking up itself for the report, a thread hand-off per copy that
        costs more than the copy on a small VM), it makes the copy.  Each transfer is answered
        exactly once either way: an exception that escapes the copy (not an ``Exception``, which
        is reported as a failed copy) answers the batch's unanswered transfers before it propagates.
        """
        if self._closed:
            return False
        return self._help()

    def _help(self) -> bool:
        """:meth:`help_one`'s copy, also once closed (``close()`` copying what no worker is left to copy): the
        rest of a batch taken before, else transfers held, else a batch taken from the queue."""
        held = self._taken or self._held
        if not held:
            held = self._taken
            try:
                # from the workers' queue into ``_taken`` by C calls alone: no bytecode runs between the
                # take and the append, so an exception raised by a signal handler (run by CPython only
                # between bytecodes) cannot fall between them and lose the batch
                held.extend(itertools.chain.from_iterable(itertools.islice(iter(self._q.get_nowait, None), 1)))
            except queue.Empty:
                return False
            if not held:  # that was a worker's stop sentinel: close() is under way, leave it to the workers
                self._q.put(None)
                return False
        batch: list[Transfer] = []
        answered = 0
        put = self._out.put
        try:
            nbytes, block = 0, self._block_bytes
            while held and (not batch or nbytes < HELP_BYTES):
                t = held[0]
                batch.append(t)   # in the batch before it leaves the queue: the except below answers for it
                held.popleft()
                nbytes += rows_len(t) * block
            for report in self._do_batch(batch):
                put(report)
                answered += 1
            self.helped += len(batch)
        except BaseException as exc:
            for t in batch[answered:]:
                if held and held[0] is t:   # interrupted before it was taken: no worker may copy it later
                    held.popleft()
                # answered failed; if the real report was put just before the interrupt, this second one
                # finds no live token and is discarded (counted as unknown_token): never lost, never applied twice
                put(Report(t.token, t.kind, False, f"copy interrupted: {exc!r}"))
            raise
        return True

    def _run(self) -> None:
        current: Optional[list[Transfer]] = None
        answered = 0
        try:
            while True:
                answered = 0   # before the take: the except below must never count the last batch's answers
                current = self._q.get()
                if current is None:
                    return
                put = self._out.put
                for report in self._do_batch(current):
                    put(report)
                    answered += 1
                current = None
        except BaseException as exc:  # the thread is dying: replaced, then it answers for what it held
            log.error("copy worker died: %r", exc)
            # replaced also while close() runs: the batches queued behind this one need a worker, and
            # close() joins the replacement too (it returns only once no worker is left)
            try:
                self._spawn()
            except Exception:   # no thread to be had: the owner copies in each flush from now on, and close()
                self._stranded = True   # copies what is left
                raise
            finally:   # after the mark: an owner woken by these answers finds the mover stranded when it is
                for t in (current or [])[answered:]:
                    self._out.put(Report(t.token, t.kind, False, f"worker died: {exc!r}"))
            if not isinstance(exc, Exception):
                raise

    # ------------------------------------------------------------------ copies
    def _do_batch(self, ts: list[Transfer]) -> list[Report]:
        """Copy a batch; its reports, one per transfer, in the batch's order."""
        out: list[Optional[Report]] = [None] * len(ts)
        if self._wide is None or (len(ts) == 1 and rows_len(ts[0]) <= FEW_ROWS):
            return [self._do(t) for t in ts]
        stores: list[int] = []
        loads: list[int] = []
        for i, (t, report) in enumerate(screen(ts, self._nrows, self._nslots)):
            if report is not None:
                out[i] = report
            else:
                (stores if t.kind is _STORE else loads).append(i)
        if stores:
            self._copy_batch(ts, stores, True, out)
        if loads:
            self._copy_batch(ts, loads, False, out)
        return out  # type: ignore[return-value]  # every slot was filled

    def _copy_batch(self, ts: list[Transfer], idx: list[int], store: bool, out: list[Optional[Report]]) -> None:
        rows: list[int] = []
        slots: list[int] = []
        for i in idx:
            rows += ts[i].rows
            slots += ts[i].slots
        wide = self._wide
        assert wide is not None
        t0 = time.perf_counter()
        try:
            fn = self._batch_fn
            for p, (dev, host) in enumerate(wide):
                stage = self._stage(p, dev)
                if store:
                    fn(host, slots, dev, rows, stage)
                else:
                    fn(dev, rows, host, slots, stage)
        except Exception as exc:   # copy each again on its own: each transfer answered by its own outcome
            log.warning("a batched copy of %d transfers failed (%r); copying them one by one", len(idx), exc)
            for i in idx:
                out[i] = self._do(ts[i])
            return
        self.batches += 1
        per_row = (time.perf_counter() - t0) / len(rows)
        block = self._block_bytes
        for i in idx:
            t = ts[i]
            m = len(t.rows)
            out[i] = Report(t.token, t.kind, True, None, m * block, m * per_row)

    def _stage(self, plane: int, like: torch.Tensor) -> torch.Tensor:
        """This thread's staging rows for ``plane`` (views of one buffer of :data:`STAGE_BYTES`)."""
        local = self._local
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = torch.empty(STAGE_BYTES, dtype=torch.uint8)
            local.views = {}
        v = local.views.get(plane)
        if v is None:
            width = int(like.shape[1])
            k = STAGE_BYTES // (width * like.element_size())
            v = local.views[plane] = buf[:k * width * like.element_size()].view(like.dtype).view(k, width)
        return v

    def _do(self, t: Transfer) -> Report:
        """Copy one transfer row by row."""
        return copy_one(t, self._nrows, self._nslots, self._block_bytes,
                        self._memmove if self._fast is not None else self._copy_rows)

    def _memmove(self, t: Transfer) -> None:
        assert self._fast is not None
        memmove_rows(self._fast, t)

    def _copy_rows(self, t: Transfer) -> None:
        copy, planes, store = self._copy, self._row_planes, t.kind is _STORE
        for r, s in zip(t.rows, t.slots, strict=True):
            for dev, host in planes:
                if store:
                    copy(host[s], dev[r])
                else:
                    copy(dev[r], host[s])

    def _end(self, deadline: float) -> None:
        """At the interpreter's exit, for a mover whose workers are still alive: they stop once the batches queued
        before are copied, waited for until ``deadline`` at most (a copy hung on the way is left: no exit hangs
        for it; each is still sent its stop when the deadline has passed, and stops after its copy).  A mover
        left open stays open: what is submitted later (an exit handler that runs after this one) is copied by the
        owner, in ``flush()`` and so in every ``poll()``/``wait()``/``finished()``, and in :meth:`close`.  A
        ``close()`` under way on another thread, or broken off in its join (Ctrl-C), put its stops already but
        its workers may still copy: they are waited for here too."""
        if self._ended:
            return
        if not self._closed:
            self._ended = True
        joined: set[threading.Thread] = set()
        while True:   # as close() does: a worker replaced on the way is stopped next round
            with self._lock:
                threads = [t for t in self._threads if t.is_alive() and t not in joined]
            if not threads:
                return
            for _ in threads:
                self._q.put(None)
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            joined.update(threads)
            if time.monotonic() >= deadline:
                return

    def _copy_here(self, help: Optional[Callable[[], bool]] = None) -> None:
        """No worker takes from the queue (after the exit stop, :meth:`_end`; one that could not be replaced;
        ``close()`` once its workers ended): what is queued is copied on the calling thread by ``help``
        (:meth:`help_one` unless given), a batch at a time in the order queued (so one flush's stores never pass
        an earlier flush's loads).  A stop sentinel met on the way goes back to the queue's end, where a worker
        still stopping takes it: so each is passed at most once, and the loop ends."""
        help = self.help_one if help is None else help
        for _ in range(self._q.qsize() + 1):
            while help():
                pass
            if not self._q.qsize():
                return

    def close(self) -> None:
        self._holding = False
        self.flush()  # queued transfers are copied (or answered as cancelled) ahead of the stop sentinels
        self._closed = True
        # one stop sentinel per worker, behind every batch; a worker that dies on the way is replaced
        # (see _run), and the replacement is stopped and joined in the next round
        joined: set[threading.Thread] = set()
        while True:
            with self._lock:
                threads = [t for t in self._threads if t not in joined]
            if not threads:
                break
            for _ in threads:
                self._q.put(None)
            for t in threads:
                t.join()
            joined.update(threads)
        # no worker is left: what none took (none since the exit stop, or the last died and could not be replaced)
        # is copied here, in the order queued; the stop sentinels left stay in the queue, unread
        self._copy_here(self._help)
