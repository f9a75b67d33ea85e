#!/usr/bin/env bash
# Install this clone's engine plugin (engine_patches/, dist "kvroute-engine") into a vLLM venv.
#
#   scripts/install_engine_plugin.sh [VLLM_PYTHON]     (default: $KVROUTE_VLLM_PYTHON)
#
# A real (non-editable) install of a copy: the vLLM venv is shared by clones and cached across
# CI runs, so it must not point back at a clone that may vanish. Cheap and idempotent: skipped
# when the installed copy came from identical sources (a hash stamp in the venv), otherwise
# one `pip install --no-deps --no-build-isolation --no-index` of a few files (~3 s).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${1:-${KVROUTE_VLLM_PYTHON:?set KVROUTE_VLLM_PYTHON or pass the vLLM python}}"
VENV="$(cd "$(dirname "$PY")/.." && pwd)"
STAMP="$VENV/.kvroute-engine.sha256"

SUM="$(cd "$ROOT" && find engine_patches scripts/engine_plugin -name '*.py' -o -name '*.toml' \
  | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$SUM" ] \
   && "$PY" -c "import importlib.metadata as m; m.version('kvroute-engine')" >/dev/null 2>&1; then
  exit 0
fi
BUILD="$(mktemp -d)"
trap 'rm -rf "$BUILD"' EXIT
cp "$ROOT/scripts/engine_plugin/pyproject.toml" "$BUILD/"
(cd "$ROOT" && tar -cf - --exclude=__pycache__ engine_patches) | tar -xf - -C "$BUILD"
"$PY" -m pip install --quiet --no-deps --no-build-isolation --no-index --force-reinstall \
  "$BUILD" >&2
echo "$SUM" > "$STAMP"
echo "kvroute: engine plugin installed into $VENV" >&2
