"""A front end blocked on the disk tier sends what the disk I/O process's pipe held back.

``ProcessDiskStore.kick`` writes the ops queued since the last kick to the pipe; what a full pipe does not take
waits in a backlog until the next kick.  ``TierManager``'s blocking calls wake each ``POLL_SLICE_S`` while
ops wait so (``TierCore.unsent``) and kick; the scheduler-side front end's ``flush()`` and ``close()`` block
through ``TierCore.simple_block_until``, which applied reports but never kicked: a flush marker the full pipe
held back stayed in the backlog, the child never answered it, and ``SlabScheduler.flush()`` returned False
after its whole timeout (with none, it never returned).  Both fronts are driven the same way here: the pipe
refuses the flush marker's frame a few times (as a full pipe does), then takes writes again.
"""

from __future__ import annotations

import errno
import os
from typing import Any

import pytest

from fakes import instrument_get
from test_front_ends import open_front, store_all  # noqa: F401 (open_front: a fixture)
from tiered_kv.core import POLL_SLICE_S
from tiered_kv.disk.proc import ProcessDiskStore


REFUSALS = 3


def _pipe_full(monkeypatch: pytest.MonkeyPatch, store: ProcessDiskStore) -> list[int]:
    """The next ``REFUSALS`` writes to ``store``'s command pipe fail as a full pipe's do (EAGAIN, nothing
    written); later ones go through.  Returns the count of refused writes."""
    refused = [0]
    write = os.write

    def full_once(fd: int, data: Any) -> int:
        if fd == store._cmd_w and refused[0] < REFUSALS:
            refused[0] += 1
            raise BlockingIOError(errno.EAGAIN, "pipe full")
        return write(fd, data)

    monkeypatch.setattr(os, "write", full_once)
    return refused


def test_a_flush_whose_marker_a_full_pipe_held_back_still_completes(open_front, monkeypatch) -> None:
    front = open_front(host_slots=8, disk_slots=32)
    core = front.s.core if hasattr(front, "s") else front.mgr._core
    store = core.disk.store
    if not isinstance(store, ProcessDiskStore):
        pytest.skip("the disk I/O runs as threads in this run: no pipe")
    ks = [b"pipe-%d" % i for i in range(4)]
    store_all(front, ks)
    assert front.flush()
    refused = _pipe_full(monkeypatch, store)
    gets: list[tuple[float, bool]] = []   # each blocking wait: (its timeout, ops held back then)
    instrument_get(core.completions, lambda t: gets.append((t, store.backlogged)))
    assert front.flush()               # the marker's frame went to the backlog, and was sent from it
    assert refused[0] == REFUSALS and not store.backlogged
    held = [t for t, backlogged in gets if backlogged]
    assert held and max(held) <= POLL_SLICE_S   # woke within a slice to send them, not after WAKE_S
    for k in ks:
        assert front.read(k) is not None
