"""Adversarial review, round 5: commits abbd538 (held recency touches), 294a32f (Readers._enqueue /
_answer_unread), a28f3b1 (SlabScheduler REQUESTS_MAX), d274653 (closes re-runnable after an interrupt) and
836df1b (DiskTier.restart / _adopt / down).

Interrupts are injected as in round 4: a function the code calls raises KeyboardInterrupt at the chosen call
(CPython 3.11 checks for a pending signal at a Python function's RESUME, before its first line runs, and after
a call of a builtin returns).

What it proved wrong, each test failing before its fix:

1. ``DiskStore._release`` (thread mode, own lock): ``lock.release(fd)`` then ``_lock_fd = -1``; interrupted
   between them, the next close released the same fd NUMBER again -- another path's lock taken meanwhile.
2. ``ProcessDiskStore._release``: ``_lock_fd = -1`` before ``lock.release``; interrupted at that call's entry,
   the next close returned at once and the path stayed locked for good.
   Fixed (1, 2): ``lock.take`` returns a ``LockFd`` (an ``int`` with an identity); ``release``/``leave`` act
   on that one only while it holds the lock, so a second release does nothing even once the number is
   another lock's, and both stores mark the lock released only after releasing it.
3. ``DiskTier._adopt``: ``index.remove(d)`` then ``on_gone(d)``; interrupted at on_gone, the re-run never told
   the front end.  Fixed: told first (twice at most, never lost).
4. ``Writer.settle_orphans`` (in ``DiskStore.close``): the dead writer's removals were taken out before their
   transaction; interrupted, the next close settled nothing and an invalidated key survived on disk.  Fixed:
   taken out once committed.
5. ``DiskStore.close``: ``_closed = True`` before ``reaper.start()``; interrupted at the start, no reaper and
   no later close ever released the path.  Fixed: the reaper is kept, a close run again starts it (a thread
   runs once), and ``_closed`` is set after the start.
6. ``DiskTier._adopt``: ``_exported`` marked before ``_export_recovery()``; interrupted there, the restarted
   process's recovery was never exported.  Fixed: the gauges are set at every run, the counts added once
   (marked just before them).

Checked and found right (no test): the touch count against ``_cmds`` (submit, kick, a down store, the
backlog, ``start_reads``' ``+=``, close's "X"); ``Readers._enqueue`` / ``_answer_unread`` at each call;
``RemoteStore.close`` re-run and ``available``; ``SlotFile.close``; reads and spills while ``_adopting``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

import tiered_kv.disk.lock as lock_mod

import disk_helpers as dh

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def drig(tmp_path: Path) -> Iterator[dh.Rig]:
    r = dh.Rig(tmp_path)
    yield r
    r.close_all()


# =============================================================================== d274653: DiskStore._release
def test_thread_a_close_interrupted_after_the_lock_release_does_not_release_another_paths_lock(
        drig: dh.Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kv = dh.make_kv(rows=8)
    mgr = drig.open(kv, host_slots=8, disk_slots=64, disk_io="thread")
    dh.store_seq(mgr, kv, dh.keys(2, "t"))
    store = mgr.disk
    old_fd = store._lock_fd
    real_release = lock_mod.release
    fired: list[int] = []

    def release_then_interrupt(fd: int) -> None:
        real_release(fd)
        if not fired and fd == old_fd:
            fired.append(fd)
            raise KeyboardInterrupt   # the SIGINT handled as lock.release returns, before ``_lock_fd = -1``

    monkeypatch.setattr(lock_mod, "release", release_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        mgr.close()
    assert fired and store._lock_fd == old_fd
    monkeypatch.undo()
    # the host goes on: another disk tier path is locked, and its lock file gets the freed number
    taken: list[tuple[Path, int]] = []
    other = None
    for i in range(64):
        d = tmp_path / f"other{i}"
        d.mkdir()
        fd = lock_mod.take(d)
        taken.append((d, fd))
        if fd == old_fd:
            other = d
            break
        if fd > old_fd:
            break
    try:
        assert other is not None, f"fd {old_fd} not reused by a new lock: {taken}"
        mgr.close()                       # finishes the broken-off close
        try:
            again = lock_mod.take(other)
        except lock_mod.LockHeld:
            again = -1
        if again >= 0:
            lock_mod.release(again)
        assert again < 0, (f"the lock of {other} (fd {old_fd}) was released by the close of another store "
                           f"that had released fd {old_fd} already")
    finally:
        for d, fd in taken:
            lock_mod.release(fd)          # (a no-op for one no longer held)


# =============================================================================== d274653: ProcessDiskStore._release
@pytest.mark.parametrize("whose", ["store", "tier"])
def test_process_a_close_interrupted_at_the_lock_release_still_frees_the_path(
        drig: dh.Rig, monkeypatch: pytest.MonkeyPatch, whose: str) -> None:
    """The path lock of the disk I/O process has two shares (the store's and the tier's, which keeps the path
    locked while a dead child is replaced): a close interrupted as either is closed is finished by the next."""
    kv = dh.make_kv(rows=8)
    mgr = drig.open(kv, host_slots=8, disk_slots=64, disk_io="process")
    dh.store_seq(mgr, kv, dh.keys(2, "r"))
    lock_fd = mgr.disk._lock_fd if whose == "store" else mgr._core.disk._path_lock
    assert lock_fd is not None and lock_fd >= 0
    real_leave = lock_mod.leave
    fired: list[int] = []

    def interrupt_at_entry(fd: int) -> None:
        if not fired and fd is lock_fd:
            fired.append(fd)
            raise KeyboardInterrupt   # handled at lock.leave's first instruction: nothing closed yet
        real_leave(fd)

    monkeypatch.setattr(lock_mod, "leave", interrupt_at_entry)
    try:
        with pytest.raises(KeyboardInterrupt):
            mgr.close()
        assert fired
        mgr.close()                       # finishes the close
        monkeypatch.undo()
        dh.assert_reopens(drig, kv, host_slots=8, disk_slots=64, disk_io="process")
    finally:
        monkeypatch.undo()
        lock_mod.leave(lock_fd)           # (a no-op once closed)


# =============================================================================== 836df1b: _adopt run again
def test_an_interrupt_at_on_gone_in_an_adoption_still_tells_the_front_end_once_it_is_finished(
        drig: dh.Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    kv = dh.make_kv(rows=8)
    mgr = drig.open(kv, host_slots=8, disk_slots=64, disk_io="process")
    dh.store_seq(mgr, kv, [b"a", b"b"])
    tier = mgr._core.disk
    old = mgr.disk
    real_adopt, real_gone = tier._adopt, tier.on_gone
    gone: list[bytes] = []
    fired: list[bytes] = []

    def adopt(store: Any, now: float) -> None:
        if not fired:   # the new process did not find ``a`` (lost with the last one: a crash before its sync)
            store.entries = [e for e in store.entries if e.key != b"a"]
        real_adopt(store, now)

    def on_gone(d: Any) -> None:
        if not fired:
            fired.append(d.key)
            raise KeyboardInterrupt   # handled at on_gone's entry: nothing of it ran
        gone.append(d.key)
        real_gone(d)

    monkeypatch.setattr(tier, "_adopt", adopt)
    monkeypatch.setattr(tier, "on_gone", on_gone)
    old.kill_for_test()
    old._receiver.join(30)
    mgr.poll()                            # starts the new process (a starter thread)
    assert tier._starting is not None
    tier._starting[0].join(30)
    with pytest.raises(KeyboardInterrupt):
        mgr.poll()                        # adopts it: interrupted at on_gone(a)
    assert fired == [b"a"] and tier._adopting is not None
    mgr.poll()                            # the adoption is finished
    assert tier._adopting is None and mgr.disk is not old
    assert mgr._core.dindex.get(b"a") is None
    assert b"a" in gone, f"on_gone never called for the entry the restarted process lost: {gone}"


# =============================================================================== d274653: DiskStore.close, orphans
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_thread_a_close_interrupted_while_it_settles_the_dead_writers_removals_still_applies_them(
        drig: dh.Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    kv = dh.make_kv(rows=8)
    mgr = drig.open(kv, host_slots=8, disk_slots=64, disk_io="thread")
    dh.store_seq(mgr, kv, [b"a", b"b"])
    store = mgr.disk
    gate = drig.gate(mgr, block_from=None, raise_at={1: SystemExit("test: the writer thread dies")})
    mgr.invalidate(b"a")                  # its tomb: the writer dies in the commit, the removal is an orphan
    mgr.poll()
    gate.entered(1)
    store.writer._thread.join(30)
    assert not store.writer._thread.is_alive()
    assert any(getattr(op, "key", None) == b"a" for op in store.writer._orphans), store.writer._orphans
    rw = store.db.rw
    real_acquire = rw.acquire_shared
    fired: list[int] = []

    def acquire_interrupted() -> None:
        if not fired and not store.writer._thread.is_alive():
            fired.append(1)
            raise KeyboardInterrupt   # handled at the call's entry: the orphans are taken out already
        real_acquire()

    monkeypatch.setattr(rw, "acquire_shared", acquire_interrupted)
    with pytest.raises(KeyboardInterrupt):
        mgr.close()
    assert fired
    mgr.close()                           # finishes the close
    monkeypatch.undo()
    assert b"a" not in dh.raw_keys(drig.path), "an invalidated key is on disk after close() was finished"


# =============================================================================== d274653: DiskStore.close, the reaper
def test_thread_a_close_interrupted_as_it_starts_the_reaper_still_releases_the_path(
        drig: dh.Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading as real_threading

    import tiered_kv.disk.store as store_mod
    from tiered_kv.errors import DiskInUseError

    kv = dh.make_kv(rows=8)
    mgr = drig.open(kv, host_slots=8, disk_slots=64, disk_io="thread")
    dh.store_seq(mgr, kv, dh.keys(2, "t"))
    store = mgr.disk
    real_join = store.readers.join
    hung: list[int] = []

    def join_hung_once(timeout: Any = None) -> bool:
        done = real_join(timeout)
        if not hung:
            hung.append(1)
            return False          # close's join: a reader "still runs" after CLOSE_JOIN_S (a hung disk)
        return done

    fired: list[int] = []

    class Thread(real_threading.Thread):
        def start(self) -> None:
            if not fired and self.name == "tiered-kv-disk-reaper":
                fired.append(1)
                raise KeyboardInterrupt   # handled at Thread.start's entry: nothing started
            super().start()

    class Threading:
        def __getattr__(self, name: str) -> Any:
            return getattr(real_threading, name)

    shim = Threading()
    shim.Thread = Thread                  # type: ignore[attr-defined]
    monkeypatch.setattr(store.readers, "join", join_hung_once)
    monkeypatch.setattr(store_mod, "threading", shim)
    with pytest.raises(KeyboardInterrupt):
        mgr.close()
    assert fired and hung
    mgr.close()                           # finishes the close
    monkeypatch.undo()
    for t in real_threading.enumerate():  # a reaper (once fixed) releases the path as the reader's join ends
        if t.name == "tiered-kv-disk-reaper":
            t.join(30)
    try:
        again = drig.open(kv, host_slots=8, disk_slots=64, disk_io="thread")
    except DiskInUseError as exc:
        locked = str(exc)
    else:
        locked = ""
        drig.close(again)
    finally:
        if store._lock_fd >= 0:           # what the broken-off close left held
            store._release()
    assert not locked, f"the path stays locked after close() was finished: {locked}"


def test_an_interrupt_at_the_recovery_export_in_an_adoption_still_exports_it_once_it_is_finished(
        drig: dh.Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    kv = dh.make_kv(rows=8)
    mgr = drig.open(kv, host_slots=8, disk_slots=64, disk_io="process")
    dh.store_seq(mgr, kv, [b"a", b"b"])
    tier = mgr._core.disk
    old = mgr.disk
    real_export = tier._export_recovery
    fired: list[int] = []

    def export() -> None:
        if not fired and tier.store is not old:
            fired.append(1)
            raise KeyboardInterrupt   # handled at the call's entry: nothing exported
        real_export()

    monkeypatch.setattr(tier, "_export_recovery", export)
    old.kill_for_test()
    old._receiver.join(30)
    mgr.poll()                            # starts the new process (a starter thread)
    assert tier._starting is not None
    tier._starting[0].join(30)
    with pytest.raises(KeyboardInterrupt):
        mgr.poll()                        # adopts it: interrupted at the export
    assert fired and tier._adopting is not None
    mgr.poll()                            # the adoption is finished
    assert tier._adopting is None and mgr.disk is not old
    new_s, old_s = mgr.disk.recovery.seconds, old.recovery.seconds
    assert new_s != old_s
    got = dh.metric(mgr, "tiered_kv_recovery_seconds")
    assert got == new_s, (f"tiered_kv_recovery_seconds = {got} (the dead process's: {old_s}), not the restarted "
                          f"process's {new_s}")
