"""A twin ends turns like a model (issue 44): replies end by themselves with ``stop`` /
``end_turn`` / ``completed`` at a drawn or expected length, at the cap with ``length`` /
``max_tokens`` / ``incomplete``; the expected length counts on every API; tools are served by
default and called in each API's shape, streamed and not, so an agent loop runs a tool and
comes back; the CLI's defaults serve an agent."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import httpx
import jsonschema
import orjson
import pytest

from loadtest import tinymodel
from loadtest.twin import TWIN_OUTPUT_FIELD, expect_key
from loadtest.twin.cluster import start_cluster

pytestmark = pytest.mark.timeout(120)
WORDS = tinymodel._WORDS
SPEEDUP = 50.0  # cpu-tiny decodes ~1.5 ms a token: a few hundred tokens take ~10 ms here


def text(n: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 131 + i * 17) % len(WORDS)] for i in range(n))


READ = {"type": "object", "additionalProperties": False, "required": ["path", "limit"],
        "properties": {"path": {"type": "string"}, "limit": {"type": "integer", "minimum": 5},
                       "mode": {"type": "string", "enum": ["a", "b"]}}}  # fmt: skip
CHAT_TOOLS = [{"type": "function", "function": {"name": "read", "parameters": READ}}]
ANTHROPIC_TOOLS = [{"name": "read", "description": "read a file", "input_schema": READ},
                   {"type": "web_search_20250305", "name": "web_search"}]  # fmt: skip
RESPONSES_TOOLS = [{"type": "function", "name": "read", "parameters": READ},
                   {"type": "web_search"}]  # fmt: skip


@pytest.fixture()
async def twin() -> AsyncIterator:
    async with start_cluster(1, "cpu-tiny", speedup=SPEEDUP) as c:
        yield c


@pytest.fixture()
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=60) as c:
        yield c


def sse(raw: bytes) -> list[dict]:
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            out.append(orjson.loads(line[6:]))
    return out


async def post(http: httpx.AsyncClient, url: str, body: dict) -> dict:
    r = await http.post(url, json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def stream(http: httpx.AsyncClient, url: str, body: dict) -> list[dict]:
    async with http.stream("POST", url, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        return sse(await r.aread())


def chat(content: str, **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **kw}


def messages(content: str, **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **kw}


# ---- how a reply ends -----------------------------------------------------------------------


async def chat_end(http, url, body) -> tuple[str, int, str, int]:
    """(finish_reason, tokens) non-streamed, then streamed."""
    j = await post(http, url + "/v1/chat/completions", body)
    s = await stream(http, url + "/v1/chat/completions",
                     {**body, "stream_options": {"include_usage": True}})  # fmt: skip
    reasons = [c["choices"][0]["finish_reason"] for c in s if c["choices"]]
    assert all(r is None for r in reasons[:-1])
    return (j["choices"][0]["finish_reason"], j["usage"]["completion_tokens"], reasons[-1],
            s[-1]["usage"]["completion_tokens"])  # fmt: skip


async def messages_end(http, url, body) -> tuple[str, int, str, int]:
    j = await post(http, url + "/v1/messages", body)
    s = await stream(http, url + "/v1/messages", body)
    delta = next(e for e in s if e["type"] == "message_delta")
    return (j["stop_reason"], j["usage"]["output_tokens"], delta["delta"]["stop_reason"],
            delta["usage"]["output_tokens"])  # fmt: skip


async def responses_end(http, url, body) -> tuple[str, int, str, int]:
    j = await post(http, url + "/v1/responses", body)
    s = await stream(http, url + "/v1/responses", body)
    last = s[-1]
    assert last["type"] == "response." + last["response"]["status"]
    return (j["status"], j["usage"]["output_tokens"], last["response"]["status"],
            last["response"]["usage"]["output_tokens"])  # fmt: skip


async def test_replies_end_by_themselves_on_every_api(twin, http):
    """No override, no ignore_eos, a cap far away: every API ends the reply at the length
    the twin drew for that prompt (the same streamed or not, and on a second try), with the
    API's own end-of-turn reason — the cap never comes into it."""
    url = twin.urls[0]
    lengths = []
    for seed in range(3):
        c = await chat_end(http, url, chat(text(40, seed), max_tokens=3000))
        assert c[0] == c[2] == "stop" and c[1] == c[3] < 3000, c
        m = await messages_end(http, url, messages(text(40, seed), max_tokens=3000))
        assert m[0] == m[2] == "end_turn" and m[1] == m[3] < 3000, m
        r = await responses_end(http, url, {"model": "tiny", "input": text(40, seed)})  # no cap
        assert r[0] == r[2] == "completed" and r[1] == r[3] < 3000, r
        assert (await chat_end(http, url, chat(text(40, seed), max_tokens=3000)))[1] == c[1]
        lengths += [c[1], m[1], r[1]]
    done = await post(http, url + "/v1/completions",
                      {"model": "tiny", "prompt": text(40, 9), "max_tokens": 3000})  # fmt: skip
    assert done["choices"][0]["finish_reason"] == "stop"
    assert len(set(lengths)) >= 3  # drawn per prompt (the same prompt, the same length)


