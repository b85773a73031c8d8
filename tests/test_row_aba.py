"""Row ABA: a device row is a location, reused all the time; it never identifies data.

Row 137 holds key A, a store of A starts, the engine frees the row and reuses it
for key B, and stores B.  A's worker then copies the row -- now B's bytes --
into A's slot.  A's late report must change nothing of B's, and A must never
be served with B's bytes (it is not served at all: its store was cancelled).
"""

from __future__ import annotations

import pytest

from fakes import content_u8, fill_row, host_matches, row_matches
from tiered_kv import JobKind, JobState
from tiered_kv.errors import BlockBusyError

STALE = "tiered_kv_stale_callbacks_total"
JOBS = "tiered_kv_jobs_total"
A, B, X = b"prefix/A", b"prefix/B", b"prefix/X"
ROW = 137


def _completions_by_job(out):
    seen = {}
    for c in out:
        assert c.job.token not in seen, f"job {c.job.token} reported twice"
        seen[c.job.token] = c
    return seen


@pytest.mark.parametrize("a_report", ["ok", "failed", "skipped"])
@pytest.mark.parametrize("order", ["A-then-B", "B-then-A", "A-after-B-polled"])
def test_row_137_reused_for_B_while_A_store_in_flight(fake, kv, metric, order, a_report):
    mgr, mover = fake
    assert kv.shape[0] > ROW
    fill_row(kv, ROW, A)
    ja = mgr.store(A, ROW)
    assert ja is not None
    ta = mover.transfer_of(ja)

    assert mgr.free_block(ROW) is True          # the engine reuses the row...
    assert ja.state is JobState.CANCELLING and ta.cancelled
    fill_row(kv, ROW, B)                        # ...for B
    jb = mgr.store(B, ROW)
    assert jb is not None
    tb = mover.transfer_of(jb)
    assert tb.slots != ta.slots                   # A's slot is still leased to A's worker

    def answer_a():
        # A's worker copies row 137 *now*: B's bytes land in A's slot
        if a_report == "ok":
            mover.complete(ta)
        elif a_report == "failed":
            mover.fail(ta, copy=True)
        else:
            mover.complete(ta, honor_cancel=True)

    out = []
    if order == "A-then-B":
        answer_a()
        mover.complete(tb)
    elif order == "B-then-A":
        mover.complete(tb)
        answer_a()
    else:
        mover.complete(tb)
        out += mgr.poll()
        answer_a()
    out += mgr.poll()
    seen = _completions_by_job(out)
    assert set(seen) == {ja.token, jb.token}
    assert not seen[ja.token].ok and "source_reused" in seen[ja.token].error
    assert seen[jb.token].ok
    assert ja.state is JobState.CANCELLED and jb.state is JobState.DONE

    # B is intact
    assert mgr.lookup([B]) == 1
    assert host_matches(mgr, B, kv) is True
    # A is not served at all, never with B's bytes
    assert mgr.lookup([A]) == 0
    assert mgr.host_bytes(A) is None
    assert mgr.load(A, 50) is None
    assert mgr.lookup([A, B]) == 0
    # loading B gives B's bytes
    jl = mgr.load(B, 60)
    mover.complete(jl)
    assert [(c.job, c.ok) for c in mgr.poll()] == [(jl, True)]
    assert row_matches(kv, 60, B)

    assert metric(STALE, kind="store", reason="source_reused") == 1
    assert metric(JOBS, kind="store", outcome="ok") == 1
    assert metric(JOBS, kind="store", outcome="cancelled") == 1
    sizes = mgr.debug_sizes()
    assert sizes["jobs"] == 0 and sizes["row_stores"] == 0 and sizes["deliver"] == 0
    assert mgr.host_used_slots == 1 == mgr.host_blocks  # A's slot went back to the free list


def test_A_copy_landed_before_free_is_still_not_trusted(fake, kv, metric):
    """A's worker copied A's correct bytes before the free, but its report was not
    applied yet: the free cancels it anyway (conservative), B is unaffected."""
    mgr, mover = fake
    fill_row(kv, ROW, A)
    ja = mgr.store(A, ROW)
    mover.complete(ja)             # correct bytes, report queued
    assert mgr.free_block(ROW)
    fill_row(kv, ROW, B)
    jb = mgr.store(B, ROW)
    mover.complete(jb)
    seen = _completions_by_job(mgr.poll())
    assert not seen[ja.token].ok and seen[jb.token].ok
    assert mgr.lookup([A]) == 0 and mgr.lookup([B]) == 1
    assert host_matches(mgr, B, kv) is True
    assert metric(STALE, kind="store", reason="source_reused") == 1


