"""Spill groups: a step's write-through spills travel as one job, one store request and one report.

Each key keeps its own token (on disk, in tombs, in deletes); the job is named by its first part's
token and answered once, with the parts that failed named in ``Report.failed``.  These tests force
the interleavings a group adds: a key invalidated while its group is being written (one part, every
part), a part failing inside a group, a group answered out of order inside the writer, and the disk
I/O process dying with a group outstanding.
"""

from __future__ import annotations

import signal
import time
import uuid

import pytest
import torch
from disk_helpers import WriterGate, drain, raw_keys, raw_token, raw_tombs, ready_host_entries, spy_spills
from fakes import ROW_BYTES, make_config, make_fake_manager, make_kv, mgr_metric, stored
from prometheus_client import CollectorRegistry

from tiered_kv import TieredKVConfig
from tiered_kv.disk.records import SPILL_PREVENTED, SpillGroup
from tiered_kv.integrations.scheduler import Lookup, SlabScheduler
from tiered_kv.integrations.slab import SharedSlab
from tiered_kv.jobs import JobKind, JobState
from tiered_kv.metrics import Metrics
from tiered_kv.reports import Report

KEYS = [b"g%d" % i for i in range(6)]


def _manager(tmp_path, *, hook=None, disk_blocks=256, **over):
    """A fake-mover manager: 16 host slots, a disk tier of ``disk_blocks`` (32: writer batches of 2)."""
    kv = make_kv(16)
    opts = dict(host_slots=16, disk_path=tmp_path / "d", disk_capacity_bytes=disk_blocks * ROW_BYTES,
                writer_batch_seconds=0.0, host_evict_ahead_blocks=0)
    opts.update(over)
    mgr, mover = make_fake_manager(make_config(**opts), kv)
    if hook is not None:
        mgr.disk.fault_hook = hook
    return mgr, mover, kv


def _spill_jobs(mgr):
    return {id(j): j for j in mgr._core.jobs.values() if j.kind is JobKind.SPILL}


# ---------------------------------------------------------------- the writer's side
def test_a_group_is_answered_once_after_its_last_part_whatever_the_order():
    """The writer answers parts as their batches commit (a group may span batches): nothing is sent
    before the last part, then one report under the first part's token naming each failed part."""
    t = uuid.uuid4()
    g = SpillGroup(t, 3)
    assert g.answer(2, Report(uuid.uuid4(), JobKind.SPILL, True, None, 10, 0.5)) is None
    assert g.answer(0, Report(uuid.uuid4(), JobKind.SPILL, False, "io_error")) is None
    r = g.answer(1, Report(uuid.uuid4(), JobKind.SPILL, True, None, 10, 0.25))
    assert r is not None and r.token == t and r.kind is JobKind.SPILL
    assert (r.ok, r.error, r.failed, r.nbytes, r.seconds) == (False, "io_error", {0: "io_error"}, 20, 0.75)


def test_a_group_whose_parts_all_succeed_is_ok_with_no_failed_parts():
    g = SpillGroup(uuid.uuid4(), 2)
    assert g.answer(1, Report(uuid.uuid4(), JobKind.SPILL, True, None, 7, 0.0)) is None
    r = g.answer(0, Report(uuid.uuid4(), JobKind.SPILL, True, None, 7, 0.0))
    assert r is not None and r.ok and r.failed is None and r.error is None and r.nbytes == 14


# ---------------------------------------------------------------- one job, one report
@pytest.mark.disk_threads
def test_a_store_of_several_keys_spills_as_one_job_each_key_under_its_own_token(tmp_path):
    gate = WriterGate(block_from=1)
    mgr, mover, kv = _manager(tmp_path, hook=gate)
    try:
        seen = spy_spills(mgr)
        stored(mgr, mover, kv, KEYS, list(range(len(KEYS))))
        jobs = _spill_jobs(mgr)
        assert len(jobs) == 1, "one spill job for the store's keys"
        (job,) = jobs.values()
        assert list(job.keys) == KEYS
        assert mgr_metric(mgr, "tiered_kv_jobs_in_flight", kind="spill") == 1
        tokens = [t for t, _ in seen]
        assert [k for _, k in seen] == KEYS and len(set(tokens)) == len(KEYS)
        assert job.token == tokens[0]
        # every part's token names the job (an invalidated key finds its write), nothing else does
        assert all(mgr._core.jobs[t.int] is job for t in tokens)
        gate.open()
        assert mgr.flush(timeout=30)
        drain(mgr)
        assert mgr_metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="ok") == len(KEYS)
        assert mgr_metric(mgr, "tiered_kv_jobs_in_flight", kind="spill") == 0
        assert not mgr._core.jobs, "every part's token left with the report"
        assert all(mgr._core.index.get(k).readers == 0 for k in KEYS), "every host slot's lease released"
        assert mgr.disk.queue_depth == 0
    finally:
        gate.open()
        mgr.close()
    assert raw_keys(tmp_path / "d") == set(KEYS)


