"""The HTTP twin with the engine plugin's rules: hints read from request bodies as vLLM gets
them, and the plugin's host-tier gauges on /metrics, with its pending-prefill gauge where the
plugin's cadence runs too (as on real vLLM)."""

from __future__ import annotations

import re

import httpx
import pytest

from costmodel.profiles import load_profile
from engine_patches.cadence import CadenceConfig
from engine_patches.retention_rule import RetentionConfig
from loadtest import tinymodel
from loadtest.twin.cluster import start_cluster
from loadtest.twin.engine import EnginePlugin, HostTier
from router.hints import with_hint

pytestmark = pytest.mark.timeout(60)
WORDS = tinymodel._WORDS
# 39 usable engine blocks (1,248 tokens) above a 64-block host tier
PROFILE = load_profile("cpu-tiny").replace(gpu_kv_blocks=40, cpu_kv_blocks=64)


def text(n: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 131 + i * 17) % len(WORDS)] for i in range(n))


def gauge(metrics: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", metrics, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


async def test_a_hinted_body_holds_the_session_on_the_host_tier_and_the_gauges_show_it():
    plugin = EnginePlugin(retention=RetentionConfig(ttl_s=600, max_share=0.5))
    async with start_cluster(1, PROFILE, plugin=plugin) as c, httpx.AsyncClient(timeout=30) as h:
        url = c.urls[0]

        async def complete(prompt: str, hint: dict | None = None) -> dict:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
            # the bytes the router's proxy sends upstream with engine_hints on
            raw = with_hint(body, hint) if hint else None
            r = await (h.post(url + "/v1/completions", content=raw,
                              headers={"content-type": "application/json"})
                       if raw else h.post(url + "/v1/completions", json=body))  # fmt: skip
            assert r.status_code == 200, r.text
            return r.json()

        m0 = (await h.get(url + "/metrics")).text
        assert gauge(m0, "vllm:kv_offload_cpu_cache_occupancy_perc") == 0.0
        assert gauge(m0, "vllm:kv_offload_cpu_retained_perc") == 0.0
        assert "vllm:num_pending_prefill_tokens" not in m0  # no cadence: not exported
        paused = text(600, 1)
        await complete(paused, {"session": "t/s-1", "state": "tool-pause", "return_s": 30})
        for seed in range(2, 8):  # unhinted prompts that push it out of the engine's cache
            await complete(text(800, seed))
        m = (await h.get(url + "/metrics")).text
        assert gauge(m, "vllm:kv_offload_cpu_cache_occupancy_perc") == 1.0  # full
        held = gauge(m, "vllm:kv_offload_cpu_retained_perc")
        assert 0 < held <= 0.5
        again = await complete(paused)
        n = again["usage"]["prompt_tokens"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 32 * 32
        cpu = c.replicas[0].engine.cpu
        assert isinstance(cpu, HostTier) and cpu.table is not None
        assert cpu.table.held(c.replicas[0].engine.now + 1.0) == {"t/s-1": round(held * 64)}


async def test_the_pending_prefill_gauge_is_exported_where_the_plugins_cadence_runs():
    plugin = EnginePlugin(cadence=CadenceConfig())
    async with start_cluster(1, PROFILE, plugin=plugin) as c, httpx.AsyncClient(timeout=30) as h:
        m = (await h.get(c.urls[0] + "/metrics")).text
        assert gauge(m, "vllm:num_pending_prefill_tokens") == 0.0


async def test_a_plain_twin_exports_occupancy_but_no_retained_share_nor_pending_prefill():
    async with start_cluster(1, PROFILE) as c, httpx.AsyncClient(timeout=30) as h:
        m = (await h.get(c.urls[0] + "/metrics")).text
        assert gauge(m, "vllm:kv_offload_cpu_cache_occupancy_perc") == 0.0
        assert "vllm:num_pending_prefill_tokens" not in m  # plain vLLM has no such series
        assert "vllm:kv_offload_cpu_retained_perc" not in m
        # a malformed hint is ignored, never an error (as the plugin's parse_hint)
        r = await h.post(c.urls[0] + "/v1/completions", json={
            "model": "tiny", "prompt": "hello there", "max_tokens": 1,
            "kv_transfer_params": {"kvroute": {"session": "s", "state": "asleep"}}})  # fmt: skip
        assert r.status_code == 200
