# ruff: noqa: F811  (fixtures shared from test_router_proxy are imported by name)
"""Many concurrent streams through one router: every stream byte-exact, and the open file
descriptors go back once the streams end and pooled connections are released (issue 13; the
2,000 × 60 s figure is ``scripts/probe_streams.py``, docs/reliability.md)."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import orjson
import pytest

from tests.integration.test_router_proxy import fakes  # noqa: F401

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


SLOW = [b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'] * 10 + [b"data: [DONE]\n\n"]


async def _six_streams(url: str, route: str = "/v1/chat/completions") -> list[tuple[int, bytes]]:
    body = {"model": "tiny", "messages": [], "stream": True, "max_tokens": 4}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:

        async def one(i: int) -> tuple[int, bytes]:
            async with s.post(url + route, json=body, headers={"x-session-id": f"s{i}"}) as r:
                return r.status, await r.read()

        return await asyncio.gather(*(one(i) for i in range(6)))


async def test_a_pool_wait_is_not_the_replicas_silence(fakes, router):
    """Issue 45 (1): with 2 connections per replica, 6 concurrent streams — 4 wait for a
    socket longer than first_byte_timeout_s, yet all are served and the breaker stays closed
    (before: 4 × 503 at the first-byte timeout and the breaker open on a healthy replica)."""
    from router.keys import REPLICAS

    (f,) = await fakes(1, chunks=SLOW, chunk_delay_s=0.12)  # ~1.3 s per stream
    url, app = await router([f.url], max_connections_per_replica=2, first_byte_timeout_s=0.6)
    got = await _six_streams(url)
    assert [st for st, _ in got] == [200] * 6 and all(b == b"".join(SLOW) for _, b in got)
    r = app[REPLICAS].get(f.url)
    assert r is not None and r.breaker.state == "closed" and r.breaker.failures == 0
    assert len(f.seen) == 6  # each call sent once: no retry
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as m:
        assert "kvroute_retries_total{" not in await m.text()


async def test_a_pool_wait_past_pool_timeout_s_is_a_503_naming_the_limit(fakes, router):
    from router.keys import REPLICAS

    (f,) = await fakes(1, chunks=SLOW, chunk_delay_s=0.3)  # ~3 s per stream
    url, app = await router([f.url], max_connections_per_replica=2, first_byte_timeout_s=0.5,
                            pool_timeout_s=0.4)  # fmt: skip
    for route, anthropic in (("/v1/chat/completions", False), ("/v1/messages", True)):
        got = await _six_streams(url, route)
        assert sorted(st for st, _ in got) == [200, 200, 503, 503, 503, 503], route
        for st, b in got:
            if st != 503:
                continue
            doc = orjson.loads(b)
            msg = doc["error"]["message"]
            assert "max_connections_per_replica=2" in msg and "pool_timeout_s" in msg
            assert doc["type"] == "error" if anthropic else doc["error"]["code"] == 503
    r = app[REPLICAS].get(f.url)
    assert r is not None and r.breaker.state == "closed" and r.breaker.failures == 0
    assert len(f.seen) == 4  # the refused calls never reached the replica, nor went elsewhere
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as m:
        text = await m.text()
    assert "kvroute_retries_total{" not in text
    want = 'kvroute_upstream_pool_timeouts_total{limit="max_connections_per_replica"} 8.0'
    assert want in text


async def _raw_stream(url: str, req: bytes, rcvbuf: int | None = None) -> tuple[
    asyncio.StreamReader, asyncio.StreamWriter]:  # fmt: skip
    import socket

    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 16)
    writer.write(req)
    await writer.drain()
    return reader, writer


def _post10(route: str, body: bytes) -> bytes:
    head = (f"POST {route} HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Connection: keep-alive\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    return head.encode() + body


async def test_an_http_1_0_stream_ends_with_the_connection(fakes, router):
    """Issue 45 (5): an HTTP/1.0 keep-alive client asking for a stream gets
    ``Connection: close`` and the connection closes at the end of the body (before: neither
    length nor close, and the socket stayed open for idle_timeout_s)."""
    from tests.integration.test_router_proxy import SSE_CHUNKS

    (f,) = await fakes(1)
    url, _ = await router([f.url])  # idle_timeout_s: the default 75 s
    for route in ("/v1/messages", "/v1/chat/completions"):
        body = orjson.dumps({"model": "tiny", "messages": [], "stream": True, "max_tokens": 4})
        reader, writer = await _raw_stream(url, _post10(route, body))
        try:
            data = await asyncio.wait_for(reader.read(), 10)  # to EOF: the server closed
        finally:
            writer.close()
        head, _, got = data.partition(b"\r\n\r\n")
        lines = head.lower().split(b"\r\n")
        assert lines[0].startswith(b"http/1.0 200"), head
        assert b"connection: close" in lines and not any(
            ln.startswith((b"transfer-encoding", b"content-length")) for ln in lines)  # fmt: skip
        assert got == b"".join(SSE_CHUNKS)
    # a non-streamed answer to HTTP/1.0 keeps its Content-Length (and may stay open)
    body = orjson.dumps({"model": "tiny", "messages": []})
    reader, writer = await _raw_stream(url, _post10("/v1/chat/completions", body))
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    finally:
        writer.close()
    assert b"content-length:" in head.lower()


async def test_a_client_that_stops_reading_is_cut_and_the_upstream_closed(fakes, router):
    """Issue 45 (5): a streamed answer to a client that reads nothing: after send_timeout_s
    with a write blocked, the router cuts the client and closes the upstream call (the replica
    sees the abort). Before: held for as long as the replica kept sending."""
    big = [b"data: " + b"x" * 65536 + b"\n\n"] * 400  # ~26 MB, far past every buffer
    (f,) = await fakes(1, chunks=big)
    url, _ = await router([f.url], send_timeout_s=0.5)
    body = orjson.dumps({"model": "tiny", "messages": [], "stream": True})
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
           b"\r\nContent-Length: %d\r\n\r\n" % len(body)) + body  # fmt: skip
    _, writer = await _raw_stream(url, req, rcvbuf=4096)
    try:
        await asyncio.wait_for(f.aborted.wait(), 20)  # never read a byte meanwhile
    finally:
        writer.close()
    assert f.completed == 0
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as m:
        assert 'status="client_stalled"' in await m.text()


async def test_new_sessions_go_where_the_wait_for_a_connection_is_shortest(fakes, router):
    """The 2,000-stream bench's defect in small (docs/results.md#router-at-scale): 4 replicas
    with 2 connections each, 16 streams of new sessions at once. A new call on a replica with
    ``inflight`` calls waits ``inflight // 2`` rounds of streams for a connection. The
    default policy's bounded load (1.25 × the mean) alone put a 5th call (round 2) on a
    replica while another had room in round 1; the ``pool_room`` filter fills round 0
    everywhere, then round 1: 4 / 4 / 4 / 4. A spec without it, the same session keys, does
    not."""
    reps = await fakes(4, chunks=SLOW, chunk_delay_s=0.2)  # ~2 s per stream: all 16 overlap
    urls = [r.url for r in reps]

    async def spread(**kw) -> list[int]:
        url, _ = await router(urls, max_connections_per_replica=2, **kw)
        for r in reps:
            r.seen.clear()
        body = {"model": "tiny", "messages": [], "stream": True, "max_tokens": 4}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:

            async def one(i: int) -> int:
                async with s.post(url + "/v1/chat/completions", json=body,
                                  headers={"x-session-id": f"new-{i}"}) as r:  # fmt: skip
                    await r.read()
                    return r.status

            assert await asyncio.gather(*(one(i) for i in range(16))) == [200] * 16
        return sorted(len(r.seen) for r in reps)

    assert await spread() == [4, 4, 4, 4]
    without = {"scorers": [{"type": "session_affinity", "weight": 1.0}]}
    got = await spread(scheduling={**without, "filters": ["healthy", "serves_model"]})
    assert got[-1] > 4, got
