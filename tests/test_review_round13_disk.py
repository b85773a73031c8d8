"""Round 13 adversarial review of the disk tier's restart / close / start-up machinery as 3e4bd18, f206d7e,
be21d39 and 9acea0b left it (``DiskTier._start`` / ``_starting`` / ``restart`` / ``abandon`` / ``restarting`` /
``died`` / ``leave_path``, ``TierCore.close_disk``, ``ProcessDiskStore.died``, ``lock.share`` / ``lock.leave``,
``ProcessDiskStore.kick``'s ``_drain`` chain).

What it proved wrong (each test fails without its fix):

1. ``test_a_restarted_disk_io_process_opens_the_directory_the_tier_locked`` -- ``disk_path`` is resolved again at
   every start of a disk I/O process.  ``DiskTier.open`` takes the path lock of ``cfg.disk_dir`` as that path
   named a directory at the open, and keeps a share of that lock (``lock.share``) for every later store; but the
   options it hands to each new store (``DiskOptions.path``) keep the path as given, and each new child opens it
   by name with the owner's working directory of the moment.  After the host changes its working directory
   (``os.chdir``: a daemonizing host, a notebook's ``%cd``) under a relative ``disk_path``, or after a symlink in
   the path is repointed (a deploy's ``current`` link), the replacement of a dead child -- by a pass
   (``TierCore.end_step`` -> ``DiskTier.restart``) or by ``close()``'s reconciling start
   (``TierCore.close_disk``) -- opens *another* directory, one whose lock it never took (the child trusts the
   share it was given: ``DiskStore(lock_fd=...)`` never locks).  If that directory holds another owner's tier of
   the same namespace, two owners write one path at once (invariant 16), and the adoption's reconciliation
   (``DiskTier._adopt``) drops every block of this tier from its index ("lost with the last one") and *deletes*
   every block of the other owner's tier ("on disk no longer wanted"), whose index still says they are there;
   if it holds nothing, the child makes a fresh, unlocked tier there.  The library knows the hazard:
   ``CachedReads.__init__`` (tiered_kv/disk/cached.py:61) makes its path absolute "not relative to a later
   working dir"; the restart path does not.
   Why it matters: lost data of another live owner, two writers on one LMDB environment and slot file, this
   tier's own blocks all dropped from its index (misses for blocks intact on disk).
   ``test_a_restart_after_the_working_directory_went_neither_raises_nor_keeps_the_path`` -- the same root cause
   when the working directory was *removed*: each start's ``ProcessDiskStore.__init__`` builds
   ``CachedReads``, whose ``Path("disk").absolute()`` calls ``os.getcwd()`` and raises ``FileNotFoundError``;
   ``restart()`` takes that for a bug and raises it out of the engine's pass (``poll()``), with no back-off, at
   every retry, and each retry leaks a share of the path lock (finding 2): after ``close()`` the path stays
   locked for the process's life.
   Suggested fix: resolve the path once at open -- ``DiskOptions(path=Path(cfg.disk_dir).resolve(), ...)`` in
   ``DiskTier.open``, and ``take_path`` on that same resolved path -- so that the lock taken, every store's
   ``DiskEnv``/``SlotFile``, the owner's page-cache reads and the thread-mode store's later path uses
   (``DiskEnv``'s ``data.mdb`` stat and truncate at map growth, the writer's ``shutil.disk_usage``) name the
   directory locked at the open, and no ``getcwd`` is needed after it (``absolute()`` covers the working
   directory only, not a repointed link).  Fixed so: ``DiskTier.open`` resolves ``disk_path`` once
   (``os.path.realpath``) and locks and opens that; a working directory already gone at the open is an
   ``open_failed`` fault (host-only service), not an exception.

2. ``test_an_interrupt_as_the_disk_io_store_is_made_leaves_the_path_free`` -- the lock share ``DiskTier.open``'s
   ``make()`` hands to ``ProcessDiskStore(..., lock_fd=share)`` is left only by the ``except`` of the
   constructor's ``try: self._start()``.  Anything raised before that ``try`` (a Ctrl-C at one of the calls
   before it -- the constructor's entry, ``CachedReads(...)``, ``RecoveryReport()``, ``_check_sigpipe()`` --,
   or the ``FileNotFoundError`` of finding 1's second test) propagates through ``make()``, which does not leave
   the share either; ``DiskTier.open`` leaves only the tier's own share, and a restart's starter thread leaves
   nothing.  The ``dup`` stays open and in ``lock._held``: the path is locked for the rest of the process's life
   (a retry in the same process is refused with ``DiskInUseError`` naming its own pid), one more descriptor per
   failed restart.
   Suggested fix: in ``make()``, ``try: return ProcessDiskStore(...)`` / ``except BaseException:
   path_lock.leave(share); raise`` (``leave`` is identity-checked, so the constructor's own leave and this one
   never close a number twice); or start the constructor's ``try`` right after ``self._lock_fd`` is set.
   Fixed the first way.

Checked and found to hold (no test):

* ``DiskTier.restart``'s never-started / still-bootstrapping starter handling after 3e4bd18: a starter whose
  thread sets ``ident`` between the owner's look and ``abandon()`` makes at most one extra store, which the late
  thread closes itself (``abandoned`` read under the start's lock; the two children may recover the path at once,
  both under the tier's lock); ``abandon()`` on a start whose outcome has just been appended returns False and
  leaves it to be adopted.
* ``close_disk``: a start in flight at close that is adopted or abandoned is its one reconciling start; a failed
  one leaves the ``disk.died`` branch to start one (``died`` now derived from ``restarting``); an interrupt at the
  end of any call there is finished by the next ``close()``; every wait is bounded (30 s per start, the store's
  own close deadline), and the thread-mode tier (no ``_reopen``) never enters either branch.
* ``_adopt``'s ordering: ``usable`` turns True only after the last call (``store.kick()``) and just before
  ``_adopting`` is cleared, with no CALL (no eval-breaker check) between, so a re-run adoption never meets spills
  started on the new store; ``index.entries()`` is a list copy, so removals inside the loop are safe.
* Ops a dead child had: every promote/spill/flush answered before ``down`` (``_gone``), applied by
  ``end_step``'s ``apply_arrived`` before ``restart``; spills are shed and promotes answered ``NOT_READ`` while
  the tier is restarting (``self.store`` is still the dead store until adoption), so the index holds only READY
  entries with no reader when ``_adopt`` reconciles.
* Lock shares: every ``ProcessDiskStore`` leaves (never unlocks) its share on a failed ``_start()`` and at its close
  (``_release``, also the receiver's late release); the tier leaves its own once (``leave_path``), after its
  stores; an abandoned start after ``leave_path`` gets ``EBADF`` from ``lock.share`` (identity check) and starts
  no child; a share made before ``leave_path`` keeps the path locked until the abandoned store closes.
* No fd, thread or child leak over three kill/restart cycles and a close (real child processes): the only fd left
  is the host slab's mapping, which lives with the tensor.
* ``kick``'s ``_drain`` chain: a partial write removes exactly what was written, ``BlockingIOError`` keeps the
  rest, ``EPIPE`` clears it; a store that is down drops its ops and backlog at the next ``kick``.

Seen and not filed (documented choices): a start in flight at close is abandoned after ``RESTART_CLOSE_WAIT_S``
(30 s) also when it is a long recovery rather than a hung disk, and then nothing is reconciled; a child killed by
``close()`` for outlasting its deadline gets no reconciling start (``died`` is False); while the tier restarts,
``lookup`` still counts its disk blocks as hits and a load of them fails (``DiskTier.dead``: "a read started now
fails at once"); a second death during the close's reconciling start ends the close ("once").
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

import tiered_kv.disk.proc as proc_mod
from disk_helpers import Rig, disk_health, keys, make_kv, metric, rig, store_seq  # noqa: F401
from test_review_round11_disk import _path_is_free
from tiered_kv import TierManager
from tiered_kv.disk import lock as lock_mod
from tiered_kv.disk.proc import ProcessDiskStore

pytestmark = pytest.mark.timeout(60)

__all__ = ["rig"]


def _wait(pred, what: str, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    """Poll a condition another process or thread makes true (a bounded wait, never an ordering sleep)."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


