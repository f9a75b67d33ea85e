"""HTTP routes: inference APIs, model list, health, metrics and the admin surface.

Owns: request validation (size, time to send the body, JSON, model), authentication
(client API key -> tenant; admin key for ``/admin/*``), the call's identity and context, and
the admin views (replicas, sessions, ``/admin/route?explain=1``). A validated call is handed
to :func:`router.proxy.handle_call` once, which takes it to its end.
Must not import :mod:`router.app` (which imports this), torch, vllm or loadtest.

Routes: ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses``,
``/v1/messages`` and the passthrough API routes (:data:`PASSTHROUGH_ROUTES`, sent to a chosen
replica: routed with their session, but not calls of it), ``GET /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel`` (to the replica that produced the response,
:mod:`router.followup`) — an allow-list: no other path reaches a replica;
``GET /v1/models`` (union over healthy replicas), ``GET /v1/models/{id}``, ``/health``
(liveness), ``/ready`` (a healthy replica and not draining), ``/metrics``; ``GET /admin/replicas``,
``GET /admin/sessions``, ``GET /admin/config``, ``POST /admin/route?explain=1``.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import time
from typing import Any

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CONTENT_TYPE_LATEST

from router.errors import error_response, request_id
from router.followup import ROUTE_CANCEL, ROUTE_GET, forward_by_id
from router.hints import HINTED_ROUTES, retention_hint
from router.keys import (
    CALLS,
    CONFIG,
    KV,
    KV_STATUS,
    METRICS,
    PIPELINE,
    PRIORITY,
    REPLICAS,
    RESPONSES,
    RUNTIME,
    STORE,
)
from router.openapi import openapi_document
from router.outcome import CallOutcome
from router.priority import call_level, call_priority, client_hint
from router.proxy import handle_call
from router.scheduling import RequestContext
from router.scheduling.pipeline import NoCandidates
from router.sessions import SessionIdentity, identify

INFERENCE_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
# other vLLM API routes that take a JSON body and are proxied to a scheduled replica as they are
PASSTHROUGH_ROUTES = (
    "/v1/messages/count_tokens",
    "/v1/embeddings",
    "/v1/score",
    "/v1/rerank",
    "/v1/classify",
)
# request body encodings the HTTP parser decodes (the body then goes upstream plain)
BODY_ENCODINGS = frozenset({"", "identity", "gzip", "deflate"})


class _Reject(Exception):
    def __init__(self, response: web.Response):
        self.response = response


def _tenant(request: web.Request, route: str) -> str:
    cfg = request.app[CONFIG]
    if not cfg.auth_enabled:
        return "-"
    key = request.headers.get("x-api-key", "")
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        key = auth[7:].strip()
    tenant = cfg.api_keys.get(key) if key else None
    if tenant is None:
        raise _Reject(error_response(route, 401, "missing or invalid API key",
                                     "authentication_error"))  # fmt: skip
    return tenant


async def _read_json(request: web.Request, route: str) -> tuple[bytes, dict[str, Any]]:
    cfg = request.app[CONFIG]
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in BODY_ENCODINGS:
        raise _Reject(error_response(route, 415, "unsupported Content-Encoding (use gzip, "
                                     "deflate or none)"))  # fmt: skip
    if request.content_length is not None and request.content_length > cfg.max_body_bytes:
        raise _Reject(error_response(route, 413, f"body over {cfg.max_body_bytes} bytes",
                                     "request_too_large"))  # fmt: skip
    try:
        if request.content.is_eof():  # the whole body has arrived already: no timer needed
            raw = await request.read()
        else:
            async with asyncio.timeout(cfg.client_body_timeout_s):
                raw = await request.read()
    except TimeoutError:
        raise _Reject(error_response(route, 408, "client sent the body too slowly",
                                     "timeout")) from None  # fmt: skip
    except web.HTTPRequestEntityTooLarge:
        raise _Reject(error_response(route, 413, f"body over {cfg.max_body_bytes} bytes",
                                     "request_too_large")) from None  # fmt: skip
    except RequestPayloadError:  # a gzip/deflate body that does not decode
        raise _Reject(error_response(route, 400, "the body does not decode as its "
                                     "Content-Encoding says")) from None  # fmt: skip
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:  # position only: the message quotes no body bytes
        where = f" at line {e.lineno} column {e.colno}" if e.lineno else ""
        raise _Reject(error_response(route, 400, f"invalid JSON body{where}")) from None
    if not isinstance(body, dict):
        raise _Reject(error_response(route, 400, "the JSON body must be an object"))
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _Reject(error_response(route, 400, "'model' must be a string"))
    return raw, body


def known_models(app: web.Application) -> set[str]:
    """Models any replica has listed, healthy or not: a model whose replicas are all down is
    unavailable (503 with Retry-After from scheduling), not unknown (404)."""
    return {m for r in app[REPLICAS] for m in r.models}


def _check_model(app: web.Application, route: str, model: str | None) -> None:
    models = known_models(app)
    if model and models and model not in models:
        raise _Reject(error_response(route, 404, "the model does not exist",
                                     "model_not_found"))  # fmt: skip


async def _context(request: web.Request, route: str) -> tuple[bytes, RequestContext]:
    tenant = _tenant(request, route)
    raw, body = await _read_json(request, route)
    app = request.app
    _check_model(app, route, body.get("model"))
    cfg = app[CONFIG]
    ident = identify(request.headers, body, tenant, cfg.prefix_chars)
    if ident.source == "prefix":  # no session id: a Responses call continuing an answer
        ident = _previous_response_session(app, ident, body)  # is that answer's session's
    ctx = RequestContext(request_id(request.headers), route, body.get("model"), ident, body)
    # count_tokens & co.: routed with the session, not a call of it (nothing to analyze)
    ctx.session_call = route not in PASSTHROUGH_ROUTES
    return raw, ctx


def _previous_response_session(
    app: web.Application, ident: SessionIdentity, body: dict[str, Any]
) -> SessionIdentity:
    """The session of the call whose answer ``previous_response_id`` names (same tenant),
    else ``ident``: a client that chains Responses calls by id sends only the new turn, so
    the conversation's head is not in the body."""
    prev = body.get("previous_response_id")
    owner = app[RESPONSES].get(prev) if isinstance(prev, str) else None
    if owner is None or owner.identity is None or owner.tenant != ident.tenant:
        return ident
    o = owner.identity
    return SessionIdentity(o.tenant, o.session, o.parent, o.agent, ident.final,
                           "previous_response_id")  # fmt: skip


