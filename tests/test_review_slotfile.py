"""Adversarial review of the disk tier's slot file and its bookkeeping: disk/slots.py, tombs.py, writer.py,
recovery.py, records.py, format.py, store.py, cached.py (and proc.py/child.py for the restart's recovery).

WHAT IT PROVED WRONG (each test failed before its fix):

* F1  A token-matched removal -- the owner's eviction (``DiskTier._evicted`` -> ``Delete``) or invalidation
      (``DiskTier.forget`` -> ``Tomb``) -- of a disk entry whose index record has no parseable header (a bit
      flip in its magic, version, flags or a length field: damage recovery would drop as corrupt) leaves the
      record in the index and its slot taken, uncounted, until the next reopen (or until some unrelated corrupt
      read happens to trigger ``Writer._reclaim``).  The owner has forgotten the entry, so the slot is outside
      every capacity count: each such removal eats one slot of the writer's two-batch headroom, and once it is
      gone every spill fails ``slots_exhausted`` (a toy tier of 8 blocks: three damaged records evicted and
      the disk tier takes no write until a restart, with its disk index not even full).
      Tests: test_f1_removing_a_headerless_record_gives_its_slot_back[evict|invalidate] (DiskStore driven
      directly: 4 damaged-and-removed records fill a 4-slot file with the owner holding nothing),
      test_f1_a_manager_evicting_damaged_records_keeps_storing (through TierManager).
      Where: tiered_kv/disk/tombs.py:106-111 (``Tombs.delete_if_token``: on ``CorruptEntry`` it deletes only
      when ``found_corrupt``, i.e. only for the reader's removal; otherwise returns False, record kept, nothing
      noted for the scan), reached from writer.py:502-505 for the ops of core/disk_tier.py:480-488.
      Fixed: on ``CorruptEntry`` the record and its touch record are always deleted and True returned (the
      writer's scan then frees its slot).  No write of anyone's makes an unparsable record, so no token can be
      mis-matched (the reader's path already did exactly this).
* F2  (low severity: a miscount, no data at risk) A slot field damaged to a number whose byte offset passes
      2**63 -- ``parse_header`` accepts any slot below 2**48 (format.py:211), so with 1 MiB blocks anything from
      2**43 up -- makes the disk reader's ``os.preadv`` raise OverflowError, which ``Readers._read``
      (readers.py:436, catches only lmdb.Error/OSError) and ``_read_many`` (readers.py:361, OSError) let escape:
      the catch-all (readers.py:240) answers "miss: read failed", counts ``errors_total{error="reader_error"}``
      (the label of a bug in the reader) and never ``corrupt_blocks_total``, against invariant 9 ("a failure is a
      miss, counted in corrupt_blocks_total").  The entry is still removed (token-matched delete, then the
      scan), so nothing is served or leaked.
      Test: test_f2_a_slot_field_damaged_past_the_offset_range_is_a_counted_corrupt_miss[1|3] (lone read, batch).
      Fixed: nothing is read (``got = 0``, as for a record of another length) when the slot's end passes the
      largest file offset, in ``_read`` and for the run in ``_read_many``; the verification then fails as
      "truncated", a counted corrupt miss.

CHECKED AND FOUND TO HOLD (plain tests below pin what no other file covers):

* suspicion 1 -- an invalidation queued but not committed when the owner dies is lost like any un-flushed
  write: DESIGN.md makes the engine thread never wait on disk, so ``invalidate()`` cannot be synchronous; the
  promise is kept once ``flush()`` returned True (the tomb op is queued at the front, the flush at the back:
  committed and synced first).  test_p1_an_invalidation_flushed_before_a_sigkill_stays_after_reopen (SIGKILL
  of a child process, sync and batch).  A dead I/O child's lost removals are redone by the restart's
  reconciliation (token-matched deletes of what the index no longer holds), a dead writer's by
  ``settle_orphans``.
* suspicion 2 -- the reader's removal of a corrupt/headerless record frees its slot (scan); only the
  owner's own removals leak it: F1.
* suspicion 3 -- slot reuse under a reader: the disk reader re-reads the index before calling bytes corrupt
  (``_index_changed``: superseded), and the owner's page-cache read checks the stale record's (seq, checksum)
  with the expected token over what it read, so a reused slot is never served
  (test_p3_the_owners_page_cache_read_of_a_reused_slot_is_never_served, with a served control).  ``reclaim``
  skips _PENDING slots and defers to the dropping commit's durability; a slot reaches the free list only from
  _PLACED/held or _PENDING, never twice; ``hold`` runs after ``drop`` in a spill, so a damaged record naming
  the very slot its rewrite was just placed in frees nothing.  Seeded fuzzing (random writes, evictions,
  tombs, reads, damaged slot fields and headers, 20% injected commit EIO; sync/batch/none; reopen and read
  all) found no wrong bytes, no double free and no slot outside a record.
* suspicion 4 -- SIGKILL after a payload's fdatasync but before its record commits, and after a tomb
  committed and its slot went to another key: every recovered entry reads its own bytes, one record per slot,
  new writes never land on a kept entry (test_p4_..., sync and batch).  A restarted I/O child's recovery syncs
  before any write, so slots the dead child dropped in a commit not yet durable are safe to reuse.
* suspicion 5 -- reopen with another block size (hence slot size) is refused by the meta check before the
  slot file is sized or recovery drops anything (test_p5_...); a reopen on a shrunk capacity keeps the
  file's slots (``SlotFile.max``) and the owner evicts the excess on replay.  Map-full retries give every
  placed slot back and undo the tomb sets; ENOSPC growing/writing/syncing fails the spills alone.  Owner
  capacity vs slots in use: a manager fuzz (8 and 40 blocks, invalidations, 30% commit EIO, batch and sync)
  never hit slots_exhausted.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from disk_helpers import ROW, Rig, StoreRig, content, keys, make_kv, metric_sum, rig, store_one, store_seq  # noqa: F401
from tiered_kv.disk.format import lmdb_key


def _good(key: bytes) -> bytes:
    return content(key, ROW).numpy().tobytes()


def _records(r: StoreRig) -> int:
    db = r.s.db
    assert db is not None
    db.rw.acquire_shared()
    try:
        with db.env.begin(db=db.blocks) as txn:
            return txn.stat(db.blocks)["entries"]
    finally:
        db.rw.release_shared()


@pytest.mark.parametrize("removal", ["evict", "invalidate"])
def test_f1_removing_a_headerless_record_gives_its_slot_back(tmp_path: Path, removal: str) -> None:
    """Invariant 12: a removal gives its slot back (via the scan when its slot number cannot be trusted).  Four
    rounds on a 4-slot store: write a block, flip its index record's magic, remove it as the owner does.  The
    owner then holds nothing, yet the four records and their slots are still there and a fifth write fails."""
    r = StoreRig(tmp_path / "d", slots=4)
    try:
        for i in range(4):
            key = b"k%d" % i
            t = r.write(key)
            assert r.flush()
            r.break_header(key)                     # a bit flip in the record's magic: no parseable header
            if removal == "evict":
                r.s.submit_delete(t, key)           # DiskTier._evicted: token-matched delete
            else:
                r.s.cancel(t, key)                  # DiskTier.forget: the tomb
            assert r.flush() and r.flush()
        t = r.submit(b"new")
        rep = r.answer(t)
        assert rep.ok, (f"after 4 {removal}s of damaged records the owner holds nothing, yet a write finds no "
                        f"slot: {rep.error}; slots in use {r.s.slots_in_use}, records {_records(r)}")
    finally:
        r.close()


@pytest.mark.disk_threads
def test_f1_a_manager_evicting_damaged_records_keeps_storing(rig: Rig) -> None:
    """The same through TierManager: 8 disk blocks (a slot file of 10: two write batches of headroom).  Three
    stored blocks' index records get a flipped magic byte (a bit flip in a data.mdb page, never read since).
    Eight new blocks push all old ones out of the disk LRU: the owner's evictions (``DiskTier._evicted``) leave
    the three damaged records and their slots behind, and from then on every spill fails (slots_exhausted),
    although the owner's disk index is not even full: the disk tier takes no writes until a restart."""
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=2, disk_slots=8)
    d = mgr.disk
    assert d is not None and d.db is not None
    first = keys(8, "a")
    store_seq(mgr, kv, first)
    for k in first[:3]:
        d.db.rw.acquire_shared()
        try:
            with d.db.env.begin(write=True, db=d.db.blocks) as txn:
                v = bytearray(txn.get(lmdb_key(k)))
                v[0] ^= 0xFF
                txn.put(lmdb_key(k), bytes(v))
        finally:
            d.db.rw.release_shared()
    flushed = []
    for i, k in enumerate(keys(8, "b")):
        store_one(mgr, kv, k, i % 8, flush=False)
        flushed.append(mgr.flush(timeout=30))
    exhausted = metric_sum(mgr, "tiered_kv_errors_total", error="slots_exhausted")
    assert all(flushed) and exhausted == 0, (f"flushes {flushed}; slots_exhausted {exhausted}; slots in use "
                                             f"{d.slots_in_use} of {d.opts.slots}, disk index "
                                             f"{len(mgr._core.disk.index)} of {mgr._core.disk.index.num_slots}")


