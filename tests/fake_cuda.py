"""A simulated CUDA device for :class:`tiered_kv.movers.CudaMover`, so its logic is tested without a GPU.

Streams are FIFO queues of operations on CPU tensors; nothing runs until the
test says so (:meth:`FakeGPU.run`, :meth:`FakeGPU.step`, :meth:`FakeGPU.run_all`),
or, with ``progress_on_query``, one runnable operation per event query (so a
manager blocked in ``wait()`` sees the device advance).  The semantics kept
from CUDA:

* operations of one stream run in order;
* ``s.wait_stream(other)`` makes everything queued on ``s`` afterwards wait
  for everything queued on ``other`` so far;
* an event recorded on a stream completes when the stream reaches it; a
  re-recorded event reads not-complete again until the *latest* record is
  reached (an earlier record still queued completes nothing);
* a copy reads and writes the bytes when it *runs*, not when it is queued --
  which is what makes the ordering hazards observable.

Engine work is queued on the compute stream (:meth:`FakeGPU.kernel`), which
is what ``current_stream`` returns.  Which runnable stream goes next is
chosen by the test (or by a seeded ``random.Random``).
"""

from __future__ import annotations

import contextlib
import random
from collections import deque
from typing import Any, Callable, Iterator, Optional

import torch


class FakeEvent:
    def __init__(self, gpu: "FakeGPU") -> None:
        self._gpu = gpu
        self.recorded = False
        self.done = False
        self.at = 0  # device "time" (operations run so far) when reached
        self.gen = 0  # records so far: a record operation completes the event only if it is the latest
        self.fail: Optional[BaseException] = None  # raised by the next query(), as a sticky CUDA error would be

    def record(self, stream: "FakeStream") -> None:
        """As ``cudaEventRecord``: only the latest record counts; an earlier one still queued is inert."""
        self._gpu.fault("record")
        self.recorded, self.done = True, False
        self.gen += 1
        stream.push(("event", self, self.gen))

    def query(self) -> bool:
        if self.fail is not None:
            raise self.fail
        if self._gpu.progress_on_query:
            self._gpu.step()
        return self.done or not self.recorded

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.done and end.done, "elapsed_time on an event not reached"
        return float(end.at - self.at) * 1e-3  # 1 us per operation


class FakeStream:
    def __init__(self, gpu: "FakeGPU", name: str) -> None:
        self._gpu = gpu
        self.name = name
        self.ops: deque[tuple[Any, ...]] = deque()
        self.queued = 0   # operations ever queued
        self.ran = 0      # operations ever run

    def push(self, op: tuple[Any, ...]) -> None:
        self.ops.append(op)
        self.queued += 1

    def wait_stream(self, other: "FakeStream") -> None:
        self.push(("wait", other, other.queued))

    def runnable(self) -> bool:
        if not self.ops:
            return False
        op = self.ops[0]
        return not (op[0] == "wait" and op[1].ran < op[2])

    def run_one(self) -> None:
        op = self.ops.popleft()
        self.ran += 1
        self._gpu.time += 1
        if op[0] == "copy":
            op[1].copy_(op[2])
        elif op[0] == "gather":
            torch.index_select(op[2], 0, op[3], out=op[1])
        elif op[0] == "scatter":
            op[1].index_copy_(0, op[2], op[3])
        elif op[0] == "fn":
            op[1]()
        elif op[0] == "event" and op[2] == op[1].gen:
            op[1].done = True
            op[1].at = self._gpu.time

    def synchronize(self) -> None:
        while self.ops:
            if not self._gpu.step():  # pragma: no cover - a dependency cycle: a bug in the test
                raise AssertionError(f"stream {self.name} cannot finish")