async def handle_inference(request: web.Request) -> web.StreamResponse:
    t0 = time.perf_counter()
    app = request.app
    path = request.path
    route = path if path in INFERENCE_ROUTES else "/v1/*"  # metric label
    rt = app[RUNTIME]
    if rt.draining:
        return error_response(path, 503, "router is shutting down", "service_unavailable",
                              headers={"Retry-After": "1", "Connection": "close"})  # fmt: skip
    rt.enter()
    try:
        try:
            raw, ctx = await _context(request, path)
        except _Reject as r:
            app[METRICS].requests_by(route, "-", str(r.response.status)).inc()
            return r.response
        return await handle_call(request, ctx, raw, t0, route)
    finally:
        rt.leave()


async def handle_response_by_id(request: web.Request) -> web.StreamResponse:
    """``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``: to the replica that
    produced the response (:mod:`router.followup`)."""
    try:
        tenant = _tenant(request, "/v1/responses")
    except _Reject as r:
        return r.response
    rt = request.app[RUNTIME]
    if rt.draining:
        return error_response("/v1/responses", 503, "router is shutting down",
                              "service_unavailable",
                              headers={"Retry-After": "1", "Connection": "close"})  # fmt: skip
    rt.enter()
    try:
        return await forward_by_id(request, tenant)
    finally:
        rt.leave()


async def handle_models(request: web.Request) -> web.Response:
    try:
        _tenant(request, "/v1/models")
    except _Reject as rej:
        return rej.response
    seen: dict[str, dict[str, Any]] = {}
    for r in request.app[REPLICAS]:
        if r.healthy:
            for card in r.model_cards:
                seen.setdefault(str(card["id"]), card)
    data = [seen[k] for k in sorted(seen)]
    return web.Response(body=orjson.dumps({"object": "list", "data": data}),
                        content_type="application/json")  # fmt: skip


async def handle_model(request: web.Request) -> web.Response:
    """``GET /v1/models/{id}``: the card from a healthy replica, else vLLM's JSON 404."""
    try:
        _tenant(request, "/v1/models")
    except _Reject as rej:
        return rej.response
    want = request.match_info["model"]
    for r in request.app[REPLICAS]:
        if r.healthy:
            for card in r.model_cards:
                if str(card["id"]) == want:
                    return web.Response(body=orjson.dumps(card), content_type="application/json")
    return error_response("/v1/models", 404, "the model does not exist", "model_not_found")


async def handle_openapi(request: web.Request) -> web.Response:
    return web.Response(body=orjson.dumps(openapi_document()), content_type="application/json")


async def handle_health(request: web.Request) -> web.Response:
    # which worker process answered (``kvroute serve --workers N`` shares one port)
    worker = request.app[RUNTIME].worker
    return web.json_response({"status": "ok", "worker": worker, "pid": os.getpid()})


async def handle_ready(request: web.Request) -> web.Response:
    app = request.app
    healthy = sum(1 for r in app[REPLICAS] if r.healthy)
    ok = healthy > 0 and not app[RUNTIME].draining
    body = {
        "ready": ok,
        "healthy_replicas": healthy,
        "draining": app[RUNTIME].draining,
        "state_backend": app[STORE].backend,
        "state_backend_up": app[STORE].up,
        # how fully the KV layer runs (full / approximate / affinity / off) and why not fully
        "kv_layer": app[KV_STATUS]().as_dict(),
    }
    return web.json_response(body, status=200 if ok else 503)


async def handle_metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


# --- admin ----------------------------------------------------------------------------


