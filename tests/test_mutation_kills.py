"""Tests that kill mutants which survived ``make mutate`` (docs/testing.md).

Each test names, in its docstring, the mutmut mutant(s) it kills (``mutmut show NAME`` prints the
change) and asserts a behaviour of the real code that the mutant breaks.  They are deterministic:
fake movers or none, no sleeps, no randomness.
"""

from __future__ import annotations

import re
import threading
import time
import uuid

import pytest
import torch
from prometheus_client import CollectorRegistry
from disk_helpers import WriterGate
from fakes import (ROW_BYTES, fake_disk_manager, fill_row, instrument_get, make_config, make_fake_manager, make_kv,
                   mgr_metric, on_disk_only, row_matches, stored)

from tiered_kv import TierManager
from tiered_kv.core.index import EntryState, TierIndex
from tiered_kv.core.tiers import WRITEBACK_PER_STEP
from tiered_kv.disk import DiskStore
from tiered_kv.errors import BlockBusyError
from tiered_kv.jobs import JobKind, JobState, StaleReason


class _WriterKilled(BaseException):
    """Raised in the writer thread: not an Exception, so it ends the thread (a dying writer)."""


def hooked_disk_manager(tmp_path, hook, **over):
    """A fake-mover manager over a 64-block disk tier whose writer calls ``hook`` at each commit."""
    kv = make_kv(16)
    opts = dict(host_slots=8, disk_path=tmp_path / "d", disk_capacity_bytes=64 * ROW_BYTES, writer_batch_seconds=0.0)
    opts.update(over)
    mgr, mover = make_fake_manager(make_config(**opts), kv)
    if not isinstance(mgr.disk, DiskStore):
        mgr.close()
        raise AssertionError("a writer hook needs the disk I/O on threads: mark the test disk_threads")
    mgr.disk.fault_hook = hook
    return mgr, mover, kv


def tok() -> uuid.UUID:
    return uuid.uuid4()


def ready(ix: TierIndex, key: bytes):
    e = ix.reserve(key, tok())
    assert e is not None and ix.publish(e)
    return e


# ---------------------------------------------------------------- core/index.py


def test_coldest_returns_exactly_n_entries_when_more_are_evictable():
    """Kills ``tiered_kv.core.index.xǁTierIndexǁcoldest__mutmut_2`` (``len(out) > n``: one entry too
    many) and ``..._3`` (``return`` for ``break``: None instead of the list)."""
    ix = TierIndex(4)
    for k in (b"a", b"b", b"c", b"d"):
        ready(ix, k)
    assert [e.key for e in ix.coldest(1)] == [b"a"]
    assert [e.key for e in ix.coldest(3)] == [b"a", b"b", b"c"]
    assert ix.coldest(0) == []
    assert [e.key for e in ix.coldest(9)] == [b"a", b"b", b"c", b"d"]


def test_reserve_absent_touches_a_key_already_present():
    """Kills ``tiered_kv.core.index.xǁTierIndexǁreserve_absent__mutmut_11`` (``lru_get(None)``: a
    present key is not marked recently used, so it is the next one evicted)."""
    evicted: list[bytes] = []
    ix = TierIndex(2, on_evict=lambda e: evicted.append(e.key))
    ready(ix, b"a")
    ready(ix, b"b")
    got, new, full = ix.reserve_absent([b"a"], tok(), (), None)
    assert (got, new, full) == ([], [], 0)
    assert [e.key for e in ix.coldest(2)] == [b"b", b"a"]
    got, new, full = ix.reserve_absent([b"c"], tok(), (), None)
    assert got == [b"c"] and full == 0
    assert evicted == [b"b"]


def test_reserve_absent_skips_a_key_of_another_tier_and_goes_on():
    """Kills ``tiered_kv.core.index.xǁTierIndexǁreserve_absent__mutmut_18`` (``break`` for ``continue``
    after a key found in ``elsewhere``: the keys after it are not reserved)."""
    ix = TierIndex(4)
    got, new, full = ix.reserve_absent([b"x", b"on-disk", b"y"], tok(), (), {b"on-disk"})
    assert got == [b"x", b"y"] and [e.key for e in new] == [b"x", b"y"] and full == 0
    assert b"on-disk" not in ix and all(e.state is EntryState.WRITING for e in new)


def test_a_freed_entry_holds_no_slot_whichever_path_freed_it():
    """Kills ``tiered_kv.core.index.xǁTierIndexǁ_maybe_free__mutmut_13`` (a slot freed by
    ``remove``/``release``/``writer_done`` left as ``-2``): every path that gives a slot back marks the
    entry slot-less the same way (``slot == -1``), as eviction does."""
    evicted = []
    ix = TierIndex(2, on_evict=evicted.append)
    a = ready(ix, b"a")
    ix.acquire(a)
    ix.remove(a)
    assert a.slot >= 0, "a reader still holds the slot"
    ix.release(a)
    w = ix.reserve(b"w", tok())
    ix.abort(w)
    ix.writer_done(w)
    b = ready(ix, b"b")
    ready(ix, b"c")
    assert ix.reserve(b"d", tok()) is not None and evicted == [b]
    assert (a.slot, w.slot, b.slot) == (-1, -1, -1)
    assert ix.used_slots == 2


def test_a_lease_misuse_names_the_entry_in_its_internal_error():
    """Kills ``tiered_kv.core.index.xǁTierIndexǁacquire__mutmut_4`` and ``...release__mutmut_3`` (the
    internal error raised without a message): the bug report must say which entry was misused."""
    ix = TierIndex(2)
    w = ix.reserve(b"being-written", tok())
    with pytest.raises(AssertionError, match=r"acquire of Entry\(key=b'being-written', slot=\d+, writing"):
        ix.acquire(w)
    r = ready(ix, b"never-leased")
    with pytest.raises(AssertionError, match=r"release without acquire: Entry\(key=b'never-leased'.*readers=0"):
        ix.release(r)


# ---------------------------------------------------------------- manager.py


def test_store_many_and_load_many_refuse_a_fenced_row_naming_it_and_change_nothing(fake, kv):
    """Kills ``tiered_kv.manager.xǁTierManagerǁstore_many__mutmut_6`` to ``..._13`` and
    ``...load_many__mutmut_6`` to ``..._13`` (the fence check of the batched calls dropped, inverted,
    or raising without naming the row): a batch with one row that a load is still writing raises
    :class:`BlockBusyError` naming that row, and starts nothing; a batch on other rows starts."""
    mgr, mover = fake
    stored(mgr, mover, kv, [b"a", b"b"], [0, 1])
    load = mgr.load(b"a", 7)
    assert load is not None
    before = (len(mover.submitted), mgr.jobs_in_flight, mgr.host_used_slots)
    for rows in ([5, 7], [7, 6]):
        with pytest.raises(BlockBusyError, match=r"^block 7 has a load in flight"):
            mgr.store_many([b"x", b"y"], rows)
        with pytest.raises(BlockBusyError, match=r"^block 7 already has a load in flight"):
            mgr.load_many([b"a", b"b"], rows)
    assert (len(mover.submitted), mgr.jobs_in_flight, mgr.host_used_slots) == before
    # rows no load writes are fine, while the load is in flight
    job = mgr.store_many([b"x", b"y"], [5, 6])
    both = mgr.load_many([b"a", b"b"], [10, 11])
    assert job is not None and job.blocks == [5, 6] and both is not None and both.blocks == (10, 11)
    mover.complete_all()
    assert [c.ok for c in mgr.poll()] == [True, True, True]
    assert mgr.free_block(7)
    assert mgr.load_many([b"x", b"y"], [7, 8]) is not None