class FakeOps:
    """What ``FakeGPU.copies_on`` yields (``TorchCuda``'s ``_TorchOps``): each call queues its operation on
    the stream -- ``copy``, ``gather`` (``index_select``), ``scatter`` (``index_copy_``) -- run when the test
    says; ``index`` gives the row numbers as a tensor at once (on CUDA an upload queued ahead of the
    operations that read it).  Every call can meet the armed ``copy_error`` (``index``: ``index_error``)."""

    def __init__(self, gpu: "FakeGPU", stream: FakeStream) -> None:
        self._gpu, self._stream = gpu, stream

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._gpu.copy(dst, src, self._stream)

    def gather(self, out: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
        self._gpu.fault("copy")
        self._gpu.calls += 1
        self._stream.push(("gather", out, src, index))

    def scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        self._gpu.fault("copy")
        self._gpu.calls += 1
        self._stream.push(("scatter", dst, index, src))

    def index(self, values: list[int]) -> torch.Tensor:
        self._gpu.fault("index")
        self._gpu.calls += 1
        return torch.tensor(values, dtype=torch.int64)


class FakeGPU:
    """The runtime ``CudaMover(runtime=...)`` takes: ``new_stream``, ``new_event``, ``current_stream``,
    ``order_after``, ``copies_on`` (and ``copy``, ``synchronize`` for the benchmarks)."""

    def __init__(self, rng: Optional[random.Random] = None, progress_on_query: bool = False) -> None:
        self.rng = rng
        self.progress_on_query = progress_on_query
        self.time = 0
        self.compute = FakeStream(self, "compute")
        self.streams: list[FakeStream] = [self.compute]
        self.events: list[FakeEvent] = []
        self.copy_error: Optional[BaseException] = None  # raised by a copy() call: the next one after ...
        self.copy_error_skip = 0                          # ... this many more have gone through
        self.record_error: Optional[BaseException] = None  # raised by an event record(), likewise
        self.record_error_skip = 0
        self.switch_error: Optional[BaseException] = None  # raised by the next copies_on() call
        self.switch_error_skip = 0
        self.index_error: Optional[BaseException] = None  # raised by an index upload, likewise
        self.index_error_skip = 0
        self.calls = 0  # calls that queued copies (copy, gather, scatter, index): the engine thread's cost
        self.strided_ok = True   # what strided_index_ops() answers (TorchCuda probes the device)
        self.batches: list[FakeStream] = []  # the stream of each batch of copies, in order

    # --- the runtime interface
    def new_stream(self, device: Any) -> FakeStream:
        s = FakeStream(self, f"side{len(self.streams)}")
        self.streams.append(s)
        return s

    def new_event(self) -> FakeEvent:
        e = FakeEvent(self)
        self.events.append(e)
        return e

    def current_stream(self, device: Any) -> FakeStream:
        return self.compute

    def order_after(self, stream: FakeStream, other: FakeStream) -> None:
        """``TorchCuda.order_after``: ``stream.wait_stream(other)``."""
        stream.wait_stream(other)

    def strided_index_ops(self, device: Any) -> bool:
        """``TorchCuda.strided_index_ops``: here the gathers and scatters run as torch CPU ops, which do it right."""
        return self.strided_ok

    def synchronize(self, device: Any = None) -> None:
        """``torch.cuda.synchronize``: everything queued runs (the benchmarks' baseline uses it)."""
        self.run_all()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: FakeStream) -> None:
        self.fault("copy")
        self.calls += 1
        stream.push(("copy", dst, src))

    @contextlib.contextmanager
    def copies_on(self, stream: FakeStream) -> Iterator[FakeOps]:
        """``stream`` current for a batch of copies (``TorchCuda.copies_on``); yields its :class:`FakeOps`."""
        self.fault("switch")
        self.batches.append(stream)
        yield FakeOps(self, stream)

    def fault(self, what: str) -> None:
        """Raise the armed ``<what>_error`` once ``<what>_error_skip`` more calls have gone through."""
        err = getattr(self, f"{what}_error")
        if err is None:
            return
        skip = getattr(self, f"{what}_error_skip")
        if skip:
            setattr(self, f"{what}_error_skip", skip - 1)
            return
        setattr(self, f"{what}_error", None)
        raise err

    # --- the engine and the test
    def kernel(self, fn: Callable[[], Any]) -> None:
        """Queue engine work on the compute stream (runs when the device gets to it)."""
        self.compute.push(("fn", fn))

    @property
    def side(self) -> list[FakeStream]:
        return self.streams[1:]

    def runnable(self) -> list[FakeStream]:
        return [s for s in self.streams if s.runnable()]

    def step(self, stream: Optional[FakeStream] = None) -> bool:
        """Run one operation: of ``stream`` (which must be runnable), else of a runnable stream
        (the first, or a random one with ``rng``).  False when nothing can run."""
        if stream is not None:
            if not stream.runnable():
                return False
            stream.run_one()
            return True
        ready = self.runnable()
        if not ready:
            return False
        (self.rng.choice(ready) if self.rng is not None else ready[0]).run_one()
        return True

    def run(self, stream: FakeStream) -> int:
        """Run ``stream`` as far as it can go without running any other stream; the count run."""
        n = 0
        while self.step(stream):
            n += 1
        return n

    def run_all(self) -> None:
        while self.step():
            pass

    @property
    def idle(self) -> bool:
        return not any(s.ops for s in self.streams)

