"""Real clients against the router in front of replica twins: the OpenAI SDK (chat with tools
and ``tool_choice`` auto, Responses streamed and not) and the Anthropic SDK (Messages streamed
and not, ``count_tokens``, error types) — the APIs Claude Code and Codex speak."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from loadtest.twin.cluster import start_cluster

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.timeout(90)

LS = {"type": "object", "properties": {"path": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "ls", "description": "list", "parameters": LS}}]


@pytest.fixture()
async def base(router) -> AsyncIterator[str]:
    async with start_cluster(2, "cpu-tiny", enable_auto_tool_choice=True) as c:
        url, _ = await router(list(c.urls), policy="session_affinity")
        yield url


async def test_openai_sdk_chat_with_auto_tools_and_responses(base: str) -> None:
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "list the files"}]
    r = await client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS,
                                             tool_choice="auto", max_tokens=4)  # fmt: skip
    assert r.choices[0].message.content and r.usage.prompt_tokens > 0
    chunks = [c async for c in await client.chat.completions.create(
        model="tiny", messages=msgs, tools=TOOLS, max_tokens=4, stream=True)]  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    resp = await client.responses.create(model="tiny", input="hello there",
                                         instructions="be brief", max_output_tokens=5)  # fmt: skip
    assert resp.output_text and resp.usage.output_tokens == 5 and resp.usage.input_tokens > 0
    events = [e async for e in await client.responses.create(
        model="tiny", input=[{"role": "user", "content": "hi"}], max_output_tokens=3,
        stream=True, tools=[{"type": "function", "name": "ls", "parameters": {}}])]  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.incomplete",
                                                            "response.completed")  # fmt: skip
    assert kinds.count("response.output_text.delta") == 3
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_anthropic_sdk_messages_stream_count_tokens_and_errors(base: str) -> None:
    client = anthropic.AsyncAnthropic(base_url=base, api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    m = await client.messages.create(model="tiny", max_tokens=4, messages=msgs,
                                     system="you are terse")  # fmt: skip
    assert m.type == "message" and m.content[0].type == "text" and m.content[0].text
    assert m.usage.output_tokens == 4 and m.stop_reason == "max_tokens"
    async with client.messages.stream(
        model="tiny", max_tokens=3, messages=msgs,
        tools=[{"name": "ls", "description": "list", "input_schema": {"type": "object"}}],
    ) as stream:  # fmt: skip
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text and final.usage.output_tokens == 3
    n = await client.messages.count_tokens(model="tiny", messages=msgs)
    assert n.input_tokens > 0
    with pytest.raises(anthropic.NotFoundError) as ei:
        await client.messages.create(model="nope", max_tokens=2, messages=msgs)
    assert ei.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as eb:
        await client.messages.create(model="tiny", max_tokens=2, messages=[])
    assert eb.value.body["error"]["type"] == "invalid_request_error"


async def test_token_metrics_equal_the_replies_usage(base: str) -> None:
    """What ``kvroute_prompt_tokens_total`` / ``_cached_total`` count is what the clients were
    told: Anthropic's prompt is input + cache read + cache creation, Responses' cached tokens
    are in ``input_tokens_details``; streamed and not."""
    ant = anthropic.AsyncAnthropic(base_url=base, api_key="none", max_retries=0)
    oai = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    prompt = cached = 0
    msgs = [{"role": "user", "content": "summarize the repository layout " * 20}]
    for _ in range(2):  # the second call finds the first one's prefix cached
        m = await ant.messages.create(model="tiny", max_tokens=3, messages=msgs, system="terse")
        u = m.usage
        prompt += u.input_tokens + (u.cache_read_input_tokens or 0)
        prompt += u.cache_creation_input_tokens or 0
        cached += u.cache_read_input_tokens or 0
        async with ant.messages.stream(model="tiny", max_tokens=3, messages=msgs,
                                       system="terse") as stream:  # fmt: skip
            u = (await stream.get_final_message()).usage
        prompt += u.input_tokens + (u.cache_read_input_tokens or 0)
        prompt += u.cache_creation_input_tokens or 0
        cached += u.cache_read_input_tokens or 0
        ask = {"model": "tiny", "input": "list the tests " * 20, "max_output_tokens": 3}
        r = await oai.responses.create(**ask)
        prompt += r.usage.input_tokens
        cached += r.usage.input_tokens_details.cached_tokens
        events = [e async for e in await oai.responses.create(**ask, stream=True)]
        done = events[-1].response
        prompt += done.usage.input_tokens
        cached += done.usage.input_tokens_details.cached_tokens
    assert cached > 0
    async with httpx.AsyncClient() as http:
        text = (await http.get(base + "/metrics")).text
    assert f'kvroute_prompt_tokens_total{{model="tiny"}} {float(prompt)}' in text
    assert f'kvroute_prompt_tokens_cached_total{{model="tiny"}} {float(cached)}' in text
