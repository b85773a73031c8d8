"""End-to-end vLLM harness for tiered_kv (a script run as a subprocess; not a test module).

Usage (the harness sets VLLM_CPU_KVCACHE_SPACE=1 itself unless already set)::

    .venv-vllm/bin/python tests/vllm_adapter/harness.py \\
        --scenario {reload,restart,chaos,crash,replay} --workdir DIR \\
        [--offload | --no-offload] [--spec {tiered_kv,vllm-lru,vllm-arc,vllm-fs}] \\
        [--disk-path P] [--host-bytes N] [--disk-bytes N] --json OUT

(``--help`` lists the scenario knobs: --num-others, --settle-s, --chaos-gpu-blocks,
--chaos-requests, --chaos-max-tokens, --abort-after-steps, --[no-]chaos-reference,
--shutdown-timeout-s, --ready-file, --done-file, --crash-prompts, --replay-seeds.)

What it does:

* builds (or reuses ``DIR/model``) a tiny seeded random Llama (2 layers, hidden 128,
  2 heads, head_dim 64, vocab 512, bf16), so the weights are bit-identical across runs;
* starts ``vllm.LLM`` on it with block_size 32, prefix caching, eager mode, token-id
  prompts and greedy sampling; with ``--offload`` it adds a ``kv_transfer_config``
  selecting vLLM's ``OffloadingConnector`` with the tiered_kv spec (see
  :func:`offload_extra_config`, the one place that names the adapter's keys), or with
  ``--spec vllm-*`` vLLM's own CPU offloading (:func:`native_extra_config`: ``CPUOffloadingSpec``
  with the lru or arc policy, or ``TieringOffloadingSpec`` with its ``fs`` tier at --disk-path;
  vLLM runs these on CUDA and XPU only);
* runs one scenario (see the ``scenario_*`` functions) and writes a JSON report.

JSON shape (all scenarios)::

    {
      "scenario": str, "offload": bool, "ok": bool, "model_built": bool,
      "extra_config": {...} | null,          # kv_connector_extra_config used
      "timings": {"model_build_s", "engine_init_s", "scenario_s", "shutdown_s", "total_s"},
      "result": {...},                       # scenario-specific, below
      "vllm_metrics": {name: [[labels, value], ...]},   # counters/gauges of llm.get_metrics()
      "num_preemptions": int,                # vllm:num_preemptions summed over engines
      "tiered_kv_metrics": {sample_name: [[labels, value], ...]} | null,
      "tiered_kv_metrics_after_shutdown": {...} | null,
      "error": str, "traceback": str,        # only when ok is false
    }

A request record ``REC`` is ``{"request_id", "prompt_len", "num_cached_tokens",
"token_ids", "finish_reason", "num_preemptions", "queued_s", "prefill_s", "decode_s"}``
(num_cached_tokens is fixed when the request is first scheduled; num_preemptions counts that
request's preemptions; the last three split its time at the engine core's timestamps).

``result`` per scenario:

* reload: ``{"prompt_a", "a_first": REC, "a_warm": REC, "others": [REC...],
  "reset_prefix_cache_ok", "a_second": REC, "same_output", "wall_s": {"a_first",
  "a_warm", "others", "a_second"}}``
* restart: ``{"prompt_a", "a": REC, "wall_s": {"a"}}``
* chaos (run in float32 while it compares with the reference: see main()): ``{"prompts": {rid: ids}, "steps",
  "finished": {rid: REC}, "num_finished",
  "aborted": [rid], "num_aborted", "tokens_at_abort": {rid: n}, "aborted_final_outputs",
  "reference": {rid: ids}, "matches_reference", "wall_s": {"run", "reference"}}``
* crash (float32; meant to be SIGKILLed with its whole process group, see :func:`scenario_crash`):
  ``{"done": n}`` if it ever ends by itself
* replay (float32): ``{"seeds": [seed], "served": {seed: REC}, "reference": {seed: ids}, "killed_run":
  {seed: ids}, "matches_reference", "matches_killed_run", "wall_s": {"served", "reference"}}``

The ``tiered_kv_*`` maps are filled only when ``PROMETHEUS_MULTIPROC_DIR`` is set (the
engine core and worker processes inherit it); they are keyed by *sample* name
(``tiered_kv_jobs_total``, ``tiered_kv_transfer_seconds_bucket`` ...), labels included
(histogram buckets carry ``le``), values summed over processes for counters. They are
read once while the engine is still alive and once after shutdown (anything flushed
on close). Nobody marks the engine's processes dead, so live gauges of exited
processes still count in the second read. Use a fresh, empty directory per run.

On an exception the traceback is printed, a JSON with ``"ok": false`` and
``"error"`` is written (when possible) and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
from typing import Any

# Must be set before vLLM is imported: the CPU backend otherwise reserves a default
# KV-cache size (it reads this in the engine process, which inherits our env).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Grace period the engine core gives the worker process to exit on shutdown before
# SIGTERM (vLLM default 5 s, often exceeded on 2 cores). The worker holds the
# offload worker side (disk writes), so let it finish cleanly.
os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "15")
# vLLM's CPU backend reserves one core for the engine-core process, plus one more
# when a kv_transfer_config is set; on a 2-core machine that second reservation
# fails, so with --offload the worker would bind both cores with OMP_NUM_THREADS=2
# and spin against the engine core. Pin the reservation to 1 so both modes run the
# worker on one core with one thread (vLLM logs a warning about it with --offload).
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")

BLOCK_SIZE = 32
MAX_MODEL_LEN = 512
# --model-size: "tiny" for the tests; "medium" (8 layers, hidden 1024, 1 MiB of KV per block)
# for benchmarks/vllm_e2e.py, where a 1.5k-token prefill costs seconds on a CPU and the
# time offloading saves is visible.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=64, max_model_len=512),
    "medium": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=8, head_dim=128, max_model_len=2048),
}
VOCAB = 512
MODEL_SEED = 1234

# Prompt A of reload/restart: 6 full blocks + 8 tokens, so at most 6 * 32 = 192
# tokens can ever be served from a cache (vLLM always recomputes the last token and
# only caches full blocks).
PROMPT_A_LEN = 6 * BLOCK_SIZE + 8
PROMPT_A_SEED = 1
RELOAD_MAX_TOKENS = 16


# ----------------------------------------------------------------------------- model

def build_model(model_dir: str, size: str = "tiny") -> bool:
    """Save the tiny random Llama into ``model_dir`` unless it is already there.

    Returns True when it was built now. Weights depend only on MODEL_SEED; the
    initializer range is widened (0.02 -> 0.2) so the logits are far from ties and
    greedy decoding is robust to bf16 rounding differences between a full prefill
    and a prefill that reuses cached KV.
    """
    if os.path.exists(os.path.join(model_dir, "config.json")):
        return False
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = dict(MODEL_SIZES[size])
    max_len = dims.pop("max_model_len")
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        **dims,
        max_position_embeddings=max_len,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(MODEL_SEED)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    tmp = model_dir + ".tmp"
    model.save_pretrained(tmp)
    os.replace(tmp, model_dir)  # atomic: a half-written dir is never reused
    return True


# ----------------------------------------------------------------------------- engine

def offload_extra_config(host_bytes: int, disk_path: str | None, disk_bytes: int,
                         remote_url: str | None = None, shm_dir: str | None = None) -> dict[str, Any]:
    """``kv_connector_extra_config`` for the tiered_kv adapter (the one place naming its keys for the
    harness and the benchmarks: ``benchmarks/vllm_scheduler_side.py`` builds its configs here too)."""
    extra: dict[str, Any] = {
        "spec_name": "TieredKVOffloadingSpec",
        "spec_module_path": "tiered_kv.integrations.vllm",
        "host_bytes": int(host_bytes),
        "disk_path": disk_path,
        "disk_bytes": int(disk_bytes),
    }
    if remote_url is not None:
        extra["remote_url"] = remote_url
    if shm_dir is not None:
        extra["shm_dir"] = shm_dir
    return extra


SPECS = ("tiered_kv", "vllm-lru", "vllm-arc", "vllm-fs")
"""``--spec``: the adapter, or vLLM's own CPU offloading (lru, arc; fs: lru and the ``tiering`` spec's disk tier)."""


def native_extra_config(spec: str, host_bytes: int, disk_path: str | None) -> dict[str, Any]:
    """``kv_connector_extra_config`` for vLLM's own offloading, the same host bytes as the adapter's."""
    if spec == "vllm-fs":
        if disk_path is None:
            raise ValueError("--spec vllm-fs needs --disk-path (the fs tier's root_dir)")
        return {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": int(host_bytes), "eviction_policy": "lru",
                "secondary_tiers": [{"type": "fs", "root_dir": disk_path}]}
    if disk_path is not None:
        raise ValueError(f"--spec {spec} has no disk tier: --disk-path goes with tiered_kv or vllm-fs")
    return {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": int(host_bytes),
            "eviction_policy": spec.split("-", 1)[1]}


def make_llm(model_dir: str, extra_config: dict[str, Any] | None, **overrides: Any):
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=model_dir,
        skip_tokenizer_init=True,  # no tokenizer files: prompts are token ids
        block_size=BLOCK_SIZE,
        enable_prefix_caching=True,
        enforce_eager=True,
        max_model_len=overrides.pop("max_model_len", MAX_MODEL_LEN),
        dtype="bfloat16",
        seed=0,
        disable_log_stats=False,  # LLM defaults to True; needed for get_metrics()/preemptions
    )
    if extra_config is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra_config,
        )
    kwargs.update(overrides)
    return LLM(**kwargs)


def shutdown_llm(llm, timeout_s: float) -> None:
    """Stop the engine-core and worker processes now (rather than at interpreter exit).

    vLLM's default grace period is 5 s, after which the EngineCore process is
    SIGKILLed; on this 2-core machine it regularly needs longer, and a killed
    EngineCore never runs the offload manager's shutdown, so we wait longer.
    """
    llm.llm_engine.engine_core.shutdown(timeout=timeout_s)


# ----------------------------------------------------------------------------- helpers

def random_tokens(seed: int, n: int) -> list[int]:
    """Seeded token ids in [3, VOCAB) (0-2 are pad/bos/eos, so EOS never appears in prompts)."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def greedy(max_tokens: int):
    from vllm import SamplingParams

    # ignore_eos: every request generates exactly max_tokens (stable block counts).
    return SamplingParams(temperature=0, detokenize=False, max_tokens=max_tokens, ignore_eos=True)


