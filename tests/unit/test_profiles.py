"""Replica profiles: shipped data files parse, derived sizes follow from first principles."""

from __future__ import annotations

import pytest

from costmodel.profiles import (
    ProfileError,
    list_profiles,
    load_profile,
    profile_from_dict,
)
from loadtest.tinymodel import SPEC

HW = {"gpu": {"hbm_bytes": 100e9, "hbm_bw": 1e12, "flops": {"fp8": 1e15, "bf16": 5e14}}}


def _raw(**over):
    d = {
        "name": "t",
        "hardware": "gpu",
        "model": {
            "params": 1e9,
            "layers": 10,
            "hidden": 1024,
            "heads": 8,
            "kv_heads": 2,
            "head_dim": 128,
            "kv_dtype_bytes": 2,
            "weight_bytes": 2e9,
            "max_model_len": 8192,
            "compute_dtype": "bf16",
        },
        "block_size": 16,
        "gpu_memory_utilization": 0.5,
        "activation_reserve_bytes": 1e9,
    }
    d.update(over)
    return d


def test_shipped_profiles_are_listed_and_load():
    names = list_profiles()
    assert {"h200-70b-fp8", "h200-8b", "cpu-tiny"} <= set(names)
    for n in names:
        p = load_profile(n)
        assert p.name == n and p.gpu_kv_blocks > 0 and p.block_size > 0


def test_h200_70b_fp8_kv_per_token_and_capacity_match_the_design_figures():
    p = load_profile("h200-70b-fp8")
    assert p.kv_bytes_per_token == 2 * 80 * 8 * 128 * 1 == 160 * 1024
    assert p.kv_bytes_per_block == p.kv_bytes_per_token * p.block_size
    # "after ~70 GB of fp8 weights only ~375k tokens fit"
    assert 350_000 <= p.gpu_kv_tokens <= 390_000
    assert p.hardware.flops == pytest.approx(2 * 790e12)  # fp8 ~2x the measured bf16 rate
    assert p.cpu_kv_blocks == 0 and p.storage_kv_blocks == 0


