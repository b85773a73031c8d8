"""Adversarial review (round 8) of 4544cbf (``RemoteTier.no_slot``: a key whose fetch found no host slot is a
miss at its next ask; ``SlabScheduler.request_finished`` drops the keys the request waited on from
``_asked``/``_kept``/``_guard`` unless another request waits on them) and 0ef7073.  Helpers and the vLLM step
model: tests/test_review_round6.py, tests/test_review_scheduler4.py.

What it proved wrong, each test failing before its fix (none could make vLLM's ``prepare_load`` raise or serve
wrong bytes: a request's lookups and its ``prepare_load`` run back to back in one step, and ``request_finished``
runs between steps; each cost hits, a fetch round trip or offloaded stores):

1. ``test_a_finished_requests_wait_is_not_dropped_while_another_request_was_told_it_is_a_hit``:
   ``request_finished`` (round 7's first fix) kept a key only if another request *waited* on it; a request told
   it is a HIT (and deferred on another key) does not wait on it, so the block was unprotected, evicted by a
   store, and fetched again when that request asked again.
2. ``test_blocks_a_finished_deferred_request_was_told_are_hits_do_not_shed_every_later_store``: the round-7
   finding 2 for the HIT keys of a deferred request that went away: they stayed in ``_kept`` through every
   decode-only step, and with them filling the slab every store was shed ``host_full``.
3. ``test_blocks_loaded_by_a_scheduled_request_do_not_shed_every_store_of_the_decode_steps_after_it``: the same
   with a request that was scheduled and loaded.
   Fixed (1-3): ``request_finished`` drops nothing from the kept keys; ``tick`` keeps the last lookups' keys
   through steps without lookups only while a request waits to be asked again (``_waiting``), and drops them at
   the first tick when none does.
4. ``test_a_no_slot_mark_does_not_make_a_miss_of_a_later_ask_once_the_key_was_stored`` and
   ``test_a_no_slot_mark_does_not_survive_reset``: a ``no_slot`` mark was cleared only by the key's next
   ``want``: a key the engine stored meanwhile, or any key across ``reset``, was a MISS at its first remote ask,
   however much later.  Fixed: a store's publish takes the mark off its keys (``TierCore.publish_store``), and
   ``drop_all`` clears them.

Checked and found right (the unmarked tests pin two): ``_guard == _asked | _kept`` and ``core.promised is
_guard`` after any seeded sequence of named/unnamed lookups, finishes, ticks and resets; ``_named`` against
``_requests``; a no-slot key asked by two requests is a miss for each within two steps (the one-shot mark
taken by the first, the second asked again and marked again).
"""

from __future__ import annotations

import pytest

from test_review_round6 import H1, H2, Z
from test_review_scheduler4 import _ask, _remote_writer, _until_fetched
from test_review_scheduler_logic import ROW
from test_vllm_scheduler import (  # noqa: F401  (rig: the fixture)
    mark, metric, rig, store_ready, worker_store,
)
from tiered_kv.integrations.scheduler import Lookup

pytestmark = pytest.mark.timeout(60)

RETRY, HIT, MISS = Lookup.RETRY, Lookup.HIT, Lookup.MISS
W = b"w-on-the-server"


def _stores(tiers, n: int, tag: bytes = b"decode") -> list[list[bytes]]:
    """``n`` decode-only engine steps: each stores one new block (no lookups), then on_schedule_end."""
    stored = []
    for i in range(n):
        if tiers.core.remote is not None:   # the last blocks' remote puts answered: their slots are read no more
            assert tiers.flush(timeout=30)  # (a put in flight leases its slot: what a store may evict is timing)
        p = tiers.prepare_store([tag + b"-%d" % i])
        stored.append(p.keys)
        if p.keys:
            worker_store(tiers.slab, p.keys, p.slots, p.seq)
            tiers.complete_store(p.keys)
        tiers.tick()
    return stored


