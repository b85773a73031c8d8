"""store_many / load_many: one job per call, the per-key guarantees of store() / load().

A fake mover answers each transfer when the test says, so every interleaving here is forced:
a row freed (or a key invalidated) while the job's copy is in flight, a late report, a read
from disk that fails, a load cancelled while it waits for its reads.
"""

from __future__ import annotations

import time

import pytest

import os

from tiered_kv.disk.format import SLOTS_NAME, lmdb_key, parse_header, slot_bytes_for
from fakes import (fake_disk_manager, fill_row, host_matches, make_config, make_fake_manager, mgr_metric, on_disk_only,
                   row_matches, snapshot, stored)
from tiered_kv.errors import BlockBusyError, InvalidBlockError, InvalidKeyError
from tiered_kv.jobs import JobKind, JobState

K = [f"key-{i}".encode() for i in range(8)]


def test_store_many_is_one_job_one_transfer_one_completion(fake, kv, metric):
    mgr, mover = fake
    for i in range(4):
        fill_row(kv, i, K[i])
    job = mgr.store_many(K[:4], [0, 1, 2, 3])
    assert list(job.keys) == K[:4] and list(job.blocks) == [0, 1, 2, 3] and job.kind is JobKind.STORE
    assert len(mover.submitted) == 1 and mover.submitted[0].rows == [0, 1, 2, 3]
    mover.complete(job)
    out = mgr.poll()
    assert [(c.job, c.ok) for c in out] == [(job, True)]
    assert all(host_matches(mgr, k, kv) for k in K[:4])
    assert metric("tiered_kv_jobs_total", kind="store", outcome="ok") == 1
    assert metric("tiered_kv_transfer_bytes_total", src="device", dst="host") == 4 * mgr.row_bytes


def test_freeing_one_row_cancels_only_that_keys_part(fake, kv, metric):
    mgr, mover = fake
    for i in range(3):
        fill_row(kv, i, K[i])
    job = mgr.store_many(K[:3], [0, 1, 2])
    assert mgr.free_block(1)                     # the engine reuses row 1 before the copy ran
    fill_row(kv, 1, b"other")
    mover.complete(job)                          # the copy now reads row 1's new bytes into K1's slot
    out = mgr.poll()
    assert [(c.job, c.ok) for c in out] == [(job, True)]
    assert host_matches(mgr, K[0], kv) and host_matches(mgr, K[2], kv)
    assert host_matches(mgr, K[1], kv) is None and mgr.lookup([K[1]]) == 0
    assert metric("tiered_kv_stale_callbacks_total", kind="store", reason="source_reused") == 1
    assert mgr.host_used_slots == 2              # K1's slot came back with the report


def test_freeing_every_row_cancels_the_job(fake, kv, metric):
    mgr, mover = fake
    for i in range(2):
        fill_row(kv, i, K[i])
    job = mgr.store_many(K[:2], [0, 1])
    assert mgr.free_block(0) and mgr.free_block(1)
    out = mgr.poll()
    assert [(c.job, c.ok) for c in out] == [(job, False)] and job.state is JobState.CANCELLED
    assert mgr.host_used_slots == 2              # leased to the copy still in flight
    mover.complete(job)
    assert mgr.poll() == []
    assert mgr.host_used_slots == 0 and mgr.lookup(K[:2]) == 0
    # one report, two parts discarded: each counted with its reason (as a spill job's parts are)
    assert metric("tiered_kv_stale_callbacks_total", kind="store", reason="source_reused") == 2
    assert metric("tiered_kv_jobs_total", kind="store", outcome="cancelled") == 1


def test_invalidating_one_key_of_a_pending_store_many_supersedes_that_part(fake, kv, metric):
    mgr, mover = fake
    for i in range(3):
        fill_row(kv, i, K[i])
    job = mgr.store_many(K[:3], [0, 1, 2])
    mgr.invalidate(K[2])
    mover.complete(job)
    mgr.poll()
    assert mgr.lookup(K[:3]) == 2 and host_matches(mgr, K[2], kv) is None
    assert metric("tiered_kv_stale_callbacks_total", kind="store", reason="superseded") == 1


