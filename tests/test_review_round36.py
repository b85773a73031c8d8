"""Review round 36: the interrupt repairs of round 34 (``TierIndex._repair``, the policies' ``holds``/``restore``)
and the exposition's bad-input checks.

Each test fails on the tree it was written against (main at 769b6a3).  Method for the index tests: the interrupt
sweeps' return hook (``tests/test_interrupt_locks.py``: ``KeyboardInterrupt`` at the k-th call return inside the
method, for every k until the call runs through), then what the engine does next (a reservation that did not get
its entry is retried), compared with the same call run through uninterrupted.  Round 34's sweeps
(``tests/test_interrupt_policy.py``) only check that every slot can still be reclaimed; these check that the
repair puts each entry back *where its state says* (docs/architecture.md, invariant 1: "a lease, a release, a
publish, a removal or another policy's eviction broken off puts each entry it touched where its state says"),
i.e. that the policy's order after the repair is the one the uninterrupted call leaves.

What it proved wrong, fixed since: (1) an eviction broken off after S3-FIFO's, ARC's or PrefixLRU's ``victim`` gave
its entry up (ghost recorded, node dropped) was undone, and the retry evicted another block: the index finishes it
now (``Policy.gave_up``, ``TierIndex._repair(evicting=True)``), and an entry S3-FIFO's walk took off its cold end
goes back there; (2) ARC's ``insert`` of a ghost hit, run again, adapted ``p`` twice or filed it in T1: it files the
entry with ``p`` before anything else changes; (3) PrefixLRU's ``restore`` left a child of the restored block an
orphan: it relinks the block under its parent and takes its children out of the orphans; (4) ``serve_metrics`` with
an address that resolves to nothing raised ``socket.gaierror``: ``ConfigError`` naming it.

Deterministic: no threads, no randomness, no sleeps.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable

import pytest

from test_interrupt_policy import _sweep as _sweep_points
from tiered_kv.core.index import TierIndex
from tiered_kv.core.policy import _ORPHAN, ARC, PrefixLRU, make_policy
from tiered_kv.errors import TieredKVError

N = 8
CHAIN = [b"k%d" % i for i in range(N)]


# ============================================================================ 1. eviction: the retry's victim
def _full_chain(policy: str) -> TierIndex:
    """A full index of ``N`` READY entries, one prefix chain k0 -> k1 -> ... -> k7 (PrefixLRU's links), the first
    three used again (ARC's T2, S3-FIFO's frequencies)."""
    idx = TierIndex(N, policy=make_policy(policy, N))
    idx.link(CHAIN)
    for k in CHAIN:
        e = idx.reserve(k, uuid.uuid4())
        assert e is not None
        idx.publish(e)
    idx.ready_run(CHAIN[:3])
    return idx


def _outcome(idx: TierIndex) -> tuple[list[bytes], Any]:
    """What the next evictions depend on: the keys held, and ARC's target size ``p``."""
    return sorted(e.key for e in idx.entries()), getattr(idx.policy, "p", None)


@pytest.mark.parametrize("policy", ["s3fifo", "arc", "prefix"])
def test_a_broken_off_eviction_retried_evicts_the_block_an_uninterrupted_one_does(policy: str) -> None:
    """A reservation in a full tier (one victim's eviction) broken off by an interrupt and retried -- what the engine
    does -- evicts another block than the same reservation run through, and (ARC) moves ``p``, at the points where
    the policy had already *given up* its victim but ``_evict_one`` did not have it yet:

    * S3-FIFO: ``victim``'s walk pops the never-used k3 off the cold end of the small FIFO (``popitem``), then
      drops its frequency and puts its key in the ghost.  Broken off at the ``popitem``'s return, ``_repair()`` ->
      ``S3FIFO.restore`` puts k3 at the *newest* end of the small FIFO (a whole new round for the block being
      evicted); broken off after it was ghosted (``len(ghost)``, or ``victim``'s return: ``_evict_one``'s
      ``entry`` still None), ``restore`` (``k not in freq``) -> ``unlease`` -> ``insert`` finds the key in the
      ghost: a *ghost hit*, so the coldest block is promoted into the MAIN FIFO.  Either way the retry evicts k4,
      a block an uninterrupted run keeps;
    * ARC: ``_replace`` moved T1's oldest (k3) into B1; ``restore`` -> ``unlease`` -> ``insert`` finds it in B1: a
      ghost hit -- ``p`` grows by one (0 -> 1) and the never-reused block lands in T2; the retry evicts k4;
    * PrefixLRU: ``_drop`` of the tail k7 took it out of its parent's children and requeued the parent k6 as a leaf;
      ``PrefixLRU.restore`` (the node still there) only re-places k7: k6 stays a leaf with no child, and the retry
      evicts k6 -- the middle of the chain, before its tail, the one thing this policy exists to avoid ("tails go
      before heads"); k7 is left behind a hole (a prefix lookup never reaches it).

    ``tests/test_interrupt_policy.py`` does not see it: it checks only that every slot can be reclaimed.  At fault:
    ``TierIndex._evict_one``'s handler (``core/index.py``) sends a victim the policy already gave up back through
    ``_repair`` -> ``policy.restore``, and the policies' ``restore`` (``core/policy.py``) treats it as a new key or
    re-places only its node.  Fix: let the policy say whether it gave an entry up (S3-FIFO: key not in ``freq`` and
    in ``ghost``; ARC: key in ``b1``/``b2`` or T1 whole-cache; PrefixLRU: key not in ``nodes`` or its node out of
    its parent's children) and have the handler finish that eviction (``_evicted``, as it does once ``entry`` is
    set) instead of restoring it, and put an entry a walk popped back at the *cold* end of the queue it left
    (``move_to_end(k, last=False)``); or make ``restore`` undo the victim's half-steps exactly (back at the cold end
    of the queue it left, its ghost key and parent link as before, ``p`` untouched)."""
    ref_idx = _full_chain(policy)
    assert ref_idx.reserve(b"z", uuid.uuid4()) is not None
    ref = _outcome(ref_idx)
    wrong: list[str] = []

    def after(idx: TierIndex, label: str) -> None:
        if idx.get(b"z") is None:   # the engine's retry of a reservation that did not happen
            assert idx.reserve(b"z", uuid.uuid4()) is not None, label
        got = _outcome(idx)
        if got != ref:
            kept = sorted(set(got[0]) - set(ref[0]))
            lost = sorted(set(ref[0]) - set(got[0]))
            wrong.append(f"{label}: kept {kept} and evicted {lost} instead; p {got[1]} (uninterrupted: {ref[1]})")

    assert _sweep_points(TierIndex.reserve, lambda: _full_chain(policy),
                         lambda idx: idx.reserve(b"z", uuid.uuid4()), after) > 1
    assert not wrong, f"{policy}: an eviction broken off and retried evicts another block:\n  " + "\n  ".join(wrong)


# ============================================================================ 2. ARC: a publish of a ghost hit
def _arc_ghost_hit() -> tuple[TierIndex, Any]:
    """ARC over 4 slots: T1 [b, e], T2 [c, d], B1 [a]; then ``a`` reserved again (a ghost hit: its victim adapted
    ``p`` and marked it), its entry about to be published (a promote's or a store's copy landed)."""
    idx = TierIndex(4, policy=ARC(4))
    for k in (b"a", b"b", b"c", b"d"):
        e = idx.reserve(k, uuid.uuid4())
        assert e is not None
        idx.publish(e)
    idx.ready_run([b"c"])
    idx.ready_run([b"d"])
    e = idx.reserve(b"e", uuid.uuid4())
    assert e is not None
    idx.publish(e)
    p = idx.policy
    assert (list(p.t1), list(p.t2), list(p.b1)) == ([b"b", b"e"], [b"c", b"d"], [b"a"])   # the setup it needs
    z = idx.reserve(b"a", uuid.uuid4())
    assert z is not None
    return idx, z


def _arc_state(idx: TierIndex) -> tuple[Any, ...]:
    p: Any = idx.policy
    return p.p, list(p.t1), list(p.t2), list(p.b1), list(p.b2)


def test_arc_an_interrupted_publish_of_a_ghost_hit_adapts_p_once_and_files_it_in_t2() -> None:
    """ARC's ``insert`` of a ghost hit is several calls: it pops the key's ``adapted`` mark (set by the victim that
    already moved ``p`` for it), then pops the key from B1/B2, then files it in T2.  A publish broken off after the
    mark was popped is repaired by ``_repair`` -> ``Policy.restore`` (ARC keeps the default: ``unlease``), which
    finds no lease and runs ``insert`` again from the start: with the mark gone it adapts ``p`` a second time
    for the same miss (``p`` 2.0 instead of 1.0); broken off after the key left B1, it files the ghost hit in T1 as
    a new key.  The class docstring: "a new key found in B1 (B2) grows (shrinks) ``p`` and enters T2"; the
    ``adapted`` marks exist so that ``p`` moves once per miss.  At fault: ``ARC.insert``/``Policy.restore``
    (``core/policy.py``): ``restore`` re-runs an ``insert`` that is not idempotent.  Fix: in ``insert`` decide
    with no call (``k in self.adapted``, ``k in b1``/``b2``), file the entry in T2 first and drop the mark and the
    ghost key after it (an interrupt then leaves it held: ``holds`` is true and nothing is restored); or an
    ``ARC.restore`` that files a key still marked or still a ghost in T2 without adapting ``p``."""
    ref_idx, z = _arc_ghost_hit()
    ref_idx.publish(z)
    ref = _arc_state(ref_idx)
    assert ref[0] == 1.0 and ref[2][-1] == b"a"
    wrong: list[str] = []

    def after(st: tuple[TierIndex, Any], label: str) -> None:
        idx, e = st
        idx.publish(e)   # the report applied again, as the core does (a READY entry: nothing more)
        got = _arc_state(idx)
        if got != ref:
            wrong.append(f"{label}: (p, T1, T2, B1, B2) = {got}")

    assert _sweep_points(TierIndex.publish, _arc_ghost_hit, lambda st: st[0].publish(st[1]), after) > 1
    assert not wrong, (f"ARC after an interrupted publish of a ghost hit differs from the uninterrupted {ref}:\n  "
                       + "\n  ".join(wrong))


# ============================================================================ 3. PrefixLRU: a publish that adopts
def _prefix_return() -> tuple[TierIndex, Any]:
    """PrefixLRU over 4 slots, the chain a -> b -> c -> d held; ``b`` invalidated (``c`` becomes an orphan), then
    stored again: its new entry about to be published."""
    idx = TierIndex(4, policy=PrefixLRU(4))
    keys = [b"a", b"b", b"c", b"d"]
    idx.link(keys)
    for k in keys:
        e = idx.reserve(k, uuid.uuid4())
        assert e is not None
        idx.publish(e)
    b = idx.get(b"b")
    assert b is not None
    idx.remove(b)
    p: Any = idx.policy
    assert list(p.orphans) == [b"c"]   # the setup it needs
    z = idx.reserve(b"b", uuid.uuid4())
    assert z is not None
    return idx, z


def _orphans_with_a_parent(idx: TierIndex) -> list[bytes]:
    """Nodes marked or queued as orphans whose parent is held (PrefixLRU: "orphans: a block whose parent left this
    tier while it stayed")."""
    p: Any = idx.policy
    return sorted(k for k, n in p.nodes.items() if (n.orphan or n.q == _ORPHAN) and n.parent in p.nodes)


def test_prefix_an_interrupted_publish_of_a_returning_block_leaves_no_orphan_under_it() -> None:
    """PrefixLRU's ``insert`` of a block that comes back (its children held meanwhile, orphans) re-adopts them: each
    child leaves the orphans queue.  A publish broken off inside that ``insert`` (after the node is made, before or
    while its children are un-orphaned) is repaired by ``PrefixLRU.restore``, which finds the node and only
    re-places it (``_place``): its children stay orphans -- marked orphan, or unmarked but still in the orphans
    queue -- though their parent is held, so they are the next victims, ahead of every leaf, and the chain is cut
    in its middle (the child's own children are orphaned in turn).  The same holds for a removal or eviction
    broken off inside ``_drop`` (see test 1).  At fault: ``PrefixLRU.restore`` (``core/policy.py``).  Fix: have
    ``restore`` finish the link bookkeeping ``insert`` does -- adopt the node under its parent (``links``/its
    ``parent``), clear the orphan mark of each held child and requeue it -- each step skipped where done; or
    make ``insert`` place the node last, so that an interrupt before it finds the node absent and ``restore``
    runs ``insert`` again whole."""
    ref_idx, z = _prefix_return()
    ref_idx.publish(z)
    assert not _orphans_with_a_parent(ref_idx)
    wrong: list[str] = []

    def after(st: tuple[TierIndex, Any], label: str) -> None:
        idx, e = st
        idx.publish(e)
        bad = _orphans_with_a_parent(idx)
        if bad:
            p: Any = idx.policy
            victim = p.peek((), None)
            wrong.append(f"{label}: orphans under a held parent {bad}; next victim "
                         f"{None if victim is None else victim.key!r}")

    assert _sweep_points(TierIndex.publish, _prefix_return, lambda st: st[0].publish(st[1]), after) > 1
    assert not wrong, "PrefixLRU after an interrupted publish:\n  " + "\n  ".join(wrong)


# ============================================================================ 4. exposition: an unusable addr
@pytest.mark.parametrize("addr", ["1:2:3", "::1::2"])
def test_serve_metrics_an_addr_that_is_no_address_is_a_config_error_naming_it(addr: str) -> None:
    """Round 34 made ``serve_metrics`` document "A bad ``port``, ``addr`` or ``registry`` raises
    :class:`~tiered_kv.errors.ConfigError`, naming it", and errors.py promises that every error on bad input derives
    from ``TieredKVError`` and names the offending value.  Only the *type* of ``addr`` is checked: a string that is
    no host name nor IP address (here malformed IPv6 literals: a ':' in it, so no name lookup is involved) raises
    ``socket.gaierror: [Errno -2] Name or service not known`` from ``wsgiref.make_server`` -- not a
    ``TieredKVError``, and not naming the address.  At fault: ``tiered_kv/exposition.py: serve_metrics``.  Fix: turn
    the ``OSError`` of resolving/binding ``(addr, port)`` (``socket.gaierror`` at least) into ``ConfigError(f"addr
    {addr!r} ...: {exc}")``, or resolve ``addr`` with ``socket.getaddrinfo`` before ``make_server``."""
    raised: Any = None
    try:
        srv = serve_metrics_call(addr)
    except TieredKVError as exc:
        assert addr in str(exc)
        return
    except OSError as exc:
        raised = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    else:
        srv.close()
        pytest.fail(f"serve_metrics(0, addr={addr!r}) started an endpoint at {srv.url}")
    pytest.fail(f"serve_metrics(0, addr={addr!r}) raised {raised} (not a TieredKVError naming the addr)")


def serve_metrics_call(addr: str) -> Any:
    from prometheus_client import CollectorRegistry

    from tiered_kv.exposition import serve_metrics
    return serve_metrics(0, addr=addr, registry=CollectorRegistry())
