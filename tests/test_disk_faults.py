"""Faults of the disk tier (issue 3 sections 2, 5, 7): the writer raising or dying,
backpressure, LMDB map growth, a full disk, read-only / missing / uncreatable
directories.  In every case the engine thread gets no exception and is never
blocked, the host tier keeps serving, the fault is counted in
``tiered_kv_errors_total{tier="disk"}`` (logged once per kind) and visible on
``tiered_kv_healthy{tier="disk"}``.

Faults are injected with ``DiskStore.fault_hook`` (called by the writer thread at
the start of every write transaction), a real tmpfs (root only, skipped
otherwise), or by patching the free-space probe.  The hooks and patches reach into the writer
and readers, so these managers run them as threads (``disk_io="thread"``, the ``disk_threads``
mark); tests/test_disk_process.py has the faults of the disk I/O process.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

import lmdb
import pytest

pytestmark = pytest.mark.disk_threads

from disk_helpers import (ROW, disk_health, drain, fill, keys, load_ok, make_kv, metric, metric_sum,
                          raw_keys, remount, rig, row_is, store_one, store_seq, tmpfs)

__all__ = ["rig"]


class WriterKilled(BaseException):
    """Not an Exception: what SystemExit / KeyboardInterrupt look like to the writer."""


def _host_still_serves(mgr, kv, key=b"after-fault"):
    store_one(mgr, kv, key, 6, flush=False)
    assert mgr.lookup([key]) == 1
    assert load_ok(mgr, kv, key, 7)


# ============================================================================ writer raising
@pytest.mark.parametrize("exc", [OSError(errno.EIO, "Input/output error"), lmdb.Error("injected lmdb failure")],
                         ids=["OSError-EIO", "lmdb.Error"])
def test_failed_write_transaction_fails_its_batch_and_later_batches_work(rig, exc):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=8)
    rig.gate(mgr, block_from=None, raise_at={1: exc})
    store_one(mgr, kv, b"lost", 0, flush=False)
    drain(mgr)
    assert metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="failed") == 1
    assert metric_sum(mgr, "tiered_kv_errors_total", tier="disk") == 1
    assert disk_health(mgr) == 0.0 and not mgr.disk.healthy
    assert mgr.lookup([b"lost"]) == 1 and load_ok(mgr, kv, b"lost", 1)   # host copy
    assert mgr.disk_blocks == 0
    store_one(mgr, kv, b"kept", 2)            # the next batch commits
    mgr.poll()
    assert disk_health(mgr) == 1.0 and mgr.disk_healthy
    assert mgr.disk_blocks == 1
    assert mgr.disk.writer_alive()
    rig.close(mgr)
    assert raw_keys(rig.path) == {b"kept"}


@pytest.mark.parametrize("exc", [RuntimeError("bug in the batch code"), ValueError("bad value")],
                         ids=["RuntimeError", "ValueError"])
def test_any_exception_in_the_writer_fails_only_its_batch(rig, exc):
    """An ordinary Exception raised inside the writer (a bug, a py-lmdb ValueError,
    a MemoryError...) must fail that batch, not kill the disk tier for good."""
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=8)
    rig.gate(mgr, block_from=None, raise_at={1: exc})
    store_one(mgr, kv, b"lost", 0, flush=False)
    drain(mgr)
    assert metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="failed") == 1
    assert metric_sum(mgr, "tiered_kv_errors_total", tier="disk") >= 1
    store_one(mgr, kv, b"kept", 2, flush=False)
    assert mgr.flush(timeout=30) is True, "later batches must still commit"
    assert mgr.disk.writer_alive()
    assert mgr.disk_blocks == 1


def test_disk_errors_are_counted_every_time_and_logged_once_per_kind(rig, caplog):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=8)
    eio = lambda: OSError(errno.EIO, "Input/output error")  # noqa: E731
    rig.gate(mgr, block_from=None, raise_at={1: eio(), 2: eio(), 3: eio()})
    with caplog.at_level(logging.ERROR, logger="tiered_kv"):
        for i in range(3):
            store_one(mgr, kv, b"x%d" % i, i, flush=False)
            drain(mgr)
    assert metric(mgr, "tiered_kv_errors_total", tier="disk", error="io_error") == 3
    logged = [r for r in caplog.records if "io_error" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in logged]
    assert "Input/output error" in logged[0].getMessage(), "the log says what the error was"


@pytest.mark.parametrize("exc,free_batches,label", [
    (OSError(errno.EIO, "Input/output error"), 100, "io_error"),
    (OSError(errno.EIO, "Input/output error"), 2, "io_error"),           # exactly two batches free: not full
    (lmdb.Error("mdb_put: Input/output error"), 1.99, "disk_full"),     # LMDB's short write on a full disk
    (OSError(errno.ENOSPC, "No space left on device"), 100, "disk_full"),
    (lmdb.Error("MDB_CORRUPTED: located page was wrong type"), 100, "lmdb_error"),
    (RuntimeError("a bug in the batch code"), 100, "writer_error"),     # not LMDB's: named as the writer's own
], ids=["eio", "eio-two-batches-free", "eio-disk-nearly-full", "enospc", "lmdb", "bug"])
def test_a_failed_commit_is_counted_under_the_label_of_its_cause(rig, monkeypatch, exc, free_batches, label):
    """An I/O error with less than two writer batches free on the device is a full disk (LMDB reports
    the short write as EIO); an exception that is not LMDB's is the writer's own error."""
    import shutil
    from collections import namedtuple
    from tiered_kv.disk import writer as writer_mod
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=8)
    usage = namedtuple("usage", "total used free")
    batch_bytes = mgr._core.disk.store.opts.batch_bytes
    real = shutil.disk_usage
    monkeypatch.setattr(writer_mod.shutil, "disk_usage",
                        lambda p: usage(1 << 40, 0, int(free_batches * batch_bytes)) if str(p) == str(mgr._core.disk.store.db.path) else real(p))
    rig.gate(mgr, block_from=None, raise_at={1: exc})
    store_one(mgr, kv, b"lost", 0, flush=False)
    drain(mgr)
    counted = {k: v for k, v in ((lab, metric(mgr, "tiered_kv_errors_total", tier="disk", error=lab))
                                 for lab in ("io_error", "disk_full", "lmdb_error", "writer_error")) if v}
    assert counted == {label: 1.0}


def test_a_failing_disk_is_retried_less_often_each_time_until_a_commit_works(rig):
    """Back-off after consecutive failed batches doubles from BACKOFF_MIN_S up to BACKOFF_MAX_S, and a
    batch that commits resets it: a persistent fault neither spins nor stalls the writer for long."""
    from tiered_kv.disk.writer import BACKOFF_MAX_S, BACKOFF_MIN_S
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=8)
    n = 9
    rig.gate(mgr, block_from=None, raise_at={i: OSError(errno.EIO, "Input/output error") for i in range(1, n + 1)})
    writer = mgr._core.disk.store.writer
    seen = []
    for i in range(n):
        store_one(mgr, kv, b"x%d" % i, i % 8, flush=False)
        drain(mgr)
        seen.append(writer._backoff)
    assert seen == [min(BACKOFF_MAX_S, BACKOFF_MIN_S * 2 ** i) for i in range(n)]
    store_one(mgr, kv, b"works", 0)
    assert writer._backoff == 0.0


def test_flush_is_false_when_a_spill_it_covers_failed(rig):
    """flush() == True is a durability promise for every spill submitted before it
    (what the crash test's journal relies on); a spill that failed breaks it."""
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=8, writer_batch_blocks=1)
    gate = rig.gate(mgr, block_from=1, raise_at={1: OSError(errno.EIO, "Input/output error")})
    store_one(mgr, kv, b"lost", 0, flush=False)
    gate.entered(1)
    gate.open()                                # the spill's transaction fails
    assert mgr.flush(timeout=30) is False
    assert mgr.disk_blocks == 0