def test_store_many_skips_stored_keys_and_sheds_what_finds_no_slot(kv, registry):
    mgr, mover = make_fake_manager(make_config(host_slots=4, host_evict_ahead_blocks=0), kv, registry)
    try:
        stored(mgr, mover, kv, K[:2], [0, 1])
        for i in range(2, 8):
            fill_row(kv, i, K[i])
        a = mgr.store_many(K[2:4], [2, 3])       # the 2 free slots
        # K0/K1 stored already, and a call never evicts a key it names: nothing left to evict
        assert mgr.store_many(K[:2] + K[4:6], [0, 1, 4, 5]) is None
        assert mgr_metric(mgr, "tiered_kv_shed_total", kind="store", reason="host_full") == 2
        job = mgr.store_many(K[4:8], [4, 5, 6, 7])   # K0/K1 evictable now; K2/K3 leased to ``a``
        assert list(job.keys) == [K[4], K[5]] and list(job.blocks) == [4, 5]
        assert mgr_metric(mgr, "tiered_kv_shed_total", kind="store", reason="host_full") == 4
        assert mgr.store_many(K[2:4], [2, 3]) is None   # being stored: nothing to do
        mover.complete(a)
        mover.complete(job)
        mgr.poll()
        assert all(host_matches(mgr, k, kv) for k in (K[2], K[3], K[4], K[5]))
    finally:
        mgr.close()


@pytest.mark.parametrize("new", [3, 12])   # a few keys, and more than the index turns into a set first
def test_a_full_tier_never_evicts_a_key_the_same_call_names(kv, registry, new):
    """The call names a stored key first (touched) and then more new keys than there are other evictable
    slots: the last new key is shed, and the named key stays, however long the call."""
    mgr, mover = make_fake_manager(make_config(host_slots=new + 1, host_evict_ahead_blocks=0), kv, registry)
    try:
        old = [f"old-{i}".encode() for i in range(new)]
        stored(mgr, mover, kv, [K[0]] + old, list(range(new + 1)))
        fresh = [f"new-{i}".encode() for i in range(new + 1)]
        for i, k in enumerate(fresh):
            fill_row(kv, 100 + i, k)
        job = mgr.store_many([K[0]] + fresh, [99] + [100 + i for i in range(new + 1)])
        assert list(job.keys) == fresh[:new]
        assert mgr_metric(mgr, "tiered_kv_shed_total", kind="store", reason="host_full") == 1
        mover.complete(job)
        mgr.poll()
        assert host_matches(mgr, K[0], kv) is not None and mgr.lookup(old) == 0
        assert all(host_matches(mgr, k, kv) for k in fresh[:new])
    finally:
        mgr.close()


def test_a_row_two_pending_stores_read_cancels_both_parts_when_freed(fake, kv, metric):
    """store(K0, row 0), then store_many([K1, K2], [0, 1]) -- both read row 0 -- and row 0 is freed
    before either copy ran: K0's job and K1's part are cancelled, K2 is stored."""
    mgr, mover = fake
    fill_row(kv, 0, K[0])
    fill_row(kv, 1, K[2])
    one = mgr.store(K[0], 0)
    many = mgr.store_many([K[1], K[2]], [0, 1])
    assert mgr.free_block(0)
    fill_row(kv, 0, b"other")
    mover.complete(one)
    mover.complete(many)
    out = {c.job: c.ok for c in mgr.poll()}
    assert out == {one: False, many: True}
    assert mgr.lookup([K[0]]) == 0 and mgr.lookup([K[1]]) == 0 and host_matches(mgr, K[2], kv)
    assert metric("tiered_kv_stale_callbacks_total", kind="store", reason="source_reused") == 2
    assert mgr.free_block(1) and mgr.host_used_slots == 1


def test_a_late_report_of_a_cancelled_store_many_is_discarded(fake, kv, metric):
    mgr, mover = fake
    for i in range(2):
        fill_row(kv, i, K[i])
    job = mgr.store_many(K[:2], [0, 1])
    mgr.cancel(job)
    assert [c.job for c in mgr.poll()] == [job]
    mover.complete(job)
    mover.duplicate(job)
    assert mgr.poll() == []
    assert metric("tiered_kv_stale_callbacks_total", kind="store", reason="cancelled") == 1
    assert metric("tiered_kv_stale_callbacks_total", kind="store", reason="unknown_token") == 1
    assert mgr.lookup(K[:2]) == 0 and mgr.host_used_slots == 0


def test_load_many_fences_every_row_until_its_report(fake, kv, metric):
    mgr, mover = fake
    stored(mgr, mover, kv, K[:3], [0, 1, 2])
    job = mgr.load_many(K[:3], [10, 11, 12])
    assert job is not None and len(mover.outstanding) == 1
    with pytest.raises(BlockBusyError, match="11"):
        mgr.store(b"x", 11)
    assert mgr.free_block(11) is False           # cancels the whole job; every row stays fenced
    assert mgr.free_block(10) is False
    assert mgr.poll() == []
    mover.complete(job)
    out = mgr.poll()
    assert [(c.job, c.ok) for c in out] == [(job, False)] and job.state is JobState.CANCELLED
    assert all(mgr.free_block(r) for r in (10, 11, 12))
    assert metric("tiered_kv_stale_callbacks_total", kind="load", reason="cancelled") == 1


