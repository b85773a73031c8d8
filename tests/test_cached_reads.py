"""A blocked owner reads the blocks the page cache holds itself (tiered_kv/disk/cached.py).

``TierManager.wait()`` reads a promote's block on its own thread when its record is known
(``Entry.where``, from the spill's report or recovery) and the page cache holds the whole block
(``preadv2(RWF_NOWAIT)``), verified against the record made again from what the owner knows.
Everything else goes to the disk readers as before, which alone decide about corruption.  These
tests force each branch: served here, not cached (fake and real), partly cached, a stale record, a
damaged block, a record from recovery (and after a touch), a child that died with the read held, an
invalidated key, a file system without ``RWF_NOWAIT``, ``poll()`` (never reads here), the option off.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_kv import TieredKVConfig
from tiered_kv.disk import cached as cached_mod
from tiered_kv.disk.format import (NO_WHERE, CorruptEntry, pack_slot_entry, slot_bytes_for, slot_payload_verifies,
                                   record_where, verify_entry, where_of, where_slot)
from tiered_kv.disk.records import SpillGroup
from tiered_kv.errors import ConfigError
from tiered_kv.jobs import JobKind
from tiered_kv.reports import Report

from disk_helpers import (ROW, Rig, disk_only_keys, keys, load_ok, make_kv, metric_sum, rig, row_is,  # noqa: F401
                          restart_disk_process, slot_file, store_one)

pytestmark = pytest.mark.timeout(120)

IO = ["process", "thread"]


def _offset(mgr, key: bytes) -> int:  # type: ignore[no-untyped-def]
    """The slot file offset of ``key``'s block, from the owner's record of it."""
    return where_slot(mgr._core.dindex.ready(key).where) * slot_bytes_for(mgr.row_bytes)


def _flip(path: Path, off: int) -> None:
    fd = os.open(slot_file(path), os.O_RDWR)
    try:
        b = os.pread(fd, 1, off)
        os.pwrite(fd, bytes([b[0] ^ 0x5A]), off)
    finally:
        os.close(fd)


def _reads(mgr):  # type: ignore[no-untyped-def]
    """The store's counts of the owner's page-cache reads, checked against what Prometheus was given."""
    c = mgr.disk.cached
    mgr.poll()   # the counter follows once per step
    assert (metric_sum(mgr, "tiered_kv_disk_page_cache_reads_total", outcome="served"),
            metric_sum(mgr, "tiered_kv_disk_page_cache_reads_total", outcome="handed_on")) == (c.served, c.passed)
    return c.served, c.passed


def _stale(mgr, kind: str) -> float:  # type: ignore[no-untyped-def]
    return metric_sum(mgr, "tiered_kv_stale_callbacks_total", kind=kind)


def _corrupt(mgr) -> float:  # type: ignore[no-untyped-def]
    return metric_sum(mgr, "tiered_kv_corrupt_blocks_total")


# ---------------------------------------------------------------------------------------------- the record
def _slot_record(ns: bytes, key: bytes, token: uuid.UUID, length: int, where: int) -> bytes:
    """The index record ``where`` reduced, made again from the fields given (what the owner's check stands for)."""
    from tiered_kv.disk.format import FLAG_SLOT, FORMAT_VERSION, HEADER_STRUCT

    head = HEADER_STRUCT.pack(b"TKVB", FORMAT_VERSION, FLAG_SLOT, len(ns), len(key), length,
                              (where >> 64) & ((1 << 64) - 1), token.bytes)
    return head + (where & ((1 << 64) - 1)).to_bytes(8, "little") + ns + key + where_slot(where).to_bytes(8, "little")


@settings(max_examples=300, deadline=None)
@given(ns=st.binary(max_size=40), key=st.binary(min_size=1, max_size=600), payload=st.binary(min_size=1, max_size=300),
       seq=st.integers(0, (1 << 64) - 1), slot=st.integers(0, (1 << 48) - 1), tok=st.integers(0, (1 << 128) - 1),
       flip=st.integers(0, 1 << 20), what=st.sampled_from(["none", "payload", "token", "key", "ns", "seq"]))
def test_the_owners_copy_of_a_record_checks_like_the_readers_check(ns, key, payload, seq, slot, tok, flip,  # type: ignore[no-untyped-def]
                                                                   what) -> None:
    """The owner's check of a block it read equals verify_entry of the record it reduced (made again),
    for the block written and for one that differs in any field the checksum covers."""
    token = uuid.UUID(int=tok)
    rec = pack_slot_entry(ns, key, token, payload, seq, slot)
    w = where_of(rec)
    assert w != NO_WHERE and where_slot(w) == slot and record_where(rec, slot, seq) == w
    assert _slot_record(ns, key, token, len(payload), w) == rec
    got = bytearray(payload)
    k2, ns2, tok2, w2 = key, ns, token, w
    if what == "payload":
        got[flip % len(got)] ^= 1 + flip % 255
    elif what == "token":
        tok2 = uuid.UUID(int=tok ^ (1 << (flip % 128)))
    elif what == "key":
        k2 = key + b"x"
    elif what == "ns":
        ns2 = ns + b"x"
    elif what == "seq":
        w2 = w ^ (1 << (64 + flip % 64))
    try:
        verify_entry(_slot_record(ns2, k2, tok2, len(got), w2), ns2, k2, len(got), got)
        readers_ok = True
    except CorruptEntry:
        readers_ok = False
    assert slot_payload_verifies(ns2, k2, tok2, w2, got) is readers_ok is (what == "none")


def test_an_inline_or_unreadable_record_has_no_where() -> None:
    from tiered_kv.disk.format import pack_header

    inline = pack_header(b"n", b"k", uuid.UUID(int=5), b"xyz", 3) + b"xyz"
    assert where_of(inline) == NO_WHERE
    assert where_of(b"junk") == NO_WHERE


def test_a_spill_groups_report_names_each_written_parts_record() -> None:
    g = SpillGroup(uuid.UUID(int=1), 3)
    assert g.answer(0, Report(uuid.UUID(int=1), JobKind.SPILL, True, None, 4, 0.0, None, [11])) is None
    assert g.answer(1, Report(uuid.UUID(int=2), JobKind.SPILL, False, "disk full")) is None
    r = g.answer(2, Report(uuid.UUID(int=3), JobKind.SPILL, True, None, 4, 0.0, None, [33]))
    assert r is not None and r.where == [11, 0, 33] and r.failed == {1: "disk full"}


# ---------------------------------------------------------------------------------------------- served here
@pytest.mark.parametrize("io", IO)
def test_a_blocked_wait_reads_a_cached_block_itself(rig: Rig, io: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kv, mgr, ks = disk_only_keys(rig, io)
    sent: list[object] = []
    if io == "process":
        from tiered_kv.disk import proc

        real = proc._frame
        monkeypatch.setattr(proc, "_frame", lambda obj: (sent.append(obj), real(obj))[1])
    for i, k in enumerate(ks):
        assert load_ok(mgr, kv, k, i)
    assert _reads(mgr) == (len(ks), 0)
    assert not any(op[0] == "P" for f in sent for op in f)   # type: ignore[attr-defined]
    # the promote was a use (its touch went to the writer) and the block is in the host tier now
    assert all(mgr.host_bytes(k) is not None for k in ks)
    assert _stale(mgr, "promote") == 0 and _corrupt(mgr) == 0


@pytest.mark.parametrize("io", IO)
def test_poll_never_reads_on_the_engines_thread(rig: Rig, io: str) -> None:
    kv, mgr, ks = disk_only_keys(rig, io)
    job = mgr.load(ks[0], 0)
    assert job is not None
    deadline = time.monotonic() + 30
    while not job.done and time.monotonic() < deadline:
        mgr.poll()
    assert job.state.name == "DONE" and row_is(kv, 0, ks[0])
    assert _reads(mgr) == (0, 0)


@pytest.mark.parametrize("io", IO)
def test_the_option_off_sends_every_read_to_the_disk_readers(rig: Rig, io: str) -> None:
    kv, mgr, ks = disk_only_keys(rig, io, disk_read_cached_in_wait=False)
    assert load_ok(mgr, kv, ks[0], 0)
    assert _reads(mgr) == (0, 0)


# ---------------------------------------------------------------------------------------------- a chunk per pass
def _chunks_of(mgr, k: int) -> list[tuple[str, object]]:  # type: ignore[no-untyped-def]
    """Page-cache reads of at most ``k`` blocks per pass; returns the events, in order: ``("read", n)`` per
    ``CachedReads.read`` of ``n`` ops, ``("hold", on)`` per ``mover.hold``, ``("help", None)`` per ``help_one``."""
    cached, mover = mgr.disk.cached, mgr._mover
    cached.chunk_ops = k
    events: list[tuple[str, object]] = []
    real_read, real_hold, real_help = cached.read, mover.hold, mover.help_one
    cached.read = lambda ops, until=None: (events.append(("read", len(ops))), real_read(ops, until))[1]
    mover.hold = lambda on: (events.append(("hold", on)), real_hold(on))[1]
    mover.help_one = lambda: (events.append(("help", None)), real_help())[1]
    return events


@pytest.mark.parametrize("io", IO)
def test_a_batch_is_read_a_chunk_per_pass_with_the_copies_of_each_started_before_the_next(rig: Rig, io: str) -> None:
    """Five blocks, two per pass: three passes; before the second and the third, the copies of the blocks
    read so far were handed to the mover's threads (``hold(False)``), not made on the owner's thread."""
    kv, mgr, ks = disk_only_keys(rig, io, n=5)
    events = _chunks_of(mgr, 2)
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    mgr.wait(jobs, timeout=30)
    assert all(j is not None and j.state.name == "DONE" for j in jobs)
    assert all(row_is(kv, i, k) for i, k in enumerate(ks))
    reads = [i for i, (what, _) in enumerate(events) if what == "read"]
    assert [events[i][1] for i in reads] == [2, 2, 1]
    for a, b in zip(reads, reads[1:]):
        between = events[a + 1:b]
        assert ("hold", False) in between and ("help", None) not in between, events
    assert _reads(mgr) == (5, 0)
    assert not mgr.disk.reads_held and _stale(mgr, "promote") == 0


@pytest.mark.parametrize("io", IO)
def test_a_block_not_cached_in_a_later_chunk_hands_it_and_all_after_it_on(rig: Rig, io: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    kv, mgr, ks = disk_only_keys(rig, io, n=5)
    offs = {k: _offset(mgr, k) for k in ks}
    events = _chunks_of(mgr, 2)
    asked = _refuse_offsets(monkeypatch, {offs[ks[2]]})
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    mgr.wait(jobs, timeout=30)
    assert all(j is not None and j.state.name == "DONE" for j in jobs)
    assert all(row_is(kv, i, k) for i, k in enumerate(ks))
    assert asked == [offs[k] for k in ks[:3]]   # the fourth and fifth not tried here
    assert [n for what, n in events if what == "read"] == [2, 2]
    assert _reads(mgr) == (2, 3)


@pytest.mark.parametrize("io", IO)
def test_a_wait_that_returns_with_reads_held_hands_them_on(rig: Rig, io: str) -> None:
    """``wait([first])`` returns once the first load is done: the reads of the others still held go to the disk
    I/O side then, never left held behind a blocking call (a ``poll()``-only engine would still get them, later)."""
    kv, mgr, ks = disk_only_keys(rig, io, n=4)
    _chunks_of(mgr, 1)
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    assert all(j is not None for j in jobs)
    mgr.wait(jobs[:1], timeout=30)
    assert jobs[0].state.name == "DONE" and row_is(kv, 0, ks[0])
    assert not mgr.disk.reads_held
    deadline = time.monotonic() + 30
    while not all(j.done for j in jobs) and time.monotonic() < deadline:
        mgr.poll()   # the disk I/O side's answers (poll() reads nothing itself)
    assert all(j.state.name == "DONE" for j in jobs) and all(row_is(kv, i, k) for i, k in enumerate(ks))
    served, passed = _reads(mgr)
    assert 1 <= served <= 4 and passed == 0   # (the reads sent on unread were not looked at: neither count)


@pytest.mark.parametrize("io", IO)
@pytest.mark.parametrize("at", [1, 2, 3, 4, 5])
def test_an_interrupt_in_any_chunks_read_loses_no_read_and_reads_none_twice(rig: Rig, io: str, at: int,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Five blocks, two per pass: the ``at``-th page-cache read raises KeyboardInterrupt (SIGINT in ``preadv``).
    The next wait() answers every load once, with its bytes; no read's report comes twice."""
    kv, mgr, ks = disk_only_keys(rig, io, n=5)
    _chunks_of(mgr, 2)
    real = cached_mod._PREADV
    calls: list[int] = []

    def preadv(fd, bufs, off, flags):  # type: ignore[no-untyped-def]
        calls.append(off)
        if len(calls) == at:
            raise KeyboardInterrupt
        return real(fd, bufs, off, flags)

    monkeypatch.setattr(cached_mod, "_PREADV", preadv)
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    assert all(j is not None for j in jobs)
    with pytest.raises(KeyboardInterrupt):
        mgr.wait(jobs, timeout=30)
    got = mgr.wait(jobs, timeout=30) + mgr.poll()
    assert all(j.state.name == "DONE" for j in jobs) and all(row_is(kv, i, k) for i, k in enumerate(ks))
    assert sorted(id(c.job) for c in got) == sorted(id(j) for j in jobs)   # each reported once
    assert _stale(mgr, "promote") == 0 and _stale(mgr, "load") == 0
    assert not mgr.disk.reads_held


def test_the_disk_process_dying_between_two_chunks_answers_each_held_read_once(rig: Rig) -> None:
    """Three blocks, one per pass; the disk I/O process is killed after the first pass, as the second chunk's
    read begins, and its receiver answers every op it had -- the read under way and the one still held --
    failed.  The read under way is not answered twice (its served report is dropped), the held one is not read
    here, the first load is served, each load is reported once, nothing stays held."""
    kv, mgr, ks = disk_only_keys(rig, "process", n=3)
    store = mgr.disk
    _chunks_of(mgr, 1)
    real = store.cached.read
    reads: list[int] = []

    def die_then_read(ops, until=None):  # type: ignore[no-untyped-def]
        reads.append(len(ops))
        if len(reads) == 2:
            store.kill_for_test(signal.SIGKILL)
            deadline = time.monotonic() + 30
            while not store.down and time.monotonic() < deadline:   # the receiver's answers are in (not an ordering sleep)
                time.sleep(0.01)
            assert store.down
        return real(ops, until)

    store.cached.read = die_then_read
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    assert all(j is not None for j in jobs)
    got = mgr.wait(jobs, timeout=30) + mgr.poll()
    assert reads == [1, 1], reads   # the read held when it died was not read here
    assert sorted(id(c.job) for c in got) == sorted(id(j) for j in jobs)   # each reported once
    assert jobs[0].state.name == "DONE" and row_is(kv, 0, ks[0])
    assert [j.state.name for j in jobs[1:]] == ["FAILED", "FAILED"]
    assert _stale(mgr, "promote") == 0 and _stale(mgr, "load") == 0
    assert not mgr.disk.reads_held


# ---------------------------------------------------------------------------------------------- not cached
def _refuse_offsets(monkeypatch: pytest.MonkeyPatch, refused: set[int]) -> list[int]:
    """preadv2 answers EAGAIN (not in the page cache) at these file offsets; returns the offsets asked."""
    real = cached_mod._PREADV
    asked: list[int] = []

    def preadv(fd, bufs, off, flags):  # type: ignore[no-untyped-def]
        asked.append(off)
        if off in refused:
            raise BlockingIOError(errno.EAGAIN, "would block")
        return real(fd, bufs, off, flags)

    monkeypatch.setattr(cached_mod, "_PREADV", preadv)
    return asked


@pytest.mark.parametrize("io", IO)
def test_after_the_first_block_not_cached_the_rest_go_to_the_disk_readers(
        rig: Rig, io: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kv, mgr, ks = disk_only_keys(rig, io, n=3)
    offs = {k: _offset(mgr, k) for k in ks}
    asked = _refuse_offsets(monkeypatch, {offs[ks[1]]})
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    mgr.wait(jobs, timeout=30)
    assert all(j is not None and j.state.name == "DONE" for j in jobs)
    assert all(row_is(kv, i, k) for i, k in enumerate(ks))
    assert asked == [offs[ks[0]], offs[ks[1]]]   # the third not tried: a cold batch costs one refused call
    assert _reads(mgr) == (1, 2)


@pytest.mark.parametrize("io", IO)
@pytest.mark.parametrize("answer", [False, None])
def test_a_block_not_cached_is_asked_about_before_it_is_read(rig: Rig, io: str, answer: Optional[bool],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """mincore says "not cached": no RWF_NOWAIT read (whose refusal would start a readahead beside the
    disk reader's read); it cannot tell (None): the read decides."""
    from tiered_kv import pages

    kv, mgr, ks = disk_only_keys(rig, io, n=2)
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(pages.FileResidency, "cached", lambda self, off, n: (asked.append((off, n)), answer)[1])
    tried = _refuse_offsets(monkeypatch, set())
    jobs = [mgr.load(k, i) for i, k in enumerate(ks)]
    mgr.wait(jobs, timeout=30)
    assert all(j is not None and j.state.name == "DONE" for j in jobs) and all(row_is(kv, i, k) for i, k in enumerate(ks))
    if answer is False:
        assert asked == [(_offset(mgr, ks[0]), ROW)] and tried == [] and _reads(mgr) == (0, 2)
    else:
        assert len(asked) == 2 and len(tried) == 2 and _reads(mgr) == (2, 0)


def test_file_residency_follows_the_page_cache_and_the_files_growth(tmp_path: Path) -> None:
    from tiered_kv.pages import PAGE, FileResidency

    f = tmp_path / "slots"
    f.write_bytes(os.urandom(16 * PAGE))
    fd = os.open(f, os.O_RDWR)
    try:
        r = FileResidency(fd)
        assert r.cached(0, 16 * PAGE) is True and r.cached(PAGE + 5, 3) is True
        assert r.cached(15 * PAGE, 2 * PAGE) is False        # past the end: not cached (nothing to read)
        os.pwrite(fd, os.urandom(8 * PAGE), 16 * PAGE)        # the file grows: mapped again, longer
        assert r.cached(16 * PAGE, 8 * PAGE) is True
        if _fs_type(tmp_path) not in ("tmpfs", "ramfs"):
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            assert r.cached(0, PAGE) is False
            os.pread(fd, PAGE, 3 * PAGE)
            assert r.cached(3 * PAGE, PAGE) is True and r.cached(3 * PAGE, 2 * PAGE) is False
        r.close()
        r.close()
    finally:
        os.close(fd)


@pytest.mark.parametrize("io", IO)
def test_a_block_the_page_cache_dropped_is_read_by_the_disk_readers(rig: Rig, io: str) -> None:
    kv, mgr, ks = disk_only_keys(rig, io, n=1)
    if _fs_type(rig.path) in ("tmpfs", "ramfs"):
        pytest.skip("the slot file's pages are its storage here: nothing to drop")
    fd = os.open(slot_file(rig.path), os.O_RDONLY)
    try:   # (no probe of it: a refused RWF_NOWAIT read starts the readahead that caches the block again)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)   # clean pages (flushed): dropped
    finally:
        os.close(fd)
    assert load_ok(mgr, kv, ks[0], 0)
    assert _reads(mgr) == (0, 1)
    assert _corrupt(mgr) == 0


def _fs_type(path: Path) -> str:
    """The file system type of the mount holding ``path`` (/proc/self/mounts, longest prefix)."""
    best, kind = "", ""
    p = str(path.resolve())
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1].replace("\\040", " ")
            if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, parts[2]
    return kind


# ---------------------------------------------------------------------------------------------- refused records
@pytest.mark.parametrize("io", IO)
def test_a_stale_record_is_not_served_and_is_not_called_corrupt(rig: Rig, io: str) -> None:
    """The owner's record names another block's slot (as after a slot reuse): its check fails on the
    bytes there, and the disk readers, which read the index, serve the right block."""
    kv, mgr, ks = disk_only_keys(rig, io, n=2)
    dindex = mgr._core.dindex
    a, b = dindex.ready(ks[0]), dindex.ready(ks[1])
    a.where = b.where
    assert load_ok(mgr, kv, ks[0], 0)
    assert _reads(mgr) == (0, 1)
    assert _corrupt(mgr) == 0 and mgr.host_bytes(ks[0]) is not None


@pytest.mark.parametrize("io", IO)
def test_a_damaged_block_is_left_to_the_disk_readers_which_count_it_once(rig: Rig, io: str) -> None:
    kv, mgr, ks = disk_only_keys(rig, io, n=1)
    _flip(rig.path, _offset(mgr, ks[0]) + 100)
    assert not load_ok(mgr, kv, ks[0], 0)
    assert _reads(mgr) == (0, 1)
    assert _corrupt(mgr) == 1
    assert mgr.lookup([ks[0]]) == 0


@pytest.mark.parametrize("io", IO)
def test_the_written_parts_of_a_spill_with_a_cancelled_part_get_their_records(rig: Rig, io: str) -> None:
    """A spill job whose report is applied part by part (one of its keys invalidated in flight): the
    parts written still get their records."""
    from disk_helpers import fill

    kv = make_kv(rows=8)
    mgr = rig.open(kv, host_slots=8, disk_slots=64, disk_io=io)
    a, b = b"part-a", b"part-b"
    fill(kv, 0, a)
    fill(kv, 1, b)
    job = mgr.store_many([a, b], [0, 1])
    assert job is not None
    mgr.wait([job], timeout=30)            # published: their one spill job is on its way, its report not applied
    mgr.invalidate(b)                      # (reports are applied on this thread only: before that report)
    assert mgr.flush(timeout=30)
    assert metric_sum(mgr, "tiered_kv_stale_callbacks_total", kind="spill") == 1
    for i, k in enumerate(keys(8, "push")):
        store_one(mgr, kv, k, i % 8)
    assert mgr.host_bytes(a) is None and mgr._core.dindex.ready(a).where != NO_WHERE
    assert load_ok(mgr, kv, a, 2)
    assert _reads(mgr) == (1, 0)


# ---------------------------------------------------------------------------------------------- records from recovery
@pytest.mark.parametrize("io", IO)
def test_recovery_gives_the_owner_each_entrys_record_also_after_a_touch(rig: Rig, io: str) -> None:
    kv, mgr, ks = disk_only_keys(rig, io, n=2)
    assert load_ok(mgr, kv, ks[0], 0)          # a promote: its touch numbers ks[0]'s recency past its write
    assert mgr.flush(timeout=30)
    mgr.close()
    mgr = rig.open(kv, host_slots=8, disk_slots=64, disk_io=io)
    d = mgr._core.dindex.ready(ks[0])
    assert d is not None and d.where != NO_WHERE
    for i, k in enumerate(ks):
        assert load_ok(mgr, kv, k, i)
    assert _reads(mgr) == (2, 0)


# ---------------------------------------------------------------------------------------------- races
def test_a_read_the_dead_childs_answer_took_is_not_answered_twice(rig: Rig) -> None:
    """The read is held (load() made it), the child dies and its receiver answers every op it had,
    this one failed; the owner does not read it from the page cache then (nor count it): no second report."""
    kv, mgr, ks = disk_only_keys(rig, "process", n=1)
    store = mgr.disk
    real = store.cached.read
    read_here: list[int] = []
    store.cached.read = lambda ops, until=None: (lambda r: (read_here.append(len(r[0])), r)[1])(real(ops, until))
    job = mgr.load(ks[0], 0)
    assert job is not None
    store.kill_for_test(signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not store.down and time.monotonic() < deadline:   # the receiver's answers are in (not an ordering sleep)
        time.sleep(0.01)
    assert store.down
    mgr.wait([job], timeout=30)
    assert job.state.name == "FAILED"
    assert read_here == [] and store.cached.served == 0   # not read here: the failed answer came first
    assert _reads(mgr) == (0, 0)                   # (so not counted, served or handed on)
    assert _stale(mgr, "promote") == 0 and _stale(mgr, "load") == 0


def test_the_page_cache_reads_counter_goes_on_across_a_restart_of_the_disk_process(rig: Rig) -> None:
    """The counter adds what each store (the restarted process's too, which counts from zero) read."""
    kv, mgr, ks = disk_only_keys(rig, "process", n=3)
    assert load_ok(mgr, kv, ks[0], 0)
    assert _reads(mgr) == (1, 0)
    restart_disk_process(mgr)
    for i, k in enumerate(ks[1:], 1):
        assert load_ok(mgr, kv, k, i)
    mgr.poll()
    assert mgr.disk.cached.served == 2
    assert metric_sum(mgr, "tiered_kv_disk_page_cache_reads_total", outcome="served") == 3
    assert metric_sum(mgr, "tiered_kv_disk_page_cache_reads_total", outcome="handed_on") == 0


@pytest.mark.parametrize("io", IO)
def test_a_key_invalidated_while_its_read_is_held_is_discarded(rig: Rig, io: str) -> None:
    kv, mgr, ks = disk_only_keys(rig, io, n=1)
    job = mgr.load(ks[0], 0)
    assert job is not None
    mgr.invalidate(ks[0])
    mgr.wait(timeout=30)
    assert job.state.name == "CANCELLED"
    assert mgr.lookup([ks[0]]) == 0 and mgr.host_bytes(ks[0]) is None
    assert metric_sum(mgr, "tiered_kv_stale_callbacks_total", kind="promote", reason="superseded") == 1


# ---------------------------------------------------------------------------------------------- the file system
@pytest.mark.parametrize("io", IO)
@pytest.mark.parametrize("refusal", [OSError(errno.EOPNOTSUPP, "Operation not supported"),
                                     OSError(errno.ENOSYS, "Function not implemented"),
                                     NotImplementedError("preadv2 flags")], ids=["EOPNOTSUPP", "ENOSYS", "no-preadv2"])
def test_a_file_system_without_nowait_reads_turns_it_off_once(rig: Rig, io: str, refusal: BaseException,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    kv, mgr, ks = disk_only_keys(rig, io, n=2)
    calls = []

    def preadv(fd, bufs, off, flags):  # type: ignore[no-untyped-def]
        calls.append(off)
        raise refusal

    monkeypatch.setattr(cached_mod, "_PREADV", preadv)
    with caplog.at_level(logging.INFO, logger="tiered_kv.disk.cached"):
        for i, k in enumerate(ks):
            assert load_ok(mgr, kv, k, i)
    assert len(calls) == 1 and mgr.disk.cached.enabled is False
    assert sum("RWF_NOWAIT" in r.getMessage() for r in caplog.records) == 1


# ---------------------------------------------------------------------------------------------- the option
def test_the_option_must_be_a_bool_and_reads_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="disk_read_cached_in_wait"):
        TieredKVConfig(namespace="n", host_capacity_bytes=1 << 20, disk_read_cached_in_wait="yes")  # type: ignore[arg-type]
    monkeypatch.setenv("TIERED_KV_NAMESPACE", "n")
    monkeypatch.setenv("TIERED_KV_HOST_CAPACITY_BYTES", str(1 << 20))
    monkeypatch.setenv("TIERED_KV_DISK_READ_CACHED_IN_WAIT", "off")
    assert TieredKVConfig.from_env().disk_read_cached_in_wait is False
    assert TieredKVConfig(namespace="n", host_capacity_bytes=1 << 20).disk_read_cached_in_wait is True
