"""One attempt of a proxied call on one replica: send, then stream or relay the answer back.

Owns: the send through the upstream client (a replica URL's credentials as its
``Authorization``), the first-byte deadline, circuit-breaker verdicts, :class:`RetryElsewhere`
(no answer or a retryable status before the first byte: the caller tries another replica),
byte-exact streaming with backpressure (``await resp.write``), the stream idle timeout, an SSE
error event when a replica dies mid-stream, aborting the upstream request when the client goes
away (the upstream connection is closed, so vLLM frees the KV), a sized answer read whole (a
replica's error answer put in the route's API shape), the per-call metrics, the first-byte
hook and :meth:`router.call.CallSequence.finish` with the call's outcome (its usage from the
first and last bytes), and which replica holds a Responses answer (:mod:`router.responses`).
Also :class:`ProxiedCall`, what the proxy's steps (:mod:`router.proxy`, :mod:`router.proxy_pd`
and this module) pass along for one call. Must not import torch, vllm or loadtest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from router.errors import error_response, replica_error_body, sse_error_event
from router.frontdoor import SendWatch, stream_to
from router.headers import response_headers
from router.keys import CALLS, CONFIG, METRICS, REPLICAS, RESPONSES, UPSTREAM
from router.outcome import ITL_SAMPLES, CallOutcome, usage_from_body, usage_from_stream
from router.responses import RESPONSES_ROUTE
from router.scheduling import RequestContext
from router.scheduling.pipeline import Decision
from router.state import SessionRecord
from router.upstream import FirstByteTimeout, PoolTimeout, UpstreamResponse

log = logging.getLogger("kvroute.relay")


RETRYABLE_STATUS = frozenset({502, 503, 504})
# vLLM's Responses stream opens with these two events at once, before prefill: a first byte
# that is not the first token (TTFT and the end of prefill are measured after them)
_RESPONSE_HEAD = (b"event: response.created", b"event: response.in_progress")


def response_head(chunk: bytes) -> bool:
    """Whether ``chunk`` holds only a Responses stream's opening events."""
    events = [e for e in chunk.split(b"\n\n") if e.strip()]
    return bool(events) and all(e.lstrip().startswith(_RESPONSE_HEAD) for e in events)


BUFFERED_MAX = 4 << 20  # sized non-SSE responses up to this are read whole, then sent
# a stream's first bytes kept for its observers: Anthropic's ``message_start`` (the prompt's
# usage) and the Responses stream's ``response.created`` (the response id)
HEAD_BYTES = 4096
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


