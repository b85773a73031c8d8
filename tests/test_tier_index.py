"""Unit tests of TierIndex (tiered_kv/core/index.py): slots, leases, LRU eviction."""

from __future__ import annotations

import uuid

import pytest

from tiered_kv.core.index import EntryState, TierIndex


def tok() -> uuid.UUID:
    return uuid.uuid4()


def ready_entry(ix: TierIndex, key: bytes):
    e = ix.reserve(key, tok())
    assert e is not None
    assert ix.publish(e) is True
    return e


def test_rejects_zero_slots():
    with pytest.raises(ValueError, match="0"):
        TierIndex(0)


def test_reserve_uses_distinct_free_slots_then_refuses_when_all_leased():
    ix = TierIndex(3)
    es = [ix.reserve(b"k%d" % i, tok()) for i in range(3)]
    assert all(e is not None and e.state is EntryState.WRITING for e in es)
    assert sorted(e.slot for e in es) == [0, 1, 2]
    assert ix.used_slots == 3 and len(ix) == 3
    # every slot is being written: nothing is evictable
    assert ix.reserve(b"k3", tok()) is None
    assert ix.used_slots == 3 and len(ix) == 3 and ix.evictions == 0
    assert b"k3" not in ix


def test_get_and_ready():
    ix = TierIndex(2)
    e = ix.reserve(b"a", tok())
    assert ix.get(b"a") is e and ix.ready(b"a") is None and b"a" in ix
    ix.publish(e)
    assert ix.ready(b"a") is e and [x for x in ix.entries() if x.state is EntryState.READY] == [e]
    assert ix.get(b"zz") is None and ix.ready(b"zz") is None


def test_reserve_of_present_key_is_an_internal_error():
    ix = TierIndex(2)
    ix.reserve(b"a", tok())
    with pytest.raises(AssertionError):
        ix.reserve(b"a", tok())


def test_lru_order_evicts_least_recently_published():
    evicted = []
    ix = TierIndex(3, on_evict=lambda e: evicted.append(e.key))
    for k in (b"a", b"b", b"c"):
        ready_entry(ix, k)
    d = ix.reserve(b"d", tok())
    assert d is not None
    assert evicted == [b"a"] and ix.evictions == 1
    assert b"a" not in ix and ix.used_slots == 3


def test_touch_moves_to_most_recently_used():
    evicted = []
    ix = TierIndex(3, on_evict=lambda e: evicted.append(e.key))
    a, b, c = (ready_entry(ix, k) for k in (b"a", b"b", b"c"))
    ix.touch(a)
    ix.touch(b)
    assert ix.reserve(b"d", tok()) is not None
    assert evicted == [b"c"]
    assert ix.reserve(b"e", tok()) is not None
    assert evicted == [b"c", b"a"]
    assert [e.key for e in ix.coldest(10)] == [b"b"]  # d and e are still WRITING


def test_touch_of_writing_or_removed_entry_is_harmless():
    ix = TierIndex(2)
    w = ix.reserve(b"w", tok())
    ix.touch(w)  # WRITING: not in the LRU, nothing happens
    r = ready_entry(ix, b"r")
    ix.remove(r)
    ix.touch(r)
    assert len(ix) == 1 and ix.used_slots == 1


def test_never_evicts_a_leased_slot():
    evicted = []
    ix = TierIndex(2, on_evict=lambda e: evicted.append(e.key))
    a = ready_entry(ix, b"a")
    b = ready_entry(ix, b"b")
    ix.acquire(a)  # a load reads a's slot
    assert ix.reserve(b"c", tok()) is not None
    assert evicted == [b"b"], "the oldest entry is leased to a reader: evict the next one"
    ix.acquire(ix.get(b"a"))
    # a has readers, c is WRITING: nothing is evictable
    assert ix.reserve(b"d", tok()) is None
    assert evicted == [b"b"]
    assert ix.get(b"a") is a and a.readers == 2


def test_never_evicts_a_protected_key_nor_the_key_being_reserved():
    evicted = []
    ix = TierIndex(2, on_evict=lambda e: evicted.append(e.key))
    ready_entry(ix, b"a")
    ready_entry(ix, b"b")
    assert ix.reserve(b"c", tok(), protect={b"a"}) is not None
    assert evicted == [b"b"]
    ix.publish(ix.get(b"c"))
    assert ix.reserve(b"d", tok(), protect=[b"a", b"c"]) is None
    assert evicted == [b"b"]


