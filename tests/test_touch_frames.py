"""Recency touches to the disk I/O process ride with the frames that go anyway.

Each promote queues a touch (``DiskTier.promote_applied``).  Sent alone, each made a frame to the child
once per lone load: a pipe write on the owner's thread and a wake-up of the child's command thread beside
the owner's copy (16-18% of one warm load from disk at a time on a 2-vCPU VM).  A frame of touches alone
now waits until ``_TOUCH_BATCH`` of them are queued or the first is ``_TOUCH_HOLD_S`` old; any other op,
a flush or the close takes them along, in the order they were queued."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from tiered_kv.disk import proc
from tiered_kv.disk.proc import ProcessDiskStore

from disk_helpers import keys, load_ok, make_kv, raw_keys, rig, store_one, store_seq  # noqa: F401 (rig: a fixture)
from test_review_disk_process2 import RawSlab, reap

pytestmark = pytest.mark.timeout(60)


class Frames:
    """Records the ops of every frame the owner makes (``proc._frame``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: list[list[tuple[Any, ...]]] = []
        real = proc._frame

        def frame(cmds: list[tuple[Any, ...]]) -> Any:
            self.sent.append(list(cmds))
            return real(cmds)

        monkeypatch.setattr(proc, "_frame", frame)


def _open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[RawSlab, ProcessDiskStore, Frames]:
    slab = RawSlab(tmp_path)
    store = slab.open()
    return slab, store, Frames(monkeypatch)


def _finish(store: ProcessDiskStore, slab: RawSlab) -> None:
    reap(store)
    store.close()
    slab.close()


def test_a_lone_touch_waits_and_rides_with_the_next_op_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slab, store, frames = _open(tmp_path, monkeypatch)
    try:
        store.submit_touch(b"a")
        store.kick()
        store.submit_touch(b"b")
        store.kick()
        assert frames.sent == [] and not store.backlogged    # nothing written, and no busy wake-ups for it
        t = uuid.uuid4()
        store.submit_delete(t, b"c")
        store.kick()
        assert frames.sent == [[("T", b"a"), ("T", b"b"), ("D", t.int, b"c")]]
        store.submit_touch(b"d")                            # counted afresh after the frame
        store.kick()
        assert len(frames.sent) == 1
        store.submit_delete(t, b"e")
        store.kick()
        assert frames.sent[1:] == [[("T", b"d"), ("D", t.int, b"e")]]
    finally:
        _finish(store, slab)


def test_touches_alone_go_once_a_batch_of_them_is_queued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slab, store, frames = _open(tmp_path, monkeypatch)
    try:
        for i in range(proc._TOUCH_BATCH - 1):
            store.submit_touch(b"k%d" % i)
            store.kick()
        assert frames.sent == []
        store.submit_touch(b"last")
        store.kick()
        assert [len(f) for f in frames.sent] == [proc._TOUCH_BATCH]
        assert frames.sent[0][-1] == ("T", b"last")
    finally:
        _finish(store, slab)


def test_a_touch_alone_goes_once_the_first_held_is_old(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slab, store, frames = _open(tmp_path, monkeypatch)
    try:
        store.submit_touch(b"a")
        store.kick()
        assert frames.sent == []
        store._touch_since -= proc._TOUCH_HOLD_S            # a is old now
        store.submit_touch(b"b")                            # the age is the first one's, not the last one's
        store.kick()
        assert frames.sent == [[("T", b"a"), ("T", b"b")]]
    finally:
        _finish(store, slab)


def test_held_touches_go_with_a_flush_and_with_the_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slab, store, frames = _open(tmp_path, monkeypatch)
    try:
        store.submit_touch(b"a")
        f = uuid.uuid4()
        store.submit_flush(f)
        assert frames.sent == [[("T", b"a"), ("F", f.int)]]
        store.submit_touch(b"b")
        store.close()
        assert frames.sent[1:] == [[("T", b"b"), ("X",)]]
    finally:
        _finish(store, slab)


def test_a_store_that_is_down_holds_no_touch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slab, store, frames = _open(tmp_path, monkeypatch)
    try:
        store.submit_touch(b"a")
        reap(store)
        store._receiver.join(30)
        assert store.down
        store.kick()
        assert store._cmds == [] and store._touches == 0 and not store.backlogged
    finally:
        _finish(store, slab)


def test_a_promote_touch_held_at_close_still_ranks_the_entry_after_a_restart(rig: Any) -> None:  # noqa: F811
    """As ``test_disk_tier.py::test_recency_survives_restart``, without the flush: the close sends it."""
    kv = make_kv(8)
    ks = keys(5)
    mgr = rig.open(kv, host_slots=2, disk_slots=4)
    store_seq(mgr, kv, ks[:4])
    assert load_ok(mgr, kv, ks[0], 6)          # promote from disk: k0 becomes the most recent
    rig.close(mgr)
    mgr = rig.open(kv, host_slots=2, disk_slots=4)
    store_one(mgr, kv, ks[4], 4)               # the first spill after the restart evicts the least recent: k1
    assert mgr.lookup([ks[1]]) == 0
    assert all(mgr.lookup([k]) == 1 for k in ks if k != ks[1])
    rig.close(mgr)
    assert raw_keys(rig.path) == {k for k in ks if k != ks[1]}
