"""Round 11 adversarial review of be21d39 (the disk tier's own share of the path lock, ``lock.share``,
``DiskTier.leave_path``; ``close_disk``'s reconciling start after a child that died during the close),
a510352 (the fake's ``died``) and 9acea0b (``ProcessDiskStore.kick``'s one chain of C calls, touches held out
of a backed-up pipe).

What it proved wrong (each fixed; each test fails without its fix):

1. ``DiskTier.open`` unlocked (``release``) the tier's share after a failed start whose killed child did not exit:
   the path was free while that child held it.  Fixed: the share is closed, never unlocked (``lock.leave``).
2. An exception (Ctrl-C) in ``DiskTier.open`` after its store opened, or in ``TierManager._open`` after
   ``TierCore``, leaked the disk I/O process and the path lock: the same process could never open the path again.
   Fixed: both close what they opened (as ``SlabScheduler.__init__`` now does).
3. ``close_disk`` abandoned a hung start in flight, then started another and waited ``RESTART_CLOSE_WAIT_S`` again.
   Fixed: a start finished (or abandoned) at the close is its one reconciling start.
4. Two stores of the tier could own the path at once: the abandoned start of 3 and the close's own start.  Fixed
   with 3.
5. A KeyboardInterrupt as ``DiskTier._start`` started its thread (``_starting`` not yet set) orphaned the start:
   its store, child and lock share were never closed; the path stayed locked after ``close()``.  Fixed:
   ``_starting`` is recorded before the thread starts (one that never started is started again).

Checked and found to hold (no test): ``kick``'s one chain of C calls (a partial write removes exactly what was
written, ``BlockingIOError`` keeps the rest, ``EPIPE`` clears it; no eval-breaker check between the write and the
removal); touches held out of a backed-up pipe never hold back or reorder a non-touch op (any non-touch op sends
the whole ``_cmds`` in order) and only touches are dropped; ``lock.share``'s identity check (a left lock's number
reused by another file is refused); the forked-child close of every share (``_held``); ``leave_path`` run again
after an interrupt; a second manager in the same process after a clean close; an interrupt anywhere in the
reconciling branch of ``close_disk`` after the start is recorded (the next close adopts or closes it); thread-mode
close is unaffected (``died``/``restarting`` are False without ``_reopen``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import tiered_kv.core.disk_tier as disk_tier_mod
import tiered_kv.disk.proc as proc_mod
from disk_helpers import Rig, keys, make_kv, rig, store_seq  # noqa: F401
from tiered_kv.core.disk_tier import DiskTier
from tiered_kv.core.tiers import TierCore
from tiered_kv.disk import lock as lock_mod
from tiered_kv.disk.proc import ProcessDiskStore
from tiered_kv.errors import DiskInUseError, DiskTierError

pytestmark = pytest.mark.timeout(60)

__all__ = ["rig"]


def _wait(pred, what: str, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    """Poll a condition another process or thread makes true (a bounded wait, never an ordering sleep)."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _path_is_free(path: Path) -> bool:
    """Whether this process can take the path's lock now (taken and released at once)."""
    try:
        fd = lock_mod.take(path)
    except lock_mod.LockHeld:
        return False
    lock_mod.release(fd)
    return True


# =========================================================================== finding 1
class _ChildLeftAtOpen:
    """The disk I/O process of an open that failed on a hung disk: killed, it does not exit (uninterruptible
    sleep), as ``ProcessDiskStore._kill`` allows for (``_child_left``).  A real process holds the descriptors
    passed to it (the path lock's share among them) until the test lets it go; ``kill()`` is the pending
    SIGKILL that cannot act yet, ``wait(timeout)`` times out."""

    def __init__(self, argv: list[str], fds: tuple[int, ...]) -> None:
        self.real = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], pass_fds=fds,
                                     stdin=subprocess.PIPE, close_fds=True)
        self.pid = self.real.pid
        self.returncode = None

    def kill(self) -> None:
        pass

    def wait(self, timeout: Any = None) -> int:
        if timeout is not None:
            raise subprocess.TimeoutExpired("disk I/O process", timeout)
        return self.real.wait()

    def poll(self) -> None:
        return None

    def finish(self) -> None:
        """The hung disk answers: the killed child exits at last."""
        assert self.real.stdin is not None
        self.real.stdin.close()
        self.real.wait(10)


