"""Work done between engine steps: host slots evicted ahead and tokens made ahead.

``poll()`` and the end of ``wait()``/``flush()`` evict least recently used host
blocks until ``host_evict_ahead_blocks`` slots are free, and refill a pool of
tokens, so that the next step's ``store()``/``load()`` calls take a free slot
and a ready token instead of evicting and building a UUID in the engine's call
(the first call of a step is the slow one on a shared VM, so work taken out of
it counts more than its own cost).

The state machines (tests/test_state_machine.py, tests/test_cuda_mover_state_machine.py)
draw ``host_evict_ahead_blocks`` and model it exactly; these tests pin the edges.
"""

from __future__ import annotations

import uuid

import pytest
import torch
from prometheus_client import CollectorRegistry

from fakes import fill_row, instrument_get, make_config, make_fake_manager, make_kv, mgr_metric
from tiered_kv import TierManager
from tiered_kv.errors import ConfigError
from tiered_kv.core.index import TierIndex
from tiered_kv.jobs import uuid_from_int

TOK = uuid.UUID(int=1)


def ready_index(n: int, slots: int, **kw) -> tuple[TierIndex, list]:
    idx = TierIndex(slots, **kw)
    entries = []
    for i in range(n):
        e = idx.reserve(b"k%d" % i, TOK)
        assert e is not None
        idx.publish(e)
        entries.append(e)
    return idx, entries


# ---------------------------------------------------------------------------- TierIndex.evict_ahead
def test_evict_ahead_takes_the_least_recently_used_and_skips_leased_and_writing_entries():
    idx, es = ready_index(6, 8)          # k0 (oldest) .. k5; 2 slots free
    idx.acquire(es[0])                   # leased to a reader: not evictable
    idx.touch(es[1])                     # now the most recent
    w = idx.reserve(b"writing", TOK)     # WRITING: not evictable; 1 slot free
    assert w is not None
    assert idx.evict_ahead(4) == 3       # needs 3 more free: k2, k3, k4 (k0 leased, k1 touched)
    assert [k for k in (b"k%d" % i for i in range(6)) if k in idx] == [b"k0", b"k1", b"k5"]
    assert idx.evictions == 3 and idx.used_slots == idx.num_slots - 4
    assert [e.slot for e in es[2:5]] == [-1, -1, -1] and not any(e.live for e in es[2:5])
    assert idx.evict_ahead(4) == 0       # already free enough: nothing more goes
    assert idx.evictions == 3


def test_evict_ahead_stops_when_nothing_more_is_evictable():
    idx, es = ready_index(4, 4)
    idx.acquire(es[1])
    idx.acquire(es[3])
    assert idx.evict_ahead(4) == 2       # only k0 and k2 may go
    assert b"k1" in idx and b"k3" in idx and len(idx._free) == 2
    assert idx.evict_ahead(0) == 0 and idx.evict_ahead(-3) == 0


def test_evict_ahead_calls_on_evict_in_lru_order():
    seen: list[bytes] = []
    idx, _ = ready_index(5, 5, on_evict=lambda e: seen.append(e.key))
    assert idx.evict_ahead(3) == 3
    assert seen == [b"k0", b"k1", b"k2"] and idx.evictions == 3
    # the freed slots are reserved again, without an eviction
    for i in range(3):
        assert idx.reserve(b"new%d" % i, TOK) is not None
    assert idx.evictions == 3 and seen == [b"k0", b"k1", b"k2"]


# ---------------------------------------------------------------------------- the manager
def full_manager(slots: int, rows: int = 16, **kw):
    kv = make_kv(rows)
    mgr, mover = make_fake_manager(make_config(host_slots=slots, **kw), kv, CollectorRegistry())
    n = 0
    while mgr.host_blocks < slots:    # fill the tier with READY blocks
        fill_row(kv, n % rows, b"fill%d" % n)
        assert mgr.store(b"fill%d" % n, n % rows) is not None
        mover.complete_all()
        mgr.poll()                    # evicts ahead as soon as the tier is nearly full
        n += 1
        if n > 4 * slots:
            break
    return mgr, mover, kv