def test_release_makes_entry_evictable_again_as_mru():
    evicted = []
    ix = TierIndex(2, on_evict=lambda e: evicted.append(e.key))
    a = ready_entry(ix, b"a")
    ready_entry(ix, b"b")
    ix.acquire(a)
    ix.release(a)  # a becomes most recently used
    assert ix.reserve(b"c", tok()) is not None
    assert evicted == [b"b"]


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "arc", "prefix"])
def test_a_pin_is_no_use_and_never_evicted(policy):
    """A spill's or a put's read pins the entry where it is: evictions pass over it, and released it is
    the next victim again (before the fix it came back as the most recently used, so a write-back spill
    of the coldest blocks made them the hottest)."""
    from tiered_kv.core.policy import make_policy
    evicted = []
    ix = TierIndex(4, on_evict=lambda e: evicted.append(e.key), policy=make_policy(policy, 4))
    a, b, c = (ready_entry(ix, k) for k in (b"a", b"b", b"c"))
    ix.pin_all([a, b])
    assert ix.coldest(3) == [c]
    assert ix.evict_ahead(2) == 1 and evicted == [b"c"]
    assert ix.reserve(b"d", tok()) is not None and ix.reserve(b"e", tok()) is not None
    assert ix.reserve(b"f", tok()) is None   # d and e being written, a and b pinned
    ix.release_all([a, b])
    assert [e.key for e in ix.coldest(2)] == [b"a", b"b"]
    assert ix.evict_ahead(2) == 2 and evicted == [b"c", b"a", b"b"]


def test_a_load_of_a_pinned_entry_is_a_use():
    """A load that leases an entry while a spill has it pinned takes it out of the policy: released, it
    is the most recently used (the order a lease gives), whichever reader lets go last."""
    for spill_last in (True, False):
        evicted = []
        ix = TierIndex(3, on_evict=lambda e: evicted.append(e.key))
        a, b, c = (ready_entry(ix, k) for k in (b"a", b"b", b"c"))
        ix.pin_all([a])
        ix.acquire(a)   # a load
        assert ix.coldest(3) == [b, c]
        for _ in range(2):
            ix.release(a)
        assert ix.coldest(3) == [b, c, a], spill_last
        assert ix.evict_ahead(1) == 1 and evicted == [b"b"]


def test_a_pinned_entry_removed_frees_its_slot_on_release():
    ix = TierIndex(1)
    a = ready_entry(ix, b"a")
    ix.pin_all([a])
    ix.remove(a)
    assert ix.reserve(b"b", tok()) is None
    ix.release(a)
    assert ix.reserve(b"b", tok()) is not None and not ix._pinned


def test_release_without_acquire_is_an_internal_error():
    ix = TierIndex(1)
    a = ready_entry(ix, b"a")
    with pytest.raises(AssertionError):
        ix.release(a)


def test_acquire_of_writing_entry_is_an_internal_error():
    ix = TierIndex(1)
    w = ix.reserve(b"w", tok())
    with pytest.raises(AssertionError):
        ix.acquire(w)


def test_slot_of_aborted_writer_is_reused_only_after_writer_done():
    ix = TierIndex(1)
    a = ix.reserve(b"a", tok())
    slot = a.slot
    ix.abort(a)               # cancelled: gone from the index...
    assert b"a" not in ix and len(ix) == 0
    assert ix.used_slots == 1  # ...but its worker may still write the slot
    assert ix.reserve(b"b", tok()) is None
    ix.writer_done(a)         # the worker reported
    assert ix.used_slots == 0
    b = ix.reserve(b"b", tok())
    assert b is not None and b.slot == slot


def test_writer_done_then_abort_frees_the_slot_too():
    ix = TierIndex(1)
    a = ix.reserve(b"a", tok())
    ix.writer_done(a)   # failed copy: report first...
    assert ix.used_slots == 1
    ix.abort(a)         # ...then dropped
    assert ix.used_slots == 0 and ix.reserve(b"b", tok()) is not None


def test_slot_of_removed_entry_with_readers_is_reused_only_after_release():
    ix = TierIndex(1)
    a = ready_entry(ix, b"a")
    ix.acquire(a)
    ix.acquire(a)
    ix.remove(a)              # invalidated while two loads read it
    assert b"a" not in ix and ix.ready(b"a") is None
    assert ix.used_slots == 1 and ix.reserve(b"b", tok()) is None
    ix.release(a)
    assert ix.used_slots == 1 and ix.reserve(b"b", tok()) is None
    ix.release(a)
    assert ix.used_slots == 0
    assert ix.reserve(b"b", tok()) is not None


def test_publish_of_removed_entry_frees_slot_and_reports_false():
    ix = TierIndex(1)
    a = ix.reserve(b"a", tok())
    ix.remove(a)
    assert ix.used_slots == 1
    assert ix.publish(a) is False
    assert ix.used_slots == 0 and ix.ready(b"a") is None


def test_remove_is_idempotent_and_never_frees_twice():
    ix = TierIndex(2)
    a = ready_entry(ix, b"a")
    ix.remove(a)
    ix.remove(a)
    ix.writer_done(a)
    assert ix.used_slots == 0
    b = ix.reserve(b"b", tok())
    c = ix.reserve(b"c", tok())
    assert b is not None and c is not None and b.slot != c.slot
    assert ix.reserve(b"d", tok()) is None


def test_stale_entry_remove_does_not_touch_newer_entry_of_same_key():
    ix = TierIndex(3)
    old = ix.reserve(b"k", tok())
    ix.abort(old)                    # cancelled store, worker still running
    new = ix.reserve(b"k", tok())    # stored again
    ix.publish(new)
    ix.remove(old)                   # late cleanup of the old entry
    ix.writer_done(old)
    assert ix.get(b"k") is new and ix.ready(b"k") is new
    assert ix.used_slots == 1 and new.slot != old.slot


