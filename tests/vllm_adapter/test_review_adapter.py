"""Adversarial review of the vLLM adapter (tiered_kv.integrations): each test forces one interleaving
deterministically (calls made in a chosen order; a worker copy that has not run is simply one whose
ring entry is not marked yet) and states the invariant it checks.  No sleeps order anything.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402

import test_vllm_adapter as base  # noqa: E402  (helpers only)
from test_vllm_adapter import (  # noqa: E402
    ROW_BYTES,
    Pair,
    gpu_spec,
    keys,
    new_kv,
    tick,
    tkv_extra,
)
from tiered_kv.errors import InvalidKeyError  # noqa: E402
from tiered_kv.jobs import JobKind  # noqa: E402

pytestmark = pytest.mark.timeout(60)

model_dir = base.model_dir  # the module-scoped tiny-Llama config fixture


def _pair(model_dir: str, tmp_path: Path, **over) -> Pair:
    return Pair(base.offloading_config(model_dir, tkv_extra(tmp_path, **over)), new_kv(seed=7))


# ----------------------------------------------------------------------------- bad keys from vLLM
@pytest.mark.parametrize("call", ["lookup", "prepare_store"])
def test_a_non_bytes_key_is_refused_not_turned_into_zero_bytes(model_dir: str, tmp_path: Path, call: str) -> None:
    """vLLM's OffloadKey is bytes; an int key (a BlockHash of another vLLM line) must raise
    InvalidKeyError, as SlabScheduler._check_key intends.  The manager converts every key with
    ``bytes(k)`` first (vllm.py:308, 316, 320, 323, 326, 333): ``bytes(4) == b"\\0\\0\\0\\0"``, so
    every int n silently becomes the key of n zero bytes (distinct inputs alias, and
    keys_to_store no longer names the keys vLLM passed)."""
    p = _pair(model_dir, tmp_path)
    try:
        ctx = ReqContext(req_id="r")
        with pytest.raises(InvalidKeyError):
            if call == "lookup":
                p.mgr.lookup(4, ctx)
            else:
                p.mgr.prepare_store([4], ctx)
        assert p.mgr.tiers.debug_sizes()["host_entries"] == 0
    finally:
        p.close()


def test_prepare_load_of_no_keys_is_a_clear_error_or_an_empty_job(model_dir: str, tmp_path: Path) -> None:
    """prepare_load([]) reaches TierCore.begin_load, which builds ``Job(token, _LOAD, keys[0], ...)``
    (core/tiers.py:381): an IndexError from deep inside the core.  Expected: InvalidKeyError naming
    the problem, or an empty spec (vLLM's CPU manager returns one)."""
    p = _pair(model_dir, tmp_path)
    try:
        ctx = ReqContext(req_id="r")
        try:
            spec = p.mgr.prepare_load([], ctx)
        except InvalidKeyError:
            return
        assert spec.slots == []
    finally:
        p.close()


# ----------------------------------------------------------------------------- KV events
def _fail_next_store_copy(mover) -> None:
    """The copy worker's next device->host copy raises (as test_adapter_regressions._fail_stores)."""
    real, left = mover._memmove, [1]
    mover._wide = None

    def memmove(t) -> None:
        if t.kind is JobKind.STORE and left[0]:
            left[0] -= 1
            raise RuntimeError("simulated device->host copy fault")
        real(t)

    mover._memmove = memmove


@pytest.mark.parametrize("taken_between", [True, False], ids=["events-taken-between", "events-pending"])
def test_a_block_evicted_then_restored_unsuccessfully_is_reported_removed(model_dir: str, tmp_path: Path,
                                                                           taken_between: bool) -> None:
    """KV events must end in the state lookup answers.  Key a is stored (event: stored), evicted by
    evict-ahead at the end of a step, then prepare_store([a]) reserves it again in the same call that
    reports the step's evictions: SlabScheduler.prepare_store filters the evicted list by
    ``k not in core.index`` (scheduler.py:197), and a is in the index again (WRITING), so its removal
    is never reported.  The new store's copy fails on the worker (the ring records it; vLLM is told
    success, as the adapter does for stores), so it is never published: a is in no tier, yet the last
    event vLLM got for it says stored (a KV-event consumer keeps routing a's prefix here).  With vLLM
    not taking the events in between, a's first "stored" was recorded only at the next take_events,
    after the removal: the events must keep the order things happened in."""
    p = Pair(base.offloading_config(model_dir, tkv_extra(tmp_path, host_bytes=2 * ROW_BYTES,
                                                         host_evict_ahead_blocks=1), kv_events=True),
             new_kv(seed=8))
    try:
        ctx = ReqContext(req_id="r")
        a, b = keys(1, "a"), keys(1, "b")
        p.store(a, [1], ctx)
        p.store(b, [2], ctx)                 # b is MRU, a LRU
        if taken_between:
            assert sorted((k, e.removed) for e in p.mgr.take_events() for k in e.keys) == sorted(
                [(a[0], False), (b[0], False)])
        tick(p.mgr)                          # evict-ahead: one free slot -> a evicted
        assert p.mgr.lookup(a[0], ctx) is LookupResult.MISS
        out = p.mgr.prepare_store(a, ctx)    # a stored again, its old residency reported in this call
        assert out.keys_to_store == a
        _fail_next_store_copy(p.worker.copier._mover)
        jid = p.job_id()
        p.worker.submit_store(jid, gpu_spec([3]), out.store_spec)
        p.finish(jid)                        # answered success (a store's failure is the ring's business)
        p.mgr.complete_store(a, ctx)
        tick(p.mgr)
        assert p.mgr.lookup(a[0], ctx) is LookupResult.MISS
        last = {}
        for e in p.mgr.take_events():
            for k in e.keys:
                last[k] = "removed" if e.removed else "stored"
        assert last.get(a[0]) == "removed", f"events since: {last}; a is in no tier"
    finally:
        p.close()
