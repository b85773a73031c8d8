"""Second adversarial review of the disk tier's write side and its recovery: writer.py (batches,
failures and back-off, map growth), slots.py, format.py, tombs.py, recovery.py, store.py, env.py.

What it proved wrong, each pinned by a test that failed before its fix (all fixed):

1. A tier whose LMDB map grew cannot be reopened once recovery has anything to remove: DiskEnv opens
   an existing environment with a map of max(configured, data.mdb's size), i.e. exactly full, and
   recovery's write transaction (dropping records past a truncated slot file, foreign or unparsable
   records) fails with MDB_MAP_FULL.  DiskStore raises "damaged", the manager runs host-only, and
   every later open fails the same way: every good entry is lost with the few bad ones.
2. Touches are kept queued by every failed batch (architecture.md: "keeps its tombs, deletes and
   touches queued"), one per promote, with no bound: while every commit fails (a disk remounted
   read-only, EIO) and reads still work, the writer's op queue grows by one op per promote for as
   long as the fault lasts ("Queues are bounded").
3. The back-off after a failed batch is cut short by any op queued meanwhile: ``_batch_failed`` waits
   on the same condition that ``_wake_writer`` notifies for every spill, so with a steady stream of
   spills a failing disk is retried once per op, not after 10 ms .. 1 s.
4. With the writer thread dead (durability any, disk_io="thread"), an invalidation's tomb is dropped
   by ``Writer.push`` (not accepting) and nothing else records it: the key invalidated after the
   death is served again after the next open.
5. ``DiskStore.close()`` lets the writer exit before the readers have finished: a corrupt entry found
   by a read that close() itself started is never removed (its Delete lands on a writer that is gone),
   so the next open indexes it again and its slot stays taken.
6. ``Writer.tombstones`` (the ``tiered_kv_disk_tombstones`` gauge) is set inside the write
   transaction, before it commits: a commit that fails leaves the gauge at the count of a transaction
   that never happened.

Checked and found to hold (plain tests below guard what no other test file covers):

* a record whose slot number (outside the checksum) is redirected to a slot holding an older
  write of the same key is a corrupt miss, never the stale bytes;
* a tier whose map grew past its configured size reopens (no damage) with every entry and takes new
  spills (the first batch grows the map ahead).
"""

from __future__ import annotations

import errno
import hashlib
import os
import struct
import threading
import time
import types
import uuid
from pathlib import Path
from typing import Any, Optional

import pytest

import tiered_kv.disk.writer as writer_mod
from test_disk_writer_regressions import Store as RegressionStore
from disk_helpers import (NS, ROW, Rig, WriterGate, make_kv, raw_env, raw_index, rig, store_one,  # noqa: F401
                          store_seq)
from tiered_kv.disk import DiskOptions, DiskStore, FlushDone
from tiered_kv.disk.format import SLOTS_NAME, lmdb_key, parse_header, slot_bytes_for
from tiered_kv.disk.records import CORRUPT, Touch
from tiered_kv.errors import DiskTierError
from tiered_kv.movers import CompletionQueue

__all__ = ["rig"]


class _WriterKilled(BaseException):
    """Not an Exception: the writer thread dies of it."""


def _payload(tag: bytes) -> bytearray:
    return bytearray(hashlib.shake_128(b"review-writer:" + tag).digest(ROW))


class _Store(RegressionStore):
    """test_disk_writer_regressions' store (every answer collected by token), 64 slots and batches of 4 by
    default, its spills tagged."""

    def __init__(self, path: Path, *, slots: int = 64, batch_blocks: int = 4, **opts: Any) -> None:
        opts.setdefault("batch_bytes", batch_blocks * ROW)
        super().__init__(path, slots=slots, batch_blocks=batch_blocks, **opts)

    def spill(self, key: bytes, tag: Optional[bytes] = None) -> uuid.UUID:   # type: ignore[override]
        tok = uuid.uuid4()
        buf = _payload(tag or key)
        self.bufs.append(buf)
        assert self.s.submit_spill(tok, key, memoryview(buf)), "spill refused"
        return tok

    def read(self, key: bytes, expect: uuid.UUID) -> tuple[Any, bytes]:
        dst = bytearray(ROW)
        tok = uuid.uuid4()
        self.s.queue_promote(tok, key, expect, memoryview(dst))
        self.s.start_reads()
        return self.answer(tok), bytes(dst)

    def close(self) -> None:
        self.s.close()


