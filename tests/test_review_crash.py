"""Adversarial review of the disk tier's crash consistency: writer.py (batches, commits, slot reuse one
commit after a delete, tombs), tombs.py, recovery.py, slots.py, format.py, as driven by
core/disk_tier.py and core/tiers.py.

Findings (each pinned by a test that failed before its fix; the fixes follow each):

1. Recovery mis-ranks recency: a promote's touch that leaves in the same write batch as spills queued
   *after* it outranks them after a restart.  ``Writer._commit`` numbers a batch's spills in its
   allocation loop, before the transaction, and numbers each touch only inside the transaction, so
   the touch always gets the higher sequence number whatever the queue order.  Touches wake no one
   and ride with the next batch, so "load a prefix from disk, then store new blocks" (the usual
   engine step) ends with the loaded blocks ranked newer than the blocks written after them: after a
   restart the newer blocks are evicted first (a reopen with a smaller capacity keeps the wrong one).
   (test_a_touch_riding_with_later_spills_does_not_outrank_them_after_a_restart)
   Fixed: ``_commit`` numbers a batch's spills and touches together, in the order they were queued.
2. Touch records of deleted entries are never collected while the tier runs: a Touch op is written
   without asking whether its entry still exists.  A tomb or delete is queued in front of the touch
   that a promote queued just before, deletes the entry and its touch record, and then the touch
   writes a new record for a key that is gone.  The ``touch`` sub-database grows by one record per
   key promoted and then invalidated (or evicted) before its touch left; only the next open's
   recovery drops them.
   (test_touch_records_of_invalidated_keys_are_not_left_behind)
   Fixed: a touch writes its record only while its entry is in the blocks sub-database.

Checked and found to hold (passing tests here add what no other test file covers):

* slot reuse under a simulated OS crash: with durability "batch", at every payload write of a seeded
  run of spills, cancels, deletes, touches and flushes, the directory as an OS crash could leave it
  (LMDB's newest meta page lost when it was not synced yet, i.e. the previous commit, and every slot
  write already on disk) holds no record whose slot bytes fail verification, and every key a
  completed flush() covered is there under its token.  The same holds for a process crash (the
  copy as it is) in all three durability modes.  Reusing a dropped slot one commit later is enough.
* a short key spelled like a long key's digest LMDB name (``b"\\xff#" + xxh3_128``) shares its index
  record, but is only ever a miss for the other key, before and after a reopen: never its bytes.

Also checked, no finding and no new test (covered elsewhere): durable tombs are consumed when their
write is prevented and rolled back with an aborted transaction (test_tombs.py,
test_disk_writer_regressions.py); recovery's handling of foreign, truncated, double-claimed and
tombstoned records (test_recovery.py, test_disk_integrity.py, test_disk_slots.py); a key of 65535
bytes (test_review_config.py); fallocate failing (test_disk_faults.py, test_disk_slots.py).
"""

from __future__ import annotations

import hashlib
import random
import shutil
import struct
import threading
import uuid
from pathlib import Path
from typing import Any

import lmdb
import pytest

import tiered_kv.disk.writer as writer_mod
from disk_helpers import (NS, ROW, Rig, keys, load_into, load_ok, make_kv, raw_env, raw_keys, rig,  # noqa: F401
                          store_one, store_seq)
from tiered_kv.disk import DiskOptions, DiskStore, FlushDone
from tiered_kv.disk.format import SLOTS_NAME, CorruptEntry, lmdb_key, parse_header, slot_bytes_for, verify_entry
from tiered_kv.movers import CompletionQueue

__all__ = ["rig"]


