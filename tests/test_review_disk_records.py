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

from pathlib import Path

import pytest

from disk_helpers import ROW, StoreRig, content


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
    r = StoreRig(tmp_path / "d", slots=4)
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
    r = StoreRig(path, slots=4)
    try:
        ta = r.write(b"a")
        r.write(b"b")
        assert r.flush()
        r.set_slot(b"b", r.slot_of(b"a"))    # damage: the newer record names the older's slot
    finally:
        r.close()
    r = StoreRig(path, slots=4)
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
    r = StoreRig(tmp_path / "d", slots=4)
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
    r = StoreRig(tmp_path / "d", slots=4)
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
