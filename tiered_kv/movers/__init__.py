"""Movers: the parts that copy bytes between device rows and host slots.  They never touch the owner's maps.

* :mod:`.base` -- the messages (:class:`Transfer`, :class:`Report`), the :class:`CompletionQueue`,
  the :class:`Mover` base class every mover subclasses (the owner calls its methods
  unconditionally) and :class:`ImmediateMover` (answers at once, copies nothing).
* :mod:`.native` -- :class:`NativeMover`: a step's copies as torch index ops in torch's inter-op
  threads, which never take the GIL; the default without CUDA.
* :mod:`.thread` -- :class:`ThreadMover`: Python worker threads; without CUDA where the native
  mover does not fit (or is not chosen), and the vLLM worker's copier (one thread: jobs in order).
* :mod:`.cuda` -- :class:`CudaMover`: CUDA streams and events, harvested by ``query()``.
* :mod:`.torch_cuda` -- :class:`TorchCuda`: the CUDA calls ``CudaMover`` makes, through torch (a
  simulated device stands in for it in the tests).

:func:`make_mover` picks one for a set of planes.
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import CompletionQueue, ImmediateMover, Mover, Plane, Report, Transfer
from .cuda import EVENT_BYTES, CudaMover
from .native import NativeMover, native_available, native_fits
from .thread import CATCH_UP_S, ThreadMover
from .torch_cuda import TorchCuda

__all__ = ["Transfer", "Report", "CompletionQueue", "Mover", "ImmediateMover", "Plane", "ThreadMover", "CudaMover",
           "TorchCuda", "NativeMover", "EVENT_BYTES", "make_mover"]


def make_mover(planes: Sequence[Plane], completions: CompletionQueue, num_workers: int, num_streams: int,
               batch_max: int, cpu_mover: str = "native") -> Mover:
    """A :class:`CudaMover` when the planes' device rows are on a CUDA device; else, with ``cpu_mover="native"``,
    a :class:`NativeMover` where this torch has TorchScript and its views fit the rows; else a :class:`ThreadMover`."""
    if planes and planes[0][0].is_cuda:  # pragma: no cover - needs CUDA
        return CudaMover(planes, completions, num_streams, batch_max=batch_max)
    if cpu_mover == "native" and native_fits(planes) and native_available():
        return NativeMover(planes, completions, batch_max=batch_max)
    return ThreadMover(planes, completions, num_workers, batch_max=batch_max, catch_up_s=CATCH_UP_S)
