"""Regressions: four adapter bugs found by reviewing tiered_kv.integrations.vllm against vLLM's call
patterns (2026-12-01), and two cases no other test covered.

The first three tests each failed before their fix (the docstrings tell the bug as it was): the
derived namespace now names the TP/PP/PCP/DCP split, data-parallel replicas get a disk directory
each, and a failed store copy is a miss rather than a vLLM assertion (the size options refused at
spec creation naming the key the user wrote are cases of test_vllm_adapter's bad-config test).
The last two pin cases that already worked.
Everything is driven in this process through vLLM's own classes (no engine is
started): the spec built by ``OffloadingSpecFactory`` from a real
``OffloadingConfig``, the manager and workers through vLLM's abstract interface,
and (for the worker-side crash) vLLM's own ``OffloadingConnector`` in both roles
via the ``Engine`` stand-in of test_vllm_adapter.py.  No sleeps order anything:
copies are awaited with ``worker.wait``, spills with ``SlabScheduler.flush``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.base")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.config import OffloadingConfig  # noqa: E402

import test_vllm_adapter as base  # noqa: E402  (helpers only: no test is re-collected from here)
from test_vllm_adapter import (  # noqa: E402
    PROMPT_LEN,
    ROW_BYTES,
    Engine,
    Pair,
    block_bytes,
    canonical,
    gpu_spec,
    jobs,
    keys,
    make_spec,
    new_kv,
    prompt_tokens,
    stale,
    tick,
    tkv_extra,
)
from tiered_kv.errors import ConfigError, DiskInUseError  # noqa: E402
from tiered_kv.jobs import JobKind  # noqa: E402
from tiered_kv.integrations.vllm import TieredKVOffloadingManager  # noqa: E402

pytestmark = pytest.mark.timeout(120)

model_dir = base.model_dir  # the module-scoped tiny-Llama config fixture


def _parallel(cfg: OffloadingConfig, **par: Any) -> OffloadingConfig:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **par))


def _fresh_cfg(model_dir: str, extra: dict[str, Any]) -> OffloadingConfig:
    """What vLLM hands a spec (a new engine_id per call, as each engine gets)."""
    return build_offloading_config(base.make_vllm_config(model_dir, extra), base.make_kv_cache_config())


# ============================================================================= bugs
def test_a_disk_tier_written_under_tp2_is_not_served_to_pp2(model_dir: str, tmp_path: Path) -> None:
    """Namespace collision: TP=2 and PP=2 (world 2) have the same bytes per block but another layout.

    Under TP=2 each rank's part of a row holds half the KV heads of *every* layer; under PP=2 it
    holds all heads of *half* the layers.  For an even layer count the bytes per rank are equal,
    and the derived namespace (model, dtype, tokens per block, row bytes, world size, KV layout)
    is the same, so a PP=2 engine restarted on a TP=2 engine's disk_path loads TP-rank-0 bytes as
    its own layers: silently wrong KV (docs/vllm.md: "a disk tier is never served to a model or
    layout it was not written by").
    """
    extra = tkv_extra(tmp_path, disk_path=str(tmp_path / "disk"), disk_bytes=64 * ROW_BYTES)
    cfg = _fresh_cfg(model_dir, extra)

    def tp2(rank: int) -> OffloadingConfig:
        return _parallel(cfg, rank=rank, world_size=2, tp_size=2, pp_size=1)

    spec_s = make_spec(tp2(0))
    kvs = [new_kv(seed=30), new_kv(seed=31)]
    workers = [make_spec(tp2(r)).get_worker(canonical(kvs[r])) for r in (0, 1)]
    mgr = spec_s.get_manager()
    ctx = ReqContext(req_id="r")
    ks = keys(3, "tp")
    try:
        out = mgr.prepare_store(ks, ctx)
        for w in workers:
            assert w.submit_store(1, gpu_spec([1, 2, 3]), out.store_spec)
            w.wait({1})
            assert [r.job_id for r in w.get_finished()] == [1]
        mgr.complete_store(ks, ctx)
        assert mgr.tiers.flush(timeout=30) and mgr.tiers.disk_blocks == 3
    finally:
        for w in workers:
            w.shutdown()
        mgr.shutdown()

    pp_cfg = _parallel(_fresh_cfg(model_dir, extra), rank=0, world_size=2, tp_size=1, pp_size=2)
    spec_pp = make_spec(pp_cfg)
    assert spec_pp.row_bytes == spec_s.row_bytes       # same geometry, other layout
    mgr2 = spec_pp.get_manager()
    try:
        got = [mgr2.lookup(k, ctx) for k in ks]
        assert got == [LookupResult.MISS] * 3, (
            f"a PP=2 engine is offered blocks a TP=2 engine wrote: {got}; namespaces "
            f"{spec_s.tkv_config.namespace!r} / {spec_pp.tkv_config.namespace!r}")
    finally:
        mgr2.shutdown()


def test_data_parallel_replicas_on_one_disk_path_both_start(model_dir: str, tmp_path: Path) -> None:
    """vLLM builds one EngineCore (one manager) per DP replica from the same kv_connector_extra_config.

    With a disk_path, the second replica's manager raises DiskInUseError at start, so the
    documented config cannot run with data_parallel_size > 1.  Expected: each replica starts
    (e.g. its own sub-directory), or the spec refuses the combination up front with a
    ConfigError that names data parallelism.
    """
    extra = tkv_extra(tmp_path, disk_path=str(tmp_path / "disk"), disk_bytes=64 * ROW_BYTES)
    mgrs: list[TieredKVOffloadingManager] = []
    try:
        for dp in (0, 1):
            cfg = _parallel(_fresh_cfg(model_dir, extra), data_parallel_index=dp, data_parallel_size=2)
            try:
                spec = make_spec(cfg)
            except ConfigError as exc:
                assert "data_parallel" in str(exc) or "data parallel" in str(exc), str(exc)
                return
            try:
                mgrs.append(spec.get_manager())  # type: ignore[arg-type]
            except DiskInUseError as exc:
                pytest.fail(f"DP replica {dp} cannot start on the shared disk_path: {exc}")
    finally:
        for m in mgrs:
            m.shutdown()


def _fail_stores(mover: Any, fail: list[int]) -> None:
    """The copy worker's next ``fail[0]`` device->host copies raise (a failed store copy); loads pass.
    Every transfer is copied row by row here (no batched copy), where the fault is injected."""
    real = mover._memmove
    mover._wide = None

    def memmove(t: Any) -> None:
        if t.kind is JobKind.STORE and fail[0] > 0:
            fail[0] -= 1
            raise RuntimeError("simulated device->host copy fault")
        real(t)

    mover._memmove = memmove


def test_a_failed_store_copy_becomes_a_miss_not_a_vllm_crash(model_dir: str, tmp_path: Path) -> None:
    """A store whose copy fails is reported to vLLM as success=False; vLLM 0.32's worker connector
    asserts ``transfer_result.success`` (OffloadingConnectorWorker.get_finished), so the engine dies.
    The ring already records the failure and SlabScheduler._finish_store never publishes a store the
    rings mark failed, so the fault could degrade into a miss (architecture invariant 11)."""
    eng = Engine(model_dir, tkv_extra(tmp_path))
    try:
        fail = [1]
        _fail_stores(eng.worker.copier._mover, fail)
        eng.add("a", prompt_tokens(21, PROMPT_LEN), max_tokens=3)
        eng.run()                                    # AssertionError inside vLLM's worker connector today
        assert fail == [0] and "a" in eng.finished
        assert eng.lookup("a") == [LookupResult.MISS] * 4   # the failed store is never served
        tick(eng.mgr)
        assert jobs(eng.mgr, "store", "failed") == 1 and jobs(eng.mgr, "store", "ok") == 0
        assert eng.mgr.tiers.debug_sizes()["host_used_slots"] == 0
    finally:
        eng.close()


# ============================================================================= untested cases (pass)
def test_keys_differing_only_in_kv_group_suffix_are_independent(model_dir: str, tmp_path: Path) -> None:
    """Untested before: OffloadKey = block hash + 4-byte group index; the adapter must treat the
    suffix as part of the key (no hit, no shared slot, own bytes)."""
    p = Pair(base.offloading_config(model_dir, tkv_extra(tmp_path)), new_kv(seed=40))
    try:
        ctx = ReqContext(req_id="r")
        h = hashlib.sha256(b"one block").digest()
        g0, g1 = make_offload_key(h, 0), make_offload_key(h, 1)
        p.store([g0], [1], ctx)
        assert p.mgr.lookup(g1, ctx) is LookupResult.MISS
        assert p.mgr.prepare_store([g1, g0], ctx).keys_to_store == [g1]
        p.mgr.reset_cache()
        p.store([g0], [1], ctx)
        p.store([g1], [2], ctx)
        p.load([g1, g0], [50, 51], ctx)
        assert block_bytes(p.kv, 50) == block_bytes(p.kv, 2) and block_bytes(p.kv, 51) == block_bytes(p.kv, 1)
        tick(p.mgr)
        assert stale(p.mgr) == 0
    finally:
        p.close()


def test_worker_job_id_reused_after_reported_and_wait_for_unknown_ids(model_dir: str, tmp_path: Path) -> None:
    """Untested at the adapter level: a job id vLLM reuses after get_finished reported it is a new
    job (reported once more, with its own bytes); wait() for ids never submitted returns at once."""
    p = Pair(base.offloading_config(model_dir, tkv_extra(tmp_path)), new_kv(seed=41))
    try:
        ctx = ReqContext(req_id="r")
        ks = keys(2, "reuse")
        out = p.mgr.prepare_store(ks, ctx)
        assert p.worker.submit_store(7, gpu_spec([3, 4]), out.store_spec)
        p.worker.wait({7, 12345})
        assert [(r.job_id, r.success) for r in p.worker.get_finished()] == [(7, True)]
        p.mgr.complete_store(ks, ctx)
        src = p.mgr.prepare_load(ks, ctx)
        assert p.worker.submit_load(7, src, gpu_spec([60, 61]), expedited=True)  # same id, new job
        p.worker.wait({7})
        assert [(r.job_id, r.success) for r in p.worker.get_finished()] == [(7, True)]
        assert p.worker.get_finished() == []
        p.mgr.complete_load(ks, ctx)
        assert [block_bytes(p.kv, b) for b in (60, 61)] == [block_bytes(p.kv, b) for b in (3, 4)]
        p.worker.wait({7, 999})                   # all reported / unknown: returns
        tick(p.mgr)
        assert stale(p.mgr) == 0 and p.mgr.tiers.debug_sizes()["live_loads"] == 0
    finally:
        p.close()


# ============================================================================= policies under vLLM's call sequence
def _chain_keys(tag: str, n: int, group: int = 0) -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"{tag}-{i}".encode()).digest(), group) for i in range(n)]


def _at(ctx: ReqContext, ks: list[bytes], first: int = 1) -> None:
    """vLLM records each key's end token in the request's context (one block: BS tokens)."""
    for i, k in enumerate(ks):
        ctx.set_offload_key_position(k, (first + i) * base.BS)


def test_the_prefix_policy_learns_a_requests_chain_across_vllms_calls(model_dir: str, tmp_path: Path) -> None:
    """vLLM never hands the manager a chain in one call: it asks a key at a time and stores one boundary (one
    key per KV group) per call, a decode block a step after its parent.  With ``host_policy="prefix"`` the
    chain a-b-c must still evict from its tail: before, nothing linked c to b, so c was a leaf of its own and
    b (older) went first, leaving c unreachable by any prefix lookup."""
    p = Pair(base.offloading_config(model_dir, tkv_extra(tmp_path, host_bytes=4 * ROW_BYTES, host_policy="prefix",
                                                         host_evict_ahead_blocks=0)), new_kv(seed=42))
    try:
        a, b, c = _chain_keys("chain", 3)
        z, n1, n2 = _chain_keys("other", 3)
        r1 = ReqContext(req_id="r1")
        _at(r1, [a, b, c])
        p.store([a], [1], r1)
        p.store([b], [2], r1)
        p.store([c], [3], r1)                      # a decode block, a step later
        r2 = ReqContext(req_id="r2")
        _at(r2, [z])
        p.store([z], [4], r2)
        r3 = ReqContext(req_id="r3")               # the same prefix again: asked key by key
        _at(r3, [a, b, c])
        assert [p.mgr.lookup(k, r3) for k in (a, b, c)] == [LookupResult.HIT] * 3
        tick(p.mgr)
        r4 = ReqContext(req_id="r4")
        _at(r4, [n1, n2])
        assert p.mgr.lookup(n1, r4) is LookupResult.MISS   # a new request: looked up, then its blocks stored
        out = p.mgr.prepare_store([n1], r4)
        assert out is not None and out.keys_to_store == [n1]
        out2 = p.mgr.prepare_store([n2], r4)
        assert out2 is not None and out2.keys_to_store == [n2]
        evicted = set(out.evicted_keys) | set(out2.evicted_keys)
        assert evicted == {c, z}, f"evicted {sorted(evicted)}: the chain a-b-c lost an inner block"
    finally:
        p.close()


def test_one_boundarys_keys_of_two_kv_groups_are_two_chains_not_one(model_dir: str, tmp_path: Path) -> None:
    """A hybrid model stores a boundary's keys of every KV group in one prepare_store call: those keys are
    siblings, not parent and child.  Each group's chain links to its own previous key (its last 4 bytes name
    the group), so the group-1 key of boundary 1 is no parent of the group-0 key of boundary 2."""
    p = Pair(base.offloading_config(model_dir, tkv_extra(tmp_path, host_policy="prefix")), new_kv(seed=43))
    try:
        h = [hashlib.sha256(b"hybrid-%d" % i).digest() for i in range(2)]
        g0 = [make_offload_key(x, 0) for x in h]
        g1 = [make_offload_key(x, 1) for x in h]
        ctx = ReqContext(req_id="hybrid")
        _at(ctx, [g0[0], g0[1]])
        _at(ctx, [g1[0], g1[1]])
        p.store([g0[0], g1[0]], [1, 2], ctx)
        p.store([g0[1], g1[1]], [3, 4], ctx)
        pol = p.mgr.tiers.core.index.policy
        parent = {k: pol.nodes[k].parent for k in g0 + g1}
        assert parent == {g0[0]: None, g1[0]: None, g0[1]: g0[0], g1[1]: g1[0]}, parent
    finally:
        p.close()


def test_second_hit_admits_a_block_vllm_asked_for_before(model_dir: str, tmp_path: Path) -> None:
    """docs/vllm.md: with ``host_admission="second_hit"`` a block is offloaded once the scheduler asked for it
    before.  The scheduler's lookups are those references: before, only TierManager's lookup counted them,
    and every store under vLLM was refused."""
    p = Pair(base.offloading_config(model_dir, tkv_extra(tmp_path, host_admission="second_hit")), new_kv(seed=44))
    try:
        once, hot = _chain_keys("admit", 2)
        ctx = ReqContext(req_id="r")
        assert p.mgr.lookup(hot, ctx) is LookupResult.MISS
        assert p.mgr.lookup(hot, ctx) is LookupResult.MISS
        out = p.mgr.prepare_store([once, hot], ctx)
        assert out is not None and out.keys_to_store == [hot], out.keys_to_store
    finally:
        p.close()
