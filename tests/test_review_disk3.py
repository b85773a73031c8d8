"""Third adversarial review of the disk tier's I/O side: tiered_kv/disk/{proc,pipes,child,env,slots,tombs,
recovery,writer,readers,store,lock,format}.py and core/disk_tier.py where it applies their reports.

What it proved wrong (each test failed before its fix):

1. writer.py ``_commit``: ``db.cover_pages()`` runs after the LMDB commit inside the ``try`` whose ``except``
   gives the batch's slots back and fails its spills.  A fault there (EIO) leaves committed entries whose
   slots are free: a later acknowledged, flushed write is overwritten (lost), and a spill reported failed is
   on disk, so the key's invalidation never tombstones it and it is served after a reopen.
2. recovery.py ``SEQ_LIMIT``: a damaged sequence number just below the limit passes recovery and the writer
   numbers every later write at or past it; the next open drops every one of them as corrupt.
3. store.py ``DiskStore.__init__``: the writer and reader threads start after ``_open``'s clean-up scope; a
   thread that cannot start leaks the path lock, the environment and the writer (the path cannot be
   opened again in this process).
4. proc.py ``_start``: a receiver thread that cannot start leaves the child running (never reaped, its
   command pipe never closed) while ``__init__`` unlocks the path lock the child shares.
5. readers.py ``_read``/``_read_many``: any ``lmdb.Error`` (MDB_READERS_FULL) is READ_FAILED and the good,
   durable entry is deleted.
6. store.py ``_open``: the OSError of the directory fsync escapes unwrapped: in thread mode TierManager()
   raises instead of running host-only (process mode turns it into a DiskTierError).
7. lock.py: the lock's open file is inherited by every process the owner forks; a forked helper of a crashed
   owner keeps the tier locked (DiskInUseError naming the dead pid).
8. proc.py ``_kill``: ``subprocess.TimeoutExpired`` escapes when a killed child is not gone yet: an open
   that timed out on a hung disk raises it instead of ProcessStartError (and leaks both pipes).
9. writer.py ``_commit``/``_batch_failed``: a spill that cannot be written (ENOSPC) fails its whole batch,
   the tombs in it too, although they need no slot space; on a full disk with spills still coming the
   kept tomb fails with every batch and close() drops it: the invalidated block is served after reopen.
10. core/disk_tier.py ``restart`` (inside ``poll()``): the new I/O process is started synchronously and its
    open and recovery awaited on the engine thread (``_first_frame``, up to 600 s).

Faults are injected by monkeypatching (a store's ``cover_pages``, its ``env.begin``, ``Readers``,
``lock.fsync_path``, the receiver's ``Thread.start``, ``_spawn``); no test sleeps for ordering.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import lmdb
import pytest

from test_review_disk_writer import _Store as _WriterReviewStore, _payload
from disk_helpers import NS, ROW, Rig, load_into, make_kv, rig, store_one  # noqa: F401
from tiered_kv.disk.format import parse_header
from tiered_kv.disk.recovery import SEQ_LIMIT
from tiered_kv.disk.writer import CLOSE_RETRIES
import tiered_kv.disk.store as store_mod
from tiered_kv.disk import lock as lock_mod
from tiered_kv.disk import proc
from tiered_kv.disk.proc import ProcessDiskStore, SharedHost
from tiered_kv.disk.records import DiskOptions
from tiered_kv.errors import DiskInUseError, DiskTierError
from tiered_kv.hostmem import make_shared_rows
from tiered_kv.movers import CompletionQueue


class _Store(_WriterReviewStore):
    """test_review_disk_writer's thread-mode store (every answer collected by token), 16 slots and batches of one
    spill by default."""

    def __init__(self, path: Path, *, slots: int = 16, batch_blocks: int = 1, **opts: Any) -> None:
        super().__init__(path, slots=slots, batch_blocks=batch_blocks, **opts)


def _eio_once_after_commit(disk: Any) -> None:
    """The store's next ``cover_pages`` (run by the writer right after its LMDB commit) raises EIO once."""
    real = disk.db.cover_pages
    calls = {"n": 0}

    def cover_pages() -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.EIO, "Input/output error")
        real()

    disk.db.cover_pages = cover_pages


