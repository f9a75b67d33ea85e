"""The replay client's verdict on how a stream ended (real aiohttp servers on loopback)."""

from __future__ import annotations

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