def test_load_many_copies_every_key_into_its_row(fake, kv):
    mgr, mover = fake
    stored(mgr, mover, kv, K[:3], [0, 1, 2])
    job = mgr.load_many([K[2], K[0], K[1]], [20, 21, 22])
    mover.complete(job)
    assert [c.ok for c in mgr.poll()] == [True]
    assert row_matches(kv, 20, K[2]) and row_matches(kv, 21, K[0]) and row_matches(kv, 22, K[1])


def test_load_many_of_a_key_in_no_tier_starts_nothing(fake, kv):
    mgr, mover = fake
    stored(mgr, mover, kv, K[:2], [0, 1])
    before = snapshot(mgr)
    assert mgr.load_many([K[0], b"absent", K[1]], [10, 11, 12]) is None
    assert snapshot(mgr) == before and mover.outstanding == []
    assert all(mgr.free_block(r) for r in (10, 11, 12))


@pytest.mark.parametrize("call", ["store_many", "load_many"])
@pytest.mark.parametrize("keys,blocks,error,named", [
    ([b"a", b"a"], [0, 1], InvalidKeyError, "b'a'"),
    ([b"a", b"b"], [3, 3], InvalidBlockError, "3"),
    ([b"a", b"b"], [0], InvalidBlockError, "2 keys for 1 blocks"),
    ([], [], InvalidKeyError, "empty"),
    ([b"a", "b"], [0, 1], InvalidKeyError, "str"),
    ([b"a"], [10 ** 6], InvalidBlockError, "1000000"),
    ([b"a", b"b"], [0, -1], InvalidBlockError, "-1"),          # torch would read the last row
    ([b"a", b"", b"c"], [0, 1, 2], InvalidKeyError, "empty"),
    ([b"a", b"b" * 1025], [0, 1], InvalidKeyError, "1025 bytes"),
    ([b"a", b"b"], [0, True], InvalidBlockError, "bool"),
    (b"ab", [0, 1], InvalidKeyError, "bytes"),
    ([b"a"], 3, InvalidBlockError, "blocks must be a sequence"),
])
def test_bad_batches_are_refused_naming_the_value_and_change_nothing(fake, kv, call, keys, blocks, error, named):
    mgr, mover = fake
    stored(mgr, mover, kv, [b"a", b"b"], [0, 1])
    before = snapshot(mgr)
    with pytest.raises(error, match=named):
        getattr(mgr, call)(keys, blocks)
    assert snapshot(mgr) == before and mover.outstanding == []


# --------------------------------------------------------------------------- with a disk tier
@pytest.fixture
def disk_mgr(tmp_path):
    mgr, mover, kv = fake_disk_manager(tmp_path / "d")
    yield mgr, mover, kv
    mgr.close()

def _poll_until(mgr, cond, what):
    deadline = time.monotonic() + 30
    while not cond():                # a disk reader thread answers: wait for it, never order by time
        assert time.monotonic() < deadline, what
        mgr.poll()
        time.sleep(0.001)


def test_load_many_waits_for_every_read_from_disk_then_copies_once(disk_mgr):
    mgr, mover, kv = disk_mgr
    on_disk_only(mgr, mover, kv, K[:2])
    job = mgr.load_many([K[0], K[1]], [20, 21])
    assert job is not None and not mover.is_outstanding(job)      # its reads first
    _poll_until(mgr, lambda: mover.is_outstanding(job), "the load's copy never started")
    t = mover.transfer_of(job)
    assert t.rows == [20, 21]
    mover.complete(job)
    out = mgr.poll()
    assert [c.ok for c in out if c.job is job] == [True]
    assert row_matches(kv, 20, K[0]) and row_matches(kv, 21, K[1])


def test_load_many_cancelled_while_it_waits_for_its_reads_is_reported_at_once(disk_mgr):
    mgr, mover, kv = disk_mgr
    on_disk_only(mgr, mover, kv, K[:2])
    job = mgr.load_many([K[0], K[1]], [20, 21])
    assert mgr.free_block(20) is True            # no copy was queued: the rows are free at once
    assert mgr.free_block(21) is True
    out = mgr.poll()
    assert [(c.job, c.ok) for c in out] == [(job, False)] and job.state is JobState.CANCELLED
    mgr.wait(timeout=30)                         # the reads land as prefetches; nothing is copied
    assert not mover.is_outstanding(job) and mgr.lookup([K[0], K[1]]) == 2


