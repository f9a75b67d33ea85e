# ruff: noqa: F811  (the raw-socket server fixture is shared with test_upstream_client by name)
"""The wire side of the upstream client (router.http1) against raw-socket servers: answers
delimited by length, chunks or the socket's close, truncated and malformed answers, streamed
chunks with backpressure, the read timeout, informational heads, and abort by closing the
socket. The pool's bounds and waits: test_upstream_client.py."""

from __future__ import annotations

import asyncio

import pytest

from router.http1 import HIGH_WATER, BadResponse, UpstreamError
from tests.integration.test_upstream_client import (  # noqa: F401
    OK,
    RawServer,
    answer_ok,
    fetch,
    hdrs,
    servers,
)

pytestmark = pytest.mark.timeout(30)


async def test_chunked_and_close_delimited_bodies(servers):
    async def chunked(s: RawServer, w: asyncio.StreamWriter, req: bytes) -> bool:
        if b"close" in req:
            w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
            return False
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")  # fmt: skip
        await w.drain()
        return True

    srv, up = await servers(chunked)
    r = await up.request("POST", srv.url, "/v1/x", hdrs(), b"")
    assert r.content_length is None and await r.read() == b"hello world"
    r.release()
    r = await up.request("POST", srv.url, "/v1/x", hdrs(), b"close")
    assert await r.read() == b"until the end"
    r.release()


async def test_a_truncated_body_fails_and_the_socket_is_not_reused(servers):
    async def short(s: RawServer, w: asyncio.StreamWriter, req: bytes) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await w.drain()
        return False

    srv, up = await servers(short)
    r = await up.request("POST", srv.url, "/v1/x", hdrs(), b"")
    with pytest.raises(UpstreamError):
        await r.read()
    r.release()
    assert up.idle_connections() == 0 and up.open == 0


async def test_a_malformed_answer_is_a_bad_response(servers):
    async def junk(s: RawServer, w: asyncio.StreamWriter, req: bytes) -> None:
        w.write(b"SPDY/9 what\r\n\r\n")
        await w.drain()

    srv, up = await servers(junk)
    with pytest.raises(BadResponse):
        await up.request("POST", srv.url, "/v1/x", hdrs(), b"")
    assert up.open == 0


async def test_streamed_chunks_arrive_as_written_and_reading_pauses_for_a_slow_consumer(servers):
    big = b"x" * (48 * HIGH_WATER)  # more than the loopback socket buffers hold
    sent = asyncio.Event()

    async def stream(s: RawServer, w: asyncio.StreamWriter, req: bytes) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
        w.write(b"%x\r\n%s\r\n" % (6, b"first\n"))
        await w.drain()
        await asyncio.sleep(0.1)
        w.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big))
        await w.drain()  # returns only once the client has read most of it
        sent.set()

    srv, up = await servers(stream)
    r = await up.request("POST", srv.url, "/v1/x", hdrs(), b"")
    assert await r.next_chunk() == b"first\n"
    await asyncio.sleep(0.5)  # the consumer is slow: the client stops reading at the mark
    assert not sent.is_set() and r._size <= HIGH_WATER + (1 << 18)  # type: ignore[attr-defined]
    got = []
    while chunk := await r.next_chunk():
        got.append(chunk)
    assert b"".join(got) == big and await r.next_chunk() == b""
    r.release()
    assert up.idle_connections() == 1


async def test_read_timeout_covers_the_wait_for_the_head(servers):
    async def silent(s: RawServer, w: asyncio.StreamWriter, req: bytes) -> bool:
        assert s.reader is not None
        await s.reader.read()  # no answer; returns when the client closes the socket
        return False

    srv, up = await servers(silent, read_timeout_s=0.3)
    with pytest.raises(TimeoutError):
        await up.request("POST", srv.url, "/v1/x", hdrs(), b"")
    await asyncio.wait_for(srv.closed.wait(), 5)  # and the socket is closed
    assert up.open == 0


async def test_cancelling_a_call_closes_its_socket_so_the_replica_sees_it_go(servers):
    async def silent(s: RawServer, w: asyncio.StreamWriter, req: bytes) -> bool:
        assert s.reader is not None
        await s.reader.read()  # no answer; returns when the client closes the socket
        return False

    srv, up = await servers(silent)
    call = asyncio.create_task(up.request("POST", srv.url, "/v1/x", hdrs(), b""))
    await asyncio.sleep(0.2)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await asyncio.wait_for(srv.closed.wait(), 1)
    assert up.open == 0


async def test_an_informational_head_before_the_answer_is_skipped(servers):
    async def hints(s: RawServer, w: asyncio.StreamWriter, req: bytes) -> None:
        w.write(b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n" + OK)
        await w.drain()

    srv, up = await servers(hints)
    for _ in range(2):  # and the socket stays usable for the next call
        r = await up.request("POST", srv.url, "/v1/x", hdrs(), b"")
        assert (r.status, await r.read()) == (200, b"{}") and "link" not in r.headers
        r.release()
    assert srv.connections == 1
