# ruff: noqa: F811  (fixtures shared from test_router_proxy are imported by name)
"""Many concurrent streams through one router: every stream byte-exact, and the open file
descriptors go back once the streams end and pooled connections are released (issue 13; the
2,000 × 60 s figure is ``scripts/probe_streams.py``, docs/reliability.md)."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest

from tests.integration.test_router_proxy import fakes, router  # noqa: F401

pytestmark = pytest.mark.timeout(90)
N = 300


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_concurrent_streams_all_complete_and_release_their_sockets(fakes, router):
    chunks = [b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'] * 10 + [b"data: [DONE]\n\n"]
    reps = await fakes(2, chunks=chunks, chunk_delay_s=0.2)
    url, app = await router([r.url for r in reps], max_connections_per_replica=N)
    base = fds()
    body = {"model": "tiny", "messages": [], "stream": True}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def one(i: int) -> bool:
            async with s.post(url + "/v1/chat/completions", json=body,
                              headers={"x-session-id": f"s{i}"}) as r:  # fmt: skip
                return r.status == 200 and await r.read() == b"".join(chunks)

        ok = await asyncio.gather(*(one(i) for i in range(N)))
        peak = fds()
    assert all(ok) and peak > base
    # the router's pooled upstream connections are kept for reuse; closing the pool gives
    # every descriptor back (nothing leaked per stream)
    from router.keys import UPSTREAM

    assert app[UPSTREAM].idle_connections() > 0  # the proxied calls went through the pool
    await app[UPSTREAM].close()
    await asyncio.sleep(0.2)
    assert fds() <= base + 4, (base, peak, fds())
