"""Residual add + RMSNorm: Triton (one and two passes) against the reference and torch's own."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch

import kernels
from kernels import reference, triton_norm
from tests.kernels._util import FP8_CPU_XFAIL, FP8_ONE_ULP, close, padded_view

pytestmark = pytest.mark.kernels


def _inputs(t: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    x = torch.randn(t, k).to(dtype)
    residual = (torch.randn(t, k) * 4).to(dtype)
    weight = (1 + 0.1 * torch.randn(k)).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize(
    ("t", "k", "dtype", "block"),
    [
        (1, 256, torch.bfloat16, None),
        (7, 200, torch.float16, None),
        (64, 96, torch.bfloat16, None),
        (3, 200, torch.float32, 64),  # two passes, ragged last chunk
        (5, 1000, torch.bfloat16, 256),
    ],
)
def test_triton_matches_reference(t: int, k: int, dtype: torch.dtype, block: int | None) -> None:
    x, residual, weight = _inputs(t, k, dtype)
    got, got_res = triton_norm.rmsnorm_residual(x, residual, weight, 1e-6, block=block)
    want, want_res = kernels.rmsnorm_residual(x, residual, weight, 1e-6, impl="torch")
    assert got.dtype == dtype and got_res.dtype == dtype
    close(got_res, want_res)
    close(got, want)


def test_public_api_forces_triton_and_default_eps() -> None:
    x, residual, weight = _inputs(4, 128, torch.bfloat16)
    got = kernels.rmsnorm_residual(x, residual, weight, impl="triton")
    want = kernels.rmsnorm_residual(x, residual, weight, impl="torch")
    close(got[0], want[0])
    close(got[1], want[1])


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("block", [None, 64])
def test_in_place_like_vllms_fused_add_rms_norm(impl: str, block: int | None) -> None:
    """out=x, residual_out=residual: vLLM's in-place op (x <- normed, residual <- x + r)."""
    if impl == "torch" and block is not None:
        pytest.skip("block is a Triton tile")
    x, residual, weight = _inputs(3, 200, torch.bfloat16)
    want, want_res = kernels.rmsnorm_residual(x, residual, weight, 1e-6, impl="torch")
    if block is None:
        got = kernels.rmsnorm_residual(
            x, residual, weight, 1e-6, out=x, residual_out=residual, impl=impl
        )
    else:  # two passes: the second re-reads the residual it wrote, then overwrites x
        got = triton_norm.rmsnorm_residual(
            x, residual, weight, 1e-6, block=block, out=x, residual_out=residual
        )
    assert got[0] is x and got[1] is residual
    close(residual, want_res)
    close(x, want)


def test_reference_is_add_then_torch_rms_norm() -> None:
    x, residual, weight = _inputs(6, 200, torch.float32)
    normed, new_res = reference.rmsnorm_residual(x, residual, weight, 1e-5)
    close(new_res, x + residual)
    close(normed, torch.nn.functional.rms_norm(x + residual, (200,), weight, eps=1e-5))


def test_eps_matters_for_a_zero_row() -> None:
    x = torch.zeros(2, 64)
    residual = torch.zeros(2, 64)
    residual[1] = 1e-3
    weight = torch.ones(64)
    for impl in ("torch", "triton"):
        normed, _ = kernels.rmsnorm_residual(x, residual, weight, 1e-6, impl=impl)
        assert torch.equal(normed[0], torch.zeros(64))  # no NaN from 0/0
        close(normed[1], torch.full((64,), 1e-3 / (1e-6 + 1e-6) ** 0.5))


def test_non_contiguous_rows_and_masks() -> None:
    """x / residual rows with a NaN tail (never read); outputs with a sentinel tail (never
    written); residual updated in place, as vLLM's fused op does."""
    t, k = 5, 200
    x, x_buf = padded_view((t, k), 56, torch.bfloat16, float("nan"))
    x.copy_(torch.randn(t, k))
    residual, _ = padded_view((t, k), 8, torch.bfloat16, float("nan"))
    residual.copy_(torch.randn(t, k))
    weight = torch.randn(k).to(torch.bfloat16)
    want, want_res = reference.rmsnorm_residual(x, residual, weight)
    out, out_buf = padded_view((t, k), 56, torch.bfloat16, 3.0)
    for block in (None, 64):
        res = residual.clone()
        normed, new_res = triton_norm.rmsnorm_residual(
            x, res, weight, block=block, out=out, residual_out=res
        )
        assert new_res is res and normed is out
        close(res, want_res)
        close(out, want)
        assert torch.equal(out_buf[:, k:].float(), torch.full((t, 56), 3.0))
    assert x_buf[:, k:].isnan().all()


def test_rejects_mismatched_shapes() -> None:
    x, residual, weight = _inputs(2, 64, torch.float32)
    for impl in ("torch", "triton"):
        with pytest.raises(ValueError, match="shapes"):
            kernels.rmsnorm_residual(x, residual[:, :32], weight, impl=impl)


def test_fp8_reference_quantises_with_scale() -> None:
    x, residual, weight = _inputs(3, 64, torch.bfloat16)
    q, _ = reference.rmsnorm_residual(x, residual, weight, quant_scale=0.05)
    normed, _ = reference.rmsnorm_residual(x, residual, weight)
    assert q.dtype == torch.float8_e4m3fn
    want = (normed.float() / 0.05).clamp(-448, 448)
    torch.testing.assert_close(q.float(), want, atol=0, rtol=0.07)


@FP8_CPU_XFAIL
@pytest.mark.parametrize("block", [None, 64])
def test_fp8_output(block: int | None) -> None:
    x, residual, weight = _inputs(4, 200, torch.bfloat16)
    scale = torch.tensor(0.01)
    got, got_res = triton_norm.rmsnorm_residual(x, residual, weight, quant_scale=scale, block=block)
    want, want_res = reference.rmsnorm_residual(x, residual, weight, quant_scale=scale)
    assert got.dtype == torch.float8_e4m3fn
    close(got_res, want_res)
    torch.testing.assert_close(got.float(), want.float(), **FP8_ONE_ULP)
