"""Engine plugin presets, `kvroute engine flags`, and the version gate (without vLLM)."""

from __future__ import annotations

import json
import shlex
import sys

import pytest

from engine_patches import presets, versions
from kvroute.cli import main


def flag_value(words: list[str], flag: str) -> str:
    return words[words.index(flag) + 1]


def test_agentic_preset_has_every_documented_part():
    words = presets.flags(
        presets.EngineOptions(
            host_tier_bytes=1 << 30, disk_tier_dir="/var/kv", kv_events="tcp://*:5557"
        )
    )
    assert flag_value(words, "--prefix-caching-hash-algo") == "sha256_cbor"
    assert "--enable-prefix-caching" in words and "--enable-prompt-tokens-details" in words
    ev = json.loads(flag_value(words, "--kv-events-config"))
    assert ev["endpoint"] == "tcp://*:5557" and ev["replay_endpoint"] == "tcp://*:5558"
    assert flag_value(words, "--scheduler-cls") == presets.SCHEDULER_CLS
    cad = json.loads(flag_value(words, "--additional-config"))["kvroute"]["cadence"]
    assert cad["interval"] >= 2 and cad["max_defer_steps"] > 0 and cad["max_defer_ms"] > 0
    assert flag_value(words, "--long-prefill-token-threshold") == "512"
    assert flag_value(words, "--scheduling-policy") == "priority"  # the router's priority
    ktc = json.loads(flag_value(words, "--kv-transfer-config"))
    extra = ktc["kv_connector_extra_config"]
    assert ktc["kv_connector"] == "OffloadingConnector"
    assert extra["spec_module_path"] == "engine_patches.offload"
    assert extra["cpu_bytes_to_use"] == 1 << 30
    assert extra["secondary_tiers"] == [
        {"type": "fs", "root_dir": "/var/kv", "enable_kv_events": True}
    ]


def test_gpu_preset_uses_the_async_scheduler_and_dcp():
    words = presets.flags(presets.EngineOptions(platform="gpu", dcp=4, dcp_comm_backend="a2a"))
    assert flag_value(words, "--scheduler-cls") == presets.ASYNC_SCHEDULER_CLS
    assert flag_value(words, "--decode-context-parallel-size") == "4"
    assert flag_value(words, "--dcp-comm-backend") == "a2a"
    with pytest.raises(ValueError, match="GPU"):
        presets.flags(presets.EngineOptions(dcp=2))


def test_prefix_preset_writes_dcp_too(capsys):
    """Issue 12: DCP is a parallelism setting, not plugin code; both presets end with it."""
    opts = presets.EngineOptions(preset="prefix", platform="gpu", dcp=4, dcp_comm_backend="a2a")
    words = presets.flags(opts)
    assert words[-4:] == ["--decode-context-parallel-size", "4", "--dcp-comm-backend", "a2a"]
    assert "--scheduler-cls" not in words
    with pytest.raises(ValueError, match="GPU"):
        presets.flags(presets.EngineOptions(preset="prefix", dcp=2))
    argv = ["engine", "flags", "--json", "--preset", "prefix", "--platform", "gpu", "--dcp", "2"]
    assert main(argv) == 0  # `kvroute engine flags` says the same
    assert json.loads(capsys.readouterr().out)[-2:] == ["--decode-context-parallel-size", "2"]
    assert main(["engine", "flags", "--preset", "prefix", "--dcp", "2"]) == 2  # CPU: refused
    assert "GPU hosts" in capsys.readouterr().out


def test_prefix_preset_is_only_the_caching_part():
    words = presets.flags(presets.EngineOptions(preset="prefix", host_tier_bytes=1 << 30))
    assert "--scheduler-cls" not in words and "--kv-transfer-config" not in words


def test_disk_tier_needs_a_host_tier():
    with pytest.raises(ValueError, match="host tier"):
        presets.flags(presets.EngineOptions(disk_tier_dir="/x"))


def test_replay_endpoint_derivation():
    assert presets.replay_endpoint_for("ipc:///run/kv.sock") == "ipc:///run/kv.sock.replay"
    assert presets.replay_endpoint_for("tcp://127.0.0.1:7000") == "tcp://127.0.0.1:7001"


def test_cli_prints_shell_words(capsys):
    assert main(["engine", "flags", "--preset", "agentic", "--host-tier-bytes", "1024",
                 "--kv-events", "ipc:///tmp/kv.sock"]) == 0  # fmt: skip
    words = shlex.split(capsys.readouterr().out)
    assert words == presets.flags(
        presets.EngineOptions(host_tier_bytes=1024, kv_events="ipc:///tmp/kv.sock")
    )
    assert main(["engine", "versions"]) == 0
    assert capsys.readouterr().out.split() == list(versions.SUPPORTED)


def test_version_gate():
    assert versions.check("0.32.0") == "0.32.0"
    assert versions.check("0.33.0+cu129") == "0.33.0"
    with pytest.raises(versions.UnsupportedVllmVersion, match=r"0\.31\.0"):
        versions.check("0.31.0")


