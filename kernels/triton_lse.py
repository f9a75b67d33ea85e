"""Triton LSE merge for DCP (decode context parallel): the full merge and the AG/RS correction.

Owns ``_lse_merge_kernel`` (N partial states -> one; also the all-to-all layout, whose packed
receive buffer is handed over as strided views) and ``_lse_correct_kernel`` (all-gather /
reduce-scatter layout: rescale this rank's output by its share). Semantics live in
``kernels.reference``; imports torch and triton, never vLLM.

Numerics: LSEs are read as fp32 and sanitised (NaN/±inf -> −inf, i.e. "no tokens"); the
weights ``base^(lse_n − max)`` and the sum are fp32, outputs are upcast to fp32 right after
the load, and the result is rounded once to the output dtype (fp8: ``clamp(x/scale, ±448)``).
A shard with weight 0 is masked out before the multiply, so garbage in an empty shard's
output (even NaN) cannot leak; non-finite output lanes count as 0. All-(−inf) heads give 0
and −inf. Base 2 uses exp2/log2 directly (FlashInfer's LSEs), base e exp/log (FlashAttention).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import reference
from kernels.launch import check_launchable, fp8_max, next_pow2


@triton.jit
def _sanitize(lse):
    # NaN and ±inf mean "no tokens on this shard" -> −inf.
    ok = (lse == lse) & (tl.abs(lse) < float("inf"))
    return tl.where(ok, lse, -float("inf"))


@triton.jit
def _lse_merge_kernel(
    out_ptr,  # [B, H, D] out dtype (bf16 | fp16 | fp32 | fp8e4m3), strides o_sb, o_sh, 1
    out_lse_ptr,  # [B, H] fp32, strides ol_sb, ol_sh (dummy when not RETURN_LSE)
    in_ptr,  # [N, B, H, D] any float dtype, strides i_sn, i_sb, i_sh, i_sd
    lse_ptr,  # [N, B, H] fp32, strides l_sn, l_sb, l_sh
    scale_ptr,  # [1] fp32 output scale (read only when OUT_FP8)
    H,
    N,  # ranks / splits (runtime: no recompilation per N; the tile is N_PAD)
    i_sn,
    i_sb,
    i_sh,
    i_sd,
    l_sn,
    l_sb,
    l_sh,
    o_sb,
    o_sh,
    ol_sb,
    ol_sh,
    D: tl.constexpr,
    N_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BASE_E: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    OUT_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    # One program per (token b, BLOCK_H heads): a [BLOCK_H, N_PAD, D_PAD] tile of the partial
    # outputs, so one program moves several KB even when N·D is small.
    pid = tl.program_id(0).to(tl.int64)
    h_blocks = tl.cdiv(H, BLOCK_H)
    b = pid // h_blocks
    h = (pid % h_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    n = tl.arange(0, N_PAD)
    d = tl.arange(0, D_PAD)
    h_ok = h < H
    lse_ptrs = lse_ptr + h[:, None] * l_sh + n[None, :] * l_sn + b * l_sb
    lse_mask = h_ok[:, None] & (n[None, :] < N)
    lse = tl.load(lse_ptrs, mask=lse_mask, other=-float("inf"))
    lse = _sanitize(lse.to(tl.float32))  # [BLOCK_H, N_PAD]
    m = tl.max(lse, axis=1)
    m_safe = tl.where(m == -float("inf"), 0.0, m)
    if BASE_E:
        w = tl.exp(lse - m_safe[:, None])
    else:
        w = tl.exp2(lse - m_safe[:, None])
    s = tl.sum(w, axis=1)  # [BLOCK_H]
    live = w > 0.0
    ptrs = (
        in_ptr
        + h[:, None, None] * i_sh
        + n[None, :, None] * i_sn
        + b * i_sb
        + d[None, None, :] * i_sd
    )
    # Shards with weight 0 (and padded heads / ranks) are not read at all; upcast after the load.
    o_mask = live[:, :, None] & (d[None, None, :] < D)
    o = tl.load(ptrs, mask=o_mask, other=0.0).to(tl.float32)
    o = tl.where((o == o) & (tl.abs(o) < float("inf")), o, 0.0)
    acc = tl.sum(o * w[:, :, None], axis=1)  # [BLOCK_H, D_PAD]
    s_safe = tl.where(s > 0.0, s, 1.0)  # all shards empty: acc is 0, so is the output
    res = acc / s_safe[:, None]
    if OUT_FP8:
        res = res * (1.0 / tl.load(scale_ptr))
        res = tl.minimum(tl.maximum(res, -FP8_MAX), FP8_MAX)
    out_ptrs = out_ptr + b * o_sb + h[:, None] * o_sh + d[None, :]
    out_mask = h_ok[:, None] & (d[None, :] < D)
    tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=out_mask)
    if RETURN_LSE:
        if BASE_E:
            g = m_safe + tl.log(s_safe)
        else:
            g = m_safe + tl.log2(s_safe)
        g = tl.where(s > 0.0, g, -float("inf"))
        tl.store(out_lse_ptr + b * ol_sb + h * ol_sh, g, mask=h_ok)


@triton.jit
def _lse_correct_kernel(
    out_ptr,  # [B, H, D] same dtype as x, contiguous (corrected local output)
    glse_ptr,  # [B, H] fp32, contiguous (merged LSE)
    x_ptr,  # [B, H, D] this rank's partial output, strides x_sb, x_sh, x_sd
    lse_ptr,  # [N, B, H] fp32 all-gathered LSEs, strides l_sn, l_sb, l_sh
    H,
    N,  # ranks (runtime)
    rank,
    x_sb,
    x_sh,
    x_sd,
    l_sn,
    l_sb,
    l_sh,
    D: tl.constexpr,
    N_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BASE_E: tl.constexpr,
):
    # One program per (b, h). out = x · base^(lse_rank − lse_global), 0 for an empty rank.
    pid = tl.program_id(0).to(tl.int64)
    b = pid // H
    h = pid % H
    n = tl.arange(0, N_PAD)
    d = tl.arange(0, D_PAD)
    lse = tl.load(lse_ptr + n * l_sn + b * l_sb + h * l_sh, mask=n < N, other=-float("inf"))
    lse = _sanitize(lse.to(tl.float32))
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == -float("inf"), 0.0, m)
    mine = _sanitize(tl.load(lse_ptr + rank * l_sn + b * l_sb + h * l_sh).to(tl.float32))
    if BASE_E:
        s = tl.sum(tl.exp(lse - m_safe), axis=0)
        s_safe = tl.where(s > 0.0, s, 1.0)
        scale = tl.exp(mine - m_safe) / s_safe
        g = m_safe + tl.log(s_safe)
    else:
        s = tl.sum(tl.exp2(lse - m_safe), axis=0)
        s_safe = tl.where(s > 0.0, s, 1.0)
        scale = tl.exp2(mine - m_safe) / s_safe
        g = m_safe + tl.log2(s_safe)
    live = mine > -float("inf")
    scale = tl.where(live, scale, 0.0)
    # An empty rank's output is not read (its lanes may hold garbage).
    d_end = tl.where(live, D, 0)
    x = tl.load(x_ptr + b * x_sb + h * x_sh + d * x_sd, mask=d < d_end, other=0.0)
    x = x.to(tl.float32)
    x = tl.where((x == x) & (tl.abs(x) < float("inf")), x, 0.0)
    tl.store(out_ptr + (b * H + h) * D + d, (x * scale).to(out_ptr.dtype.element_ty), mask=d < D)
    tl.store(glse_ptr + b * H + h, tl.where(s > 0.0, g, -float("inf")))


def _scale_tensor(out_scale: float | torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if out_scale is None:
        return torch.ones(1, dtype=torch.float32, device=device)
    return torch.as_tensor(out_scale, dtype=torch.float32, device=device).reshape(1)


def lse_merge(
    outputs: torch.Tensor,
    lses: torch.Tensor,
    *,
    base: str = "e",
    return_lse: bool = False,
    out_dtype: torch.dtype | None = None,
    out_scale: float | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher for :func:`kernels.reference.lse_merge` (any input strides).

    ``out`` [B,H,D] (unit stride on D) is written in place when given.
    """
    if outputs.dim() != 4 or lses.shape != outputs.shape[:3]:
        raise ValueError(f"want outputs [N,B,H,D], lses [N,B,H]; got {outputs.shape}, {lses.shape}")
    base_e = reference.check_base(base)
    check_launchable(_lse_merge_kernel, outputs, lses)
    n, b, h, d = outputs.shape
    out_dtype = out_dtype or outputs.dtype
    fp8 = out_dtype == torch.float8_e4m3fn
    if fp8 and out_scale is None:
        raise ValueError("an fp8 output needs out_scale")
    if lses.dtype != torch.float32:
        lses = lses.float()
    if out is None:
        out = torch.empty((b, h, d), dtype=out_dtype, device=outputs.device)
    elif out.shape != (b, h, d) or out.dtype != out_dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [B,H,D] {out_dtype} with unit stride on D")
    out_lse = torch.empty((b, h) if return_lse else (1, 1), dtype=torch.float32, device=lses.device)
    n_pad, d_pad = next_pow2(n), next_pow2(d)
    block_h = merge_block_h(h, n_pad, d_pad, outputs.element_size())
    if b * h:
        _lse_merge_kernel[(b * triton.cdiv(h, block_h),)](
            out,
            out_lse,
            outputs,
            lses,
            _scale_tensor(out_scale, outputs.device),
            h,
            n,
            *outputs.stride(),
            *lses.stride(),
            out.stride(0),
            out.stride(1),
            out_lse.stride(0),
            out_lse.stride(1),
            D=d,
            N_PAD=n_pad,
            D_PAD=d_pad,
            BLOCK_H=block_h,
            BASE_E=base_e,
            RETURN_LSE=return_lse,
            OUT_FP8=fp8,
            FP8_MAX=fp8_max(),
            num_warps=merge_num_warps(block_h * n_pad * d_pad),
        )
    return (out, out_lse) if return_lse else out


