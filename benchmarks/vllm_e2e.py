"""End to end inside vLLM: tiered_kv's adapter beside vLLM's own CPU offloading and beside no offloading.

    .venv-vllm/bin/python benchmarks/vllm_e2e.py [--plan smoke|quick|full] [--json OUT]
    make bench-vllm-e2e                     # the quick plan, results under benchmarks/results/

``benchmarks/gpu_check.sh`` runs it where vLLM imports (a GPU machine with vLLM installed).

Every run is ``tests/vllm_adapter/harness.py`` in a process of its own: a fresh engine (its EngineCore
and worker processes), the same seeded random Llama (built once into the work directory: no model
hub), the same token-id prompts, greedy decoding, block size 32, prefix caching on.  The systems
differ only in ``kv_transfer_config``:

* ``none``: no offloading (the baseline of every ratio);
* ``tiered_kv``: the adapter, host tier only (the like-for-like case: vLLM's CPU spec has no disk);
* ``vllm-lru``, ``vllm-arc``: vLLM's ``CPUOffloadingSpec`` with that policy, on the same host bytes;
* ``tiered_kv+disk``: the adapter with its LMDB tier; ``vllm-fs``: vLLM's ``TieringOffloadingSpec``
  with its ``fs`` tier, each with a directory of its own.

vLLM runs its own specs on CUDA and XPU only (``CPUOffloadingSpec.get_worker`` refuses other
platforms, and the tiering spec inherits that worker), so on a CPU machine their rows say
``skipped`` with that reason, and the run measures tiered_kv against no offloading.

Figures (each the median over ``repeats``, the systems' order rotated each repeat):

1. **reload**: prompt A (``prompt_blocks`` full blocks + 8 tokens, 16 tokens generated), A again,
   four other prompts, ``reset_prefix_cache()``, A again.  The last request's wall time against
   ``none``'s (which recomputes A), and how many of its tokens came from the cache.
2. **store cost**: the first A request's wall time (the request whose blocks are stored) against
   ``none``'s: what offloading adds to the request that pays for it.
3. **churn**: ``churn_requests`` requests sharing a 2-block prefix, each generating
   ``churn_tokens`` tokens on a KV pool too small for all of them (the scheduler preempts), a third
   aborted after 40 engine steps: tokens of the completed requests per second of the run.
4. **restart** (the disk systems): after the reload run, a fresh engine on the same directory
   serves A: its cached tokens and wall time, against ``none``'s first A (a recompute), and the
   bytes on disk (allocated blocks) against the configured capacity (vLLM's ``fs`` tier takes none).

5. **after a SIGKILL mid-write** (the disk systems, float32): an engine serving prompt A and then one
   prompt after another is SIGKILLed with all its processes once A is on disk and two more prompts
   finished, and (tiered_kv) its engine has spill jobs in flight (``tests/vllm_adapter/crashrun.py``); a fresh engine on the same directory replays each
   prompt the killed one finished or had in flight, then the same prompts again under a cache salt of
   their own (a full recompute) as the reference: the blocks it served from disk against the full
   blocks of the prompts the killed engine finished, and whether every output equals the reference's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "tests" / "vllm_adapter" / "harness.py"
sys.path.insert(0, str(HARNESS.parent))
from crashrun import kill_mid_write  # noqa: E402  (tests/vllm_adapter: the test's kill harness, shared)
MiB = 1 << 20

PLANS: dict[str, dict[str, Any]] = {
    # model, full blocks in prompt A, repeats, churn requests and tokens, churn pool (> max_model_len / 32: vLLM
    # refuses a pool that cannot hold one request of the model's length)
    "full": {"model_size": "medium", "prompt_blocks": 48, "repeats": 3, "churn_requests": 16, "churn_tokens": 160,
             "churn_blocks": 72},
    "quick": {"model_size": "medium", "prompt_blocks": 48, "repeats": 1, "churn_requests": 16, "churn_tokens": 160,
              "churn_blocks": 72},
    "smoke": {"model_size": "tiny", "prompt_blocks": 6, "repeats": 1, "churn_requests": 10, "churn_tokens": 160,
              "churn_blocks": 24},
}
HOST_SYSTEMS = ("none", "tiered_kv", "vllm-lru", "vllm-arc")
DISK_SYSTEMS = ("tiered_kv+disk", "vllm-fs")
NATIVE = frozenset({"vllm-lru", "vllm-arc", "vllm-fs"})
HOST_BYTES = {"tiny": 64 * MiB, "medium": 512 * MiB}    # holds A and the four other prompts
DISK_BYTES = {"tiny": 256 * MiB, "medium": 1024 * MiB}


def native_refused() -> Optional[str]:
    """Why vLLM's own specs cannot run here (vLLM's own check), or None where they can."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike() or current_platform.is_xpu():
        return None
    return ("skipped: vLLM's CPUOffloadingSpec runs on CUDA and XPU only (its get_worker refuses the "
            f"{current_platform.device_type or 'cpu'} platform)")


