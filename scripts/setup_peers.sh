#!/usr/bin/env bash
# Prepare venvs with peer routers for benchmarks (loadtest/bench/bench_proxy.py, `kvroute bench`).
#
#   scripts/setup_peers.sh [sglang|vllm-router|all]     (default: sglang)
#
# sglang-router (PyPI, a Rust load balancer with a Python launcher) and vllm-router (PyPI, its
# vLLM fork). Each venv lives outside the clone, keyed by version:
# ${KVROUTE_CACHE:-~/.cache/kvroute}/peers-<name>-<ver>. Prints the (last) venv path on its
# last line. Idempotent: a finished venv has a `.ready` stamp.
set -euo pipefail
WHICH="${1:-sglang}"
CACHE="${KVROUTE_CACHE:-$HOME/.cache/kvroute}"
PY="${PYTHON:-python3}"

setup() {  # name version import-check
  local name="$1" ver="$2" check="$3"
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
  "$venv/bin/pip" install --quiet "$name==$ver" >&2
  "$venv/bin/python" -c "import $check, sys; print('$check ok', file=sys.stderr)" >&2
  touch "$venv/.ready"
  echo "$venv"
}

case "$WHICH" in
  sglang) setup sglang-router "${SGLANG_ROUTER_VERSION:-0.3.2}" sglang_router ;;
  vllm-router) setup vllm-router "${VLLM_ROUTER_VERSION:-0.1.17}" vllm_router ;;
  all)
    setup sglang-router "${SGLANG_ROUTER_VERSION:-0.3.2}" sglang_router
    setup vllm-router "${VLLM_ROUTER_VERSION:-0.1.17}" vllm_router ;;
  *) echo "usage: $0 [sglang|vllm-router|all]" >&2; exit 2 ;;
esac
