"""A hypothesis state machine over the whole core API, checked against a plain model.

The manager runs on a :class:`~fakes.FakeMover`: every transfer is answered
only when a rule says so, in any order, after cancels, frees and invalidations,
with failures, skipped (cancel-hinted) copies, duplicate and unknown reports.
The copy happens when the transfer is answered, so a stale worker really
copies whatever the row/slot holds at that moment.

The model is plain Python (tests/host_model.py), written from the spec, not the code: which
keys the host tier holds and which are readable, the jobs not yet answered and their states, the
cancelled stores awaiting delivery and the metric counters; slots in use, fences and table sizes
are derived from those.  Checked after every step:

* no exception escapes except ``BlockBusyError``, exactly when the model says;
* store/load/lookup/free_block results equal the model's;
* poll()/wait() report exactly the jobs the model says, each exactly once,
  with the right ok/error; an ok load's row holds the key's bytes;
* every key READY in the host tier holds that key's bytes (never wrong bytes);
* after every poll()/wait(): jobs_total{kind,outcome},
  stale_callbacks_total{kind,reason}, shed_total{kind,reason},
  errors_total{tier,error="copy_failed"}, evictions, lookup keys and hits equal
  the model's counters;
* debug_sizes() equal the sizes the model derives and stay bounded;
  host_used_slots <= capacity;
* teardown: every job issued was reported exactly once (the machine's count and the model's).
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Union

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from prometheus_client import CollectorRegistry

from fakes import (fill_row, host_matches, make_config, make_fake_manager, make_kv, metric_samples, row_matches,
                   sm_settings)
from host_model import Copy, MJob, Model
from tiered_kv import Job, JobKind
from tiered_kv.errors import BlockBusyError

ROWS = 6
KEYS = [b"key-%d" % i for i in range(6)]
CAPACITY = 4          # host slots: eviction and host_full shedding happen often
MAX_INFLIGHT = 7      # inflight_limit shedding happens too
OUTCOMES = ("ok", "failed", "cancelled", "shed")
REASONS = ("unknown_token", "cancelled", "superseded", "source_reused")
SHED = ("inflight_limit", "host_full")


# ============================================================================ the model
@dataclass
class FakeMoverModel(Model):
    """The shared model (tests/host_model.py), plus the reports the fake mover has put, applied in
    put order at the next poll, and which key's bytes each row holds."""

    queue: list[tuple[uuid.UUID, str, bool]] = field(default_factory=list)   # put, not yet applied
    row_content: list[Optional[bytes]] = field(default_factory=list)         # row -> key, or None

    def add_store(self, job: Job, key: bytes, row: int, c: Copy) -> MJob:
        return self.add(MJob(job, "store", key, row, c))

    def add_load(self, job: Job, key: bytes, row: int, c: Copy) -> MJob:
        self.row_content[row] = None
        return self.add(MJob(job, "load", key, row, c))

    def poll(self) -> list[tuple[MJob, bool, Optional[str]]]:
        out: list[tuple[MJob, bool, Optional[str]]] = []
        queue, self.queue = self.queue, []
        for token, kind, ok in queue:
            mj = self.jobs.get(token)
            if mj is None:
                self.stale[(kind, "unknown_token")] += 1
                continue
            r = self.apply(mj, ok)
            if mj.kind == "load":
                self.row_content[mj.row] = mj.key if mj.state == "done" else None
            if r is not None:
                out.append((mj, *r))
        out += [(mj, *r) for mj, r in self.take_deliver()]
        self.evict_ahead()
        return out


# ============================================================================ the machine
rows = st.integers(0, ROWS - 1)
keys = st.sampled_from(KEYS)