def test_failed_write_transaction_does_not_drop_an_invalidation(rig):
    """A tomb / delete in a failed batch must not be lost: the key was invalidated
    before the last successful flush, so it must not come back after a restart."""
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=8, writer_batch_blocks=1)
    store_one(mgr, kv, b"k", 0)
    rig.gate(mgr, block_from=None, raise_at={1: OSError(errno.EIO, "Input/output error")})
    mgr.invalidate(b"k")                       # the tomb's transaction fails
    ok = mgr.flush(timeout=30)
    if not ok:
        ok = mgr.flush(timeout=30)
    assert ok is True
    assert mgr.lookup([b"k"]) == 0
    rig.close(mgr)
    mgr = rig.open(kv, host_slots=8)
    assert mgr.lookup([b"k"]) == 0, "an invalidated block is readable again after a restart"


def test_invalidate_after_a_failed_spill_leaves_no_tombstone_behind(rig):
    """Interleaving: the spill's batch fails in the writer, and before the engine polls
    that failure the key is invalidated (the spill is still PENDING for the manager).
    The tomb then guards a write that can never come: it must be neither made durable
    nor kept in memory (before the fix it stayed in both for the life of the store)."""
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=8, writer_batch_blocks=1)
    failed = threading.Event()
    disk = mgr.disk
    calls = {"n": 0}

    def hook(point: str) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.EIO, "Input/output error")

    orig_fail = disk.writer._fail_ops

    def fail_ops(ops, error):  # observe the failure report leaving the writer
        orig_fail(ops, error)
        failed.set()

    disk.writer._fail_ops = fail_ops
    disk.fault_hook = hook
    fill(kv, 0, b"k")
    job = mgr.store(b"k", 0)
    done = mgr.wait([job], timeout=30)        # store applied -> spill queued -> its batch fails
    assert [c.ok for c in done] == [True]
    assert failed.wait(30)
    mgr.invalidate(b"k")                       # the failure report is not applied yet
    assert mgr.flush(timeout=30) is True       # the tomb's own batch commits
    assert disk.tombs.cancelled == set() and disk.tombs.unsettled == set()
    assert mgr.debug_sizes()["disk_tombstones"] == 0
    assert mgr.lookup([b"k"]) == 0
    assert metric(mgr, "tiered_kv_stale_callbacks_total", kind="spill", reason="superseded") == 1


