"""Review: faults degrade the service -- counted, logged, visible -- and never kill, hang or corrupt it.

Cross-cutting review of the fault paths end to end through the public API (``TierManager`` with a
``TieredKVConfig``): an I/O error, a worker thread dying, a disk that fails every commit, a remote
server that is away.  What it proved wrong (each test failed before its fix): a fault after a disk commit
gave committed slots back; dead reader threads left every later load unanswered; spills queued behind
failing tombstones were never answered; a dropped remote tombstone op was logged once per invalidate();
restarting a dead disk I/O process held the engine thread for the new child's open; recency touches grew
without bound behind a stuck writer; doomed spills evicted readable blocks; an OSError at open escaped
TierManager() in thread mode; a corrupt disk block was never logged; flush() waited out its timeout while
the breaker held an invalidation back.

Faults are injected by monkeypatching (``DiskEnv.cover_pages``, ``Readers._read``), by the writer's
``fault_hook`` (``disk_helpers.WriterGate``) and by a remote URL nobody listens on; the disk tests run
the disk I/O as threads of this process (``disk_threads``), where the hooks reach.
"""

from __future__ import annotations

import errno
import os
import logging
import socket
import time

import pytest

from disk_helpers import ROW, fill, keys, load_ok, make_kv, metric, metric_sum, rig, store_one
from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.disk.env import DiskEnv
from tiered_kv.disk.readers import Readers
from prometheus_client import CollectorRegistry

pytestmark = pytest.mark.disk_threads

__all__ = ["rig"]


class ThreadKilled(BaseException):
    """Not an Exception: what SystemExit / an asynchronous exception looks like to a worker thread
    (tests/test_disk_faults.py kills the writer the same way)."""


