"""A seeded engine whose every call may be interrupted: exactly-once reporting and no leak, whatever call a
``KeyboardInterrupt`` breaks off.

Each of 30 seeded runs makes 60 random engine calls on a small manager (``store``/``store_many`` from rows 0..9,
``load``/``load_many`` into rows 10..14, ``cancel``, ``free_block`` -- retried until True, then the engine writes
the row --, ``invalidate``, ``poll``, ``wait``); each call first runs once interrupted at a random call return
made from library code (the sweep's hook, ``test_review_round29_sweep._interrupt_at``), then, as an engine
would, the same call again.  A store or load whose interrupted call never returned its job is not held by the
caller: it may still be reported (a completion naming a job the caller does not know), and it must leak
nothing.  After the run, :func:`test_review_round29_sweep.check` (host tier) or
:func:`test_review_round31.check_disk` (disk tier): every job the caller holds reported exactly once, nothing
in flight, every row free, every host entry READY and unleased with its slot, the gauges at 0, no row written
after its load was reported, every ready key loads back the bytes its store copied.

With a disk tier (thread mode) ``poll``/``wait`` are interrupted too: a spill's start is finished or undone
(``TierCore._spill_start_broken``) and its report applied as a store's is (``_spill_reported`` runs again,
``_spill_applied`` once); before those, 19 of 40 seeds leaked host leases or left spill tokens behind.  Below,
sweeps of the spill's steps on their own: every call return inside each.  A read from disk's report is swept in
``tests/test_interrupt_promote.py``, the remote tier's steps in ``tests/test_interrupt_remote.py``.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Optional

import pytest

import tiered_kv.manager
from disk_helpers import content
from test_review_round29_sweep import ROW_BYTES, World, _interrupt_at, _run_with, check, key
from test_review_round31 import check_disk
from tiered_kv.errors import BlockBusyError
from tiered_kv.jobs import JobKind

STEPS = 60
WAIT_S = 0.5


class _World(World):
    """:class:`World` that keeps every job a completion names alive: ``seen`` counts completions by ``id``, and a
    job the caller never held (its call interrupted) would otherwise be freed and its id reused by a new one."""

    def __init__(self, seed: int, disk_path: Optional[str], disk_io: str = "thread",
                 remote_url: Optional[str] = None) -> None:
        super().__init__(seed, disk_path, disk_io, remote_url, f"r29s-{seed}" if remote_url else "r29s")
        self.alive: list[Any] = []

    def take(self, comps: list[Any]) -> None:
        self.alive.extend(c.job for c in comps)
        super().take(comps)


def _twice(rnd: random.Random, call: Callable[[], Any]) -> Any:
    """``call()`` interrupted at a random call return, then ``call()`` again (what the engine does after an
    interrupt it caught); returns the second call's result."""
    _run_with(_interrupt_at(rnd.randrange(1, 80))[0], call)
    return call()