@pytest.mark.parametrize("reads", [1, 3])
def test_f2_a_slot_field_damaged_past_the_offset_range_is_a_counted_corrupt_miss(tmp_path: Path, reads: int) -> None:
    """Invariant 9: a read that fails verification is a miss, counted in corrupt_blocks_total (``on_corrupt``).  With
    1 MiB blocks a slot field flipped to 2**44 + 5 (parse_header accepts any slot below 2**48) gives an offset
    past 2**63: ``os.preadv`` raises OverflowError, which neither ``Readers._read`` nor ``_read_many`` catches;
    the reader's catch-all answers READ_FAILED and counts ``reader_error`` (a reader bug) instead."""
    from tiered_kv.disk import DiskOptions, DiskStore
    from tiered_kv.movers import CompletionQueue

    bb = 1 << 20
    q = CompletionQueue()
    errors: list[str] = []
    corrupt: list[str] = []
    s = DiskStore(DiskOptions(path=tmp_path / "d", namespace="rev|u8", block_bytes=bb, capacity_bytes=4 * bb,
                              durability="sync", batch_blocks=4, batch_bytes=4 * bb, batch_seconds=0.0, slots=4,
                              num_readers=1), q, on_error=lambda kind, msg: errors.append(kind),
                  on_corrupt=corrupt.append)
    try:
        bufs = [bytearray(bytes([i]) * bb) for i in range(reads)]
        toks = [uuid.uuid4() for _ in range(reads)]
        names = [b"k%d" % i for i in range(reads)]
        assert s.submit_spills(toks, names, list(range(reads)), lambda i: memoryview(bufs[i]))
        assert q.get(30).ok
        assert s.db is not None
        s.db.rw.acquire_shared()
        try:
            with s.db.env.begin(write=True, db=s.db.blocks) as txn:
                v = bytearray(txn.get(lmdb_key(names[0])))
                v[-8:] = ((1 << 44) + 5).to_bytes(8, "little")     # the slot field: outside the checksum
                txn.put(lmdb_key(names[0]), bytes(v))
        finally:
            s.db.rw.release_shared()
        dsts = [bytearray(bb) for _ in range(reads)]
        ps = [uuid.uuid4() for _ in range(reads)]
        for p, k, t, d in zip(ps, names, toks, dsts):
            s.queue_promote(p, k, t, memoryview(d))
        s.start_reads()
        got = {}
        while len(got) < reads:
            r = q.get(30)
            assert r is not None
            got[r.token] = r
        bad = got[ps[0]]
        assert not bad.ok and bad.error.startswith("miss: corrupt") and corrupt and "reader_error" not in errors, (
            bad.error, errors, corrupt)
        for p, i in zip(ps[1:], range(1, reads)):
            assert got[p].ok and dsts[i] == bufs[i]
    finally:
        s.close()


