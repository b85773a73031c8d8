"""Adversarial review of the vLLM adapter's glue, second pass (tiered_kv/integrations/vllm.py and
tiered_kv/integrations/scheduler.py), driven the way vLLM 0.32's OffloadingConnector calls it.

What it proved wrong, each pinned by a test that failed before its fix:

1. A block served from the disk tier was counted twice in tiered_kv_lookup_hits_total: once as a
   ``disk`` hit at the lookup that answers HIT_PENDING and starts its read-back, and again as a
   ``host`` hit at the lookup (vLLM's retry a step later) that finds it landed
   (scheduler.py:SlabScheduler.lookup) -- docs/observability.md: "each hit counted once".
2. ``max_key_bytes`` below the length of vLLM's OffloadKey (block hash + 4 bytes: 36 with sha256) was
   accepted when vLLM creates the spec; the first request's lookup then raises InvalidKeyError inside
   vLLM's scheduler and takes the engine down (vllm.py:TieredKVOffloadingSpec.__init__ /
   scheduler.py:SlabScheduler._check_key).
3. After ``TieredKVOffloadingManager.shutdown()`` the manager still reported
   ``tiered_kv_healthy{tier="host"} == 1`` (and ``device``): SlabScheduler.close never calls
   ``Metrics.closed()``, which TierManager.close does (docs/observability.md: at close the tiers'
   ``tiered_kv_healthy`` goes to 0) -- the disk tier alone reads 0, so the front ends disagree.
4. With KV events on, a host block evicted outside prepare_store -- by evict-ahead at the end of a
   scheduler step (on_schedule_end), or by a disk read-back's slot reservation inside lookup -- is
   reported removed only at the next prepare_store call: take_events drained only published keys
   (vllm.py:TieredKVOffloadingManager.take_events), so through steps without stores (decode with
   offload_prompt_only, an idle engine) vLLM's event consumers keep a block that is in no tier.

Plain tests pin guarantees checked here that held (not covered elsewhere): prepare_store of keys
being loaded or being stored by another request, a load in flight across reset_cache with the host
slab refilled at once, and a real Scheduler that aborts a request while its blocks are read back
from disk.

Every interleaving is forced deterministically: a worker copy that has not run is one still queued
in the copier's batch (copy_batch_max > 1 queues a submit until get_finished/wait), disk reads are
awaited with SlabScheduler.flush (a wait point on the completion queue); no sleeps order anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

import test_vllm_adapter as base  # noqa: E402  (helpers only: no test is re-collected from here)
from test_vllm_adapter import (  # noqa: E402
    BS,
    PROMPT_LEN,
    ROW_BYTES,
    Engine,
    Pair,
    block_bytes,
    gpu_spec,
    jobs,
    keys,
    new_kv,
    prompt_tokens,
    stale,
    tick,
    tkv_extra,
)
from tiered_kv.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.timeout(120)

model_dir = base.model_dir  # the module-scoped tiny-Llama config fixture


def _pair(model_dir: str, tmp_path: Path, seed: int, **over: Any) -> Pair:
    return Pair(base.offloading_config(model_dir, tkv_extra(tmp_path, **over)), new_kv(seed=seed))


def _hits(mgr: Any) -> dict[str, float]:
    r = mgr.metrics.registry
    return {t: r.get_sample_value("tiered_kv_lookup_hits_total", {"tier": t}) or 0.0 for t in ("host", "disk")}


def _settle_lookups(p: Pair, ks: list[bytes], ctx: ReqContext) -> list[LookupResult]:
    """vLLM's retry loop for a deferred request: a step (tick) and a lookup of every key, until all are HIT
    (disk reads awaited through flush, a wait point on the completion queue)."""
    got: list[LookupResult] = []
    for _ in range(400):
        tick(p.mgr)
        got = [p.mgr.lookup(k, ctx) for k in ks]
        if got == [LookupResult.HIT] * len(ks):
            return got
        assert set(got) <= {LookupResult.HIT, LookupResult.HIT_PENDING}, got
        p.mgr.tiers.flush(timeout=1.0)
    return got


# ============================================================================= findings
def test_a_block_read_back_from_disk_is_one_hit_not_two(model_dir: str, tmp_path: Path) -> None:
    disk = str(tmp_path / "disk")
    ks = keys(2, "dh")
    ctx = ReqContext(req_id="r")
    p1 = _pair(model_dir, tmp_path, 50, disk_path=disk, disk_bytes=64 * ROW_BYTES)
    try:
        p1.store(ks, [1, 2], ctx)
        assert p1.mgr.tiers.flush(timeout=30) and p1.mgr.tiers.disk_blocks == 2
    finally:
        p1.close()
    p2 = _pair(model_dir, tmp_path, 51, disk_path=disk, disk_bytes=64 * ROW_BYTES)
    try:
        # vLLM: the first lookups answer HIT_PENDING (request deferred), a later step's lookups HIT
        assert [p2.mgr.lookup(k, ctx) for k in ks] == [LookupResult.HIT_PENDING] * 2
        assert _settle_lookups(p2, ks, ctx) == [LookupResult.HIT] * 2
        p2.load(ks, [30, 31], ctx)   # the two blocks are served once each
        tick(p2.mgr)
        h = _hits(p2.mgr)
        assert h["disk"] == 2, h
        assert h["host"] + h["disk"] == 2, f"2 blocks served from disk counted as {h}"
    finally:
        p2.close()


def test_max_key_bytes_below_vllm_key_length_is_refused_up_front_not_at_the_first_request(
        model_dir: str, tmp_path: Path) -> None:
    try:
        eng = Engine(model_dir, tkv_extra(tmp_path, max_key_bytes=32))   # sha256's digest size: a plausible value
    except ConfigError as exc:
        assert "max_key_bytes" in str(exc)
        return
    try:
        eng.add("a", prompt_tokens(60, PROMPT_LEN), max_tokens=2)
        assert len(eng.offload_keys("a")[0]) == 36
        eng.run()                                    # InvalidKeyError from the manager's lookup today
        assert "a" in eng.finished
    finally:
        eng.close()


def test_manager_shutdown_reports_its_tiers_unhealthy_like_tiermanager(model_dir: str, tmp_path: Path) -> None:
    p = _pair(model_dir, tmp_path, 52, disk_path=str(tmp_path / "disk"), disk_bytes=64 * ROW_BYTES)
    p.store(keys(2, "hs"), [1, 2], ReqContext(req_id="r"))
    p.close()
    r = p.mgr.metrics.registry
    health = {t: r.get_sample_value("tiered_kv_healthy", {"tier": t}) for t in ("device", "host", "disk")}
    assert r.get_sample_value("tiered_kv_jobs_total", {"kind": "store", "outcome": "ok"}) == 1  # final counts stay
    assert health == {"device": 0.0, "host": 0.0, "disk": 0.0}, health


def test_a_block_evicted_by_evict_ahead_is_reported_removed_at_the_next_take_events(model_dir: str,
                                                                                   tmp_path: Path) -> None:
    p = Pair(base.offloading_config(model_dir, tkv_extra(tmp_path, host_bytes=2 * ROW_BYTES,
                                                         host_evict_ahead_blocks=1), kv_events=True),
             new_kv(seed=57))
    try:
        ctx = ReqContext(req_id="r")
        a, b = keys(1, "ea"), keys(1, "eb")
        p.store(a, [1], ctx)
        p.store(b, [2], ctx)
        assert sorted((k, e.removed) for e in p.mgr.take_events() for k in e.keys) == sorted(
            [(a[0], False), (b[0], False)])
        tick(p.mgr)                          # a scheduler step without stores: evict-ahead frees a's slot
        assert p.mgr.lookup(a[0], ctx) is LookupResult.MISS
        tick(p.mgr)                          # (update_from_output) vLLM takes the events of the step
        got = [(k, e.removed) for e in p.mgr.take_events() for k in e.keys]
        assert got == [(a[0], True)], f"a is in no tier; events since: {got}"
    finally:
        p.close()


def test_reset_cache_reports_every_block_it_dropped_removed(model_dir: str, tmp_path: Path) -> None:
    """KV events across reset_cache: a block stored before it (its "stored" taken or not) is reported removed,
    after its "stored", so that a consumer folding the events in order counts on no block that is gone."""
    p = Pair(base.offloading_config(model_dir, tkv_extra(tmp_path, host_bytes=8 * ROW_BYTES), kv_events=True),
             new_kv(seed=58))
    try:
        ctx = ReqContext(req_id="r")
        a, b, c = keys(1, "ra"), keys(1, "rb"), keys(1, "rc")
        p.store(a, [1], ctx)
        p.store(b, [2], ctx)
        claimed: dict[bytes, bool] = {}
        for e in p.mgr.take_events():
            for k in e.keys:
                claimed[k] = not e.removed
        assert claimed == {a[0]: True, b[0]: True}
        p.store(c, [3], ctx)                 # published; its event not taken yet
        p.mgr.reset_cache()
        tick(p.mgr)
        for e in p.mgr.take_events():
            for k in e.keys:
                claimed[k] = not e.removed
        assert claimed == {a[0]: False, b[0]: False, c[0]: False}, claimed
        assert [p.mgr.lookup(k[0], ctx) for k in (a, b, c)] == [LookupResult.MISS] * 3
    finally:
        p.close()


# ============================================================================= guarantees that hold
def test_prepare_store_of_keys_being_loaded_stores_nothing_and_the_load_lands(model_dir: str,
                                                                            tmp_path: Path) -> None:
    """vLLM may prepare_store keys another request is loading (a request computed the same blocks): nothing
    to store, nothing evicted, the load's slots untouched, the keys still hits afterwards."""
    p = _pair(model_dir, tmp_path, 53, host_bytes=4 * ROW_BYTES, copy_batch_max=8)
    try:
        ctx = ReqContext(req_id="r")
        ks = keys(3, "bl")
        p.store(ks, [1, 2, 3], ctx)
        src = p.mgr.prepare_load(ks, ctx)
        jid = p.job_id()
        assert p.worker.submit_load(jid, src, gpu_spec([40, 41, 42]))     # queued, not copied yet
        out = p.mgr.prepare_store(ks, ReqContext(req_id="other"))
        assert out.keys_to_store == [] and out.evicted_keys == []
        # the one free slot is all another store gets: the loaded slots stay leased
        more = p.mgr.prepare_store(keys(3, "new"), ReqContext(req_id="other"))
        assert len(more.keys_to_store) == 1 and set(more.store_spec.slots).isdisjoint(src.slots)
        p.finish(jid)
        p.mgr.complete_load(ks, ctx)
        assert [block_bytes(p.kv, b) for b in (40, 41, 42)] == [block_bytes(p.kv, b) for b in (1, 2, 3)]
        assert [p.mgr.lookup(k, ctx) for k in ks] == [LookupResult.HIT] * 3
        tick(p.mgr)
        assert stale(p.mgr) == 0 and jobs(p.mgr, "load", "ok") == 1
    finally:
        p.close()


