"""Batched disk reads: a reader takes the reads queued, reads them in file order, runs in one preadv.

``Readers._reader_main`` takes the first queued read and those behind it
(``_take_queued``, up to ``read_batch_bytes``), looks them all up in one read
transaction and reads them sorted by slot, neighbouring slots by one
``preadv`` (``_read_many``).  Checked here:

1. file order and one ``preadv`` per run of neighbouring slots (capped by
   ``read_run_bytes``; a batch's first run by ``read_first_run_slots``, one
   slot by default), padding between slots when a block is not a whole
   number of pages; every read answered once with its own bytes;
2. each read of a batch keeps its own outcome: absent, superseded, corrupt,
   short (a truncated slot file) next to good reads in the same run; a slot
   reused between the batch's lookup and its read is a superseded miss;
3. the batch answers exactly what single reads answer (hypothesis, against
   ``_read`` as the model);
4. faults: a run's ``preadv`` failing sends its reads one by one (a lone
   slot's failure is its answer, not read twice); an LMDB error in the batch
   lookup sends them one by one too; an exception inside the reader answers
   every read it had taken (``error="reader_error"``) and the reader goes on;
5. the reader thread really batches (forced with a gate before it takes the
   queue), and ``close()`` with reads and stop sentinels in one batch answers
   every read;
6. through a ``TierManager``: many disk-only keys loaded at once come back
   byte for byte.

Most tests build a ``DiskStore`` without reader threads and call the batch
path on the test thread; ordering is forced with events, never sleeps.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import lmdb
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiered_kv.disk.readers as disk_mod
from disk_helpers import NS, ROW, content, keys, make_kv, metric, rig, row_is, store_seq  # noqa: F401
from tiered_kv.disk import DiskOptions, DiskStore
from tiered_kv.disk.records import Promote as _Promote
from tiered_kv.disk.format import SLOTS_NAME, parse_header, slot_bytes_for
from tiered_kv.movers import CompletionQueue, Report


class Store:
    """A DiskStore on ``path`` (``num_readers`` reader threads, 0 by default) holding ``ks`` in slots 0..

    ``read_first_run_slots`` is 0 here unless a test asks: the run layouts below are written for runs
    that all merge up to ``read_run_bytes``; the short first run of the default has tests of its own.
    """

    def __init__(self, path: Path, ks: list[bytes], *, block: int = ROW, num_readers: int = 0,
                 read_first_run_slots: int = 0, **opts: Any) -> None:
        self.block = block
        self.q = CompletionQueue()
        self.errors: list[str] = []
        self.corrupt: list[str] = []
        slots = max(8, 2 * len(ks) + 4)
        self.s = DiskStore(DiskOptions(path=path, namespace=NS, block_bytes=block, capacity_bytes=slots * block,
                                       durability="none", batch_blocks=1, batch_bytes=block, batch_seconds=0.0,
                                       slots=slots, num_readers=num_readers,
                                       read_first_run_slots=read_first_run_slots, **opts),
                           self.q, on_error=lambda kind, msg: self.errors.append(kind),
                           on_corrupt=self.corrupt.append)
        self.tokens: dict[bytes, uuid.UUID] = {}
        self.early: dict[uuid.UUID, Any] = {}
        for k in ks:   # one batch each, in turn: slot i holds ks[i]
            self.write(k)
        assert self.slots() == {k: i for i, k in enumerate(ks)}

    def write(self, key: bytes, tag: Optional[bytes] = None) -> uuid.UUID:
        tok = uuid.uuid4()
        buf = bytearray(payload(tag or key, self.block))
        assert self.s.submit_spill(tok, key, memoryview(buf))
        r = self.answer(tok)
        assert r.ok, r
        self.tokens[key] = tok
        return tok

    def answer(self, token: uuid.UUID, timeout: float = 30.0) -> Any:
        """The answer for ``token`` (answers for other tokens that come first are kept for later)."""
        deadline = time.monotonic() + timeout
        while token not in self.early:
            item = self.q.get(max(0.0, deadline - time.monotonic()))
            assert item is not None, f"no answer for {token} within {timeout} s"
            assert item.token not in self.early, f"{item.token} answered twice"
            self.early[item.token] = item
        return self.early.pop(token)

    def slots(self) -> dict[bytes, int]:
        env = self.s.db.env
        assert env is not None
        with env.begin(db=self.s.db.blocks) as txn:
            return {parse_header(v).key: parse_header(v).slot for _, v in txn.cursor()}

    def op(self, key: bytes, expect: Optional[uuid.UUID] = None) -> _Promote:
        return _Promote(uuid.uuid4(), key, expect or self.tokens.get(key, uuid.uuid4()),
                        memoryview(bytearray(self.block)))

    def flip(self, key: bytes, offset: int = 17) -> None:
        sb = slot_bytes_for(self.block)
        fd = os.open(self.s.opts.path / SLOTS_NAME, os.O_RDWR)
        try:
            at = self.slots()[key] * sb + offset
            b = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([b[0] ^ 0x5A]), at)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.s.close()


@pytest.fixture
def make_store(tmp_path: Path) -> Any:
    """``make_store(keys, **options)``: a :class:`Store` in its own directory, closed after the test."""
    made: list[Store] = []

    def make(ks: list[bytes], **kw: Any) -> Store:
        made.append(Store(tmp_path / f"d{len(made)}", ks, **kw))
        return made[-1]

    yield make
    for st_ in made:
        st_.close()   # idempotent


def payload(key: bytes, block: int) -> bytes:
    return content(key, block).numpy().tobytes()


class PreadvLog:
    """Records every ``os.preadv`` the disk module makes: (offset, number of buffers, bytes asked)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: Any = None) -> None:
        self.calls: list[tuple[int, int, int]] = []
        real = os.preadv

        def preadv(fd: int, buffers: list, offset: int, *a: Any) -> int:
            self.calls.append((offset, len(buffers), sum(len(b) for b in buffers)))
            if fail is not None and fail(offset, buffers):
                raise OSError(errno.EIO, "Input/output error")
            return real(fd, buffers, offset, *a)

        monkeypatch.setattr(disk_mod.os, "preadv", preadv)


