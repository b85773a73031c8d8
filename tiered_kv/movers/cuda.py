"""CudaMover: copies on a pool of CUDA streams, finished transfers found by querying events.

Transfers are queued by ``submit`` and put on the device in batches by ``flush()``/``harvest()``
(or when ``batch_max`` are queued), each batch ordered after the work already queued on the
engine's compute stream; finished transfers are found by querying end events in ``harvest()``,
never by a blocking synchronize on the engine thread.  All CUDA calls go through a runtime object
(:class:`TorchCuda`; tests pass the simulated device of ``tests/fake_cuda.py``).
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any, Callable, Iterator, Optional

import torch

from ..jobs import JobKind
from .base import CompletionQueue, Mover, Plane, Report, Transfer, check_planes

__all__ = ["CudaMover", "TorchCuda", "EVENT_BYTES"]

log = logging.getLogger(__name__)

_STORE = JobKind.STORE


def _copy_non_blocking(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


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
"""``CudaMover``: block copies of a batch share an end event per this many bytes (at least one copy each).
Each event costs a record, a query and a timing read on the engine thread -- on some hosts as much as a
block's own copy call -- while a link moves this much in a fraction of an engine step: finer completion
than that buys nothing."""


class _Chunk:
    """The copies queued between two events of one stream: reported when ``end`` is reached.

    ``ended``: the transfers whose last copy is in this chunk (one that spans chunks is reported with
    the last); ``failed``: transfers with copies on the stream, one of which could not be queued
    (answered failed here, once their queued copies can no longer land)."""

    __slots__ = ("ended", "failed", "copies", "start", "end", "final")

    def __init__(self, start: Any) -> None:
        self.ended: list[Transfer] = []
        self.failed: list[tuple[Transfer, str]] = []
        self.copies = 0   # block copies (each over every plane)
        self.start = start
        self.end: Any = None
        self.final = False  # the last chunk of its batch: its end event is no later chunk's start

    def __len__(self) -> int:
        return len(self.ended) + len(self.failed)


class CudaMover(Mover):
    """Copies on a pool of CUDA streams, queued in batches; ``harvest()`` queries end events in order.

    ``submit`` only queues the transfer (no CUDA call: on the engine thread a
    driver call costs tens of microseconds on some hosts).  The queue goes to
    the device at the next ``flush()``/``harvest()`` -- the manager's ``poll()`` and
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
    different streams (the two directions of the link run at once; with one
    stream, everything runs in submission order of the flushes).

    A transfer's block copies (each over every plane) are followed by an end
    event every ``event_bytes`` (at least one block copy; a block of that size
    or more gets its own), timed from the event before it; a transfer is
    reported once, when the end event after its *last* copy is reached (its
    copies may span several events), timed at that chunk's rate.  Events are
    recycled once their copies are reported.  Nothing here blocks the calling
    thread.  A copy that cannot be queued (a CUDA error) fails its transfer:
    answered at once when none of its copies reached the stream, else at the
    end event after those that did; an event that reports an error fails every
    transfer reported at it.  Never raised.
    """

    polled = True

    def __init__(self, planes: Sequence[Plane], completions: CompletionQueue, num_streams: int = 2,
                 runtime: Optional[Any] = None, batch_max: int = 64, event_bytes: int = EVENT_BYTES) -> None:
        if batch_max < 1:
            raise ValueError(f"batch_max must be >= 1, got {batch_max!r}")
        if event_bytes < 1:
            raise ValueError(f"event_bytes must be >= 1, got {event_bytes!r}")
        rt = runtime if runtime is not None else TorchCuda()
        self._planes, self._block_bytes = check_planes(planes)
        self._out = completions
        self._device = self._planes[0][0].device
        self._new_event = rt.new_event
        self._current = rt.current_stream
        self._copies_on = rt.copies_on
        self._streams = [rt.new_stream(self._device) for _ in range(num_streams)]
        self._pending: list[deque[_Chunk]] = [deque() for _ in self._streams]  # per stream, in queue order
        self._per_event = max(1, -(-event_bytes // max(1, self._block_bytes)))
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
                put(Report(t.token, t.kind, False, "cancelled before copy"))
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
        ev = self._events
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
        pend = self._pending[i]
        chunk = _Chunk(prev)
        last: Optional[_Chunk] = None  # the latest chunk with an end event, not yet pending
        cur: Optional[Transfer] = None  # the transfer being queued, in no chunk yet
        k = 0  # copy calls of ``cur`` that reached the stream
        n = 0  # transfers of ts taken

        def end_chunk() -> None:  # an end event after the chunk's copies: they are reported when it is reached
            nonlocal last, chunk
            end = ev.pop() if ev else self._new_event()
            end.record(stream)
            chunk.end = end
            if last is not None:
                pend.append(last)
            last, chunk = chunk, _Chunk(end)

        planes, per_event = self._planes, self._per_event
        try:
            with self._copies_on(stream) as copy:
                for t in ts:
                    n += 1
                    if len(t.rows) != len(t.slots):
                        put(Report(t.token, t.kind, False, f"{len(t.rows)} rows for {len(t.slots)} slots"))
                        continue
                    cur, k, error = t, 0, None
                    for r, s in zip(t.rows, t.slots):
                        if chunk.copies >= per_event:  # closed here, so that a transfer ends in its last copy's chunk
                            end_chunk()
                        try:
                            for dev, host in planes:
                                if store:
                                    copy(host[s], dev[r])
                                else:
                                    copy(dev[r], host[s])
                                k += 1
                        except Exception as exc:  # this copy did not reach the stream: fail t, go on
                            log.error("CUDA copy of %s row %d / slot %d could not be queued: %r", t.kind, r, s, exc)
                            error = f"copy failed: {exc!r}"
                            break
                        chunk.copies += 1
                    if error is None:
                        chunk.ended.append(t)
                    elif k:  # some of its copies are on the stream: failed once they can no longer land
                        chunk.failed.append((t, error))
                    else:
                        put(Report(t.token, t.kind, False, error))
                    cur = None
                if chunk.copies or len(chunk):  # the last, partial chunk
                    end_chunk()
        except Exception as exc:  # the stream switch or an event record failed: answer what has no event yet
            log.error("CUDA copies of a batch of %d could not all be queued: %r", len(ts), exc)
            if chunk.copies or chunk.failed or (cur is not None and k):
                # these copies are on the stream with no end event behind them: answering them now
                # would lift their row's fence or free their slot while a copy can still land there.
                # Wait for the stream first (a fault path, the only one where the engine thread
                # waits on the device); with a broken context that fails too, and nothing queued runs
                try:
                    stream.synchronize()
                except Exception as sexc:
                    log.error("CUDA copy stream could not be synchronized after a failed record: %r", sexc)
            error = f"copy failed: {exc!r}"
            unanswered = chunk.ended + [t for t, _ in chunk.failed] + ([cur] if cur is not None else []) + ts[n:]
            for t in unanswered:
                put(Report(t.token, t.kind, False, error))
        if last is None:
            ev.append(prev)  # no copy queued: its start event is free again (only its latest record counts)
        else:
            last.final = True
            pend.append(last)

    def harvest(self) -> None:
        if self._queued:
            self.flush()
        put, free, block_bytes = self._out.put, self._events, self._block_bytes
        for pend in self._pending:
            while pend:
                c = pend[0]
                try:
                    if not c.end.query():
                        break
                    per_copy = c.start.elapsed_time(c.end) / 1e3 / max(1, c.copies)
                except Exception as exc:  # a CUDA error surfaced by the query: these copies are lost
                    pend.popleft()
                    free.append(c.start)  # an errored context fails whatever comes next anyway
                    if c.final:
                        free.append(c.end)
                    log.error("CUDA copies of %d transfer(s) failed: %r", len(c), exc)
                    for t in c.ended:
                        put(Report(t.token, t.kind, False, f"copy failed: {exc!r}"))
                    for t, error in c.failed:
                        put(Report(t.token, t.kind, False, error))
                    continue
                pend.popleft()
                free.append(c.start)  # the batch's start event, or the previous chunk's end: no longer read
                if c.final:
                    free.append(c.end)
                for t in c.ended:
                    m = len(t.rows)
                    put(Report(t.token, t.kind, True, None, m * block_bytes, m * per_copy))
                for t, error in c.failed:
                    put(Report(t.token, t.kind, False, error))

    def in_flight(self) -> int:
        """Transfers submitted and not yet reported by ``harvest()`` (queued or on the device)."""
        return len(self._queued) + sum(len(c) for p in self._pending for c in p)

    def synchronize(self) -> None:
        """Put what is queued on the device, block until the copy streams ran it, and answer it: for
        callers that asked to wait (``close()``, the vLLM copier's ``wait()``), never the engine's poll."""
        self.flush()
        for s in self._streams:
            try:
                s.synchronize()
            except Exception as exc:  # a broken context: harvest() answers what is left as failed
                log.error("CUDA copy stream could not be synchronized: %r", exc)
        self.harvest()

    def close(self) -> None:
        self.synchronize()
