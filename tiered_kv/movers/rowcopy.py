"""The CPU movers' batched copy, written once: ``dst[dst_rows[i]] = src[src_rows[i]]`` over planes, with
torch index ops and no Python per row.

:data:`COPY_SOURCE` is both Python and TorchScript.  :func:`copy_rows` is it run as Python (the
:class:`~.thread.ThreadMover`'s workers call it through :func:`~.thread.batch_copy`); :func:`compiled`
compiles it with a launcher that starts a flush's groups of copies with one ``torch.jit.fork`` in
torch's inter-op threads (the :class:`~.native.NativeMover`); its row indexes cross as lists of ints and
become tensors there, off the engine's thread.  The cases, per plane (rows viewed as
16- or 8-byte elements):

* both sides' rows consecutive: one ``copy_`` of the range;
* the destination's consecutive: one ``index_select`` into them (also where the rows are padded, as
  the vLLM copier's planes are: 4x faster than the ``index_copy_`` from a gathered copy);
* the source's consecutive: one ``index_copy_`` from them;
* neither: an ``index_select`` into a staging buffer and an ``index_copy_`` from it, a stage-full of
  rows per pass (while the stage is still in the CPU's cache); rows wider than the stage: one
  ``copy_`` each.

:func:`index_args` builds the Python copy's arguments, so that a side's index tensor is made only
where a case uses it.
"""

from __future__ import annotations

import array
import functools
import logging
import os
import typing
from typing import Any

import torch

from .base import is_run

__all__ = ["COPY_SOURCE", "copy_rows", "compiled", "native_available", "index_args", "list_args"]

log = logging.getLogger(__name__)

COPY_SOURCE = '''
def copy_rows(dsts: List[Tensor], srcs: List[Tensor], dst_rows: Tensor, src_rows: Tensor, d0: int, s0: int,
              n: int, dst_run: bool, src_run: bool, stages: List[Tensor], stage_rows: List[int]) -> int:
    for p in range(len(dsts)):
        dst = dsts[p]
        src = srcs[p]
        if dst_run and src_run:
            dst.narrow(0, d0, n).copy_(src.narrow(0, s0, n))
        elif dst_run:
            torch.index_select(src, 0, src_rows, out=dst.narrow(0, d0, n))
        elif src_run:
            dst.index_copy_(0, dst_rows, src.narrow(0, s0, n))
        else:
            if len(stages) > p:
                stage = stages[p]
            else:
                stage = torch.empty([min(stage_rows[p], n), src.size(1)], dtype=src.dtype)
            k = stage.size(0)
            if k == 0:
                for i in range(n):
                    dst[int(dst_rows[i])].copy_(src[int(src_rows[i])])
            else:
                i = 0
                while i < n:
                    m = min(k, n - i)
                    part = stage.narrow(0, 0, m)
                    torch.index_select(src, 0, src_rows.narrow(0, i, m), out=part)
                    dst.index_copy_(0, dst_rows.narrow(0, i, m), part)
                    i += m
    return n
'''
"""``copy_rows(dsts, srcs, dst_rows, src_rows, d0, s0, n, dst_run, src_run, stages, stage_rows)``: per plane
``p``, ``dsts[p][dst_rows[i]] = srcs[p][src_rows[i]]`` for ``i < n``, where a side whose rows are a range
(``*_run``) starts at ``d0``/``s0`` and its index may be empty (:func:`index_args`).  ``stages[p]``, where
given, is plane ``p``'s staging buffer (never resized); else one of ``stage_rows[p]`` rows is made per call.
The destination rows must be distinct (the owner's leases and fences see to it)."""