# =========================================================================== 1. a hit told to another request
def test_a_finished_requests_wait_is_not_dropped_while_another_request_was_told_it_is_a_hit(rig, redis_url):
    _remote_writer(rig, redis_url, [Z, W])
    tiers = rig.open(rig.slab(num_slots=3, row_bytes=ROW, name="b.slab"), host_evict_ahead_blocks=0,
                     remote_url=redis_url)
    # step N-1: r1 asks Z (RETRY); its fetch lands
    assert tiers.lookup(Z, request="r1") is RETRY
    _until_fetched(tiers)
    assert tiers.state_of(Z)[0] == "ready"
    # step N: r2 asks [Z, W]: Z a HIT, W RETRY (deferred).  r1 is not asked for Z again (vLLM starts its
    # lookups past its GPU prefix hit, which now covers Z, or skips it this step); its wait on Z stays until
    # it finishes
    assert _ask(tiers, "r2", [Z, W]) == ([Z], True)
    tiers.tick()                                  # on_schedule_end (W's probe goes out)
    tiers.request_finished("r1")                  # r1 done (update_from_output)
    kept = Z in tiers._guard                      # (False: Z, told a HIT to the deferred r2, is kept for no one)
    _until_fetched(tiers)                         # W lands in the third slot
    _stores(tiers, 2)                             # the step's stores: the slab is full, the LRU unkept block goes
    hits, deferred = _ask(tiers, "r2", [Z, W])
    assert hits == [Z, W] and not deferred, (
        f"r2, told Z is a HIT and deferred, asks again: hits {hits}, deferred {deferred}; Z {tiers.state_of(Z)}; "
        f"Z kept after r1 finished: {kept}")


# =========================================================================== 2. a finished request's hits kept
def test_blocks_a_finished_deferred_request_was_told_are_hits_do_not_shed_every_later_store(rig, redis_url):
    _remote_writer(rig, redis_url, [Z])
    tiers = rig.open(rig.slab(num_slots=2, row_bytes=ROW, name="b.slab"), host_evict_ahead_blocks=0,
                     remote_url=redis_url)
    store_ready(tiers, [H1])
    store_ready(tiers, [H2])
    tiers.tick()
    assert _ask(tiers, "r", [H1, H2, Z]) == ([H1, H2], True)   # deferred on Z
    tiers.tick()                                  # on_schedule_end
    tiers.request_finished("r")                   # r aborted before the next step
    _until_fetched(tiers)
    stored = _stores(tiers, 5)
    shed = metric(tiers.metrics, "tiered_kv_shed_total", kind="store", reason="host_full")
    assert any(stored), (
        f"5 steps after request r finished, every store was shed host_full ({shed:.0f}): the 2 slots hold "
        f"H1 {tiers.state_of(H1)}, H2 {tiers.state_of(H2)}, told hits to r and kept {sorted(tiers._kept)}")


def test_blocks_loaded_by_a_scheduled_request_do_not_shed_every_store_of_the_decode_steps_after_it(rig):
    tiers = rig.open(rig.slab(num_slots=2, row_bytes=ROW, name="b.slab"), host_evict_ahead_blocks=0)
    store_ready(tiers, [H1])
    store_ready(tiers, [H2])
    tiers.tick()
    assert _ask(tiers, "r", [H1, H2, b"r-new-block"]) == ([H1, H2], False)   # scheduled with 2 hits
    p = tiers.prepare_load([H1, H2])              # update_state_after_alloc
    tiers.tick()                                  # on_schedule_end
    mark(tiers.slab, p.seq)                       # the worker's load copies finished (its ring marked)
    tiers.complete_load([H1, H2])
    tiers.tick()
    stored = _stores(tiers, 5)                    # r decodes: its new blocks are stored, no lookups
    shed = metric(tiers.metrics, "tiered_kv_shed_total", kind="store", reason="host_full")
    assert any(stored), (f"every store of the 5 decode steps after r was scheduled was shed host_full "
                         f"({shed:.0f}); kept: {sorted(tiers._kept)}")