def pool_full(
    ctx: RequestContext, route_label: str, retry_s: float, e: PoolTimeout, metrics: Any
) -> web.Response:
    """503 for a call that waited ``pool_timeout_s`` for an upstream connection: the message
    names the router's limit that was reached (the replica was not tried, nor blamed)."""
    metrics.pool_timeouts.labels(e.limit).inc()
    metrics.requests_by(route_label, "-", "503").inc()
    log.warning("request %s: %s", ctx.request_id, e)
    return error_response(
        ctx.route, 503, f"router connection limit reached: {e} (pool_timeout_s)",
        "service_unavailable",
        headers={"Retry-After": str(max(1, int(retry_s))), "X-Request-Id": ctx.request_id},
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class ProxiedCall:
    """One call as the proxy carries it through its attempts (:func:`router.proxy.forward`,
    :func:`router.proxy_pd.forward_pd`, :func:`stream_from`): the client's request, the
    call's scheduling context, its session record (None outside the session table), when it
    arrived (``time.perf_counter()``) and its route's metrics label. The body, headers and
    path sent upstream travel apart: they change on the way (engine hints, the P/D legs)."""

    request: web.Request
    ctx: RequestContext
    record: SessionRecord | None
    t0: float
    route_label: str


class RetryElsewhere(Exception):
    """No answer (``kind`` "no_response"), or a status the caller retries (``kind`` "status",
    the replica's ``status``), before the first byte reached the client."""

    def __init__(self, kind: str, reason: str, first_byte: bool = False, status: int | None = None):
        super().__init__(reason)
        self.kind, self.reason, self.first_byte, self.status = kind, reason, first_byte, status


async def stream_from(
    call: ProxiedCall,
    raw: bytes,
    headers: CIMultiDict[str],
    path: str,
    replica: Any,
    decision: Decision,
    last_attempt: bool,
    handled: frozenset[int] = frozenset(),
) -> web.StreamResponse:
    """Send ``raw`` to ``path`` on ``replica`` and relay the answer to the client (see the
    module docstring); raises :class:`RetryElsewhere` before the first byte: on no answer, on
    a status of :data:`RETRYABLE_STATUS` unless ``last_attempt``, and on any status in
    ``handled`` (ones the caller answers another way, so not held against the replica's
    breaker here: the P/D decode leg's 500, :mod:`router.proxy_pd`)."""
    request, ctx, t0, route_label = call.request, call.ctx, call.t0, call.route_label
    app = request.app
    metrics = app[METRICS]
    name = replica.name
    if replica.auth:  # credentials from the replica's URL win over the upstream key
        headers = headers.copy()
        headers["Authorization"] = replica.auth
    first_byte = app[CONFIG].first_byte_deadline_s(ctx.body.get("stream") is True)
    upstream = app[UPSTREAM]
    try:
        # bounded by the upstream client's pool wait (pool_timeout_s: PoolTimeout, handled by
        # the caller), connect / read (read_timeout_s) timeouts, and by first_byte_timeout_s
        # counted from the send: a replica that sent no response head by then (frozen,
        # stuck) is left, and the call that has received nothing goes to another one. (A
        # redirect is the client's to follow: neither upstream client follows one.)
        resp = await upstream.request(request.method, replica.url, path, headers, raw,
                                      first_byte if first_byte > 0 else None)  # fmt: skip
    except FirstByteTimeout:
        replica.breaker.on_failure()
        raise RetryElsewhere("no_response", f"no response head in {first_byte:g} s",
                              first_byte=True) from None  # fmt: skip
    except UPSTREAM_ERRORS as e:
        replica.breaker.on_failure()
        raise RetryElsewhere("no_response", f"{type(e).__name__}") from None
    watch: SendWatch | None = None
    try:
        if resp.status in handled:
            raise RetryElsewhere("status", f"upstream status {resp.status}", status=resp.status)
        if resp.status in RETRYABLE_STATUS and not last_attempt:
            replica.breaker.on_failure()
            raise RetryElsewhere("status", f"upstream status {resp.status}", status=resp.status)
        if resp.status >= 500:
            replica.breaker.on_failure()
        else:
            replica.breaker.on_success()
        sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        if (resp.content_length is not None and resp.content_length <= BUFFERED_MAX) or (
            resp.status >= 400 and not sse  # an error answer: read whole, put in API shape
        ):
            # a sized, non-streaming body: one read, one write (cheaper than chunk streaming)
            return await _buffered(call, resp, replica.name, decision)
        out = web.StreamResponse(
            status=resp.status,
            reason=resp.reason,
            headers=response_headers(resp.headers, ctx.request_id),
        )
        stream_to(request, out)  # HTTP/1.0: the stream ends with the connection
        watch = SendWatch(request, app[CONFIG].send_timeout_s)  # a client that stops reading
        await out.prepare(request)
        first_at = None
        last_at = 0.0
        itl: list[float] = []
        events = 0
        nbytes = 0
        tail = head = b""
        status = str(resp.status)
        idle = app[CONFIG].stream_idle_timeout_s
        while True:
            try:
                # before the first chunk the wait is prefill (read_timeout_s); after it, a
                # replica silent for stream_idle_timeout_s is frozen: end with an error event
                async with asyncio.timeout(idle if first_at is not None and idle > 0 else None):
                    chunk = await resp.next_chunk()
            except UPSTREAM_ERRORS as e:
                replica.breaker.on_failure()
                status = "upstream_error"
                log.warning("request %s: replica %s failed mid-stream: %r", ctx.request_id,
                            name, e)  # fmt: skip
                if sse:
                    await out.write(
                        sse_error_event(ctx.route, f"replica failed mid-stream: {type(e).__name__}")
                    )
                    await out.write_eof()
                else:
                    if request.transport is not None:  # truncated body: tell the client
                        request.transport.close()
                break
            if not chunk:  # the body is complete
                break
            now = time.perf_counter()
            if first_at is None and not (ctx.route == "/v1/responses" and response_head(chunk)):
                first_at = now
                metrics.ttft_by(name).observe(first_at - t0)
                app[CALLS].first_byte(ctx)  # prefill is over: not queued work any more
            elif len(itl) < ITL_SAMPLES:
                itl.append(now - last_at)
            last_at = now
            if sse:
                events += chunk.count(b"\n\n")
            nbytes += len(chunk)
            tail = (tail + chunk)[-4096:] if len(chunk) < 4096 else chunk[-4096:]
            if len(head) < HEAD_BYTES:
                head += chunk[: HEAD_BYTES - len(head)]
                if ctx.route == RESPONSES_ROUTE and resp.status < 400:
                    _note_response(app, ctx, name, head)
            watch.since = now
            await out.write(chunk)  # backpressure: waits while the client's buffer is full
            watch.since = None
        if status != "upstream_error":
            watch.since = time.perf_counter()
            await out.write_eof()
        end = time.perf_counter()
        if sse and first_at is not None and events > 1:
            metrics.tpot_by(name).observe((end - first_at) / (events - 1))
        metrics.requests_by(route_label, name, status).inc()
        app[CALLS].finish(ctx, CallOutcome(
            name, status, ttft_s=None if first_at is None else first_at - t0,
            duration_s=end - t0, usage=usage_from_stream(head, tail), events=events, bytes=nbytes,
            itl_s=tuple(itl), decision=decision,
        ))  # fmt: skip
        return out
    except asyncio.CancelledError:
        # The client went away: closing the upstream connection makes vLLM abort the request.
        metrics.requests_by(route_label, name, _gone(watch)).inc()
        resp.close()
        raise
    except ConnectionResetError:  # the write found the client gone before the cancellation
        metrics.requests_by(route_label, name, _gone(watch)).inc()
        resp.close()
        return out
    finally:
        if watch is not None:
            watch.stop()
        resp.release()


def _gone(watch: SendWatch | None) -> str:
    """How the client left: cut for reading nothing (send_timeout_s), or gone by itself."""
    return "client_stalled" if watch is not None and watch.cut else "client_closed"


async def _buffered(
    call: ProxiedCall, resp: UpstreamResponse, name: str, decision: Decision
) -> web.StreamResponse:
    ctx, t0, route_label = call.ctx, call.t0, call.route_label
    app = call.request.app
    metrics = app[METRICS]
    try:
        body = await resp.read()
    except UPSTREAM_ERRORS as e:
        resp.close()
        r = app[REPLICAS].get(name)
        if r is not None:
            r.breaker.on_failure()
        log.warning("request %s: replica %s failed mid-body: %r", ctx.request_id, name, e)
        metrics.requests_by(route_label, name, "upstream_error").inc()
        return error_response(
            ctx.route,
            502,
            f"replica failed mid-response: {type(e).__name__}",
            "upstream_error",
            headers={"X-Request-Id": ctx.request_id},
        )
    first = time.perf_counter()
    metrics.ttft_by(name).observe(first - t0)
    headers = response_headers(resp.headers, ctx.request_id)
    headers.popall("Content-Length", None)
    if resp.status >= 400:
        shaped = replica_error_body(ctx.route, resp.status, body)
        if shaped is not None:  # the replica's message, in the client's API family
            body = shaped
            headers["Content-Type"] = "application/json"
    elif ctx.route == RESPONSES_ROUTE:
        _note_response(app, ctx, name, body[:HEAD_BYTES])
    out = web.Response(status=resp.status, reason=resp.reason, body=body, headers=headers)
    metrics.requests_by(route_label, name, str(resp.status)).inc()
    app[CALLS].finish(ctx, CallOutcome(
        name, str(resp.status), ttft_s=first - t0, duration_s=first - t0,
        usage=usage_from_body(body), bytes=len(body), decision=decision,
    ))  # fmt: skip
    return out


def _note_response(app: web.Application, ctx: RequestContext, replica: str, head: bytes) -> None:
    """Remember which replica produced the Responses answer starting with ``head`` (once)."""
    if "response_id" not in ctx.extra:
        rid = app[RESPONSES].note_answer(head, replica, ctx.identity)
        if rid is not None:
            ctx.extra["response_id"] = rid