def test_eviction_counter_and_callback_count_only_evictions():
    seen = []
    ix = TierIndex(2, on_evict=lambda e: seen.append(e))
    for i in range(10):
        e = ix.reserve(b"k%d" % i, tok())
        assert e is not None
        ix.publish(e)
    assert ix.evictions == 8 and len(seen) == 8
    assert [e.key for e in seen] == [b"k%d" % i for i in range(8)]
    assert all(not e.live for e in seen)
    # removals and aborts are not evictions
    ix.remove(ix.get(b"k8"))
    x = ix.reserve(b"x", tok())
    ix.abort(x)
    ix.writer_done(x)
    assert ix.evictions == 8 and len(seen) == 8


@pytest.mark.parametrize("callback", [False, True])
def test_an_evicted_entry_leaves_the_index_as_remove_would_with_or_without_a_callback(callback):
    """Eviction removes the entry without remove() (a written-out path, with or without a callback);
    the callback sees the entry while it is still in the index."""
    seen: list = []
    ix = TierIndex(2, on_evict=(lambda e: seen.append((e, e.live, ix.get(e.key) is e))) if callback else None)
    a, b = ready_entry(ix, b"a"), ready_entry(ix, b"b")
    slot_a = a.slot
    c = ix.reserve(b"c", tok())
    assert c is not None and c.slot == slot_a
    assert not a.live and a.slot == -1 and b"a" not in ix and ix.get(b"a") is None
    assert ix.evictions == 1 and ix.used_slots == 2 and len(ix) == 2
    assert ix.coldest(5) == [b]                  # c is still writing: not evictable
    assert seen == ([(a, True, True)] if callback else [])
    ix.remove(a)                                 # a stale reference: harmless, nothing freed twice
    assert ix.used_slots == 2 and ix.reserve(b"d", tok()) is not None and ix.used_slots == 2
    assert b"b" not in ix and ix.reserve(b"e", tok()) is None   # c and d write: nothing to evict


def test_used_slots_never_exceed_capacity_under_churn():
    import random
    rng = random.Random(5)
    ix = TierIndex(4)
    live: dict[bytes, object] = {}
    for step in range(3000):
        k = b"k%d" % rng.randrange(12)
        op = rng.randrange(6)
        e = ix.get(k)
        if op == 0 and e is None:
            e = ix.reserve(k, tok())
        elif op == 1 and e is not None and e.state is EntryState.WRITING:
            ix.publish(e)
        elif op == 2 and e is not None and e.state is EntryState.READY:
            ix.acquire(e)
            live.setdefault(k, []).append(e)  # type: ignore[union-attr]
        elif op == 3 and live.get(k):
            ix.release(live[k].pop())  # type: ignore[union-attr]
        elif op == 4 and e is not None:
            if e.state is EntryState.WRITING:
                ix.abort(e)
                ix.writer_done(e)
            else:
                ix.remove(e)
        elif op == 5:
            ix.touch(e) if e is not None else None
        assert 0 <= ix.used_slots <= 4
        assert len(ix) <= ix.used_slots
        slots = [x.slot for x in ix.entries()]
        assert len(slots) == len(set(slots)) and all(0 <= s < 4 for s in slots)


def test_ready_run_touches_the_leading_ready_entries_and_returns_where_it_stopped():
    idx = TierIndex(8)
    es = {}
    for k in (b"a", b"b", b"c", b"d"):
        es[k] = idx.reserve(k, uuid.uuid4())
        idx.publish(es[k])
    idx.acquire(es[b"b"])                          # READY but leased: counted, not in the LRU
    w = idx.reserve(b"w", uuid.uuid4())           # WRITING: stops the run
    assert w is not None
    assert idx.ready_run([b"c", b"a", b"b", b"w", b"d"]) == 3
    assert list(idx.policy.od) == [b"d", b"c", b"a"]    # c then a moved to the MRU end, b still leased
    assert idx.ready_run([b"c", b"a", b"b", b"w", b"d"], 4) == 5
    assert list(idx.policy.od) == [b"c", b"a", b"d"]
    assert idx.ready_run([b"x", b"a"]) == 0 and idx.ready_run([]) == 0 and idx.ready_run([b"a"], 1) == 1
    assert list(idx.policy.od) == [b"c", b"a", b"d"]    # nothing touched past a miss


@pytest.mark.parametrize("keys", [[b"n1", b"n2", b"n1"], [b"n1", b"old"]], ids=["repeated", "present"])
def test_reserve_each_refuses_a_repeated_or_present_key_before_changing_anything(keys):
    """An internal caller's bug (a spill of a key twice, or of a key already in the tier) is an
    AssertionError before any slot is taken: two entries for one key would leak a slot."""
    ix = TierIndex(4)
    old = ix.reserve(b"old", uuid.uuid4())
    assert old is not None
    with pytest.raises(AssertionError, match="reserve_each of present or repeated keys"):
        ix.reserve_each(keys, [uuid.uuid4() for _ in keys])
    assert len(ix) == 1 and ix.used_slots == 1 and ix.get(b"n1") is None
