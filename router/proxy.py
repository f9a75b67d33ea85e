"""The streaming proxy: pick a replica, send the already-read body, stream bytes back.

Owns: one proxied call end to end — scheduling attempts, retry on another replica only
before the first byte, circuit-breaker bookkeeping, header hygiene (hop-by-hop stripped,
``X-Request-Id`` propagated or assigned, upstream API key injected and never echoed),
byte-exact passthrough with backpressure (``await resp.write``), aborting the upstream request
when the client goes away (the handler is cancelled, the upstream connection is closed, so
vLLM frees the KV), an SSE error event when a replica dies mid-stream, and a replica's error
answer put in the route's API shape. Must not import torch, vllm or loadtest; parses no
answer beyond that and a Responses answer's id (which replica holds it, :mod:`router.responses`);
its first and last bytes go to the observers (the usage).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from router import disagg
from router.admission import AdmissionRefused, retry_after
from router.errors import error_response, replica_error_body, sse_error_event
from router.frontdoor import SendWatch, stream_to
from router.hints import call_hint, hinted_body
from router.keys import (
    ADMISSION,
    CALLS,
    CONFIG,
    METRICS,
    PRIORITY,
    REPLICAS,
    RESPONSES,
    STORE,
    UPSTREAM,
)
from router.outcome import ITL_SAMPLES, CallOutcome, usage_from_body, usage_from_stream
from router.priority import (
    PRIORITY_HEADER,
    ROLE_PLAIN,
    call_level,
    call_priority,
    class_of,
    client_hint,
)
from router.responses import RESPONSES_ROUTE
from router.scheduling import RequestContext
from router.scheduling.pipeline import Decision, NoCandidates
from router.state import SessionRecord
from router.upstream import FirstByteTimeout, PoolTimeout, UpstreamResponse

log = logging.getLogger("kvroute.proxy")

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "host", "content-length",
})  # fmt: skip
# Never forwarded: the client's cookies and admin key are the router's business, and the body
# goes upstream decoded (the HTTP parser undid any gzip/deflate), so its old label goes too.
# ``Expect``: the router has read the whole body already, so no replica is asked to continue.
CLIENT_ONLY = frozenset({"cookie", "x-admin-key", "content-encoding", "expect"})
RETRYABLE_STATUS = frozenset({502, 503, 504})
# vLLM's Responses stream opens with these two events at once, before prefill: a first byte
# that is not the first token (TTFT and the end of prefill are measured after them)
_RESPONSE_HEAD = (b"event: response.created", b"event: response.in_progress")


def _response_head(chunk: bytes) -> bool:
    """Whether ``chunk`` holds only a Responses stream's opening events."""
    events = [e for e in chunk.split(b"\n\n") if e.strip()]
    return bool(events) and all(e.lstrip().startswith(_RESPONSE_HEAD) for e in events)


BUFFERED_MAX = 4 << 20  # sized non-SSE responses up to this are read whole, then sent
# a stream's first bytes kept for its observers: Anthropic's ``message_start`` (the prompt's
# usage) and the Responses stream's ``response.created`` (the response id)
HEAD_BYTES = 4096
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


# the per-call drop sets, built once (a ``Connection`` header naming more adds to them)
_UPSTREAM_DROP = HOP_BY_HOP | CLIENT_ONLY | {"x-request-id"}
_UPSTREAM_DROP_AUTH = _UPSTREAM_DROP | {"authorization", "x-api-key"}
_RESPONSE_DROP = (HOP_BY_HOP - {"content-length"}) | {"x-request-id"}


def _drop(headers: Mapping[str, str], base: frozenset[str] = HOP_BY_HOP) -> frozenset[str]:
    """``base`` (hop-by-hop names), plus any the ``Connection`` header lists."""
    conn = headers.get("connection")
    if not conn:
        return base
    return base | {h.strip().lower() for h in conn.split(",") if h.strip()}


def upstream_headers(
    headers: CIMultiDictProxy[str], rid: str, upstream_key: str | None, strip_auth: bool
) -> CIMultiDict[str]:
    drop = _drop(headers, _UPSTREAM_DROP_AUTH if strip_auth or upstream_key else _UPSTREAM_DROP)
    out = CIMultiDict([(k, v) for k, v in headers.items() if k.lower() not in drop])
    out["X-Request-Id"] = rid
    if upstream_key:
        out["Authorization"] = f"Bearer {upstream_key}"
    return out


