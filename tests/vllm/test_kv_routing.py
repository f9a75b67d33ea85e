"""kv_cost in front of the real vLLM-CPU bed: calls go where their blocks are (by cached_tokens),
and a replica whose cache was reset stops being preferred.

The router's block index is fed from the bed's own KV events (the session collector owns the
socket the replicas connect to, so the test hands its decoded batches to the index); the
router's tokens and block keys come from its own chat rendering + incremental tokenizer, so
a match here also proves they equal what vLLM hashed.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from router.app import build_app, start_site
from router.config import RouterConfig
from router.kv.config import KVConfig
from router.kv.state import KVState
from router.vllm.kvevents import AllBlocksCleared, BlockStored
from router.vllm.tokenizer import ModelTokenizer
from tests.vllm.conftest import BLOCK_SIZE, unique_text

pytestmark = pytest.mark.timeout(240)


class Bridge:
    """Applies the collector's decoded batches to the router's index, in order."""

    def __init__(self, st: KVState, kv_events, replicas):
        self.st, self.ev = st, kv_events
        self.topics = {r.topic: r.url for r in replicas}
        self.done = dict.fromkeys(self.topics, 0)

    def pump(self) -> None:
        for topic, url in self.topics.items():
            batches = self.ev.snapshot(topic)
            for b in batches[self.done[topic] :]:
                self.st.index.apply(url, b.events)
            self.done[topic] = len(batches)

    async def until_stored(self, topic: str, keys: list[int]) -> None:
        want = set(keys)
        await asyncio.to_thread(
            self.ev.wait_for,
            topic,
            lambda bs: (
                want
                <= {
                    k
                    for b in bs
                    for e in b.events
                    if isinstance(e, BlockStored)
                    for k in e.block_hashes
                }
            ),
            60,
        )
        self.pump()

    async def until_cleared(self, topic: str, after: int) -> None:
        await asyncio.to_thread(
            self.ev.wait_for,
            topic,
            lambda bs: any(isinstance(e, AllBlocksCleared) for b in bs[after:] for e in b.events),
            30,
        )
        self.pump()


async def post(http: aiohttp.ClientSession, url: str, body: dict | None = None) -> int:
    async with http.post(url, json=body) as r:
        await r.read()
        return r.status


def chat(content: str, **kw) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 2,
        "temperature": 0,
        **kw,
    }


EXPLAINED: list[dict] = []  # the last decisions' explain payloads (for failure messages)


async def routed(http, url, body, session) -> tuple[str, int]:
    hdr = {"x-claude-code-session-id": session, "X-Admin-Key": "adm"}
    async with http.post(url + "/admin/route?explain=1", json=body, headers=hdr) as r:
        explained = await r.json()
        winner = explained["winner"]
    EXPLAINED[:] = [explained]
    async with http.post(url + "/v1/chat/completions", json=body, headers=hdr) as r:
        assert r.status == 200, await r.text()
        usage = (await r.json())["usage"]
    return winner, usage["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture()
async def router(vllm_bed, kv_events, tiny_model):
    urls = [r.url for r in vllm_bed]
    st = KVState(
        KVConfig(block_size=BLOCK_SIZE, profile="cpu-tiny"),
        tokenizer=ModelTokenizer.from_dir(tiny_model),
    )
    bridge = Bridge(st, kv_events, list(vllm_bed))
    bridge.pump()  # everything the bed published so far
    app = build_app(
        RouterConfig(replicas=urls, policy="kv_cost", admin_key="adm", metrics_interval_s=0.2),
        kv=st,
    )
    runner, url = await start_site(app)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        yield url, http, st, bridge
    await runner.cleanup()


def keys_of(st: KVState, body: dict) -> list[int]:
    text = st.tokenizer.render(body["messages"])
    return st.hasher.hash_keys(st.tokenizer.encode(text))


async def test_calls_go_where_their_blocks_are(router, vllm_bed):
    url, http, st, bridge = router
    by_name = {r.cfg.name: r for r in vllm_bed}
    for name, seed in (("b", 1), ("a", 2), ("b", 3)):
        rep = by_name[name]
        prefix = unique_text(1100, seed=1000 + seed)
        warm = chat(prefix)
        # KV only on `name`
        assert await post(http, rep.url + "/v1/chat/completions", warm) == 200
        await bridge.until_stored(rep.topic, keys_of(st, warm)[:-1])
        # a new session that shares the prefix: only the blocks can point to `name`
        body = chat(
            prefix,
            messages=[
                {"role": "user", "content": prefix},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "and now the tests"},
            ],
        )
        winner, cached = await routed(http, url, body, f"fresh-{name}-{seed}")
        assert winner == rep.url
        assert cached >= 1000  # vLLM confirms: the prefix was served from its cache
        # the same session's next call stays where its (now longer) prefix is
        await bridge.until_stored(rep.topic, keys_of(st, body)[:-1])
        body["messages"] += [
            {"role": "assistant", "content": "done"},
            {"role": "user", "content": "thanks"},
        ]
        winner2, cached2 = await routed(http, url, body, f"fresh-{name}-{seed}")
        assert winner2 == rep.url and cached2 >= cached


async def test_reset_replica_is_no_longer_preferred(router, vllm_bed):
    url, http, st, bridge = router
    a, b = (next(r for r in vllm_bed if r.cfg.name == n) for n in ("a", "b"))
    prefix = unique_text(1200, seed=77)
    half = " ".join(prefix.split()[:500])
    assert await post(http, a.url + "/v1/chat/completions", chat(prefix)) == 200
    assert await post(http, b.url + "/v1/chat/completions", chat(half)) == 200
    await bridge.until_stored(a.topic, keys_of(st, chat(prefix))[:-1])
    await bridge.until_stored(b.topic, keys_of(st, chat(half))[:-1])
    body = chat(prefix + " what next")
    winner, cached = await routed(http, url, body, "reset-1")
    assert winner == a.url and cached >= 1100
    seen = len(bridge.ev.snapshot(a.topic))
    assert await post(http, a.url + "/reset_prefix_cache") == 200
    # vLLM queues AllBlocksCleared and publishes it with the next engine step's events
    assert (
        await post(
            http, a.url + "/v1/completions", {"model": "tiny", "prompt": "flush", "max_tokens": 1}
        )
        == 200
    )
    await bridge.until_cleared(a.topic, seen)
    assert st.index.match(keys_of(st, body), [a.url]) == {}
    winner, cached = await routed(http, url, chat(prefix + " and again"), "reset-2")
    # b still has the first ~500 words (failed once in a full run, 2026-12-04, a chosen, not
    # reproduced alone: the decision's explain payload is in the message for the next one)
    assert winner == b.url and cached >= 400, (winner, cached, b.url, EXPLAINED)