def _long_key(i: int) -> bytes:
    return b"key-%06d-" % i + b"x" * 300   # index records of ~400 bytes: a small map fills soon


# ============================================================================ finding 1
def test_a_tier_whose_map_grew_reopens_when_recovery_must_drop_records(tmp_path: Path) -> None:
    """Invariant 8 (recovery removes records whose slot lies past the slot file's end, and serves the
    rest) and the map's growth ("disk_map_size_bytes: initial LMDB map size").  The map grows while
    the tier fills; the slot file then loses its tail.  Reopening must drop the records past the end
    and keep the others -- not refuse the whole directory because the reopened map is exactly as
    large as data.mdb and recovery's transaction finds no page to write."""
    path = tmp_path / "d"
    n, keep = 200, 100
    st = _Store(path, slots=400, batch_blocks=64, map_size_bytes=64 << 10, queue_blocks=512)
    try:
        toks = [st.spill(_long_key(i), b"%d" % i) for i in range(n)]
        assert all(st.answer(t).ok for t in toks) and st.flush()
        assert st.s.map_size > 64 << 10, "the map did not grow: the test needs a grown map"
        slots = {parse_header(v).key: parse_header(v).slot for v in raw_index_live(st)}
    finally:
        st.close()
    assert sorted(slots.values()) == list(range(n))
    os.truncate(path / SLOTS_NAME, keep * slot_bytes_for(ROW))     # the slot file lost its tail
    try:
        st2 = _Store(path, slots=400, batch_blocks=64, map_size_bytes=64 << 10, queue_blocks=512)
    except DiskTierError as exc:
        pytest.fail(f"the tier no longer opens: {exc}")
    try:
        assert st2.s.recovery.corrupt == n - keep and st2.s.recovery.entries == keep
        k0 = next(k for k, s in slots.items() if s == 0)
        r, got = st2.read(k0, next(e.token for e in st2.s.entries if e.key == k0))
        assert r.ok and got == bytes(_payload(b"0"))
    finally:
        st2.close()


def raw_index_live(st: _Store) -> list[bytes]:
    """Every index record, read through the open store's own environment."""
    env = st.s.db.env
    st.s.db.rw.acquire_shared()
    try:
        with env.begin(db=st.s.db.blocks) as txn:
            return [bytes(v) for _, v in txn.cursor()]
    finally:
        st.s.db.rw.release_shared()


# ============================================================================ finding 2
def test_touches_queued_while_every_commit_fails_stay_bounded(tmp_path: Path, monkeypatch) -> None:
    """DESIGN: "Queues are bounded".  A promote queues a touch (recency only; architecture.md: a crash
    may lose them).  With the disk remounted read-only every commit fails while reads still work, and
    each failed batch puts its touches back at the head of the queue: 20 batches' worth of promotes
    stay queued however many attempts pass.  Bounded would mean: no more than the spill queue's
    bound once the writer has had a try at each of them."""
    monkeypatch.setattr(writer_mod, "BACKOFF_MIN_S", 0.0005)
    monkeypatch.setattr(writer_mod, "BACKOFF_MAX_S", 0.0005)
    st = _Store(tmp_path / "d", batch_blocks=4, queue_blocks=8)
    w = st.s.writer
    promotes = 20 * 4
    gate = WriterGate(block_from=None, raise_at={i: OSError(errno.EROFS, "Read-only file system")
                                                 for i in range(1, 2000)})
    st.s.fault_hook = gate
    try:
        for i in range(promotes):
            st.s.submit_touch(b"k%d" % i)              # what DiskTier.promote_applied queues per promote
        st.s.submit_delete(uuid.uuid4(), b"evicted")   # an eviction: wakes the writer (touches wake no one)
        gate.entered(promotes + 20)                    # far more attempts than batches queued
        with w._cond:
            touches = sum(1 for op in w._ops if isinstance(op, Touch))
        assert touches <= st.opts.queue_blocks, \
            f"{touches} touches still queued after {gate.calls} failed commits (bound {st.opts.queue_blocks})"
    finally:
        gate.raise_at.clear()
        st.close()


