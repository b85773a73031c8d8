"""Review round 32: an adversarial review of 90c435b, 523451f and 3ca95e4 (interrupt-safe submits, report
application with a commit, raw locks in the disk and remote I/O threads).

Findings (both fixed; the first one's test fails before its fix and passes now):

1. ``test_a_store_report_applied_again_never_inserts_its_entry_twice`` -- ``_store_reported`` was not "safe to run
   again" under a non-default host policy: ``publish_entries`` -> ``TierIndex.publish_all`` called
   ``policy.insert`` again on an entry the broken-off pass had already published.  With S3-FIFO the entry ended up
   in both FIFOs, and a later ``store()`` raised ``KeyError``.  Fixed: ``publish_all``/``publish`` pass over an
   entry already READY.
2. ``TierIndex.release_taken`` took each entry off the front of the list with ``list.pop(0)``: O(n^2) for a big
   ``load_many`` (releasing 65536 leases ~20x slower than leasing them, 8192 in 4.4 ms).  A timing is no unit
   test here; fixed (each place set to None, then the list cleared: O(n)) and measured by hand (the issue note).

Sound (ordinary tests that fail if the guarded line is broken): ``test_the_same_report_object_queued_twice_is_
applied_once_and_counted_stale`` (``TierCore.apply_arrived``'s ``self.applied = None`` after the popleft).
Read and found sound without a test of their own (normal path): the split of ``_apply_store``/``_apply_load`` into
``*_reported``/``*_applied`` (same states, completions and counts as 13f3c2f, cancelled loads counted once);
``drop_store``'s abort-then-``writer_done`` order; ``begin_load`` registering before its leases and promotes;
``_block_until``/``simple_block_until`` applying what ``CompletionQueue.wait`` left queued on every pass;
``_evict_lru``'s single C call; the disk writer's touch de-dup and spill bound (same counts as before, one step);
``IOThread.wait_idle``'s waiter lock (removed on every path without an interrupt; ``notify_all`` releases it).
"""

from __future__ import annotations

import sys
from pathlib import Path

from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).parent))

from fakes import fill_row, make_config, make_fake_manager, make_kv, mgr_metric  # noqa: E402
from test_review_round29_sweep import _interrupt_on, _run_with  # noqa: E402


def _stored(mgr, mover, kv, k: bytes, row: int):  # type: ignore[no-untyped-def]
    fill_row(kv, row, k)
    job = mgr.store(k, row)
    assert job is not None, k
    mover.complete(job)
    return job


