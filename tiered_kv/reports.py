"""The answers workers send the owner: :class:`Report`, and the :class:`CompletionQueue` they travel on.

Shared by the copy movers (``movers/``) and the disk store (``disk/``); free of torch, so that the
disk I/O process (:mod:`tiered_kv.disk.proc`) imports it without the engine's dependencies.
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
import queue
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .jobs import JobKind

__all__ = ["Report", "CompletionQueue", "get_within", "drain_into"]


@dataclass(slots=True)
class Report:
    """A worker's one answer for one token: ``ok`` only if every copy of the transfer succeeded;
    ``nbytes``: all bytes it moved.

    A job of several parts answered as one (the disk writer's spill groups): ``failed`` maps each
    part that failed to its error, the others succeeded; ``None`` when every part shares ``ok`` and
    ``error``.

    ``where``: a disk spill's written records, one int per part (``disk.format.where_of``; 0 for a
    part not written), so that the owner can read a block the page cache holds without asking the
    disk I/O side where it is; ``None`` from every other worker."""

    token: Any
    kind: JobKind
    ok: bool
    error: Optional[str] = None
    nbytes: int = 0
    seconds: float = 0.0
    failed: Optional[dict[int, str]] = None
    where: Optional[list[int]] = None


class CompletionQueue:
    """Multi-producer, single-consumer queue of reports (movers -> owner)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # reports a timed get took off the queue when a signal handler raised (see get_within): served first
        self._kept: collections.deque[Any] = collections.deque()

    def put(self, item: Any) -> None:
        self._q.put(item)

    def put_many(self, items: list[Any]) -> None:
        """``put`` of each of ``items``, in order (a queue that sends them on may send them together)."""
        put = self.put
        for it in items:
            put(it)

    def drain(self) -> list[Any]:
        """Every report queued so far (one consumer: ``qsize()`` items are there to take)."""
        kept = self._kept
        if kept:
            return [kept.popleft() for _ in range(len(kept))] + self.drain()
        q = self._q
        n = q.qsize()
        if not n:
            return []
        get = q.get_nowait
        return [get() for _ in range(n)]

    def arrived(self) -> "collections.deque[Any]":
        """Every report queued so far, moved in C to the end of the kept deque, which is returned: the consumer
        takes each off its front once applied, so that an interrupt loses none (:func:`drain_into`)."""
        kept = self._kept
        drain_into(kept, self._q)
        return kept

    def wait(self, timeout: Optional[float]) -> bool:
        """Wait at most ``timeout`` seconds (None: for ever) until a report is there; it is left queued, at the
        front of the kept deque (:meth:`arrived` takes it with the rest).  False when none came."""
        if self._kept:
            return True
        try:
            get_within(self._q, timeout, self._kept, leave=True)
        except queue.Empty:
            return False
        return True

    def get(self, timeout: Optional[float]) -> Optional[Any]:
        """The next report, waiting at most ``timeout`` seconds (None: for ever); None when none came."""
        if self._kept:
            return self._kept.popleft()
        try:
            return get_within(self._q, timeout, self._kept)
        except queue.Empty:
            return None


_SLICE_S = 0.05
"""A timed wait runs in slices of at most this long, asynchronous signals held off during each (below):
a Ctrl-C or another handler waits for the end of the slice, at most this long."""