# --------------------------------------------------------------------------- 1
def test_a_fault_after_the_commit_never_frees_slots_that_committed_entries_reference(tmp_path: Path) -> None:
    """slots.py invariant: "a slot is referenced by at most one committed entry".  ``Writer._commit`` runs
    ``db.cover_pages()`` (a stat and an ``os.truncate`` of data.mdb) *after* the LMDB commit but inside the
    ``try`` whose ``except`` gives the batch's slots back (``slots.give_back(placed)``: "nothing committed
    references them") and fails its spills.  An EIO there leaves A committed on disk while its slot is free:
    B is written into the same slot, and once A's stale record is replaced (A spilled again, as write-back
    does after a failed spill) the slot is freed a second time and a third write C lands on B's bytes.  B was
    reported ok and flushed; it is lost (read back as corrupt)."""
    st = _Store(tmp_path / "d")
    try:
        _eio_once_after_commit(st.s)
        ta = st.spill(b"A")
        st.answer(ta)                          # reported failed today (though committed)
        tb = st.spill(b"B")
        assert st.answer(tb).ok and st.flush()   # B: acknowledged and durable
        ta2 = st.spill(b"A")                   # A stored again (its first spill "failed")
        assert st.answer(ta2).ok and st.flush()
        tc = st.spill(b"C")
        assert st.answer(tc).ok and st.flush()
        r, got = st.read(b"B", tb)
        assert r.ok and got == bytes(_payload(b"B")), r
    finally:
        st.close()


@pytest.mark.disk_threads
def test_a_key_invalidated_after_a_post_commit_fault_does_not_come_back(rig: Rig) -> None:
    """DESIGN: "cancel(job) and invalidate(key) record a tombstone ... a cancelled write never becomes
    visible"; manager.invalidate: "it is never served again until stored again".  The same post-commit EIO
    (``cover_pages``) makes the writer answer a committed spill as failed: the core drops the disk entry from
    its index (``DiskTier.finish_spill``), so ``invalidate`` finds nothing to tombstone, and the entry the
    writer did commit is recovered and served by the next open."""
    kv = make_kv(rows=4)
    mgr = rig.open(kv)
    assert mgr.disk is not None and hasattr(mgr.disk, "writer")
    _eio_once_after_commit(mgr.disk)
    store_one(mgr, kv, b"gone", 0, flush=False)
    mgr.flush(timeout=30)            # False today: the spill was reported failed
    mgr.invalidate(b"gone")
    rig.close(mgr)
    mgr2 = rig.open(kv)
    job, comp = load_into(mgr2, kv, b"gone", 1)
    assert job is None or not comp.ok, "an invalidated key was served after reopen"


# --------------------------------------------------------------------------- 2
def test_a_damaged_sequence_number_just_below_the_limit_does_not_cost_later_writes(tmp_path: Path) -> None:
    """recovery.py: "recovery reads no checksum: a damaged sequence number would number every later write
    past 64 bits", so a header (or touch record) whose seq is ``>= SEQ_LIMIT`` is dropped as damage.  The same
    damage one below the limit passes, the writer resumes from it (``seq`` = SEQ_LIMIT - 1), numbers the next
    write SEQ_LIMIT, and the next open drops that good, flushed write as corrupt -- and every one after it,
    at every open, for good.  The damaged record itself is the only thing that may be lost."""
    path = tmp_path / "d"
    st = _Store(path)
    t = st.spill(b"X")
    assert st.answer(t).ok and st.flush()
    # damage X's record: its sequence number (outside nothing recovery checks) becomes SEQ_LIMIT - 1
    st.rewrite_record(b"X", lambda b: _with_seq(bytes(b), SEQ_LIMIT - 1))
    st.close()
    st = _Store(path)
    try:
        ty = st.spill(b"Y")
        assert st.answer(ty).ok and st.flush()
    finally:
        st.close()
    st = _Store(path)
    try:
        r, got = st.read(b"Y", ty)
        assert r.ok and got == bytes(_payload(b"Y")), r
    finally:
        st.close()


def _with_seq(value: bytes, seq: int) -> bytes:
    """``value`` (a slot entry's index record) with its sequence number replaced, checksum left as it was."""
    h = parse_header(value)
    assert h.in_slot
    b = bytearray(value)
    b[20:28] = seq.to_bytes(8, "little")   # magic 4, version 2, flags 2, ns_len 2, key_len 2, length 8, seq 8
    return bytes(b)