# =========================================================================== finding 1
def _process_manager_in(rig: Rig, cwd: Path, monkeypatch: pytest.MonkeyPatch,
                        prefix: str) -> tuple[TierManager, list[bytes]]:
    """A process-mode manager opened on the *relative* ``disk_path="disk"`` with ``cwd`` as the working directory,
    four blocks spilled (durable)."""
    monkeypatch.chdir(cwd)
    kv = make_kv(rows=8)
    mgr = rig.open(kv, path=Path("disk"), host_slots=8, disk_slots=64, disk_io="process")
    ks = keys(4, prefix)
    store_seq(mgr, kv, ks)
    return mgr, ks


def _kill_child(mgr: TierManager) -> ProcessDiskStore:
    dead = mgr.disk
    assert isinstance(dead, ProcessDiskStore)
    dead.kill_for_test(signal.SIGKILL)
    _wait(lambda: dead.down, "the dead child's ops to be answered")
    return dead


@pytest.mark.parametrize("where", ["restart_in_a_pass", "reconciling_start_at_close"])
@pytest.mark.parametrize("how", ["relative_path_after_chdir", "symlink_repointed"])
def test_a_restarted_disk_io_process_opens_the_directory_the_tier_locked(
        rig: Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, how: str) -> None:
    """Contract: invariant 16 (docs/architecture.md, "One owner per disk path": a second store on a path another
    owner holds is refused; the tier's share keeps *its* path locked while a dead child is replaced) and
    ``DiskTier.restart``'s reconciliation ("an entry the index holds under the same writer token stays"; only
    what the owner dropped is deleted).  The replacement child must open the directory the tier opened and locked.

    Forced scenario: manager A opens its tier in ``a/`` -- as the relative ``disk_path="disk"`` with ``a/`` the
    working directory, or as ``current/disk`` with the symlink ``current -> a`` (a deploy's link) -- and spills
    four blocks; manager B (same namespace) opens ``b/disk`` and spills four of its own.  The host then changes
    its working directory to ``b/`` (or the link is repointed to ``b``) and A's disk I/O process dies (SIGKILL).
    Its replacement -- started by A's next pass, or by A's ``close()`` when no pass ran -- opens ``b/disk``, B's
    live tier, without its lock; A's adoption finds none of its tokens there, drops its four blocks from its
    index and deletes B's four blocks.  A fixed tier keeps its four blocks and B's survive.
    """
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    link = tmp_path / "current"
    if how == "relative_path_after_chdir":
        mgr_a, ks_a = _process_manager_in(rig, a, monkeypatch, "r13a")
    else:
        link.symlink_to(a)
        kv_a = make_kv(rows=8)
        mgr_a = rig.open(kv_a, path=link / "disk", host_slots=8, disk_slots=64, disk_io="process")
        ks_a = keys(4, "r13a")
        store_seq(mgr_a, kv_a, ks_a)
    kv_b = make_kv(rows=8, seed=11)
    mgr_b = rig.open(kv_b, path=b / "disk", host_slots=8, disk_slots=64, disk_io="process")
    ks_b = keys(4, "r13b")
    store_seq(mgr_b, kv_b, ks_b)

    if how == "relative_path_after_chdir":
        monkeypatch.chdir(b)   # the host changes its working directory after the open
    else:
        link.unlink()          # the deploy's link now names the other directory
        link.symlink_to(b)
    dead = _kill_child(mgr_a)
    tier = mgr_a._core.disk
    assert tier is not None
    kept_by_a = None
    if where == "restart_in_a_pass":
        deadline = time.monotonic() + 20
        while mgr_a.disk is dead or tier.restarting or not tier.usable:   # the engine's passes restart it
            mgr_a.wait(timeout=0.01)
            assert time.monotonic() < deadline, "the disk I/O process was never restarted"
        kept_by_a = len(tier.index)
    mgr_a.close()          # (at close: its reconciling start is the one that opens the wrong directory)
    mgr_b.close()

    mgr_b2 = rig.open(make_kv(rows=8), path=b / "disk", host_slots=8, disk_slots=64, disk_io="process")
    found_b = mgr_b2.lookup(ks_b)
    mgr_b2.close()
    mgr_a2 = rig.open(make_kv(rows=8), path=a / "disk", host_slots=8, disk_slots=64, disk_io="process")
    found_a = mgr_a2.lookup(ks_a)
    mgr_a2.close()
    assert found_a == len(ks_a)   # A's blocks were never touched on disk: only its index forgot them
    assert found_b == len(ks_b) and kept_by_a in (None, len(ks_a)), (
        f"after the {how.replace('_', ' ')}, A's replacement disk I/O process opened b/disk (B's live tier, "
        f"locked by B): {len(ks_b) - found_b} of B's {len(ks_b)} blocks were deleted by A's reconciliation; A's "
        f"index kept {kept_by_a} of its {len(ks_a)} blocks that are intact in a/disk")