# ============================================================================ writer dying
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_dead_writer_fails_every_queued_spill_and_the_host_tier_keeps_serving(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=8)
    store_one(mgr, kv, b"durable", 0)
    gate = rig.gate(mgr, block_from=1, raise_at={1: WriterKilled("writer killed")})
    ks = keys(4)
    for i, k in enumerate(ks):
        store_one(mgr, kv, k, 1 + i, flush=False)
    gate.entered(1)                            # 1 spill in the writer's hands, 3 queued
    gate.open()                                # ... and the writer dies
    t0 = time.monotonic()
    while mgr.disk.writer_alive() and time.monotonic() - t0 < 30:
        mgr.wait(timeout=0.05)
    drain(mgr)
    assert metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="failed") == 4
    assert metric(mgr, "tiered_kv_errors_total", tier="disk", error="writer_died") == 1
    assert disk_health(mgr) == 0.0 and not mgr.disk_healthy
    assert mgr.flush(timeout=5) is False
    # no exception reaches the engine; the host tier serves; reads of the disk tier still work
    assert mgr.lookup(ks) == 4
    _host_still_serves(mgr, kv)
    for i in range(10):
        store_one(mgr, kv, b"later%d" % i, i % 6, flush=False)
    drain(mgr)
    assert mgr.disk_blocks == 1
    mgr.invalidate(b"later0")
    assert mgr.lookup([b"durable"]) == 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_spills_after_the_writer_died_are_shed_and_counted(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=8)
    rig.gate(mgr, block_from=None, raise_at={1: WriterKilled("writer killed")})
    store_one(mgr, kv, b"first", 0, flush=False)
    t0 = time.monotonic()
    while mgr.disk.writer_alive() and time.monotonic() - t0 < 30:
        mgr.wait(timeout=0.05)
    drain(mgr)
    shed0 = metric_sum(mgr, "tiered_kv_shed_total", kind="spill")
    for i in range(5):
        store_one(mgr, kv, b"later%d" % i, 1 + i, flush=False)
    drain(mgr)
    assert metric_sum(mgr, "tiered_kv_shed_total", kind="spill") - shed0 == 5, \
        "spills that can no longer be written must be counted as shed"
    assert metric(mgr, "tiered_kv_shed_total", kind="spill", reason="disk_down") == 5, \
        "... as disk_down (the alert's reason), not as backpressure of a queue that will never drain"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_close_after_the_writer_died_releases_the_path(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=8)
    store_one(mgr, kv, b"durable", 0)
    rig.gate(mgr, block_from=None, raise_at={1: WriterKilled("writer killed")})
    store_one(mgr, kv, b"lost", 1, flush=False)
    t0 = time.monotonic()
    while mgr.disk.writer_alive() and time.monotonic() - t0 < 30:
        mgr.wait(timeout=0.05)
    drain(mgr)
    rig.close(mgr)
    mgr2 = rig.open(kv, host_slots=8)            # must not raise DiskInUseError
    assert mgr2.disk is not None and mgr2.disk_healthy
    assert mgr2.lookup([b"durable"]) == 1 and mgr2.lookup([b"lost"]) == 0
    assert load_ok(mgr2, kv, b"durable", 2)


