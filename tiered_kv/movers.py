"""Movers: the parts that copy bytes.  They never touch the manager's maps.

A mover receives :class:`Transfer` messages ``(token, what to move)`` from the
owner thread and answers each with exactly one :class:`Report`
``(token, outcome)`` on the shared :class:`CompletionQueue`.  The owner applies
reports in ``poll()``.

* :class:`ThreadMover` -- worker threads copying rows with ``memmove`` (through
  ctypes, which releases the GIL; ``Tensor.copy_`` of a 256 KiB row costs
  about twice as much, its intra-op threads fighting the workers for the
  cores).  Used without CUDA.  A worker that dies is replaced and its
  in-hand transfer is reported failed, so every transfer is answered.
* :class:`CudaMover` -- a pool of CUDA copy streams with events.  Transfers
  are queued by ``submit`` and put on the device in batches by ``harvest()``
  (or when ``batch_max`` are queued), each batch ordered after the work
  already queued on the engine's compute stream; finished transfers are found
  by querying events in ``harvest()``, never by a blocking synchronize on the
  engine thread.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import logging
import queue
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol

import torch

from .jobs import JobKind

__all__ = ["Transfer", "Report", "CompletionQueue", "Mover", "ThreadMover", "CudaMover", "TorchCuda", "make_mover"]

log = logging.getLogger(__name__)


_STORE = JobKind.STORE  # a module constant: cheaper than the class attribute, on every copy


@dataclass(slots=True)
class Transfer:
    """One copy between a device row and a host slot.  ``cancelled`` is a hint
    the owner may set so that a worker that has not started skips the copy."""

    token: uuid.UUID
    kind: JobKind  # STORE: device row -> host slot; LOAD: host slot -> device row
    row: int
    slot: int
    cancelled: bool = False


@dataclass(slots=True)
class Report:
    """A worker's answer for one token."""

    token: uuid.UUID
    kind: JobKind
    ok: bool
    error: Optional[str] = None
    nbytes: int = 0
    seconds: float = 0.0
    copied: bool = True  # False when the worker skipped the copy


