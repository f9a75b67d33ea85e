"""The proxy's upstream client: pooled keep-alive HTTP/1.1 to each replica, parsed by httptools.

Why not aiohttp's ``ClientSession`` for proxied calls: its request machinery (tracing hooks,
cookie and redirect handling, timeout objects, a stream reader per response) cost about
0.18 ms of CPU per call here, about as much as sglang-router spends on a whole call. This
client writes each request head in one call and parses answers with httptools (llhttp, the
parser of Node and uvicorn). Measured as a bare pass-through on the 2-core VM at c = 32: 0.32
→ 0.14 ms CPU per 2 KB call and 0.42 → 0.25 ms per 200 KB call (docs/benchmarks-log.md).

Owns: a pool of connections per replica address, bounded per replica and in total (idle ones
reused last-in first-out, dropped after ``keepalive_s`` or when the replica closes them); the
wait for a connection when a bound is reached, itself bounded by ``pool_timeout_s`` and ended
by :class:`PoolTimeout` (the router's limit, not an ``OSError``: no caller blames the replica);
the first-byte deadline (``first_byte_s``, :class:`FirstByteTimeout`) counted from the moment
the request is written, not from the start of the pool wait; connect and read timeouts
(``read_timeout_s``: the longest silence, the wait for the response head included); response
bodies read whole or chunk by chunk with backpressure (reading pauses while more than
``HIGH_WATER`` bytes wait for the consumer); abort by closing the connection, which makes vLLM
abort the request; informational (1xx) heads before the answer skipped. A request that finds a
reused idle connection closed by the replica before any answer byte (a keep-alive race) is sent
once more on a fresh one. Idle sockets past ``keepalive_s`` are closed in every pool by a sweep
that runs when a socket goes idle, at most once per ``keepalive_s``.

Plain ``http://`` replicas only: ``https://`` ones (and any method with a bodiless answer, such
as HEAD) go through the aiohttp session, behind the same response interface. The health,
models and metrics probes stay on aiohttp (:mod:`router.replicas`); they are not the hot path.
Must not import torch, vllm or loadtest.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol
from urllib.parse import urlsplit

import aiohttp
import httptools
from multidict import CIMultiDict, CIMultiDictProxy

__all__ = [
    "BadResponse", "FirstByteTimeout", "PoolTimeout", "ServerDisconnected", "Upstream",
    "UpstreamError", "UpstreamResponse",
]  # fmt: skip

# buffered answer bytes at which reading pauses while the consumer streams; it resumes once
# the consumer has taken what was buffered
HIGH_WATER = 1 << 20
_STALE_WINDOW_S = 1.0  # a reused connection that died this fast, answerless, was stale


class UpstreamError(ConnectionError):
    """The replica's connection failed (an ``OSError``, as aiohttp's socket errors are)."""


class ServerDisconnected(UpstreamError):
    pass


class BadResponse(UpstreamError):
    pass


class FirstByteTimeout(TimeoutError):
    """The replica sent no response head within ``first_byte_s`` of the request being sent
    (the wait for a pooled connection is not part of it)."""


class PoolTimeout(Exception):
    """No connection to the replica came free within ``pool_timeout_s``: the router's own
    limit (``limit`` names which), not the replica's fault. Deliberately not an ``OSError``,
    so no caller mistakes it for a failed replica."""

    def __init__(self, limit: str, value: int, waited_s: float):
        super().__init__(f"the router's {limit}={value} was reached and no connection came "
                         f"free in {waited_s:g} s")  # fmt: skip
        self.limit, self.value, self.waited_s = limit, value, waited_s


class UpstreamResponse(Protocol):
    """What the proxy reads of an answer, whichever client carried it."""

    status: int
    reason: str
    headers: CIMultiDictProxy[str]
    content_length: int | None

    async def read(self) -> bytes: ...

    async def next_chunk(self) -> bytes:
        """The bytes that arrived since the last call; ``b""`` once the body is complete."""
        ...

    def close(self) -> None:
        """Abort: drop the connection (the replica sees the client go)."""

    def release(self) -> None:
        """Done with the answer: the connection goes back to the pool if it can be reused."""


_NO_HEADERS: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError("the replica was silent for read_timeout_s"))


def _give_up(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)  # the waiter checks the time and raises PoolTimeout


class _Response:
    __slots__ = (
        "_chunks",
        "_complete",
        "_conn",
        "_exc",
        "_got_bytes",
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
        "headers",
        "reason",
        "status",
    )  # fmt: skip

    def __init__(self, conn: _Conn, read_timeout: float | None) -> None:
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
        self._got_bytes = False
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

    async def _wait_head(self) -> None:
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


class _Conn(asyncio.Protocol):
    """One keep-alive connection: the parser's callbacks feed the response in flight."""

    def __init__(self, pool: _Pool, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: _Response | None = None
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
        r._got_bytes = True
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


class _Pool:
    """The connections to one replica address."""

    def __init__(self, owner: Upstream, host: str, port: int) -> None:
        self.owner, self.host, self.port = owner, host, port
        self.idle: list[_Conn] = []
        self.open = 0

    def put_idle(self, c: _Conn) -> None:
        self.idle.append(c)
        self.owner._wake_waiters()
        if c.idle_since - self.owner.swept_at > self.owner.keepalive_s:
            self.owner.sweep(c.idle_since)

    def lost(self, c: _Conn) -> None:
        if c.counted:
            c.counted = False
            self.open -= 1
            self.owner.open -= 1
            self.owner._wake_waiters()
        if c in self.idle:
            self.idle.remove(c)


class _AiohttpResponse:
    """An aiohttp answer behind :class:`UpstreamResponse` (https replicas, HEAD)."""

    __slots__ = ("_done", "_r", "content_length", "headers", "reason", "status")

    def __init__(self, r: aiohttp.ClientResponse, done: Callable[[], None]) -> None:
        self._r = r
        self._done: Callable[[], None] | None = done  # frees the call's per-replica slot
        self.status = r.status
        self.reason = r.reason or ""
        self.headers = r.headers
        self.content_length = r.content_length

    async def read(self) -> bytes:
        return await self._r.read()

    async def next_chunk(self) -> bytes:
        return await self._r.content.readany()

    def _free(self) -> None:
        done, self._done = self._done, None
        if done is not None:
            done()

    def close(self) -> None:
        self._r.close()
        self._free()

    def release(self) -> None:
        self._r.release()
        self._free()


class Upstream:
    """Sends proxied calls to replicas: the lean pool for http, ``session`` for the rest."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        limit: int,
        limit_per_host: int,
        connect_timeout_s: float | None,
        read_timeout_s: float | None,
        keepalive_s: float = 30.0,
        pool_timeout_s: float | None = None,
    ) -> None:
        self.session = session
        self.limit = limit  # 0: unbounded, as in aiohttp
        self.limit_per_host = limit_per_host
        self.connect_timeout_s = connect_timeout_s or None
        self.read_timeout_s = read_timeout_s or None
        self.keepalive_s = keepalive_s
        self.pool_timeout_s = pool_timeout_s or None  # the longest wait for a free connection
        self.open = 0
        self.pool_timeouts = 0  # calls that gave up waiting for a connection (PoolTimeout)
        self._aio_busy: dict[str, int] = {}  # calls in flight per host on the aiohttp path
        self.swept_at = time.monotonic()
        self._pools: dict[tuple[str, int], _Pool] = {}
        self._targets: dict[str, tuple[_Pool, str, str] | None] = {}
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    # -- bookkeeping --
    def _wake_waiters(self) -> None:
        while self._waiters:
            f = self._waiters.popleft()
            if not f.done():
                f.set_result(None)

    def _target(self, url: str) -> tuple[_Pool, str, str] | None:
        """(pool, Host header, path prefix) for a plain-http base URL; None for the rest."""
        try:
            return self._targets[url]
        except KeyError:
            pass
        parts = urlsplit(url)
        t = None
        try:
            port = parts.port or 80
        except ValueError:  # not a port: aiohttp says so
            port = 0
        if parts.scheme == "http" and parts.hostname and "@" not in parts.netloc and port:
            key = (parts.hostname, port)
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = _Pool(self, parts.hostname, port)
            t = (pool, parts.netloc, parts.path.rstrip("/"))
        if len(self._targets) > 4096:  # replica churn: forget old URLs, keep the pools
            self._targets.clear()
        self._targets[url] = t
        return t

    def sweep(self, now: float) -> None:
        """Close idle sockets past ``keepalive_s`` in every pool (a replica that went away
        or froze would otherwise keep them until its address is asked for again)."""
        self.swept_at = now
        for p in self._pools.values():
            for c in [c for c in p.idle if now - c.idle_since > self.keepalive_s]:
                c.drop()

    def idle_connections(self) -> int:
        return sum(len(p.idle) for p in self._pools.values())

    async def _acquire(self, pool: _Pool) -> _Conn:
        """An idle connection, a new one, or — when a limit is reached — the next one to come
        free, waiting at most ``pool_timeout_s`` (then :class:`PoolTimeout`)."""
        deadline: float | None = None
        while True:
            if self._closed:
                raise UpstreamError("client closed")
            now = time.monotonic()
            while pool.idle:
                c = pool.idle.pop()
                if c.closed or now - c.idle_since > self.keepalive_s:
                    c.drop()
                    continue
                return c
            if self.limit and self.open >= self.limit:
                other = next((p for p in self._pools.values() if p.idle), None)
                if other is not None:  # the total is held by idle sockets elsewhere: free one
                    other.idle[0].drop()
                    continue
                which = ("max_connections", self.limit)
            elif not self.limit_per_host or pool.open < self.limit_per_host:
                return await self._connect(pool)
            else:
                which = ("max_connections_per_replica", self.limit_per_host)
            deadline = await self._wait_turn(deadline, which)

    async def _wait_turn(self, deadline: float | None, which: tuple[str, int]) -> float | None:
        """Wait for a connection to come free (any pool); raise :class:`PoolTimeout` once
        ``pool_timeout_s`` has passed since the first wait. Returns the deadline."""
        loop = asyncio.get_running_loop()
        if deadline is None and self.pool_timeout_s is not None:
            deadline = loop.time() + self.pool_timeout_s
        if deadline is not None and loop.time() >= deadline:
            self.pool_timeouts += 1
            raise PoolTimeout(which[0], which[1], self.pool_timeout_s or 0.0)
        fut = loop.create_future()
        self._waiters.append(fut)
        timer = None if deadline is None else loop.call_at(deadline, _give_up, fut)
        try:
            await fut
        finally:
            if timer is not None:
                timer.cancel()
        return deadline

    async def _connect(self, pool: _Pool) -> _Conn:
        pool.open += 1
        self.open += 1
        loop = asyncio.get_running_loop()
        c = _Conn(pool, loop)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await loop.create_connection(lambda: c, pool.host, pool.port)
        except BaseException:
            pool.lost(c)
            raise
        return c

    # -- the call --
    async def request(
        self,
        method: str,
        url: str,
        path: str,
        headers: CIMultiDict[str],
        body: bytes,
        first_byte_s: float | None = None,
    ) -> UpstreamResponse:
        """Send ``method url+path`` with ``headers`` and ``body``; return once the response
        head is in. ``headers`` carry no Host, Content-Length or Transfer-Encoding (the proxy's
        ``upstream_headers`` drops them). Cancellation (client gone, a deadline) closes the
        connection.

        Two bounds, told apart: waiting for a connection when the pool's limits are reached
        (``pool_timeout_s``: :class:`PoolTimeout`, the router's limit), and ``first_byte_s``
        from the moment the request is written to the replica's connection to its response
        head (:class:`FirstByteTimeout`, the replica's silence)."""
        target = None if method == "HEAD" else self._target(url)
        if target is None:
            return await self._via_aiohttp(method, url, path, headers, body, first_byte_s)
        pool, host, prefix = target
        lines = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
        if lines.count("\n") != len(headers) or lines.count("\r") != len(headers):
            raise ValueError("a header holds a line break")  # aiohttp's parser lets none in
        head = (
            f"{method} {prefix}{path} HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Length: {len(body)}\r\n{lines}\r\n"
        ).encode("utf-8", "surrogateescape")
        for attempt in (0, 1):
            c = await self._acquire(pool)
            resp = _Response(c, self.read_timeout_s)
            c.resp = resp
            sent = time.monotonic()
            deadline = None if not first_byte_s else asyncio.timeout(first_byte_s)
            try:
                assert c.transport is not None
                c.transport.writelines((head, body))
                if deadline is None:
                    await resp._wait_head()
                else:
                    async with deadline:
                        await resp._wait_head()
                return resp
            except UpstreamError as e:
                resp.close()
                stale = c.reused and not resp._got_bytes and not isinstance(e, BadResponse)
                if attempt == 0 and stale and time.monotonic() - sent < _STALE_WINDOW_S:
                    continue  # the replica closed the idle socket as we wrote: not an answer
                raise
            except TimeoutError:
                resp.close()
                if deadline is not None and deadline.expired():
                    raise FirstByteTimeout(f"no response head in {first_byte_s:g} s") from None
                raise
            except BaseException:
                resp.close()
                raise
        raise AssertionError("unreachable")

    async def _via_aiohttp(
        self,
        method: str,
        url: str,
        path: str,
        headers: CIMultiDict[str],
        body: bytes,
        first_byte_s: float | None,
    ) -> UpstreamResponse:
        """https replicas and HEAD: the aiohttp session, behind the same per-replica bound
        and pool wait as the lean pool (the session's connector has headroom above it, so
        the wait happens here, where it is told apart from the replica's silence)."""
        key = urlsplit(url).netloc
        deadline: float | None = None
        while self.limit_per_host and self._aio_busy.get(key, 0) >= self.limit_per_host:
            if self._closed:
                raise UpstreamError("client closed")
            deadline = await self._wait_turn(
                deadline, ("max_connections_per_replica", self.limit_per_host)
            )
        self._aio_busy[key] = self._aio_busy.get(key, 0) + 1
        try:
            async with asyncio.timeout(first_byte_s or None) as cm:
                r = await self.session.request(method, url + path, data=body, headers=headers,
                                               allow_redirects=False)  # fmt: skip
        except TimeoutError:
            self._aio_done(key)
            if first_byte_s and cm.expired():
                raise FirstByteTimeout(f"no response head in {first_byte_s:g} s") from None
            raise
        except BaseException:
            self._aio_done(key)
            raise
        return _AiohttpResponse(r, lambda: self._aio_done(key))

    def _aio_done(self, key: str) -> None:
        n = self._aio_busy.get(key, 0) - 1
        if n > 0:
            self._aio_busy[key] = n
        else:
            self._aio_busy.pop(key, None)
        self._wake_waiters()

    async def close(self) -> None:
        self._closed = True
        for p in self._pools.values():
            for c in list(p.idle):
                c.drop()
        self._wake_waiters()
        await asyncio.sleep(0)  # let the transports run their close callbacks
