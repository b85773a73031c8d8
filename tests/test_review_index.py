"""Review of tiered_kv.core.index / tiered_kv.core.policy: ARC's ghost-hit mark must not outlive the
reservation it was made for (an aborted store, or a reservation that found no slot)."""

from __future__ import annotations

import uuid

from tiered_kv.core.index import Entry, TierIndex
from tiered_kv.core.policy import ARC


def _put(ix: TierIndex, key: bytes) -> Entry:
    e = ix.reserve(key, uuid.uuid4())
    assert e is not None
    assert ix.publish(e)
    return e


def test_arc_an_aborted_ghost_reservation_does_not_make_a_later_cold_insert_a_ghost_hit() -> None:
    """ARC.victim records a ghost key it adapted ``p`` for in ``adapted``; only ``insert`` clears it.
    When that reservation is aborted (or finds no slot), the mark stays: much later, after the key
    left the ghost lists, its next insert is taken for a ghost hit and goes to T2 (the frequency
    list) instead of T1."""
    ix = TierIndex(4, policy=ARC(4))
    pol = ix.policy
    assert isinstance(pol, ARC)
    for k in (b"a", b"b"):
        ix.touch(_put(ix, k))            # a, b in T2
    for k in (b"c", b"d", b"e"):
        _put(ix, k)                      # e evicts c: c in B1
    assert list(pol.b1) == [b"c"]
    e = ix.reserve(b"c", uuid.uuid4())  # a ghost hit: victim() adapts p, marks c
    assert e is not None
    ix.writer_done(e)
    ix.abort(e)                          # the store of c failed: c never inserted
    for i in range(12):
        _put(ix, b"x%d" % i)             # c long gone from the ghost lists
    assert b"c" not in pol.b1 and b"c" not in pol.b2
    ix.evict_ahead(1)                    # a free slot: insert() decides where c goes
    _put(ix, b"c")
    assert b"c" in pol.t1, (f"a key in neither ghost list entered T2: t1={list(pol.t1)} t2={list(pol.t2)} "
                            f"(stale adapted mark)")


def test_arc_a_ghost_reservation_that_finds_no_slot_leaves_no_mark() -> None:
    """A ghost key whose reservation finds nothing evictable (every entry protected) is not reserved:
    the mark victim() made for it goes, as an aborted store's does."""
    ix = TierIndex(4, policy=ARC(4))
    pol = ix.policy
    assert isinstance(pol, ARC)
    for k in (b"a", b"b"):
        ix.touch(_put(ix, k))
    for k in (b"c", b"d", b"e"):
        _put(ix, k)                      # e evicts c: c in B1
    assert list(pol.b1) == [b"c"]
    held = [b"a", b"b", b"d", b"e"]
    got, new, full = ix.reserve_absent([b"c"], uuid.uuid4(), held, None)
    assert (got, full) == ([], 1)
    assert b"c" not in pol.adapted