# ---------------------------------------------------------------- invalidation inside a group
@pytest.mark.disk_threads
def test_a_key_invalidated_while_its_group_is_written_never_lands_and_the_rest_publish(tmp_path):
    """The forced interleaving: the writer holds the group's batch before its transaction; one key is
    invalidated (its part tombstoned, out of the index); then the batch commits."""
    gate = WriterGate(block_from=1)
    mgr, mover, kv = _manager(tmp_path, hook=gate)
    try:
        stored(mgr, mover, kv, KEYS, list(range(len(KEYS))))
        gate.entered(1)                                      # the writer holds the batch
        mgr.invalidate(KEYS[2])
        (job,) = _spill_jobs(mgr).values()
        assert job.state is JobState.PENDING, "the other parts still publish"
        gate.open()
        assert mgr.flush(timeout=30)
        drain(mgr)
        assert mgr.lookup([KEYS[2]]) == 0
        assert KEYS[2] not in mgr._core.dindex
        for k in KEYS[:2] + KEYS[3:]:
            assert mgr._core.dindex.ready(k) is not None, k
        assert mgr_metric(mgr, "tiered_kv_stale_callbacks_total", kind="spill", reason="superseded") == 1
        assert mgr_metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="ok") == len(KEYS) - 1
        assert mgr_metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="cancelled") == 1
        assert mgr_metric(mgr, "tiered_kv_orphaned_writes_prevented_total") == 1
        assert not mgr._core.jobs
    finally:
        gate.open()
        mgr.close()
    assert raw_keys(tmp_path / "d") == set(KEYS) - {KEYS[2]}
    assert raw_tombs(tmp_path / "d") == {}, "the tomb was consumed by the write it prevented"


@pytest.mark.disk_threads
def test_every_key_of_a_group_invalidated_cancels_the_whole_job(tmp_path):
    gate = WriterGate(block_from=1)
    mgr, mover, kv = _manager(tmp_path, hook=gate)
    try:
        stored(mgr, mover, kv, KEYS[:3], [0, 1, 2])
        gate.entered(1)
        (job,) = _spill_jobs(mgr).values()
        mgr.invalidate(KEYS[1])
        mgr.invalidate(KEYS[0])
        assert job.state is JobState.PENDING
        mgr.invalidate(KEYS[2])
        assert job.state is JobState.CANCELLING, "its last live part cancels the job"
        gate.open()
        assert mgr.flush(timeout=30)
        drain(mgr)
        assert job.state is JobState.CANCELLED
        assert mgr_metric(mgr, "tiered_kv_stale_callbacks_total", kind="spill", reason="superseded") == 3
        assert mgr_metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="ok") == 0
        assert mgr_metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="cancelled") == 3
        assert not mgr._core.jobs and mgr._core.dindex.used_slots == 0
    finally:
        gate.open()
        mgr.close()
    assert raw_keys(tmp_path / "d") == set()


@pytest.mark.disk_threads
def test_a_key_stored_again_after_its_group_part_was_invalidated_gets_a_new_write(tmp_path):
    """Invalidate a part in flight, store the key again (new bytes), let everything commit: disk
    holds the new write, never the cancelled part's."""
    gate = WriterGate(block_from=1)
    mgr, mover, kv = _manager(tmp_path, hook=gate)
    try:
        seen = spy_spills(mgr)
        stored(mgr, mover, kv, KEYS[:3], [0, 1, 2])
        gate.entered(1)
        mgr.invalidate(KEYS[1])
        stored(mgr, mover, kv, [KEYS[1]], [5])               # a new residency, its own spill job
        assert len(_spill_jobs(mgr)) == 2
        gate.open()
        assert mgr.flush(timeout=30)
        drain(mgr)
        old, new = [t for t, k in seen if k == KEYS[1]]
        d = mgr._core.dindex.ready(KEYS[1])
        assert d is not None and d.writer == new
        assert mgr_metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="ok") == 3
    finally:
        gate.open()
        mgr.close()
    assert raw_token(tmp_path / "d", KEYS[1]) == new != old


