"""Triton RoPE + paged KV-cache write for small-batch decode.

Owns ``_rope_kv_write_kernel``: one program per token rotates all its q and k heads (as
[heads, D/2] tiles, so cos/sin are read once per token), writes the rotated k and the v
row into the paged caches at ``slot_mapping[t]``, and returns rotated q and k — the rotary
op and ``reshape_and_cache`` of the unfused sequence in one launch. Semantics live in
``kernels.reference.rope_kv_write``.

Numerics: q, k, cos and sin upcast to fp32 after the load; ``x1·cos − x2·sin`` and
``x2·cos + x1·sin`` in fp32, one rounding to the output / cache dtype; v is copied exactly.
A negative slot (padding) writes nothing to the caches (masked store, not a branch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import check_launchable, next_pow2


@triton.jit
def _rotate_store(
    src_ptr,  # [T, Hx, D] row of token t: strides s_st, s_sh, unit lane stride
    dst_ptr,  # [T, Hx, D] contiguous rotated output
    cache_ptr,  # [num_blocks, block_size, Hx, D] (only when WRITE_CACHE), strides c_*
    t,
    cache_row,  # block · c_sb + offset · c_so for this token's slot (any value when skipped)
    write,  # scalar bool: the slot is valid
    cos,  # [HALF_PAD] fp32
    sin,  # [HALF_PAD] fp32
    HX,
    s_st,
    s_sh,
    c_sh,
    D: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HX_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
):
    half = D // 2
    h = tl.arange(0, HX_PAD)
    i = tl.arange(0, HALF_PAD)
    if IS_NEOX:
        first = i
        second = i + half
    else:
        first = 2 * i
        second = 2 * i + 1
    mask = (h[:, None] < HX) & (i[None, :] < half)
    row = src_ptr + t * s_st + h[:, None] * s_sh
    x1 = tl.load(row + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + second[None, :], mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    out = dst_ptr + (t * HX + h[:, None]) * D
    tl.store(out + first[None, :], o1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(out + second[None, :], o2.to(dst_ptr.dtype.element_ty), mask=mask)
    if WRITE_CACHE:
        h_end = tl.where(write, HX, 0)
        cmask = (h[:, None] < h_end) & (i[None, :] < half)
        crow = cache_ptr + cache_row + h[:, None] * c_sh
        tl.store(crow + first[None, :], o1.to(cache_ptr.dtype.element_ty), mask=cmask)
        tl.store(crow + second[None, :], o2.to(cache_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _rope_kv_write_kernel(
    q_out_ptr,  # [T, Hq, D] q dtype, contiguous
    k_out_ptr,  # [T, Hk, D] k dtype, contiguous
    q_ptr,  # [T, Hq, D] strides q_st, q_sh, 1
    k_ptr,  # [T, Hk, D] strides k_st, k_sh, 1
    v_ptr,  # [T, Hk, D] strides v_st, v_sh, 1
    pos_ptr,  # [T] int32/int64 positions
    cs_ptr,  # [max_pos, D] cos | sin, row stride cs_st, unit lane stride
    kc_ptr,  # [num_blocks, block_size, Hk, D] key cache, strides kc_sb, kc_so, kc_sh, 1
    vc_ptr,  # [num_blocks, block_size, Hk, D] value cache, strides vc_sb, vc_so, vc_sh, 1
    slot_ptr,  # [T] int32/int64 slot = block · block_size + offset; < 0 = padding
    HQ,
    HK,
    block_size,
    q_st,
    q_sh,
    k_st,
    k_sh,
    v_st,
    v_sh,
    cs_st,
    kc_sb,
    kc_so,
    kc_sh,
    vc_sb,
    vc_so,
    vc_sh,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HQ_PAD: tl.constexpr,
    HK_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    cmask = i < D // 2
    cos = tl.load(cs_ptr + pos * cs_st + i, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * cs_st + D // 2 + i, mask=cmask, other=0.0).to(tl.float32)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    write = slot >= 0
    slot_safe = tl.where(write, slot, 0)
    blk = slot_safe // block_size
    off = slot_safe % block_size
    _rotate_store(
        q_ptr, q_out_ptr, q_out_ptr, t, 0, write, cos, sin, HQ, q_st, q_sh, 0,
        D, HALF_PAD, HQ_PAD, IS_NEOX, False,
    )  # fmt: skip
    _rotate_store(
        k_ptr, k_out_ptr, kc_ptr, t, blk * kc_sb + off * kc_so, write, cos, sin, HK, k_st, k_sh,
        kc_sh, D, HALF_PAD, HK_PAD, IS_NEOX, True,
    )  # fmt: skip
    # v: a straight copy into its cache slot.
    h = tl.arange(0, HK_PAD)
    d = tl.arange(0, D_PAD)
    vmask = (h[:, None] < HK) & (d[None, :] < D)
    v = tl.load(v_ptr + t * v_st + h[:, None] * v_sh + d[None, :], mask=vmask, other=0.0)
    h_end = tl.where(write, HK, 0)
    wmask = (h[:, None] < h_end) & (d[None, :] < D)
    vdst = vc_ptr + blk * vc_sb + off * vc_so + h[:, None] * vc_sh + d[None, :]
    tl.store(vdst, v.to(vc_ptr.dtype.element_ty), mask=wmask)


def rope_kv_write(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher for :func:`kernels.reference.rope_kv_write`."""
    t, hq, d = q.shape
    hk = k.shape[1]
    if d % 2 or cos_sin_cache.shape[-1] != d or k.shape != (t, hk, d) or v.shape != k.shape:
        raise ValueError(f"shapes q {q.shape} k {k.shape} v {v.shape} cache {cos_sin_cache.shape}")
    if key_cache.shape[2:] != (hk, d) or value_cache.shape != key_cache.shape:
        raise ValueError(f"caches {key_cache.shape} / {value_cache.shape} do not fit k {k.shape}")
    tensors = (positions, q, k, v, cos_sin_cache, key_cache, value_cache, slot_mapping)
    check_launchable(_rope_kv_write_kernel, *tensors)
    q, k, v, cos_sin_cache = (
        x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, cos_sin_cache)
    )
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("caches need a unit stride on the head dim")
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hk, d), dtype=k.dtype, device=k.device)
    if t:
        _rope_kv_write_kernel[(t,)](
            q_out,
            k_out,
            q,
            k,
            v,
            positions,
            cos_sin_cache,
            key_cache,
            value_cache,
            slot_mapping,
            hq,
            hk,
            key_cache.shape[1],
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            cos_sin_cache.stride(0),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            value_cache.stride(0),
            value_cache.stride(1),
            value_cache.stride(2),
            D=d,
            D_PAD=next_pow2(d),
            HALF_PAD=next_pow2(d // 2),
            HQ_PAD=next_pow2(hq),
            HK_PAD=next_pow2(hk),
            IS_NEOX=is_neox,
            num_warps=4 if hq * d >= 4096 else 1,
        )
    return q_out, k_out
