"""Second adversarial review of the disk tier's crash safety and recovery: disk/recovery.py, tombs.py,
slots.py, writer.py, env.py, lock.py, and what TierManager serves after a reopen (core/disk_tier.py).

What it proved wrong, each pinned by a test that failed before its fix:

* C1  A healthy environment is refused as "data.mdb is truncated" after a batch that deleted many
      entries: LMDB legitimately leaves freed, never-written pages past the end of data.mdb (loose pages
      returned to the freelist at commit), so ``(last_pgno + 1) * psize`` exceeds the file size;
      ``DiskEnv.__init__`` took that for truncation and the tier never opened again (host-only service
      for good; ``tools/ops.py: _check_not_truncated`` refused verify/compact/export the same way).
      Nothing needs to crash: a clean close after invalidating most of the tier is enough.  data.mdb is
      now kept as long as LMDB's last page (``DiskEnv.cover_pages``: at open and after each commit).
      (test_c1_a_healthy_tier_whose_last_batch_deleted_many_entries_opens_again)
* C2  A zero-length data.mdb (the owner killed, or the disk full, between LMDB creating the file and
      writing its first meta pages; an OS crash of a durability="none" tier before writeback) made every
      later open refuse the tier ("data.mdb is empty (truncated)"), although it holds nothing that could
      be lost and LMDB initialises such a file as a new environment (``DiskEnv.__init__``).
      (test_c2_a_zero_length_data_file_left_by_a_crash_before_the_first_commit_opens_as_a_new_tier)
* C3  One damaged recency record poisoned the writer for good: ``recover`` took the largest sequence
      number of every touch record (8 bytes, no checksum) and header as the writer's next ``_seq``; a
      touch value of 0xFF..FF makes the next write's ``seq`` 2**64, ``pack_header`` raises struct.error,
      and every later batch with a spill fails (flush() False, nothing is stored on disk again), across
      reopens, since recovery keeps the record.
      (test_c3_a_damaged_touch_record_does_not_stop_every_later_spill)

Checked and found to hold (plain tests at the end pin what no other test file covers):

* a lock file left by a dead owner, with no process holding the flock, opens at once and names the new
  owner; a lock still held by the dead owner's disk I/O process (shared flock, written pid dead) is waited
  for, not refused, and taken as soon as that process is gone (forced deterministically);
* after a reopen that purged entries under durable tombs, dropped records past a truncated slot file and
  the older of two records on one slot, the slot accounting equals what the index holds, and new spills
  written afterwards never land on a slot of a kept entry (every kept and new key loads its own bytes).

Also checked, no new finding: the commit order (payload, fdatasync, commit) and slot reuse one durable
commit later (test_review_crash.py's crash copies); durable tombs across SIGKILL (test_disk_crash.py);
the child's restart reconciliation (test_review_disk_process*.py); meta of another namespace / format /
block size refused at open (documented, test_disk_integrity.py).  Seen, not filed (a window of
milliseconds): if the dead owner's pid is reused while its I/O process still holds the lock,
``lock._gone`` sees a live pid and ``take`` refuses at once instead of waiting for that process.
"""

from __future__ import annotations

import os
import random
import subprocess
import uuid
from pathlib import Path

import lmdb
import pytest

from disk_helpers import (PYTHON, ROW, Rig, keys, load_ok, make_kv, metric, put_raw, raw_env, raw_index,  # noqa: F401
                          rig, slot_file, store_one, store_seq)
from tiered_kv.disk import lock as lock_mod
from tiered_kv.disk.env import map_in_use
from tiered_kv.disk.format import lmdb_key, pack_slot_entry, parse_header, slot_bytes_for
from tiered_kv.disk.recovery import U64

pytestmark = pytest.mark.timeout(180)


def _file_and_used(path: Path) -> tuple[int, int]:
    """(data.mdb's size, LMDB's pages in use * page size) of a closed tier."""
    env = lmdb.open(str(path), subdir=True, max_dbs=4, readonly=True, lock=False)
    try:
        return os.path.getsize(path / "data.mdb"), map_in_use(env)
    finally:
        env.close()


