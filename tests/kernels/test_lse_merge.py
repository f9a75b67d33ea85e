"""LSE merge: the Triton kernel against the torch reference, vLLM's own combine, and by hand."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("triton")

import torch
import triton

import kernels
from kernels import reference, triton_lse
from tests.kernels._util import FP8_CPU_XFAIL, FP8_ONE_ULP, close, padded_view, vllm_function

pytestmark = pytest.mark.kernels

INF = math.inf


def _inputs(n: int, b: int, h: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    outputs = torch.randn(n, b, h, d).to(dtype)
    lses = torch.randn(n, b, h) * 4.0
    return outputs, lses


@pytest.mark.parametrize(
    ("n", "h", "d", "dtype", "base"),
    [
        (1, 13, 48, torch.bfloat16, "e"),
        (2, 13, 96, torch.float16, "2"),
        (4, 13, 128, torch.bfloat16, "2"),
        (8, 5, 48, torch.float32, "e"),
        (8, 13, 96, torch.bfloat16, "e"),
        (3, 4, 128, torch.float32, "2"),
    ],
)
def test_triton_matches_reference(n: int, h: int, d: int, dtype: torch.dtype, base: str) -> None:
    outputs, lses = _inputs(n, 3, h, d, dtype)
    got, got_lse = kernels.lse_merge(outputs, lses, base=base, return_lse=True, impl="triton")
    want, want_lse = kernels.lse_merge(outputs, lses, base=base, return_lse=True, impl="torch")
    assert got.dtype == dtype and got.shape == (3, h, d)
    close(got, want)
    close(got_lse, want_lse)


def test_reference_by_hand() -> None:
    """Two shards, one head: out = (e^1·o0 + e^2·o1) / (e^1 + e^2), lse = log(e^1 + e^2)."""
    outputs = torch.tensor([[[[1.0, 2.0]]], [[[3.0, 4.0]]]])
    lses = torch.tensor([[[1.0]], [[2.0]]])
    w0, w1 = math.e / (math.e + math.e**2), math.e**2 / (math.e + math.e**2)
    for impl in ("torch", "triton"):
        out, lse = kernels.lse_merge(outputs, lses, return_lse=True, impl=impl)
        close(out, torch.tensor([[[w0 * 1 + w1 * 3, w0 * 2 + w1 * 4]]]))
        close(lse, torch.tensor([[math.log(math.e + math.e**2)]]))
        out2, lse2 = kernels.lse_merge(outputs, lses, base="2", return_lse=True, impl=impl)
        v0, v1 = 2 / 6, 4 / 6
        close(out2, torch.tensor([[[v0 * 1 + v1 * 3, v0 * 2 + v1 * 4]]]))
        close(lse2, torch.tensor([[math.log2(6.0)]]))


def test_base_two_equals_base_e_rescaled() -> None:
    outputs, lses = _inputs(4, 2, 13, 48, torch.float32)
    out_e, lse_e = kernels.lse_merge(outputs, lses, base="e", return_lse=True, impl="triton")
    out_2, lse_2 = kernels.lse_merge(
        outputs, lses * math.log2(math.e), base="2", return_lse=True, impl="triton"
    )
    close(out_2, out_e)
    close(lse_2, lse_e * math.log2(math.e))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_empty_shards_contribute_nothing_and_never_leak_nan(impl: str) -> None:
    n, b, h, d = 4, 3, 13, 48
    outputs, lses = _inputs(n, b, h, d, torch.bfloat16)
    # Shard 1 saw no tokens for token 0 and its output lanes hold garbage (NaN, inf).
    lses[1, 0] = -INF
    outputs[1, 0] = float("nan")
    outputs[1, 0, :, 0] = INF
    # NaN and +inf LSEs mean "empty" too (vLLM's rule).
    lses[2, 1, 3] = float("nan")
    lses[3, 1, 4] = INF
    outputs[2, 1, 3] = float("nan")
    outputs[3, 1, 4] = float("nan")
    # Token 2, head 5: every shard empty -> output 0, lse -inf.
    lses[:, 2, 5] = -INF
    outputs[:, 2, 5] = float("nan")
    out, lse = kernels.lse_merge(outputs, lses, return_lse=True, impl=impl)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[2, 5].float(), torch.zeros(d))
    assert lse[2, 5] == -INF
    keep = torch.tensor([0, 2, 3])
    want = kernels.lse_merge(outputs[keep, :1], lses[keep, :1], impl="torch")
    close(out[:1], want)
    keep_h3 = torch.tensor([0, 1, 3])
    want_h3 = kernels.lse_merge(outputs[keep_h3, 1:2, 3:4], lses[keep_h3, 1:2, 3:4], impl="torch")
    close(out[1:2, 3:4], want_h3)
    assert torch.isfinite(lse[:2]).all()


def test_single_live_shard_is_copied() -> None:
    outputs, lses = _inputs(8, 2, 13, 96, torch.float32)
    lses[torch.arange(8) != 6] = -INF
    out, lse = kernels.lse_merge(outputs, lses, return_lse=True, impl="triton")
    close(out, outputs[6])
    close(lse, lses[6])


def test_non_contiguous_inputs() -> None:
    n, b, h, d = 4, 3, 13, 96
    outputs = torch.randn(b, h, n, d).to(torch.bfloat16).permute(2, 0, 1, 3)  # [N,B,H,D] view
    lses = (torch.randn(h, b, n) * 3).permute(2, 1, 0)  # [N,B,H] view
    assert not outputs.is_contiguous() and not lses.is_contiguous()
    got = kernels.lse_merge(outputs, lses, impl="triton")
    want = kernels.lse_merge(outputs.contiguous(), lses.contiguous(), impl="torch")
    close(got, want)


def test_masks_read_and_write_only_head_dim() -> None:
    """D = 48 runs a 64-lane tile: lanes 48..63 are never written, and the NaN that sits
    past D in the input rows cannot reach the output."""
    n, b, h, d = 2, 2, 13, 48
    outputs, _ = padded_view((n, b, h, d), 16, torch.float32, float("nan"))
    outputs.copy_(torch.randn(n, b, h, d))
    lses = torch.randn(n, b, h)
    out, out_buf = padded_view((b, h, d), 16, torch.float32, 7.0)
    triton_lse.lse_merge(outputs, lses, out=out)
    assert torch.equal(out_buf[..., d:], torch.full((b, h, 16), 7.0))
    close(out, kernels.lse_merge(outputs, lses, impl="torch"))


@pytest.mark.parametrize(("n", "d", "dtype"), [(2, 48, torch.float32), (8, 96, torch.bfloat16)])
def test_head_tile_masks(n: int, d: int, dtype: torch.dtype) -> None:
    """H = 13 in tiles of 16 (one tile) or 4 (four, the last with one head): padded heads
    write nothing — the output sits in a buffer 3 heads and 16 lanes larger."""
    b, h = 2, 13
    block_h = triton_lse.merge_block_h(h, triton.next_power_of_2(n), triton.next_power_of_2(d),
                                       torch.empty((), dtype=dtype).element_size())  # fmt: skip
    assert block_h in (16, 4)
    outputs, lses = _inputs(n, b, h, d, dtype)
    buf = torch.full((b, h + 3, d + 16), 7.0, dtype=dtype)
    out = buf[:, :h, :d]
    triton_lse.lse_merge(outputs, lses, out=out)
    assert (buf[:, h:] == 7.0).all() and (buf[:, :, d:] == 7.0).all()
    close(out, kernels.lse_merge(outputs, lses, impl="torch"))


def test_no_heads_or_tokens() -> None:
    out, lse = kernels.lse_merge(
        torch.zeros(2, 0, 4, 48), torch.zeros(2, 0, 4), return_lse=True, impl="triton"
    )
    assert out.shape == (0, 4, 48) and lse.shape == (0, 4)


def test_rejects_bad_arguments() -> None:
    outputs, lses = _inputs(2, 1, 4, 48, torch.float32)
    for impl in ("torch", "triton"):
        with pytest.raises(ValueError, match="base"):
            kernels.lse_merge(outputs, lses, base="10", impl=impl)
        with pytest.raises(ValueError, match="lses"):
            kernels.lse_merge(outputs, lses[:, :, :3], impl=impl)
        with pytest.raises(ValueError, match="out_scale"):
            kernels.lse_merge(outputs, lses, out_dtype=torch.float8_e4m3fn, impl=impl)
    with pytest.raises(ValueError, match="impl"):
        kernels.lse_merge(outputs, lses, impl="cuda")


@FP8_CPU_XFAIL
def test_fp8_output_with_scale() -> None:
    n, b, h, d = 4, 2, 13, 128
    outputs, lses = _inputs(n, b, h, d, torch.bfloat16)
    # Values straddling powers of two, where the interpreter's fp8 cast goes wrong.
    outputs = (outputs.float().sign() * 2.0 ** outputs.float().round()).to(torch.bfloat16)
    scale = torch.tensor(0.02)
    got = kernels.lse_merge(outputs, lses, out_dtype=torch.float8_e4m3fn, out_scale=scale,
                            impl="triton")  # fmt: skip
    want = reference.lse_merge(outputs, lses, out_dtype=torch.float8_e4m3fn, out_scale=scale)
    assert got.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(got.float(), want.float(), **FP8_ONE_ULP)


def test_fp8_reference_saturates_and_scales() -> None:
    outputs = torch.tensor([[[[1000.0, -1000.0, 0.5, 3.0]]]])
    lses = torch.zeros(1, 1, 1)
    out = reference.lse_merge(outputs, lses, out_dtype=torch.float8_e4m3fn, out_scale=0.5)
    assert out.float().tolist() == [[[448.0, -448.0, 1.0, 6.0]]]


@pytest.mark.parametrize("base", ["e", "2"])
def test_agrees_with_vllm_lse_weighted_combine(base: str) -> None:
    vllm_combine = vllm_function("dcp", "_lse_weighted_combine")
    outputs, lses = _inputs(4, 3, 13, 96, torch.float32)
    lses[1, 0] = -INF
    lses[:, 2, 7] = -INF
    want, want_lse = vllm_combine(outputs, lses, return_lse=True, is_lse_base_on_e=base == "e")
    for impl in ("torch", "triton"):
        got, got_lse = kernels.lse_merge(outputs, lses, base=base, return_lse=True, impl=impl)
        close(got, want)
        close(got_lse, want_lse)


def test_two_state_merge_agrees_with_vllm_merge_attn_states() -> None:
    """vLLM's prefix/suffix merge: outputs [T,H,D], LSEs [H,T] — N=2 as strided views."""
    merge_torch = vllm_function("merge_attn_states", "_merge_attn_states_torch")
    t, h, d = 7, 13, 48
    prefix, suffix = torch.randn(t, h, d), torch.randn(t, h, d)
    p_lse, s_lse = torch.randn(h, t), torch.randn(h, t)
    p_lse[2, 3] = -INF
    p_lse[4, 5], s_lse[4, 5] = -INF, -INF
    s_lse[0, 0] = INF  # vLLM maps +inf to -inf as well
    want, want_lse = torch.empty(t, h, d), torch.empty(h, t)
    merge_torch(want, prefix, p_lse, suffix, s_lse, output_lse=want_lse)
    outputs = torch.stack([prefix, suffix])
    lses = torch.stack([p_lse, s_lse]).transpose(1, 2)  # [2, T, H] view
    got, got_lse = kernels.lse_merge(outputs, lses, return_lse=True, impl="triton")
    close(got, want)
    close(got_lse, want_lse.t())