def _engine(seed: int, disk_path: Optional[str], remote_url: Optional[str] = None,
            settle: Optional[Callable[[Any, str], None]] = None) -> None:
    """``remote_url``: a remote tier too, and more stores and ``lookup`` among the calls (a key the host evicted is
    asked from the server, and fetched); ``settle(world, label)`` waits for its writes, probes and fetches before
    the checks (taking the completions it meets).  The keys are then content-addressed, as a serving engine's
    are (a key names a prefix of tokens, and its KV is always the same): before a store the engine frees the row
    and writes the key's bytes there (``disk_helpers.content``).  A store of a key the server holds is not
    skipped as one the host or disk holds is, so with a key's bytes changing from store to store a failed or
    cancelled store would leave the server's older value to be fetched back under it."""
    rnd = random.Random(seed)
    w = _World(seed, disk_path, remote_url=remote_url)
    m = w.mgr
    ops = ["store", "store_many", "load", "load_many", "cancel", "free", "inval", "poll", "wait"]
    steps = STEPS
    if remote_url is not None:   # more stores (the host evicts) and lookups (evicted keys are fetched back)
        ops += ["lookup", "lookup", "lookup", "store_many", "store_many"]
        steps = 2 * STEPS
    try:
        for _ in range(steps):
            op = rnd.choice(ops)
            try:
                if op in ("store", "store_many"):
                    n = 1 if op == "store" else 2
                    rs, ks = rnd.sample(range(10), n), [key(x) for x in rnd.sample(range(24), n)]
                    if remote_url is not None:
                        for k, r in zip(ks, rs):
                            w.free_and_rewrite(r, bytes(content(k, ROW_BYTES).numpy()), f"seed {seed}")
                    j = _twice(rnd, lambda: m.store(ks[0], rs[0]) if n == 1 else m.store_many(ks, rs))
                    # the bytes each key holds: its row's where the retry's job stores it; where not, the interrupted
                    # call's job may or may not have stored it (or an older store did): not checked
                    got = {} if j is None else dict(zip(j.keys, j.blocks))
                    for k, r in zip(ks, rs):
                        if k in got or remote_url is not None:
                            w.expect[k] = w.row(r)
                        else:
                            w.expect.pop(k, None)
                    if j is not None:
                        w.held.append(j)
                elif op == "load":
                    k, r = key(rnd.randrange(0, 24)), rnd.randrange(10, 15)
                    _twice(rnd, lambda: w.load(k, r))
                elif op == "load_many":
                    ks, rs = [key(x) for x in rnd.sample(range(24), 2)], rnd.sample(range(10, 15), 2)
                    _twice(rnd, lambda: w.load_many(ks, rs))
                elif op == "cancel" and w.held:
                    j = rnd.choice(w.held)
                    _twice(rnd, lambda: m.cancel(j))
                elif op == "free":
                    r = rnd.randrange(0, 15)
                    _run_with(_interrupt_at(rnd.randrange(1, 80))[0], lambda: m.free_block(r))
                    w.free_and_rewrite(r, bytes([rnd.randrange(256)]) * ROW_BYTES, f"seed {seed}")
                elif op == "inval":
                    k = key(rnd.randrange(0, 24))
                    _twice(rnd, lambda: m.invalidate(k))
                    if remote_url is None:
                        w.expect.pop(k, None)
                elif op == "lookup":
                    ks = [key(x) for x in sorted(rnd.sample(range(24), 3))]
                    _twice(rnd, lambda: m.lookup(ks))
                elif op == "poll":
                    _run_with(_interrupt_at(rnd.randrange(1, 120))[0], lambda: w.take(m.poll()))
                    w.take(m.poll())
                else:
                    _run_with(_interrupt_at(rnd.randrange(1, 200))[0], lambda: w.take(m.wait(timeout=0.05)))
                    w.take(m.wait(timeout=0.05))
            except BlockBusyError:
                pass
        label = f"seed {seed} ({'remote' if remote_url else 'disk' if disk_path else 'host'} tier)"
        if settle is not None:
            settle(w, label)
        if disk_path is None:
            check(w, label)
        else:
            check_disk(w, label)
    finally:
        m.close()


def test_a_seeded_engine_every_call_interrupted_host_tier() -> None:
    for seed in range(30):
        _engine(seed, None)


def test_a_seeded_engine_every_call_interrupted_disk_tier(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiered_kv.manager, "CLOSE_TIMEOUT_S", WAIT_S)
    for seed in range(30):
        _engine(seed, str(tmp_path / f"d{seed}"))


def _internal_counts_agree(core: Any, label: str) -> None:
    """The in-flight counts of the internal jobs and ``spill_extra`` say what the job map holds."""
    jobs = {id(j): j for j in core.jobs.values()}.values()
    for kind in (JobKind.SPILL, JobKind.PUT):
        n = sum(1 for j in jobs if j.kind is kind)
        assert core.n_in_flight[kind] == n, f"{label}: {kind.value} in flight {core.n_in_flight[kind]}, jobs {n}"
    extra = len(core.jobs) - len(jobs)
    assert core.spill_extra == extra, f"{label}: spill_extra {core.spill_extra}, the jobs' extra tokens {extra}"


def _interrupted(fn: Callable[..., Any], k: int, call: Callable[[], Any], what: str) -> tuple[bool, str]:
    """``call()`` with an interrupt at the ``k``-th call return inside ``fn``: whether it fired, and a label naming
    where; only the interrupt may come out."""
    from test_interrupt_locks import _call_with, _interrupt_inside

    hook, fired = _interrupt_inside(fn, k)
    _, exc = _call_with(hook, call)
    label = f"{what}: {fn.__name__} interrupted at {fired[0] if fired else 'no point (ran through)'}"
    assert exc is None or (fired and isinstance(exc, KeyboardInterrupt)), f"{label}: raised {exc!r}"
    return bool(fired), label


def _sweep(one: Callable[[int], bool], least: int) -> None:
    """``one(k)`` for k = 1, 2, ... until the call ran through with no interrupt; at least ``least`` points."""
    from test_interrupt_locks import MAX_K

    for k in range(1, MAX_K):
        if not one(k):
            assert k > least, f"only {k - 1} call returns swept"
            return
    raise AssertionError(f"more than {MAX_K} call returns")


def _settled(w: _World, label: str) -> None:
    """After the spill's report: the counts agree with the job map, no spill in flight, nothing leased, pinned or
    lost (``check_disk``)."""
    core = w.mgr._core
    _internal_counts_agree(core, label)
    assert core.n_in_flight[JobKind.SPILL] == 0, f"{label}: a spill still in flight"
    check_disk(w, label)
    assert not core.index._pinned, f"{label}: pinned at quiescence: {core.index._pinned}"


