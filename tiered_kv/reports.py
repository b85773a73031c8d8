"""The answers workers send the owner: :class:`Report`, and the :class:`CompletionQueue` they travel on.

Shared by the copy movers (``movers/``) and the disk store (``disk/``); free of torch, so that the
disk I/O process (:mod:`tiered_kv.disk.proc`) imports it without the engine's dependencies.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any, Optional

from .jobs import JobKind

__all__ = ["Report", "CompletionQueue", "get_within"]


@dataclass(slots=True)
class Report:
    """A worker's one answer for one token: ``ok`` only if every copy of the transfer succeeded;
    ``nbytes``: all bytes it moved.

    A job of several parts answered as one (the disk writer's spill groups): ``failed`` maps each
    part that failed to its error, the others succeeded; ``None`` when every part shares ``ok`` and
    ``error``."""

    token: Any
    kind: JobKind
    ok: bool
    error: Optional[str] = None
    nbytes: int = 0
    seconds: float = 0.0
    failed: Optional[dict[int, str]] = None


class CompletionQueue:
    """Multi-producer, single-consumer queue of reports (movers -> owner)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def put(self, item: Any) -> None:
        self._q.put(item)

    def put_many(self, items: list[Any]) -> None:
        """``put`` of each of ``items``, in order (a queue that sends them on may send them together)."""
        put = self.put
        for it in items:
            put(it)

    def drain(self) -> list[Any]:
        """Every report queued so far (one consumer: ``qsize()`` items are there to take)."""
        q = self._q
        n = q.qsize()
        if not n:
            return []
        get = q.get_nowait
        return [get() for _ in range(n)]

    def get(self, timeout: Optional[float]) -> Optional[Any]:
        """The next report, waiting at most ``timeout`` seconds (None: for ever); None when none came."""
        try:
            return get_within(self._q, timeout)
        except queue.Empty:
            return None


def get_within(q: "queue.SimpleQueue[Any]", timeout: Optional[float]) -> Any:
    """``q.get(timeout=timeout)`` (None: block; <= 0: do not wait) that keeps its timeout.

    CPython's ``SimpleQueue.get`` (3.11, and its source through 3.13 at least) can block for ever on an
    empty queue when given a timeout: if it finds its lock free, it takes it, then recomputes the time
    left; when the timeout has passed meanwhile by a microsecond or more (the thread was preempted, or
    the timeout is that short), the time left is negative, and a negative wait on that lock is unbounded:
    released only by the next ``put()``, which never comes when the waiting thread is the one that
    would cause it (the CUDA mover's reports).  The lock is free after a ``get`` that found an item.
    ``get_nowait()`` on an empty queue takes the lock and returns at once, so that the timed ``get``
    after it finds the lock held and waits on it with the positive timeout; a ``put()`` in between
    leaves an item, which the timed ``get`` takes without waiting.  One consumer per queue."""
    if timeout is None:
        return q.get()
    try:
        return q.get_nowait()
    except queue.Empty:
        if timeout <= 0:
            raise
        return q.get(timeout=timeout)
