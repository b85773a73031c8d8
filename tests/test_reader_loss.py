"""Disk readers that die and cannot be replaced (``Readers._orphaned``, ``Readers.start``).

``tests/test_review_suspicions.py`` proves that a load from disk is answered once no reader is left.
Here: the failed replacement is counted; the reads queued when the last reader died are answered
``NOT_READ`` (a miss whose entry stays); and once threads can start again, the next pass starts a
reader and the same block is served from disk, its entry never dropped.

Deterministic: the readers die on an injected ``BaseException`` in their read path, their replacements
are refused by a patched ``Thread.start``; only bounded waits that detect a hang.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest

from disk_helpers import NS, ROW, content, keys, load_ok, make_kv, metric, rig, store_one  # noqa: F401
from tiered_kv.disk import DiskOptions, DiskStore
from tiered_kv.disk.readers import Readers
from tiered_kv.disk.records import NOT_READ, READ_FAILED
from tiered_kv.movers import CompletionQueue

__all__ = ["rig"]


class _Killed(BaseException):
    """What an asynchronous exception looks like to a reader thread."""


@pytest.mark.disk_threads
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_reads_are_answered_while_no_reader_can_start_and_served_once_one_can(rig, monkeypatch) -> None:
    kv = make_kv(8)
    # the disk readers' path (a blocked wait() would read a cached block itself)
    mgr = rig.open(kv, host_slots=2, host_evict_ahead_blocks=0, disk_read_cached_in_wait=False)
    ks = keys(6)
    for i, k in enumerate(ks):
        store_one(mgr, kv, k, i)
    assert mgr.disk is not None and mgr.host_bytes(ks[2]) is None and mgr.lookup([ks[2]]) == 1
    real_read, real_start = Readers._read, threading.Thread.start
    kills = {"left": 2}

    def read(self: Readers, op: Any) -> Any:
        if kills["left"]:
            kills["left"] -= 1
            raise _Killed("reader killed")
        return real_read(self, op)

    def start(self: threading.Thread) -> None:
        if self.name == "tiered-kv-disk-reader":
            raise RuntimeError("can't start new thread")
        real_start(self)

    errors0 = metric(mgr, "tiered_kv_errors_total", tier="disk", error="reader_error")
    monkeypatch.setattr(Readers, "_read", read)
    monkeypatch.setattr(threading.Thread, "start", start)
    for k, row in ((ks[0], 6), (ks[1], 7)):   # each kills the reader that takes it
        job = mgr.load(k, row)
        assert job is not None
        mgr.wait([job], timeout=30)
        assert job.state.value == "failed", job
    for t in list(mgr.disk.readers._threads):
        t.join(timeout=30)
    assert mgr.disk.readers._readerless
    # no reader: the read is answered at once, a miss that keeps the entry on disk
    job = mgr.load(ks[2], 5)
    assert job is not None
    mgr.wait([job], timeout=30)
    assert job.state.value == "failed" and "not read" in (job.error or ""), job
    assert mgr.lookup([ks[2]]) == 1, "a read nobody made dropped the entry"
    # the two deaths' failed replacements and the refused start of the pass: each counted
    assert metric(mgr, "tiered_kv_errors_total", tier="disk", error="reader_error") >= errors0 + 3
    # threads start again: the next pass starts a reader, and the block is served from disk
    monkeypatch.setattr(threading.Thread, "start", real_start)
    assert load_ok(mgr, kv, ks[2], 5)
    assert not mgr.disk.readers._readerless
    rig.close(mgr)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_reads_queued_behind_the_last_reader_when_it_dies_are_answered(tmp_path, monkeypatch) -> None:
    """One reader, one read per batch: it takes the first read, dies on it (that read answered failed) and
    cannot be replaced; the two reads queued behind it are answered ``NOT_READ`` by the dying reader
    instead of waiting for a reader that never comes, and their entries stay."""
    q = CompletionQueue()
    opts = DiskOptions(path=tmp_path / "d", namespace=NS, block_bytes=ROW, capacity_bytes=8 * ROW, durability="sync",
                       batch_blocks=8, batch_bytes=8 * ROW, batch_seconds=0.0, slots=8, num_readers=1,
                       read_batch_bytes=ROW)
    s = DiskStore(opts, q)
    seen: dict[uuid.UUID, Any] = {}

    def answer(token: uuid.UUID) -> Any:
        deadline = time.monotonic() + 30
        while token not in seen:
            item = q.get(max(0.0, deadline - time.monotonic()))
            assert item is not None, f"no answer for {token}: a read was left queued"
            seen[item.token] = item
        return seen.pop(token)

    bufs = []
    writes = {}
    real_start = threading.Thread.start
    try:
        for k in (b"a", b"b", b"c"):
            buf = bytearray(content(k, ROW).numpy().tobytes())
            bufs.append(buf)
            t = uuid.uuid4()
            assert s.submit_spill(t, k, memoryview(buf))
            assert answer(t).ok
            writes[k] = t
        real_read = Readers._read
        kills = {"left": 1}

        def read(self: Readers, op: Any) -> Any:
            if kills["left"]:
                kills["left"] -= 1
                raise _Killed("reader killed")
            return real_read(self, op)

        def start(self: threading.Thread) -> None:
            if self.name == "tiered-kv-disk-reader":
                raise RuntimeError("can't start new thread")
            real_start(self)

        monkeypatch.setattr(Readers, "_read", read)
        monkeypatch.setattr(threading.Thread, "start", start)
        reads = {}
        for k in (b"a", b"b", b"c"):
            p = uuid.uuid4()
            s.queue_promote(p, k, writes[k], memoryview(bytearray(ROW)))
            reads[k] = p
        s.start_reads()
        first = answer(reads[b"a"])
        assert not first.ok and first.error.startswith(READ_FAILED), first
        for k in (b"b", b"c"):
            r = answer(reads[k])
            assert not r.ok and r.error.startswith(NOT_READ), (k, r)
        monkeypatch.setattr(threading.Thread, "start", real_start)
        p = uuid.uuid4()                           # a reader starts again: the entry is still there
        dst = bytearray(ROW)
        s.queue_promote(p, b"b", writes[b"b"], memoryview(dst))
        s.start_reads()
        assert answer(p).ok and bytes(dst) == content(b"b", ROW).numpy().tobytes()
    finally:
        monkeypatch.setattr(threading.Thread, "start", real_start)
        s.close()