# ============================================================================ finding 1: recency
@pytest.mark.disk_threads
def test_a_touch_riding_with_later_spills_does_not_outrank_them_after_a_restart(rig: Rig, monkeypatch) -> None:
    """Invariant: recency survives a restart, each entry ranked by the newer of its write and its last
    read-back (architecture.md, "Durability": recovery ranks by the larger of the two).  A is read back
    from disk, then C is written: C is the newer.  A reopen that keeps only the newest entry must keep C."""
    monkeypatch.setattr(writer_mod, "IDLE_WAKE_S", 3600.0)   # a queued touch leaves with the next batch only
    kv = make_kv(8)
    a, b, c = b"A", b"B", b"C"
    # 64 blocks: write batches of 4 (a tier below 32 blocks writes one op per batch)
    mgr = rig.open(kv, host_slots=2, disk_slots=64)
    store_seq(mgr, kv, [a, b])
    rig.close(mgr)
    mgr = rig.open(kv, host_slots=2, disk_slots=64)          # the host tier starts empty: A comes from disk
    assert load_ok(mgr, kv, a, 6)                              # promote: A's touch is queued
    store_one(mgr, kv, c, 0)                                   # C is written after A was read back
    rig.close(mgr)
    mgr = rig.open(kv, host_slots=2, disk_slots=1)             # room for the newest entry only
    assert mgr.disk_blocks == 1
    newest = [k for k in (a, b, c) if mgr.lookup([k]) == 1]
    rig.close(mgr)
    assert newest == [c], f"the reopened tier kept {newest}, not C (written after A's read-back)"


# ============================================================================ finding 2: touch records leak
@pytest.mark.disk_threads
def test_touch_records_of_invalidated_keys_are_not_left_behind(rig: Rig, monkeypatch) -> None:
    """Invariant: the touch sub-database holds recency records of entries on disk (recovery drops the
    others as dead).  Each key here is read back from disk and then invalidated; after a flush the
    blocks sub-database is empty, and so should the touch one be -- not only after the next reopen."""
    monkeypatch.setattr(writer_mod, "IDLE_WAKE_S", 3600.0)   # the touch leaves with the next batch
    kv = make_kv(8)
    ks = keys(8)
    mgr = rig.open(kv, host_slots=2, disk_slots=64, durability="sync")   # "sync": no idle sync takes a touch alone
    store_seq(mgr, kv, ks)
    rig.close(mgr)
    mgr = rig.open(kv, host_slots=2, disk_slots=64, durability="sync")
    for k in ks:
        assert load_ok(mgr, kv, k, 6)      # promote: a touch queued behind ...
        mgr.invalidate(k)                  # ... the tomb, queued in front of it
    assert mgr.flush(timeout=30) is True
    assert mgr.disk_blocks == 0
    rig.close(mgr)
    with raw_env(rig.path) as (env, dbs):
        with env.begin() as txn:
            blocks = [bytes(k) for k, _ in txn.cursor(db=dbs["blocks"])]
            touched = [bytes(k) for k, _ in txn.cursor(db=dbs["touch"])]
    assert blocks == []
    assert touched == [], f"{len(touched)} touch records of keys no longer on disk: {touched}"


# ============================================================================ held: slot reuse across crashes
_META_TXNID = 16 + 4 + 4 + 8 + 8 + 2 * 48 + 8   # page header, magic, version, address, mapsize, 2 dbs, last_pg


def _meta_txnids(data: bytes, psize: int) -> tuple[int, int]:
    return (struct.unpack_from("<Q", data, _META_TXNID)[0], struct.unpack_from("<Q", data, psize + _META_TXNID)[0])


def _payload(key: bytes, token: uuid.UUID) -> bytearray:
    return bytearray(hashlib.shake_128(b"crash-review:" + key + token.bytes).digest(ROW))


class _SyncSpy:
    """The store's environment, recording the newest transaction made durable by an explicit sync."""

    def __init__(self, env: Any) -> None:
        self._env = env
        self.synced = env.info()["last_txnid"]   # recovery syncs its commit at open

    def sync(self, force: bool = False) -> None:
        txn = self._env.info()["last_txnid"]
        self._env.sync(force)
        self.synced = max(self.synced, txn)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


