"""What every mover shares: the messages (:class:`Transfer` in, :class:`Report` out), the
:class:`CompletionQueue` reports travel on, and the :class:`Mover` base class the owner calls.

A mover copies bytes between one or more *planes*: pairs ``(device_rows, host_rows)`` of
tensors whose rows are blocks (``TierManager``: the engine's ``[num_blocks, row_bytes]`` view
and the host slab; the vLLM worker: one pair per KV tensor, each mapped onto its byte region of
the slab rows).  A transfer copies ``rows[i] <-> slots[i]`` for every ``i`` over every plane, and
is answered by exactly one report, whatever happens to its copies.  Movers never touch the
owner's maps: ``(token, what to move)`` in, ``(token, outcome)`` out.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..jobs import JobKind
from ..reports import CompletionQueue, Report

__all__ = ["Transfer", "Report", "CompletionQueue", "Mover", "ImmediateMover", "Plane"]

Plane = tuple[torch.Tensor, torch.Tensor]
"""``(device_rows, host_rows)``: row ``r`` of the first and row ``s`` of the second hold one block's bytes."""


@dataclass(slots=True)
class Transfer:
    """One job's copies: ``rows[i] <-> slots[i]`` for every ``i``, over every plane of the mover.

    ``token`` is opaque to the mover and comes back in the report (``TierManager``: the job's UUID;
    the vLLM copier: its job record).  ``cancelled`` is a hint the owner may set so that a worker
    that has not started skips the copies.  ``taken``: set by ``submit`` right before the call that queues
    it, with no call between (an interrupt lands at a call's return), so that an owner whose submit was
    interrupted knows whether the mover answers it (True) or it must be answered for it."""

    token: Any
    kind: JobKind  # STORE: device rows -> host slots; LOAD: host slots -> device rows
    rows: list[int]
    slots: list[int]
    cancelled: bool = False
    taken: bool = False


class Mover(abc.ABC):
    """What the owner calls on a mover; every method is called unconditionally.

    * ``submit(t)`` (owner thread): take a transfer; it is answered by exactly one
      :class:`Report` on the mover's completion queue.  Sets ``t.taken`` right before the call that
      queues it (see :class:`Transfer`).
    * ``harvest()``: answer what finished since the last call.  Movers whose reports appear
      only here set ``polled = True``; the default does nothing.
    * ``flush()``: start the transfers the mover queued (one that batches what ``submit``
      gets); the owner calls it at the end of every poll.  Default: nothing to start.
    * ``hold(on)``: while on, transfers submitted are left for :meth:`help_one` (no worker is
      woken); off, what is left goes to the workers.  The owner turns it on while it blocks,
      off in a ``finally``.  Default: nothing is held.
    * ``help_one() -> bool``: run one queued transfer on the calling (owner) thread and answer
      it like any other; False when there is none.  Default: False.
    * ``needs_harvest() -> bool``: a polled mover has a transfer whose end only ``harvest()`` sees, so
      an owner that blocks must wake to harvest it.  Default: ``polled``.
    * ``close()``: finish or answer everything submitted, then release the workers.
    """

    polled: bool = False  # True when reports appear only through harvest()

    @abc.abstractmethod
    def submit(self, t: Transfer) -> None: ...

    def harvest(self) -> None:
        return None

    def flush(self) -> None:
        return None

    def hold(self, on: bool) -> None:
        return None

    def help_one(self) -> bool:
        return False

    def needs_harvest(self) -> bool:
        return self.polled

    @abc.abstractmethod
    def close(self) -> None: ...


class ImmediateMover(Mover):
    """Answers each transfer at once, ok, on the submitting thread, without copying: the owner sees
    its jobs complete in the order it submitted them, whatever the machine's timing.  For work where
    the rows carry no data: ``tiered-kv replay`` (hit ratios that depend only on the trace) and the
    control path's benchmarks."""

    polled = False

    def __init__(self, device_rows: torch.Tensor, host_rows: torch.Tensor, completions: CompletionQueue) -> None:
        self._put = completions.put
        self._nbytes = host_rows[0].numel() * host_rows.element_size()   # a row's bytes, whatever its shape

    def submit(self, t: Transfer) -> None:
        t.taken = True
        self._put(Report(t.token, t.kind, True, None, len(t.rows) * self._nbytes, 0.0))

    def close(self) -> None:
        return None


