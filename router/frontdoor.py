"""The front door: what a connection and a request go through before a handler runs.

Owns:

- :class:`FrontDoorRunner` — an ``aiohttp`` ``AppRunner`` whose connections are
  :class:`FrontDoorHandler`: the HTTP parser's own errors (bad request line, malformed or
  oversized header, undecodable body encoding) and unhandled exceptions answer a JSON error
  that echoes no request bytes, and are logged by exception type only (aiohttp's default
  puts the offending header line, keys included, in the body and in an ERROR log line);
  a request head must be complete ``header_timeout_s`` after its first byte (slowloris), and
  a connection without a request in progress is closed after ``keepalive_timeout`` (aiohttp
  arms that timer at connection start too, so a silent connection goes as well); ``CONNECT``
  is refused (405 JSON) and, like any request that asks for an upgrade, the bytes after its
  head are never parsed as another request: the connection closes after the answer.
- :func:`stream_to` and :class:`SendWatch` — for streamed answers: an HTTP/1.0 client's
  stream ends with the connection (``Connection: close``), and a client that stops reading
  is cut after ``send_timeout_s`` with one write blocked (the upstream call is then closed).
- :func:`json_errors` — the app middleware: refuses dot segments and encoded separators in the
  path (``/v1/%2e%2e/reset_prefix_cache``), header values that are not UTF-8, and turns every
  ``HTTPException`` (404, 405, 413 ...) and unhandled error into the JSON error of the route's
  API family (:mod:`router.errors`).

Checked against aiohttp 3.14 (``web_protocol.RequestHandler.handle_error`` /
``_make_error_handler`` / ``data_received``); ``tests/integration/test_frontdoor.py`` pins
the behaviour with raw sockets, so an aiohttp upgrade that changes it fails there.
Must not import :mod:`router.api`, :mod:`router.app`, torch or vllm.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from typing import Any, cast
from urllib.parse import unquote

from aiohttp import HttpVersion11, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse
from aiohttp.web_server import Server

from router.errors import error_body, error_response, status_error_type, status_message

log = logging.getLogger("kvroute.frontdoor")

# set on a request whose header values the server-level wrapper has checked already
HEADERS_CHECKED = web.RequestKey("kvroute.headers_checked", bool)

__all__ = ["FrontDoorRunner", "SendWatch", "json_errors", "path_problem", "stream_to"]


def _exc_name(exc: BaseException | None) -> str:
    return type(exc).__name__ if exc is not None else "-"


def _where(exc: BaseException | None) -> str:
    """The traceback's frames without the exception's message (which may hold request bytes)."""
    if exc is None or exc.__traceback__ is None:
        return ""
    return "".join(traceback.format_tb(exc.__traceback__)[-4:])


class FrontDoorHandler(RequestHandler):
    """One client connection: JSON parser errors without echo, and a request-head deadline."""

    header_timeout_s: float = 10.0
    _head_timer: asyncio.TimerHandle | None = None
    _head_mark = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        # the first bytes of a new request head (no request being handled, none queued)
        if self._head_timer is None and self._current_request is None and not self._messages:
            self._arm_head_timer()
        super().data_received(data)
        if self._upgraded:
            # a CONNECT or Upgrade request: the parser stopped at its head and keeps what
            # follows as a tunnel's bytes, which aiohttp parses as the next request once the
            # upgrade is declined (a CONNECT's "body" served as a second request, issue 45).
            # The router tunnels nothing: those bytes are dropped, no more are read, and the
            # connection closes after the answer to the request.
            self._message_tail = b""
            self._close = True

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self.header_timeout_s <= 0:
            return
        self._head_mark = self._request_count
        self._head_timer = self._loop.call_later(self.header_timeout_s, self._head_deadline)

    def _head_deadline(self) -> None:
        self._head_timer = None
        if self._request_count != self._head_mark:
            return  # a request head arrived in time
        if self._current_request is None and not self._messages:
            log.info("closing a connection that sent no complete request head in %.1f s",
                     self.header_timeout_s)  # fmt: skip
            self.force_close()

    def log_exception(self, *args: Any, **kw: Any) -> None:
        exc = kw.get("exc_info")
        msg = str(args[0]) if args else "error"
        if isinstance(exc, RequestPayloadError | HttpProcessingError):  # the client's fault
            log.info("%s: %s", msg.split(" from ")[0], _exc_name(exc))
            return
        log.error("%s: %s (message withheld)\n%s", msg.split(" from ")[0], _exc_name(exc),
                  _where(exc if isinstance(exc, BaseException) else None))  # fmt: skip

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> StreamResponse:
        if status >= 500:
            log.error("HTTP %d: %s (message withheld)\n%s", status, _exc_name(exc), _where(exc))
        else:
            log.info("HTTP %d from the request parser: %s", status, _exc_name(exc))
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send the error")
        try:
            route = request.path
        except Exception:
            route = "/"
        text = "malformed HTTP request" if status == 400 else status_message(status)
        resp = web.Response(
            status=status,
            body=error_body(route, status, text, status_error_type(status)),
            content_type="application/json",
        )
        resp.force_close()
        return resp


class FrontDoorServer(Server):
    """aiohttp's low-level server, making :class:`FrontDoorHandler` connections."""

    header_timeout_s: float = 10.0

    def __call__(self) -> RequestHandler:
        h = FrontDoorHandler(self, loop=self._loop, **self._kwargs)
        h.header_timeout_s = self.header_timeout_s
        return h


