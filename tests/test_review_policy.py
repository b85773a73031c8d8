"""Review of tiered_kv.core.policy as driven by tiered_kv.core.index: what an adversarial review proved
wrong, each pinned by a test that failed before its fix, and guarantees checked and found to hold.

* ``admission_victim`` names the entry ``victim(protect, key)`` then takes (``Policy.peek``): under a hot
  shared prefix (S3-FIFO's main FIFO, the prefix policy's CLOCK), with protected keys (S3-FIFO keeps to
  the FIFO it started on, ARC to the list REPLACE chose), and for an ARC ghost key (``p`` adapted first);
  a seeded workload per policy checks it at every eviction;
* PrefixLRU's ``coldest`` foresees the children an orphan's eviction orphans;
* PrefixLRU queues new orphans (and children adopted again) least recently used first, not in a set's
  order (which follows Python's per-process hash seed);
* ``ready_run_below`` tells the lower tier's policy the chain (a prefix disk tier learns it);
* TinyLFU's 64-bit hash has independent halves (CRC-32 twice did not: keys with one CRC-32 shared
  every counter).
"""

from __future__ import annotations

import random
import uuid
import zlib
from typing import Optional

import pytest

from tiered_kv.core.index import Entry, EntryState, TierIndex
from test_review_index import _Asked
from test_review_index import _put as put
from tiered_kv.core.policy import (ARC, LRU, S3FIFO, Admission, Policy, PrefixLRU, TinyLFU, admission_victim,
                                   make_admission, make_policy)

WRITER = uuid.UUID(int=1)


def ready(key: bytes) -> Entry:
    e = Entry(key, 0, WRITER)
    e.state = EntryState.READY
    e.writing = False
    return e


# --------------------------------------------------------------------------- the next victim, named before it goes

def test_s3fifo_admission_is_asked_against_the_next_victim_with_a_hot_shared_prefix() -> None:
    """A shared prompt prefix of 30 blocks, each hit by three requests, sits in the main FIFO with frequency 3.
    The next victim is the prefix's first block (after three rounds): the filter is asked about it.
    (``coldest``, which write-back asks, simulates at most ``8 n + 64`` steps: past them it lists FIFO order.)"""
    pol = S3FIFO(100)
    prefix = [ready(b"sys%02d" % i) for i in range(30)]
    for e in prefix:
        pol.insert(e)
    for _ in range(3):
        for e in prefix:
            pol.hit(e)
    once = ready(b"once")
    pol.insert(once)
    assert pol.victim((), None) is once          # the used prefix moved to main
    assert list(pol.main) == [e.key for e in prefix] and not pol.small
    named = admission_victim(pol, (), b"new")
    v = pol.victim((), b"new")
    assert v is not None and named == v.key == b"sys00", (named, v)


def test_prefix_admission_is_asked_against_the_next_victim_with_many_reused_leaves() -> None:
    """30 conversations whose last block was reused three times: 30 leaves at frequency 3.  The CLOCK takes
    the first after three rounds: the filter is asked about it."""
    pol = PrefixLRU(100)
    for i in range(30):
        e = ready(b"tail%02d" % i)
        pol.insert(e)
        for _ in range(3):
            pol.hit(e)
    named = admission_victim(pol, (), b"new")
    v = pol.victim((), b"new")
    assert v is not None and named == v.key == b"tail00", (named, v)


def test_prefix_coldest_foresees_the_children_an_orphan_eviction_orphans() -> None:
    pol = PrefixLRU(16)
    z = ready(b"z")
    pol.insert(z)                               # an unrelated leaf, the oldest use
    pol.link([b"h", b"a", b"b"])
    es = {k: ready(k) for k in (b"h", b"a", b"b")}
    for e in es.values():
        pol.insert(e)
    pol.remove(es[b"h"])                       # invalidated: a is an orphan
    cold = [e.key for e in pol.coldest(3)]
    every = [e.key for e in pol.coldest(10)]   # more than there are: each evictable entry once
    victims = []
    for _ in range(3):
        v = pol.victim((), None)
        assert v is not None
        victims.append(v.key)
    assert victims == [b"a", b"b", b"z"]       # a's eviction orphaned b: it goes before the leaf z
    assert cold == victims and every == victims


def _head_and_children(n: int) -> tuple[PrefixLRU, list[bytes]]:
    """A head and ``n`` children linked to it, inserted (used) in order; the head then invalidated: the
    children are orphans."""
    pol = PrefixLRU(32)
    pol.insert(ready(b"head"))
    kids = [b"c%02d" % i for i in range(n)]
    for k in kids:
        pol.link([b"head", k])
        pol.insert(ready(k))
    pol.remove(pol.nodes[b"head"].entry)
    return pol, kids


