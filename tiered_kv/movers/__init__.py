"""Movers: the parts that copy bytes between device rows and host slots.  They never touch the owner's maps.

* :mod:`.base` -- the messages (:class:`Transfer`, :class:`Report`), the :class:`CompletionQueue`,
  the :class:`Mover` base class every mover subclasses (the owner calls its methods
  unconditionally) and :class:`ImmediateMover` (answers at once, copies nothing).
* :mod:`.thread` -- :class:`ThreadMover`: worker threads, ``memmove``; used without CUDA.
* :mod:`.cuda` -- :class:`CudaMover`: CUDA streams and events, harvested by ``query()``.
* :mod:`.torch_cuda` -- :class:`TorchCuda`: the CUDA calls ``CudaMover`` makes, through torch (a
  simulated device stands in for it in the tests).

:func:`make_mover` picks one for a set of planes.
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import CompletionQueue, ImmediateMover, Mover, Plane, Report, Transfer
from .cuda import EVENT_BYTES, CudaMover
from .thread import CATCH_UP_S, ThreadMover
from .torch_cuda import TorchCuda

__all__ = ["Transfer", "Report", "CompletionQueue", "Mover", "ImmediateMover", "Plane", "ThreadMover", "CudaMover",
           "TorchCuda", "EVENT_BYTES", "make_mover"]


def make_mover(planes: Sequence[Plane], completions: CompletionQueue, num_workers: int, num_streams: int,
               batch_max: int) -> Mover:
    """A :class:`CudaMover` when the planes' device rows are on a CUDA device, else a :class:`ThreadMover`."""
    if planes and planes[0][0].is_cuda:  # pragma: no cover - needs CUDA
        return CudaMover(planes, completions, num_streams, batch_max=batch_max)
    return ThreadMover(planes, completions, num_workers, batch_max=batch_max, catch_up_s=CATCH_UP_S)