@pytest.mark.parametrize("slots,auto", [(31, 0), (64, 2), (320, 10), (4096, 64), (65536, 64)])
def test_the_default_keeps_a_thirty_second_of_the_slots_free_at_most_64(slots, auto):
    kv = make_kv(4)
    with TierManager(make_config(host_slots=slots), kv, registry=CollectorRegistry()) as mgr:
        assert mgr._core.evict_ahead == auto


def test_poll_leaves_slots_free_and_the_next_steps_stores_do_not_evict():
    mgr, mover, kv = full_manager(64, host_evict_ahead_blocks=5)
    assert mgr.host_used_slots == 59 and mgr.host_blocks == 59
    evicted = mgr._index.evictions
    assert mgr_metric(mgr, "tiered_kv_evictions_total", tier="host") == evicted

    def no_inline_eviction(*a):
        raise AssertionError("store() evicted in the engine's call")

    mgr._index._evict_one = no_inline_eviction           # type: ignore[method-assign]
    jobs = []
    for i in range(5):                                     # the step's five stores take the free slots
        fill_row(kv, i, b"step%d" % i)
        jobs.append(mgr.store(b"step%d" % i, i))
    assert all(j is not None for j in jobs) and mgr._index.evictions == evicted
    del mgr._index._evict_one                              # a sixth store in the same step evicts inline
    fill_row(kv, 5, b"step5")
    assert mgr.store(b"step5", 5) is not None and mgr._index.evictions == evicted + 1
    mover.complete_all()
    mgr.poll()
    assert mgr.host_used_slots == 59
    assert mgr_metric(mgr, "tiered_kv_evictions_total", tier="host") == evicted + 6
    mgr.close()


def test_zero_evicts_only_when_a_slot_is_needed():
    mgr, mover, kv = full_manager(64, host_evict_ahead_blocks=0)
    assert mgr.host_used_slots == 64 and mgr._index.evictions == 0
    mgr.wait()
    assert mgr.host_used_slots == 64
    mgr.close()


def test_wait_evicts_ahead_when_it_returns():
    mgr, mover, kv = full_manager(64, host_evict_ahead_blocks=3)
    for i in range(3):
        fill_row(kv, i, b"w%d" % i)
        assert mgr.store(b"w%d" % i, i) is not None
    mover.complete_all()
    assert mgr.host_used_slots == 64
    mgr.wait()
    assert mgr.host_used_slots == 61
    mgr.close()


def test_wait_evicts_for_the_state_it_leaves_not_for_one_it_passed_through():
    """A slot freed by a report that arrives while wait() blocks counts: wait() evicts only at its end."""
    mgr, mover, kv = full_manager(64, host_evict_ahead_blocks=2)
    fill_row(kv, 0, b"s1")
    s1 = mgr.store(b"s1", 0)
    mgr.cancel(s1)                        # its slot stays leased until its worker reports
    fill_row(kv, 1, b"s2")
    s2 = mgr.store(b"s2", 1)
    assert s1 is not None and s2 is not None and mgr.host_used_slots == 64
    evicted = mgr._index.evictions
    answered = []

    def workers_answer_while_the_owner_blocks(timeout):
        if not answered:
            answered.append(mover.complete_all())

    instrument_get(mgr._completions, workers_answer_while_the_owner_blocks)
    mgr.wait([s2])
    assert answered and s2.done
    # s1's report freed one slot: one eviction makes two free (evicting before it arrived would take two)
    assert mgr._index.evictions == evicted + 1 and mgr.host_used_slots == 62
    mgr.close()


def test_an_evict_ahead_of_the_whole_tier_is_a_config_error():
    kv = make_kv(4)
    with pytest.raises(ConfigError, match=r"host_evict_ahead_blocks=8 .* 8 slots"):
        TierManager(make_config(host_slots=8, host_evict_ahead_blocks=8), kv, registry=CollectorRegistry())
    TierManager(make_config(host_slots=8, host_evict_ahead_blocks=7), kv, registry=CollectorRegistry()).close()