def test_the_same_block_hash_prepared_by_two_requests_is_stored_once(model_dir: str, tmp_path: Path) -> None:
    """Two requests compute the same block in one step: the second prepare_store gets nothing to store
    (the key is being written); the first store publishes it; no completion is stale."""
    p = _pair(model_dir, tmp_path, 54, copy_batch_max=8)
    try:
        a, b = ReqContext(req_id="a"), ReqContext(req_id="b")
        ks = keys(2, "twice")
        first = p.mgr.prepare_store(ks, a)
        second = p.mgr.prepare_store(ks + keys(1, "tail"), b)
        assert first.keys_to_store == ks and second.keys_to_store == keys(1, "tail")
        j1, j2 = p.job_id(), p.job_id()
        assert p.worker.submit_store(j1, gpu_spec([1, 2]), first.store_spec)
        assert p.worker.submit_store(j2, gpu_spec([5]), second.store_spec)
        assert [p.mgr.lookup(k, a) for k in ks] == [LookupResult.MISS] * 2   # not before its store completed
        p.finish(j1, j2)
        p.mgr.complete_store(set(ks), a)
        p.mgr.complete_store(set(keys(1, "tail")), b)
        p.load(ks + keys(1, "tail"), [50, 51, 52], a)
        assert [block_bytes(p.kv, x) for x in (50, 51, 52)] == [block_bytes(p.kv, x) for x in (1, 2, 5)]
        tick(p.mgr)
        assert stale(p.mgr) == 0 and jobs(p.mgr, "store", "ok") == 2
    finally:
        p.close()


