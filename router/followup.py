"""Calls that follow a Responses answer by its id: ``GET /v1/responses/{id}`` (with vLLM's
``stream`` / ``starting_after`` query) and ``POST /v1/responses/{id}/cancel``.

Owns: sending such a call to the replica that produced the response (vLLM keeps it in that
replica's memory; any other answers 404) and relaying its answer. The owner comes from
:class:`router.responses.ResponseOwners`, filled as the proxy relays answers. An id this router
has not seen (another router process, a restart, an id forgotten by the bounded table) is asked
of each healthy replica in turn until one answers other than 404; the one that does is
remembered. An id known to belong to another tenant is a 404, as an unknown id is. Error
answers reach the client OpenAI-shaped (:func:`router.errors.replica_error_body`). Imports
neither torch, vllm nor loadtest.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from router.errors import error_response, replica_error_body, request_id
from router.headers import response_headers, upstream_headers
from router.keys import CONFIG, METRICS, REPLICAS, RESPONSES, UPSTREAM
from router.relay import BUFFERED_MAX, UPSTREAM_ERRORS
from router.responses import RESPONSES_ROUTE, valid_response_id
from router.upstream import UpstreamResponse

log = logging.getLogger("kvroute.proxy")

ROUTE_GET = "/v1/responses/{response_id}"
ROUTE_CANCEL = "/v1/responses/{response_id}/cancel"


async def forward_by_id(request: web.Request, tenant: str) -> web.StreamResponse:
    """Relay a call on ``/v1/responses/{id}[/cancel]`` to the replica holding the response."""
    app = request.app
    cfg = app[CONFIG]
    metrics = app[METRICS]
    rid = request.match_info["response_id"]
    cancel = request.path.endswith("/cancel")
    label = ROUTE_CANCEL if cancel else ROUTE_GET
    xrid = request_id(request.headers)
    if not valid_response_id(rid):
        metrics.requests_by(label, "-", "404").inc()
        return error_response(RESPONSES_ROUTE, 404, "no response with that id", "not_found",
                              headers={"X-Request-Id": xrid})  # fmt: skip
    owners = app[RESPONSES]
    owner = owners.get(rid)
    replicas = app[REPLICAS]
    if owner is not None:
        if owner.tenant != tenant:  # never show (or cancel) another tenant's answer
            metrics.requests_by(label, "-", "404").inc()
            return error_response(RESPONSES_ROUTE, 404, "no response with that id", "not_found",
                                  headers={"X-Request-Id": xrid})  # fmt: skip
        r = replicas.get(owner.replica)
        candidates = [r] if r is not None else []
    else:
        candidates = [r for r in replicas if r.healthy]
    if not candidates:
        gone = owner is not None
        metrics.requests_by(label, "-", "404" if gone else "503").inc()
        if gone:
            return error_response(RESPONSES_ROUTE, 404, "the replica that produced this "
                                  "response is gone", "not_found",
                                  headers={"X-Request-Id": xrid})  # fmt: skip
        return error_response(RESPONSES_ROUTE, 503, "no healthy replica",
                              "service_unavailable", headers={"X-Request-Id": xrid})  # fmt: skip
    query = request.rel_url.raw_query_string
    path = f"/v1/responses/{rid}" + ("/cancel" if cancel else "") + ("?" + query if query else "")
    headers = upstream_headers(request.headers, xrid, cfg.upstream_api_key, cfg.auth_enabled)
    upstream = app[UPSTREAM]
    problem = "no replica answered"
    for i, r in enumerate(candidates):
        h = headers
        if r.auth:
            h = headers.copy()
            h["Authorization"] = r.auth
        try:
            resp = await upstream.request(request.method, r.url, path, h, b"")
        except UPSTREAM_ERRORS as e:
            problem = f"{type(e).__name__} from a replica"
            log.warning("request %s: %s on %s", xrid, type(e).__name__, r.name)
            continue
        if resp.status == 404 and owner is None and i < len(candidates) - 1:
            try:  # not this one's: ask the next (its short answer read, the connection kept)
                await resp.read()
            except UPSTREAM_ERRORS:
                resp.close()
            finally:
                resp.release()
            continue
        if owner is None and resp.status < 400:
            owners.note(rid, r.name, tenant)
        metrics.requests_by(label, r.name, str(resp.status)).inc()
        return await _relay(request, resp, xrid)
    metrics.requests_by(label, "-", "502").inc()
    return error_response(RESPONSES_ROUTE, 502, problem, "upstream_error",
                          headers={"X-Request-Id": xrid})  # fmt: skip


async def _relay(request: web.Request, resp: UpstreamResponse, xrid: str) -> web.StreamResponse:
    """The replica's answer, passed on: whole when sized or an error, else chunk by chunk."""
    headers = response_headers(resp.headers, xrid)
    t0 = time.perf_counter()
    try:
        sized = resp.content_length is not None and resp.content_length <= BUFFERED_MAX
        if sized or resp.status >= 400:
            try:
                body = await resp.read()
            except UPSTREAM_ERRORS as e:
                resp.close()
                return error_response(RESPONSES_ROUTE, 502, f"replica failed mid-response: "
                                      f"{type(e).__name__}", "upstream_error",
                                      headers={"X-Request-Id": xrid})  # fmt: skip
            headers.popall("Content-Length", None)
            if resp.status >= 400:
                shaped = replica_error_body(RESPONSES_ROUTE, resp.status, body)
                if shaped is not None:
                    body = shaped
                    headers["Content-Type"] = "application/json"
            return web.Response(status=resp.status, reason=resp.reason, body=body,
                                headers=headers)  # fmt: skip
        out = web.StreamResponse(status=resp.status, reason=resp.reason, headers=headers)
        await out.prepare(request)
        while True:
            try:
                chunk = await resp.next_chunk()
            except UPSTREAM_ERRORS as e:  # truncated: the client sees the connection end
                log.warning("request %s: replica failed mid-stream after %.1f s: %r", xrid,
                            time.perf_counter() - t0, e)  # fmt: skip
                if request.transport is not None:
                    request.transport.close()
                return out
            if not chunk:
                break
            await out.write(chunk)
        await out.write_eof()
        return out
    except asyncio.CancelledError:
        resp.close()  # the client went away: so does the upstream request
        raise
    except ConnectionResetError:  # the write found the client gone
        resp.close()
        return web.Response(status=499)  # (nobody reads it)
    finally:
        resp.release()