# --------------------------------------------------------------------------- 3
def test_an_open_that_cannot_start_its_threads_releases_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """store.py: "Invariant of the facade: open takes the path lock, then the environment, the slot file and
    recovery, in that order, and releases all of it if any step fails".  Starting the writer and reader
    threads is the last step of the same open (``DiskStore.__init__``), outside ``_open``'s clean-up: when it
    fails (``RuntimeError: can't start new thread`` at a thread or memory limit) the exception reaches the
    caller, but the path lock, the environment, the slot file and the already started writer thread stay
    behind, so the tier cannot be opened again in this process (DiskInUseError naming our own pid) until it
    exits."""
    path = tmp_path / "d"
    real = store_mod.Readers

    def no_threads(*a: Any, **kw: Any) -> Any:
        raise RuntimeError("can't start new thread")

    writers: list[Any] = []
    real_writer = store_mod.Writer

    def writer(*a: Any, **kw: Any) -> Any:
        w = real_writer(*a, **kw)
        writers.append(w)
        return w

    monkeypatch.setattr(store_mod, "Readers", no_threads)
    monkeypatch.setattr(store_mod, "Writer", writer)
    with pytest.raises((RuntimeError, DiskTierError)):   # as it is, or wrapped by a fix
        _Store(path)
    monkeypatch.setattr(store_mod, "Readers", real)
    try:
        st = _Store(path)      # the fault is gone: the tier opens again
    except DiskInUseError:
        for w in writers:      # what the failed open left running (the lock's fd stays open: not ours to guess)
            if w.alive():
                w.begin_close()
                w.join()
        raise
    st.close()


