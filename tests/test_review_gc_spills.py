"""Review of the untracked index entries and the batched spill reservations.

* ``test_arc_disk_tier_spill_fast_path_changes_the_policy_like_the_key_by_key_loop``: found that
  ``DiskTier.start_spills``' batched path, which stops at the first key without a slot, left an ARC
  disk tier's target ``p`` (and so its later victims) different from the loop over every key it
  replaced; the batched path is now taken under the default LRU policy only (``TierIndex.plain_lru``).
* ``test_guard_untrack_keeps_the_gil``, ``test_guard_an_untracked_entry_held_by_a_garbage_cycle_of_jobs_is_freed``,
  ``test_guard_partial_eviction_fast_path_matches_key_by_key``: risks no other test covers.

Every test is deterministic: temp dirs, no sleeps, the disk store's queue room and submission stubbed
where a test needs the writer out of the way (as tests/test_spill_groups.py does).
"""

from __future__ import annotations

import ctypes
import gc
import sys
import weakref
from typing import Any

import pytest
from disk_helpers import ready_host_entries
from fakes import ROW_BYTES, make_config, make_fake_manager, make_kv

from tiered_kv.core.index import Entry
from tiered_kv.jobs import Job, JobKind, TokenFactory
from tiered_kv.untrack import untrack

cpython = pytest.mark.skipif(sys.implementation.name != "cpython", reason="the collector's tracking is CPython's")


def _manager(tmp_path, name: str, **over: Any):
    opts = dict(host_slots=16, disk_path=tmp_path / name, disk_capacity_bytes=64 * ROW_BYTES,
                writer_batch_seconds=0.0, host_evict_ahead_blocks=0)
    opts.update(over)
    mgr, _ = make_fake_manager(make_config(**opts), make_kv(16))
    return mgr


def _stub_store(mgr, monkeypatch, room: int = 64) -> list[tuple[Any, bytes]]:
    """The writer out of the way: every submission accepted, ``room`` blocks of queue; the deletes an
    eviction queues are recorded (token, key) in order."""
    store = mgr._core.disk.store
    deletes: list[tuple[Any, bytes]] = []
    monkeypatch.setattr(store, "submit_spills", lambda tokens, keys, slots, view: True)
    monkeypatch.setattr(store, "spill_room", lambda: room)
    monkeypatch.setattr(store, "submit_delete", lambda token, key: deletes.append((token, key)))
    return deletes