# ============================================================================ backpressure
def test_a_spill_shed_for_backpressure_costs_the_full_disk_tier_no_block(rig):
    """start_spill used to reserve the disk entry first -- evicting the least recently used block of a
    full tier -- and only then find the writer queue full: the spill was shed, and the evicted block
    was gone for nothing.  The queue is asked first now."""
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=8, disk_slots=4, writer_queue_blocks=1, writer_batch_blocks=1,
                   host_evict_ahead_blocks=0)
    ks = keys(6)
    for i, k in enumerate(ks[:4]):
        store_one(mgr, kv, k, i)               # the disk tier is full: 4 of 4
    assert mgr.disk_blocks == 4
    gate = rig.gate(mgr)
    store_one(mgr, kv, ks[4], 4, flush=False)  # its spill takes the one queue place (evicting ks[0]) ...
    gate.entered(1)                            # ... and the writer is held in that transaction
    assert metric(mgr, "tiered_kv_evictions_total", tier="disk") == 1
    store_one(mgr, kv, ks[5], 5, flush=False)  # the queue is full: this spill is shed ...
    assert metric(mgr, "tiered_kv_shed_total", kind="spill", reason="backpressure") == 1
    assert metric(mgr, "tiered_kv_evictions_total", tier="disk") == 1   # ... and evicts nothing
    assert mgr.disk_blocks == 4 and mgr.lookup(ks[1:4]) == 3
    gate.open()
    assert mgr.flush(timeout=30) is True
    rig.close(mgr)
    assert raw_keys(rig.path) == set(ks[1:5])


