"""Unit tests of the vLLM adapter (tiered_kv.integrations.vllm) against vLLM's own classes.

Three layers, all in this process, on CPU tensors:

* the spec, built by vLLM's ``OffloadingSpecFactory`` from an ``OffloadingConfig``
  that vLLM's own ``build_offloading_config`` derived from a ``VllmConfig``;
* manager and worker driven directly through vLLM's abstract interface
  (``OffloadingManager`` / ``OffloadingWorker``), the way the connector calls them;
* a real ``vllm.v1.core.sched.scheduler.Scheduler`` whose ``OffloadingConnector``
  (SCHEDULER role) loads the spec through ``spec_module_path``, plus an
  ``OffloadingConnector`` in WORKER role fed the scheduler's metadata, with real
  CPU KV tensors registered through ``register_kv_caches`` (:class:`Engine`).

The engine stand-in simulates the forward pass: every KV block it computes is
filled with bytes that are a pure function of the tokens up to the block's end
(as a real model's KV would be), so a block loaded from the offload tiers can be
checked against what recomputing it would have produced.

Determinism: every copy the worker submitted is waited for before the step goes
on; disk reads are awaited through ``SlabScheduler.flush`` (a wait point on the
completion queue), never by sleeping.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import pickle
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.base")  # conftest skips the directory already; this guards the module alone

from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402
from vllm.forward_context import ForwardContext  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import OffloadingConfig  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from tiered_kv.errors import ConfigError, DiskInUseError, UnsupportedVersionError  # noqa: E402
from tiered_kv.integrations import vllm as tkv_vllm  # noqa: E402
from tiered_kv.integrations.vllm import (  # noqa: E402
    TieredKVLoadStoreSpec,
    TieredKVOffloadingManager,
    TieredKVOffloadingSpec,
    TieredKVOffloadingWorker,
    _check_vllm_version,
)

pytestmark = pytest.mark.timeout(120)

# ----------------------------------------------------------------------------- geometry
BS = 16                      # tokens per vLLM block (= per offloaded key: blocks_per_chunk 1)
NUM_GPU_BLOCKS = 64
LAYERS = ("layer0", "layer1")
KV_HEADS, HEAD_SIZE = 2, 8
KV_DTYPE = torch.float32
PAGE_BYTES = 2 * BS * KV_HEADS * HEAD_SIZE * 4          # K and V of one layer, one block: 2048
ROW_BYTES = PAGE_BYTES * len(LAYERS)                    # one block of every layer: 4096
VOCAB = 512
SPEC_MODULE = "tiered_kv.integrations.vllm"
NO_CTX = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


# ----------------------------------------------------------------------------- configs
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama config (no weights: nothing here runs the model)."""
    from transformers import LlamaConfig

    d = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=len(LAYERS),
                num_attention_heads=2, num_key_value_heads=KV_HEADS, head_dim=32,
                max_position_embeddings=1024).save_pretrained(str(d))
    return str(d)


def tkv_extra(shm_dir: Path, **over: Any) -> dict[str, Any]:
    """kv_connector_extra_config selecting the tiered_kv spec (host slab in ``shm_dir``)."""
    extra: dict[str, Any] = {"spec_name": "TieredKVOffloadingSpec", "spec_module_path": SPEC_MODULE,
                             "host_bytes": 64 * ROW_BYTES, "shm_dir": str(shm_dir)}
    extra.update(over)
    return {k: v for k, v in extra.items() if v is not None}


def make_vllm_config(model_dir: str, extra: dict[str, Any], *, num_gpu_blocks: int = NUM_GPU_BLOCKS,
                     max_num_batched_tokens: int = 1024, kv_events: bool = False) -> VllmConfig:
    vc = VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", seed=0,
                                 max_model_len=1024),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=1024, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                            kv_connector_extra_config=extra),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None,
        device_config=DeviceConfig("cpu"),
    )
    vc.cache_config.num_gpu_blocks = num_gpu_blocks
    return vc


def make_kv_cache_config(num_blocks: int = NUM_GPU_BLOCKS) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(list(LAYERS), FullAttentionSpec(block_size=BS, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                                                         dtype=KV_DTYPE))])


def offloading_config(model_dir: str, extra: dict[str, Any], **kw: Any) -> OffloadingConfig:
    """What vLLM hands a spec: ``build_offloading_config`` of a real VllmConfig (fresh engine_id each call)."""
    return build_offloading_config(make_vllm_config(model_dir, extra, **kw), make_kv_cache_config())


def make_spec(cfg: OffloadingConfig) -> TieredKVOffloadingSpec:
    spec = OffloadingSpecFactory.create_spec(cfg)
    assert isinstance(spec, TieredKVOffloadingSpec)
    return spec


# ----------------------------------------------------------------------------- KV tensors
def new_kv(num_blocks: int = NUM_GPU_BLOCKS, seed: Optional[int] = None) -> dict[str, torch.Tensor]:
    """Per-layer KV caches shaped (num_blocks, 2, BS, heads, head_size): seeded random, or zeros."""
    if seed is None:
        return {n: torch.zeros(num_blocks, 2, BS, KV_HEADS, HEAD_SIZE, dtype=KV_DTYPE) for n in LAYERS}
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(num_blocks, 2, BS, KV_HEADS, HEAD_SIZE, generator=g, dtype=KV_DTYPE) for n in LAYERS}


def canonical(kv: dict[str, torch.Tensor]) -> CanonicalKVCaches:
    """vLLM's canonical form of ``kv``: one (num_blocks, page_bytes) int8 view per layer."""
    tensors = [CanonicalKVCacheTensor(kv[n].view(kv[n].shape[0], -1).view(torch.int8), PAGE_BYTES) for n in LAYERS]
    return CanonicalKVCaches(tensors=tensors,
                             group_data_refs=[[CanonicalKVCacheRef(i, PAGE_BYTES) for i in range(len(LAYERS))]])


def block_bytes(kv: dict[str, torch.Tensor], block_id: int) -> bytes:
    return b"".join(kv[n][block_id].contiguous().view(torch.uint8).numpy().tobytes() for n in LAYERS)


def gpu_spec(block_ids: Sequence[int]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(list(block_ids), group_sizes=[len(block_ids)], block_indices=[0])


def keys(n: int, tag: str = "k") -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"{tag}{i}".encode()).digest(), 0) for i in range(n)]


def stale(mgr: TieredKVOffloadingManager, kind: Optional[str] = None, reason: Optional[str] = None) -> float:
    """tiered_kv_stale_callbacks_total of ``mgr`` (summed over the labels not given)."""
    total = 0.0
    for metric in mgr.metrics.registry.collect():
        for s in metric.samples:
            if s.name != "tiered_kv_stale_callbacks_total":
                continue
            if (kind is None or s.labels["kind"] == kind) and (reason is None or s.labels["reason"] == reason):
                total += s.value
    return total


def jobs(mgr: TieredKVOffloadingManager, kind: str, outcome: str) -> float:
    return mgr.metrics.registry.get_sample_value("tiered_kv_jobs_total", {"kind": kind, "outcome": outcome}) or 0.0


def tick(mgr: OffloadingManager) -> None:
    """One scheduler step's end (the adapter applies batched metrics and finished work here)."""
    mgr.on_schedule_end(NO_CTX)


def assert_no_job_left(mgr: TieredKVOffloadingManager) -> dict[str, int]:
    """After a step: no live, quarantined or awaiting job and nothing stale; returns the sizes."""
    tick(mgr)
    assert stale(mgr) == 0
    sizes = mgr.tiers.debug_sizes()
    assert sizes["live_stores"] == sizes["live_loads"] == sizes["quarantine"] == sizes["awaiting"] == 0, sizes
    return sizes