def test_store_many_of_two_keys_never_evicts_the_other_key_it_names(kv):
    """Kills ``tiered_kv.manager.xǁTierManagerǁstore_many__mutmut_22`` (``len(keys) > 2``: a two-key call
    does not protect its keys): the slot for the absent key must not be found by evicting the present
    key the same call names; with nothing else evictable that key is shed."""
    mgr, mover = make_fake_manager(make_config(host_slots=2, host_evict_ahead_blocks=0), kv)
    try:
        stored(mgr, mover, kv, [b"present"], [0])
        fill_row(kv, 1, b"writing")
        assert mgr.store(b"writing", 1) is not None       # the other slot, leased to a store in flight
        fill_row(kv, 2, b"absent")
        assert mgr.store_many([b"present", b"absent"], [3, 2]) is None
        assert mgr.host_bytes(b"present") is not None and mgr.lookup([b"present"]) == 1
        assert mgr_metric(mgr, "tiered_kv_shed_total", kind="store", reason="host_full") == 1
    finally:
        mover.complete_all()
        mgr.close()


def test_a_load_whose_read_from_disk_failed_counts_a_disk_copy_fault(tmp_path):
    """Kills ``tiered_kv.manager.xǁTierManagerǁ_load_failed__mutmut_4``, ``..._17`` and ``..._18`` (the
    fault counted under another tier label): a load failed by its read from disk (not a miss) is
    reported failed with the read's error and counted as ``errors_total{tier="disk",error="copy_failed"}``."""
    mgr, mover, kv = fake_disk_manager(tmp_path / "d")
    try:
        on_disk_only(mgr, mover, kv, [b"k"])
        job = mgr.load(b"k", 9)
        assert job is not None
        (promote,) = [j for j in mgr._core.jobs.values() if j.kind is JobKind.PROMOTE]
        mover.inject(promote.token, JobKind.PROMOTE, ok=False, error="EIO reading the slot file")
        out = [c for c in mgr.wait([job], timeout=30) if c.job is job]
        assert [(c.ok, c.error) for c in out] == [(False, "failed: EIO reading the slot file")]
        assert mgr_metric(mgr, "tiered_kv_errors_total", tier="disk", error="copy_failed") == 1
        assert mgr_metric(mgr, "tiered_kv_errors_total", tier="device", error="copy_failed") == 0
        assert mgr.free_block(9)
    finally:
        mgr.close()


def test_debug_sizes_names_each_table_with_its_size(tmp_path):
    """Kills ``tiered_kv.manager.xǁTierManagerǁdebug_sizes__mutmut_*`` (a table left out, renamed, or
    sized from another one): in a state where every table holds a known number of entries,
    ``debug_sizes()`` names each one with its size."""
    mgr, mover, kv = fake_disk_manager(tmp_path / "d")
    try:
        on_disk_only(mgr, mover, kv, [b"a", b"b"])        # host: filler-0..3; disk: a, b and the fillers
        fill_row(kv, 10, b"p")
        pending = mgr.store(b"p", 10)                     # a store in flight (its slot evicted filler-0)
        cancelled = mgr.store_many([b"q", b"r"], [11, 12])  # another, cancelled: reported at the next poll
        load = mgr.load(b"filler-3", 20)                  # a load in flight, fencing row 20
        assert pending is not None and cancelled is not None and load is not None
        mgr.cancel(cancelled)
        assert mgr.debug_sizes() == {
            "jobs": 3, "deliver": 1, "outbox": 0, "row_stores": 1, "row_load": 1, "key_loads": 1,
            "flushes": 0, "host_entries": 2, "host_used_slots": 4, "disk_entries": 6, "disk_tombstones": 0,
        }   # q and r left the host index when cancelled; their slots stay leased until their report
        mover.complete_all()
        mgr.wait()
        assert mgr.flush(timeout=30)                      # p's spill (write-through) is applied too
        assert mgr.debug_sizes() == {
            "jobs": 0, "deliver": 0, "outbox": 0, "row_stores": 0, "row_load": 0, "key_loads": 0,
            "flushes": 0, "host_entries": 2, "host_used_slots": 2, "disk_entries": 7,
            "disk_tombstones": 0,
        }
    finally:
        mgr.close()
    host_only, mover = make_fake_manager(make_config(host_slots=4), make_kv(8))
    try:
        assert host_only.debug_sizes()["disk_entries"] == host_only.debug_sizes()["disk_tombstones"] == 0
    finally:
        host_only.close()


@pytest.mark.disk_threads
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_flush_with_a_dead_writer_still_prepares_the_next_step(tmp_path):
    """Kills ``tiered_kv.manager.xǁTierManagerǁflush__mutmut_7`` and ``..._8`` (``_poll(None)`` /
    ``_poll(False)`` on the dead-writer path): ``flush()`` is an API call like ``poll()``, so its last
    pass applies the reports *and* frees host slots ahead (``host_evict_ahead_blocks``) for the next step."""
    dies = WriterGate(block_from=None, raise_at={1: _WriterKilled("writer killed")})
    mgr, mover, kv = hooked_disk_manager(tmp_path, dies, host_slots=4, host_evict_ahead_blocks=1)
    try:
        stored(mgr, mover, kv, [b"first"], [0])           # its spill kills the writer
        deadline = time.monotonic() + 30
        while mgr.disk.writer_alive() and time.monotonic() < deadline:
            mgr.wait(timeout=0.05)
        assert not mgr.disk.writer_alive()
        assert mgr.host_used_slots == 1
        for i, k in enumerate((b"k1", b"k2", b"k3")):
            fill_row(kv, 1 + i, k)
            assert mgr.store(k, 1 + i) is not None
        mover.complete_all()                              # reported, not yet applied: the host is full
        assert mgr.host_used_slots == 4
        assert mgr.flush(timeout=5) is False
        assert mgr.lookup([b"k1", b"k2", b"k3"]) == 3
        assert mgr.host_used_slots == 3 and mgr.lookup([b"first"]) == 0   # the coldest went ahead of need
    finally:
        mgr.close()


def test_a_load_cancelled_by_freeing_its_row_says_so_in_its_cancel_reason(fake, kv):
    """Kills ``tiered_kv.manager.xǁTierManagerǁfree_block__mutmut_8`` (``_cancel(job, None)``): the job's
    public ``cancel_reason`` tells why it was cancelled -- ``cancelled`` by ``free_block``/``cancel``,
    ``superseded`` by ``invalidate`` -- and its completion's error says the same."""
    mgr, mover = fake
    stored(mgr, mover, kv, [b"a", b"b", b"c"], [0, 1, 2])
    freed, cancelled, invalidated = mgr.load(b"a", 10), mgr.load(b"b", 11), mgr.load(b"c", 12)
    assert freed is not None and cancelled is not None and invalidated is not None
    assert mgr.free_block(10) is False
    mgr.cancel(cancelled)
    mgr.invalidate(b"c")
    assert freed.cancel_reason is StaleReason.CANCELLED
    assert cancelled.cancel_reason is StaleReason.CANCELLED
    assert invalidated.cancel_reason is StaleReason.SUPERSEDED
    mover.complete_all()
    out = {c.job.key: c.error for c in mgr.wait([freed, cancelled, invalidated], timeout=30)}
    assert out == {b"a": "cancelled (cancelled)", b"b": "cancelled (cancelled)", b"c": "cancelled (superseded)"}