def test_engine_patches_imports_without_vllm():
    import engine_patches.cadence
    import engine_patches.plugin
    import engine_patches.scheduler  # noqa: F401

    assert "vllm" not in sys.modules


def test_write_back_host_tier_is_the_plugins_connector_on_cpu_and_gpu():
    for platform in ("cpu", "gpu"):
        opts = presets.EngineOptions(
            platform=platform, host_tier_bytes=1 << 28, host_tier_mode="write-back"
        )
        ktc = json.loads(flag_value(presets.flags(opts), "--kv-transfer-config"))
        # the plugin's subclass on both: its eviction-front walk is the scheduler side's
        assert ktc["kv_connector"] == "KVRouteWriteBackConnector"
        assert ktc["kv_connector_module_path"] == "engine_patches.writeback"
        assert ktc["kv_connector_extra_config"] == {
            "cpu_bytes_to_use": 1 << 28,
            "lazy_offload": True,
        }
    # the default stays write-through
    ktc = json.loads(
        flag_value(presets.flags(presets.EngineOptions(host_tier_bytes=1)), "--kv-transfer-config")
    )
    assert ktc["kv_connector"] == "OffloadingConnector"


@pytest.mark.parametrize(
    "extra",
    [{"disk_tier_dir": "/var/kv"}, {"retention": True}, {"eviction_policy": "arc"}],
)
def test_write_back_refuses_what_only_the_write_through_tier_has(extra):
    opts = presets.EngineOptions(host_tier_bytes=1 << 28, host_tier_mode="write-back", **extra)
    with pytest.raises(ValueError, match="write-back host tier does not take"):
        presets.flags(opts)
    with pytest.raises(ValueError, match="host tier mode"):
        presets.flags(presets.EngineOptions(host_tier_bytes=1, host_tier_mode="lazy"))


def test_cli_writes_the_write_back_tier(capsys):
    assert (
        main(["engine", "flags", "--host-tier-bytes", "4096", "--host-tier-mode", "write-back"])
        == 0
    )
    words = shlex.split(capsys.readouterr().out)
    ktc = json.loads(flag_value(words, "--kv-transfer-config"))
    assert ktc["kv_connector"] == "KVRouteWriteBackConnector"


def test_pool_tier_sits_below_disk_with_remote_locality_and_recompute_on_failed_loads(capsys):
    assert main(["engine", "flags", "--host-tier-bytes", "4096", "--disk-tier-dir", "/d",
                 "--pool-dir", "/shared/kv", "--pool-bytes", "1000000", "--json"]) == 0  # fmt: skip
    ktc = json.loads(flag_value(json.loads(capsys.readouterr().out), "--kv-transfer-config"))
    extra = ktc["kv_connector_extra_config"]
    assert extra["spec_name"] == "KVRouteTieringSpec"
    disk, pool = extra["secondary_tiers"]
    assert disk == {"type": "fs", "root_dir": "/d", "enable_kv_events": True}
    assert pool["type"] == presets.POOL_TIER and pool["module_path"] == presets.POOL_MODULE
    assert pool["root_dir"] == "/shared/kv" and pool["pool_bytes"] == 1000000
    assert pool["locality"] == "REMOTE" and pool["enable_kv_events"] is True
    assert ktc["kv_load_failure_policy"] == "recompute"
    # without a pool the write-through config is what it was (vLLM's default failure policy)
    plain = presets.kv_transfer_config(presets.EngineOptions(host_tier_bytes=4096))
    assert "kv_load_failure_policy" not in plain


@pytest.mark.parametrize(
    "opts, why",
    [
        (dict(pool_dir="/p"), "needs a host tier"),
        (dict(host_tier_bytes=4096, pool_bytes=10), "needs --pool-dir"),
        (dict(host_tier_bytes=4096, pool_dir="/p", pool_bytes=-1), ">= 0"),
        (dict(host_tier_bytes=4096, pool_dir="/p", host_tier_mode="write-back"), "pool tier"),
    ],
)
def test_pool_options_that_cannot_work_are_refused(opts, why):
    with pytest.raises(ValueError, match=why):
        presets.flags(presets.EngineOptions(**opts))


def test_scheduling_policy_fcfs_writes_no_flag_and_nonsense_is_refused(capsys):
    words = presets.flags(presets.EngineOptions(scheduling_policy="fcfs"))
    assert "--scheduling-policy" not in words
    assert "--scheduling-policy" not in presets.flags(presets.EngineOptions(preset="prefix"))
    with pytest.raises(ValueError, match="scheduling policy"):
        presets.flags(presets.EngineOptions(scheduling_policy="lifo"))
    assert main(["engine", "flags", "--json", "--scheduling-policy", "fcfs"]) == 0
    assert "--scheduling-policy" not in json.loads(capsys.readouterr().out)
