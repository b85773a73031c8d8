"""A read from disk's report, applied by the engine thread's ``poll()``, survives an interrupt anywhere inside it.

Set-up (``test_review_round31.prepare_landed``, disk tier in thread mode): k1 and k2 on disk only, a ``load_many``
of them into rows 11 and 12 waiting for their two reads (PROMOTE jobs), both reads' reports queued.  The next
``poll()`` applies them: each publishes its host entry, lets go of its disk entry's lease, leases its host entry to
the load and, the second one, queues the load's copy (``on_load_ready``); a failed read fails the load instead
(``on_load_failed``) and drops its keys.

Method: round 29's return hook, counting only the call returns made while ``TierCore.apply`` applies a PROMOTE
report (its frame's ``kind``), raises ``KeyboardInterrupt`` at the k-th, for every k until the poll runs through.
Then, with plain calls (``check_disk``): the load is reported exactly once (DONE with its rows' bytes, or FAILED for a
failed read), every host entry is READY and unleased, no record is left, no disk entry stays leased, the in-flight
counts agree with the job map.

Before the fix the promote's record was taken first and its report applied once: an interrupt between taking the
load off the promote's waiters and leasing its entry, or before the load's copy was queued, left the load
PENDING for good (``wait()`` never returned it) and its rows fenced; one in the disk lease's release left the disk
entry leased for ever.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest

import tiered_kv.manager
from disk_helpers import metric_sum
from test_interrupt_engine import _internal_counts_agree, _sweep
from test_interrupt_locks import _call_with
from test_interrupt_remote import _inside_apply_of
from test_review_round29_sweep import WAIT_S, World, check_disk
from test_review_round31 import prepare_landed
from tiered_kv.jobs import JobKind, JobState


def _inside_promote_apply(k: int) -> tuple[Callable[..., None], list[Any]]:
    """The hook: the k-th call return made from library code while ``TierCore.apply`` applies a PROMOTE report."""
    return _inside_apply_of(JobKind.PROMOTE, k)


def _fail_reads(w: World) -> None:
    """Turn the queued PROMOTE reports into failed reads (an I/O error), the other reports left as they are."""
    q = w.mgr._completions
    for r in q.drain():
        if getattr(r, "kind", None) is JobKind.PROMOTE:
            r = dataclasses.replace(r, ok=False, error="disk read failed: injected EIO")
        q.put(r)


@pytest.mark.parametrize("reads,then", [("ok", "retry"), ("failed", "retry"), ("ok", "cancel"), ("ok", "invalidate"),
                                        ("failed", "cancel")])
def test_an_interrupted_promote_report_is_applied_again(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                        reads: str, then: str) -> None:
    """``then``: what the engine does after the interrupt, before its next poll applies the report again --
    nothing (``retry``), ``cancel`` the load_many, or ``invalidate`` its first key (which cancels it, and its
    read's promote if that is not published yet)."""
    monkeypatch.setattr(tiered_kv.manager, "CLOSE_TIMEOUT_S", WAIT_S)

    def one(k: int) -> bool:
        w = World(31, str(tmp_path / f"{reads}{then}{k}"))
        m = w.mgr
        core = m._core
        try:
            prepare_landed(w)
            load = w.held[-1]
            assert load.kind is JobKind.LOAD and load._waiters, "the load_many should wait for its two reads"
            if reads == "failed":
                _fail_reads(w)
            hook, fired = _inside_promote_apply(k)
            comps, exc = _call_with(hook, m.poll)
            label = f"reads {reads}: interrupted at {fired[0] if fired else 'no point (ran through)'}"
            assert exc is None or (fired and isinstance(exc, KeyboardInterrupt)), f"{label}: raised {exc!r}"
            if comps:
                w.take(comps)
            _internal_counts_agree(core, label)
            if then != "retry":   # the copy the interrupted pass queued (if it did) has run: its report waits
                m._mover.flush()
                w.settle_copies()
            if then == "cancel":
                m.cancel(load)
            elif then == "invalidate":
                m.invalidate(load.keys[0])
                w.expect.pop(load.keys[0], None)
            check_disk(w, label)   # exactly once, nothing leased or left, the rows' bytes
            if then == "retry":
                want = [JobState.DONE if reads == "ok" else JobState.FAILED]
            else:   # (cancelled, unless it was reported or its copy landed before the cancel)
                want = [JobState.CANCELLED, JobState.DONE if reads == "ok" else JobState.FAILED]
            assert load.state in want, f"{label}: the load_many ended {load.state.value}, not {want}"
            assert w.seen.get(id(load)) == 1, f"{label}: the load_many reported {w.seen.get(id(load), 0)} times"
            # every copy's report found its job: none was given up while its copy was queued
            unknown = metric_sum(m, "tiered_kv_stale_callbacks_total", reason="unknown_token")
            assert unknown == 0, f"{label}: {unknown} reports of no live job"
            leased = [d for d in core.dindex.entries() if d.readers]
            assert not leased, f"{label}: disk entries still leased: {leased}"
            assert core.n_in_flight[JobKind.PROMOTE] == 0, f"{label}: a promote still in flight"
            return bool(fired)
        finally:
            m.close()

    _sweep(one, 20)


@pytest.mark.parametrize("interrupted", [False, True])
def test_a_read_landing_after_close_closed_the_mover_fails_its_load(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                                    interrupted: bool) -> None:
    """``close()`` waits ``CLOSE_TIMEOUT_S`` for the reads from disk; one that lands after that finds the mover
    closed: the load waiting for it gets no copy (it could land after ``close()`` returned) and is answered failed,
    a miss, once, with nothing left leased or recorded.  ``interrupted``: the pass applying that read is broken off
    at every call return inside it, and ``close()`` called again (the pass runs again, the load is not failed
    twice)."""
    monkeypatch.setattr(tiered_kv.manager, "CLOSE_TIMEOUT_S", 0.01)

    def one(k: int) -> bool:
        w = World(31, str(tmp_path / f"close{interrupted}{k}"))
        m = w.mgr
        core = m._core
        fired: list[Any] = []
        try:
            prepare_landed(w)
            load = w.held[-1]
            q = m._completions
            reads = []
            for r in q.drain():   # the reads' reports held back until the mover is closed
                if getattr(r, "kind", None) is JobKind.PROMOTE:
                    reads.append(r)
                else:
                    q.put(r)
            mover_close = m._mover.close

            def close_then_land() -> None:
                mover_close()
                for r in reads:
                    q.put(r)
                reads.clear()

            monkeypatch.setattr(m._mover, "close", close_then_land)
            if interrupted:
                hook, fired = _inside_promote_apply(k)
                _, exc = _call_with(hook, m.close)
                assert exc is None or (fired and isinstance(exc, KeyboardInterrupt)), f"k={k}: raised {exc!r}"
            m.close()
            label = f"interrupted at {fired[0]}" if fired else "not interrupted"
            comps = [c for c in core.outbox if c.job is load]
            assert load.state is JobState.FAILED and len(comps) == 1, f"{label}: {load!r}, {comps}"
            assert "closed before its read from disk landed" in (load.error or ""), f"{label}: {load.error}"
            assert not core.jobs, f"{label}: records left: {list(core.jobs.values())[:3]}"
            leased = [e for e in core.index.entries() if e.readers] + [d for d in core.dindex.entries() if d.readers]
            assert not leased, f"{label}: still leased: {leased}"
            assert not m._row_load, f"{label}: rows still fenced: {m._row_load}"
            return bool(fired)
        finally:
            m.close()

    if interrupted:
        _sweep(one, 10)
    else:
        one(0)