def test_full_writer_queue_sheds_spills_and_never_blocks_the_engine(rig):
    kv = make_kv(16)
    q = 4
    mgr = rig.open(kv, host_slots=16, writer_queue_blocks=q, writer_batch_blocks=1)
    gate = rig.gate(mgr)
    store_one(mgr, kv, b"held", 0, flush=False)
    gate.entered(1)                            # the writer is stuck in its first transaction
    ks = keys(10)
    t0 = time.monotonic()
    jobs = []
    for i, k in enumerate(ks):
        fill(kv, 1 + i, k)
        jobs.append(mgr.store(k, 1 + i))
    done = mgr.wait(jobs, timeout=30)          # store completions start spills: 4 queued, 6 shed
    assert len(done) == 10 and all(c.ok for c in done)
    assert mgr.lookup(ks) == 10
    assert mgr.flush(timeout=0.2) is False     # times out, does not hang
    elapsed = time.monotonic() - t0
    assert elapsed < 10, f"engine thread blocked {elapsed:.1f} s behind a stuck writer"
    assert metric(mgr, "tiered_kv_shed_total", kind="spill", reason="backpressure") == len(ks) - q
    assert metric(mgr, "tiered_kv_writer_queue_blocks") == q
    assert gate.calls == 1
    gate.open()
    assert mgr.flush(timeout=30) is True
    assert mgr.disk_blocks == 1 + q
    assert mgr.debug_sizes()["flushes"] == 0
    rig.close(mgr)
    # which q of the 10 got queued depends on the order the two copy workers finished in
    on_disk = raw_keys(rig.path)
    assert b"held" in on_disk and len(on_disk) == 1 + q and on_disk <= {b"held", *ks}


def test_completions_applied_during_flush_are_returned_by_the_next_poll(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=8)
    fill(kv, 0, b"a")
    job = mgr.store(b"a", 0)
    assert mgr.flush(timeout=30) is True
    got = mgr.poll() + mgr.wait([job], timeout=30)
    assert [c.job for c in got if c.job is job] == [job] and job.done
    assert mgr.poll() == []


# ============================================================================ LMDB map
# The map holds only index records (payloads live in the slot file), so these tests fill it
# with long keys: each index record carries its full key (24 KiB here, in overflow pages).
LONG = {"max_key_bytes": 32768}


def long_keys(n: int) -> list[bytes]:
    return [k + b"." * 24000 for k in keys(n)]


def test_map_full_grows_the_map_and_retries_without_losing_a_block(rig):
    kv = make_kv(8, row_bytes=16384)
    mgr = rig.open(kv, host_slots=8, disk_slots=64, disk_map_size_bytes=256 * 1024, writer_batch_blocks=1, **LONG)
    first = mgr.disk.map_size
    ks = long_keys(40)
    store_seq(mgr, kv, ks)
    drain(mgr)
    assert mgr.disk.map_size > first
    assert metric(mgr, "tiered_kv_disk_map_bytes") == mgr.disk.map_size
    assert metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="ok") == 40
    assert metric_sum(mgr, "tiered_kv_errors_total", tier="disk") == 0
    assert mgr.disk_blocks == 40
    rig.close(mgr)
    assert raw_keys(rig.path) == set(ks)
    mgr = rig.open(kv, host_slots=8, disk_slots=64, disk_map_size_bytes=256 * 1024, **LONG)
    assert mgr.lookup(ks) == 40
    assert load_ok(mgr, kv, ks[0], 0)


def test_map_growth_waits_for_a_read_transaction_in_flight(rig):
    """LMDB forbids set_mapsize with a transaction open in the process.  Pin the
    interleaving: a reader is inside its read transaction (the test holds the
    readers' shared lock, as _read does around its txn) when the writer needs to
    grow the map; the growth must wait for it, then go on, losing nothing."""
    kv = make_kv(8, row_bytes=16384)
    mgr = rig.open(kv, host_slots=8, disk_slots=64, disk_map_size_bytes=256 * 1024, writer_batch_blocks=1, **LONG)
    disk = mgr.disk
    first = disk.map_size
    wants_exclusive = threading.Event()
    orig = disk.db.rw.acquire_exclusive

    def acquire_exclusive() -> None:
        wants_exclusive.set()
        orig()

    disk.db.rw.acquire_exclusive = acquire_exclusive
    disk.db.rw.acquire_shared()                  # "a read transaction is open"
    ks = long_keys(40)
    stored = []
    try:
        for i, k in enumerate(ks):             # spill until the writer has to grow the map
            if wants_exclusive.is_set():
                break
            fill(kv, i % 8, k)
            if mgr.store(k, i % 8) is not None:
                stored.append(k)
            mgr.wait(timeout=30)               # the store is applied and its spill queued
        assert wants_exclusive.wait(30), "the writer never needed to grow the map"
        assert disk.map_size == first          # ... and it has not grown under the open read
    finally:
        disk.db.rw.release_shared()
    assert mgr.flush(timeout=30) is True
    assert disk.map_size > first
    rest = [k for k in ks if k not in stored]
    store_seq(mgr, kv, rest)
    drain(mgr)
    assert mgr.disk_blocks == 40
    assert metric_sum(mgr, "tiered_kv_errors_total", tier="disk") == 0
    assert load_ok(mgr, kv, ks[0], 0)