# ============================================================================ finding 3
class _SpyCondition(threading.Condition):
    """A Condition that records when the first wait longer than ``watch`` s begins (the back-off's:
    the writer's other waits are ``IDLE_WAKE_S`` = 1 s or shorter)."""

    watch = -1.0
    began: Optional[float] = None
    waiting = threading.Event()

    def wait(self, timeout: Optional[float] = None) -> bool:
        if timeout is not None and timeout > type(self).watch and type(self).began is None:
            type(self).began = time.monotonic()
            type(self).waiting.set()
        return super().wait(timeout)


def test_a_spill_queued_during_the_back_off_does_not_cut_it_short(tmp_path: Path, monkeypatch) -> None:
    """architecture.md: a failed batch's kept ops are "retried with a back-off from 10 ms to 1 s";
    writer.py: "so a persistent fault does not spin".  ``_wake_writer`` notifies the writer's condition
    for each spill (it "waits for work"), and ``_batch_failed`` waits on that same condition: a spill
    queued during the back-off starts the next attempt at once."""
    backoff = 2.0
    monkeypatch.setattr(writer_mod, "BACKOFF_MIN_S", backoff)
    monkeypatch.setattr(writer_mod, "BACKOFF_MAX_S", backoff)

    class Spy(_SpyCondition):
        watch = 0.75 * backoff
        began = None
        waiting = threading.Event()

    monkeypatch.setattr(writer_mod, "threading", types.SimpleNamespace(
        Condition=Spy, Lock=threading.Lock, Thread=threading.Thread, Event=threading.Event))
    st = _Store(tmp_path / "d", batch_blocks=1)
    attempts: list[float] = []
    failing = {"left": 2}

    def hook(point: str) -> None:
        attempts.append(time.monotonic())
        if failing["left"]:
            failing["left"] -= 1
            raise OSError(errno.EIO, "Input/output error")

    st.s.fault_hook = hook
    try:
        assert not st.answer(st.spill(b"a")).ok          # attempt 1 fails: the back-off begins
        assert Spy.waiting.wait(30)
        second = st.spill(b"b")                          # queued while the writer backs off
        assert not st.answer(second, timeout=30).ok      # attempt 2 (fails too)
        waited = attempts[1] - Spy.began
        assert waited >= 0.9 * backoff, f"the writer retried {waited:.3f} s into a {backoff} s back-off"
    finally:
        st.close()


# ============================================================================ finding 4
@pytest.mark.disk_threads
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_key_invalidated_after_the_writer_died_does_not_come_back(rig: Rig) -> None:
    """DESIGN: a cancelled/invalidated key never comes back; architecture.md invariant 11: a dead writer
    fails its ops and the tier sheds spills, "reads still work".  The disk I/O process gets this right
    (a restart deletes what the index no longer holds); the thread writer drops the tomb in
    ``Writer.push`` and close() does nothing about it."""
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=2, disk_slots=64)
    store_seq(mgr, kv, [b"A", b"B", b"C"])                   # A on disk only, durable
    assert mgr.lookup([b"A"]) == 1
    gate = rig.gate(mgr, block_from=None, raise_at={1: _WriterKilled("writer killed")})
    store_one(mgr, kv, b"D", 3, flush=False)                # its batch kills the writer
    t0 = time.monotonic()
    while mgr.disk.writer_alive() and time.monotonic() - t0 < 30:
        mgr.wait(timeout=0.05)
    assert not mgr.disk.writer_alive()
    mgr.invalidate(b"A")
    assert mgr.lookup([b"A"]) == 0
    gate.open()
    rig.close(mgr)
    mgr = rig.open(kv, host_slots=2, disk_slots=64)
    assert mgr.lookup([b"A"]) == 0, "a key invalidated while the writer was dead is back after a reopen"


