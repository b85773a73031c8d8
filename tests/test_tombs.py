"""``Tombs`` on its own, on a real LMDB environment: each rule of its docstring, one transaction at a
time, with what it leaves in the ``blocks``, ``touch`` and ``tombs`` sub-databases and in its in-memory
sets.  The writer-level paths (a tomb queued in front of its spill, a cancel that races the batch)
are in ``tests/test_disk_integrity.py``; these pin the rules those paths rely on, including the ones
only a crash or another process reaches (a durable tomb with no in-memory cancel)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tiered_kv.disk.env import DiskEnv
from tiered_kv.disk.format import lmdb_key, pack_slot_entry
from tiered_kv.disk.tombs import Tombs, Undo

NS = b"tombs-test"
KEY = b"key-0"
OTHER = b"key-1"


def _token(i: int) -> uuid.UUID:
    return uuid.UUID(int=i + 1)


@pytest.fixture
def db(tmp_path: Any) -> Iterator[DiskEnv]:
    errors: list[tuple[str, str]] = []
    env = DiskEnv(tmp_path, NS, 64, "none", 0, 16, 1, lambda k, m: errors.append((k, m)))
    try:
        yield env
    finally:
        env.close()
        assert errors == []


def _write(db: DiskEnv, key: bytes, token: uuid.UUID, slot: int) -> None:
    """A committed entry of ``key`` written under ``token`` in ``slot``, with a touch record."""
    with db.env.begin(write=True) as txn:
        txn.put(lmdb_key(key), pack_slot_entry(NS, key, token, bytes(64), 1, slot), db=db.blocks)
        txn.put(lmdb_key(key), b"\0" * 8, db=db.touch)


def _write_garbage(db: DiskEnv, key: bytes) -> None:
    with db.env.begin(write=True) as txn:
        txn.put(lmdb_key(key), b"not a header", db=db.blocks)
        txn.put(lmdb_key(key), b"\0" * 8, db=db.touch)


def _contents(db: DiskEnv) -> dict[str, dict[bytes, bytes]]:
    with db.env.begin() as txn:
        return {name: {bytes(k): bytes(v) for k, v in txn.cursor(db=getattr(db, name))}
                for name in ("blocks", "touch", "tombs")}


def _run(db: DiskEnv, fn: Any) -> Any:
    with db.env.begin(write=True) as txn:
        return fn(txn)


# --------------------------------------------------------------------------- prevents
def test_a_durable_tomb_alone_prevents_its_spill_and_is_consumed(db: DiskEnv) -> None:
    """A tomb committed by an earlier process life (nothing cancelled in this one's memory) still
    prevents a spill under its token, and the tomb is gone once it did."""
    t = _token(0)
    _run(db, lambda txn: txn.put(t.bytes, KEY, db=db.tombs))
    tombs = Tombs(db)
    tombs.queued(t)
    undo: Undo = []
    assert _run(db, lambda txn: tombs.prevents(txn, t, undo)) is True
    assert _contents(db)["tombs"] == {}
    assert tombs.unsettled == set()


def test_prevents_lets_a_spill_without_a_tomb_through_and_settles_it(db: DiskEnv) -> None:
    t, other = _token(0), _token(1)
    _run(db, lambda txn: txn.put(other.bytes, OTHER, db=db.tombs))
    tombs = Tombs(db)
    tombs.queued(t)
    tombs.cancel(other)
    undo: Undo = []
    assert _run(db, lambda txn: tombs.prevents(txn, t, undo)) is False
    assert tombs.unsettled == set() and tombs.cancelled == {other}
    assert _contents(db)["tombs"] == {other.bytes: OTHER}, "another token's tomb is not consumed"


def _queued_then_cancelled(db: DiskEnv, t: uuid.UUID) -> Tombs:
    """Tombs of a spill under ``t`` that was queued, then cancelled by its owner."""
    tombs = Tombs(db)
    tombs.queued(t)
    tombs.cancel(t)
    return tombs


def test_prevents_in_an_aborted_transaction_is_undone(db: DiskEnv) -> None:
    t = _token(0)
    tombs = _queued_then_cancelled(db, t)
    undo: Undo = []
    _run(db, lambda txn: tombs.prevents(txn, t, undo))
    assert tombs.unsettled == set() and tombs.cancelled == set()
    tombs.undo(undo)
    assert tombs.unsettled == {t} and tombs.cancelled == {t} and undo == []


# --------------------------------------------------------------------------- apply (the tomb op)
def test_a_tomb_of_a_still_queued_write_is_made_durable_naming_its_key(db: DiskEnv) -> None:
    t = _token(0)
    tombs = _queued_then_cancelled(db, t)
    undo: Undo = []
    _run(db, lambda txn: tombs.apply(txn, t, KEY, [], undo))
    assert _contents(db)["tombs"] == {t.bytes: KEY}
    assert tombs.cancelled == {t}, "still cancelled in memory until its write is prevented"
    assert undo == []


def test_a_tomb_of_a_committed_write_deletes_it_with_its_touch_and_frees_its_slot(db: DiskEnv) -> None:
    t = _token(0)
    _write(db, KEY, t, slot=5)
    _write(db, OTHER, _token(1), slot=6)
    tombs = Tombs(db)
    tombs.cancel(t)
    frees: list[int] = []
    undo: Undo = []
    _run(db, lambda txn: tombs.apply(txn, t, KEY, frees, undo))
    c = _contents(db)
    assert set(c["blocks"]) == set(c["touch"]) == {lmdb_key(OTHER)}
    assert c["tombs"] == {} and frees == [5] and tombs.cancelled == set()
    assert undo == [(tombs.cancelled, t)]


def test_a_tomb_never_deletes_a_newer_write_of_its_key_but_drops_an_unparseable_record(db: DiskEnv) -> None:
    """A tomb deletes only its own write; a record whose header cannot be parsed (no write makes one, nothing
    can read it) it drops whatever its token, reporting it (True) so that the writer's scan frees its slot:
    kept, it would hold that slot, outside every count, until a reopen."""
    old, new = _token(0), _token(1)
    _write(db, KEY, new, slot=3)
    _write_garbage(db, OTHER)
    tombs = Tombs(db)
    tombs.cancel(old)
    tombs.cancel(_token(2))
    frees: list[int] = []
    undo: Undo = []
    lost: list[bool] = []
    _run(db, lambda txn: lost.append(tombs.apply(txn, old, KEY, frees, undo)))
    _run(db, lambda txn: lost.append(tombs.apply(txn, _token(2), OTHER, frees, undo)))
    c = _contents(db)
    assert set(c["blocks"]) == set(c["touch"]) == {lmdb_key(KEY)}
    assert c["tombs"] == {} and frees == [] and tombs.cancelled == set() and lost == [False, True]


def test_a_tomb_applied_in_an_aborted_transaction_is_cancelled_again_after_undo(db: DiskEnv) -> None:
    t = _token(0)
    tombs = Tombs(db)
    tombs.cancel(t)
    undo: Undo = []
    _run(db, lambda txn: tombs.apply(txn, t, KEY, [], undo))
    assert tombs.cancelled == set()
    tombs.undo(undo)
    assert tombs.cancelled == {t}


# --------------------------------------------------------------------------- delete_if_token (a reader's Delete)
@pytest.mark.parametrize("found_corrupt", [False, True])
def test_delete_if_token_drops_an_unparseable_record_whoever_asks(db: DiskEnv, found_corrupt: bool) -> None:
    """The owner's eviction or invalidation (a plain delete) as well as a reader's removal: its slot is left to
    the writer's scan (True), never noted from a header that cannot be read."""
    _write_garbage(db, KEY)
    tombs = Tombs(db)
    frees: list[int] = []
    lost: list[bool] = []
    _run(db, lambda txn: lost.append(tombs.delete_if_token(txn, KEY, _token(0), frees, found_corrupt=found_corrupt)))
    c = _contents(db)
    assert c["blocks"] == {} and c["touch"] == {} and frees == [] and lost == [True]


def test_delete_if_token_of_a_corrupt_read_drops_its_record_without_trusting_its_slot(db: DiskEnv) -> None:
    """A reader's removal (``found_corrupt``) of a parseable record of its token: dropped, its slot number
    not noted (the checksum does not cover it) but reported (True) for the writer's reclaim scan; a plain
    delete of the same record notes the slot instead."""
    t = _token(0)
    _write(db, KEY, t, slot=3)
    _write(db, OTHER, t, slot=5)
    tombs = Tombs(db)
    frees: list[int] = []
    lost = []
    _run(db, lambda txn: lost.append(tombs.delete_if_token(txn, KEY, t, frees, found_corrupt=True)))
    _run(db, lambda txn: lost.append(tombs.delete_if_token(txn, OTHER, t, frees)))
    c = _contents(db)
    assert c["blocks"] == {} and c["touch"] == {}
    assert lost == [True, False] and frees == [5]


def test_delete_if_token_removes_only_its_tokens_entry(db: DiskEnv) -> None:
    mine, theirs = _token(0), _token(1)
    _write(db, KEY, mine, slot=2)
    _write(db, OTHER, theirs, slot=4)
    tombs = Tombs(db)
    frees: list[int] = []
    _run(db, lambda txn: tombs.delete_if_token(txn, OTHER, mine, frees, found_corrupt=True))
    _run(db, lambda txn: tombs.delete_if_token(txn, b"absent", mine, frees))
    _run(db, lambda txn: tombs.delete_if_token(txn, KEY, mine, frees))
    c = _contents(db)
    assert set(c["blocks"]) == set(c["touch"]) == {lmdb_key(OTHER)} and frees == [2]


# --------------------------------------------------------------------------- forget / undo
def test_forget_settles_and_uncancels_failed_spills_only(db: DiskEnv) -> None:
    a, b, c = _token(0), _token(1), _token(2)
    tombs = Tombs(db)
    for t in (a, b, c):
        tombs.queued(t)
        tombs.cancel(t)
    tombs.forget(iter([a, b]))
    assert tombs.unsettled == {c} and tombs.cancelled == {c}


def test_undo_keeps_what_the_owner_added_meanwhile(db: DiskEnv) -> None:
    a, b = _token(0), _token(1)
    tombs = Tombs(db)
    tombs.queued(a)
    undo: Undo = []
    _run(db, lambda txn: tombs.prevents(txn, a, undo))
    tombs.cancel(b)
    tombs.undo(undo)
    tombs.undo(undo)   # a second undo of the same list changes nothing
    assert tombs.unsettled == {a} and tombs.cancelled == {b}
