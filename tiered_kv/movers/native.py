"""NativeMover: a step's CPU copies run in torch's native thread pool, without the GIL.

:class:`~.thread.ThreadMover` copies on Python threads.  Each of them needs the GIL to take a
batch, again after each torch op, and again to put its reports; while the engine thread runs
Python back to back it gets the GIL only when the interpreter forces a switch (every 5 ms), so a
step's copies wait for the engine's calls instead of running beside them (``docs/benchmarks.md``,
"A step's copies as one batch").  Here the owner hands what a flush queued -- its stores, then its
loads -- to a TorchScript function started with one ``torch.jit.fork`` from TorchScript: it runs on
torch's inter-op thread pool, in C++, and never takes the GIL.  The owner learns that a batch is
done by asking its future (:meth:`harvest`, at every ``poll()``), and answers the batch's transfers
itself, one report each.

The copy is :data:`.rowcopy.COPY_SOURCE` compiled, the one the threads run as Python (rows viewed as
16- or 8-byte elements; one ``copy_`` when both sides' rows are consecutive, an ``index_select`` or
``index_copy_`` when one side's are, a gather and a scatter through a staging buffer of
:data:`.thread.STAGE_BYTES` made per copy when neither is).  Only planes every row of which such a view fits
are taken (:func:`native_fits`); :func:`tiered_kv.movers.make_mover` gives other planes, and
injected copy functions, a :class:`~.thread.ThreadMover`.

Every transfer is answered exactly once: a batch stays in ``_inflight`` until its reports are
on the completion queue (an interrupt between the two answers it again at the next harvest; the
owner discards the second report as an unknown token); a batch whose copy raised is started
again a transfer at a time, so that each is answered by its own outcome.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from array import array
from collections.abc import Sequence
from itertools import starmap
from typing import Any, Callable, Optional

import torch

from ..jobs import JobKind
from .base import CompletionQueue, Mover, Plane, Report, Transfer, check_planes, rows_in_range
from .rowcopy import compiled, list_args, native_available, pool_used
from .thread import (FEW_ROWS, HELP_BYTES, STAGE_BYTES, copy_one, fast_planes, memmove_rows, rows_len, screen,
                     split_batches, wide_planes)

__all__ = ["NativeMover", "native_fits", "native_available", "LaunchFn"]

log = logging.getLogger(__name__)

_STORE = JobKind.STORE
_NO_CUT = 1 << 62   # split_batches' cap: a flush's transfers of one direction are one group

LaunchFn = Callable[..., Any]
"""``launch(planes, to_host, dst_idx, src_idx, d0, s0, n, dst_run, src_run, stage_rows)`` -> a
``torch.futures.Future``: the compiled launcher (:mod:`.rowcopy`'s ``launch``; ``planes`` the future
``hold_planes`` made), each argument but the first and the last a list with one entry per group of one
direction; tests inject failing ones.  ``run_fn`` takes the same arguments, with ``planes`` the list
``[device planes, host planes]`` itself, and copies on the calling thread."""

def native_fits(planes: Sequence[Plane]) -> bool:
    """Whether :class:`NativeMover` can copy these planes: CPU tensors whose rows are byte ranges
    of equal size that a 16- or 8-byte element view fits."""
    return wide_planes(list(planes)) is not None


HELP_WAIT_S = 0.001
""":meth:`NativeMover.help_one` waits at most this long for the oldest copy in flight, so that a ``wait()``
with a timeout returns within about this of it however long the copy takes."""


POLL_MIN_S, POLL_MAX_S = 0.00002, 0.0002
""":meth:`NativeMover._wait_oldest`'s timed wait (see there why not a callback) sleeps until about when the batch's
copy should end (its rows at the rate blocked waits saw), then asks its future after this long, twice as long
each time after, up to the second figure: each wake-up costs 10-20 us of CPU on the reference VM, taken from the
copy on a machine of two cores."""
EXPECT_SHARE = 0.8   # of its expected duration, a timed wait sleeps before it first asks a batch's future


class _Batch:
    """A launch's transfers, in flight from before the launch: ``futs`` gets the launch's future from C
    (``list.extend`` of the launcher's result), so no interrupt can fall between the launch returning
    and the batch knowing it (an empty ``futs`` after an interrupt: nothing was launched)."""

    __slots__ = ("futs", "transfers", "started", "rows", "expect", "poll_s")

    def __init__(self, transfers: list[Transfer], started: float, row_s: float) -> None:
        self.futs: list[Any] = []
        self.transfers = transfers
        self.started = started
        self.rows = sum(len(t.rows) for t in transfers)
        self.expect = started + EXPECT_SHARE * row_s * self.rows   # a timed wait first asks about then
        self.poll_s = POLL_MIN_S   # its next pause after that (_wait_oldest)

    @property
    def future(self) -> Any:
        return self.futs[0] if self.futs else None


class NativeMover(Mover):
    """Copies a batch of transfers at a time in torch's inter-op threads; reports at :meth:`harvest`.

    ``batch_max``: as :class:`~.thread.ThreadMover` -- transfers wait on the owner until
    :meth:`flush` (the manager's ``poll()``/``wait()``) or until ``batch_max`` are queued.
    ``launch_fn`` replaces the compiled launcher, ``run_fn`` the copy an owner that blocks makes itself
    (:meth:`help_one`; tests inject failures and gates into both)."""

    polled = True

    def __init__(self, planes: Sequence[Plane], completions: CompletionQueue, batch_max: int = 1,
                 launch_fn: Optional[LaunchFn] = None, run_fn: Optional[LaunchFn] = None) -> None:
        if batch_max < 1:
            raise ValueError(f"batch_max must be >= 1, got {batch_max}")
        self._planes, self._block_bytes = check_planes(planes)
        wide = wide_planes(self._planes)
        if wide is None:
            raise ValueError("NativeMover needs CPU planes whose rows a 16- or 8-byte element view fits "
                             "(see native_fits); use ThreadMover")
        self._dev = [d for d, _ in wide]
        self._host = [h for _, h in wide]
        # rows per staging pass; 0 (rows wider than the stage): one copy_ per row where neither side is a range
        self._stage_rows = [STAGE_BYTES // (int(h.shape[1]) * h.element_size()) for h in self._host]
        self._nrows, self._nslots = rows_in_range(self._planes)
        self._fast = fast_planes(self._planes)   # row addresses, for a lone transfer copied by the owner
        if launch_fn is None:
            pool_used()
        self._launch: LaunchFn = launch_fn or compiled().launch
        self._run: LaunchFn = run_fn or compiled().copy_groups   # the same copy, on the calling thread
        self._planes_now = [self._dev, self._host]                # its planes
        # the launcher's: detached once, in a future Python never reads (rowcopy's hold_planes)
        self._planes_held: Any = compiled().hold_planes(self._dev, self._host)
        self._planes_held.wait()
        self._out = completions
        self._batch_max = batch_max
        self._held: collections.deque[Transfer] = collections.deque()
        self._holding = False
        self._inflight: collections.deque[_Batch] = collections.deque()
        self._closed = False
        if launch_fn is None and run_fn is None:
            self._warm_up()
        self.batches = 0     # batched copies started
        self._row_s = 0.0    # seconds per row of a batch's copy, as blocked waits saw them end (moving average)
        self.retried = 0     # transfers started again alone after their batch's copy raised

    def _warm_up(self) -> None:
        """Run the compiled copy on scratch rows of the planes' element types, in the inter-op threads
        and here, so that its first runs -- TorchScript's profiling runs and the optimization after them,
        21 ms and 2.5 ms on the reference VM -- happen at start, not in the engine's first steps."""
        dev, host = ([torch.zeros((2, int(h.shape[1])), dtype=h.dtype) for h in self._host] for _ in range(2))
        cu = compiled()
        held = cu.hold_planes(dev, host)
        args = ([True, False], [[1], [1]], [[0], [1]], [1, 1], [0, 0], [1, 1], [False] * 2, [False] * 2,
                self._stage_rows)   # both directions, both indexes made: every case the step's copies take
        for _ in range(3):
            self._launch(held, *args).wait()
        with torch.jit.optimized_execution(False):
            self._run([dev, host], *args)

    # ------------------------------------------------------------------ owner thread
    def submit(self, t: Transfer) -> None:
        held = self._held
        t.taken = True   # no call between this and the append (Transfer.taken)
        held.append(t)
        if len(held) >= self._batch_max:
            self.flush()

    def flush(self) -> None:
        """Start the queued transfers' copies, stores then loads, as one launch, unless the owner holds
        them (:meth:`hold`); a transfer that cannot be copied (cancelled, out of range) is answered at once."""
        if not self._holding:
            self._start_held(now=False)

    def _start_held(self, now: bool) -> None:
        held = self._held
        if not held:
            return
        self._held = collections.deque()
        groups: Optional[list[list[Transfer]]] = None
        try:
            groups = split_batches(held, self._block_bytes, _NO_CUT)   # a flush's stores, then its loads
            self._start(groups, now)
        except BaseException as exc:   # answer what was not started: nothing submitted goes unanswered
            self._answer_unstarted(list(held) if groups is None else [t for g in groups for t in g],
                                   f"copy not started: {exc!r}")
            raise

    def _answer_unstarted(self, ts: list[Transfer], error: str) -> None:
        """After an interrupt: answer (failed) those of ``ts`` whose copy is not in flight.  One that is
        in flight is answered by its copy only: answered now, its job's row fence or slot lease could
        be released while the copy may still land.  (One that the screen answered before the interrupt
        is answered twice: the owner discards the second report as an unknown token.)"""
        flying = {id(t) for b in self._inflight for t in b.transfers}
        put = self._out.put
        for t in ts:
            if id(t) not in flying:
                put(Report(t.token, t.kind, False, error))

    def _start(self, groups: list[list[Transfer]], now: bool = False) -> None:
        """One launch for ``groups`` (each of one direction), after the screen answered what needs no copy;
        ``now``: the copy is made on the calling thread instead (the GIL released), its outcome a finished
        future, answered like a launched one."""
        put = self._out.put
        go: list[Transfer] = []
        to_host: list[bool] = []
        args: list[tuple[Any, ...]] = []
        for group in groups:
            ts: list[Transfer] = []
            for t, report in screen(group, self._nrows, self._nslots):
                if report is None:
                    ts.append(t)
                else:
                    put(report)
            if not ts:
                continue
            if len(ts) == 1:
                rows, slots = ts[0].rows, ts[0].slots
            else:
                rows, slots = [], []
                for t in ts:
                    rows += t.rows
                    slots += t.slots
            try:
                # exact ints only: the launcher's List[int] would take a one-element float tensor as its int()
                # (row 3 for tensor(3.5)); array("q") asks each for __index__, in C
                _ints(rows)
                _ints(slots)
                arg = list_args(slots, rows) if ts[0].kind is _STORE else list_args(rows, slots)
            except Exception as exc:   # noqa: BLE001 - rows that are not ints
                if len(ts) > 1:   # each started again alone: only the malformed one fails
                    for t in ts:
                        self._start([[t]], now)
                        self.retried += 1
                    continue
                put(Report(ts[0].token, ts[0].kind, False, f"copy failed: malformed transfer: {exc!r}"))
                continue
            to_host.append(ts[0].kind is _STORE)
            args.append(arg)
            go += ts
        if not go:
            return
        cols = list(zip(*args))   # per argument of copy_rows, one entry per group
        b = _Batch(go, time.perf_counter(), self._row_s)
        inflight = self._inflight
        try:
            # in the try: an interrupt as the append returns is answered by the handler below (an
            # unlaunched batch left in flight would never be answered, and close() would wait on it for ever);
            # before the launch: once that returned, an interrupt must not answer these
            inflight.append(b)
            if now:
                fut = torch.futures.Future()
                try:
                    with torch.jit.optimized_execution(False):   # this thread only: no profiling runs
                        fut.set_result(self._run(self._planes_now, to_host, *cols, self._stage_rows))
                except Exception as exc:   # noqa: BLE001 - the copy's own error, reported by harvest()
                    fut.set_exception(exc)
                b.futs.append(fut)   # (interrupted before: the copy is done, nothing lands later)
            else:
                b.futs.extend(starmap(self._launch, ((self._planes_held, to_host, *cols, self._stage_rows),)))
        except Exception as exc:
            if b in inflight:   # (not there where the append itself failed)
                inflight.remove(b)
            if len(go) > 1 and not now:
                # the launcher refused its arguments (a row that is not an int: TorchScript checks the lists'
                # types): each transfer is started again alone, so that only the malformed one fails
                for t in go:
                    self._start([[t]])
                    self.retried += 1
                return
            for t in go:
                put(Report(t.token, t.kind, False, f"copy failed to start: {exc!r}"))
            return
        except BaseException:
            if not b.futs and b in inflight:   # not launched: the caller answers its transfers (_answer_unstarted)
                inflight.remove(b)
            raise
        self.batches += 1

    def harvest(self) -> None:
        """Answer every batch whose copy has finished (in any order)."""
        inflight = self._inflight
        if not inflight:
            return
        for b in [b for b in inflight if b.futs and b.futs[0].done()]:
            try:
                b.futs[0].value()
            except Exception as exc:   # noqa: BLE001 - the copy's own error, reported
                self._failed(b, exc)
                continue
            self._answer(b)
            inflight.remove(b)   # after its reports: an interrupt in between answers it twice (the owner
            #                      discards the second as an unknown token), never not at all

    def _failed(self, b: _Batch, exc: Exception) -> None:
        """A batch whose copy raised leaves the batches in flight: one transfer is answered failed; several
        are started again one by one, so that each is answered by its own outcome (and none is copied
        twice).  Interrupted anywhere, each transfer is still answered: by this, by its new copy, or --
        interrupted before the batch left -- by the next harvest."""
        put, ts = self._out.put, b.transfers
        try:
            self._inflight.remove(b)   # first: its transfers are started again (or failed) exactly once below
            if len(ts) == 1:
                t = ts[0]
                put(Report(t.token, t.kind, False, f"copy failed: {_first_line(exc)}",
                           seconds=time.perf_counter() - b.started))
                return
            log.warning("a batched copy of %d transfers failed (%s); copying them one by one", len(ts),
                        _first_line(exc))
            for t in ts:
                self._start([[t]])
                self.retried += 1
        except BaseException:
            self._answer_unstarted(ts, f"copy failed: {_first_line(exc)}")
            raise

    def _answer(self, b: _Batch) -> None:
        put = self._out.put
        block = self._block_bytes
        per_row = (time.perf_counter() - b.started) / max(1, b.rows)
        for t in b.transfers:
            m = len(t.rows)
            put(Report(t.token, t.kind, True, None, m * block, m * per_row))

    def hold(self, on: bool) -> None:
        """Owner thread only.  While on, what is queued -- before the hold started too -- stays with the
        owner for :meth:`help_one`, which copies it itself (a lone 256 KiB load from the host tier, queued
        by ``load()`` and waited for at once, on the reference VM: 116-125 us when the hold handed it to
        an inter-op thread first, 54-55 us copied here, 45-60 us with the Python threads, whose owner
        copies it itself too); turning it off starts what is left."""
        self._holding = on
        if not on:
            self.flush()

    def help_one(self) -> bool:
        """Called by an owner that blocks.  What is held, up to :data:`~.thread.HELP_BYTES`, is copied here,
        on the calling thread (the GIL released): a copy handed to an inter-op thread and waited for costs
        two thread hand-offs more (a lone 256 KiB copy took 45 us so on the reference VM, 33 us copied
        here); more than that is started in the inter-op threads.  Then, with nothing held, wait for the
        oldest batch in flight and answer what has finished.  False when nothing is held or in flight."""
        held = self._held
        if len(held) == 1 and rows_len(held[0]) <= FEW_ROWS and self._fast is not None:
            self._memmove_one(held)
            return True
        if held:
            if sum(map(rows_len, held)) * self._block_bytes <= HELP_BYTES:
                self._start_held(now=True)
                self.harvest()
                return True
            self._start_held(now=False)
        if not self._inflight:
            return False
        self._wait_oldest(HELP_WAIT_S)
        self.harvest()
        return True

    def needs_harvest(self) -> bool:
        """Owner thread only: a transfer is held or its batch in flight (nothing else ends unseen)."""
        return bool(self._held or self._inflight)

    def _wait_oldest(self, timeout: Optional[float]) -> None:
        """Wait until the oldest batch's copy ends, at most ``timeout`` seconds (None: for as long as it
        takes).  A torch future has no timed wait, and a Python done-callback would not do: torch runs it, and
        drops it, on the inter-op thread that completed the future -- after the future reads done -- taking the
        GIL there; a process that ends meanwhile aborts ("terminate called without an active exception": the
        thread meets a finalizing interpreter).  So a timed wait asks the future, pausing a little longer each
        time (:data:`POLL_MIN_S`, :data:`POLL_MAX_S`)."""
        b = self._inflight[0]
        fut = b.future
        if fut is None or fut.done():
            return
        if timeout is None:
            try:
                fut.wait()
            except Exception:   # noqa: BLE001 - its error is reported by harvest()
                pass
            return
        done, clock, sleep = fut.done, time.perf_counter, time.sleep
        now = before = clock()
        deadline = now + timeout
        while not done():
            left = deadline - now
            if left <= 0:
                return
            pause = b.expect - now
            if pause >= POLL_MIN_S:
                if pause <= left:   # this sleep reaches it: an estimate far off costs one such sleep per batch
                    b.expect = 0.0
            else:
                pause = b.poll_s
                b.poll_s = min(2 * pause, POLL_MAX_S)
            sleep(min(left, pause))
            before, now = now, clock()
        if b.rows and now > before:
            # it ended between the last two looks: the middle, per row, is what the next batches' first sleeps
            # go by -- taken at once when it is lower (an estimate too high only delays), at most doubling the
            # estimate when higher (one stalled copy must not hold back the waits after it)
            seen, est = ((before + now) / 2 - b.started) / b.rows, self._row_s
            self._row_s = seen if not est or seen < est else 0.7 * est + 0.3 * min(seen, 2 * est)

    def _memmove_one(self, held: collections.deque[Transfer]) -> None:
        """The one held transfer of at most :data:`~.thread.FEW_ROWS` rows, copied here with ``memmove``
        (the GIL released) and answered: a lone load's row copy (2 MiB: 88-90 us, against 132-134 us through the
        compiled copy, whose ``copy_`` wakes torch's intra-op threads; ``benchmarks/breakdown.py promote``).
        Taken off the queue first, so never copied twice; an interrupt answers it failed (a second answer
        after its real one is discarded by the owner as an unknown token)."""
        t = held[0]
        put = self._out.put
        fast = self._fast
        assert fast is not None
        try:
            held.popleft()   # taken inside the try: an interrupt from here on answers it
            report = copy_one(t, self._nrows, self._nslots, self._block_bytes, lambda x: memmove_rows(fast, x))
            put(report)
        except BaseException as exc:
            if held and held[0] is t:   # not taken yet: still held, copied and answered later
                raise
            put(Report(t.token, t.kind, False, f"copy interrupted: {exc!r}"))
            raise

    def close(self) -> None:
        """Start what is queued and answer everything in flight once its copy is done."""
        if self._closed:
            return
        self._holding = False
        self.flush()
        while self._inflight:
            self._wait_oldest(None)
            self.harvest()
        self._closed = True


_ints = functools.partial(array, "q")   # a list of exact ints, or TypeError naming what is not one


def _first_line(exc: BaseException) -> str:
    """A TorchScript error's type and last line: the error itself (the lines before it are the script's
    traceback)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"
