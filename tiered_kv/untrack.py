"""Taking per-block objects out of the cyclic garbage collector's sight.

The core makes one or two small objects per block that live as long as the block is cached: an index
:class:`~tiered_kv.core.index.Entry`, and the spill's :class:`uuid.UUID` token it keeps.  They are
freed by reference counting like any object, but CPython's collector also tracks them, because their
classes could in principle hold containers.  A process whose tiers cache tens of thousands of blocks
then makes the collector walk them while the tiers fill, and a full collection walks them all.  On the
reference VM, in the bench's engine step (``tiered-kv bench --sections step --quick``, whose heap from
start-up is frozen with ``gc.freeze()`` as vLLM's engine freezes its own), the collector took 42-43 us
a step and its full collection 9-10 ms; untracked, 12-19 us and 3-7 ms.  In a process that never froze
its start-up heap (the same step called directly) it took 159-207 us a step, and one 77-104 ms full
collection per 700 steps; untracked, 8-10 us and none.

Neither kind can be part of a reference cycle: an ``Entry`` refers only to bytes, ints, bools, an enum
member and a token, and a token only to an int and an enum member (``tests/test_untrack.py`` keeps them
so).  :func:`untrack` therefore tells the collector to forget such an object (``PyObject_GC_UnTrack``,
what CPython itself does for tuples and dicts of atomic values): it is still freed the moment its last
reference goes.  Elsewhere than CPython it does nothing.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, Callable

__all__ = ["untrack", "make_untrack"]


def _nothing(obj: Any) -> None:
    return None


def make_untrack(implementation: str = sys.implementation.name) -> Callable[[Any], None]:
    """CPython's ``PyObject_GC_UnTrack`` as a Python callable, the GIL held through the call (a
    ``PYFUNCTYPE`` prototype of our own: the shared ``ctypes.pythonapi`` attribute is not changed);
    elsewhere, or without the symbol, a function that does nothing."""
    if implementation != "cpython":
        return _nothing
    try:
        return ctypes.PYFUNCTYPE(None, ctypes.py_object)(("PyObject_GC_UnTrack", ctypes.pythonapi))
    except (AttributeError, OSError):   # pragma: no cover - a CPython built without the C API exported
        return _nothing


untrack: Callable[[Any], None] = make_untrack()
"""``untrack(obj)``: the collector stops tracking ``obj``, an instance of a class defined in Python (a
type the collector knows: never an int, bytes or other atomic object, whose memory has no collector
header) that must never be part of a reference cycle.  Calling it again on the same object is harmless."""
