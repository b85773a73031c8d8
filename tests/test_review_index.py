"""Review of tiered_kv.core.index / tiered_kv.core.policy: ARC's ghost-hit mark must not outlive the
reservation it was made for (an aborted store, or a reservation that found no slot); the admission
filter weighs a new key against the entry its reservation would evict, not a protected one."""

from __future__ import annotations

import uuid

from tiered_kv.core.index import Entry, TierIndex
from typing import Optional

import pytest

from tiered_kv.core.policy import ARC, LRU, S3FIFO, Admission, PrefixLRU, admission_victim
from tiered_kv.tools.tracetools import _Tier


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


class _Asked(Admission):
    """Admits every key and records the victim it was asked against."""

    def __init__(self) -> None:
        self.asked: list[tuple[bytes, Optional[bytes]]] = []

    def admit(self, key: bytes, victim: Optional[bytes]) -> bool:
        self.asked.append((key, victim))
        return True


def test_admission_is_asked_against_the_entry_the_reservation_evicts_not_a_protected_one() -> None:
    """A full tier whose coldest entry is one of the step's own keys (protected): the reservation
    evicts the next coldest, so that is the block TinyLFU must weigh the new key against."""
    adm = _Asked()
    ix = TierIndex(3, admission=adm)
    for k in (b"a", b"b", b"c"):
        _put(ix, k)                                   # LRU order: a (coldest), b, c
    got, new, full = ix.reserve_absent([b"n"], uuid.uuid4(), protect=[b"a", b"n"], elsewhere=None)
    assert got == [b"n"] and full == 0
    assert adm.asked[-1] == (b"n", b"b")              # b is what went, not a
    assert b"b" not in ix and b"a" in ix


def test_admission_victim_is_none_when_every_evictable_entry_is_protected() -> None:
    pol = LRU()
    ix = TierIndex(2, policy=pol)
    for k in (b"a", b"b"):
        _put(ix, k)
    assert admission_victim(pol, {b"a", b"b"}, b"n") is None
    assert admission_victim(pol, {b"a"}, b"n") == b"b"
    assert admission_victim(pol, (), b"n") == b"a"


@pytest.mark.parametrize("make", [LRU, lambda: S3FIFO(8), lambda: ARC(8), PrefixLRU])
def test_admission_victim_names_what_victim_then_evicts_and_changes_nothing(make) -> None:
    """For every policy: asking changes no order (the filter may refuse), and the key named is the one
    ``victim(protect, key)`` takes next when nothing else changed."""
    pol = make()
    ix = TierIndex(8, policy=pol)
    for i in range(8):
        _put(ix, b"k%d" % i)
    protect = {e.key for e in pol.coldest(3)}
    before = [e.key for e in pol.coldest(8)]
    named = admission_victim(pol, protect, b"new")
    assert [e.key for e in pol.coldest(8)] == before
    v = pol.victim(protect, b"new")
    assert v is not None and named == v.key


def test_the_trace_simulator_asks_admission_against_the_same_victim() -> None:
    tier = _Tier(3, "lru", "all")
    adm = _Asked()
    tier.admission, tier.admit_all = adm, False
    evicted: list = []
    for k in (b"a", b"b", b"c"):
        tier.publish([tier.reserve(k, set(), evicted)])
    tier.reserve(b"n", {b"a", b"n"}, evicted)
    assert adm.asked[-1] == (b"n", b"b")
    assert [e.key for e in evicted] == [b"b"]
