"""Prometheus metrics of one router app, on its own registry (never the global one).

Owns: :class:`RouterMetrics` — metric names, labels and buckets, the hooks the app calls
(``watch_*``, which register the scrape-time collectors of :mod:`router.collectors`), the call
observer and session spans. Names follow Prometheus/vLLM conventions (``_total`` counters,
``_seconds`` histograms, no ``_created`` series). The full list with meanings is in docs/router.md
("Metrics"); in short:

* calls: ``kvroute_requests_total{route,replica,status}``, ``kvroute_added_latency_seconds``
  (router time before the upstream request is sent), ``kvroute_decision_latency_seconds``
  (the scheduling pipeline alone), ``kvroute_ttft_seconds{replica}``,
  ``kvroute_tpot_seconds{replica}`` (per SSE event), ``kvroute_retries_total{reason}``,
  ``kvroute_inflight{replica}``, ``kvroute_router_inflight_requests`` (this pod; the HPA's);
* sessions: ``kvroute_identity_calls_total{source}``,
  ``kvroute_session_placements_total{outcome=kept|moved|new}``,
  ``kvroute_session_moves_total{reason=retry|unavailable|cost|score|other}``,
  ``kvroute_active_sessions``,
  ``kvroute_session_duration_seconds`` (session completion time),
  ``kvroute_session_service_tokens`` (a completed session's attained service),
  ``kvroute_priority_ttft_seconds{priority_class}`` (queue wait + prefill by priority class),
  ``kvroute_admission_wait_seconds{priority_class}``, ``kvroute_admission_refused_total{reason}``,
  ``kvroute_admission_queued`` (admission at the router);
  ``kvroute_request_time_per_output_token_seconds{model}`` (P90 interactivity = 1 / its P90);
* cache: ``kvroute_prompt_tokens_total{model}`` / ``kvroute_prompt_tokens_cached_total{model}``
  (from responses' usage), ``kvroute_replica_prompt_tokens_cached_total{replica,source}``
  (by tier, as the replicas' own ``/metrics`` report them);
* replicas as the router sees them: ``kvroute_replica_healthy``,
  ``kvroute_replica_requests_running`` / ``_waiting``, ``kvroute_replica_kv_cache_usage_perc``,
  ``kvroute_breaker_state`` (0 closed, 1 half-open, 2 open);
* prompt analysis: ``kvroute_kv_analyses_total{outcome=waited|not_waited|late|dropped|
  burst_wait}``;
* KV events: ``kvroute_kv_event_batches_total``, ``_gaps_total``, ``_replayed_total``,
  ``_restarts_total`` (per replica), ``kvroute_kv_event_lag_seconds`` (publish to apply, last
  batch), ``kvroute_kv_event_decode_errors_total``;
* the cluster KV pool: ``kvroute_kv_pool_blocks``, ``kvroute_kv_pool_members``,
  ``kvroute_kv_pool_removed_total``;
* the process: ``kvroute_event_loop_lag_seconds`` (how late a 50 ms timer fired: the stall
  every call through this process saw);
* state: ``kvroute_state_backend_up{backend}``, ``kvroute_redis_pending_writes``,
  ``kvroute_redis_reconciles_total``.

The per-call series (requests, latencies, TTFT/TPOT, placements, identity, usage tokens,
retries) are :class:`router.loopmetrics.LoopCounter` / ``LoopHistogram``: plain adds on the
event loop's thread, scraped through prometheus_client's families (the same text as its own
``Counter`` / ``Histogram``, pinned by a test). Everything updated from another thread stays on
prometheus_client's locked metrics.

Must not import aiohttp handlers, the proxy, scheduling or the KV layer: live state reaches
the collectors as plain objects or zero-argument callables (duck-typed).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from router.collectors import (
    CalibrationCollector,
    KVAnalysisCollector,
    KVEventCollector,
    KVModeCollector,
    KVPoolCollector,
    ReplicaCollector,
    StoreCollector,
    WithoutCreated,
)
from router.loopmetrics import LAT_BUCKETS, LoopCounter, LoopHistogram
from router.outcome import CallOutcome
from router.priority import class_of, served_tokens

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64)
# agent sessions: tens of calls with tool pauses, minutes to hours
SERVICE_BUCKETS = tuple(float(4096 * 2**k) for k in range(12))  # router.priority's levels
SESSION_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400)
# the event-loop lag probe: a timer every 50 ms (20 wake-ups a second, ~1 ms of CPU); lateness
# buckets from 1 ms (scheduling noise) to 5 s (a cold tokenization on the loop would be ~0.3 s)
LOOP_TICK_S = 0.05
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
SESSION_IDLE_S = 300.0  # a session silent this long counts as complete (unless it said final)
MAX_TRACKED_SESSIONS = 100_000
# why a placement moved a session (router.scheduling.pipeline.Decision.move_reason)
MOVE_REASONS = ("retry", "unavailable", "cost", "score", "other")


class RouterMetrics:
    def __init__(self, session_idle_s: float = SESSION_IDLE_S) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = LoopCounter(
            "kvroute_requests",
            "Requests by route, replica and status",
            ["route", "replica", "status"],
            registry=r,
        )
        self.added_latency = LoopHistogram(
            "kvroute_added_latency_seconds",
            "Router time before the upstream request is sent",
            buckets=LAT_BUCKETS,
            registry=r,
        )
        self.decision_latency = LoopHistogram(
            "kvroute_decision_latency_seconds",
            "Scheduling pipeline time per placement (filters, scorers, picker)",
            buckets=LAT_BUCKETS,
            registry=r,
        )
        self.ttft = LoopHistogram(
            "kvroute_ttft_seconds",
            "Time to the first upstream byte",
            ["replica"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = LoopHistogram(
            "kvroute_tpot_seconds",
            "Time per SSE event after the first",
            ["replica"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.request_tpot = LoopHistogram(
            "kvroute_request_time_per_output_token_seconds",
            "Mean time per output token after the first, per streamed call (usage tokens)",
            ["model"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge("kvroute_inflight", "Requests in flight", ["replica"], registry=r)
        self.active_sessions = Gauge("kvroute_active_sessions", "Sessions in the table", registry=r)
        self.retries = LoopCounter(
            "kvroute_retries", "Retries on another replica", ["reason"], registry=r
        )
        self.pool_timeouts = LoopCounter(
            "kvroute_upstream_pool_timeouts",
            "Calls answered 503 after waiting pool_timeout_s for an upstream connection, by the "
            "router limit that was reached (not a replica failure)",
            ["limit"],
            registry=r,
        )
        self.breaker = Gauge(
            "kvroute_breaker_state",
            "Circuit breaker: 0 closed, 1 half-open, 2 open",
            ["replica"],
            registry=r,
        )
        self.backend_up = Gauge(
            "kvroute_state_backend_up", "Session store reachable", ["backend"], registry=r
        )
        self.identity_calls = LoopCounter(
            "kvroute_identity_calls",
            "Calls by the convention that identified their session (prefix: none did)",
            ["source"],
            registry=r,
        )
        self.placements = LoopCounter(
            "kvroute_session_placements",
            "Placements: kept (the session's replica), moved (another one), new (first)",
            ["outcome"],
            registry=r,
        )
        self.moves = LoopCounter(
            "kvroute_session_moves",
            "Placements that moved a session off its replica, by reason: retry (it failed the "
            "call before the first byte), unavailable (not a candidate: gone, unhealthy, breaker "
            "open), cost (a cost scorer found another replica cheaper), score (other scorers), "
            "other (the session store's answer)",
            ["reason"],
            registry=r,
        )
        self.prompt_tokens = LoopCounter(
            "kvroute_prompt_tokens",
            "Prompt tokens of answered calls (usage.prompt_tokens)",
            ["model"],
            registry=r,
        )
        self.cached_tokens = LoopCounter(
            "kvroute_prompt_tokens_cached",
            "Cached prompt tokens of answered calls (usage.prompt_tokens_details.cached_tokens)",
            ["model"],
            registry=r,
        )
        self.session_duration = Histogram(
            "kvroute_session_duration_seconds",
            "Session completion time seen by this router: first call start to last call end",
            buckets=SESSION_BUCKETS,
            registry=r,
        )
        self.session_service = Histogram(
            "kvroute_session_service_tokens",
            "Attained service of a completed session (prompt tokens computed + tokens decoded, "
            "its own calls through this router)",
            buckets=SERVICE_BUCKETS,
            registry=r,
        )
        self.priority_ttft = LoopHistogram(
            "kvroute_priority_ttft_seconds",
            "Time to the first upstream byte (queue wait + prefill) by the call's priority "
            "class (router.priority: high = level 0-1, mid = 2-4, low = 5+; priority: session)",
            ["priority_class"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.admission_wait = LoopHistogram(
            "kvroute_admission_wait_seconds",
            "Time a call waited in the router's admission queue (admission: on; every replica "
            "full) by its priority class (router.priority: high, mid, low; '-' without one)",
            ["priority_class"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.admission_refused = LoopCounter(
            "kvroute_admission_refused",
            "Calls answered without a replica by admission: timeout (503) or queue_full (429)",
            ["reason"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "kvroute_event_loop_lag_seconds",
            "How late the event loop ran a timer due every 50 ms: time every call through this "
            "process waited for something else on the loop (a stall)",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.pd = LoopCounter(
            "kvroute_pd_calls",
            "Calls on a P/D-disaggregated replica set, by mode (split: a prefill leg then a "
            "decode leg; colocated: one decode-side replica) and the reason of the verdict",
            ["mode", "reason"],
            registry=r,
        )
        for outcome in ("kept", "moved", "new"):
            self.placements.labels(outcome)
        for reason in MOVE_REASONS:
            self.moves.labels(reason)
        # the per-call series (loop-only metrics: labels() is a dict lookup)
        self.requests_by = self.requests.labels
        self.ttft_by = self.ttft.labels
        self.tpot_by = self.tpot.labels
        self.retries_by = self.retries.labels
        self.placements_by = self.placements.labels
        self.identity_calls_by = self.identity_calls.labels
        self.prompt_tokens_by = self.prompt_tokens.labels
        self.cached_tokens_by = self.cached_tokens.labels
        self.request_tpot_by = self.request_tpot.labels
        self.pd_calls = lambda split, reason: self.pd.labels(
            "split" if split else "colocated", reason
        ).inc()
        self.session_idle_s = session_idle_s
        # key -> [start, end, attained service]
        self._sessions: OrderedDict[str, list[float]] = OrderedDict()
        self._refreshers: list[Callable[[], None]] = []
        self.on_scrape(self.expire_sessions)

    async def watch_loop(self, tick_s: float = LOOP_TICK_S, stalls: Any = None) -> None:
        """Run for ever (a task): every ``tick_s`` observe how late the loop woke up. With
        ``stalls`` (a :class:`router.loopwatch.StallWatch`) each tick is also armed there, so
        its thread can sample the loop's stack while a tick is late."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                due = loop.time() + tick_s
                if stalls is not None:
                    stalls.arm(time.monotonic() + tick_s)
                await asyncio.sleep(tick_s)
                if stalls is not None:
                    stalls.fired()
                self.loop_lag.observe(max(loop.time() - due, 0.0))
        finally:
            if stalls is not None:  # no tick is pending any more: nothing to wait for
                stalls.fired()

    def on_scrape(self, fn: Callable[[], None]) -> None:
        """Register a callback that refreshes gauges right before each exposition."""
        self._refreshers.append(fn)

    def exposition(self) -> bytes:
        for fn in self._refreshers:
            fn()
        return generate_latest(WithoutCreated(self.registry))

    # ---- hooks the app calls ------------------------------------------------------------

    def watch_replicas(self, replicas: Iterable[Any], runtime: Any = None) -> None:
        """Per-replica health, engine load and cached tokens by tier, read from the live
        replica set at each scrape (a removed replica's series go with it); with
        ``runtime`` (has ``inflight``) also this pod's in-flight calls."""
        self.registry.register(ReplicaCollector(replicas, runtime))

    def watch_admission(self, gate: Any) -> None:
        """``kvroute_admission_queued``: calls waiting in the router's admission queue."""
        queued = Gauge("kvroute_admission_queued", "Calls waiting in the router's admission "
                       "queue", registry=self.registry)  # fmt: skip
        self.on_scrape(lambda: queued.set(gate.waiting))

    def watch_store(self, store: Any) -> None:
        """Redis write-back backlog and reconciles, when ``store`` is the Redis store."""
        if getattr(store, "backend", None) == "redis":
            self.registry.register(StoreCollector(store))

    def watch_kv_events(self, subscriber: Callable[[], Any]) -> None:
        """KV event stream health from ``subscriber()`` (a ``KVEventSubscriber`` or None)."""
        self.registry.register(KVEventCollector(subscriber))

    def watch_calibration(self, kv: Any) -> None:
        """The KV layer's per-replica fit of observed against modelled time (``kv`` has
        ``calibrators`` and ``calibration(replica)``, :class:`router.kv.state.KVState`)."""
        self.registry.register(CalibrationCollector(kv))

    def watch_kv_analysis(self, kv: Any) -> None:
        """How calls fared with prompt analysis (``kv.analysis_stats()``,
        :class:`router.kv.state.KVState`)."""
        self.registry.register(KVAnalysisCollector(kv))

    def watch_kv_mode(self, status: Callable[[], Any]) -> None:
        """``kvroute_kv_layer_mode{mode}``: 1 for how fully the KV layer runs now
        (``status()`` is a :class:`router.kv.autoconf.LayerStatus`), 0 for the other modes."""
        self.registry.register(KVModeCollector(status))

    def watch_kv_pool(self, kv: Any) -> None:
        """The cluster pool as the index sees it (``kv.index``, a
        :class:`router.kv.index.BlockIndex`)."""
        self.registry.register(KVPoolCollector(kv))

    def placed(self, previous: str | None, chosen: str, decision: Any = None) -> None:
        """One placement of a session's call: kept / moved / new (a move counted by its
        reason, ``decision.move_reason``), and the decision's time (``decision.elapsed_s``
        when the pipeline measured it)."""
        outcome = "new" if previous is None else "kept" if previous == chosen else "moved"
        self.placements_by(outcome).inc()
        if outcome == "moved":
            reason = getattr(decision, "move_reason", None)
            self.moves.labels(reason if reason in MOVE_REASONS else "other").inc()
        elapsed = getattr(decision, "elapsed_s", None)
        if isinstance(elapsed, float):
            self.decision_latency.observe(elapsed)

    def observe_call(self, ctx: Any, outcome: CallOutcome) -> None:
        """A call observer (the first of the app's :class:`router.call.CallSequence`):
        identity source, usage tokens, per-call TPOT and the session's span, once per call
        (dry runs and calls that are no turn of their session, ``count_tokens``, excluded)."""
        if outcome.status == "dry_run" or not getattr(ctx, "session_call", True):
            return  # (count_tokens & co.: no turn of the session, no tokens of a prompt run)
        ident = ctx.identity
        self.identity_calls_by(ident.source).inc()
        now = time.monotonic()
        duration = outcome.duration_s
        span = self._sessions.get(ident.key)
        start = now - duration if duration is not None else now
        usage = outcome.usage
        served = 0
        if outcome.replica is not None and usage is not None:
            served = served_tokens(usage.prompt_tokens, usage.cached_tokens,
                                   usage.completion_tokens)  # fmt: skip
        if span is None:
            self._sessions[ident.key] = [start, now, served]
            while len(self._sessions) > MAX_TRACKED_SESSIONS:
                self._sessions.popitem(last=False)
        else:
            span[1] = now
            span[2] += served
            self._sessions.move_to_end(ident.key)
        if ident.final:
            self._session_done(*self._sessions.pop(ident.key))
        level = getattr(ctx, "priority_level", None)
        if level is not None and outcome.ttft_s is not None:
            self.priority_ttft.labels(class_of(level)).observe(outcome.ttft_s)
        if outcome.replica is None or usage is None:
            return
        model = ctx.model or "-"
        if usage.prompt_tokens is not None and usage.prompt_tokens >= 0:
            self.prompt_tokens_by(model).inc(usage.prompt_tokens)
        if usage.cached_tokens is not None and usage.cached_tokens >= 0:
            self.cached_tokens_by(model).inc(usage.cached_tokens)
        out = usage.completion_tokens
        ttft = outcome.ttft_s
        if out is not None and out > 1 and outcome.events > 1 and ttft is not None and duration:
            self.request_tpot_by(model).observe(max(0.0, duration - ttft) / (out - 1))

    def expire_sessions(self, now: float | None = None) -> None:
        """Sessions silent for ``session_idle_s`` are complete: observe their span."""
        now = time.monotonic() if now is None else now
        while self._sessions:
            key, (s, e, served) = next(iter(self._sessions.items()))
            if now - e < self.session_idle_s:
                break
            del self._sessions[key]
            self._session_done(s, e, served)

    def _session_done(self, start: float, end: float, served: float) -> None:
        self.session_duration.observe(max(0.0, end - start))
        self.session_service.observe(served)
