"""The disk tier's main flows: write-through / write-back spills, promotes on load,
lookup across tiers, reopen, LRU and capacity, durability modes, one manager per
path, namespace / format / block-size mismatch, configuration errors.

Every manager runs the real ThreadMover and DiskStore on ``tmp_path``; ordering
is forced with ``flush()``, ``wait()`` and writer gates, never with sleeps.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path
import time

import pytest
import torch
from prometheus_client import CollectorRegistry

from disk_helpers import (NS, PYTHON, ROW, child_env, content, disk_config, disk_health, drain, fill,
                          keys, load_into, load_ok, make_kv, metric, put_raw, raw_keys, readline, rig, row_is,
                          store_one, store_seq)
from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.errors import ConfigError, DiskInUseError

__all__ = ["rig"]


# ============================================================================ basic flows
def test_write_through_spills_every_completed_store(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=16)
    ks = keys(10)
    store_seq(mgr, kv, ks, flush=False)
    assert mgr.flush(timeout=30) is True
    assert mgr.disk_blocks == 10
    assert metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="ok") == 10
    assert metric(mgr, "tiered_kv_transfer_bytes_total", src="host", dst="disk") == 10 * ROW
    assert metric(mgr, "tiered_kv_tier_blocks", tier="disk") == 10
    assert metric(mgr, "tiered_kv_tier_used_bytes", tier="disk") == 10 * ROW
    assert disk_health(mgr) == 1.0
    assert mgr.disk_healthy
    rig.close(mgr)
    assert raw_keys(rig.path) == set(ks)


def test_load_of_disk_only_key_promotes_and_reports_once(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=2)
    ks = keys(4)
    store_seq(mgr, kv, ks)                      # host keeps the last two, disk all four
    assert mgr.host_bytes(ks[0]) is None and mgr.host_bytes(ks[3]) is not None
    assert mgr.lookup(ks) == 4                  # disk, disk, host, host
    mgr.poll()                                  # lookup counts are applied at the end of the next poll
    assert metric(mgr, "tiered_kv_lookup_hits_total", tier="disk") == 2
    assert metric(mgr, "tiered_kv_lookup_hits_total", tier="host") == 2
    # host, disk, host, disk, then a miss: the run stops there (a key after it is not counted)
    assert mgr.lookup([ks[3], ks[0], ks[2], ks[1], b"missing", ks[3]]) == 4
    mgr.poll()
    assert metric(mgr, "tiered_kv_lookup_hits_total", tier="disk") == 4
    assert metric(mgr, "tiered_kv_lookup_hits_total", tier="host") == 4
    assert metric(mgr, "tiered_kv_lookup_keys_total") == 10
    kv[5].fill_(0xEE)
    job, comp = load_into(mgr, kv, ks[0], 5)
    assert job is not None and comp is not None and comp.ok, comp
    assert row_is(kv, 5, ks[0])
    assert metric(mgr, "tiered_kv_jobs_total", kind="promote", outcome="ok") == 1
    assert metric(mgr, "tiered_kv_jobs_total", kind="load", outcome="ok") == 1
    assert metric(mgr, "tiered_kv_transfer_bytes_total", src="disk", dst="host") == ROW
    # the promoted block is now in the host tier too, with its bytes
    hb = mgr.host_bytes(ks[0])
    assert hb is not None and torch.equal(hb, content(ks[0]))
    assert mgr.poll() == []


def test_lookup_counts_leading_keys_ready_in_host_or_disk(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=2)
    a, b, c, d = keys(4)
    store_seq(mgr, kv, [a, b, c])            # a only on disk now
    assert mgr.lookup([a, c, b]) == 3
    assert mgr.lookup([a, d, b]) == 1
    assert mgr.lookup([d, a]) == 0
    assert mgr.load(d, 0) is None


def test_two_loads_of_one_disk_key_share_one_promote(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=2)
    ks = keys(3)
    store_seq(mgr, kv, ks)
    kv[6].fill_(1)
    kv[7].fill_(2)
    j1 = mgr.load(ks[0], 6)
    j2 = mgr.load(ks[0], 7)
    assert j1 is not None and j2 is not None
    comps = mgr.wait([j1, j2], timeout=30)
    comps += mgr.poll()
    mine = [c for c in comps if c.job in (j1, j2)]
    assert sorted(c.job.block for c in mine) == [6, 7] and all(c.ok for c in mine), mine
    assert row_is(kv, 6, ks[0]) and row_is(kv, 7, ks[0])
    assert metric(mgr, "tiered_kv_jobs_total", kind="promote", outcome="ok") == 1


def test_invalidate_removes_key_from_every_tier_and_from_lmdb(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=2)
    ks = keys(4)
    store_seq(mgr, kv, ks)
    mgr.invalidate(ks[0])          # only on disk
    mgr.invalidate(ks[3])          # on host and disk
    assert mgr.lookup([ks[0]]) == 0 and mgr.lookup([ks[3]]) == 0
    assert mgr.load(ks[0], 0) is None and mgr.load(ks[3], 0) is None
    assert mgr.flush(timeout=30) is True
    assert mgr.disk_blocks == 2
    assert mgr.debug_sizes()["disk_tombstones"] == 0
    rig.close(mgr)
    assert raw_keys(rig.path) == {ks[1], ks[2]}
    mgr2 = rig.open(kv, host_slots=2)
    assert mgr2.lookup([ks[0]]) == 0 and mgr2.lookup([ks[3]]) == 0
    assert mgr2.lookup([ks[1], ks[2]]) == 2


def test_invalidate_while_promote_in_flight_cancels_the_load_and_never_writes_the_row(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=2)
    ks = keys(3)
    store_seq(mgr, kv, ks)
    fill(kv, 5, b"sentinel")
    job = mgr.load(ks[0], 5)
    assert job is not None
    mgr.invalidate(ks[0])             # no poll in between: the promote is still in flight
    got = mgr.wait([job], timeout=30) + drain(mgr)
    mine = [c for c in got if c.job is job]
    assert len(mine) == 1 and not mine[0].ok and "cancel" in (mine[0].error or ""), mine
    assert row_is(kv, 5, b"sentinel")
    assert mgr.lookup([ks[0]]) == 0 and mgr.load(ks[0], 6) is None
    assert mgr.flush(timeout=30) is True
    rig.close(mgr)
    assert ks[0] not in raw_keys(rig.path)


def test_cancel_of_a_load_waiting_for_its_promote(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=2)
    ks = keys(3)
    store_seq(mgr, kv, ks)
    fill(kv, 5, b"sentinel")
    job = mgr.load(ks[0], 5)
    assert job is not None
    mgr.cancel(job)
    got = mgr.poll()
    mine = [c for c in got if c.job is job]
    assert len(mine) == 1 and not mine[0].ok
    drain(mgr)
    assert row_is(kv, 5, b"sentinel")
    # the promote itself completed: the key is readable, from the host tier now
    assert mgr.lookup([ks[0]]) == 1
    assert load_ok(mgr, kv, ks[0], 4)


@pytest.mark.disk_threads
@pytest.mark.parametrize("durability", ["sync", "batch", "none"])
def test_a_new_tier_directory_and_its_files_are_named_durably(rig, tmp_path, monkeypatch, durability):
    """A file's fsync does not sync its name: a tier made in new directories, whose spills a flush()
    reported durable, could vanish whole in a power loss.  Each directory made is synced into its
    parent when the path is taken, and the tier's directory once its files exist (not for "none")."""
    from tiered_kv.disk import lock
    synced: list[Path] = []
    real = lock.fsync_path

    def spy(p, directory=False):
        if directory:   # a store syncs its directory through the descriptor it opened it with
            synced.append(Path(os.readlink(f"/proc/self/fd/{p}")) if isinstance(p, int) else Path(p).absolute())
        real(p, directory)

    monkeypatch.setattr(lock, "fsync_path", spy)
    path = tmp_path / "x" / "y" / "tier"
    kv = make_kv(8)
    mgr = rig.open(kv, path=path, durability=durability)
    parents = [(tmp_path / "x" / "y").absolute(), (tmp_path / "x").absolute(), tmp_path.absolute()]
    assert synced == parents + ([] if durability == "none" else [path.absolute()])
    rig.close(mgr)
    synced.clear()
    rig.open(kv, path=path, durability=durability)   # nothing made: the tier's directory only
    assert synced == ([] if durability == "none" else [path.absolute()])