def _harness(work: Path, name: str, *args: str, timeout_s: float) -> dict[str, Any]:
    """One harness run; its report (``ok`` false and ``error`` set when it failed)."""
    prom = work / f"prom-{name}"
    shutil.rmtree(prom, ignore_errors=True)
    prom.mkdir(parents=True)
    out = work / f"{name}.json"
    out.unlink(missing_ok=True)
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(prom))
    try:
        proc = subprocess.run([sys.executable, str(HARNESS), "--workdir", str(work), "--json", str(out), *args],
                              env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout_s:.0f} s"}
    if not out.exists():
        return {"ok": False, "error": f"rc={proc.returncode}, no report: {proc.stderr[-2000:]}"}
    report: dict[str, Any] = json.loads(out.read_text())
    if not report.get("ok"):
        report.setdefault("error", f"rc={proc.returncode}")
        causes = [ln for ln in proc.stderr.splitlines() if "Error:" in ln]   # the engine process's root cause
        if causes:
            report["error"] += f" | {causes[-1].strip()[-600:]}"
    return report


def _system_args(system: str, disk: Optional[Path], plan: dict[str, Any], gpu_share: Optional[float]) -> list[str]:
    size = plan["model_size"]
    args = ["--model-size", size, "--host-bytes", str(HOST_BYTES[size]), "--disk-bytes", str(DISK_BYTES[size])]
    if gpu_share is not None:
        args += ["--gpu-memory-utilization", str(gpu_share)]
    if system == "none":
        return args + ["--no-offload"]
    spec = {"tiered_kv": "tiered_kv", "tiered_kv+disk": "tiered_kv"}.get(system, system)
    args += ["--offload", "--spec", spec]
    if disk is not None:
        args += ["--disk-path", str(disk)]
    return args


def _gen_tokens(recs: Any) -> int:
    return sum(len(r["token_ids"]) for r in recs)


def _du(path: Path) -> int:
    """Bytes the files under ``path`` take on disk (allocated blocks: LMDB's map file is sparse)."""
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def run_system(system: str, rep: int, work: Path, plan: dict[str, Any], gpu_share: Optional[float],
               timeout_s: float) -> dict[str, Any]:
    """One system's runs of one repeat: reload (and restart for a disk system), and churn for a host one."""
    disk = work / f"disk-{system}-{rep}" if system in DISK_SYSTEMS else None
    if disk is not None:
        shutil.rmtree(disk, ignore_errors=True)
    base = _system_args(system, disk, plan, gpu_share)
    tag = f"{system}-{rep}".replace("+", "_")
    out: dict[str, Any] = {"system": system, "repeat": rep}
    r = _harness(work, f"reload-{tag}", "--scenario", "reload", "--prompt-blocks", str(plan["prompt_blocks"]),
                 *base, timeout_s=timeout_s)
    if not r["ok"]:
        return {**out, "error": f"reload: {r['error']}"}
    res = r["result"]
    first = res["a_first"]
    out.update(store_prefill_s=first.get("prefill_s"), store_decode_s=first.get("decode_s"),
               store_queued_s=first.get("queued_s"))
    out.update(store_s=res["wall_s"]["a_first"], reload_s=res["wall_s"]["a_second"],
               reload_cached_tokens=res["a_second"]["num_cached_tokens"], prompt_tokens=res["a_second"]["prompt_len"],
               same_output=res["same_output"], first_tokens=res["a_first"]["token_ids"],
               engine_init_s=r["timings"]["engine_init_s"])
    if disk is not None:
        out["disk_bytes_used"] = _du(disk)
        # vLLM's fs tier takes no bound: it writes a file per block until the disk is full
        out["disk_bytes_capacity"] = None if system == "vllm-fs" else DISK_BYTES[plan["model_size"]]
        r = _harness(work, f"restart-{tag}", "--scenario", "restart", "--prompt-blocks", str(plan["prompt_blocks"]),
                     *base, timeout_s=timeout_s)
        if not r["ok"]:
            return {**out, "error": f"restart: {r['error']}"}
        res = r["result"]
        out.update(restart_s=res["wall_s"]["a"], restart_cached_tokens=res["a"]["num_cached_tokens"],
                   restart_same_output=res["a"]["token_ids"] == out["first_tokens"])
        return {**out, **crash_system(system, tag, work, plan, gpu_share, timeout_s)}
    r = _harness(work, f"churn-{tag}", "--scenario", "chaos", "--no-chaos-reference",
                 "--chaos-gpu-blocks", str(plan["churn_blocks"]), "--chaos-requests", str(plan["churn_requests"]),
                 "--chaos-max-tokens", str(plan["churn_tokens"]), *base, timeout_s=timeout_s)
    if not r["ok"]:
        return {**out, "error": f"churn: {r['error']}"}
    res = r["result"]
    out.update(churn_s=res["wall_s"]["run"], churn_tokens=_gen_tokens(res["finished"].values()),
               churn_completed=res["num_finished"], churn_aborted=res["num_aborted"],
               churn_preemptions=r["num_preemptions"])
    out["churn_tokens_per_s"] = out["churn_tokens"] / out["churn_s"]
    return out


