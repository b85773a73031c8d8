"""Adversarial review of the disk tier's records: the slot number the checksum does not cover.

What it proved wrong (each proof failed with an AssertionError before its fix):

* a token-matched removal (an eviction's delete, an invalidation's tomb) freed the slot its record names:
  with that field damaged to name another live entry's slot, the next write overwrote that entry, stored
  and flushed; with it naming a free slot, the slot went on the free list twice and two live entries
  shared it.  Fixed: the writer keeps per slot a print of the index key whose record names it
  (``SlotFile.hold``/``recovered``), a removal frees only a slot that holds its record (``SlotFile.drop``),
  the record's own slot is found by the writer's scan (``Writer._reclaim``), and a slot free already is
  never freed again (``SlotFile._free_locked``);
* recovery dropped the older of two records on one slot unread: a newer record with a damaged slot field
  deleted the intact entry it collided with.  Fixed: the slot is read and the record that verifies over
  it stays (``recovery._loser``);
* the scan's slots were freed at once, also with ``durability="batch"``, where the commit that dropped
  their records is not durable yet (invariant 12).  Fixed: they wait for it as its other drops do.

The rest pins the ordinary paths: an intact record's removal frees its slot directly, with no scan.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from disk_helpers import NS, ROW, content
from tiered_kv.disk import DiskOptions, DiskStore, FlushDone
from tiered_kv.disk.format import lmdb_key, parse_header
from tiered_kv.movers import CompletionQueue


class _Rig:
    """A thread-mode DiskStore driven directly, its answers awaited by token."""

    def __init__(self, path: Path, slots: int = 8, durability: str = "sync", batch_blocks: int = 0) -> None:
        self.q = CompletionQueue()
        bb = batch_blocks or slots
        opts = DiskOptions(path=path, namespace=NS, block_bytes=ROW, capacity_bytes=slots * ROW, durability=durability,
                           batch_blocks=bb, batch_bytes=bb * ROW, batch_seconds=0.0, slots=slots, num_readers=1)
        self.s = DiskStore(opts, self.q)
        self.seen: dict[uuid.UUID, Any] = {}
        self.bufs: list[bytearray] = []

    def answer(self, token: uuid.UUID) -> Any:
        deadline = time.monotonic() + 30
        while token not in self.seen:
            item = self.q.get(max(0.0, deadline - time.monotonic()))
            assert item is not None, f"no answer for {token}"
            self.seen[item.token] = item
        return self.seen.pop(token)

    def write(self, key: bytes) -> uuid.UUID:
        buf = bytearray(content(key, ROW).numpy().tobytes())
        self.bufs.append(buf)
        t = uuid.uuid4()
        assert self.s.submit_spill(t, key, memoryview(buf))
        assert self.answer(t).ok
        return t

    def flush(self) -> bool:
        tok = uuid.uuid4()
        self.s.submit_flush(tok)
        r = self.answer(tok)
        assert isinstance(r, FlushDone)
        return r.ok

    def record(self, key: bytes) -> bytes:
        db = self.s.db
        with db.env.begin(db=db.blocks) as txn:
            return bytes(txn.get(lmdb_key(key)))

    def slot_of(self, key: bytes) -> int:
        return parse_header(self.record(key)).slot

    def set_slot(self, key: bytes, slot: int) -> None:
        """Damage ``key``'s record: its slot field (outside the checksum) now names ``slot``."""
        db = self.s.db
        db.rw.acquire_shared()
        try:
            with db.env.begin(write=True, db=db.blocks) as txn:
                v = bytearray(txn.get(lmdb_key(key)))
                v[-8:] = slot.to_bytes(8, "little")
                txn.put(lmdb_key(key), bytes(v))
        finally:
            db.rw.release_shared()

    def read(self, key: bytes, expect: uuid.UUID) -> tuple[Any, bytes]:
        dst = bytearray(ROW)
        p = uuid.uuid4()
        self.s.queue_promote(p, key, expect, memoryview(dst))
        self.s.start_reads()
        return self.answer(p), bytes(dst)

    def close(self) -> None:
        self.s.close()


def _good(key: bytes) -> bytes:
    return content(key, ROW).numpy().tobytes()


# --------------------------------------------------------------------------- 1

@pytest.mark.parametrize("removal", ["evict", "invalidate"])
def test_removing_a_record_with_a_damaged_slot_field_never_frees_a_live_entrys_slot(tmp_path: Path,
                                                                                   removal: str) -> None:
    """The checksum does not cover the slot number, so a damaged slot field may name another live entry's slot
    (architecture.md, invariant 9).  The reader's corrupt-removal path does not trust it; a token-matched
    removal (the owner's eviction, ``DiskTier._evicted``; an invalidation's tomb, ``Tombs.apply``) does: it
    frees the slot the damaged field names -- b's -- and the next writes overwrite b, a stored, flushed block."""
    r = _Rig(tmp_path / "d", slots=4)
    try:
        ta = r.write(b"a")
        tb = r.write(b"b")
        assert r.flush()
        sb = r.slot_of(b"b")
        r.set_slot(b"a", sb)                 # a bit flip in a's index record: it names b's slot
        if removal == "evict":
            r.s.submit_delete(ta, b"a")      # the owner evicts a (DiskTier._evicted: token-matched)
        else:
            r.s.cancel(ta, b"a")             # the owner invalidates a (DiskTier.forget: a tomb, token-matched)
        assert r.flush()
        assert sb not in r.s.slots.free, "b's slot (still referenced by b's record) was freed"
        for key in (b"c", b"d", b"e"):
            r.write(key)
        assert r.flush()
        rep, got = r.read(b"b", tb)
        assert rep.ok and got == _good(b"b"), f"b was lost: {rep}"
    finally:
        r.close()


