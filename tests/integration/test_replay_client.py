"""The replay client's verdict on how a stream ended (real aiohttp servers on loopback)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from loadtest.replay.client import stream_chat

TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'


def _server(body: bytes) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(body)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


@pytest.mark.parametrize(
    ("body", "ok", "error"),
    [
        (TOKEN * 2 + USAGE + b"data: [DONE]\n\n", True, None),
        (TOKEN * 2, False, "truncated"),  # the replica went away mid-stream
        (
            TOKEN
            + b'data: {"error":{"message":"EngineCore died","code":500}}\n\n'
            + b"data: [DONE]\n\n",
            False,
            "stream error",
        ),
    ],
)
async def test_only_a_stream_that_finished_counts_as_ok(body, ok, error):
    runner = web.AppRunner(_server(body))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as http:
            res = await stream_chat(http, url + "/v1/chat/completions",
                                    {"model": "m", "messages": []}, {})  # fmt: skip
        assert res.ok is ok
        assert (res.error is None) if error is None else (error in res.error)
    finally:
        await runner.cleanup()


def _paced_server() -> web.Application:
    """Streams 2 tokens 20 ms apart; a call asking for 7 tokens hangs for 10 s first."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["vllm_xargs"]["kvroute_twin_output_tokens"] == 7:  # the recorded length
            await asyncio.sleep(10.0)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(2):
            await asyncio.sleep(0.02)
            await resp.write(TOKEN)
        await resp.write(USAGE + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


@pytest.mark.timeout(60)
async def test_bounded_replay_marks_cut_sessions_and_honours_absolute_turn_times(tmp_path):
    from loadtest import tinymodel
    from loadtest.prompts import PromptBuilder
    from loadtest.replay.records import CallRecord, SessionRecord, read_jsonl
    from loadtest.replay.runner import ReplayConfig, replay
    from loadtest.traces import Call, Dep, Session, Trace

    def call(cid: str, out: int = 2, **kw) -> Call:
        return Call(cid, "main", (1, 2), 100, out, **kw)

    trace = Trace(
        "t",
        64,
        [
            Session("done", [call("done/0"), call("done/1", deps=(Dep("done/0"),))]),
            # an absolute turn time (aiperf timestamp): 1 s after the session start
            Session("abs", [call("abs/0"), call("abs/1", deps=(Dep("abs/0"),), not_before_s=1.0)]),
            # the second call is due long after the 2 s bound: never starts
            Session("gap", [call("gap/0"), call("gap/1", deps=(Dep("gap/0", 30.0),))]),
            # in flight at the bound, cancelled after the grace
            Session("hang", [call("hang/0", out=7)]),
        ],
    )
    runner = web.AppRunner(_paced_server())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        builder = PromptBuilder(tinymodel.ensure(), block_size=32, trace_block_size=64)
        cfg = ReplayConfig(target=url, model="m", concurrency=4, duration_s=2.0, grace_s=0.3,
                           max_plays=4, convention="none", progress=False)  # fmt: skip
        summary = await replay(trace, builder, cfg, tmp_path)
    finally:
        await runner.cleanup()
    plays = {s.session: s for s in read_jsonl(tmp_path / "sessions.jsonl", SessionRecord)}
    assert plays["done"].complete and plays["abs"].complete
    assert plays["gap"].cut and plays["hang"].cut
    assert not plays["done"].cut and not plays["abs"].cut
    calls = {c.call: c for c in read_jsonl(tmp_path / "calls.jsonl", CallRecord)}
    assert calls["abs/1"].t_start >= plays["abs"].t_start + 1.0
    # the wait was the turn time's: abs/0 (~40 ms) ended long before it (bounds with room for
    # a loaded machine, far from the 1 s turn time and the 2 s bound)
    assert calls["abs/0"].t_end < plays["abs"].t_start + 0.8
    assert "gap/1" not in calls and calls["hang/0"].error.startswith("cancelled")
    assert summary["sessions_completed"] == 2 and summary["sessions_unfinished"] == 2
    assert summary["sessions_failed"] == 0 and summary["requests_cancelled"] == 1
    # the unfinished plays ran from their start until the bound (+ grace) stopped them: not
    # before the 2 s bound, and long before the hanging call's 10 s would have ended them
    assert 1.9 < summary["session_unfinished_elapsed_max_s"] < 8.0
    assert summary["session_completion_p90_lower_bound_s"] > summary["session_completion_p90_s"]