def test_offload_profile_adds_tiers_on_top_of_its_base():
    base, off = load_profile("h200-70b-fp8"), load_profile("h200-70b-fp8-offload")
    assert off.gpu_kv_blocks == base.gpu_kv_blocks and off.model == base.model
    assert off.cpu_kv_blocks == int(200e9 // base.kv_bytes_per_block)
    assert off.storage_kv_blocks > off.cpu_kv_blocks > off.gpu_kv_blocks


def test_h200_8b_uses_the_bf16_rate_and_fits_more_tokens():
    p = load_profile("h200-8b")
    assert p.kv_bytes_per_token == 128 * 1024
    assert p.hardware.flops == pytest.approx(790e12)
    assert p.gpu_kv_tokens > 2 * load_profile("h200-70b-fp8").gpu_kv_tokens


def test_cpu_tiny_matches_the_vllm_bed_configuration():
    p = load_profile("cpu-tiny")
    m = p.model
    assert p.block_size == 32 and p.gpu_kv_blocks == 256
    assert p.gpu_kv_blocks * p.kv_bytes_per_block == 16 << 20  # --kv-cache-memory-bytes 16M
    assert (m.layers, m.kv_heads, m.head_dim, m.hidden) == (
        SPEC.num_hidden_layers,
        SPEC.num_key_value_heads,
        SPEC.hidden_size // SPEC.num_attention_heads,
        SPEC.hidden_size,
    )
    assert m.max_model_len == 4096


def test_gpu_blocks_are_derived_from_memory_when_not_given():
    p = profile_from_dict(_raw(), HW)
    kv_block = 2 * 10 * 2 * 128 * 2 * 16
    assert p.gpu_kv_blocks == int((100e9 * 0.5 - 2e9 - 1e9) // kv_block)
    assert p.hardware.flops == 5e14  # the model's compute dtype picks the rate
    assert profile_from_dict(_raw(gpu_kv_blocks=7), HW).gpu_kv_blocks == 7


@pytest.mark.parametrize(
    ("over", "msg"),
    [
        ({"hardware": "tpu"}, "unknown hardware"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": "x"}, "must be a number"),
        ({"bogus": 1}, "unknown keys"),
        ({"gpu_memory_utilization": 0.01}, "no room for KV"),
        ({"gpu_memory_utilization": 1.5}, "<= 1"),
        ({"cpu_kv_blocks": 3, "cpu_kv_bytes": 1e9}, "not both"),
        ({"cpu_kv_bytes": 1e9}, "exceeds host_dram_bytes"),
        ({"prefill_mfu": 2}, "<= 1"),
        ({"name": ""}, "missing 'name'"),
    ],
)
def test_bad_profiles_get_a_clear_error(over, msg):
    with pytest.raises(ProfileError, match=msg):
        profile_from_dict(_raw(**over), HW)


def test_bad_model_and_unknown_profile():
    bad = _raw()
    bad["model"] = {**bad["model"], "kv_heads": 3}
    with pytest.raises(ProfileError, match="multiple of kv_heads"):
        profile_from_dict(bad, HW)
    bad["model"] = {k: v for k, v in bad["model"].items() if k != "layers"}
    with pytest.raises(ProfileError, match="missing 'layers'"):
        profile_from_dict(bad, HW)
    with pytest.raises(ProfileError, match="unknown profile"):
        load_profile("no-such-profile")


def test_engine_settings_can_be_overridden_with_checks():
    from costmodel.profiles import parse_overrides, with_overrides

    base = load_profile("cpu-tiny")
    p = with_overrides(base, parse_overrides(["prefill_interval_steps=2", "gpu_kv_blocks = 64"]))
    assert (p.prefill_interval_steps, p.gpu_kv_blocks) == (2, 64)
    assert p.model == base.model and base.gpu_kv_blocks == 256  # the cached one is untouched
    for bad, msg in (
        (["hbm_bytes=1"], "cannot override"),
        (["max_num_seqs=0"], "> 0"),
        (["prefill_mfu=1.5"], "<= 1"),
        (["gpu_kv_blocks=1"], "at least 2"),
        (["block_size=x"], "must be a number"),
        (["nokey"], "KEY=VALUE"),
    ):
        with pytest.raises(ProfileError, match=msg):
            with_overrides(base, parse_overrides(bad))


def test_tensor_parallel_replica_pools_the_kv_memory_of_its_gpus():
    tp1, tp4 = load_profile("h200-70b-fp8"), load_profile("h200-70b-fp8-tp4")
    assert (tp1.gpus, tp4.gpus) == (1, 4)
    per_gpu = 141e9 * 0.95 - 70.6e9 / 4 - 2.5e9
    assert tp4.gpu_kv_blocks == int(4 * per_gpu // (163_840 * 64))
    assert tp4.gpu_kv_tokens > 7 * tp1.gpu_kv_tokens  # weights paid once, not four times
    off = load_profile("h200-70b-fp8-tp4-offload")
    assert off.cpu_kv_blocks == int(800e9 // (163_840 * 64))


def test_tensor_parallel_size_must_split_the_kv_heads():
    raw = {
        "name": "bad-tp",
        "hardware": "h200",
        "model": load_profile("h200-70b-fp8").source["model"],
        "block_size": 64,
        "tensor_parallel_size": 3,
    }
    hw = {"h200": {"hbm_bytes": 141e9, "hbm_bw": 4.8e12, "flops": 1.58e15}}
    with pytest.raises(ProfileError, match="does not split 8 KV heads"):
        profile_from_dict(raw, hw)
    # more ranks than KV heads would replicate them (not split): refused, not mis-sized
    with pytest.raises(ProfileError, match="does not split 8 KV heads"):
        profile_from_dict({**raw, "tensor_parallel_size": 16}, hw)
