"""Scheduler-side cost of tiered_kv's vLLM adapter beside vLLM's own CPU offloading manager.

Runs in the vLLM environment (``make bench-vllm-scheduler``; ``--help`` for the knobs).
Both managers are built the way vLLM builds them -- by ``OffloadingSpecFactory`` from the
``OffloadingConfig`` that vLLM's ``build_offloading_config`` derives from one ``VllmConfig``
(a tiny Llama geometry, 4 KiB per block) -- and differ only in ``kv_connector_extra_config``:

* ``vllm-lru`` / ``vllm-arc``: ``CPUOffloadingSpec`` with ``eviction_policy`` lru / arc
  (``CPUOffloadingManager``);
* ``tiered_kv``: ``TieredKVOffloadingSpec``, host tier only (the like-for-like case: vLLM's
  CPU manager has no disk tier), on the same number of host blocks.

Each replays the same call sequence, built from a Mooncake-format trace (``hash_ids``, one
offload key per id): per request ``on_new_request``, ``lookup`` in prefix order up to the first
key that is not a ready hit, ``prepare_load`` and ``touch`` of the hits, ``prepare_store`` of
the rest.  ``--per-step`` requests make one scheduler step; the step's loads and stores
complete at the start of the next step (``complete_load``/``complete_store``, as vLLM reports
finished transfers after the model ran), then ``on_schedule_end``.  No bytes move: for
tiered_kv the stand-in worker only marks each job done in the shared slab's ring (the write a
real worker makes after its copies), and that write is inside the timed region, so its figures
carry a little of the worker's cost.

Reported per manager and repeat (the managers' order rotates each repeat): microseconds of
manager calls per block reference (the figure to compare), per-step time p50/p99, block hits
and stores accepted; the JSON also keeps every repeat.  The ratio column is vLLM's time over
tiered_kv's, so above 1 means tiered_kv spends less scheduler time per block.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402
from vllm import __version__ as vllm_version  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

from tiered_kv.bench.trace import TraceError, load_trace  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = ROOT / "benchmarks" / "traces" / "mooncake_synthetic_trace.jsonl"
BS, LAYERS, KV_HEADS, HEAD_SIZE = 16, ("layer0", "layer1"), 2, 8
ROW_BYTES = 2 * BS * KV_HEADS * HEAD_SIZE * 4 * len(LAYERS)   # K and V, float32, both layers: 4096
MANAGERS = ("vllm-lru", "vllm-arc", "tiered_kv")
NO_CTX = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def model_dir() -> str:
    d = tempfile.mkdtemp(prefix="tkv-sched-bench-")
    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=len(LAYERS),
                num_attention_heads=2, num_key_value_heads=KV_HEADS, head_dim=32,
                max_position_embeddings=1024).save_pretrained(d)
    return d


def offloading_config(model: str, extra: dict[str, Any]) -> Any:
    vc = VllmConfig(
        model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="float32", seed=0, max_model_len=1024),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=1024,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                            kv_connector_extra_config=extra),
        device_config=DeviceConfig("cpu"))
    vc.cache_config.num_gpu_blocks = 64
    kc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(list(LAYERS), FullAttentionSpec(block_size=BS, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                                                         dtype=torch.float32))])
    return build_offloading_config(vc, kc)


def _harness() -> Any:
    """tests/vllm_adapter/harness.py, whose two functions name each spec's keys (the end-to-end runs use them)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tkv_vllm_harness", ROOT / "tests" / "vllm_adapter" / "harness.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def extra_config(name: str, slots: int, shm_dir: str) -> dict[str, Any]:
    h = _harness()
    if name == "tiered_kv":
        return h.offload_extra_config(slots * ROW_BYTES, None, 0, shm_dir=shm_dir)
    return h.native_extra_config(name, slots * ROW_BYTES, None)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def replay(name: str, requests: list[list[bytes]], slots: int, per_step: int, model: str) -> dict[str, Any]:
    """One manager, one pass over ``requests``: the timed call sequence described in the module doc."""
    with tempfile.TemporaryDirectory(prefix="tkv-sched-shm-") as shm:
        spec = OffloadingSpecFactory.create_spec(offloading_config(model, extra_config(name, slots, shm)))
        mgr = spec.get_manager()
        # the stand-in worker: a tiered_kv job is finished once rank 0's ring shows its sequence number
        mark: Callable[[Any], None] = ((lambda s: mgr.slab.mark_done(0, s.seq)) if name == "tiered_kv"
                                       else (lambda s: None))
        hit = LookupResult.HIT
        refs = hits = stored = refused = 0
        step_s: list[float] = []
        pending: list[tuple[str, list[Any], ReqContext]] = []
        gc.collect()
        gc.disable()
        try:
            clock = time.perf_counter
            total = 0.0
            for start in range(0, len(requests), per_step):
                t0 = clock()
                done, pending = pending, []
                for kind, keys, ctx in done:
                    if kind == "load":
                        mgr.complete_load(keys, ctx)
                    else:
                        mgr.complete_store(keys, ctx)
                for i, keys in enumerate(requests[start:start + per_step], start):
                    ctx = ReqContext(req_id=f"r{i}")
                    mgr.on_new_request(ctx)
                    n = 0
                    for k in keys:
                        if mgr.lookup(k, ctx) is not hit:
                            break
                        n += 1
                    if n:
                        spec_l = mgr.prepare_load(keys[:n], ctx)
                        mark(spec_l)
                        mgr.touch(keys[:n], ctx)
                        pending.append(("load", keys[:n], ctx))
                    if n < len(keys):
                        out = mgr.prepare_store(keys[n:], ctx)
                        if out is None:
                            refused += len(keys) - n
                        elif out.keys_to_store:
                            mark(out.store_spec)
                            pending.append(("store", list(out.keys_to_store), ctx))
                            stored += len(out.keys_to_store)
                    refs += len(keys)
                    hits += n
                mgr.on_schedule_end(NO_CTX)
                dt = clock() - t0
                step_s.append(dt)
                total += dt
            for kind, keys, ctx in pending:
                (mgr.complete_load if kind == "load" else mgr.complete_store)(keys, ctx)
            mgr.on_schedule_end(NO_CTX)
        finally:
            gc.enable()
            mgr.shutdown()
    return {"manager": name, "block_refs": refs, "hits": hits, "hit_ratio": hits / refs if refs else 0.0,
            "stored": stored, "refused": refused, "seconds": total, "us_per_block": 1e6 * total / refs,
            "step_us_p50": 1e6 * pct(step_s, 0.5), "step_us_p99": 1e6 * pct(step_s, 0.99), "steps": len(step_s)}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL (default: %(default)s)")
    p.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--slots", type=int, default=4096, help="host blocks of each manager (default: %(default)s)")
    p.add_argument("--per-step", type=int, default=8, help="requests per scheduler step (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="passes per manager, order rotated (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="write the full result here")
    a = p.parse_args(argv)
    for name in ("requests", "slots", "per_step", "repeats"):
        v = getattr(a, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {v}")
    try:
        ids = load_trace(a.trace, a.requests)
    except TraceError as exc:
        p.error(str(exc))
    requests = [[make_offload_key(hashlib.sha256(i.to_bytes(8, "little")).digest(), 0) for i in r] for r in ids]
    model = model_dir()
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MANAGERS}
    for rep in range(a.repeats):
        order = MANAGERS[rep % len(MANAGERS):] + MANAGERS[:rep % len(MANAGERS)]
        for m in order:
            r = replay(m, requests, a.slots, a.per_step, model)
            runs[m].append(r)
            print(f"repeat {rep + 1}/{a.repeats} {m:9s} {r['us_per_block']:6.2f} us/block  "
                  f"hits {r['hit_ratio']:.3f}  step p99 {r['step_us_p99']:.0f} us", file=sys.stderr)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("us_per_block", "step_us_p50", "step_us_p99",
                                                               "hit_ratio")} | {"block_refs": rs[0]["block_refs"]}
           for m, rs in runs.items()}
    base = med["tiered_kv"]["us_per_block"]
    print(f"\nscheduler-side cost, {len(requests)} requests, {med['tiered_kv']['block_refs']} block references, "
          f"{a.slots} host blocks, {a.per_step} requests per step; median of {a.repeats}")
    print(f"{'manager':10s} {'us/block':>9s} {'vs tiered_kv':>13s} {'step p50 us':>12s} {'step p99 us':>12s} "
          f"{'hit ratio':>10s}")
    for m in MANAGERS:
        r = med[m]
        print(f"{m:10s} {r['us_per_block']:9.2f} {r['us_per_block'] / base:12.2f}x {r['step_us_p50']:12.0f} "
              f"{r['step_us_p99']:12.0f} {r['hit_ratio']:10.3f}")
    if a.json is not None:
        facts = {"python": platform.python_version(), "vllm": vllm_version, "torch": torch.__version__,
                 "cpus": os.cpu_count(), "machine": platform.machine(), "trace": str(a.trace),
                 "requests": len(requests), "slots": a.slots, "per_step": a.per_step, "repeats": a.repeats,
                 "row_bytes": ROW_BYTES, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        a.json.write_text(json.dumps({"facts": facts, "median": med, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