def test_reopen_serves_every_entry_with_its_bytes(rig):
    kv = make_kv(8)
    ks = keys(20) + [b"L" * 600]        # a key longer than LMDB's key limit: stored under a digest
    mgr = rig.open(kv, host_slots=4)
    store_seq(mgr, kv, ks)
    rig.close(mgr)
    mgr = rig.open(kv, host_slots=4)
    assert mgr.disk is not None and mgr.disk.recovery.entries == len(ks)
    assert metric(mgr, "tiered_kv_recovery_seconds") == pytest.approx(mgr.disk.recovery.seconds)
    assert mgr.lookup(ks) == len(ks)
    for i, k in enumerate(ks):
        kv[i % 8].fill_(0)
        assert load_ok(mgr, kv, k, i % 8), k


@pytest.mark.parametrize("durability", ["sync", "batch", "none"])
def test_each_durability_mode_flushes_and_reopens(rig, durability):
    kv = make_kv(8)
    ks = keys(12)
    mgr = rig.open(kv, host_slots=16, durability=durability)
    for i, k in enumerate(ks):
        store_one(mgr, kv, k, i % 8, flush=False)
    assert mgr.flush(timeout=30) is True
    assert mgr.disk_blocks == len(ks)
    rig.close(mgr)
    assert raw_keys(rig.path) == set(ks)
    mgr = rig.open(kv, host_slots=4, durability=durability)
    assert mgr.lookup(ks) == len(ks)
    for i, k in enumerate(ks):
        assert load_ok(mgr, kv, k, i % 8)