@pytest.mark.parametrize("how", ["open_timeout_fallback_to_threads", "open_failed_host_only"])
def test_a_failed_open_frees_the_path_a_killed_child_still_holds(rig: Rig, monkeypatch: pytest.MonkeyPatch,
                                                                 how: str) -> None:
    """Contract (docs/architecture.md, "The disk I/O process"): "its answer to the open (``_OPEN_TIMEOUT_S``, then
    it is killed and the open fails; a killed child that has not exited within ``_KILLED_EXIT_S`` keeps the path
    until it does, ``lock.leave``)"; invariant 16: "the path is free only once both are gone".

    What is wrong: since be21d39 the owner's lock is the tier's (``DiskTier.open`` takes it, ``held``), and the
    store gets a ``dup`` of it.  ``ProcessDiskStore.__init__`` (tiered_kv/disk/proc.py:188-190) duly *leaves* its
    share when ``_child_left``, but ``DiskTier.open`` then *releases* the tier's share
    (tiered_kv/core/disk_tier.py:214 after a ``ProcessStartError``, :223 after a ``DiskTierError``, :229 after
    anything else): ``flock(LOCK_UN)`` on a ``dup`` unlocks the one open file description that the killed child
    shares, so the path is free while that child lives (and, in the fallback, the threads' ``DiskStore`` takes the
    path beside it).  Before be21d39 the store left the only lock and the path stayed held until the child exited.
    Fix: in ``DiskTier.open``'s failure branches ``path_lock.leave`` the tier's share when the store's start left
    a child (or always leave it: with no other share, leave closes the last descriptor, which frees the lock too);
    for the fallback to threads, the threads' store then finds the path held, as before be21d39.
    """
    children: list[_ChildLeftAtOpen] = []

    def spawn(argv: list[str], fds: tuple[int, ...]) -> _ChildLeftAtOpen:
        child = _ChildLeftAtOpen(argv, fds)
        children.append(child)
        return child

    monkeypatch.setattr(proc_mod, "_spawn", spawn)
    monkeypatch.setattr(proc_mod, "_KILLED_EXIT_S", 0.1)
    if how == "open_timeout_fallback_to_threads":
        monkeypatch.setattr(proc_mod, "_OPEN_TIMEOUT_S", 0.2)   # a hung disk: the child never answers its open
    else:
        def fail(self: ProcessDiskStore, frames: Any) -> Any:   # the child's open failed ("fail"), then it hung
            raise DiskTierError(f"disk_path {str(self.opts.path)!r}: the disk I/O process could not open it")
        monkeypatch.setattr(ProcessDiskStore, "_first_frame", fail)
    left: list[bool] = []
    real_kill = ProcessDiskStore._kill

    def kill(self: ProcessDiskStore) -> None:
        real_kill(self)
        left.append(self._child_left)

    monkeypatch.setattr(ProcessDiskStore, "_kill", kill)
    kv = make_kv(rows=8)
    try:
        try:
            mgr = rig.open(kv, host_slots=8, disk_slots=64, disk_io="process")
        except DiskInUseError:
            mgr = None   # the threads' store found the path held: what the contract asks for
        assert children and left == [True], (children, left)   # the scenario: one start, its child left
        if mgr is not None:
            rig.close(mgr)
        assert children[0].real.poll() is None, "the left child must still be alive here"
        assert not _path_is_free(rig.path), \
            "the path is free while the killed disk I/O process of the failed open still runs with it"
    finally:
        for c in children:
            c.finish()
    assert _path_is_free(rig.path)   # once that child is gone, the path is free