def test_lookup_takes_any_iterable_of_keys(fake, kv):
    """Kills ``tiered_kv.manager.xǁTierManagerǁlookup__mutmut_7`` (a non-list argument replaced by None):
    ``lookup`` accepts a tuple or a generator of keys as it does a list."""
    mgr, mover = fake
    stored(mgr, mover, kv, [b"a", b"b"], [0, 1])
    want = [b"a", b"b", b"c"]
    assert mgr.lookup(want) == mgr.lookup(tuple(want)) == mgr.lookup(k for k in want) == 2
    assert mgr.lookup(iter([b"c", b"a"])) == 0


def test_cancel_refuses_another_managers_job_whatever_its_state(kv):
    """Kills ``tiered_kv.manager.xǁTierManagerǁcancel__mutmut_1`` (``and`` for ``or`` in the ownership
    check, so only internal jobs of another manager were refused): a job another manager returned is
    refused by ``cancel`` as not this manager's, pending or finished, and neither manager changes."""
    from tiered_kv.errors import InvalidJobError
    a, mover_a = make_fake_manager(make_config(), kv)
    b, mover_b = make_fake_manager(make_config(), make_kv(8))
    try:
        pending = b.store(b"k", 0)
        assert pending is not None
        with pytest.raises(InvalidJobError, match=r"^not a job of this manager: "):
            a.cancel(pending)
        mover_b.complete_all()
        assert [c.ok for c in b.wait([pending], timeout=30)] == [True]
        with pytest.raises(InvalidJobError, match=r"^not a job of this manager: "):
            a.cancel(pending)
        assert b.lookup([b"k"]) == 1 and a.jobs_in_flight == 0
    finally:
        a.close()
        b.close()


def test_wait_refuses_one_job_or_a_non_iterable_naming_what_it_got(fake, kv):
    """Kills ``tiered_kv.manager.xǁTierManagerǁwait__mutmut_21`` (``and`` for ``or``: a bare job or an
    int passed on to ``list()``) and ``..._24`` (the message naming ``NoneType``): ``wait(job)`` -- a
    common slip for ``wait([job])`` -- and ``wait(5)`` raise :class:`InvalidJobError` naming the type given."""
    from tiered_kv.errors import InvalidJobError
    mgr, mover = fake
    job = mgr.store(b"k", 0)
    assert job is not None
    with pytest.raises(InvalidJobError, match=r"^jobs must be an iterable of Job or None, got Job: Job\(token="):
        mgr.wait(job)
    with pytest.raises(InvalidJobError, match=r"^jobs must be an iterable of Job or None, got int: 5$"):
        mgr.wait(5)
    mover.complete_all()
    assert [c.ok for c in mgr.wait([job], timeout=30)] == [True]


def test_every_call_after_close_says_the_manager_is_closed(kv):
    """Kills ``tiered_kv.manager.xǁTierManagerǁ_check_open__mutmut_2`` and ``..._3`` (the message's
    wording): each call on a closed manager raises :class:`ManagerClosedError` saying so."""
    from tiered_kv.errors import ManagerClosedError
    mgr, mover = make_fake_manager(make_config(), kv)
    job = mgr.store(b"k", 0)
    mover.complete_all()
    mgr.close()
    calls = [lambda: mgr.store(b"k", 1), lambda: mgr.load(b"k", 1), lambda: mgr.store_many([b"k"], [1]),
             lambda: mgr.load_many([b"k"], [1]), lambda: mgr.lookup([b"k"]),
             lambda: mgr.free_block(0), lambda: mgr.invalidate(b"k"), mgr.poll, mgr.wait, mgr.flush]
    for call in calls:
        with pytest.raises(ManagerClosedError, match=r"^the TierManager is closed$"):
            call()
    mgr.cancel(job)   # valid at any time (its docstring): after close() it does nothing
    mgr.close()   # idempotent


def test_wait_with_a_timeout_waits_for_a_report_that_comes_before_it(fake, kv):
    """Kills ``tiered_kv.manager.xǁTierManagerǁ_block_until__mutmut_25`` (``remaining <= 1``: a wait
    gives up as soon as less than a second is left): ``wait([job], timeout=0.9)`` whose job is reported
    while it waits returns with the job done."""
    mgr, mover = fake
    job = mgr.store(b"k", 0)
    assert job is not None
    mgr.poll()                                   # the copy is queued; no report yet
    instrument_get(mgr._completions, lambda timeout: mover.complete_all())   # reported once wait() blocks
    out = mgr.wait([job], timeout=0.9)
    assert job.done and [c.ok for c in out if c.job is job] == [True]


def test_wait_without_a_timeout_on_a_polled_mover_sleeps_in_slices_until_its_events_complete():
    """Kills ``tiered_kv.manager.xǁTierManagerǁ_block_until__mutmut_43`` and ``..._45`` (the slice a
    polled mover's waiter sleeps computed from a missing deadline: ``min(slice, None)``): on a mover
    whose reports appear only when it is polled (CUDA events; here the simulated device, where each
    query runs one operation), ``wait()`` with no time limit sleeps in short slices and polls until
    its jobs are reported."""
    from fake_cuda import FakeGPU
    from tiered_kv.movers import CudaMover
    gpu = FakeGPU(progress_on_query=True)
    made = []

    def factory(dev, host, out):
        made.append(CudaMover([(dev, host)], out, 1, runtime=gpu))
        return made[0]
    kv = make_kv(8)
    mgr = TierManager(make_config(host_slots=8), kv, registry=CollectorRegistry(), mover_factory=factory)
    try:
        assert made[0].polled
        for i in range(4):
            fill_row(kv, i, b"k%d" % i)
        jobs = [mgr.store(b"k%d" % i, i) for i in range(4)]
        out = mgr.wait(jobs)
        assert all(j.done for j in jobs) and sorted(c.ok for c in out) == [True] * 4
        assert mgr.lookup([b"k0", b"k1", b"k2", b"k3"]) == 4
    finally:
        mgr.close()


def test_three_stores_reading_one_row_are_all_cancelled_by_freeing_it(fake, kv):
    """Kills ``tiered_kv.manager.xǁTierManagerǁ_submit_store__mutmut_21`` and ``..._23`` (a third store
    of a row already read by two nested in, or added as None to, the row's list): one device row
    stored under three keys has three stores reading it; freeing the row cancels each of them, and
    once reported none is left in the row table."""
    mgr, mover = fake
    fill_row(kv, 5, b"same")
    jobs = [mgr.store(k, 5) for k in (b"x", b"y", b"z")]
    assert all(j is not None for j in jobs)
    assert mgr.debug_sizes()["row_stores"] == 1
    assert mgr.free_block(5) is True
    assert [j.cancel_reason for j in jobs] == [StaleReason.SOURCE_REUSED] * 3
    mover.complete_all()
    out = {c.job.key: c.error for c in mgr.wait(jobs, timeout=30)}
    assert out == {k: "cancelled (source_reused)" for k in (b"x", b"y", b"z")}
    assert mgr.debug_sizes()["row_stores"] == 0 and mgr.lookup([b"x"]) == 0


def test_stores_sharing_a_row_leave_the_row_table_as_each_is_reported(fake, kv):
    """Kills ``tiered_kv.manager.xǁTierManagerǁ_drop_row_stores__mutmut_22`` and ``..._24`` (a store
    reported while another store still reads its row is never taken off that row's list): the row
    table holds live stores only -- one entry while either reads the row, none once both are reported."""
    mgr, mover = fake
    fill_row(kv, 3, b"same")
    a, b = mgr.store(b"a", 3), mgr.store(b"b", 3)
    assert a is not None and b is not None and mgr.debug_sizes()["row_stores"] == 1
    mover.complete(a)
    assert [c.ok for c in mgr.wait([a], timeout=30) if c.job is a] == [True]
    assert mgr._row_stores == {3: b}
    mover.complete(b)
    mgr.wait([b], timeout=30)
    assert mgr.debug_sizes()["row_stores"] == 0 and mgr.lookup([b"a", b"b"]) == 2