async def test_the_cap_ends_a_reply_with_length_max_tokens_incomplete(twin, http):
    url = twin.urls[0]
    over = {"vllm_xargs": {TWIN_OUTPUT_FIELD: 50}}  # the reply would go on to 50
    assert await chat_end(http, url, chat(text(30, 1), max_tokens=3, **over)) == (
        "length", 3, "length", 3)  # fmt: skip
    assert await messages_end(http, url, messages(text(30, 1), max_tokens=3, **over)) == (
        "max_tokens", 3, "max_tokens", 3)  # fmt: skip
    body = {"model": "tiny", "input": text(30, 1), "max_output_tokens": 3, **over}
    assert await responses_end(http, url, body) == ("incomplete", 3, "incomplete", 3)
    j = await post(http, url + "/v1/responses", body)
    assert j["incomplete_details"] == {"reason": "max_output_tokens"}
    # ignore_eos runs to the cap, as vLLM (benchmarks that want exact lengths send it)
    assert await chat_end(http, url, chat(text(30, 2), max_tokens=40, ignore_eos=True)) == (
        "length", 40, "length", 40)  # fmt: skip


async def test_the_expected_length_counts_on_every_api(twin, http):
    """The replay's override (vllm_xargs, or registered out of band at /twin/expect) ends
    the reply there on chat, Messages and Responses alike (it used to be dropped on the
    last two), and a cap above it leaves the end to the reply."""
    url = twin.urls[0]
    xargs = {"vllm_xargs": {TWIN_OUTPUT_FIELD: 7}}
    c = await chat_end(http, url, chat(text(30, 3), max_tokens=50, **xargs))
    m = await messages_end(http, url, messages(text(30, 3), max_tokens=50, **xargs))
    body = {"model": "tiny", "input": text(30, 3), "max_output_tokens": 50, **xargs}
    r = await responses_end(http, url, body)
    assert [c[1::2], m[1::2], r[1::2]] == [(7, 7)] * 3  # the lengths, streamed and not
    assert [c[::2], m[::2], r[::2]] == [("stop",) * 2, ("end_turn",) * 2, ("completed",) * 2]
    for path, body in (
        ("/v1/messages", messages(text(30, 4), max_tokens=50)),
        ("/v1/responses", {"model": "tiny", "input": text(30, 4), "max_output_tokens": 50}),
    ):
        r = await http.post(
            url + "/twin/expect", json={"key": expect_key(body), "output_tokens": 5}
        )
        assert r.status_code == 200
        j = await post(http, url + path, body)
        assert j["usage"]["output_tokens"] == 5, (path, j["usage"])


async def test_replayed_calls_produce_exactly_their_recorded_tokens(twin, http):
    """The two bodies the replay sends (loadtest/replay/runner.py): ``twin`` mode (the agents'
    cap, ignore_eos and the recorded length in vllm_xargs) and ``max_tokens`` mode (the
    recorded length as max_tokens, with ignore_eos, for real replicas)."""
    url = twin.urls[0]
    for n in (1, 13, 400):
        twin_mode = chat(text(30, n), max_tokens=3000, ignore_eos=True,
                         vllm_xargs={TWIN_OUTPUT_FIELD: n})  # fmt: skip
        assert await chat_end(http, url, twin_mode) == ("stop", n, "stop", n)
        oracle = chat(text(30, n), max_tokens=n, ignore_eos=True)
        assert await chat_end(http, url, oracle) == ("length", n, "length", n)


