"""The vLLM 0.21 offloading ``KeyError``, restated for this API.

In the original, a worker's completion for a store was looked up in a plain
dict keyed by job id; a request aborted mid-store had its entry popped, and the
late completion raised ``KeyError`` on the engine thread.  Here every report is
matched by token on the owner thread; a report matching no live job is
discarded and counted in ``tiered_kv_stale_callbacks_total{kind,reason}``.
"""

from __future__ import annotations

import random
import threading
import uuid

import pytest

from fakes import fill_row, host_matches, instrument_get, make_config, make_fake_manager, row_matches, snapshot
from tiered_kv import Job, JobKind, JobState, TierManager
from tiered_kv.errors import BlockBusyError

STALE = "tiered_kv_stale_callbacks_total"
JOBS = "tiered_kv_jobs_total"
A, B, C = b"key-A", b"key-B", b"key-C"


def _one(completions, job):
    """The single completion of ``job`` in ``completions`` (asserts exactly one)."""
    mine = [c for c in completions if c.job is job]
    assert len(mine) == 1, f"job {job.token} reported {len(mine)} times in {completions}"
    return mine[0]


def _ready_store(mgr, mover, kv, key, row):
    """Store ``key`` from ``row`` and let it complete: the key ends READY."""
    fill_row(kv, row, key)
    j = mgr.store(key, row)
    assert j is not None
    mover.complete(j)
    assert _one(mgr.poll(), j).ok
    return j


# --------------------------------------------------------------------- unknown token
@pytest.mark.parametrize("kind", [JobKind.STORE, JobKind.LOAD])
@pytest.mark.parametrize("ok", [True, False])
def test_report_for_unknown_token_does_not_raise_and_is_counted(fake, metric, kind, ok):
    mgr, mover = fake
    before = mgr.debug_sizes()
    mover.inject(uuid.uuid4(), kind, ok=ok)
    assert mgr.poll() == []
    assert metric(STALE, kind=kind.value, reason="unknown_token") == 1
    assert mgr.debug_sizes() == before
    # and through wait() as well
    mover.inject(uuid.uuid4(), kind, ok=ok)
    assert mgr.wait(timeout=0) == []
    assert metric(STALE, kind=kind.value, reason="unknown_token") == 2


@pytest.mark.parametrize("token", ["not-a-uuid", 12345, b"\x00" * 16, 1.5])
def test_report_whose_token_is_not_a_uuid_is_counted_not_raised(fake, metric, token):
    mgr, mover = fake
    before = mgr.debug_sizes()
    mover.inject(token, JobKind.STORE, ok=True)
    assert mgr.poll() == []
    assert metric(STALE, kind="store", reason="unknown_token") == 1
    assert mgr.debug_sizes() == before


def test_unknown_token_among_live_jobs_touches_nothing(fake, kv, metric):
    mgr, mover = fake
    fill_row(kv, 3, A)
    j = mgr.store(A, 3)
    mover.inject(uuid.uuid4(), JobKind.STORE)       # before the real one
    mover.complete(j)
    mover.inject(uuid.uuid4(), JobKind.LOAD, ok=False)  # after it
    out = mgr.poll()
    assert [(c.job, c.ok) for c in out] == [(j, True)]
    assert metric(STALE, kind="store", reason="unknown_token") == 1
    assert metric(STALE, kind="load", reason="unknown_token") == 1
    assert host_matches(mgr, A, kv) is True


# --------------------------------------------------------------------- cancel drops the record
def test_cancel_removes_pending_record(fake, kv, metric):
    mgr, mover = fake
    fill_row(kv, 5, A)
    j = mgr.store(A, 5)
    assert mgr.debug_sizes()["jobs"] == 1
    mgr.cancel(j)
    out = mgr.poll()
    c = _one(out, j)
    assert not c.ok and c.error.startswith("cancelled (") and "cancelled" in c.error
    assert j.state is JobState.CANCELLED and j.done
    # the slot stays leased until the worker's report arrives
    assert mgr.host_used_slots == 1
    assert mgr.debug_sizes()["jobs"] == 1
    assert mgr.lookup([A]) == 0 and mgr.host_bytes(A) is None
    mover.complete(j)                     # the late report
    assert mgr.poll() == []
    sizes = mgr.debug_sizes()
    assert sizes["jobs"] == 0 and sizes["deliver"] == 0 and sizes["row_stores"] == 0
    assert mgr.host_used_slots == 0 and mgr.jobs_in_flight == 0
    assert metric(STALE, kind="store", reason="cancelled") == 1
    assert metric(JOBS, kind="store", outcome="cancelled") == 1
    assert metric(JOBS, kind="store", outcome="ok") == 0


