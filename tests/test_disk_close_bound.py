"""``close()`` with ``disk_io="thread"`` is bounded when a disk thread hangs (``DiskStore.close``,
``CLOSE_JOIN_S``), and the path is released once the hung thread ends (``DiskStore._release_late``).

``tests/test_review_suspicions.py`` proves the bound.  Here: nothing is released while the hung writer may
still use it (the path stays locked: a second open is refused), and once its fdatasync returns the writer
commits what it held, the path is released, and a reopen in the same process serves every block.
Deterministic: the writer's fdatasync is held by an event; only bounded waits that detect a hang.
"""

from __future__ import annotations

import threading

import pytest

import tiered_kv.core.tiers as tiers_mod
import tiered_kv.disk.store as store_mod
import tiered_kv.manager as manager_mod
from disk_helpers import keys, load_ok, make_kv, rig, store_one  # noqa: F401
from tiered_kv.disk.slots import SlotFile
from tiered_kv.errors import DiskInUseError

__all__ = ["rig"]


@pytest.mark.disk_threads
def test_a_close_that_left_a_hung_writer_releases_the_path_once_it_ends(rig, monkeypatch) -> None:
    monkeypatch.setattr(manager_mod, "CLOSE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(tiers_mod, "CLOSE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(store_mod, "CLOSE_JOIN_S", 1.0)
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=4)
    store_one(mgr, kv, b"before", 0)
    entered, release = threading.Event(), threading.Event()
    real_sync = SlotFile.sync

    def hung_sync(self: SlotFile) -> None:
        entered.set()
        release.wait(120)
        real_sync(self)

    monkeypatch.setattr(SlotFile, "sync", hung_sync)
    store_one(mgr, kv, b"hung", 1, flush=False)
    assert entered.wait(30), "the writer never reached its fdatasync"
    disk = mgr.disk
    mgr.close()                                   # bounded: CLOSE_TIMEOUT_S, then CLOSE_JOIN_S
    assert disk is not None and disk._lock_fd >= 0, "released while the hung writer may still use it"
    with pytest.raises(DiskInUseError):
        rig.open(make_kv(8), host_slots=4)         # the path is still held: the writer may still write
    monkeypatch.setattr(SlotFile, "sync", real_sync)
    reapers = [t for t in threading.enumerate() if t.name == "tiered-kv-disk-reaper"]
    assert len(reapers) == 1
    release.set()
    reapers[0].join(30)                            # it releases the path once the writer ends
    assert not reapers[0].is_alive() and disk._lock_fd < 0, "the path was never released after the writer ended"
    kv2 = make_kv(8)
    again = rig.open(kv2, host_slots=4)
    assert load_ok(again, kv2, b"before", 2)
    rig.close(again)
