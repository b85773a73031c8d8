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
from disk_helpers import WriterGate, drain, raw_keys, raw_token, raw_tombs, spy_spills
from fakes import make_config, make_fake_manager, make_kv, mgr_metric, stored

from tiered_kv.disk.records import SPILL_PREVENTED, SpillGroup
from tiered_kv.jobs import JobKind, JobState
from tiered_kv.reports import Report

ROW_BYTES = 4096
KEYS = [b"g%d" % i for i in range(6)]


def _manager(tmp_path, *, hook=None, **over):
    kv = make_kv(16)
    opts = dict(host_slots=16, disk_path=tmp_path / "d", disk_capacity_bytes=256 * ROW_BYTES,
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