def _until(pred, timeout: float, mgr: TierManager) -> bool:
    """Poll ``mgr`` until ``pred()`` or the timeout (a bound to detect a hang, not a timing assert)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        mgr.wait(timeout=0.05)
    return True


# ============================================================================ 1. a fault after the commit
def test_an_error_after_the_commit_never_frees_a_slot_a_committed_entry_holds(rig, monkeypatch) -> None:
    """Invariant 12 (docs/architecture.md): "A slot is referenced by at most one committed entry"; and a
    durably flushed block stays readable.  ``DiskEnv.cover_pages`` (a ``stat``/``truncate`` of data.mdb
    after each commit) failing once with EIO is enough to break both."""
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=2, host_evict_ahead_blocks=0, durability="sync")
    orig = DiskEnv.cover_pages
    calls = {"n": 0}

    def cover_pages(self: DiskEnv) -> None:
        calls["n"] += 1
        if calls["n"] == 1:   # the first commit's post-commit step only
            raise OSError(errno.EIO, "Input/output error")
        orig(self)

    monkeypatch.setattr(DiskEnv, "cover_pages", cover_pages)
    fill(kv, 0, b"A")
    job = mgr.store(b"A", 0)
    mgr.wait([job], timeout=10)
    mgr.flush(timeout=10)                 # A's batch committed, then the I/O error: reported failed
    assert calls["n"] >= 1
    store_one(mgr, kv, b"B", 1)          # B: stored, flushed durably (flush() is True)
    mgr.invalidate(b"A")                 # the engine drops A and stores it again: its spill replaces A's record
    store_one(mgr, kv, b"A", 2)
    for i, k in enumerate((b"C", b"D", b"E")):
        store_one(mgr, kv, k, 3 + i)     # B leaves the host tier; C is written into a free slot
    assert mgr.host_bytes(b"B") is None and mgr.lookup([b"B"]) == 1   # B only on disk now
    ok = load_ok(mgr, kv, b"B", 6)       # asserts on wrong bytes itself
    corrupt = metric_sum(mgr, "tiered_kv_corrupt_blocks_total")
    assert ok and corrupt == 0, (f"a durably flushed block was lost after one I/O error on another commit: "
                                 f"load ok={ok}, tiered_kv_corrupt_blocks_total={corrupt}")


# ============================================================================ 2. a disk reader thread dying
def test_loads_from_disk_are_still_reported_after_the_disk_reader_threads_died(rig, monkeypatch) -> None:
    """Invariant 1 (exactly once: every job a load returns is reported once by poll()/wait()) and 11
    (faults degrade, never raise or hang).  Both reader threads (the default ``num_readers``) die on a
    ``BaseException`` in their read path; a later load of a block only on disk must still be reported
    (failed or ok) instead of pending for ever."""
    import tiered_kv.core.tiers as tiers_mod
    import tiered_kv.manager as manager_mod
    monkeypatch.setattr(manager_mod, "CLOSE_TIMEOUT_S", 1.0)   # close() of the broken tier: not 30 s
    monkeypatch.setattr(tiers_mod, "CLOSE_TIMEOUT_S", 1.0)
    kv = make_kv(8)
    # the disk readers' path (a blocked wait() would read a cached block itself)
    mgr = rig.open(kv, host_slots=2, host_evict_ahead_blocks=0, disk_read_cached_in_wait=False)
    ks = keys(6)
    for i, k in enumerate(ks):
        store_one(mgr, kv, k, i)
    assert mgr.disk is not None and len(mgr.disk.readers._threads) == 2
    orig = Readers._read
    kills = {"left": 2}

    def read(self: Readers, op):   # a lone read goes through here
        if kills["left"]:
            kills["left"] -= 1
            raise ThreadKilled("reader killed")
        return orig(self, op)

    monkeypatch.setattr(Readers, "_read", read)
    for k, row in ((ks[0], 6), (ks[1], 7)):   # each kills the reader that takes it (answered failed)
        job = mgr.load(k, row)
        assert job is not None
        mgr.wait([job], timeout=5)
        assert job.done and job.state.value == "failed", job
    assert kills["left"] == 0
    job = mgr.load(ks[2], 5)
    assert job is not None, "the block is on disk"
    mgr.wait([job], timeout=3)
    reported = job.done
    mgr.close()
    assert reported, f"a load from disk is never reported once the reader threads died: {job}"


# ============================================================================ 3. spills behind failing tombs
def test_a_spill_queued_behind_failing_tombstones_is_answered_while_the_disk_fails(rig) -> None:
    """docs/architecture.md, Durability: "A failed batch fails its spills (they can be stored again) but keeps
    its tombs and deletes queued ... retried after a back-off".  A disk tier of the tests' usual 64 blocks
    (write batch: 4 blocks) whose every commit fails with EIO: four invalidated keys keep four tombs queued,
    and a new block's write-through spill behind them must still be answered (failed) -- the host slot it pins
    can then be evicted and the block offered again."""
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=8)
    ks = keys(4)
    for i, k in enumerate(ks):
        store_one(mgr, kv, k, i)
    assert mgr.disk_blocks == 4 and mgr.disk.writer.opts.batch_blocks == 4
    rig.gate(mgr, block_from=None, raise_at={i: OSError(errno.EIO, "Input/output error") for i in range(1, 10_000)})
    for k in ks:
        mgr.invalidate(k)                # four tombs: each batch of them fails, and they are kept
    mgr.poll()
    fill(kv, 4, b"new")
    job = mgr.store(b"new", 4)
    assert job is not None
    mgr.wait([job], timeout=5)
    assert job.done
    answered = _until(lambda: mgr.jobs_in_flight == 0, 6.0, mgr)
    failed = metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="failed")
    assert answered and failed == 1, (f"the spill is still in flight ({mgr.debug_sizes()}), spill failures "
                                      f"counted: {failed}: starved behind the kept tombstones")


# ============================================================================ 4. remote tombstone overflow logs
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tombstone_ops_dropped_while_the_server_is_away_are_logged_once(monkeypatch, caplog) -> None:
    """core/remote_tier.py's error callback logs each kind once ("further %s errors are counted, not logged");
    docs/remote.md: beyond the bound the oldest tombstone op is dropped, "counted as error=tomb_dropped".
    With the server away (nobody listens on the URL: the breaker opens at start) and the bound lowered, every
    further ``invalidate()`` drops one op: counted each time, but a log line each time floods the log at the
    engine's invalidation rate."""
    from tiered_kv.remote import writer as writer_mod
    monkeypatch.setattr(writer_mod, "TOMB_CAP", 4)
    cfg = TieredKVConfig(namespace="faults|u8", host_capacity_bytes=4 * ROW,
                         remote_url=f"redis://127.0.0.1:{_free_port()}/0", remote_timeout_seconds=0.2)
    kv = make_kv(4)
    caplog.set_level(logging.WARNING, logger="tiered_kv")
    mgr = TierManager(cfg, kv, registry=CollectorRegistry())
    try:
        assert metric(mgr, "tiered_kv_healthy", tier="remote") == 0.0   # the breaker is open
        caplog.clear()
        for k in keys(4 + 40, "inv"):
            mgr.invalidate(k)
        mgr.poll()
        dropped = metric(mgr, "tiered_kv_errors_total", tier="remote", error="tomb_dropped")
        lines = [r for r in caplog.records if "tomb" in r.getMessage().lower() or "tombstone" in r.getMessage()]
    finally:
        mgr.close()
    assert dropped == 40, dropped
    assert len(lines) <= 1, f"{len(lines)} log records for {dropped:.0f} dropped tombstone ops: {lines[:3]}"


