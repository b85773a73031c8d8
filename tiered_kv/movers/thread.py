"""ThreadMover: copies on worker threads, for KV tensors without CUDA.

Rows are copied with ``memmove`` between addresses precomputed per plane (through ctypes, which
releases the GIL; ``Tensor.copy_`` of a large row costs more, its intra-op threads fighting the
workers for the cores).  A worker that dies is replaced and its in-hand transfer is reported
failed, so every transfer is answered exactly once.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Callable, Optional

import torch

from ..jobs import JobKind
from .base import CompletionQueue, Mover, Plane, Report, Transfer, check_planes

__all__ = ["ThreadMover", "CopyFn"]

log = logging.getLogger(__name__)

_STORE = JobKind.STORE  # a module constant: cheaper than the class attribute, on every copy

CopyFn = Callable[[torch.Tensor, torch.Tensor], None]


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def _fast_planes(planes: list[Plane]) -> Optional[tuple[tuple[int, int, int, int, int], ...]]:
    """Per plane ``(device row 0, device row stride, host row 0, host row stride, row bytes)`` in bytes,
    when every plane is two CPU tensors with contiguous rows of equal size; else None."""
    out = []
    for dev, host in planes:
        n = int(host.shape[1]) * host.element_size()
        if dev.is_cuda or host.is_cuda or not (dev[0].is_contiguous() and host[0].is_contiguous()) \
                or dev[0].numel() * dev.element_size() != n:
            return None
        out.append((dev.data_ptr(), dev.stride(0) * dev.element_size(),
                    host.data_ptr(), host.stride(0) * host.element_size(), n))
    return tuple(out)


class ThreadMover(Mover):
    """Copies on worker threads; reports through ``completions``.

    ``copy_fn(dst_row, src_row)`` replaces the copy (tests inject torn or failing copies); by
    default rows are copied with ``memmove`` between their addresses.  A transfer's copies run in
    order on one thread; with ``num_workers=1`` transfers also run one after another in
    submission order (unless the owner runs one itself in :meth:`help_one`).

    The owner keeps the transfers it submits in one queue (``_held``) and hands them to the
    workers at :meth:`flush`, with two reasons to keep them:

    * ``batch_max`` > 1: the queue goes to the workers at :meth:`flush` (the manager's
      ``poll()``/``wait()``) or once ``batch_max`` are queued.  An engine step's ``store()``
      calls then wake no worker: the copies run during the step's forward pass instead of
      competing with the engine thread for the GIL and the cores while it makes them.  ``1``:
      each transfer goes to the workers in its ``submit``.
    * :meth:`hold`: while the owner blocks, what it submits stays with it for :meth:`help_one`
      and :meth:`flush` keeps it; what was queued before goes to the workers when the hold
      starts, what is left when it ends.
    """

    polled = False

    def __init__(self, planes: Sequence[Plane], completions: CompletionQueue, num_workers: int = 2,
                 copy_fn: Optional[CopyFn] = None, batch_max: int = 1) -> None:
        if batch_max < 1:
            raise ValueError(f"batch_max must be >= 1, got {batch_max}")
        self._planes, self._block_bytes = check_planes(planes)
        self._batch_max = batch_max
        self._fast = _fast_planes(self._planes) if copy_fn is None else None
        # bounds of rows and slots valid in every plane: never memmove out of bounds
        self._nrows = min(int(d.shape[0]) for d, _ in self._planes)
        self._nslots = min(int(h.shape[0]) for _, h in self._planes)
        self._out = completions
        self._q: queue.SimpleQueue[Optional[Transfer]] = queue.SimpleQueue()
        self._copy = copy_fn or _copy
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

    def help_one(self) -> bool:
        """Run one transfer on the calling thread, a held one (see :meth:`hold`) before one queued for the
        workers; False when there is none.

        The owner calls it while it blocks in ``wait()``: instead of sleeping until a worker wakes
        up for the copy (and then waking up itself for the report, a thread hand-off per copy that
        costs more than the copy on a small VM), it makes the copy.  The transfer is answered
        exactly once either way: an exception that escapes the copy (not an ``Exception``, which
        ``_do`` reports as a failed copy) is answered before it propagates.
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
            self._out.put(Report(t.token, t.kind, False, f"copy interrupted: {exc!r}"))
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
                self._out.put(Report(current.token, current.kind, False, f"worker died: {exc!r}"))
            if not self._closed:
                self._spawn()
            if not isinstance(exc, Exception):
                raise

    def _do(self, t: Transfer) -> Report:
        if t.cancelled:
            return Report(t.token, t.kind, False, "cancelled before copy")
        t0 = time.perf_counter()
        try:
            if self._fast is not None:
                self._memmove(t)
            else:
                self._copy_rows(t)
        except Exception as exc:
            return Report(t.token, t.kind, False, f"copy failed: {exc!r}", seconds=time.perf_counter() - t0)
        return Report(t.token, t.kind, True, None, len(t.rows) * self._block_bytes, time.perf_counter() - t0)

    def _memmove(self, t: Transfer) -> None:
        planes, nrows, nslots, mm = self._fast, self._nrows, self._nslots, ctypes.memmove
        assert planes is not None
        store = t.kind is _STORE
        for r, s in zip(t.rows, t.slots, strict=True):
            if not (0 <= r < nrows and 0 <= s < nslots):
                raise IndexError(f"row {r} / slot {s} out of range ({nrows} rows, {nslots} slots)")
            for d0, ds, h0, hs, n in planes:
                if store:
                    mm(h0 + s * hs, d0 + r * ds, n)
                else:
                    mm(d0 + r * ds, h0 + s * hs, n)

    def _copy_rows(self, t: Transfer) -> None:
        copy, planes, store = self._copy, self._planes, t.kind is _STORE
        for r, s in zip(t.rows, t.slots, strict=True):
            for dev, host in planes:
                if store:
                    copy(host[s], dev[r])
                else:
                    copy(dev[r], host[s])

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
