"""Two HTTP twins sharing one cluster pool, on the request sequence of the real pool's test.

``tests/vllm/test_engine_pool.py``'s first test on two twins of one ``kvroute cluster`` whose
profile has ``pool_kv_blocks`` (one :class:`loadtest.twin.engine.ClusterPool` for both): a
prompt computed on ``twin-0`` is served to ``twin-1`` from the pool (``cached_tokens``; vLLM's
by-source metric counts it as ``disk``, the twin's own as ``pool``), and the pool's KV events
(``medium`` STORAGE, ``locality`` REMOTE) put it in the router's index as reachable from both.
Without the pool the same call is a miss. ``tests/vllm/test_twin_pool_fidelity.py`` runs the
same sequence on real vLLM-CPU and on these twins and compares them call by call.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from costmodel.profiles import load_profile
from loadtest import tinymodel
from loadtest.twin.cluster import start_cluster
from loadtest.vllmbed import EventCollector
from router.kv.index import BlockIndex, is_pool_event
from router.vllm.hashing import BlockHasher
from router.vllm.kvevents import BlockRemoved, BlockStored
from router.vllm.metrics import cached_by_source

pytestmark = pytest.mark.timeout(60)

# the vllm tier's bed: 256 engine blocks of 32 tokens, an 8192-token host tier, a 256-block pool
HOST_BLOCKS = 256
POOL_BLOCKS = 256
PROFILE = load_profile("cpu-tiny").replace(cpu_kv_blocks=HOST_BLOCKS, pool_kv_blocks=POOL_BLOCKS)
TIER = "kvroute:twin_prompt_tokens_cached_by_tier_total"


def words(n: int, seed: int) -> str:
    """``tests.vllm.conftest.unique_text`` (the same prose for the same seed)."""
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(tinymodel._WORDS) for _ in range(n))


def pool_sequence() -> list[tuple[int, str]]:
    """(replica index, prompt) of the real pool test's first test: a ~2k-token prompt cold on
    replica 0, a short one of replica 1's own, then the first prompt on replica 1."""
    a = words(2000, seed=4301)
    return [(0, a), (1, words(300, seed=4302)), (1, a)]


def by_tier(text: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(rf'^{TIER}{{[^}}]*source="(\w+)"}} (\S+)$',
                                                   text, re.M)}  # fmt: skip


async def run_sequence(h: httpx.AsyncClient, urls: list[str]) -> list[dict]:
    """Each call of :func:`pool_sequence` on ``urls``: cached tokens, and the by-source split
    of vLLM's metric (and the twin's own, where exported) over that call."""
    out = []
    for i, prompt in pool_sequence():
        url = urls[i]
        m0 = (await h.get(url + "/metrics")).text
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        r = await h.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        m1 = (await h.get(url + "/metrics")).text
        b0, b1 = cached_by_source(m0), cached_by_source(m1)
        t0, t1 = by_tier(m0), by_tier(m1)
        out.append(
            {
                "replica": i,
                "prompt_tokens": usage["prompt_tokens"],
                "cached": usage["prompt_tokens_details"]["cached_tokens"],
                "by_source": {k: b1.get(k, 0.0) - b0.get(k, 0.0) for k in b1},
                "by_tier": {k: t1.get(k, 0.0) - t0.get(k, 0.0) for k in t1},
            }
        )
    return out


def _pool_keys(batches, cls) -> set[int]:
    return {k for b in batches for e in b.events if isinstance(e, cls) and is_pool_event(e)
            for k in e.block_hashes}  # fmt: skip


async def test_a_prefix_computed_on_one_twin_is_served_to_the_other_from_the_shared_pool():
    events = EventCollector()
    try:
        async with (
            start_cluster(2, PROFILE, kv_events=events.endpoint) as c,
            httpx.AsyncClient(timeout=30) as h,
        ):
            calls = await run_sequence(h, c.urls)
            a = pool_sequence()[0][1]
            toks = (await h.post(c.urls[0] + "/tokenize", json={"prompt": a})).json()["tokens"]
            keys = BlockHasher(PROFILE.block_size).hash_keys(toks)
            await asyncio.sleep(0.5)  # the last batches reach the collector
            snaps = [events.snapshot(t) for t in c.topics]
    finally:
        events.close()
    want = (len(toks) - 1) // PROFILE.block_size * PROFILE.block_size
    assert [x["cached"] for x in calls] == [0, 0, want], calls
    last = calls[2]
    # vLLM's metric: the pool is a STORAGE tier, source "disk"; the twin's own says "pool"
    assert last["by_source"].get("device", 0) == 0 and last["by_source"]["disk"] == want, last
    assert last["by_tier"]["pool"] == want and last["by_tier"]["disk"] == 0, last
    # twin-0 wrote a's blocks to the pool and said so (STORAGE, REMOTE); twin-1 wrote its own
    assert set(keys[:-1]) <= _pool_keys(snaps[0], BlockStored)
    assert _pool_keys(snaps[1], BlockStored)
    assert not _pool_keys(snaps[0], BlockRemoved)  # far below the pool's capacity
    ix = BlockIndex()
    for name, batches in zip(c.names, snaps, strict=True):
        for b in batches:
            ix.apply(name, b.events)
    assert sorted(ix.pool_members()) == sorted(c.names)


