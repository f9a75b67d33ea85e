#!/usr/bin/env bash
# One device call for issue 15's GPU checks, from the repo root of a CUDA host with torch,
# triton and pytest installed: the kernels tier with the *compiled* kernels on the GPU (the
# fp8 tests must pass there), then — where vLLM (0.32.0/0.33.0) imports — the engine
# plugin's kernel patches (KVROUTE_KERNELS) installed by register() on the CUDA platform and
# each patched vLLM function against vLLM's original on GPU tensors (vllm_patch_check.py here;
# no engine, no model), then every benchmark (bench_all.py here). Under 5 min in all.
#   bash loadtest/kernel_tools/gpu_session.sh [OUT_DIR]     (default: $OUT, else out/kernels-gpu)
set -uo pipefail
out="${1:-${OUT:-out/kernels-gpu}}"
py="${PYTHON:-python3}"
mkdir -p "$out"
"$py" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'" || exit 2
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > "$out/gpu.txt" 2>&1
export KVROUTE_KERNELS_TEST_DEVICE=cuda TRITON_DEFAULT_FP_FUSION=1
budget="${KVROUTE_GPU_SESSION_S:-290}"  # the whole script stays under 5 min: bench gets the rest
timeout 110 "$py" -m pytest tests/kernels -q -p no:cacheprovider > "$out/pytest.txt" 2>&1
echo "pytest rc=$?" >> "$out/pytest.txt"
if timeout 60 "$py" -c "import vllm" > /dev/null 2>&1; then
  timeout 60 "$py" -m loadtest.kernel_tools.vllm_patch_check --device cuda --impl triton \
    --json "$out/vllm_patches.json" > "$out/vllm_patches.txt" 2>&1
  echo "vllm_patch_check rc=$?" >> "$out/vllm_patches.txt"
else
  echo "vllm_patch_check skipped: vLLM does not import with $py" > "$out/vllm_patches.txt"
fi
left=$((budget - SECONDS)); [ "$left" -lt 30 ] && left=30
timeout "$left" "$py" -m loadtest.kernel_tools.bench_all --out "$out" > "$out/bench.txt" 2>&1
echo "bench_all rc=$?" >> "$out/bench.txt"
tail -n 6 "$out/pytest.txt"
tail -n 1 "$out/vllm_patches.txt"
tail -n 4 "$out/bench.txt"
