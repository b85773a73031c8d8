"""Adversarial review of the fixes of reviews core3, disk3 and faults (their library changes).

What it proved wrong (each test failed before its fix):

* ``DiskTier.restart(force=True)`` at close: a start that had just produced its store, its thread not yet
  gone, was neither adopted nor closed (the new disk I/O process and its path lock left running);
* ``lock.take``: a fork from another thread between the lock file's open and its record left the child a
  copy that its at-fork hook did not close (the child held the path lock as long as it lived);
* a full disk tier whose writer turned unhealthy on a one-off fault after a commit shed every later spill
  for good (only a commit makes the writer healthy, and no spill came to commit): an idle unhealthy writer
  now probes the disk (``Writer._probe``);
* recovery dropped every touch numbered past ``SEQ_CHECKED`` as damage, also where a verified entry is
  numbered that high and the writer resumed from it (every promote's recency lost at the next open).
"""

from __future__ import annotations

import os
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tiered_kv.core import disk_tier as disk_tier_mod
from tiered_kv.core.disk_tier import DiskTier
from tiered_kv.core.index import TierIndex
from tiered_kv.disk import lock
from tiered_kv.disk.recovery import RecoveryReport
from tiered_kv.metrics import Metrics

HANG_S = 5.0


def _wait(pred, what: str, timeout: float = HANG_S) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class _DeadStore:
    """A disk I/O process store that died and had its answers applied."""
    down = True
    dead = True

    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


class _NewStore:
    """What the starter's reopen() makes: a running store (its child, its path lock)."""

    def __init__(self) -> None:
        self.closed = 0
        self.entries: list[Any] = []
        self.recovery = RecoveryReport()
        self.opts = types.SimpleNamespace(path=Path("/nonexistent"))
        self.pid = 12345
        self.down = False

    def submit_delete(self, token: Any, key: bytes) -> None:
        pass

    def kick(self) -> None:
        pass

    def close(self) -> None:
        self.closed += 1


def test_close_restart_start_ending_at_the_wait_leaks_the_new_store(monkeypatch: pytest.MonkeyPatch) -> None:
    new = _NewStore()
    returned = threading.Event()      # reopen() returned: start() is about to hand over its outcome
    finish = threading.Event()        # the starter thread may end (its bootstrap's last steps)

    class LateThread(threading.Thread):
        """A starter whose target has returned (its outcome handed over) and that is not yet gone: the
        window between ``start()``'s return and the thread's end, held open."""

        def run(self) -> None:
            try:
                super().run()
            finally:
                returned.set()
                finish.wait(HANG_S)

    monkeypatch.setattr(disk_tier_mod, "threading", types.SimpleNamespace(Thread=LateThread, Lock=threading.Lock))
    monkeypatch.setattr(disk_tier_mod, "RESTART_CLOSE_WAIT_S", 0.2)   # the close's wait runs out meanwhile
    dead = _DeadStore()
    go = threading.Event()            # the new child's open answers

    def reopen() -> _NewStore:
        go.wait(HANG_S)
        return new

    tier = DiskTier(dead, TierIndex(4), Metrics(CollectorRegistry()), reopen=reopen)   # type: ignore[arg-type]
    try:
        assert tier.restart() is False   # the pass that starts it: the start runs on the starter thread
        go.set()
        _wait(returned.is_set, "the starter's reopen() to return")
        tier.restart(force=True)         # the owner closing: the start has ended, its thread not quite
        # the start ended with a store: adopted (closed by close_disk next) or closed -- never left running
        assert tier.store is new or new.closed, \
            f"restart(force=True) left the new store running unowned (adopted={tier.store is new}, closed={new.closed})"
    finally:
        go.set()
        finish.set()