_SYNCHRONOUS = ("SIGKILL", "SIGSTOP", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGSYS", "SIGABRT")
_HELD_OFF = (frozenset(int(s) for s in signal.valid_signals()) - {int(getattr(signal, n)) for n in _SYNCHRONOUS
                                                                   if hasattr(signal, n)}
             if hasattr(signal, "pthread_sigmask") else frozenset())

try:
    # CPython's C function.  ``signal.pthread_sigmask`` wraps it only to turn each signal of the mask it
    # returns into a ``Signals`` enum member: about 100 us a call (the old mask holds every held-off
    # signal), most of a report's wake-up on the owner thread, paid by every timed wait
    from _signal import pthread_sigmask as _sigmask
except ImportError:   # another Python: the public one
    _sigmask = getattr(signal, "pthread_sigmask", None)


_NOTHING = object()


def get_within(q: "queue.SimpleQueue[Any]", timeout: Optional[float],
               kept: "Optional[collections.deque[Any]]" = None, leave: bool = False) -> Any:
    """``q.get(timeout=timeout)`` (None, or longer than a lock can wait: block; <= 0: do not wait) that
    keeps its timeout.

    CPython's ``SimpleQueue.get`` (3.11, and its source through 3.13 at least) can block for ever on an
    empty queue when given a timeout: whenever its loop recomputes the time left and finds it negative,
    its next wait on the queue's lock has no limit, released only by the next ``put()``, which never
    comes when the waiting thread is the one that would cause it (the CUDA mover's reports).  It
    recomputes in two cases.  (1) It finds the lock free (it is, after a ``get`` that found an item),
    takes it, and the timeout passed meanwhile (the thread was preempted, or the timeout is that short):
    ``get_nowait()`` on an empty queue takes the lock and returns at once, so the timed ``get`` after it
    finds the lock held and waits on it with the positive timeout (a ``put()`` in between leaves an
    item, which it takes without waiting).  (2) A signal interrupts the wait, and its Python handler
    runs past the time left: each timed ``get`` runs with the asynchronous signals held off
    (``pthread_sigmask``, this thread only), for at most :data:`_SLICE_S`; they are delivered between
    two slices.  One consumer per queue.

    The signals held off during a slice are delivered when it ends, that is right after its ``get``
    took an item, if it did: a handler that raises there (Ctrl-C's ``KeyboardInterrupt``) would drop
    the item taken.  With ``kept`` (the consumer's deque, empty, of items to take before the queue's),
    the item goes there before the signals are let in and is taken back from it afterwards: an
    exception from a handler leaves it in ``kept`` for the consumer's next call.  With ``leave`` too, it
    stays there (``kept[0]``, returned): the consumer pops it once it recorded it, so that no handler can
    drop it in between either."""
    if kept is not None:
        if timeout is None or timeout > threading.TIMEOUT_MAX:
            return _into(kept, q.get, leave)
        try:
            return _into(kept, q.get_nowait, leave)
        except queue.Empty:
            if timeout <= 0:
                raise
    elif timeout is None or timeout > threading.TIMEOUT_MAX:
        return q.get()
    else:
        try:
            return q.get_nowait()
        except queue.Empty:
            if timeout <= 0:
                raise
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise queue.Empty
        old = _sigmask(signal.SIG_BLOCK, _HELD_OFF) if _HELD_OFF else None
        got = _NOTHING
        try:
            if kept is None:
                got = q.get(timeout=min(left, _SLICE_S))
            else:   # straight into kept, and left there until the signals held off were handled below
                _keep(kept, functools.partial(q.get, True, min(left, _SLICE_S)))
        except queue.Empty:
            pass
        finally:
            if old is not None:
                _sigmask(signal.SIG_SETMASK, old)   # a signal that came meanwhile is handled now
        if kept is not None:
            if kept:
                return kept[0] if leave else kept.popleft()
        elif got is not _NOTHING:
            return got
        try:   # and the lock is held again before the next timed get (case 1)
            return q.get_nowait() if kept is None else _into(kept, q.get_nowait, leave)
        except queue.Empty:
            pass


_CALL = operator.methodcaller("__call__")   # f -> f(), in C


def _keep(kept: "collections.deque[Any]", take: Callable[[], Any]) -> None:
    """Append ``take()``'s item to ``kept`` in C, before any Python code runs: a Python signal handler runs
    between two bytecodes (on the main thread, also for a signal another thread received), and one that
    raises there would drop an item held only by a Python frame.  No comparison either: ``iter(take,
    sentinel)`` compares each item with the sentinel, which runs a dataclass's ``__eq__`` (a
    :class:`Report`'s) -- Python code, between the take and the append."""
    kept.extend(map(_CALL, (take,)))


def drain_into(kept: "collections.deque[Any]", q: "queue.SimpleQueue[Any]") -> None:
    """Append every item ``q`` holds now to ``kept``, by C calls alone (as :func:`_keep`): however a signal
    handler interrupts, each item taken is in ``kept``."""
    try:
        kept.extend(map(_CALL, itertools.repeat(q.get_nowait)))
    except queue.Empty:
        pass


def _into(kept: "collections.deque[Any]", take: Callable[[], Any], leave: bool = False) -> Any:
    """``take()``'s item, kept (:func:`_keep`) then taken back from the front of ``kept``: an exception from
    a handler in between leaves it there for the consumer's next call.  ``leave``: left there too."""
    _keep(kept, take)
    return kept[0] if leave else kept.popleft()
