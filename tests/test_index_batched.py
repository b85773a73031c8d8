"""The tier index's batched paths (a step's new keys reserved together, the default policy's victims
evicted together (passing over pinned entries), a load's entries leased and released together, a lookup's run through the host
tier and the tier below it in one loop) against the same index taking every key one by one: after
every call both hold the same keys in the same states, the policy's order, the counts and the leases
agree, and slots stay unique (which free slot a key gets may differ)."""

from __future__ import annotations

import uuid
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fakes import sm_settings
from tiered_kv.core.index import Entry, EntryState, TierIndex
from tiered_kv.core.policy import make_policy

KEYS = [b"k%02d" % i for i in range(14)]
SLOTS = 6
BELOW_SLOTS = 9


class KeyByKey(TierIndex):
    """The reference: no batched path."""

    _batched = False

    def acquire_all(self, entries: Any) -> None:
        for e in entries:
            self.acquire(e)

    def release_all(self, entries: Any) -> None:
        for e in entries:
            if e is not None:
                self.release(e)


def _remove(pair: tuple[TierIndex, TierIndex], key: bytes) -> None:
    """``key`` out of both indexes of a pair (batched and key by key), where present."""
    for ix in pair:
        e = ix.get(key)
        if e is not None:
            ix.remove(e)


class BatchedIndexMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["lru", "lru", "s3fifo", "arc", "prefix"]),
                below_policy=st.sampled_from(["lru", "lru", "lru", "s3fifo", "arc"]))
    def setup(self, policy: str, below_policy: str) -> None:
        self.evicted: tuple[list[bytes], list[bytes]] = ([], [])
        self.ix = (TierIndex(SLOTS, on_evict=lambda e: self.evicted[0].append(e.key),
                             policy=make_policy(policy, SLOTS)),
                   KeyByKey(SLOTS, on_evict=lambda e: self.evicted[1].append(e.key), policy=make_policy(policy, SLOTS)))
        # the tier below (the disk tier), filled and leased through the plain per-key calls in both
        self.below = (TierIndex(BELOW_SLOTS, policy=make_policy(below_policy, BELOW_SLOTS)),
                      KeyByKey(BELOW_SLOTS, policy=make_policy(below_policy, BELOW_SLOTS)))
        self.below_leases: list[tuple[Entry, Entry]] = []
        self.writing: list[bytes] = []          # keys WRITING in both
        self.leases: list[tuple[list[Entry], list[Entry]]] = []   # entries leased together (a load), per index
        self.pins: list[tuple[list[Entry], list[Entry]]] = []     # entries pinned together (a spill), per index

    def _entry(self, i: int, key: bytes) -> Entry:
        e = self.ix[i].get(key)
        assert e is not None
        return e

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=7),
          protect=st.sampled_from(["none", "own", "other", "coldest"]),
          other=st.sets(st.sampled_from(KEYS), max_size=4),
          elsewhere=st.sets(st.sampled_from(KEYS), max_size=3))
    def reserve(self, keys: list[bytes], protect: str, other: set[bytes], elsewhere: set[bytes]) -> None:
        prot: Any = (() if protect == "none" else list(keys) if protect == "own" else frozenset(other)
                     if protect == "other" else frozenset(e.key for e in self.ix[0].coldest(2)))   # the next victims
        w = uuid.uuid4()
        a, b = (ix.reserve_absent(keys, w, prot, elsewhere or None) for ix in self.ix)
        assert a[0] == b[0] and [e.key for e in a[1]] == [e.key for e in b[1]] and a[2] == b[2], (a, b)
        assert self.evicted[0] == self.evicted[1]
        self.writing += a[0]

    @rule(n=st.integers(2, 4), cold=st.integers(1, 3))
    def reserve_new_protecting_the_next_victims(self, n: int, cold: int) -> None:
        """The engine's step on a full tier: new keys, while another call's keys are the coldest."""
        new = [k for k in KEYS if self.ix[0].get(k) is None][:n]
        if len(new) > 1:
            prot = frozenset(e.key for e in self.ix[0].coldest(cold))
            before = len(self.evicted[0])
            a, b = (ix.reserve_absent(new, uuid.uuid4(), prot, None) for ix in self.ix)
            assert a[0] == b[0] and a[2] == b[2] and self.evicted[0] == self.evicted[1]
            assert not prot & set(self.evicted[0][before:])
            self.writing += a[0]

    @rule(n=st.integers(1, 5), present=st.booleans())
    def reserve_each_under_its_own_writer(self, n: int, present: bool) -> None:
        """A spill's blocks: new keys, a writer each, reserved in order until one finds no slot (a key
        already here is refused as a bug, before anything changes)."""
        new = [k for k in KEYS if self.ix[0].get(k) is None][:n]
        if present and len(self.ix[0]):
            keys = new + [next(iter(self.ix[0]._entries))]
            before = [(len(ix), ix.used_slots) for ix in self.ix]
            for ix in self.ix:
                try:
                    ix.reserve_each(keys, [uuid.uuid4() for _ in keys])
                except AssertionError:
                    pass
                else:
                    raise AssertionError("reserve_each took a present key")
            assert [(len(ix), ix.used_slots) for ix in self.ix] == before
            return
        writers = [uuid.uuid4() for _ in new]
        a, b = (ix.reserve_each(new, writers) for ix in self.ix)
        assert [(e.key, e.writer) for e in a] == [(e.key, e.writer) for e in b] == list(zip(new, writers))[:len(a)]
        assert self.evicted[0] == self.evicted[1]
        self.writing += [e.key for e in a]

    @precondition(lambda self: self.writing)
    @rule()
    def publish_every_write(self) -> None:
        out = [ix.publish_all([self._entry(i, k) for k in self.writing]) for i, ix in enumerate(self.ix)]
        assert [e.key for e in out[0]] == [e.key for e in out[1]]
        self.writing = []

    @precondition(lambda self: self.writing)
    @rule(data=st.data())
    def publish(self, data: Any) -> None:
        ks = data.draw(st.lists(st.sampled_from(self.writing), min_size=1, unique=True))
        out = [ix.publish_all([self._entry(i, k) for k in ks if ix.get(k) is not None])
               for i, ix in enumerate(self.ix)]
        assert [e.key for e in out[0]] == [e.key for e in out[1]]
        self.writing = [k for k in self.writing if k not in ks]

    @precondition(lambda self: self.writing)
    @rule(data=st.data())
    def abort(self, data: Any) -> None:
        k = data.draw(st.sampled_from(self.writing))
        for i, ix in enumerate(self.ix):
            e = self._entry(i, k)
            ix.writer_done(e)
            ix.abort(e)
        self.writing.remove(k)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5))
    def lease(self, keys: list[bytes]) -> None:
        """A load of the keys READY in both (a key named twice takes two leases)."""
        ready = [k for k in keys if self.ix[0].ready(k) is not None]
        assert ready == [k for k in keys if self.ix[1].ready(k) is not None]
        if ready:
            held = tuple([self._entry(i, k) for k in ready] for i in (0, 1))
            for ix, es in zip(self.ix, held):
                ix.acquire_all(es)
            self.leases.append(held)   # the entries themselves: a leased key may leave the index meanwhile

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data: Any) -> None:
        held = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        for ix, es in zip(self.ix, held):
            ix.release_all(es + [None])   # a load's entries: None where it waited for a read

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5, unique=True))
    def pin(self, keys: list[bytes]) -> None:
        """A spill (or put) of the keys READY in both: pinned in place, passed over by evictions."""
        ready = [k for k in keys if self.ix[0].ready(k) is not None]
        assert ready == [k for k in keys if self.ix[1].ready(k) is not None]
        if ready:
            held = tuple([self._entry(i, k) for k in ready] for i in (0, 1))
            for ix, es in zip(self.ix, held):
                ix.pin_all(es)
            self.pins.append(held)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: Any) -> None:
        held = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        for ix, es in zip(self.ix, held):
            ix.release_all(es)   # the spill's report: batched, and key by key in the reference

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=5))
    def hits(self, keys: list[bytes]) -> None:
        assert self.ix[0].ready_run(keys) == self.ix[1].ready_run(keys)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4), publish=st.booleans())
    def below_store(self, keys: list[bytes], publish: bool) -> None:
        """Keys new below are written there (published, or left WRITING: not a hit)."""
        for ix in self.below:
            for k in keys:
                if ix.get(k) is None:
                    e = ix.reserve(k, uuid.uuid4())
                    if e is not None and publish:
                        ix.publish(e)

    @rule(key=st.sampled_from(KEYS))
    def below_remove(self, key: bytes) -> None:
        _remove(self.below, key)

    @rule(key=st.sampled_from(KEYS))
    def below_lease(self, key: bytes) -> None:
        """A spill or promote reading a block below: out of its policy until released."""
        es = [ix.ready(key) for ix in self.below]
        assert (es[0] is None) == (es[1] is None)
        if es[0] is not None and es[1] is not None:
            for ix, e in zip(self.below, es):
                ix.acquire(e)
            self.below_leases.append((es[0], es[1]))

    @precondition(lambda self: self.below_leases)
    @rule(data=st.data())
    def below_release(self, data: Any) -> None:
        held = self.below_leases.pop(data.draw(st.integers(0, len(self.below_leases) - 1)))
        for ix, e in zip(self.below, held):
            ix.release(e)

    @rule(data=st.data())
    def hits_through_both_tiers(self, data: Any) -> None:
        """A lookup of the keys READY in either tier (in any order: the run reaches them all, leased ones
        too), then maybe any keys: hits on both sides of the run, and a stop."""
        present = [k for k in KEYS if self.ix[0].ready(k) is not None or self.below[0].ready(k) is not None]
        keys = data.draw(st.permutations(present)) + data.draw(st.lists(st.sampled_from(KEYS), max_size=3))
        assert self.ix[0].ready_run_below(keys, self.below[0]) == self.ix[1].ready_run_below(keys, self.below[1])

    @rule(free=st.integers(0, SLOTS))
    def evict_ahead(self, free: int) -> None:
        assert self.ix[0].evict_ahead(free) == self.ix[1].evict_ahead(free)
        assert self.evicted[0] == self.evicted[1]

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key: bytes) -> None:
        _remove(self.ix, key)
        if key in self.writing:
            self.writing.remove(key)

    @invariant()
    def the_same_index(self) -> None:
        if not hasattr(self, "ix"):
            return
        a, b = self.ix
        sa = {k: (e.state, e.readers, e.writing) for k in KEYS if (e := a.get(k)) is not None}
        sb = {k: (e.state, e.readers, e.writing) for k in KEYS if (e := b.get(k)) is not None}
        assert sa == sb
        assert [e.key for e in a.coldest(SLOTS)] == [e.key for e in b.coldest(SLOTS)]
        assert (a.used_slots, a.evictions, len(a)) == (b.used_slots, b.evictions, len(b))
        c, d = self.below
        assert ({k: (e.state, e.readers) for k in KEYS if (e := c.get(k)) is not None}
                == {k: (e.state, e.readers) for k in KEYS if (e := d.get(k)) is not None})
        assert [e.key for e in c.coldest(BELOW_SLOTS)] == [e.key for e in d.coldest(BELOW_SLOTS)]
        for ix in self.ix:
            live = [e.slot for k in KEYS if (e := ix.get(k)) is not None]
            assert len(set(live)) == len(live) and not set(live) & set(ix._free)
            assert len(set(ix._free)) == len(ix._free) and all(0 <= s < SLOTS for s in ix._free)
            assert all(e.state is EntryState.READY and not e.readers for e in ix.coldest(SLOTS))
            assert all(e.readers for e in ix._pinned)   # (a pinned entry removed meanwhile stays until released)


BatchedIndexMachine.TestCase.settings = sm_settings(300, 60)
test_batched_index_machine = BatchedIndexMachine.TestCase