# ---------------------------------------------------------------- a part failing inside a group
def test_a_part_failing_inside_a_group_drops_only_that_key(tmp_path):
    """A fake writer answers the group with one failed part: that key leaves the disk index (counted
    failed, a fault for flush), the others publish, every host lease goes."""
    mgr, mover, kv = _manager(tmp_path)
    sent: list[tuple[list[uuid.UUID], list[bytes]]] = []
    store = mgr._core.disk.store
    try:
        store.submit_spills = lambda tokens, keys, slots, view: sent.append((tokens, keys)) or True
        stored(mgr, mover, kv, KEYS[:4], [0, 1, 2, 3])
        (tokens, keys), = sent
        assert keys == KEYS[:4]
        mgr._core.completions.put(Report(tokens[0], JobKind.SPILL, False, "io_error", 2 * ROW_BYTES, 0.01,
                                         {1: "io_error", 3: SPILL_PREVENTED}))
        mgr.poll()
        dix = mgr._core.dindex
        assert dix.ready(KEYS[0]) is not None and dix.ready(KEYS[2]) is not None
        assert KEYS[1] not in dix and KEYS[3] not in dix
        assert mgr_metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="ok") == 2
        assert mgr_metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="failed") == 2
        assert mgr._core.spill_faults == 1, "a tomb's prevention is not a fault"
        assert not mgr._core.jobs
        assert all(mgr._core.index.get(k).readers == 0 for k in KEYS[:4])
        # a late duplicate of the same report is stale, not applied twice
        mgr._core.completions.put(Report(tokens[0], JobKind.SPILL, True))
        mgr.poll()
        assert mgr_metric(mgr, "tiered_kv_stale_callbacks_total", kind="spill", reason="unknown_token") == 1
        assert KEYS[1] not in dix
    finally:
        del store.submit_spills
        mgr.close()


def test_a_group_failing_as_a_whole_drops_every_key(tmp_path):
    mgr, mover, kv = _manager(tmp_path)
    sent: list[list[uuid.UUID]] = []
    store = mgr._core.disk.store
    try:
        store.submit_spills = lambda tokens, keys, slots, view: sent.append(tokens) or True
        stored(mgr, mover, kv, KEYS[:3], [0, 1, 2])
        mgr._core.completions.put(Report(sent[0][0], JobKind.SPILL, False, "disk_full"))
        mgr.poll()
        assert mgr._core.dindex.used_slots == 0
        assert mgr_metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="failed") == 3
        assert mgr._core.spill_faults == 3
    finally:
        del store.submit_spills
        mgr.close()


# ---------------------------------------------------------------- room: all or none
@pytest.mark.disk_threads
def test_a_group_larger_than_the_queue_room_spills_what_fits_and_sheds_the_rest(tmp_path):
    gate = WriterGate(block_from=1)
    mgr, mover, kv = _manager(tmp_path, hook=gate, writer_queue_blocks=4)
    try:
        stored(mgr, mover, kv, KEYS, list(range(len(KEYS))))
        assert mgr_metric(mgr, "tiered_kv_shed_total", kind="spill", reason="backpressure") == 2
        shed = [k for k in KEYS if not mgr._core.index.get(k).spilled]
        assert shed == KEYS[4:], "the keys shed may be spilled again later"
        assert all(k not in mgr._core.dindex for k in shed)
        gate.open()
        assert mgr.flush(timeout=30)
        drain(mgr)
        assert mgr_metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="ok") == 4
    finally:
        gate.open()
        mgr.close()


