"""Triton split-KV decode attention (GQA, paged KV cache) and its LSE combine.

Owns ``_decode_partial_kernel``: grid (B, Hk, S) — each program takes the whole query-head
group of one KV head (so every K/V tile is read once per group, not once per query head)
over the S-th slice of its sequence, walking the block table ``BLOCK_N`` tokens at a time
with an online softmax. The S partial states are then merged by ``triton_lse.lse_merge``.
Semantics live in ``kernels.reference.decode_attention``.

Numerics: scores and the online softmax are fp32 in base 2 (``scale·log2(e)`` folded into
q·k); the partial LSE is stored in base e. Dot operands are the cache dtype on GPU (bf16
tensor cores, fp32 accumulation; p is rounded to bf16 for p·V as FlashAttention does) and
fp32 under the interpreter (``DOT_F32``), where bf16 arithmetic is not trustworthy. Tokens
past the end of a split or sequence are masked to −inf before the max and to 0 for V, so a
page's stale lanes never count; an empty split stores output 0 and LSE −inf, which the
merge gives weight 0, and a sequence of length 0 comes out as 0 with LSE −inf.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import triton_lse
from kernels.launch import check_launchable, is_interpreted, next_pow2

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _decode_partial_kernel(
    o_ptr,  # [S, B, Hq, D_PAD] fp32 partial outputs, contiguous
    lse_ptr,  # [S, B, Hq] fp32 partial LSEs (base e), contiguous
    q_ptr,  # [B, Hq, D] strides q_sb, q_sh, 1
    kc_ptr,  # [num_blocks, block_size, Hk, D] strides kc_sb, kc_so, kc_sh, 1
    vc_ptr,  # [num_blocks, block_size, Hk, D] strides vc_sb, vc_so, vc_sh, 1
    bt_ptr,  # [B, max_blocks] int32 block table, row stride bt_sb
    sl_ptr,  # [B] int32 sequence lengths
    B,
    HQ,
    block_size,
    qk_scale,  # softmax scale · log2(e)
    q_sb,
    q_sh,
    kc_sb,
    kc_so,
    kc_sh,
    vc_sb,
    vc_so,
    vc_sh,
    bt_sb,
    num_splits,  # runtime: no recompilation per split count
    G: tl.constexpr,  # query heads per KV head
    G_PAD: tl.constexpr,  # ≥ 16 (tl.dot's smallest M)
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,  # tokens per step, ≥ 16
    DOT_F32: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(sl_ptr + b).to(tl.int64)
    # Split boundaries in whole BLOCK_N steps, so only the last step of a split is ragged.
    steps = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(steps, num_splits)
    start = split * per_split * BLOCK_N
    end = tl.minimum(start + per_split * BLOCK_N, seq_len)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    n = tl.arange(0, BLOCK_N)
    heads = hk * G + g
    g_ok = g < G
    d_ok = d < D
    q = tl.load(
        q_ptr + b * q_sb + heads[:, None] * q_sh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    if DOT_F32:
        q_dot = q
    else:
        q_dot = q.to(kc_ptr.dtype.element_ty)

    m_i = tl.full([G_PAD], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    for tok0 in range(start, end, BLOCK_N):
        tok = tok0 + n
        t_ok = tok < end
        page = tl.load(bt_ptr + b * bt_sb + tok // block_size, mask=t_ok, other=0).to(tl.int64)
        slot = tok % block_size
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(
            kc_ptr + page[:, None] * kc_sb + slot[:, None] * kc_so + hk * kc_sh + d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)
        v = tl.load(
            vc_ptr + page[:, None] * vc_sb + slot[:, None] * vc_so + hk * vc_sh + d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)
        if DOT_F32:
            s = tl.dot(q_dot, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q_dot, tl.trans(k.to(kc_ptr.dtype.element_ty)))
        s = tl.where(t_ok[None, :], s * qk_scale, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every step has a live token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_F32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(vc_ptr.dtype.element_ty), v.to(vc_ptr.dtype.element_ty))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    live = l_i > 0.0
    l_safe = tl.where(live, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(live, (m_i + tl.log2(l_safe)) * 0.6931471805599453, -float("inf"))
    row = (split * B + b) * HQ + heads
    tl.store(o_ptr + row[:, None] * D_PAD + d[None, :], out, mask=g_ok[:, None])
    tl.store(lse_ptr + row, lse, mask=g_ok)


TARGET_PROGRAMS = 4 * 132  # ~4 programs per SM on H100/H200 (132 SMs) to hide latency
MAX_SPLITS = 64


def default_num_splits(batch: int, kv_heads: int, max_seq_len: int, block_n: int) -> int:
    """Splits per sequence so that batch · kv_heads · splits ≈ ``TARGET_PROGRAMS``.

    At most ``MAX_SPLITS`` and never more than the BLOCK_N steps of the longest sequence.
    """
    steps = max(1, math.ceil(max_seq_len / block_n))
    want = max(1, math.ceil(TARGET_PROGRAMS / max(1, batch * kv_heads)))
    return int(min(MAX_SPLITS, steps, want))


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher for :func:`kernels.reference.decode_attention` (+ ``num_splits``)."""
    b, hq, d = q.shape
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape or key_cache.shape[3] != d:
        raise ValueError(f"caches {key_cache.shape} / {value_cache.shape} do not fit q {q.shape}")
    hk = key_cache.shape[2]
    if hq % hk:
        raise ValueError(f"Hq={hq} is not a multiple of Hk={hk}")
    check_launchable(_decode_partial_kernel, q, key_cache, value_cache, block_table, seq_lens)
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    seq_lens = seq_lens.contiguous()
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("caches need a unit stride on the head dim")
    interp = is_interpreted(_decode_partial_kernel)
    block_n = block_n or (16 if interp else 64)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two ≥ 16, got {block_n}")
    # The split count needs only a bound on the length (no device sync): the block table's
    # capacity. The kernel reads seq_lens itself.
    max_len = block_table.shape[1] * key_cache.shape[1]
    splits = num_splits or default_num_splits(b, hk, max_len, block_n)
    d_pad = max(16, next_pow2(d))
    part_o = torch.empty((splits, b, hq, d_pad), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((splits, b, hq), dtype=torch.float32, device=q.device)
    if b:
        _decode_partial_kernel[(b, hk, splits)](
            part_o,
            part_lse,
            q,
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            b,
            hq,
            key_cache.shape[1],
            (d**-0.5 if scale is None else scale) * LOG2E,
            q.stride(0),
            q.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            value_cache.stride(0),
            value_cache.stride(1),
            value_cache.stride(2),
            block_table.stride(0),
            splits,
            G=hq // hk,
            G_PAD=max(16, next_pow2(hq // hk)),
            D=d,
            D_PAD=d_pad,
            BLOCK_N=block_n,
            DOT_F32=interp or q.dtype == torch.float32,
            num_warps=4,
        )
    return triton_lse.lse_merge(
        part_o[..., :d], part_lse, base="e", return_lse=return_lse, out_dtype=q.dtype
    )
