"""Adversarial review of commits 22faf32 (a spill's or a put's read *pins* its host block in place) and
bc442f2 (write-back keeps the host's next victims written; ``evicted_unwritten``).

Finding (failed before its fix):

* ``PrefixLRU.coldest`` (tiered_kv/core/policy.py:883 and :896) is not the next victims when a pinned
  block is orphaned by an orphan's eviction: the orphan phase passes over the pinned child but leaves it
  in the leaves phase's view, where it serves as the "coldest leaf" a parent that just became a leaf is
  compared with, although ``victim`` has moved it to the orphans by then.  The parent is foreseen at the
  cold end when it goes to the hot end, so ``coldest`` disagrees with ``victim`` inside the part the
  docstring says it foresees (orphans, then leaves).  For a user of ``host_policy="prefix"`` with
  ``write_mode="back"``: write-back spills "the next victims" in ``coldest`` order, so it writes a block
  that is not next while the real next victim is evicted unwritten (``evicted_unwritten``, a lost block).
  Fixed: the orphan phase marks a pinned orphan taken, out of the leaves' view.

Guarantees checked and found to hold (plain tests, coverage the existing suites lack):

* through the real ``TierIndex`` (``pin_all``/``acquire``/``acquire_all``/``release``/``release_all``/
  ``remove``/``reserve``/``reserve_absent``/``publish``/``ready_run``/``evict_ahead``) under every policy,
  with pins and leases of one entry mixed in any order: no pinned entry is evicted or freed, ``peek`` is
  ``victim``, ``coldest`` is the next victims (LRU, S3-FIFO, ARC; its first for the prefix policy), the
  policy holds exactly the READY entries not leased, and ``_pinned`` never leaks;
* write-back under S3-FIFO, ARC and the prefix policy (the existing test covers LRU), with invalidations
  and a load of a block whose spill is in flight: ``evicted_unwritten`` counts exactly the blocks in no
  tier afterwards, and the loaded block's bytes are right;
* write-through never counts ``evicted_unwritten``, even for blocks whose spills were shed and that were
  then evicted (they are counted once, as ``backpressure``).

Nothing wrong was found in: the index's pin/lease bookkeeping (release first or last, a put and a spill
on one entry, remove while pinned), S3-FIFO's and ARC's victim/peek/coldest with pins, write-back while
closing, or the accounting of ``evicted_unwritten`` (no double count, none for blocks on disk or being
written, counted with ``collect_evicted`` on as well).
"""

from __future__ import annotations

import copy
import random
import uuid

import pytest
import torch

from disk_helpers import ROW, fill, keys, load_ok, metric, rig  # noqa: F401 (rig: a fixture)
from test_policies import ready
from tiered_kv.core.index import EntryState, TierIndex
from tiered_kv.core.policy import POLICIES, PrefixLRU, make_policy


# -- finding: PrefixLRU.coldest with a pinned block orphaned by an orphan's eviction ----------------------

def test_prefix_coldest_is_the_next_victims_with_a_pinned_child_of_an_orphan() -> None:
    """Chains z -> o -> p and q -> l1, and a lone leaf l2; z is gone (o is an orphan), p is pinned (a
    write-back spill reads it).  ``victim``: o (p becomes an orphan, passed over), l1 (q becomes a leaf,
    at the hot end: it was used after l2, the coldest leaf left), l2, q.  ``coldest`` compares q with p,
    no leaf any more, puts q at the cold end and lists q before l2."""
    pol = PrefixLRU(16)
    es = {k: ready(k) for k in (b"z", b"o", b"p", b"q", b"l1", b"l2")}
    pol.link([b"z", b"o", b"p"])
    pol.link([b"q", b"l1"])
    for k in (b"l1", b"z", b"o", b"p", b"l2", b"q"):   # leaves in order l1, p, l2; q inner (child l1)
        pol.insert(es[k])
    pol.hit(es[b"p"])                                   # p used last: l2 < q < p on the policy's clock
    es[b"z"].live = False
    pol.remove(es[b"z"])                                # o is an orphan
    es[b"p"].readers = 1                                # pinned
    assert (list(pol.orphans), list(pol.leaves), list(pol.inner)) == ([b"o"], [b"l1", b"p", b"l2"], [b"q"])
    c = copy.deepcopy(pol)
    victims = [c.victim((), None).key for _ in range(4)]   # type: ignore[union-attr]
    assert victims == [b"o", b"l1", b"l2", b"q"]
    assert pol.peek((), None) is es[b"o"]
    assert [e.key for e in pol.coldest(4)] == victims