# ============================================================================ C1
@pytest.mark.disk_threads
def test_c1_a_healthy_tier_whose_last_batch_deleted_many_entries_opens_again(rig: Rig) -> None:
    """Invariant: a tier closed cleanly opens again with what it held (nothing crashed here at all).
    400 blocks are stored, then 390 of them (a seeded shuffle) invalidated in one write batch (the writer
    held by a gate while they queue), flushed, closed.  LMDB itself reads the environment fine; the
    tier must open it and serve the 10 blocks left."""
    kv = make_kv(8)
    cfg = dict(host_slots=512, disk_slots=8192)    # batches of up to 512 ops
    mgr = rig.open(kv, **cfg)
    ks = keys(400, "block-")
    store_seq(mgr, kv, ks, flush=False)
    assert mgr.flush(timeout=30) is True
    gone = list(ks)
    random.Random(1).shuffle(gone)
    gone, kept = gone[:390], gone[390:]
    gate = rig.gate(mgr, block_from=1)
    mgr.invalidate(gone[0])                        # its tomb's batch holds the writer at the gate ...
    gate.entered(1)
    for k in gone[1:]:                             # ... while the other 389 tombs queue: one batch
        mgr.invalidate(k)
    gate.open()
    assert mgr.flush(timeout=30) is True
    rig.close(mgr)
    size, used = _file_and_used(rig.path)
    # the environment is healthy: LMDB reads every record of it
    left = {parse_header(v).key for v in raw_index(rig.path).values()}
    assert left == set(kept)
    mgr = rig.open(kv, **cfg)
    assert mgr.disk is not None, (f"a healthy disk tier was refused at open (data.mdb {size} bytes, LMDB's "
                                  f"last page ends at {used}; open_failed counted "
                                  f"{metric(mgr, 'tiered_kv_errors_total', tier='disk', error='open_failed')})")
    assert mgr.lookup([kept[0]]) == 1
    for i, k in enumerate(kept):
        assert load_ok(mgr, kv, k, i % 8), k


# ============================================================================ C2
def test_c2_a_zero_length_data_file_left_by_a_crash_before_the_first_commit_opens_as_a_new_tier(rig: Rig) -> None:
    """The directory as the owner's SIGKILL between LMDB's ``open(O_CREAT)`` of data.mdb and its first
    ``pwrite`` of the meta pages leaves it (or a full disk refusing that write): the path lock's file
    naming a dead owner, LMDB's lock file and a zero-length data.mdb.  Nothing was ever stored; the tier
    must open (empty), store and serve."""
    d = rig.path
    d.mkdir(parents=True)
    dead = subprocess.run([PYTHON, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    (d / lock_mod.LOCK_NAME).write_text(dead.stdout.strip())
    (d / "lock.mdb").write_bytes(b"")
    (d / "data.mdb").write_bytes(b"")
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=2, disk_slots=16)
    assert mgr.disk is not None, (
        "a tier whose data.mdb is empty (nothing ever committed) was refused; open_failed counted "
        f"{metric(mgr, 'tiered_kv_errors_total', tier='disk', error='open_failed')}")
    assert mgr.disk.recovery.entries == 0
    store_seq(mgr, kv, keys(3))
    rig.close(mgr)
    mgr = rig.open(kv, host_slots=2, disk_slots=16)
    assert mgr.disk is not None and mgr.lookup(keys(3)) == 3
    assert load_ok(mgr, kv, keys(3)[0], 5)


# ============================================================================ C3
def test_c3_a_damaged_touch_record_does_not_stop_every_later_spill(rig: Rig) -> None:
    """Invariant: a damaged record is dropped or read as a miss; it never costs the tier its writes.  A
    touch record (recency only) of a stored block is overwritten with 0xFF bytes, as a damaged value page
    could leave it.  After the reopen the tier must still store new blocks."""
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=4, disk_slots=64)
    ks = keys(3)
    store_seq(mgr, kv, ks)
    rig.close(mgr)
    put_raw(rig.path, "touch", lmdb_key(ks[0]), b"\xff" * U64.size)
    mgr = rig.open(kv, host_slots=4, disk_slots=64)
    assert mgr.disk is not None and mgr.lookup(ks) == 3
    new = keys(2, "new")
    for i, k in enumerate(new):
        store_one(mgr, kv, k, i, flush=False)
    ok = mgr.flush(timeout=30)
    errors = metric(mgr, "tiered_kv_errors_total", tier="disk", error="writer_error")
    rig.close(mgr)
    stored = {parse_header(v).key for v in raw_index(rig.path).values()}
    assert ok is True and set(new) <= stored, (
        f"after the reopen no spill is written any more: flush() {ok}, writer errors {errors:.0f}, on disk: "
        f"{sorted(stored)}")


# ============================================================================ held: the path lock
class _Clock:
    """``lock.py``'s ``time`` module with its ``sleep`` replaced (the real module stays untouched)."""

    def __init__(self, sleep) -> None:  # type: ignore[no-untyped-def]
        import time
        self.monotonic = time.monotonic
        self.sleep = sleep


