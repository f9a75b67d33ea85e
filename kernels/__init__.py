"""Triton kernels for agentic decode on NVIDIA GPUs, each beside its torch reference.

Public API (this module): ``lse_merge``, ``lse_merge_packed``, ``lse_correct``,
``a2a_pack``, ``rmsnorm_residual``, ``rope_kv_write``, ``decode_attention``, and
``available()`` / ``SETTINGS`` for the engine plugin. Each kernel function takes
``impl="auto" | "triton" | "torch"``: auto picks Triton when every tensor is on CUDA and
Triton imports, the torch reference otherwise; "triton" forces the kernel (on CPU tensors
only under ``TRITON_INTERPRET=1`` set before first use); "torch" forces the reference.

Importing this package needs neither torch nor triton: implementations load on first use.
The router never imports this package. See docs/kernels.md for the numerics of each kernel.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "SETTINGS",
    "a2a_pack",
    "available",
    "decode_attention",
    "lse_correct",
    "lse_merge",
    "lse_merge_packed",
    "rmsnorm_residual",
    "rope_kv_write",
]

_IMPLS = ("auto", "triton", "torch")

# Opt-in engine settings the plugin may expose on GPU hosts (never on CPU): name -> what it
# replaces. ``available()["settings"]`` lists the ones this host can honour. The plugin
# installs dcp_lse_merge, merge_attn_states and fused_add_rmsnorm (KVROUTE_KERNELS,
# engine_patches/kernel_patches.py); rope_kv_write and split_kv_decode have no single vLLM
# function to replace and are refused there.
SETTINGS: dict[str, str] = {
    "dcp_lse_merge": (
        "DCP combine: lse_correct for the ag_rs backend (before the reduce-scatter), "
        "lse_merge_packed for the a2a backend (after the all-to-all)"
    ),
    "fused_add_rmsnorm": "residual add + RMSNorm (+ static fp8 quantisation) in one launch",
    "merge_attn_states": (
        "prefix/suffix attention-state merge (chunked prefill over cached context): "
        "lse_merge over the two states"
    ),
    "rope_kv_write": "RoPE on q/k + paged KV-cache write in one launch",
    "split_kv_decode": "split-KV GQA decode attention over the paged cache + its LSE combine",
}


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def available() -> dict[str, Any]:
    """What this host can run: versions, CUDA, and which opt-in ``SETTINGS`` apply here.

    ``{"torch": str | None, "triton": str | None, "cuda": bool, "interpreter": bool,
    "settings": [names]}`` — settings is empty unless torch sees a CUDA device and Triton
    imports, so a CPU host never offers them.
    """
    info: dict[str, Any] = {
        "torch": None,
        "triton": None,
        "cuda": False,
        "interpreter": False,
        "settings": [],
    }
    if _has("torch"):
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = bool(torch.cuda.is_available())
    if _has("triton"):
        import importlib.metadata
        import os

        # The version without importing triton: an import decorates Triton's own helpers
        # for the current TRITON_INTERPRET, which must stay the caller's choice.
        info["triton"] = importlib.metadata.version("triton")
        info["interpreter"] = os.environ.get("TRITON_INTERPRET") == "1"
    if info["cuda"] and info["triton"]:
        info["settings"] = sorted(SETTINGS)
    return info


def _use_triton(impl: str, *tensors: torch.Tensor) -> bool:
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "torch":
        return False
    if impl == "triton":
        return True
    return all(t.is_cuda for t in tensors) and _has("triton")


def _triton(module: str) -> Any:
    return importlib.import_module(f"kernels.{module}")


def _reference() -> Any:
    return importlib.import_module("kernels.reference")


def lse_merge(
    outputs: torch.Tensor,
    lses: torch.Tensor,
    *,
    base: str = "e",
    return_lse: bool = False,
    out_dtype: torch.dtype | None = None,
    out_scale: float | torch.Tensor | None = None,
    impl: str = "auto",
) -> Any:
    """Merge partial attention states: outputs [N,B,H,D], lses [N,B,H] fp32 -> out [B,H,D].

    Returns ``out`` (in ``out_dtype``, default the outputs' dtype; fp8 e4m3 needs
    ``out_scale``), or ``(out, lse [B,H] fp32)`` with ``return_lse``. ``base`` is "e"
    (FlashAttention LSEs) or "2" (FlashInfer); the merged LSE is in the same base.
    """
    mod = _triton("triton_lse") if _use_triton(impl, outputs, lses) else _reference()
    return mod.lse_merge(
        outputs, lses, base=base, return_lse=return_lse, out_dtype=out_dtype, out_scale=out_scale
    )


def lse_merge_packed(
    recv: torch.Tensor,
    head_dim: int,
    *,
    base: str = "e",
    return_lse: bool = False,
    out_dtype: torch.dtype | None = None,
    out_scale: float | torch.Tensor | None = None,
    impl: str = "auto",
) -> Any:
    """All-to-all layout: merge the receive buffer [N,B,H/N,D+pack] -> out [B,H/N,D].

    The buffer is what ``a2a_pack`` (or vLLM's ``_dcp_a2a_pack_send``) builds and one
    ``all_to_all_single`` delivers: outputs in the first D lanes, the fp32 LSE's bytes in
    the last ``pack`` lanes (2 for 16-bit outputs, 1 for fp32). Unpacking is a strided view,
    so the merge reads the buffer once.
    """
    outputs, lses = _reference().a2a_unpack(recv, head_dim)
    return lse_merge(
        outputs,
        lses,
        base=base,
        return_lse=return_lse,
        out_dtype=out_dtype,
        out_scale=out_scale,
        impl=impl,
    )


def a2a_pack(out: torch.Tensor, lse: torch.Tensor, world_size: int) -> torch.Tensor:
    """Send buffer [N,B,H/N,D+pack] for the all-to-all from out [B,H,D] and lse [B,H] fp32."""
    result: torch.Tensor = _reference().a2a_pack(out, lse, world_size)
    return result


def lse_correct(
    out: torch.Tensor,
    lses: torch.Tensor,
    rank: int,
    *,
    base: str = "e",
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather/reduce-scatter layout: ``(out · base^(lse_rank − lse), lse)``.

    ``out`` [B,H,D] is this rank's partial output, ``lses`` [N,B,H] the all-gathered LSEs.
    Reduce-scatter (sum) the first result over ranks along H to get the merged heads.
    """
    mod = _triton("triton_lse") if _use_triton(impl, out, lses) else _reference()
    result: tuple[torch.Tensor, torch.Tensor] = mod.lse_correct(out, lses, rank, base=base)
    return result


def rmsnorm_residual(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    quant_scale: float | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, new_residual)`` for x, residual [T, K] and weight [K], both in x's dtype.

    ``new_residual = x + residual``; ``normed = RMSNorm(new_residual) · weight``. With
    ``quant_scale`` the normed output is fp8 e4m3 (static per-tensor scale). ``out`` /
    ``residual_out`` ([T, K], unit lane stride) receive the results in place and are
    returned; ``out=x, residual_out=residual`` is vLLM's in-place ``fused_add_rms_norm``
    (the Triton kernel reads each row before writing it, so the aliasing is safe).
    """
    tensors = (x, residual, weight)
    if _use_triton(impl, *tensors):
        result: tuple[torch.Tensor, torch.Tensor] = _triton("triton_norm").rmsnorm_residual(
            x, residual, weight, eps, quant_scale=quant_scale, out=out, residual_out=residual_out
        )
        return result
    normed, new_res = _reference().rmsnorm_residual(
        x, residual, weight, eps, quant_scale=quant_scale
    )
    if out is not None:
        out.copy_(normed)
        normed = out
    if residual_out is not None:
        residual_out.copy_(new_res)
        new_res = residual_out
    return normed, new_res


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
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [T,Hq,D], k [T,Hk,D], then write k, v into the paged caches in place.

    Caches are [num_blocks, block_size, Hk, D]; ``slot_mapping`` [T] (negative = padding,
    not written). Returns the rotated ``(q, k)``.
    """
    tensors = (positions, q, k, v, cos_sin_cache, key_cache, value_cache, slot_mapping)
    mod = _triton("triton_rope") if _use_triton(impl, *tensors) else _reference()
    result: tuple[torch.Tensor, torch.Tensor] = mod.rope_kv_write(
        positions, q, k, v, cos_sin_cache, key_cache, value_cache, slot_mapping, is_neox=is_neox
    )
    return result


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
    impl: str = "auto",
) -> Any:
    """Split-KV GQA decode attention over a paged cache, combined with ``lse_merge``.

    q [B,Hq,D], caches [num_blocks, block_size, Hk, D], block_table [B, max_blocks] int32,
    seq_lens [B] int32 -> out [B,Hq,D] in q's dtype (and lse [B,Hq] fp32, base e).
    ``num_splits`` (Triton only) is how many KV splits each sequence is cut into.
    """
    tensors = (q, key_cache, value_cache, block_table, seq_lens)
    if _use_triton(impl, *tensors):
        return _triton("triton_decode").decode_attention(
            q,
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            scale=scale,
            return_lse=return_lse,
            num_splits=num_splits,
        )
    return _reference().decode_attention(
        q, key_cache, value_cache, block_table, seq_lens, scale=scale, return_lse=return_lse
    )