def answers(store: Store, ops: list[_Promote]) -> dict[bytes, Report]:
    """Run the batch path on this thread; every read answered exactly once; key -> report."""
    got = [x for group in store.s.readers._read_many(ops) for x in group]
    assert sorted(id(op) for op, _ in got) == sorted(id(op) for op in ops), "a read answered twice or not at all"
    assert all(r.token == op.token for op, r in got)
    return {op.key: r for op, r in got}


def bytes_ok(op: _Promote, block: int) -> bool:
    return bytes(op.dst) == payload(op.key, block)


# ============================================================================ 1. file order, runs, padding
def test_batch_reads_in_file_order_one_preadv_per_run(make_store, monkeypatch):
    ks = keys(12)
    st_ = make_store(ks)
    want = [ks[9], ks[2], ks[3], ks[1], ks[7], ks[8], ks[4]]     # slots 1-4 and 7-9, shuffled
    ops = [st_.op(k) for k in want]
    log = PreadvLog(monkeypatch)
    t0 = time.perf_counter()
    got = answers(st_, ops)
    wall = time.perf_counter() - t0
    sb = slot_bytes_for(ROW)
    assert log.calls == [(1 * sb, 4, 4 * ROW), (7 * sb, 3, 3 * ROW)]
    assert all(got[op.key].ok and got[op.key].nbytes == ROW and bytes_ok(op, ROW) for op in ops)
    secs = [got[k].seconds for k in want]
    assert all(s >= 0 for s in secs) and 0 < sum(secs) <= wall   # the batch's time, shared, not multiplied


@pytest.mark.parametrize("first, layout", [(DiskOptions.read_first_run_slots, [(1, 1), (2, 3), (7, 3)]),
                                           (2, [(1, 2), (3, 2), (7, 3)]), (0, [(1, 4), (7, 3)])])