# --------------------------------------------------------------------------- checked, found to hold
_CHILD = r'''
import os, signal, sys, uuid
from pathlib import Path
from disk_helpers import StoreRig
from tiered_kv.disk.slots import SlotFile
path, what = Path(sys.argv[1]), sys.argv[2]
r = StoreRig(path, slots=8, durability=sys.argv[3])
ta = r.write(b"a"); r.write(b"b")
assert r.flush()
print(ta.hex, flush=True)
if what == "invalidate":
    r.s.cancel(ta, b"a")                     # DiskTier.forget
    assert r.flush()                         # the caller's flush(): the tomb is committed and synced
elif what == "rewrite-after-sync":
    real = SlotFile.sync
    def sync(self):
        real(self)
        os.kill(os.getpid(), signal.SIGKILL)     # payload durable, its record never committed
    SlotFile.sync = sync
    r.submit(b"a")
    r.submit(b"c")
    import threading
    threading.Event().wait(60)               # (the writer's sync kills the process long before)
    sys.exit(3)
elif what == "invalidate-then-reuse":
    r.s.cancel(ta, b"a")
    assert r.flush() and r.flush()           # a's slot is free again
    r.write(b"c")                            # ... and taken by c
    assert r.flush()
    r.s.db.env.sync(True)
os.kill(os.getpid(), signal.SIGKILL)
'''