def test_close_lets_a_load_waiting_for_its_read_back_finish(tmp_path):
    """Kills ``tiered_kv.manager.xǁTierManagerǁclose__mutmut_4`` (the wait for promotes skipped when
    there is a disk tier): a load still waiting for its key's read from disk when ``close()`` is called
    gets its read and then its copy before the mover stops: it ends done, with the bytes in its row."""
    kv = make_kv(16)
    cfg = make_config(host_slots=4, disk_path=tmp_path / "d", disk_capacity_bytes=64 * ROW_BYTES,
                      host_evict_ahead_blocks=0, writer_batch_seconds=0.0)
    mgr = TierManager(cfg, kv, registry=CollectorRegistry())     # the default (thread) mover
    for i, k in enumerate([b"k", b"f0", b"f1", b"f2", b"f3"]):  # k, then 4 more: k is on disk only
        fill_row(kv, i, k)
        job = mgr.store(k, i)
        assert job is not None and [c.ok for c in mgr.wait([job], timeout=30) if c.job is job] == [True]
        assert mgr.free_block(i) and mgr.flush(timeout=30)
    assert mgr.host_bytes(b"k") is None and mgr.lookup([b"k"]) == 1
    kv[9].zero_()
    load = mgr.load(b"k", 9)
    assert load is not None and load._waiters
    mgr.close()
    assert load.state is JobState.DONE and row_matches(kv, 9, b"k")


@pytest.mark.timeout(60)
def test_close_waits_a_bounded_time_for_a_read_from_disk_that_never_ends(tmp_path, monkeypatch):
    """Kills ``tiered_kv.manager.xǁTierManagerǁclose__mutmut_6`` (the wait for reads from disk without a
    time limit): a read that never finishes (a stuck disk; here its reads are never started) holds
    ``close()`` for ``CLOSE_TIMEOUT_S`` at most -- a host process's shutdown must not hang on it."""
    import tiered_kv.manager as manager_module
    mgr, mover, kv = fake_disk_manager(tmp_path / "d")
    on_disk_only(mgr, mover, kv, [b"k"])
    monkeypatch.setattr(mgr.disk, "start_reads", lambda **kw: None)
    monkeypatch.setattr(manager_module, "CLOSE_TIMEOUT_S", 0.2)
    load = mgr.load(b"k", 9)
    assert load is not None and load._waiters
    mgr.close()                            # returns: the mutant waits here for ever (the test's timeout)
    assert mgr._closed


def test_a_device_tensor_of_one_row_is_enough():
    """Kills ``tiered_kv.manager.xǁTierManagerǁ__init____mutmut_12`` (the row size read from row 1): a
    KV tensor of a single block works -- its row size comes from row 0."""
    kv = make_kv(1)
    mgr, mover = make_fake_manager(make_config(host_slots=2), kv)
    try:
        assert mgr.num_blocks == 1 and mgr.row_bytes == ROW_BYTES
        fill_row(kv, 0, b"only")
        job = mgr.store(b"only", 0)
        mover.complete_all()
        assert [c.ok for c in mgr.wait([job], timeout=30)] == [True] and mgr.lookup([b"only"]) == 1
    finally:
        mgr.close()


def test_close_with_nothing_in_flight_never_sleeps(tmp_path):
    """Kills ``tiered_kv.manager.xǁTierManagerǁclose__mutmut_9`` (the wait for reads from disk never
    satisfied, so every ``close()`` of a manager with a disk tier slept its whole ``CLOSE_TIMEOUT_S``):
    with no job in flight ``close()`` returns without once blocking on the completion queue."""
    mgr, mover, kv = fake_disk_manager(tmp_path / "d")
    stored(mgr, mover, kv, [b"k"], [0])
    assert mgr.flush(timeout=30)
    slept = []
    instrument_get(mgr._completions, slept.append)
    mgr.close()
    assert slept == []


# ---------------------------------------------------------------- core/tiers.py


def _write_back_manager(path, host_slots: int = 32):
    kv = make_kv(max(64, host_slots))
    cfg = make_config(host_slots=host_slots, disk_path=path, disk_capacity_bytes=128 * ROW_BYTES,
                      host_evict_ahead_blocks=0, writer_batch_seconds=0.0, write_mode="back")
    mgr, mover = make_fake_manager(cfg, kv)
    return mgr, mover, kv


def _spilling(mgr) -> list[bytes]:
    """The keys being spilled, in the order their jobs started (a job is named by each of its keys' tokens)."""
    jobs = {id(j): j for j in mgr._core.jobs.values() if j.kind is JobKind.SPILL}
    return [k for j in jobs.values() for k in j.keys]


def _store_24(mgr, mover, kv, prefix: bytes) -> None:
    """One store_many of 24 fresh keys from rows 0..23, answered and applied (rows left fenced)."""
    keys = [prefix + b"-%02d" % i for i in range(24)]
    for i, k in enumerate(keys):
        fill_row(kv, i, k)
    mover.complete(mgr.store_many(keys, list(range(24))))
    mgr.poll()


def _store_steps(mgr, mover, kv, steps: int, per_step: int = 8) -> list[bytes]:
    """``steps`` engine steps of ``per_step`` fresh keys each (store_many, answered, poll); the keys.  No
    spill starts before the last step, which fills 3/4 of a 128-slot host with 12 steps of 8."""
    keys = [b"wb-%03d" % i for i in range(steps * per_step)]
    for s in range(steps):
        part = keys[s * per_step: (s + 1) * per_step]
        for i, k in enumerate(part):
            fill_row(kv, s * per_step + i, k)
        job = mgr.store_many(part, list(range(s * per_step, (s + 1) * per_step)))
        assert job is not None
        mover.complete(job)
        mgr.poll()                                             # publishes, then one write-back pass
        assert s == steps - 1 or _spilling(mgr) == []
    return keys


def test_write_back_spills_at_most_its_per_step_budget_coldest_first(tmp_path):
    """Kills mutants of ``TierCore._writeback``'s budget (ignored, or counted wrong): the pass after a
    step that fills the host to ``WRITEBACK_FILL`` starts the spills of as many blocks as the step
    stored plus ``WRITEBACK_PER_STEP``, the coldest entries."""
    mgr, mover, kv = _write_back_manager(tmp_path / "d", host_slots=128)
    try:
        keys = _store_steps(mgr, mover, kv, 12)                # 96 of 128 slots: exactly WRITEBACK_FILL
        assert _spilling(mgr) == keys[:8 + WRITEBACK_PER_STEP]
    finally:
        mgr.close()


def test_a_flush_covers_the_write_back_spills_of_the_stores_it_applies(tmp_path):
    """Kills a ``TierCore.flush`` without its write-back pass: a flush right after the stores of the step
    that fills the host to ``WRITEBACK_FILL`` (their copies answered, not yet applied) returns with the
    spills those stores call for durable, not started after it returned."""
    mgr, mover, kv = _write_back_manager(tmp_path / "d", host_slots=128)
    try:
        _store_steps(mgr, mover, kv, 11)
        part = [b"last-%d" % i for i in range(8)]
        for i, k in enumerate(part):
            fill_row(kv, 88 + i, k)
        job = mgr.store_many(part, list(range(88, 96)))
        assert job is not None
        mover.complete(job)
        assert mgr.flush(timeout=30) is True
        assert mgr_metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="ok") == 8 + WRITEBACK_PER_STEP
    finally:
        mgr.close()