# =========================================================================== finding 2
@pytest.mark.parametrize("where", ["DiskTier._replay_recovered", "TierCore.refresh_gauges"])
def test_an_interrupt_after_the_disk_tier_opened_leaves_the_path_locked(rig: Rig, monkeypatch: pytest.MonkeyPatch,
                                                                        where: str) -> None:
    """Contract (invariant 16, "One owner per disk path"; the brief's "a TierManager whose constructor fails after
    the tier opened"): the path is held by a live owner only; a constructor that raised leaves no owner, so the
    path must be free again (``TierCore.__init__`` itself closes the disk store and ``leave_path`` when the remote
    tier's open raises, tiered_kv/core/tiers.py:205-210: the library means a failed construction to free it).

    What is wrong: ``DiskTier.open`` guards only the store's creation (tiered_kv/core/disk_tier.py:206-229); what
    follows it -- the index (``TierIndex``, ``make_policy``, ``make_admission``) and ``_replay_recovered``
    (disk_tier.py:233-237: one ``index.reserve`` per recovered block, the longest part of a start-up, where a
    Ctrl-C lands) -- closes nothing when it raises: the ``ProcessDiskStore`` (its child, its share of the lock) and
    the tier's own share (``held[0]``) stay open in this process.  Likewise ``TierManager._open`` guards only
    ``TierCore(...)`` (tiered_kv/manager.py:223-227; ``refresh_gauges`` at :237): ``core.refresh_gauges()`` and what follows it close nothing,
    and ``TierManager.__init__``'s handler (manager.py:167-170) closes the slab and the metrics, not the core.
    A retry in the same process (an engine that catches the interrupt, a notebook) is refused with
    ``DiskInUseError`` naming its own pid, for as long as the process lives; the child runs on.
    Fix: in ``DiskTier.open`` wrap everything after ``make()`` in ``try/except BaseException`` that closes the
    store and leaves/releases ``held``; in ``TierManager._open`` close the core's disk (``store.close()``,
    ``leave_path()``) and remote tiers when anything after ``TierCore(...)`` raises.
    """
    cls, name = (DiskTier, "_replay_recovered") if where.startswith("DiskTier") else (TierCore, "refresh_gauges")
    real = getattr(cls, name)
    fired: list[bool] = []
    stores: list[ProcessDiskStore] = []
    real_init = ProcessDiskStore.__init__

    def init(self: ProcessDiskStore, *a: Any, **k: Any) -> None:
        real_init(self, *a, **k)
        stores.append(self)

    def interrupted(self: Any, *a: Any, **k: Any) -> Any:
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt   # Ctrl-C at this call of the start-up
        return real(self, *a, **k)

    monkeypatch.setattr(ProcessDiskStore, "__init__", init)
    monkeypatch.setattr(cls, name, interrupted)
    kv = make_kv(rows=8)
    held_before = set(map(id, lock_mod._held.values()))
    try:
        with pytest.raises(KeyboardInterrupt):
            rig.open(kv, host_slots=8, disk_slots=64, disk_io="process")
        assert fired and len(stores) == 1
        try:
            mgr = rig.open(kv, host_slots=8, disk_slots=64, disk_io="process")
        except DiskInUseError as exc:
            raise AssertionError(f"the constructor that raised left the path locked in this process: {exc}; its "
                                 f"disk I/O process (pid {stores[0].pid}) alive: "
                                 f"{stores[0]._proc.poll() is None}") from None
        rig.close(mgr)
    finally:
        monkeypatch.undo()
        for s in stores:   # what the failed constructor left (a no-op where it was closed)
            s.close()
        for fd in list(lock_mod._held.values()):   # the lock shares the failed constructor left open
            if id(fd) not in held_before:
                lock_mod.leave(fd)