# --------------------------------------------------------------------------- 2

def test_recovery_keeps_the_entry_whose_bytes_a_damaged_newer_record_claims(tmp_path: Path) -> None:
    """Two records on one slot at open: recovery removes the older one unread ("only a lost commit could do
    that").  A damaged slot field makes the same picture: b (newer) names a's slot.  a's bytes are intact
    and its record verifies against them; the newer record is the damaged one.  Recovery deletes a, a stored
    and flushed block, and keeps b, which fails its checksum at the first read."""
    path = tmp_path / "d"
    r = _Rig(path, slots=4)
    try:
        ta = r.write(b"a")
        r.write(b"b")
        assert r.flush()
        r.set_slot(b"b", r.slot_of(b"a"))    # damage: the newer record names the older's slot
    finally:
        r.close()
    r = _Rig(path, slots=4)
    try:
        assert any(e.key == b"a" for e in r.s.entries), "recovery dropped a, whose record and bytes are good"
        rep, got = r.read(b"a", ta)
        assert rep.ok and got == _good(b"a"), rep
    finally:
        r.close()


# --------------------------------------------------------------------------- 3

def test_removing_a_record_whose_slot_field_names_a_free_slot_never_gives_that_slot_to_two_writes(
        tmp_path: Path) -> None:
    """slots.py: "a slot is referenced by at most one committed entry".  A removal pushes the slot its record
    names onto the free heap without asking whether it is free already (``SlotFile._free_locked``): with a's
    slot field damaged to name a free slot, evicting a puts that slot on the heap twice, two later writes
    are both placed in it and both committed, and the first one's bytes -- reported stored and flushed --
    are gone (a's own slot meanwhile is never freed)."""
    r = _Rig(tmp_path / "d", slots=4)
    try:
        ta = r.write(b"a")
        r.write(b"b")
        assert r.flush()
        r.set_slot(b"a", 3)                  # damage: a's record names slot 3, which no entry uses
        r.s.submit_delete(ta, b"a")
        assert r.flush()
        tc = r.write(b"c")
        td = r.write(b"d")
        te = r.write(b"e")                   # slots 2, 3 and then the duplicate 3 (a's slot 0 never comes back)
        assert r.flush()
        slots = {k: r.slot_of(k) for k in (b"b", b"c", b"d", b"e")}
        assert len(set(slots.values())) == 4, f"two live entries share a slot: {slots}"
        for key, tok in ((b"c", tc), (b"d", td), (b"e", te)):
            rep, got = r.read(key, tok)
            assert rep.ok and got == _good(key), f"{key!r} was lost: {rep}"
    finally:
        r.close()


# --------------------------------------------------------------------------- the ordinary paths stay direct
@pytest.mark.parametrize("removal", ["evict", "invalidate", "rewrite"])
def test_an_ordinary_removal_frees_its_slot_without_a_scan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           removal: str) -> None:
    """A removal of an intact record frees the slot it names (its slot holds it: ``SlotFile.hold`` at the
    write), without the writer's full scan of the index that a damaged record costs."""
    from tiered_kv.disk.writer import Writer

    scans: list[int] = []
    real = Writer._reclaim
    monkeypatch.setattr(Writer, "_reclaim", lambda self, txn_id: (scans.append(1), real(self, txn_id))[1])
    r = _Rig(tmp_path / "d", slots=4)
    try:
        ta = r.write(b"a")
        assert r.flush()
        sa = r.slot_of(b"a")
        if removal == "evict":
            r.s.submit_delete(ta, b"a")
        elif removal == "invalidate":
            r.s.cancel(ta, b"a")
        else:
            r.write(b"a")                    # a new write of the key replaces the record
        assert r.flush() and r.flush()       # a second commit: the first one's frees are durable
        assert sa in r.s.slots.free and scans == [] and r.s.slots.double_frees == 0
    finally:
        r.close()


def test_a_slot_is_never_put_on_the_free_list_twice(tmp_path: Path) -> None:
    from tiered_kv.disk.slots import SlotFile

    f = SlotFile(tmp_path, ROW, 8, "none", 4)
    try:
        f.recovered({})
        s = f.alloc()
        f.give_back([s])
        f.give_back([s])
        f.dropped([s, 99], 1)
        assert sorted(f.free).count(s) == 1 and 99 not in f.free and f.double_frees == 3
        assert f.alloc() == s and f.alloc() != s
    finally:
        f.close()


def test_a_slot_the_scan_finds_waits_for_the_commit_that_dropped_its_record_to_be_durable(tmp_path: Path) -> None:
    """``durability="batch"``: the scan's slots (records dropped whose slot number was not trusted) are freed
    as the commit's other drops are, after a later commit -- freed at once, the next write could overwrite
    bytes an OS crash that rolls that commit back would point its record at again (invariant 12)."""
    from tiered_kv.disk.slots import SlotFile

    f = SlotFile(tmp_path, ROW, 8, "batch", 4)
    try:
        f.recovered({})
        a, b = f.alloc(), f.alloc()
        f.hold(a, b"a")
        f.hold(b, b"b")
        assert f.reclaim({b}, 5) == 1                 # a's record was dropped by commit 5, unnoted
        assert a not in f.free and (5, a) in f.freed_unsynced
        f.dropped([], 6)                              # commit 6: commit 5 is durable now
        assert a in f.free and b not in f.free
    finally:
        f.close()