def response_headers(headers: CIMultiDictProxy[str], rid: str) -> CIMultiDict[str]:
    drop = _drop(headers, _RESPONSE_DROP)
    out = CIMultiDict([(k, v) for k, v in headers.items() if k.lower() not in drop])
    out["X-Request-Id"] = rid
    return out


async def place_session(
    app: web.Application, ctx: RequestContext, record: SessionRecord | None, decision: Decision
) -> str:
    """Record the pick in the session table; a concurrent first placement elsewhere wins.
    A call that is not a session call (``count_tokens``) reads the session, places nothing."""
    store = app[STORE]
    chosen = decision.endpoint.name
    if record is None or not ctx.session_call:
        return chosen
    if store.backend == "redis" and not store.up:
        # Redis away: every router must give a session the same answer without talking to
        # the others — the newest binding published through Redis before it went (every
        # router heard it: router.state), else a rendezvous hash of the session over the
        # replicas the policy ranked (the same healthy set on every router)
        names = [e.name for e, _ in decision.ranked]
        if record.replica not in names:
            chosen = rendezvous(ctx.identity.key, names) or chosen
        else:
            chosen = record.replica
        if record.replica != chosen:
            await store.assign(ctx.identity.key, chosen)  # local view, written back later
        app[METRICS].placed(record.replica, chosen, decision)
        record.replica = chosen
        return chosen
    if record.replica is None:
        owner = await store.claim(ctx.identity.key, chosen)
        if owner != chosen and any(e.name == owner for e, _ in decision.ranked):
            chosen = owner
    elif record.replica != chosen:
        await store.assign(ctx.identity.key, chosen)
    app[METRICS].placed(record.replica, chosen, decision)
    record.replica = chosen
    return chosen


def set_priority(
    app: web.Application,
    ctx: RequestContext,
    client_headers: Mapping[str, str],
    headers: CIMultiDict[str],
    record: SessionRecord | None,
) -> None:
    """Put the call's session-level priority (:func:`router.priority.call_priority`) in
    ``X-Vllm-Priority``, which vLLM reads before the body's ``priority`` field (and on every
    route it serves: its Anthropic route has no ``priority`` field), replacing any the client
    sent. A call outside the session table (``count_tokens``) gets the level of a new one."""
    pcfg = app[PRIORITY]
    service, role = (0, ROLE_PLAIN)
    if record is not None and ctx.session_call:
        service, role = app[STORE].priority_inputs(ctx.identity.key)
    hint = client_hint(client_headers, ctx.body)
    ctx.priority_level = call_level(service, role, hint, pcfg)
    ctx.priority = call_priority(service, role, hint, time.time(), pcfg)
    headers.popall(PRIORITY_HEADER, None)
    headers[PRIORITY_HEADER] = str(ctx.priority)


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
    calls = app[CALLS]
    route = ctx.route
    headers = upstream_headers(request.headers, ctx.request_id, cfg.upstream_api_key,
                               cfg.auth_enabled)  # fmt: skip
    # only the matched API route goes upstream, never the client's raw path (the app's routes
    # are an allow-list and the front door refused dot segments before routing)
    query = request.rel_url.raw_query_string
    path = route + ("?" + query if query else "")
    ctx.hint = call_hint(route, ctx.identity, record, cfg.engine_hints)
    if cfg.priority == "session":
        set_priority(app, ctx, request.headers, headers, record)
    hinted = hinted_body(route, ctx.body, ctx.hint)
    if hinted is not None:
        raw = hinted  # retention hint set, or a client-set kvroute hint stripped
    gate = app[ADMISSION]
    if gate is not None and ctx.session_call:
        refused = await _admit(app, ctx, gate, route_label)
        if refused is not None:
            return refused
    exclude: frozenset[str] = frozenset()
    if disagg.pd_enabled(replicas):  # a P/D set: split the call, or run it decode-side
        if route in disagg.PD_ROUTES and ctx.session_call and cfg.pd_mode != "never":
            done = await forward_pd(request, ctx, raw, record, t0, route_label, headers, path)
            if done is not None:
                return done
        # colocated (priced so, pd_mode never, another API route): never on a prefill-only
        # replica, which serves prefill legs only
        exclude = disagg.not_decode(replicas.views())
    tried: set[str] = set()
    last_problem = "no healthy replica"
    silent = 0  # replicas that sent nothing within first_byte_timeout_s
    streamed = ctx.body.get("stream") is True
    for attempt in range(cfg.retries + 1):
        ctx.excluded = frozenset(tried) | exclude
        try:
            decision = calls.decide(ctx, replicas.views(), record)
        except NoCandidates:
            break
        name = await place_session(app, ctx, record, decision)
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
                                      decision, last_attempt=attempt == cfg.retries)  # fmt: skip
        except PoolTimeout as e:  # the router's own limit: no retry, the replica not blamed
            return _pool_full(ctx, route_label, cfg.health_interval_s, e, metrics)
        except _RetryElsewhere as e:
            last_problem = e.reason
            if e.first_byte:
                silent += 1
                if not streamed and silent > 1:  # a non-streamed call is moved once only
                    break
            metrics.retries_by(e.kind).inc()
            log.warning("request %s: %s on %s; trying another replica", ctx.request_id,
                        e.reason, name)  # fmt: skip
        finally:
            replica.inflight -= 1
            replica.finished += 1
            if is_probe and replica.breaker.probe_inflight:
                replica.breaker.on_abandon()  # the probe ended undecided (client went away)
    if silent and not streamed:
        # nothing arrived in time, here and on the one other replica tried (or no other one)
        metrics.requests_by(route_label, "-", "504").inc()
        return error_response(
            route, 504, "no replica answered within the first-byte timeout", "timeout",
            headers={"X-Request-Id": ctx.request_id},
        )  # fmt: skip
    metrics.requests_by(route_label, "-", "503").inc()
    return error_response(
        route, 503, f"no replica could take the request ({last_problem})", "service_unavailable",
        headers={"Retry-After": str(max(1, int(cfg.health_interval_s))),
                 "X-Request-Id": ctx.request_id},
    )  # fmt: skip


