"""The router counts a call's prompt as prefill queued on its replica from the decision until
the answer's first byte — for a Responses stream, the first byte after vLLM's opening
``response.created`` / ``response.in_progress`` events — and not after."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from costmodel.profiles import load_profile
from loadtest import tinymodel
from loadtest.twin.cluster import start_cluster
from router.app import build_app, start_site
from router.config import RouterConfig
from router.kv.config import KVConfig
from router.kv.state import KVState
from router.relay import response_head
from router.vllm.tokenizer import ModelTokenizer

pytestmark = pytest.mark.timeout(60)
WORDS = tinymodel._WORDS
PROF = load_profile("cpu-tiny")


def words(n: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7919 + i * 104729) % len(WORDS)] for i in range(n))


def test_response_head_is_only_the_opening_events():
    head = b"event: response.created\ndata: {}\n\nevent: response.in_progress\ndata: {}\n\n"
    assert response_head(head)
    assert not response_head(head + b"event: response.output_item.added\ndata: {}\n\n")
    assert not response_head(b'data: {"choices": []}\n\n') and not response_head(b"")


async def test_prompt_counts_as_queued_prefill_until_the_first_byte():
    model = tinymodel.ensure()
    st = KVState(KVConfig(block_size=PROF.block_size, profile="cpu-tiny"),
                 tokenizer=ModelTokenizer.from_dir(model), profile=PROF)  # fmt: skip
    # speedup 0.25: a 3,000-token prefill takes ~0.6 s, long enough to look at it
    async with start_cluster(1, PROF, speedup=0.25) as c:
        app = build_app(RouterConfig(replicas=c.urls, policy="kv_cost", health_interval_s=30),
                        kv=st)  # fmt: skip
        runner, url = await start_site(app)
        try:
            async with aiohttp.ClientSession() as http:
                bodies = [
                    ("/v1/chat/completions", {"messages": [
                        {"role": "user", "content": words(3000, 1)}], "max_tokens": 2}),
                    ("/v1/responses", {"input": words(3000, 2), "max_output_tokens": 16}),
                ]  # fmt: skip
                for path, body in bodies:
                    body = {"model": "tiny", "stream": True, **body}
                    async with http.post(url + path, json=body) as r:
                        assert r.status == 200  # the head comes at once; prefill goes on
                        ((n, tokens),) = st.pending_prefill().values()
                        assert n == 1 and tokens > 2500, (path, tokens)
                        seen = b""
                        if path == "/v1/responses":  # the opening events come at once
                            seen = await r.content.readany()
                            assert response_head(seen), seen[:200]
                            await asyncio.sleep(0.1)
                            assert st.pending_prefill(), "a head event is not the first token"
                        while b"output_item.added" not in seen and b'"content":"' not in seen:
                            seen += await r.content.readany()
                        await asyncio.sleep(0.05)
                        assert st.pending_prefill() == {}, path  # the first token came
                        await r.read()
        finally:
            await runner.cleanup()
            await st.close()
