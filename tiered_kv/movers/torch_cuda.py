"""TorchCuda: the CUDA calls :class:`~tiered_kv.movers.cuda.CudaMover` makes, through torch.

Kept apart from the mover's logic so that a simulated device (``tests/fake_cuda.py``) can stand in for
it; everything here needs a GPU to run (``tests/test_cuda.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

__all__ = ["TorchCuda"]


def _copy_non_blocking(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


class _TorchOps:  # pragma: no cover - needs CUDA (tests/test_cuda.py)
    """The calls one batch makes on its stream (current while the batch is queued): ``copy``
    (``copy_(non_blocking=True)``), ``gather``/``scatter`` (``index_select``/``index_copy_`` on the device)
    and ``index`` (a list of row numbers as a device tensor, uploaded from pinned memory on the stream:
    torch's pinned-memory allocator keeps the buffer until that copy has run)."""

    __slots__ = ("device",)
    copy = staticmethod(_copy_non_blocking)

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @staticmethod
    def gather(out: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
        torch.index_select(src, 0, index, out=out)

    @staticmethod
    def scatter(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        dst.index_copy_(0, index, src)

    def index(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(self.device, non_blocking=True)


class TorchCuda:  # pragma: no cover - needs CUDA (tests/test_cuda.py)
    """The CUDA calls :class:`CudaMover` makes, through torch.

    The mover goes through an object with these methods (``synchronize`` is
    for the benchmarks only), so that a simulated device
    (``tests/fake_cuda.py``: streams as queues of operations that run when and
    in the order a test says) can stand in for the GPU and the mover's own
    logic is tested without one.  A stream needs ``synchronize()``; an event
    ``record(stream)``, ``query()`` and ``elapsed_time(end)`` (ms).
    ``order_after(stream, other)`` does what ``stream.wait_stream(other)`` does,
    with a reused event.
    """

    def __init__(self) -> None:
        self._order: dict[Any, Any] = {}  # copy stream -> its ordering event (no timing), re-recorded per batch

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def order_after(self, stream: Any, other: Any) -> None:
        """Make work queued on ``stream`` from now on wait for everything queued on ``other`` so far: torch's
        ``wait_stream`` with one event per stream, recorded again each time (a wait takes the record that is
        current when the wait is queued), instead of an event created, recorded and destroyed per call."""
        ev = self._order.get(stream)
        if ev is None:
            ev = self._order[stream] = torch.cuda.Event()
        ev.record(other)
        stream.wait_event(ev)

    def new_event(self) -> Any:
        return torch.cuda.Event(enable_timing=True)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    @contextlib.contextmanager
    def copies_on(self, stream: Any) -> Iterator[_TorchOps]:
        """``stream`` made current once for a batch of copies; yields the calls the batch makes on it
        (``copy(dst, src)``, ``gather(out, src, index)``, ``scatter(dst, index, src)``, ``index(values)``)."""
        with torch.cuda.stream(stream):
            yield _TorchOps(stream.device)

    def strided_index_ops(self, device: torch.device) -> bool:
        """Whether ``index_select`` into, and ``index_copy_`` from, a column slice of a device tensor give the right
        bytes here and touch no other column, for 8-byte and 1-byte elements: what :class:`~.cuda.CudaMover` does
        with the staging rows of planes side by side in one host row.  Probed once per mover, at its start, on a few
        rows (it waits for them)."""
        try:
            for dtype in (torch.int64, torch.uint8):
                src = (torch.arange(1, 25, device=device) % 127).to(dtype).view(6, 4)
                idx = torch.tensor([4, 0, 2], dtype=torch.int64, device=device)
                stage = torch.zeros((3, 10), dtype=dtype, device=device)
                torch.index_select(src, 0, idx, out=stage[:, 3:7])
                back = torch.zeros_like(src)
                back.index_copy_(0, idx, stage[:, 3:7])
                want, got, again = src.cpu()[[4, 0, 2]], stage.cpu(), back.cpu()
                if not (torch.equal(got[:, 3:7], want) and torch.equal(again[[4, 0, 2]], want)
                        and int(again[[1, 3, 5]].abs().sum()) == 0 and int(got[:, :3].abs().sum()) == 0
                        and int(got[:, 7:].abs().sum()) == 0):
                    return False
            return True
        except Exception:   # noqa: BLE001 - any failure: the mover copies those planes block by block
            return False

    def synchronize(self, device: torch.device) -> None:
        """Not used by the mover (it never blocks); the benchmarks' baseline needs it."""
        torch.cuda.synchronize(device)
