"""An interrupt inside a lease, a release or an eviction never leaves a live entry out of the eviction order.

Every policy (``lru``, the default; ``s3fifo``, ``arc``, ``prefix``) and each step that moves an entry into or out
of the policy's order on the engine's thread: ``TierIndex.acquire`` and ``acquire_all`` (a load's lease),
``release`` and ``release_taken`` (its end), a reservation in a full tier (its victim's eviction) and a publish.
Method: the interrupt sweeps' return hook (``tests/test_interrupt_locks.py``): ``KeyboardInterrupt`` at the k-th
call return inside the method, for every k until the call runs through; then what the engine does next (it
releases what it holds, retries what did not happen), and the check that matters to a user: with nothing leased,
every slot of the tier can be taken by new keys (``_every_slot_reclaimable``).  An entry left live and unleased
but out of the policy's order is never evicted: its slot is lost to the tier until the key's next load.

Before the fix, the sweeps failed for every policy: the lease left the order first and counted itself after (an
interrupt between: out of the order, unleased), a non-default policy's release or eviction could be broken off
between its steps (``S3FIFO.unlease`` forgot the lease before the FIFO took the entry back; another policy's
``victim`` took its entry out before the index's map let it go), and PrefixLRU's ``lease`` took its node out of
its queue before marking it leased.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable, Optional

import pytest

from test_interrupt_locks import MAX_K, _call_with, _interrupt_inside
from tiered_kv.core.index import Entry, TierIndex
from tiered_kv.core.policy import ARC, S3FIFO, PrefixLRU, make_policy

POLICIES = ["lru", "s3fifo", "arc", "prefix"]
SLOTS = 6
KEYS = [b"k%d" % i for i in range(SLOTS)]


def _full(policy: str, pin: bool = False) -> tuple[TierIndex, list[Entry]]:
    """A full index of ``SLOTS`` READY entries, linked as one chain (PrefixLRU's inner nodes and leaf); the
    first used twice (ARC's T2, S3-FIFO's frequency); ``pin``: the first two pinned (a spill reading them)."""
    idx = TierIndex(SLOTS, policy=make_policy(policy, SLOTS))
    idx.link(KEYS)
    _, new, full = idx.reserve_absent(KEYS, uuid.uuid4(), (), None)
    assert full == 0
    idx.publish_all(new)
    idx.ready_run(KEYS[:1])
    idx.ready_run(KEYS[:1])
    if pin:
        idx.pin_all(new[:2])
    return idx, new


def _policy_agrees(idx: TierIndex, label: str) -> None:
    """Nothing leased: the policy records no lease, its counts of leases are 0, and every entry it knows is the
    index's, in the queue it is marked for (S3-FIFO's frequencies, ARC's lease counts, PrefixLRU's queue marks)."""
    p: Any = idx.policy
    if isinstance(p, S3FIFO):
        assert set(p.freq) == set(p.small) | set(p.main), f"{label}: S3-FIFO frequencies {p.freq}"
    elif isinstance(p, ARC):
        assert not p.leased and p.n_leased == [0, 0, 0], f"{label}: ARC leases {p.leased}, {p.n_leased}"
    elif isinstance(p, PrefixLRU):
        for k, node in p.nodes.items():
            assert p._queue(node.q).get(k) is node, f"{label}: PrefixLRU node {k!r} not in the queue it is marked for"
        assert len(p) == len(p.nodes), f"{label}: PrefixLRU queues hold {len(p)} keys for {len(p.nodes)} nodes"
    for e in idx.entries():
        assert _in_order(p, e), f"{label}: {e!r} out of the order"


def _in_order(p: Any, e: Entry) -> bool:
    """Whether ``e`` is in the policy's eviction order, read from the policy's own queues (not its ``holds``)."""
    k = e.key
    if isinstance(p, S3FIFO):
        return p.small.get(k) is e or p.main.get(k) is e
    if isinstance(p, ARC):
        return p.t1.get(k) is e or p.t2.get(k) is e
    if isinstance(p, PrefixLRU):
        node = p.nodes.get(k)
        return node is not None and node.entry is e and p._queue(node.q).get(k) is node
    return p.od.get(k) is e


def _every_slot_reclaimable(idx: TierIndex, label: str) -> None:
    """Nothing leased or pinned any more: new keys take every slot (each old entry evicted), none fails."""
    for e in idx.entries():
        assert e.readers == 0 and not e.writing, f"{label}: still held: {e!r}"
    _policy_agrees(idx, label)
    fresh = [b"new%d" % i for i in range(SLOTS)]
    got: list[Optional[Entry]] = []
    for k in fresh:
        got.append(idx.reserve(k, uuid.uuid4()))
    lost = [e for e in idx.entries() if e.key not in fresh]
    assert all(e is not None for e in got) and not lost, (
        f"{label}: {sum(e is None for e in got)} new keys found no slot; left out of the order: {lost}")
    assert idx.used_slots == SLOTS and len({e.slot for e in got if e is not None}) == SLOTS, label


def _sweep(fn: Callable[..., Any], setup: Callable[[], Any], call: Callable[[Any], Any],
           after: Callable[[Any, str], None]) -> int:
    """``call(setup())`` interrupted at each call return inside ``fn`` in turn (k = 1, 2, ... until it runs through);
    ``after(state, label)`` does what the engine would next and checks.  Returns the number of points swept."""
    for k in range(1, MAX_K):
        st = setup()
        hook, fired = _interrupt_inside(fn, k)
        _, exc = _call_with(hook, lambda: call(st))
        assert exc is None or (fired and isinstance(exc, KeyboardInterrupt)), exc
        after(st, f"k={k} ({fired[0] if fired else 'ran through'})")
        if not fired:
            return k
    raise AssertionError("the sweep never ran through")


@pytest.mark.parametrize("pin", [False, True], ids=["unpinned", "pinned"])
@pytest.mark.parametrize("policy", POLICIES)
def test_an_interrupted_lease_leaves_its_entry_leased_or_in_the_order(policy: str, pin: bool) -> None:
    """``acquire`` of the first entry (``pinned``: one a spill is reading, in the order) broken off anywhere: the
    lease is in the holder's list and its release puts the entry back, or it was not taken and the entry is
    still in the order."""
    def setup() -> tuple[TierIndex, list[Entry], list[Any]]:
        idx, new = _full(policy, pin)
        return idx, new, [None]

    def after(st: tuple[TierIndex, list[Entry], list[Any]], label: str) -> None:
        idx, new, into = st
        idx.release_taken(into)
        if pin:
            idx.release_all(new[:2])
        _every_slot_reclaimable(idx, f"{policy}, {label}")

    assert _sweep(TierIndex.acquire, setup, lambda st: st[0].acquire(st[1][0], st[2], 0), after) > 1


@pytest.mark.parametrize("policy", POLICIES)
def test_an_interrupted_batch_lease_leaves_each_entry_leased_or_in_the_order(policy: str) -> None:
    """``acquire_all`` of three entries (one pinned) broken off anywhere: the leases in the list are released by
    the holder; every other entry is still in the order."""
    def setup() -> tuple[TierIndex, list[Entry], list[Any]]:
        idx, new = _full(policy, pin=True)
        return idx, new, [None] * 3

    def after(st: tuple[TierIndex, list[Entry], list[Any]], label: str) -> None:
        idx, new, into = st
        idx.release_taken(into)
        idx.release_all(new[:2])
        _every_slot_reclaimable(idx, f"{policy}, {label}")

    assert _sweep(TierIndex.acquire_all, setup, lambda st: st[0].acquire_all(st[1][1:4], st[2]), after) > 1


@pytest.mark.parametrize("removed", [False, True], ids=["live", "removed"])
@pytest.mark.parametrize("held", ["leased", "pinned"])
@pytest.mark.parametrize("how", ["release", "release_taken"])
@pytest.mark.parametrize("policy", POLICIES)
def test_an_interrupted_release_puts_the_entry_back_in_the_order(policy: str, how: str, held: str, removed: bool) -> None:
    """The end of a read of two entries (a load's lease, or a spill's pin), ``release`` of one or ``release_taken`` of
    the holder's list, broken off anywhere, then run again where the read is still counted: each entry is back in
    the order; ``removed``: the first was invalidated while it was read, and its slot is free."""
    def setup() -> tuple[TierIndex, list[Any]]:
        idx, new = _full(policy)
        into: list[Any] = [None, None]
        if held == "leased":
            idx.acquire_all(new[:2], into)
        else:
            idx.pin_all(new[:2])
            into[:] = new[:2]
        if removed:
            idx.remove(new[0])
        return idx, into

    def call(st: tuple[TierIndex, list[Any]]) -> None:
        idx, into = st
        if how == "release":
            idx.release(into[0])
        else:
            idx.release_taken(into)

    def after(st: tuple[TierIndex, list[Any]], label: str) -> None:
        idx, into = st
        if how == "release":
            if into[0].readers:   # not released: the holder's retry
                idx.release(into[0])
            idx.release(into[1])
        else:
            idx.release_taken(into)   # releases what is left in its list
        _every_slot_reclaimable(idx, f"{policy}, {label}")

    fn = TierIndex.release if how == "release" else TierIndex.release_taken
    swept = _sweep(fn, setup, call, after)
    assert swept > 1 or how == "release"   # (the default policy's release of a live lease makes no call)


@pytest.mark.parametrize("leased", [False, True], ids=["unleased", "leased"])
@pytest.mark.parametrize("policy", POLICIES)
def test_an_interrupted_remove_leaves_the_entry_in_the_order_or_gone(policy: str, leased: bool) -> None:
    """An invalidate's removal of a READY entry (``leased``: one a load reads, released after) broken off anywhere,
    and not retried: the entry is gone with its slot free, or still in the index and in the order (evicted like any
    other); a lease the policy recorded is forgotten with its count (S3-FIFO's and ARC's counts of leases)."""
    def setup() -> tuple[TierIndex, list[Entry], list[Any]]:
        idx, new = _full(policy)
        into: list[Any] = [None]
        if leased:
            idx.acquire(new[2], into, 0)
        return idx, new, into

    def after(st: tuple[TierIndex, list[Entry], list[Any]], label: str) -> None:
        idx, _, into = st
        idx.release_taken(into)
        _every_slot_reclaimable(idx, f"{policy}, {label}")

    assert _sweep(TierIndex.remove, setup, lambda st: st[0].remove(st[1][2]), after) > 1


@pytest.mark.parametrize("policy", POLICIES)
def test_an_interrupted_eviction_never_leaves_a_live_entry_out_of_the_order(policy: str) -> None:
    """A reservation in the full tier (its victim's eviction) broken off anywhere, then retried if the key did not
    get its entry: the victim is gone with its slot free, or still in the order; and a key the eviction hook was
    told of (the disk tier queues the block's delete) is gone."""
    told: list[bytes] = []

    def setup() -> TierIndex:
        told.clear()
        idx = _full(policy)[0]
        idx._on_evict = lambda e: told.append(e.key)
        return idx

    def after(idx: TierIndex, label: str) -> None:
        if idx.get(b"z") is None:
            assert idx.reserve(b"z", uuid.uuid4()) is not None, label
        e = idx.get(b"z")
        assert e is not None
        idx.publish(e)
        assert told and not [k for k in told if idx.get(k) is not None], f"{policy}, {label}: told {told}, still here"
        _every_slot_reclaimable(idx, f"{policy}, {label}")

    assert _sweep(TierIndex.reserve, setup, lambda idx: idx.reserve(b"z", uuid.uuid4()), after) > 1


@pytest.mark.parametrize("how", ["publish_all", "publish"])
@pytest.mark.parametrize("policy", POLICIES)
def test_an_interrupted_publish_leaves_the_entry_ready_in_the_order_when_run_again(policy: str, how: str) -> None:
    """A store's report publishing its entries (``publish_all``; a read's or a fetch's, ``publish`` of one) broken off
    anywhere and applied again, as the core does: every entry is READY and in the order."""
    def setup() -> tuple[TierIndex, list[Entry]]:
        idx = TierIndex(SLOTS, policy=make_policy(policy, SLOTS))
        idx.link(KEYS)
        _, new, _ = idx.reserve_absent(KEYS, uuid.uuid4(), (), None)
        if how == "publish":
            idx.publish_all(new[1:])
        return idx, new

    def call(st: tuple[TierIndex, list[Entry]]) -> None:
        if how == "publish":
            st[0].publish(st[1][0])
        else:
            st[0].publish_all(st[1])

    def after(st: tuple[TierIndex, list[Entry]], label: str) -> None:
        call(st)
        _every_slot_reclaimable(st[0], f"{policy}, {label}")

    fn = TierIndex.publish if how == "publish" else TierIndex.publish_all
    assert _sweep(fn, setup, call, after) > 1 or (policy, how) == ("lru", "publish_all")
