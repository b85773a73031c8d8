"""Regressions: six disk-tier bugs found by an adversarial review of disk.py / disktier.py (2026-12-01).

Each docstring names the invariant and tells the bug as it was; each test asserts the contract and
failed before its fix: an aborted transaction's tomb state rolled back (1, 1b), map growth faults
failing the batch (2), corrupt reads removed token-matched without a re-read (3, 6), bounded retries
once closing (4), flush() counting spill failures it applies (5).  Every test forces its
interleaving deterministically (writer gates, a wrapped LMDB environment, patched I/O, events);
no sleeps for ordering.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import lmdb
import pytest

import tiered_kv.disk.env as disk_mod
import tiered_kv.disk.readers as readers_mod
import tiered_kv.disk.writer as writer_mod
from disk_helpers import (NS, ROW, WriterGate, content, drain, fail_first_batch, make_kv, rig, store_one,  # noqa: F401
                          store_seq)
from tiered_kv.disk import DiskOptions, DiskStore, FlushDone
from tiered_kv.disk.format import lmdb_key, parse_header
from tiered_kv.movers import CompletionQueue

# the writer's own hooks and internals: the in-process threads (tests/test_disk_process.py has the process)
pytestmark = pytest.mark.disk_threads

__all__ = ["rig"]


# ============================================================================ helpers
def payload(key: bytes) -> bytearray:
    return bytearray(content(key, ROW).numpy().tobytes())


class SyncSpy:
    """Stands in for a store's LMDB environment: every attribute is the environment's, and each
    ``sync`` is passed on, its ``force`` argument recorded and ``synced`` set."""

    def __init__(self, env: Any) -> None:
        self._env = env
        self.forced: list[Any] = []
        self.synced = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    def sync(self, force: bool = False) -> None:
        self._env.sync(force)
        self.forced.append(force)
        self.synced.set()


@contextlib.contextmanager
def sync_spy(st: "Store") -> Iterator[SyncSpy]:
    """A :class:`SyncSpy` in place of ``st``'s environment for the block; the environment is back after."""
    env = st.s.db.env
    spy = st.s.db.env = SyncSpy(env)
    try:
        yield spy
    finally:
        st.s.db.env = env


class Store:
    """A DiskStore on ``path`` with every answer collected by token (answers kept for later asks)."""

    def __init__(self, path: Path, *, durability: str = "batch", num_readers: int = 1, slots: int = 16,
                 on_corrupt: Optional[Callable[[str], None]] = None, **opts: Any) -> None:
        self.q = CompletionQueue()
        self.errors: list[str] = []
        self.messages: list[str] = []
        batch_blocks = opts.pop("batch_blocks", 16)
        self.opts = DiskOptions(path=path, namespace=NS, block_bytes=ROW, capacity_bytes=slots * ROW,
                                durability=durability, batch_blocks=batch_blocks,
                                batch_bytes=opts.pop("batch_bytes", 16 * ROW),
                                batch_seconds=opts.pop("batch_seconds", 0.0), slots=slots,
                                num_readers=num_readers, **opts)
        kw: dict[str, Any] = {} if on_corrupt is None else {"on_corrupt": on_corrupt}
        self.s = DiskStore(self.opts, self.q, on_error=self._on_error, **kw)
        self.seen: dict[uuid.UUID, Any] = {}
        self.bufs: list[bytearray] = []   # host slots stay alive while the writer reads them

    def _on_error(self, kind: str, msg: str) -> None:
        self.errors.append(kind)
        self.messages.append(msg)

    def spill(self, key: bytes, token: Optional[uuid.UUID] = None) -> uuid.UUID:
        tok = token or uuid.uuid4()
        buf = payload(key)
        self.bufs.append(buf)
        assert self.s.submit_spill(tok, key, memoryview(buf)), "spill refused"
        return tok

    def answer(self, token: uuid.UUID, timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        while token not in self.seen:
            item = self.q.get(max(0.0, deadline - time.monotonic()))
            assert item is not None, f"no answer for {token} within {timeout} s"
            self.seen[item.token] = item
        return self.seen.pop(token)

    def flush(self) -> bool:
        tok = uuid.uuid4()
        self.s.submit_flush(tok)
        r = self.answer(tok)
        assert isinstance(r, FlushDone)
        assert (r.error is None) if r.ok else bool(r.error), r   # a failed flush says why; a good one has no error
        return r.ok

    def index(self) -> dict[bytes, Any]:
        """Block key -> header of every committed entry (through the store's own environment)."""
        env = self.s.db.env
        self.s.db.rw.acquire_shared()
        try:
            with env.begin(db=self.s.db.blocks) as txn:
                return {parse_header(v).key: parse_header(v) for _, v in txn.cursor()}
        finally:
            self.s.db.rw.release_shared()

    def read_damaged(self, key: bytes, damage: Callable[[bytearray], bytes]) -> uuid.UUID:
        """Spill ``key`` durably, ``damage`` its index record, read it back: a corrupt miss.  Returns the
        spill's token."""
        t = self.spill(key)
        assert self.answer(t).ok and self.flush()
        self.rewrite_record(key, damage)
        p = uuid.uuid4()
        self.s.queue_promote(p, key, t, memoryview(bytearray(ROW)))
        self.s.start_reads()
        r = self.answer(p)
        assert not r.ok and r.error.startswith("miss: corrupt")
        return t

    def rewrite_record(self, key: bytes, fn: Callable[[bytearray], bytes]) -> None:
        """Replace ``key``'s index record in place (models a bit flip in a data.mdb page)."""
        self.s.db.rw.acquire_shared()
        try:
            with self.s.db.env.begin(write=True, db=self.s.db.blocks) as txn:
                lk = lmdb_key(key)
                txn.put(lk, fn(bytearray(txn.get(lk))))
        finally:
            self.s.db.rw.release_shared()


@pytest.fixture
def stores(tmp_path: Path):
    made: list[Store] = []
    cleanups: list[Callable[[], None]] = []

    def make(name: str = "d", **kw: Any) -> Store:
        st = Store(tmp_path / name, **kw)
        made.append(st)
        return st

    make.cleanups = cleanups  # type: ignore[attr-defined]
    yield make
    for fn in cleanups:
        fn()
    for st in made:
        st.s.fault_hook = None
        st.s.close()


class _TxnProxy:
    def __init__(self, txn: Any, env: "EnvProxy") -> None:
        self._txn = txn
        self._envp = env

    def __enter__(self) -> "_TxnProxy":
        self._txn.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        if exc[0] is None and self._envp.fail_commit:
            self._envp.fail_commit = False
            self._txn.abort()            # the commit fails: nothing of this transaction is kept
            raise lmdb.MapFullError("mdb_txn_commit: MDB_MAP_FULL: Environment mapsize limit reached")
        return self._txn.__exit__(*exc)

    def replace(self, key: Any, value: Any, db: Any = None) -> Any:
        self._envp.before_replace(bytes(key))
        return self._txn.replace(key, value, db=db)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)


