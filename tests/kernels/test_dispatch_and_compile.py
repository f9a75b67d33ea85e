"""The dispatcher, the plugin-facing ``available()``, import hygiene, and every kernel
variant compiled for sm_90 (the interpreter accepts code the GPU compiler rejects)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

import torch

import kernels
from kernels import launch, reference, triton_lse
from tests.kernels._util import ON_CPU

pytestmark = pytest.mark.kernels

ROOT = Path(__file__).resolve().parents[2]


def test_auto_picks_the_reference_for_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("Triton path taken for CPU tensors")

    monkeypatch.setattr(triton_lse, "lse_merge", boom)
    outputs, lses = torch.randn(2, 1, 4, 48, device="cpu"), torch.randn(2, 1, 4, device="cpu")
    got = kernels.lse_merge(outputs, lses)  # impl="auto"
    torch.testing.assert_close(got, reference.lse_merge(outputs, lses))
    with pytest.raises(AssertionError, match="Triton path"):
        kernels.lse_merge(outputs, lses, impl="triton")


def test_triton_on_cpu_without_the_interpreter_is_refused() -> None:
    class JitLike:  # a kernel decorated without TRITON_INTERPRET
        pass

    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        launch.check_launchable(JitLike(), torch.zeros(1, device="cpu"))
    with pytest.raises(ValueError, match="devices"):
        cpu, meta = torch.zeros(1, device="cpu"), torch.zeros(1, device="meta")
        launch.check_launchable(JitLike(), cpu, meta)


def test_available_offers_settings_only_with_cuda() -> None:
    info = kernels.available()
    assert info["torch"] == torch.__version__ and info["triton"]
    assert info["cuda"] is torch.cuda.is_available()
    assert info["settings"] == (sorted(kernels.SETTINGS) if info["cuda"] else [])
    assert set(kernels.SETTINGS) == {
        "dcp_lse_merge",
        "fused_add_rmsnorm",
        "merge_attn_states",
        "rope_kv_write",
        "split_kv_decode",
    }


def test_interpreter_variable_does_not_leak_out_of_the_tier() -> None:
    assert os.environ.get("TRITON_INTERPRET") != "1"
    assert launch.is_interpreted(triton_lse._lse_merge_kernel) is ON_CPU


def test_importing_kernels_needs_no_torch() -> None:
    code = (
        "import sys, kernels; kernels.SETTINGS; assert 'torch' not in sys.modules; "
        "kernels.available(); assert 'triton' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_router_never_imports_torch() -> None:
    for path in (ROOT / "router").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            bad = [n for n in names if n.split(".")[0] in ("torch", "triton", "kernels")]
            assert not bad, f"{path} imports {bad}"


def test_every_kernel_variant_compiles_for_sm90(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.kernel_tools.compile_check", "--arch", "90"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in records if not r["ok"]]
    assert proc.returncode == 0 and not failed, failed or proc.stderr[-2000:]
    kinds = {r["variant"].split()[0] for r in records}
    assert kinds == {"lse_merge", "lse_correct", "rmsnorm_residual", "rope_kv_write",
                     "decode_partial"}  # fmt: skip
    assert all(r["cubin_bytes"] > 0 for r in records)


def test_gpu_bench_script_runs_end_to_end_in_smoke_mode(tmp_path: Path) -> None:
    """The kernel bench (loadtest.kernel_tools.bench_all) on CPU (interpreter, tiny shapes):
    every section is written."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest.kernel_tools.bench_all",
            "--smoke",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((tmp_path / "kernels_bench.json").read_text())
    assert results["lse_merge"] and results["fused"] and results["decode"]
    for row in results["lse_merge"]:
        assert all("ms" in row[k] for k in ("triton", "triton_packed", "triton_correct", "torch"))
    assert {r["piece"] for r in results["fused"]} == {"rmsnorm_residual", "rope_kv_write"}
    assert all("ms" in r["triton"] and "ms" in r["torch"] for r in results["fused"])
    assert all("ms" in r["triton"] for r in results["decode"])
    assert set(results["goals"]) >= {"lse_merge_goal_met", "fused_goal_met"}


def test_gpu_bench_script_refuses_without_cuda() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # hide a GPU if the host has one
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.kernel_tools.bench_all", "--out", "/nonexistent"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "no CUDA device" in proc.stdout