def offload_and_forget_on_gpu(eng: Any, req_id: str, prompt: list[int]) -> None:
    """Run ``prompt`` to completion (its full blocks are offloaded), then drop vLLM's GPU prefix cache."""
    eng.add(req_id, prompt, max_tokens=2)
    eng.run()
    assert eng.sched.reset_prefix_cache()


def start_with_a_pending_store(eng: Any, seed: int) -> Any:
    """Request "a" (a prompt of ``seed``) runs one step: its store is prepared, not yet copied."""
    eng.add("a", prompt_tokens(seed, PROMPT_LEN), max_tokens=4)
    eng.step()
    (store_id,) = eng.store_jobs
    assert eng.mgr.tiers.debug_sizes()["live_stores"] == 1   # deferred a step by vLLM
    return store_id


class Pair:
    """Scheduler-side manager and one worker, as two processes would build them from one config."""

    def __init__(self, cfg: OffloadingConfig, kv: dict[str, torch.Tensor], worker_first: bool = False) -> None:
        self.cfg = cfg
        self.spec_s = make_spec(cfg)                      # the EngineCore process's spec
        self.spec_w = make_spec(dataclasses.replace(cfg))  # the worker process's spec
        self.kv = kv
        if worker_first:  # vLLM's order: workers register their KV caches before the scheduler exists
            self.worker = self.spec_w.get_worker(canonical(kv))
            self.mgr = self.spec_s.get_manager()
        else:
            self.mgr = self.spec_s.get_manager()
            self.worker = self.spec_w.get_worker(canonical(kv))
        assert isinstance(self.mgr, TieredKVOffloadingManager)
        assert isinstance(self.worker, TieredKVOffloadingWorker)
        self._job = 100

    def job_id(self) -> int:
        self._job += 1
        return self._job

    def finish(self, *job_ids: int) -> list:
        self.worker.wait(set(job_ids))
        done = self.worker.get_finished()
        assert sorted(r.job_id for r in done) == sorted(job_ids)
        assert all(r.success for r in done)
        return done

    def store(self, ks: list[bytes], blocks: Sequence[int], ctx: ReqContext) -> int:
        out = self.mgr.prepare_store(ks, ctx)
        assert out is not None and out.keys_to_store == ks
        jid = self.job_id()
        assert self.worker.submit_store(jid, gpu_spec(blocks), out.store_spec)
        self.finish(jid)
        self.mgr.complete_store(ks, ctx)
        return jid

    def load(self, ks: list[bytes], blocks: Sequence[int], ctx: ReqContext, **kw: Any) -> int:
        src = self.mgr.prepare_load(ks, ctx)
        jid = self.job_id()
        assert self.worker.submit_load(jid, src, gpu_spec(blocks), **kw)
        self.finish(jid)
        self.mgr.complete_load(ks, ctx)
        return jid

    def close(self) -> None:
        self.worker.shutdown()
        self.mgr.shutdown()


@pytest.fixture
def pair(model_dir: str, tmp_path: Path):
    p = Pair(offloading_config(model_dir, tkv_extra(tmp_path)), new_kv(seed=1))
    yield p
    p.close()


# ============================================================================= 1. loading, config, version
def test_spec_loads_through_spec_module_path(model_dir: str, tmp_path: Path) -> None:
    extra = tkv_extra(tmp_path)
    cls = OffloadingSpecFactory.get_spec_cls(extra)
    assert cls is TieredKVOffloadingSpec
    assert issubclass(cls, OffloadingSpec)
    spec = OffloadingSpecFactory.create_spec(offloading_config(model_dir, extra))
    assert isinstance(spec, TieredKVOffloadingSpec)
    assert spec.row_bytes == ROW_BYTES and spec.num_slots == 64 and spec.blocks_per_chunk == 1
    assert spec.tkv_config.namespace.startswith("vllm/")
    mgr, worker = spec.get_manager(), spec.get_worker(canonical(new_kv()))
    try:
        assert isinstance(mgr, OffloadingManager) and isinstance(worker, OffloadingWorker)
        assert spec.get_manager() is mgr and spec.get_worker(canonical(new_kv())) is worker
    finally:
        worker.shutdown()
        mgr.shutdown()
    assert list(tmp_path.iterdir()) == []  # the slab's name is gone after shutdown


def test_namespace_is_stable_across_engines_and_differs_by_geometry(model_dir: str, tmp_path: Path) -> None:
    a = make_spec(offloading_config(model_dir, tkv_extra(tmp_path)))
    b = make_spec(offloading_config(model_dir, tkv_extra(tmp_path)))
    assert a.engine_id != b.engine_id                          # a restart is a new engine ...
    assert a.tkv_config.namespace == b.tkv_config.namespace    # ... reading the same disk namespace
    cfg = offloading_config(model_dir, tkv_extra(tmp_path))
    other = make_spec(dataclasses.replace(cfg, worker_kv_bytes_per_block=2 * ROW_BYTES))
    assert other.tkv_config.namespace != a.tkv_config.namespace


def test_offloading_spec_pickles_without_its_live_halves(model_dir: str, tmp_path: Path) -> None:
    spec = make_spec(offloading_config(model_dir, tkv_extra(tmp_path)))
    mgr = spec.get_manager()
    try:
        back = pickle.loads(pickle.dumps(spec))         # a spec in use still pickles ...
        assert back._manager is None and back._worker is None
        assert back.tkv_config == spec.tkv_config and back.engine_id == spec.engine_id
        assert (back.num_slots, back.row_bytes) == (spec.num_slots, spec.row_bytes)
        assert spec._manager is mgr                      # ... and the original keeps its manager
    finally:
        mgr.shutdown()


def test_load_store_spec_pickles(pair: Pair) -> None:
    out = pair.mgr.prepare_store(keys(3), ReqContext(req_id="r"))
    spec = out.store_spec
    assert isinstance(spec, TieredKVLoadStoreSpec)
    back = pickle.loads(pickle.dumps(spec))
    assert type(back) is TieredKVLoadStoreSpec
    assert (back.token, back.seq, back.slots) == (spec.token, spec.seq, spec.slots)
    assert len(back.token) == 16 and len(back.slots) == 3
    # as the scheduler ships it to the workers: inside the connector metadata
    meta = OffloadingConnectorMetadata(load_jobs={}, store_jobs={
        7: TransferJob(req_id="r", src_spec=gpu_spec([1, 2, 3]), dst_spec=spec)})
    meta2 = pickle.loads(pickle.dumps(meta))
    s2 = meta2.store_jobs[7].dst_spec
    assert (s2.token, s2.seq, s2.slots) == (spec.token, spec.seq, spec.slots)
    # the unpickled spec drives the worker exactly like the original
    assert pair.worker.submit_store(1, meta2.store_jobs[7].src_spec, s2)
    pair.finish(1)
    pair.mgr.complete_store(keys(3), ReqContext(req_id="r"))
    assert all(pair.mgr.lookup(k, ReqContext(req_id="r")) is LookupResult.HIT for k in keys(3))