def test_a_restart_after_the_working_directory_went_neither_raises_nor_keeps_the_path(
        rig: Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Contract: the engine's thread never sees a disk fault as an exception ("a failed restart is counted
    (``io_process_restart_failed``) and retried after 1 s, doubling"); invariant 16: the path is free once the
    owner closed and its children are gone.

    Forced scenario: the same relative ``disk_path``; the host's working directory is then removed (a release or
    scratch directory deleted under a running server) and the disk I/O process dies.  The pass's start runs
    ``DiskTier._reopen`` on the starter thread: ``lock.share`` makes a share of the tier's lock, then
    ``ProcessDiskStore.__init__`` builds ``CachedReads(opts.path, ...)`` *before* its ``try``, whose
    ``Path("disk").absolute()`` calls ``os.getcwd()``: ``FileNotFoundError``.  Nothing leaves that share (the
    constructor's cleanup is inside the ``try`` it never reached), and ``restart()`` takes an exception other
    than ``DiskTierError`` for a bug and raises it out of the next pass (``TierCore.end_step``), with no back-off:
    every second ``poll()`` raises and leaks one more share; after ``close()`` the path stays locked for the
    process's life.  Each pass's start is awaited (``join`` of the starter thread) so that the outcome is seen
    by the next pass deterministically.
    """
    before = set(lock_mod._held)
    a = tmp_path / "a"
    a.mkdir()
    mgr, ks = _process_manager_in(rig, a, monkeypatch, "r13w")
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()           # the working directory is removed under the running host
    _kill_child(mgr)
    tier = mgr._core.disk
    assert tier is not None
    raised: list[BaseException] = []
    for _ in range(4):     # four engine passes, each start awaited before the next pass looks at it
        if tier._starting is not None:
            tier._starting[0].join(15)
        tier._retry_at = 0.0   # (the back-off of a failed start is not what this test waits for)
        try:
            mgr.poll()
        except Exception as exc:   # noqa: BLE001 - what the engine's thread would get
            raised.append(exc)
    monkeypatch.chdir(a)   # (back where the tier was opened: the close's reconciling start opens a/disk)
    mgr.close()
    leaked = [fd for fd in lock_mod._held if fd not in before]
    free = _path_is_free(a / "disk")
    try:
        assert not raised and free and not leaked, (
            f"{len(raised)} of 4 passes raised {[type(e).__name__ for e in raised]} to the engine; after close "
            f"the path is {'free' if free else 'locked'} and {len(leaked)} share(s) of its lock stay open")
    finally:
        for fd in leaked:   # (the later tests of this process must not inherit them)
            lock_mod.leave(fd)


# =========================================================================== finding 2
def test_an_interrupt_as_the_disk_io_store_is_made_leaves_the_path_free(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Contract: invariant 16 (the path is held by a live owner only); round 11's fix 2 ("an exception (Ctrl-C)
    in ``DiskTier.open`` ... leaked the disk I/O process and the path lock: the same process could never open the
    path again.  Fixed: both close what they opened").

    What is wrong: ``DiskTier.open``'s ``make()`` (tiered_kv/core/disk_tier.py) takes a share of the tier's
    lock (``path_lock.share(held[0])``, a ``dup`` recorded in ``lock._held``) and hands it to
    ``ProcessDiskStore(..., lock_fd=share)``.  The constructor leaves a share it was given only in the
    ``except`` of its ``try: self._start()`` (tiered_kv/disk/proc.py); everything before that ``try`` --
    ``CachedReads(...)``, ``RecoveryReport()``, ``_check_sigpipe()``, the constructor's own entry -- is a
    Python call whose eval-breaker check runs a pending SIGINT handler.  A Ctrl-C there (or any exception
    there) propagates through ``make()``, which does not leave the share either; ``DiskTier.open``'s
    ``except BaseException`` leaves only the tier's own share (``held``).  The dup stays open and in
    ``_held``: the path is locked for the rest of the process's life, and a retry (a notebook, an engine that
    catches the interrupt) is refused with ``DiskInUseError`` naming its own pid.  The same leak happens on the
    starter thread at every restart whose constructor fails there (see the test above: one share per pass).
    Fix: in ``make()``, ``try: return ProcessDiskStore(...)`` / ``except BaseException: path_lock.leave(share);
    raise`` (``leave`` acts once: the identity check makes a second leave of the same share a no-op), or begin
    the constructor's ``try`` right after ``self._lock_fd`` is set.

    The interrupt is injected at the constructor's first Python call before its ``try`` (``CachedReads``), where
    CPython runs a pending SIGINT handler (its ``RESUME`` eval-breaker check).
    """
    interrupted_open_leaves_the_path_free(rig, monkeypatch, proc_mod, "CachedReads", after=False,
                                          what="its disk I/O store was made")


def interrupted_open_leaves_the_path_free(rig: Rig, monkeypatch: pytest.MonkeyPatch, owner: Any, name: str,
                                          after: bool, what: str) -> None:
    """A process-mode manager's open interrupted once (``KeyboardInterrupt``) at ``owner.name``, before the call
    or, with ``after``, as it returns: the open raises it, and no share of the path's lock stays open, the path
    free (shares left after the check are left, so that the next tests find the path free)."""
    before = set(lock_mod._held)
    fired: list[bool] = []
    real = getattr(owner, name)

    def interrupted(*a: Any, **k: Any) -> Any:
        got = real(*a, **k) if after else None
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt   # where CPython would run a pending SIGINT handler
        return got if after else real(*a, **k)

    monkeypatch.setattr(owner, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        rig.open(make_kv(rows=8), host_slots=8, disk_slots=64, disk_io="process")
    assert fired
    monkeypatch.undo()
    leaked = [fd for fd in lock_mod._held if fd not in before]
    free = _path_is_free(rig.path)
    try:
        assert free and not leaked, (
            f"after a start-up interrupted as {what}, no owner is left but the path is "
            f"{'free' if free else 'locked'} and {len(leaked)} share(s) of its lock stay open in this process")
    finally:
        for fd in leaked:   # (the next tests of this process must find the path free)
            lock_mod.leave(fd)


@pytest.mark.parametrize("disk_io", ["process", "thread"])
def test_a_relative_disk_path_under_a_working_directory_already_gone_serves_host_only(
        rig: Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, disk_io: str) -> None:
    """Finding 1's fix resolves ``disk_path`` once, at the open.  Where the working directory is already gone then,
    the path cannot be resolved: the manager still opens, serving from the host tier with the disk tier counted
    unhealthy (``open_failed``), and no share of any lock stays open."""
    before = set(lock_mod._held)
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    kv = make_kv(rows=8)
    mgr = rig.open(kv, path=Path("disk"), host_slots=8, disk_slots=64, disk_io=disk_io)
    assert mgr.disk is None
    assert metric(mgr, "tiered_kv_errors_total", tier="disk", error="open_failed") == 1
    assert disk_health(mgr) == 0
    ks = keys(2, "r13g")
    store_seq(mgr, kv, ks)
    assert mgr.lookup(ks) == 2
    mgr.close()
    assert set(lock_mod._held) == before