# ============================================================================ finding 5
def test_a_corrupt_entry_found_by_a_read_during_close_is_removed(tmp_path: Path) -> None:
    """readers.py: a read that finds its entry corrupt "also queues the entry's removal with the
    writer"; store.py: close() "drains the writer and the readers".  close() begins the writer's close
    before it stops the readers, so the writer may be gone when a read it let run finds the damage.
    Forced here: the reader's corrupt callback waits until the writer thread has ended."""
    holder: dict[str, Any] = {}

    def on_corrupt(reason: str) -> None:
        holder["reason"] = reason
        w = holder["st"].s.writer
        if w._closed:                 # close() began the writer's close before this read ended:
            w._thread.join(10)        # the read finishes only after the writer is gone

    path = tmp_path / "d"
    st = _Store(path, on_corrupt=on_corrupt)
    holder["st"] = st
    tok = st.spill(b"k")
    assert st.answer(tok).ok and st.flush()
    h = parse_header(raw_index_live(st)[0])
    fd = os.open(path / SLOTS_NAME, os.O_RDWR)
    try:
        at = h.slot * slot_bytes_for(ROW) + 100
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x5A]), at)
    finally:
        os.close(fd)
    dst = bytearray(ROW)
    rtok = uuid.uuid4()
    st.s.queue_promote(rtok, b"k", tok, memoryview(dst))   # held: close() hands it to the readers
    st.close()
    r = st.answer(rtok)
    assert not r.ok and r.error.startswith(CORRUPT) and holder["reason"] == "checksum"
    assert lmdb_key(b"k") not in raw_index(path), "the corrupt entry is still indexed after close()"


# ============================================================================ finding 6
class _FailingCommits:
    """The store's environment, with every write transaction aborted at its commit (EIO) while on."""

    def __init__(self, env: Any) -> None:
        self._env = env
        self.on = False

    def begin(self, *a: Any, **kw: Any) -> Any:
        txn = self._env.begin(*a, **kw)
        if not (kw.get("write") and self.on):
            return txn
        outer = self

        class Ctx:
            def __enter__(self) -> Any:
                return txn.__enter__()

            def __exit__(self, et: Any, ev: Any, tb: Any) -> bool:
                txn.abort()
                if et is None and outer.on:
                    raise OSError(errno.EIO, "Input/output error")
                return False
        return Ctx()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


def test_the_tombstone_gauge_counts_only_committed_tombs(tmp_path: Path) -> None:
    """``DiskStore.tombstones``: "Durable tombs in the tombs sub-database after the last commit".  A tomb
    of a spill still queued is written durably; when that transaction's commit fails, no tomb exists
    on disk, yet the gauge says one does (until some later commit succeeds)."""
    st = _Store(tmp_path / "d", batch_blocks=1)
    gate = WriterGate(block_from=1)
    st.s.fault_hook = gate
    env = _FailingCommits(st.s.db.env)
    st.s.db.env = env
    try:
        a = st.spill(b"a")
        gate.entered(1)                          # the writer holds spill a's batch
        t = st.spill(b"t")                       # queued behind it
        st.s.cancel(t, b"t")                     # tomb of a queued spill: made durable by its batch
        gate.step(1)
        assert st.answer(a).ok                   # batch 1 committed
        gate.entered(2)                          # the writer holds the tomb's batch
        env.on = True                            # ... whose commit fails
        gate.step(1)
        gate.entered(3)                          # the failure was handled: the tomb is queued again
        env.on = False
        with raw_lock(st):
            with env._env.begin() as txn:
                on_disk = txn.stat(st.s.db.tombs)["entries"]
        assert on_disk == 0
        assert st.s.tombstones == on_disk, f"gauge says {st.s.tombstones} durable tombs, the disk holds {on_disk}"
    finally:
        st.s.db.env = env._env
        gate.open()
        st.close()