# ---- tool calls -----------------------------------------------------------------------------


def _args_ok(args: dict) -> None:
    jsonschema.validate(args, READ)


async def test_tool_calls_in_the_chat_shape_streamed_and_not(twin, http):
    url = twin.urls[0] + "/v1/chat/completions"
    body = chat(text(30, 5), tools=CHAT_TOOLS, tool_choice="required", max_tokens=3000)
    j = await post(http, url, body)
    choice = j["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] is None and len(msg["tool_calls"]) == 1
    call = msg["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "read"
    assert call["id"].startswith("chatcmpl-tool-")
    _args_ok(orjson.loads(call["function"]["arguments"]))
    chunks = await stream(http, url, {**body, "stream_options": {"include_usage": True}})
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
    first = deltas[1]["delta"]["tool_calls"][0]
    assert first["function"]["name"] == "read" and first["id"].startswith("chatcmpl-tool-")
    args = "".join(d["delta"].get("tool_calls", [{}])[0].get("function", {}).get("arguments", "")
                   for d in deltas[1:])  # fmt: skip
    _args_ok(orjson.loads(args))
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert chunks[-1]["usage"]["completion_tokens"] == j["usage"]["completion_tokens"]
    assert len(deltas) <= 1 + j["usage"]["completion_tokens"]  # at most a chunk per token


async def test_tool_calls_in_the_anthropic_shape_streamed_and_not(twin, http):
    url = twin.urls[0] + "/v1/messages"
    body = messages(text(30, 6), tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"},
                    max_tokens=3000)  # fmt: skip
    j = await post(http, url, body)
    assert j["stop_reason"] == "tool_use" and len(j["content"]) == 1
    block = j["content"][0]
    assert block["type"] == "tool_use" and block["name"] == "read"  # not the server tool
    assert block["id"].startswith("toolu_")
    _args_ok(block["input"])
    events = await stream(http, url, body)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = events[1]["content_block"]
    assert start["type"] == "tool_use" and start["name"] == "read" and start["input"] == {}
    partial = "".join(e["delta"]["partial_json"] for e in events
                      if e["type"] == "content_block_delta")  # fmt: skip
    assert all(e["delta"]["type"] == "input_json_delta" for e in events
               if e["type"] == "content_block_delta")  # fmt: skip
    _args_ok(orjson.loads(partial))
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    assert events[-2]["usage"]["output_tokens"] == j["usage"]["output_tokens"]


async def test_tool_calls_in_the_responses_shape_streamed_and_not(twin, http):
    url = twin.urls[0] + "/v1/responses"
    body = {"model": "tiny", "input": text(30, 7), "tools": RESPONSES_TOOLS,
            "tool_choice": "required"}  # fmt: skip
    j = await post(http, url, body)
    assert j["status"] == "completed" and len(j["output"]) == 1
    item = j["output"][0]
    assert item["type"] == "function_call" and item["name"] == "read"
    assert item["status"] == "completed" and item["call_id"].startswith("call_")
    _args_ok(orjson.loads(item["arguments"]))
    events = await stream(http, url, body)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]  # fmt: skip
    assert events[2]["item"]["type"] == "function_call" and events[2]["item"]["arguments"] == ""
    args = "".join(e["delta"] for e in events
                   if e["type"] == "response.function_call_arguments.delta")  # fmt: skip
    assert args == events[-3]["arguments"]
    _args_ok(orjson.loads(args))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"]["output"][0]["call_id"] == events[-2]["item"]["call_id"]


async def test_tool_choice_none_named_and_unknown(twin, http):
    url = twin.urls[0]
    for i in range(6):
        j = await post(http, url + "/v1/chat/completions",
                       chat(text(30, 20 + i), tools=CHAT_TOOLS, tool_choice="none",
                            max_tokens=3000))  # fmt: skip
        assert j["choices"][0]["finish_reason"] == "stop"
        assert j["choices"][0]["message"]["tool_calls"] == []
    named = {"type": "function", "function": {"name": "read"}}
    body = chat(text(30, 8), tools=CHAT_TOOLS, tool_choice=named, max_tokens=3000)
    j = await post(http, url + "/v1/chat/completions", body)
    assert j["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "read"
    bad = {"type": "function", "function": {"name": "write"}}
    r = await http.post(url + "/v1/chat/completions",
                        json=chat("hi", tools=CHAT_TOOLS, tool_choice=bad))  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = await http.post(
        url + "/v1/messages",
        json=messages(
            "hi", max_tokens=5, tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "x"}
        ),
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"  # Anthropic-shaped


async def test_tools_with_auto_choice_are_served_by_default_and_called_some_of_the_time(http):
    """The default twin (no flag) serves tools with tool_choice auto (a bare vLLM answers
    400) and calls one in about half of its first replies, a fifth right after a result."""
    async with start_cluster(1, "cpu-tiny", speedup=SPEEDUP) as c:
        url = c.urls[0] + "/v1/chat/completions"
        first, after = [], []
        for i in range(16):
            msgs = [{"role": "user", "content": text(20, 40 + i)}]
            j = await post(http, url, {"model": "tiny", "messages": msgs, "tools": CHAT_TOOLS,
                                       "max_tokens": 3000})  # fmt: skip
            first.append(j["choices"][0]["finish_reason"])
            msgs += [{"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function",
                          "function": {"name": "read", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c1",
                      "content": text(30, 60 + i)}]  # fmt: skip
            j = await post(http, url, {"model": "tiny", "messages": msgs, "tools": CHAT_TOOLS,
                                       "max_tokens": 3000})  # fmt: skip
            after.append(j["choices"][0]["finish_reason"])
    assert set(first) == {"stop", "tool_calls"}, first
    assert first.count("tool_calls") > after.count("tool_calls"), (first, after)
    assert set(first) | set(after) <= {"stop", "tool_calls"}


# ---- an agent loop through the router, with the real SDKs -----------------------------------

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")


@pytest.fixture()
async def routed(router) -> AsyncIterator[str]:
    """kvroute in front of a twin that calls a tool on every first reply and answers in text
    after a result: the agent loop below is then deterministic."""
    async with start_cluster(1, "cpu-tiny", speedup=SPEEDUP, tool_call_rate=1.0,
                             tool_call_rate_after_result=0.0) as c:  # fmt: skip
        url, _ = await router(list(c.urls), policy="session_affinity")
        yield url


async def test_an_openai_chat_agent_runs_a_tool_and_comes_back(routed):
    client = openai.AsyncOpenAI(base_url=routed + "/v1", api_key="none", max_retries=0)
    msgs: list[dict] = [{"role": "user", "content": "read the notes"}]
    ran = 0
    for _ in range(4):
        stream_ = await client.chat.completions.create(
            model="tiny", messages=msgs, tools=CHAT_TOOLS, max_tokens=2000, stream=True
        )
        calls: dict[int, dict] = {}
        text_, finish = "", None
        async for ch in stream_:
            d = ch.choices[0].delta
            text_ += d.content or ""
            for tc in d.tool_calls or ():
                c = calls.setdefault(tc.index, {"id": "", "name": "", "args": ""})
                c["id"] += tc.id or ""
                c["name"] += (tc.function and tc.function.name) or ""
                c["args"] += (tc.function and tc.function.arguments) or ""
            finish = ch.choices[0].finish_reason or finish
        if finish != "tool_calls":
            break
        ran += 1
        c = calls[0]
        _args_ok(orjson.loads(c["args"]))
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
                    {"id": c["id"], "type": "function",
                     "function": {"name": c["name"], "arguments": c["args"]}}]},
                 {"role": "tool", "tool_call_id": c["id"],
                  "content": "notes: " + text(40, 1)}]  # fmt: skip
    assert ran == 1 and finish == "stop" and text_