# --------------------------------------------------------------------- superseded token
@pytest.mark.parametrize("late_first", [True, False], ids=["stale-report-first", "stale-report-last"])
def test_superseded_report_discarded_second_job_wins(fake, kv, metric, late_first):
    mgr, mover = fake
    fill_row(kv, 3, A)
    j1 = mgr.store(A, 3)
    mgr.invalidate(A)
    assert j1.state is JobState.CANCELLING
    c1 = _one(mgr.poll(), j1)
    assert not c1.ok and "superseded" in c1.error
    fill_row(kv, 7, A)
    j2 = mgr.store(A, 7)
    assert j2 is not None and j2.token != j1.token
    t1, t2 = mover.transfer_of(j1), mover.transfer_of(j2)
    assert t1.slots != t2.slots, "the superseded job's slot must still be leased"
    # make the stale job's bytes observably wrong: its source row now holds C
    assert mgr.free_block(3) is True
    fill_row(kv, 3, C)
    for t in ([t1, t2] if late_first else [t2, t1]):
        mover.complete(t)
    out = mgr.poll()
    assert [c.job for c in out] == [j2] and out[0].ok
    assert j1.state is JobState.CANCELLED and j2.state is JobState.DONE
    assert metric(STALE, kind="store", reason="superseded") == 1
    assert mgr.lookup([A]) == 1
    assert host_matches(mgr, A, kv) is True
    assert mgr.host_used_slots == 1 and mgr.debug_sizes()["jobs"] == 0
    jl = mgr.load(A, 11)
    mover.complete(jl)
    assert _one(mgr.poll(), jl).ok
    assert row_matches(kv, 11, A)


# --------------------------------------------------------------------- cancelled job's report
@pytest.mark.parametrize("report_ok", [True, False])
def test_cancelled_store_report_is_discarded(fake, kv, metric, report_ok):
    mgr, mover = fake
    fill_row(kv, 9, A)
    j = mgr.store(A, 9)
    mgr.cancel(j)
    mover.complete(j, ok=report_ok)
    out = mgr.poll()
    assert len(out) == 1 and out[0].job is j and not out[0].ok
    assert mgr.lookup([A]) == 0 and mgr.host_bytes(A) is None
    assert metric(STALE, kind="store", reason="cancelled") == 1
    assert metric(JOBS, kind="store", outcome="ok") == 0
    assert metric(JOBS, kind="store", outcome="failed") == 0
    assert mgr.debug_sizes()["jobs"] == 0 and mgr.host_used_slots == 0


# --------------------------------------------------------------------- abort racing completion
def test_store_worker_completes_then_cancel_before_poll(fake, kv, metric):
    mgr, mover = fake
    fill_row(kv, 4, A)
    j = mgr.store(A, 4)
    mover.complete(j)          # the copy landed, the report is queued...
    mgr.cancel(j)              # ...but the engine aborts before polling
    out = mgr.poll()
    c = _one(out, j)
    assert not c.ok and c.error == "cancelled (cancelled)"
    assert mgr.lookup([A]) == 0
    assert metric(STALE, kind="store", reason="cancelled") == 1
    assert metric(JOBS, kind="store", outcome="cancelled") == 1
    assert mgr.poll() == []
    assert mgr.debug_sizes()["jobs"] == 0 and mgr.host_used_slots == 0


def test_store_cancel_then_worker_completes(fake, kv, metric):
    mgr, mover = fake
    fill_row(kv, 4, A)
    j = mgr.store(A, 4)
    mgr.cancel(j)
    mover.complete(j)
    out = mgr.poll()
    assert [(c.job, c.ok) for c in out] == [(j, False)]
    assert mgr.lookup([A]) == 0
    assert metric(STALE, kind="store", reason="cancelled") == 1
    assert mgr.poll() == [] and mgr.debug_sizes()["jobs"] == 0


