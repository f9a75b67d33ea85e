"""The streaming proxy: pick a replica, send the already-read body, stream bytes back.

Owns: one proxied call end to end — scheduling attempts, retry on another replica only
before the first byte, circuit-breaker bookkeeping, header hygiene (hop-by-hop stripped,
``X-Request-Id`` propagated or assigned, upstream API key injected and never echoed),
byte-exact passthrough with backpressure (``await resp.write``), aborting the upstream request
when the client goes away (the handler is cancelled, the upstream connection is closed, so
vLLM frees the KV), and an SSE error event when a replica dies mid-stream. Must not import
torch, vllm or loadtest; does not parse response bodies (observers may).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from router.app import (
    CLIENT,
    CONFIG,
    METRICS,
    OBSERVERS,
    PIPELINE,
    PROMPT_ANALYZER,
    REPLICAS,
    STATE_PROVIDERS,
    STORE,
)
from router.hints import hinted_body
from router.scheduling import RequestContext, Snapshot
from router.scheduling.pipeline import Decision, NoCandidates
from router.state import SessionRecord

log = logging.getLogger("kvroute.proxy")

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "host", "content-length",
})  # fmt: skip
RETRYABLE_STATUS = frozenset({502, 503, 504})
BUFFERED_MAX = 4 << 20  # sized non-SSE responses up to this are read whole, then sent
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


def error_body(route: str, status: int, message: str, etype: str) -> bytes:
    """OpenAI-style error (Anthropic-style on /v1/messages)."""
    if route == "/v1/messages":
        return orjson.dumps({"type": "error", "error": {"type": etype, "message": message}})
    return orjson.dumps(
        {"error": {"message": message, "type": etype, "param": None, "code": status}}
    )


def error_response(
    route: str,
    status: int,
    message: str,
    etype: str = "invalid_request_error",
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    return web.Response(
        status=status, body=error_body(route, status, message, etype),
        content_type="application/json", headers=headers,
    )  # fmt: skip


def request_id(headers: Mapping[str, str]) -> str:
    rid = headers.get("x-request-id", "")
    if 0 < len(rid) <= 128 and rid.isprintable() and " " not in rid:
        return rid
    return uuid.uuid4().hex


def _drop(headers: Mapping[str, str]) -> frozenset[str]:
    """Hop-by-hop names, including any the ``Connection`` header lists."""
    extra = {h.strip().lower() for h in headers.get("connection", "").split(",") if h.strip()}
    return HOP_BY_HOP | extra


def upstream_headers(
    headers: CIMultiDictProxy[str], rid: str, upstream_key: str | None, strip_auth: bool
) -> CIMultiDict[str]:
    drop = _drop(headers)
    if strip_auth or upstream_key:
        drop = drop | {"authorization", "x-api-key"}
    out = CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in drop)
    out["X-Request-Id"] = rid
    if upstream_key:
        out["Authorization"] = f"Bearer {upstream_key}"
    return out


def response_headers(headers: CIMultiDictProxy[str], rid: str) -> CIMultiDict[str]:
    drop = _drop(headers) - {"content-length"}
    out = CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in drop)
    out["X-Request-Id"] = rid
    return out


def sse_error_event(route: str, message: str) -> bytes:
    if route == "/v1/messages":
        payload = orjson.dumps(
            {"type": "error", "error": {"type": "api_error", "message": message}}
        )
        return b"event: error\ndata: " + payload + b"\n\n"
    payload = orjson.dumps(
        {"error": {"message": message, "type": "upstream_error", "param": None, "code": 502}}
    )
    return b"data: " + payload + b"\n\n"


async def run_analyzer(app: web.Application, ctx: RequestContext) -> None:
    fn = app[PROMPT_ANALYZER]
    if fn is None:
        return
    try:
        res = fn(ctx)  # type: ignore[operator]
        if inspect.isawaitable(res):
            await res
    except Exception:
        log.exception("prompt analyzer failed for %s; scheduling without it", ctx.request_id)


def snapshot(app: web.Application, session: SessionRecord | None) -> Snapshot:
    states = {}
    for name, fn in app[STATE_PROVIDERS].items():
        try:
            states[name] = fn()
        except Exception:
            log.exception("state provider %s failed; scorers see None", name)
    return Snapshot(app[REPLICAS].views(), session, app[PIPELINE].seq, states)


async def place_session(
    app: web.Application, ctx: RequestContext, record: SessionRecord | None, decision: Decision
) -> str:
    """Record the pick in the session table; a concurrent first placement elsewhere wins."""
    store = app[STORE]
    chosen = decision.endpoint.name
    if record is None:
        return chosen
    if record.replica is None:
        owner = await store.claim(ctx.identity.key, chosen)
        if owner != chosen and any(e.name == owner for e, _ in decision.ranked):
            chosen = owner
    elif record.replica != chosen:
        await store.assign(ctx.identity.key, chosen)
    record.replica = chosen
    return chosen


async def forward(
    request: web.Request,
    ctx: RequestContext,
    raw: bytes,
    record: SessionRecord | None,
    t0: float,
    route_label: str,
) -> web.StreamResponse:
    """Proxy one call; returns the (already streamed) response."""
    app = request.app
    cfg = app[CONFIG]
    metrics = app[METRICS]
    replicas = app[REPLICAS]
    pipeline = app[PIPELINE]
    route = ctx.route
    headers = upstream_headers(request.headers, ctx.request_id, cfg.upstream_api_key,
                               cfg.auth_enabled)  # fmt: skip
    path = request.rel_url.raw_path_qs
    hinted = hinted_body(route, ctx.body, ctx.identity, record, cfg.engine_hints)
    if hinted is not None:
        raw = hinted  # retention hint set, or a client-set kvroute hint stripped
    tried: set[str] = set()
    last_problem = "no healthy replica"
    for attempt in range(cfg.retries + 1):
        ctx.excluded = frozenset(tried)
        try:
            decision = pipeline.schedule(ctx, snapshot(app, record))
        except NoCandidates:
            break
        name = await place_session(app, ctx, record, decision)
        pipeline.record(decision)
        replica = replicas.get(name)
        if replica is None:  # removed by discovery between snapshot and now
            tried.add(name)
            continue
        tried.add(name)
        if attempt == 0:
            metrics.added_latency.observe(time.perf_counter() - t0)
        if not replica.breaker.allows():  # another call took the half-open probe meanwhile
            continue
        is_probe = replica.breaker.on_send()
        replica.inflight += 1  # exported as kvroute_inflight at scrape time
        try:
            return await _stream_from(request, ctx, raw, headers, path, replica, t0, route_label,
                                      last_attempt=attempt == cfg.retries)  # fmt: skip
        except _RetryElsewhere as e:
            last_problem = e.reason
            metrics.retries.labels(e.kind).inc()
            log.warning("request %s: %s on %s; trying another replica", ctx.request_id,
                        e.reason, name)  # fmt: skip
        finally:
            replica.inflight -= 1
            replica.finished += 1
            if is_probe and replica.breaker.probe_inflight:
                replica.breaker.on_abandon()  # the probe ended undecided (client went away)
    metrics.requests.labels(route_label, "-", "503").inc()
    return error_response(
        route, 503, f"no replica could take the request ({last_problem})", "service_unavailable",
        headers={"Retry-After": str(max(1, int(cfg.health_interval_s))),
                 "X-Request-Id": ctx.request_id},
    )  # fmt: skip


class _RetryElsewhere(Exception):
    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind, self.reason = kind, reason


async def _stream_from(
    request: web.Request,
    ctx: RequestContext,
    raw: bytes,
    headers: CIMultiDict[str],
    path: str,
    replica: Any,
    t0: float,
    route_label: str,
    last_attempt: bool,
) -> web.StreamResponse:
    app = request.app
    metrics = app[METRICS]
    name = replica.name
    try:
        # bounded by the session's sock_connect / sock_read (read_timeout_s) timeouts
        resp = await app[CLIENT].request(
            request.method, replica.url + path, data=raw, headers=headers
        )
    except UPSTREAM_ERRORS as e:
        replica.breaker.on_failure()
        raise _RetryElsewhere("no_response", f"{type(e).__name__}") from None
    try:
        if resp.status in RETRYABLE_STATUS and not last_attempt:
            replica.breaker.on_failure()
            raise _RetryElsewhere("status", f"upstream status {resp.status}")
        if resp.status >= 500:
            replica.breaker.on_failure()
        else:
            replica.breaker.on_success()
        if resp.content_length is not None and resp.content_length <= BUFFERED_MAX:
            # a sized, non-streaming body: one read, one write (cheaper than chunk streaming)
            return await _buffered(request, ctx, resp, replica.name, t0, route_label)
        out = web.StreamResponse(
            status=resp.status,
            reason=resp.reason,
            headers=response_headers(resp.headers, ctx.request_id),
        )
        sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        await out.prepare(request)
        first_at = None
        events = 0
        nbytes = 0
        tail = b""
        status = str(resp.status)
        it = resp.content.iter_any()
        while True:
            try:
                chunk = await it.__anext__()
            except StopAsyncIteration:
                break
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
            if first_at is None:
                first_at = time.perf_counter()
                metrics.ttft.labels(name).observe(first_at - t0)
            if sse:
                events += chunk.count(b"\n\n")
            nbytes += len(chunk)
            tail = (tail + chunk)[-4096:] if len(chunk) < 4096 else chunk[-4096:]
            await out.write(chunk)  # backpressure: waits while the client's buffer is full
        if status != "upstream_error":
            await out.write_eof()
        end = time.perf_counter()
        if sse and first_at is not None and events > 1:
            metrics.tpot.labels(name).observe((end - first_at) / (events - 1))
        metrics.requests.labels(route_label, name, status).inc()
        outcome = {"replica": name, "status": status, "bytes": nbytes, "events": events,
                   "ttft_s": None if first_at is None else first_at - t0,
                   "duration_s": end - t0, "tail": tail}  # fmt: skip
        observe_once(app, ctx, outcome)
        return out
    except asyncio.CancelledError:
        # The client went away: closing the upstream connection makes vLLM abort the request.
        metrics.requests.labels(route_label, name, "client_closed").inc()
        resp.close()
        raise
    except ConnectionResetError:  # the write found the client gone before the cancellation
        metrics.requests.labels(route_label, name, "client_closed").inc()
        resp.close()
        return out
    finally:
        resp.release()


async def _buffered(
    request: web.Request,
    ctx: RequestContext,
    resp: aiohttp.ClientResponse,
    name: str,
    t0: float,
    route_label: str,
) -> web.StreamResponse:
    app = request.app
    metrics = app[METRICS]
    try:
        body = await resp.read()
    except UPSTREAM_ERRORS as e:
        resp.close()
        r = app[REPLICAS].get(name)
        if r is not None:
            r.breaker.on_failure()
        log.warning("request %s: replica %s failed mid-body: %r", ctx.request_id, name, e)
        metrics.requests.labels(route_label, name, "upstream_error").inc()
        return error_response(
            ctx.route,
            502,
            f"replica failed mid-response: {type(e).__name__}",
            "upstream_error",
            headers={"X-Request-Id": ctx.request_id},
        )
    first = time.perf_counter()
    metrics.ttft.labels(name).observe(first - t0)
    headers = response_headers(resp.headers, ctx.request_id)
    headers.popall("Content-Length", None)
    out = web.Response(status=resp.status, reason=resp.reason, body=body, headers=headers)
    metrics.requests.labels(route_label, name, str(resp.status)).inc()
    observe_once(app, ctx, {"replica": name, "status": str(resp.status), "bytes": len(body),
                        "events": 0, "ttft_s": first - t0, "duration_s": first - t0,
                        "tail": body[-4096:]})  # fmt: skip
    return out


def observe_once(app: web.Application, ctx: RequestContext, outcome: dict[str, Any]) -> None:
    if ctx.observed:
        return
    ctx.observed = True
    for fn in app[OBSERVERS]:
        try:
            fn(ctx, outcome)
        except Exception:
            log.exception("observer %r failed", fn)
