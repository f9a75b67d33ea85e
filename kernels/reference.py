"""Plain torch references for every kernel in this package (the CPU path and the test oracle).

Owns the semantics: each Triton kernel in ``kernels/`` must agree with the function of the
same name here. Pure torch, no Triton, no vLLM. Everything is computed in fp32 and rounded
once to the output dtype.
"""

from __future__ import annotations

import math

import torch

FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def check_base(base: str) -> bool:
    """``True`` for base e, ``False`` for base 2; anything else is an error."""
    if base not in ("e", "2"):
        raise ValueError(f"base must be 'e' or '2', got {base!r}")
    return base == "e"


def sanitize_lse(lses: torch.Tensor) -> torch.Tensor:
    """NaN and ±inf LSEs mean "this shard saw no tokens": map them to −inf (vLLM's rule)."""
    lses = lses.float()
    return torch.where(torch.isfinite(lses), lses, torch.full_like(lses, -math.inf))


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _cast_out(
    x: torch.Tensor, out_dtype: torch.dtype, out_scale: float | torch.Tensor | None
) -> torch.Tensor:
    if out_dtype == torch.float8_e4m3fn:
        if out_scale is None:
            raise ValueError("an fp8 output needs out_scale")
        inv = 1.0 / torch.as_tensor(out_scale, dtype=torch.float32, device=x.device)
        return (x * inv).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(out_dtype)
    return x.to(out_dtype)


