"""The slot of a dropped record whose header could not be parsed is found by a scan of the index and freed
(``Writer._reclaim``, ``SlotFile.reclaim``), and only that slot: never one a readable entry references, nor
one a commit dropped that is not yet durable (``durability="batch"``: free one commit later).

(``tests/test_review_suspicions.py`` proves the leak itself: four such deletes took a 4-slot file's slots.)
Deterministic: a DiskStore driven directly, its answers awaited by token (bounded waits only detect a hang).
"""

from __future__ import annotations

from pathlib import Path

from disk_helpers import ROW, StoreRig, WriterGate, content


def test_the_scan_frees_the_lost_slot_but_never_one_a_readable_entry_references(tmp_path: Path) -> None:
    """Two readable entries and one whose header breaks: once the reader's removal of the broken one is
    committed, its slot -- and no other -- is free again, and the writes that take it leave both readable
    entries' bytes intact."""
    r = StoreRig(tmp_path / "d", slots=4, durability="sync")
    try:
        ta, tb = r.write(b"a"), r.write(b"b")
        tx = r.write(b"x")
        lost = r.slot_of(b"x")
        kept = {r.slot_of(b"a"), r.slot_of(b"b")}
        r.break_header(b"x")
        rep, _ = r.read(b"x", tx)
        assert not rep.ok and rep.error.startswith("miss: corrupt")
        assert r.flush()                                  # the reader's removal committed, then the scan
        assert sorted(r.s.slots.free) == sorted({0, 1, 2, 3} - kept), (r.s.slots.free, kept, lost)
        assert r.s.slots_in_use == 2
        for key in (b"c", b"d"):                   # fill the file: the two free slots, one of them the lost one
            r.write(key)
        assert r.flush()
        for key, t in ((b"a", ta), (b"b", tb)):
            rep, dst = r.read(key, t)
            assert rep.ok and bytes(dst) == content(key, ROW).numpy().tobytes(), key
    finally:
        r.s.close()


def test_the_scan_leaves_a_slot_dropped_by_a_commit_not_yet_durable(tmp_path: Path) -> None:
    """``durability="batch"``: a slot whose entry a commit dropped is free only once a later commit is
    durable (so a crash never finds a committed entry over another write's bytes).  The scan after the
    removal of a broken record must leave waiting a slot its own commit dropped (the rewrite of ``a`` in
    the same batch), though no readable entry references that slot any more."""
    r = StoreRig(tmp_path / "d", slots=6, durability="batch")
    gate = WriterGate(block_from=1)
    try:
        r.write(b"a")
        tx = r.write(b"x")
        assert r.flush()
        old = r.slot_of(b"a")
        r.break_header(b"x")
        r.s.fault_hook = gate
        ty = r.submit(b"y")                        # the writer takes it and is held at its commit
        gate.entered(1)
        rep, _ = r.read(b"x", tx)                  # corrupt: the reader queued the record's removal first
        assert not rep.ok and rep.error.startswith("miss: corrupt")
        ta = r.submit(b"a")                        # a's rewrite, queued behind the removal: one batch
        gate.open()
        assert r.answer(ty).ok and r.answer(ta).ok
        waiting = {i for _, i in r.s.slots.freed_unsynced}
        assert old in waiting, "a's old slot was freed before a later commit made its drop durable"
        assert old not in r.s.slots.free
        assert r.slot_of(b"a") not in r.s.slots.free
    finally:
        gate.open()
        r.s.close()


def test_a_corrupt_record_whose_slot_field_names_a_live_entrys_slot_never_frees_that_slot(tmp_path: Path) -> None:
    """The checksum covers a record's header, namespace, key and payload, not its slot number: a damaged
    slot field that names another live entry's slot parses, and the read finds that entry's bytes (a
    checksum mismatch: corrupt).  The reader's removal must not free the slot the damaged field names --
    the live entry's: the next write would take it and overwrite that entry's bytes -- but the record's
    own slot, which only a scan can tell (no readable record names it)."""
    r = StoreRig(tmp_path / "d", slots=4, durability="sync")
    try:
        ta = r.write(b"a")
        tb = r.write(b"b")
        sa, sb = r.slot_of(b"a"), r.slot_of(b"b")
        r.set_slot(b"a", sb)                           # a's record now names b's slot; its checksum still parses
        assert r.slot_of(b"a") == sb
        rep, _ = r.read(b"a", ta)
        assert not rep.ok and rep.error.startswith("miss: corrupt"), rep
        assert r.flush()                                      # the reader's removal committed
        assert sb not in r.s.slots.free, "the slot of a live entry was freed by a corrupt record naming it"
        assert sa in r.s.slots.free, "the corrupt record's own slot was not freed"
        for key in (b"c", b"d", b"e"):                 # take every free slot
            r.write(key)
        assert r.flush()
        rep, dst = r.read(b"b", tb)
        assert rep.ok and bytes(dst) == content(b"b", ROW).numpy().tobytes(), "b's bytes were overwritten"
    finally:
        r.s.close()