class FrontDoorRunner(web.AppRunner):
    """``web.AppRunner`` for the router: same arguments plus ``header_timeout_s``."""

    def __init__(self, app: web.Application, *, header_timeout_s: float = 10.0, **kw: Any):
        super().__init__(app, **kw)
        self._header_timeout_s = header_timeout_s

    async def _make_server(self) -> Server:
        base = await super()._make_server()  # starts the app, builds the stock server
        server = FrontDoorServer(
            _outside_middlewares(base.request_handler),
            request_factory=base.request_factory,
            handler_cancellation=base.handler_cancellation,
            loop=base._loop,
            **base._kwargs,
        )
        server.header_timeout_s = self._header_timeout_s
        return server


def _as_json(request: web.BaseRequest, e: web.HTTPException) -> web.Response:
    headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
    return error_response(request.path, e.status, status_message(e.status),
                          status_error_type(e.status), headers=headers)  # fmt: skip


def _outside_middlewares(handler: Any) -> Any:
    """aiohttp answers some requests before the app's middlewares run — an ``Expect`` header
    other than ``100-continue`` raises a plain-text 417 that quotes the header — so the
    server's own handler is wrapped as well."""

    async def handle(request: web.BaseRequest) -> StreamResponse:
        if request.method == "CONNECT":  # not a proxy (its bytes after the head: above)
            resp = error_response("/", 405, "CONNECT is not served", "method_not_allowed",
                                  headers={"Allow": "GET, POST, DELETE"})  # fmt: skip
            resp.force_close()
            return resp
        problem = header_problem(request)
        request[HEADERS_CHECKED] = True  # the app's middleware need not look again
        if problem is None:
            expect = request.headers.get("expect")
            if expect is not None and expect.lower() != "100-continue":
                return error_response(request.path, 417, "only Expect: 100-continue is served")
        else:
            return error_response(request.path, 400, problem)
        try:
            return cast(StreamResponse, await handler(request))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _as_json(request, e)

    return handle


# ---- streamed answers ----------------------------------------------------------------------


def stream_to(request: web.BaseRequest, resp: web.StreamResponse) -> None:
    """Make ``resp`` (a body of unknown length, about to be prepared) end unambiguously for
    the client that sent ``request``: an HTTP/1.0 client has no chunked encoding, so the end
    of the body is the end of the connection — ``Connection: close``, and the connection
    closes once the body is written. (aiohttp drops keep-alive for such a body but still
    keeps the connection open when the client asked ``Connection: keep-alive``, so the client
    waited for ``idle_timeout_s`` to learn the body had ended: issue 45.)"""
    if request.version < HttpVersion11:
        resp.force_close()
        resp.headers["Connection"] = "close"


class SendWatch:
    """Cuts a client that stops reading a streamed answer: one write blocked (the client's
    socket buffer full, backpressure) for ``timeout_s`` aborts the client's connection, which
    cancels the handler and so closes the upstream call (the replica frees the request).

    One timer per stream, re-armed every ``timeout_s``; the stream marks each write
    (``since = now`` before, ``None`` after): no timeout context per chunk. The bytes held
    meanwhile are bounded by backpressure (the transport's high-water mark, one chunk, the
    kernel's socket buffers); the time by ``timeout_s``."""

    __slots__ = ("_handle", "_loop", "_request", "cut", "since", "timeout_s")

    def __init__(self, request: web.BaseRequest, timeout_s: float):
        self._request = request
        self.timeout_s = timeout_s
        self.since: float | None = None  # time.perf_counter() when the write in progress began
        self.cut = False
        self._loop = asyncio.get_running_loop()
        self._handle: asyncio.TimerHandle | None = None
        if timeout_s > 0:
            self._handle = self._loop.call_later(timeout_s, self._check)

    def _check(self) -> None:
        since, now = self.since, time.perf_counter()
        if since is not None and now - since >= self.timeout_s:
            self._handle = None
            self.cut = True
            log.info("cutting a client that read nothing of its stream for %.1f s",
                     self.timeout_s)  # fmt: skip
            t = self._request.transport
            if t is not None:
                t.abort()  # not close(): that would wait to flush to a client that never reads
            return
        wait = self.timeout_s if since is None else self.timeout_s - (now - since)
        self._handle = self._loop.call_later(max(wait, 0.01), self._check)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


# ---- the middleware ----------------------------------------------------------------------


def path_problem(raw_path: str) -> str | None:
    """Why a raw request path is refused (dot segments, encoded or not; encoded ``/`` or
    ``\\``; NUL; backslashes), or None. ``raw_path`` is the path as sent, without the query."""
    plain = "%" not in raw_path and "." not in raw_path  # nothing to decode, no dot
    if plain and "\\" not in raw_path and "\x00" not in raw_path:
        return None  # the usual API path
    low = raw_path.lower()
    if "%2f" in low or "%5c" in low or "%00" in low:
        return "the path has an encoded separator"
    decoded = unquote(raw_path)
    if "\\" in decoded or "\x00" in decoded:
        return "the path has a backslash"
    if any(seg in (".", "..") for seg in decoded.split("/")):
        return "the path has dot segments"
    return None


def header_problem(request: web.BaseRequest) -> str | None:
    """A header value that is not UTF-8 (aiohttp keeps such bytes as surrogates)."""
    for v in request.headers.values():
        if not v.isascii():
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return "a header value is not valid UTF-8"
    return None


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    route = request.path
    problem = path_problem(request.rel_url.raw_path) or (
        None if HEADERS_CHECKED in request else header_problem(request)
    )
    if problem is not None:
        return error_response(route, 400, problem)
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _as_json(request, e)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:
        log.error("unhandled %s on a request (message withheld)\n%s", _exc_name(e), _where(e))
        return error_response(route, 500, "internal error", "internal_error")