@pytest.mark.disk_threads
def test_load_many_fails_when_one_read_from_disk_fails(disk_mgr, tmp_path):
    mgr, mover, kv = disk_mgr
    on_disk_only(mgr, mover, kv, K[:2])
    flip_live_slot_byte(mgr, tmp_path / "d", K[1])   # K1's bytes on disk fail verification: a miss
    job = mgr.load_many([K[0], K[1]], [20, 21])
    _poll_until(mgr, lambda: job.done, "the load was never reported")
    assert job.state is JobState.FAILED and not mover.is_outstanding(job)
    assert all(mgr.free_block(r) for r in (20, 21))
    assert mgr.lookup([K[1]]) == 0                # the corrupt entry is gone
    assert mgr.lookup([K[0]]) == 1                # the other read landed as a prefetch


def flip_live_slot_byte(mgr, path, key):
    """Flip the first payload byte of ``key`` in the slot file, finding its slot through the manager's own
    open environment (a second open of it in this process is refused by LMDB)."""
    db = mgr.disk.db
    with db.env.begin(db=db.blocks) as txn:
        h = parse_header(bytes(txn.get(lmdb_key(key))))
    fd = os.open(path / SLOTS_NAME, os.O_RDWR)
    try:
        at = h.slot * slot_bytes_for(h.length)
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x5A]), at)
    finally:
        os.close(fd)


def test_a_read_from_disk_for_load_many_never_evicts_another_key_of_the_same_load(disk_mgr):
    """The host tier is full and the load's READY key is its least recently used block: the slot for
    the load's other key, read back from disk, must come from another block, or the READY key would
    be evicted between the lookup of the load and its lease."""
    mgr, mover, kv = disk_mgr
    on_disk_only(mgr, mover, kv, [K[1]])
    stored(mgr, mover, kv, [K[0]], [0])
    assert mgr.flush(timeout=30)
    for i in range(3):
        stored(mgr, mover, kv, [f"fill-{i}".encode()], [50 + i])
        assert mgr.flush(timeout=30)
    assert mgr.host_used_slots == 4 and mgr.host_bytes(K[1]) is None
    job = mgr.load_many([K[0], K[1]], [20, 21])   # K0 (host, LRU) and K1 (disk)
    assert job is not None
    _poll_until(mgr, lambda: mover.is_outstanding(job), "the load's copy never started")
    mover.complete(job)
    assert [c.ok for c in mgr.poll() if c.job is job] == [True]
    assert row_matches(kv, 20, K[0]) and row_matches(kv, 21, K[1])


def test_every_pending_load_of_a_key_is_superseded_by_its_invalidation(fake, kv, metric):
    """The map of loads per key holds the one load of a key, or a list once another names it: both found."""
    mgr, mover = fake
    stored(mgr, mover, kv, K[:4], [0, 1, 2, 3])
    a = mgr.load_many([K[0], K[1]], [10, 11])
    b = mgr.load_many([K[1], K[2]], [12, 13])
    c = mgr.load_many([K[3], K[0]], [14, 15])
    d = mgr.load(K[1], 16)                        # a third load of K[1]
    e = mgr.load_many([K[2], K[0]], [17, 18])
    assert mgr.debug_sizes()["key_loads"] == 4
    mgr.invalidate(K[1])                          # three loads name it
    assert [j.state for j in (a, b, d)] == [JobState.CANCELLING] * 3
    assert c.state is JobState.PENDING and e.state is JobState.PENDING
    mgr.invalidate(K[3])                          # one load names it
    assert c.state is JobState.CANCELLING and e.state is JobState.PENDING
    for j in (b, c, e, d, a):
        mover.complete(j)
    out = {x.job.token: x.ok for x in mgr.poll()}
    assert out == {a.token: False, b.token: False, c.token: False, d.token: False, e.token: True}
    assert row_matches(kv, 17, K[2]) and row_matches(kv, 18, K[0])
    assert metric("tiered_kv_stale_callbacks_total", kind="load", reason="superseded") == 4
    assert mgr.debug_sizes()["key_loads"] == 0 and mgr.debug_sizes()["row_load"] == 0
    assert mgr.lookup([K[0]]) == 1 and mgr.lookup([K[1]]) == 0 and mgr.lookup([K[3]]) == 0