@pytest.mark.parametrize(("over", "needles"), [
    ({"host_bytes": None}, ["host_bytes"]),
    ({"disk_path": "/nonexistent/tkv-disk"}, ["disk_path", "/nonexistent/tkv-disk", "disk_bytes"]),
    ({"blocks_per_chunk": 2}, ["blocks_per_chunk", "2"]),
    ({"host_bytes": -4096}, ["host_bytes", "-4096"]),
    ({"host_bytes": 0}, ["host_bytes", "0"]),
    ({"host_bytes": True}, ["host_bytes", "True"]),
    ({"host_bytes": "8G"}, ["host_bytes", "8G"]),
    ({"host_bytes": ROW_BYTES - 1}, ["host_bytes", str(ROW_BYTES - 1)]),
    ({"disk_path": "/nonexistent/tkv-disk", "disk_bytes": -1}, ["disk_bytes", "-1"]),
    ({"durability": "sometimes"}, ["durability", "sometimes"]),
    ({"writer_queue_blocks": 0}, ["writer_queue_blocks", "0"]),
    # refused at spec creation (not later in EngineCore), naming the key the user wrote (regressions)
    ({"disk_path": "/nonexistent/tkv-disk", "disk_bytes": ROW_BYTES - 1}, ["disk_bytes", str(ROW_BYTES - 1)]),
    ({"host_bytes": None, "cpu_bytes_to_use": 0}, ["cpu_bytes_to_use", "0"]),
    ({"host_bytes": None, "cpu_bytes_to_use": "8G"}, ["cpu_bytes_to_use", "8G"]),
], ids=["no-host_bytes", "disk_path-without-disk_bytes", "blocks_per_chunk-2", "negative-host_bytes",
        "zero-host_bytes", "bool-host_bytes", "str-host_bytes", "host_bytes-below-one-block", "negative-disk_bytes",
        "bad-durability", "zero-writer_queue", "disk_bytes-below-one-block", "zero-cpu_bytes_to_use",
        "str-cpu_bytes_to_use"])
def test_bad_config_raises_config_error_naming_the_value(model_dir: str, tmp_path: Path, over: dict,
                                                         needles: list[str]) -> None:
    extra = tkv_extra(tmp_path)
    for k, v in over.items():
        if v is None:
            extra.pop(k, None)
        else:
            extra[k] = v
    cfg = offloading_config(model_dir, extra)
    with pytest.raises(ConfigError) as ei:
        OffloadingSpecFactory.create_spec(cfg)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not named in {msg!r}"
    assert list(tmp_path.iterdir()) == []  # nothing created in shm_dir by a rejected config


def test_vllm_cpu_bytes_to_use_key_is_accepted(model_dir: str, tmp_path: Path) -> None:
    extra = tkv_extra(tmp_path, host_bytes=None, cpu_bytes_to_use=8 * ROW_BYTES)
    spec = make_spec(offloading_config(model_dir, extra))
    assert spec.num_slots == 8


@pytest.mark.parametrize("version", ["0.29.1", "0.34.0", "0.34.0rc1", "0.35.2+cpu", "0.29.99", "1.0.0", "unknown"])
def test_unsupported_vllm_version_raises(version: str) -> None:
    with pytest.raises(UnsupportedVersionError) as ei:
        _check_vllm_version(version)
    msg = str(ei.value)
    assert ">= 0.30" in msg and "< 0.34" in msg, msg  # names the supported range
    assert version in msg
    assert isinstance(ei.value, ImportError)  # what an `import` of the adapter raises


@pytest.mark.parametrize("version", ["0.30.0", "0.32.0+cpu", "0.33.1", "0.31.2.post1", "0.33.9.dev3+g1234abc"])
def test_supported_vllm_version_passes(version: str) -> None:
    _check_vllm_version(version)


def test_installed_vllm_is_in_range() -> None:
    import vllm

    _check_vllm_version(vllm.__version__)
    assert tkv_vllm.SUPPORTED_RANGE == ("0.30", "0.34")


# ============================================================================= 2. manager + worker
@pytest.mark.parametrize("expedited", [None, False, True], ids=["0.32-signature", "expedited-False",
                                                                "expedited-True-0.33"])
def test_store_lookup_load_roundtrip(pair: Pair, expedited: Optional[bool]) -> None:
    ctx = ReqContext(req_id="r0")
    ks = keys(4)
    src_blocks, dst_blocks = [3, 5, 7, 9], [20, 31, 22, 40]
    originals = [block_bytes(pair.kv, b) for b in src_blocks]
    for b in dst_blocks:
        for n in LAYERS:
            pair.kv[n][b].zero_()

    out = pair.mgr.prepare_store(ks, ctx)
    assert out.keys_to_store == ks and out.evicted_keys == []
    assert isinstance(out.store_spec, TieredKVLoadStoreSpec)
    assert all(pair.mgr.lookup(k, ctx) is LookupResult.MISS for k in ks)  # not offloaded until completed
    jid = pair.job_id()
    assert pair.worker.submit_store(jid, gpu_spec(src_blocks), out.store_spec)
    (res,) = pair.finish(jid)
    assert res.transfer_size == 4 * ROW_BYTES and res.transfer_time is not None and res.transfer_time >= 0
    assert all(pair.mgr.lookup(k, ctx) is LookupResult.MISS for k in ks)
    pair.mgr.complete_store(ks, ctx)
    assert [pair.mgr.lookup(k, ctx) for k in ks] == [LookupResult.HIT] * 4
    assert not pair.mgr.has_pending_work()

    # storing keys already offloaded is a no-op the scheduler understands (empty keys_to_store)
    again = pair.mgr.prepare_store(ks[:2], ctx)
    assert again is not None and again.keys_to_store == []

    load = pair.mgr.prepare_load(ks, ctx)
    assert isinstance(load, TieredKVLoadStoreSpec)
    jid = pair.job_id()
    kw = {} if expedited is None else {"expedited": expedited}
    assert pair.worker.submit_load(jid, load, gpu_spec(dst_blocks), **kw)
    (res,) = pair.finish(jid)
    assert res.transfer_size == 4 * ROW_BYTES
    pair.mgr.complete_load(ks, ctx)
    assert [block_bytes(pair.kv, b) for b in dst_blocks] == originals
    assert [pair.mgr.lookup(k, ctx) for k in ks] == [LookupResult.HIT] * 4

    assert assert_no_job_left(pair.mgr)["host_entries"] == 4
    assert jobs(pair.mgr, "store", "ok") == 1 and jobs(pair.mgr, "load", "ok") == 1


def test_load_subset_in_another_order(pair: Pair) -> None:
    ctx = ReqContext(req_id="r0")
    ks = keys(5)
    pair.store(ks, [1, 2, 3, 4, 5], ctx)
    expect = {k: block_bytes(pair.kv, b) for k, b in zip(ks, [1, 2, 3, 4, 5])}
    sub = [ks[3], ks[0], ks[4]]
    pair.load(sub, [60, 61, 62], ctx)
    assert [block_bytes(pair.kv, b) for b in (60, 61, 62)] == [expect[k] for k in sub]


@pytest.mark.parametrize("worker_first", [True, False], ids=["worker-first", "manager-first"])
def test_slab_is_shared_and_its_name_dropped(model_dir: str, tmp_path: Path, worker_first: bool) -> None:
    p = Pair(offloading_config(model_dir, tkv_extra(tmp_path)), new_kv(seed=5), worker_first=worker_first)
    try:
        assert p.worker.slab.path == p.mgr.slab.path and p.worker.slab.path.parent == tmp_path
        assert p.worker.slab.created is worker_first and p.mgr.slab.created is not worker_first
        if worker_first:  # the scheduler attaches last and drops the name: the memory dies with the processes
            assert list(tmp_path.iterdir()) == []
        ctx = ReqContext(req_id="r")
        p.store(keys(2), [1, 2], ctx)
        p.load(keys(2), [50, 51], ctx)
        assert [block_bytes(p.kv, b) for b in (50, 51)] == [block_bytes(p.kv, b) for b in (1, 2)]
    finally:
        p.close()
    assert list(tmp_path.iterdir()) == []


