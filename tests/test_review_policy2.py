"""Second adversarial review of tiered_kv.core.policy and tiered_kv.core.index as the core and its front ends
use them.  Not repeated here: what tests/test_review_policy.py, tests/test_review_index.py,
tests/test_review_pins.py, tests/test_policies.py, tests/test_policy_core.py and tests/test_index_batched.py
already cover.

What it proved wrong, each pinned by a test that failed before its fix:

* under the vLLM front end (``SlabScheduler``) the admission filters never saw a reference: its ``lookup``
  never recorded one, so ``host_admission="second_hit"`` refused every store (and ``tinylfu`` every store
  into a full tier; ``disk_admission`` likewise every spill) however often a key was asked for
  (``test_vllm_front_end_second_hit_admits_a_key_the_scheduler_asked_for_twice``);
* under the vLLM front end the prefix policy never learnt a chain across calls: vLLM asks a key at a time
  and stores one boundary's keys (one per KV group) per call, so a block stored a step after its parent
  (every decode block) was a parentless leaf and its parent was evicted first, the chain broken.  The fix
  lives in the adapter, which knows the request and each key's KV group and end token, and is pinned
  there (``tests/vllm_adapter/test_adapter_regressions.py``:
  ``test_the_prefix_policy_learns_a_requests_chain_across_vllms_calls``, and
  ``test_one_boundarys_keys_of_two_kv_groups_are_two_chains_not_one``).

Guarantees checked and found to hold (plain tests):

* a state machine over one ``TierIndex`` per policy and filter (reservations of chains and of random keys
  with protected sets, single reservations asked through the filter, ``reserve_each``, publish/abort in
  either order, leases and pins of several entries released together or one by one, removals of WRITING,
  READY, leased and pinned entries, evict-ahead, hits, ``coldest``): slots form a partition, the policy holds
  exactly the READY entries that are not leased, an evicted entry was READY, unread and unprotected, and each
  policy's own bookkeeping stays consistent: ARC's ghost lists disjoint from each other and from the keys
  held, ``p`` within ``[0, c]``, its ghost-hit marks only on keys being written; S3-FIFO's frequencies exactly
  on the keys held and its ghost disjoint from them; the prefix policy's nodes, queues, parent/child links
  and orphan marks in agreement;
* the same filter under ``TierManager`` (whose ``lookup`` records references) admits a key asked for twice,
  and the prefix policy under ``TierManager`` (whose ``lookup`` links the chain) evicts the chain's tail.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Optional

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from prometheus_client import CollectorRegistry

from fakes import ROW_BYTES, fill_row, make_kv
from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.core.index import Entry, EntryState, TierIndex
from tiered_kv.core.policy import ARC, LRU, S3FIFO, PrefixLRU, make_admission, make_policy
from tiered_kv.integrations.scheduler import Lookup, SlabScheduler
from tiered_kv.integrations.slab import SharedSlab
from tiered_kv.metrics import Metrics

pytestmark = pytest.mark.timeout(120)

_READY = EntryState.READY


# --------------------------------------------------------------------------- helpers: the vLLM front end

class _Sched:
    """A SlabScheduler over a 4-slot slab (one rank) whose stores the test completes at once."""

    def __init__(self, tmp_path: Path, slots: int = 4, **kw: Any) -> None:
        self.slab = SharedSlab.open(tmp_path / "x.slab", slots, 64, 1)
        cfg = TieredKVConfig(namespace="t", host_capacity_bytes=slots * 64, host_evict_ahead_blocks=0, **kw)
        self.s = SlabScheduler(cfg, self.slab, metrics=Metrics(registry=CollectorRegistry(), namespace="t"))

    def store(self, keys: list[bytes]) -> Any:
        p = self.s.prepare_store(keys)
        if p.keys:
            self.slab.mark_done(0, p.seq)     # the worker copied them
            self.s.complete_store(p.keys)
        self.s.tick()
        return p

    def close(self) -> None:
        self.s.close()
        self.slab.close()


def _manager(**kw: Any) -> TierManager:
    kv = make_kv(16)
    cfg = TieredKVConfig(namespace="review-policy2", host_capacity_bytes=4 * ROW_BYTES, host_evict_ahead_blocks=0,
                         **kw)
    mgr = TierManager(cfg, kv, registry=CollectorRegistry())
    mgr._test_kv = kv   # type: ignore[attr-defined]
    return mgr


def _mgr_store(mgr: TierManager, keys: list[bytes], first_row: int) -> list[bytes]:
    """store_many of ``keys`` from consecutive rows, waited for; the keys it stored."""
    kv = mgr._test_kv   # type: ignore[attr-defined]
    rows = list(range(first_row, first_row + len(keys)))
    for k, r in zip(keys, rows):
        fill_row(kv, r, k)
    job = mgr.store_many(keys, rows)
    if job is None:
        return []
    mgr.wait([job], timeout=30)
    return list(job.keys)


# --------------------------------------------------------------------------- finding 1: admission under vLLM

def test_vllm_front_end_second_hit_admits_a_key_the_scheduler_asked_for_twice(tmp_path: Path) -> None:
    t = _Sched(tmp_path, host_admission="second_hit")
    try:
        for _ in range(3):
            assert t.s.lookup(b"hot", protect=set()) is Lookup.MISS   # asked for three times
        p = t.store([b"hot"])
        assert p.keys == [b"hot"], f"refused a key asked for three times (refused={t.s.core.index.refused})"
        assert t.s.lookup(b"hot", protect=set()) is Lookup.HIT
    finally:
        t.close()


def test_tier_manager_second_hit_admits_a_key_looked_up_twice() -> None:
    """The same filter under TierManager, whose lookup records the references: the contrast for the finding."""
    mgr = _manager(host_admission="second_hit")
    with mgr:
        assert mgr.lookup([b"once"]) == 0
        assert _mgr_store(mgr, [b"once"], 0) == []           # one reference: refused
        assert mgr.lookup([b"hot"]) == 0 and mgr.lookup([b"hot"]) == 0
        assert _mgr_store(mgr, [b"hot"], 1) == [b"hot"]      # two: admitted
        assert mgr.lookup([b"hot"]) == 1


# --------------------------------------------------------------------------- prefix chains (the vLLM finding: tests/vllm_adapter)

def test_tier_manager_prefix_policy_evicts_a_chain_from_its_tail() -> None:
    """The same steps under TierManager, whose lookup links the chain: its tail c goes, not b."""
    mgr = _manager(host_policy="prefix")
    with mgr:
        assert _mgr_store(mgr, [b"a", b"b"], 0) == [b"a", b"b"]
        assert _mgr_store(mgr, [b"c"], 2) == [b"c"]
        assert _mgr_store(mgr, [b"z"], 3) == [b"z"]
        assert mgr.lookup([b"a", b"b", b"c"]) == 3
        assert _mgr_store(mgr, [b"n1", b"n2"], 4) == [b"n1", b"n2"]
        assert mgr.lookup([b"a", b"b"]) == 2 and mgr.lookup([b"z"]) == 0 and mgr.lookup([b"c"]) == 0


# --------------------------------------------------------------------------- the index and its policy's bookkeeping

def check_index(ix: TierIndex) -> None:
    """Slots, the policy's content and each policy's own bookkeeping, all consistent with the index."""
    pol = ix.policy
    live = list(ix._entries.values())
    held_slots = [e.slot for e in live]
    assert all(s >= 0 for s in held_slots) and len(set(held_slots)) == len(held_slots)
    free = ix._free
    assert len(set(free)) == len(free) and not set(free) & set(held_slots)
    assert len(free) + len(held_slots) <= ix.num_slots
    for e in live:
        assert e.live and ix._entries[e.key] is e
    for e in ix._pinned:
        assert e.readers > 0
    inpol = {e.key for e in live if e.state is _READY and (e.readers == 0 or e in ix._pinned)}
    leased = {e.key for e in live if e.state is _READY and e.readers and e not in ix._pinned}
    writing = {e.key for e in live if e.state is not _READY}
    assert len(pol) == len(inpol | leased if pol.leases_in_place else inpol)
    if isinstance(pol, LRU):
        assert set(pol.od) == inpol
    elif isinstance(pol, ARC):
        assert set(pol.t1) | set(pol.t2) == inpol and not set(pol.t1) & set(pol.t2)
        assert set(pol.leased) == leased
        assert pol.n_leased[1:] == [sum(1 for v in pol.leased.values() if v == q) for q in (1, 2)]
        assert not set(pol.b1) & set(pol.b2)
        assert not (set(pol.b1) | set(pol.b2)) & (inpol | leased), "a ghost of a key held"
        assert 0.0 <= pol.p <= pol.c and len(pol.b1) + len(pol.b2) <= 2 * pol.c
        assert set(pol.adapted) <= writing, "a ghost-hit mark outlived its reservation"
    elif isinstance(pol, S3FIFO):
        assert set(pol.small) | set(pol.main) == inpol | leased and not set(pol.small) & set(pol.main)
        assert set(pol.freq) == inpol | leased   # (a leased entry stays in its FIFO)
        assert all(0 <= f <= 3 for f in pol.freq.values())
        assert len(pol.ghost) <= pol.ghost_max and not set(pol.ghost) & (inpol | leased)
    elif isinstance(pol, PrefixLRU):
        nodes = pol.nodes
        assert set(nodes) == inpol | leased
        for k, n in nodes.items():
            assert n.entry is ix._entries[k]
            if k in leased:
                assert n.q == 0
            else:
                assert pol._queue(n.q).get(k) is n
                assert n.q == (1 if n.orphan else 3 if pol.children.get(k) else 2)
            if n.orphan:
                assert n.parent is not None and n.parent not in nodes
            if n.parent is not None:
                assert k in pol.children.get(n.parent, ())
        for parent, kids in pol.children.items():
            assert kids and all(c in nodes and nodes[c].parent == parent for c in kids)
        assert len(pol.links) <= pol.links_max and len(pol.ghosts) <= pol.links_max


SLOTS = 4
UNIVERSE = [b"k%02d" % i for i in range(14)]


class IndexBookkeepingMachine(RuleBasedStateMachine):
    policy_name = "lru"
    admission_name: Optional[str] = None

    @initialize(slots=st.sampled_from([1, 2, SLOTS]))
    def setup(self, slots: int) -> None:
        self.evicted: list[Entry] = []
        adm = None if self.admission_name is None else make_admission(self.admission_name, slots)
        self.ix = TierIndex(slots, on_evict=self.evicted.append, policy=make_policy(self.policy_name, slots),
                            admission=adm)
        self.writing: list[Entry] = []
        self.reads: list[tuple[str, list[Entry]]] = []

    def _evictions_ok(self, before: int, protect: Any) -> None:
        for e in self.evicted[before:]:
            assert e.state is _READY and e.readers == 0 and not e.writing and e.key not in protect
            assert e.key not in self.ix

    @rule(start=st.integers(0, len(UNIVERSE) - 1), n=st.integers(1, 5), chain=st.booleans(),
          picks=st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=5),
          protect=st.sampled_from(["own", "none", "coldest"]))
    def lookup_then_store(self, start: int, n: int, chain: bool, picks: list[bytes], protect: str) -> None:
        ix = self.ix
        keys = UNIVERSE[start:start + n] if chain else picks
        ix.seen(keys)
        hit = ix.ready_run(keys)
        prot: Any = (keys if protect == "own" else () if protect == "none"
                     else frozenset(e.key for e in ix.coldest(2)))
        before = len(self.evicted)
        got, new, full = ix.reserve_absent(keys[hit:], uuid.uuid4(), prot, None)
        self._evictions_ok(before, prot)
        assert len(self.evicted) - before <= len(new)
        self.writing += new

    @rule(k=st.sampled_from(UNIVERSE), protect=st.sets(st.sampled_from(UNIVERSE), max_size=3))
    def store_one(self, k: bytes, protect: set[bytes]) -> None:
        ix = self.ix
        if ix.get(k) is not None:
            return
        before = len(self.evicted)
        if ix.admits(k, protect):
            e = ix.reserve(k, uuid.uuid4(), protect)
            if e is not None:
                self.writing.append(e)
        else:
            assert len(self.evicted) == before
        self._evictions_ok(before, protect)

    @rule(ks=st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=4, unique=True))
    def spill_each(self, ks: list[bytes]) -> None:
        ks = [k for k in ks if self.ix.get(k) is None]
        if ks:
            before = len(self.evicted)
            self.writing += self.ix.reserve_each(ks, [uuid.uuid4() for _ in ks])
            self._evictions_ok(before, ())

    @precondition(lambda self: self.writing)
    @rule(i=st.integers(0, 99), how=st.sampled_from(["publish", "publish_all", "abort", "abort_late"]))
    def finish_write(self, i: int, how: str) -> None:
        e = self.writing.pop(i % len(self.writing))
        ix = self.ix
        if how == "publish":
            ix.publish(e)
        elif how == "publish_all":
            ix.publish_all([e])
        elif how == "abort":
            ix.writer_done(e)
            ix.abort(e)
        else:
            ix.abort(e)
            ix.writer_done(e)

    @rule(ks=st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=3), pin=st.booleans())
    def read(self, ks: list[bytes], pin: bool) -> None:
        es = [e for e in map(self.ix.ready, ks) if e is not None]
        if not es:
            return
        if pin:
            es = list({id(e): e for e in es}.values())   # a spill or put reads each block once
            self.ix.pin_all(es)
        else:
            self.ix.acquire_all(es)
        self.reads.append(("pin" if pin else "lease", es))

    @precondition(lambda self: self.reads)
    @rule(i=st.integers(0, 99), together=st.booleans())
    def release(self, i: int, together: bool) -> None:
        _, es = self.reads.pop(i % len(self.reads))
        if together:
            self.ix.release_all(es)
        else:
            for e in es:
                self.ix.release(e)

    @rule(k=st.sampled_from(UNIVERSE))
    def invalidate(self, k: bytes) -> None:
        e = self.ix.get(k)
        if e is not None:
            self.ix.remove(e)

    @rule(n=st.integers(1, SLOTS))
    def evict_ahead(self, n: int) -> None:
        before = len(self.evicted)
        self.ix.evict_ahead(n)
        self._evictions_ok(before, ())

    @rule(k=st.sampled_from(UNIVERSE))
    def touch(self, k: bytes) -> None:
        e = self.ix.get(k)
        if e is not None:
            self.ix.touch(e)

    @rule(n=st.integers(0, SLOTS + 1))
    def coldest(self, n: int) -> None:
        cold = self.ix.coldest(n)
        assert len({id(e) for e in cold}) == len(cold)
        for e in cold:
            assert e.live and e.state is _READY and e.readers == 0 and self.ix.get(e.key) is e

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "ix"):
            check_index(self.ix)


_SETTINGS = settings(max_examples=30, stateful_step_count=40, derandomize=True, deadline=None, database=None,
                     suppress_health_check=list(HealthCheck))
for _pol in ("lru", "s3fifo", "arc", "prefix"):
    for _adm in (None, "second_hit", "tinylfu"):
        _name = f"IndexBookkeeping_{_pol}_{_adm or 'all'}"
        _machine = type(_name, (IndexBookkeepingMachine,), {"policy_name": _pol, "admission_name": _adm})
        _case = _machine.TestCase
        _case.settings = _SETTINGS
        globals()[f"Test{_name}"] = _case
del _pol, _adm, _name, _machine, _case