class raw_lock:
    def __init__(self, st: _Store) -> None:
        self.rw = st.s.db.rw

    def __enter__(self) -> None:
        self.rw.acquire_shared()

    def __exit__(self, *a: Any) -> None:
        self.rw.release_shared()


# ============================================================================ held
def test_a_slot_number_redirected_to_an_older_write_of_the_key_is_a_miss_not_stale_bytes(tmp_path: Path) -> None:
    """format.py: the checksum covers the header's fixed fields (token, seq, length), namespace, key and
    payload -- not the slot number stored after it.  A record whose slot number is damaged to point at
    the slot still holding an older write of the same key (its bytes intact, no other record on it)
    must fail verification: serving it would be a stale version, i.e. wrong bytes."""
    path = tmp_path / "d"
    st = _Store(path, durability="sync", batch_blocks=1)
    try:
        old = st.spill(b"k", b"v1")
        assert st.answer(old).ok
        new = st.spill(b"k", b"v2")                    # replaces it; v1's slot is free, its bytes stay
        assert st.answer(new).ok and st.flush()
        h = parse_header(raw_index_live(st)[0])
        assert h.token == new
        r, got = st.read(b"k", new)                    # undamaged: served, v2's bytes
        assert r.ok and got == bytes(_payload(b"v2"))
    finally:
        st.close()
    old_slot = 1 - h.slot
    data = (path / SLOTS_NAME).read_bytes()
    sb = slot_bytes_for(ROW)
    assert data[old_slot * sb:old_slot * sb + ROW] == bytes(_payload(b"v1")), "v1's bytes are still there"
    with raw_env(path, write=True) as (env, dbs):
        with env.begin(write=True, db=dbs["blocks"]) as txn:
            v = bytearray(txn.get(lmdb_key(b"k")))
            struct.pack_into("<Q", v, len(v) - 8, old_slot)
            txn.put(lmdb_key(b"k"), bytes(v))
    st = _Store(path, durability="sync", batch_blocks=1)
    try:
        assert st.s.recovery.entries == 1 and st.s.recovery.corrupt == 0
        r, got = st.read(b"k", new)
        assert not r.ok and r.error.startswith(CORRUPT), r
    finally:
        st.close()
    assert lmdb_key(b"k") not in raw_index(path), "the damaged record was removed"


def test_a_tier_whose_map_grew_reopens_whole_and_grows_again_for_new_spills(tmp_path: Path) -> None:
    """env.py: an existing environment is opened with a map of at least data.mdb's size (never smaller
    than what it holds), and the first batch after the reopen grows the map ahead when it is full:
    every entry survives and new spills commit."""
    path = tmp_path / "d"
    kw: dict[str, Any] = dict(slots=400, batch_blocks=64, map_size_bytes=64 << 10, queue_blocks=512)
    st = _Store(path, **kw)
    try:
        toks = {_long_key(i): st.spill(_long_key(i), b"%d" % i) for i in range(150)}
        assert all(st.answer(t).ok for t in toks.values()) and st.flush()
        grown = st.s.map_size
        assert grown > 64 << 10
    finally:
        st.close()
    st = _Store(path, **kw)
    try:
        assert st.s.recovery.entries == 150 and st.s.recovery.corrupt == 0
        assert {e.key: e.token for e in st.s.entries} == toks
        more = [st.spill(_long_key(1000 + i), b"m%d" % i) for i in range(100)]
        assert all(st.answer(t).ok for t in more) and st.flush()
        for i in (0, 149):
            r, got = st.read(_long_key(i), toks[_long_key(i)])
            assert r.ok and got == bytes(_payload(b"%d" % i))
        r, got = st.read(_long_key(1099), more[-1])
        assert r.ok and got == bytes(_payload(b"m99"))
    finally:
        st.close()