def test_tensor_parallel_store_publishes_only_when_every_rank_copied(model_dir: str, tmp_path: Path) -> None:
    """world_size 2: each worker rank copies its own part of a block; a store is loadable only once all did."""
    base = offloading_config(model_dir, tkv_extra(tmp_path))

    def ranked(rank: int) -> OffloadingConfig:
        return dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, rank=rank, world_size=2,
                                                                      tp_size=2))

    spec_s = make_spec(ranked(0))
    assert spec_s.row_bytes == 2 * ROW_BYTES and spec_s.num_slots == 32
    kvs = [new_kv(seed=20), new_kv(seed=21)]
    workers = [make_spec(ranked(r)).get_worker(canonical(kvs[r])) for r in (0, 1)]
    mgr = spec_s.get_manager()
    try:
        ctx = ReqContext(req_id="r")
        ks = keys(3)
        src, dst = [1, 2, 3], [40, 41, 42]
        originals = [[block_bytes(kv, b) for b in src] for kv in kvs]
        out = mgr.prepare_store(ks, ctx)
        assert workers[0].submit_store(1, gpu_spec(src), out.store_spec)
        workers[0].wait({1})
        assert [r.job_id for r in workers[0].get_finished()] == [1]
        mgr.complete_store(ks, ctx)          # early: rank 1 has not copied yet
        tick(mgr)
        assert all(mgr.lookup(k, ctx) is LookupResult.MISS for k in ks)
        assert mgr.tiers.debug_sizes()["awaiting"] == 1
        assert workers[1].submit_store(1, gpu_spec(src), out.store_spec)
        workers[1].wait({1})
        assert [r.job_id for r in workers[1].get_finished()] == [1]
        tick(mgr)
        assert [mgr.lookup(k, ctx) for k in ks] == [LookupResult.HIT] * 3
        load = mgr.prepare_load(ks, ctx)
        for r, w in enumerate(workers):
            assert w.submit_load(2, load, gpu_spec(dst))
            w.wait({2})
            assert [x.job_id for x in w.get_finished()] == [2]
        mgr.complete_load(ks, ctx)
        for r in (0, 1):  # each rank got its own bytes back, not the other rank's
            assert [block_bytes(kvs[r], b) for b in dst] == originals[r]
        tick(mgr)
        assert stale(mgr) == 0 and jobs(mgr, "store", "ok") == 1 and jobs(mgr, "load", "ok") == 1
    finally:
        for w in workers:
            w.shutdown()
        mgr.shutdown()


def test_host_full_evicts_lru_and_reports_evicted_keys(model_dir: str, tmp_path: Path) -> None:
    p = Pair(offloading_config(model_dir, tkv_extra(tmp_path, host_bytes=4 * ROW_BYTES)), new_kv(seed=2))
    try:
        ctx = ReqContext(req_id="r")
        old, new = keys(4, "old"), keys(2, "new")
        p.store(old, [1, 2, 3, 4], ctx)
        assert p.mgr.lookup(old[0], ctx) is LookupResult.HIT  # old[0] becomes most recently used
        out = p.mgr.prepare_store(new, ctx)
        assert out.keys_to_store == new
        assert sorted(out.evicted_keys) == sorted(old[1:3])
        jid = p.job_id()
        p.worker.submit_store(jid, gpu_spec([10, 11]), out.store_spec)
        p.finish(jid)
        p.mgr.complete_store(new, ctx)
        got = {k: p.mgr.lookup(k, ctx) for k in old + new}
        assert [got[k] for k in old] == [LookupResult.HIT, LookupResult.MISS, LookupResult.MISS, LookupResult.HIT]
        assert [got[k] for k in new] == [LookupResult.HIT] * 2
        # a key leased by a load is never evicted: with every slot leased, the store is shed
        p.mgr.prepare_load([old[0], old[3]] + new, ctx)
        shed = p.mgr.prepare_store(keys(1, "x"), ctx)
        assert shed is not None and shed.keys_to_store == [] and shed.evicted_keys == []
    finally:
        p.close()


def test_kv_events_are_emitted_when_enabled(model_dir: str, tmp_path: Path) -> None:
    p = Pair(offloading_config(model_dir, tkv_extra(tmp_path, host_bytes=2 * ROW_BYTES), kv_events=True),
             new_kv(seed=3))
    try:
        ctx = ReqContext(req_id="r")
        a, b = keys(2, "a"), keys(1, "b")
        p.store(a, [1, 2], ctx)
        ev = list(p.mgr.take_events())
        assert [(sorted(e.keys), e.removed) for e in ev] == [(sorted(a), False)]
        p.store(b, [3], ctx)  # evicts the LRU of a
        ev = list(p.mgr.take_events())
        assert sorted((tuple(e.keys), e.removed) for e in ev) == sorted([((a[0],), True), ((b[0],), False)])
        assert list(p.mgr.take_events()) == []
    finally:
        p.close()


@pytest.mark.parametrize("side", ["worker", "manager"])
def test_failed_construction_leaves_no_slab_behind(model_dir: str, tmp_path: Path, side: str) -> None:
    """A manager or worker whose construction raises after it created the slab must remove the slab's name.

    Otherwise the file (host_bytes of /dev/shm by default) outlives the crashed engine.  Worker side: KV
    tensors wider than vLLM's worker_kv_bytes_per_block (ConfigError from SlabCopier); manager side: a
    disk path held by another engine (DiskInUseError from SlabScheduler).  In both cases the failing object
    is the first to open the slab, so it created the file.
    """
    if side == "worker":
        spec = make_spec(offloading_config(model_dir, tkv_extra(tmp_path)))
        kv = new_kv()
        wide = canonical(kv)
        wide.tensors.append(wide.tensors[0])          # 3 pages per block; the slab row holds 2
        with pytest.raises(ConfigError, match="bytes"):
            spec.get_worker(wide)
    else:
        extra = tkv_extra(tmp_path, disk_path=str(tmp_path / "disk"), disk_bytes=64 * ROW_BYTES)
        holder = Pair(offloading_config(model_dir, extra), new_kv())
        try:
            with pytest.raises(DiskInUseError):
                make_spec(offloading_config(model_dir, extra)).get_manager()
        finally:
            holder.close()
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".slab"))
    assert leftovers == [], f"slab file(s) left in shm_dir after a failed {side} construction: {leftovers}"


# ============================================================================= 3. stale callbacks
def test_complete_store_of_keys_never_prepared_is_counted_not_raised(pair: Pair) -> None:
    ctx = ReqContext(req_id="r")
    ks = keys(3, "never")
    pair.mgr.complete_store(ks, ctx)
    pair.mgr.complete_store(ks[:1], ctx, success=False)
    tick(pair.mgr)
    assert stale(pair.mgr, "store", "unknown_token") == 2
    assert stale(pair.mgr) == 2
    assert all(pair.mgr.lookup(k, ctx) is LookupResult.MISS for k in ks)
    assert pair.mgr.tiers.debug_sizes()["host_entries"] == 0
    assert jobs(pair.mgr, "store", "ok") == 0


