"""RoPE + paged KV-cache write: Triton against the reference, the reference against complex
rotation, and the cache left untouched outside the written slots."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch

import kernels
from kernels import reference
from tests.kernels._util import close, padded_view

pytestmark = pytest.mark.kernels

SENTINEL = -77.0


def _cos_sin(d: int, max_pos: int = 128) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # vLLM layout: cos | sin


def _case(t: int, hq: int, hk: int, d: int, bs: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    num_blocks = max(2, (t + bs - 1) // bs + 1)
    slots = torch.randperm(num_blocks * bs)[:t]
    slots[t // 2] = -1  # a padding token: nothing is written for it
    return {
        "positions": torch.randint(0, 128, (t,)),
        "q": torch.randn(t, hq, d).to(dtype),
        "k": torch.randn(t, hk, d).to(dtype),
        "v": torch.randn(t, hk, d).to(dtype),
        "cos_sin_cache": _cos_sin(d),
        "key_cache": torch.full((num_blocks, bs, hk, d), SENTINEL, dtype=dtype),
        "value_cache": torch.full((num_blocks, bs, hk, d), SENTINEL, dtype=dtype),
        "slot_mapping": slots,
    }


def _run(case: dict[str, torch.Tensor], impl: str, is_neox: bool) -> tuple[torch.Tensor, ...]:
    # Fresh caches per run; inputs as given (clone() would make strided views contiguous).
    c = dict(case, key_cache=case["key_cache"].clone(), value_cache=case["value_cache"].clone())
    q, k = kernels.rope_kv_write(**c, is_neox=is_neox, impl=impl)  # type: ignore[arg-type]
    return q, k, c["key_cache"], c["value_cache"]


@pytest.mark.parametrize(
    ("t", "hq", "hk", "d", "bs", "dtype", "is_neox"),
    [
        (1, 8, 2, 128, 16, torch.bfloat16, True),
        (9, 13, 1, 48, 16, torch.float16, False),
        (33, 4, 4, 96, 32, torch.bfloat16, True),
        (64, 8, 1, 48, 32, torch.float32, False),
    ],
)
def test_triton_matches_reference(
    t: int, hq: int, hk: int, d: int, bs: int, dtype: torch.dtype, is_neox: bool
) -> None:
    case = _case(t, hq, hk, d, bs, dtype)
    got = _run(case, "triton", is_neox)
    want = _run(case, "torch", is_neox)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        close(g, w)
    # Untouched slots keep the sentinel; the padding token wrote nothing.
    written = torch.zeros(case["key_cache"].shape[:2], dtype=torch.bool)
    live = case["slot_mapping"][case["slot_mapping"] >= 0]
    written.view(-1)[live] = True
    assert (got[2][~written] == SENTINEL).all() and (got[3][~written] == SENTINEL).all()
    assert (got[3][written] != SENTINEL).all()


@pytest.mark.parametrize("is_neox", [True, False])
def test_reference_is_a_complex_rotation(is_neox: bool) -> None:
    t, h, d = 5, 3, 48
    case = _case(t, h, h, d, 16, torch.float32)
    q_rot, _ = reference.rope_kv_write(**case, is_neox=is_neox)  # type: ignore[arg-type]
    pos = case["positions"].float()
    theta = torch.outer(pos, 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))
    q = case["q"]
    pairs = torch.stack(q.chunk(2, -1), -1) if is_neox else q.view(t, h, d // 2, 2)
    z = (
        torch.view_as_complex(pairs.contiguous())
        * torch.polar(torch.ones_like(theta), theta)[:, None]
    )
    rot = torch.view_as_real(z)
    want = torch.cat([rot[..., 0], rot[..., 1]], -1) if is_neox else rot.flatten(-2)
    close(q_rot, want)


def test_position_zero_is_identity_and_v_is_copied_exactly() -> None:
    case = _case(4, 2, 2, 96, 16, torch.bfloat16)
    case["positions"] = torch.zeros(4, dtype=torch.long)
    case["slot_mapping"] = torch.tensor([0, 5, 17, 31])
    q, k, kc, vc = _run(case, "triton", True)
    assert torch.equal(q, case["q"]) and torch.equal(k, case["k"])
    assert torch.equal(vc.view(-1, 2, 96)[case["slot_mapping"]], case["v"])
    assert torch.equal(kc.view(-1, 2, 96)[case["slot_mapping"]], case["k"])


def test_strided_inputs_and_read_masks() -> None:
    """q/k/v rows inside wider buffers whose extra lanes are NaN: never read."""
    t, hq, hk, d = 6, 13, 1, 48
    case = _case(t, hq, hk, d, 16, torch.float32)
    for name, h in (("q", hq), ("k", hk), ("v", hk)):
        view, _ = padded_view((t, h, d), 16, torch.float32, float("nan"))
        view.copy_(case[name])
        case[name] = view
    case["positions"] = case["positions"].repeat_interleave(2)[::2]  # stride 2
    case["slot_mapping"] = case["slot_mapping"].repeat_interleave(2)[::2]
    assert case["q"].stride(1) == 64 and case["positions"].stride(0) == 2
    got = _run(case, "triton", True)
    want = _run({k: v.contiguous() for k, v in case.items()}, "torch", True)
    for g, w in zip(got, want, strict=True):
        close(g, w)
    assert not any(x.isnan().any() for x in got)


def test_interleaved_cache_layout_views() -> None:
    """vLLM's FlashAttention layout [2, num_blocks, block_size, Hk, D]: caches as its views."""
    case = _case(5, 4, 2, 48, 16, torch.bfloat16)
    kv = torch.stack([case["key_cache"], case["value_cache"]])
    tri = dict(case, key_cache=kv[0], value_cache=kv[1])
    kernels.rope_kv_write(**tri, impl="triton")  # type: ignore[arg-type]
    _, _, kc, vc = _run(case, "torch", True)
    close(kv[0], kc)
    close(kv[1], vc)


def test_rejects_odd_head_dim() -> None:
    case = _case(2, 2, 2, 48, 16, torch.float32)
    case["cos_sin_cache"] = case["cos_sin_cache"][:, :46]
    for impl in ("torch", "triton"):
        with pytest.raises(ValueError):
            kernels.rope_kv_write(**case, impl=impl)  # type: ignore[arg-type]