def record(out) -> dict[str, Any]:
    """One RequestOutput as JSON."""
    comp = out.outputs[0]
    stats = getattr(out, "metrics", None)

    def span(a: str, b: str) -> float | None:   # seconds between two of the engine core's timestamps
        t0, t1 = getattr(stats, a, 0.0), getattr(stats, b, 0.0)
        return t1 - t0 if t0 and t1 else None

    return {
        "request_id": out.request_id,
        "prompt_len": len(out.prompt_token_ids or []),
        "num_cached_tokens": out.num_cached_tokens,
        "token_ids": list(comp.token_ids),
        "finish_reason": comp.finish_reason,
        "num_preemptions": getattr(stats, "num_preemptions", None),
        # where a request's time went (None where vLLM kept no stats): waiting to be scheduled, its
        # prefill (scheduled to first token), its decode (first to last token)
        "queued_s": span("queued_ts", "scheduled_ts"),
        "prefill_s": span("scheduled_ts", "first_token_ts"),
        "decode_s": span("first_token_ts", "last_token_ts"),
    }


def generate(llm, prompts: list[list[int]], max_tokens: int) -> tuple[list[dict[str, Any]], float]:
    from vllm import TokensPrompt

    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy(max_tokens), use_tqdm=False)
    return [record(o) for o in outs], time.perf_counter() - t0