@pytest.mark.parametrize("io", ["thread", "process"])
def test_an_interrupted_spill_start_is_finished_or_undone(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                          io: str) -> None:
    """A store's report applied by ``wait()`` starts its write-through spill: an interrupt at every call return inside
    ``TierCore._start_spills`` (and what it calls: the disk reservations, the pins, the store's queueing, the job's
    registration) leaves it all done or none of it (``TierCore._spill_start_broken``): ``n_in_flight[SPILL]`` and
    ``spill_extra`` agree with the job map, and once the spill's report is applied nothing is leased, in flight or
    lost (``check_disk``: every host entry READY and unleased, every ready key loads back its bytes).  Before,
    a job registered with its count taken in two steps took the count to -1, the disk writer was taken for dead
    (``Thread.is_alive()`` interrupted), and a start broken off after its pins left its host entries leased."""
    from tiered_kv.core.tiers import TierCore

    monkeypatch.setattr(tiered_kv.manager, "CLOSE_TIMEOUT_S", WAIT_S)

    def one(k: int) -> bool:
        w = _World(29, str(tmp_path / f"d{k}"), disk_io=io)
        m = w.mgr
        try:
            assert w.store_many([key(0), key(1)], [0, 1]) is not None
            w.expect.update({key(0): w.row(0), key(1): w.row(1)})
            fired, label = _interrupted(TierCore._start_spills, k, lambda: w.take(m.wait(timeout=WAIT_S)), io)
            _internal_counts_agree(m._core, label)
            w.take(m.wait(timeout=WAIT_S))
            assert m.flush(timeout=5), label
            w.take(m.poll())
            _settled(w, label + ", its report applied")
            return fired
        finally:
            m.close()

    _sweep(one, 10)


def test_an_interrupted_pin_pins_each_entry_or_not() -> None:
    """``TierIndex.pin_all`` interrupted at every call return inside it: each entry is pinned (one lease more, in the
    pinned set) or untouched -- never in the set without its lease (the order of the two steps before), which
    ``TierCore._spill_start_broken`` could not tell from a pin, and which a later release would not undo."""
    import uuid

    from test_interrupt_locks import MAX_K, _call_with, _interrupt_inside
    from tiered_kv.core.index import TierIndex

    for k in range(1, MAX_K):
        idx = TierIndex(4)
        _, new, _ = idx.reserve_absent([b"a", b"b", b"c"], uuid.uuid4(), (), None)
        idx.publish_all(new)
        hook, fired = _interrupt_inside(TierIndex.pin_all, k)
        _, exc = _call_with(hook, lambda: idx.pin_all(new))
        assert exc is None or (fired and isinstance(exc, KeyboardInterrupt)), exc
        for e in new:
            assert (e in idx._pinned) == (e.readers == 1) and e.readers <= 1, f"k={k}: {e!r}, pinned {idx._pinned}"
        if not fired:
            assert all(e.readers == 1 for e in new)
            break


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "arc", "prefix"])
def test_an_interrupted_remove_never_leaves_a_removed_entry_in_the_policy(policy: str) -> None:
    """``TierIndex.remove`` of a READY entry (``invalidate``'s ``drop_key``) interrupted at every call return inside
    it, then made again as the engine's retried ``invalidate`` would (if the key is still there): every entry the
    policy would evict is the map's, live; the key is gone with its slot free; and the index evicts every other
    entry to make room for new keys without an error.  Before, the entry left the map and was marked removed
    before the policy forgot it: interrupted inside the policy's ``remove`` (the default one: at ``od.get``'s
    return), it stayed in the eviction order, dead, and a retry found nothing to remove.  Its eviction later
    raised ``KeyError`` out of ``store_many`` (the remote tier's seeded engine, seed 8), or, had the key been
    stored again meanwhile, would have taken that new entry out of the map."""
    import uuid

    from test_interrupt_locks import MAX_K, _call_with, _interrupt_inside
    from tiered_kv.core.index import TierIndex
    from tiered_kv.core.policy import make_policy

    keys = [b"a", b"b", b"c", b"d"]
    for k in range(1, MAX_K):
        idx = TierIndex(4, policy=make_policy(policy, 4))
        _, new, _ = idx.reserve_absent(keys, uuid.uuid4(), (), None)
        idx.publish_all(new)
        victim = new[1]
        hook, fired = _interrupt_inside(TierIndex.remove, k)
        _, exc = _call_with(hook, lambda: idx.remove(victim))
        assert exc is None or (fired and isinstance(exc, KeyboardInterrupt)), exc
        label = f"{policy}, k={k} ({fired[0] if fired else 'ran through'})"
        if idx.get(b"b") is victim:   # still in the index: the retry removes it
            idx.remove(victim)
        assert idx.get(b"b") is None and not victim.live and victim.slot == -1, f"{label}: {victim!r}"
        # every other entry evicted for new keys: the policy gives up only entries of the map, live
        _, again, full = idx.reserve_absent([b"w", b"x", b"y", b"z"], uuid.uuid4(), (), None)
        assert full == 0 and len(again) == 4, f"{label}: {full} keys found no slot"
        assert sorted(e.key for e in idx.entries()) == [b"w", b"x", b"y", b"z"], label
        assert idx.used_slots == 4 and len(set(e.slot for e in again)) == 4, f"{label}: slots {[e.slot for e in again]}"
        if not fired:
            break