def test_write_back_spills_only_under_host_pressure_and_never_loses_a_block(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=32, write_mode="back")
    ks = keys(48)
    for i in range(20):                    # 20/32 slots: below the 3/4 mark, nothing spilled
        store_one(mgr, kv, ks[i], i % 8)
    assert mgr.disk_blocks == 0 and metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="ok") == 0
    for i in range(20, 48):                # past 3/4: the coldest are written before being evicted
        store_one(mgr, kv, ks[i], i % 8)
    assert mgr.flush(timeout=30) is True
    drain(mgr)
    assert mgr.lookup(ks) == 48
    for i, k in enumerate(ks[:16]):        # evicted from host: served from disk
        assert mgr.host_bytes(k) is None
        assert load_ok(mgr, kv, k, i % 8), k


@pytest.mark.disk_threads
def test_write_back_spills_leave_the_written_blocks_the_next_victims(rig):
    """A write-back spill reads the coldest host blocks.  It used to lease them like a load, and the
    lease's release made them the most recently used: the blocks not yet written became the coldest,
    and the next store that evicted took them, unwritten (lost, though the disk had room; the trace
    replay hit 33 where its simulation hit 118).  A spill is no use of a block now (it is pinned where
    it is), so the blocks written are the next victims."""
    kv = torch.zeros((64, ROW), dtype=torch.uint8)
    mgr = rig.open(kv, host_slots=64, disk_slots=256, write_mode="back", host_evict_ahead_blocks=0,
                   writer_queue_blocks=8, writer_batch_blocks=8)
    gate = rig.gate(mgr)
    old, new = keys(48), keys(24, "n")
    for i, k in enumerate(old):
        fill(kv, i, k)
    job = mgr.store_many(old, list(range(48)))     # 3/4 of the host: the 8 coldest are spilled
    assert job is not None and mgr.wait([job], timeout=30) and job.done
    gate.step(1)                                   # k0..k7 written; 16 more on their way, held
    deadline = time.monotonic() + 30
    while metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="ok") < 8 and time.monotonic() < deadline:
        gate.entered(1)
        mgr.wait(timeout=0.01)
    assert metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="ok") == 8
    for i, k in enumerate(new):
        fill(kv, i, k)
    job = mgr.store_many(new, list(range(24)))     # 16 free slots, 8 evictions
    assert job is not None and mgr.wait([job], timeout=30) and job.done
    assert metric(mgr, "tiered_kv_evictions_total", tier="host") == 8
    assert metric(mgr, "tiered_kv_shed_total", kind="spill", reason="evicted_unwritten") == 0
    gate.open()
    assert mgr.flush(timeout=30) is True
    assert [k for k in old + new if mgr.lookup([k]) == 0] == []
    for i, k in enumerate(old[:8]):                # the 8 written first were the victims: from disk
        assert mgr.host_bytes(k) is None
        assert load_ok(mgr, kv, k, i), k