def crash_system(system: str, tag: str, work: Path, plan: dict[str, Any], gpu_share: Optional[float],
                 timeout_s: float) -> dict[str, Any]:
    """Figure 5 for one disk system: its ``crash_*`` fields, or ``crash_error``."""
    disk = work / f"crash-disk-{tag}"
    shutil.rmtree(disk, ignore_errors=True)
    args = _system_args(system, None, plan, gpu_share) + ["--prompt-blocks", str(plan["prompt_blocks"])]
    killed = kill_mid_write(work, f"crash-{tag}", disk, args, timeout_s)
    if killed.error:
        return {"crash_error": killed.error}
    r = _harness(work, f"replay-{tag}", "--scenario", "replay", "--disk-path", str(disk), "--done-file",
                 str(killed.done_file), "--replay-seeds", ",".join(map(str, killed.seeds)), *args, timeout_s=timeout_s)
    if not r["ok"]:
        return {"crash_error": f"replay: {r['error']}"}
    res = r["result"]
    return {"crash_finished_prompts": killed.finished, "crash_finished_blocks": killed.finished * plan["prompt_blocks"],
            "crash_served_blocks": sum(x["num_cached_tokens"] for x in res["served"].values()) // 32,
            # per prompt replayed (A, B0, ..., the one that may have been in flight): its blocks served from disk
            "crash_served_by_prompt": [res["served"][str(s)]["num_cached_tokens"] // 32 for s in killed.seeds],
            "crash_right": bool(res["matches_reference"] and res["matches_killed_run"]
                                and res["reference_cached_tokens"] == 0),
            "crash_slabs_left": len(killed.slabs_left), "crash_spills_in_flight": killed.spills_in_flight}


def _median(runs: list[dict[str, Any]], k: str) -> Optional[float]:
    xs = [r[k] for r in runs if r.get(k) is not None]
    return statistics.median(xs) if xs else None


def summarize(runs: dict[str, list[dict[str, Any]]], skipped: dict[str, str]) -> list[dict[str, Any]]:
    """The table's rows: figure, system, value, the baseline's value, ratio (system / baseline)."""
    rows: list[dict[str, Any]] = []
    ok = {s: [r for r in rs if "error" not in r] for s, rs in runs.items()}

    def row(figure: str, unit: str, system: str, key: str, base_key: str, better: str) -> None:
        if system in skipped:
            rows.append({"figure": figure, "system": system, "skipped": skipped[system]})
            return
        if not ok.get(system):
            errs = [r["error"] for r in runs.get(system, []) if "error" in r]
            rows.append({"figure": figure, "system": system, "skipped": f"failed: {errs[:1]}"})
            return
        v, b = _median(ok[system], key), _median(ok.get("none", []), base_key)
        rows.append({"figure": figure, "unit": unit, "system": system, "value": v, "baseline": b,
                     "ratio": None if v is None or not b else v / b, "better": better})

    for s in HOST_SYSTEMS[1:]:
        row("reload after reset_prefix_cache()", "s", s, "reload_s", "reload_s", "lower")
    for s in HOST_SYSTEMS[1:]:
        row("the storing request (A's first)", "s", s, "store_s", "store_s", "lower")
    for s in HOST_SYSTEMS[1:]:
        row("churn with aborts and preemption", "tokens/s", s, "churn_tokens_per_s", "churn_tokens_per_s", "higher")
    for s in DISK_SYSTEMS:
        row("A on a restarted engine, from disk", "s", s, "restart_s", "store_s", "lower")
    for s in DISK_SYSTEMS:   # against what the killed engine had finished, not against none
        if s in skipped:
            rows.append({"figure": "served after a SIGKILL mid-write", "system": s, "skipped": skipped[s]})
            continue
        rs = [r for r in ok.get(s, []) if "crash_served_blocks" in r]
        if not rs:
            errs = [r.get("crash_error") or r.get("error") for r in runs.get(s, [])]
            rows.append({"figure": "served after a SIGKILL mid-write", "system": s, "skipped": f"failed: {errs[:1]}"})
            continue
        v, b = _median(rs, "crash_served_blocks"), _median(rs, "crash_finished_blocks")
        rows.append({"figure": "served after a SIGKILL mid-write", "unit": "blocks", "system": s, "value": v,
                     "baseline": b, "ratio": v / b if v is not None and b else None, "better": "higher",
                     "note": (f"baseline: the full blocks of the {_median(rs, 'crash_finished_prompts'):.0f} prompts "
                              f"the killed engine finished; every output right: {all(r['crash_right'] for r in rs)}; "
                              f"slab files left in /dev/shm: {sum(r['crash_slabs_left'] for r in rs)}; spill jobs in flight at the "
                              f"kill: {_median(rs, 'crash_spills_in_flight') or 0:.0f}")})
    for r in rows:   # what the figure's runs served, beside it
        rs = ok.get(r["system"], [])
        if not rs or "skipped" in r:
            continue
        if r["figure"].startswith("reload"):
            r["note"] = (f"{_median(rs, 'reload_cached_tokens'):.0f} of {_median(rs, 'prompt_tokens'):.0f} prompt "
                         f"tokens from the cache; same output: {all(x['same_output'] for x in rs)}")
        elif r["figure"].startswith("the storing request") and _median(rs, "store_prefill_s") is not None:
            base = ok.get("none", [])
            bp, bd = _median(base, "store_prefill_s"), _median(base, "store_decode_s")
            r["note"] = (f"prefill {_median(rs, 'store_prefill_s'):.3f} s, decode {_median(rs, 'store_decode_s'):.3f} s"
                         + ("" if bp is None or bd is None else f" (none: {bp:.3f} s, {bd:.3f} s)"))
        elif r["figure"].startswith("churn"):
            r["note"] = (f"{_median(rs, 'churn_completed'):.0f} completed, {_median(rs, 'churn_aborted'):.0f} "
                         f"aborted, {_median(rs, 'churn_preemptions'):.0f} preemptions")
        elif r["figure"].startswith("A on a restarted"):
            r["note"] = (f"{_median(rs, 'restart_cached_tokens'):.0f} tokens from disk, same output: "
                         f"{all(x.get('restart_same_output') for x in rs)}; "
                         f"{_median(rs, 'disk_bytes_used') / MiB:.1f} MiB on disk of "
                         + ("no bound" if _median(rs, "disk_bytes_capacity") is None else
                            f"{_median(rs, 'disk_bytes_capacity') / MiB:.0f} MiB"))
    return rows


def format_rows(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, f"{'figure':38s} {'system':15s} {'value':>10s} {'unit':9s} {'none':>10s} {'ratio':>7s}  note"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['figure']:38s} {r['system']:15s} {r['skipped']}")
            continue
        v = "-" if r["value"] is None else f"{r['value']:.3f}"
        b = "-" if r["baseline"] is None else f"{r['baseline']:.3f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        lines.append(f"{r['figure']:38s} {r['system']:15s} {v:>10s} {r['unit']:9s} {b:>10s} {ratio:>7s}  "
                     f"{r.get('note', '')}")
    lines.append("ratio = system / none (no offloading; for the SIGKILL row, / its note's baseline); for seconds "
                 "lower is better, for tokens/s and blocks higher")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", choices=sorted(PLANS), default="quick")
    p.add_argument("--repeats", type=int, default=None, help="override the plan's repeats")
    p.add_argument("--systems", default=None, help="comma-separated subset of "
                   + ",".join(HOST_SYSTEMS + DISK_SYSTEMS) + " (none is always run)")
    p.add_argument("--workdir", type=Path, default=None, help="model and run files (default: a temporary dir)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="on a GPU: the share of its memory each engine may take (vLLM's default otherwise)")
    p.add_argument("--run-timeout-s", type=float, default=900.0, help="per engine run")
    p.add_argument("--json", type=Path, default=None, help="write the full result here")
    a = p.parse_args(argv)
    plan = dict(PLANS[a.plan])
    if a.repeats is not None:
        if a.repeats < 1:
            p.error(f"--repeats must be >= 1, got {a.repeats}")
        plan["repeats"] = a.repeats
    systems = list(HOST_SYSTEMS + DISK_SYSTEMS)
    if a.systems:
        wanted = [s.strip() for s in a.systems.split(",") if s.strip()]
        unknown = sorted(set(wanted) - set(systems))
        if unknown:
            p.error(f"--systems: unknown {unknown}; choose from {systems}")
        systems = [s for s in systems if s == "none" or s in wanted]
    if a.json is not None and not a.json.parent.is_dir():
        p.error(f"--json: no directory {a.json.parent}")
    refused = native_refused()
    skipped = {s: refused for s in NATIVE if refused is not None}
    skipped.update({s: "skipped: not in --systems" for s in HOST_SYSTEMS + DISK_SYSTEMS if s not in systems})
    todo = [s for s in systems if s not in skipped]

    from vllm import __version__ as vllm_version
    import torch

    tmp = None
    if a.workdir is None:
        tmp = tempfile.mkdtemp(prefix="tkv-vllm-e2e-")
        work = Path(tmp)
    else:
        work = a.workdir
        work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in todo}
    try:
        for rep in range(plan["repeats"]):
            order = todo[rep % len(todo):] + todo[:rep % len(todo)]
            for s in order:
                r = run_system(s, rep, work, plan, a.gpu_memory_utilization, a.run_timeout_s)
                runs[s].append(r)
                print(f"repeat {rep + 1}/{plan['repeats']} {s:15s} "
                      + (f"FAILED {r['error'][:300]}" if "error" in r else
                         " ".join(f"{k}={r[k]:.3f}" for k in ("store_s", "reload_s", "churn_tokens_per_s",
                                                              "restart_s") if k in r)), flush=True)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    # every system's first request must produce the tokens the engine without offloading produced
    base_tokens = [r["first_tokens"] for r in runs.get("none", []) if "first_tokens" in r]
    for s, rs in runs.items():
        for r in rs:
            if base_tokens and r.get("first_tokens") not in (None, base_tokens[0]):
                r["error"] = "its first request's output differs from the engine's without offloading"
    rows = summarize(runs, skipped)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    header = (f"vLLM {vllm_version} end to end ({a.plan} plan: {plan['model_size']} model, prompt A of "
              f"{plan['prompt_blocks']} blocks of 32 tokens, median of {plan['repeats']}); device: {device}, "
              f"{os.cpu_count()} cores; {time.perf_counter() - t0:.0f} s")
    print()
    print(format_rows(rows, header))
    if a.json is not None:
        a.json.write_text(json.dumps({"plan": a.plan, "params": plan, "vllm": vllm_version, "device": device,
                                      "cores": os.cpu_count(), "skipped": skipped, "rows": rows,
                                      "runs": {s: [{k: v for k, v in r.items() if k != "first_tokens"} for r in rs]
                                               for s, rs in runs.items()}}, indent=1))
        print(f"wrote {a.json}")
    failed = [r for rs in runs.values() for r in rs if "error" in r or "crash_error" in r
              or r.get("crash_right") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