def test_write_back_starts_nothing_on_an_unusable_disk_nor_while_closing(tmp_path):
    """Kills ``tiered_kv.core.tiers.xǁTierCoreǁ_writeback__mutmut_3`` and ``..._4`` (``and`` for ``or``
    in the guard): with the disk writer gone, or once ``close()`` began, write-back starts no spill
    (and so sheds none as ``disk_down``)."""
    for closing in (False, True):
        mgr, mover, kv = _write_back_manager(tmp_path / f"d{closing}")
        try:
            if closing:
                mgr._core.closing = True
            else:
                mgr._core.disk.usable = False
            _store_24(mgr, mover, kv, b"x")
            assert _spilling(mgr) == []
            assert mgr_metric(mgr, "tiered_kv_shed_total", kind="spill", reason="disk_down") == 0
        finally:
            mgr._core.closing = False
            mgr.close()



def test_close_starts_no_write_back_spill_of_its_own(tmp_path):
    """Kills ``tiered_kv.manager.xǁTierManagerǁclose__mutmut_2`` and ``..._3`` (``close()`` not marking
    the core as closing before its last passes): ``close()`` lets the spills already running finish and
    starts none, so a write-back manager closed with cold entries not yet spilled writes only the
    spills its last step started."""
    mgr, mover, kv = _write_back_manager(tmp_path / "d", host_slots=128)
    _store_steps(mgr, mover, kv, 12)
    assert len(_spilling(mgr)) == 8 + WRITEBACK_PER_STEP      # 80 cold entries left for later steps
    mgr.close()
    assert mgr_metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="ok") == 8 + WRITEBACK_PER_STEP
    assert mgr_metric(mgr, "tiered_kv_shed_total", kind="spill") == 0

def test_write_back_stops_when_the_writer_queue_is_full(tmp_path, monkeypatch):
    """Kills ``tiered_kv.core.tiers.xǁTierCoreǁ_writeback__mutmut_14`` (``>`` for ``>=``): a writer queue
    holding ``writer_queue_blocks`` spills already is full, and write-back queues none."""
    mgr, mover, kv = _write_back_manager(tmp_path / "d")
    try:
        monkeypatch.setattr(type(mgr._core.disk.store), "queue_depth",
                            property(lambda self: self.opts.queue_blocks))
        _store_24(mgr, mover, kv, b"q")
        assert _spilling(mgr) == []
    finally:
        monkeypatch.undo()
        mgr.close()


def test_settling_or_abandoning_a_job_twice_is_a_no_op(fake, kv):
    """Kills ``tiered_kv.core.tiers.xǁTierCoreǁsettle_cancelled__mutmut_3`` and
    ``...abandon__mutmut_3`` (``jobs.pop(token)`` without a default: a second call raises KeyError)."""
    mgr, mover = fake
    core = mgr._core
    fill_row(kv, 0, b"s")
    store = mgr.store(b"s", 0)
    core.cancel(store, StaleReason.CANCELLED)
    core.settle_cancelled(store)
    core.settle_cancelled(store)
    stored(mgr, mover, kv, [b"l"], [1])
    load = mgr.load(b"l", 2)
    core.abandon(load)
    core.abandon(load)
    assert core.n_in_flight[JobKind.STORE] == 0 and core.n_in_flight[JobKind.LOAD] == 0
    assert mgr.jobs_in_flight == 0 and mgr.host_used_slots == 1   # only l's slot: no lease left


def test_drop_all_forgets_the_keys_only_on_disk_too(tmp_path):
    """Kills ``tiered_kv.core.tiers.xǁTierCoreǁdrop_all__mutmut_3`` (``drop_key(None)`` for a disk entry):
    after ``drop_all()`` no key is served from any tier."""
    mgr, mover, kv = fake_disk_manager(tmp_path / "d")
    try:
        on_disk_only(mgr, mover, kv, [b"k0", b"k1"])
        mgr._core.drop_all()
        assert mgr.lookup([b"k0"]) == 0 and mgr.lookup([b"k1"]) == 0
        assert mgr.host_blocks == 0 and mgr.disk_blocks == 0
    finally:
        mgr.close()


def test_core_touch_marks_keys_recently_used_on_the_host_else_on_disk(tmp_path):
    """Kills ``tiered_kv.core.tiers.xǁTierCoreǁtouch__mutmut_1`` to ``..._10`` (the scheduler front end's
    ``touch``, which no other fast test reaches): a key on the host moves to the host LRU's hot end, a
    key only on disk to the disk LRU's hot end, an unknown key changes nothing."""
    mgr, mover, kv = fake_disk_manager(tmp_path / "d")
    try:
        on_disk_only(mgr, mover, kv, [b"d0", b"d1"])
        core = mgr._core
        host = [e.key for e in core.index.coldest(99)]
        disk = [e.key for e in core.dindex.coldest(99)]
        assert host[0] != host[-1] and b"d1" in disk and disk[-1] != b"d0"
        core.touch([host[0], b"d0", b"nowhere"])
        assert [e.key for e in core.index.coldest(99)] == host[1:] + host[:1]
        assert [e.key for e in core.dindex.coldest(99)] == [k for k in disk if k != b"d0"] + [b"d0"]
    finally:
        mgr.close()


def test_store_many_at_the_inflight_limit_sheds_only_when_a_key_is_absent_and_touches_present_ones(tmp_path):
    """Kills ``tiered_kv.core.tiers.xǁTierCoreǁbegin_store__mutmut_4`` to ``..._9``, ``..._12`` and ``..._16``
    (the ``max_inflight_jobs`` path of a batched store): at the limit a call naming an absent key is shed
    once (``inflight_limit``); a call whose keys are all in a tier is not, and its host keys are touched."""
    mgr, mover, kv = fake_disk_manager(tmp_path / "d")
    try:
        on_disk_only(mgr, mover, kv, [b"on-disk"])
        mgr._core.max_inflight = 1
        fill_row(kv, 0, b"busy")
        assert mgr.store(b"busy", 0) is not None               # the one job in flight
        host = [e.key for e in mgr._core.index.coldest(99)]
        assert len(host) == 3
        shed = lambda: mgr_metric(mgr, "tiered_kv_shed_total", kind="store", reason="inflight_limit")  # noqa: E731
        assert mgr.store_many([host[0], b"on-disk"], [1, 2]) is None and shed() == 0
        assert [e.key for e in mgr._core.index.coldest(99)] == host[1:] + host[:1]
        assert mgr.store_many([host[1], b"new"], [1, 2]) is None and shed() == 1
        assert [e.key for e in mgr._core.index.coldest(99)] == host[2:] + host[:2]
    finally:
        mover.complete_all()
        mgr.close()


def test_store_many_skips_a_key_only_on_disk_and_names_its_first_stored_key(tmp_path):
    """Kills ``tiered_kv.core.tiers.xǁTierCoreǁbegin_store__mutmut_31`` (the disk index not passed as
    ``elsewhere``: a key only on disk is stored again) and ``..._49`` (the job's ``key`` left None)."""
    mgr, mover, kv = fake_disk_manager(tmp_path / "d")
    try:
        on_disk_only(mgr, mover, kv, [b"on-disk"])
        fill_row(kv, 5, b"fresh")
        job = mgr.store_many([b"on-disk", b"fresh"], [4, 5])
        assert job is not None and job.keys == [b"fresh"] and job.key == b"fresh" and job.blocks == [5]
        mover.complete(job)
        assert [c.ok for c in mgr.poll()] == [True]
    finally:
        mgr.close()


