#!/usr/bin/env bash
# The checks that need a GPU, in one run (CI has no GPU; a GPU machine is lent rarely and briefly):
#   1. tiered-kv bench --sections cuda,store_latency: device<->host GB/s beside torch's copy_, a step's
#      blocks as one store_many/load_many beside one large copy_ (issue 25, with the engine thread's CPU
#      per step), the vLLM worker's layout (32 KV tensors side by side in a slab row, through staging rows
#      and block by block), and store() latency on a CUDA KV tensor beside the unsafe original (then the CPU
#      mover's, on this host); first, since its figures are what a short lease is for
#   2. tests/test_cuda.py: the manager and its CudaMover on a real device (ordering, fences, failures)
#   3. tiered-kv bench --quick --sections lifecycles,copy_step: the engine thread's bookkeeping on this
#      host's cores without CUDA calls, to read the CUDA step's CPU against
#   4. the core suite with CUDA present, in parallel and time-capped (SUITE_S seconds, SUITE_N workers)
#   5. where vLLM imports (not on a machine without it): benchmarks/vllm_e2e.py, tiered_kv's adapter beside
#      vLLM's own CPU offloading (lru, arc, the tiering spec's fs tier) and no offloading, end to end
#      (issue 22; vLLM runs its own specs on CUDA only). VLLM_PLAN (quick) and VLLM_E2E_S (1200) bound it
# Usage, from the repository root, with a python whose torch sees CUDA and the project's
# dependencies importable (pip install -e '.[test]' pytest-xdist, or PYTHONPATH):
#   OUT=gpu-out benchmarks/gpu_check.sh
# Each step's output is written under $OUT; a step that fails does not stop the next.
# A lent GPU machine without the network and without lmdb (torch, pytest-xdist present): fetch the
# wheels here first, carry .whl (git-ignored) along, and install them there into a private target:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl lmdb diskcache
#   (there) pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site \
#       OUT=$OUT benchmarks/gpu_check.sh
set -u
OUT=${OUT:-gpu-out}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

step() { echo; echo "=== $* ($(date -u +%T))"; }

step machine
nvidia-smi -L 2>&1 | head -4
"$PY" - <<'EOF' 2>&1 | tee "$OUT/machine.txt"
import os, torch, lmdb, xxhash, prometheus_client
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "cores", os.cpu_count())
print("lmdb", lmdb.__version__, "xxhash", xxhash.VERSION)
EOF

step "bench: cuda, store_latency"
timeout "${BENCH_S:-360}" "$PY" -m tiered_kv.tools.cli bench --sections "${BENCH_SECTIONS:-cuda,store_latency}" \
    --json "$OUT/bench-gpu.json" 2>&1 | tee "$OUT/bench-gpu.txt" | tail -40

step "tests/test_cuda.py"
timeout "${CUDA_TESTS_S:-240}" "$PY" -m pytest -q -p no:cacheprovider -rA tests/test_cuda.py 2>&1 \
    | tee "$OUT/test_cuda.txt" | tail -30

step "bench, CPU rows on this host (quick): ${CPU_SECTIONS:-lifecycles,copy_step}"
# the engine thread's bookkeeping without CUDA calls, on this host's cores: beside the CUDA step's CPU above
timeout "${CPU_BENCH_S:-120}" "$PY" -m tiered_kv.tools.cli bench --quick --sections "${CPU_SECTIONS:-lifecycles,copy_step}" \
    --json "$OUT/bench-cpu.json" 2>&1 | tee "$OUT/bench-cpu.txt" | tail -40

step "core suite with CUDA present"
timeout "${SUITE_S:-150}" "$PY" -m pytest -q -p no:cacheprovider -n "${SUITE_N:-12}" \
    --ignore=tests/vllm_adapter 2>&1 | tee "$OUT/suite.txt" | tail -25
step "vLLM end to end: tiered_kv beside vLLM's own offloading"
if "$PY" -c 'import vllm' 2>/dev/null; then
    timeout "${VLLM_E2E_S:-1200}" "$PY" benchmarks/vllm_e2e.py --plan "${VLLM_PLAN:-quick}" \
        --gpu-memory-utilization "${VLLM_GPU_SHARE:-0.3}" --json "$OUT/vllm-e2e.json" 2>&1 \
        | tee "$OUT/vllm-e2e.txt" | tail -30
else
    echo "skipped: vllm is not importable by $PY (install vllm with its CUDA torch to run this part)" \
        | tee "$OUT/vllm-e2e.txt"
fi
step done
