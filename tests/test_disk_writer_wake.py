"""When queueing an op wakes the disk writer (``Writer._wake_writer``, tiered_kv/disk/writer.py).

The writer waits for a first op, then fills its batch until the batch is full,
a flush comes, or ``batch_seconds`` pass.  A push wakes it only when that
changes what it does next:

1. a writer waiting for work is woken by any op;
2. a writer filling a batch is not woken by an op that leaves the batch short
   (touches, a spill short of ``batch_blocks``), so it sleeps on to the
   deadline instead of switching in once per op;
3. it is woken by the op that completes the batch (by count or by bytes) and
   by a flush, which therefore never wait for the deadline;
4. a recency touch wakes no one, not even a writer waiting for work: it
   leaves with the next op's batch, or the writer finds it on its idle
   wake-up (``IDLE_WAKE_S``).

The deadline is set to minutes, so a missing wake-up shows as a test that does
not finish (bounded waits of 30 s), not as a timing.  Ordering is observed
through the store's own state under its condition lock; no sleeps.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import tiered_kv.disk.writer as disk_mod
from disk_helpers import NS, ROW, content
from tiered_kv.disk import DiskOptions, DiskStore, FlushDone
from tiered_kv.movers import CompletionQueue

# the writer's own hooks and internals: the in-process threads (tests/test_disk_process.py has the process)
pytestmark = pytest.mark.disk_threads

LONG = 600.0   # batch_seconds: a batch that waits for its deadline never leaves within the test


class Notifies:
    """Counts ``_cond.notify()`` calls made by pushes."""

    def __init__(self, store: DiskStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = store.writer._cond.notify

        def notify(n: int = 1) -> None:
            self.count += 1
            real(n)

        monkeypatch.setattr(store.writer._cond, "notify", notify)


def open_store(path: Path, batch_blocks: int = 4, batch_bytes: int = 4 * ROW) -> DiskStore:
    """A store whose batches wait LONG for their deadline; its answers on ``store.q``."""
    q = CompletionQueue()
    s = DiskStore(DiskOptions(path=path, namespace=NS, block_bytes=ROW, capacity_bytes=64 * ROW,
                              durability="none", batch_blocks=batch_blocks, batch_bytes=batch_bytes,
                              batch_seconds=LONG, slots=64, num_readers=0), q)
    s.q = q   # type: ignore[attr-defined]
    return s


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = open_store(tmp_path / "d")
    yield s
    s.close()   # close() wakes the writer whatever it waits for


def wait_until(pred: Any, what: str, store: DiskStore) -> None:
    deadline = time.monotonic() + 30
    while True:
        with store.writer._cond:
            if pred():
                return
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def filling(store: DiskStore, n_ops: int) -> None:
    """Wait until the writer holds ``n_ops`` ops and sleeps on its batch deadline."""
    wait_until(lambda: store.writer._filling and store.writer._fill[0] == n_ops and not store.writer._ops,
               f"the writer never held {n_ops} ops while filling", store)


def spill(store: DiskStore, key: bytes) -> uuid.UUID:
    tok = uuid.uuid4()
    assert store.submit_spill(tok, key, memoryview(bytearray(content(key).numpy().tobytes())))
    return tok


def answers(store: DiskStore, n: int) -> list[Any]:
    out = []
    for _ in range(n):
        item = store.q.get(30)   # type: ignore[attr-defined]
        assert item is not None, f"only {len(out)} of {n} answers within 30 s: the writer was not woken"
        out.append(item)
    return out


def test_a_waiting_writer_is_woken_by_the_first_op(store, monkeypatch):
    wait_until(lambda: not store.writer._filling and not store.writer._ops, "writer never idle", store)
    n = Notifies(store, monkeypatch)
    spill(store, b"a")
    assert n.count == 1
    filling(store, 1)


def test_ops_that_leave_the_batch_short_do_not_wake_a_filling_writer(store, monkeypatch):
    spill(store, b"a")
    filling(store, 1)
    n = Notifies(store, monkeypatch)
    store.submit_touch(b"a")
    store.submit_delete(uuid.uuid4(), b"zz")  # 3 of 4: still short
    assert n.count == 0
    with store.writer._cond:
        assert len(store.writer._ops) == 2 and store.writer._fill[0] == 1   # queued; the writer sleeps on


def test_the_op_that_completes_a_batch_wakes_the_writer(store, monkeypatch):
    t1 = spill(store, b"a")
    filling(store, 1)
    n = Notifies(store, monkeypatch)
    t2 = spill(store, b"b")
    store.submit_touch(b"a")
    assert n.count == 0
    t4 = spill(store, b"c")                   # 1 held + 3 queued = batch_blocks
    assert n.count == 1
    got = answers(store, 3)                   # committed long before the 600 s deadline
    assert {r.token for r in got} == {t1, t2, t4} and all(r.ok for r in got)


def test_a_batch_full_by_bytes_wakes_the_writer(tmp_path, monkeypatch):
    s = open_store(tmp_path / "d", batch_blocks=64, batch_bytes=2 * ROW)
    try:
        t1 = spill(s, b"a")
        filling(s, 1)
        n = Notifies(s, monkeypatch)
        t2 = spill(s, b"b")                   # 2 x ROW = batch_bytes
        assert n.count == 1
        assert {r.token for r in answers(s, 2)} == {t1, t2}
    finally:
        s.close()


def test_a_flush_wakes_a_filling_writer(store, monkeypatch):
    t1 = spill(store, b"a")
    filling(store, 1)
    n = Notifies(store, monkeypatch)
    ft = uuid.uuid4()
    store.submit_flush(ft)
    assert n.count == 1
    got = answers(store, 2)
    assert [type(x) for x in got] == [type(got[0]), FlushDone] and got[0].token == t1 and got[0].ok
    assert got[1].token == ft and got[1].ok


def test_close_wakes_a_filling_writer_and_commits_what_it_held(tmp_path):
    s = open_store(tmp_path / "d")
    q = s.q   # type: ignore[attr-defined]
    t1 = spill(s, b"a")
    filling(s, 1)
    closer = threading.Thread(target=s.close)
    closer.start()
    closer.join(30)
    assert not closer.is_alive(), "close() waited for the batch deadline"
    r = q.get(1)
    assert r is not None and r.token == t1 and r.ok



def test_a_touch_does_not_wake_a_writer_waiting_for_work_the_next_op_takes_it_along(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_mod, "IDLE_WAKE_S", LONG)   # no idle wake-up within the test
    s = open_store(tmp_path / "d")
    try:
        wait_until(lambda: not s.writer._filling and not s.writer._ops, "writer never idle", s)
        n = Notifies(s, monkeypatch)
        s.submit_touch(b"a")
        assert n.count == 0
        with s.writer._cond:
            assert len(s.writer._ops) == 1 and not s.writer._filling   # queued; the writer sleeps on
        spill(s, b"b")
        assert n.count == 1
        filling(s, 2)                                    # the touch left with the spill's batch
    finally:
        s.close()


def test_an_idle_writer_finds_a_queued_touch_on_its_idle_wake_up(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_mod, "IDLE_WAKE_S", 0.01)
    s = open_store(tmp_path / "d")
    try:
        wait_until(lambda: not s.writer._filling and not s.writer._ops, "writer never idle", s)
        n = Notifies(s, monkeypatch)
        s.submit_touch(b"a")
        filling(s, 1)                                    # taken without being woken
        assert n.count == 0
    finally:
        s.close()