# =========================================================================== 3. no_slot outliving its cause
def _no_slot_for_z(rig, redis_url):
    """A 2-slot host holding H1, H2 (told hits to r): Z's fetch finds no slot (RemoteTier.no_slot)."""
    _remote_writer(rig, redis_url, [Z])
    tiers = rig.open(rig.slab(num_slots=2, row_bytes=ROW, name="b.slab"), host_evict_ahead_blocks=0,
                     remote_url=redis_url)
    store_ready(tiers, [H1])
    store_ready(tiers, [H2])
    tiers.tick()
    assert _ask(tiers, "r", [H1, H2, Z]) == ([H1, H2], True)
    _until_fetched(tiers)
    assert Z in tiers.core.remote.no_slot
    return tiers


def _a_step_that_keeps_nothing(tiers, key: bytes) -> None:
    """A step whose only lookup is a MISS (``key``, which the server does not hold: asked once, then noted
    missed), then on_schedule_end: nothing is kept after it."""
    assert tiers.lookup(key, request="q") is RETRY
    _until_fetched(tiers)
    assert tiers.lookup(key, request="q") is MISS
    tiers.tick()
    assert not tiers._guard


def test_a_no_slot_mark_does_not_make_a_miss_of_a_later_ask_once_the_key_was_stored(rig, redis_url):
    tiers = _no_slot_for_z(rig, redis_url)
    tiers.request_finished("r")                   # r went away (never asked Z again)
    _a_step_that_keeps_nothing(tiers, b"unrelated")
    assert tiers.flush(timeout=30)                # H1's, H2's remote puts answered: their slots are evictable
    store_ready(tiers, [Z], tag="engine")         # another request computed Z; the engine stores it
    assert tiers.lookup(Z, request="q2") is HIT
    tiers.tick()
    _a_step_that_keeps_nothing(tiers, b"unrelated-2")
    _stores(tiers, 2)                             # Z evicted from the 2-slot host
    assert tiers.state_of(Z) == (None, None)
    assert tiers.lookup(Z, request="r3") is RETRY, "Z is on the server and the host has evictable slots"


def test_a_no_slot_mark_does_not_survive_reset(rig, redis_url):
    tiers = _no_slot_for_z(rig, redis_url)
    tiers.reset()
    tiers.tick()
    assert tiers.lookup(Z, request="r2") is RETRY, "after reset the host is empty; Z is on the server"


# =========================================================================== pins (checked, found right)
def test_guard_stays_the_union_of_asked_and_kept_across_finishes_resets_and_ticks(rig, redis_url):
    import random

    rnd = random.Random(8)
    _remote_writer(rig, redis_url, [Z, W])
    tiers = rig.open(rig.slab(num_slots=3, row_bytes=ROW, name="b.slab"), host_evict_ahead_blocks=0,
                     remote_url=redis_url)
    store_ready(tiers, [H1])
    store_ready(tiers, [H2])
    keys = [H1, H2, Z, W, b"miss-1"]
    reqs = ["a", "b", "c", None]
    for _ in range(300):
        op = rnd.random()
        if op < 0.55:
            tiers.lookup(rnd.choice(keys), request=rnd.choice(reqs))
        elif op < 0.75:
            tiers.request_finished(rnd.choice(reqs[:-1]))
        elif op < 0.95:
            tiers.tick()
        else:
            tiers.reset()
        assert tiers._guard == tiers._asked | tiers._kept
        assert tiers._named == sum(map(len, tiers._requests.values()))
        assert tiers.core.promised is tiers._guard
    _until_fetched(tiers)


def test_a_no_slot_key_asked_by_two_requests_is_a_miss_for_each_within_two_steps(rig, redis_url):
    """The one-shot mark is taken by the first asker; the second is asked again and gets its own mark: both
    scheduled within two steps (not a retry for ever)."""
    tiers = _no_slot_for_z(rig, redis_url)
    assert tiers.lookup(Z, request="r2") is MISS          # r2 first in this step takes the mark
    assert _ask(tiers, "r", [H1, H2, Z]) == ([H1, H2], True)
    _until_fetched(tiers)
    assert _ask(tiers, "r", [H1, H2, Z]) == ([H1, H2], False)