def test_A_stored_again_after_aba_gets_its_own_bytes(fake, kv, metric):
    """After the ABA, the engine recomputes A into another row and stores it: A's
    late report from the first store must not clobber the new A."""
    mgr, mover = fake
    fill_row(kv, ROW, A)
    ja1 = mgr.store(A, ROW)
    assert mgr.free_block(ROW)
    fill_row(kv, ROW, B)
    jb = mgr.store(B, ROW)
    fill_row(kv, 12, A)
    ja2 = mgr.store(A, 12)
    assert ja2 is not None
    # answer in the worst order: the new A, then B, then A's stale copy of B's bytes
    mover.complete(ja2)
    mover.complete(jb)
    mover.complete(ja1)
    seen = _completions_by_job(mgr.poll())
    assert seen[ja2.token].ok and seen[jb.token].ok and not seen[ja1.token].ok
    assert host_matches(mgr, A, kv) is True
    assert host_matches(mgr, B, kv) is True
    for key, row in ((A, 70), (B, 71)):
        j = mgr.load(key, row)
        mover.complete(j)
        assert [c.ok for c in mgr.poll()] == [True]
        assert row_matches(kv, row, key)


@pytest.mark.parametrize("order", ["load-first", "store-first", "store-after-load-polled"])
def test_load_into_row_racing_a_store_from_that_row(fake, kv, metric, order):
    """A store of A reads row 137; the engine loads B into row 137.  The load
    gives the row up (A's store loses its source) and the copy of B may land
    before A's worker reads the row."""
    mgr, mover = fake
    fill_row(kv, 5, B)
    jb = mgr.store(B, 5)
    mover.complete(jb)
    assert [c.ok for c in mgr.poll()] == [True]

    fill_row(kv, ROW, A)
    ja = mgr.store(A, ROW)
    jl = mgr.load(B, ROW)
    assert jl is not None and jl.kind is JobKind.LOAD
    assert ja.state is JobState.CANCELLING and ja.cancel_reason.value == "source_reused"
    # the row is fenced while the load is in flight
    assert mgr.free_block(ROW) is False
    with pytest.raises(BlockBusyError, match=str(ROW)):
        mgr.store(X, ROW)
    assert jl.state is JobState.CANCELLING  # free_block cancelled the load as well...
    out = []
    if order == "load-first":
        mover.complete(jl)     # B's bytes land in row 137...
        mover.complete(ja)     # ...then A's worker copies them into A's slot
    elif order == "store-first":
        mover.complete(ja)
        mover.complete(jl)
    else:
        mover.complete(jl)
        out += mgr.poll()
        mover.complete(ja)
    out += mgr.poll()
    seen = _completions_by_job(out)
    assert set(seen) == {ja.token, jl.token}
    assert not seen[ja.token].ok and not seen[jl.token].ok  # ...so both are reported cancelled
    assert mgr.lookup([A]) == 0 and mgr.host_bytes(A) is None and mgr.load(A, 90) is None
    assert host_matches(mgr, B, kv) is True
    assert mgr.free_block(ROW) is True
    assert metric(STALE, kind="store", reason="source_reused") == 1
    assert metric(STALE, kind="load", reason="cancelled") == 1
    assert mgr.debug_sizes()["jobs"] == 0 and mgr.debug_sizes()["row_load"] == 0


@pytest.mark.parametrize("order", ["load-first", "store-first"])
def test_load_into_row_racing_store_without_free(fake, kv, metric, order):
    """Same race, but the engine does not free the row: the load completes ok
    and the row holds B; A's store (source overwritten) is discarded."""
    mgr, mover = fake
    fill_row(kv, 5, B)
    jb = mgr.store(B, 5)
    mover.complete(jb)
    mgr.poll()
    fill_row(kv, ROW, A)
    ja = mgr.store(A, ROW)
    jl = mgr.load(B, ROW)
    if order == "load-first":
        mover.complete(jl)
        mover.complete(ja)
    else:
        mover.complete(ja)
        mover.complete(jl)
    seen = _completions_by_job(mgr.poll())
    assert seen[jl.token].ok and not seen[ja.token].ok
    assert row_matches(kv, ROW, B)
    assert mgr.lookup([A]) == 0 and mgr.host_bytes(A) is None
    assert host_matches(mgr, B, kv) is True
    assert metric(STALE, kind="store", reason="source_reused") == 1
    # the row now holds B: storing it under B is a no-op, storing it again under A is not allowed to leak B as A
    assert mgr.store(B, ROW) is None
    assert mgr.free_block(ROW) is True


def test_stale_A_report_does_not_free_Bs_slot(fake, kv):
    """Slot bookkeeping after the ABA: the stale report frees only A's lease."""
    mgr, mover = fake
    fill_row(kv, ROW, A)
    ja = mgr.store(A, ROW)
    mgr.free_block(ROW)
    fill_row(kv, ROW, B)
    jb = mgr.store(B, ROW)
    mover.complete(jb)
    mgr.poll()
    assert mgr.host_used_slots == 2      # B's entry + A's still-leased slot
    mover.complete(ja)
    mgr.poll()
    assert mgr.host_used_slots == 1 and mgr.host_blocks == 1
    assert host_matches(mgr, B, kv) is True
    assert mover.transfer_of(jb).slots != mover.transfer_of(ja).slots
    assert torch_equal_u8(mgr.host_bytes(B), content_u8(B))


def torch_equal_u8(a, b) -> bool:
    import torch
    return a is not None and torch.equal(a.reshape(-1), b.reshape(-1))