# --------------------------------------------------------------------------- 4
def test_an_open_whose_receiver_cannot_start_leaves_no_child_writing_the_path(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """proc.py: "the path lock is taken by the owner and shared with the child, so it is free only once both
    are gone".  ``_start`` kills the child only around the options write and the first frame; when the
    receiver thread then fails to start (``RuntimeError: can't start new thread``), ``__init__``'s clean-up
    unlocks the shared lock (``flock(LOCK_UN)`` on the open file both share) and raises, while the child --
    recovery done, its writer running, its command pipe still open in the owner (never EOF) -- lives on.
    The path is free (a second store may open it and allocate the same slots) while this child can still
    write it, and the child is never reaped."""
    mm, fd = make_shared_rows(4, ROW)
    anchor = ctypes.c_char.from_buffer(mm)
    base = ctypes.addressof(anchor)
    del anchor
    path = tmp_path / "d"
    opts = DiskOptions(path=path, namespace=NS, block_bytes=ROW, capacity_bytes=64 * ROW, batch_seconds=0.0)
    host = SharedHost(fd, 0, 4, ROW, base, populate=False)
    spawned: list[subprocess.Popen] = []
    real_spawn = proc._spawn

    def spawn(argv: list[str], fds: tuple[int, ...]) -> subprocess.Popen:
        p = real_spawn(argv, fds)
        spawned.append(p)
        return p

    class _NoReceiver(threading.Thread):
        def start(self) -> None:
            if self.name == "tiered-kv-disk-receiver":
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(proc, "_spawn", spawn)
    monkeypatch.setattr(proc, "threading", types.SimpleNamespace(Thread=_NoReceiver, Lock=threading.Lock))
    try:
        with pytest.raises((RuntimeError, DiskTierError)):   # as it is, or wrapped by a fix
            ProcessDiskStore(opts, CompletionQueue(), host)
        assert len(spawned) == 1
        child = spawned[0]
        try:
            child.wait(timeout=5)       # bounded: a child left behind never exits by itself
        except subprocess.TimeoutExpired:
            held = True
            try:
                lock_mod.release(lock_mod.take(path))
                held = False
            except lock_mod.LockHeld:
                pass
            raise AssertionError(f"the disk I/O process (pid {child.pid}) outlived its failed open; "
                                 f"path lock {'held' if held else 'FREE while it runs'}") from None
    finally:
        for p in spawned:
            if p.poll() is None:
                p.kill()
                p.wait(30)
        mm.close()
        os.close(fd)


# --------------------------------------------------------------------------- 5
class _ReadersFullOnce:
    """The store's LMDB environment, whose next ``n`` read transactions cannot begin: every slot of LMDB's
    reader table is taken (by read-only operator tools, which share the table and never take the path lock)."""

    def __init__(self, env: Any, n: int) -> None:
        self._env = env
        self.left = n

    def begin(self, *a: Any, **kw: Any) -> Any:
        if not kw.get("write", False) and self.left > 0:
            self.left -= 1
            raise lmdb.ReadersFullError("mdb_txn_begin: MDB_READERS_FULL: Environment maxreaders limit reached")
        return self._env.begin(*a, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


def test_a_read_refused_by_a_full_reader_table_does_not_delete_the_entry(tmp_path: Path) -> None:
    """readers.py: a read that "finds its entry corrupt, or fails with an I/O error" queues the entry's removal.
    ``Readers._read`` lumps every ``lmdb.Error`` with I/O errors: ``MDB_READERS_FULL`` -- the reader table is
    shared with every process reading the environment (``tiered-kv verify``/``export`` hold no path lock) --
    is answered READ_FAILED and the writer deletes the entry, token-matched (the core forgets it too:
    ``promote_reported`` keeps an entry only for NOT_READ).  The block was fine and durable; a later read with
    the table free finds it gone.  A transient refusal to begin a transaction should be a miss that keeps the
    block (NOT_READ), as a read the I/O process never made is."""
    st = _Store(tmp_path / "d")
    try:
        t = st.spill(b"K")
        assert st.answer(t).ok and st.flush()
        env = st.s.db.env
        st.s.db.env = _ReadersFullOnce(env, 1)
        r, _ = st.read(b"K", t)
        assert not r.ok                       # a miss now is fine ...
        st.s.db.env = env
        assert st.flush()
        r, got = st.read(b"K", t)             # ... but the block must still be there
        assert r.ok and got == bytes(_payload(b"K")), r
    finally:
        st.close()


# --------------------------------------------------------------------------- 6
@pytest.mark.disk_threads
def test_an_eio_syncing_the_tier_directory_at_open_runs_host_only(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """DiskTier.open: a tier that cannot open is "counted, logged, host-only service" (``open_failed``); it
    catches ``DiskTierError``, which every other step of the open is wrapped in (``take_path``, ``SlotFile``,
    LMDB errors, sizes).  ``DiskStore._open``'s ``lock.fsync_path(o.path, directory=True)`` (durability
    batch/sync) is not: an EIO there -- a failing disk -- propagates as a bare OSError out of
    ``TierManager.__init__``, and the engine does not start at all.  (The disk I/O process turns the same error
    into a DiskTierError, so under ``disk_io="process"`` the manager runs host-only: the two modes differ.)"""
    real = lock_mod.fsync_path

    def fsync_path(p: Any, directory: bool = False) -> None:
        if directory and Path(os.readlink(f"/proc/self/fd/{p}") if isinstance(p, int) else p).name == "disk":
            raise OSError(errno.EIO, "Input/output error")
        real(p, directory)

    monkeypatch.setattr(lock_mod, "fsync_path", fsync_path)
    kv = make_kv(rows=4)
    mgr = rig.open(kv)              # raises OSError today
    assert mgr.disk is None


# --------------------------------------------------------------------------- 7
_FORKING_OWNER = """
import os, sys, time, types
p = types.ModuleType("tiered_kv"); p.__path__ = [{pkg!r}]; sys.modules["tiered_kv"] = p
from tiered_kv.disk.store import take_path
from pathlib import Path
fd = take_path(Path({path!r}))          # the owner takes the tier's path (DiskStore/ProcessDiskStore do this)
pid = os.fork()                          # a helper the engine forks (multiprocessing's default start method)
if pid == 0:
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1); os.dup2(null, 2)   # (not the test's pipes)
    time.sleep(60)                       # ... that outlives the engine
    os._exit(0)
print(pid, flush=True)
os._exit(0)                              # the engine crashes: nothing released
"""


def test_a_forked_helper_of_a_crashed_owner_does_not_keep_the_path_locked(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """lock.py: "a lock held while the pid written in it is gone is held by that owner's disk I/O process
    (disk/proc.py), which shares the lock and dies with its owner: take() waits for it".  The lock's open file
    is shared with every process the owner forks (``os.fork``: multiprocessing workers, a forked data loader),
    not only with the I/O process, and nothing drops it in them (no ``register_at_fork`` for it; ``flock``
    belongs to the open file, so the lock lives as long as any copy).  When the engine crashes, its forked
    helper goes on holding the tier: the restarted engine waits ``ORPHAN_WAIT_S`` and gets DiskInUseError naming
    the dead pid (DiskTier.open raises it: the engine does not start), for as long as the helper lives."""
    path = tmp_path / "d"
    pkg = str(Path(proc.__file__).resolve().parent.parent)
    owner = subprocess.run([sys.executable, "-c", _FORKING_OWNER.format(pkg=pkg, path=str(path))],
                           capture_output=True, text=True, timeout=60)
    assert owner.returncode == 0, owner.stderr[-2000:]
    helper = int(owner.stdout.split()[0])
    monkeypatch.setattr(lock_mod, "ORPHAN_WAIT_S", 0.5)   # bounded: the helper lives for 60 s
    try:
        st = _Store(path)     # the owner is dead: its tier must open
        st.close()
    finally:
        try:
            os.kill(helper, signal.SIGKILL)
        except ProcessLookupError:
            pass


# --------------------------------------------------------------------------- 8
def test_an_open_timed_out_on_a_hung_disk_raises_a_disk_tier_error(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """proc.py: the constructor "raises like DiskStore at open: ... DiskTierError when it cannot be opened (or
    the child cannot start)"; DiskTier.open serves around exactly that (ProcessStartError: threads instead;
    DiskTierError: host-only), and DiskTier.restart -- run inside the engine's ``poll()`` -- catches only
    DiskTierError/DiskInUseError.  An open that times out (``_first_frame``: the child stuck on a hung disk)
    is cleaned up by ``_kill()``, whose ``self._proc.wait(timeout=_CLOSE_TIMEOUT_S)`` raises
    ``subprocess.TimeoutExpired`` when the killed child is not gone yet (uninterruptible sleep: the case
    ``close()`` handles with ``_release_late``); ``_kill`` catches only OSError, so TimeoutExpired replaces the
    ProcessStartError, leaks both pipes, and reaches the engine: TierManager() fails to start, or ``poll()``
    raises from a restart.  Simulated as test_review_disk_process2's P6 does: a stopped child whose SIGKILL is
    not acted on yet."""
    monkeypatch.setattr(proc, "_OPEN_TIMEOUT_S", 1.0)
    monkeypatch.setattr(proc, "_CLOSE_TIMEOUT_S", 1.0)
    real_spawn = proc._spawn
    spawned: list[subprocess.Popen] = []

    def stuck_spawn(argv: list[str], fds: tuple[int, ...]) -> subprocess.Popen:
        p = real_spawn(argv, fds)
        os.kill(p.pid, signal.SIGSTOP)        # hangs at open (a hung disk) ...
        p.kill = lambda: None                 # ... and a SIGKILL is not acted on yet (D state)
        spawned.append(p)
        return p

    monkeypatch.setattr(proc, "_spawn", stuck_spawn)
    mm, fd = make_shared_rows(4, ROW)
    anchor = ctypes.c_char.from_buffer(mm)
    base = ctypes.addressof(anchor)
    del anchor
    opts = DiskOptions(path=tmp_path / "d", namespace=NS, block_bytes=ROW, capacity_bytes=64 * ROW,
                       batch_seconds=0.0)
    try:
        with pytest.raises(DiskTierError):
            ProcessDiskStore(opts, CompletionQueue(), SharedHost(fd, 0, 4, ROW, base, populate=False))
    finally:
        for p in spawned:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(30)
        os.close(fd)


# --------------------------------------------------------------------------- 10
def test_an_invalidation_commits_while_a_full_disk_fails_every_spill(tmp_path: Path) -> None:
    """DESIGN: invalidate(key) records a tombstone; a cancelled/invalidated entry never becomes visible again.
    architecture.md: a failed batch "keeps its tombs and deletes queued ... so an I/O error never resurrects an
    invalidated key; once close() has begun they get CLOSE_RETRIES = 3 more attempts and are then dropped".
    ``Writer._commit`` writes a batch's payloads (``slots.alloc``/``pwrite``) before its transaction, and any
    failure there fails the whole batch, the tomb with it.  On a full disk (ENOSPC writing the slot file --
    the slot file grows by ``posix_fallocate``, or a CoW/sparse file takes blocks at ``pwrite``) every batch
    holds the kept tomb and the engine's next spills, so the tomb -- a delete in LMDB, which needs no slot --
    fails as often as spills keep coming, and close() drops it: the invalidated block is served after the next
    open.  The spills' fault should not cost the removals that share their batch."""
    path = tmp_path / "d"
    st = _Store(path, batch_blocks=4)
    closed = False
    try:
        tk = st.spill(b"K")
        assert st.answer(tk).ok and st.flush()

        def disk_full(slot: int, src: memoryview) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        st.s.slots.pwrite = disk_full          # the disk is full from here on
        entered = threading.Event()
        go = threading.Event()
        feed = {"calls": 0, "after_close": 0}

        def hook(point: str) -> None:          # each commit: the engine stores one more block meanwhile
            feed["calls"] += 1
            if feed["calls"] == 1:
                entered.set()
                assert go.wait(30)
            if st.s.writer._closed:            # (the writer's own flag: close() has begun)
                feed["after_close"] += 1
            if feed["after_close"] <= CLOSE_RETRIES + 1:   # ... until close() gave up on what failed
                st.spill(b"S%d" % feed["calls"])
            if feed["calls"] == 4:
                hook.fourth.set()              # type: ignore[attr-defined]

        hook.fourth = threading.Event()        # type: ignore[attr-defined]
        st.s.fault_hook = hook
        st.spill(b"S-first")                   # the writer takes it and waits in the hook
        assert entered.wait(30)
        st.s.cancel(tk, b"K")                  # invalidate K: its tomb queues at the front
        go.set()
        assert hook.fourth.wait(30)            # the tomb failed with the spills a few times
        st.close()
        closed = True
    finally:
        if not closed:
            st.s.fault_hook = None
            go.set()
            st.close()
    st = _Store(path)
    try:
        r, _ = st.read(b"K", tk)
        assert not r.ok, "an invalidated block was served after reopen"
    finally:
        st.close()


# --------------------------------------------------------------------------- 11
def test_a_restart_of_the_io_process_does_not_hold_the_engine_thread_for_its_recovery(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """DESIGN: "The engine thread never waits on disk."  The disk I/O process exists so that the engine's
    thread never stands behind disk work (proc.py); after it dies, the next ``poll()`` runs
    ``DiskTier.restart`` -> ``ProcessDiskStore(...)`` -> ``_first_frame``, which waits (up to
    ``_OPEN_TIMEOUT_S`` = 600 s) for the new child's start-up and its recovery scan, which "reads every index
    record" of the tier.  The engine's step is held for all of it: here the new child is stopped before it
    answers, and ``poll()`` does not return (bounded join) until the child is killed.  The tier is documented
    as down meanwhile anyway (spills shed, reads missing): the new child's open could be awaited by the
    receiver (or a starter thread) and the reconciliation applied by a later pass."""
    from test_disk_process import _wait_down

    kv = make_kv(rows=4)
    mgr = rig.open(kv)
    store = mgr.disk
    assert isinstance(store, ProcessDiskStore), "needs the disk I/O process"
    real_spawn = proc._spawn
    spawned: list[subprocess.Popen] = []

    def slow_spawn(argv: list[str], fds: tuple[int, ...]) -> subprocess.Popen:
        p = real_spawn(argv, fds)
        os.kill(p.pid, signal.SIGSTOP)          # its recovery is under way (a large tier, a slow disk)
        spawned.append(p)
        return p

    store.kill_for_test(signal.SIGKILL)
    _wait_down(store)
    monkeypatch.setattr(proc, "_spawn", slow_spawn)
    step = threading.Thread(target=mgr.poll, daemon=True)   # the engine's next step
    step.start()
    step.join(5)
    held = step.is_alive()
    deadline = time.monotonic() + 30
    while not spawned and time.monotonic() < deadline:   # a start off the engine's thread spawns on its own
        time.sleep(0.005)
    monkeypatch.setattr(proc, "_spawn", real_spawn)
    for p in spawned:                            # let it go: the open sees EOF and the restart fails
        p.kill()
        p.wait(30)
    step.join(60)
    assert not held, "poll() waited for the restarted I/O process's open (its recovery) on the engine thread"