@pytest.mark.disk_threads
def test_write_back_counts_each_block_evicted_before_its_spill(rig):
    """With the writer held, the spills write-back started stay pinned and a store that evicts takes
    blocks not written yet: each is counted (``tiered_kv_shed_total{kind="spill",
    reason="evicted_unwritten"}``), and they are exactly the blocks in no tier afterwards."""
    kv = torch.zeros((64, ROW), dtype=torch.uint8)
    mgr = rig.open(kv, host_slots=64, disk_slots=256, write_mode="back", host_evict_ahead_blocks=0,
                   writer_queue_blocks=8, writer_batch_blocks=8)
    gate = rig.gate(mgr)                           # nothing is written until the end
    old, new = keys(48), keys(40, "n")
    for i, k in enumerate(old):
        fill(kv, i, k)
    job = mgr.store_many(old, list(range(48)))
    assert job is not None and mgr.wait([job], timeout=30) and job.done
    for i, k in enumerate(new):
        fill(kv, i, k)
    job = mgr.store_many(new, list(range(40)))     # 16 free slots, 24 evictions past the pinned spills
    assert job is not None and mgr.wait([job], timeout=30) and job.done
    unwritten = metric(mgr, "tiered_kv_shed_total", kind="spill", reason="evicted_unwritten")
    assert metric(mgr, "tiered_kv_evictions_total", tier="host") == 24 and 0 < unwritten <= 24
    gate.open()
    assert mgr.flush(timeout=30) is True
    assert len([k for k in old + new if mgr.lookup([k]) == 0]) == unwritten


@pytest.mark.disk_threads
def test_write_back_counts_a_shed_block_once_however_often_it_offers_it_again(rig):
    """Write-back offers a block shed at its spill's start (here ``disk_full``: every disk slot is being
    written, the writer held) again at later passes; each block is counted once, whether it is shed again
    or evicted unwritten at last: the shed counter counts blocks, not passes."""
    kv = torch.zeros((64, ROW), dtype=torch.uint8)
    mgr = rig.open(kv, host_slots=64, disk_slots=8, write_mode="back", host_evict_ahead_blocks=0)
    rig.gate(mgr)                                  # nothing is written: the disk's slots stay reserved
    ks = keys(48)
    for i, k in enumerate(ks):
        fill(kv, i, k)
    job = mgr.store_many(ks, list(range(48)))
    assert job is not None and mgr.wait([job], timeout=30) and job.done
    for _ in range(5):                             # five more passes offer the shed blocks again
        mgr.poll()
    shed = metric(mgr, "tiered_kv_shed_total", kind="spill", reason="disk_full")
    in_flight = mgr.disk_blocks                    # the disk entries reserved for spills held by the gate
    assert 0 < shed == 48 - in_flight, (shed, in_flight)
    new = keys(16, "n")
    for i, k in enumerate(new):
        fill(kv, i, k)
    job = mgr.store_many(new, list(range(16)))     # 16 free slots: no eviction yet
    assert job is not None and mgr.wait([job], timeout=30) and job.done
    more = keys(8, "m")
    for i, k in enumerate(more):
        fill(kv, i, k)
    job = mgr.store_many(more, list(range(8)))     # 8 evictions of blocks shed before: counted already
    assert job is not None and mgr.wait([job], timeout=30) and job.done
    assert metric(mgr, "tiered_kv_evictions_total", tier="host") == 8
    assert metric(mgr, "tiered_kv_shed_total", kind="spill", reason="evicted_unwritten") == 0