def test_the_core_collects_evicted_keys_only_when_asked(tmp_path):
    """Kills ``tiered_kv.core.tiers.xǁTierCoreǁ_disk_evicted__mutmut_1`` (``or`` for ``and``): a front end
    that did not ask for ``collect_evicted`` (TierManager) never accumulates evicted keys."""
    kv = make_kv(64)
    cfg = make_config(host_slots=2, disk_path=tmp_path / "d", disk_capacity_bytes=4 * ROW_BYTES,
                      host_evict_ahead_blocks=0, writer_batch_seconds=0.0)
    mgr, mover = make_fake_manager(cfg, kv)
    try:
        for i in range(8):                                   # 8 keys through a 2-slot host over a 4-block disk
            stored(mgr, mover, kv, [b"e%d" % i], [i])
            assert mgr.flush(timeout=30)
        assert mgr.metrics.evicted["disk"]._value.get() > 0
        assert mgr._core.evicted == []
    finally:
        mgr.close()


def test_a_failure_report_without_an_error_is_reported_as_failed(fake, kv):
    """Kills ``tiered_kv.manager.xǁTierManagerǁ_fail__mutmut_4``/``_5`` (the default error text changed):
    a failed report with no error fails its job with ``"failed"``."""
    mgr, mover = fake
    fill_row(kv, 0, b"s")
    job = mgr.store(b"s", 0)
    mover._take(job)                                          # the copy's report, replaced by one with no error
    mover.inject(job.token, JobKind.STORE, ok=False, error=None)
    assert [(c.ok, c.error) for c in mgr.poll()] == [(False, "failed: failed")] and job.error == "failed"


@pytest.mark.parametrize("error,reported", [("miss: gone", "failed: miss: gone"), (None, "failed: miss")])
def test_a_failed_read_from_disk_fails_its_load_as_a_miss_and_counts_no_copy_fault(tmp_path, error, reported):
    """Kills ``tiered_kv.manager.xǁTierManagerǁ_fail__mutmut_11``/``_12`` (a miss counted as a copy fault)
    and ``tiered_kv.core.tiers.xǁTierCoreǁ_apply_promote__mutmut_49`` (the default error of a failed
    promote changed): a read from disk that failed, with its error text or none, fails the load as a
    ``miss``, which counts no ``copy_failed`` fault."""
    mgr, mover, kv = fake_disk_manager(tmp_path / "d")
    try:
        on_disk_only(mgr, mover, kv, [b"k"])
        load = mgr.load(b"k", 9)
        (promote,) = [j for j in mgr._core.jobs.values() if j.kind is JobKind.PROMOTE]
        mover.inject(promote.token, JobKind.PROMOTE, ok=False, error=error)
        out = [c for c in mgr.wait([load], timeout=30) if c.job is load]
        assert [(c.ok, c.error) for c in out] == [(False, reported)]
        assert mgr_metric(mgr, "tiered_kv_errors_total", tier="disk", error="copy_failed") == 0
    finally:
        mgr.close()


def test_simple_block_until_waits_in_bounded_steps_and_honours_its_timeout(fake):
    """Kills ``tiered_kv.core.tiers.xǁTierCoreǁsimple_block_until__mutmut_1`` to ``_4``, ``_8`` to ``_11``,
    ``_16``, ``_17``, ``_20`` and ``_21`` (the scheduler front end's blocking loop: no deadline, a wrong
    wait step, or no wait): without a timeout it waits on the completion queue in 0.5 s steps until
    ``done()``; with one, in steps of at most 0.5 s and never past it.  The queue's ``wait`` is replaced
    by one that records its timeout and returns at once, so nothing here really sleeps."""
    mgr, _ = fake
    core = mgr._core
    waits: list = []
    core.completions.wait = lambda timeout: waits.append(timeout) or False   # type: ignore[method-assign]
    core.simple_block_until(lambda: True, None)
    assert waits == []
    answers = iter([False, False, True])
    core.simple_block_until(lambda: next(answers), None)
    assert waits == [0.5, 0.5]
    waits.clear()
    start = time.monotonic()

    def never() -> bool:
        assert time.monotonic() - start < 10, "simple_block_until ran past its timeout"
        return False

    core.simple_block_until(never, 0.6)
    assert waits and waits[0] == 0.5 and all(0 < w <= 0.5 for w in waits)
    assert time.monotonic() - start >= 0.6


@pytest.mark.disk_threads
def test_a_late_answer_to_a_flush_that_timed_out_never_ends_a_later_flush(tmp_path):
    """Kills ``tiered_kv.core.tiers.xǁTierCoreǁflush__mutmut_7`` (every flush marker sent with the token
    ``None``): a flush that timed out gets its writer's answer later; arriving while a second flush
    waits, it must not end that one, whose own spill is still held in the writer."""
    gate = WriterGate(block_from=1)
    mgr, mover, kv = hooked_disk_manager(tmp_path, gate)
    try:
        stored(mgr, mover, kv, [b"a"], [0])                # a's spill: held at the writer's first commit
        gate.entered(1)
        assert mgr.flush(timeout=0.05) is False            # times out; its marker waits behind a's batch
        stored(mgr, mover, kv, [b"b"], [1])                # b's spill, queued behind that marker
        second = {"on": False}

        def on_enter(timeout):
            if second["on"]:
                second["on"] = False
                gate.step(2)       # a's batch, then the first marker's (a batch of its own) commit and
                gate.entered(3)    # it is answered; b's batch is held: that answer is queued before the
                #                    second flush reads the queue
        instrument_get(mgr._completions, on_enter)
        second["on"] = True
        assert mgr.flush(timeout=0.5) is False, "b is not durable: its batch is still held"
        gate.open()
        assert mgr.flush(timeout=30) is True
    finally:
        gate.open()
        mgr.close()


@pytest.mark.disk_threads
def test_each_failed_spill_a_flush_is_first_to_apply_fails_that_flush(tmp_path):
    """Kills ``tiered_kv.core.tiers.xǁTierCoreǁ_apply_spill__mutmut_25`` (``spill_faults = 1``: after the
    first failure no later one moves the count): a spill whose write failed before a flush was asked for,
    but whose report that flush is the first to apply, fails the flush -- the second such failure too."""
    failing = {"on": False}

    def hook(point):
        if failing["on"]:                      # one commit fails: the spill's, not the flush marker's
            failing["on"] = False
            raise OSError(5, "injected EIO")
    mgr, mover, kv = hooked_disk_manager(tmp_path, hook)
    failed = threading.Event()
    put = mgr._completions.put

    def observed_put(item):
        put(item)
        if getattr(item, "kind", None) is JobKind.SPILL and not item.ok:
            failed.set()
    mgr._completions.put = observed_put
    try:
        for n, (key, row) in enumerate(((b"a", 0), (b"b", 1)), 1):
            failed.clear()
            failing["on"] = True
            stored(mgr, mover, kv, [key], [row])
            assert failed.wait(30)             # its write failed; the report is queued, not applied
            assert mgr.flush(timeout=30) is False, f"failure {n} applied by this flush"
            assert mgr_metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="failed") == n
        stored(mgr, mover, kv, [b"c"], [2])
        assert mgr.flush(timeout=30) is True
    finally:
        mgr.close()


