"""CudaMover: copies on a pool of CUDA streams, finished transfers found by querying events.

Transfers are queued by ``submit`` and put on the device in batches by ``flush()``/``harvest()``
(or when ``batch_max`` are queued), each batch ordered after the work already queued on the
engine's compute stream; finished transfers are found by querying end events in ``harvest()``,
never by a blocking synchronize on the engine thread.  All CUDA calls go through a runtime object
(:class:`TorchCuda`; tests pass the simulated device of ``tests/fake_cuda.py``).

Longer than most modules here (over 500 lines) because one invariant holds it together: every
transfer is answered exactly once, and never while a copy of it can still land.  The chunking of a
batch (``_queue_on_stream``), its failure handler (``_queue_failed``), the copy calls of a chunk
(``_queue_copies``) and ``harvest`` all read and hand over the same chunk and event state; split
over modules, that hand-over would be harder to check, not easier.
"""

from __future__ import annotations

import array
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

from ..jobs import JobKind
from .base import (CompletionQueue, Mover, Plane, Report, Transfer, byte_rows, check_planes, is_run, rows_in_range,
                   rows_view, transfer_error, widen)
from .torch_cuda import TorchCuda

__all__ = ["CudaMover", "TorchCuda", "EVENT_BYTES", "STAGE_BYTES", "GROUP_STAGE_BYTES"]

log = logging.getLogger(__name__)

_STORE = JobKind.STORE


EVENT_BYTES = 64 << 20
"""``CudaMover``: block copies of a batch share an end event per this many bytes (at least one copy each), so
a step's blocks are typically one chunk: one end event, and one copy call per run of consecutive slots.
Each event costs a record, a query and a timing read on the engine thread, and a chunk boundary splits a
run into two copy calls.  On an H200 host a chunk per 2 MiB made a step of 64 stores of 2 MiB blocks cost
2.5 ms of the engine thread (64 copies, 64 events); in chunks of 64 MiB, 0.3 ms.  A link moves this many
bytes in about a millisecond, a fraction of an engine step: finer completion than that buys nothing."""


STAGE_BYTES = 8 << 20
"""``CudaMover``: the device staging rows of a copy stream and plane (rows gathered for one DMA) hold at most
this many bytes (at least one row, at most a chunk's)."""


GROUP_STAGE_BYTES = 64 << 20
"""``CudaMover``: a copy stream's device staging rows for a group of planes (see :class:`_Group`) hold at most this
many bytes (at least one block, at most a chunk's: one pass per chunk of :data:`EVENT_BYTES`).  A pass costs a
gather or a scatter per plane, so with the vLLM worker's layout (one plane per layer, a 2 MiB slab row for 32
layers of 64 KiB) 8 MiB of staging rows would take 16 passes of 32 calls for a step of 64 blocks, and these rows
take two."""


class _Group:
    """Planes whose host rows lie side by side in one host row, as the vLLM worker's KV tensors do in a slab row
    (one plane per KV tensor, each a byte region of the row).  Each such plane's host rows alone are not one range
    in memory, so copied plane by plane they would take a call per block per plane; as a group a chunk's blocks
    go through staging rows laid out as the host rows' region: one gather (stores) or scatter (loads) per plane on
    the device into or out of its columns, and one copy per run of consecutive slots (``one_range``: the region is
    the whole host row) or per block (it is part of one) between the staging rows and the host.

    ``planes``: the plane numbers; ``devs``: their device rows (elements of ``host``'s type); ``cols``: each plane's
    columns of the region (``(start, end)``, in those elements); ``host``: the region as ``[slots, width]``."""

    __slots__ = ("planes", "devs", "cols", "host", "one_range", "width")

    def __init__(self, planes: list[int], devs: list[torch.Tensor], cols: list[tuple[int, int]],
                 host: torch.Tensor) -> None:
        self.planes, self.devs, self.cols, self.host = planes, devs, cols, host
        self.width = int(host.shape[1])
        self.one_range = _one_range(host)