def _crash(tmp_path: Path, what: str, durability: str) -> tuple[Path, uuid.UUID]:
    import subprocess

    from disk_helpers import PYTHON, child_env

    path = tmp_path / "d"
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    p = subprocess.run([PYTHON, str(script), str(path), what, durability], capture_output=True, text=True,
                       env=child_env(), timeout=120)
    assert p.returncode == -9, (p.returncode, p.stderr[-3000:])
    return path, uuid.UUID(p.stdout.split()[0])


@pytest.mark.parametrize("durability", ["sync", "batch"])
def test_p1_an_invalidation_flushed_before_a_sigkill_stays_after_reopen(tmp_path: Path, durability: str) -> None:
    """Suspicion 1 (refuted as a defect): DESIGN.md promises durable tombs, and invalidate() never waits on disk;
    once the caller's flush() returned True the invalidation holds across a SIGKILL of the owner."""
    path, ta = _crash(tmp_path, "invalidate", durability)
    r = StoreRig(path, slots=8, durability=durability)
    try:
        assert b"a" not in {e.key for e in r.s.entries}
        rep, _ = r.read(b"a", ta)
        assert not rep.ok
        assert r.read(b"b", next(e.token for e in r.s.entries if e.key == b"b"))[0].ok
    finally:
        r.close()


@pytest.mark.parametrize("what", ["rewrite-after-sync", "invalidate-then-reuse"])
@pytest.mark.parametrize("durability", ["sync", "batch"])
def test_p4_a_sigkill_mid_write_never_serves_other_bytes_nor_shares_a_slot(tmp_path: Path, what: str,
                                                                           durability: str) -> None:
    """Suspicion 4 (refuted): killed after a payload was written and synced but before its record was committed,
    or after a tomb committed and its slot went to another key: every entry recovered reads its own bytes, each
    slot holds one record, and the free list is exactly the rest."""
    path, _ = _crash(tmp_path, what, durability)
    r = StoreRig(path, slots=8, durability=durability)
    try:
        used = [parse_slot(r, e.key) for e in r.s.entries]
        assert len(set(used)) == len(used) == r.s.slots_in_use
        for e in r.s.entries:
            rep, got = r.read(e.key, e.token)
            assert rep.ok and got == _good(e.key), (e.key, rep)
        if what == "invalidate-then-reuse":
            assert b"a" not in {e.key for e in r.s.entries}
        for key in (b"x", b"y", b"z"):       # new writes never land on a kept entry's slot
            r.write(key)
        for e in r.s.entries:
            rep, got = r.read(e.key, e.token)
            assert rep.ok and got == _good(e.key), (e.key, rep)
    finally:
        r.close()