def test_a_load_in_flight_across_reset_cache_keeps_its_slots_until_copied(model_dir: str, tmp_path: Path) -> None:
    """reset_cache while a load is queued on the worker and the slab is full: the new stores get no slot
    of the load until its copy is in the rings; the load still lands the pre-reset bytes."""
    p = _pair(model_dir, tmp_path, 55, host_bytes=2 * ROW_BYTES, copy_batch_max=8)
    try:
        ctx = ReqContext(req_id="r")
        ks = keys(2, "rl")
        p.store(ks, [1, 2], ctx)
        want = [block_bytes(p.kv, b) for b in (1, 2)]
        src = p.mgr.prepare_load(ks, ctx)
        jid = p.job_id()
        assert p.worker.submit_load(jid, src, gpu_spec([20, 21]))     # queued in the copier's batch
        p.mgr.reset_cache()
        for tag in ("n1", "n2"):           # ticks before the copy ran: still leased
            assert p.mgr.prepare_store(keys(2, tag), ctx).keys_to_store == []
            tick(p.mgr)
        p.worker.wait({jid})               # vLLM flushes every job after a reset; the copy runs now
        assert [r.job_id for r in p.worker.get_finished()] == [jid]
        assert [block_bytes(p.kv, b) for b in (20, 21)] == want
        tick(p.mgr)                        # the rings show it: the quarantine lets the slots go
        out = p.mgr.prepare_store(keys(2, "n3"), ctx)
        assert out.keys_to_store == keys(2, "n3") and sorted(out.store_spec.slots) == sorted(src.slots)
        tick(p.mgr)
        assert jobs(p.mgr, "load", "cancelled") == 1 and jobs(p.mgr, "load", "ok") == 0 and stale(p.mgr) == 0
    finally:
        p.close()


