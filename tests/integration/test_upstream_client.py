"""The proxy's upstream client (router.upstream) against raw-socket servers that answer exactly
the bytes each test writes: keep-alive reuse, the pool's bounds and waits, the first-byte
deadline, keep-alive races, idle sweeps and https through aiohttp. The wire side (bodies,
malformed answers, backpressure, read timeout, abort): test_http1.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from router.http1 import ServerDisconnected
from router.upstream import FirstByteTimeout, PoolTimeout, Upstream

pytestmark = pytest.mark.timeout(30)

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class RawServer:
    """Reads one request head + Content-Length body at a time and calls ``answer``."""

    def __init__(self, answer: Callable[[RawServer, asyncio.StreamWriter, bytes], Any]):
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.reader: asyncio.StreamReader | None = None
        self.url = ""

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.reader = r
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await r.readexactly(length)
                self.requests.append(head + body)
                again = await self.answer(self, w, head + body)
                if again is False:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
            w.close()

    async def start(self) -> RawServer:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()


@pytest.fixture
async def servers() -> AsyncIterator[Callable[..., Any]]:
    made: list[RawServer] = []
    sessions: list[aiohttp.ClientSession] = []
    clients: list[Upstream] = []

    async def make(answer: Callable[..., Any], **kw: Any) -> tuple[RawServer, Upstream]:
        s = await RawServer(answer).start()
        made.append(s)
        sess = aiohttp.ClientSession()
        sessions.append(sess)
        opts: dict[str, Any] = dict(limit=0, limit_per_host=0, connect_timeout_s=5,
                                    read_timeout_s=10)  # fmt: skip
        opts.update(kw)
        up = Upstream(sess, **opts)
        clients.append(up)
        return s, up

    yield make
    for up in clients:
        await up.close()
    for sess in sessions:
        await sess.close()
    for s in made:
        if s.server is not None and s.server.is_serving():
            await s.stop()


async def answer_ok(s: RawServer, w: asyncio.StreamWriter, req: bytes) -> None:
    w.write(OK)
    await w.drain()


def hdrs(**kw: str) -> CIMultiDict[str]:
    return CIMultiDict({"Content-Type": "application/json", **kw})


async def fetch(up: Upstream, url: str, body: bytes = b"") -> bytes:
    """One call through ``up``: its whole answer, the connection released."""
    r = await up.request("POST", url, "/v1/x", hdrs(), body)
    try:
        return await r.read()
    finally:
        r.release()


async def test_the_request_goes_out_as_written_and_the_connection_is_reused(servers):
    srv, up = await servers(answer_ok)
    for _ in range(3):
        r = await up.request("POST", srv.url + "/base", "/v1/x?a=1", hdrs(**{"X-A": "b"}), b"hi")
        assert (r.status, r.reason, await r.read()) == (200, "OK", b"{}")
        assert r.headers["content-type"] == "application/json" and r.content_length == 2
        r.release()
    assert srv.connections == 1 and len(srv.requests) == 3
    head, _, body = srv.requests[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /base/v1/x?a=1 HTTP/1.1"
    port = srv.url.rsplit(":", 1)[1]
    assert f"Host: 127.0.0.1:{port}".encode() in lines and b"Content-Length: 2" in lines
    assert b"X-A: b" in lines and body == b"hi"


async def test_a_header_with_a_line_break_is_refused_before_anything_is_sent(servers):
    srv, up = await servers(answer_ok)
    with pytest.raises(ValueError):
        await up.request("POST", srv.url, "/v1/x", hdrs(**{"X-A": "b\r\nX-Evil: 1"}), b"")
    assert srv.connections == 0


async def test_the_per_replica_bound_holds_and_a_waiting_call_gets_the_freed_socket(servers):
    gate = asyncio.Event()

    async def slow(s: RawServer, w: asyncio.StreamWriter, req: bytes) -> None:
        await gate.wait()
        w.write(OK)
        await w.drain()

    srv, up = await servers(slow, limit_per_host=2)

    calls = [asyncio.create_task(fetch(up, srv.url)) for _ in range(5)]
    await asyncio.sleep(0.3)
    assert srv.connections == 2 and len(srv.requests) == 2 and up.open == 2  # three wait
    gate.set()
    assert await asyncio.gather(*calls) == [b"{}"] * 5
    assert srv.connections == 2 and up.open == 2  # the waiting calls reused the two sockets


async def test_a_pool_wait_has_its_own_bound_and_error_naming_the_limit(servers):
    gate = asyncio.Event()

    async def slow(s: RawServer, w: asyncio.StreamWriter, req: bytes) -> None:
        await gate.wait()
        w.write(OK)
        await w.drain()

    for kw, limit in (({"limit_per_host": 1}, "max_connections_per_replica"),
                      ({"limit": 1}, "max_connections")):  # fmt: skip
        gate.clear()
        srv, up = await servers(slow, pool_timeout_s=0.3, **kw)
        held = asyncio.create_task(fetch(up, srv.url))
        await asyncio.sleep(0.1)
        with pytest.raises(PoolTimeout) as e:
            await up.request("POST", srv.url, "/v1/x", hdrs(), b"", first_byte_s=30)
        assert e.value.limit == limit and f"{limit}=1" in str(e.value)
        assert not isinstance(e.value, OSError)  # never mistaken for a failed replica
        assert len(srv.requests) == 1 and up.pool_timeouts == 1
        gate.set()
        assert await held == b"{}"


async def test_first_byte_s_counts_from_the_send_not_from_the_pool_wait(servers):
    async def half_second(s: RawServer, w: asyncio.StreamWriter, req: bytes) -> None:
        await asyncio.sleep(0.5)
        w.write(OK)
        await w.drain()

    srv, up = await servers(half_second, limit_per_host=1)

    async def one() -> bytes:
        r = await up.request("POST", srv.url, "/v1/x", hdrs(), b"", first_byte_s=1.2)
        try:
            return await r.read()
        finally:
            r.release()  # the next waiter gets the socket

    # the fourth call waits ~1.5 s for the one socket, then has its head 0.5 s after its send
    assert await asyncio.gather(*(one() for _ in range(4))) == [b"{}"] * 4
    assert srv.connections == 1

    async def silent(s: RawServer, w: asyncio.StreamWriter, req: bytes) -> None:
        await asyncio.sleep(10)

    srv, up = await servers(silent)
    with pytest.raises(FirstByteTimeout):
        await up.request("POST", srv.url, "/v1/x", hdrs(), b"", first_byte_s=0.2)


async def test_the_total_bound_frees_an_idle_socket_of_another_replica(servers):
    a, up = await servers(answer_ok, limit=1)
    b = await RawServer(answer_ok).start()
    try:
        await fetch(up, a.url)
        assert up.idle_connections() == 1
        r = await up.request("POST", b.url, "/v1/x", hdrs(), b"")  # a's idle socket gives way
        assert await r.read() == b"{}"
        r.release()
        await asyncio.wait_for(a.closed.wait(), 5)
        assert up.open == 1
    finally:
        await b.stop()


async def test_an_idle_socket_the_replica_closed_is_not_an_answer(servers):
    async def once(s: RawServer, w: asyncio.StreamWriter, req: bytes) -> bool:
        w.write(OK.replace(b"Content-Length: 2", b"Content-Length: 2\r\nKeep-Alive: timeout=5"))
        await w.drain()
        return False  # then close the keep-alive connection, as uvicorn does when idle

    srv, up = await servers(once)
    await fetch(up, srv.url)
    await asyncio.wait_for(srv.closed.wait(), 5)
    await asyncio.sleep(0.05)  # the close reached the client: the idle socket is dropped
    r = await up.request("POST", srv.url, "/v1/x", hdrs(), b"")
    assert await r.read() == b"{}" and srv.connections == 2


async def test_a_keep_alive_race_is_sent_again_once_on_a_fresh_socket(servers):
    async def first_then_drop(s: RawServer, w: asyncio.StreamWriter, req: bytes) -> bool:
        if len(s.requests) == 2:  # the second request, on the reused socket: close, no answer
            return False
        w.write(OK)
        await w.drain()
        return True

    srv, up = await servers(first_then_drop)
    await fetch(up, srv.url, b"a")
    r = await up.request("POST", srv.url, "/v1/x", hdrs(), b"b")
    assert await r.read() == b"{}"
    assert srv.connections == 2 and [q[-1:] for q in srv.requests] == [b"a", b"b", b"b"]


async def test_a_fresh_socket_closed_without_an_answer_fails_once(servers):
    async def drop(s: RawServer, w: asyncio.StreamWriter, req: bytes) -> bool:
        return False

    srv, up = await servers(drop)
    with pytest.raises(ServerDisconnected):
        await up.request("POST", srv.url, "/v1/x", hdrs(), b"")
    assert srv.connections == 1  # not sent again: a fresh socket's close is the replica's


async def test_https_replicas_go_through_the_aiohttp_session(servers):
    srv, up = await servers(answer_ok)
    await srv.stop()  # nothing listens there now
    with pytest.raises(OSError) as plain:
        await up.request("POST", srv.url, "/v1/x", hdrs(), b"")
    assert not isinstance(plain.value, aiohttp.ClientError)  # the lean client's own error
    with pytest.raises(aiohttp.ClientConnectorError):  # aiohttp's: it carried the https call
        await up.request("POST", srv.url.replace("http:", "https:"), "/v1/x", hdrs(), b"")


async def test_idle_sockets_past_the_keep_alive_are_closed_in_every_pool(servers):
    a, up = await servers(answer_ok, keepalive_s=0.2)
    b = await RawServer(answer_ok).start()
    try:
        await fetch(up, a.url)
        await asyncio.sleep(0.3)  # a's socket is past the keep-alive; nobody asks for a again
        await fetch(up, b.url)  # b's socket goes idle: the sweep closes a's
        await asyncio.wait_for(a.closed.wait(), 5)
        assert up.idle_connections() == 1 and up.open == 1
    finally:
        await b.stop()