def test_write_back_keeps_up_with_steps_that_store_more_than_a_few_blocks(rig):
    """Write-back spills, once per call, the blocks stored since the last one (plus a few) from a
    reserve of the next victims sized to the steps' stores: 32 stores a step on a 128-block host
    lose none, and the blocks it wrote first are the first evicted."""
    kv = torch.zeros((32, ROW), dtype=torch.uint8)
    mgr = rig.open(kv, host_slots=128, disk_slots=1024, write_mode="back")
    ks = keys(20 * 32)
    for step in range(20):
        part = ks[32 * step: 32 * step + 32]
        for i, k in enumerate(part):
            fill(kv, i, k)
        job = mgr.store_many(part, list(range(32)))
        assert job is not None and mgr.wait([job], timeout=30) and job.done
        assert mgr.flush(timeout=30) is True
    assert metric(mgr, "tiered_kv_evictions_total", tier="host") >= 20 * 32 - 128
    assert metric(mgr, "tiered_kv_shed_total", kind="spill", reason="evicted_unwritten") == 0
    assert [k for k in ks if mgr.lookup([k]) == 0] == []


def test_write_back_spills_each_host_residency_once_even_when_the_disk_tier_is_smaller(rig):
    """Write-back used to spill "every cold host entry not on disk" at every poll: with a disk tier
    smaller than the host tier each spill evicted a disk entry whose key was still on the host, which
    the next poll spilled again -- disk writes without end while the engine was idle, and close()
    waited out its 30 s for spills to stop.  Each host residency is now spilled once."""
    row = 256
    kv = torch.zeros((16, row), dtype=torch.uint8)
    mgr = rig.open(kv, host_slots=16, disk_slots=8, write_mode="back", host_evict_ahead_blocks=0)
    ks = keys(12)
    for i, k in enumerate(ks):                 # 12 of 16 host slots: past the 3/4 mark
        fill(kv, i, k)
        assert mgr.store(k, i) is not None
    drain(mgr)
    assert mgr.flush(timeout=30) is True
    written = metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="ok")
    assert written == 12                       # each once; the disk tier keeps the 8 most recent
    for _ in range(4):                         # the engine does nothing
        assert mgr.flush(timeout=30) is True
        mgr.poll()
    assert metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="ok") == written
    assert mgr.disk_blocks == 8 and metric(mgr, "tiered_kv_evictions_total", tier="disk") == 4
    assert mgr.lookup(ks) == 12                # all on the host; the disk holds 8 of them too
    rig.close(mgr)                             # returns without waiting on spills that never stop


# ============================================================================ LRU and capacity
def test_capacity_evicts_least_recently_written_from_lookup_and_lmdb(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=2, disk_slots=4)
    ks = keys(6)
    store_seq(mgr, kv, ks)
    assert mgr.disk_blocks == 4
    assert metric(mgr, "tiered_kv_evictions_total", tier="disk") == 2
    assert mgr.lookup([ks[0]]) == 0 and mgr.lookup([ks[1]]) == 0
    assert mgr.load(ks[0], 0) is None
    assert mgr.lookup(ks[2:]) == 4
    assert mgr.flush(timeout=30) is True
    rig.close(mgr)
    assert raw_keys(rig.path) == set(ks[2:])


def test_lookup_refreshes_disk_recency(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=2, disk_slots=4)
    ks = keys(5)
    store_seq(mgr, kv, ks[:4])
    assert mgr.lookup([ks[0]]) == 1        # k0 (disk only) becomes most recent
    store_one(mgr, kv, ks[4], 4)           # evicts k1, the least recent
    assert mgr.lookup([ks[1]]) == 0
    assert mgr.lookup([ks[0]]) == 1 and mgr.lookup(ks[2:]) == 3


@pytest.mark.parametrize("promoted", [False, True], ids=["write-order", "promote-touch"])
def test_recency_survives_restart(rig, promoted):
    kv = make_kv(8)
    ks = keys(5)
    mgr = rig.open(kv, host_slots=2, disk_slots=4)
    store_seq(mgr, kv, ks[:4])
    if promoted:
        assert load_ok(mgr, kv, ks[0], 6)  # promote from disk: k0 becomes the most recent
        assert mgr.flush(timeout=30) is True
    rig.close(mgr)
    mgr = rig.open(kv, host_slots=2, disk_slots=4)
    store_one(mgr, kv, ks[4], 4)           # the first spill after the restart evicts the least recent
    gone = ks[1] if promoted else ks[0]
    kept = [k for k in ks if k != gone]
    assert mgr.lookup([gone]) == 0
    for k in kept:
        assert mgr.lookup([k]) == 1, k
    rig.close(mgr)
    assert raw_keys(rig.path) == set(kept)


