"""The answers workers send the owner: :class:`Report`, and the :class:`CompletionQueue` they travel on.

Shared by the copy movers (``movers/``) and the disk store (``disk/``); free of torch, so that the
disk I/O process (:mod:`tiered_kv.disk.proc`) imports it without the engine's dependencies.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any, Optional

from .jobs import JobKind

__all__ = ["Report", "CompletionQueue"]


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