def test_the_first_run_of_a_batch_is_short_then_runs_merge_as_before(make_store, monkeypatch, first, layout):
    """The default reads the batch's first slot alone: the kernel serves a first request at a new offset
    without readahead; the next, sequential one opens the readahead window."""
    assert DiskOptions.read_first_run_slots == 1
    ks = keys(12)
    st_ = make_store(ks, read_first_run_slots=first)
    want = [ks[9], ks[2], ks[3], ks[1], ks[7], ks[8], ks[4]]     # slots 1-4 and 7-9, shuffled
    ops = [st_.op(k) for k in want]
    log = PreadvLog(monkeypatch)
    got = answers(st_, ops)
    sb = slot_bytes_for(ROW)
    assert [(off // sb, nbuf) for off, nbuf, _ in log.calls] == layout
    assert all(got[op.key].ok and bytes_ok(op, ROW) for op in ops)


def test_runs_are_capped_by_read_run_bytes(make_store, monkeypatch):
    ks = keys(6)
    st_ = make_store(ks, read_run_bytes=2 * ROW)
    ops = [st_.op(k) for k in reversed(ks[:5])]
    log = PreadvLog(monkeypatch)
    got = answers(st_, ops)
    assert [(off // ROW, n) for off, n, _ in log.calls] == [(0, 2), (2, 2), (4, 1)]
    assert all(got[op.key].ok and bytes_ok(op, ROW) for op in ops)


def test_blocks_smaller_than_their_slots_are_read_with_padding_between(make_store, monkeypatch):
    block = 5000                                 # slots of 8192 bytes
    ks = keys(4)
    st_ = make_store(ks, block=block)
    ops = [st_.op(k, st_.tokens[k]) for k in (ks[2], ks[0], ks[1])]
    for op in ops:
        op.dst[:] = b"\xee" * block          # garbage a wrong offset would leave or copy
    log = PreadvLog(monkeypatch)
    got = answers(st_, ops)
    sb = slot_bytes_for(block)
    assert log.calls == [(0, 5, 3 * block + 2 * (sb - block))]   # block, pad, block, pad, block
    assert all(got[op.key].ok and bytes_ok(op, block) for op in ops)


# ============================================================================ 2. each read its own outcome
def test_each_read_of_a_batch_keeps_its_own_outcome(make_store, monkeypatch):
    ks = keys(8)
    st_ = make_store(ks)
    st_.flip(ks[3])                                               # inside the run 1..5
    ops = {
        "ok1": st_.op(ks[1]), "ok2": st_.op(ks[2]), "corrupt": st_.op(ks[3]), "ok4": st_.op(ks[4]),
        "superseded": st_.op(ks[5], expect=uuid.uuid4()),         # the index holds another write
        "absent": st_.op(b"never-stored"),
        "ok7": st_.op(ks[7]),
    }
    log = PreadvLog(monkeypatch)
    got = answers(st_, list(ops.values()))
    by = {name: got[op.key] for name, op in ops.items()}
    assert [name for name, r in by.items() if r.ok] == ["ok1", "ok2", "ok4", "ok7"]
    assert all(bytes_ok(ops[n], ROW) for n in ("ok1", "ok2", "ok4", "ok7"))
    assert by["corrupt"].error.startswith("miss: corrupt (checksum")
    assert by["superseded"].error == "miss: superseded on disk"
    assert by["absent"].error == "miss: absent"
    assert st_.corrupt == ["checksum"] and st_.errors == []
    # 5, another writer's record, is read with its run and verified against its own fields: intact, a miss that
    # leaves it on disk (a record whose token field is damaged fails there: tests/test_review_round39_reads.py)
    assert [(off // ROW, n) for off, n, _ in log.calls] == [(1, 5), (7, 1)]


@pytest.mark.parametrize("block", [ROW, 5000])
def test_a_short_read_fails_only_the_reads_past_the_end_of_the_file(make_store, block):
    ks = keys(4)
    st_ = make_store(ks, block=block)
    os.truncate(st_.s.opts.path / SLOTS_NAME, 2 * slot_bytes_for(block) + 100)   # slot 2 cut short, 3 gone
    ops = [st_.op(k) for k in ks]
    got = answers(st_, ops)
    assert [got[k].ok for k in ks] == [True, True, False, False]
    assert all(bytes_ok(op, block) for op in ops[:2])
    assert all(got[k].error.startswith("miss: corrupt (truncated") for k in ks[2:])
    assert st_.corrupt == ["truncated", "truncated"]


# ============================================================================ 3. batch == single reads
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_batch_answers_what_single_reads_answer(tmp_path_factory, data):
    block = data.draw(st.sampled_from([ROW, 5000]), label="block")
    n = data.draw(st.integers(2, 10), label="keys")
    ks = keys(n)
    st_ = Store(tmp_path_factory.mktemp("d"), ks, block=block,
                read_run_bytes=data.draw(st.sampled_from([1, 2, 3, 64]), label="run_blocks") * block,
                read_first_run_slots=data.draw(st.sampled_from([0, 1, 2]), label="first_run_slots"))
    try:
        picked = data.draw(st.lists(st.sampled_from(ks + [b"absent"]), min_size=2, max_size=12), label="reads")
        damage = data.draw(st.dictionaries(st.sampled_from(ks), st.sampled_from(["flip", "stale"]), max_size=3),
                           label="damage")
        for k, how in damage.items():
            if how == "flip":
                st_.flip(k, offset=data.draw(st.integers(0, block - 1)))
        def ops() -> list[_Promote]:
            return [st_.op(k, uuid.uuid4() if damage.get(k) == "stale" else None) for k in picked]
        single = [(op, st_.s.readers._read(op)) for op in ops()]
        batch_ops = ops()
        got = [x for group in st_.s.readers._read_many(batch_ops) for x in group]
        assert sorted(id(op) for op, _ in got) == sorted(id(op) for op in batch_ops)
        by_op = {id(op): r for op, r in got}
        for (sop, sr), bop in zip(single, batch_ops):
            br = by_op[id(bop)]
            assert (br.ok, br.error) == (sr.ok, sr.error), (bop.key, br, sr)
            if br.ok:
                assert bytes(bop.dst) == bytes(sop.dst) == payload(bop.key, block)
    finally:
        st_.close()


def test_a_slot_reused_between_the_batch_lookup_and_its_read_is_a_superseded_miss(make_store, monkeypatch):
    """The batch looks every read up first; one read's entry is dropped and its slot rewritten for
    another key before the run is read: that read is a miss ("superseded"), never corruption, never
    the other key's bytes; its neighbours in the same run are served."""
    ks = keys(3)
    st_ = make_store(ks)
    held = threading.Event()
    go = threading.Event()
    real = os.preadv

    def preadv(fd: int, buffers: list, offset: int, *a: Any) -> int:
        if threading.current_thread().name == "batch" and not held.is_set():
            held.set()
            assert go.wait(30)
        return real(fd, buffers, offset, *a)

    monkeypatch.setattr(disk_mod.os, "preadv", preadv)
    ops = [st_.op(k) for k in ks]
    got: list = []
    t = threading.Thread(target=lambda: got.extend(x for g in st_.s.readers._read_many(ops) for x in g), name="batch")
    t.start()
    assert held.wait(30)                              # the records are looked up, no byte read yet
    st_.s.submit_delete(st_.tokens[ks[1]], ks[1])     # durability "none": slot 1 is free at once
    st_.write(b"intruder")                            # ... and takes slot 1
    assert st_.slots()[b"intruder"] == 1
    go.set()
    t.join(30)
    by = {op.key: r for op, r in got}
    assert len(got) == 3
    assert by[ks[1]].error == "miss: superseded on disk"
    assert by[ks[0]].ok and by[ks[2]].ok and bytes_ok(ops[0], ROW) and bytes_ok(ops[2], ROW)
    assert st_.corrupt == []


# ============================================================================ 4. faults
def test_a_failing_run_read_sends_its_reads_one_by_one(make_store, monkeypatch):
    ks = keys(5)
    st_ = make_store(ks)
    ops = [st_.op(k) for k in ks[:4]]
    log = PreadvLog(monkeypatch, fail=lambda off, bufs: len(bufs) > 1)   # only multi-block reads fail
    got = answers(st_, ops)
    assert all(got[op.key].ok and bytes_ok(op, ROW) for op in ops)
    assert [n for _, n, _ in log.calls] == [4, 1, 1, 1, 1]
    assert st_.errors == []


def test_an_unreadable_slot_fails_only_its_own_read(make_store, monkeypatch):
    ks = keys(4)
    st_ = make_store(ks)
    bad = slot_bytes_for(ROW) * 2
    PreadvLog(monkeypatch, fail=lambda off, bufs: len(bufs) > 1 or off == bad)
    ops = [st_.op(k) for k in ks]
    got = answers(st_, ops)
    assert [got[k].ok for k in ks] == [True, True, False, True]
    assert got[ks[2]].error.startswith("miss: read failed")
    assert st_.errors == ["io_error"]


def test_a_failing_read_of_a_lone_slot_is_reported_without_reading_it_again(make_store, monkeypatch):
    ks = keys(4)
    st_ = make_store(ks)
    bad = slot_bytes_for(ROW) * 2
    log = PreadvLog(monkeypatch, fail=lambda off, bufs: off == bad)
    ops = [st_.op(ks[0]), st_.op(ks[2])]              # two runs of one slot each
    got = answers(st_, ops)
    assert [off for off, _, _ in log.calls] == [0, bad]   # one attempt each
    assert got[ks[0]].ok and bytes_ok(ops[0], ROW)
    assert got[ks[2]].error.startswith("miss: read failed")
    assert st_.errors == ["io_error"]


def test_an_lmdb_error_in_the_batch_lookup_sends_the_reads_one_by_one(make_store, monkeypatch):
    ks = keys(3)
    st_ = make_store(ks)
    real = st_.s.readers._lookup
    calls = []

    def lookup(txn: Any, op: _Promote, t0: float) -> Any:
        calls.append(op.key)
        if len(calls) == 1:
            raise lmdb.ReadonlyError("injected")
        return real(txn, op, t0)

    monkeypatch.setattr(st_.s.readers, "_lookup", lookup)
    ops = [st_.op(k) for k in ks]
    got = answers(st_, ops)
    assert all(got[op.key].ok and bytes_ok(op, ROW) for op in ops)
    assert calls == [ks[0]] + ks          # the batch gave up at once; each read looked itself up


class Gate:
    """Holds a reader thread before it takes the reads queued behind its first one."""

    def __init__(self, store: DiskStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()
        self.batches: list[int] = []
        real = store.readers._take_queued

        def take(first: _Promote) -> Any:
            if not self.entered.is_set():
                self.entered.set()
                assert self.go.wait(30)
            ops, stop = real(first)
            self.batches.append(len(ops))
            return ops, stop

        monkeypatch.setattr(store.readers, "_take_queued", take)


def submit_as_one_batch(st_: Store, gate: Gate, ops: list[_Promote], release: bool = True) -> None:
    """Queue ``ops`` while the gate holds the reader after it took the first: it takes the rest at once."""
    for i, op in enumerate(ops):
        st_.s.queue_promote(op.token, op.key, op.expect, op.dst)
        st_.s.start_reads()
        if i == 0:
            assert gate.entered.wait(30)
    if release:
        gate.go.set()


def break_verify(st_: Store, monkeypatch: pytest.MonkeyPatch, key: bytes) -> Any:
    """Make the reader raise while verifying ``key``; returns the real ``_verify``."""
    real = st_.s.readers._verify

    def verify(op: _Promote, value: bytes, got: int, t0: float, h: Any) -> Report:
        if op.key == key:
            raise RuntimeError("bug in the read path")
        return real(op, value, got, t0, h)

    monkeypatch.setattr(st_.s.readers, "_verify", verify)
    return real


def test_an_exception_inside_a_reader_answers_every_read_it_took_and_the_reader_goes_on(make_store, monkeypatch):
    ks = keys(6)
    st_ = make_store(ks, num_readers=1)
    gate = Gate(st_.s, monkeypatch)
    real_verify = break_verify(st_, monkeypatch, ks[3])
    ops = [st_.op(k) for k in ks]
    submit_as_one_batch(st_, gate, ops)
    got = {op.key: st_.answer(op.token) for op in ops}
    assert gate.batches == [6]
    # slots 0..5 form one run: the exception came while its reports were being made
    assert [got[k].ok for k in ks] == [False] * 6
    assert all("bug in the read path" in r.error for r in got.values())
    assert all(r.error.startswith("miss: read failed") for r in got.values())
    assert st_.errors == ["reader_error"]
    assert st_.q.get(0.0) is None and not st_.early, "a read was answered twice"
    monkeypatch.setattr(st_.s.readers, "_verify", real_verify)
    # the reader is alive; the failed reads' entries were removed (token-matched), the others serve
    flushed = uuid.uuid4()
    st_.s.submit_flush(flushed)
    assert st_.answer(flushed).ok
    assert st_.slots() == {}
    st_.write(b"again")
    op = st_.op(b"again")
    st_.s.queue_promote(op.token, op.key, op.expect, op.dst)
    st_.s.start_reads()
    assert st_.answer(op.token).ok and bytes_ok(op, ROW)


def test_an_exception_after_some_runs_fails_only_the_reads_not_yet_answered(make_store, monkeypatch):
    ks = keys(6)
    st_ = make_store(ks, num_readers=1, read_run_bytes=2 * ROW)
    gate = Gate(st_.s, monkeypatch)
    break_verify(st_, monkeypatch, ks[4])
    ops = [st_.op(k) for k in reversed(ks)]
    submit_as_one_batch(st_, gate, ops)
    got = {op.key: st_.answer(op.token) for op in ops}
    assert [got[k].ok for k in ks] == [True, True, True, True, False, False]   # runs 0-1, 2-3 went out
    assert all(bytes_ok(op, ROW) for op in ops if got[op.key].ok)
    assert st_.q.get(0.0) is None and not st_.early


def test_a_runs_answers_leave_together_in_one_put(make_store, monkeypatch):
    """A reader hands its queue a run's answers in one call (the disk I/O process sends them as one frame:
    one wake-up of the owner per run, not per block), and those its lookups answered in another, first."""
    ks = keys(6)
    st_ = make_store(ks, read_run_bytes=3 * ROW)
    groups: list[list[uuid.UUID]] = []
    real = st_.q.put_many
    monkeypatch.setattr(st_.q, "put_many", lambda items: (groups.append([r.token for r in items]), real(items)))
    by_key = {k: st_.op(k) for k in (ks[5], ks[0], ks[1], ks[2], ks[4], ks[3])}
    absent = st_.op(b"absent")
    st_.s.readers._run(list(by_key.values()) + [absent])
    assert groups == [[absent.token], [by_key[k].token for k in ks[:3]], [by_key[k].token for k in ks[3:]]]
    assert all(st_.answer(op.token).ok and bytes_ok(op, ROW) for op in by_key.values())
    assert not st_.answer(absent.token).ok


# ============================================================================ 5. the reader thread
def test_take_queued_takes_at_most_a_bounded_number_of_reads(make_store):
    st_ = make_store([], read_batch_bytes=1 << 40)
    ops = [st_.op(b"k%d" % i) for i in range(disk_mod.READ_BATCH_MAX + 5)]
    for op in ops[1:]:
        st_.s.readers._reads.put(op)
    got, stop = st_.s.readers._take_queued(ops[0])
    assert got == ops[:disk_mod.READ_BATCH_MAX] and not stop
    assert st_.s.readers._reads.qsize() == 5


def test_take_queued_stops_at_the_batch_limit_and_at_a_stop_sentinel(make_store):
    ks = keys(6)
    st_ = make_store(ks, read_batch_bytes=3 * ROW)
    ops = [st_.op(k) for k in ks]
    for op in ops[1:]:
        st_.s.readers._reads.put(op)
    st_.s.readers._reads.put(None)
    got, stop = st_.s.readers._take_queued(ops[0])
    assert got == ops[:3] and not stop
    got, stop = st_.s.readers._take_queued(st_.s.readers._reads.get_nowait())
    assert got == ops[3:6] and not stop
    first = st_.op(ks[0])
    got, stop = st_.s.readers._take_queued(first)
    assert got == [first] and stop and st_.s.readers._reads.empty()


SHUFFLED = [5, 0, 7, 2, 1, 6, 3]   # slots asked for, in this order; slot 4 not: two runs in file order


def shuffled_reads(make_store: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Store, list[_Promote], PreadvLog]:
    """A store with one reader thread, reads of the keys in slots ``SHUFFLED``, and a log of its preadvs."""
    ks = keys(8)
    st_ = make_store(ks, num_readers=1)
    return st_, [st_.op(ks[i]) for i in SHUFFLED], PreadvLog(monkeypatch)


def read_in_file_order(st_: Store, ops: list[_Promote], log: PreadvLog) -> None:
    """Every read of ``shuffled_reads`` answered ok with its bytes, by two preadvs in file order."""
    got = {op.key: st_.answer(op.token) for op in ops}
    assert [(off // ROW, n) for off, n, _ in log.calls] == [(0, 4), (5, 3)]
    assert all(got[op.key].ok and bytes_ok(op, ROW) for op in ops)


def test_the_reader_thread_reads_a_queued_batch_in_file_order(make_store, monkeypatch):
    st_, ops, log = shuffled_reads(make_store, monkeypatch)
    gate = Gate(st_.s, monkeypatch)
    submit_as_one_batch(st_, gate, ops)
    read_in_file_order(st_, ops, log)
    assert gate.batches == [7]


def test_close_with_reads_and_stop_sentinels_in_one_batch_answers_every_read(tmp_path, monkeypatch):
    ks = keys(5)
    st_ = Store(tmp_path / "d", ks, num_readers=1)
    closer: Optional[threading.Thread] = None
    try:
        gate = Gate(st_.s, monkeypatch)
        ops = [st_.op(k) for k in ks]
        submit_as_one_batch(st_, gate, ops, release=False)
        closer = threading.Thread(target=st_.close)
        closer.start()
        deadline = time.monotonic() + 30
        while st_.s.readers._reads.qsize() < len(ops):         # 4 reads + the reader's stop sentinel queued
            assert time.monotonic() < deadline, "close() never queued the reader's stop sentinel"
            time.sleep(0.001)
        gate.go.set()
        closer.join(30)
        assert not closer.is_alive()
        got = [st_.answer(op.token, timeout=1) for op in ops]
        assert all(r.ok for r in got) and all(bytes_ok(op, ROW) for op in ops)
        assert gate.batches == [len(ops)]
    finally:
        gate.go.set()
        if closer is None:
            st_.close()


# ============================================================================ 6. through a manager
def _disk_only_keys(rig, n: int) -> tuple[Any, Any, list[bytes]]:
    """A manager (host tier of 20 slots) that stored 40 keys, its rows, and ``n`` of them only on disk."""
    kv = make_kv(24)
    mgr = rig.open(kv, host_slots=20, disk_slots=96)
    ks = keys(40, "m")
    store_seq(mgr, kv, ks)
    on_disk = [k for k in ks if mgr.host_bytes(k) is None]
    assert len(on_disk) >= n
    return mgr, kv, on_disk[:n]


def test_many_disk_only_keys_loaded_at_once_come_back_byte_for_byte(rig):
    mgr, kv, on_disk = _disk_only_keys(rig, 16)
    jobs = [(mgr.load(k, i), k, i) for i, k in enumerate(on_disk)]
    assert all(j is not None for j, _, _ in jobs)
    comps = {c.job.token: c for c in mgr.wait([j for j, _, _ in jobs], timeout=30)}
    for j, k, row in jobs:
        assert comps[j.token].ok, comps[j.token]
        assert row_is(kv, row, k)
    assert metric(mgr, "tiered_kv_corrupt_blocks_total", reason="checksum") == 0


# ============================================================================ 7. reads held by the owner
def record_batches(store: DiskStore, monkeypatch: pytest.MonkeyPatch) -> list[list[bytes]]:
    """The keys of each batch a reader thread takes, in the order it took them."""
    batches: list[list[bytes]] = []
    real = store.readers._take_queued

    def take(first: Any) -> Any:
        ops, stop = real(first)
        batches.append([op.key for op in ops])
        return ops, stop

    monkeypatch.setattr(store.readers, "_take_queued", take)
    return batches


def test_queued_promotes_wait_for_start_reads_then_go_as_one_batch_in_file_order(make_store, monkeypatch):
    st_, ops, log = shuffled_reads(make_store, monkeypatch)
    batches = record_batches(st_.s, monkeypatch)
    for op in ops:
        st_.s.queue_promote(op.token, op.key, op.expect, op.dst)
    # nothing reached a reader: queueing is a list append in the caller's thread, no wake-up
    assert st_.s.readers._reads.empty() and batches == [] and log.calls == []
    st_.s.start_reads()
    read_in_file_order(st_, ops, log)
    assert batches == [[op.key for op in ops]]           # the reader saw them all at once
    st_.s.start_reads()                                  # nothing held: nothing handed over
    assert st_.s.readers._reads.empty() and st_.q.get(0.0) is None


def test_start_reads_hands_over_batches_of_what_one_reader_takes(make_store):
    ks = keys(7)
    st_ = make_store(ks, read_batch_bytes=3 * ROW)       # no reader threads: the queue is left as handed over
    ops = [st_.op(k) for k in ks]
    for op in ops:
        st_.s.queue_promote(op.token, op.key, op.expect, op.dst)
    st_.s.start_reads()
    items = [st_.s.readers._reads.get_nowait() for _ in range(3)]
    assert items == [ops[0:3], ops[3:6], ops[6:7]] and st_.s.readers._reads.empty()
    # a reader takes a handed-over batch whole, and reads queued behind it up to its limit
    lone = st_.op(ks[0])
    st_.s.readers._reads.put(lone)
    st_.s.readers._reads.put(ops[2:4])
    got, stop = st_.s.readers._take_queued(ops[0:2])
    assert got == [ops[0], ops[1], lone] and not stop
    got, stop = st_.s.readers._take_queued(st_.s.readers._reads.get_nowait())
    assert got == ops[2:4] and not stop and st_.s.readers._reads.empty()


def test_close_reads_what_is_still_held(tmp_path):
    ks = keys(5)
    st_ = Store(tmp_path / "d", ks, num_readers=1)
    ops = [st_.op(k) for k in ks]
    for op in ops:
        st_.s.queue_promote(op.token, op.key, op.expect, op.dst)
    st_.close()
    got = [st_.answer(op.token, timeout=1) for op in ops]
    assert all(r.ok for r in got) and all(bytes_ok(op, ROW) for op in ops)
    assert st_.q.get(0.0) is None


@pytest.mark.disk_threads
def test_a_load_from_disk_starts_its_read_at_the_next_poll_not_in_the_call(rig, monkeypatch):
    mgr, kv, ks = _disk_only_keys(rig, 6)
    batches = record_batches(mgr.disk, monkeypatch)
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    assert all(j is not None for j in jobs)
    # the engine's calls queued the reads in this thread: none was handed to a reader
    assert len(mgr.disk.readers._held_reads) == 6 and mgr.disk.readers._reads.empty() and batches == []
    mgr.poll()
    assert mgr.disk.readers._held_reads == []
    comps = {c.job.token: c for c in mgr.wait(jobs, timeout=30)}
    assert all(comps[j.token].ok for j in jobs)
    assert all(row_is(kv, i, k) for i, k in enumerate(ks))
    assert batches == [ks]                                # one batch, taken whole by one reader


def test_wait_alone_starts_the_held_reads(rig):
    mgr, kv, ks = _disk_only_keys(rig, 3)
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    comps = mgr.wait(jobs, timeout=30)                    # no poll() in between: wait() hands them over
    assert len(comps) == 3 and all(c.ok for c in comps)
    assert all(row_is(kv, i, k) for i, k in enumerate(ks))


@pytest.mark.disk_threads
def test_loads_cancelled_or_invalidated_while_their_reads_are_held(rig):
    mgr, kv, ks = _disk_only_keys(rig, 3)
    a, b, c = ks
    ja, jb, jc = mgr.load(a, 0), mgr.load(b, 1), mgr.load(c, 2)
    assert ja is not None and jb is not None and jc is not None
    mgr.cancel(ja)
    mgr.invalidate(b)
    assert len(mgr.disk.readers._held_reads) == 3                 # still held: cancelling touched no reader
    comps = {x.job.token: x for x in mgr.wait(timeout=30)}
    assert set(comps) == {ja.token, jb.token, jc.token}   # each reported exactly once
    assert not comps[ja.token].ok and not comps[jb.token].ok
    assert comps[jc.token].ok and row_is(kv, 2, c)
    assert mgr.jobs_in_flight == 0 and mgr.debug_sizes()["jobs"] == 0
    # b is gone from every tier; a and c are still served with their own bytes
    assert mgr.lookup([b]) == 0 and mgr.load(b, 3) is None and mgr.host_bytes(b) is None
    for row, k in ((4, a), (5, c)):
        j = mgr.load(k, row)
        assert j is not None
        done = mgr.wait([j], timeout=30)
        assert [x.ok for x in done if x.job is j] == [True] and row_is(kv, row, k)


@pytest.mark.disk_threads
def test_a_row_freed_while_its_load_waits_on_a_held_read_is_never_written(rig, monkeypatch):
    """free_block() of a load whose read is still held: True at once (the load's copy to the row was
    never queued, so nothing can land there); the next poll() reports the load cancelled and starts
    the read, which the reader holds back until the engine has written the row again: it lands in
    the host tier only."""
    mgr, kv, (k,) = _disk_only_keys(rig, 1)
    row = 3
    gate = Gate(mgr.disk, monkeypatch)
    job = mgr.load(k, row)
    assert job is not None
    assert mgr.free_block(row) is True
    kv[row].fill_(7)                                     # the engine reuses the row
    done = mgr.poll()                                    # hands the read over; reports the load
    assert [(c.job.token, c.ok) for c in done] == [(job.token, False)] and "cancelled" in (done[0].error or "")
    assert gate.entered.wait(30)                         # the reader has the read, not yet its bytes
    gate.go.set()
    assert mgr.wait(timeout=30) == []                    # nothing more to report to the engine
    assert torch.equal(kv[row], torch.full_like(kv[row], 7))
    assert torch.equal(mgr.host_bytes(k), content(k))    # the promote itself completed
    again = mgr.load(k, 4)
    assert again is not None and [c.ok for c in mgr.wait([again], timeout=30)] == [True] and row_is(kv, 4, k)
