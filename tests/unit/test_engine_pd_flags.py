"""`kvroute engine flags --role prefill|decode`: the P/D connector, alone and with the tiers."""

from __future__ import annotations

import json

import pytest

from engine_patches import presets
from kvroute.cli import main


def ktc(words: list[str]) -> dict:
    return json.loads(words[words.index("--kv-transfer-config") + 1])


def test_gpu_roles_get_vllms_nixl_connector():
    for role in ("prefill", "decode", "both"):
        w = presets.flags(presets.EngineOptions(platform="gpu", pd_role=role))
        assert ktc(w) == {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                          "kv_load_failure_policy": "recompute"}  # fmt: skip
    # a prefill replica decodes nothing: no cadence scheduler; a decode replica keeps it
    pre = presets.flags(presets.EngineOptions(platform="gpu", pd_role="prefill"))
    dec = presets.flags(presets.EngineOptions(platform="gpu", pd_role="decode"))
    assert "--scheduler-cls" not in pre and "--scheduler-cls" in dec
    cpu = presets.flags(presets.EngineOptions(platform="cpu", pd_role="decode"))
    assert ktc(cpu)["kv_buffer_device"] == "cpu"
    assert "--kv-transfer-config" not in presets.flags(presets.EngineOptions())


def test_role_with_host_tier_is_a_multi_connector_pd_first():
    w = presets.flags(
        presets.EngineOptions(
            platform="gpu", pd_role="decode", host_tier_bytes=1 << 30, pool_dir="/pool"
        )
    )
    c = ktc(w)
    assert c["kv_connector"] == "MultiConnector"
    inner = c["kv_connector_extra_config"]["connectors"]
    assert [x["kv_connector"] for x in inner] == ["NixlConnector", "OffloadingConnector"]
    assert c["kv_load_failure_policy"] == "recompute"
    # without a pool the policy is the P/D connector's, on the outer config (vLLM reads it there)
    w = presets.flags(
        presets.EngineOptions(platform="gpu", pd_role="decode", host_tier_bytes=1 << 30)
    )
    c = ktc(w)
    assert c["kv_load_failure_policy"] == "recompute"
    assert all(
        "kv_load_failure_policy" not in x for x in c["kv_connector_extra_config"]["connectors"]
    )


def test_shared_storage_connector_roles_and_prefix_preset():
    w = presets.flags(
        presets.EngineOptions(
            preset="prefix", pd_role="prefill", pd_connector="shared-storage", pd_dir="/kv"
        )
    )
    assert ktc(w) == {"kv_connector": "ExampleConnector", "kv_role": "kv_producer",
                      "kv_connector_extra_config": {"shared_storage_path": "/kv"}}  # fmt: skip
    with pytest.raises(ValueError, match="pd-dir"):
        presets.flags(presets.EngineOptions(pd_role="decode", pd_connector="shared-storage"))
    with pytest.raises(ValueError, match="role"):
        presets.flags(presets.EngineOptions(pd_connector="nixl"))


def test_cli_role_flag(capsys):
    assert main(["engine", "flags", "--role", "prefill", "--platform", "gpu", "--json"]) == 0
    words = json.loads(capsys.readouterr().out)
    assert ktc(words)["kv_connector"] == "NixlConnector"
    assert main(["engine", "flags", "--role", "decode", "--pd-connector", "shared-storage"]) == 2
