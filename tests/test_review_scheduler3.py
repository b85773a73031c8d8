"""Adversarial review (3) of ``tiered_kv/integrations/scheduler.py`` (SlabScheduler, vLLM's scheduler side).

What it proved wrong (each test failed before its fix, for the reason given; each fix is named after it):

1. prepare_store evicts the blocks a waiting request was just told are hits: a request deferred by a
   read-back is deferred at every step while another request stores a block per step (livelock).
   ``test_a_waiting_request_is_answered_while_another_request_stores_a_block_each_step``.
   scheduler.py:250 ``core.begin_store(keys, protect=frozenset(keys), ...)`` protects only the store's own
   keys; lookup's read-backs (``protect``) and the step's evict-ahead (``_kept``, tick) leave the keys
   answered HIT/PENDING, the store's reservation does not (docs/vllm.md promises "a request waiting on a
   read-back does not lose the blocks it was told are hits before vLLM asks again").
   Fixed: the reservation also protects the keys answered HIT or PENDING in the same step (``_asked``; vLLM
   makes a step's lookups before its stores): a store that finds only those is shed.

2. A block fetched from the remote tier counts a lookup key at every ask: lookup answers RETRY, vLLM asks
   again next step (and while the fetch runs), each ask is a key; one served block gives hit ratio 1/2
   (1/3 with one ask meanwhile).  The same defect the previous review fixed for disk read-backs.
   ``test_a_block_fetched_from_the_remote_and_served_counts_one_lookup_and_one_hit``.
   scheduler.py:156 and :160 (``m.count(m.lookups)`` before each RETRY answer), :186-187 (``_hit`` counts
   the landed block again).  Fixed: ``SlabScheduler._waiting`` holds every key answered PENDING or RETRY
   until it is answered HIT or MISS (bounded); a key in it is one lookup key, counted at its first ask.

3. close() broken off (Ctrl-C in its bounded waits, or any exception) is never finished: the next close()
   returns at once, leaving the disk I/O process running, the disk path locked (DiskInUseError for the
   next owner), the host fd and the slab's views open.
   ``test_a_close_an_interrupt_broke_off_is_finished_by_the_next_close``.
   scheduler.py:410-412 sets ``self._closed = True`` before the waits; ProcessDiskStore.close documents
   "a close an interrupt broke off is finished by the next one" and TierManager.close sets ``_closed`` last.
   Fixed: ``_closed`` is set last (each step of close() may run again), as TierManager.close() does.

4. reset() leaves vLLM's KV events claiming blocks that are gone: no dropped key is reported removed, and
   stores published before the reset but not yet taken are reported "stored" after it.
   ``test_kv_events_after_reset_claim_no_block_that_is_gone``.
   scheduler.py:350 ``core.drop_all()`` removes entries with ``TierIndex.remove`` (no ``on_evict``, so
   nothing reaches ``core.evicted``).  Fixed: ``TierCore.drop_key`` collects a key that was READY in a tier
   as gone (``collect_evicted``), after any "stored" of it still to be taken; the vLLM manager's
   ``reset_cache`` records both at once.

5. A read-back that fails verification counts a disk hit (and the MISS re-ask a second lookup key): one
   block asked for, none served, metrics say 2 keys and 1 hit.
   ``test_a_read_back_that_fails_verification_counts_no_hit``.
   scheduler.py:170 counts ``hits["disk"]`` when the read *starts*; :160 counts the re-ask after the
   failed read.  Fixed: the disk hit is counted when the read-back is served (``_hit``), and a re-ask
   after a read that never landed is the same lookup key (``_waited``).

Checked and found right (unmarked tests pin them): keys repeated across/within prepare_store calls, a key
stored while it is read back from disk, prepare_load of a key being stored, a load in flight across reset().
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from test_vllm_scheduler import (  # noqa: F401  (rig: the fixture)
    HIT, MISS, PENDING, JOBS, A, B, C, D, Rig, metric, mark, pattern, rig, slot_bytes_of, stale_total,
    store_ready, wait_promotes, worker_store,
)
from test_review_scheduler_logic import ROW, _disk_only, _keys, _vllm_prefix_step
from tiered_kv.integrations.scheduler import Lookup, SlabScheduler


def _settle(tiers: SlabScheduler) -> None:
    """Between two engine steps: the step's read-backs landed and its write-through spills are durable."""
    wait_promotes(tiers)
    assert tiers.flush(timeout=30)
    tiers.tick()