def test_load_worker_completes_then_cancel_before_poll(fake, kv, metric):
    mgr, mover = fake
    _ready_store(mgr, mover, kv, A, 1)
    jl = mgr.load(A, 20)
    mover.complete(jl)         # the copy landed in row 20, report queued
    mgr.cancel(jl)
    assert jl.state is JobState.CANCELLING
    out = mgr.poll()
    c = _one(out, jl)
    assert not c.ok and c.error == "cancelled (cancelled)"
    assert metric(STALE, kind="load", reason="cancelled") == 1
    assert metric(JOBS, kind="load", outcome="cancelled") == 1
    assert mgr.free_block(20) is True
    assert mgr.debug_sizes()["jobs"] == 0 and mgr.debug_sizes()["row_load"] == 0
    assert mgr.lookup([A]) == 1  # the host copy is untouched


def test_load_cancel_then_worker_completes_is_fenced_until_report(fake, kv, metric):
    mgr, mover = fake
    _ready_store(mgr, mover, kv, A, 1)
    jl = mgr.load(A, 20)
    mgr.cancel(jl)
    # a cancelled load is reported only once its copy can no longer land
    assert mgr.poll() == []
    assert jl.state is JobState.CANCELLING and not jl.done
    assert mgr.free_block(20) is False
    with pytest.raises(BlockBusyError, match="20"):
        mgr.store(B, 20)
    with pytest.raises(BlockBusyError, match="20"):
        mgr.load(A, 20)
    assert mgr.wait([jl], timeout=0) == []
    mover.complete(jl)
    out = mgr.poll()
    assert [(c.job, c.ok) for c in out] == [(jl, False)]
    assert metric(STALE, kind="load", reason="cancelled") == 1
    assert mgr.free_block(20) is True
    assert mgr.poll() == [] and mgr.debug_sizes()["jobs"] == 0


@pytest.mark.parametrize("kind", ["store", "load"])
def test_cancel_after_completion_applied_is_a_noop(fake, kv, metric, kind):
    mgr, mover = fake
    if kind == "store":
        fill_row(kv, 2, A)
        j = mgr.store(A, 2)
        mover.complete(j)
    else:
        _ready_store(mgr, mover, kv, A, 2)
        j = mgr.load(A, 30)
        mover.complete(j)
    assert _one(mgr.poll(), j).ok
    before = snapshot(mgr)
    mgr.cancel(j)
    mgr.cancel(j)  # idempotent
    assert j.state is JobState.DONE
    assert mgr.poll() == []
    assert snapshot(mgr) == before
    assert mgr.lookup([A]) == 1
    if kind == "load":
        assert row_matches(kv, 30, A) and mgr.free_block(30) is True


@pytest.mark.parametrize("kind", ["store", "load"])
def test_cancel_twice_before_report_reports_once(fake, kv, metric, kind):
    mgr, mover = fake
    if kind == "store":
        fill_row(kv, 2, A)
        j = mgr.store(A, 2)
    else:
        _ready_store(mgr, mover, kv, A, 2)
        j = mgr.load(A, 30)
    mgr.cancel(j)
    mgr.cancel(j)
    seen = mgr.poll()
    mgr.cancel(j)
    mover.complete(j)
    seen += mgr.poll()
    mgr.cancel(j)
    seen += mgr.poll()
    assert len([c for c in seen if c.job is j]) == 1
    assert metric(STALE, kind=kind, reason="cancelled") == 1
    assert metric(JOBS, kind=kind, outcome="cancelled") == 1
    assert mgr.debug_sizes()["jobs"] == 0


# --------------------------------------------------------------------- duplicates
@pytest.mark.parametrize("same_poll", [True, False])
def test_duplicate_report_is_counted_not_applied_twice(fake, kv, metric, same_poll):
    mgr, mover = fake
    fill_row(kv, 6, A)
    j = mgr.store(A, 6)
    r = mover.complete(j)
    if same_poll:
        mover.duplicate(r)
        out = mgr.poll()
    else:
        out = mgr.poll()
        mover.duplicate(r)
        out += mgr.poll()
    assert [(c.job, c.ok) for c in out] == [(j, True)]
    assert metric(STALE, kind="store", reason="unknown_token") == 1
    assert metric(JOBS, kind="store", outcome="ok") == 1
    assert metric("tiered_kv_transfer_bytes_total", src="device", dst="host") == kv[0].numel() * kv.element_size()
    assert mgr.lookup([A]) == 1 and host_matches(mgr, A, kv)
    assert mgr.host_used_slots == 1