def test_an_interrupted_eviction_never_leaves_a_live_entry_out_of_the_order() -> None:
    """A reservation in a full host tier (default policy) evicts its victim (``TierIndex._evict_one``); interrupted at
    every call return inside that, then made again: every entry is either in the eviction order or gone, with its
    slot free.  Before, the policy's ``victim`` took the entry out of the order first: an interrupt at its return,
    or at the eviction hook's, left it live in the map and out of the order, never evicted until its next load."""
    import uuid

    from test_interrupt_locks import MAX_K, _call_with, _interrupt_inside
    from tiered_kv.core.index import TierIndex

    told: list[bytes] = []
    for k in range(1, MAX_K):
        told.clear()
        idx = TierIndex(4, on_evict=lambda e: told.append(e.key))
        _, new, _ = idx.reserve_absent([b"a", b"b", b"c", b"d"], uuid.uuid4(), (), None)
        idx.publish_all(new)
        hook, fired = _interrupt_inside(TierIndex._evict_one, k)
        w = uuid.uuid4()
        _, exc = _call_with(hook, lambda: idx.reserve(b"z", w))
        assert exc is None or (fired and isinstance(exc, KeyboardInterrupt)), exc
        label = f"k={k} ({fired[0] if fired else 'ran through'})"
        if idx.get(b"z") is None:   # the engine's retry
            assert idx.reserve(b"z", w) is not None, label
        lru = idx._lru
        assert lru is not None
        live = [e for e in idx.entries() if e.key != b"z"]
        assert all(lru.get(e.key) is e for e in live), f"{label}: out of the order: {live}, order {list(lru)}"
        assert len(live) == 3 and not new[0].live and new[0].slot == -1, f"{label}: {new[0]!r}"
        assert told and set(told) == {b"a"}, f"{label}: the hook was told {told}"
        assert idx.used_slots == 4 and len(idx._free) == 0, label
        if not fired:
            break


@pytest.mark.parametrize("parts", ["all_written", "one_invalidated"])
def test_an_interrupted_spill_report_is_applied_again_once(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                            parts: str) -> None:
    """A write-through spill's report applied by ``flush()``, interrupted at every call return inside
    ``TierCore._spill_reported`` (the part that may run again): the report stays queued and the next pass applies
    it -- the job's tokens all leave ``jobs``, ``spill_extra`` and the in-flight count drop once, every host lease
    goes, each part is published (or, invalidated, let go and counted stale once), nothing leaks (``check_disk``).
    ``one_invalidated`` takes the per-part path, ``all_written`` the batched one.  Before, the report was applied
    once with its record taken first, and an interrupt inside lost the rest of it (host entries leased for good,
    the other parts' tokens left in ``jobs``)."""
    from disk_helpers import metric_sum
    from tiered_kv.core.tiers import TierCore

    monkeypatch.setattr(tiered_kv.manager, "CLOSE_TIMEOUT_S", WAIT_S)

    def one(k: int) -> bool:
        w = _World(29, str(tmp_path / f"d{k}"))
        m = w.mgr
        core = m._core
        try:
            assert w.store_many([key(0), key(1)], [0, 1]) is not None
            w.take(m.wait(timeout=WAIT_S))   # the store's report starts the spill
            assert core.n_in_flight[JobKind.SPILL] == 1
            w.expect[key(0)] = w.row(0)
            if parts == "one_invalidated":
                m.invalidate(key(1))
            else:
                w.expect[key(1)] = w.row(1)
            fired, label = _interrupted(TierCore._spill_reported, k, lambda: m.flush(timeout=5), parts)
            assert m.flush(timeout=5), label
            w.take(m.poll())
            assert not core.jobs, f"{label}: {core.jobs}"
            stale = metric_sum(m, "tiered_kv_stale_callbacks_total", kind="spill")
            assert stale == (1 if parts == "one_invalidated" else 0), f"{label}: {stale} stale spill reports"
            _settled(w, label)
            return fired
        finally:
            m.close()

    _sweep(one, 5)