@pytest.mark.disk_threads
def test_the_writer_takes_a_group_whole_or_not_at_all(tmp_path):
    gate = WriterGate(block_from=1)
    mgr, mover, kv = _manager(tmp_path, hook=gate, writer_queue_blocks=4)
    store = mgr._core.disk.store
    try:
        rows = [memoryview(bytearray(ROW_BYTES)) for _ in range(5)]
        toks = [uuid.uuid4() for _ in range(5)]
        assert store.spill_room() == 4
        assert not store.submit_spills(toks, [b"x%d" % i for i in range(5)], list(range(5)), rows.__getitem__)
        assert store.spill_room() == 4 and store.queue_depth == 0, "a refused group holds no room"
        assert store.submit_spills(toks[:4], [b"x%d" % i for i in range(4)], list(range(4)), rows.__getitem__)
        assert store.spill_room() == 0 and store.queue_depth == 4
        gate.open()
        assert mgr.flush(timeout=30)
        drain(mgr)
        assert store.spill_room() == 4
    finally:
        gate.open()
        mgr.close()


# ---------------------------------------------------------------- the disk I/O process
def test_a_group_outstanding_when_the_io_process_dies_is_answered_failed_once(tmp_path):
    mgr, mover, kv = _manager(tmp_path)
    store = mgr._core.disk.store
    try:
        store.kill_for_test(signal.SIGSTOP)    # the group is sent, never written
        stored(mgr, mover, kv, KEYS[:4], [0, 1, 2, 3])
        assert store.queue_depth == 4 and len(_spill_jobs(mgr)) == 1
        store.kill_for_test()                                 # SIGKILL: the receiver answers what was out
        deadline = time.monotonic() + 30
        while mgr._core.jobs:
            mgr.wait(timeout=0.05)
            assert time.monotonic() < deadline, mgr.debug_sizes()
        assert store.queue_depth == 0, "the group's four spills are answered, not one"
        assert mgr_metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="failed") == 4
        assert mgr._core.dindex.used_slots == 0
        assert mgr_metric(mgr, "tiered_kv_errors_total", tier="disk", error="io_process_died") == 1
    finally:
        mgr.close()


def test_a_group_through_the_io_process_is_answered_whole_and_frees_its_queue_room(tmp_path):
    mgr, mover, kv = _manager(tmp_path, writer_queue_blocks=8)
    store = mgr._core.disk.store
    try:
        stored(mgr, mover, kv, KEYS, list(range(len(KEYS))))
        assert mgr.flush(timeout=30)
        drain(mgr)
        assert store.queue_depth == 0 and store.spill_room() == 8
        assert mgr_metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="ok") == len(KEYS)
        assert all(mgr._core.dindex.ready(k) is not None for k in KEYS)
    finally:
        mgr.close()
    assert raw_keys(tmp_path / "d") == set(KEYS)


class WriterKilled(BaseException):
    """Not an Exception: the writer thread dies of it (as in tests/test_disk_faults.py)."""


# ---------------------------------------------------------------- metrics
@pytest.mark.disk_threads
def test_spill_copy_latency_is_observed_once_per_block(tmp_path):
    """``tiered_kv_transfer_seconds`` is "the duration of one block copy" (metrics.py, the dashboard's
    "Transfer latency p50 / p99 per link" panel): a spill job of N blocks is N observations, each
    its share of the writer's time, not one of their sum (N-fold quantiles, an N-fold smaller count)."""
    mgr, mover, kv = _manager(tmp_path)
    try:
        stored(mgr, mover, kv, KEYS, list(range(len(KEYS))))
        assert mgr.flush(timeout=30)
        drain(mgr)
        assert mgr_metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="ok") == len(KEYS)
        n = mgr_metric(mgr, "tiered_kv_transfer_seconds_count", src="host", dst="disk")
        assert n == len(KEYS), f"{len(KEYS)} blocks copied host->disk, {n:.0f} latency observation(s)"
    finally:
        mgr.close()