def _pool_full(
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


async def _admit(
    app: web.Application, ctx: RequestContext, gate: Any, route_label: str
) -> web.Response | None:
    """Wait in the admission queue (router.admission) while every replica is full: in the
    order of the call's priority (its arrival without one). None: go on; else the answer."""
    metrics = app[METRICS]
    key = ctx.priority
    if key is None:  # priority off: arrival order
        key = call_priority(0, ROLE_PLAIN, None, time.time(), app[PRIORITY])
    try:
        waited = await gate.admit(key)
    except AdmissionRefused as e:
        reason = "queue_full" if e.status == 429 else "timeout"
        metrics.admission_refused.labels(reason).inc()
        metrics.requests_by(route_label, "-", str(e.status)).inc()
        kind = "rate_limit_exceeded" if e.status == 429 else "service_unavailable"
        return error_response(ctx.route, e.status, e.message, kind,
                              headers={"Retry-After": retry_after(e.retry_after_s),
                                       "X-Request-Id": ctx.request_id})  # fmt: skip
    if waited > 0:
        level = ctx.priority_level
        metrics.admission_wait.labels("-" if level is None else class_of(level)).observe(waited)
    return None


class _PrefillRefused(Exception):
    """The prefill leg's replica answered the call with a client error (4xx): the decode leg
    would get the same, so that answer is the client's."""

    def __init__(self, status: int, body: bytes):
        super().__init__(f"prefill leg answered {status}")
        self.status, self.body = status, body


async def forward_pd(
    request: web.Request,
    ctx: RequestContext,
    raw: bytes,
    record: SessionRecord | None,
    t0: float,
    route_label: str,
    headers: CIMultiDict[str],
    path: str,
) -> web.StreamResponse | None:
    """One call over a disaggregated set (:mod:`router.disagg`): a prefill leg on the replica
    the policy picks among the prefill-capable ones (``kv_cost``'s fetch-or-recompute cost,
    the session placed there: that is where its prefix lives), then the decode leg, streamed,
    on the decode replica with the least load and the most KV room, carrying the prefill
    leg's ``kv_transfer_params``. Returns None when the call is to run colocated instead —
    the per-call price says so (``pd_mode: auto``), the body is not JSON, or every prefill
    leg failed before answering — and the caller then runs it as one call on the decode
    side. A prefill leg that fails (no answer, a 5xx, a timeout) is retried on another
    prefill replica; one answered with a 4xx is the client's answer."""
    app = request.app
    cfg = app[CONFIG]
    replicas = app[REPLICAS]
    calls = app[CALLS]
    metrics = app[METRICS]
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict):
        return None
    pbody = orjson.dumps(disagg.prefill_body(body))
    pheaders = headers.copy()
    pheaders["Accept-Encoding"] = "identity"  # the leg's JSON is read here
    tried: set[str] = set()
    params: Any = None
    decision: Decision | None = None
    dview = None
    prefilled = None  # the replica whose prefill leg answered
    for attempt in range(cfg.retries + 1):
        views = replicas.views()
        ctx.excluded = frozenset(tried) | disagg.not_prefill(views)
        try:
            decision = calls.decide(ctx, views, record, dry_run=True)
        except NoCandidates:
            decision = None
            break
        if attempt == 0:
            dview = disagg.pick_decode(ctx, views)
            if dview is None:
                return None  # the colocated path answers (503 when nothing can take it)
            kv = calls.snapshot(views, record).state("kv")
            terms = disagg.plan(ctx, decision.endpoint, dview, kv, mode=cfg.pd_mode,
                                min_prompt_tokens=cfg.pd_min_prompt_tokens,
                                body_bytes=len(raw))  # fmt: skip
            ctx.extra["pd"] = {
                **(terms.as_dict() if terms is not None else {"mode": cfg.pd_mode}),
                "decode": dview.name,
            }
            if terms is not None and not terms.disaggregate:
                metrics.pd_calls(False, terms.reason)
                return None
        calls.commit(ctx, decision)
        name = await place_session(app, ctx, record, decision)
        replica = replicas.get(name)
        tried.add(name)
        if replica is None or not replica.breaker.allows():
            continue
        if attempt == 0:
            metrics.added_latency.observe(time.perf_counter() - t0)
        is_probe = replica.breaker.on_send()
        replica.inflight += 1
        try:
            params = await _prefill_leg(app, ctx, replica, pheaders, path, pbody)
            prefilled = name
            break
        except PoolTimeout as e:  # the router's own limit: no retry, the replica not blamed
            return _pool_full(ctx, route_label, cfg.health_interval_s, e, metrics)
        except _RetryElsewhere as e:
            metrics.retries_by(e.kind).inc()
            log.warning("request %s: prefill leg %s on %s; trying another prefill replica",
                        ctx.request_id, e.reason, name)  # fmt: skip
        except _PrefillRefused as e:
            metrics.requests_by(route_label, name, str(e.status)).inc()
            shaped = replica_error_body(ctx.route, e.status, e.body)
            return web.Response(status=e.status, body=shaped if shaped is not None else e.body,
                                headers={"Content-Type": "application/json",
                                         "X-Request-Id": ctx.request_id})  # fmt: skip
        finally:
            replica.inflight -= 1
            replica.finished += 1
            if is_probe and replica.breaker.probe_inflight:
                replica.breaker.on_abandon()
    if prefilled is None:
        why = "prefill_failed" if tried else "no_prefill_replica"
        log.warning("request %s: %s; running it colocated", ctx.request_id, why)
        metrics.pd_calls(False, why)
        return None
    assert decision is not None  # set by the attempt whose prefill leg answered
    metrics.pd_calls(True, (ctx.extra.get("pd") or {}).get("reason", cfg.pd_mode))
    ctx.extra["pd_prefill"] = prefilled
    calls.first_byte(ctx)  # the prompt's prefill is over
    dbody = orjson.dumps(disagg.decode_body(body, params))
    tried_d: set[str] = set()
    last_problem = "no decode replica"
    for attempt in range(cfg.retries + 1):
        if attempt:
            dview = disagg.pick_decode(ctx, replicas.views(), frozenset(tried_d))
        if dview is None:
            break
        tried_d.add(dview.name)
        dreplica = replicas.get(dview.name)
        if dreplica is None or not dreplica.breaker.allows():
            continue
        ctx.extra["pd_decode"] = dreplica.name
        is_probe = dreplica.breaker.on_send()
        dreplica.inflight += 1
        try:
            return await _stream_from(request, ctx, dbody, headers, path, dreplica, t0,
                                      route_label, decision,
                                      last_attempt=attempt == cfg.retries)  # fmt: skip
        except PoolTimeout as e:
            return _pool_full(ctx, route_label, cfg.health_interval_s, e, metrics)
        except _RetryElsewhere as e:
            last_problem = e.reason
            metrics.retries_by(e.kind).inc()
            log.warning("request %s: decode leg %s on %s; trying another decode replica",
                        ctx.request_id, e.reason, dreplica.name)  # fmt: skip
        finally:
            dreplica.inflight -= 1
            dreplica.finished += 1
            if is_probe and dreplica.breaker.probe_inflight:
                dreplica.breaker.on_abandon()
    metrics.requests_by(route_label, "-", "503").inc()
    app[CALLS].finish(ctx, CallOutcome(None, "503", duration_s=time.perf_counter() - t0,
                                       decision=decision))  # fmt: skip
    return error_response(
        ctx.route, 503, f"no decode replica could take the request ({last_problem})",
        "service_unavailable",
        headers={"Retry-After": str(max(1, int(cfg.health_interval_s))),
                 "X-Request-Id": ctx.request_id},
    )  # fmt: skip


