"""Adversarial review (round 6) of the vLLM scheduler side after 4f0edfc / ec0da24 / a28f3b1:
``SlabScheduler._guard`` (``_asked | _kept`` as ``core.promised``), the fetch's reservation protecting it
(``RemoteTier.probe_answered``), a fetched block reported stored (``TierCore._apply_fetch``), and the
``_waiting`` trim bound (``(num_slots + len(remote.asking)) * (1 + len(_requests))``).

vLLM 0.32's step as the manager drives it (see tests/test_review_scheduler4.py): a waiting request's lookups
in prefix order (``protect``: its keys answered HIT/PENDING/RETRY in this step); a RETRY or PENDING answer
defers the whole request (``get_num_new_matched_tokens`` returns None) and it is asked again next step; then
``on_schedule_end`` (``tick``), then the step's stores.

What it proved wrong, each test failing before its fix:

1. ``test_a_request_whose_fetch_finds_every_host_slot_promised_is_scheduled``: a probe answer whose fetch
   found no host slot (every slot promised) dropped the keys from ``asking`` silently, not noted missed, not
   counted; the next lookup asked the server again (RETRY): the request was deferred at every step, for ever.
   Fixed: those keys are noted missed (a MISS until the miss TTL ends, as a read-back with no slot is) and
   shed ``host_full`` (``RemoteTier.probe_answered``; the partial case:
   ``test_a_fetch_with_a_slot_for_part_of_the_prefix_sheds_and_notes_the_rest``).
2. ``test_a_block_fetched_for_a_waiting_request_is_kept_until_it_asks_again``: a RETRY answer was not added to
   ``_asked``/``_guard``, so the block its fetch landed was evicted before the request asked again: fetched and
   evicted at every step.  Fixed: every answer but MISS is kept.
3. ``test_a_request_waiting_on_a_long_remote_prefix_the_slab_cannot_hold_counts_each_block_once``: the
   ``_waiting`` trim bound counted ``remote.asking``, but a key dropped from ``asking`` still had its wait: a
   request waiting on more remote keys than slots lost waits and counted those blocks twice.  Fixed: a named
   request's waits are never trimmed (they go when it is answered or finishes; ``REQUESTS_MAX`` bounds the
   requests); the bound is for unnamed waits only (``SlabScheduler._named`` counts the others;
   ``test_a_named_requests_waits_stay_when_the_remote_tier_stops_asking_its_keys``).
4. ``test_a_disk_only_block_the_server_holds_is_not_retried_for_the_whole_disk_back_off``: with the disk I/O
   process dead (a restart in back-off) a disk-only block was asked from the remote tier (RETRY) at every step
   for the whole back-off.  Fixed: it is a MISS, as docs/vllm.md says.

Checked and found right (the unmarked tests pin two): a fetch superseded by the engine's store of the same key
is announced stored once (the store's), its late answer counted stale and its bytes never served; a fetch in
flight at ``reset`` is never announced stored nor served.  Also read and found right (no test): the guard is
refilled from ``_kept`` only on a tick after lookups, so it equals ``_asked | _kept`` at every call; it is
cleared by ``reset``; a read-back's and a fetch's reservation pass it (``start_promote``: the live set or a
union with ``protect``, never mutated by the reservation); ``prepare_store`` after ``tick`` (vLLM's order)
protects ``_kept`` which is then the guard; a HIT key stays READY until the same step's ``prepare_load`` (every
reservation inside a lookup or tick protects the guard); counts of a read-back refused for lack of a slot (one
key, no hit).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from test_review_scheduler4 import _ask, _remote_writer, _until_fetched
from test_review_scheduler_logic import ROW
from test_vllm_scheduler import (  # noqa: F401  (rig: the fixture)
    HIT, metric, pattern, rig, store_ready, worker_store,
)
from tiered_kv import TieredKVConfig
from tiered_kv.integrations.scheduler import Lookup, SlabScheduler
from tiered_kv.metrics import Metrics

pytestmark = pytest.mark.timeout(60)

KEYS_M = "tiered_kv_lookup_keys_total"
HITS_M = "tiered_kv_lookup_hits_total"
RETRY = Lookup.RETRY

Z = b"z-on-the-server"
H1, H2 = b"h1-on-the-host", b"h2-on-the-host"


def _steps_until_scheduled(tiers: SlabScheduler, request: str, prefix: list[bytes], steps: int = 8) -> list[Any]:
    """vLLM's steps for one waiting request: its lookups (deferred on PENDING/RETRY), then the end of the step,
    until the server answered.  Returns each step's answers (HIT keys, deferred, Z's host state after)."""
    log = []
    for _ in range(steps):
        hits, deferred = _ask(tiers, request, prefix)
        log.append((len(hits), deferred))
        if not deferred:
            break
        _until_fetched(tiers)          # on_schedule_end; waits (never orders) for the probe's and fetch's answers
        log.append(("after the step", tiers.state_of(prefix[-1])))
    return log


# =========================================================================== 1. a fetch that finds no slot
def test_a_request_whose_fetch_finds_every_host_slot_promised_is_scheduled(rig, redis_url):
    _remote_writer(rig, redis_url, [Z])
    tiers = rig.open(rig.slab(num_slots=2, row_bytes=ROW, name="b.slab"), host_evict_ahead_blocks=0,
                     remote_url=redis_url)     # default remote_miss_ttl_seconds (1 s)
    store_ready(tiers, [H1])
    store_ready(tiers, [H2])
    tiers.tick()
    log = _steps_until_scheduled(tiers, "r", [H1, H2, Z])
    assert log[-1][1] is False, (
        f"request r ([H1, H2] on the 2-slot host, Z on the server) is still deferred after {len(log) // 2} steps "
        f"(hits, deferred) / Z's state after each step: {log}")
    assert metric(tiers.metrics, "tiered_kv_shed_total", kind="fetch", reason="host_full") == 1   # counted once


def test_a_fetch_with_a_slot_for_part_of_the_prefix_sheds_and_notes_the_rest(rig, redis_url):
    """The partial case of 1: the fetch takes the one slot left, the block after it is shed (counted) and a miss
    at the next ask, not a retry at every step."""
    Z1, Z2 = b"z1-on-the-server", b"z2-on-the-server"
    _remote_writer(rig, redis_url, [Z1, Z2])
    tiers = rig.open(rig.slab(num_slots=2, row_bytes=ROW, name="b.slab"), host_evict_ahead_blocks=0,
                     remote_url=redis_url)     # default remote_miss_ttl_seconds (1 s)
    store_ready(tiers, [H1])
    tiers.tick()
    assert _ask(tiers, "r", [H1, Z1, Z2]) == ([H1], True)
    _until_fetched(tiers)
    assert metric(tiers.metrics, "tiered_kv_shed_total", kind="fetch", reason="host_full") == 1
    assert [tiers.lookup(k, request="r") for k in (H1, Z1, Z2)] == [HIT, HIT, Lookup.MISS]


# =========================================================================== 2. a fetched block not kept
def test_a_block_fetched_for_a_waiting_request_is_kept_until_it_asks_again(rig, redis_url):
    _remote_writer(rig, redis_url, [Z])
    tiers = rig.open(rig.slab(num_slots=3, row_bytes=ROW, name="b.slab"), host_evict_ahead_blocks=1,
                     remote_url=redis_url)
    store_ready(tiers, [H1])
    store_ready(tiers, [H2])
    tiers.tick()
    log = _steps_until_scheduled(tiers, "r", [H1, H2, Z])
    fetched = metric(tiers.metrics, "tiered_kv_jobs_total", kind="fetch", outcome="ok")
    assert log[-1][1] is False, (
        f"request r ([H1, H2] on a 3-slot host with evict-ahead 1, Z on the server) is still deferred after "
        f"{len(log) // 2} steps; Z fetched {fetched:.0f} times; (hits, deferred) / Z after each step: {log}")


# =========================================================================== 3. the _waiting bound
def test_a_request_waiting_on_a_long_remote_prefix_the_slab_cannot_hold_counts_each_block_once(rig, redis_url):
    keys = [b"remote-prefix-%02d" % i for i in range(20)]
    _remote_writer(rig, redis_url, keys)
    tiers = rig.open(rig.slab(num_slots=4, row_bytes=ROW, name="b.slab"), host_evict_ahead_blocks=0,
                     remote_url=redis_url)
    # step s: vLLM's maximal prefix lookup goes on past RETRY: every block is asked from the server
    assert [tiers.lookup(k, request="r") for k in keys] == [RETRY] * len(keys)
    _until_fetched(tiers)                               # the first four fetched into the four slots
    again = [tiers.lookup(k, request="r") for k in keys]   # step s+1: the same request asks again
    assert again[:4] == [HIT] * 4, again
    m = tiers.metrics
    got = (metric(m, KEYS_M), metric(m, HITS_M, tier="remote"))
    assert got == (len(keys), 4), (
        f"one request asked {len(keys)} blocks (4 served from the remote tier): (lookup keys, remote hits) {got}")


def test_a_named_requests_waits_stay_when_the_remote_tier_stops_asking_its_keys(rig, redis_url):
    """The bound fixed after 3 (without 1's fix to lean on): a refused probe or fetch drops keys from the remote
    tier's asking map while a request still waits on them; its waits stay until it is answered or finishes."""
    keys = [b"remote-prefix-%02d" % i for i in range(20)]
    tiers = rig.open(rig.slab(num_slots=4, row_bytes=ROW, name="b.slab"), host_evict_ahead_blocks=0,
                     remote_url=redis_url)
    assert [tiers.lookup(k, request="r") for k in keys] == [RETRY] * len(keys)
    tiers.core.remote.asking.clear()                   # what a refused probe does to the keys it held
    tiers.lookup(b"another", request="r")
    assert all(("r", k) in tiers._waiting for k in keys), sorted(k for r, k in tiers._waiting)
    tiers.request_finished("r")
    assert not tiers._waiting and tiers._named == 0


# =========================================================================== checked and found right
def _events_scheduler(rig, redis_url: str, num_slots: int = 3) -> SlabScheduler:
    slab = rig.slab(num_slots=num_slots, row_bytes=ROW, name="e.slab")
    cfg = TieredKVConfig(namespace="t", host_capacity_bytes=num_slots * ROW, host_evict_ahead_blocks=0,
                         remote_url=redis_url, remote_miss_ttl_seconds=0.0)
    tiers = SlabScheduler(cfg, slab, metrics=Metrics(registry=CollectorRegistry(), namespace="t"),
                          collect_published=True)
    rig.tiers.append(tiers)
    return tiers


def test_a_fetch_superseded_by_a_store_is_announced_stored_once(rig, redis_url):
    """The engine stores a key whose fetch is in flight: its own store is published ("stored" once), the
    fetch's late answer is discarded (counted stale), never announced."""
    _remote_writer(rig, redis_url, [Z], tag="remote")
    tiers = _events_scheduler(rig, redis_url)
    assert tiers.lookup(Z, request="r") is RETRY
    tiers.tick()                                   # the probe goes out
    # the probe answered: the fetch reserved Z's slot (WRITING)
    deadline_steps = 0
    while tiers.state_of(Z)[0] is None:
        _step_once(tiers)
        deadline_steps += 1
        assert deadline_steps < 20000, "the probe did not answer"
    assert tiers.state_of(Z)[0] == "writing"       # the fetch is in flight: the engine stores Z itself
    p = tiers.prepare_store([Z])
    assert p.keys == [Z]
    worker_store(tiers.slab, p.keys, p.slots, p.seq, "engine")
    tiers.complete_store(p.keys)
    _until_fetched(tiers)
    stored = tiers.take_published()
    assert stored == [Z], stored
    assert tiers.state_of(Z)[0] == "ready"
    assert metric(tiers.metrics, "tiered_kv_stale_callbacks_total", kind="fetch", reason="superseded") == 1
    pl = tiers.prepare_load([Z])                   # the engine's bytes, not the server's
    assert bool((tiers.slab.rows[pl.slots[0]] == pattern(Z, "engine", ROW)).all())


def _step_once(tiers: SlabScheduler) -> None:
    time.sleep(0.0005)   # waits for the server's answer; orders nothing
    tiers.tick()


def test_a_fetch_in_flight_at_reset_is_never_announced_stored(rig, redis_url):
    _remote_writer(rig, redis_url, [Z], tag="remote")
    tiers = _events_scheduler(rig, redis_url)
    assert tiers.lookup(Z, request="r") is RETRY
    tiers.tick()
    steps = 0
    while tiers.state_of(Z)[0] is None:
        _step_once(tiers)
        steps += 1
        assert steps < 20000, "the probe did not answer"
    assert tiers.state_of(Z)[0] == "writing"       # the fetch is in flight
    assert tiers.take_published() == []
    tiers.reset()
    _until_fetched(tiers)                          # its answer lands after the reset: discarded
    assert tiers.take_published() == [] and tiers.state_of(Z) == (None, None)



# =========================================================================== 4. the disk I/O process down
def test_a_disk_only_block_the_server_holds_is_not_retried_for_the_whole_disk_back_off(rig, redis_url):
    import signal

    from test_disk_process import _wait_down
    from test_review_scheduler_logic import _disk_only

    A = b"a-on-disk-and-on-the-server"
    _remote_writer(rig, redis_url, [A])                 # another engine of the namespace wrote it there too
    tiers = _disk_only(rig, [A], num_slots=4, io="process", remote_url=redis_url)
    tier, store = tiers.core.disk, tiers.disk
    tier.restarts, tier._started_at, tier._backoff = 1, time.monotonic(), 30.0   # died again soon after a restart
    store.kill_for_test(signal.SIGKILL)
    _wait_down(store)
    answers = []
    for _ in range(4):                                  # four engine steps; each waits for the probe's answer
        answers.append(tiers.lookup(A, request="r"))
        _until_fetched(tiers)
    assert tier.down and not tier.usable                # still in its back-off
    assert answers[-1] is not RETRY, (
        f"a disk-only block (host {tiers.state_of(A)[0]}, disk {tiers.state_of(A)[1]}), held by the server too, "
        f"with the disk I/O process down: answers at four steps {answers}")