# -- guarantee: pins through the real index, every policy ---------------------------------------------

def _check_index(ix: TierIndex, name: str, evicted_with_readers: list) -> None:
    assert not evicted_with_readers, f"{name}: evicted while read: {evicted_with_readers}"
    live = dict(ix._entries)
    held = {k for k, e in live.items() if e.state is EntryState.READY
            and (e.readers == 0 or e in ix._pinned or ix.policy.leases_in_place)}
    assert len(ix.policy) == len(held), name
    assert all(e.readers > 0 for e in ix._pinned), name
    slots = [e.slot for e in live.values()]
    assert len(set(slots)) == len(slots) and not set(slots) & set(ix._free), name
    cold = ix.coldest(len(live) + 1)
    assert all(e.live and e.state is EntryState.READY and not e.readers for e in cold), name
    assert len(cold) == sum(1 for k in held if live[k].readers == 0), name
    c = copy.deepcopy(ix.policy)
    p, v = c.peek((), None), c.victim((), None)
    assert (p is None) == (v is None) and (p is None or p.key == v.key), f"{name}: peek {p!r} victim {v!r}"
    if cold:
        c = copy.deepcopy(ix.policy)
        nxt = [c.victim((), None) for _ in (cold if name != "prefix" else cold[:1])]
        assert [e.key for e in cold[:len(nxt)]] == [None if e is None else e.key for e in nxt], name


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_pins_and_leases_through_the_index_keep_every_policy_consistent(name: str) -> None:
    slots, ks = 8, [b"k%02d" % i for i in range(14)]
    for seed in range(12):
        rnd = random.Random(seed)
        bad: list = []
        ix = TierIndex(slots, on_evict=lambda e: bad.append(e) if e.readers else None,
                       policy=make_policy(name, slots))
        ix._batched = seed % 2 == 0
        writing: list = []
        readers: list = []   # (kind, entries)
        for _ in range(150):
            op = rnd.randrange(10)
            ready_es = [e for e in ix._entries.values() if e.state is EntryState.READY]
            if op == 0:
                k = rnd.choice(ks)
                if k not in ix:
                    e = ix.reserve(k, uuid.uuid4())
                    if e is not None:
                        writing.append(e)
            elif op == 1 and writing:
                ix.publish(writing.pop(rnd.randrange(len(writing))))
            elif op in (2, 3) and ready_es:
                es = rnd.sample(ready_es, min(len(ready_es), rnd.randint(1, 3)))
                if op == 2:
                    ix.pin_all(es)                         # a spill or a put
                elif rnd.random() < 0.5:
                    ix.acquire_all(es)                     # a load
                else:
                    for e in es:
                        ix.acquire(e)
                readers.append(es)
            elif op == 4 and readers:
                es = readers.pop(rnd.randrange(len(readers)))
                if rnd.random() < 0.5:
                    ix.release_all(es)
                else:
                    for e in es:
                        ix.release(e)
            elif op == 5:
                ix.ready_run(rnd.sample(ks, rnd.randint(1, 4)))
            elif op == 6:
                e = ix.get(rnd.choice(ks))
                if e is not None:
                    if e.state is EntryState.WRITING:
                        writing.remove(e)
                        ix.writer_done(e)
                    ix.remove(e)                           # invalidated, maybe while pinned or leased
            elif op == 7:
                ix.evict_ahead(rnd.randint(1, 4))
            else:
                got = rnd.sample(ks, rnd.randint(1, 4))
                writing.extend(ix.reserve_absent(got, uuid.uuid4(), got, None)[1])
            _check_index(ix, name, bad)
        for es in readers:
            ix.release_all(es)
        for e in writing:
            ix.publish(e)
        _check_index(ix, name, bad)
        assert not ix._pinned
        ix.evict_ahead(slots)
        assert ix.used_slots == 0 and sorted(ix._free) == list(range(slots)), name