def _merge_weights(lses: torch.Tensor, base_e: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Unnormalised weights [N, ...] and the merged LSE [...] (−inf where all are −inf)."""
    lses = sanitize_lse(lses)
    m = lses.max(dim=0).values
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    centered = lses - m_safe.unsqueeze(0)
    w = torch.exp(centered) if base_e else torch.exp2(centered)
    s = w.sum(dim=0)
    lse = torch.where(
        s > 0,
        m_safe + (torch.log(s) if base_e else torch.log2(s)),
        torch.full_like(s, -math.inf),
    )
    return w, lse


def lse_merge(
    outputs: torch.Tensor,
    lses: torch.Tensor,
    *,
    base: str = "e",
    return_lse: bool = False,
    out_dtype: torch.dtype | None = None,
    out_scale: float | torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Merge N partial attention states: outputs [N,B,H,D], lses [N,B,H] -> out [B,H,D].

    ``out = Σ_n w_n·o_n / Σ_n w_n`` with ``w_n = base^(lse_n − max lse)``; the merged LSE is
    ``max + log_base(Σ w_n)``. A shard whose LSE is not finite has weight 0 and its output
    is never read into the sum (it may hold garbage); non-finite output values of a shard
    with weight > 0 count as 0 (as vLLM's all-reduce path does), so no NaN escapes. A head
    with every LSE −inf gives output 0 and LSE −inf.
    """
    if outputs.dim() != 4 or lses.shape != outputs.shape[:3]:
        raise ValueError(f"want outputs [N,B,H,D], lses [N,B,H]; got {outputs.shape}, {lses.shape}")
    w, lse = _merge_weights(lses, check_base(base))
    s = w.sum(dim=0)
    contrib = torch.where((w > 0).unsqueeze(-1), w.unsqueeze(-1) * _finite_or_zero(outputs), 0.0)
    acc = contrib.sum(dim=0)
    out = torch.where((s > 0).unsqueeze(-1), acc / s.clamp_min(1e-30).unsqueeze(-1), 0.0)
    out = _cast_out(out, out_dtype or outputs.dtype, out_scale)
    return (out, lse) if return_lse else out


def lse_correct(
    out: torch.Tensor, lses: torch.Tensor, rank: int, *, base: str = "e"
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather/reduce-scatter layout: this rank's share of the merged output.

    ``out`` [B,H,D] is this rank's partial output, ``lses`` [N,B,H] every rank's LSE (after
    the all-gather). Returns ``(out · base^(lse_rank − lse_global), lse_global)``: summing
    the first over ranks (the reduce-scatter) gives :func:`lse_merge`'s output.
    """
    if out.dim() != 3 or lses.dim() != 3 or lses.shape[1:] != out.shape[:2]:
        raise ValueError(f"want out [B,H,D], lses [N,B,H]; got {out.shape}, {lses.shape}")
    if not 0 <= rank < lses.shape[0]:
        raise ValueError(f"rank {rank} outside 0..{lses.shape[0] - 1}")
    base_e = check_base(base)
    _, glse = _merge_weights(lses, base_e)
    mine = sanitize_lse(lses[rank])
    g_safe = torch.where(torch.isfinite(glse), glse, torch.zeros_like(glse))
    diff = mine - g_safe
    scale = torch.exp(diff) if base_e else torch.exp2(diff)
    scale = torch.where(torch.isfinite(mine), scale, torch.zeros_like(scale))
    corrected = torch.where(
        (scale > 0).unsqueeze(-1), _finite_or_zero(out) * scale.unsqueeze(-1), 0.0
    )
    return corrected.to(out.dtype), glse


def a2a_pack_dim(dtype: torch.dtype) -> int:
    """Lanes of ``dtype`` that hold one fp32 LSE in the packed all-to-all buffer."""
    size = torch.empty((), dtype=dtype).element_size()
    if size not in (2, 4):
        raise ValueError(f"cannot pack an fp32 LSE into {dtype}")
    return 4 // size


def a2a_pack(out: torch.Tensor, lse: torch.Tensor, world_size: int) -> torch.Tensor:
    """Pack [B,H,D] output and [B,H] fp32 LSE into the all-to-all send buffer.

    Returns [N, B, H/N, D + pack]: slot n holds heads ``n·H/N … (n+1)·H/N − 1`` (the rank
    that will own them), the fp32 LSE's little-endian bytes in the last ``pack`` lanes —
    byte-identical to vLLM's ``_dcp_a2a_pack_send``.
    """
    b, h, d = out.shape
    if h % world_size:
        raise ValueError(f"H={h} is not divisible by world size {world_size}")
    hl, pack = h // world_size, a2a_pack_dim(out.dtype)
    buf = torch.empty((world_size, b, hl, d + pack), dtype=out.dtype, device=out.device)
    buf[..., :d] = out.view(b, world_size, hl, d).permute(1, 0, 2, 3)
    lanes = lse.float().contiguous().view(torch.int32).view(out.dtype if pack == 1 else torch.int16)
    lanes = lanes.view(b, world_size, hl, pack).permute(1, 0, 2, 3)
    buf.view(torch.int16 if pack == 2 else out.dtype)[..., d:] = lanes
    return buf


def a2a_unpack(recv: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (no copy when possible) of a packed buffer: outputs [N,B,Hl,D], lses [N,B,Hl]."""
    pack = recv.shape[-1] - head_dim
    if pack != a2a_pack_dim(recv.dtype):
        raise ValueError(f"last dim {recv.shape[-1]} is not head_dim + {a2a_pack_dim(recv.dtype)}")
    if recv.stride(-1) != 1:
        recv = recv.contiguous()
    tail = recv[..., head_dim:]
    try:
        lses = tail.view(torch.float32)[..., 0]
    except RuntimeError:  # odd head_dim with 16-bit lanes: the fp32 is not 4-byte aligned
        lses = tail.contiguous().view(torch.float32)[..., 0]
    return recv[..., :head_dim], lses


def rmsnorm_residual(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    quant_scale: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm over the last dim: x, residual [T, K], weight [K].

    ``new_residual = round(x + residual)`` (fp32 add, one rounding to x's dtype);
    ``normed = round(new_residual · rsqrt(mean(new_residual²) + eps) · weight)`` computed
    in fp32 from the rounded residual (what the next layer sees). With ``quant_scale`` the
    normed output is fp8 e4m3: ``clamp(normed_fp32 / scale, ±448)``.
    """
    if x.shape != residual.shape or weight.shape != x.shape[-1:]:
        raise ValueError(f"shapes x {x.shape}, residual {residual.shape}, weight {weight.shape}")
    z = (x.float() + residual.float()).to(x.dtype)
    zf = z.float()
    rms = torch.rsqrt(zf.pow(2).mean(dim=-1, keepdim=True) + eps)
    normed = zf * rms * weight.float()
    out_dtype = torch.float8_e4m3fn if quant_scale is not None else x.dtype
    return _cast_out(normed, out_dtype, quant_scale), z


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """x [T, H, D] fp32, cos/sin [T, D/2] -> rotated x."""
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    if is_neox:
        return torch.cat([o1, o2], dim=-1)
    return torch.stack([o1, o2], dim=-1).flatten(-2)


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
    """RoPE on q [T,Hq,D] and k [T,Hk,D], then k and v written to the paged cache.

    ``cos_sin_cache`` [max_pos, D] is vLLM's layout (cos in the first D/2 lanes, sin in the
    last); NeoX style rotates the two halves, GPT-J style adjacent pairs. The caches are
    [num_blocks, block_size, Hk, D]; token t goes to slot ``slot_mapping[t]`` = block ·
    block_size + offset, and a negative slot (padding) writes nothing. Returns the rotated
    (q, k) in their dtypes; the caches are written in place.
    """
    d = q.shape[-1]
    if d % 2 or cos_sin_cache.shape[-1] != d:
        raise ValueError(f"head dim {d} must be even and match cos_sin_cache {cos_sin_cache.shape}")
    cs = cos_sin_cache.float()[positions.long()]
    cos, sin = cs[:, : d // 2], cs[:, d // 2 :]
    q_rot = _rotate(q.float(), cos, sin, is_neox).to(q.dtype)
    k_rot = _rotate(k.float(), cos, sin, is_neox).to(k.dtype)
    bs = key_cache.shape[1]
    slots = slot_mapping.long()
    keep = slots >= 0
    blk, off = slots[keep] // bs, slots[keep] % bs
    key_cache[blk, off] = k_rot[keep].to(key_cache.dtype)
    value_cache[blk, off] = v[keep].to(value_cache.dtype)
    return q_rot, k_rot


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One query token per sequence over a paged KV cache, GQA.

    q [B, Hq, D]; caches [num_blocks, block_size, Hk, D] with Hq a multiple of Hk (query
    head h reads KV head h // (Hq/Hk)); block_table [B, max_blocks]; seq_lens [B]. Softmax
    in fp32. A sequence of length 0 gives output 0 and LSE −inf. LSE is base e.
    """
    b, hq, d = q.shape
    bs, hk = key_cache.shape[1], key_cache.shape[2]
    if hq % hk:
        raise ValueError(f"Hq={hq} is not a multiple of Hk={hk}")
    scale = d**-0.5 if scale is None else scale
    out = torch.zeros((b, hq, d), dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq), -math.inf, dtype=torch.float32, device=q.device)
    for i in range(b):
        n = int(seq_lens[i])
        if n == 0:
            continue
        tok = torch.arange(n, device=q.device)
        blocks = block_table[i, tok // bs].long()
        kk = key_cache[blocks, tok % bs].float().repeat_interleave(hq // hk, dim=1)  # [n,Hq,D]
        vv = value_cache[blocks, tok % bs].float().repeat_interleave(hq // hk, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), kk) * scale
        lse[i] = torch.logsumexp(s, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), vv)
    o = out.to(q.dtype)
    return (o, lse) if return_lse else o