class CompletionQueue:
    """Multi-producer, single-consumer queue of reports (movers -> owner)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def put(self, item: Any) -> None:
        self._q.put(item)

    def drain(self) -> list[Any]:
        """Every report queued so far (one consumer: ``qsize()`` items are there to take)."""
        q = self._q
        n = q.qsize()
        if not n:
            return []
        get = q.get_nowait
        return [get() for _ in range(n)]

    def get(self, timeout: Optional[float]) -> Optional[Any]:
        try:
            return self._q.get(timeout=timeout) if timeout is None or timeout > 0 else self._q.get_nowait()
        except queue.Empty:
            return None


class Mover(Protocol):
    """What the manager needs of a mover.

    A mover may also define ``help_one() -> bool``: run one queued transfer on
    the calling (owner) thread and answer it like any other, False when none
    is queued.  The manager calls it while it blocks in ``wait()``/``flush()``/
    ``close()`` (see :meth:`ThreadMover.help_one`).  With it, ``hold(on)``:
    while on, transfers submitted are left for ``help_one`` (no worker is
    woken); off, the ones left go to the workers.  The manager turns it on for
    as long as it blocks, and off in a ``finally``.  A mover that queues what
    ``submit`` gets (``CudaMover``, ``ThreadMover`` with ``batch_max`` > 1)
    defines ``flush()``: start the transfers queued; the manager calls it at the
    end of every poll, so that a step's copies start at its ``poll()`` (and
    those submitted while reports were applied start in the same poll).
    """

    polled: bool  # True when reports appear only through harvest()

    def submit(self, t: Transfer) -> None: ...
    def harvest(self) -> None: ...
    def close(self) -> None: ...


CopyFn = Callable[[torch.Tensor, torch.Tensor], None]


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def _copy_non_blocking(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


def _row_addresses(rows: torch.Tensor) -> tuple[int, int]:
    """(address of row 0, bytes between rows) of a CPU tensor whose rows are contiguous."""
    return rows.data_ptr(), rows.stride(0) * rows.element_size()


class ThreadMover:
    """Copies on worker threads; reports through ``completions``.

    ``copy_fn(dst_row, src_row)`` replaces the copy (tests inject torn or
    failing copies); by default rows are copied with ``memmove`` between
    their addresses, computed once from the tensors' strides.

    The owner keeps the transfers it submits in one queue (``_held``) and hands
    them to the workers at :meth:`flush`, with two reasons to keep them:

    * ``batch_max`` > 1: the queue goes to the workers at :meth:`flush` (the
      manager's ``poll()``/``wait()``) or once ``batch_max`` are queued.  An
      engine step's ``store()`` calls then wake no worker: the copies run during
      the step's forward pass instead of competing with the engine thread for
      the GIL and the cores while it makes them.  ``1``: each transfer goes to
      the workers in its ``submit``.
    * :meth:`hold`: while the owner blocks, what it submits stays with it for
      :meth:`help_one` and :meth:`flush` keeps it; what was queued before goes
      to the workers when the hold starts, what is left when it ends.
    """

    polled = False

    def __init__(self, device_rows: torch.Tensor, host_rows: torch.Tensor, completions: CompletionQueue,
                 num_workers: int = 2, copy_fn: Optional[CopyFn] = None,
                 on_worker_death: Optional[Callable[[], None]] = None, batch_max: int = 1) -> None:
        if batch_max < 1:
            raise ValueError(f"batch_max must be >= 1, got {batch_max}")
        self._batch_max = batch_max
        self._dev = device_rows
        self._host = host_rows
        self._row_bytes = int(host_rows.shape[1])
        if copy_fn is None and not device_rows.is_cuda and not host_rows.is_cuda \
                and device_rows[0].is_contiguous() and host_rows[0].is_contiguous() \
                and device_rows[0].numel() * device_rows.element_size() == self._row_bytes * host_rows.element_size():
            self._dev_at = _row_addresses(device_rows)
            self._host_at = _row_addresses(host_rows)
            self._nbytes = self._row_bytes * host_rows.element_size()
            self._rows, self._slots = int(device_rows.shape[0]), int(host_rows.shape[0])
            self._fast = True
        else:
            self._fast = False
        copy_fn = copy_fn or _copy
        self._out = completions
        self._q: queue.SimpleQueue[Optional[Transfer]] = queue.SimpleQueue()
        self._copy = copy_fn
        self._on_death = on_worker_death
        self._closed = False
        self.helped = 0  # transfers run by the owner in help_one()
        self._holding = False
        # owner thread only: submitted, not yet given to the workers (batched, or held: see hold())
        self._held: collections.deque[Transfer] = collections.deque()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        for _ in range(num_workers):
            self._spawn()

    def _spawn(self) -> None:
        t = threading.Thread(target=self._run, name="tiered-kv-copy", daemon=True)
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def submit(self, t: Transfer) -> None:
        if self._batch_max == 1 and not self._holding:
            self._q.put(t)
            return
        held = self._held
        held.append(t)
        if len(held) >= self._batch_max:
            self.flush()  # keeps them while the owner holds them

    def flush(self) -> None:
        """Owner thread only: give the queued transfers to the workers (in submission order), unless
        the owner holds them (:meth:`hold`)."""
        if self._held and not self._holding:
            held, self._held = self._held, collections.deque()
            put = self._q.put
            for t in held:
                put(t)

    def hold(self, on: bool) -> None:
        """Owner thread only.  While on, transfers submitted stay with the owner for :meth:`help_one`
        instead of waking a worker; turning it on first hands the ones queued before to the
        workers, turning it off hands what is left to them."""
        self._holding = False
        self.flush()   # on: what was queued before goes now; off: what is left goes
        self._holding = on

    def harvest(self) -> None:
        return None

    def help_one(self) -> bool:
        """Run one transfer on the calling thread, a held one (see :meth:`hold`) before one queued for the
        workers; False when there is none.

        The owner calls it while it blocks in ``wait()``: instead of sleeping
        until a worker wakes up for the copy (and then waking up itself for the
        report, a thread hand-off per copy that costs more than a 256 KiB copy on
        a small VM), it makes the copy.  The transfer is answered exactly once
        either way: an exception that escapes the copy (not an ``Exception``,
        which ``_do`` reports as a failed copy) is answered before it propagates.
        """
        if self._closed:
            return False
        held = self._held
        if not held:
            try:
                # from the workers' queue into ``held`` by C calls alone: no bytecode runs between the
                # take and the append, so an exception raised by a signal handler (run by CPython only
                # between bytecodes) cannot fall between them and lose the transfer
                held.extend(itertools.islice(iter(self._q.get_nowait, None), 1))
            except queue.Empty:
                return False
            if not held:  # that was a worker's stop sentinel: close() is under way, leave it to the workers
                self._q.put(None)
                return False
        t = held[0]  # bound before it leaves the queue: from here on the except below answers for it
        try:
            held.popleft()
            report = self._do(t)
            self.helped += 1
            self._out.put(report)
        except BaseException as exc:
            if held and held[0] is t:   # interrupted before it was taken: no worker may copy it later
                held.popleft()
            # answered failed; if the real report was put just before the interrupt, this second one
            # finds no live token and is discarded (counted as unknown_token): never lost, never applied twice
            self._out.put(Report(t.token, t.kind, False, f"copy interrupted: {exc!r}", copied=True))
            raise
        return True

    def _run(self) -> None:
        current: Optional[Transfer] = None
        try:
            while True:
                current = self._q.get()
                if current is None:
                    return
                self._out.put(self._do(current))
                current = None
        except BaseException as exc:  # the thread is dying: answer for what it held, then replace it
            log.error("copy worker died: %r", exc)
            if current is not None:
                self._out.put(Report(current.token, current.kind, False, f"worker died: {exc!r}", copied=True))
            if self._on_death is not None:
                self._on_death()
            if not self._closed:
                self._spawn()
            if not isinstance(exc, Exception):
                raise

    def _do(self, t: Transfer) -> Report:
        if t.cancelled:
            return Report(t.token, t.kind, False, "cancelled before copy", copied=False)
        t0 = time.perf_counter()
        try:
            if self._fast:
                if not (0 <= t.row < self._rows and 0 <= t.slot < self._slots):  # never memmove out of bounds
                    raise IndexError(f"row {t.row} / slot {t.slot} out of range ({self._rows} rows, {self._slots} slots)")
                (d0, ds), (h0, hs) = self._dev_at, self._host_at
                if t.kind is _STORE:
                    ctypes.memmove(h0 + t.slot * hs, d0 + t.row * ds, self._nbytes)
                else:
                    ctypes.memmove(d0 + t.row * ds, h0 + t.slot * hs, self._nbytes)
            elif t.kind is _STORE:
                self._copy(self._host[t.slot], self._dev[t.row])
            else:
                self._copy(self._dev[t.row], self._host[t.slot])
        except Exception as exc:
            return Report(t.token, t.kind, False, f"copy failed: {exc!r}", seconds=time.perf_counter() - t0)
        return Report(t.token, t.kind, True, None, self._row_bytes, time.perf_counter() - t0)

    def close(self) -> None:
        self._holding = False
        self.flush()  # queued transfers are copied (or answered as cancelled) ahead of the stop sentinels
        self._closed = True
        with self._lock:
            threads = list(self._threads)
        for _ in threads:
            self._q.put(None)
        for t in threads:
            t.join()


class TorchCuda:  # pragma: no cover - needs CUDA (tests/test_cuda.py)
    """The CUDA calls :class:`CudaMover` makes, through torch.

    The mover goes through an object with these methods (``synchronize`` is
    for the benchmarks only), so that a simulated device
    (``tests/fake_cuda.py``: streams as queues of operations that run when and
    in the order a test says) can stand in for the GPU and the mover's own
    logic is tested without one.  A stream needs
    ``wait_stream(other)`` and ``synchronize()``; an event ``record(stream)``,
    ``query()`` and ``elapsed_time(end)`` (ms).
    """

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def new_event(self) -> Any:
        return torch.cuda.Event(enable_timing=True)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    @contextlib.contextmanager
    def copies_on(self, stream: Any) -> Iterator[Callable[[torch.Tensor, torch.Tensor], None]]:
        """``stream`` made current once for a batch of copies; yields ``copy(dst, src)``."""
        with torch.cuda.stream(stream):
            yield _copy_non_blocking

    def synchronize(self, device: torch.device) -> None:
        """Not used by the mover (it never blocks); the benchmarks' baseline needs it."""
        torch.cuda.synchronize(device)


EVENT_BYTES = 2 << 20
"""``CudaMover``: copies of a batch share an end event per this many bytes (at least one copy each).  Each
event costs a record, a query and a timing read on the engine thread -- several microseconds apiece on
some hosts, as much as a 256 KiB copy's own call -- while 2 MiB is ~40 us of a PCIe 5 link: finer
completion than that buys nothing."""


class CudaMover:
    """Copies on a pool of CUDA streams, queued in batches; ``harvest()`` queries end events in order.

    ``submit`` only queues the transfer (no CUDA call: on the engine thread a
    driver call costs tens of microseconds on some hosts).  The queue goes to
    the device at the next ``harvest()`` -- the manager's ``poll()`` and
    ``wait()`` -- or at once when ``batch_max`` transfers are queued
    (``batch_max=1``: each transfer at its own ``submit``).  A transfer
    cancelled while queued is answered without a copy.

    A batch is ordered once, at the flush, behind everything already queued on
    the engine's current stream, in both directions: a store's source row may
    still be written by that work, and a load's destination row may still be
    read by kernels queued before the engine gave the row up (write after
    read).  Work the engine queues after ``submit`` and before the flush is
    waited for too; by the protocol it cannot touch a row with a transfer in
    flight (a store's row is released by ``free_block``, which discards the
    store; a load's row is fenced).  Stores and loads of a batch go to
    different streams (the two directions of the link run at once).  Copies
    are followed by an end event every ``event_bytes`` (at least one copy; a
    copy of 2 MiB or more gets its own), timed from the event before it in the
    batch, so the copies between two events are reported together; events
    are recycled once their copies are reported.  Nothing
    here blocks the calling thread.  A copy that cannot be queued (a CUDA
    error) or whose event reports an error is answered as failed, never raised.
    ``runtime``: the CUDA calls (:class:`TorchCuda` by default; tests pass a
    simulated device).
    """

    polled = True

    def __init__(self, device_rows: torch.Tensor, host_rows: torch.Tensor, completions: CompletionQueue,
                 num_streams: int = 2, runtime: Optional[Any] = None, batch_max: int = 64,
                 event_bytes: int = EVENT_BYTES) -> None:
        if batch_max < 1:
            raise ValueError(f"batch_max must be >= 1, got {batch_max!r}")
        if event_bytes < 1:
            raise ValueError(f"event_bytes must be >= 1, got {event_bytes!r}")
        rt = runtime if runtime is not None else TorchCuda()
        self._dev = device_rows
        self._host = host_rows
        self._row_bytes = int(host_rows.shape[1])
        self._out = completions
        self._device = device_rows.device
        self._new_event = rt.new_event
        self._current = rt.current_stream
        self._copies_on = rt.copies_on
        self._streams = [rt.new_stream(self._device) for _ in range(num_streams)]
        # per stream, in queue order: (transfers, the event before their copies, their end event, that end event
        # is the last of its batch) -- one end event per ``event_bytes`` of copies
        self._pending: list[deque[tuple[list[Transfer], Any, Any, bool]]] = [deque() for _ in self._streams]
        self._per_event = max(1, -(-event_bytes // max(1, self._row_bytes)))
        self._queued: list[Transfer] = []  # submitted, not yet on the device
        self._batch_max = batch_max
        self._events: list[Any] = []  # recycled timing events
        self._next = 0

    def submit(self, t: Transfer) -> None:
        q = self._queued
        q.append(t)
        if len(q) >= self._batch_max:
            self.flush()

    def flush(self) -> None:
        """Put the queued transfers on the device (stores on one stream, loads on the next)."""
        batch = self._queued
        if not batch:
            return
        self._queued = []
        stores: list[Transfer] = []
        loads: list[Transfer] = []
        put = self._out.put
        for t in batch:
            if t.cancelled:
                put(Report(t.token, t.kind, False, "cancelled before copy", copied=False))
            elif t.kind is _STORE:
                stores.append(t)
            else:
                loads.append(t)
        if stores:
            self._queue_on_stream(stores, True)
        if loads:
            self._queue_on_stream(loads, False)

    def _queue_on_stream(self, ts: list[Transfer], store: bool) -> None:
        i = self._next
        self._next = (i + 1) % len(self._streams)
        stream = self._streams[i]
        pend = self._pending[i]
        ev = self._events
        dev, host = self._dev, self._host
        prev = ev.pop() if ev else self._new_event()
        put = self._out.put
        try:
            stream.wait_stream(self._current(self._device))
            prev.record(stream)
        except Exception as exc:  # a broken context: nothing of this batch reached the stream
            ev.append(prev)
            log.error("CUDA copies of a batch of %d could not be queued: %r", len(ts), exc)
            for t in ts:
                put(Report(t.token, t.kind, False, f"copy failed: {exc!r}"))
            return
        per_event = self._per_event
        last: Optional[tuple[list[Transfer], Any, Any, bool]] = None
        chunk: list[Transfer] = []  # copies queued since the last end event
        n = 0  # transfers of ts answered or on the stream

        def end_chunk() -> None:  # an end event after the chunk's copies: they are reported when it is reached
            nonlocal last, prev, chunk
            end = ev.pop() if ev else self._new_event()
            end.record(stream)
            if last is not None:
                pend.append(last)
            last = (chunk, prev, end, False)
            prev, chunk = end, []

        try:
            with self._copies_on(stream) as copy:
                for t in ts:
                    n += 1
                    try:
                        if store:
                            copy(host[t.slot], dev[t.row])
                        else:
                            copy(dev[t.row], host[t.slot])
                    except Exception as exc:  # this copy did not reach the stream: answer it, go on
                        log.error("CUDA copy of %s row %d / slot %d could not be queued: %r",
                                  t.kind, t.row, t.slot, exc)
                        put(Report(t.token, t.kind, False, f"copy failed: {exc!r}"))
                        continue
                    chunk.append(t)
                    if len(chunk) >= per_event:
                        end_chunk()
                if chunk:  # the last, partial chunk
                    end_chunk()
        except Exception as exc:  # the stream switch or an event record failed: answer what has no event yet
            log.error("CUDA copies of a batch of %d could not all be queued: %r", len(ts), exc)
            if chunk:
                # these copies are on the stream with no end event behind them: answering them now
                # would lift their row's fence or free their slot while a copy can still land there.
                # Wait for the stream first (a fault path, the only one where the engine thread
                # waits on the device); with a broken context that fails too, and nothing queued runs
                try:
                    stream.synchronize()
                except Exception as sexc:
                    log.error("CUDA copy stream could not be synchronized after a failed record: %r", sexc)
            for t in chunk + ts[n:]:
                put(Report(t.token, t.kind, False, f"copy failed: {exc!r}"))
        if last is None:
            ev.append(prev)  # no copy queued: its start event is free again (only its latest record counts)
        else:
            pend.append((last[0], last[1], last[2], True))

    def harvest(self) -> None:
        if self._queued:
            self.flush()
        put, free, nbytes = self._out.put, self._events, self._row_bytes
        for pend in self._pending:
            while pend:
                ts, start, end, final = pend[0]
                try:
                    if not end.query():
                        break
                    seconds = start.elapsed_time(end) / 1e3 / len(ts)
                except Exception as exc:  # a CUDA error surfaced by the query: these copies are lost
                    pend.popleft()
                    free.append(start)  # an errored context fails whatever comes next anyway
                    if final:
                        free.append(end)
                    log.error("CUDA copies of %d %s row(s) from row %d failed: %r", len(ts), ts[0].kind, ts[0].row, exc)
                    for t in ts:
                        put(Report(t.token, t.kind, False, f"copy failed: {exc!r}"))
                    continue
                pend.popleft()
                free.append(start)  # the batch's start event, or the previous chunk's end: no longer read
                if final:
                    free.append(end)
                for t in ts:
                    put(Report(t.token, t.kind, True, None, nbytes, seconds))

    def in_flight(self) -> int:
        """Transfers submitted and not yet reported by ``harvest()`` (queued or on the device)."""
        return len(self._queued) + sum(len(g[0]) for p in self._pending for g in p)

    def close(self) -> None:
        self.flush()
        for s in self._streams:
            try:
                s.synchronize()
            except Exception as exc:  # a broken context: harvest() answers what is left as failed
                log.error("CUDA copy stream could not be synchronized at close: %r", exc)
        self.harvest()


def make_mover(device_rows: torch.Tensor, host_rows: torch.Tensor, completions: CompletionQueue,
               num_workers: int, num_streams: int, batch_max: int) -> Mover:
    if device_rows.is_cuda:  # pragma: no cover - needs CUDA
        return CudaMover(device_rows, host_rows, completions, num_streams, batch_max=batch_max)
    return ThreadMover(device_rows, host_rows, completions, num_workers, batch_max=batch_max)
