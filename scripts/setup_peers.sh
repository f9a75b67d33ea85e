#!/usr/bin/env bash
# Prepare venvs with peer routers for benchmarks (loadtest/bench/bench_proxy.py, `kvroute bench`).
#
#   scripts/setup_peers.sh [sglang|vllm-router|dynamo|all]     (default: sglang)
#
# sglang-router (PyPI, a Rust load balancer with a Python launcher), vllm-router (PyPI, its
# vLLM fork) and NVIDIA Dynamo's KV router (PyPI `ai-dynamo-runtime`, its runtime-free
# `dynamo._core.SelectionService`; not the `ai-dynamo` meta-package, which fails on its
# `aisimulate` dependency), with what the harness's HTTP front for it needs
# (loadtest/sweep/dynamo_front.py: aiohttp, and the twins' tokenizer code's tokenizers, jinja2,
# numpy, cbor2, orjson). Each venv lives outside the clone, keyed by version:
# ${KVROUTE_CACHE:-~/.cache/kvroute}/peers-<name>-<ver>. Prints the (last) venv path on its
# last line. Idempotent: a finished venv has a `.ready` stamp.
set -euo pipefail
WHICH="${1:-sglang}"
CACHE="${KVROUTE_CACHE:-$HOME/.cache/kvroute}"
PY="${PYTHON:-python3}"

setup() {  # name version import-check [pip package] [extra pip requirements...]
  local name="$1" ver="$2" check="$3" pkg="${4:-$1}"
  shift 4 2>/dev/null || shift $#
  local venv="$CACHE/peers-$name-$ver"
  if [ -f "$venv/.ready" ]; then
    echo "$venv"
    return 0
  fi
  mkdir -p "$CACHE"
  rm -rf "$venv"
  echo "kvroute: creating $name $ver venv at $venv (one-off)" >&2
  "$PY" -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip >&2
  "$venv/bin/pip" install --quiet "$pkg==$ver" "$@" >&2
  "$venv/bin/python" -c "import $check, sys; print('$check ok', file=sys.stderr)" >&2
  touch "$venv/.ready"
  echo "$venv"
}

sglang() { setup sglang-router "${SGLANG_ROUTER_VERSION:-0.3.2}" sglang_router; }
vllm_router() { setup vllm-router "${VLLM_ROUTER_VERSION:-0.1.17}" vllm_router; }
dynamo() {
  setup dynamo "${DYNAMO_RUNTIME_VERSION:-1.6.1}" "dynamo._core, aiohttp, tokenizers, jinja2" \
    ai-dynamo-runtime "aiohttp>=3.9" "tokenizers>=0.20" "jinja2>=3.1" "numpy>=1.26" \
    "cbor2>=5.6" "orjson>=3.9"
}

case "$WHICH" in
  sglang) sglang ;;
  vllm-router) vllm_router ;;
  dynamo) dynamo ;;
  all) sglang; vllm_router; dynamo ;;
  *) echo "usage: $0 [sglang|vllm-router|dynamo|all]" >&2; exit 2 ;;
esac