def test_map_full_on_a_batch_larger_than_one_growth_step_loses_nothing(rig):
    kv = make_kv(48, row_bytes=16384)
    mgr = rig.open(kv, host_slots=48, disk_slots=64, disk_map_size_bytes=128 * 1024, **LONG)
    gate = rig.gate(mgr)
    store_one(mgr, kv, b"first", 0, flush=False)
    gate.entered(1)
    ks = long_keys(40)
    jobs = []
    for i, k in enumerate(ks):
        fill(kv, 1 + i, k)
        jobs.append(mgr.store(k, 1 + i))
    mgr.wait(jobs, timeout=30)                 # 40 spills queued: the next batch is ~640 KiB
    gate.open()
    flushed = mgr.flush(timeout=60)
    drain(mgr)
    lost = metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="failed")
    assert lost == 0, f"{lost:.0f} spills lost to MapFullError although the map could grow"
    assert mgr.disk_blocks == 41
    assert flushed is True


def test_map_full_without_room_to_grow_fails_the_batch_and_counts_it(rig, monkeypatch):
    import shutil
    import tiered_kv.disk.env as disk_mod

    kv = make_kv(8, row_bytes=16384)
    mgr = rig.open(kv, host_slots=8, disk_slots=64, disk_map_size_bytes=128 * 1024, writer_batch_blocks=1, **LONG)
    real = shutil.disk_usage
    monkeypatch.setattr(disk_mod.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=0))
    ks = long_keys(20)
    for i, k in enumerate(ks):
        store_one(mgr, kv, k, i % 8, flush=False)
        drain(mgr)
    assert metric(mgr, "tiered_kv_errors_total", tier="disk", error="map_full") >= 1
    assert metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="failed") >= 1
    assert mgr.disk_blocks < 20
    mgr.poll()
    assert disk_health(mgr) == 0.0
    _host_still_serves(mgr, kv)
    on_disk = [k for k in ks if mgr.host_bytes(k) is None and mgr.lookup([k])]
    for k in on_disk:
        assert load_ok(mgr, kv, k, 5)


# ============================================================================ disk full
def _run_until_disk_full(rig, mnt):
    """Spill 64 KiB blocks onto a 2 MiB tmpfs (half taken by a filler) until a commit fails."""
    kv = make_kv(8, row_bytes=65536)
    mgr = rig.open(kv, path=mnt / "db", host_slots=4, disk_slots=64)
    stored = []
    for i in range(40):
        k = b"k%03d" % i
        store_one(mgr, kv, k, i % 4, flush=False)
        mgr.flush(timeout=30)
        drain(mgr)
        stored.append(k)
        if metric_sum(mgr, "tiered_kv_errors_total", tier="disk"):
            break
    return mgr, kv, stored