# ============================================================================ 5. the I/O process's restart
def test_restarting_a_dead_io_process_never_holds_the_engine_thread_past_its_timeout(rig, monkeypatch) -> None:
    """DESIGN.md: "The engine thread never waits on disk"; invariant 10: "Only wait(), flush() and close()
    block, and only because the caller asked".  The disk I/O process died and the next pass restarts it; the
    new child is stuck in its open (stopped here, as on a hung disk: its recovery scan does not finish).
    ``wait(timeout=0.2)`` must still return on time (the open's own bound, lowered here to 2 s, is 600 s)."""
    import os
    import signal
    from tiered_kv.disk import proc
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=8, disk_io="process")
    store_one(mgr, kv, b"kept", 0)
    first = mgr.disk
    assert isinstance(first, proc.ProcessDiskStore)
    monkeypatch.setattr(proc, "_OPEN_TIMEOUT_S", 2.0)
    real_spawn = proc._spawn
    stopped: list[int] = []
    stopping = {"on": True}

    def spawn(argv, fds):
        p = real_spawn(argv, fds)
        if stopping["on"]:
            os.kill(p.pid, signal.SIGSTOP)   # the new child hangs in its open
            stopped.append(p.pid)
        return p

    monkeypatch.setattr(proc, "_spawn", spawn)
    first.kill_for_test(signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not first.down:                    # its receiver answered what it had (a state, not an ordering sleep)
        assert time.monotonic() < deadline
        time.sleep(0.005)
    try:
        t0 = time.monotonic()
        mgr.wait(timeout=0.2)
        took = time.monotonic() - t0
    finally:
        deadline = time.monotonic() + 30
        while not stopped and time.monotonic() < deadline:   # the restart spawns on its starter thread
            time.sleep(0.005)
        stopping["on"] = False
        for pid in stopped:                  # our own stopped children, if still there
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert stopped, "the pass did not try to restart the I/O process"
    assert took < 1.0, f"wait(timeout=0.2) returned after {took:.2f} s: it waited for the new child's open"


# ============================================================================ 6. a hung writer and recency touches
def test_recency_touches_stay_bounded_while_the_writer_is_stuck(rig) -> None:
    """DESIGN.md: "Queues are bounded"; writer.py's own reason for dropping a failed batch's touches: a disk
    that fails every commit "would grow the queue by one per promote for as long as it lasts".  A disk that
    hangs (the writer stuck in a commit: a stalled fdatasync) does exactly that.  Eight keys promoted over and
    over: the touches queued should stay within the tier's bounds (its keys, its writer queue), not grow with
    the number of promotes."""
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=4, host_evict_ahead_blocks=0)
    ks = keys(8)
    for i, k in enumerate(ks):
        store_one(mgr, kv, k, i)
    writer = mgr.disk.writer
    gate = rig.gate(mgr, block_from=1)      # the next commit hangs
    fill(kv, 0, b"held")
    mgr.wait([mgr.store(b"held", 0)], timeout=10)
    mgr.poll()
    gate.entered(1)                          # the writer is inside its commit, stuck
    promotes = 0
    for rnd in range(60):                    # cycle the 8 keys through a 4-slot host tier: each load promotes
        for i, k in enumerate(ks):
            row = 1 + (i % 7)
            job = mgr.load(k, row)
            if job is None:
                continue
            mgr.wait([job], timeout=10)
            assert job.done
            mgr.free_block(row)
            promotes += 1
    touches = sum(1 for op in list(writer._ops) if type(op).__name__ == "Touch")
    bound = max(len(ks), writer.opts.queue_blocks)
    gate.open()
    assert promotes > bound, promotes
    assert touches <= bound, f"{touches} recency touches queued behind a stuck writer after {promotes} promotes"