async def test_an_anthropic_agent_runs_a_tool_and_comes_back(routed):
    client = anthropic.AsyncAnthropic(base_url=routed, api_key="none", max_retries=0)
    msgs: list[dict] = [{"role": "user", "content": "read the notes"}]
    m = await client.messages.create(model="tiny", max_tokens=2000, messages=msgs,
                                     tools=ANTHROPIC_TOOLS[:1])  # fmt: skip
    assert m.stop_reason == "tool_use"
    use = m.content[0]
    _args_ok(use.input)
    msgs += [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": "notes: " + text(40, 2)}]}]  # fmt: skip
    async with client.messages.stream(model="tiny", max_tokens=2000, messages=msgs,
                                      tools=ANTHROPIC_TOOLS[:1]) as s:  # fmt: skip
        final = await s.get_final_message()
    assert final.stop_reason == "end_turn" and final.content[0].type == "text"
    assert final.content[0].text


async def test_a_responses_agent_runs_a_tool_and_comes_back(routed):
    client = openai.AsyncOpenAI(base_url=routed + "/v1", api_key="none", max_retries=0)
    tools = RESPONSES_TOOLS[:1]
    r = await client.responses.create(model="tiny", input="read the notes", tools=tools)
    call = r.output[0]
    assert r.status == "completed" and call.type == "function_call"
    _args_ok(orjson.loads(call.arguments))
    items = [
        {"role": "user", "content": "read the notes"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "notes"},
    ]
    events = [e async for e in await client.responses.create(model="tiny", input=items,
                                                             tools=tools, stream=True)]  # fmt: skip
    done = events[-1]
    assert done.type == "response.completed" and done.response.output[0].type == "message"
    assert done.response.output_text


# ---- defaults that serve an agent -----------------------------------------------------------


async def test_the_cli_defaults_serve_an_agent(http):
    """``kvroute twin`` / ``kvroute cluster`` with no flags: a profile whose window holds
    Codex's first prompt (11,520 tokens, above cpu-tiny's 4,096) and auto tool choice on."""
    from loadtest.cli_args import profile_from_args, reply_kwargs
    from loadtest.twin import cluster_cli, twin_cli

    for mod in (twin_cli, cluster_cli):
        p = argparse.ArgumentParser()
        mod.add_arguments(p)
        args = p.parse_args([])
        assert reply_kwargs(args)["enable_auto_tool_choice"] is True
        prof = profile_from_args(args)
        assert prof.max_model_len >= 128_000
        assert reply_kwargs(p.parse_args(["--no-enable-auto-tool-choice"])) == {
            **reply_kwargs(args), "enable_auto_tool_choice": False}  # fmt: skip
    async with start_cluster(1, prof, speedup=100.0, **reply_kwargs(args)) as c:
        models = (await http.get(c.urls[0] + "/v1/models")).json()
        assert models["data"][0]["max_model_len"] == prof.max_model_len
        body = chat(text(11_520, 3), tools=CHAT_TOOLS)  # Codex-sized, auto choice, no cap
        j = await post(http, c.urls[0] + "/v1/chat/completions", body)
        assert j["usage"]["prompt_tokens"] > 11_520
        assert j["choices"][0]["finish_reason"] in ("stop", "tool_calls")


async def test_streamed_messages_carry_the_cache_split_in_message_delta(twin, http) -> None:
    """As vLLM 0.32: ``message_start`` counts the whole prompt as input, ``message_delta``
    repeats the whole usage with the prefix hit as ``cache_read_input_tokens`` (Claude Code
    streams every call: without it a client and the router's metrics saw no cache hit)."""
    url = twin.urls[0] + "/v1/messages"
    body = messages(text(400, 7), max_tokens=4)
    await post(http, url, body)  # the prefix is cached now
    events = await stream(http, url, body)
    start = next(e for e in events if e["type"] == "message_start")["message"]["usage"]
    delta = next(e for e in events if e["type"] == "message_delta")["usage"]
    assert start == {"input_tokens": start["input_tokens"], "output_tokens": 0}
    assert delta["cache_read_input_tokens"] > 0
    assert delta["input_tokens"] + delta["cache_read_input_tokens"] == start["input_tokens"]
    assert 0 < delta["output_tokens"] <= 4
