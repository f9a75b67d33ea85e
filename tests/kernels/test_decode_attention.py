"""Split-KV GQA decode attention over a paged cache: Triton against the reference, the
reference against torch's scaled_dot_product_attention, stale cache lanes never read."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("triton")

import torch

import kernels
from kernels import reference, triton_decode
from tests.kernels._util import close

pytestmark = pytest.mark.kernels


def _case(
    seq_lens: list[int], hq: int, hk: int, d: int, bs: int, dtype: torch.dtype, stale: float = 0.0
) -> dict[str, torch.Tensor]:
    """Pages scattered at random; every slot no sequence owns holds ``stale`` (NaN to catch
    a missing mask); unused block-table entries point at a stale page."""
    b = len(seq_lens)
    max_blocks = max(1, max((n + bs - 1) // bs for n in seq_lens))
    num_blocks = b * max_blocks + 1
    perm = torch.randperm(num_blocks - 1)
    block_table = torch.full((b, max_blocks), num_blocks - 1, dtype=torch.int32)
    kc = torch.full((num_blocks, bs, hk, d), stale, dtype=dtype)
    vc = torch.full((num_blocks, bs, hk, d), stale, dtype=dtype)
    for i, n in enumerate(seq_lens):
        pages = perm[i * max_blocks : i * max_blocks + (n + bs - 1) // bs]
        block_table[i, : len(pages)] = pages.int()
        tok = torch.arange(n)
        kc[pages[tok // bs], tok % bs] = torch.randn(n, hk, d).to(dtype)
        vc[pages[tok // bs], tok % bs] = torch.randn(n, hk, d).to(dtype)
    return {
        "q": torch.randn(b, hq, d).to(dtype),
        "key_cache": kc,
        "value_cache": vc,
        "block_table": block_table,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
    }


@pytest.mark.parametrize(
    ("seq_lens", "hq", "hk", "d", "bs", "dtype", "splits", "block_n"),
    [
        ([1, 17, 64], 8, 2, 128, 16, torch.bfloat16, 1, 16),
        ([33, 5], 13, 1, 48, 16, torch.float16, 3, 16),
        ([64, 63, 2, 40], 4, 4, 96, 32, torch.bfloat16, 2, 32),
        ([20], 8, 1, 96, 32, torch.float32, 8, 16),  # more splits than steps: empty splits
    ],
)
def test_triton_matches_reference(
    seq_lens: list[int],
    hq: int,
    hk: int,
    d: int,
    bs: int,
    dtype: torch.dtype,
    splits: int,
    block_n: int,
) -> None:
    case = _case(seq_lens, hq, hk, d, bs, dtype)
    got, got_lse = triton_decode.decode_attention(
        **case, return_lse=True, num_splits=splits, block_n=block_n
    )
    want, want_lse = kernels.decode_attention(**case, return_lse=True, impl="torch")
    assert got.dtype == dtype and got.shape == (len(seq_lens), hq, d)
    close(got, want)
    close(got_lse, want_lse, torch.float32)


def test_public_api_default_splits_and_strided_tables() -> None:
    case = _case([40, 9], 8, 2, 48, 16, torch.bfloat16)
    want = kernels.decode_attention(**case, impl="torch")
    bt = case["block_table"]
    strided = dict(
        case,
        block_table=bt.t().contiguous().t(),
        seq_lens=case["seq_lens"].repeat_interleave(2)[::2],
    )
    assert strided["block_table"].stride(-1) != 1 and strided["seq_lens"].stride(0) == 2
    close(kernels.decode_attention(**strided, impl="triton"), want)
    assert triton_decode.default_num_splits(1, 8, 131072, 64) == 64
    assert triton_decode.default_num_splits(64, 8, 131072, 64) == 2
    assert triton_decode.default_num_splits(512, 8, 131072, 64) == 1
    assert triton_decode.default_num_splits(1, 1, 40, 16) == 3  # never more than steps


def test_stale_cache_lanes_are_never_read() -> None:
    case = _case([7, 30, 16], 8, 2, 48, 16, torch.float32, stale=float("nan"))
    out, lse = triton_decode.decode_attention(**case, return_lse=True, num_splits=2, block_n=16)
    assert not out.isnan().any() and not lse.isnan().any()
    clean = dict(case)
    clean["key_cache"] = torch.nan_to_num(case["key_cache"], nan=0.0)
    clean["value_cache"] = torch.nan_to_num(case["value_cache"], nan=0.0)
    close(out, reference.decode_attention(**clean))


def test_empty_sequence_gives_zero_and_minus_inf() -> None:
    case = _case([0, 12], 4, 2, 48, 16, torch.bfloat16)
    for impl in ("torch", "triton"):
        out, lse = kernels.decode_attention(**case, return_lse=True, impl=impl)
        assert torch.equal(out[0].float(), torch.zeros(4, 48))
        assert (lse[0] == -math.inf).all() and torch.isfinite(lse[1]).all()


def test_reference_matches_sdpa_with_gqa() -> None:
    seq_lens, hq, hk, d = [5, 16, 33], 8, 2, 48
    case = _case(seq_lens, hq, hk, d, 16, torch.float32)
    out, lse = reference.decode_attention(**case, scale=0.3, return_lse=True)
    for i, n in enumerate(seq_lens):
        tok = torch.arange(n)
        pages = case["block_table"][i, tok // 16].long()
        k = case["key_cache"][pages, tok % 16].transpose(0, 1)  # [Hk, n, D]
        v = case["value_cache"][pages, tok % 16].transpose(0, 1)
        q = case["q"][i].unsqueeze(1)  # [Hq, 1, D]
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=True)
        close(out[i], want.squeeze(1))
        scores = torch.einsum("hd,hnd->hn", case["q"][i], k.repeat_interleave(hq // hk, 0)) * 0.3
        close(lse[i], torch.logsumexp(scores, -1))


def test_split_results_merge_like_one_pass() -> None:
    """The split count changes only the summation order: 1, 2 and 5 splits agree (fp32)."""
    case = _case([50, 31], 4, 1, 48, 16, torch.float32)
    runs = [triton_decode.decode_attention(**case, num_splits=s, block_n=16) for s in (1, 2, 5)]
    close(runs[1], runs[0])
    close(runs[2], runs[0])


def test_rejects_bad_shapes() -> None:
    case = _case([4], 6, 4, 48, 16, torch.float32)
    for impl in ("torch", "triton"):
        with pytest.raises(ValueError, match="multiple"):
            kernels.decode_attention(**case, impl=impl)
    with pytest.raises(ValueError, match="block_n"):
        triton_decode.decode_attention(**_case([4], 4, 2, 48, 16, torch.float32), block_n=24)