def test_reopen_with_smaller_capacity_evicts_the_oldest(rig):
    kv = make_kv(8)
    ks = keys(4)
    mgr = rig.open(kv, host_slots=2, disk_slots=4)
    store_seq(mgr, kv, ks)
    rig.close(mgr)
    mgr = rig.open(kv, host_slots=2, disk_slots=2)
    assert mgr.disk_blocks == 2
    assert mgr.lookup([ks[0]]) == 0 and mgr.lookup([ks[1]]) == 0
    assert mgr.lookup(ks[2:]) == 2
    assert mgr.flush(timeout=30) is True
    rig.close(mgr)
    assert raw_keys(rig.path) == set(ks[2:])


@pytest.mark.disk_threads
def test_spills_are_shed_when_every_disk_slot_is_being_written(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=8, disk_slots=2)
    gate = rig.gate(mgr)                    # no spill can commit, so no disk slot frees up
    ks = keys(4)
    jobs = []
    for i, k in enumerate(ks):
        fill(kv, i, k)
        jobs.append(mgr.store(k, i))
    got = mgr.wait(jobs, timeout=30)
    assert all(c.ok for c in got) and len(got) == 4
    assert metric(mgr, "tiered_kv_shed_total", kind="spill", reason="disk_full") == 2
    gate.open()
    assert mgr.flush(timeout=30) is True
    assert mgr.disk_blocks == 2
    assert mgr.lookup(ks) == 4             # all still on host


# ============================================================================ one manager per path
def test_second_manager_on_the_same_path_in_this_process_raises(rig):
    kv = make_kv(8)
    mgr = rig.open(kv)
    store_one(mgr, kv, b"a", 0)
    with pytest.raises(DiskInUseError, match=str(os.getpid())):
        TierManager(disk_config(rig.path), make_kv(8), registry=CollectorRegistry())
    # the first manager is unaffected
    store_one(mgr, kv, b"b", 1)
    assert mgr.disk_blocks == 2 and mgr.disk_healthy
    rig.close(mgr)
    mgr2 = rig.open(kv)
    assert mgr2.lookup([b"a", b"b"]) == 2


_CHILD = textwrap.dedent("""
    import sys, torch
    from prometheus_client import CollectorRegistry
    from tiered_kv import TierManager
    from tiered_kv.errors import DiskInUseError
    from disk_helpers import disk_config, make_kv
    path = sys.argv[1]
    def open_mgr():
        return TierManager(disk_config(path), make_kv(8), registry=CollectorRegistry())
    try:
        open_mgr().close()
        print("opened", flush=True)
    except DiskInUseError as exc:
        print("in-use", exc, flush=True)
    sys.stdin.readline()                 # the parent closed its manager
    m = open_mgr()
    print("holding", flush=True)
    sys.stdin.readline()
    m.close()
    print("closed", flush=True)
""")