def test_duplicate_complete_store_is_counted_once_and_changes_nothing(pair: Pair) -> None:
    ctx = ReqContext(req_id="r")
    ks = keys(2)
    pair.store(ks, [4, 5], ctx)
    before = pair.mgr.tiers.debug_sizes()
    pair.mgr.complete_store(ks, ctx)          # duplicate
    pair.mgr.complete_store(set(ks), ctx)     # and again, as the scheduler passes it (a set)
    tick(pair.mgr)
    assert stale(pair.mgr, "store", "unknown_token") == 2 and stale(pair.mgr) == 2
    assert jobs(pair.mgr, "store", "ok") == 1
    assert [pair.mgr.lookup(k, ctx) for k in ks] == [LookupResult.HIT] * 2
    assert pair.mgr.tiers.debug_sizes() == before


def test_complete_load_after_reset_cache_is_counted_and_frees_slots(pair: Pair) -> None:
    ctx = ReqContext(req_id="r")
    ks = keys(3)
    pair.store(ks, [1, 2, 3], ctx)
    src = pair.mgr.prepare_load(ks, ctx)
    jid = pair.job_id()
    assert pair.worker.submit_load(jid, src, gpu_spec([10, 11, 12]))
    pair.mgr.reset_cache()                     # the load is in flight
    assert all(pair.mgr.lookup(k, ctx) is LookupResult.MISS for k in ks)
    pair.finish(jid)
    pair.mgr.complete_load(ks, ctx)            # late report of the cancelled load
    pair.mgr.complete_load(ks, ctx)            # and a duplicate of it
    tick(pair.mgr)
    assert stale(pair.mgr, "load", "cancelled") == 2
    assert stale(pair.mgr) == 2
    assert jobs(pair.mgr, "load", "cancelled") == 1 and jobs(pair.mgr, "load", "ok") == 0
    sizes = pair.mgr.tiers.debug_sizes()
    assert sizes["quarantine"] == 0 and sizes["host_used_slots"] == 0 and sizes["host_entries"] == 0
    assert not pair.mgr.has_pending_work()
    assert all(pair.mgr.lookup(k, ctx) is LookupResult.MISS for k in ks)


def test_store_cancelled_by_reset_cache_is_never_published(pair: Pair) -> None:
    ctx = ReqContext(req_id="r")
    ks = keys(3)
    out = pair.mgr.prepare_store(ks, ctx)
    jid = pair.job_id()
    assert pair.worker.submit_store(jid, gpu_spec([1, 2, 3]), out.store_spec)
    pair.mgr.reset_cache()
    assert pair.mgr.tiers.debug_sizes()["quarantine"] == 1  # slots leased until the copy is known finished
    pair.finish(jid)
    pair.mgr.complete_store(ks, ctx)           # late report of the cancelled store
    assert all(pair.mgr.lookup(k, ctx) is LookupResult.MISS for k in ks)
    tick(pair.mgr)
    assert all(pair.mgr.lookup(k, ctx) is LookupResult.MISS for k in ks)
    assert stale(pair.mgr, "store", "cancelled") == 1 and stale(pair.mgr) == 1
    assert jobs(pair.mgr, "store", "cancelled") == 1 and jobs(pair.mgr, "store", "ok") == 0
    sizes = pair.mgr.tiers.debug_sizes()
    assert sizes["quarantine"] == 0 and sizes["host_used_slots"] == 0
    assert not pair.mgr.has_pending_work()
    # the keys are not poisoned: storing them again publishes the new bytes
    pair.store(ks, [7, 8, 9], ctx)
    pair.load(ks, [40, 41, 42], ctx)
    assert [block_bytes(pair.kv, b) for b in (40, 41, 42)] == [block_bytes(pair.kv, b) for b in (7, 8, 9)]
    tick(pair.mgr)
    assert stale(pair.mgr) == 1


def test_quarantined_slots_are_not_reused_before_the_copy_finished(model_dir: str, tmp_path: Path) -> None:
    """After reset_cache, a cancelled store's slots stay leased until its worker copy has run."""
    p = Pair(offloading_config(model_dir, tkv_extra(tmp_path, host_bytes=2 * ROW_BYTES)), new_kv(seed=4))
    try:
        ctx = ReqContext(req_id="r")
        old = keys(2, "old")
        out = p.mgr.prepare_store(old, ctx)
        p.mgr.reset_cache()                                  # before the worker even got the job
        assert p.mgr.prepare_store(keys(1, "new"), ctx).keys_to_store == []  # no free slot: shed
        tick(p.mgr)
        assert p.mgr.prepare_store(keys(1, "new2"), ctx).keys_to_store == []  # still leased
        jid = p.job_id()
        assert p.worker.submit_store(jid, gpu_spec([1, 2]), out.store_spec)  # vLLM flushes it after a reset
        p.finish(jid)
        tick(p.mgr)
        assert p.mgr.prepare_store(keys(2, "new3"), ctx).keys_to_store == keys(2, "new3")
        tick(p.mgr)
        assert stale(p.mgr) == 0
    finally:
        p.close()


def test_store_reported_failed_is_not_published(pair: Pair) -> None:
    ctx = ReqContext(req_id="r")
    ks = keys(2)
    out = pair.mgr.prepare_store(ks, ctx)
    jid = pair.job_id()
    pair.worker.submit_store(jid, gpu_spec([1, 2]), out.store_spec)
    pair.finish(jid)
    pair.mgr.complete_store(ks, ctx, success=False)
    tick(pair.mgr)
    assert all(pair.mgr.lookup(k, ctx) is LookupResult.MISS for k in ks)
    assert jobs(pair.mgr, "store", "failed") == 1 and stale(pair.mgr) == 0
    assert pair.mgr.tiers.debug_sizes()["host_used_slots"] == 0


def test_worker_counts_reports_after_shutdown_without_raising(pair: Pair) -> None:
    ctx = ReqContext(req_id="r")
    out = pair.mgr.prepare_store(keys(1), ctx)
    pair.worker.shutdown()
    assert pair.worker.submit_store(1, gpu_spec([1]), out.store_spec) is False
    assert pair.worker.get_finished() == []
    pair.worker.shutdown()  # idempotent


# ============================================================================= 4. a real vLLM Scheduler
def _fill(tokens: Sequence[int], layer: int) -> torch.Tensor:
    """The KV a model would compute for the block ending the prefix ``tokens`` (a pure function of it)."""
    h = hashlib.sha256(repr((layer, tuple(tokens))).encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(h[:7], "little"))
    return torch.randn(2, BS, KV_HEADS, HEAD_SIZE, generator=g, dtype=KV_DTYPE)


def _next_token(tokens: Sequence[int]) -> int:
    return 3 + int.from_bytes(hashlib.sha256(repr(tuple(tokens)).encode()).digest()[:4], "little") % (VOCAB - 3)


def prompt_tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


