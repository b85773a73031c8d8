"""``recover()`` on its own: a directory's index planted record by record, then what recovery keeps,
removes and counts.  Each kind of damage is planted twice, so a count that is set instead of added
to is caught; the reopen-level paths (a crash between the data sync and the commit, tombs across a
SIGKILL) are in ``tests/test_disk_integrity.py`` and ``tests/test_disk_crash.py``."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tiered_kv.disk.env import DiskEnv
from tiered_kv.disk.format import SLOTS_NAME, lmdb_key, pack_slot_entry, slot_bytes_for
from tiered_kv.disk.recovery import U64, recover
from tiered_kv.disk.slots import SlotFile

NS = b"recovery-test"
BLOCK = 64
FILE_SLOTS = 8          # the slot file holds slots 0..7


class Dir:
    def __init__(self, path: Path, durability: str = "none") -> None:
        self.path = path
        with open(path / SLOTS_NAME, "wb") as f:
            f.truncate(FILE_SLOTS * slot_bytes_for(BLOCK))
        self.db = DiskEnv(path, NS, BLOCK, durability, 0, 16, 1, self._error)
        self.slots = SlotFile(path, BLOCK, 16, durability, 4)
        self.errors: list[tuple[str, str]] = []

    def _error(self, kind: str, msg: str) -> None:
        self.errors.append((kind, msg))

    def put(self, key: bytes, slot: int, seq: int, token: Any = None, ns: bytes = NS, length: int = BLOCK) -> uuid.UUID:
        token = token or uuid.uuid4()
        with self.db.env.begin(write=True) as txn:
            txn.put(lmdb_key(key), pack_slot_entry(ns, key, token, bytes(length), seq, slot), db=self.db.blocks)
        return token

    def raw(self, sub: str, k: bytes, v: bytes) -> None:
        with self.db.env.begin(write=True) as txn:
            txn.put(k, v, db=getattr(self.db, sub))

    def keys(self, sub: str) -> set[bytes]:
        with self.db.env.begin() as txn:
            return {bytes(k) for k, _ in txn.cursor(db=getattr(self.db, sub))}

    def close(self) -> None:
        self.slots.close()
        self.db.close()


@pytest.fixture
def d(tmp_path: Path) -> Iterator[Dir]:
    dd = Dir(tmp_path)
    try:
        yield dd
    finally:
        dd.close()
        assert dd.errors == []


def test_recovery_removes_and_counts_each_kind_of_damage_and_keeps_the_rest(d: Dir) -> None:
    good = {b"good-%d" % i: d.put(b"good-%d" % i, slot=i, seq=10 + i) for i in range(2)}
    for i in range(2):
        d.raw("blocks", lmdb_key(b"garbage-%d" % i), b"no header here")           # unparseable
        d.put(b"past-end-%d" % i, slot=FILE_SLOTS + i, seq=20 + i)                 # slot past the file's end
        d.put(b"foreign-%d" % i, slot=6, seq=30 + i, ns=b"someone-else")           # another namespace
        d.put(b"short-%d" % i, slot=7, seq=40 + i, length=BLOCK // 2)              # another block length
    doomed = [uuid.uuid4(), uuid.uuid4()]
    for i, t in enumerate(doomed):
        d.put(b"tombed-%d" % i, slot=2 + i, seq=50 + i, token=t)                   # written under a tombstoned token
        d.raw("tombs", t.bytes, b"tombed-%d" % i)
    d.raw("tombs", uuid.uuid4().bytes, b"guards-nothing")
    entries, seq, rep = recover(d.db, d.slots, NS, BLOCK)
    assert [(e.key, e.token) for e in entries] == list(good.items())
    assert (rep.entries, rep.corrupt, rep.purged, rep.foreign, rep.tombs_dropped) == (2, 4, 2, 4, 3)
    assert seq == 11
    assert d.keys("blocks") == {lmdb_key(k) for k in good} and d.keys("tombs") == set()
    assert rep.slots_free == 16 - 2 and sorted(d.slots.free) == list(range(2, FILE_SLOTS))
    with d.db.env.begin() as txn:
        stored = json.loads(bytes(txn.get(b"last_recovery", db=d.db.meta)))
    assert (stored["entries"], stored["corrupt"], stored["purged"], stored["foreign"]) == (2, 4, 2, 4)


def test_of_two_records_on_one_slot_the_older_goes_and_the_scan_goes_on(d: Dir) -> None:
    """Two pairs of records share a slot (only a lost commit could do that).  Keys are named so that
    in each pair the scan meets the newer record first, then the older, then a record after both."""
    assert lmdb_key(b"a-new") < lmdb_key(b"b-old") < lmdb_key(b"c-after")
    d.put(b"a-new", slot=0, seq=9)
    d.put(b"b-old", slot=0, seq=3)
    d.put(b"c-after", slot=1, seq=4)
    d.put(b"d-old", slot=2, seq=5)
    d.put(b"e-new", slot=2, seq=6)
    d.put(b"f-after", slot=3, seq=7)
    entries, seq, rep = recover(d.db, d.slots, NS, BLOCK)
    assert [e.key for e in entries] == [b"c-after", b"e-new", b"f-after", b"a-new"]
    assert rep.corrupt == 2 and rep.entries == 4 and seq == 9
    assert d.keys("blocks") == {lmdb_key(k) for k in (b"a-new", b"c-after", b"e-new", b"f-after")}


def test_a_touch_newer_than_the_write_orders_the_entries_and_dead_touches_go(d: Dir) -> None:
    assert lmdb_key(b"a-bad") < lmdb_key(b"gone") < lmdb_key(b"k0")
    d.put(b"k0", slot=0, seq=1)
    d.put(b"k1", slot=1, seq=2)
    d.raw("touch", lmdb_key(b"k0"), U64.pack(7))       # k0 was read back after k1 was written
    d.raw("touch", lmdb_key(b"k1"), U64.pack(1))       # older than its write: the write counts
    d.raw("touch", lmdb_key(b"gone"), U64.pack(9))     # no entry: dropped, but its sequence is seen
    d.raw("touch", lmdb_key(b"a-bad"), b"bad")         # damaged: dropped (and the scan goes on past it)
    entries, seq, _ = recover(d.db, d.slots, NS, BLOCK)
    assert [(e.key, e.seq) for e in entries] == [(b"k1", 2), (b"k0", 7)]
    assert seq == 9
    assert d.keys("touch") == {lmdb_key(b"k0"), lmdb_key(b"k1")}


def test_an_empty_directory_recovers_to_nothing(d: Dir) -> None:
    entries, seq, rep = recover(d.db, d.slots, NS, BLOCK)
    assert entries == [] and seq == 0 and rep.entries == 0 and rep.slots_free == 16
    assert os.path.getsize(d.path / SLOTS_NAME) == FILE_SLOTS * slot_bytes_for(BLOCK)


class SyncSpy:
    """The environment, with its ``sync`` calls recorded (DiskEnv reads ``env`` on each use)."""

    def __init__(self, env: Any) -> None:
        self._env = env
        self.syncs = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    def sync(self, force: bool = False) -> None:
        self.syncs += 1
        self._env.sync(force)


@pytest.mark.parametrize("durability,syncs", [("none", 0), ("batch", 1), ("sync", 1)])
def test_recovery_is_made_durable_unless_durability_is_none(tmp_path: Path, durability: str, syncs: int) -> None:
    dd = Dir(tmp_path, durability)
    try:
        dd.put(b"k0", slot=0, seq=1)
        spy = SyncSpy(dd.db.env)
        dd.db.env = spy
        before = time.perf_counter()
        entries, _, rep = recover(dd.db, dd.slots, NS, BLOCK)
        took = time.perf_counter() - before
        dd.db.env = spy._env
        assert len(entries) == 1 and spy.syncs == syncs
        assert 0 <= rep.seconds <= took, "the report's duration is the recovery's own"
    finally:
        dd.close()