def test_duplicate_of_cancelled_load_report(fake, kv, metric):
    mgr, mover = fake
    _ready_store(mgr, mover, kv, A, 1)
    jl = mgr.load(A, 40)
    mgr.free_block(40)  # cancels the load, fenced
    r = mover.complete(jl)
    mover.duplicate(r)
    out = mgr.poll()
    assert [(c.job, c.ok) for c in out] == [(jl, False)]
    assert metric(STALE, kind="load", reason="cancelled") == 1
    assert metric(STALE, kind="load", reason="unknown_token") == 1
    assert mgr.free_block(40) is True
    # the host entry's reader lease was released exactly once: it is evictable/loadable again
    jl2 = mgr.load(A, 41)
    mover.complete(jl2)
    assert _one(mgr.poll(), jl2).ok and row_matches(kv, 41, A)


# --------------------------------------------------------------------- wait() after an abort
def test_wait_all_returns_only_when_no_worker_report_is_outstanding(fake, kv, metric):
    """The engine aborts a request mid-store, then drains with wait().

    wait(None) is documented as "block until every job in flight is reported",
    and jobs_in_flight counts "jobs whose worker report has not been applied
    (including cancelled ones)".  A cancelled store is delivered (reported) at
    once, but its worker report -- which releases its host slot and drops its
    record -- is still outstanding: wait(None) must keep blocking until it has
    been applied, so that afterwards nothing is in flight.
    """
    mgr, mover = fake
    fill_row(kv, 0, A)
    j = mgr.store(A, 0)
    mgr.cancel(j)
    entered, stop = threading.Event(), threading.Event()
    instrument_get(mover.completions, lambda timeout: entered.set())

    def worker():  # the cancelled copy reports only once the owner blocks in wait()
        while not stop.is_set():
            if entered.wait(0.05):
                mover.complete(j)
                return

    th = threading.Thread(target=worker, daemon=True)
    th.start()
    try:
        out = mgr.wait(timeout=10)
    finally:
        stop.set()
        th.join(10)
    assert [(c.job, c.ok) for c in out] == [(j, False)]
    assert mgr.jobs_in_flight == 0, (f"wait() returned while the cancelled store's worker report was still "
                                     f"outstanding: {mgr.debug_sizes()}")
    assert mgr.host_used_slots == 0 and mgr.debug_sizes()["jobs"] == 0
    assert metric(STALE, kind="store", reason="cancelled") == 1


def test_wait_all_with_timeout_returns_what_was_applied(fake, kv):
    """On timeout wait() returns what was applied so far; the job stays in flight."""
    mgr, mover = fake
    fill_row(kv, 0, A)
    fill_row(kv, 1, B)
    ja, jb = mgr.store(A, 0), mgr.store(B, 1)
    mover.complete(ja)
    out = mgr.wait(timeout=0.05)           # jb's worker never answers within the timeout
    assert [(c.job, c.ok) for c in out] == [(ja, True)]
    assert not jb.done and mgr.jobs_in_flight == 1
    mover.complete(jb)
    assert [(c.job, c.ok) for c in mgr.wait()] == [(jb, True)]
    assert mgr.jobs_in_flight == 0


# --------------------------------------------------------------------- a small engine
class _MiniEngine:
    """Requests of a few blocks: compute, store, abort mid-store, reuse rows."""

    def __init__(self, mgr: TierManager, kv, rng: random.Random) -> None:
        self.mgr, self.kv, self.rng = mgr, kv, rng
        self.free_rows = list(range(kv.shape[0]))
        self.fenced: list[int] = []
        self.running: dict[int, tuple[list[bytes], list[int], list[Job]]] = {}
        self.reported: dict[uuid.UUID, int] = {}
        self.issued: list[Job] = []
        self.next_rid = 0

    def admit(self, n_blocks: int) -> int:
        rid = self.next_rid
        self.next_rid += 1
        keys = [b"req%d/blk%d" % (rid % 5, i) for i in range(n_blocks)]  # shared prefixes across requests
        rows = [self.free_rows.pop() for _ in range(n_blocks)]
        jobs: list[Job] = []
        hit = self.mgr.lookup(keys)
        for i, (k, r) in enumerate(zip(keys, rows)):
            j = self.mgr.load(k, r) if i < hit else None
            if j is None:
                fill_row(self.kv, r, k)
                j = self.mgr.store(k, r)
            if j is not None:
                jobs.append(j)
                self.issued.append(j)
        self.running[rid] = (keys, rows, jobs)
        return rid

    def abort(self, rid: int) -> None:
        keys, rows, jobs = self.running.pop(rid)
        for j in jobs:
            self.mgr.cancel(j)
        for r in rows:
            (self.free_rows if self.mgr.free_block(r) else self.fenced).append(r)
            if r in self.free_rows:
                fill_row(self.kv, r, b"garbage/%d" % self.rng.randrange(1 << 30))  # reused at once

    def step(self) -> None:
        for c in self.mgr.poll():
            self.reported[c.job.token] = self.reported.get(c.job.token, 0) + 1
            if c.ok and c.job.kind is JobKind.LOAD:
                assert row_matches(self.kv, c.job.block, c.job.key)
        still = []
        for r in self.fenced:
            (self.free_rows if self.mgr.free_block(r) else still).append(r)
        self.fenced = still
        for rid in [rid for rid, (_, _, jobs) in self.running.items() if all(j.done for j in jobs)]:
            _, rows, _ = self.running.pop(rid)
            for r in rows:
                assert self.mgr.free_block(r)
                self.free_rows.append(r)