class Engine:
    """One engine step = what EngineCore + the model runner do with a KV connector, in this process.

    scheduler.schedule() -> worker connector (handle_preemptions, bind, start_load_kv) -> every submitted
    copy awaited -> loaded blocks checked -> simulated forward writes the computed blocks -> wait_for_save ->
    get_finished + build_connector_worker_meta -> ModelRunnerOutput with KVConnectorOutput ->
    scheduler.update_from_output().
    """

    def __init__(self, model_dir: str, extra: dict[str, Any], *, num_gpu_blocks: int = NUM_GPU_BLOCKS,
                 max_num_batched_tokens: int = 1024) -> None:
        self.vc = make_vllm_config(model_dir, extra, num_gpu_blocks=num_gpu_blocks,
                                   max_num_batched_tokens=max_num_batched_tokens)
        kcc = make_kv_cache_config(num_gpu_blocks)
        self.sched = Scheduler(vllm_config=self.vc, kv_cache_config=kcc,
                               structured_output_manager=StructuredOutputManager(self.vc), block_size=BS,
                               log_stats=True)
        conn = self.sched.connector
        assert isinstance(conn, OffloadingConnector)
        self.mgr = conn.connector_scheduler.manager
        assert isinstance(self.mgr, TieredKVOffloadingManager)
        self.wc = OffloadingConnector(self.vc, KVConnectorRole.WORKER, kcc)
        self.kv = new_kv(num_gpu_blocks)
        with set_current_vllm_config(self.vc):
            self.wc.register_kv_caches(self.kv)
        self.worker = self.wc.connector_worker.worker
        assert isinstance(self.worker, TieredKVOffloadingWorker)
        assert self.worker.copier.block_bytes == ROW_BYTES == self.mgr.slab.row_bytes

        # observation points
        self.matched: list[tuple[str, int, Optional[int], bool]] = []  # (req, num_computed, matched, async)
        self.load_jobs: dict[int, TransferJob] = {}
        self.store_jobs: dict[int, TransferJob] = {}
        self.flushed: set[int] = set()
        self.load_checks: list[tuple[str, int, bool]] = []            # (req, block index, bytes as recomputed)
        self.finished: dict[str, list[int]] = {}                       # req -> output tokens
        self.block_hashes: dict[str, list[bytes]] = {}
        self.steps = 0
        self._submitted: set[int] = set()
        self._closed = False

        orig_match = conn.get_num_new_matched_tokens

        def recording_match(request: Request, num_computed_tokens: int):
            n, is_async = orig_match(request, num_computed_tokens)
            self.matched.append((request.request_id, num_computed_tokens, n, is_async))
            return n, is_async

        conn.get_num_new_matched_tokens = recording_match  # type: ignore[method-assign]

        orig_store, orig_load = self.worker.submit_store, self.worker.submit_load

        def submit_store(job_id: int, src, dst) -> bool:
            self._submitted.add(job_id)
            return orig_store(job_id, src, dst)

        def submit_load(job_id: int, src, dst, *a: Any, **kw: Any) -> bool:
            self._submitted.add(job_id)
            return orig_load(job_id, src, dst, *a, **kw)

        self.worker.submit_store = submit_store  # type: ignore[method-assign]
        self.worker.submit_load = submit_load  # type: ignore[method-assign]
        self._fwd_ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BS, sha256)

    # ------------------------------------------------------------------ requests
    def add(self, req_id: str, prompt: list[int], max_tokens: int = 3) -> Request:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                      block_hasher=self._hasher)
        self.sched.add_request(req)
        self.block_hashes[req_id] = list(req.block_hashes)
        return req

    def offload_keys(self, req_id: str) -> list[bytes]:
        return [make_offload_key(h, 0) for h in self.block_hashes[req_id]]

    def lookup(self, req_id: str) -> list[LookupResult]:
        ctx = ReqContext(req_id="probe")
        return [self.mgr.lookup(k, ctx) for k in self.offload_keys(req_id)]

    def matched_for(self, req_id: str) -> list[tuple[int, Optional[int], bool]]:
        return [(c, n, a) for r, c, n, a in self.matched if r == req_id]

    # ------------------------------------------------------------------ one step
    def step(self):
        so = self.sched.schedule()
        self.steps += 1
        meta = so.kv_connector_metadata
        assert isinstance(meta, OffloadingConnectorMetadata)
        self.load_jobs.update(meta.load_jobs)
        self.store_jobs.update(meta.store_jobs)
        self.flushed |= set(meta.jobs_to_flush or ())
        wc = self.wc
        wc.handle_preemptions(meta)
        wc.bind_connector_metadata(meta)
        wc.start_load_kv(self._fwd_ctx)
        self._await_copies()
        self._check_loads(meta)
        self._forward(so)
        wc.wait_for_save()
        finished_sending, finished_recving = wc.get_finished(so.finished_req_ids)
        worker_meta = wc.build_connector_worker_meta()
        wc.clear_connector_metadata()

        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.sched.requests[rid]
            sampled.append([_next_token(req.all_token_ids)] if req.num_computed_tokens >= req.num_tokens else [])
        out = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(finished_sending=finished_sending, finished_recving=finished_recving,
                                                  kv_connector_worker_meta=worker_meta))
        for outs in self.sched.update_from_output(so, out).values():
            for o in outs.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = list(o.new_token_ids)
        return so

    def run(self, max_steps: int = 40, between: Optional[Any] = None) -> int:
        """Step until the engine is idle (as EngineCore's has_work), at most ``max_steps`` steps."""
        n = 0
        while self.sched.has_requests():
            assert n < max_steps, f"engine not idle after {max_steps} steps: {self.debug()}"
            self.step()
            if between is not None:
                between()
            n += 1
        return n

    def debug(self) -> dict[str, Any]:
        return {"waiting": [r.request_id for r in self.sched.waiting], "running": [r.request_id for r in
                self.sched.running], "tiers": self.mgr.tiers.debug_sizes(), "matched": self.matched[-6:]}

    def _await_copies(self) -> None:
        if self._submitted:
            self.worker.wait(set(self._submitted))  # results stay for get_finished
            self._submitted.clear()

    def _check_loads(self, meta: OffloadingConnectorMetadata) -> None:
        for job in meta.load_jobs.values():
            req = self.sched.requests[job.req_id]
            first = job.dst_spec.block_indices[0]
            for j, bid in enumerate(job.dst_spec.block_ids.tolist()):
                idx = first + j
                toks = req.all_token_ids[:(idx + 1) * BS]
                ok = all(torch.equal(self.kv[n][bid], _fill(toks, li)) for li, n in enumerate(LAYERS))
                self.load_checks.append((job.req_id, idx, ok))

    def _forward(self, so) -> None:
        """Write the KV of every token computed this step (blocks hold a function of their prefix)."""
        for rid, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            end = req.num_computed_tokens          # already advanced by schedule()
            start = end - n
            block_ids = self.sched.kv_cache_manager.get_block_ids(rid)[0]
            for bi in range(start // BS, (end + BS - 1) // BS):
                toks = req.all_token_ids[:min((bi + 1) * BS, end)]
                for li, name in enumerate(LAYERS):
                    self.kv[name][block_ids[bi]] = _fill(toks, li)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.wc.shutdown()
            self.sched.shutdown()


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(*a: Any, **kw: Any) -> Engine:
        e = Engine(*a, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


PROMPT_LEN = 4 * BS + 3  # 4 full blocks (offloadable) + 3 tokens


def test_scheduler_stores_after_prefill_and_loads_after_gpu_cache_reset(model_dir: str, tmp_path: Path,
                                                                       engines) -> None:
    eng = engines(model_dir, tkv_extra(tmp_path))
    prompt = prompt_tokens(1, PROMPT_LEN)
    eng.add("a", prompt, max_tokens=3)
    eng.step()                                            # the whole prompt is prefilled in one step
    assert len(eng.store_jobs) == 1                       # its 4 full blocks are to be stored ...
    (store,) = eng.store_jobs.values()
    assert store.req_id == "a" and len(store.src_spec.block_ids) == 4
    assert isinstance(store.dst_spec, TieredKVLoadStoreSpec)
    assert eng.lookup("a") == [LookupResult.MISS] * 4     # ... but are not offloaded yet
    eng.run()
    assert eng.finished["a"] and len(eng.finished["a"]) >= 1
    assert eng.lookup("a") == [LookupResult.HIT] * 4
    assert eng.matched_for("a") == [(0, 0, False)]        # nothing offloaded when "a" arrived
    assert not eng.load_jobs

    assert eng.sched.reset_prefix_cache()                 # the GPU prefix cache forgets "a"
    eng.add("b", prompt, max_tokens=3)
    eng.run()
    assert eng.matched_for("b")[0] == (0, 4 * BS, True)   # every full block of the prompt is offered
    assert [j.req_id for j in eng.load_jobs.values()] == ["b"]
    (load,) = eng.load_jobs.values()
    assert isinstance(load.src_spec, TieredKVLoadStoreSpec) and len(load.dst_spec.block_ids) == 4
    assert eng.load_checks == [("b", i, True) for i in range(4)]  # loaded bytes == recomputed bytes
    assert "b" in eng.finished
    assert_no_job_left(eng.mgr)
    assert jobs(eng.mgr, "store", "ok") == 1 and jobs(eng.mgr, "load", "ok") == 1


def test_scheduler_new_request_with_a_shared_prefix_loads_only_what_gpu_lacks(model_dir: str, tmp_path: Path,
                                                                             engines) -> None:
    """A longer prompt sharing "a"'s prefix: offloaded blocks are loaded, the rest is computed and stored."""
    eng = engines(model_dir, tkv_extra(tmp_path))
    prompt = prompt_tokens(2, PROMPT_LEN)
    offload_and_forget_on_gpu(eng, "a", prompt)
    longer = prompt[:4 * BS] + prompt_tokens(3, 2 * BS + 5)
    eng.add("b", longer, max_tokens=2)
    eng.run()
    assert eng.matched_for("b")[0] == (0, 4 * BS, True)
    assert eng.load_checks == [("b", i, True) for i in range(4)]
    assert eng.lookup("b") == [LookupResult.HIT] * 6      # b's two new full blocks were stored too
    tick(eng.mgr)
    assert jobs(eng.mgr, "store", "ok") == 2 and stale(eng.mgr) == 0


def test_scheduler_two_requests_for_the_same_offloaded_prompt_load_it_once(model_dir: str, tmp_path: Path,
                                                                          engines) -> None:
    eng = engines(model_dir, tkv_extra(tmp_path))
    prompt = prompt_tokens(11, PROMPT_LEN)
    offload_and_forget_on_gpu(eng, "a", prompt)
    eng.add("b", prompt, max_tokens=2)
    eng.add("c", prompt, max_tokens=2)
    eng.run()
    assert "b" in eng.finished and "c" in eng.finished
    assert [j.req_id for j in eng.load_jobs.values()] == ["b"]  # "c" waits for it, then hits the GPU cache
    assert eng.load_checks == [("b", i, True) for i in range(4)]
    tick(eng.mgr)
    assert jobs(eng.mgr, "load", "ok") == 1 and stale(eng.mgr) == 0
    sizes = eng.mgr.tiers.debug_sizes()
    assert sizes["live_loads"] == 0 and sizes["host_entries"] == 4


def test_scheduler_preemption_mid_store_flushes_the_store_then_resumes_from_it(model_dir: str, tmp_path: Path,
                                                                             engines) -> None:
    eng = engines(model_dir, tkv_extra(tmp_path))
    store_id = start_with_a_pending_store(eng, seed=4)
    # preempt "a" while its store is pending (and drop the GPU prefix cache, so it must reload)
    assert eng.sched.reset_prefix_cache(reset_running_requests=True)
    eng.run()
    assert store_id in eng.flushed                            # vLLM flushed the pending store
    assert "a" in eng.finished and len(eng.finished["a"]) >= 1
    after = eng.matched_for("a")[1:]                          # the lookups after the preemption
    assert (0, 4 * BS, True) in after                         # resumed from the offloaded blocks
    assert eng.load_checks == [("a", i, True) for i in range(4)]
    assert_no_job_left(eng.mgr)
    assert jobs(eng.mgr, "store", "ok") == 1 and jobs(eng.mgr, "store", "cancelled") == 0
    assert jobs(eng.mgr, "load", "ok") == 1


def test_scheduler_connector_reset_mid_store_never_serves_the_cancelled_store(model_dir: str, tmp_path: Path,
                                                                             engines) -> None:
    eng = engines(model_dir, tkv_extra(tmp_path))
    store_id = start_with_a_pending_store(eng, seed=5)
    # reset everything (GPU prefix cache, running requests, the offload tiers) while the store is pending
    assert eng.sched.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    assert eng.lookup("a") == [LookupResult.MISS] * 4
    assert eng.mgr.tiers.debug_sizes()["quarantine"] == 1
    eng.run()
    assert store_id in eng.flushed
    assert "a" in eng.finished
    after = eng.matched_for("a")[1:]
    assert after and after[0][2] == 0                       # nothing offered from the cancelled store
    assert not eng.load_jobs and not eng.load_checks
    assert eng.lookup("a") == [LookupResult.HIT] * 4        # the recompute stored them again
    tick(eng.mgr)
    # vLLM drops pre-reset completions itself (_stale_job_threshold): the manager never sees them
    assert stale(eng.mgr) == 0
    assert jobs(eng.mgr, "store", "cancelled") == 1 and jobs(eng.mgr, "store", "ok") == 1
    sizes = eng.mgr.tiers.debug_sizes()
    assert sizes["quarantine"] == 0 and sizes["live_stores"] == 0
    assert sizes["host_used_slots"] == 4                    # the cancelled store's slots came back


def test_scheduler_abort_mid_store_keeps_the_stored_bytes_right(model_dir: str, tmp_path: Path, engines) -> None:
    """An aborted request's blocks are freed while its store is pending and reused by another request."""
    eng = engines(model_dir, tkv_extra(tmp_path), num_gpu_blocks=12)
    prompt = prompt_tokens(6, PROMPT_LEN)
    eng.add("a", prompt, max_tokens=8)
    eng.step()
    (store_id,) = eng.store_jobs
    eng.sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    eng.add("c", prompt_tokens(7, 8 * BS + 1), max_tokens=2)  # needs most of the 11 usable blocks
    eng.run()
    assert "c" in eng.finished
    assert eng.lookup("a") == [LookupResult.HIT] * 4
    tick(eng.mgr)
    assert stale(eng.mgr) == 0 and jobs(eng.mgr, "store", "ok") >= 1
    # what was stored for "a" is what a recompute of "a" produces, even though "c" reused its blocks
    assert eng.sched.reset_prefix_cache()
    eng.add("d", prompt, max_tokens=2)
    eng.run()
    assert eng.matched_for("d")[0] == (0, 4 * BS, True)
    assert eng.load_checks == [("d", i, True) for i in range(4)]


def test_scheduler_with_kv_events_reports_only_what_it_stores(model_dir: str, tmp_path: Path, engines,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """With KV events on (and a 2-block host slab), the manager reports the blocks it stores, not the shed ones."""
    monkeypatch.setattr(sys.modules[__name__], "make_vllm_config",
                        functools.partial(make_vllm_config, kv_events=True))
    eng = engines(model_dir, tkv_extra(tmp_path, host_bytes=2 * ROW_BYTES))
    taken: list = []
    orig = eng.mgr.take_events

    def take_events():
        evs = list(orig())
        taken.extend(evs)
        return evs

    eng.mgr.take_events = take_events  # type: ignore[method-assign]
    eng.add("a", prompt_tokens(10, PROMPT_LEN), max_tokens=2)
    eng.run()
    ks = eng.offload_keys("a")
    assert eng.lookup("a") == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS, LookupResult.MISS]
    stored = [k for e in taken if not e.removed for k in e.keys]
    removed = [k for e in taken if e.removed for k in e.keys]
    assert sorted(stored) == sorted(ks[:2]) and removed == []
    tick(eng.mgr)
    assert eng.mgr.metrics.registry.get_sample_value("tiered_kv_shed_total",
                                                     {"kind": "store", "reason": "host_full"}) == 2


# ============================================================================= 5. disk tier
def _settle_disk(mgr: TieredKVOffloadingManager, rounds: int = 400) -> None:
    """Wait until every spill/promote the manager started has been applied (flush = completion-queue wait)."""
    for _ in range(rounds):
        tick(mgr)
        if mgr.tiers.debug_sizes()["disk_jobs"] == 0:
            return
        assert mgr.tiers.flush(timeout=1.0)
    raise AssertionError(f"disk jobs still pending: {mgr.tiers.debug_sizes()}")


def test_disk_spill_survives_restart_hit_pending_then_hit(model_dir: str, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    extra = tkv_extra(tmp_path, disk_path=str(disk), disk_bytes=64 * ROW_BYTES)
    ks = keys(4)
    src_blocks = [2, 4, 6, 8]
    p1 = Pair(offloading_config(model_dir, extra), new_kv(seed=11))
    originals = [block_bytes(p1.kv, b) for b in src_blocks]
    ctx = ReqContext(req_id="r")
    try:
        p1.store(ks, src_blocks, ctx)
        assert p1.mgr.tiers.flush(timeout=30)
        assert [p1.mgr.tiers.state_of(k) for k in ks] == [("ready", "ready")] * 4
        assert p1.mgr.tiers.disk_blocks == 4
        # the path is held: a second engine on it fails loudly, and leaves the first intact
        with pytest.raises(DiskInUseError):
            Pair(offloading_config(model_dir, extra), new_kv())
    finally:
        p1.close()

    # restart: a new engine (new engine_id, new slab), same disk path and namespace
    p2 = Pair(offloading_config(model_dir, extra), new_kv())
    try:
        assert p2.spec_s.engine_id != p1.spec_s.engine_id
        assert p2.spec_s.tkv_config.namespace == p1.spec_s.tkv_config.namespace
        assert p2.mgr.tiers.disk_blocks == 4 and p2.mgr.tiers.host_blocks == 0
        assert [p2.mgr.lookup(k, ctx) for k in ks] == [LookupResult.HIT_PENDING] * 4
        assert p2.mgr.has_pending_work()
        results: list[LookupResult] = []
        for _ in range(400):
            tick(p2.mgr)
            results = [p2.mgr.lookup(k, ctx) for k in ks]
            if results == [LookupResult.HIT] * 4:
                break
            assert set(results) <= {LookupResult.HIT, LookupResult.HIT_PENDING}, results
            p2.mgr.tiers.flush(timeout=1.0)  # a wait point on the completion queue, not a sleep
        assert results == [LookupResult.HIT] * 4
        tick(p2.mgr)
        assert not p2.mgr.has_pending_work()
        assert jobs(p2.mgr, "promote", "ok") == 4
        p2.load(ks, [30, 31, 32, 33], ctx)
        assert [block_bytes(p2.kv, b) for b in (30, 31, 32, 33)] == originals
        tick(p2.mgr)
        assert stale(p2.mgr) == 0
    finally:
        p2.close()


def test_disk_reset_cache_forgets_disk_blocks_across_restart(model_dir: str, tmp_path: Path) -> None:
    extra = tkv_extra(tmp_path, disk_path=str(tmp_path / "disk"), disk_bytes=64 * ROW_BYTES)
    ks = keys(3)
    ctx = ReqContext(req_id="r")
    p1 = Pair(offloading_config(model_dir, extra), new_kv(seed=12))
    try:
        p1.store(ks, [1, 2, 3], ctx)
        assert p1.mgr.tiers.flush(timeout=30)
        p1.mgr.reset_cache()
        assert all(p1.mgr.lookup(k, ctx) is LookupResult.MISS for k in ks)
        assert p1.mgr.tiers.flush(timeout=30)
    finally:
        p1.close()
    p2 = Pair(offloading_config(model_dir, extra), new_kv())
    try:
        assert all(p2.mgr.lookup(k, ctx) is LookupResult.MISS for k in ks)
        assert p2.mgr.tiers.disk_blocks == 0
    finally:
        p2.close()


def test_scheduler_restart_reloads_prompt_from_disk(model_dir: str, tmp_path: Path, engines) -> None:
    """Through the Scheduler: HIT_PENDING defers the request, ticks land the reads, then it loads."""
    extra = tkv_extra(tmp_path, disk_path=str(tmp_path / "disk"), disk_bytes=64 * ROW_BYTES)
    prompt = prompt_tokens(8, PROMPT_LEN)
    e1 = engines(model_dir, extra)
    e1.add("a", prompt, max_tokens=2)
    e1.run()
    assert e1.mgr.tiers.flush(timeout=30) and e1.mgr.tiers.disk_blocks == 4
    e1.close()

    e2 = engines(model_dir, extra)
    e2.add("b", prompt, max_tokens=2)
    e2.run(between=lambda: _settle_disk(e2.mgr))
    first = e2.matched_for("b")[0]
    assert first == (0, None, False)                        # deferred while the blocks come back from disk
    assert (0, 4 * BS, True) in e2.matched_for("b")
    assert e2.load_checks == [("b", i, True) for i in range(4)]
    tick(e2.mgr)
    assert jobs(e2.mgr, "promote", "ok") == 4 and stale(e2.mgr) == 0


def test_scheduler_prefix_longer_than_host_slab_is_not_starved(model_dir: str, tmp_path: Path, engines) -> None:
    """A disk-resident prefix of more blocks than the host slab holds must not defer its request forever.

    The request's lookups start disk reads (HIT_PENDING) whose host reservations evict the very blocks
    the same lookup pass just reported as HIT, so every pass ends with a pending key and vLLM defers the
    request again (get_num_new_matched_tokens -> None): it is never scheduled, the engine steps forever.
    Keys 0-1 and 2-3 take turns in the 2 host slots: HIT,HIT,PENDING,PENDING / PENDING,PENDING,MISS / ...
    Expected: it is scheduled within a few steps (loading the part of the prefix the host can hold, or
    recomputing it).
    """
    disk = str(tmp_path / "disk")
    prompt = prompt_tokens(9, PROMPT_LEN)
    e1 = engines(model_dir, tkv_extra(tmp_path, disk_path=disk, disk_bytes=64 * ROW_BYTES))
    e1.add("a", prompt, max_tokens=2)
    e1.run()
    assert e1.mgr.tiers.flush(timeout=30) and e1.mgr.tiers.disk_blocks == 4
    e1.close()

    # restart with a host slab of 2 blocks (same disk, same namespace: host size is not part of it)
    e2 = engines(model_dir, tkv_extra(tmp_path, disk_path=disk, disk_bytes=64 * ROW_BYTES, host_bytes=2 * ROW_BYTES))
    e2.add("b", prompt, max_tokens=2)
    steps = 0
    while "b" not in e2.finished and steps < 30:
        e2.step()
        _settle_disk(e2.mgr)
        steps += 1
    assert "b" in e2.finished, (f"request starved: deferred in every one of {steps} steps; lookups "
                                f"(num_computed, matched, async) = {e2.matched_for('b')[:6]}...")
    assert all(ok for _, _, ok in e2.load_checks)