def vllm_metrics(llm) -> dict[str, list]:
    """Counters and gauges of llm.get_metrics() as name -> [[labels, value], ...]."""
    from vllm.v1.metrics.reader import Counter, Gauge

    res: dict[str, list] = {}
    for m in llm.get_metrics():
        if isinstance(m, (Counter, Gauge)):
            res.setdefault(m.name, []).append([dict(m.labels), m.value])
    return res


def tiered_kv_metrics() -> dict[str, list] | None:
    """All ``tiered_kv_*`` samples in PROMETHEUS_MULTIPROC_DIR (None when unset)."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        return None
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=path)
    res: dict[str, list] = {}
    for fam in reg.collect():
        if not fam.name.startswith("tiered_kv_"):
            continue
        for s in fam.samples:
            res.setdefault(s.name, []).append([dict(s.labels), s.value])
    return res


# ----------------------------------------------------------------------------- scenarios

def scenario_reload(llm, args) -> dict[str, Any]:
    """A, A again (vLLM's own prefix cache), other prompts, reset_prefix_cache, A again.

    ``a_second`` is the one that matters: vLLM's own cache was just emptied, so with
    offload its ``num_cached_tokens`` (> 0) can only come from tiered_kv, and its
    tokens must equal ``a_first``'s. Without offload it is 0. ``a_warm`` is a
    control: a hit in vLLM's own cache must also give identical tokens.
    """
    n = args.prompt_blocks * BLOCK_SIZE + 8
    a = random_tokens(PROMPT_A_SEED, n)
    others = [random_tokens(100 + i, n) for i in range(args.num_others)]

    (a_first,), t_first = generate(llm, [a], RELOAD_MAX_TOKENS)
    (a_warm,), t_warm = generate(llm, [a], RELOAD_MAX_TOKENS)
    other_recs, t_others = generate(llm, others, RELOAD_MAX_TOKENS)
    # No pause is needed: A's stores were issued and completed during its own decode steps.
    if args.settle_s:
        time.sleep(args.settle_s)
    reset_ok = llm.reset_prefix_cache()  # reset_connector=False: the offload tier is kept
    (a_second,), t_second = generate(llm, [a], RELOAD_MAX_TOKENS)
    return {
        "prompt_a": a,
        "a_first": a_first,
        "a_warm": a_warm,
        "others": other_recs,
        "reset_prefix_cache_ok": reset_ok,
        "a_second": a_second,
        "same_output": a_first["token_ids"] == a_second["token_ids"],
        "wall_s": {"a_first": t_first, "a_warm": t_warm, "others": t_others, "a_second": t_second},
    }


def scenario_restart(llm, args) -> dict[str, Any]:
    """A once. Run after a 'reload' with the same --disk-path: a fresh engine whose
    ``a.num_cached_tokens`` > 0 read A's blocks back from disk; or, with the same --remote-url and
    no disk, a second engine that got them from the first engine's writes to the shared server."""
    a = random_tokens(PROMPT_A_SEED, args.prompt_blocks * BLOCK_SIZE + 8)
    (rec,), t = generate(llm, [a], RELOAD_MAX_TOKENS)
    return {"prompt_a": a, "a": rec, "wall_s": {"a": t}}


def scenario_chaos(llm, args) -> dict[str, Any]:
    """Preemption + aborts on a tiny KV pool, driven step by step through llm.llm_engine.

    The pool has CHAOS_GPU_BLOCKS blocks (num_gpu_blocks_override, see main()). Each
    request has a 2-block shared prefix plus a unique 1.5-block suffix and generates
    CHAOS_MAX_TOKENS tokens, so it ends up needing ~8 blocks; 10 of them at once
    cannot all fit and the scheduler preempts (recompute) running requests.
    Requests ``chaos-abort-*`` are aborted after ``abort_after_steps`` engine steps,
    i.e. mid-generation (some may be preempted/waiting at that moment).
    """
    from vllm import TokensPrompt

    prefix = random_tokens(500, 2 * BLOCK_SIZE)
    prompts: dict[str, list[int]] = {}
    for i in range(args.chaos_requests):
        kind = "abort" if i % 3 == 2 else "keep"
        prompts[f"chaos-{kind}-{i}"] = prefix + random_tokens(600 + i, BLOCK_SIZE + BLOCK_SIZE // 2)

    engine = llm.llm_engine
    t0 = time.perf_counter()
    for rid, p in prompts.items():
        # request_id is the *external* id; the engine appends a random suffix
        # internally, but RequestOutput.request_id and abort_request() use this one.
        engine.add_request(rid, TokensPrompt(prompt_token_ids=p), greedy(args.chaos_max_tokens))

    finished: dict[str, dict[str, Any]] = {}
    to_abort = [rid for rid in prompts if "-abort-" in rid]
    aborted: list[str] = []
    partial_at_abort: dict[str, int] = {}
    latest: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            latest[out.request_id] = out
            if out.finished:
                finished[out.request_id] = record(out)
        steps += 1
        if steps == args.abort_after_steps:
            live = [rid for rid in to_abort if rid not in finished]
            for rid in live:
                partial_at_abort[rid] = len(latest[rid].outputs[0].token_ids) if rid in latest else 0
            engine.abort_request(live)  # external ids; internal=False
            aborted.extend(live)
        if steps > 100_000:
            raise RuntimeError("chaos: engine did not drain")
    wall = time.perf_counter() - t0
    completed = {rid: rec for rid, rec in finished.items() if rid not in aborted}

    # Reference: each completed prompt again, alone (one request never exceeds the
    # pool, so no preemption), after emptying vLLM's own prefix cache. Greedy
    # outputs under preemption/aborts must equal these.
    reference: dict[str, list[int]] = {}
    t_ref = 0.0
    if args.chaos_reference:
        llm.reset_prefix_cache()
        for rid in sorted(completed):
            (rec,), t = generate(llm, [prompts[rid]], args.chaos_max_tokens)
            reference[rid] = rec["token_ids"]
            t_ref += t
    return {
        "prompts": prompts,
        "steps": steps,
        "finished": completed,
        "num_finished": len(completed),
        "aborted": aborted,
        "num_aborted": len(aborted),
        "tokens_at_abort": partial_at_abort,
        # Aborted requests may still emit a final output with finish_reason "abort".
        "aborted_final_outputs": {rid: rec for rid, rec in finished.items() if rid in aborted},
        "reference": reference,
        "matches_reference": (all(completed[r]["token_ids"] == reference[r] for r in completed)
                              if args.chaos_reference else None),
        "wall_s": {"run": wall, "reference": t_ref},
    }


CRASH_SEED0 = 1000   # crash: prompt B_i is random_tokens(CRASH_SEED0 + i, ...)


def _put_line(path: str, obj: Any) -> None:
    """One JSON line appended and flushed to the page cache (it survives a SIGKILL of this process)."""
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")


def _spilled_blocks() -> float:
    """Blocks the adapter's disk tier wrote so far: the host -> disk bytes over one block's (a spill job may
    carry several blocks)."""
    m = tiered_kv_metrics() or {}

    def total(name: str, **want: str) -> float:
        return sum(v for lab, v in m.get(name, []) if all(lab.get(k) == w for k, w in want.items()))

    blocks, used = total("tiered_kv_tier_blocks", tier="disk"), total("tiered_kv_tier_used_bytes", tier="disk")
    return total("tiered_kv_transfer_bytes_total", src="host", dst="disk") / (used / blocks) if blocks and used else 0


def scenario_crash(llm, args) -> dict[str, Any]:
    """Prompt A, then prompts B0, B1, ... one at a time, each line ``{"seed", "token_ids"}`` appended to
    ``--done-file`` as it finishes.  Once A's blocks are on disk (the tiered_kv adapter's spill jobs counted
    in PROMETHEUS_MULTIPROC_DIR, or after 3 B prompts with vLLM's own tiers, which count nothing there),
    ``--ready-file`` is written: from then on the caller SIGKILLs the engine's process group at any moment,
    while the blocks of the prompts that follow are stored and spilled.  Ends by itself after
    ``--crash-prompts`` B prompts (a caller that meant to kill it failed to)."""
    n = args.prompt_blocks * BLOCK_SIZE + 8
    ready = False
    (rec,), _ = generate(llm, [random_tokens(PROMPT_A_SEED, n)], RELOAD_MAX_TOKENS)
    _put_line(args.done_file, {"seed": PROMPT_A_SEED, "token_ids": rec["token_ids"]})
    for i in range(args.crash_prompts):
        seed = CRASH_SEED0 + i
        (rec,), _ = generate(llm, [random_tokens(seed, n)], RELOAD_MAX_TOKENS)
        _put_line(args.done_file, {"seed": seed, "token_ids": rec["token_ids"]})
        if not ready and (_spilled_blocks() >= args.prompt_blocks if args.spec == "tiered_kv" else i >= 2):
            ready = True
            with open(args.ready_file + ".tmp", "w") as f:
                f.write(str(i + 1))
            os.replace(args.ready_file + ".tmp", args.ready_file)
    return {"done": args.crash_prompts + 1}


def scenario_replay(llm, args) -> dict[str, Any]:
    """After a ``crash`` run was SIGKILLed, a fresh engine on the same ``--disk-path``: the prompts of
    ``--replay-seeds`` (A's and the B's the killed engine finished, or may have had in flight) in one batch,
    then the same prompts again under a ``cache_salt`` of their own (no cache can serve them: a full
    recompute, in a batch of the same shape) as the reference.  What the disk served after the crash is
    each served record's ``num_cached_tokens``; its output must equal the reference's, and the killed
    engine's output where that finished the prompt (``--done-file``)."""
    from vllm import TokensPrompt

    n = args.prompt_blocks * BLOCK_SIZE + 8
    seeds = [int(x) for x in args.replay_seeds.split(",")]
    prompts = [random_tokens(seed, n) for seed in seeds]
    killed: dict[int, list[int]] = {}
    with open(args.done_file) as f:
        for line in f:
            try:
                d = json.loads(line)
            except ValueError:   # a line the kill cut short
                continue
            killed[int(d["seed"])] = d["token_ids"]
    t0 = time.perf_counter()
    served = [record(o) for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                               greedy(RELOAD_MAX_TOKENS), use_tqdm=False)]
    t_served = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = [record(o) for o in llm.generate([TokensPrompt(prompt_token_ids=p, cache_salt=f"reference-{s}")
                                            for p, s in zip(prompts, seeds)],
                                           greedy(RELOAD_MAX_TOKENS), use_tqdm=False)]
    t_ref = time.perf_counter() - t0
    return {
        "seeds": seeds,
        "served": {s: r for s, r in zip(seeds, served)},
        "reference": {s: r["token_ids"] for s, r in zip(seeds, ref)},
        "reference_cached_tokens": sum(r["num_cached_tokens"] for r in ref),
        "killed_run": {s: killed[s] for s in seeds if s in killed},
        "matches_reference": all(a["token_ids"] == b["token_ids"] for a, b in zip(served, ref)),
        "matches_killed_run": all(r["token_ids"] == killed[s] for s, r in zip(seeds, served) if s in killed),
        "wall_s": {"served": t_served, "reference": t_ref},
    }


SCENARIOS = {"reload": scenario_reload, "restart": scenario_restart, "chaos": scenario_chaos,
             "crash": scenario_crash, "replay": scenario_replay}


# ----------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    p.add_argument("--workdir", required=True, help="holds model/ (built once, then reused)")
    p.add_argument("--json", required=True, help="where to write the report")
    p.add_argument("--offload", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--spec", choices=SPECS, default="tiered_kv", help="with --offload: whose offloading")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="on a GPU: the share of its memory vLLM may take (vLLM's default otherwise)")
    p.add_argument("--disk-path", default=None)
    p.add_argument("--remote-url", default=None, help="a Redis server shared by the engines (the remote tier)")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="tiny")
    p.add_argument("--prompt-blocks", type=int, default=6, help="reload/restart: full blocks in prompt A")
    p.add_argument("--host-bytes", type=int, default=64 << 20)
    p.add_argument("--disk-bytes", type=int, default=256 << 20)
    p.add_argument("--shutdown-timeout-s", type=float, default=40.0,
                   help="grace period before vLLM SIGKILLs the engine core (vLLM default: 5)")
    p.add_argument("--num-others", type=int, default=4, help="reload: prompts pushed between the A's")
    p.add_argument("--settle-s", type=float, default=0.0, help="reload: pause before reset_prefix_cache")
    p.add_argument("--chaos-gpu-blocks", type=int, default=24)
    p.add_argument("--chaos-requests", type=int, default=10)
    p.add_argument("--chaos-max-tokens", type=int, default=160)
    p.add_argument("--abort-after-steps", type=int, default=40)
    p.add_argument("--chaos-reference", action=argparse.BooleanOptionalAction, default=True,
                   help="chaos: re-run each completed prompt alone for comparison")
    p.add_argument("--ready-file", help="crash: written once the caller may kill the engine")
    p.add_argument("--done-file", help="crash: each finished prompt's output is appended here; replay: read")
    p.add_argument("--crash-prompts", type=int, default=400, help="crash: B prompts before it ends by itself")
    p.add_argument("--replay-seeds", help="replay: the prompts' seeds, comma-separated")
    return p.parse_args(argv)


def run(args: argparse.Namespace, report: dict[str, Any]) -> None:
    t_start = time.perf_counter()
    model_dir = os.path.join(args.workdir, "model" if args.model_size == "tiny" else f"model-{args.model_size}")
    os.makedirs(args.workdir, exist_ok=True)
    t0 = time.perf_counter()
    report["model_built"] = build_model(model_dir, args.model_size)
    timings = report["timings"]
    timings["model_build_s"] = time.perf_counter() - t0

    if not args.offload:
        extra = None
    elif args.spec == "tiered_kv":
        extra = offload_extra_config(args.host_bytes, args.disk_path, args.disk_bytes, args.remote_url)
    else:
        if args.remote_url is not None:
            raise ValueError(f"--remote-url is the tiered_kv adapter's remote tier; --spec {args.spec} has none")
        extra = native_extra_config(args.spec, args.host_bytes, args.disk_path)
    report["extra_config"] = extra
    overrides: dict[str, Any] = {"max_model_len": MODEL_SIZES[args.model_size]["max_model_len"]}
    if args.gpu_memory_utilization is not None:
        overrides["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.scenario == "chaos":
        # Tiny pool -> preemption. Must stay >= max_model_len / block_size (16) or
        # vLLM refuses to start (one max-length request must fit).
        overrides["num_gpu_blocks_override"] = args.chaos_gpu_blocks
        overrides["max_num_seqs"] = args.chaos_requests
        if args.chaos_reference:
            # float32: the scenario compares greedy outputs under preemption with each prompt run alone, and in
            # bfloat16 vLLM's CPU kernels round differently for another batch shape: a near-tie flips a token late
            # in a request (seen without any offloading: 1 of 7 requests, from its 145th token on).  Without the
            # comparison (the churn benchmark) the model's own dtype stays
            overrides["dtype"] = "float32"
    if args.scenario in ("crash", "replay"):
        # the replay compares a prefix served from disk with a full recompute, in float32 for the reason above;
        # both runs must agree on the dtype (it sizes the blocks the disk tier holds)
        overrides["dtype"] = "float32"
        if not (args.offload and args.disk_path and args.done_file):
            raise ValueError(f"--scenario {args.scenario} needs --offload, --disk-path and --done-file")
        if args.scenario == "crash" and not args.ready_file:
            raise ValueError("--scenario crash needs --ready-file")
        if args.scenario == "replay" and not args.replay_seeds:
            raise ValueError("--scenario replay needs --replay-seeds")

    t0 = time.perf_counter()
    llm = make_llm(model_dir, extra, **overrides)
    timings["engine_init_s"] = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        report["result"] = SCENARIOS[args.scenario](llm, args)
        timings["scenario_s"] = time.perf_counter() - t0
        report["vllm_metrics"] = vllm_metrics(llm)
        report["num_preemptions"] = int(sum(v for _, v in report["vllm_metrics"].get("vllm:num_preemptions", [])))
        report["tiered_kv_metrics"] = tiered_kv_metrics()
    finally:
        t0 = time.perf_counter()
        shutdown_llm(llm, args.shutdown_timeout_s)
        timings["shutdown_s"] = time.perf_counter() - t0
    report["tiered_kv_metrics_after_shutdown"] = tiered_kv_metrics()
    timings["total_s"] = time.perf_counter() - t_start


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict[str, Any] = {"scenario": args.scenario, "offload": args.offload,
                              "spec": args.spec if args.offload else None, "ok": False, "timings": {}}
    rc = 0
    try:
        run(args, report)
        report["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - report anything, then fail
        traceback.print_exc()
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()
        rc = 1
    with open(args.json + ".tmp", "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(args.json + ".tmp", args.json)
    return rc


if __name__ == "__main__":  # the engine spawns processes that re-import this file
    sys.exit(main())
