"""Review round 35: the vLLM adapter's scheduler side (``SlabScheduler`` driven as vLLM 0.32's
``OffloadingConnectorScheduler`` drives the manager), core venv, no vLLM import.

The first test failed on the code it was written against (main at 1917ce3): a block a named request was told is
a MISS was counted a new lookup key at each ask (vLLM asks a deferred request's prefix again up to its first
miss); fixed since (``SlabScheduler._missed``), the second test pins the other half (a miss found stored at a later
ask is one key and one hit).  Deterministic: ``tmp_path``, the worker played by the test, bounded waits only.
"""

from __future__ import annotations

from test_scheduler_counts_machine import _counts, _disk_tiers, _make_disk_only
from test_vllm_scheduler import HIT, MISS, PENDING, A, B, C, E, rig, store_ready, wait_promotes  # noqa: F401  (rig: the fixture)

__all__ = ["rig"]


def test_a_miss_asked_again_by_a_request_deferred_on_a_read_back_is_one_lookup_key(rig) -> None:
    """vLLM's ``_maximal_prefix_lookup`` (offloading/scheduler.py) scans past ``HIT_PENDING`` up to the first
    ``MISS`` and asks the whole prefix again at every step the request stays deferred.  A request whose prefix
    is on disk followed by new blocks -- the ordinary case of a request served from disk -- asks for its first
    new block twice: once in the step that starts the read-back, once when it is served.  The adapter counts
    the read-back's block one key (docs/observability.md: "one lookup key however often vLLM asks for it while
    it waits"), a HIT block one key "however often vLLM asks that request again before scheduling it", but the
    MISS block a new key at each ask: one request that asked 2 blocks and got 1 hit is counted 3 keys (hit ratio
    1/3 instead of 1/2; with a longer wait, or a remote ``RETRY``, one more key per step).
    At fault: ``tiered_kv/integrations/scheduler.py: SlabScheduler.lookup`` -- a MISS is counted whenever the
    (request, key) is not in ``_waiting``, and a MISS is never recorded as the request's.  Fix: remember a named
    request's MISS keys as its HIT keys are (``_told``, dropped at ``request_scheduled``/``request_finished``) and
    count a MISS asked again by the same request before it is scheduled as the same key."""
    tiers = _disk_tiers(rig, num_slots=2)
    _make_disk_only(tiers, A, [B, C])                   # host: B, C; disk: A (and B, C)
    base = _counts(tiers.metrics)
    # step 1: request R asks its prefix [A, E]: A is read back (PENDING), vLLM goes on to E (never stored): MISS
    assert tiers.lookup(A, request="R") == PENDING
    assert tiers.lookup(E, request="R") == MISS
    wait_promotes(tiers)                                # end of step; the read-back lands
    # step 2: R asked again (the same prefix): A served from the read-back it waited on, E still a miss
    assert tiers.lookup(A, request="R") == HIT
    assert tiers.lookup(E, request="R") == MISS
    keys, hits = _counts(tiers.metrics)
    got = (keys - base[0], hits["disk"] - base[1]["disk"], hits["host"] - base[1]["host"])
    assert got == (2, 1, 0), f"(lookup keys, disk hits, host hits) = {got}: one request asked A and E once each"


def test_a_miss_that_a_later_ask_of_the_same_request_finds_stored_is_one_lookup_key_and_one_hit(rig) -> None:
    """The other half of the fix: a request told MISS for a key, asked again once another request stored it, is
    told HIT: one lookup key (counted at the miss) and one host hit, not a second key."""
    tiers = _disk_tiers(rig, num_slots=4)
    base = _counts(tiers.metrics)
    assert tiers.lookup(E, request="R") == MISS
    store_ready(tiers, [E])                             # another request computed and stored it meanwhile
    assert tiers.lookup(E, request="R") == HIT
    assert tiers.lookup(E, request="R") == HIT          # (asked again: still the same key, the same hit)
    keys, hits = _counts(tiers.metrics)
    got = (keys - base[0], hits["host"] - base[1]["host"])
    assert got == (1, 1), f"(lookup keys, host hits) = {got}: one request asked E, a miss then a hit"