async def _prefill_leg(
    app: web.Application,
    ctx: RequestContext,
    replica: Any,
    headers: CIMultiDict[str],
    path: str,
    body: bytes,
) -> Any:
    """Send the prefill leg; its answer's ``kv_transfer_params`` (None when the replica runs
    no connector: the decode leg then prefills itself). Raises :class:`_RetryElsewhere` on no
    answer or a 5xx, :class:`_PrefillRefused` on a 4xx."""
    if replica.auth:
        headers = headers.copy()
        headers["Authorization"] = replica.auth
    try:
        resp = await app[UPSTREAM].request("POST", replica.url, path, headers, body)
    except UPSTREAM_ERRORS as e:
        replica.breaker.on_failure()
        raise _RetryElsewhere("no_response", f"{type(e).__name__}") from None
    try:
        try:
            data = await resp.read()
        except UPSTREAM_ERRORS as e:
            replica.breaker.on_failure()
            raise _RetryElsewhere("no_response", f"{type(e).__name__} mid-body") from None
        if resp.status >= 500:
            replica.breaker.on_failure()
            raise _RetryElsewhere("status", f"upstream status {resp.status}")
        replica.breaker.on_success()
        if resp.status >= 400:
            raise _PrefillRefused(resp.status, data)
        try:
            answer = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise _RetryElsewhere("status", "prefill leg answer is not JSON") from None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        return params if isinstance(params, dict) else None
    except asyncio.CancelledError:
        resp.close()  # the client went away: the prefill replica aborts the leg
        raise
    finally:
        resp.release()


