"""Keep-alive HTTP/1.1 on httptools: one connection to a replica, the answer it carries, and
the connections to one replica address.

Owns: :class:`Conn` (an ``asyncio.Protocol`` whose httptools parser callbacks feed the answer
in flight; informational 1xx heads before the answer skipped), :class:`Response` (the answer:
its head, its body read whole or chunk by chunk with backpressure — reading pauses while more
than ``HIGH_WATER`` bytes wait for the consumer —, the read timeout ``read_timeout_s``, abort
by closing the connection), :class:`Pool` (one address's idle and open connections) and the
connection errors. The limits, the waits for a free connection and the request itself are
:class:`router.upstream.Upstream`'s; a pool reaches it only through :class:`PoolOwner`.
Must not import torch, vllm or loadtest.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

# buffered answer bytes at which reading pauses while the consumer streams; it resumes once
# the consumer has taken what was buffered
HIGH_WATER = 1 << 20


class UpstreamError(ConnectionError):
    """The replica's connection failed (an ``OSError``, as aiohttp's socket errors are)."""


class ServerDisconnected(UpstreamError):
    pass


class BadResponse(UpstreamError):
    pass


_NO_HEADERS: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError("the replica was silent for read_timeout_s"))


class Response:
    __slots__ = (
        "_chunks",
        "_complete",
        "_conn",
        "_exc",
        "_head",
        "_keep_alive",
        "_paused",
        "_raw_headers",
        "_read_timeout",
        "_reason",
        "_released",
        "_size",
        "_waiter",
        "_whole",
        "content_length",
        "got_bytes",
        "headers",
        "reason",
        "status",
    )  # fmt: skip

    def __init__(self, conn: Conn, read_timeout: float | None) -> None:
        self._conn = conn
        self._read_timeout = read_timeout
        self.status = 0
        self.reason = ""
        self.headers: CIMultiDictProxy[str] = _NO_HEADERS  # until the head is in
        self.content_length: int | None = None
        self._raw_headers: list[tuple[str, str]] = []
        self._reason: list[bytes] = []
        self._chunks: list[bytes] = []
        self._size = 0
        self._waiter: asyncio.Future[None] | None = None
        self._head = False
        self._complete = False
        self._exc: BaseException | None = None
        self._whole = False  # read() wants everything: never pause
        self._paused = False
        self._released = False
        self.got_bytes = False
        self._keep_alive = False

    # -- fed by the connection (parser callbacks) --
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _on_head(self, status: int, keep_alive: bool) -> None:
        self.status = status
        self.reason = b"".join(self._reason).decode("latin-1")
        h = CIMultiDict(self._raw_headers)
        self.headers = CIMultiDictProxy(h)
        cl = h.get("content-length")
        if cl is not None and "transfer-encoding" not in h and cl.isdigit():
            self.content_length = int(cl)
        self._keep_alive = keep_alive
        self._head = True
        self._wake()

    def _delimited_by_close(self) -> bool:
        return self.content_length is None and "transfer-encoding" not in self.headers

    def _on_body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > HIGH_WATER and not self._whole and not self._paused:
            self._paused = True
            self._conn.pause()
        self._wake()

    def _on_done(self, keep_alive: bool) -> None:
        self._keep_alive = keep_alive
        self._complete = True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self._exc is None and not self._complete:
            self._exc = exc
            self._wake()

    # -- the consumer's side --
    async def _wait(self) -> None:
        # a timer handle, not an ``asyncio.timeout`` context: this runs two or more times a
        # call, and those contexts took about 4 % of the router's CPU (py-spy, 2 KB JSON calls)
        loop = self._conn.loop  # not asyncio.get_running_loop(): that is a getpid() call
        self._waiter = fut = loop.create_future()
        timer = None if self._read_timeout is None else loop.call_later(
            self._read_timeout, _expire, fut)  # fmt: skip
        try:
            await fut
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def wait_head(self) -> None:
        while not self._head:
            if self._exc is not None:
                raise self._exc
            await self._wait()

    async def read(self) -> bytes:
        self._whole = True
        if self._paused:
            self._paused = False
            self._conn.resume()
        while not self._complete:
            if self._exc is not None:
                raise self._exc
            await self._wait()
        return self._take()

    async def next_chunk(self) -> bytes:
        while not self._chunks:
            if self._complete:
                return b""
            if self._exc is not None:
                raise self._exc
            await self._wait()
        return self._take()

    def _take(self) -> bytes:
        """Everything buffered; reading resumes if it had paused."""
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks = []
        self._size = 0
        if self._paused:
            self._paused = False
            self._conn.resume()
        return data

    def close(self) -> None:
        if not self._released:
            self._released = True
            self._conn.drop()

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._complete and self._keep_alive and self._exc is None:
            self._conn.reuse()
        else:
            self._conn.drop()


class Conn(asyncio.Protocol):
    """One keep-alive connection: the parser's callbacks feed the response in flight."""

    def __init__(self, pool: Pool, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: Response | None = None
        self.closed = False
        self.counted = True  # holds a slot of the pool's limits until dropped
        self.idle_since = 0.0
        self.reused = False
        self.informational = False  # parsing a 1xx head that precedes the answer

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        r = self.resp
        if r is None:  # bytes nobody asked for: the connection is not reusable
            self.drop()
            return
        r.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            r._fail(BadResponse("replica switched protocols"))
            self.drop()
        except httptools.HttpParserError as e:
            r._fail(BadResponse(f"malformed response from the replica: {e}"))
            self.drop()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        r = self.resp
        if r is not None and r._head and r._delimited_by_close():
            r._on_done(False)  # an answer with neither length nor chunks ends with the socket
        elif r is not None:
            r._fail(ServerDisconnected("replica closed the connection")
                    if exc is None else UpstreamError(f"{type(exc).__name__}: {exc}"))  # fmt: skip
        self.pool.lost(self)

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    # httptools callbacks
    def on_status(self, status: bytes) -> None:
        if self.resp is not None:
            self.resp._reason.append(status)

    def on_header(self, name: bytes, value: bytes | None) -> None:
        if self.resp is not None:
            v = (value or b"").decode("utf-8", "surrogateescape")
            self.resp._raw_headers.append((name.decode("utf-8", "surrogateescape"), v))

    def on_headers_complete(self) -> None:
        r = self.resp
        if r is None:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # informational (103 Early Hints, ...):
            r._raw_headers, r._reason = [], []  # not the answer, which follows it
            self.informational = True
            return
        r._on_head(status, self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        if self.resp is not None:
            self.resp._on_body(body)

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
        elif self.resp is not None:
            self.resp._on_done(self.parser.should_keep_alive())

    # the pool's side
    def reuse(self) -> None:
        self.resp = None
        if self.closed or self.transport is None or self.transport.is_closing():
            self.drop()
            return
        self.resume()
        self.reused = True
        self.idle_since = time.monotonic()
        self.pool.put_idle(self)

    def drop(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.pool.lost(self)


class Pool:
    """The connections to one replica address."""

    def __init__(self, owner: PoolOwner, host: str, port: int) -> None:
        self.owner, self.host, self.port = owner, host, port
        self.idle: list[Conn] = []
        self.open = 0

    def put_idle(self, c: Conn) -> None:
        self.idle.append(c)
        self.owner.wake_waiters()
        if c.idle_since - self.owner.swept_at > self.owner.keepalive_s:
            self.owner.sweep(c.idle_since)

    def lost(self, c: Conn) -> None:
        if c.counted:
            c.counted = False
            self.open -= 1
            self.owner.open -= 1
            self.owner.wake_waiters()
        if c in self.idle:
            self.idle.remove(c)


class PoolOwner(Protocol):
    """What a :class:`Pool` needs of the client that owns it (:class:`router.upstream.Upstream`)."""

    open: int
    keepalive_s: float
    swept_at: float

    def wake_waiters(self) -> None: ...

    def sweep(self, now: float) -> None: ...