def parse_slot(r: StoreRig, key: bytes) -> int:
    return r.slot_of(key)


@pytest.mark.parametrize("removal", ["evict", "rewrite"])
def test_p3_the_owners_page_cache_read_of_a_reused_slot_is_never_served(tmp_path: Path, removal: str) -> None:
    """Suspicion 3 (refuted): the owner keeps a's record (``Entry.where``) after a's slot was dropped and handed to
    another write; its page-cache read (disk/cached.py) of that slot, with the bytes in the page cache, is
    refused by the checksum over (namespace, key, expected token, seq) and handed on, never served."""
    from tiered_kv.disk.cached import CachedReads
    from tiered_kv.disk.format import where_slot
    from tiered_kv.disk.records import Promote

    r = StoreRig(tmp_path / "d", slots=4)
    try:
        ta = r.submit(b"a")
        rep = r.answer(ta)
        assert rep.ok and rep.where
        where = rep.where[0]
        slot = where_slot(where)
        if removal == "evict":
            r.s.submit_delete(ta, b"a")
            assert r.flush() and r.flush()
            tb = r.submit(b"b")                      # the lowest free slot: a's
        else:
            r.write(b"a")                            # a newer write of a: a's old slot is dropped ...
            assert r.flush() and r.flush()
            tb = r.submit(b"b")                      # ... and taken by b
        rb = r.answer(tb)
        assert rb.ok and r.slot_of(b"b") == slot
        cached = CachedReads(r.opts.path, r.opts.namespace, ROW)
        if not cached.enabled:
            pytest.skip("no RWF_NOWAIT here")
        try:
            dst = bytearray(ROW)
            served, rest = cached.read([Promote(uuid.uuid4(), b"a", ta, memoryview(dst), where)])
            assert served == [] and len(rest) == 1
            served, rest = cached.read([Promote(uuid.uuid4(), b"b", tb, memoryview(dst), rb.where[0])])
            assert len(served) == 1 and bytes(dst) == _good(b"b")   # the control: b's own record is served
        finally:
            cached.close()
    finally:
        r.close()


def test_p5_a_reopen_with_another_block_size_is_refused_and_leaves_the_tier_intact(tmp_path: Path) -> None:
    """Suspicion 5 (refuted): another block size means another slot size; the open is refused by the meta check
    (env.py ``_check_meta``) before the slot file is sized or recovery drops anything as foreign."""
    from tiered_kv.disk import DiskOptions, DiskStore
    from tiered_kv.errors import DiskTierError
    from tiered_kv.movers import CompletionQueue

    path = tmp_path / "d"
    r = StoreRig(path, slots=4)
    try:
        ta = r.write(b"a")
        assert r.flush()
    finally:
        r.close()
    for bb in (ROW // 2, 2 * ROW):
        opts = DiskOptions(path=path, namespace=r.opts.namespace, block_bytes=bb, capacity_bytes=4 * bb, slots=4,
                           num_readers=1)
        with pytest.raises(DiskTierError):
            DiskStore(opts, CompletionQueue())
    r = StoreRig(path, slots=4)
    try:
        rep, got = r.read(b"a", ta)
        assert rep.ok and got == _good(b"a")
    finally:
        r.close()
