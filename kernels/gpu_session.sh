#!/usr/bin/env bash
# One device call for issue 15's GPU checks, from the repo root of a CUDA host with torch,
# triton and pytest installed: the kernels tier with the *compiled* kernels on the GPU (the
# fp8 tests must pass there), then every benchmark (kernels/bench_all.py). ~5 min at most.
#   bash kernels/gpu_session.sh [OUT_DIR]     (default: $OUT, else out/kernels-gpu)
set -uo pipefail
out="${1:-${OUT:-out/kernels-gpu}}"
py="${PYTHON:-python3}"
mkdir -p "$out"
"$py" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'" || exit 2
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > "$out/gpu.txt" 2>&1
export KVROUTE_KERNELS_TEST_DEVICE=cuda TRITON_DEFAULT_FP_FUSION=1
timeout 120 "$py" -m pytest tests/kernels -q -p no:cacheprovider > "$out/pytest.txt" 2>&1
echo "pytest rc=$?" >> "$out/pytest.txt"
timeout 240 "$py" -m kernels.bench_all --out "$out" > "$out/bench.txt" 2>&1
echo "bench_all rc=$?" >> "$out/bench.txt"
tail -n 6 "$out/pytest.txt"
tail -n 4 "$out/bench.txt"