# ---------------------------------------------------------------- a group across writer batches
@pytest.mark.disk_threads
def test_a_part_committed_in_an_earlier_batch_of_its_group_then_invalidated_never_stays(tmp_path):
    """Batches of 2 blocks: the group's first batch commits (K0, K1 published on disk, the owner not
    told: the group answers after its last part), the writer holds the second; K0 is invalidated
    then (its tomb must delete the committed record), and stored again while still held."""
    gate = WriterGate(block_from=2)
    mgr, mover, kv = _manager(tmp_path, hook=gate, disk_blocks=32)
    k = KEYS[:4]
    try:
        stored(mgr, mover, kv, k, [0, 1, 2, 3])
        (job,) = _spill_jobs(mgr).values()
        gate.entered(2)                       # batch 1 committed, batch 2 held
        mgr.invalidate(k[0])
        mgr.invalidate(k[1])
        assert mgr.lookup([k[0]]) == 0 and mgr.lookup([k[1]]) == 0
        stored(mgr, mover, kv, [k[1]], [5])   # stored again: its own new write
        gate.open()
        assert mgr.flush(timeout=30)
        drain(mgr)
        assert mgr.lookup([k[0]]) == 0 and k[0] not in mgr._core.dindex
        for key in k[1:]:
            assert mgr._core.dindex.ready(key) is not None, key
        assert mgr_metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="cancelled") == 2
        assert mgr_metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="ok") == 3
        assert not mgr._core.jobs and mgr.disk.queue_depth == 0
        assert all(e.readers == 0 for e in mgr._core.index.entries())
        assert mgr._core.dindex.used_slots == len(mgr._core.dindex)
    finally:
        gate.open()
        mgr.close()
    assert raw_keys(tmp_path / "d") == set(k[1:])


@pytest.mark.disk_threads
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_writer_dying_between_two_batches_of_a_group_publishes_the_committed_parts_only(tmp_path):
    """The group's first batch commits, the writer thread dies at the second: one report, the
    committed parts published (they are on disk), the others failed; nothing leaks."""
    gate = WriterGate(block_from=None, raise_at={2: WriterKilled("writer killed")})
    mgr, mover, kv = _manager(tmp_path, hook=gate, disk_blocks=32)
    k = KEYS[:4]
    try:
        stored(mgr, mover, kv, k, [0, 1, 2, 3])
        deadline = time.monotonic() + 30
        while mgr._core.jobs:
            mgr.wait(timeout=0.05)
            assert time.monotonic() < deadline, mgr.debug_sizes()
        dix = mgr._core.dindex
        assert dix.ready(k[0]) is not None and dix.ready(k[1]) is not None
        assert k[2] not in dix and k[3] not in dix
        assert mgr_metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="ok") == 2
        assert mgr_metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="failed") == 2
        assert mgr_metric(mgr, "tiered_kv_jobs_in_flight", kind="spill") == 0
        assert mgr._core.spill_faults == 2
        assert all(e.readers == 0 for e in mgr._core.index.entries())
        assert mgr.flush(timeout=5) is False
    finally:
        mgr.close()
    assert raw_keys(tmp_path / "d") == set(k[:2])


# ---------------------------------------------------------------- the vLLM scheduler front end
A, B, C = b"key-A", b"key-B", b"key-C"


def test_scheduler_reset_while_a_group_is_held_publishes_nothing_and_frees_everything(tmp_path):
    slab = SharedSlab.open(tmp_path / "x.slab", 4, 256, 1)
    cfg = TieredKVConfig(namespace="t", host_capacity_bytes=4 * 256, disk_path=tmp_path / "disk",
                         disk_capacity_bytes=32 * 256, writer_batch_seconds=0.0, disk_io="thread")
    tiers = SlabScheduler(cfg, slab, metrics=Metrics(registry=CollectorRegistry(), namespace="t"))
    gate = WriterGate(block_from=2)
    tiers.disk.fault_hook = gate
    try:
        p = tiers.prepare_store([A, B, C])
        assert p.keys == [A, B, C]
        for key, s in zip(p.keys, p.slots):
            slab.rows[s] = torch.full((256,), 7, dtype=torch.uint8)
        slab.mark_done(0, p.seq)
        tiers.complete_store(p.keys)          # write-through: one spill job of 3 blocks, 2 batches
        tiers.tick()
        gate.entered(2)                       # A, B committed on disk; C held
        tiers.reset()
        assert all(tiers.lookup(key) is Lookup.MISS for key in (A, B, C))
        gate.open()
        assert tiers.flush(timeout=30)
        tiers.tick()
        sizes = tiers.debug_sizes()
        assert sizes["disk_jobs"] == 0 and sizes["host_used_slots"] == 0, sizes
        assert tiers.disk_blocks == 0 and not tiers.core.jobs
    finally:
        gate.open()
        tiers.close()
        slab.close()
    assert raw_keys(tmp_path / "disk") == set()


