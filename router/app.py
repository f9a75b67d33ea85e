"""The router's aiohttp application: typed state on the app, paired start-up/clean-up.

Owns: :func:`build_app` — routes, the call sequence (:class:`router.call.CallSequence`) and
the cleanup contexts (the proxied calls' upstream client and the probes' HTTP session, replica
set and its monitors, session store, and the KV layer when one is given:
``build_app(cfg, kv=KVState(...))`` is the one place that installs it and subscribes it to the
replica set) — plus :func:`start_site` and :func:`drain`, which the CLI and the tests share.
The app's keys live in :mod:`router.keys`, handlers in :mod:`router.api`, the streaming proxy
in :mod:`router.proxy` and its upstream client in :mod:`router.upstream`. Must not import
torch, vllm or loadtest.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from router import api
from router.admission import AdmissionGate
from router.call import CallSequence, DecisionHook, FirstByteHook, Observer, PromptAnalyzer
from router.config import RouterConfig
from router.frontdoor import FrontDoorRunner, json_errors
from router.keys import (
    ADMISSION,
    CALLS,
    CLIENT,
    CONFIG,
    KV,
    KV_STATUS,
    METRICS,
    MONITOR,
    PIPELINE,
    PRIORITY,
    REPLICAS,
    RESPONSES,
    RUNTIME,
    STORE,
    UPSTREAM,
    Runtime,
)
from router.kv.autoconf import LayerStatus, no_layer_status, replica_facts, tokenize_request
from router.metrics import RouterMetrics
from router.monitor import ReplicaMonitor, cancel_all
from router.outcome import CallOutcome
from router.priority import served_tokens
from router.redis_store import RedisStore, make_store
from router.replicas import BREAKER_CODE, ReplicaSet
from router.responses import ResponseOwners
from router.scheduling.registry import build_pipeline
from router.upstream import Upstream

if TYPE_CHECKING:
    from router.kv.state import KVState

log = logging.getLogger("kvroute")

__all__ = ["build_app", "drain", "start_site"]

PROBE_HEADROOM = 8  # connector slots above the proxy's limits, for health/metrics probes


async def _client_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    # the proxied calls' bounds are enforced (and waited for) in Upstream; the connector has
    # headroom above them for the probes that share it, so no proxied call waits in it
    conn = aiohttp.TCPConnector(
        limit=cfg.max_connections + PROBE_HEADROOM if cfg.max_connections else 0,
        limit_per_host=cfg.max_connections_per_replica + PROBE_HEADROOM
        if cfg.max_connections_per_replica
        else 0,
        ttl_dns_cache=int(cfg.dns_interval_s),
        keepalive_timeout=30,
    )
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=cfg.connect_timeout_s, sock_read=cfg.read_timeout_s
    )
    app[CLIENT] = aiohttp.ClientSession(
        connector=conn, timeout=timeout, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
    )
    app[UPSTREAM] = Upstream(
        app[CLIENT], limit=cfg.max_connections, limit_per_host=cfg.max_connections_per_replica,
        connect_timeout_s=cfg.connect_timeout_s, read_timeout_s=cfg.read_timeout_s,
        pool_timeout_s=cfg.pool_timeout_s,
    )  # fmt: skip
    yield
    await app[UPSTREAM].close()
    await app[CLIENT].close()


async def _replicas_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    replicas = app[REPLICAS]
    replicas.set_source("static", cfg.replicas)
    mon = ReplicaMonitor(replicas, app[CLIENT], cfg)
    app[MONITOR] = mon
    await mon.discovery.resolve_dns()
    if cfg.k8s_service:
        await mon.discovery.poll_k8s()
    await mon.check_all()  # know health and models before taking traffic
    metrics = app[METRICS]

    def refresh() -> None:
        for r in replicas:
            metrics.breaker.labels(r.name).set(BREAKER_CODE[r.breaker.state])
            metrics.inflight.labels(r.name).set(r.inflight)

    metrics.on_scrape(refresh)
    metrics.watch_replicas(replicas, app[RUNTIME])
    tasks = mon.tasks()
    yield
    await cancel_all(tasks)


async def _store_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    store = make_store(cfg.redis_url, cfg.session_ttl_s, cfg.redis_timeout_s,
                       cfg.redis_reconcile_interval_s)  # fmt: skip
    app[STORE] = store
    if isinstance(store, RedisStore) and not await store.reconcile():
        log.warning("redis at start-up unreachable: serving from the local view until it is up")
        store._up = False
    metrics = app[METRICS]

    def refresh() -> None:
        metrics.active_sessions.set(store.active_count())
        metrics.backend_up.labels(store.backend).set(1 if store.up else 0)

    metrics.on_scrape(refresh)
    metrics.watch_store(store)
    task = asyncio.create_task(store.run(), name="kvroute-store")
    stalls = None
    if cfg.loop_stall_log_ms > 0:
        from router.loopwatch import StallWatch

        stalls = StallWatch(cfg.loop_stall_log_ms / 1000.0).start()
    lag = asyncio.create_task(metrics.watch_loop(stalls=stalls), name="kvroute-loop-lag")
    tasks = [task, lag]
    gate = app[ADMISSION]
    if isinstance(gate, AdmissionGate):  # scrapes show room: release waiters
        tasks.append(asyncio.create_task(gate.run(cfg.metrics_interval_s), name="kvroute-gate"))
        metrics.watch_admission(gate)
    yield
    await cancel_all(tasks)
    if stalls is not None:
        stalls.stop()
    await store.close()


def reads_kv(pipeline: Any) -> bool:
    """Whether a pipeline has a scorer that reads the KV layer (``kv_cost``, ``kv_prefix``,
    ``kv_queue``, ``kv_util``, ``kv_sglang_tree``: the ``kv_`` scorers)."""
    return any(str(getattr(s, "name", "")).startswith("kv_") for s, _w in pipeline.scorers)


async def discover_kv(app: web.Application, kv: KVState) -> bool:
    """Complete a zero-config KV layer from the replicas (``kv.cfg.discover``): a scrape of
    each healthy replica's ``/metrics`` (vLLM's ``vllm:cache_config_info``), then
    :meth:`router.kv.state.KVState.autoconfigure` with what ``/v1/models`` and it reported
    (the tokenizer is looked up and loaded off the event loop). False while no replica has
    answered."""
    await app[MONITOR].scrape_all()
    facts = [
        replica_facts(r.name, r.model_cards, r.cache_config)
        for r in app[REPLICAS]
        if r.healthy and r.model_cards
    ]
    if not facts:
        return False
    done = await asyncio.to_thread(kv.autoconfigure, facts)
    if done and kv.tokens is None and kv.remote_tokens is None:
        kv.remote_tokens = functools.partial(replica_tokens, app)
        kv.tokenizer_source = "a replica's /tokenize (a session's first call)"
    return done


async def replica_tokens(app: web.Application, route: str, body: Any) -> list[int] | None:
    """The token ids of a call's prompt from a healthy replica's ``POST /tokenize`` (the one
    with the fewest calls in flight from this router), for a zero-config KV layer with no
    tokenizer on this machine; None when there is no prompt or no usable answer."""
    payload = tokenize_request(route, body) if isinstance(body, dict) else None
    ready = [r for r in app[REPLICAS] if r.healthy]
    if payload is None or not ready:
        return None
    r = min(ready, key=lambda x: x.inflight)
    timeout = aiohttp.ClientTimeout(total=max(app[CONFIG].health_timeout_s, 1.0))
    async with app[CLIENT].post(
        r.url + "/tokenize", json=payload, headers=app[MONITOR].headers_for(r), timeout=timeout
    ) as resp:
        if resp.status != 200:
            return None
        doc = await resp.json(content_type=None)
    toks = doc.get("tokens") if isinstance(doc, dict) else None
    if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
        return None
    return toks


async def _discover_later(app: web.Application, kv: KVState) -> None:
    """Retry :func:`discover_kv` every ``health_interval_s`` until a replica answers."""
    while True:
        await asyncio.sleep(max(app[CONFIG].health_interval_s, 0.1))
        try:
            if await discover_kv(app, kv):
                _log_status(app[KV_STATUS]())
                return
        except Exception:  # a replica's odd answer must not end the retries
            log.exception("KV layer discovery failed; retrying")


def _log_status(st: LayerStatus) -> None:
    (log.info if st.mode in ("full", "off") else log.warning)("%s", st.line())


class SessionService:
    """The observer that adds an answered call's service (:func:`router.priority.served_tokens`)
    to its session in the session table (the priority rule's attained service)."""

    def __init__(self, app: web.Application):
        self.app = app

    def observe(self, ctx: Any, outcome: CallOutcome) -> None:
        u = outcome.usage
        if outcome.replica is None or u is None or not ctx.session_call or STORE not in self.app:
            return
        self.app[STORE].add_service(
            ctx.identity.key, served_tokens(u.prompt_tokens, u.cached_tokens, u.completion_tokens)
        )


def build_app(
    cfg: RouterConfig,
    *,
    kv: KVState | None = None,
    analyzer: PromptAnalyzer | None = None,
    state_providers: dict[str, Callable[[], Any]] | None = None,
    observers: list[Observer] | None = None,
) -> web.Application:
    """The router app. ``kv`` installs the KV layer (its analyzer, its ``"kv"`` view, its
    observer, and its event subscribers following the app's replica set); ``analyzer``,
    ``state_providers`` and ``observers`` are the bare seams (tests, out-of-tree layers)."""
    app = web.Application(client_max_size=cfg.max_body_bytes, middlewares=[json_errors])
    app[CONFIG] = cfg
    app[PRIORITY] = cfg.priority_config()
    metrics = app[METRICS] = RouterMetrics()
    app[REPLICAS] = ReplicaSet(
        cfg.breaker_failures, cfg.breaker_cooldown_s, cfg.max_connections_per_replica or None
    )
    gate = app[ADMISSION] = (
        AdmissionGate(cfg.admission_limits(), app[REPLICAS].views)
        if cfg.admission == "on"
        else None
    )
    pipeline = build_pipeline(cfg.scheduling if cfg.scheduling else cfg.policy)
    app[PIPELINE] = pipeline
    providers = dict(state_providers or {})
    obs: list[Observer] = [metrics.observe_call]
    hooks: list[DecisionHook] = []
    first: list[FirstByteHook] = []
    if kv is not None:
        if analyzer is not None:
            raise ValueError("give the KV layer or an analyzer, not both")
        analyzer = kv.analyze
        providers["kv"] = kv.view
        obs.append(kv.observe)
        hooks.append(kv.decided)
        first.append(kv.prefill_done)
        metrics.watch_kv_events(lambda: kv.subscriber)
        metrics.watch_calibration(kv)
        metrics.watch_kv_analysis(kv)
        metrics.watch_kv_pool(kv)
    obs.append(SessionService(app).observe)
    if gate is not None:
        obs.append(gate.observe)  # a call ended: room, maybe
    obs.extend(observers or [])
    if cfg.decision_log:
        from router.decisionlog import DecisionLog

        dlog = DecisionLog(cfg.decision_log, per_process=cfg.workers > 1)
        hooks.append(dlog)

        async def _close_log(app: web.Application) -> None:
            dlog.close()

        app.on_cleanup.append(_close_log)
    app[CALLS] = CallSequence(pipeline, analyzer=analyzer, state_providers=providers,
                              observers=obs, decision_hooks=hooks,
                              first_byte_hooks=first)  # fmt: skip
    app[KV] = kv
    uses_kv = reads_kv(pipeline)

    def status() -> LayerStatus:
        if kv is None:
            return no_layer_status(uses_kv)
        return kv.status([r.name for r in app[REPLICAS]])

    app[KV_STATUS] = status
    metrics.watch_kv_mode(status)
    if kv is None and uses_kv:
        _log_status(status())
    app[RESPONSES] = ResponseOwners()
    app[RUNTIME] = Runtime()
    app[RUNTIME].idle.set()
    app.cleanup_ctx.extend([_client_ctx, _replicas_ctx, _store_ctx])
    if kv is not None:  # ZMQ subscribers; follows the replica set the contexts above filled

        async def _kv_ctx(app: web.Application) -> AsyncIterator[None]:
            later = None
            if kv.cfg.discover and not await discover_kv(app, kv):
                later = asyncio.create_task(_discover_later(app, kv), name="kvroute-kv-discover")
            async for _ in kv.lifespan(app[REPLICAS]):
                _log_status(status())  # after the subscribers started: events are known
                yield
            if later is not None:
                await cancel_all([later])

        app.cleanup_ctx.append(_kv_ctx)
    api.add_routes(app)
    return app


async def start_site(
    app: web.Application, host: str = "127.0.0.1", port: int = 0, *, reuse_port: bool = False
) -> tuple[web.AppRunner, str]:
    """Start ``app`` on ``host:port`` (0 = a free port); returns the runner and base URL.
    Connections get the front door (:mod:`router.frontdoor`): JSON parser errors without
    echo, ``header_timeout_s`` for a request head, ``idle_timeout_s`` without a request.
    ``reuse_port`` binds with ``SO_REUSEPORT`` (the workers of ``kvroute serve --workers``)."""
    cfg = app[CONFIG]
    runner = FrontDoorRunner(
        app,
        header_timeout_s=cfg.header_timeout_s,
        keepalive_timeout=cfg.idle_timeout_s,
        handler_cancellation=True,  # a client disconnect cancels the handler: abort upstream
        max_line_size=cfg.max_header_bytes,
        max_field_size=cfg.max_header_bytes,
        access_log=None,
        shutdown_timeout=cfg.drain_timeout_s,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None)
    await site.start()
    actual = runner.addresses[0][1] if runner.addresses else port
    return runner, f"http://{host}:{actual}"


async def drain(app: web.Application, timeout_s: float) -> bool:
    """Stop taking new calls (503) and wait up to ``timeout_s`` for in-flight ones."""
    rt = app[RUNTIME]
    rt.draining = True
    with contextlib.suppress(asyncio.TimeoutError):
        async with asyncio.timeout(timeout_s):
            await rt.idle.wait()
    return rt.inflight == 0
