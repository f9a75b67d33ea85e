"""One call over a prefill/decode-disaggregated replica set: the prefill leg, then the decode
leg, streamed (the per-call price and the picks are :mod:`router.disagg`'s).

Owns: :func:`forward_pd` — the prefill leg on the replica the policy picks among the
prefill-capable ones (the session placed there), retried on another prefill replica when it
gets no answer or a 5xx, a 4xx answer being the client's; then the decode leg carrying the
prefill leg's ``kv_transfer_params``, sent and streamed by :mod:`router.relay` and retried on
another decode replica when it gets no answer or a 502-504 before its first byte; a 500 then
(the leg's KV pull failed, :data:`KV_LOAD_FAILED`) runs the call colocated. Must not import
torch, vllm or loadtest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict

from router import disagg
from router.errors import error_response, replica_error_body
from router.keys import CALLS, CONFIG, METRICS, REPLICAS, UPSTREAM
from router.outcome import CallOutcome
from router.placement import place_session
from router.relay import UPSTREAM_ERRORS, ProxiedCall, RetryElsewhere, pool_full, stream_from
from router.replicas import EndpointView
from router.scheduling import RequestContext
from router.scheduling.pipeline import Decision, NoCandidates
from router.upstream import PoolTimeout

log = logging.getLogger("kvroute.proxy_pd")

# a decode leg's answer before any byte that runs the call colocated (its prompt recomputed
# decode-side, no ``kv_transfer_params``) rather than on another decode replica: vLLM answers
# 500 when the leg's KV pull failed and its ``kv_load_failure_policy`` is "fail", its default
# (a NIXL handshake timing out, a prefill replica gone; docs/vllm-facts.md). A streamed leg's
# failure comes after its 200 head, as an error event: only the engine's "recompute" policy
# covers that (engine_patches/presets.py sets it).
KV_LOAD_FAILED = frozenset({500})


class _PrefillRefused(Exception):
    """The prefill leg's replica answered the call with a client error (4xx): the decode leg
    would get the same, so that answer is the client's."""

    def __init__(self, status: int, body: bytes):
        super().__init__(f"prefill leg answered {status}")
        self.status, self.body = status, body


async def forward_pd(
    call: ProxiedCall, raw: bytes, headers: CIMultiDict[str], path: str
) -> web.StreamResponse | None:
    """One call over a disaggregated set (:mod:`router.disagg`): a prefill leg on the replica
    the policy picks among the prefill-capable ones (``kv_cost``'s fetch-or-recompute cost,
    the session placed there: that is where its prefix lives), then the decode leg, streamed,
    on the decode replica with the least load and the most KV room, carrying the prefill
    leg's ``kv_transfer_params``. Returns None when the call is to run colocated instead —
    the per-call price says so (``pd_mode: auto``), the body is not JSON, every prefill leg
    failed before answering, or the decode leg answered 500 before any byte (its KV pull
    failed) — and the caller then runs it as one call on the decode side. A prefill leg that
    fails (no answer, a 5xx, a timeout) is retried on another prefill replica; one answered
    with a 4xx is the client's answer. ``raw``, ``headers`` and ``path``: what the colocated
    call would send (:func:`router.proxy.forward`)."""
    ctx, record, t0, route_label = call.ctx, call.record, call.t0, call.route_label
    app = call.request.app
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
            return pool_full(ctx, route_label, cfg.health_interval_s, e, metrics)
        except RetryElsewhere as e:
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
    split_reason = (ctx.extra.get("pd") or {}).get("reason", cfg.pd_mode)
    ctx.extra["pd_prefill"] = prefilled
    calls.first_byte(ctx)  # the prompt's prefill is over
    dbody = orjson.dumps(disagg.decode_body(body, params))
    fell_back = False
    try:
        answer = await _decode_legs(call, dbody, headers, path, dview, decision, prefilled)
        fell_back = answer is None
        return answer
    finally:  # a split call, however it ended, unless it fell back to running colocated
        metrics.pd_calls(not fell_back, "decode_failed" if fell_back else split_reason)


async def _decode_legs(
    call: ProxiedCall,
    dbody: bytes,
    headers: CIMultiDict[str],
    path: str,
    dview: EndpointView | None,
    decision: Decision,
    prefilled: str,
) -> web.StreamResponse | None:
    """Send the decode leg ``dbody`` to ``dview`` and stream its answer, retried on another
    decode replica on no answer or a 502-504 before the first byte; a 503 when none could take
    it; None (run the call colocated) on a 500 before the first byte (:data:`KV_LOAD_FAILED`:
    its KV pull from the prefill replica ``prefilled`` failed)."""
    ctx, t0, route_label = call.ctx, call.t0, call.route_label
    app = call.request.app
    cfg = app[CONFIG]
    replicas = app[REPLICAS]
    metrics = app[METRICS]
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
            return await stream_from(call, dbody, headers, path, dreplica, decision,
                                     last_attempt=attempt == cfg.retries,
                                     handled=KV_LOAD_FAILED)  # fmt: skip
        except PoolTimeout as e:
            return pool_full(ctx, route_label, cfg.health_interval_s, e, metrics)
        except RetryElsewhere as e:
            if e.status in KV_LOAD_FAILED:
                log.warning("request %s: decode leg on %s answered %s before any byte (its KV "
                            "pull from %s failed?); running the call colocated",
                            ctx.request_id, dreplica.name, e.status, prefilled)  # fmt: skip
                metrics.retries_by("pd_decode_failed").inc()
                return None
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
    no connector: the decode leg then prefills itself). Raises :class:`RetryElsewhere` on no
    answer or a 5xx, :class:`_PrefillRefused` on a 4xx."""
    if replica.auth:
        headers = headers.copy()
        headers["Authorization"] = replica.auth
    try:
        resp = await app[UPSTREAM].request("POST", replica.url, path, headers, body)
    except UPSTREAM_ERRORS as e:
        replica.breaker.on_failure()
        raise RetryElsewhere("no_response", f"{type(e).__name__}") from None
    try:
        try:
            data = await resp.read()
        except UPSTREAM_ERRORS as e:
            replica.breaker.on_failure()
            raise RetryElsewhere("no_response", f"{type(e).__name__} mid-body") from None
        if resp.status >= 500:
            replica.breaker.on_failure()
            raise RetryElsewhere("status", f"upstream status {resp.status}")
        replica.breaker.on_success()
        if resp.status >= 400:
            raise _PrefillRefused(resp.status, data)
        try:
            answer = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise RetryElsewhere("status", "prefill leg answer is not JSON") from None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        return params if isinstance(params, dict) else None
    except asyncio.CancelledError:
        resp.close()  # the client went away: the prefill replica aborts the leg
        raise
    finally:
        resp.release()
