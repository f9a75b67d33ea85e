"""Step-time model: the regimes and the ratios the router's decisions rest on."""

from __future__ import annotations

import pytest

from costmodel import steptime as st
from costmodel.profiles import load_profile

P70 = load_profile("h200-70b-fp8")
P70_OFF = load_profile("h200-70b-fp8-offload")


def test_recomputing_a_142k_context_costs_tens_of_seconds_loading_it_under_one():
    recompute = st.request_prefill_time(P70, 142_000)
    load = st.load_time(P70_OFF, 142_000 // P70.block_size, "cpu")
    assert 20 < recompute < 120
    assert load < 1.0
    assert recompute / load > 50


def test_prefill_throughput_is_a_few_thousand_tokens_per_second_per_gpu():
    tps = 8192 / st.prefill_time(P70, 8192)
    assert 2_000 < tps < 10_000
    # attention makes later chunks dearer than the first
    assert st.prefill_time(P70, 8192, 100_000) > 2 * st.prefill_time(P70, 8192, 0)


def test_prefill_time_matches_the_flop_formula():
    m = P70.model
    n, c = 1000, 5000
    flops = 2 * m.params * n + 4 * m.layers * m.heads * m.head_dim * n * (c + (n + 1) / 2)
    want = flops / (P70.hardware.flops * P70.prefill_mfu)
    assert st.prefill_time(P70, n, c) == pytest.approx(want)


def test_decode_is_memory_bound_weights_plus_kv_reads():
    bw = P70.hardware.hbm_bw * P70.hbm_efficiency
    want = P70.hardware.step_overhead_s + (P70.model.weight_bytes + 375_000 * 163_840) / bw
    assert st.decode_step_time(P70, 3, 375_000) == pytest.approx(want)
    assert st.decode_step_time(P70, 3, 375_000) > st.decode_step_time(P70, 3, 10_000)
    assert st.decode_step_time(P70, 0, 0) == 0.0


def test_mixed_step_combines_and_is_at_least_each_part():
    dec = [100_000, 50_000]
    mixed = st.step_time(P70, [(4096, 20_000)], dec)
    assert mixed >= st.step_time(P70, [], dec)
    assert mixed >= st.step_time(P70, [(4096, 20_000)])
    assert st.step_time(P70, [], dec) == pytest.approx(st.decode_step_time(P70, 2, 150_000))
    assert st.step_time(P70) == 0.0


def test_chunked_prefill_pays_overhead_per_chunk_and_threshold_adds_chunks():
    one_chunk = st.request_prefill_time(P70, 8192)
    assert one_chunk >= st.prefill_time(P70, 8192) + P70.hardware.step_overhead_s
    small = P70.replace(long_prefill_token_threshold=512)
    assert st.request_prefill_time(small, 8192) > one_chunk


def test_load_time_per_tier():
    assert st.load_time(P70_OFF, 100, "gpu") == 0.0
    cpu, sto = st.load_time(P70_OFF, 100, "cpu"), st.load_time(P70_OFF, 100, "storage")
    assert 0 < cpu < sto
    hw = P70_OFF.hardware
    want = hw.host_latency_s + 100 * P70_OFF.kv_bytes_per_block / hw.host_load_bw
    assert cpu == pytest.approx(want)


@pytest.mark.parametrize(
    "call",
    [
        lambda: st.prefill_time(P70, -1),
        lambda: st.decode_step_time(P70, 1, -5),
        lambda: st.step_time(P70, [(-1, 0)]),
        lambda: st.step_time(P70, [], [-3]),
        lambda: st.load_time(P70, -1, "cpu"),
    ],
)
def test_negative_sizes_are_rejected(call):
    with pytest.raises(ValueError):
        call()


def test_unknown_tier_is_rejected():
    with pytest.raises(ValueError, match="unknown tier"):
        st.load_time(P70, 1, "tape")


def test_decode_time_grows_with_batch_and_output():
    alone = st.decode_time(P70, 100, 50_000)
    shared = st.decode_time(P70, 100, 50_000, batch=[100_000, 100_000])
    assert shared > alone > 0
    assert st.decode_time(P70, 200, 50_000) > alone


P70_TP4 = load_profile("h200-70b-fp8-tp4")


def test_one_h200_cannot_decode_a_70b_at_the_agentx_line_but_tp4_can():
    # the P90 >= 50 tok/s line needs steps <= 20 ms; a 70B replica on one H200 reads 70.6 GB
    # of weights per step (>= 17 ms at 4.08 TB/s) before any KV
    assert st.decode_step_time(P70, 1, 1_000) > 0.020
    assert st.decode_step_time(P70_TP4, 1, 1_000) < 0.012
    # ten 100k-token sessions decoding together still fit the line on TP4
    assert st.decode_step_time(P70_TP4, 10, 1_000_000) < 0.020


def test_tensor_parallel_step_splits_weights_and_flops_and_adds_allreduces():
    hw, m = P70_TP4.hardware, P70_TP4.model
    bw = hw.hbm_bw * P70_TP4.hbm_efficiency * 4
    allreduces = 2 * m.layers
    comm = allreduces * (hw.allreduce_latency_s + 1.5 * 3 * m.hidden * 2 / hw.interconnect_bw)
    want = hw.step_overhead_s + comm + (m.weight_bytes + 300_000 * 163_840) / bw
    assert st.decode_step_time(P70_TP4, 3, 300_000) == pytest.approx(want)
    # prefill compute runs on 4 GPUs: the same chunk is 3-4x faster (all-reduces eat the rest)
    ratio = st.step_time(P70, [(8192, 0)]) / st.step_time(P70_TP4, [(8192, 0)])
    assert 2.5 < ratio < 4.0
    # each GPU loads its own quarter of the KV heads from host DRAM
    off1 = P70_OFF.hardware.host_latency_s
    assert st.load_time(P70_TP4, 1000, "cpu") - off1 == pytest.approx(
        (st.load_time(P70_OFF, 1000, "cpu") - off1) / 4
    )