def test_slot_views_alias_each_slot_and_refuse_use_after_release():
    """Kills ``tiered_kv.core.tiers.xǁSlotViewsǁ__getitem____mutmut_2`` and ``..._3`` (the message of
    the use-after-release assertion): a view is slot ``i``'s bytes of the slab itself, and once
    released the views refuse to be used, saying so."""
    from tiered_kv.core.tiers import SlotViews
    rows = torch.zeros(4, 8, dtype=torch.int16)            # 16 bytes per slot
    views = SlotViews(rows)
    v = views[2]
    assert len(v) == 16
    v[:] = bytes(range(16))
    assert rows[2].numpy().tobytes() == bytes(range(16)) and not rows[[0, 1, 3]].any()
    views.release()
    with pytest.raises(AssertionError, match=r"^slot views used after release\(\)$"):
        views[0]


@pytest.mark.disk_threads
def test_the_spills_in_flight_are_counted_one_by_one(tmp_path):
    """Kills ``tiered_kv.core.tiers.xǁTierCoreǁstart_spills`` mutants (once ``start_spill``'s 36 to 38: the count of spills
    in flight set to 1, decremented, or raised by 2 when one starts): ``tiered_kv_jobs_in_flight
    {kind="spill"}`` says how many spills were queued and not yet applied, and falls back to 0 once
    they are -- which is also what ``close()`` waits for."""
    gate = WriterGate(block_from=1)
    mgr, mover, kv = hooked_disk_manager(tmp_path, gate)
    try:
        for i, k in enumerate((b"a", b"b", b"c")):
            stored(mgr, mover, kv, [k], [i])                 # write-through: each starts a spill
            assert mgr_metric(mgr, "tiered_kv_jobs_in_flight", kind="spill") == i + 1
        gate.open()
        assert mgr.flush(timeout=30)
        assert mgr_metric(mgr, "tiered_kv_jobs_in_flight", kind="spill") == 0
    finally:
        gate.open()
        mgr.close()


def test_keys_shed_by_a_batched_store_are_counted_as_keys_in_both_counters(kv):
    """Kills ``tiered_kv.core.tiers.xǁTierCoreǁshed__mutmut_6`` (the job-outcome counter raised by 1
    for a shed of ``n`` keys): a ``store_many`` whose keys find no evictable slot counts each key it
    sheds, in ``tiered_kv_shed_total`` and in ``tiered_kv_jobs_total{outcome="shed"}`` alike."""
    mgr, mover = make_fake_manager(make_config(host_slots=2, host_evict_ahead_blocks=0), kv)
    try:
        first = mgr.store_many([b"a", b"b"], [0, 1])         # both slots leased to a store in flight
        assert first is not None
        assert mgr.store_many([b"c", b"d", b"e"], [2, 3, 4]) is None
        mgr.poll()
        assert mgr_metric(mgr, "tiered_kv_shed_total", kind="store", reason="host_full") == 3
        assert mgr_metric(mgr, "tiered_kv_jobs_total", kind="store", outcome="shed") == 3
    finally:
        mover.complete_all()
        mgr.close()


def test_dropping_a_key_being_read_back_cancels_the_loads_waiting_for_it(tmp_path):
    """Kills ``tiered_kv.core.tiers.xǁTierCoreǁcancel__mutmut_22`` to ``..._25`` (the loads waiting for a
    cancelled promote not cancelled, or cancelled without their job or reason): the core's contract,
    whatever its front end did first -- ``TierManager.invalidate`` cancels the key's loads itself
    before ``drop_key``; here the core is called alone.  A load waiting for the read-back of a key that
    is dropped is cancelled as superseded, its row unfenced, and no job is left waiting."""
    mgr, mover, kv = fake_disk_manager(tmp_path / "d")
    try:
        on_disk_only(mgr, mover, kv, [b"k"])
        load = mgr.load(b"k", 9)
        assert load is not None and load._waiters            # waits for its promote
        mgr._core.drop_key(b"k")
        assert load.cancel_reason is StaleReason.SUPERSEDED
        out = [c for c in mgr.wait([load], timeout=30) if c.job is load]
        assert [(c.ok, c.error) for c in out] == [(False, "cancelled (superseded)")]
        assert mgr.free_block(9) is True and mgr.lookup([b"k"]) == 0
        mgr.wait(timeout=30)
        assert mgr.jobs_in_flight == 0
    finally:
        mgr.close()


def test_a_load_that_may_not_promote_never_waits_for_a_read_back_already_running(tmp_path):
    """Kills ``tiered_kv.core.tiers.xǁTierCoreǁbegin_load__mutmut_15`` (``and`` for ``or``: with
    ``promote=False`` a key being read back from disk was waited for): the scheduler front end's loads
    (``promote=False``) are for keys READY on the host only; a key whose read-back is still running is
    not, and such a load is refused."""
    mgr, mover, kv = fake_disk_manager(tmp_path / "d")
    try:
        on_disk_only(mgr, mover, kv, [b"k"])
        load = mgr.load(b"k", 9)                          # starts the read-back
        assert load is not None and load._waiters
        core = mgr._core
        assert core.begin_load([b"k"], promote=False) is None
        assert core.n_in_flight[JobKind.LOAD] == 1
    finally:
        mgr.close()


@pytest.mark.disk_threads
def test_a_failed_flush_is_counted_as_a_disk_flush_failure(tmp_path):
    """Kills ``tiered_kv.core.tiers.xǁTierCoreǁapply__mutmut_6``, ``..._7`` and ``..._10`` (the failed
    flush counted under other labels): a flush whose own batch fails answers False and counts
    ``tiered_kv_errors_total{tier="disk",error="flush_failed"}``."""
    failing = {"on": False}

    def hook(point):
        if failing["on"]:
            failing["on"] = False
            raise OSError(5, "injected EIO")
    mgr, mover, kv = hooked_disk_manager(tmp_path, hook)
    try:
        stored(mgr, mover, kv, [b"a"], [0])
        assert mgr.flush(timeout=30) is True
        failing["on"] = True                      # the next commit is the flush marker's own batch
        assert mgr.flush(timeout=30) is False
        assert mgr_metric(mgr, "tiered_kv_errors_total", tier="disk", error="flush_failed") == 1
    finally:
        mgr.close()


def test_a_normal_close_logs_no_error_and_debug_logs_name_each_stale_report(tmp_path, caplog):
    """Kills ``tiered_kv.core.tiers.xǁTierCoreǁend_step__mutmut_5`` (the writer check not told that the
    manager is closing: every normal close logged "disk writer is gone" as an error) and ``..._1`` (the
    DEBUG switch, refreshed each step, left off): at DEBUG a discarded report is logged with its token;
    closing a healthy disk manager logs nothing at ERROR."""
    import logging
    caplog.set_level(logging.DEBUG, logger="tiered_kv")
    mgr, mover, kv = fake_disk_manager(tmp_path / "d")
    fill_row(kv, 0, b"k")
    job = mgr.store(b"k", 0)
    assert job is not None
    mgr.poll()                                   # a step ends (the DEBUG switch is read again there)
    mgr.cancel(job)
    mover.complete_all()
    mgr.wait([job], timeout=30)
    assert any(r.levelno == logging.DEBUG and str(job.token) in r.getMessage() and "stale" in r.getMessage()
               for r in caplog.records)
    mgr.close()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_the_manager_keeps_no_list_of_published_or_evicted_keys(kv):
    """Kills ``tiered_kv.core.tiers.xǁTierCoreǁ__init____mutmut_3``, ``..._36`` and ``..._43`` (the core
    collecting published or evicted keys by default): only a front end that hands them out (the vLLM
    scheduler) asks for them; the manager never does, so lists of them would only grow."""
    mgr, mover = make_fake_manager(make_config(host_slots=2, host_evict_ahead_blocks=0), kv)
    try:
        for i, k in enumerate((b"a", b"b", b"c", b"d")):      # c and d evict a and b
            stored(mgr, mover, kv, [k], [i])
        assert mgr.lookup([b"c", b"d"]) == 2 and mgr.lookup([b"a"]) == 0
        core = mgr._core
        assert core.published == [] and core.evicted == []
        assert not core.collect_published and not core.collect_evicted
    finally:
        mgr.close()