def _victims(pol: Policy, n: int, protect: set[bytes]) -> list[bytes]:
    out = []
    for _ in range(n):
        v = pol.victim(protect, None)
        assert v is not None
        out.append(v.key)
    return out


def test_prefix_orphans_leave_least_recently_used_first() -> None:
    """Twelve children of one head, used in order; the head is invalidated: the orphans' queue is "least
    recently used first" (the class doc), so they go c00, c01, ..., in every process (a set's order, which
    they once followed, changes with PYTHONHASHSEED)."""
    pol, kids = _head_and_children(12)
    assert _victims(pol, len(kids), set()) == kids


def test_prefix_children_adopted_again_rejoin_least_recently_used_first() -> None:
    """The head comes back (a promote): its orphans are leaves again, and leave least recently used first."""
    pol, kids = _head_and_children(12)
    pol.insert(ready(b"head"))
    assert _victims(pol, len(kids), {b"head"}) == kids


# --------------------------------------------------------------------------- admission_victim == victim(protect, key)

def _victim_key(pol: Policy, protect: set[bytes], key: bytes) -> Optional[bytes]:
    v = pol.victim(protect, key)
    return None if v is None else v.key


def test_s3fifo_admission_victim_with_a_protected_coldest_entry() -> None:
    pol = S3FIFO(20)                           # small FIFO's share: 2
    m, x = ready(b"m"), ready(b"x")
    pol.insert(m)
    pol.hit(m)
    pol.insert(x)
    assert pol.victim((), None) is x           # m (used) moved to main
    for k in (b"a", b"b"):
        pol.insert(ready(k))                   # small [a, b], main [m]
    named = admission_victim(pol, {b"a"}, b"new")
    assert named == _victim_key(pol, {b"a"}, b"new"), "the filter weighed the new key against another entry"


def test_arc_admission_victim_with_protected_t1_entries() -> None:
    pol = ARC(4)
    es: dict[bytes, Entry] = {}

    def ins(k: bytes) -> None:
        es[k] = ready(k)
        pol.insert(es[k])

    for k in (b"a", b"b"):
        ins(k)
        pol.hit(es[k])                         # T2 [a, b]
    ins(b"c")
    ins(b"d")                                  # T1 [c, d]
    assert _victim_key(pol, set(), b"e") == b"c"
    ins(b"e")                                  # B1 [c]
    assert _victim_key(pol, set(), b"c") == b"d" and pol.p == 1.0   # a ghost hit: p = 1
    ins(b"c")                                  # T1 [e], T2 [a, b, c]
    pol.remove(es[b"a"])                       # invalidated
    pol.remove(es[b"b"])
    ins(b"f")
    ins(b"g")                                  # T1 [e, f, g], T2 [c], p = 1
    assert list(pol.t1) == [b"e", b"f", b"g"] and list(pol.t2) == [b"c"]
    named = admission_victim(pol, {b"e", b"f"}, b"new")
    assert named == _victim_key(pol, {b"e", b"f"}, b"new"), "the filter weighed the new key against another entry"


def test_prefix_admission_victim_with_a_protected_leaf() -> None:
    pol = PrefixLRU(16)
    pol.link([b"p", b"a"])
    for k in (b"p", b"a", b"b"):
        pol.insert(ready(k))                   # p inner, leaves [a, b]
    named = admission_victim(pol, {b"a"}, b"new")
    assert named == _victim_key(pol, {b"a"}, b"new"), "the filter weighed the new key against another entry"


def test_arc_admission_is_asked_against_the_entry_a_ghost_key_evicts() -> None:
    """Through the index: a tier with a filter stores a key that is an ARC ghost; the filter must weigh it
    against the entry its reservation evicts."""
    evicted: list[bytes] = []
    adm = _Asked()
    ix = TierIndex(2, policy=ARC(2), admission=adm, on_evict=lambda e: evicted.append(e.key))
    a = put(ix, b"a")
    put(ix, b"b")
    ix.touch(a)                                # a -> T2
    put(ix, b"c")                              # evicts b into B1
    assert evicted == [b"b"]
    got, _, full = ix.reserve_absent([b"b"], uuid.uuid4(), [], None)   # b: a ghost hit
    assert got == [b"b"] and full == 0
    assert adm.asked[-1] == (b"b", evicted[-1]), f"asked against {adm.asked[-1][1]!r}, evicted {evicted[-1]!r}"


