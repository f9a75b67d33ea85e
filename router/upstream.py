"""The proxy's upstream client: pooled keep-alive HTTP/1.1 to each replica, parsed by httptools.

Why not aiohttp's ``ClientSession`` for proxied calls: its request machinery (tracing hooks,
cookie and redirect handling, timeout objects, a stream reader per response) cost about
0.18 ms of CPU per call here, about as much as sglang-router spends on a whole call. This
client writes each request head in one call and parses answers with httptools (llhttp, the
parser of Node and uvicorn). Measured as a bare pass-through on the 2-core VM at c = 32: 0.32
→ 0.14 ms CPU per 2 KB call and 0.42 → 0.25 ms per 200 KB call (docs/benchmarks-log.md).

Owns: :class:`Upstream` — a pool of connections per replica address (:mod:`router.http1`:
the connection, its parser and the answer it carries), bounded per replica and in total (idle
ones reused last-in first-out, dropped after ``keepalive_s`` or when the replica closes them);
the wait for a connection when a bound is reached, itself bounded by ``pool_timeout_s`` and
ended by :class:`PoolTimeout` (the router's limit, not an ``OSError``: no caller blames the
replica); the first-byte deadline (``first_byte_s``, :class:`FirstByteTimeout`) counted from
the moment the request is written, not from the start of the pool wait; connect timeouts; the
:class:`UpstreamResponse` interface both clients' answers share. A request that finds a reused
idle connection closed by the replica before any answer byte (a keep-alive race) is sent once
more on a fresh one. Idle sockets past ``keepalive_s`` are closed in every pool by a sweep
that runs when a socket goes idle, at most once per ``keepalive_s``.

Plain ``http://`` replicas only: ``https://`` ones (and any method with a bodiless answer, such
as HEAD) go through the aiohttp session, behind the same response interface. The health,
models and metrics probes stay on aiohttp (:mod:`router.monitor`); they are not the hot path.
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
from multidict import CIMultiDict, CIMultiDictProxy

from router.http1 import BadResponse, Conn, Pool, Response, UpstreamError

__all__ = ["FirstByteTimeout", "PoolTimeout", "Upstream", "UpstreamResponse"]

_STALE_WINDOW_S = 1.0  # a reused connection that died this fast, answerless, was stale


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


def _give_up(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)  # the waiter checks the time and raises PoolTimeout


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
        self._pools: dict[tuple[str, int], Pool] = {}
        self._targets: dict[str, tuple[Pool, str, str] | None] = {}
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    # -- bookkeeping --
    def wake_waiters(self) -> None:
        while self._waiters:
            f = self._waiters.popleft()
            if not f.done():
                f.set_result(None)

    def _target(self, url: str) -> tuple[Pool, str, str] | None:
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
                pool = self._pools[key] = Pool(self, parts.hostname, port)
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

    async def _acquire(self, pool: Pool) -> Conn:
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

    async def _connect(self, pool: Pool) -> Conn:
        pool.open += 1
        self.open += 1
        loop = asyncio.get_running_loop()
        c = Conn(pool, loop)
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
            resp = Response(c, self.read_timeout_s)
            c.resp = resp
            sent = time.monotonic()
            deadline = None if not first_byte_s else asyncio.timeout(first_byte_s)
            try:
                assert c.transport is not None
                c.transport.writelines((head, body))
                if deadline is None:
                    await resp.wait_head()
                else:
                    async with deadline:
                        await resp.wait_head()
                return resp
            except UpstreamError as e:
                resp.close()
                stale = c.reused and not resp.got_bytes and not isinstance(e, BadResponse)
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
        self.wake_waiters()

    async def close(self) -> None:
        self._closed = True
        for p in self._pools.values():
            for c in list(p.idle):
                c.drop()
        self.wake_waiters()
        await asyncio.sleep(0)  # let the transports run their close callbacks
