"""ThreadMover.hold: while the owner blocks in wait(), the copies it submits stay with it.

Inside ``wait()`` the owner applies promote reports, and each submits the
load copy that was waiting on the promote.  Handed to the workers, every such
copy woke a worker thread that then competed with the owner (which copies
too, ``help_one``) and the disk reader for two cores.  With ``hold(True)``
those transfers are left for the owner's ``help_one``; ``hold(False)`` (in a
``finally``) hands whatever is left to the workers, so nothing is stranded
when a wait times out or an exception escapes it.

The worker queue is wrapped to record every batch of transfers put on it: whether a
copy was handed to the workers is then a fact the test reads, not a race it
hopes to win.
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from prometheus_client import CollectorRegistry

from disk_helpers import content, disk_config, keys, make_kv, row_is, store_seq
from tiered_kv import TierManager
from tiered_kv.jobs import JobKind
from tiered_kv.movers import CompletionQueue, ThreadMover, Transfer
from tiered_kv.movers import thread as thread_mod

ROWS, ROW = 8, 4096


class RecordingQueue:
    """The workers' queue, recording every item put on it (the items still go through)."""

    def __init__(self, q: "queue.SimpleQueue[Any]") -> None:
        self.q = q
        self.puts: list[Any] = []

    def put(self, item: Any) -> None:
        self.puts.append(item)
        self.q.put(item)

    def get(self, *a: Any, **k: Any) -> Any:
        return self.q.get(*a, **k)

    def get_nowait(self) -> Any:
        return self.q.get_nowait()

    def qsize(self) -> int:
        return self.q.qsize()


class Copies:
    """copy_fn recording (thread name, destination address) per copy."""

    def __init__(self) -> None:
        self.made: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def __call__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)
        with self._lock:
            self.made.append((threading.current_thread().name, dst.data_ptr()))

    def threads(self) -> list[str]:
        with self._lock:
            return [t for t, _ in self.made]


def _mover(workers: int = 1) -> tuple[ThreadMover, torch.Tensor, torch.Tensor, CompletionQueue, Copies, RecordingQueue]:
    dev = torch.zeros((ROWS, ROW), dtype=torch.uint8)
    host = torch.stack([torch.full((ROW,), i + 1, dtype=torch.uint8) for i in range(ROWS)])
    cq = CompletionQueue()
    copies = Copies()
    m = ThreadMover([(dev, host)], cq, num_workers=workers, copy_fn=copies)
    rq = RecordingQueue(m._q)
    m._q = rq  # type: ignore[assignment]
    return m, dev, host, cq, copies, rq


def _load(i: int) -> Transfer:
    return Transfer(f"t{i}", JobKind.LOAD, [i], [i])  # type: ignore[arg-type]


def test_held_transfers_are_run_by_help_one_in_order_and_never_reach_a_worker():
    m, dev, host, cq, copies, rq = _mover()
    try:
        m.hold(True)
        for i in range(3):
            m.submit(_load(i))
        assert rq.puts == [] and rq.qsize() == 0
        assert [m.help_one() for _ in range(2)] == [True, False]   # one batch: all three, in order
        reports = [cq.get(0) for _ in range(3)]
        assert [r.token for r in reports] == ["t0", "t1", "t2"] and all(r.ok for r in reports)
        assert copies.made == [(threading.current_thread().name, dev[i].data_ptr()) for i in range(3)]
        assert all(torch.equal(dev[i], host[i]) for i in range(3))
        assert cq.get(0) is None
    finally:
        m.hold(False)
        m.close()


def test_turning_hold_off_hands_what_is_left_to_the_workers_each_answered_once():
    m, dev, host, cq, copies, rq = _mover(workers=2)
    try:
        m.hold(True)
        for i in range(4):
            m.submit(_load(i))
        with mock.patch.object(thread_mod, "HELP_BYTES", 1):
            assert m.help_one()                  # t0 on the owner (one transfer per call with this cap)
        m.hold(False)
        assert [[t.token for t in b] for b in rq.puts] == [["t1", "t2", "t3"]]   # one batch
        got = sorted(cq.get(30).token for _ in range(4))
        assert got == ["t0", "t1", "t2", "t3"] and cq.get(0) is None
        names = copies.threads()
        assert names.count(threading.current_thread().name) == 1
        assert sum(n.startswith("tiered-kv-copy") for n in names) == 3
        # off means off: a later submit goes straight to the workers
        m.submit(_load(4))
        assert [t.token for t in rq.puts[-1]] == ["t4"] and cq.get(30).token == "t4"
    finally:
        m.close()


def test_a_cancelled_held_transfer_is_answered_without_a_copy():
    m, dev, host, cq, copies, rq = _mover()
    try:
        m.hold(True)
        t = _load(0)
        m.submit(t)
        t.cancelled = True
        assert m.help_one()
        r = cq.get(0)
        assert r.token == "t0" and not r.ok and "cancelled" in (r.error or "") and copies.made == []
    finally:
        m.hold(False)
        m.close()