# --------------------------------------------------------------------------- the index drives the lower tier's policy

def test_a_prefix_disk_tier_learns_the_chain_a_lookup_runs_through() -> None:
    """Host on LRU, disk on the prefix policy; a chain a, b, c only on disk, and a block z stored after it.
    A lookup runs through the chain on disk (tools/tracetools.py links the disk policy on each request).
    Evicting two disk blocks must keep the chain's head: the tail c and the unrelated z go."""
    host = TierIndex(4)
    disk = TierIndex(4, policy=PrefixLRU(4))
    for k in (b"a", b"b", b"c", b"z"):
        put(disk, k)
    assert host.ready_run_below([b"a", b"b", b"c"], disk) == (3, 0)
    assert disk.evict_ahead(2) == 2
    assert b"a" in disk and b"b" in disk, f"disk kept {sorted(e.key for e in disk.entries())}"


# --------------------------------------------------------------------------- TinyLFU's hash

def _crc_pair(length: int = 16) -> tuple[bytes, bytes]:
    """Two random keys of one length with the same CRC-32 (a birthday search: ~10^5 keys, seeded)."""
    rng = random.Random(1)
    seen: dict[int, bytes] = {}
    while True:
        k = rng.randbytes(length)
        c = zlib.crc32(k)
        other = seen.setdefault(c, k)
        if other != k:
            return other, k


def test_tinylfu_a_never_referenced_key_does_not_inherit_another_keys_count() -> None:
    hot, never = _crc_pair()
    adm = TinyLFU(1024)
    for _ in range(8):
        adm.record(hot)
    adm.record(b"victim-seen-once".ljust(16, b"."))
    assert adm.frequency(never) == 0, f"estimated {adm.frequency(never)} references of a key never referenced"
    assert not adm.admit(never, b"victim-seen-once".ljust(16, b"."))


# --------------------------------------------------------------------------- guarantees that hold (pinned)

