"""The two DCP layouts, simulated over N ranks in one process.

All-gather/reduce-scatter: every rank all-gathers the LSEs, rescales its own full-head
output (``lse_correct``), and the reduce-scatter sums the ranks and hands rank r heads
``r·H/N … (r+1)·H/N − 1``. All-to-all: every rank packs output and fp32 LSE into one
buffer (``a2a_pack``), one all-to-all swaps slot n of rank r with slot r of rank n, and
each rank merges what it received (``lse_merge_packed``). Both must equal the one-shot
merge of the full-head partial states.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("triton")

import torch

import kernels
from kernels import reference
from tests.kernels._util import close

pytestmark = pytest.mark.kernels


def _partials(n: int, b: int, h: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    outputs = torch.randn(n, b, h, d).to(dtype)
    lses = torch.randn(n, b, h) * 3.0
    lses[n - 1, 0] = -math.inf  # the last rank holds no tokens of sequence 0
    outputs[n - 1, 0] = float("nan")  # ... and garbage in its output
    return outputs, lses


@pytest.mark.parametrize(
    ("n", "dtype", "base", "impl"),
    [
        (2, torch.bfloat16, "e", "triton"),
        (4, torch.float32, "2", "triton"),
        (4, torch.float16, "e", "torch"),
    ],
)
def test_all_gather_reduce_scatter_equals_merge(
    n: int, dtype: torch.dtype, base: str, impl: str
) -> None:
    b, h, d = 3, 8, 48
    outputs, lses = _partials(n, b, h, d, dtype)
    want, want_lse = kernels.lse_merge(
        outputs.float(), lses, base=base, return_lse=True, impl="torch"
    )
    corrected, glses = [], []
    for rank in range(n):
        c, g = kernels.lse_correct(outputs[rank], lses, rank, base=base, impl=impl)
        assert c.dtype == dtype and not c.isnan().any()
        corrected.append(c.float())
        glses.append(g)
    summed = torch.stack(corrected).sum(dim=0)  # the reduce-scatter's sum
    hl = h // n
    for rank in range(n):
        heads = slice(rank * hl, (rank + 1) * hl)
        close(summed[:, heads], want[:, heads].to(dtype), dtype)
        close(glses[rank], want_lse)


def test_correct_matches_reference_and_empty_rank_is_zero() -> None:
    n, b, h, d = 4, 2, 13, 96
    outputs, lses = _partials(n, b, h, d, torch.bfloat16)
    lses[:, 1, 2] = -math.inf
    for rank in range(n):
        got, got_lse = kernels.lse_correct(outputs[rank], lses, rank, impl="triton")
        want, want_lse = kernels.lse_correct(outputs[rank], lses, rank, impl="torch")
        close(got, want)
        close(got_lse, want_lse)
        assert torch.equal(got[1, 2].float(), torch.zeros(d)) and got_lse[1, 2] == -math.inf
    empty, _ = kernels.lse_correct(outputs[n - 1], lses, n - 1, impl="triton")
    assert torch.equal(empty[0].float(), torch.zeros(h, d))


def test_correct_rejects_a_rank_outside_the_group() -> None:
    outputs, lses = _partials(2, 1, 4, 48, torch.float32)
    for impl in ("torch", "triton"):
        with pytest.raises(ValueError, match="rank"):
            kernels.lse_correct(outputs[0], lses, 2, impl=impl)


def _all_to_all(sends: list[torch.Tensor]) -> list[torch.Tensor]:
    """recv[r][n] = send[n][r] — what one all_to_all_single does to [N, ...] buffers."""
    n = len(sends)
    return [torch.stack([sends[src][r] for src in range(n)]) for r in range(n)]


@pytest.mark.parametrize(
    ("n", "d", "dtype", "impl"),
    [
        (2, 48, torch.bfloat16, "triton"),
        (4, 96, torch.float32, "triton"),
        (4, 47, torch.float16, "torch"),
    ],
)
def test_all_to_all_packed_equals_merge(n: int, d: int, dtype: torch.dtype, impl: str) -> None:
    b, h = 3, 8
    outputs, lses = _partials(n, b, h, d, dtype)
    want, want_lse = kernels.lse_merge(outputs, lses, return_lse=True, impl="torch")
    sends = [kernels.a2a_pack(outputs[r], lses[r], n) for r in range(n)]
    pack = reference.a2a_pack_dim(dtype)
    assert sends[0].shape == (n, b, h // n, d + pack)
    hl = h // n
    for rank, recv in enumerate(_all_to_all(sends)):
        got, got_lse = kernels.lse_merge_packed(recv, d, return_lse=True, impl=impl)
        heads = slice(rank * hl, (rank + 1) * hl)
        close(got, want[:, heads])
        close(got_lse, want_lse[:, heads])


def test_pack_layout_is_vllms_lo_hi_lanes() -> None:
    """vLLM's pack kernel stores the fp32 LSE bits' low 16 at lane D, high 16 at D+1."""
    b, h, d, n = 2, 4, 48, 2
    out = torch.randn(b, h, d).to(torch.bfloat16)
    lse = torch.tensor([[1.5, -math.inf, 3.25, -7.0], [0.1, 2.0, 100.0, -0.5]])
    buf = kernels.a2a_pack(out, lse, n)
    bits = lse.view(torch.int32)
    lanes = buf.view(torch.int16)
    for r in range(n):
        for j in range(h // n):
            head = r * (h // n) + j
            assert torch.equal(buf[r, :, j, :d], out[:, head])
            lo = lanes[r, :, j, d].to(torch.int32) & 0xFFFF
            hi = lanes[r, :, j, d + 1].to(torch.int32) & 0xFFFF
            assert torch.equal(lo | (hi << 16), bits[:, head])
    outputs, lses = reference.a2a_unpack(buf, d)
    assert outputs.data_ptr() == buf.data_ptr()  # a view, not a copy
    assert torch.equal(lses, lse.view(b, n, h // n).permute(1, 0, 2))


def test_pack_rejects_heads_not_divisible_by_world_size() -> None:
    with pytest.raises(ValueError, match="divisible"):
        kernels.a2a_pack(torch.zeros(1, 13, 48), torch.zeros(1, 13), 4)