_LAUNCH_SOURCE = '''
def copy_groups(planes: List[List[Tensor]], to_host: List[bool], dst_idx: List[List[int]], src_idx: List[List[int]],
                d0: List[int], s0: List[int], n: List[int], dst_run: List[bool], src_run: List[bool],
                stage_rows: List[int]) -> int:
    dev = planes[0]
    host = planes[1]
    no_stages: List[Tensor] = []
    empty = torch.empty([0], dtype=torch.long)
    total = 0
    for g in range(len(n)):
        dst_rows = empty if dst_run[g] else torch.tensor(dst_idx[g], dtype=torch.long)
        src_rows = empty if src_run[g] else torch.tensor(src_idx[g], dtype=torch.long)
        if to_host[g]:
            total += copy_rows(host, dev, dst_rows, src_rows, d0[g], s0[g], n[g], dst_run[g], src_run[g],
                               no_stages, stage_rows)
        else:
            total += copy_rows(dev, host, dst_rows, src_rows, d0[g], s0[g], n[g], dst_run[g], src_run[g],
                               no_stages, stage_rows)
    return total

def _detached(dev: List[Tensor], host: List[Tensor]) -> List[List[Tensor]]:
    d = [t.detach() for t in dev]
    h = [t.detach() for t in host]
    return [d, h]

def hold_planes(dev: List[Tensor], host: List[Tensor]) -> Future[List[List[Tensor]]]:
    # the planes detached once, held by a future Python never reads: the inter-op thread must never need the
    # GIL to drop a reference (a tensor Python holds takes the GIL there when its count falls to the Python
    # object's own: the copy would wait for an engine thread running Python, up to the switch interval).  The
    # future's own reference already keeps the planes' counts above that; detached, they have no Python
    # object at all
    return torch.jit.fork(_detached, dev, host)

def launch(planes: Future[List[List[Tensor]]], to_host: List[bool], dst_idx: List[List[int]],
           src_idx: List[List[int]], d0: List[int], s0: List[int], n: List[int], dst_run: List[bool],
           src_run: List[bool], stage_rows: List[int]) -> Future[int]:
    # the indexes cross as lists of ints and become tensors in the inter-op thread (no Python object either)
    return torch.jit.fork(copy_groups, torch.jit.wait(planes), to_host, dst_idx, src_idx, d0, s0, n, dst_run,
                          src_run, stage_rows)
'''
"""``copy_groups(planes, to_host, dst_idx, src_idx, d0, s0, n, dst_run, src_run, stage_rows)``: the groups of a
flush one after the other, each of one direction (``to_host[g]``: device rows into host slots, else back), between
``planes`` = ``[device planes, host planes]``, as :func:`copy_rows` per plane; a side's rows are ``idx[g]``, or
the ``n[g]`` rows from ``d0[g]``/``s0[g]`` where ``*_run[g]`` (its list may then be empty).  ``launch(...)``:
the same started in torch's inter-op threads, its future returned, on planes held by ``hold_planes(dev, host)``
(a finished future); its other arguments are ``copy_groups``'."""


def _python() -> Any:
    namespace: dict[str, Any] = {"torch": torch, "Tensor": torch.Tensor, "List": typing.List}
    exec(compile(COPY_SOURCE, f"<{__name__}.COPY_SOURCE>", "exec"), namespace)   # noqa: S102 - our own source
    return namespace["copy_rows"]


copy_rows = _python()


@functools.lru_cache(maxsize=1)
def compiled() -> Any:
    """:data:`COPY_SOURCE` and its launcher as TorchScript (``.copy_rows``, ``.launch``), compiled once per
    process on first use, from strings: no source file needs to be readable at run time."""
    return torch.jit.CompilationUnit(COPY_SOURCE + _LAUNCH_SOURCE)


@functools.lru_cache(maxsize=1)
def _compiles() -> bool:
    try:
        compiled()
    except Exception as exc:   # noqa: BLE001 - a torch without TorchScript: the Python threads copy instead
        log.warning("the native CPU mover is not available (%r); copying on Python threads", exc)
        return False
    return True


_pool_pid = 0          # the process whose torch inter-op threads a native mover started (0: none yet)
_fork_logged = False


def native_available() -> bool:
    """Whether this torch compiles :func:`compiled` (TorchScript), and its inter-op threads work here: not in a
    process forked after a native mover used them in its parent (torch's inter-op pool does not survive
    ``fork()``: the child's first ``torch.jit.fork`` waits for ever).  Logged once when it does not."""
    global _fork_logged
    if not _compiles():
        return False
    if _pool_pid and _pool_pid != os.getpid():
        if not _fork_logged:
            _fork_logged = True
            log.warning("this process was forked from one whose native CPU mover used torch's inter-op threads, "
                        "which do not survive fork(); copying on Python threads")
        return False
    return True


def pool_used() -> None:
    """A native mover is about to start work in torch's inter-op threads (see :func:`native_available`)."""
    global _pool_pid
    if not _pool_pid:
        _pool_pid = os.getpid()


def index_args(dst_idx: list[int], src_idx: list[int],
               empty: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int, int, bool, bool]:
    """``(dst_rows, src_rows, d0, s0, n, dst_run, src_run)`` for :func:`copy_rows`: :func:`list_args` with each
    index made a tensor here, ``empty`` where its rows are a range (no case reads it then)."""
    dst, src, d0, s0, n, dst_run, src_run = list_args(dst_idx, src_idx)
    return empty if dst_run else _index(dst), empty if src_run else _index(src), d0, s0, n, dst_run, src_run


_NONE: list[int] = []   # a side whose rows are a range: no index crosses (never appended to)


def list_args(dst_idx: list[int], src_idx: list[int]) -> tuple[list[int], list[int], int, int, int, bool, bool]:
    """:func:`index_args` for the compiled ``copy_groups``: a side's index as the list itself (made a tensor on
    the thread that copies), or an empty list where its rows are a range."""
    dst_run, src_run = is_run(dst_idx), is_run(src_idx)
    return (_NONE if dst_run else dst_idx, _NONE if src_run else src_idx, dst_idx[0], src_idx[0], len(dst_idx),
            dst_run, src_run)


def _index(idx: list[int]) -> torch.Tensor:
    """``idx`` as an int64 tensor: through an ``array`` (1.4 us for 64 rows, ``torch.tensor`` 7.7 us).  The
    tensor shares the array's buffer, so whoever hands it to another thread keeps it until that thread is
    done (its storage's last release gives the buffer back, which takes the GIL)."""
    return torch.frombuffer(array.array("q", idx), dtype=torch.int64)