def full_slab_of_a_waiting_prefix(rig: Rig, R: list[bytes]) -> SlabScheduler:
    """A 4-slot slab (evict-ahead 0) holding three of the four prefix blocks ``R`` (read back by an earlier
    request) and one other block; ``R[3]`` on disk only."""
    tiers = _disk_only(rig, R, num_slots=4)
    assert tiers.core.evict_ahead == 0
    for k in R[:3]:                                 # k0..k2 read back into the host (an earlier request)
        assert tiers.lookup(k) == PENDING
        _settle(tiers)
    store_ready(tiers, [b"other-x"])                # the fourth slot: some other block
    _settle(tiers)
    assert tiers.host_blocks == 4
    return tiers


# =========================================================================== prepare_store vs keys told HIT

def test_a_waiting_request_is_answered_while_another_request_stores_a_block_each_step(rig):
    """A 4-slot slab (evict-ahead 0) holds three of a waiting request's four prefix blocks (k0..k2) and one
    other block; k3 is on disk only.  Another (running) request stores one new block per step, its copy done
    within the step.  Played as vLLM plays a step: the waiting request's lookups (vllm.py: the keys answered
    HIT/PENDING are ``protect``), then build_connector_meta's prepare_store, then on_schedule_end's tick.

    lookup's contract: keys answered HIT or PENDING are never evicted by a read-back of the same request nor
    by the step's evict-ahead, "so a prefix longer than the slab gets the part that fits instead of evicting
    itself forever".  prepare_store's reservation protects only its own keys: it evicts the block the waiting
    request was just told is a HIT, the next step reads that one back (PENDING again), and so on forever."""
    R = _keys(4)
    tiers = full_slab_of_a_waiting_prefix(rig, R)
    answers: list[Optional[int]] = []
    for step in range(10):
        answers.append(_vllm_prefix_step(tiers, R))     # the waiting request's lookups
        if answers[-1] is not None:
            break
        # the running request's new block, stored this step (build_connector_meta), its copy done
        p = tiers.prepare_store([b"run-%03d" % step])
        if p.keys:
            worker_store(tiers.slab, p.keys, p.slots, p.seq, "run")
            tiers.complete_store(p.keys)
        tiers.tick()                                    # on_schedule_end
        _settle(tiers)
    assert answers[-1] is not None, (
        f"the waiting request was deferred at each of {len(answers)} steps: prepare_store evicted a block it "
        f"had just been told is a hit; stores shed: {metric(tiers.metrics, 'tiered_kv_shed_total', kind='store', reason='host_full')}")


# =========================================================================== lookup counters, remote tier
def _remote_pair(rig: Rig, redis_url: str) -> tuple[SlabScheduler, SlabScheduler]:
    """Two schedulers of one namespace sharing a Redis server: ``a`` stores, ``b`` is the one asked."""
    kw = dict(remote_url=redis_url, remote_miss_ttl_seconds=0.0)
    a = rig.open(rig.slab(num_slots=8, row_bytes=ROW, name="a.slab"), **kw)
    b = rig.open(rig.slab(num_slots=8, row_bytes=ROW, name="b.slab"), **kw)
    return a, b


def _until_fetched(tiers: SlabScheduler, timeout: float = 20.0) -> None:
    import time
    deadline = time.monotonic() + timeout
    tiers.tick()
    while tiers.pending_work:
        assert time.monotonic() < deadline, "the probe and fetch did not answer"
        time.sleep(0.002)   # the server answers on its own time: waits, orders nothing
        tiers.tick()


def _hits(m) -> float:
    return sum(metric(m, "tiered_kv_lookup_hits_total", tier=t) for t in ("host", "disk", "remote"))



@pytest.mark.parametrize("asks_while_fetching", [0, 1])
def test_a_block_fetched_from_the_remote_and_served_counts_one_lookup_and_one_hit(rig, redis_url, monkeypatch,
                                                                                   asks_while_fetching):
    """vLLM asks a key again at a later step when lookup answered RETRY (and again while its fetch runs).
    A block read back from disk is one lookup key and one hit however often it is asked meanwhile (fixed by
    the previous review: the dashboard's hit ratio halved for disk hits); a block fetched from the remote tier
    is counted a lookup key at every ask: one served block, hit ratio 1/2 (1/3 with one ask meanwhile)."""
    a, b = _remote_pair(rig, redis_url)
    store_ready(a, [A])
    assert a.flush(timeout=30)
    m = b.metrics
    assert b.lookup(A) == Lookup.RETRY
    b.tick()                                      # the step's probe goes out
    with monkeypatch.context() as mp:             # asked again while its fetch runs (answers not applied yet)
        mp.setattr(b.core, "apply_arrived", lambda: None)
        for _ in range(asks_while_fetching):
            assert b.lookup(A) in (Lookup.RETRY, Lookup.MISS)
    _until_fetched(b)
    assert b.lookup(A) == HIT                     # vLLM asks again: the block landed
    assert torch.equal(slot_bytes_of(b, A), pattern(A, "v1", ROW))
    hits = _hits(m)
    assert hits == 1 and metric(m, "tiered_kv_lookup_hits_total", tier="remote") == 1
    assert metric(m, "tiered_kv_lookup_keys_total") == hits, (
        f"one block asked for and served from the remote tier: lookup keys "
        f"{metric(m, 'tiered_kv_lookup_keys_total')}, hits {hits}")


