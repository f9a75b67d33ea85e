"""The twin's cluster pool against real vLLM-CPU's: the same request sequence, the same cached
tokens and the same split by source, call by call.

Real side: two vLLM-CPU replicas sharing one pool directory, with ``test_engine_pool.py``'s
flags (``kvroute engine flags --host-tier-bytes N --pool-dir DIR --pool-bytes B``). Twin side:
two ``cpu-tiny`` twins of one cluster with ``cpu_kv_blocks`` = the host tier's blocks and
``pool_kv_blocks`` = the pool's bound in blocks (one :class:`loadtest.twin.engine.ClusterPool`).
Both get :func:`tests.integration.test_twin_pool.pool_sequence` (the real pool test's first
test: a prompt cold on replica 0, one of replica 1's own, then the first prompt on replica 1).
The real side waits for its pool writes (asynchronous file writes) before each next call; the
twin's are done when its call returns.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from loadtest.twin.cluster import start_cluster
from loadtest.vllmbed import EventCollector
from router.kv.index import is_pool_event
from router.vllm.kvevents import BlockStored
from router.vllm.metrics import cached_by_source
from tests.integration.test_twin_pool import HOST_BLOCKS, POOL_BLOCKS, PROFILE, pool_sequence
from tests.vllm import conftest
from tests.vllm.conftest import BLOCK_SIZE, KV_BYTES

pytestmark = pytest.mark.timeout(300)

BLOCK_BYTES = BLOCK_SIZE * 2048  # 2 KiB of fp32 KV per token for the tiny model: one pool file
assert KV_BYTES == HOST_BLOCKS * BLOCK_BYTES  # the twin's host tier is the real one's
assert conftest.POOL_BLOCKS == POOL_BLOCKS  # ... and its pool's bound


@pytest.fixture(scope="module")
def real_pair(pool_fidelity_bed, kv_events):
    """The session's ``pool-fidelity`` bed (tests/vllm/conftest.py): f1 and f2 share a pool of
    their own, empty at the start."""
    return pool_fidelity_bed.replicas, kv_events


def _pool_stored(events: EventCollector, topic: str) -> set[int]:
    return {k for b in events.snapshot(topic) for e in b.events
            if isinstance(e, BlockStored) and is_pool_event(e) for k in e.block_hashes}  # fmt: skip


def _real_calls(reps, events: EventCollector) -> list[dict]:
    out = []
    with httpx.Client(timeout=120) as http:
        for i, prompt in pool_sequence():
            r = reps[i]
            before = cached_by_source(http.get(r.url + "/metrics").text)
            n_pool = len(_pool_stored(events, r.topic))
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
            resp = http.post(r.url + "/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            usage = resp.json()["usage"]
            after = cached_by_source(http.get(r.url + "/metrics").text)
            # its blocks reach the pool (asynchronous writes) before the next call
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and len(_pool_stored(events, r.topic)) <= n_pool:
                time.sleep(0.25)
            out.append(
                {
                    "prompt_tokens": usage["prompt_tokens"],
                    "cached": usage["prompt_tokens_details"]["cached_tokens"],
                    "by_source": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after},
                }
            )
    return out


async def _twin_calls() -> list[dict]:
    from tests.integration.test_twin_pool import run_sequence

    async with start_cluster(2, PROFILE) as c, httpx.AsyncClient(timeout=60) as h:
        return await run_sequence(h, c.urls)


def test_the_twin_pool_gives_real_vllms_cached_tokens_by_source_call_by_call(real_pair):
    reps, events = real_pair
    real = _real_calls(reps, events)
    twin = asyncio.run(_twin_calls())
    report = {"real": real, "twin": twin}
    assert [x["prompt_tokens"] for x in real] == [x["prompt_tokens"] for x in twin], report
    assert [x["cached"] for x in real] == [x["cached"] for x in twin], report
    assert real[2]["cached"] > 0, report  # the pool served the other replica
    for r, t in zip(real, twin, strict=True):
        for src in ("device", "host", "disk"):
            assert r["by_source"].get(src, 0.0) == t["by_source"].get(src, 0.0), report
