"""Adversarial review (round 7) of 0ef7073 (the scheduler: a fetch with no host slot is a miss and shed
``host_full``; every answer but MISS is kept; named waits never trimmed, ``_named``; a disk-only key a MISS
while the disk I/O process is dead), 54ddc18 (``lock.LockFd``) and 9ac7eaa (``Writer.settle_orphans``,
``DiskTier._adopt``).  Helpers and the vLLM step model: tests/test_review_round6.py,
tests/test_review_scheduler4.py.

What it proved wrong, each test failing before its fix:

1. ``test_a_fetch_with_no_host_slot_is_a_miss_even_with_no_miss_ttl``: a fetch that found no host slot was a
   miss only through ``RemoteTier.note_miss``, for ``remote_miss_ttl_seconds``; with the valid setting 0 the
   next lookup asked the server again (RETRY), the fetch again found every slot promised: deferred for ever (the
   round-6 loop, back).  Fixed: such a key is a miss at its next ask whatever the TTL (``RemoteTier.no_slot``,
   one-shot, bounded as ``missed`` is).
2. ``test_blocks_fetched_for_a_finished_request_do_not_shed_every_later_store`` (a regression of 0ef7073, the
   test passed on 0ef7073^): RETRY keys are kept (``_asked``/``_kept``), ``tick`` keeps ``_kept`` while no step
   makes a lookup, and ``request_finished`` left them: blocks fetched for a request that went away stayed
   promised through the decode-only steps after it, and every store was shed ``host_full``.  Fixed: ``tick``
   keeps the last lookups' keys only while a request waits (round 8 replaced a first fix that dropped a
   finished request's keys, which unprotected a block another request was told is a hit).

Checked and found right: ``_named`` against ``_requests``/``_waiting`` (lookup, ``_hit``, ``_unwait``,
``request_finished``, the REQUESTS_MAX eviction, ``reset``; a seeded random run of named/unnamed lookups,
finishes, resets and ticks over a disk tier, REQUESTS_MAX=3, kept the invariant and the unnamed bound);
``lock.release``/``leave`` of a LockFd run again once its number is another lock's (pinned below); every
caller passes the LockFd ``take`` returned (the disk I/O child's shared lock is closed, never released);
``settle_orphans`` is never run by the close and the reaper at once (the reaper starts after close's call).
"""

from __future__ import annotations

import pytest

from test_review_round6 import H1, H2, Z, _steps_until_scheduled
from test_review_scheduler4 import _remote_writer, _until_fetched
from test_review_scheduler_logic import ROW
from test_vllm_scheduler import (  # noqa: F401  (rig: the fixture)
    metric, rig, store_ready, worker_store,
)
from tiered_kv.integrations.scheduler import Lookup

pytestmark = pytest.mark.timeout(60)

RETRY = Lookup.RETRY


# =========================================================================== 1. host_full with no miss TTL
def test_a_fetch_with_no_host_slot_is_a_miss_even_with_no_miss_ttl(rig, redis_url):
    _remote_writer(rig, redis_url, [Z])
    tiers = rig.open(rig.slab(num_slots=2, row_bytes=ROW, name="b.slab"), host_evict_ahead_blocks=0,
                     remote_url=redis_url, remote_miss_ttl_seconds=0.0)
    store_ready(tiers, [H1])
    store_ready(tiers, [H2])
    tiers.tick()
    log = _steps_until_scheduled(tiers, "r", [H1, H2, Z], steps=6)
    shed = metric(tiers.metrics, "tiered_kv_shed_total", kind="fetch", reason="host_full")
    assert log[-1][1] is False, (
        f"request r ([H1, H2] on the 2-slot host, Z on the server, remote_miss_ttl_seconds=0) is still deferred "
        f"after {len(log) // 2} steps; Z shed host_full {shed:.0f} times; (hits, deferred) / Z after each step: "
        f"{log}")



# =========================================================================== 2. kept for a finished request
def test_blocks_fetched_for_a_finished_request_do_not_shed_every_later_store(rig, redis_url):
    Z1, Z2 = b"z1-on-the-server", b"z2-on-the-server"
    _remote_writer(rig, redis_url, [Z1, Z2])
    tiers = rig.open(rig.slab(num_slots=2, row_bytes=ROW, name="b.slab"), host_evict_ahead_blocks=0,
                     remote_url=redis_url)
    assert [tiers.lookup(k, request="r") for k in (Z1, Z2)] == [RETRY, RETRY]   # r deferred
    tiers.request_finished("r")                  # r aborted (or preempted for good) before the next step
    _until_fetched(tiers)                        # its fetch lands: Z1, Z2 READY in both slots
    assert tiers.state_of(Z1)[0] == tiers.state_of(Z2)[0] == "ready"
    stored = []
    for i in range(5):                           # decode-only steps: running requests store new blocks
        p = tiers.prepare_store([b"decode-%d" % i])
        stored.append(p.keys)
        if p.keys:
            worker_store(tiers.slab, p.keys, p.slots, p.seq)
            tiers.complete_store(p.keys)
        tiers.tick()
    shed = metric(tiers.metrics, "tiered_kv_shed_total", kind="store", reason="host_full")
    assert any(stored), (
        f"5 steps after request r finished, every store was shed host_full ({shed:.0f}): the 2 slots hold "
        f"Z1 {tiers.state_of(Z1)}, Z2 {tiers.state_of(Z2)}, fetched for r and promised for ever")

# =========================================================================== pins (checked, found right)
def test_a_lock_released_twice_never_frees_the_lock_that_reused_its_number(tmp_path):
    """54ddc18: a second release of a LockFd, once its number is another path's lock, leaves that one held."""
    import fcntl
    import os

    from tiered_kv.disk import lock

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    fa = lock.take(a)
    lock.release(fa)
    fb = lock.take(b)
    try:
        # (the number is normally reused: the lowest free descriptor; the check holds either way)
        lock.release(fa)               # a close run again, once n may be b's lock
        lock.leave(fa)
        other = os.open(b / lock.LOCK_NAME, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)   # b is still held
        finally:
            os.close(other)
    finally:
        lock.release(fb)
    again = lock.take(b)               # and free once its own handle released it
    lock.release(again)


def test_a_finished_requests_block_stays_kept_while_another_request_waits(rig, redis_url):  # noqa: F811
    """The other half of 2's fix: the kept blocks go at a tick once no request waits, not before."""
    tiers = rig.open(rig.slab(num_slots=4, row_bytes=ROW, name="b.slab"), remote_url=redis_url)
    assert tiers.lookup(Z, request="r1") is RETRY
    assert tiers.lookup(b"w", request="r2") is RETRY
    tiers.tick()                        # the step's lookups are kept
    tiers.request_finished("r1")
    tiers.tick()                        # a step with no lookups: r2 still waits, so they stay
    assert Z in tiers._guard and Z in tiers._kept
    tiers.request_finished("r2")
    assert Z in tiers._guard            # until the next tick
    tiers.tick()
    assert not tiers._guard and not tiers._kept