def test_disk_full_on_a_real_tmpfs_keeps_serving_and_recovers(rig, tmp_path):
    with tmpfs(tmp_path / "mnt", size="2m") as mnt:
        filler = mnt / "filler"
        filler.write_bytes(b"\0" * (1024 * 1024))          # leaves ~1 MiB: about a dozen blocks
        mgr, kv, stored = _run_until_disk_full(rig, mnt)
        try:
            assert metric_sum(mgr, "tiered_kv_errors_total", tier="disk") >= 1
            assert metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="failed") >= 1
            mgr.poll()
            assert disk_health(mgr) == 0.0
            # what was written before still reads back right; the host tier serves
            on_disk = [k for k in stored if mgr.host_bytes(k) is None and mgr.lookup([k])]
            assert on_disk
            for k in on_disk:
                assert load_ok(mgr, kv, k, 5)
            _host_still_serves(mgr, kv)
            # space comes back: the next spill commits and the tier is healthy again
            filler.unlink()
            store_one(mgr, kv, b"after", 6)
            mgr.poll()
            assert disk_health(mgr) == 1.0
            assert mgr.lookup([b"after"]) == 1
        finally:
            rig.close(mgr)
        mgr = rig.open(make_kv(8, row_bytes=65536), path=mnt / "db", host_slots=4, disk_slots=64)
        try:
            assert mgr.lookup([b"after"]) == 1 and mgr.lookup(on_disk) == len(on_disk)
        finally:
            rig.close(mgr)


def test_disk_full_on_a_real_tmpfs_is_counted_as_disk_full(rig, tmp_path):
    """LMDB reports a short write on a full file system as EIO ("Input/output
    error"); the tier must still count it as error="disk_full" (the label the
    dashboards and alerts use), not as a generic io_error."""
    with tmpfs(tmp_path / "mnt", size="2m") as mnt:
        (mnt / "filler").write_bytes(b"\0" * (1024 * 1024))
        mgr, kv, stored = _run_until_disk_full(rig, mnt)
        try:
            labels = {s.labels["error"]: s.value for fam in mgr.metrics.registry.collect() for s in fam.samples
                      if s.name == "tiered_kv_errors_total" and s.labels.get("tier") == "disk" and s.value}
            assert labels.get("disk_full", 0) >= 1, f"disk full was counted as {labels}"
        finally:
            rig.close(mgr)


def test_disk_full_reported_by_the_io_layer(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=8)
    rig.gate(mgr, block_from=None, raise_at={1: OSError(errno.ENOSPC, "No space left on device")})
    store_one(mgr, kv, b"lost", 0, flush=False)
    drain(mgr)
    assert metric(mgr, "tiered_kv_errors_total", tier="disk", error="disk_full") == 1
    assert disk_health(mgr) == 0.0
    _host_still_serves(mgr, kv)
    assert mgr.flush(timeout=30) is True
    assert disk_health(mgr) == 1.0


# ============================================================================ directories
def _assert_host_only(mgr, kv):
    assert mgr.disk is None
    assert disk_health(mgr) == 0.0
    assert metric(mgr, "tiered_kv_errors_total", tier="disk", error="open_failed") == 1
    _host_still_serves(mgr, kv)
    assert mgr.flush(timeout=5) is True


def test_read_only_empty_directory_runs_host_only(rig, tmp_path):
    kv = make_kv(8)
    with tmpfs(tmp_path / "ro", size="1m", options="ro") as ro:
        mgr = rig.open(kv, path=ro)
        try:
            _assert_host_only(mgr, kv)
        finally:
            rig.close(mgr)


def test_directory_remounted_read_only_runs_host_only_and_keeps_its_data(rig, tmp_path):
    kv = make_kv(8)
    with tmpfs(tmp_path / "fs", size="4m") as fs:
        mgr = rig.open(kv, path=fs / "db")
        store_seq(mgr, kv, keys(3))
        rig.close(mgr)
        remount(fs, "ro")
        mgr = rig.open(kv, path=fs / "db")
        try:
            _assert_host_only(mgr, kv)
        finally:
            rig.close(mgr)
        remount(fs, "rw")
        mgr = rig.open(kv, path=fs / "db")
        try:
            assert mgr.lookup(keys(3)) == 3
        finally:
            rig.close(mgr)