def test_a_store_report_applied_again_never_inserts_its_entry_twice() -> None:
    """What was wrong: 523451f makes ``TierCore.apply`` run the front end's ``on_store`` again when an interrupt
    broke off the previous pass before the commit, and documents ``TierManager._store_reported`` as "safe to run
    again".  It is not: its last call, ``core.publish_entries(job)`` -> ``TierIndex.publish_all``, publishes each
    live entry with ``policy.insert(e)`` (any policy but the default LRU's dict store).  An interrupt at the
    return of ``publish_entries`` (in ``_store_reported``, before ``apply``'s commit) leaves the entries READY
    and in the policy; the next ``poll()`` applies the report again and inserts them a second time.  S3-FIFO's
    ``insert`` sends a key found in its ghost to the main FIFO, and the second insert (ghost entry gone) to the
    small FIFO as well: one entry in both.  It is then evicted from the small FIFO (its freq deleted, slot freed)
    while the main FIFO still holds it, and the next victim search reaching the main FIFO raises
    ``KeyError`` from ``store()`` (or, had the key been stored again, returns the dead entry and ``_evicted``
    deletes the live one from the map and appends slot -1 to the free list).

    How it was found: reading ``_store_reported``'s claim against ``publish_all``; proven with round 29's
    ``_interrupt_on`` hook at the return of ``publish_entries`` in ``_store_reported`` (manager.py), fake mover,
    4 host slots, ``host_policy="s3fifo"``.

    Fixed as proposed: the publish is idempotent.  ``TierIndex.publish_all`` (and ``publish``): an entry already READY was
    published by a pass an interrupt broke off -- append it to ``out`` if live and ``continue`` without calling
    ``policy.insert``/``lru[...] =`` (``if e.state is _READY: ...`` before ``e.state = _READY``)."""
    kv = make_kv(64)
    cfg = make_config(host_slots=4, host_policy="s3fifo", host_evict_ahead_blocks=0)
    mgr, mover = make_fake_manager(cfg, kv, CollectorRegistry())
    pol = mgr._core.index.policy
    _stored(mgr, mover, kv, b"k", 0)
    mgr.poll()
    for i, k in enumerate([b"a", b"b", b"c", b"d"]):   # d's reservation evicts k (freq 0) into the ghost
        _stored(mgr, mover, kv, k, 1 + i)
        mgr.poll()
    assert b"k" in pol.ghost
    assert mgr.free_block(0)
    job = _stored(mgr, mover, kv, b"k", 0)   # k again: its publish finds it in the ghost -> main FIFO
    hook, fired = _interrupt_on("manager.py", "_store_reported", "publish_entries")
    _run_with(hook, mgr.poll)
    assert fired, "the interrupt point is gone"
    comps = mgr.poll()   # the report is applied again: reported once
    assert [c.job for c in comps] == [job] and job.done
    # the invariant: a policy holds an entry once
    assert not (b"k" in pol.small and b"k" in pol.main), "k is in both S3-FIFO queues"
    # the damage: four stores push k out of the small FIFO; the next victim search reaches the main FIFO
    for i, k in enumerate([b"x", b"y", b"z", b"w"]):
        _stored(mgr, mover, kv, k, 5 + i)
        mgr.poll()
    mgr.lookup([b"x", b"y", b"z", b"w"])   # used (with the bug: all 4 held, and the next victim search moves them)
    fill_row(kv, 9, b"v")
    assert mgr.store(b"v", 9) is not None   # with the bug: KeyError b'k' (S3FIFO.victim, the entry evicted twice)


def test_the_same_report_object_queued_twice_is_applied_once_and_counted_stale() -> None:
    """Sound: a producer that queues the very same report object twice gets its job reported once and the
    second counted ``unknown_token`` (``TierCore.apply_arrived`` clears ``self.applied`` after each popleft).
    Fails if that ``self.applied = None`` (tiers.py, after ``kept.popleft()`` in ``apply_arrived``) is removed:
    the second copy would then be skipped as "committed, still queued" and never counted."""
    kv = make_kv(64)
    mgr, mover = make_fake_manager(make_config(host_slots=8), kv, CollectorRegistry())
    job = _stored(mgr, mover, kv, b"k", 0)
    r = mover.reports[-1]
    mover.completions.put(r)   # the same object, queued again right behind itself
    comps = mgr.poll()
    assert [c.job for c in comps] == [job] and job.done
    assert mgr_metric(mgr, "tiered_kv_stale_callbacks_total", kind="store", reason="unknown_token") == 1
    assert mgr.poll() == []


def test_a_spill_part_published_again_sits_in_its_policy_once() -> None:
    """``TierIndex.publish`` (a spill part's, run again when an interrupt broke off ``TierCore._spill_reported``
    before its commit) passes over an entry already READY: with S3-FIFO on the disk tier (``disk_policy``) a key
    back from the ghost went to the main FIFO on the first publish and to the small one on the second.  Fails
    without the ``entry.state is _READY`` check in ``publish``."""
    import uuid

    from tiered_kv.core.index import TierIndex
    from tiered_kv.core.policy import make_policy

    idx = TierIndex(4, policy=make_policy("s3fifo", 4))
    pol = idx.policy
    for k in (b"a", b"b", b"c", b"d", b"e"):   # e's reservation evicts a (freq 0) into the ghost
        e = idx.reserve(k, uuid.uuid4())
        assert e is not None and idx.publish(e)
    assert b"a" in pol.ghost and b"a" not in idx
    a = idx.reserve(b"a", uuid.uuid4())
    assert a is not None
    assert idx.publish(a) and idx.publish(a)
    assert (b"a" in pol.main) + (b"a" in pol.small) == 1, "a is in both S3-FIFO queues"