def _host_groups(planes: Sequence[Plane], views: list[Optional[tuple[torch.Tensor, torch.Tensor, bool, bool]]]
                 ) -> list[_Group]:
    """The groups (two planes or more) of ``planes`` whose host rows are adjacent byte ranges of one host row:
    same storage, same row stride and slots, each plane's region starting where the one before it ends.  Only
    planes the batched path takes (``views``) whose own host rows are not one range; each side's row bytes
    consecutive."""
    found: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []   # (host address, plane, host bytes, device bytes)
    for p, v in enumerate(views):
        if v is None or v[3]:
            continue
        d, h = rows_view(planes[p][0]), rows_view(planes[p][1])
        if d is None or h is None or d.stride(1) != 1 or h.stride(1) != 1 or d.shape[1] != h.shape[1]:
            continue
        found.append((h.data_ptr(), p, h, d))
    found.sort(key=lambda f: f[0])
    runs: list[list[tuple[int, int, torch.Tensor, torch.Tensor]]] = []
    for f in found:
        if runs:
            ptr, _, h, _ = runs[-1][-1]
            if (f[0] == ptr + int(h.shape[1]) and f[2].stride(0) == h.stride(0) and f[2].shape[0] == h.shape[0]
                    and f[2].untyped_storage().data_ptr() == h.untyped_storage().data_ptr()):
                runs[-1].append(f)
                continue
        runs.append([f])
    return [_group(run) for run in runs if len(run) >= 2 and not _overlapped(run, planes)]


def _overlapped(run: list[tuple[int, int, torch.Tensor, torch.Tensor]], planes: Sequence[Plane]) -> bool:
    """Whether a plane outside ``run`` may share bytes with it: a group is copied as one, so only its own planes'
    order is kept, and aliased rows would land another plane's bytes than copying plane by plane.  On the host a
    plane of the same storage is clear only with the same row stride and bytes of the row beside the run's; on
    the device, only a plane of another storage."""
    first = run[0][2]
    base, stride = first.untyped_storage().data_ptr(), first.stride(0)
    if stride <= 0:
        return True
    lo = (first.data_ptr() - base) % stride
    hi = lo + sum(int(h.shape[1]) for _, _, h, _ in run)
    if int(first.shape[0]) > 1 and (hi - lo > stride or any(d.stride(0) < d.shape[1] for _, _, _, d in run)):
        return True   # the run's own rows overlap from slot to slot (or a member's device rows from row to row)
    members = {p for _, p, _, _ in run}
    devices = {d.untyped_storage().data_ptr() for _, _, _, d in run}
    for q, (dev, host) in enumerate(planes):
        if q in members:
            continue
        if dev.untyped_storage().data_ptr() in devices:
            return True
        if host.untyped_storage().data_ptr() != base:
            continue
        h = rows_view(host)
        if h is None or h.stride(0) != stride:
            return True
        a = (h.data_ptr() - base) % stride
        b = a + int(h.shape[1]) * h.stride(1) if h.shape[1] else a
        if b > stride or hi > stride or (a < hi and lo < b):
            return True
    return False