def test_second_manager_on_the_same_path_in_another_process_raises(rig):
    kv = make_kv(8)
    mgr = rig.open(kv)
    store_one(mgr, kv, b"a", 0)
    proc = subprocess.Popen([PYTHON, "-c", _CHILD, str(rig.path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        line = readline(proc, 120)
        assert line.startswith("in-use") and str(os.getpid()) in line, line
        rig.close(mgr)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert readline(proc, 60) == "holding"
        with pytest.raises(DiskInUseError, match=str(proc.pid)):
            TierManager(disk_config(rig.path), make_kv(8), registry=CollectorRegistry())
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert readline(proc, 60) == "closed"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    mgr2 = rig.open(kv)
    assert mgr2.lookup([b"a"]) == 1


# ============================================================================ bad configuration
def test_disk_path_without_capacity_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="disk_capacity_bytes"):
        TieredKVConfig(namespace=NS, host_capacity_bytes=16 * ROW, disk_path=tmp_path / "d", disk_capacity_bytes=0)


def test_disk_capacity_below_one_block_is_a_config_error(tmp_path):
    kv = make_kv(8)
    cfg = TieredKVConfig(namespace=NS, host_capacity_bytes=16 * ROW, disk_path=tmp_path / "d",
                         disk_capacity_bytes=ROW - 1)
    with pytest.raises(ConfigError, match="disk_capacity_bytes"):
        TierManager(cfg, kv, registry=CollectorRegistry())
    # nothing was left holding the path
    mgr = TierManager(cfg.replace(disk_capacity_bytes=ROW), kv, registry=CollectorRegistry())
    try:
        assert mgr.disk is not None
    finally:
        mgr.close()


# ============================================================================ foreign directories
def _assert_host_only(mgr: TierManager, kv: torch.Tensor) -> None:
    assert mgr.disk is None and not mgr.disk_healthy
    assert disk_health(mgr) == 0.0
    assert metric(mgr, "tiered_kv_errors_total", tier="disk", error="open_failed") == 1
    # the host tier keeps serving, nothing raises
    store_one(mgr, kv, b"host-only", 0, flush=False)
    assert mgr.flush(timeout=5) is True
    assert mgr.lookup([b"host-only"]) == 1
    assert load_ok(mgr, kv, b"host-only", 1)
    mgr.invalidate(b"host-only")
    assert mgr.lookup([b"host-only"]) == 0


def test_directory_of_another_namespace_runs_host_only_and_is_left_intact(rig):
    kv = make_kv(8)
    ks = keys(3)
    mgr = rig.open(kv)
    store_seq(mgr, kv, ks)
    rig.close(mgr)
    other = rig.open(kv, namespace="another|model")
    _assert_host_only(other, kv)
    assert other.lookup(ks) == 0
    rig.close(other)
    mgr = rig.open(kv)
    assert mgr.lookup(ks) == 3


def test_directory_of_another_format_version_runs_host_only(rig):
    kv = make_kv(8)
    mgr = rig.open(kv)
    store_seq(mgr, kv, keys(2))
    rig.close(mgr)
    put_raw(rig.path, "meta", b"format_version", b"999")
    mgr = rig.open(kv)
    _assert_host_only(mgr, kv)


def test_directory_of_another_block_size_runs_host_only(rig):
    kv = make_kv(8)
    mgr = rig.open(kv)
    store_seq(mgr, kv, keys(2))
    rig.close(mgr)
    small = make_kv(8, row_bytes=ROW // 2)
    mgr = rig.open(small)
    _assert_host_only(mgr, small)
    rig.close(mgr)
    mgr = rig.open(kv)
    assert mgr.lookup(keys(2)) == 2


# ============================================================================ edges of store / load
def test_store_of_a_key_already_on_disk_is_a_no_op(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=2)
    ks = keys(3)
    store_seq(mgr, kv, ks)                 # ks[0] is only on disk
    fill(kv, 4, ks[0])
    assert mgr.store(ks[0], 4) is None
    assert mgr.flush(timeout=30) is True
    assert metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="ok") == 3
    assert mgr.disk_blocks == 3


@pytest.mark.disk_threads
def test_load_of_a_disk_key_is_shed_when_every_host_slot_is_leased(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=1)
    store_one(mgr, kv, b"old", 0)          # on disk (and in the only host slot)
    gate = rig.gate(mgr)
    store_one(mgr, kv, b"new", 1, flush=False)   # evicts "old" from host; its spill leases the slot
    gate.entered(1)
    assert mgr.host_bytes(b"old") is None and mgr.lookup([b"old"]) == 1
    assert mgr.load(b"old", 2) is None
    mgr.poll()                             # sheds are counted at the end of the next poll
    assert metric(mgr, "tiered_kv_shed_total", kind="load", reason="host_full") == 1
    gate.open()
    assert mgr.flush(timeout=30) is True
    drain(mgr)
    assert load_ok(mgr, kv, b"old", 2)