TILE_BYTES = 8192  # input bytes one merge program aims to read


def merge_block_h(h: int, n_pad: int, d_pad: int, elem_size: int) -> int:
    """Heads per merge program: ~``TILE_BYTES`` of input, a power of two in 1..16, ≤ H."""
    per_head = n_pad * d_pad * elem_size
    block = 1
    while block < 16 and block * 2 * per_head <= TILE_BYTES and block < h:
        block *= 2
    return block


def merge_num_warps(lanes: int) -> int:
    """Warps for a tile of ``lanes`` elements: one per 256, 1..8."""
    return max(1, min(8, lanes // 256))


def lse_correct(
    out: torch.Tensor, lses: torch.Tensor, rank: int, *, base: str = "e"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher for :func:`kernels.reference.lse_correct`."""
    if out.dim() != 3 or lses.dim() != 3 or lses.shape[1:] != out.shape[:2]:
        raise ValueError(f"want out [B,H,D], lses [N,B,H]; got {out.shape}, {lses.shape}")
    if not 0 <= rank < lses.shape[0]:
        raise ValueError(f"rank {rank} outside 0..{lses.shape[0] - 1}")
    base_e = reference.check_base(base)
    check_launchable(_lse_correct_kernel, out, lses)
    n = lses.shape[0]
    b, h, d = out.shape
    if lses.dtype != torch.float32:
        lses = lses.float()
    res = torch.empty((b, h, d), dtype=out.dtype, device=out.device)
    glse = torch.empty((b, h), dtype=torch.float32, device=out.device)
    if b * h:
        _lse_correct_kernel[(b * h,)](
            res,
            glse,
            out,
            lses,
            h,
            n,
            rank,
            *out.stride(),
            *lses.stride(),
            D=d,
            N_PAD=next_pow2(n),
            D_PAD=next_pow2(d),
            BASE_E=base_e,
            num_warps=merge_num_warps(next_pow2(n) * next_pow2(d)),
        )
    return res, glse