class EnvProxy:
    """Wraps the store's lmdb.Environment: ``map_full_on`` makes the first ``replace`` of that LMDB key
    raise MapFullError (what LMDB raises when a batch's records do not fit); ``set_mapsize_error``
    makes growing the map fail."""

    def __init__(self, env: Any, map_full_on: Optional[bytes] = None,
                 set_mapsize_error: Optional[BaseException] = None) -> None:
        self._env = env
        self.map_full_on = map_full_on
        self.set_mapsize_error = set_mapsize_error
        self.fail_commit = False     # the next write transaction's commit raises MapFullError
        self.raised = 0

    def before_replace(self, lk: bytes) -> None:
        if self.map_full_on is not None and lk == self.map_full_on:
            self.map_full_on = None
            self.raised += 1
            raise lmdb.MapFullError("mdb_put: MDB_MAP_FULL: Environment mapsize limit reached")

    def begin(self, *a: Any, **kw: Any) -> Any:
        txn = self._env.begin(*a, **kw)
        return _TxnProxy(txn, self) if kw.get("write") else txn

    def set_mapsize(self, n: int) -> None:
        if self.set_mapsize_error is not None:
            raise self.set_mapsize_error
        self._env.set_mapsize(n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


# ============================================================================ 1. MapFullError retry
def test_a_map_full_retry_does_not_publish_a_spill_cancelled_ahead_of_it_in_its_batch(stores):
    """Invariant 7 (a cancelled write is never published; an invalidated key is gone after flush()
    and after reopen).  Batch = [Tomb(T), Spill(T), Spill(X)].  Attempt 1 of the transaction writes
    the durable tomb, prevents Spill(T) -- and, as side effects outside the transaction, drops T
    from ``_unsettled`` and ``_cancelled`` -- then MapFullError on X aborts it.  The retry finds T
    neither settled-pending nor cancelled: the tomb is discarded and Spill(T) is published."""
    st = stores()
    gate = WriterGate(block_from=1)
    st.s.fault_hook = gate
    st.s.db.env = EnvProxy(st.s.db.env, map_full_on=lmdb_key(b"x"))
    t0 = st.spill(b"first")
    gate.entered(1)                          # the writer holds batch 1 = [Spill(first)]
    t = st.spill(b"k")
    st.s.cancel(t, b"k")                     # queued ahead of Spill(k): [Tomb(t), Spill(t)]
    tx = st.spill(b"x")
    gate.open()
    assert st.answer(t0).ok
    r = st.answer(t)
    assert st.answer(tx).ok
    assert st.s.db.env.raised == 1, "the MapFullError was not injected"
    assert st.flush() is True
    committed = b"k" in st.index()
    st.s.close()
    again = stores("d")
    reopened = b"k" in {e.key for e in again.s.entries}
    assert (committed, reopened, r.ok) == (False, False, False), (
        f"cancelled spill: committed after flush()={committed}, present after reopen={reopened}, "
        f"reported ok={r.ok}")


# ============================================================================ 2. writer dies growing the map
@pytest.mark.parametrize("fault", ["statvfs_eio", "set_mapsize_error"])
def test_map_growth_failing_after_map_full_does_not_kill_the_writer(stores, monkeypatch, fault):
    """Invariant 11 (faults degrade, never kill the writer).  After a MapFullError, ``_run_batch``
    calls ``_grow`` inside its ``except lmdb.MapFullError`` clause, outside any try: an OSError from
    the free-space probe or an lmdb.Error from set_mapsize escapes and kills the writer thread (the
    tier stops accepting spills for good; queued tombs/deletes are dropped unapplied)."""
    st = stores()
    proxy = EnvProxy(st.s.db.env, map_full_on=lmdb_key(b"a"),
                     set_mapsize_error=lmdb.Error("mdb_env_set_mapsize: Cannot allocate memory")
                     if fault == "set_mapsize_error" else None)
    st.s.db.env = proxy
    if fault == "statvfs_eio":
        import shutil
        real = shutil.disk_usage

        def disk_usage(p: Any) -> Any:
            if threading.current_thread().name == "tiered-kv-disk-writer" and proxy.raised:
                raise OSError(errno.EIO, "Input/output error")
            return real(p)

        monkeypatch.setattr(disk_mod.shutil, "disk_usage", disk_usage)
    r = st.answer(st.spill(b"a"))
    assert proxy.raised == 1
    assert not r.ok                          # the batch fails: fine
    proxy.set_mapsize_error = None
    monkeypatch.undo()
    ok = st.s.submit_spill(uuid.uuid4(), b"b", memoryview(payload(b"b")))
    assert ok and st.s.writer_alive(), f"the writer died on a failed map growth: {st.s.writer_error!r}"


# ============================================================================ 3. a poison delete
def test_a_corrupt_index_record_fails_no_later_batch(stores):
    """Invariant 11 (a fault fails its batch, later batches work).  A bit flip in the length field of a
    committed index record (high bit: length 4096 + 2**60).  The reader reports it corrupt and queues
    ``_DeleteCorrupt``; the writer re-verifies with ``_read_slot`` = ``os.pread(fd, h.length, ...)``,
    which raises MemoryError.  ``_batch_failed`` keeps the op and retries it with every later batch:
    no spill ever commits again and every flush() answers False, until restart."""
    st = stores()

    def flip_length(v: bytearray) -> bytes:
        v[19] ^= 0x10                        # header: magic 4, version 2, flags 2, ns_len 2, key_len 2, length 8
        return bytes(v)

    st.read_damaged(b"k", flip_length)
    later = [st.spill(b"n%d" % i) for i in range(3)]
    outcomes = [st.answer(x) for x in later]
    flushed = st.flush()
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    assert flushed is True
    assert b"k" not in st.index()            # the token-matched removal took the damaged record


# ============================================================================ 4. close() under a persistent fault
@pytest.mark.parametrize("op", ["touch", "delete", "tomb"])
def test_close_returns_while_the_disk_fails_every_commit(stores, op):
    """Invariant 11 / shutdown: with a persistent fault (EIO on every commit: a dead or read-only
    disk) and a control op queued (a promote's touch, an eviction's delete, an invalidation's tomb),
    ``_batch_failed`` re-queues the op and, once closed, skips its back-off: the writer retries the
    same failing batch in a tight loop forever and ``close()`` (TierManager/SlabScheduler.close) never
    returns."""
    st = stores()
    t = st.spill(b"k")
    assert st.answer(t).ok and st.flush()
    done, outcome = threading.Event(), threading.Event()
    state = {"after_close": 0}

    def hook(point: str) -> None:
        if st.s._closed:
            state["after_close"] += 1
            if state["after_close"] >= 50:   # the same batch failed 50 times after close(): spinning
                outcome.set()
        raise OSError(errno.EIO, "Input/output error")

    st.s.fault_hook = hook
    if op == "touch":
        st.s.submit_touch(b"k")
    elif op == "delete":
        st.s.submit_delete(t, b"k")
    else:
        st.s.cancel(t, b"k")

    def run_close() -> None:
        st.s.close()
        done.set()
        outcome.set()

    threading.Thread(target=run_close, daemon=True).start()
    assert outcome.wait(30)
    hung = not done.is_set()
    st.s.fault_hook = None                   # let it finish
    assert done.wait(30)
    assert not hung, f"close() still retrying after {state['after_close']} failed commits"


def test_once_closing_a_failing_batch_gets_exactly_close_retries_more_attempts(tmp_path, monkeypatch):
    """The attempt under way when close() begins, then CLOSE_RETRIES retries: the kept op is then
    dropped (logged) and close() returns."""
    from tiered_kv.disk.writer import CLOSE_RETRIES
    st = Store(tmp_path / "d")
    t = st.spill(b"k")
    assert st.answer(t).ok and st.flush()
    gate = WriterGate(block_from=1, raise_at={i: OSError(errno.EIO, "Input/output error") for i in range(1, 20)})
    st.s.fault_hook = gate
    writer = st.s.writer
    closing = threading.Event()
    real_begin = writer.begin_close

    def begin_close() -> None:
        real_begin()
        closing.set()

    monkeypatch.setattr(writer, "begin_close", begin_close)
    st.s.cancel(t, b"k")                       # a tomb: a control op, kept and retried when its batch fails
    gate.entered(1)                            # its first attempt holds in the writer
    closer = threading.Thread(target=st.s.close, daemon=True)
    closer.start()
    assert closing.wait(30)                    # the writer is closing
    gate.open()
    closer.join(30)
    assert not closer.is_alive()
    assert gate.calls == 1 + CLOSE_RETRIES
    assert writer.writer_error is None and "writer_died" not in st.errors, "the op is dropped, the writer ends cleanly"


class _WriterKilled(BaseException):
    """Not an Exception: the writer thread dies of it (answering what is queued)."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("how", ["closed", "died"])
def test_a_flush_asked_of_a_writer_that_is_gone_is_answered_false_at_once(tmp_path, how):
    """No flush is left unanswered: once the writer was closed, or died, a flush is refused at once
    (it is never queued for a thread that will not take it)."""
    st = Store(tmp_path / "d")
    try:
        if how == "closed":
            st.s.close()
        else:
            st.s.fault_hook = lambda point: (_ for _ in ()).throw(_WriterKilled("killed"))
            assert not st.answer(st.spill(b"k")).ok
            st.s.writer._thread.join(30)
            assert not st.s.writer_alive()
        tok = uuid.uuid4()
        st.s.submit_flush(tok)
        r = st.q.get(0)                          # answered in the call: nothing to wait for
        assert isinstance(r, FlushDone) and r.token == tok and r.ok is False and "gone" in (r.error or "")
    finally:
        st.s.close()


def test_a_flush_whose_own_batch_fails_is_false(tmp_path):
    """The flush's batch is the one that syncs what earlier batches committed (durability "batch"):
    if it fails, those commits are not known durable, so the flush is False."""
    st = Store(tmp_path / "d", durability="batch")
    try:
        assert st.answer(st.spill(b"k")).ok        # committed, not yet synced
        st.s.fault_hook = WriterGate(block_from=None, raise_at={1: OSError(errno.EIO, "Input/output error")})
        tok = uuid.uuid4()
        st.s.submit_flush(tok)
        r = st.answer(tok)
        assert isinstance(r, FlushDone) and r.token == tok and r.ok is False and "Input/output" in (r.error or "")
    finally:
        st.s.close()


def test_the_spill_queue_takes_queue_blocks_spills_and_refuses_the_next(tmp_path):
    st = Store(tmp_path / "d", queue_blocks=3, batch_blocks=1)
    gate = WriterGate(block_from=1)
    st.s.fault_hook = gate
    try:
        first = st.spill(b"held")
        gate.entered(1)                                       # the writer holds the first spill's batch
        queued = [st.spill(b"q%d" % i) for i in range(3)]     # the queue's three places
        assert st.s.queue_depth == 3 and not st.s.spill_room()
        assert st.s.submit_spill(uuid.uuid4(), b"over", memoryview(payload(b"over"))) is False
        gate.open()
        assert all(st.answer(t).ok for t in [first] + queued)
        assert b"over" not in st.index() and st.s.spill_room()
    finally:
        gate.open()
        st.s.close()


@pytest.mark.parametrize("grow,label,words", [
    (OSError(errno.ENOSPC, "No space left on device"), "disk_full", "growing the LMDB map"),
    (False, "map_full", "no room to grow"),
    (True, "map_full", "still full after growing"),
], ids=["growing-raises", "no-room-to-grow", "still-full-after-growing"])
def test_a_full_map_that_cannot_grow_fails_its_batch_and_the_writer_carries_on(tmp_path, monkeypatch, grow, label,
                                                                                 words):
    st = Store(tmp_path / "d")
    try:
        def no_growth(need: int = 0) -> bool:
            if isinstance(grow, BaseException):
                raise grow
            return grow

        monkeypatch.setattr(st.s.db, "grow", no_growth)
        from tiered_kv.disk.writer import MAP_FULL_ATTEMPTS
        attempts = MAP_FULL_ATTEMPTS if grow is True else 1    # the map "grows", and is full again, each time
        st.s.fault_hook = WriterGate(block_from=None, raise_at={i: lmdb.MapFullError("MDB_MAP_FULL")
                                                                for i in range(1, attempts + 1)})
        assert not st.answer(st.spill(b"lost")).ok
        assert st.errors == [label] and words in st.messages[0], st.messages
        assert st.s.writer_alive()
        assert st.answer(st.spill(b"later")).ok and st.flush()
        assert set(st.index()) == {b"later"}
    finally:
        st.s.close()


def test_an_idle_writer_syncs_its_last_commit_in_batch_mode(tmp_path):
    """Durability "batch": a commit is not synced by itself; the writer syncs it once idle (after
    DIRTY_SYNC_S) without any further op, so an OS crash loses at most that long of commits."""
    st = Store(tmp_path / "d", durability="batch")
    try:
        with sync_spy(st) as spy:
            assert st.answer(st.spill(b"k")).ok
            assert spy.synced.wait(30), "no idle sync of the batch-mode commit"
            assert st.answer(st.spill(b"after")).ok, "the writer goes on after an idle sync"
    finally:
        st.s.close()


@pytest.mark.parametrize("durability", ["sync", "none"])
def test_only_batch_durability_syncs_from_the_writer(tmp_path, durability):
    """LMDB syncs each "sync" commit itself and "none" never syncs: the writer's own sync (a flush's, an
    idle writer's) is for "batch" alone, so neither of the others ever calls it."""
    st = Store(tmp_path / "d", durability=durability)
    try:
        with sync_spy(st) as spy:
            assert st.answer(st.spill(b"k")).ok
            assert st.flush() is True
            assert st.answer(st.spill(b"k2")).ok
            assert st.flush() is True
            assert spy.forced == []
    finally:
        st.s.close()


def test_a_flush_leaves_a_batch_mode_writer_clean(tmp_path):
    """The flush's sync made every commit durable: the writer is no longer dirty, so when idle it does
    not sync again (a writer left dirty would sync every DIRTY_SYNC_S for as long as it is idle)."""
    st = Store(tmp_path / "d", durability="batch")
    try:
        assert st.answer(st.spill(b"k")).ok
        assert st.flush() is True
        assert st.s.writer._dirty is False
    finally:
        st.s.close()


def test_a_dirty_idle_writer_waits_dirty_sync_s_not_the_idle_wake(tmp_path, monkeypatch):
    """The idle sync of a batch-mode commit comes after DIRTY_SYNC_S, however long the idle wake-up
    (IDLE_WAKE_S) is: an OS crash loses at most DIRTY_SYNC_S of commits."""
    monkeypatch.setattr(writer_mod, "DIRTY_SYNC_S", 0.01)
    monkeypatch.setattr(writer_mod, "IDLE_WAKE_S", 3600.0)
    st = Store(tmp_path / "d", durability="batch")
    try:
        with sync_spy(st) as spy:
            assert st.answer(st.spill(b"k")).ok
            assert spy.synced.wait(20), "the dirty writer slept on to the idle wake-up instead of syncing"
    finally:
        st.s.close()


def test_a_clean_idle_writer_takes_queued_touches_at_its_idle_wake(tmp_path, monkeypatch):
    """A touch wakes no one: a clean idle writer takes it at its next idle wake-up (IDLE_WAKE_S), not
    after DIRTY_SYNC_S, which is for a dirty writer only."""
    monkeypatch.setattr(writer_mod, "DIRTY_SYNC_S", 3600.0)
    monkeypatch.setattr(writer_mod, "IDLE_WAKE_S", 0.01)
    took_touch = threading.Event()
    run_batch = writer_mod.Writer._run_batch

    def spy(self: Any, batch: list[Any]) -> None:
        run_batch(self, batch)
        if any(isinstance(op, writer_mod.Touch) for op in batch):
            took_touch.set()

    monkeypatch.setattr(writer_mod.Writer, "_run_batch", spy)
    st = Store(tmp_path / "d", durability="sync")   # a "sync" writer is never dirty
    try:
        assert st.answer(st.spill(b"k")).ok
        st.s.submit_touch(b"k")
        assert took_touch.wait(20), "the touch waited for DIRTY_SYNC_S on a clean writer"
    finally:
        st.s.close()


def spill_counts_per_batch(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of spills in each batch the writer runs from now on (appended as each starts)."""
    from tiered_kv.disk.records import Spill

    sizes: list[int] = []
    run_batch = writer_mod.Writer._run_batch

    def spy(self: Any, batch: list[Any]) -> None:
        sizes.append(sum(1 for op in batch if isinstance(op, Spill)))
        run_batch(self, batch)

    monkeypatch.setattr(writer_mod.Writer, "_run_batch", spy)
    return sizes


def test_a_batch_closes_when_it_reaches_batch_bytes(tmp_path, monkeypatch):
    """writer_batch_bytes: a write transaction commits when its spills reach that many bytes -- the
    spill that reaches it is the batch's last, the next queued one starts the next batch."""
    sizes = spill_counts_per_batch(monkeypatch)
    st = Store(tmp_path / "d", batch_blocks=16, batch_bytes=2 * ROW)
    gate = WriterGate(block_from=1)
    st.s.fault_hook = gate
    try:
        toks = [st.spill(b"a")]
        gate.entered(1)                     # the writer holds [a]; b, c, d queue behind it
        toks += [st.spill(k) for k in (b"b", b"c", b"d")]
        gate.open()
        assert all(st.answer(t).ok for t in toks)
        assert sizes[:3] == [1, 2, 1]
    finally:
        gate.open()
        st.s.close()


def test_a_writer_waits_up_to_batch_seconds_to_fill_a_batch(tmp_path, monkeypatch):
    """writer_batch_seconds: a writer holding a partial batch waits that long for more spills, so a
    spill queued while it waits joins the same transaction (one commit, not one per spill)."""
    sizes = spill_counts_per_batch(monkeypatch)
    st = Store(tmp_path / "d", batch_blocks=2, batch_seconds=0.9)
    try:
        a = st.spill(b"a")
        deadline = time.monotonic() + 10
        while not st.s.writer._filling and time.monotonic() < deadline:
            time.sleep(0.001)   # until the writer holds [a] and waits for more
        b = st.spill(b"b")
        assert st.answer(a).ok and st.answer(b).ok
        assert sizes == [2]
    finally:
        st.s.close()


def test_an_idle_writer_is_woken_by_each_spill(tmp_path, monkeypatch):
    """A writer that has finished its batches waits for work, and the next spill wakes it at once: it
    does not sleep on to its idle wake-up (here an hour) believing it still fills a batch."""
    monkeypatch.setattr(writer_mod, "IDLE_WAKE_S", 3600.0)
    monkeypatch.setattr(writer_mod, "DIRTY_SYNC_S", 3600.0)
    st = Store(tmp_path / "d", durability="sync")
    try:
        assert st.answer(st.spill(b"a")).ok
        assert st.answer(st.spill(b"b"), timeout=20).ok
    finally:
        st.s.close()


def test_writes_are_sequenced_so_a_reopen_keeps_their_order(tmp_path):
    """Each write gets the next sequence number: recovery orders the entries by it (oldest first, the
    LRU order the index is rebuilt in), not by their keys."""
    st = Store(tmp_path / "d", batch_blocks=1)
    order = [b"c", b"a", b"b"]
    try:
        for k in order:
            assert st.answer(st.spill(k)).ok
        assert st.flush()
    finally:
        st.s.close()
    st = Store(tmp_path / "d")
    try:
        assert [e.key for e in st.s.entries] == order
        assert [e.seq for e in st.s.entries] == [1, 2, 3]
    finally:
        st.s.close()


def test_a_spill_cancelled_while_queued_is_answered_as_prevented(tmp_path):
    """The store's contract with its owner: a spill its tomb stopped is reported not ok with the
    error SPILL_PREVENTED (which is not a fault), and nothing of it is published."""
    from tiered_kv.disk import SPILL_PREVENTED
    st = Store(tmp_path / "d", batch_blocks=1)
    gate = WriterGate(block_from=1)
    st.s.fault_hook = gate
    try:
        held = st.spill(b"held")
        gate.entered(1)
        victim = st.spill(b"victim")
        st.s.cancel(victim, b"victim")
        gate.open()
        assert st.answer(held).ok
        r = st.answer(victim)
        assert (r.ok, r.error) == (False, SPILL_PREVENTED)
        assert st.flush() and set(st.index()) == {b"held"}
    finally:
        gate.open()
        st.s.close()


def test_a_key_written_again_drops_its_old_recency_record(tmp_path):
    """A touch record holds the recency of a read-back; a new write of the key supersedes it (its own
    sequence number is newer), so the old record is dropped with the old entry, not left behind."""
    st = Store(tmp_path / "d", batch_blocks=1)
    try:
        assert st.answer(st.spill(b"k")).ok
        st.s.submit_touch(b"k")
        assert st.flush()

        def touched() -> set[bytes]:
            st.s.db.rw.acquire_shared()
            try:
                with st.s.db.env.begin() as txn:
                    return {bytes(k) for k, _ in txn.cursor(db=st.s.db.touch)}
            finally:
                st.s.db.rw.release_shared()

        assert touched() == {lmdb_key(b"k")}
        assert st.answer(st.spill(b"k")).ok and st.flush()
        assert touched() == set()
    finally:
        st.s.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("when", ["before its first batch", "in an idle sync after a batch"])
def test_a_writer_that_dies_outside_a_batch_refuses_spills_and_answers_flushes(tmp_path, monkeypatch, when):
    """A writer that dies answers everything queued and refuses further ops -- also when it dies
    outside a batch: before it ever took one, or syncing an earlier commit while idle."""
    from tiered_kv.disk.writer import Writer

    def die(*a: Any) -> None:
        raise _WriterKilled(f"killed {when}")

    if when.startswith("before"):
        monkeypatch.setattr(Writer, "_take_batch", die)
    st = Store(tmp_path / "d", durability="batch")
    try:
        if not when.startswith("before"):
            assert st.answer(st.spill(b"k")).ok
            env = st.s.db.env

            class Dying:
                def __getattr__(self, name: str) -> Any:
                    return getattr(env, name)

                sync = die

            st.s.db.env = Dying()
        st.s.writer._thread.join(30)
        assert not st.s.writer_alive() and isinstance(st.s.writer_error, _WriterKilled)
        assert "writer_died" in st.errors and not st.s.healthy and st.s.queue_depth == 0
        assert f"killed {when}" in st.messages[st.errors.index("writer_died")], "the log says what killed it"
        assert st.s.submit_spill(uuid.uuid4(), b"k", memoryview(payload(b"k"))) is False
        tok = uuid.uuid4()
        st.s.submit_flush(tok)
        r = st.q.get(0)
        assert isinstance(r, FlushDone) and r.token == tok and r.ok is False
    finally:
        if not when.startswith("before"):
            st.s.db.env = env
        st.s.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_ops_queued_when_the_writer_dies_are_answered_failed_saying_why(tmp_path, monkeypatch):
    """A spill and a flush queued behind a writer that then dies are each answered once, failed, with
    the cause in the answer (the owner counts and logs it; a failed flush always says why)."""
    from tiered_kv.disk.writer import Writer

    go = threading.Event()

    def take_then_die(self: Any) -> None:
        assert go.wait(30)
        raise _WriterKilled("killed with ops queued")

    monkeypatch.setattr(Writer, "_take_batch", take_then_die)
    st = Store(tmp_path / "d", durability="batch")
    try:
        tok = st.spill(b"k")
        ftok = uuid.uuid4()
        st.s.submit_flush(ftok)
        go.set()
        r = st.answer(tok)
        assert r.ok is False and "disk writer died" in r.error and "killed with ops queued" in r.error
        f = st.answer(ftok)
        assert isinstance(f, FlushDone) and f.ok is False and "disk writer died" in f.error
    finally:
        st.s.close()


def test_a_batch_s_time_is_shared_out_among_its_spills(tmp_path):
    """Each spill's report carries its share of its batch's write time (the transfer-time histogram
    sums them): none is negative and together they are at most the batch's wall time."""
    st = Store(tmp_path / "d")
    gate = WriterGate(block_from=1)
    st.s.fault_hook = gate
    try:
        first = st.spill(b"first")
        gate.entered(1)
        rest = [st.spill(b"k%d" % i) for i in range(4)]
        t0 = time.perf_counter()
        gate.open()
        reports = [st.answer(t) for t in rest]
        elapsed = time.perf_counter() - t0
        assert st.answer(first).ok and all(r.ok for r in reports)
        assert gate.calls == 2, "the four queued spills shared one batch"
        assert all(r.seconds >= 0 for r in reports) and sum(r.seconds for r in reports) <= elapsed
    finally:
        gate.open()
        st.s.close()


def test_a_batch_s_spills_share_all_of_its_time(tmp_path):
    """The shares add up to the whole batch: with the batch's transaction held 0.2 s inside its timed
    window (a delay injected at the start of the commit, not a timing of the machine), the four
    spills' seconds sum to at least that."""
    calls: list[str] = []
    held, go = threading.Event(), threading.Event()

    def hook(point: str) -> None:
        calls.append(point)
        if len(calls) == 1:      # the first batch waits while four spills queue behind it
            held.set()
            go.wait(30)
        elif len(calls) == 2:    # the four spills' batch: a known 0.2 s inside its commit
            time.sleep(0.2)

    st = Store(tmp_path / "d")
    st.s.fault_hook = hook
    try:
        first = st.spill(b"first")
        assert held.wait(30)
        rest = [st.spill(b"k%d" % i) for i in range(4)]
        go.set()
        reports = [st.answer(t) for t in rest]
        assert st.answer(first).ok and all(r.ok for r in reports)
        assert len(calls) == 2, "the four queued spills shared one batch"
        assert sum(r.seconds for r in reports) >= 0.2
    finally:
        go.set()
        st.s.close()


def test_an_unclosed_store_does_not_keep_the_process_from_exiting(tmp_path):
    """The writer is a daemon thread: a host process that exits without closing its manager exits
    (recovery on the next open takes care of the rest)."""
    import subprocess
    import sys
    code = ("import sys; sys.path.insert(0, 'tests'); from pathlib import Path; import test_disk_writer_regressions as t; "
            f"st = t.Store(Path({str(tmp_path / 'd')!r})); assert st.answer(st.spill(b'k')).ok")
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent, timeout=120,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_flush_whose_sync_fails_is_false_and_the_next_good_sync_clears_it(tmp_path):
    """Durability "batch": the flush's sync makes the earlier commits durable; if LMDB's sync fails
    the flush is False, the fault is counted as sync_failed with its cause, and once a sync works
    again flushes are True again."""
    st = Store(tmp_path / "d", durability="batch")
    env = st.s.db.env
    failing = {"on": True}

    class FailingSync:
        def __getattr__(self, name: str) -> Any:
            return getattr(env, name)

        def sync(self, force: bool = False) -> None:
            if failing["on"]:
                raise lmdb.Error("mdb_env_sync: Input/output error")
            env.sync(force)

    try:
        assert st.answer(st.spill(b"k")).ok
        st.s.db.env = FailingSync()
        assert st.flush() is False
        assert st.errors == ["sync_failed"] and "mdb_env_sync: Input/output error" in st.messages[0]
        failing["on"] = False
        assert st.answer(st.spill(b"k2")).ok
        assert st.flush() is True
    finally:
        st.s.db.env = env
        st.s.close()


# ============================================================================ 5. flush after a failed spill
def test_flush_is_false_when_a_spill_failed_before_it_was_asked_for(rig):
    """Durability contract (a spill submitted before flush() is durable when flush() returns True;
    test_disk_faults.test_flush_is_false_when_a_spill_it_covers_failed).  ``submit_flush`` snapshots
    ``_failures`` when it is queued, so a spill whose batch failed *before* that (but after the spill
    was submitted) is not covered: flush() returns True and the block is gone after reopen."""
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=8)
    failed = fail_first_batch(mgr.disk)
    store_one(mgr, kv, b"k", 0, flush=False)          # store done, its spill queued
    assert failed.wait(30)                            # its batch failed before flush() is called
    flushed = mgr.flush(timeout=30)
    rig.close(mgr)
    mgr = rig.open(kv, host_slots=8)
    on_disk = mgr.lookup([b"k"])
    assert not (flushed and on_disk == 0), "flush() returned True, and the block stored before it is lost"


def test_a_flush_is_false_when_a_batch_fails_after_it_was_queued_even_after_an_earlier_failure(tmp_path):
    """A flush compares the failed batches counted when it was queued with those when it is answered;
    with one failure already behind, a second one after the flush was queued must still make it False
    although the flush's own batch commits."""
    st = Store(tmp_path / "d")
    try:
        eio = lambda: OSError(errno.EIO, "Input/output error")  # noqa: E731
        gate = WriterGate(block_from=2, raise_at={1: eio(), 2: eio()})
        st.s.fault_hook = gate
        assert not st.answer(st.spill(b"first")).ok            # failure 1
        second = st.spill(b"second")
        gate.entered(2)                                         # the writer holds the second spill's batch
        flushed = uuid.uuid4()
        st.s.submit_flush(flushed)                              # queued behind it, after one failure
        gate.open()
        assert not st.answer(second).ok                         # failure 2
        r = st.answer(flushed)
        assert isinstance(r, FlushDone) and r.ok is False and "failed" in (r.error or "")
        assert gate.points.count("commit") == 3                 # the flush had a batch of its own
    finally:
        st.s.close()


# ============================================================================ 6. transient corrupt read
def test_a_corrupt_read_removes_its_entry_even_when_a_second_read_would_pass(rig, monkeypatch):
    """Invariants 9 and 12 / capacity (an entry that fails verification is removed; no slot is held
    outside the owner's count).  One read returns damaged bytes (a transient: the device or the bus),
    the reader reports "corrupt", the owner forgets the key (``forget_failed_read``), but the writer's
    ``_DeleteCorrupt`` re-reads the slot, finds it good and keeps the entry: a committed entry and its
    slot outside ``disk_capacity_bytes`` accounting, until the key happens to be spilled again or a
    restart."""
    kv = make_kv(8)
    # the disk readers' path (a blocked wait() would read a cached block itself)
    mgr = rig.open(kv, host_slots=2, disk_read_cached_in_wait=False)
    store_seq(mgr, kv, [b"A", b"B", b"C"])           # A only on disk now
    assert mgr.host_bytes(b"A") is None
    real = os.preadv
    armed = {"on": True}

    def preadv(fd: int, buffers: list, offset: int, *a: Any) -> int:
        n = real(fd, buffers, offset, *a)
        if armed["on"] and threading.current_thread().name == "tiered-kv-disk-reader":
            armed["on"] = False
            buffers[0][100] ^= 0x5A               # what this one read returned
        return n

    monkeypatch.setattr(readers_mod.os, "preadv", preadv)
    job = mgr.load(b"A", 5)
    assert job is not None
    got = [c for c in mgr.wait([job], timeout=30) if c.job is job]
    assert [c.ok for c in got] == [False]
    mgr.wait(timeout=30)
    drain(mgr)
    assert mgr.flush(timeout=30) is True
    drain(mgr)
    disk = mgr.disk
    env = disk.db.env
    disk.db.rw.acquire_shared()
    try:
        with env.begin(db=disk.db.blocks) as txn:
            committed = {parse_header(v).key for _, v in txn.cursor()}
    finally:
        disk.db.rw.release_shared()
    assert mgr.disk_blocks == len(committed), (
        f"owner counts {mgr.disk_blocks} disk blocks, {len(committed)} committed entries hold slots "
        f"({sorted(committed)}): an orphan outside the capacity count")


# ============================================================================ 1b. same root cause, other order
def test_a_map_full_retry_does_not_publish_a_spill_cancelled_while_its_batch_waits(stores):
    """Invariant 7, same root cause as test 1, the other order: the writer has taken [Spill(T), Spill(X)]
    when T is cancelled (its tomb goes to the next batch).  Attempt 1 prevents Spill(T) and consumes the
    in-memory cancellation; MapFullError on X; the retry publishes Spill(T).  The tomb of the next
    batch deletes it again, but until then the cancelled write is committed (readable, and it survives
    a crash in that window with nothing to purge it: no durable tomb was ever written)."""
    st = stores()
    gate = WriterGate(block_from=1)
    st.s.fault_hook = gate
    st.s.db.env = EnvProxy(st.s.db.env, map_full_on=lmdb_key(b"x"))
    t0 = st.spill(b"first")
    gate.entered(1)
    t = st.spill(b"k")
    tx = st.spill(b"x")
    gate.step(1)                             # batch 1 commits; the writer takes [Spill(k), Spill(x)] ...
    gate.entered(2)                          # ... and is held at the start of its transaction
    st.s.cancel(t, b"k")                     # the tomb waits for the next batch
    gate.step(2)                             # attempt 1 (MapFullError) and the retry
    gate.entered(4)                          # held before the tomb's batch: the retry has committed
    try:
        assert st.s.db.env.raised == 1
        assert b"k" not in st.index(), "a spill cancelled before its transaction is committed"
    finally:
        gate.open()
    assert st.answer(t0).ok
    st.answer(t)
    assert st.answer(tx).ok
    assert st.flush() is True


def test_a_corrupt_read_of_a_record_without_a_header_still_removes_the_record(stores):
    """The reader's removal of a corrupt read is token-matched; a record whose header cannot be parsed
    (bad magic) has no token to match, and no write of anyone's makes one: it is dropped all the same,
    at the next commit, not left in the index until a restart."""
    st = stores()

    def bad_magic(v: bytearray) -> bytes:
        v[0] ^= 0xFF
        return bytes(v)

    st.read_damaged(b"k", bad_magic)
    assert st.answer(st.spill(b"n")).ok and st.flush()     # a later commit carries the removal
    st.s.db.rw.acquire_shared()
    try:
        with st.s.db.env.begin(db=st.s.db.blocks) as txn:
            assert txn.get(lmdb_key(b"k")) is None, "the headerless record is still in the index"
    finally:
        st.s.db.rw.release_shared()


def test_a_tombstone_whose_transaction_aborts_keeps_the_cancellation_in_memory(stores):
    """The writer's tomb op (``Tombs.apply``) deleting the entry takes the token out of ``cancelled``.
    If that transaction's commit fails, the entry is still there, so the in-memory cancellation must
    be too (``Tombs.undo``), or the retry of the same tomb op would find it settled and keep nothing."""
    st = stores()
    t = st.spill(b"k")
    assert st.answer(t).ok and st.flush()
    seen: list[tuple[bool, bool]] = []
    calls = {"n": 0}

    def hook(point: str) -> None:     # at the start of each commit attempt, on the writer thread
        calls["n"] += 1
        if calls["n"] == 2:           # the retry, after the aborted attempt
            seen.append((b"k" in st.index(), st.s.tombs.is_cancelled(t)))

    real = st.s.db.env
    st.s.db.env = EnvProxy(real)
    st.s.db.env.fail_commit = True
    st.s.fault_hook = hook
    try:
        st.s.cancel(t, b"k")                 # the tomb op deletes the entry; its commit fails once
        st.flush()
    finally:
        st.s.fault_hook = None
        st.s.db.env = real
    assert seen == [(True, True)]            # the delete was not committed, and the cancellation is back
    assert b"k" not in st.index()            # the retry removed it