def test_simulated_engine_aborts_mid_store_and_keeps_stepping(cfg, kv, registry, metric):
    mgr, mover = make_fake_manager(make_config(host_slots=16), kv, registry)
    rng = random.Random(7)
    eng = _MiniEngine(mgr, kv, rng)
    rid = eng.admit(4)
    _, rows, jobs = eng.running[rid]
    assert len(jobs) == 4 and all(j.kind is JobKind.STORE for j in jobs)
    # two copies land before the abort, two after: the original KeyError scenario
    mover.complete(jobs[0])
    mover.complete(jobs[1])
    eng.abort(rid)  # cancel + free_block, mid-store
    assert all(j.state is JobState.CANCELLING for j in jobs)
    for step in range(20):
        if step % 3 == 0:
            eng.admit(1 + rng.randrange(3))
        if step == 4 and eng.running:
            eng.abort(next(iter(eng.running)))
        # late and out-of-order worker reports, including the aborted ones
        k = len(mover.outstanding)
        for t in rng.sample(list(mover.outstanding), k=min(k, 1 + rng.randrange(3))):
            mover.complete(t)
        if step % 5 == 0:
            mover.inject(uuid.uuid4(), JobKind.STORE)
        eng.step()
    mover.complete_all("lifo")
    eng.step()
    eng.step()
    assert all(j.done for j in eng.issued)
    assert all(eng.reported.get(j.token) == 1 for j in eng.issued), "every job reported exactly once"
    assert metric(STALE, kind="store", reason="cancelled") >= 4
    assert metric(STALE, kind="store", reason="unknown_token") == 4
    sizes = mgr.debug_sizes()
    assert sizes["jobs"] == sizes["deliver"] == sizes["row_stores"] == sizes["row_load"] == sizes["key_loads"] == 0
    assert sizes["host_used_slots"] == sizes["host_entries"]
    for key in {k for k in [b"req%d/blk%d" % (r, i) for r in range(5) for i in range(4)]}:
        assert host_matches(mgr, key, kv) in (None, True)
    mgr.close()


def test_simulated_engine_with_real_workers(kv, registry, metric):
    from tiered_kv import TierManager as TM
    mgr = TM(make_config(host_slots=16), kv, registry=registry)
    rng = random.Random(11)
    eng = _MiniEngine(mgr, kv, rng)
    try:
        rid = eng.admit(4)
        eng.abort(rid)
        for step in range(20):
            if step % 2 == 0:
                eng.admit(1 + rng.randrange(3))
            if step % 3 == 1 and eng.running:
                eng.abort(rng.choice(sorted(eng.running)))
            eng.step()
        for c in mgr.wait(timeout=30):
            eng.reported[c.job.token] = eng.reported.get(c.job.token, 0) + 1
            if c.ok and c.job.kind is JobKind.LOAD:
                assert row_matches(kv, c.job.block, c.job.key)
        assert all(j.done for j in eng.issued)
        assert all(eng.reported.get(j.token) == 1 for j in eng.issued)
    finally:
        mgr.close()
    # close() joined the workers and applied every late report: nothing is left behind
    sizes = mgr.debug_sizes()
    assert sizes["jobs"] == sizes["deliver"] == sizes["row_stores"] == sizes["row_load"] == sizes["key_loads"] == 0
    assert sizes["host_used_slots"] == sizes["host_entries"]