# ============================================================================ 7. doomed spills evict good entries
def test_spills_that_cannot_be_written_do_not_evict_readable_blocks(rig) -> None:
    """DESIGN.md: faults degrade the service; invariant 10: "a shed spill never costs an eviction".  A full disk
    tier (56 blocks) whose directory turns read-only at run time: every commit fails with EROFS (counted
    ``read_only``, ``tiered_kv_healthy{tier="disk"} 0``), but every block on it is still readable.  The engine's
    next stores spill (write-through) and fail; at most the first of them may cost a block -- the rest should
    be shed while the writer cannot write, not evict what the disk can still serve."""
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=8, disk_slots=64)
    old = keys(56, "old")
    for i, k in enumerate(old):
        store_one(mgr, kv, k, i % 8)
    assert mgr.disk_blocks == 56
    rig.gate(mgr, block_from=None,
             raise_at={i: OSError(errno.EROFS, "Read-only file system") for i in range(1, 10_000)})
    for i, k in enumerate(keys(8, "new")):
        fill(kv, i, k)
        job = mgr.store(k, i)
        if job is not None:
            mgr.wait([job], timeout=10)
        deadline = time.monotonic() + 30
        while i == 0 and metric(mgr, "tiered_kv_errors_total", tier="disk", error="read_only") < 1:
            # the first spill's batch has failed before the next store (a state, not an ordering sleep): the
            # spills of one batch window cannot know of its failure, the ones after it can
            assert time.monotonic() < deadline, "the first spill's batch never failed"
            mgr.wait(timeout=0.01)
        mgr.wait(timeout=0.05)
    assert metric(mgr, "tiered_kv_errors_total", tier="disk", error="read_only") >= 1
    assert metric(mgr, "tiered_kv_healthy", tier="disk") == 0.0
    for i in range(8):
        mgr.free_block(i)
    still = sum(mgr.lookup([k]) for k in old)
    evicted = metric(mgr, "tiered_kv_evictions_total", tier="disk")
    assert still >= len(old) - 1, (f"{len(old) - still} readable blocks left the disk tier ({evicted:.0f} evicted) "
                                   f"for spills that could not be written")


# ============================================================================ 8. an I/O error while opening
def test_an_io_error_while_opening_the_disk_tier_leaves_the_service_host_only(rig, monkeypatch) -> None:
    """docs/architecture.md invariant 11: "a path that cannot be opened leaves the service host-only with
    tiered_kv_healthy{tier="disk"} 0 (DiskTier.open) ... Only a path already held raises: DiskInUseError";
    errors.py: every error raised at the API boundary derives from TieredKVError.  The directory's fsync at
    open fails with EIO (a failing device); the disk I/O process (the default) already turns this into a
    host-only service, the in-process store must too."""
    from tiered_kv.disk import lock
    rig.path.mkdir()                          # an existing tier directory (a restart)

    def fsync_path(p, directory: bool = False) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(lock, "fsync_path", fsync_path)
    kv = make_kv(8)
    try:
        mgr = rig.open(kv, host_slots=4)
    except OSError as exc:
        pytest.fail(f"TierManager() raised {exc!r} instead of running host-only")
    assert mgr.disk is None
    assert metric(mgr, "tiered_kv_healthy", tier="disk") == 0.0
    assert metric(mgr, "tiered_kv_errors_total", tier="disk", error="open_failed") == 1
    store_one(mgr, kv, b"host-only", 0)