class TierMachine(RuleBasedStateMachine):
    """Guards the TierManager's protocol on a fake mover (exactly-once reports, token match or discard,
    leases, fences, LRU eviction, shedding, counters; see the module docstring) against the spec's model."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = make_kv(ROWS, seed=99)
        self.registry = CollectorRegistry()
        self.mgr, self.mover = make_fake_manager(
            make_config(host_slots=CAPACITY, max_inflight_jobs=MAX_INFLIGHT), self.kv, self.registry)
        self.model = FakeMoverModel(CAPACITY, MAX_INFLIGHT, row_content=[None] * ROWS)
        self.mjobs: dict[uuid.UUID, MJob] = {}
        self.issued: list[Job] = []
        self.reported: Counter = Counter()
        self.broken = False  # set while a step runs; left set if it raised

    # -- helpers -------------------------------------------------------------
    def _check_completions(self, got, expected) -> None:
        assert [(c.job.token, c.ok) for c in got] == [(mj.job.token, ok) for mj, ok, _ in expected], \
            (f"reported {[(c.job.kind.value, c.job.key, c.ok, c.error) for c in got]}, model expected "
             f"{[(mj.kind, mj.key, ok, err) for mj, ok, err in expected]}")
        for c, (mj, ok, err) in zip(got, expected):
            assert c.job is mj.job
            self.reported[c.job.token] += 1
            assert self.reported[c.job.token] == 1, f"job {c.job!r} reported twice"
            assert c.job.done and c.job.state.value == mj.state
            if ok:
                assert c.error is None
                if mj.kind == "load":
                    assert row_matches(self.kv, mj.row, mj.key), \
                        f"ok load of {mj.key!r} into row {mj.row}: wrong bytes"
            else:
                assert c.error is not None and c.error.startswith(err), (c.error, err)

    def _answer(self, t, ok: bool, honor_cancel: bool, copy_on_fail: bool) -> None:
        if ok:
            r = self.mover.complete(t, honor_cancel=honor_cancel)
        else:
            r = self.mover.fail(t, copy=copy_on_fail)
        self.model.queue.append((r.token, r.kind.value, r.ok))

    # -- rules ---------------------------------------------------------------
    @initialize(n=st.integers(0, CAPACITY), fail_one=st.booleans(), ahead=st.integers(0, 2))
    def warm_host_tier(self, n: int, fail_one: bool, ahead: int) -> None:
        """Start with ``n`` keys READY in the host tier (so loads, hits and evictions happen early), on a
        manager whose poll()/wait() leave ``ahead`` slots free (``host_evict_ahead_blocks``)."""
        self.broken = True
        if ahead:
            self.mgr.close()
            self.registry = CollectorRegistry()
            self.mgr, self.mover = make_fake_manager(
                make_config(host_slots=CAPACITY, max_inflight_jobs=MAX_INFLIGHT, host_evict_ahead_blocks=ahead),
                self.kv, self.registry)
            self.model.ahead = ahead
        for i in range(n):
            key, row = KEYS[i], i
            assert self.model.free_block(row) is True and self.mgr.free_block(row) is True
            fill_row(self.kv, row, key)
            self.model.row_content[row] = key
            e = self.model.store(key, row)
            job = self.mgr.store(key, row)
            assert isinstance(e, Copy) and job is not None
            self.mjobs[job.token] = self.model.add_store(job, key, row, e)
            self.issued.append(job)
        for t in list(self.mover.outstanding)[::-1]:
            self._answer(t, not (fail_one and t is self.mover.outstanding[0]), False, False)
        self._check_completions(self.mgr.poll(), self.model.poll())
        self.metrics_agree()
        self.broken = False

    @rule(row=rows, key=keys, write=st.booleans())
    def engine_reuses_row(self, row: int, key: bytes, write: bool) -> None:
        """The engine reuses a row: free_block, and only when it returns True, compute ``key`` into it."""
        self.broken = True
        expected = self.model.free_block(row)
        assert self.mgr.free_block(row) is expected
        if expected and write:
            fill_row(self.kv, row, key)
            self.model.row_content[row] = key
        self.broken = False

    @rule(row=rows, key=keys, answer_now=st.booleans())
    def store(self, row: int, key: bytes, answer_now: bool) -> None:
        self.broken = True
        if not self.model.fenced(row):
            if self.model.row_content[row] is None:
                # the engine computes a block before storing it
                assert self.model.free_block(row) is True and self.mgr.free_block(row) is True
                fill_row(self.kv, row, key)
                self.model.row_content[row] = key
            key = self.model.row_content[row]  # the engine stores what the row holds
        self._issue(self.mgr.store, JobKind.STORE, self.model.store(key, row), self.model.add_store,
                    key, row, answer_now)
        self.broken = False

    @rule(row=rows, key=keys, answer_now=st.booleans())
    def load(self, row: int, key: bytes, answer_now: bool) -> None:
        self.broken = True
        self._issue(self.mgr.load, JobKind.LOAD, self.model.load(key, row), self.model.add_load,
                    key, row, answer_now)
        self.broken = False

    def _issue(self, call, kind: JobKind, expected: Union[str, Copy], add, key: bytes, row: int, answer_now: bool) -> None:
        """Call ``mgr.store``/``mgr.load`` and check its answer against the model's ``expected``."""
        if expected == "busy":
            with pytest.raises(BlockBusyError):
                call(key, row)
            return
        job = call(key, row)
        if expected == "none":
            assert job is None
            return
        assert job is not None and job.kind is kind and job.key == key and job.block == row
        self.mjobs[job.token] = add(job, key, row, expected)
        self.issued.append(job)
        if answer_now:
            self._answer(self.mover.transfer_of(job), True, False, False)

    @precondition(lambda self: self.issued)
    @rule(data=st.data())
    def cancel(self, data) -> None:
        self.broken = True
        job = data.draw(st.sampled_from(self.issued), label="job")
        self.model.cancel(self.mjobs[job.token], "cancelled")
        self.mgr.cancel(job)
        self.broken = False

    @rule(key=keys)
    def invalidate(self, key: bytes) -> None:
        self.broken = True
        self.model.invalidate(key)
        self.mgr.invalidate(key)
        self.broken = False

    @rule(ks=st.lists(keys, max_size=4))
    def lookup(self, ks: list[bytes]) -> None:
        self.broken = True
        assert self.mgr.lookup(ks) == self.model.lookup(ks)
        self.broken = False

    @rule(use_wait=st.booleans())
    def poll(self, use_wait: bool) -> None:
        self.broken = True
        got = self.mgr.wait(timeout=0) if use_wait else self.mgr.poll()
        self._check_completions(got, self.model.poll())
        self.metrics_agree()
        self.broken = False

    @precondition(lambda self: self.mover.outstanding)
    @rule(data=st.data(), honor_cancel=st.booleans(), copy_on_fail=st.booleans())
    def workers_answer(self, data, honor_cancel: bool, copy_on_fail: bool) -> None:
        """1-3 outstanding transfers answered, any of them (out of order), mostly ok."""
        self.broken = True
        n = data.draw(st.integers(1, 3), label="n")
        for _ in range(min(n, len(self.mover.outstanding))):
            i = data.draw(st.integers(0, len(self.mover.outstanding) - 1), label="transfer")
            ok = data.draw(st.integers(0, 5), label="fail-if-0") > 0
            self._answer(self.mover.outstanding[i], ok, honor_cancel, copy_on_fail)
        self.broken = False

    @rule(data=st.data(), kind=st.sampled_from([JobKind.STORE, JobKind.LOAD]), ok=st.booleans())
    def bogus_report(self, data, kind: JobKind, ok: bool) -> None:
        """A report for a token never issued, or a duplicate of one already put."""
        self.broken = True
        if self.mover.reports and data.draw(st.booleans(), label="duplicate"):
            r = data.draw(st.sampled_from(self.mover.reports), label="report")
            d = self.mover.duplicate(r)
        else:
            d = self.mover.inject(uuid.uuid4(), kind, ok=ok)
        self.model.queue.append((d.token, d.kind.value, d.ok))
        self.broken = False

    # -- invariants ------------------------------------------------------------
    @invariant()
    def tables_agree_and_are_bounded(self) -> None:
        want, s = self.model.sizes(), self.mgr.debug_sizes()
        assert {k: s[k] for k in want} == want, f"debug_sizes {s}, the model says {want}"
        assert self.mgr.jobs_in_flight == want["jobs"] <= MAX_INFLIGHT
        assert self.mgr.host_blocks == want["host_entries"] <= CAPACITY
        assert self.mgr.host_used_slots == want["host_used_slots"] <= CAPACITY
        assert want["row_load"] <= ROWS and want["row_stores"] <= ROWS and want["key_loads"] <= len(KEYS)

    @invariant()
    def never_wrong_bytes_in_host_tier(self) -> None:
        for k in KEYS:
            hm = host_matches(self.mgr, k, self.kv)
            assert (hm is not None) == self.model.ready(k), k
            assert hm in (None, True), f"host tier holds wrong bytes for {k!r}"

    def metrics_agree(self, full: bool = False) -> None:
        """Counters equal the model's (checked right after poll()/wait(): counters may be batched until then)."""
        if full:
            samples = metric_samples(self.registry)
        else:  # the same samples, collected from the four families only (the histograms are slow to collect)
            mx = self.mgr.metrics
            samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for fam in (mx.jobs, mx.stale_callbacks, mx.evictions, mx.lookup_hits, mx.lookups,
                                   mx.shed_total, mx.errors)
                       for metric in fam.collect() for s in metric.samples}
        m = self.model
        for kind in ("store", "load"):
            for outcome in OUTCOMES:
                got = samples.get(("tiered_kv_jobs_total", (("kind", kind), ("outcome", outcome))), 0.0)
                assert got == m.jobs_total[(kind, outcome)], (kind, outcome, got, m.jobs_total)
            for reason in REASONS:
                got = samples.get(("tiered_kv_stale_callbacks_total", (("kind", kind), ("reason", reason))), 0.0)
                assert got == m.stale[(kind, reason)], (kind, reason, got, m.stale)
            for why in SHED:
                got = samples.get(("tiered_kv_shed_total", (("kind", kind), ("reason", why))), 0.0)
                assert got == m.shed[(kind, why)], (kind, why, got, m.shed)
        for tier in ("host", "device"):
            got = samples.get(("tiered_kv_errors_total", (("error", "copy_failed"), ("tier", tier))), 0.0)
            assert got == m.errors[tier], (tier, got, m.errors)
        assert samples.get(("tiered_kv_evictions_total", (("tier", "host"),)), 0.0) == m.evictions
        assert samples.get(("tiered_kv_lookup_hits_total", (("tier", "host"),)), 0.0) == m.hits
        assert samples.get(("tiered_kv_lookup_keys_total", ()), 0.0) == m.asked

    def teardown(self) -> None:
        try:
            if self.broken:
                return
            # every worker answers at last; then every job is reported exactly once
            for t in list(self.mover.outstanding):
                self._answer(t, True, False, False)
            self._check_completions(self.mgr.poll(), self.model.poll())
            missing = [j for j in self.issued if self.reported[j.token] != 1]
            assert not missing, f"jobs never reported: {missing}"
            assert not self.model.unreported(list(self.mjobs.values()))
            s = self.mgr.debug_sizes()
            assert s["jobs"] == s["deliver"] == s["row_stores"] == s["row_load"] == s["key_loads"] == 0
            assert s["host_used_slots"] == s["host_entries"]
            self.metrics_agree(full=True)
        finally:
            self.mgr.close()


TierMachine.TestCase.settings = sm_settings(400, 80)
test_tier_manager_state_machine = TierMachine.TestCase