# ---------------------------------------------------------------------------- tokens made ahead
def test_tokens_come_from_the_pool_in_the_order_they_were_made_and_are_unique():
    kv = make_kv(8)
    mgr, mover = make_fake_manager(make_config(host_slots=4096), kv, CollectorRegistry())
    tokens = []
    for i in range(300):                  # stores of 1..7 per step: the pool is refilled many times
        for j in range(1 + i % 7):
            job = mgr.store(b"t%d-%d" % (i, j), j)
            assert job is not None
            tokens.append(job.token)
        if i % 3 == 0 and i >= 3:
            assert mgr.load(b"t%d-0" % (i - 3), 7) is not None
        mover.complete_all()
        mgr.poll()
    assert len(set(tokens)) == len(tokens)
    prefix = tokens[0].int >> 48
    assert all(t.int >> 48 == prefix for t in tokens)      # one factory
    counters = [t.int & ((1 << 48) - 1) for t in tokens]
    assert counters == sorted(counters)                    # issued in the order they were made
    assert all(t.version == 4 for t in tokens)
    assert uuid_from_int(tokens[5].int) == tokens[5]
    mgr.close()


def test_evicting_ahead_while_a_worker_copies_out_of_a_slot_keeps_that_slot():
    """poll() starts the step's copies and then evicts ahead: a load's copy, stopped by a gate inside
    the copy worker halfway through reading its host slot, keeps that slot leased, so the eviction
    takes the other block, a store of the same moment gets another slot, and the row gets its bytes."""
    import threading

    from tiered_kv.movers import ThreadMover

    gate_on, copying, go = threading.Event(), threading.Event(), threading.Event()

    def gated_copy(dst, src):
        if gate_on.is_set() and dst.data_ptr() == kv[5].data_ptr():   # only the load into row 5 is stopped
            copying.set()
            assert go.wait(30)
        dst.copy_(src)

    kv = make_kv(8)
    mgr = TierManager(make_config(host_slots=8, host_evict_ahead_blocks=0), kv, registry=CollectorRegistry(),
                      mover_factory=lambda d, h, q: ThreadMover([(d, h)], q, num_workers=1, copy_fn=gated_copy,
                                                                 batch_max=64))
    try:
        for row, key in ((0, b"A"), (1, b"B")):
            fill_row(kv, row, key)
            assert mgr.store(key, row) is not None
        assert len(mgr.wait(timeout=30)) == 2 and mgr.host_blocks == 2
        a_slot = mgr._index.get(b"A").slot
        mgr._core.evict_ahead = 7          # from now on each poll wants 7 of the 8 slots free
        gate_on.set()
        load = mgr.load(b"A", 5)      # leases A's slot; its copy waits in the mover's queue
        assert load is not None and not copying.is_set()
        mgr.poll()                    # hands the copy to the worker, then evicts ahead
        assert copying.wait(30)       # the worker is inside the copy out of A's slot
        assert mgr.host_bytes(b"B") is None and mgr._index.get(b"A").slot == a_slot
        assert mgr.host_used_slots == 1
        fill_row(kv, 2, b"C")
        c_job = mgr.store(b"C", 2)
        assert c_job is not None and mgr._index.get(b"C").slot != a_slot
        # C's copy is run by this thread while the worker is still inside A's: C is reported first, so
        # the load of A, reported after it, is what was used last (a fixed order, not a race)
        assert [c.ok for c in mgr.wait([c_job], timeout=30) if c.job is c_job] == [True]
        assert not load.done
        go.set()
        done = {c.job.token: c for c in mgr.wait(timeout=30)}
        assert done[load.token].ok and torch.equal(kv[5], kv[0])
        # A, used last, stays; the end of wait() evicted ahead again down to one block
        assert torch.equal(mgr.host_bytes(b"A"), kv[0].reshape(-1).view(torch.uint8)) and mgr.host_blocks == 1
    finally:
        go.set()
        mgr.close()