# =========================================================================== finding 3
def test_close_waits_once_for_a_hung_restart(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Contract (docs/architecture.md, "The disk I/O process"): ``close()`` on a tier whose child died "starts one
    more child, whatever the back-off, to reconcile, and closes that one (``TierCore.close_disk``, once; it waits
    for a start in flight up to ``RESTART_CLOSE_WAIT_S`` = 30 s, then abandons it, the store it makes closed at
    once)".  Before be21d39 a start in flight at close was that one start: ``restart(force=True)`` joined it,
    abandoned it, and the close went on.

    What is wrong: since be21d39 ``close_disk`` (tiered_kv/core/tiers.py:1169-1182) first finishes a start in
    flight (``disk.restarting`` -> ``restart(force=True)``, which abandons it after ``RESTART_CLOSE_WAIT_S``), then
    asks ``disk.died`` -- still True, the dead store is still ``disk.store`` -- and, ``disk_reconciled`` being
    False, calls ``restart(force=True)`` again: a *second* start on the disk whose start just hung, and a second
    wait of ``RESTART_CLOSE_WAIT_S``.  A close with a hung disk now takes 60 s (plus the first branch's
    ``CLOSE_TIMEOUT_S`` waits) instead of 30 s, and leaves two abandoned starters (each with a share of the path
    lock once it gets one).  Fix: treat the first branch's restart as the reconciling one -- set
    ``self.disk_reconciled = True`` when ``disk.restarting`` was handled (or skip the second branch when
    ``restart`` abandoned a start).
    """
    monkeypatch.setattr(disk_tier_mod, "RESTART_CLOSE_WAIT_S", 0.5)
    kv = make_kv(rows=8)
    mgr = rig.open(kv, host_slots=8, disk_slots=64, disk_io="process")
    store_seq(mgr, kv, keys(2, "r11hang"))
    tier = mgr._core.disk
    assert tier is not None and tier._reopen is not None
    real_reopen = tier._reopen
    hang = threading.Event()   # the disk hangs: a new child's open does not return until the test ends
    starts: list[float] = []

    def hung_reopen() -> Any:
        starts.append(time.monotonic())
        hang.wait(15)
        return real_reopen()

    tier._reopen = hung_reopen
    store = mgr.disk
    assert isinstance(store, ProcessDiskStore)
    store.kill_for_test(signal.SIGKILL)
    _wait(lambda: store.down, "the dead child's ops to be answered")
    _wait(lambda: (mgr.poll(), tier._starting is not None)[1], "a pass to start the restart")   # (a pass starts it)
    _wait(lambda: len(starts) == 1, "the starter to call reopen")
    try:
        t0 = time.monotonic()
        mgr.close()
        took = time.monotonic() - t0
        assert len(starts) == 1, (f"close() abandoned the hung start, then started {len(starts) - 1} more on the "
                                  f"same hung disk (close took {took:.2f} s for RESTART_CLOSE_WAIT_S=0.5)")
    finally:
        hang.set()


# =========================================================================== finding 4
def test_two_disk_io_processes_of_one_tier_never_own_the_path_at_once(rig: Rig,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Contract (invariant 16, "One owner per disk path"): "A second store on the same path, in this process or
    another, ... [is] refused"; the abandoned start's store is "closed at once" (architecture, "The disk I/O
    process").

    What is wrong: before be21d39 each ``ProcessDiskStore`` took the path lock itself (``take_path``), so a store
    of the same tier opened while another was open was refused (``LockHeld``: same pid).  Since be21d39 each
    store gets ``lock.share(held[0])`` (tiered_kv/core/disk_tier.py:194-203), a ``dup`` of the one open file
    description: the lock excludes *other* owners only, never two stores of the same tier, so nothing serializes
    them.  ``close_disk`` (tiered_kv/core/tiers.py:1169-1179) makes two such starts: it abandons a start in
    flight after ``RESTART_CLOSE_WAIT_S``, then starts another (see the previous test); the abandoned starter
    goes on (``DiskTier._start.start``, disk_tier.py:406-417) and, once the disk answers, its child opens and
    runs recovery on the path while the close's child has it open (here both are open together: the abandoned
    store is closed only after its construction, the other is being adopted).  Two recoveries and two writers
    (each with its own slot allocator) on one LMDB environment and slot file.
    Fix: serialize the tier's starts -- never start while a starter of the tier is alive (``close_disk``: skip
    the reconciling start after an abandoned one, finding 3), or keep a tier-side guard (a per-tier "store
    open" flag/lock that ``make()`` checks and a store's close clears) in place of the exclusion the lock gave.
    """
    monkeypatch.setattr(disk_tier_mod, "RESTART_CLOSE_WAIT_S", 4.0)
    kv = make_kv(rows=8)
    mgr = rig.open(kv, host_slots=8, disk_slots=64, disk_io="process")
    store_seq(mgr, kv, keys(2, "r11two"))
    tier = mgr._core.disk
    assert tier is not None and tier._reopen is not None
    real_reopen = tier._reopen
    second_made, first_made = threading.Event(), threading.Event()
    calls: list[int] = []
    overlap: list[str] = []
    made: list[ProcessDiskStore] = []

    def reopen() -> Any:
        calls.append(len(calls))
        if len(calls) == 1:        # the pass's start: its disk hangs until the close has started another
            second_made.wait(6)
            try:
                s = real_reopen()
            except Exception as exc:   # refused: what the contract asks for
                overlap.append(f"refused: {exc}")
                first_made.set()
                raise
            others = [m for m in made if m._lock_fd >= 0]
            overlap.append(f"opened beside {len(others)} open store(s) of the tier")
            made.append(s)
            first_made.set()
            return s
        s = real_reopen()          # the close's reconciling start: its child opens the path ...
        made.append(s)
        second_made.set()
        first_made.wait(10)        # ... and is still open (not yet adopted) when the abandoned one's opens
        return s

    tier._reopen = reopen
    store = mgr.disk
    assert isinstance(store, ProcessDiskStore)
    store.kill_for_test(signal.SIGKILL)
    _wait(lambda: store.down, "the dead child's ops to be answered")
    _wait(lambda: (mgr.poll(), tier._starting is not None)[1], "a pass to start the restart")
    starter = tier._starting[0]   # type: ignore[index]
    try:
        mgr.close()
        starter.join(10)
        assert not starter.is_alive()
        assert overlap, "the abandoned start never ran"
        assert overlap[0].startswith("refused") or overlap[0].endswith("beside 0 open store(s) of the tier"), (
            f"two disk I/O processes of one tier owned the path at once: {overlap[0]}")
    finally:
        second_made.set()
        first_made.set()
        starter.join(10)
        for s in made:
            s.close()


# =========================================================================== finding 5
def test_an_interrupt_as_the_reconciling_start_begins_leaves_no_store_running(rig: Rig,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Contract (``TierManager.close``: "Idempotent"; ``ProcessDiskStore.close``/``close_disk``: "a close an
    interrupt broke off is finished by the next one"; invariant 16: the path is free once the owner and its
    children are gone).

    What is wrong: ``DiskTier._start`` (tiered_kv/core/disk_tier.py:425-431) starts the starter thread and only
    then records it (``self._starting = (starter, outcome, abandon)``).  A SIGINT handled as ``starter.start()``
    returns (or while it waits for the thread's bootstrap, ``Thread._started.wait()``, an interruptible lock
    acquire) raises out of ``restart`` -- here out of ``close_disk``'s reconciling ``restart(force=True)``
    (tiers.py:1179), the new close path of be21d39 -- with the thread running and unrecorded.  Its ``reopen()``
    makes a ``ProcessDiskStore`` (a child, a share of the path lock) that nobody adopts, abandons or closes; the
    next ``close()`` finishes (starting yet another child, which runs beside the orphan: finding 4) and returns,
    but the orphan's child and lock share live as long as the process: the path is never free again in it.
    Fix: record ``_starting`` before ``starter.start()`` (and clear it on ``RuntimeError``, or when the thread
    never started: ``starter.ident is None``), so that the next ``restart``/``close`` adopts or abandons it.
    """
    import tiered_kv.core.disk_tier as dtm

    fired: list[threading.Thread] = []

    class InterruptedAsItStarts(threading.Thread):
        def start(self) -> None:
            super().start()
            if not fired and self.name == "tiered-kv-disk-restart":
                fired.append(self)
                raise KeyboardInterrupt   # Ctrl-C handled as Thread.start() returns

    import types
    monkeypatch.setattr(dtm, "threading", types.SimpleNamespace(Thread=InterruptedAsItStarts, Lock=threading.Lock))
    kv = make_kv(rows=8)
    mgr = rig.open(kv, host_slots=8, disk_slots=64, disk_io="process")
    store_seq(mgr, kv, keys(2, "r11orphan"))
    store = mgr.disk
    assert isinstance(store, ProcessDiskStore)
    store.kill_for_test(signal.SIGKILL)
    _wait(lambda: store.down, "the dead child's ops to be answered")
    made: list[ProcessDiskStore] = []
    real_init = ProcessDiskStore.__init__

    def init(self: ProcessDiskStore, *a: Any, **k: Any) -> None:
        real_init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(ProcessDiskStore, "__init__", init)
    try:
        with pytest.raises(KeyboardInterrupt):
            mgr.close()          # the reconciling start is interrupted as it begins
        mgr.close()              # the next close finishes
        assert fired
        fired[0].join(15)        # the interrupted start's thread has ended (its store made)
        assert not fired[0].is_alive()
        left = [s for s in made if s._lock_fd >= 0]
        assert not left and _path_is_free(rig.path), (
            f"after close() {len(left)} disk I/O process(es) (pid {[s.pid for s in left]}) still run with a share "
            f"of the path lock; path free: {_path_is_free(rig.path)}")
    finally:
        monkeypatch.undo()
        for s in made:
            s.close()
