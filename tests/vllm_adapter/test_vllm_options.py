"""kv_connector_extra_config <-> TieredKVConfig: every field that means something under vLLM is a key
of the extra config with the same name, default and validation, and reaches the config the scheduler
side and the worker use; the others, and unknown keys, are refused at spec creation naming the key.

Driven in this process through vLLM's own classes (the spec from ``OffloadingSpecFactory``, manager
and worker through vLLM's abstract interface), as test_vllm_adapter.py does.  Copies are awaited with
``worker.wait`` and spills with ``SlabScheduler.flush``: nothing is ordered by sleeping.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.base")

from vllm.v1.kv_offload.base import OffloadingSpec, ReqContext  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

import test_vllm_adapter as base  # noqa: E402  (helpers only: no test is re-collected from here)
from test_vllm_adapter import (  # noqa: E402
    BS,
    ROW_BYTES,
    Pair,
    gpu_spec,
    keys,
    make_spec,
    new_kv,
    offloading_config,
    tick,
    tkv_extra,
)
from tiered_kv.config import TieredKVConfig  # noqa: E402
from tiered_kv.errors import ConfigError  # noqa: E402
from tiered_kv.integrations import copier as copier_mod  # noqa: E402
from tiered_kv.integrations import vllm as tkv_vllm  # noqa: E402
from tiered_kv.movers import ThreadMover  # noqa: E402

pytestmark = pytest.mark.timeout(120)

model_dir = base.model_dir  # the module-scoped tiny-Llama config fixture
CTX = ReqContext(req_id="r")


def _pair(model_dir: str, tmp_path: Path, **over: Any) -> Pair:
    return Pair(offloading_config(model_dir, tkv_extra(tmp_path, **over)), new_kv(seed=5))


def _refused(model_dir: str, tmp_path: Path, **over: Any) -> str:
    with pytest.raises(ConfigError) as ei:
        OffloadingSpecFactory.create_spec(offloading_config(model_dir, tkv_extra(tmp_path, **over)))
    assert list(tmp_path.iterdir()) == []  # refused before any slab or disk tier was made
    return str(ei.value)


# ============================================================================= the table
def test_every_config_field_is_either_a_key_or_refused_and_defaults_are_tieredkvconfigs() -> None:
    fields = {f.name: f for f in dataclasses.fields(TieredKVConfig)}
    assert sorted(tkv_vllm.CONFIG_KEYS + tuple(tkv_vllm.REFUSED_KEYS)) == sorted(fields)
    assert not set(tkv_vllm.CONFIG_KEYS) & set(tkv_vllm.REFUSED_KEYS)
    for k in tkv_vllm.CONFIG_KEYS:
        default = fields[k].default
        assert tkv_vllm.OPTIONS[k] == (None if default is dataclasses.MISSING else default), k


def test_vllms_eviction_policy_key_names_the_host_policy(model_dir: str, tmp_path: Path) -> None:
    p = _pair(model_dir, tmp_path, eviction_policy="arc")
    try:
        assert p.mgr.tiers.config.host_policy == "arc" and p.mgr.tiers.core.index.policy.name == "arc"
    finally:
        p.close()
    with pytest.raises(ConfigError, match="eviction_policy='arc' and host_policy='lru' disagree"):
        OffloadingSpecFactory.create_spec(offloading_config(model_dir, tkv_extra(tmp_path, eviction_policy="arc",
                                                                                  host_policy="lru")))


def test_defaults_reach_the_scheduler_and_the_worker_unchanged(model_dir: str, tmp_path: Path) -> None:
    p = _pair(model_dir, tmp_path)
    try:
        cfg = p.mgr.tiers.config
        default = TieredKVConfig(namespace="x", host_capacity_bytes=1)
        for k in tkv_vllm.CONFIG_KEYS:
            if k != "namespace":
                assert getattr(cfg, k) == getattr(default, k), k
        assert p.spec_w.tkv_config == cfg
        assert p.worker.copier._mover._batch_max == default.copy_batch_max
    finally:
        p.close()


@pytest.mark.parametrize(("key", "value"), [
    ("namespace", "tenant-a/model"), ("durability", "sync"), ("write_mode", "back"), ("max_inflight_jobs", 3),
    ("copy_batch_max", 5), ("host_evict_ahead_blocks", 4), ("pin_host_memory", False), ("max_key_bytes", 100),
    ("writer_queue_blocks", 10), ("writer_batch_blocks", 7), ("writer_batch_bytes", 1 << 20),
    ("writer_batch_seconds", 0.05), ("disk_map_size_bytes", 1 << 24), ("host_policy", "arc"),
    ("disk_policy", "s3fifo"), ("host_admission", "tinylfu"), ("disk_admission", "second_hit"),
])
def test_each_key_reaches_the_config_both_sides_use(model_dir: str, tmp_path: Path, key: str, value: Any) -> None:
    p = _pair(model_dir, tmp_path, **{key: value})
    try:
        assert getattr(p.mgr.tiers.config, key) == value and getattr(p.spec_w.tkv_config, key) == value
    finally:
        p.close()


def test_vllms_own_keys_are_accepted(model_dir: str, tmp_path: Path) -> None:
    extra = dict(offload_prompt_only=False, self_describing_kv_events=False, block_size=BS, canonical_layout=False)
    make_spec(offloading_config(model_dir, tkv_extra(tmp_path, **extra)))


# ============================================================================= refused
def test_an_unknown_key_is_refused_naming_it(model_dir: str, tmp_path: Path) -> None:
    msg = _refused(model_dir, tmp_path, host_byte=1 << 20)
    assert "'host_byte'" in msg and "unknown" in msg and "host_bytes" in msg


@pytest.mark.parametrize(("key", "instead"), [
    ("host_capacity_bytes", "host_bytes"), ("disk_capacity_bytes", "disk_bytes"),
    ("num_copy_workers", "submission order"), ("num_copy_streams", "submission order"),
    ("cpu_mover", "submission order"),
])
def test_fields_that_mean_something_else_under_vllm_are_refused(model_dir: str, tmp_path: Path, key: str,
                                                                instead: str) -> None:
    msg = _refused(model_dir, tmp_path, **{key: 2})
    assert f"'{key}'" in msg and instead in msg, msg


@pytest.mark.parametrize(("over", "needles"), [
    ({"write_mode": "sideways"}, ["write_mode", "sideways"]),
    ({"max_inflight_jobs": 0}, ["max_inflight_jobs", "0"]),
    ({"copy_batch_max": 0}, ["copy_batch_max", "0"]),
    ({"copy_batch_max": "8"}, ["copy_batch_max", "'8'"]),
    ({"host_evict_ahead_blocks": -1}, ["host_evict_ahead_blocks", "-1"]),
    ({"host_evict_ahead_blocks": 64}, ["host_evict_ahead_blocks=64", "64 slots", "host_bytes"]),
    ({"pin_host_memory": "yes"}, ["pin_host_memory", "yes"]),
    ({"max_key_bytes": 0}, ["max_key_bytes", "0"]),
    ({"writer_batch_seconds": 61}, ["writer_batch_seconds", "61"]),
    ({"namespace": ""}, ["namespace", "''"]),
], ids=lambda v: str(v))
def test_bad_values_are_refused_at_spec_creation_naming_key_and_value(model_dir: str, tmp_path: Path, over: dict,
                                                                      needles: list[str]) -> None:
    msg = _refused(model_dir, tmp_path, **over)
    for n in needles:
        assert n in msg, f"{n!r} not named in {msg!r}"


# ============================================================================= the scheduler side applies them
def _store(p: Pair, ks: list[bytes], first_block: int) -> None:
    out = p.mgr.prepare_store(ks, CTX)
    assert out.keys_to_store == ks
    jid = p.job_id()
    assert p.worker.submit_store(jid, gpu_spec(range(first_block, first_block + len(ks))), out.store_spec)
    p.finish(jid)
    p.mgr.complete_store(ks, CTX)


@pytest.mark.parametrize("mode", ["through", "back"])
def test_write_mode_back_spills_only_once_the_host_fills(model_dir: str, tmp_path: Path, mode: str) -> None:
    p = _pair(model_dir, tmp_path, host_bytes=32 * ROW_BYTES, disk_path=str(tmp_path / "disk"),
              disk_bytes=64 * ROW_BYTES, write_mode=mode)
    try:
        _store(p, keys(2, "a"), 0)
        tick(p.mgr)
        assert p.mgr.tiers.flush(timeout=30)
        assert p.mgr.tiers.disk_blocks == (2 if mode == "through" else 0)   # back: host 2/32 full, no spill
        _store(p, keys(22, "b"), 2)                                         # 24 of 32 slots: 3/4 full
        tick(p.mgr)
        assert p.mgr.tiers.flush(timeout=30)
        spilled = p.mgr.tiers.disk_blocks
        assert (spilled == 24) if mode == "through" else (0 < spilled <= 24)   # back: the coldest, once 3/4 full
    finally:
        p.close()


def test_max_inflight_jobs_sheds_prepare_store(model_dir: str, tmp_path: Path) -> None:
    p = _pair(model_dir, tmp_path, max_inflight_jobs=2)
    try:
        a = p.mgr.prepare_store(keys(1, "a"), CTX)
        b = p.mgr.prepare_store(keys(1, "b"), CTX)
        c = p.mgr.prepare_store(keys(1, "c"), CTX)
        assert a.keys_to_store == keys(1, "a") and b.keys_to_store == keys(1, "b")
        assert c.keys_to_store == []    # two jobs in flight: the third is shed, the engine stores less
        tick(p.mgr)                     # batched metrics are applied at the step's end
        shed = p.mgr.metrics.registry.get_sample_value("tiered_kv_shed_total", {"kind": "store", "reason": "inflight_limit"})
        assert shed == 1
    finally:
        p.close()


@pytest.mark.parametrize(("ahead", "left"), [(0, 8), (3, 5)])
def test_host_evict_ahead_blocks_leaves_slots_free_after_the_step(model_dir: str, tmp_path: Path, ahead: int,
                                                                  left: int) -> None:
    p = _pair(model_dir, tmp_path, host_bytes=8 * ROW_BYTES, host_evict_ahead_blocks=ahead)
    try:
        _store(p, keys(8), 0)
        assert p.mgr.tiers.host_blocks == 8
        tick(p.mgr)                     # on_schedule_end: evict ahead
        assert p.mgr.tiers.host_blocks == left
    finally:
        p.close()


# ============================================================================= the worker applies them
@pytest.mark.parametrize(("batch", "held"), [(4, 1), (1, 0)], ids=["batch-4", "batch-1"])
def test_copy_batch_max_decides_when_the_workers_copies_start(model_dir: str, tmp_path: Path, batch: int,
                                                              held: int) -> None:
    """copy_batch_max=4: the submit wakes no copy thread, vLLM's get_finished starts the copy; 1: the
    submit starts it."""
    p = _pair(model_dir, tmp_path, copy_batch_max=batch)
    try:
        mover = p.worker.copier._mover
        assert isinstance(mover, ThreadMover)
        out = p.mgr.prepare_store(keys(2), CTX)
        assert p.worker.submit_store(1, gpu_spec([3, 4]), out.store_spec)
        assert len(mover._held) == held
        if held:
            assert mover._q.qsize() == 0     # nothing handed to the copy thread yet
        got = p.worker.get_finished()        # the engine asks for results: queued copies start
        assert len(mover._held) == 0
        p.worker.wait({1})
        assert [r.job_id for r in got + p.worker.get_finished()] == [1]
    finally:
        p.close()


class _Cudart:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append("register")
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append("unregister")
        return 0


def test_pin_host_memory_true_without_cuda_is_refused_at_spec_creation(model_dir: str, tmp_path: Path,
                                                                       monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    msg = _refused(model_dir, tmp_path, pin_host_memory=True)
    assert "pin_host_memory=True needs CUDA" in msg


@pytest.mark.parametrize(("pin", "kv_on_cuda", "pinned"), [(True, False, True), (None, True, True),
                                                          (None, False, False), (False, True, False)])
def test_worker_pins_the_slab_as_tiermanager_would(model_dir: str, tmp_path: Path, monkeypatch, pin: Any,
                                                   kv_on_cuda: bool, pinned: bool) -> None:
    """CUDA simulated: torch.cuda.is_available, the KV tensors' device and cudart are stand-ins."""
    rt = _Cudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(copier_mod, "_on_cuda", lambda tensors: kv_on_cuda)
    p = _pair(model_dir, tmp_path, pin_host_memory=pin)
    try:
        assert p.worker.slab.pinned is pinned and not p.mgr.slab.pinned   # the worker's mapping only
        assert rt.calls == (["register"] if pinned else [])
    finally:
        p.close()
    assert rt.calls == (["register", "unregister"] if pinned else [])