def _admin(request: web.Request) -> None:
    key = request.app[CONFIG].admin_key
    if not key:
        raise _Reject(error_response("/admin", 404, "admin API disabled (no admin key set)",
                                     "not_found"))  # fmt: skip
    given = request.headers.get("x-admin-key", "")
    auth = request.headers.get("authorization", "")
    if not given and auth[:7].lower() == "bearer ":  # X-Admin-Key wins: Authorization may
        given = auth[7:].strip()  # carry the client key of the request being explained
    if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), key.encode()):
        raise _Reject(error_response("/admin", 401, "invalid admin key", "authentication_error"))


def admin(handler: Any) -> Any:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            _admin(request)
            return await handler(request)
        except _Reject as r:
            return r.response

    return wrapped


@admin
async def admin_replicas(request: web.Request) -> web.Response:
    return web.json_response([r.to_json() for r in request.app[REPLICAS]])


@admin
async def admin_sessions(request: web.Request) -> web.Response:
    try:
        limit = max(1, min(10_000, int(request.query.get("limit", "100"))))
    except ValueError:
        return error_response("/admin", 400, "limit must be an integer")
    store = request.app[STORE]
    return web.json_response({
        "backend": store.backend, "backend_up": store.up, "active": store.active_count(),
        "sessions": [s.to_json() for s in store.list(limit)],
    })  # fmt: skip


@admin
async def admin_config(request: web.Request) -> web.Response:
    app = request.app
    calls = app[CALLS]
    kv = app[KV]
    return web.json_response({
        "config": repr(app[CONFIG]),  # secrets masked
        "policy": app[PIPELINE].name,
        "worker": app[RUNTIME].worker,
        "kv_layer": kv is not None,
        "kv_status": app[KV_STATUS]().as_dict(),  # full / approximate / affinity / off, why
        "kv_pool": None if kv is None else _kv_pool(kv),
        "prompt_analyzer": calls.analyzer is not None,
        "state_providers": sorted(calls.state_providers),
        "observers": [getattr(fn, "__qualname__", repr(fn)) for fn in calls.observers],
    })  # fmt: skip


def _kv_pool(kv: Any) -> dict[str, Any]:
    """The cluster pool as the KV layer sees it: occupancy (blocks), its members, and each
    member's pool link as the cost model prices it (calibrated from observed TTFT)."""
    members = sorted(kv.index.pool_members())
    return {"blocks": kv.index.pool_blocks(), "members": members,
            "links": {m: kv.pool_link(m) for m in members}}  # fmt: skip


@admin
async def admin_route(request: web.Request) -> web.Response:
    """Schedule the request in the body as if it were sent; route nothing, record nothing."""
    route = request.query.get("route", "/v1/chat/completions")
    try:
        _raw, ctx = await _context(request, route)
    except _Reject as r:
        return r.response
    app = request.app
    record = await app[STORE].get(ctx.identity.key)
    calls = app[CALLS]
    if ctx.session_call:  # the KV layer's analysis, as a sent call gets it
        pending = calls.analyze(ctx)
        if pending is not None:
            await pending
    try:
        d = calls.decide(ctx, app[REPLICAS].views(), record, dry_run=True,
                         explain=request.query.get("explain") in ("1", "true"))  # fmt: skip
    except NoCandidates as e:
        return web.json_response({"winner": None, "filtered_out": e.removed_by}, status=503)
    finally:
        # undo what the analyzer counted for this request
        calls.finish(ctx, CallOutcome(None, "dry_run"))
    ident = ctx.identity
    out: dict[str, Any] = {
        "winner": d.endpoint.name,
        "worker": app[RUNTIME].worker,  # which process decided (kvroute serve --workers N)
        "identity": {
            "tenant": ident.tenant,
            "session": ident.session,
            "parent": ident.parent,
            "agent": ident.agent,
            "final": ident.final,
            "source": ident.source,
            "key": ident.key,
        },
    }
    if d.explain:
        out["explain"] = d.explain
        if app[CONFIG].engine_hints and route in HINTED_ROUTES:
            out["engine_hint"] = retention_hint(ident, record)
        if app[CONFIG].priority == "session":
            service, role = app[STORE].priority_inputs(ident.key)
            hint = client_hint(request.headers, ctx.body)
            pcfg = app[PRIORITY]
            out["priority"] = {
                "service_tokens": service, "role": role, "client_hint": hint,
                "level": call_level(service, role, hint, pcfg),
                "value": call_priority(service, role, hint, time.time(), pcfg),
                "bound_s": pcfg.bound_s,
            }  # fmt: skip
    return web.json_response(out)


def add_routes(app: web.Application) -> None:
    for path in INFERENCE_ROUTES:
        app.router.add_post(path, handle_inference)
    for path in PASSTHROUGH_ROUTES:
        app.router.add_post(path, handle_inference)
    app.router.add_get(ROUTE_GET, handle_response_by_id)
    app.router.add_post(ROUTE_CANCEL, handle_response_by_id)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/v1/models/{model}", handle_model)
    app.router.add_get("/openapi.json", handle_openapi)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/ready", handle_ready)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/admin/replicas", admin_replicas)
    app.router.add_get("/admin/sessions", admin_sessions)
    app.router.add_get("/admin/config", admin_config)
    app.router.add_post("/admin/route", admin_route)
