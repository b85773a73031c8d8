"""Time saved by tiered_kv inside vLLM: the same seeded prompt with and without offloading.

Runs ``tests/vllm_adapter/harness.py`` (scenario ``reload``, ``--model-size medium``: 8 layers,
hidden 1024, 1 MiB of KV per 32-token block) three times in the vLLM venv:

* no offloading: after ``reset_prefix_cache()`` prompt A is prefilled again;
* tiered_kv, host tier: A's KV comes back from the shared slab;
* tiered_kv, host + disk, then a fresh engine on the same disk path: A's KV comes back
  from LMDB (read into the slab, then copied to the KV cache).

and prints one table of ``a_second`` wall times (the request after the reset) with the
ratio to the no-offload run.  Usage::

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--prompt-blocks 48] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HARNESS = Path(__file__).resolve().parent.parent / "tests" / "vllm_adapter" / "harness.py"


def run(workdir: Path, name: str, *args: str) -> dict:
    out = workdir / f"{name}.json"
    prom = workdir / f"prom-{name}"
    prom.mkdir()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(prom))
    proc = subprocess.run([sys.executable, str(HARNESS), "--workdir", str(workdir), "--json", str(out),
                           "--model-size", "medium", *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{name} failed")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-blocks", type=int, default=48)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    pb = ["--prompt-blocks", str(args.prompt_blocks), "--num-others", "2"]
    with tempfile.TemporaryDirectory(prefix="tkv-bench-vllm-") as tmp:
        w = Path(tmp)
        host_bytes = str((args.prompt_blocks * 3 + 16) << 20)
        base = run(w, "base", "--scenario", "reload", "--no-offload", *pb)
        host = run(w, "host", "--scenario", "reload", "--offload", "--host-bytes", host_bytes, *pb)
        disk = str(w / "disk")
        run(w, "disk1", "--scenario", "reload", "--offload", "--host-bytes", host_bytes, "--disk-path", disk,
            "--disk-bytes", str(4 << 30), *pb)
        again = run(w, "disk2", "--scenario", "restart", "--offload", "--host-bytes", host_bytes, "--disk-path", disk,
                    "--disk-bytes", str(4 << 30), *pb)
    rows = [
        ("no offloading (recompute)", base["result"]["a_second"], base["result"]["wall_s"]["a_second"]),
        ("tiered_kv host tier", host["result"]["a_second"], host["result"]["wall_s"]["a_second"]),
        ("tiered_kv disk tier, fresh engine", again["result"]["a"], again["result"]["wall_s"]["a"]),
    ]
    ref = rows[0][2]
    same = all(r[1]["token_ids"] == rows[0][1]["token_ids"] for r in rows)
    print(f"prompt: {args.prompt_blocks * 32 + 8} tokens, 16 generated; identical greedy output in all runs: {same}")
    print(f"{'run':38} {'cached tokens':>14} {'wall s':>8} {'vs recompute':>13}")
    result = []
    for name, rec, t in rows:
        print(f"{name:38} {rec['num_cached_tokens']:>14} {t:>8.3f} {t / ref:>12.2f}x")
        result.append({"run": name, "num_cached_tokens": rec["num_cached_tokens"], "wall_s": t, "ratio": t / ref})
    # what offloading costs the request that computes the prefix in the first place
    first = {"no offloading": base["result"]["wall_s"]["a_first"], "tiered_kv host": host["result"]["wall_s"]["a_first"]}
    print("first request (computes and, with tiered_kv, stores the prefix): "
          + ", ".join(f"{k} {v:.3f} s" for k, v in first.items())
          + f" ({first['tiered_kv host'] / first['no offloading']:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"prompt_blocks": args.prompt_blocks, "identical_output": same,
                                               "rows": result, "first_request_wall_s": first}, indent=2))
    if not same:
        raise SystemExit("greedy outputs differ")


if __name__ == "__main__":
    main()