# -- guarantee: evicted_unwritten counts exactly the blocks lost, under every policy ---------------------

@pytest.mark.disk_threads
@pytest.mark.parametrize("policy", ["s3fifo", "arc", "prefix"])
def test_write_back_counts_exactly_the_blocks_lost_under_every_policy(rig, policy: str) -> None:
    """The writer held: write-back's spills stay pinned, evictions pass over them and take blocks not
    written (counted).  A load of a block whose spill is in flight leases it; an invalidated block is
    neither lost nor counted.  Afterwards the blocks in no tier are exactly the ones counted."""
    kv = torch.zeros((48, ROW), dtype=torch.uint8)
    mgr = rig.open(kv, host_slots=64, disk_slots=256, write_mode="back", host_evict_ahead_blocks=0,
                   host_policy=policy, writer_queue_blocks=8, writer_batch_blocks=8)
    gate = rig.gate(mgr)
    old, new = keys(48), keys(40, "n")
    for i, k in enumerate(old):
        fill(kv, i, k)
    job = mgr.store_many(old, list(range(48)))
    assert job is not None and mgr.wait([job], timeout=30) and job.done
    core = mgr._core
    being_spilled = [e.key for e in core.index._pinned]
    assert being_spilled, "write-back started no spill"
    assert load_ok(mgr, kv, being_spilled[0], 0)         # a load of a pinned block: a lease, then released
    mgr.invalidate(being_spilled[-1])                     # invalidated while its spill reads it
    gone = {being_spilled[-1]}
    for i, k in enumerate(new):
        fill(kv, i, k)
    job = mgr.store_many(new, list(range(40)))
    assert job is not None and mgr.wait([job], timeout=30) and job.done
    unwritten = metric(mgr, "tiered_kv_shed_total", kind="spill", reason="evicted_unwritten")
    assert unwritten > 0
    gate.open()
    assert mgr.flush(timeout=30) is True
    lost = [k for k in old + new if k not in gone and mgr.lookup([k]) == 0]
    assert len(lost) == unwritten, (policy, len(lost), unwritten)
    assert not core.index._pinned or all(e.readers for e in core.index._pinned)


@pytest.mark.disk_threads
def test_write_through_never_counts_evicted_unwritten(rig) -> None:
    """Write-through: a spill shed (writer queue full) leaves its block host-only; evicted, it is lost,
    counted once as ``backpressure``, never as ``evicted_unwritten`` (write-back only)."""
    kv = torch.zeros((16, ROW), dtype=torch.uint8)
    mgr = rig.open(kv, host_slots=16, disk_slots=256, host_evict_ahead_blocks=0,
                   writer_queue_blocks=4, writer_batch_blocks=4)
    gate = rig.gate(mgr)
    for part in (keys(16), keys(16, "n")):
        for i, k in enumerate(part):
            fill(kv, i, k)
        job = mgr.store_many(part, list(range(16)))
        assert job is not None and mgr.wait([job], timeout=30) and job.done
    assert metric(mgr, "tiered_kv_shed_total", kind="spill", reason="backpressure") > 0
    assert metric(mgr, "tiered_kv_evictions_total", tier="host") > 0
    assert metric(mgr, "tiered_kv_shed_total", kind="spill", reason="evicted_unwritten") == 0
    gate.open()
    assert mgr.flush(timeout=30) is True