def _group(run: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> _Group:
    first = run[0][2]
    width = sum(int(h.shape[1]) for _, _, h, _ in run)
    region = first.as_strided((int(first.shape[0]), width), (first.stride(0), 1))
    devs = [d for _, _, _, d in run]
    widths = [int(h.shape[1]) for _, _, h, _ in run]
    wide = widen(region, torch.int64)
    wide_devs = [widen(d, torch.int64) for d in devs]
    if wide is not None and all(w % 8 == 0 for w in widths) and all(d is not None for d in wide_devs):
        region, devs, widths = wide, [d for d in wide_devs if d is not None], [w // 8 for w in widths]
    cols, at = [], 0
    for w in widths:
        cols.append((at, at + w))
        at += w
    return _Group([p for _, p, _, _ in run], devs, cols, region)


def _range_views(dev: torch.Tensor, host: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor, bool, bool]]:
    """A plane as ``(device rows, host rows, device rows are one range, host rows are one range)``: both
    viewed as ``[rows, elements]`` of 8-byte elements where they fit (index ops move an element per
    thread), else of bytes; None when the rows are not byte ranges of one size."""
    d, h = rows_view(dev), rows_view(host)
    if d is None or h is None or d.shape[1] != h.shape[1]:
        return None
    wd, wh = widen(d, torch.int64), widen(h, torch.int64)
    if wd is not None and wh is not None:
        d, h = wd, wh
    return d, h, _one_range(d), _one_range(h)


def _one_range(t: torch.Tensor) -> bool:
    """Whether consecutive rows of ``t`` are consecutive in memory (a run of them is one range)."""
    return t.stride(1) == 1 and (t.shape[0] < 2 or t.stride(0) == t.shape[1])


def _slot_runs(slots: list[int], rows: Optional[list[int]] = None) -> list[tuple[int, int]]:
    """``slots`` cut into maximal runs ``[a, b)`` of consecutive slots (and, given ``rows``, of consecutive
    rows too: each run one range on both sides)."""
    n = len(slots)
    if is_run(slots) and (rows is None or is_run(rows)):
        return [(0, n)]
    out, a = [], 0
    for i in range(1, n):
        if slots[i] != slots[i - 1] + 1 or (rows is not None and rows[i] != rows[i - 1] + 1):
            out.append((a, i))
            a = i
    out.append((a, n))
    return out


def _singles(n: int) -> list[tuple[int, int]]:
    return [(a, a + 1) for a in range(n)]



def _put_all(put: Callable[[Report], None], reps: list[Report]) -> None:
    """Put every report of a chunk taken off its pending list: an interrupt between two puts still puts
    the rest, then goes on (a chunk's copies have landed; one report answered twice, interrupted inside
    its put, is discarded by the owner as an unknown token, where one never answered would hang its job)."""
    done = 0
    try:
        for r in reps:
            put(r)
            done += 1
    except BaseException:
        for r in reps[done:]:
            put(r)
        raise


def _failed(bad: Optional[list[tuple[int, int, str]]], a: int, b: int, exc: Exception,
            store: bool) -> list[tuple[int, int, str]]:
    log.error("CUDA %s copy of blocks %d..%d of a chunk could not be queued: %r", "store" if store else "load",
              a, b - 1, exc)
    out = bad if bad is not None else []
    out.append((a, b, f"copy failed: {exc!r}"))
    return out


class _Chunk:
    """The copies queued between two events of one stream: reported when ``end`` is reached.

    ``ended``: the transfers whose last block is in this chunk (one that spans chunks is reported with
    the last); ``failed``: transfers with a block in a call of this chunk that could not be queued
    (answered failed here, once none of their queued copies can still land)."""

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

    A batch's block copies (a block is one row over every plane) are cut into
    chunks of ``event_bytes`` (at least one block; a block of that size or more
    is a chunk of its own), each followed by an end event and timed from the
    event before it; a transfer is reported once, when the end event after its
    *last* block is reached (its blocks may span chunks), timed at that chunk's
    rate.  Events are recycled once their copies are reported.

    ``batched`` (the default): a chunk's blocks go to the device as few calls
    as the host side allows.  Each run of consecutive host slots is one host
    range, so one DMA: ``copy_`` straight from or to the device rows when they
    are consecutive too, else through a staging buffer on the device that one
    ``index_select`` gathers the rows into (stores) or one ``index_copy_``
    scatters them from (loads), the row numbers uploaded once per chunk --
    unless the staging rows hold only one block (blocks over half of
    ``STAGE_BYTES``): a gather and a copy per block, serialized on that one row,
    would cost more than a ``copy_`` per run of consecutive rows and slots,
    which they get instead.  Slots
    in ascending runs (what the host index hands a step's stores) make a
    step one or two calls per chunk and plane; scattered slots fall back to a
    copy per block.  Planes whose host rows lie side by side in one host row
    (the vLLM worker's, one per KV tensor, each a byte region of the slab rows)
    go through staging rows together (:class:`_Group`): a gather or scatter per
    plane and a copy per run of consecutive slots, where plane by plane each
    block would take a copy per plane (a step of 64 blocks over 32 KV tensors:
    about 35 calls instead of 2,048); on a real device only once a probe at
    start saw the device do those index ops on column slices right.  Any other
    plane whose host rows are not one range in memory is copied block by block.
    A chunk that loads one row twice is copied block by block, every plane, in order.
    ``batched=False``: every block is its own ``copy_`` (the
    per-block path the benchmarks compare against).  ``stage_bytes``: the
    staging rows' bound (None: ``STAGE_BYTES`` when first used).

    A transfer whose rows and slots differ in number, or that names a row or
    slot out of range, is answered failed at the flush, before any copy.
    Nothing here blocks the calling thread.  A call that cannot be queued (a
    CUDA error) fails every transfer with a block in it; they are answered at
    the chunk's end event, once none of their queued copies can still land, and
    a failed transfer takes no copies in later chunks.  The rest of the batch
    goes on.  An event that reports an error fails every transfer reported at
    it.  Never raised.
    """

    polled = True

    def __init__(self, planes: Sequence[Plane], completions: CompletionQueue, num_streams: int = 2,
                 runtime: Optional[Any] = None, batch_max: int = 64, event_bytes: int = EVENT_BYTES,
                 batched: bool = True, stage_bytes: Optional[int] = None) -> None:
        if batch_max < 1:
            raise ValueError(f"batch_max must be >= 1, got {batch_max!r}")
        if num_streams < 1:
            raise ValueError(f"num_streams must be >= 1, got {num_streams!r}")
        if event_bytes < 1:
            raise ValueError(f"event_bytes must be >= 1, got {event_bytes!r}")
        if stage_bytes is not None and stage_bytes < 1:
            raise ValueError(f"stage_bytes must be >= 1, got {stage_bytes!r}")
        self._stage_bytes = stage_bytes
        rt = runtime if runtime is not None else TorchCuda()
        self._planes, self._block_bytes = check_planes(planes)
        self._nrows, self._nslots = rows_in_range(self._planes)
        self._out = completions
        self._device = self._planes[0][0].device
        self._new_event = rt.new_event
        self._current = rt.current_stream
        self._order_after = rt.order_after
        self._copies_on = rt.copies_on
        self._streams = [rt.new_stream(self._device) for _ in range(num_streams)]
        self._pending: list[deque[_Chunk]] = [deque() for _ in self._streams]  # per stream, in queue order
        self._per_event = max(1, -(-event_bytes // max(1, self._block_bytes)))
        self._queued: list[Transfer] = []  # submitted, not yet on the device
        self._batch_max = batch_max
        self._events: list[Any] = []  # recycled timing events
        self._next = 0
        # per plane: (device rows, host rows, device rows are one range, host rows are one range) as views
        # index ops and range copies take, or None: copied block by block
        self._views = [_range_views(d, h) if batched else None for d, h in self._planes]
        # each plane's rows for copies block by block (its own path, or a fallback of the batched one), as byte
        # rows where torch views them so, else as they are when both sides hold the same elements (copy_ converts
        # none); any other plane is refused here (ValueError): a bf16 or fp8 row beside integer host rows would be
        # converted value by value and reported ok
        self._blocks = [byte_rows(d, h) for d, h in self._planes]
        self._stages: list[list[Optional[torch.Tensor]]] = [[None] * len(self._planes) for _ in self._streams]
        # planes side by side in one host row go through staging rows together (_Group), where the device
        # computes index ops on column slices of them right (probed once here on a real device)
        groups = _host_groups(self._planes, self._views) if batched else []
        if groups and not rt.strided_index_ops(self._device):
            log.warning("index_select/index_copy_ on column slices of staging rows gave wrong bytes or failed on %s: "
                        "the planes side by side in one host row are copied block by block", self._device)
            groups = []
        self._groups = groups
        grouped = {p for g in groups for p in g.planes}
        self._solo = [p for p in range(len(self._planes)) if p not in grouped]   # planes copied on their own
        # per stream and group: its staging rows and each plane's columns of them
        self._gstages: list[list[Optional[tuple[torch.Tensor, list[torch.Tensor]]]]] = [
            [None] * len(groups) for _ in self._streams]
        self._stage_failed = False   # a group's staging rows could not be made (logged once)
        self._taken = False   # flush(): the direction being handed on was taken by _queue_on_stream

    def submit(self, t: Transfer) -> None:
        q = self._queued
        t.taken = True   # no call between this and the append (Transfer.taken)
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
        k = 0          # transfers of the batch sorted
        handed = 0     # directions handed to _queue_on_stream (which answers all of its own once it took them)
        try:
            for t in batch:
                k += 1
                if t.cancelled:
                    put(Report(t.token, t.kind, False, "cancelled before copy"))
                elif t.kind is _STORE:
                    stores.append(t)
                else:
                    loads.append(t)
            handed = 1
            if stores:
                self._taken = False
                self._queue_on_stream(stores, True)
            handed = 2
            if loads:
                self._taken = False
                self._queue_on_stream(loads, False)
            handed = 3
        except BaseException as exc:
            # an interrupt: what was taken off the queue and not handed on is answered (failed, no copy of it
            # was queued), and so is a direction interrupted before _queue_on_stream took it; one answered
            # twice (interrupted inside its put) is discarded by the owner
            if handed == 0:
                rest = stores + loads + batch[k - 1:]
            else:
                rest = [] if handed == 3 else (loads if handed == 1 else [])
                if handed < 3 and not self._taken:
                    rest = (stores if handed == 1 else loads) + rest
            for t in rest:
                put(Report(t.token, t.kind, False, f"copy not started: {exc!r}"))
            raise

    def _queue_on_stream(self, ts: list[Transfer], store: bool) -> None:
        """Queue ``ts`` (one direction) on the next stream, in chunks; every transfer is answered exactly once:
        here (refused, or lost to a failure or an interrupt) or by :meth:`harvest` (its chunk pending).

        Interrupt-safe by construction: whatever point an exception (a CUDA error or a KeyboardInterrupt)
        reaches, the handler waits for the stream once a copy may be on it (no copy may land after its
        transfer is answered), puts
        every chunk that has an end event in the pending queue exactly once, and answers the transfers that
        are in none of those chunks; only then does it log, and re-raise an interrupt."""
        i: Optional[int] = None
        stream: Any = None
        prev: Any = None
        pend: Optional[deque[_Chunk]] = None
        last: Optional[_Chunk] = None   # the latest chunk with an end event, not yet pending
        chunk: Optional[_Chunk] = None
        answered: set[int] = set()      # ids of transfers answered here
        copying = False                 # a copy of this batch may be on the stream (set before the first call)
        put = self._out.put
        ev = self._events
        try:
            self._taken = True
            i = self._next
            self._next = (i + 1) % len(self._streams)
            stream = self._streams[i]
            pend = self._pending[i]
            prev = ev.pop() if ev else self._new_event()
            try:
                self._order_after(stream, self._current(self._device))
                prev.record(stream)
            except Exception as exc:  # a broken context: nothing of this batch reached the stream
                ev.append(prev)
                prev = None
                for t in ts:
                    put(Report(t.token, t.kind, False, f"copy failed: {exc!r}"))
                    answered.add(id(t))
                log.error("CUDA copies of a batch of %d could not be queued: %r", len(ts), exc)
                return
            chunk = _Chunk(prev)
            rows: list[int] = []   # the open chunk's blocks, not yet queued
            slots: list[int] = []
            spans: list[tuple[Transfer, int, int]] = []  # transfers whose last block is in the open chunk: (t, lo, hi)
            cur: Optional[Transfer] = None  # the transfer being taken, in no span yet
            per_event, nrows, nslots = self._per_event, self._nrows, self._nslots

            def close(ops: Any, cur_lo: int) -> bool:
                """Queue the open chunk's copies and its end event; sort its transfers into ``ended`` and
                ``failed``, pend the chunk before it and keep this one as ``last``.  False when ``cur`` (whose
                blocks go on in the next chunk) failed here: it takes no more copies."""
                nonlocal last, chunk, copying
                c = chunk
                assert c is not None
                copying = True
                bad = self._queue_copies(ops, i, rows, slots, store) if rows else None
                end = ev.pop() if ev else self._new_event()
                end.record(stream)
                c.end, c.copies = end, len(rows)
                go_on = True
                if bad:
                    def error(lo: int, hi: int) -> Optional[str]:  # a transfer with no block is in no call
                        return next((e for a, b, e in bad if a < hi and lo < b), None) if lo < hi else None
                    for t, lo, hi in spans:
                        e = error(lo, hi)
                        if e is None:
                            c.ended.append(t)
                        else:
                            c.failed.append((t, e))
                    if cur is not None:
                        e = error(cur_lo, len(rows))
                        if e is not None:
                            c.failed.append((cur, e))
                            go_on = False
                else:
                    c.ended += [t for t, _, _ in spans]
                spans.clear()
                rows.clear()
                slots.clear()
                if last is not None:
                    pend.append(last)   # type: ignore[union-attr]
                last = c
                chunk = _Chunk(end)
                return go_on

            with self._copies_on(stream) as ops:
                for t in ts:
                    tr, tsl = t.rows, t.slots
                    try:
                        error = transfer_error(t, nrows, nslots)
                    except Exception as exc:   # rows or slots that are not ints: answered, like any bad transfer
                        error = f"malformed transfer: {exc!r}"
                    if error is not None:  # before any copy: a slice past the end is short, an index faults
                        put(Report(t.token, t.kind, False, error))
                        answered.add(id(t))
                        continue
                    m = len(tr)
                    cur, lo, j = t, len(rows), 0
                    while j < m:
                        if len(rows) >= per_event:  # closed here, so that a transfer ends in its last block's chunk
                            if not close(ops, lo):
                                break
                            lo = 0
                        k = min(per_event - len(rows), m - j)
                        rows += tr[j:j + k]
                        slots += tsl[j:j + k]
                        j += k
                    else:
                        spans.append((t, lo, len(rows)))
                    cur = None
                if rows or spans:  # the last, partial chunk
                    close(ops, 0)
            if last is None:
                ev.append(prev)  # no copy queued: its start event is free again (only its latest record counts)
            else:
                last.final = True
                pend.append(last)
        except BaseException as exc:
            self._queue_failed(exc, ts, stream if copying else None, pend, last, answered, prev)
            if not isinstance(exc, Exception):
                raise

    def _queue_failed(self, exc: BaseException, ts: list[Transfer], stream: Any, pend: Optional[deque[_Chunk]],
                      last: Optional[_Chunk], answered: set[int], prev: Any) -> None:
        """:meth:`_queue_on_stream`'s handler (see there): nothing of ``ts`` is left unanswered or answered
        while a copy of it can still land.  ``stream``: None when no copy of the batch was queued (nothing to
        wait for: synchronizing would wait for the engine's own work too, behind the batch's barrier)."""
        if stream is not None:
            try:
                stream.synchronize()   # a fault path: the only one where the engine thread waits on the device
            except Exception as sexc:   # a broken context: nothing queued runs
                log.error("CUDA copy stream could not be synchronized after a failed batch: %r", sexc)
        owned: set[int] = set()
        if pend is not None:
            if last is not None and not any(c is last for c in pend):
                pend.append(last)   # chunks reach the queue only as `last`: the ones before it are there
            for c in pend:
                owned.update(id(t) for t in c.ended)
                owned.update(id(t) for t, _ in c.failed)
        if last is not None:
            last.final = True   # the newest chunk kept: its end event goes back to the pool when it is reached
        elif prev is not None and not any(e is prev for e in self._events):
            self._events.append(prev)   # no chunk kept: its start event is free (the stream ran everything)
        error = f"copy failed: {exc!r}"
        put = self._out.put
        for t in ts:
            if id(t) not in owned and id(t) not in answered:
                put(Report(t.token, t.kind, False, error))
        log.error("CUDA copies of a batch of %d could not all be queued: %r", len(ts), exc)

    def _queue_copies(self, ops: Any, stream: int, rows: list[int], slots: list[int],
                      store: bool) -> Optional[list[tuple[int, int, str]]]:
        """Queue the copies of blocks ``rows[i] <-> slots[i]`` on the current stream, over every plane; the
        ranges ``[a, b)`` of blocks whose call could not be queued, with the error, or None when all were."""
        bad: Optional[list[tuple[int, int, str]]] = None
        runs: Optional[list[tuple[int, int]]] = None    # runs of consecutive slots
        ranges: Optional[list[tuple[int, int]]] = None  # runs of consecutive slots and rows
        idx: Optional[torch.Tensor] = None
        if not store and len(set(rows)) < len(rows):
            # a chunk that loads a row twice: one index_copy_ would land either block; copied block by block, plane
            # by plane, the later one lands last, as submitted
            for p in range(len(self._planes)):
                bad = self._copy_blocks(ops, p, rows, slots, store, bad)
            return bad
        for g_at, g in enumerate(self._groups):
            try:
                staged = self._group_stage(stream, g_at, g)
            except Exception as exc:   # no device memory for the staging rows: this chunk's copies block by block
                if not self._stage_failed:
                    self._stage_failed = True
                    log.warning("staging rows for %d planes side by side in a host row could not be made (%r): "
                                "their copies go block by block until they can", len(g.planes), exc)
                for p in g.planes:
                    bad = self._copy_blocks(ops, p, rows, slots, store, bad)
                continue
            if idx is None:
                try:
                    idx = ops.index(array.array("q", rows).tolist())
                except Exception:   # noqa: BLE001 - a row that is not an int, or the upload failed: block by block,
                    for p in g.planes:   # where each transfer meets its own outcome
                        bad = self._copy_blocks(ops, p, rows, slots, store, bad)
                    continue
            bad = self._queue_group(ops, staged, g, idx, rows, slots, store, bad)
        for p in self._solo:
            views = self._views[p]
            if views is None:   # block by block
                bad = self._copy_blocks(ops, p, rows, slots, store, bad)
                continue
            dev, host, dev_range, host_range = views
            if not host_range:
                spans = _singles(len(rows))
            elif self._stage_rows(dev) > 1 or not dev_range:
                spans = runs = runs if runs is not None else _slot_runs(slots)
            else:  # staging rows that hold one block would take a gather and a copy per block: a copy per range
                spans = ranges = ranges if ranges is not None else _slot_runs(slots, rows)
            for a, b in spans:
                done = a   # the run's blocks before this one are queued: a call failing later does not carry them
                try:
                    k, s0, r0 = b - a, slots[a], rows[a]
                    hs = host[s0:s0 + k]
                    if k == 1 or (dev_range and is_run(rows[a:b])):  # one range to another
                        if store:
                            ops.copy(hs, dev[r0:r0 + k])
                        else:
                            ops.copy(dev[r0:r0 + k], hs)
                        continue
                    if idx is None:   # array("q") refuses a row that is not an integer (torch.tensor truncates 1.5)
                        idx = ops.index(array.array("q", rows).tolist())
                    stage = self._stage(stream, p, dev)
                    c = int(stage.shape[0])
                    for j in range(a, b, c):
                        e = min(b, j + c)
                        part, hj = stage[:e - j], host[slots[j]:slots[j] + e - j]
                        if store:
                            ops.gather(part, dev, idx[j:e])
                            ops.copy(hj, part)
                        else:
                            ops.copy(part, hj)
                            ops.scatter(dev, idx[j:e], part)
                        done = e
                except Exception as exc:  # these blocks' call did not reach the stream: their transfers fail
                    bad = _failed(bad, done, b, exc, store)
        return bad

    def _copy_blocks(self, ops: Any, p: int, rows: list[int], slots: list[int], store: bool,
                     bad: Optional[list[tuple[int, int, str]]]) -> Optional[list[tuple[int, int, str]]]:
        """Plane ``p``'s copies of blocks ``rows[i] <-> slots[i]``, a call per block, in order."""
        dev, host = self._blocks[p]
        for a in range(len(rows)):
            try:
                if store:
                    ops.copy(host[slots[a]], dev[rows[a]])
                else:
                    ops.copy(dev[rows[a]], host[slots[a]])
            except Exception as exc:
                bad = _failed(bad, a, a + 1, exc, store)
        return bad

    def _queue_group(self, ops: Any, staged: tuple[torch.Tensor, list[torch.Tensor]], g: _Group, idx: torch.Tensor,
                     rows: list[int], slots: list[int], store: bool, bad: Optional[list[tuple[int, int, str]]]
                     ) -> Optional[list[tuple[int, int, str]]]:
        """Group ``g``'s copies of blocks ``rows[i] <-> slots[i]`` (``idx``: ``rows`` on the device) through
        ``staged`` (its staging rows and each plane's columns of them), a stage-full at a time: stores gather each
        plane's rows into its columns, then copy them to the host, a call per run of consecutive slots (or per
        block); loads the other way round.  A gather or scatter that cannot be queued fails the pass's blocks, a
        host copy its own."""
        stage, cols = staged
        c, n, host = int(stage.shape[0]), len(rows), g.host
        for j in range(0, n, c):
            e = min(n, j + c)
            try:
                m = e - j
                part = stage if m == c else stage[:m]
                views = cols if m == c else [v[:m] for v in cols]
                at = idx if j == 0 and e == n else idx[j:e]
                # the host side: runs of consecutive slots where the region is whole host rows, else a block each
                spans = ([(a + j, b + j) for a, b in _slot_runs(slots[j:e])] if g.one_range
                         else [(a, a + 1) for a in range(j, e)])
                if store:
                    for dev, v in zip(g.devs, views):
                        ops.gather(v, dev, at)
            except Exception as exc:  # the pass's rows are not all in the staging rows: its blocks fail
                bad = _failed(bad, j, e, exc, store)
                continue
            lost: list[tuple[int, int]] = []   # spans whose host copy did not reach the stream
            for a, b in spans:
                try:
                    if store:
                        ops.copy(host[slots[a]:slots[a] + b - a], part[a - j:b - j])
                    else:
                        ops.copy(part[a - j:b - j], host[slots[a]:slots[a] + b - a])
                except Exception as exc:  # these blocks' call did not reach the stream: their transfers fail
                    bad = _failed(bad, a, b, exc, store)
                    lost.append((a, b))
            if not store:
                try:
                    if not lost:
                        for dev, v in zip(g.devs, views):
                            ops.scatter(dev, at, v)
                    else:   # a fault path: the rows of the lost spans keep their bytes, the others get theirs
                        for i in range(j, e):
                            if not any(a <= i < b for a, b in lost):
                                for dev, v in zip(g.devs, views):
                                    ops.copy(dev[rows[i]], v[i - j])
                except Exception as exc:  # some planes' rows not written: the pass's blocks fail
                    bad = _failed(bad, j, e, exc, store)
        return bad

    def _group_stage(self, stream: int, g_at: int, g: _Group) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Stream ``stream``'s staging rows for group ``g`` and each plane's columns of them (as :meth:`_stage`)."""
        st = self._gstages[stream][g_at]
        if st is None:
            row = g.width * g.host.element_size()
            bound = self._stage_bytes if self._stage_bytes is not None else GROUP_STAGE_BYTES
            n = max(1, min(self._per_event, bound // max(1, row)))
            with torch.inference_mode(False):
                t = torch.empty((n, g.width), dtype=g.host.dtype, device=self._device)
                st = self._gstages[stream][g_at] = (t, [t[:, a:b] for a, b in g.cols])
        return st

    def _stage_rows(self, like: torch.Tensor) -> int:
        """How many of ``like``'s rows the staging rows hold: ``stage_bytes`` (or ``STAGE_BYTES``) of them, at
        least one, at most a chunk's."""
        row = int(like.shape[1]) * like.element_size()
        bound = self._stage_bytes if self._stage_bytes is not None else STAGE_BYTES
        return max(1, min(self._per_event, bound // max(1, row)))

    def _stage(self, stream: int, plane: int, like: torch.Tensor) -> torch.Tensor:
        """Stream ``stream``'s staging rows on the device for ``plane`` (made on first use, on that stream,
        and only ever used on it: the stream's order keeps one chunk's use from overlapping the next)."""
        st = self._stages[stream][plane]
        if st is None:
            with torch.inference_mode(False):   # made in the caller's step, written in later ones, in any mode
                st = self._stages[stream][plane] = torch.empty((self._stage_rows(like), int(like.shape[1])),
                                                                dtype=like.dtype, device=like.device)
        return st

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
                    log.error("CUDA copies of %d transfer(s) failed: %r", len(c), exc)
                    reps = ([Report(t.token, t.kind, False, f"copy failed: {exc!r}") for t in c.ended]
                            + [Report(t.token, t.kind, False, error) for t, error in c.failed])
                else:
                    reps = ([Report(t.token, t.kind, True, None, len(t.rows) * block_bytes, len(t.rows) * per_copy)
                             for t in c.ended] + [Report(t.token, t.kind, False, error) for t, error in c.failed])
                # answered before it leaves the queue: an interrupt in between answers it again at the next
                # harvest (the owner discards the second), never not at all
                _put_all(put, reps)
                pend.popleft()
                free.append(c.start)  # the batch's start event, or the previous chunk's end: no longer read
                if c.final:
                    free.append(c.end)

    def needs_harvest(self) -> bool:
        return bool(self._queued) or any(self._pending)

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
