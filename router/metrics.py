"""Prometheus metrics of one router app, on its own registry (never the global one).

Owns: metric names, labels and buckets. Names: ``kvroute_requests_total{route,replica,status}``,
``kvroute_added_latency_seconds`` (router time before the upstream request is sent: parse,
identity, analyzer, scheduling, state), ``kvroute_ttft_seconds{replica}`` (to the first
upstream body byte), ``kvroute_tpot_seconds{replica}`` (per SSE event after the first),
``kvroute_inflight{replica}``, ``kvroute_active_sessions``, ``kvroute_retries_total{reason}``,
``kvroute_breaker_state{replica}`` (0 closed, 1 half-open, 2 open),
``kvroute_state_backend_up{backend}``. Must not import aiohttp handlers or scheduling.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LAT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvroute_requests",
            "Requests by route, replica and status",
            ["route", "replica", "status"],
            registry=r,
        )
        self.added_latency = Histogram(
            "kvroute_added_latency_seconds",
            "Router time before the upstream request is sent",
            buckets=LAT_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvroute_ttft_seconds",
            "Time to the first upstream byte",
            ["replica"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "kvroute_tpot_seconds",
            "Time per SSE event after the first",
            ["replica"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge("kvroute_inflight", "Requests in flight", ["replica"], registry=r)
        self.active_sessions = Gauge("kvroute_active_sessions", "Sessions in the table", registry=r)
        self.retries = Counter(
            "kvroute_retries", "Retries on another replica", ["reason"], registry=r
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
        self._refreshers: list[Callable[[], None]] = []

    def on_scrape(self, fn: Callable[[], None]) -> None:
        """Register a callback that refreshes gauges right before each exposition."""
        self._refreshers.append(fn)

    def exposition(self) -> bytes:
        for fn in self._refreshers:
            fn()
        return generate_latest(self.registry)