# ============================================================================ 9. a corrupt block is not logged
def test_a_corrupt_disk_block_is_logged(rig, caplog) -> None:
    """errors.py: faults inside the library "are counted, logged and reported as failed jobs"; remote/reader.py
    logs a corrupt remote value (a warning).  A flipped byte in a disk block's slot: the load is a miss and
    ``tiered_kv_corrupt_blocks_total{reason="checksum"}`` counts it, but the operator finds nothing in the
    log to say which key or slot is damaged."""
    from disk_helpers import flip_slot_byte
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=4)
    ks = keys(3)
    for i, k in enumerate(ks):
        store_one(mgr, kv, k, i)
    mgr.close()
    flip_slot_byte(rig.path, ks[0], 100)
    mgr = rig.open(kv, host_slots=4)           # a fresh host tier: the block is on disk only
    caplog.set_level(logging.INFO, logger="tiered_kv")
    caplog.clear()
    assert mgr.lookup([ks[0]]) == 1
    assert not load_ok(mgr, kv, ks[0], 5)
    assert metric(mgr, "tiered_kv_corrupt_blocks_total", reason="checksum") == 1
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING and "corrupt" in r.getMessage().lower()]
    assert lines, f"no warning or error logged for a corrupt disk block: {[r.getMessage() for r in caplog.records]}"


# ============================================================================ 10. flush() while the server is away
def test_flush_answers_at_once_while_the_breaker_holds_an_invalidation_back(monkeypatch) -> None:
    """remote/store.py wait_writes: "False on timeout or while the breaker holds tombstone ops back"; remote.md:
    with the breaker open "queued writes and fetches are answered at once"; the disk tier's flush() answers False
    at once when its writer cannot write.  The server is away (nobody listens: the breaker opens at start) and the
    engine invalidated one key: flush(timeout=5) must say False without waiting its 5 s (flush() with no timeout
    would wait until the server comes back)."""
    cfg = TieredKVConfig(namespace="faults|u8", host_capacity_bytes=4 * ROW,
                         remote_url=f"redis://127.0.0.1:{_free_port()}/0", remote_timeout_seconds=0.2)
    kv = make_kv(4)
    mgr = TierManager(cfg, kv, registry=CollectorRegistry())
    try:
        assert metric(mgr, "tiered_kv_healthy", tier="remote") == 0.0   # the breaker is open
        assert mgr.flush(timeout=5) is True                            # nothing queued: at once
        mgr.invalidate(b"gone")
        t0 = time.monotonic()
        ok = mgr.flush(timeout=5)
        took = time.monotonic() - t0
    finally:
        mgr.close()
    assert ok is False
    assert took < 2.5, f"flush(timeout=5) waited {took:.1f} s for a server the breaker knows is away"


# ============================================================================ 11. out of room, by another name
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG], ids=["ENOSPC", "EDQUOT", "EFBIG"])
def test_a_write_refused_for_want_of_room_is_counted_as_disk_full(err: int) -> None:
    """A quota exceeded (EDQUOT) or a file past the largest allowed (EFBIG) is the disk tier out of room, as
    ENOSPC is: counted ``error="disk_full"`` (and a spill that meets it fails alone, writer.py ``_no_room``),
    not ``lmdb_error``, the label that says a bug."""
    from tiered_kv.disk.records import error_kind
    assert error_kind(OSError(err, os.strerror(err))) == "disk_full"