def check_planes(planes: Sequence[Plane]) -> tuple[list[Plane], int]:
    """The planes as a list and the bytes one block copy moves over all of them (host row bytes)."""
    out = list(planes)
    if not out:
        raise ValueError("a mover needs at least one (device_rows, host_rows) plane")
    return out, sum(h[0].numel() * h.element_size() for _, h in out)


def rows_in_range(planes: Sequence[Plane]) -> tuple[int, int]:
    """The device rows and host slots every plane has: a transfer may name ``0 <= row, slot`` below these."""
    return min(int(d.shape[0]) for d, _ in planes), min(int(h.shape[0]) for _, h in planes)


def transfer_error(t: Transfer, nrows: int, nslots: int) -> Optional[str]:
    """Why ``t`` cannot be copied (rows and slots of different lengths, a row or slot out of range), or None.
    Checked before any copy of it: a slice past the end is silently short, an index past it faults a device.
    Raises TypeError where the rows or slots do not compare as numbers (:func:`.thread.screen` and the CUDA
    mover answer that transfer alone).  Their type is not checked here, on the engine thread's path per
    transfer: a row that is not an int fails where it is used (an index or a slice refuses it; every list of
    rows that becomes an index goes through ``array("q")``, which refuses a float, where ``torch.tensor``
    would truncate 1.5 to row 1)."""
    rows, slots = t.rows, t.slots
    if len(rows) != len(slots):
        return f"copy failed: {len(rows)} rows for {len(slots)} slots"
    if rows and not (0 <= min(rows) and max(rows) < nrows and 0 <= min(slots) and max(slots) < nslots):
        return f"copy failed: a row or slot out of range ({nrows} rows, {nslots} slots)"
    return None


def is_run(idx: list[int]) -> bool:
    """Whether ``idx`` is ``i0, i0 + 1, ...`` (compared in C)."""
    i0 = idx[0]
    return idx[-1] - i0 == len(idx) - 1 and idx == list(range(i0, i0 + len(idx)))


def rows_view(t: torch.Tensor) -> Optional[torch.Tensor]:
    """``t``'s rows as ``[rows, row bytes]`` uint8 without a copy, or None when torch cannot view them so
    (the bytes of a row need not be consecutive: callers check ``stride(1)`` where it matters)."""
    try:
        return t.view(int(t.shape[0]), -1).view(torch.uint8)
    except RuntimeError:
        return None


def byte_rows(dev: torch.Tensor, host: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A plane's rows for a copy row by row that moves bytes, never values: both sides as byte rows where
    torch can view them so (:func:`rows_view`), else the plane as it is when both sides hold the same
    elements (``copy_`` then converts nothing); a plane that is neither raises ValueError (an fp8 or
    bf16 row beside uint8 host bytes would be converted value by value)."""
    d, h = rows_view(dev), rows_view(host)
    if d is not None and h is not None and d.shape[1] == h.shape[1]:
        return d, h
    if dev.dtype == host.dtype and dev[0].shape == host[0].shape:
        return dev, host
    raise ValueError(f"a plane of {dev.dtype} rows {tuple(dev.shape[1:])} (strides {dev.stride()}) and {host.dtype} "
                     f"rows {tuple(host.shape[1:])} cannot be copied byte for byte")


def widen(rows: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Byte rows (:func:`rows_view`) viewed as elements of ``dtype``, or None where they do not fit: the
    width, the row stride and the start must be multiples of the element (torch also checks the
    storage offset)."""
    w = torch.empty((), dtype=dtype).element_size()
    if int(rows.shape[1]) % w or rows.stride(0) % w or rows.data_ptr() % w:
        return None
    try:
        return rows.view(dtype)
    except RuntimeError:
        return None
