"""Triton residual add + RMSNorm (+ static fp8 quantisation) for small-batch decode.

Owns ``_rmsnorm_residual_kernel``: one program per row reads x and residual once, writes
the new residual and the normed row — the two launches (add, norm) of the unfused torch
sequence in one. Semantics live in ``kernels.reference.rmsnorm_residual``.

Numerics: x + residual in fp32, rounded once to x's dtype (the new residual); the sum of
squares, rsqrt and the weight multiply are fp32 and read the *rounded* residual (what the
next layer sees), so both outputs agree with a model that stores the residual in bf16.
fp8: ``clamp(normed / scale, ±448)`` then one cast. Rows longer than ``BLOCK`` take two
passes (the second re-reads the residual it just wrote); shorter rows stay in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import check_launchable, fp8_max, next_pow2

MAX_BLOCK = 8192  # lanes kept in registers per row; longer rows loop in chunks


@triton.jit
def _rmsnorm_residual_kernel(
    out_ptr,  # [T, K] x dtype or fp8e4m3, row stride o_st, unit lane stride
    res_out_ptr,  # [T, K] x dtype (new residual), row stride ro_st, unit lane stride
    x_ptr,  # [T, K] row stride x_st, unit lane stride
    res_ptr,  # [T, K] row stride r_st, unit lane stride
    w_ptr,  # [K] weight, contiguous
    scale_ptr,  # [1] fp32 quantisation scale (read only when OUT_FP8)
    K,
    x_st,
    r_st,
    o_st,
    ro_st,
    eps,
    BLOCK: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    OUT_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if SINGLE_PASS:
        mask = offs < K
        x = tl.load(x_ptr + row * x_st + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(res_ptr + row * r_st + offs, mask=mask, other=0.0).to(tl.float32)
        z = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * ro_st + offs, z, mask=mask)
        zf = z.to(tl.float32)
        inv = tl.rsqrt(tl.sum(zf * zf, axis=0) / K + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = zf * inv * w
        if OUT_FP8:
            y = tl.minimum(tl.maximum(y * (1.0 / tl.load(scale_ptr)), -FP8_MAX), FP8_MAX)
        tl.store(out_ptr + row * o_st + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        sq = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, K, BLOCK):
            mask = start + offs < K
            x = tl.load(x_ptr + row * x_st + start + offs, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(res_ptr + row * r_st + start + offs, mask=mask, other=0.0)
            z = (x + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * ro_st + start + offs, z, mask=mask)
            zf = z.to(tl.float32)
            sq += zf * zf
        inv = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        inv_scale = 1.0 / tl.load(scale_ptr)  # a valid [1] tensor even without fp8
        for start in range(0, K, BLOCK):
            mask = start + offs < K
            zf = tl.load(res_out_ptr + row * ro_st + start + offs, mask=mask, other=0.0)
            w = tl.load(w_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
            y = zf.to(tl.float32) * inv * w
            if OUT_FP8:
                y = tl.minimum(tl.maximum(y * inv_scale, -FP8_MAX), FP8_MAX)
            tl.store(out_ptr + row * o_st + start + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def num_warps_for(block: int) -> int:
    """Warps per row: one per 512 lanes, 1..16."""
    return max(1, min(16, block // 512))


def rmsnorm_residual(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    quant_scale: float | torch.Tensor | None = None,
    block: int | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher for :func:`kernels.reference.rmsnorm_residual` (2-D inputs).

    ``block`` overrides the lane tile (tests use it to reach the two-pass path); ``out`` and
    ``residual_out`` [T, K] (unit lane stride) are written in place when given —
    ``residual_out=residual`` updates the residual stream in place, as vLLM's op does.
    """
    if x.dim() != 2 or x.shape != residual.shape or weight.shape != x.shape[-1:]:
        raise ValueError(f"shapes x {x.shape}, residual {residual.shape}, weight {weight.shape}")
    check_launchable(_rmsnorm_residual_kernel, x, residual, weight)
    t, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual.stride(-1) != 1:
        residual = residual.contiguous()
    weight = weight.contiguous()
    fp8 = quant_scale is not None
    out_dtype = torch.float8_e4m3fn if fp8 else x.dtype
    if out is None:
        out = torch.empty((t, k), dtype=out_dtype, device=x.device)
    new_res = (
        torch.empty((t, k), dtype=x.dtype, device=x.device)
        if residual_out is None
        else residual_out
    )
    for name, buf, dt in (("out", out, out_dtype), ("residual_out", new_res, x.dtype)):
        if buf.shape != (t, k) or buf.dtype != dt or buf.stride(-1) != 1:
            raise ValueError(f"{name} must be [T, K] {dt} with unit lane stride")
    scale = torch.as_tensor(1.0 if quant_scale is None else quant_scale, dtype=torch.float32)
    blk = block or min(next_pow2(k), MAX_BLOCK)
    if t:
        _rmsnorm_residual_kernel[(t,)](
            out,
            new_res,
            x,
            residual,
            weight,
            scale.to(x.device).reshape(1),
            k,
            x.stride(0),
            residual.stride(0),
            out.stride(0),
            new_res.stride(0),
            float(eps),
            BLOCK=blk,
            SINGLE_PASS=blk >= k,
            OUT_FP8=fp8,
            FP8_MAX=fp8_max(),
            num_warps=num_warps_for(blk),
        )
    return out, new_res