@pytest.mark.parametrize("slots", [1, 5, 24])
@pytest.mark.parametrize("admission", [None, "second_hit", "tinylfu"])
@pytest.mark.parametrize("name", ["lru", "s3fifo", "arc", "prefix"])
def test_long_random_workload_keeps_policy_state_bounded_and_in_step(name: str, admission: Optional[str],
                                                                     slots: int) -> None:
    """Through a TierIndex (lookups, reservations of chains, aborts, leases, invalidations, evict-ahead) over
    ~20k distinct keys: the policy holds exactly the READY entries without a reader, its ghost lists and link
    tables stay within their documented bounds, and a refused key neither evicts nor takes a slot."""
    rng = random.Random(97 + slots)
    pol = make_policy(name, slots)
    adm = None if admission is None else make_admission(admission, slots)
    ix = TierIndex(slots, policy=pol, admission=adm)
    leased: list[Entry] = []
    for step in range(1500):
        base = rng.randrange(20000) if rng.random() < 0.7 else rng.randrange(20)
        keys = [b"%d-%d" % (base, j) for j in range(rng.randrange(1, 5))]
        ix.seen(keys)
        n = ix.ready_run(keys)
        before = (ix.evictions, ix.refused, ix.used_slots)
        got, new, full = ix.reserve_absent(keys[n:], uuid.uuid4(), keys, None)
        evicted = ix.evictions - before[0]
        assert evicted <= len(new), "an eviction for no reservation (a refused or failed key evicted)"
        assert ix.used_slots == before[2] + len(new) - evicted, "a slot taken by no reservation"
        for e in new:
            if rng.random() < 0.05:
                ix.writer_done(e)
                ix.abort(e)
            else:
                ix.publish(e)
        r = rng.random()
        if r < 0.1:
            es = [e for e in ix.entries() if e.state is EntryState.READY]
            if es:
                e = rng.choice(es)
                ix.acquire(e)
                leased.append(e)
        elif r < 0.22 and leased:
            ix.release(leased.pop(rng.randrange(len(leased))))
        elif r < 0.27:
            es = list(ix.entries())
            if es:
                ix.remove(rng.choice(es))
        elif r < 0.32:
            ix.evict_ahead(max(1, slots // 4))
        assert len(pol) == sum(1 for e in ix.entries()
                               if e.state is EntryState.READY and (e.readers == 0 or pol.leases_in_place))
        assert not {id(e) for e in pol.coldest(slots)} & {id(e) for e in leased}
    if isinstance(pol, S3FIFO):
        assert len(pol.ghost) <= pol.ghost_max and len(pol.freq) <= slots
    elif isinstance(pol, ARC):
        assert len(pol.b1) + len(pol.b2) <= 2 * pol.c and len(pol.adapted) <= pol.c
        assert len(pol.t1) + len(pol.b1) + pol.n_leased[1] <= pol.c + 1
    elif isinstance(pol, PrefixLRU):
        assert len(pol.links) <= pol.links_max and len(pol.ghosts) <= pol.links_max
        assert len(pol.nodes) <= slots and sum(map(len, pol.children.values())) <= slots
    elif isinstance(pol, LRU):
        assert len(pol.od) <= slots


@pytest.mark.parametrize("name", ["s3fifo", "arc", "prefix"])
def test_refused_key_changes_no_order_and_no_slot(name: str) -> None:
    """A full tier under each non-default policy with a filter that refuses: the refused store leaves the
    policy's whole order, the entries and the free slots as they were (ARC's p included)."""

    class Refuse(Admission):
        def admit(self, key: bytes, victim: Optional[bytes]) -> bool:
            return False

    pol = make_policy(name, 6)
    ix = TierIndex(6, policy=pol)
    for i in range(6):
        e = put(ix, b"k%d" % i)
        if i % 2:
            ix.touch(e)
    ix.evict_ahead(1)
    put(ix, b"k6")                              # full again, with a ghost (ARC: B1, S3-FIFO: ghost)
    ghost = b"k0"
    snapshot = ([e.key for e in pol.coldest(6)], sorted(e.key for e in ix.entries()), ix.used_slots,
                getattr(pol, "p", None))
    ix.admission = Refuse()
    assert ix.reserve_absent([ghost, b"fresh"], uuid.uuid4(), [], None) == ([], [], 0)
    assert ix.refused == 2
    assert ([e.key for e in pol.coldest(6)], sorted(e.key for e in ix.entries()), ix.used_slots,
            getattr(pol, "p", None)) == snapshot


@pytest.mark.parametrize("slots", [1, 3, 8, 24])
@pytest.mark.parametrize("name", ["lru", "s3fifo", "arc", "prefix"])
def test_peek_names_what_victim_then_takes_through_a_long_random_workload(name: str, slots: int) -> None:
    """``peek(protect, key)`` against the real ``victim(protect, key)`` right after it, at every eviction of a
    seeded workload of inserts (chains linked for the prefix policy), hits, leases, releases, removals and
    victims with random protected sets and keys (new ones, and ghosts: keys evicted before)."""
    rng = random.Random(zlib.crc32(name.encode()) + slots)
    pol = make_policy(name, slots)
    held: dict[bytes, Entry] = {}      # evictable
    leased: dict[bytes, Entry] = {}
    gone: list[bytes] = []
    n = 0
    for _ in range(4000):
        op = rng.random()
        if op < 0.3 or not held:
            if len(held) + len(leased) >= slots:
                continue
            k = rng.choice(gone) if gone and rng.random() < 0.3 else b"k%05d" % n
            n += 1
            if k in held or k in leased:
                continue
            if pol.uses_links and held:
                pol.link([rng.choice(list(held)), k])
            e = held[k] = ready(k)
            pol.insert(e)
        elif op < 0.5:
            pol.hit(held[rng.choice(list(held))])
        elif op < 0.6:
            k = rng.choice(list(held))
            pol.lease(held[k])
            held[k].readers = 1   # as the index counts a lease (S3-FIFO keeps the entry in place: passed over)
            leased[k] = held.pop(k)
        elif op < 0.7 and leased:
            k = rng.choice(list(leased))
            leased[k].readers = 0
            pol.unlease(leased[k])
            held[k] = leased.pop(k)
        elif op < 0.75:
            k = rng.choice(list(held))
            pol.remove(held.pop(k))
        else:
            protect = set(rng.sample(sorted(held), rng.randrange(len(held) + 1))) if rng.random() < 0.5 else set()
            ghosts = [k for k in gone if k not in held and k not in leased]   # a key being stored is not held
            key = rng.choice(ghosts) if ghosts and rng.random() < 0.4 else b"new%05d" % n
            want = pol.peek(protect, key)
            v = pol.victim(protect, key)
            assert v is want, f"peek named {want and want.key!r}, victim took {v and v.key!r}"
            if v is not None:
                assert v.key in held and v.key not in protect and v.key != key
                del held[v.key]
                gone.append(v.key)
            else:
                assert all(k in protect for k in held), "victim found none with unprotected entries held"
                pol.abandon(key)