def test_scheduler_abort_while_blocks_are_read_back_from_disk(model_dir: str, tmp_path: Path) -> None:
    """A real Scheduler: a request deferred on HIT_PENDING is aborted before its read-backs land; the reads
    finish as prefetches (no job left, no slot leaked) and the next request with that prompt loads them."""
    extra = tkv_extra(tmp_path, disk_path=str(tmp_path / "disk"), disk_bytes=64 * ROW_BYTES)
    prompt = prompt_tokens(56, PROMPT_LEN)
    e1 = Engine(model_dir, extra)
    try:
        e1.add("a", prompt, max_tokens=2)
        e1.run()
        assert e1.mgr.tiers.flush(timeout=30) and e1.mgr.tiers.disk_blocks == 4
    finally:
        e1.close()
    e2 = Engine(model_dir, extra)
    try:
        e2.add("b", prompt, max_tokens=2)
        e2.step()                                         # lookups: HIT_PENDING, the request deferred
        assert e2.matched_for("b") == [(0, None, False)] and e2.mgr.has_pending_work()
        e2.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
        for _ in range(400):                              # the engine keeps stepping while reads are pending
            if not e2.mgr.has_pending_work():
                break
            e2.step()
            e2.mgr.tiers.flush(timeout=1.0)
        assert not e2.mgr.has_pending_work()
        sizes = e2.mgr.tiers.debug_sizes()
        assert sizes["live_loads"] == sizes["quarantine"] == sizes["awaiting"] == 0, sizes
        assert sizes["host_used_slots"] == sizes["host_entries"] == 4, sizes   # landed, evictable, no leak
        e2.add("c", prompt, max_tokens=2)
        e2.run()
        assert (0, 4 * BS, True) in e2.matched_for("c")
        assert e2.load_checks == [("c", i, True) for i in range(4)]
        tick(e2.mgr)
        assert stale(e2.mgr) == 0 and jobs(e2.mgr, "promote", "ok") == 4
    finally:
        e2.close()
