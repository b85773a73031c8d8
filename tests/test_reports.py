"""The completion queue's timed wait keeps its timeout (CPython's ``SimpleQueue.get(timeout=...)`` does not).

The hang this guards: the owner thread of a CUDA mover blocked in ``wait()`` asks the queue for a report
with a 0.5 ms timeout, between two queries of its own copy events; the reports come only from those
queries, so a ``get`` that never returns stops the engine for good (seen in CI, under load).
"""

from __future__ import annotations

import queue
import threading

import pytest

from tiered_kv.reports import CompletionQueue, get_within

# A liveness bound, not a timing assert: the loops below take milliseconds; the bug blocks for ever.
_HANG_S = 120.0


def _finishes(fn) -> bool:
    """Run ``fn`` on a daemon thread; whether it returned within the liveness bound (a thread blocked in
    C with the GIL released is left behind as a daemon)."""
    done = threading.Event()
    err: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # pragma: no cover - reported below
            err.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name="get-within-probe").start()
    finished = done.wait(_HANG_S)
    if err:
        raise err[0]
    return finished


def test_a_timed_get_after_a_drained_report_times_out_instead_of_blocking_for_ever() -> None:
    """The sequence that hangs ``SimpleQueue.get(timeout=1e-6)`` on every CPython with ``_queue``: a report
    put and drained (the queue's lock is left free), then a timed get on the empty queue whose microsecond
    passes before it recomputes the time left."""
    q = CompletionQueue()

    def loop() -> None:
        for i in range(5000):
            q.put(i)
            assert q.drain() == [i]
            assert q.get(1e-6) is None
            q.put(i)
            assert q.get(1e-6) == i   # an item taken by the timed get frees the lock too
            assert q.get(1e-6) is None

    assert _finishes(loop), "CompletionQueue.get(timeout) blocked on an empty queue past its timeout"


def test_the_copier_queue_helper_keeps_the_timeout_on_a_plain_simple_queue() -> None:
    q: "queue.SimpleQueue[int]" = queue.SimpleQueue()

    def loop() -> None:
        for i in range(5000):
            q.put(i)
            assert q.get_nowait() == i
            with pytest.raises(queue.Empty):
                get_within(q, 1e-6)

    assert _finishes(loop), "get_within blocked on an empty queue past its timeout"


def test_get_within_takes_an_item_at_once_and_does_not_wait_on_zero_or_negative_timeouts() -> None:
    q: "queue.SimpleQueue[str]" = queue.SimpleQueue()
    for t in (0, -1.0, 0.0):
        with pytest.raises(queue.Empty):
            get_within(q, t)
    q.put("a")
    q.put("b")
    assert get_within(q, 0) == "a"
    assert get_within(q, 5.0) == "b"
    with pytest.raises(queue.Empty):
        get_within(q, 1e-3)


def test_get_within_none_blocks_until_a_producer_puts() -> None:
    q: "queue.SimpleQueue[int]" = queue.SimpleQueue()
    got: list[int] = []
    ready = threading.Barrier(2)

    def consumer() -> None:
        ready.wait()
        got.append(get_within(q, None))

    t = threading.Thread(target=consumer)
    t.start()
    ready.wait()
    q.put(7)   # before or after the consumer blocks: it gets it either way
    t.join(_HANG_S)
    assert got == [7]


def test_completion_queue_get_returns_none_when_nothing_came_and_the_report_when_one_did() -> None:
    q = CompletionQueue()
    assert q.get(0) is None and q.get(1e-4) is None
    q.put("r")
    assert q.get(None) == "r"
    q.put("s")
    assert q.get(0.0) == "s"


def test_a_handler_that_raises_inside_an_items_eq_never_drops_the_item() -> None:
    """What it proved wrong (found by round 28's interrupt sweep, ``tests/test_review_round28.py``): ``_keep`` and
    the vLLM copier's drain took items with ``iter(take, sentinel)``, which compares each item with the sentinel;
    for a :class:`Report` (a dataclass) that runs its ``__eq__``, Python code in which a signal handler may run,
    between the take and the append.  A ``KeyboardInterrupt`` there dropped the item.  Fixed: items are taken and
    appended by C calls alone (``map`` of a C caller), with no comparison (``_keep``, ``drain_into``).  Here the
    item's ``__eq__`` raises, as the handler would."""
    import collections

    from tiered_kv.reports import drain_into

    class Touchy:
        def __eq__(self, other: object) -> bool:
            raise KeyboardInterrupt("a handler ran in __eq__")

        __hash__ = object.__hash__

    q: queue.SimpleQueue = queue.SimpleQueue()
    kept: collections.deque = collections.deque()
    first = Touchy()
    q.put(first)
    assert get_within(q, 0.5, kept) is first and not kept
    items = [Touchy() for _ in range(3)]
    for it in items:
        q.put(it)
    drain_into(kept, q)
    assert [id(x) for x in kept] == [id(x) for x in items]   # (by identity: == would run __eq__)
    assert q.empty()
