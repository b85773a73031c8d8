"""Adversarial review of the slot holders (``SlotFile.hold``/``drop``, a removal frees only the slot that
holds its record), recovery's choice between two records on one slot, and the page-cache reads counter.

What it proved wrong (each proof failed with an AssertionError before its fix):

* a slot whose record a commit dropped kept its old key's print while it waited for that commit to be
  durable (``durability="batch"``): a damaged record of the same key naming it was trusted, so the slot
  was dropped twice and the key's real slot never freed, and when the slot went to a new write before the
  second drop matured, it was freed under the new entry, whose bytes the next write overwrote.  Fixed: a
  dropped slot is marked pending (``SlotFile.dropped``) and a matured drop frees only a slot still pending
  (``SlotFile._free_durable_locked``);
* a page-cache read whose load the dead disk process's answer had failed already was counted ``served``.
  Fixed: the store takes the reads it drops back off the count (``ProcessDiskStore.start_reads``); the
  old store's last reads are counted before a restarted one replaces it (``DiskTier``).

The unmarked tests pin what the review checked and found right: an aborted attempt after ``hold``,
recovery when the older record names the newer one's slot, a file longer than the capacity.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import tiered_kv.disk.writer as writer_mod
from disk_helpers import ROW, StoreRig
from test_review_disk_records import _good

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def no_idle_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """durability="batch": no idle sync between the test's commits (only a flush syncs)."""
    monkeypatch.setattr(writer_mod, "DIRTY_SYNC_S", 3600.0)
    monkeypatch.setattr(writer_mod, "IDLE_WAKE_S", 3600.0)


# --------------------------------------------------------------------------- 1
def test_a_slot_waiting_for_its_free_no_longer_holds_the_key_it_held(tmp_path: Path, no_idle_sync: None) -> None:
    """durability="batch": a's rewrite drops its old slot 0, which waits one commit (freed_unsynced) with its
    holder still print(a).  a's new record (slot 1) is then damaged to name slot 0; evicting a trusts it
    (SlotFile.holds(0, a) is True): slot 0 is freed twice (the second refused, counted as a bug) and a's real
    slot 1 is never freed -- no scan runs (lost == 0): leaked until the next open."""
    r = StoreRig(tmp_path / "d", slots=4, durability="batch", batch_blocks=1)
    try:
        r.write(b"a")
        assert r.flush()
        assert r.slot_of(b"a") == 0
        t2 = r.write(b"a")                   # slot 1; slot 0 waits for this commit to be durable
        assert r.slot_of(b"a") == 1 and 0 not in r.s.slots.free
        r.set_slot(b"a", 0)                  # damage: a's record names the slot its old record used
        r.s.submit_delete(t2, b"a")          # the owner evicts a
        assert r.flush() and r.flush()
        f = r.s.slots
        assert f.double_frees == 0, "a slot was freed twice"
        assert sorted(f.free) == [0, 1, 2, 3], f"a's slot leaked: free={sorted(f.free)}"
    finally:
        r.close()




def test_a_slot_waiting_for_its_free_is_never_freed_under_the_entry_that_reuses_it(tmp_path: Path,
                                                                                   no_idle_sync: None) -> None:
    """As above, without a sync between the eviction and the next writes: the eviction's commit frees slot 0 (its
    first, real free) and queues it again; b's write takes slot 0, and b's commit makes that second free durable:
    b's live slot goes on the free list, c is written over b -- a stored block lost."""
    r = StoreRig(tmp_path / "d", slots=4, durability="batch", batch_blocks=1)
    try:
        r.write(b"a")
        assert r.flush()
        t2 = r.write(b"a")                   # slot 1; slot 0 waits for this commit to be durable
        r.set_slot(b"a", 0)                  # damage: a's record names the slot its old record used
        r.s.submit_delete(t2, b"a")
        tb = r.write(b"b")
        assert r.slot_of(b"b") == 0
        assert 0 not in r.s.slots.free, "b's live slot is on the free list"
        r.write(b"c")
        assert r.flush()
        rep, got = r.read(b"b", tb)
        assert rep.ok and got == _good(b"b"), f"b was lost: {rep}"
    finally:
        r.close()


# --------------------------------------------------------------------------- 2
def test_a_page_cache_read_dropped_after_the_childs_death_is_not_counted_served(tmp_path: Path) -> None:
    """proc.start_reads drops a read served from the page cache when the child's death answered its op first
    (the load FAILED); CachedReads.read counted it served before that filter, and count_page_cache_reads adds
    it to tiered_kv_disk_page_cache_reads_total{outcome="served"}: a failed load shows as one that skipped
    the disk I/O side."""
    import signal

    from disk_helpers import Rig, disk_only_keys, metric_sum

    rig = Rig(tmp_path)
    try:
        kv, mgr, ks = disk_only_keys(rig, "process", n=1)
        store = mgr.disk
        before = metric_sum(mgr, "tiered_kv_disk_page_cache_reads_total", outcome="served")
        job = mgr.load(ks[0], 0)
        assert job is not None
        store.kill_for_test(signal.SIGKILL)
        store._receiver.join(30)             # the receiver answered every op the child had: this one failed
        assert store.down
        mgr.wait([job], timeout=30)
        assert job.state.name == "FAILED"
        mgr.poll()
        served = metric_sum(mgr, "tiered_kv_disk_page_cache_reads_total", outcome="served") - before
        assert served == 0, f"a failed load counted as {served} page-cache read(s) served"
    finally:
        rig.close_all()