# =========================================================================== close() broken off

def test_a_close_an_interrupt_broke_off_is_finished_by_the_next_close(rig, monkeypatch):
    """close() blocks (bounded) while read-backs and spills finish; a Ctrl-C (or any exception) there
    leaves the disk I/O process, its path lock, the slab views and the host fd open.  The disk store's own
    close() says "Idempotent; a close an interrupt broke off is finished by the next one" (disk/proc.py), as
    TierManager.close() does (it sets ``_closed`` last).  SlabScheduler.close() sets ``_closed`` first: the
    next close() returns at once and finishes nothing; the disk path stays locked for the process's life."""
    import os

    from tiered_kv.errors import DiskInUseError

    tiers = _disk_only(rig, [A], num_slots=4, io="process")
    core = tiers.core
    calls = []
    real = core.simple_block_until

    def interrupted_once(done, timeout):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt   # the operator's Ctrl-C during close's bounded wait
        return real(done, timeout)

    monkeypatch.setattr(core, "simple_block_until", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        tiers.close()
    fd = tiers._host_fd
    try:
        tiers.close()                                   # finishes what the first one left
        try:
            again = rig.open(rig.slab(num_slots=4, row_bytes=ROW, name="z.slab"), disk=True,
                             disk_blocks=16, disk_io="process")
        except DiskInUseError as exc:
            raise AssertionError(f"the disk path is still held after close() returned: {exc}") from None
        assert again.disk_blocks == 1
        assert tiers._host_fd == -1, "the host fd of the disk I/O process's slab mapping is still open"
    finally:   # what the broken-off close left, so that the rig's teardown does not hang on it
        if tiers.disk is not None:
            tiers.disk.close()
        if tiers._host_fd >= 0:
            os.close(tiers._host_fd)
            tiers._host_fd = -1
        core.slot_views.release()
        del fd


# =========================================================================== KV events across reset()
def _take_events(tiers: SlabScheduler, claimed: dict[bytes, bool]) -> None:
    """What TieredKVOffloadingManager.take_events hands vLLM (integrations/vllm.py: the stores published
    since the last call, then the keys gone from every tier), folded into what a KV-event consumer believes."""
    for k in tiers.take_published():
        claimed[k] = True
    for k in tiers.take_evicted():
        claimed[k] = False


def _offloaded(tiers: SlabScheduler, k: bytes) -> bool:
    core = tiers.core
    return core.index.ready(k) is not None or (core.dindex is not None and core.dindex.ready(k) is not None)



@pytest.mark.parametrize("disk", [False, True])
def test_kv_events_after_reset_claim_no_block_that_is_gone(rig, disk):
    """vLLM's KV events (``take_events``: "stored" for each store published, "removed" for each key gone from
    every tier) let a router count on the offloaded blocks; docs/vllm.md: a block that is gone "is reported
    evicted, so vLLM and KV-event consumers stop counting on it".  reset() (vLLM's reset_cache) drops every
    block without reporting any removed, and the stores published before it but not yet taken are reported
    "stored" after it: the event stream says A and B are offloaded, neither is in any tier."""
    tiers = rig.open(rig.slab(num_slots=8, row_bytes=ROW), disk=disk)
    tiers.core.collect_published = True            # as TieredKVOffloadingManager with KV events on
    claimed: dict[bytes, bool] = {}
    store_ready(tiers, [A])
    _take_events(tiers, claimed)                   # a step's events: A stored
    store_ready(tiers, [B])                        # published, its event not taken yet
    if disk:
        assert tiers.flush(timeout=30)
    tiers.reset()
    cleared: dict[bytes, bool] = {}                # a consumer that also cleared everything at the reset
    tiers.tick()
    events = (tiers.take_published(), tiers.take_evicted())
    for state in (claimed, cleared):
        for k in events[0]:
            state[k] = True
        for k in events[1]:
            state[k] = False
    for name, state in (("events only", claimed), ("events and a clear at the reset", cleared)):
        wrong = sorted(k for k, v in state.items() if v and not _offloaded(tiers, k))
        assert not wrong, f"{name}: the KV events claim {wrong} offloaded after reset(); no tier holds them"


# =========================================================================== lookup counters, failed read-back

def test_a_read_back_that_fails_verification_counts_no_hit(rig):
    """docs/vllm.md: "a failed read turns into a MISS and the request simply recomputes".  lookup() counts the
    disk hit when it *starts* the read (scheduler.py, the PENDING answer), before the bytes were verified; the
    read fails its checksum, vLLM asks again and is told MISS (a second lookup key): one block asked for,
    none served, and the metrics say 2 lookup keys and 1 disk hit."""
    from disk_helpers import flip, payload_offset, raw_blocks, rewrite_value
    from tiered_kv.disk.format import lmdb_key

    first = rig.open(rig.slab(num_slots=4, row_bytes=ROW), disk=True)
    store_ready(first, [A], tag="disk")
    assert first.flush(timeout=30)
    first.close()
    rewrite_value(rig.disk, A, flip(payload_offset(raw_blocks(rig.disk)[lmdb_key(A)]) + 17))
    tiers = rig.open(rig.slab(num_slots=4, row_bytes=ROW, name="y.slab"), disk=True)
    assert tiers.lookup(A) == PENDING
    wait_promotes(tiers)
    assert tiers.lookup(A) == MISS                  # vLLM asks again: the request recomputes the block
    m = tiers.metrics
    assert metric(m, "tiered_kv_corrupt_blocks_total", reason="checksum") == 1
    assert (_hits(m), metric(m, "tiered_kv_lookup_keys_total")) == (0, 1), (
        f"one block asked for, none served: hits {_hits(m)} "
        f"(disk {metric(m, 'tiered_kv_lookup_hits_total', tier='disk')}), "
        f"lookup keys {metric(m, 'tiered_kv_lookup_keys_total')}")


# =========================================================================== checked and found right
def test_keys_repeated_across_prepare_store_calls_are_stored_once_with_their_first_bytes(rig):
    tiers = rig.open(rig.slab(num_slots=8, row_bytes=ROW))
    p1 = tiers.prepare_store([A, B])
    p2 = tiers.prepare_store([B, C, C])              # B being stored by p1; C repeated in the call
    assert p1.keys == [A, B] and p2.keys == [C]
    worker_store(tiers.slab, p2.keys, p2.slots, p2.seq, "two")
    tiers.complete_store(p2.keys)
    worker_store(tiers.slab, p1.keys, p1.slots, p1.seq, "one")
    tiers.complete_store(p1.keys)
    tiers.tick()
    for k, tag in ((A, "one"), (B, "one"), (C, "two")):
        assert torch.equal(slot_bytes_of(tiers, k), pattern(k, tag, ROW)), k
    assert stale_total(tiers.metrics) == 0
    assert tiers.debug_sizes()["host_used_slots"] == 3


def test_a_key_stored_while_it_is_read_back_from_disk_keeps_the_disk_bytes(rig):
    tiers = _disk_only(rig, [A], num_slots=4)
    assert tiers.lookup(A) == PENDING
    p = tiers.prepare_store([A])                     # the engine computed it again meanwhile: skipped
    assert p.keys == [] and p.slots == []
    wait_promotes(tiers)
    assert tiers.lookup(A) == HIT
    assert torch.equal(slot_bytes_of(tiers, A), pattern(A, "disk", ROW))


def test_a_failed_store_of_keys_that_are_loaded_meanwhile_is_impossible_and_a_load_outlives_reset(rig):
    """A key being stored is not READY, so prepare_load refuses it; a load in flight across reset() keeps
    its slot until its ring mark, and the slot's bytes are not overwritten by a new store meanwhile."""
    from tiered_kv.errors import InvalidKeyError

    tiers = rig.open(rig.slab(num_slots=2, row_bytes=ROW))
    p = tiers.prepare_store([A])
    with pytest.raises(InvalidKeyError):
        tiers.prepare_load([A])
    worker_store(tiers.slab, p.keys, p.slots, p.seq)
    tiers.complete_store([A])
    pl = tiers.prepare_load([A])
    tiers.reset()
    q = tiers.prepare_store([B, C])                  # one free slot: A's is leased to the load
    assert q.keys == [B] and pl.slots[0] not in q.slots
    tiers.tick()
    assert torch.equal(tiers.slab.rows[pl.slots[0]], pattern(A, "v1", ROW))
    mark(tiers.slab, pl.seq)
    tiers.complete_load([A])                         # late: stale (cancelled by the reset)
    tiers.tick()
    assert tiers.debug_sizes()["quarantine"] == 0
    assert metric(tiers.metrics, JOBS, kind="load", outcome="cancelled") == 1
