"""Adversarial review of ``tiered_kv/integrations/scheduler.py`` (SlabScheduler's own logic).

What it proved wrong (each proof failed with an AssertionError before its fix):

* a disk-only prefix about as long as the slab was answered PENDING at every step: the step's evict-ahead
  took the oldest block the waiting request had been told is a hit, its next lookup read it back and
  evicted another (``protect`` shielded them only from the lookup's own reservation).  Fixed: the
  evict-ahead leaves the keys answered HIT or PENDING in the last step that answered any
  (``SlabScheduler.tick`` -> ``TierCore.end_step(protect=...)`` -> ``TierIndex.evict_ahead``);
* a block read back from disk counted a lookup key at every ask (the PENDING ones and the one once it
  landed) but one hit: the dashboard's hit ratio halved for disk hits.  Fixed: counted at the first ask;
* the ``_read_back`` bound trimmed a key read back a second time (it kept its old place first in the
  dict), so its hit was counted twice.  Fixed: the key moves last;
* with the disk I/O process dead (its restart backed off), a lookup started a read that failed at once,
  every step: the request was told PENDING for the whole back-off.  Fixed: a MISS (``DiskTier.dead``).

The other tests pin what the review suspected and found right.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from test_vllm_scheduler import (  # noqa: F401  (rig: the fixture)
    HIT, MISS, PENDING, JOBS, A, B, C, D, Rig, metric, mark, pattern, rig, slot_bytes_of, stale_total,
    store_ready, wait_promotes, worker_store,
)
from tiered_kv.integrations.scheduler import SlabScheduler

ROW = 256


def _keys(n: int) -> list[bytes]:
    return [b"prefix-%03d" % i for i in range(n)]


def _disk_only(rig: Rig, keys: list[bytes], num_slots: int, tag: str = "disk", io: str = "thread",
               **kw) -> SlabScheduler:
    """Write ``keys`` to the disk tier with one scheduler, close it, and open a fresh one (on a fresh,
    zeroed slab of ``num_slots`` slots) that holds them on disk only."""
    first = rig.open(rig.slab(num_slots=len(keys) + 4, row_bytes=ROW, name="w.slab"), disk=True,
                     disk_blocks=2 * len(keys) + 8, disk_io="thread")
    for k in keys:
        store_ready(first, [k], tag=tag)
    assert first.flush(timeout=30)
    first.close()
    tiers = rig.open(rig.slab(num_slots=num_slots, row_bytes=ROW, name="y.slab"), disk=True,
                     disk_blocks=2 * len(keys) + 8, disk_io=io, **kw)
    assert tiers.disk_blocks == len(keys) and tiers.host_blocks == 0
    return tiers


def _vllm_prefix_step(tiers: SlabScheduler, keys: list[bytes]) -> Optional[int]:
    """One scheduler step of vLLM's ``_maximal_prefix_lookup`` through the adapter's ``lookup``
    (integrations/vllm.py: the step's keys answered HIT or PENDING are the ``protect`` set): the
    number of hits, or None when a lookup was deferred (a read-back pending: asked again next step)."""
    seen: set[bytes] = set()
    hits, deferred = 0, False
    for k in keys:
        r = tiers.lookup(k, protect=seen)
        if r != MISS:
            seen.add(k)
        if r == HIT:
            hits += 1
        elif r == PENDING:
            hits += 1
            deferred = True
        else:
            break
    return None if deferred else hits


def _steps_until_answered(tiers: SlabScheduler, keys: list[bytes], steps: int = 8) -> list[Optional[int]]:
    """Each step's answer (:func:`_vllm_prefix_step`) until one is not deferred, or ``steps`` of them; between
    two, the step ends (tick) until the step's read-backs landed."""
    answers: list[Optional[int]] = []
    for _ in range(steps):
        answers.append(_vllm_prefix_step(tiers, keys))
        if answers[-1] is not None:
            break
        wait_promotes(tiers)
    return answers


# =========================================================================== protect vs evict-ahead
def test_a_disk_prefix_as_long_as_the_slab_is_answered_within_a_few_steps(rig):
    """The default config on a 32-slot slab (evict-ahead = 32 // 32 = 1 slot) and a request whose 32-block
    prefix is on disk only.  lookup's docstring: a prefix longer than the slab gets the part that fits
    instead of evicting itself forever.  Played as vLLM plays it (each step's lookups, then tick)."""
    keys = _keys(32)
    tiers = _disk_only(rig, keys, num_slots=32)
    assert tiers.core.evict_ahead == 1
    answers = _steps_until_answered(tiers, keys)
    assert answers[-1] is not None and answers[-1] >= 1, (
        f"the request was deferred at each of {len(answers)} steps ({answers}); "
        f"host holds {tiers.host_blocks} blocks, promotes ok so far: "
        f"{metric(tiers.metrics, JOBS, kind='promote', outcome='ok')}")


def test_a_four_block_disk_prefix_on_four_slots_with_evict_ahead_one(rig):
    keys = _keys(4)
    tiers = _disk_only(rig, keys, num_slots=4, host_evict_ahead_blocks=1)
    answers = _steps_until_answered(tiers, keys)
    assert answers[-1] is not None, f"deferred at every step: {answers}"


def test_a_disk_prefix_longer_than_the_slab_without_evict_ahead_gets_the_part_that_fits(rig):
    """Control: with evict-ahead 0 the same protocol ends (the part that fits), as documented."""
    keys = _keys(6)
    tiers = _disk_only(rig, keys, num_slots=4, host_evict_ahead_blocks=0)
    answers = _steps_until_answered(tiers, keys)
    assert answers[-1] == 4, answers
    for k in keys[:4]:
        assert torch.equal(slot_bytes_of(tiers, k), pattern(k, "disk", ROW)), k


# =========================================================================== lookup counters
@pytest.mark.parametrize("asks_while_pending", [0, 2])
def test_a_block_read_back_and_served_counts_one_lookup_and_one_hit(rig, monkeypatch, asks_while_pending):
    tiers = _disk_only(rig, [A], num_slots=4)
    assert tiers.lookup(A) == PENDING
    with monkeypatch.context() as mp:
        mp.setattr(tiers.core, "apply_arrived", lambda: None)   # the read has not landed: asked again meanwhile
        for _ in range(asks_while_pending):
            assert tiers.lookup(A) == PENDING
    wait_promotes(tiers)
    assert tiers.lookup(A) == HIT                  # vLLM asks again once it landed: the same block
    m = tiers.metrics
    hits = sum(metric(m, "tiered_kv_lookup_hits_total", tier=t) for t in ("host", "disk", "remote"))
    assert hits == 1
    assert metric(m, "tiered_kv_lookup_keys_total") == hits, "one block asked for and served, hit ratio must be 1"


# =========================================================================== reset with everything in flight
def test_reset_with_read_backs_awaiting_and_quarantined_jobs_then_the_same_keys(rig):
    """reset() while: a read-back is in flight (A), a store awaits its ring (B: reported, ring not shown),
    a store is quarantined by an engine failure (C), a load is live (D).  Afterwards every key is a MISS,
    stored again each is served with its new bytes, and every slot comes back."""
    slab_keys = [A, D]
    tiers = _disk_only(rig, slab_keys, num_slots=8)
    slab = tiers.slab
    assert tiers.lookup(D) == PENDING
    wait_promotes(tiers)
    assert tiers.lookup(D) == HIT
    pl = tiers.prepare_load([D])                                # live load of D
    assert tiers.lookup(A) == PENDING                           # read-back of A in flight
    pb = tiers.prepare_store([B])
    pc = tiers.prepare_store([C])
    # B: the engine reports first (a late report), the ring does not show it yet -> awaiting
    tiers.complete_store([B])
    assert tiers.debug_sizes()["awaiting"] == 1
    # C: the engine reports a failure before the ring -> quarantined
    tiers.complete_store([C], success=False)
    assert tiers.debug_sizes()["quarantine"] == 1
    tiers.reset()
    for k in (A, B, C, D):
        assert tiers.lookup(k) == MISS, k
    # the old copies land now, with old bytes, and their marks
    worker_store(slab, [B], pb.slots, pb.seq, tag="old")
    worker_store(slab, [C], pc.slots, pc.seq, tag="old")
    mark(slab, pl.seq)
    tiers.complete_load([D])                                    # late: stale
    wait_promotes(tiers)
    for k in (A, B, C, D):
        assert tiers.lookup(k) == MISS, k
    for k in (A, B, C, D):
        store_ready(tiers, [k], tag="new")
    for k in (A, B, C, D):
        assert torch.equal(slot_bytes_of(tiers, k), pattern(k, "new", ROW)), k
    tiers.reset()
    assert tiers.flush(timeout=30)              # the write-through spills' reports: their pins go
    tiers.tick()
    s = tiers.debug_sizes()
    assert (s["quarantine"], s["awaiting"], s["live_stores"], s["live_loads"], s["host_used_slots"]) == (0, 0, 0, 0, 0), s
    m = tiers.metrics
    # each engine job counted once: B and D cancelled, C failed
    assert metric(m, JOBS, kind="store", outcome="failed") == 1
    assert metric(m, JOBS, kind="store", outcome="cancelled") == 1
    assert metric(m, JOBS, kind="load", outcome="cancelled") == 1


def test_failed_store_before_its_ring_then_the_ring_marks_ok_never_publishes(rig):
    slab = rig.slab(num_slots=4, row_bytes=ROW)
    tiers = rig.open(slab)
    p = tiers.prepare_store([A, B])
    tiers.complete_store([A, B], success=False)
    worker_store(slab, [A, B], p.slots, p.seq)                 # the copy then finishes, marked ok
    tiers.tick()
    assert tiers.lookup(A) == MISS and tiers.lookup(B) == MISS
    tiers.complete_store([A, B])                               # a duplicate: stale, changes nothing
    tiers.tick()
    assert tiers.lookup(A) == MISS
    assert tiers.debug_sizes()["host_used_slots"] == 0
    m = tiers.metrics
    assert metric(m, JOBS, kind="store", outcome="failed") == 1
    assert metric(m, JOBS, kind="store", outcome="ok") == 0
    assert stale_total(m) == 1


def test_a_key_read_back_twice_is_counted_once_when_the_bound_trims(rig):
    k1, k2, k3, k4, k5 = ks = _keys(5)
    tiers = _disk_only(rig, ks, num_slots=4, host_evict_ahead_blocks=0)
    for k in (k1, k2):                          # read back; their requests never ask again (aborted)
        assert tiers.lookup(k) == PENDING
        wait_promotes(tiers)
    X, Y, Z = b"host-X", b"host-Y", b"host-Z"
    store_ready(tiers, [X])
    store_ready(tiers, [Y])
    assert tiers.flush(timeout=30)              # their spills done: not pinned
    store_ready(tiers, [Z])                     # the host is full: evicts k1, the coldest
    assert tiers.flush(timeout=30)
    assert tiers.state_of(k1)[0] is None
    assert tiers.lookup(k1) == PENDING          # a new request: k1 read back again (evicts k2)
    wait_promotes(tiers)
    for k in (k3, k4, k5):                      # three more read-backs (evict X, Y, Z)
        assert tiers.lookup(k) == PENDING
        wait_promotes(tiers)
    assert tiers.state_of(k1)[0] == "ready"
    m = tiers.metrics
    tiers_ = ("host", "disk", "remote")
    before = {t: metric(m, "tiered_kv_lookup_hits_total", tier=t) for t in tiers_}
    assert before == {"host": 0, "disk": 0, "remote": 0}, "a read-back is a hit when it is served, not when it starts"
    keys = metric(m, "tiered_kv_lookup_keys_total")
    assert keys == 6                            # k1, k2, k1 again (a new request: the first one's block landed), k3-k5
    assert tiers.lookup(k1) == HIT              # the request whose lookup started the read asks again
    after = {t: metric(m, "tiered_kv_lookup_hits_total", tier=t) for t in tiers_}
    assert after == {"host": 0, "disk": 1, "remote": 0}, f"k1 served once, one disk hit: {before} -> {after}"
    assert metric(m, "tiered_kv_lookup_keys_total") == keys, "k1's re-ask counted as a second key"


# =========================================================================== a dead disk I/O process
def test_lookup_while_the_disk_io_process_is_down_misses_instead_of_stalling_the_request(rig):
    """DiskTier.restart: while the tier is down (a restart in back-off) reads miss.  vLLM defers a request
    whose lookup says PENDING and asks again next step; here it is deferred for the whole back-off."""
    import signal
    import time

    from test_disk_process import _wait_down

    tiers = _disk_only(rig, [A], num_slots=4, io="process")
    tier = tiers.core.disk
    store = tiers.disk
    tier.restarts, tier._started_at, tier._backoff = 1, time.monotonic(), 30.0   # died again soon after a restart
    store.kill_for_test(signal.SIGKILL)
    _wait_down(store)
    answers = []
    for _ in range(4):                          # four engine steps, each asking for the block once
        answers.append(tiers.lookup(A))
        tiers.tick()
    assert tier.down and not tier.usable        # still in its back-off
    m = tiers.metrics
    disk_hits = metric(m, "tiered_kv_lookup_hits_total", tier="disk")
    assert answers[-1] == MISS, f"answers while the disk tier is down: {answers}, disk hits counted: {disk_hits}"


def test_flush_and_close_after_the_io_process_died_answer_without_raising(rig):
    """flush() with the I/O process dead answers False (not durable) at once; close() then returns, bounded."""
    import signal
    import time

    from test_disk_process import _wait_down

    tiers = _disk_only(rig, [A], num_slots=4, io="process")
    assert tiers.lookup(A) == PENDING               # a read-back in flight at the death
    store_ready(tiers, [B])                         # its write-through spill goes to the child
    store = tiers.disk
    store.kill_for_test(signal.SIGKILL)
    _wait_down(store)
    t0 = time.monotonic()
    assert tiers.flush(timeout=10) is False
    assert time.monotonic() - t0 < 5
    assert tiers.lookup(B) == HIT                   # the host copy still serves
    t0 = time.monotonic()
    tiers.close()
    assert time.monotonic() - t0 < 25