def _snapshot(src: Path, dst: Path, psize: int, last: int, roll_back: bool) -> dict[bytes, tuple[uuid.UUID, str]]:
    """Copy ``src``'s files to ``dst`` (what a crash now leaves: the page cache's contents); with
    ``roll_back``, also lose LMDB's newest meta page (an OS crash before it reached the disk).  Returns
    block key -> (token, "ok" or why its bytes fail verification) of every record the copy holds."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir()
    for name in ("data.mdb", SLOTS_NAME):
        shutil.copyfile(src / name, dst / name)
    with open(dst / "data.mdb", "r+b") as f:
        t0, t1 = _meta_txnids(f.read(2 * psize), psize)
        assert max(t0, t1) == last, ("LMDB meta layout not as expected", t0, t1, last)
        if roll_back:
            f.seek((0 if t0 > t1 else 1) * psize + _META_TXNID)
            f.write(struct.pack("<Q", 0))
    env = lmdb.open(str(dst), subdir=True, max_dbs=4, readonly=True, lock=False, map_size=1 << 30)
    try:
        data = (dst / SLOTS_NAME).read_bytes()
        out = {}
        with env.begin(db=env.open_db(b"blocks", create=False)) as txn:
            for _, v in txn.cursor():
                h = parse_header(v)
                off = h.slot * slot_bytes_for(h.length)
                try:
                    verify_entry(v, NS.encode(), h.key, ROW, data[off:off + h.length])
                    out[h.key] = (h.token, "ok")
                except CorruptEntry as exc:
                    out[h.key] = (h.token, f"bad: {exc}")
        return out
    finally:
        env.close()


def _crash_copies_run(tmp: Path, durability: str, seed: int, ops: int = 160) -> tuple[int, list[Any]]:
    """A seeded run of spills, cancels, deletes, touches and flushes on a small store (slots reused all
    the time).  At every payload write, just before the commit that would publish it, the directory
    is copied as a crash would leave it and checked.  Returns (copies checked, problems)."""
    rng = random.Random(seed)
    path = tmp / f"d-{durability}-{seed}"
    q = CompletionQueue()
    st = DiskStore(DiskOptions(path=path, namespace=NS, block_bytes=ROW, capacity_bytes=16 * ROW,
                               durability=durability, batch_blocks=3, batch_bytes=3 * ROW, batch_seconds=0.0,
                               slots=16, queue_blocks=64, num_readers=1), q)
    assert st.db is not None and st.slots is not None
    spy = _SyncSpy(st.db.env)
    st.db.env = spy
    psize = spy.stat()["psize"]
    lock = threading.Lock()
    expect: dict[bytes, uuid.UUID] = {}   # key -> token: covered by a completed flush, nothing queued since
    problems: list[Any] = []
    checked = [0]
    slots = st.slots
    real_sync = slots.sync

    def check(roll_back: bool) -> None:
        last = spy._env.info()["last_txnid"]
        got = _snapshot(path, tmp / "copy", psize, last, roll_back)
        checked[0] += 1
        with lock:
            want = dict(expect)
        for k, (t, how) in got.items():
            if how != "ok":
                problems.append(("corrupt", roll_back, k, t, how))
        for k, t in want.items():
            if got.get(k, (None,))[0] != t:
                problems.append(("flushed key lost", roll_back, k, t, got.get(k)))

    def sync_then_crash() -> None:      # the batch's payloads are written: a crash here, before the commit
        real_sync()
        check(roll_back=False)
        if durability == "batch" and spy._env.info()["last_txnid"] > spy.synced:
            check(roll_back=True)       # the newest commit's meta page not on disk yet

    slots.sync = sync_then_crash        # type: ignore[method-assign]
    if durability == "none":            # no sync at all: check at each payload write instead
        real_pwrite = slots.pwrite

        def pwrite_then_crash(slot: int, src: memoryview) -> None:
            real_pwrite(slot, src)
            check(roll_back=False)
        slots.pwrite = pwrite_then_crash   # type: ignore[method-assign]
    names = [b"k%02d" % i for i in range(10)] + [b"L" * 600 + b"1", b"L" * 600 + b"2"]
    last_spill: dict[bytes, uuid.UUID] = {}
    answers: dict[uuid.UUID, Any] = {}
    bufs: list[bytearray] = []
    try:
        for _ in range(ops):
            r, k = rng.random(), rng.choice(names)
            if r < 0.5:
                t = uuid.uuid4()
                buf = _payload(k, t)
                bufs.append(buf)
                with lock:
                    expect.pop(k, None)
                if st.submit_spill(t, k, memoryview(buf)):
                    last_spill[k] = t
                else:
                    last_spill.pop(k, None)
            elif r < 0.62 and k in last_spill:
                with lock:
                    expect.pop(k, None)
                st.cancel(last_spill.pop(k), k)
            elif r < 0.74 and k in last_spill:
                with lock:
                    expect.pop(k, None)
                st.submit_delete(last_spill.pop(k), k)
            elif r < 0.88:
                st.submit_touch(k)
            else:
                ft = uuid.uuid4()
                st.submit_flush(ft)
                while ft not in answers:
                    item = q.get(30)
                    assert item is not None, "no answer within 30 s"
                    answers[item.token] = item
                done_flush = answers.pop(ft)
                assert isinstance(done_flush, FlushDone) and done_flush.ok, done_flush
                with lock:
                    for key, t in last_spill.items():
                        rep = answers.get(t)
                        if rep is not None and rep.ok:
                            expect[key] = t
    finally:
        st.close()
    return checked[0], problems


@pytest.mark.parametrize("durability", ["batch", "sync", "none"])
def test_a_crash_at_any_payload_write_leaves_every_record_verifiable_and_every_flushed_key(tmp_path: Path,
                                                                                          durability: str) -> None:
    """Invariant 12 (a slot is referenced by at most one committed entry; a dropped slot is reused only
    once the commit that dropped it is durable) and the durability table: a crash right after a batch's
    payloads were written -- with "batch" also the OS crash that loses the newest, unsynced meta page --
    leaves no index record over bytes of another write, and loses no key a completed flush() covered."""
    total = 0
    for seed in range(2):
        n, problems = _crash_copies_run(tmp_path, durability, seed)
        assert problems == [], problems[:5]
        total += n
    assert total >= 40, f"only {total} crash copies were checked"


# ============================================================================ held: digest-named keys
def test_a_short_key_spelled_like_a_long_keys_digest_name_is_only_ever_a_miss_for_the_other(rig: Rig) -> None:
    """format.lmdb_key: a key over 480 bytes is indexed under b"\\xff#" + its xxh3-128 digest, a name a
    short key (18 bytes) can spell too.  The two then share one index record; each is served only its
    own bytes (the header's key is authoritative), the other is a miss, before and after a reopen."""
    kv = make_kv(8)
    long_key = b"L" * 600
    short_key = lmdb_key(long_key)
    assert len(short_key) == 18 and lmdb_key(short_key) == short_key
    mgr = rig.open(kv, host_slots=2, disk_slots=8)
    store_seq(mgr, kv, [long_key, short_key, b"x", b"y"])   # both leave the host; short_key's write replaced long_key's
    job, comp = load_into(mgr, kv, long_key, 6)
    assert job is None or (comp is not None and not comp.ok), "long_key was served from short_key's record"
    assert load_ok(mgr, kv, short_key, 7)
    rig.close(mgr)
    assert raw_keys(rig.path) == {short_key, b"x", b"y"}
    mgr = rig.open(kv, host_slots=2, disk_slots=8)
    assert mgr.lookup([long_key]) == 0 and mgr.load(long_key, 6) is None
    assert load_ok(mgr, kv, short_key, 7)
    rig.close(mgr)