def test_debug_logging_is_on_from_the_first_call(kv, caplog):
    """Kills ``tiered_kv.core.tiers.xǁTierCoreǁ__init____mutmut_51`` (the DEBUG switch off until the first
    step ends): with DEBUG enabled when the manager is made, a store shed in its very first call is
    logged."""
    import logging
    caplog.set_level(logging.DEBUG, logger="tiered_kv")
    mgr, mover = make_fake_manager(make_config(max_inflight_jobs=1), kv)
    try:
        fill_row(kv, 0, b"a")
        fill_row(kv, 1, b"b")
        assert mgr.store(b"a", 0) is not None and mgr.store(b"b", 1) is None   # the second one is shed
        assert any(r.levelno == logging.DEBUG and "shed" in r.getMessage() and "inflight_limit" in r.getMessage()
                   for r in caplog.records)
    finally:
        mover.complete_all()
        mgr.close()


# ---------------------------------------------------------------- core/disk_tier.py


def _disk_manager(path, disk_blocks: int, **kw):
    kv = make_kv(8)
    cfg = make_config(host_slots=4, disk_path=path, disk_capacity_bytes=disk_blocks * ROW_BYTES,
                      writer_batch_seconds=0.0, **kw)
    return make_fake_manager(cfg, kv)[0]


def test_a_writer_batch_is_bounded_by_writer_batch_bytes_in_whole_blocks(tmp_path):
    """Kills ``tiered_kv.core.disk_tier.xǁDiskTierǁopen__mutmut_13``, ``..._15``, ``..._53`` and ``..._54``
    (the byte bound dropped or divided into a fraction of a block, a batch option not passed on):
    2.5 blocks' worth of bytes is a batch of 2, and the configured batch deadline reaches the writer."""
    mgr = _disk_manager(tmp_path / "d", 1024, writer_batch_blocks=64, writer_batch_bytes=5 * ROW_BYTES // 2)
    try:
        opts = mgr._core.disk.store.opts
        assert (opts.batch_blocks, opts.batch_bytes, opts.batch_seconds) == (2, 2 * ROW_BYTES, 0.0)
        assert type(opts.batch_blocks) is int
    finally:
        mgr.close()


@pytest.mark.parametrize("disk_blocks,index_blocks", [(31, 31), (32, 28), (64, 56)])
def test_a_disk_tier_of_32_blocks_or_more_keeps_two_batches_of_headroom_inside_its_capacity(
        tmp_path, disk_blocks, index_blocks):
    """Kills ``tiered_kv.core.disk_tier.xǁDiskTierǁopen__mutmut_23`` (``>`` for ``>=``): from 32 blocks
    on, the two writer batches a reused slot waits for come out of the capacity the index may fill."""
    mgr = _disk_manager(tmp_path / "d", disk_blocks)
    try:
        assert mgr._core.dindex.num_slots == index_blocks
        assert mgr_metric(mgr, "tiered_kv_tier_capacity_bytes", tier="disk") == index_blocks * ROW_BYTES
    finally:
        mgr.close()


def test_a_spill_the_writer_refuses_after_room_was_checked_is_shed_holding_nothing(tmp_path, monkeypatch):
    """Kills ``tiered_kv.core.disk_tier.xǁDiskTierǁstart_spills`` mutants (once ``start_spill``'s 25 to 29): the writer
    queue had room, then refused the spill (it began closing meanwhile).  The spill is shed as
    ``backpressure``, its disk entry is given back and the host entry's lease released."""
    kv = make_kv(8)
    cfg = make_config(host_slots=4, disk_path=tmp_path / "d", disk_capacity_bytes=64 * ROW_BYTES,
                      writer_batch_seconds=0.0)
    mgr, mover = make_fake_manager(cfg, kv)
    try:
        monkeypatch.setattr(mgr._core.disk.store, "submit_spills", lambda tokens, keys, slots, view: False)
        stored(mgr, mover, kv, [b"refused"], [0])
        assert mgr_metric(mgr, "tiered_kv_shed_total", kind="spill", reason="backpressure") == 1
        assert b"refused" not in mgr._core.dindex and mgr._core.dindex.used_slots == 0
        entry = mgr._core.index.get(b"refused")
        assert entry is not None and entry.readers == 0 and entry.state is EntryState.READY
        assert not entry.spilled, "a shed spill may be tried again"
        assert mgr.flush(timeout=30)
    finally:
        mgr.close()


# ---------------------------------------------------------------------- the last core and writer functions
def test_a_disk_tier_smaller_than_one_row_is_refused_naming_both_sizes(tmp_path):
    """The manager refuses a disk tier smaller than one row before it allocates anything, naming the
    capacity and the row size.  (``core.tiers.__init___70``, ``_71``: the core's copy of this check,
    which no front end ever reached, is gone.)"""
    from tiered_kv.errors import ConfigError
    cfg = make_config(host_slots=4, disk_path=tmp_path / "d", disk_capacity_bytes=ROW_BYTES - 1)
    with pytest.raises(ConfigError, match=rf"disk_capacity_bytes={ROW_BYTES - 1} holds no block of {ROW_BYTES} bytes"):
        TierManager(cfg, make_kv(4), registry=CollectorRegistry())
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir()), "nothing written for a refused tier"


@pytest.mark.parametrize("slab", [torch.zeros(4, 2 * ROW_BYTES, dtype=torch.uint8)[:, ::2],   # not contiguous
                                  torch.zeros(2, 4, ROW_BYTES, dtype=torch.uint8)],               # not [slots, bytes]
                         ids=["strided", "3-d"])
def test_slot_views_refuse_a_slab_that_is_not_a_contiguous_2d_tensor(slab):
    """``core.tiers.SlotViews.__init___1``, ``_5``, ``_6``: either fault alone is refused (one view over
    the whole slab, sliced per slot, would alias the wrong bytes), and the message gives the shape."""
    from tiered_kv.core.tiers import SlotViews
    with pytest.raises(ValueError, match=r"contiguous \[slots, bytes\] tensor, got " + re.escape(str(tuple(slab.shape)))):
        SlotViews(slab)


@pytest.mark.disk_threads
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("exc", [RuntimeError("a bug in the writer"), _WriterKilled("killed")], ids=["Exception", "BaseException"])
def test_a_dying_writer_ends_quietly_on_an_exception_and_re_raises_anything_else(tmp_path, monkeypatch, exc):
    """``disk.writer._writer_main_32``: a writer that dies of an ``Exception`` has logged and counted it
    (``writer_died``) and answered what was queued, so its thread ends without an unhandled
    exception; a ``BaseException`` (an interrupt, a ``SystemExit``) still propagates out of the thread."""
    from tiered_kv.disk.writer import Writer

    unhandled: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: unhandled.append(args.exc_value))

    def die(self):
        raise exc

    monkeypatch.setattr(Writer, "_take_batch", die)
    mgr, _, _ = hooked_disk_manager(tmp_path, None)
    try:
        mgr.disk.writer._thread.join(30)
        assert not mgr.disk.writer_alive() and mgr.disk.writer_error is exc
        assert unhandled == ([] if isinstance(exc, Exception) else [exc])
    finally:
        mgr.close()
