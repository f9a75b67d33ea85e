#!/usr/bin/env bash
# Prepare a venv with peer routers for the proxy benchmark (loadtest/bench/bench_proxy.py).
#
# Today: sglang-router (PyPI, a Rust load balancer with a Python launcher). The venv lives
# outside the clone, keyed by version: ${KVROUTE_CACHE:-~/.cache/kvroute}/peers-sglang-router-<ver>.
# Prints the venv path on its last line. Idempotent: a finished venv has a `.ready` stamp.
set -euo pipefail
VER="${SGLANG_ROUTER_VERSION:-0.3.2}"
CACHE="${KVROUTE_CACHE:-$HOME/.cache/kvroute}"
VENV="$CACHE/peers-sglang-router-$VER"
PY="${PYTHON:-python3}"

if [ -f "$VENV/.ready" ]; then
  echo "$VENV"
  exit 0
fi
mkdir -p "$CACHE"
rm -rf "$VENV"
echo "kvroute: creating sglang-router $VER venv at $VENV (one-off)" >&2
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip >&2
"$VENV/bin/pip" install --quiet "sglang-router==$VER" >&2
"$VENV/bin/python" -c "import sglang_router, sys; print('sglang_router ok', file=sys.stderr)" >&2
touch "$VENV/.ready"
echo "$VENV"