# --------------------------------------------------------------------------- pins of correct behaviour
def test_an_aborted_attempt_after_hold_leaks_no_slot_and_frees_none_twice(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A MapFullError inside the transaction after ``SlotFile.hold`` (the map grows, the batch is retried):
    the aborted attempt's slots go back once, the retry's replace frees the old slot directly."""
    import lmdb

    from tiered_kv.disk.slots import SlotFile

    r = StoreRig(tmp_path / "d", slots=4, durability="sync", batch_blocks=1)
    try:
        r.write(b"a")
        assert r.slot_of(b"a") == 0
        real = SlotFile.hold
        raised: list[int] = []

        def hold(self: SlotFile, slot: int, lk: bytes) -> None:
            real(self, slot, lk)
            if not raised:
                raised.append(slot)
                raise lmdb.MapFullError("review: abort after hold")

        monkeypatch.setattr(SlotFile, "hold", hold)
        r.write(b"a")                        # first attempt aborts after holding slot 1, the retry commits
        assert raised == [1]
        assert r.flush()
        f = r.s.slots
        assert f.double_frees == 0
        assert r.slot_of(b"a") == 1 and sorted(f.free) == [0, 2, 3]
    finally:
        r.close()


def test_recovery_keeps_the_newer_entry_whose_bytes_a_damaged_older_record_claims(tmp_path: Path) -> None:
    """The mirror of test_review_disk_records' case 2: the older record's slot field is damaged to name the
    newer entry's slot; the newer one verifies and stays, the older one goes and its own slot is free."""
    path = tmp_path / "d"
    r = StoreRig(path, slots=4)
    try:
        r.write(b"a")
        tb = r.write(b"b")
        assert r.flush()
        sa, sb = r.slot_of(b"a"), r.slot_of(b"b")
        r.set_slot(b"a", sb)
    finally:
        r.close()
    r = StoreRig(path, slots=4)
    try:
        assert [e.key for e in r.s.entries] == [b"b"]
        rep, got = r.read(b"b", tb)
        assert rep.ok and got == _good(b"b")
        assert sa in r.s.slots.free and sb not in r.s.slots.free
    finally:
        r.close()


def test_a_file_longer_than_the_capacity_keeps_its_holders_past_the_capacity(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Reopened with a smaller capacity, the slots past it still hold their records (SlotFile.recovered over the
    file's length): evicting the entry in one frees that slot directly, with no scan and no refused free."""
    from tiered_kv.disk.writer import Writer

    path = tmp_path / "d"
    r = StoreRig(path, slots=8)
    toks = {}
    try:
        for k in (b"a", b"b", b"c", b"d", b"e", b"f"):
            toks[k] = r.write(k)
        assert r.flush()
    finally:
        r.close()
    scans: list[int] = []
    real = Writer._reclaim
    monkeypatch.setattr(Writer, "_reclaim", lambda self, txn_id: (scans.append(1), real(self, txn_id))[1])
    r = StoreRig(path, slots=4)
    try:
        f = r.s.slots
        assert f.length >= 6 and sorted(f.free) == list(range(6, f.length))
        s = r.slot_of(b"f")
        assert s >= 4
        r.s.submit_delete(toks[b"f"], b"f")
        assert r.flush()
        assert s in f.free and scans == [] and f.double_frees == 0
        rep, got = r.read(b"e", toks[b"e"])
        assert rep.ok and got == _good(b"e")
    finally:
        r.close()


def test_a_slot_dropped_twice_is_not_freed_under_the_entry_that_took_it_meanwhile(tmp_path: Path) -> None:
    """SlotFile alone, durability="batch": a slot's first drop matures and the slot goes to a new write; a
    second drop of it (a bug elsewhere) that matures later must not free it under its new holder."""
    from tiered_kv.disk.slots import SlotFile

    f = SlotFile(tmp_path, ROW, 8, "batch", 4)
    try:
        f.recovered({})
        a = f.alloc()
        f.hold(a, b"a")
        f.dropped([a], 5)
        f.dropped([a], 6)              # commit 5 durable: a is free again; the second drop waits on commit 6
        assert a in f.free
        assert f.alloc() == a
        f.hold(a, b"c")                # c's record names a now
        f.dropped([], 8)               # commit 6 durable: the second drop matures
        assert a not in f.free and f.holds(a, b"c") and f.double_frees == 1
    finally:
        f.close()