# ---------------------------------------------------------------------- a step's reservations together
def _spill_outcome(tmp_path, name, keys_first, keys_then, room, one_by_one, monkeypatch):
    """Two DiskTier.start_spills calls, the first's writes left in flight (their disk entries WRITING):
    what the second reserved and shed, by the step's batched path or key by key."""
    mgr, _, _ = _manager(tmp_path / name, disk_blocks=64, host_slots=64)
    try:
        disk = mgr._core.disk
        if keys_first is None:   # all but two of the disk tier's slots
            keys_first = [b"first%02d" % i for i in range(disk.index.num_slots - 2)]
        monkeypatch.setattr(disk.store, "submit_spills", lambda tokens, keys, slots, view: True)
        monkeypatch.setattr(disk.store, "spill_room", lambda: room)
        if one_by_one:
            monkeypatch.setattr(disk.index, "none_of", lambda keys: False)
        calls = []
        real = disk.index.reserve_each
        monkeypatch.setattr(disk.index, "reserve_each", lambda *a: calls.append(a) or real(*a))
        view = mgr._core.slot_views.__getitem__
        first = disk.start_spills(ready_host_entries(mgr, keys_first), mgr._core.index, mgr._core.tokens, view)
        hosts, disks, shed = disk.start_spills(ready_host_entries(mgr, keys_then), mgr._core.index, mgr._core.tokens, view)
        assert bool(calls) is not one_by_one
        assert [d.key for d in disks] == [e.key for e in hosts]
        assert len({d.writer for d in disks}) == len(disks), "a token per block"
        assert all(e.readers == 1 for e in hosts), "each written host entry leased to its write"
        assert all(e.readers == 0 for e, _ in shed), "a shed one holds nothing"
        assert disk.index.used_slots == len(disk.index), "a slot taken without an entry"
        return len(first[0]), [e.key for e in hosts], [(e.key, why) for e, why in shed]
    finally:
        mgr.close()


@pytest.mark.parametrize("room, first, then, expect_written, expect_shed", [
    (64, None, 6, 2, ["disk_full"] * 4),        # 2 slots left, the rest leased to writes in flight
    (64, 0, 6, 6, []),
    (3, 0, 6, 3, ["backpressure"] * 3),         # the writer queue's room
    (0, 0, 4, 0, ["backpressure"] * 4),
], ids=["disk-full", "all", "queue-room", "no-room"])
def test_a_steps_spills_reserved_together_match_the_key_by_key_loop(tmp_path, monkeypatch, room, first, then,
                                                                    expect_written, expect_shed):
    """DiskTier.start_spills takes a step's new blocks together (``TierIndex.reserve_each``); what it
    writes and sheds, and why, is what the key-by-key loop gives."""
    first_keys = None if first is None else [b"first%02d" % i for i in range(first)]
    then_keys = [b"then%02d" % i for i in range(then)]
    outcomes = []
    for one_by_one in (False, True):
        with monkeypatch.context() as m:
            outcomes.append(_spill_outcome(tmp_path, f"d{one_by_one}", first_keys, then_keys, room, one_by_one, m))
    assert outcomes[0] == outcomes[1]
    _, written, shed = outcomes[0]
    assert written == then_keys[:expect_written]
    assert [why for _, why in shed] == expect_shed