def rendezvous(key: str, names: list[str]) -> str | None:
    """Highest-random-weight choice of ``names`` for ``key`` (stable across processes)."""
    best, best_w = None, b""
    for n in names:
        w = hashlib.blake2b(f"{key}\x00{n}".encode("utf-8", "surrogateescape"),
                            digest_size=8).digest()  # fmt: skip
        if best is None or w > best_w:
            best, best_w = n, w
    return best


class _RetryElsewhere(Exception):
    def __init__(self, kind: str, reason: str, first_byte: bool = False):
        super().__init__(reason)
        self.kind, self.reason, self.first_byte = kind, reason, first_byte


async def _stream_from(
    request: web.Request,
    ctx: RequestContext,
    raw: bytes,
    headers: CIMultiDict[str],
    path: str,
    replica: Any,
    t0: float,
    route_label: str,
    decision: Decision,
    last_attempt: bool,
) -> web.StreamResponse:
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
        raise _RetryElsewhere("no_response", f"no response head in {first_byte:g} s",
                              first_byte=True) from None  # fmt: skip
    except UPSTREAM_ERRORS as e:
        replica.breaker.on_failure()
        raise _RetryElsewhere("no_response", f"{type(e).__name__}") from None
    watch: SendWatch | None = None
    try:
        if resp.status in RETRYABLE_STATUS and not last_attempt:
            replica.breaker.on_failure()
            raise _RetryElsewhere("status", f"upstream status {resp.status}")
        if resp.status >= 500:
            replica.breaker.on_failure()
        else:
            replica.breaker.on_success()
        sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        if (resp.content_length is not None and resp.content_length <= BUFFERED_MAX) or (
            resp.status >= 400 and not sse  # an error answer: read whole, put in API shape
        ):
            # a sized, non-streaming body: one read, one write (cheaper than chunk streaming)
            return await _buffered(request, ctx, resp, replica.name, t0, route_label, decision)
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
            if first_at is None and not (ctx.route == "/v1/responses" and _response_head(chunk)):
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
    request: web.Request,
    ctx: RequestContext,
    resp: UpstreamResponse,
    name: str,
    t0: float,
    route_label: str,
    decision: Decision,
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
