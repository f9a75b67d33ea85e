"""The streaming proxy: one call from a validated request to its answer.

Owns: :func:`handle_call` (the call's beginning and end around the send: analysis and the
session table, :meth:`router.call.CallSequence.begin` / ``end``) and :func:`forward` — the
attempts: header hygiene (:mod:`router.headers`), the engine hints, the session-level
priority header, the admission queue, the split of a call over a P/D set
(:mod:`router.proxy_pd`), then per attempt the placement (:mod:`router.placement`: decide,
place the session) and the send on that replica (:mod:`router.relay`: stream back, breaker
verdicts, the outcome to the observers), retrying on another replica only before the first
byte; the 503 / 504 when no replica could take it. Must not import torch, vllm or loadtest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from router import disagg
from router.admission import AdmissionRefused, retry_after
from router.errors import error_response
from router.headers import upstream_headers
from router.hints import call_hint, hinted_body
from router.keys import (
    ADMISSION,
    CALLS,
    CONFIG,
    METRICS,
    PRIORITY,
    REPLICAS,
    STORE,
)
from router.placement import place_call
from router.priority import (
    PRIORITY_HEADER,
    ROLE_PLAIN,
    call_level,
    call_priority,
    class_of,
    client_hint,
)
from router.proxy_pd import forward_pd
from router.relay import ProxiedCall, RetryElsewhere, pool_full, stream_from
from router.scheduling import RequestContext
from router.scheduling.pipeline import NoCandidates
from router.state import SessionRecord
from router.upstream import PoolTimeout

log = logging.getLogger("kvroute.proxy")


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


async def handle_call(
    request: web.Request, ctx: RequestContext, raw: bytes, t0: float, route_label: str
) -> web.StreamResponse:
    """A validated call from :mod:`router.api`, to its end: :meth:`CallSequence.begin
    <router.call.CallSequence.begin>` (analysis, the session table), :func:`forward`, and
    :meth:`~router.call.CallSequence.end` however it ended."""
    calls, store = request.app[CALLS], request.app[STORE]
    record = await calls.begin(ctx, store)
    try:
        return await forward(ProxiedCall(request, ctx, record, t0, route_label), raw)
    finally:
        await calls.end(ctx, store)


async def forward(call: ProxiedCall, raw: bytes) -> web.StreamResponse:
    """Proxy one call whose body is ``raw``; returns the (already streamed) response."""
    request, ctx, record = call.request, call.ctx, call.record
    t0, route_label = call.t0, call.route_label
    app = request.app
    cfg = app[CONFIG]
    metrics = app[METRICS]
    replicas = app[REPLICAS]
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
            done = await forward_pd(call, raw, headers, path)
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
            decision, name = await place_call(app, ctx, replicas.views(), record)
        except NoCandidates:
            break
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
            return await stream_from(call, raw, headers, path, replica, decision,
                                     last_attempt=attempt == cfg.retries)  # fmt: skip
        except PoolTimeout as e:  # the router's own limit: no retry, the replica not blamed
            return pool_full(ctx, route_label, cfg.health_interval_s, e, metrics)
        except RetryElsewhere as e:
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