def _spill_step(tmp_path, name, monkeypatch, one_by_one, *, on_disk=(), twice=False, alive=True, **over):
    """One DiskTier.start_spills of six host entries (``on_disk``: keys written to the disk index
    first; ``twice``: the list names its first entry twice; ``alive``: the writer alive), by the step's
    batched path or key by key: what it wrote and shed, the disk index's keys and what was asked of
    the admission filter."""
    mgr, _, _ = _manager(tmp_path / name, disk_blocks=64, host_slots=64, **over)
    try:
        core, disk = mgr._core, mgr._core.disk
        monkeypatch.setattr(disk.store, "submit_spills", lambda tokens, keys, slots, view: True)
        monkeypatch.setattr(disk.store, "spill_room", lambda: 64)
        monkeypatch.setattr(disk.store, "writer_alive", lambda: alive)
        asked: list[bytes] = []
        real_admits = disk.index.admits
        monkeypatch.setattr(disk.index, "admits", lambda key, protect=(): asked.append(key) or real_admits(key, protect))
        if one_by_one:
            monkeypatch.setattr(disk.index, "none_of", lambda keys: False)
        for k in on_disk:
            d = disk.index.reserve(k, core.tokens())
            disk.index.publish(d)
        hosts = ready_host_entries(mgr, [b"s%d" % i for i in range(6)])
        if twice:
            hosts = [hosts[0]] + hosts
        written, disks, shed = disk.start_spills(hosts, core.index, core.tokens, core.slot_views.__getitem__)
        assert [e.readers for e in written] == [1] * len(written)
        assert disk.index.used_slots == len(disk.index)
        return ([e.key for e in written], [d.key for d in disks], [(e.key, why) for e, why in shed],
                sorted(e.key for e in disk.index.entries()), asked)
    finally:
        mgr.close()


@pytest.mark.parametrize("case", ["on-disk", "twice", "admission", "writer-dead"])
def test_a_step_the_batched_reservation_cannot_take_goes_key_by_key(tmp_path, monkeypatch, case):
    """What the step's batched reservation must leave to the loop: keys already on disk (passed over,
    neither written nor shed), an entry named twice (written once), an admission filter (asked for
    every new key), a dead writer (every block shed ``disk_down``).  Each gives what the key-by-key
    loop gives."""
    over = dict(on_disk=[b"s1", b"s4"] if case == "on-disk" else (), twice=case == "twice",
                alive=case != "writer-dead")
    if case == "admission":
        over["disk_admission"] = "second_hit"
    outcomes = []
    for one_by_one in (False, True):
        with monkeypatch.context() as m:
            outcomes.append(_spill_step(tmp_path, f"{case}-{one_by_one}", m, one_by_one, **over))
    assert outcomes[0] == outcomes[1]
    written, _, shed, on_disk, asked = outcomes[0]
    if case == "on-disk":
        assert written == [b"s0", b"s2", b"s3", b"s5"] and shed == [] and on_disk == sorted(b"s%d" % i for i in range(6))
    elif case == "twice":
        assert written == [b"s%d" % i for i in range(6)] and shed == []
    elif case == "admission":
        assert asked == [b"s%d" % i for i in range(6)] and written == [] and shed == []   # seen once: refused
    else:
        assert written == [] and shed == [(b"s%d" % i, "disk_down") for i in range(6)]


def test_a_cancelled_spill_whose_write_landed_is_counted_stale_not_published(tmp_path, monkeypatch):
    """A spill job cancelled whole (its one key invalidated) whose report then says the write landed:
    every part is discarded as stale, nothing is published, the host slot's lease goes, no bytes are
    counted as moved; the clean-report shortcut of ``_apply_spill`` must not take it."""
    from tiered_kv.jobs import StaleReason
    mgr, _, _ = _manager(tmp_path, disk_blocks=64, host_slots=64)
    try:
        core, disk = mgr._core, mgr._core.disk
        monkeypatch.setattr(disk.store, "submit_spills", lambda tokens, keys, slots, view: True)
        monkeypatch.setattr(disk.store, "cancel", lambda token, key: None)
        hosts = ready_host_entries(mgr, [b"c0", b"c1"])
        core.start_spills(hosts)
        job = core.jobs[disk.index.get(b"c0").writer.int]
        core.cancel(job, StaleReason.SUPERSEDED)
        assert job._dead is None
        before = mgr_metric(mgr, "tiered_kv_stale_callbacks_total", kind="spill", reason="superseded")
        core.apply(Report(job.token, JobKind.SPILL, True, None, 2 * ROW_BYTES, 0.001))   # pops the record, as a poll does
        assert mgr_metric(mgr, "tiered_kv_stale_callbacks_total", kind="spill", reason="superseded") == before + 2
        assert not core.jobs   # every part's token gone: close() has nothing to wait for
        assert b"c0" not in disk.index and b"c1" not in disk.index
        assert [e.readers for e in hosts] == [0, 0]
        assert mgr_metric(mgr, "tiered_kv_transfer_bytes_total", src="host", dst="disk") == 0
    finally:
        mgr.close()