async def test_without_a_pool_the_other_twin_recomputes():
    prof = PROFILE.replace(pool_kv_blocks=0)
    async with start_cluster(2, prof) as c, httpx.AsyncClient(timeout=30) as h:
        calls = await run_sequence(h, c.urls)
    assert [x["cached"] for x in calls] == [0, 0, 0], calls


async def test_a_restarted_twin_comes_back_empty_and_reads_the_pool():
    async with start_cluster(2, PROFILE) as c, httpx.AsyncClient(timeout=30) as h:
        a = words(600, seed=77)
        body = {"model": "tiny", "prompt": a, "max_tokens": 4}
        r0 = (await h.post(c.urls[0] + "/v1/completions", json=body)).json()
        n = r0["usage"]["prompt_tokens"]
        r = await h.post(c.urls[0] + "/twin/disrupt", json={"action": "restart",
                                                             "downtime_s": 0.5})  # fmt: skip
        assert r.status_code == 200, r.text
        for _ in range(200):
            st = (await h.get(c.urls[0] + "/twin/disrupt")).json()
            if st["state"] == "up" and st["restarts"] == 1:
                break
            assert (await h.get(c.urls[0] + "/health")).status_code in (200, 503)
            await asyncio.sleep(0.02)
        assert st == {"state": "up", "restarts": 1}
        twin = c.replicas[0]
        assert not twin.engine.pool.cached and len(twin.engine.cpu) == 0  # empty
        r1 = (await h.post(c.urls[0] + "/v1/completions", json=body)).json()
        got = r1["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert got == (n - 1) // PROFILE.block_size * PROFILE.block_size
        assert twin.engine.cached_by_tier["pool"] == got  # from the pool, not HBM or host
        # the counters carried over the restart: both calls' prompts were looked up
        assert twin.engine.prefix_queries == 2 * n


async def test_a_lost_twin_refuses_calls_with_503_until_it_is_up():
    async with start_cluster(1, PROFILE) as c, httpx.AsyncClient(timeout=30) as h:
        url = c.urls[0]
        assert (await h.post(url + "/twin/disrupt", json={"action": "down"})).status_code == 200
        assert (await h.get(url + "/health")).status_code == 503
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 2}
        r = await h.post(url + "/v1/completions", json=body)
        assert r.status_code == 503 and "down" in r.json()["error"]["message"], r.text
        bad = await h.post(url + "/twin/disrupt", json={"action": "explode"})
        assert bad.status_code == 400
        assert (await h.post(url + "/twin/disrupt", json={"action": "up"})).status_code == 200
        assert (await h.post(url + "/v1/completions", json=body)).status_code == 200


async def _in_flight(twin) -> None:
    for _ in range(1000):
        if twin.streams:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the call never reached the engine")


async def test_a_call_in_flight_finishes_through_a_drain_and_is_cut_by_a_loss():
    async with start_cluster(1, PROFILE) as c, httpx.AsyncClient(timeout=30) as h:
        url = c.urls[0]
        body = {"model": "tiny", "prompt": words(300, seed=5), "max_tokens": 300,
                "ignore_eos": True}  # fmt: skip
        call = asyncio.create_task(h.post(url + "/v1/completions", json=body))
        await _in_flight(c.replicas[0])
        await h.post(url + "/twin/disrupt", json={"action": "restart"})
        r = await call
        assert r.status_code == 200, r.text  # the drain waited for it
        assert r.json()["usage"]["completion_tokens"] == 300
        for _ in range(200):
            if (await h.get(url + "/health")).status_code == 200:
                break
            await asyncio.sleep(0.02)
        call = asyncio.create_task(h.post(url + "/v1/completions", json=body))
        await _in_flight(c.replicas[0])
        await h.post(url + "/twin/disrupt", json={"action": "down"})
        r = await call
        assert r.status_code == 503, r.text  # lost with its replica