# ---------------------------------------------------------------------------------------------- the finding
def _arc_outcome(tmp_path, name, one_by_one, monkeypatch):
    """An ARC disk tier full of leased entries (nothing evictable) with ghosts in B1; a step spills
    four ghost keys: all shed disk_full.  What ARC's target ``p`` and its eviction order are after."""
    mgr = _manager(tmp_path, name, disk_policy="arc")
    core = mgr._core
    dix = core.disk.index
    leased = []
    try:
        with monkeypatch.context() as m:
            _stub_store(mgr, m)
            if one_by_one:   # the key-by-key loop (the reference the commit claims to match)
                m.setattr(dix, "none_of", lambda keys: False)
            n = dix.num_slots
            for i in range(n):
                e = dix.reserve(b"a%02d" % i, core.tokens())
                dix.publish(e)
            for i in range(n // 2, n):   # used again: T2
                dix.touch(dix.get(b"a%02d" % i))
            for i in range(8):           # evict 8 of T1: a00..a07 become B1 ghosts
                e = dix.reserve(b"z%02d" % i, core.tokens())
                dix.publish(e)
            assert all(b"a%02d" % i in dix.policy.b1 for i in range(4))
            leased = list(dix.entries())
            for e in leased:             # every slot read by a promote: nothing evictable
                dix.acquire(e)
            hosts = ready_host_entries(mgr, [b"a%02d" % i for i in range(4)])
            written, _, shed = core.disk.start_spills(hosts, core.index, core.tokens, core.slot_views.__getitem__)
            assert written == [] and [w for _, w in shed] == ["disk_full"] * 4
            for e in leased:
                dix.release(e)
            leased = []
            return dix.policy.p, [e.key for e in dix.coldest(dix.num_slots)]
    finally:
        for e in leased:
            dix.release(e)
        mgr.close()


def test_arc_disk_tier_spill_fast_path_changes_the_policy_like_the_key_by_key_loop(tmp_path, monkeypatch):
    """DiskTier.start_spills' fast path (reserve_each) stops at the first key that finds no slot; the
    key-by-key loop it replaced asked for a slot for every key, and ARC's victim() adapts ``p`` for each
    ghost key it is asked about.  With disk_policy="arc" the same step leaves a different ``p``, hence a
    different eviction order afterwards: not "the same outcome except which free slot a key gets"."""
    fast = _arc_outcome(tmp_path, "fast", False, monkeypatch)
    ref = _arc_outcome(tmp_path, "ref", True, monkeypatch)
    assert (fast[0], fast[1]) == (ref[0], ref[1]), (
        f"ARC p after the step: batched {fast[0]}, key by key {ref[0]}; victims 21-25 differ: "
        f"{fast[1][20:25]} vs {ref[1][20:25]}")


# ---------------------------------------------------------------------------------------------- guards
@cpython
def test_guard_untrack_keeps_the_gil():
    """untrack() is called on the engine thread while other threads run Python: it must be a
    PYFUNCTYPE (ctypes keeps the GIL through the call), never a CFUNCTYPE (which releases it while
    PyObject_GC_UnTrack edits the collector's lists)."""
    assert isinstance(untrack, ctypes._CFuncPtr)
    assert untrack._flags_ & ctypes._FUNCFLAG_PYTHONAPI
    assert untrack.restype is None and untrack.argtypes == (ctypes.py_object,)


@cpython
def test_guard_an_untracked_entry_held_by_a_garbage_cycle_of_jobs_is_freed():
    """Jobs do form cycles (a promote and the load waiting on it name each other in ``_waiters``): an
    untracked Entry (and its untracked token) held by such a cycle is freed when the collector frees the
    cycle -- untracking only an object that is never *inside* a cycle is safe."""
    tokens = TokenFactory()
    token = tokens()
    gone = weakref.ref(token)
    entry = Entry(b"k", 0, token)
    assert not gc.is_tracked(entry) and not gc.is_tracked(token)
    promote = Job(tokens(), JobKind.PROMOTE, b"k", -1)
    load = Job(tokens(), JobKind.LOAD, b"k", 0)
    promote._entries = [entry]
    promote._waiters = [(load, 0)]
    load._waiters = [promote]
    del entry, token, promote, load
    assert gone() is not None, "held by the cycle until the collector runs"
    gc.collect()
    assert gone() is None, "the cycle's untracked entry and token were leaked"


def _partial_eviction_outcome(tmp_path, name, one_by_one, monkeypatch):
    """An LRU disk tier full of READY entries, all but 3 read by promotes; a step spills 6 new keys with
    a room of 5: the 3 evictable entries go, 3 keys are written, 3 shed."""
    mgr = _manager(tmp_path, name)
    core = mgr._core
    dix = core.disk.index
    leased = []
    try:
        with monkeypatch.context() as m:
            deletes = _stub_store(mgr, m, room=5)
            if one_by_one:
                m.setattr(dix, "none_of", lambda keys: False)
            n = dix.num_slots
            for i in range(n):
                e = dix.reserve(b"a%02d" % i, core.tokens())
                dix.publish(e)
            for i in (40, 2, 17):        # used again: the LRU order is not the insertion order
                dix.touch(dix.get(b"a%02d" % i))
            keep = {b"a%02d" % i for i in (5, 40, 11)}
            leased = [e for e in dix.entries() if e.key not in keep]
            for e in leased:
                dix.acquire(e)
            hosts = ready_host_entries(mgr, [b"new%d" % i for i in range(6)])
            written, disks, shed = core.disk.start_spills(hosts, core.index, core.tokens, core.slot_views.__getitem__)
            out = ([e.key for e in written], [d.key for d in disks], [(e.key, w) for e, w in shed],
                   [k for _, k in deletes], dix.evictions, [e.readers for e in hosts], len(dix), dix.used_slots)
            for e in leased:
                dix.release(e)
            leased = []
            return out + ([e.key for e in dix.coldest(n)],)
    finally:
        for e in leased:
            dix.release(e)
        mgr.close()


def test_guard_partial_eviction_fast_path_matches_key_by_key(tmp_path, monkeypatch):
    """A tier with fewer evictable entries than the step needs: the same victims (LRU order, their
    deletes queued in that order), the same keys written and shed and why, the same leases, whether
    the step's reservations were made together or key by key."""
    fast = _partial_eviction_outcome(tmp_path, "fast", False, monkeypatch)
    ref = _partial_eviction_outcome(tmp_path, "ref", True, monkeypatch)
    assert fast == ref
    written, _, shed, victims, evictions, readers, _, _, _ = fast
    assert written == [b"new0", b"new1", b"new2"]
    assert shed == [(b"new3", "disk_full"), (b"new4", "disk_full"), (b"new5", "disk_full")]
    assert victims == [b"a05", b"a11", b"a40"] and evictions == 3
    assert readers == [1, 1, 1, 0, 0, 0]
