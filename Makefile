# Two entry points, each creating .venv on first use.
# torch is pinned to the CPU build that lies on this kind of machine; see README for CUDA.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0

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

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q

bench: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/tiered-kv bench --json benchmarks/results/bench-$$(date +%F).json --plot docs/img

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