def test_fork_while_take_opens_the_lock_file_child_keeps_the_lock(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open
    r, w = os.pipe()
    ready_r, ready_w = os.pipe()   # the child says it runs its own code (its at-fork hooks are done)
    child: list[int] = []

    guarded: list[bool] = []
    about_to_fork = threading.Event()

    def fork() -> None:   # another thread's os.fork() (a multiprocessing worker), while take() opens the file
        about_to_fork.set()
        pid = os.fork()
        if pid == 0:   # the forked child: lives on for a while, as a worker would
            try:
                os.close(w)
                os.write(ready_w, b"x")
                os.read(r, 1)
            finally:
                os._exit(0)
        child.append(pid)

    forker = threading.Thread(target=fork)

    def open_then_fork(path: Any, flags: int, mode: int = 0o777, *a: Any, **k: Any) -> int:
        fd = real_open(path, flags, mode, *a, **k)
        if str(path).endswith(lock.LOCK_NAME) and not forker.is_alive() and not child:
            # the open and its record are one step as a fork sees them: a fork from another thread waits for both
            guarded.append(lock._fds.locked())
            forker.start()
            about_to_fork.wait(HANG_S)
        return fd

    monkeypatch.setattr(os, "open", open_then_fork)
    try:
        fd = lock.take(tmp_path)
    finally:
        monkeypatch.undo()
    forker.join(HANG_S)
    try:
        assert child and os.read(ready_r, 1) == b"x"
        assert child and guarded == [True], "take() opened the lock file with no guard against a concurrent fork"
        # this process is done with the path and closes its lock file without unlocking it (lock.leave: what the
        # owner does when its I/O process shares it); nobody else shares it -- the module says a forked child closed
        # its copy -- so the path must be free again
        lock.leave(fd)
        try:
            fd2 = lock.take(tmp_path)
        except lock.LockHeld as held:
            raise AssertionError(f"the forked child (pid {child[0]}) holds the path lock (holder {held})") from None
        lock.release(fd2)
    finally:
        os.close(w)
        os.waitpid(child[0], 0)
        for fd_ in (r, ready_r, ready_w):
            os.close(fd_)


# ---------------------------------------------------------------------------- spills shed while unhealthy
from disk_helpers import drain, make_kv, metric, rig, store_one  # noqa: E402
from disk_helpers import keys as _keys  # noqa: E402

__all__ = ["rig"]


@pytest.mark.disk_threads
def test_one_fault_after_a_commit_leaves_a_full_tier_shedding_every_spill_for_good(rig, monkeypatch) -> None:
    kv = make_kv(16)
    mgr = rig.open(kv, host_slots=16, disk_slots=4, disk_io="thread")
    for i, k in enumerate(_keys(4)):
        store_one(mgr, kv, k, i)                  # the disk tier full of readable blocks
    assert mgr.disk_blocks == 4 and mgr.disk_healthy
    db = mgr.disk.writer._db
    real = db.cover_pages
    failing = [True]   # a transient EIO extending data.mdb after a commit, for the commits of one step
    faults: list[int] = []

    def cover_pages() -> None:
        if failing[0]:
            faults.append(1)
            raise OSError(5, "Input/output error")
        real()

    monkeypatch.setattr(db, "cover_pages", cover_pages)
    store_one(mgr, kv, b"after-fault", 4, flush=False)   # evicts the oldest; commits; cover_pages fails
    drain(mgr)
    writer = mgr.disk.writer
    deadline = time.monotonic() + 30

    def settled() -> bool:   # the writer idle, and every fault it met counted (it marks itself unhealthy first)
        with writer._cond:
            idle = not writer._ops and not writer._retry and not writer._batch
        return idle and metric(mgr, "tiered_kv_errors_total", tier="disk", error="io_error") == len(faults)

    while not settled():                         # states, not ordering sleeps
        assert time.monotonic() < deadline, "the writer never settled after the fault"
        mgr.wait(timeout=0.01)
    failing[0] = False                           # the fault is gone
    assert faults and mgr.disk_blocks == 4
    while not mgr.disk_healthy:                  # no op left to commit: the idle writer's probe
        assert time.monotonic() < deadline, "the disk tier never became healthy again"
        mgr.wait(timeout=0.01)
    shed_before = metric(mgr, "tiered_kv_shed_total", kind="spill", reason="disk_down")
    # the engine goes on storing new blocks, one per step
    for i, k in enumerate(_keys(6, prefix="later")):
        store_one(mgr, kv, k, 5 + i, flush=False)
        drain(mgr)
    shed = metric(mgr, "tiered_kv_shed_total", kind="spill", reason="disk_down") - shed_before
    assert mgr.disk_healthy and shed < 6, \
        f"{shed:.0f} of 6 spills shed as disk_down after a one-off fault; writer healthy={mgr.disk.healthy}"


# ---------------------------------------------------------------------------- recovery's implausible numbers
from test_review_disk_writer import _Store  # noqa: E402
from tiered_kv.disk.recovery import SEQ_CHECKED  # noqa: E402


def test_a_verified_entry_past_seq_checked_makes_every_later_touch_count_as_damage(tmp_path: Path) -> None:
    path = tmp_path / "d"
    st = _Store(path)
    try:
        # a tier whose writer was numbering past SEQ_CHECKED (an earlier version resumed from a damaged number
        # below SEQ_LIMIT): the entries it wrote verify, so recovery keeps them and resumes from them
        st.s.writer._seq = SEQ_CHECKED + 10
        a = st.spill(b"A")
        b = st.spill(b"B")
        assert st.answer(a).ok and st.answer(b).ok and st.flush()
    finally:
        st.close()
    st = _Store(path)   # recovery: A and B verified and kept; the writer resumes past SEQ_CHECKED
    try:
        assert [e.key for e in st.s.entries] == [b"A", b"B"], st.s.recovery
        assert st.s.recovery.corrupt == 0
        st.s.submit_touch(b"A")   # A promoted: the most recently used now
        assert st.flush()
    finally:
        st.close()
    st = _Store(path)
    try:
        order = [e.key for e in st.s.entries]   # oldest first (the LRU order the tier rebuilds)
        assert order == [b"B", b"A"], f"A's touch was dropped at open: recency order {order}"
    finally:
        st.close()