def test_a_lock_file_naming_a_dead_owner_nobody_holds_opens_at_once(rig: Rig, monkeypatch) -> None:
    """A crash leaves ``tiered_kv.lock`` with the dead owner's pid in it, but no flock (a dead process's
    locks go with it).  ``take`` must not wait for that pid (no orphan holds the lock) and must write the
    new owner's pid."""
    kv = make_kv(4)
    mgr = rig.open(kv, host_slots=2)
    store_one(mgr, kv, b"survivor", 0)
    rig.close(mgr)
    dead = subprocess.run([PYTHON, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    (rig.path / lock_mod.LOCK_NAME).write_text(dead)

    def no_wait(s: float) -> None:
        raise AssertionError("take() waited although no process holds the lock")
    monkeypatch.setattr(lock_mod, "time", _Clock(no_wait))
    mgr = rig.open(kv, host_slots=2)
    try:
        assert mgr.disk is not None
        held = (rig.path / lock_mod.LOCK_NAME).read_text().strip()
        assert held == str(os.getpid())
        assert load_ok(mgr, kv, b"survivor", 1)
    finally:
        monkeypatch.undo()
        rig.close(mgr)


def test_a_lock_held_by_the_dead_owners_io_process_is_waited_for_then_taken(tmp_path: Path, monkeypatch) -> None:
    """Invariant 16: a lock whose written pid is dead belongs to that owner's disk I/O process (which shares
    the flock and dies with it); ``take`` waits for it instead of refusing.  Here a child of this test holds
    the shared flock, the file names a dead pid, and the child is ended at ``take``'s first wait: the lock
    must then be taken (not LockHeld), with this process's pid written."""
    d = tmp_path / "tier"
    d.mkdir()
    dead = subprocess.run([PYTHON, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    fd = lock_mod.take(d)                      # the "owner" takes it ...
    os.pwrite(fd, dead.encode().ljust(16), 0)  # ... and is dead now (its pid in the file)
    os.ftruncate(fd, len(dead))
    orphan = subprocess.Popen([PYTHON, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                              pass_fds=(fd,))  # the I/O process: shares the open file, so the flock
    os.close(fd)                               # only the orphan holds it now
    waits = []

    def orphan_exits(s: float) -> None:
        if not waits:
            assert orphan.stdin is not None
            orphan.stdin.close()
            orphan.wait(timeout=30)
        waits.append(s)
    monkeypatch.setattr(lock_mod, "time", _Clock(orphan_exits))
    try:
        got = lock_mod.take(d)
    finally:
        monkeypatch.undo()
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()
    try:
        assert waits, "take() did not wait for the orphan"
        assert lock_mod.holder_pid(got) == str(os.getpid())
    finally:
        lock_mod.release(got)


# ============================================================================ held: slot accounting after recovery
def test_slot_accounting_after_a_recovery_that_dropped_every_kind_of_record_matches_the_index(rig: Rig) -> None:
    """One reopen meets purged (durable tomb), past-the-end (truncated slot file) and doubly-claimed
    records at once.  Afterwards slots in use == entries indexed, and 6 new blocks written after it never
    land on a kept entry's slot: every kept and new key loads its own bytes, before and after a reopen."""
    kv = make_kv(8)
    cfg = dict(host_slots=2, disk_slots=32)
    mgr = rig.open(kv, **cfg)
    ks = keys(8)
    store_seq(mgr, kv, ks)
    rig.close(mgr)
    idx = {parse_header(v).key: parse_header(v) for v in raw_index(rig.path).values()}
    slots = {k: h.slot for k, h in idx.items()}
    assert sorted(slots.values()) == list(range(8))
    by_slot = {s: k for k, s in slots.items()}
    # a durable tomb guarding the write of the block in slot 1
    put_raw(rig.path, "tombs", idx[by_slot[1]].token.bytes, by_slot[1])
    # the slot file cut right after slot 6: slot 7's record points past the end
    os.truncate(slot_file(rig.path), 7 * slot_bytes_for(ROW))
    # slot 3's record copied under slot 2's key with an older sequence number: two records on slot 3,
    # the copy (seq 0) is the older and goes; the original of slot 2's key is gone with it
    victim = by_slot[2]
    with raw_env(rig.path, write=True) as (env, dbs):
        with env.begin(write=True, db=dbs["blocks"]) as txn:
            v = bytearray(txn.get(lmdb_key(by_slot[3])))
            h = parse_header(bytes(v))
            txn.put(lmdb_key(victim), pack_slot_entry(h.namespace, victim, uuid.uuid4(), bytes(ROW), 0, 3))
    mgr = rig.open(kv, **cfg)
    rep = mgr.disk.recovery
    assert (rep.purged, rep.corrupt) == (1, 2), rep
    kept = [by_slot[s] for s in (0, 3, 4, 5, 6)]
    assert mgr.lookup([by_slot[1]]) == 0 and mgr.lookup([by_slot[7]]) == 0 and mgr.lookup([victim]) == 0
    assert mgr.disk.slots_in_use == len(kept) == mgr.disk_blocks
    new = keys(6, "new")
    store_seq(mgr, kv, new)
    for i, k in enumerate(kept + new):
        assert load_ok(mgr, kv, k, i % 8), k
    rig.close(mgr)
    mgr = rig.open(kv, **cfg)
    assert mgr.disk.recovery.corrupt == 0 and mgr.disk.recovery.entries == len(kept) + len(new)
    assert mgr.disk.slots_in_use == len(kept) + len(new)
    for i, k in enumerate(kept + new):
        assert load_ok(mgr, kv, k, i % 8), k