def test_directory_that_cannot_be_created_runs_host_only(rig, tmp_path, caplog):
    kv = make_kv(8)
    (tmp_path / "a-file").write_bytes(b"x")
    with caplog.at_level(logging.ERROR, logger="tiered_kv.core.disk_tier"):
        mgr = rig.open(kv, path=tmp_path / "a-file" / "db")
    _assert_host_only(mgr, kv)
    # the operator is told why, naming the path and the OS error
    assert any("open_failed" in r.getMessage() and "a-file" in r.getMessage() and "cannot be created" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_missing_directory_is_created(rig, tmp_path):
    kv = make_kv(8)
    path = tmp_path / "does" / "not" / "exist"
    mgr = rig.open(kv, path=path)
    assert mgr.disk is not None and disk_health(mgr) == 1.0
    store_one(mgr, kv, b"a", 0)
    rig.close(mgr)
    assert raw_keys(path) == {b"a"}
    assert os.path.exists(path / "tiered_kv.lock")


# ============================================================================ slot file allocation
def test_filesystem_without_fallocate_gets_a_sparse_slot_file(rig, monkeypatch):
    import tiered_kv.disk.slots as disk_mod

    def no_fallocate(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(disk_mod.os, "posix_fallocate", no_fallocate)
    kv = make_kv(8)
    mgr = _spill_without_errors_and_read_back(rig, kv, 12, disk_slots=32)
    assert mgr.disk_blocks == 12 and mgr.disk.slot_file_bytes() >= 12 * ROW


def _spill_without_errors_and_read_back(rig, kv, n: int, disk_slots: int):
    mgr = rig.open(kv, host_slots=4, disk_slots=disk_slots)
    ks = keys(n)
    store_seq(mgr, kv, ks)
    drain(mgr)
    assert metric_sum(mgr, "tiered_kv_errors_total", tier="disk") == 0
    for i, k in enumerate(ks):
        assert load_ok(mgr, kv, k, i % 8)
    return mgr


def test_nearly_full_disk_takes_one_slot_at_a_time(rig, monkeypatch):
    import tiered_kv.disk.slots as disk_mod

    real = os.posix_fallocate
    asked: list[int] = []

    def tight(fd, offset, length):          # room for single slots only
        asked.append(length)
        if length > ROW:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(disk_mod.os, "posix_fallocate", tight)
    kv = make_kv(8)
    mgr = _spill_without_errors_and_read_back(rig, kv, 6, disk_slots=64)
    assert mgr.disk.slot_file_bytes() == 6 * ROW           # grown slot by slot, no further
    assert asked.count(ROW) == 6 and all(a == ROW or a > ROW for a in asked)


def test_wait_with_a_timeout_returns_on_time_while_a_read_from_disk_is_stuck(rig, monkeypatch):
    """``wait(jobs, timeout)`` is bounded whatever the disk does: a read that hangs (a failing disk)
    runs in a reader thread, so the engine thread gets its call back with the load still pending, and
    the load completes, with its bytes, once the read does."""
    from tiered_kv.disk.readers import Readers

    kv = make_kv(16)
    # the disk readers' path (a blocked wait() would read a cached block itself)
    mgr = rig.open(kv, host_slots=4, host_evict_ahead_blocks=0,
                   disk_read_cached_in_wait=False)
    store_seq(mgr, kv, keys(5))                      # the 4-slot host tier keeps the last four: k0000 is on disk only
    assert mgr.host_bytes(b"k0000") is None and mgr.lookup([b"k0000"]) == 1
    entered, release = threading.Event(), threading.Event()
    read = Readers._read

    def stuck(self, op):
        entered.set()
        release.wait(60)
        return read(self, op)

    monkeypatch.setattr(Readers, "_read", stuck)
    try:
        job = mgr.load(b"k0000", 9)
        assert job is not None
        mgr.wait([job], timeout=0.05)
        assert entered.wait(30), "the read never reached a reader"
        assert not job.done, "wait() outlived its timeout: it waited for the stuck read"
    finally:
        release.set()
    got = [c for c in mgr.wait([job], timeout=30) if c.job is job]
    assert [c.ok for c in got] == [True] and row_is(kv, 9, b"k0000")