# --------------------------------------------------------------------------- through a TierManager
@pytest.fixture
def disk_rig(tmp_path: Path):
    kv = make_kv(24)
    copies = Copies()
    made: list[ThreadMover] = []

    def factory(dev: torch.Tensor, host: torch.Tensor, q: CompletionQueue) -> ThreadMover:
        m = ThreadMover([(dev, host)], q, num_workers=2, copy_fn=copies)
        m._q = RecordingQueue(m._q)  # type: ignore[assignment]
        made.append(m)
        return m

    mgr = TierManager(disk_config(tmp_path / "disk", host_slots=20, disk_slots=96), kv,
                      registry=CollectorRegistry(), mover_factory=factory)
    try:
        yield kv, mgr, made[0], copies
    finally:
        mgr.close()


def _disk_only(mgr: TierManager, kv: torch.Tensor, n: int) -> list[bytes]:
    ks = keys(40, "h")
    store_seq(mgr, kv, ks)
    on_disk = [k for k in ks if mgr.host_bytes(k) is None]
    assert len(on_disk) >= n
    return on_disk[:n]


def _disk_only_fresh(disk_rig: Any, n: int) -> tuple[list[bytes], RecordingQueue]:
    """``n`` keys only on disk, the worker queue's record and the copies' record cleared."""
    kv, mgr, mover, copies = disk_rig
    ks = _disk_only(mgr, kv, n)
    rq: RecordingQueue = mover._q  # type: ignore[assignment]
    rq.puts.clear()
    copies.made.clear()
    return ks, rq


def _handed_loads(rq: RecordingQueue) -> list[Transfer]:
    """The load copies put on the workers' queue."""
    return [t for b in rq.puts if b is not None for t in b if t.kind is JobKind.LOAD]


def _loads(mgr: TierManager, ks: list[bytes]) -> list[tuple[Any, bytes, int]]:
    jobs = [(mgr.load(k, i), k, i) for i, k in enumerate(ks)]
    assert all(j is not None for j, _, _ in jobs)
    return jobs


def test_loads_behind_promotes_are_copied_by_the_owner_inside_wait(disk_rig):
    kv, mgr, mover, copies = disk_rig
    ks, rq = _disk_only_fresh(disk_rig, 8)
    jobs = _loads(mgr, ks)
    done = {c.job.token: c for c in mgr.wait([j for j, _, _ in jobs], timeout=30)}
    for j, k, row in jobs:
        assert done[j.token].ok, done[j.token]
        assert row_is(kv, row, k)
    # every load copy was submitted while the owner waited: none was handed to a worker
    assert _handed_loads(rq) == []
    assert copies.threads() == [threading.current_thread().name] * len(ks)
    assert not mover._holding and not mover._held


def test_an_exception_escaping_wait_hands_the_held_copies_to_the_workers(disk_rig):
    kv, mgr, mover, copies = disk_rig
    ks, rq = _disk_only_fresh(disk_rig, 4)
    real_help = mover.help_one

    def help_one() -> bool:
        if mover._held:   # a load copy is held for the owner: interrupt the wait right here
            raise KeyboardInterrupt
        return real_help()

    mover.help_one = help_one  # type: ignore[method-assign]
    jobs = _loads(mgr, ks)
    with pytest.raises(KeyboardInterrupt):
        mgr.wait([j for j, _, _ in jobs], timeout=30)
    mover.help_one = real_help  # type: ignore[method-assign]
    # the wait's finally gave the held copies to the workers
    assert not mover._holding and not mover._held
    handed = _handed_loads(rq)
    assert handed, "no load copy was held when the wait was interrupted"
    done = {c.job.token: c for c in mgr.wait([j for j, _, _ in jobs], timeout=30)}
    for j, k, row in jobs:
        assert j.done and done.get(j.token) is not None and done[j.token].ok, done.get(j.token)
        assert torch.equal(kv[row], content(k, ROW))


def test_a_wait_that_times_out_hands_the_held_copies_to_the_workers(disk_rig):
    """The timeout path out of wait() (not an exception): copies held for the owner go to the workers."""
    kv, mgr, mover, copies = disk_rig
    ks, rq = _disk_only_fresh(disk_rig, 4)
    real_help = mover.help_one

    def help_one() -> bool:
        return False if mover._held else real_help()   # the owner never runs a held copy itself

    mover.help_one = help_one  # type: ignore[method-assign]
    jobs = _loads(mgr, ks)
    deadline = time.monotonic() + 30
    while not _handed_loads(rq):
        assert time.monotonic() < deadline, "no promote was applied inside a wait within 30 s"
        mgr.wait([j for j, _, _ in jobs], timeout=0.05)      # each ends by its timeout while copies are held
        assert not mover._holding and not mover._held        # ... and hands them over on the way out
    mover.help_one = real_help  # type: ignore[method-assign]
    mgr.wait([j for j, _, _ in jobs], timeout=30)
    for j, k, row in jobs:
        assert j.done and row_is(kv, row, k)
    # every handed copy is one of these loads, handed once (who ran it -- a worker, or the owner in
    # the last wait -- is a race this test leaves open)
    handed = [t.token for t in _handed_loads(rq)]
    assert handed and len(set(handed)) == len(handed) and set(handed) <= {j.token for j, _, _ in jobs}
