"""router.loopmetrics: the loop-only counter and histogram expose what prometheus_client's would."""

from __future__ import annotations

import pytest


def test_loop_metrics_expose_what_prometheus_clients_own_would():
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from router.loopmetrics import LAT_BUCKETS, LoopCounter, LoopHistogram

    def text(registry: CollectorRegistry) -> list[str]:
        lines = generate_latest(registry).decode().splitlines()
        return sorted(x for x in lines if "_created" not in x)

    ours, theirs = CollectorRegistry(), CollectorRegistry()
    lc = LoopCounter("t_calls", "Calls", ["route", "status"], registry=ours)
    pc = Counter("t_calls", "Calls", ["route", "status"], registry=theirs)
    lh = LoopHistogram("t_lat_seconds", "Latency", ["replica"], buckets=LAT_BUCKETS, registry=ours)
    ph = Histogram("t_lat_seconds", "Latency", ["replica"], buckets=LAT_BUCKETS, registry=theirs)
    lu = LoopHistogram("t_one_seconds", "One", buckets=(1, 2), registry=ours)
    pu = Histogram("t_one_seconds", "One", buckets=(1, 2), registry=theirs)
    # on a bound, between bounds, above all, zero, many per bucket
    for v in (0.0, 0.0001, 0.0002, 0.00025, 0.3, 0.5, 0.7, 12.0, 0.003, 0.003):
        for h in (lh.labels("a"), ph.labels("a")):
            h.observe(v)
        for u in (lu, pu):
            u.observe(v * 4)
    for route, status, n in (("/v1/x", "200", 3), ("/v1/x", "503", 1), ("/v1/y", "200", 2.5)):
        lc.labels(route, status).inc(n)
        pc.labels(route, status).inc(n)
    lh.labels("b")  # a child with no observation yet is exposed with zeros, as theirs is
    ph.labels("b")
    assert text(ours) == text(theirs)
    with pytest.raises(ValueError):
        lc.labels("/v1/x", "200").inc(-1)
    with pytest.raises(ValueError):
        lc.labels("/v1/x")  # a label missing
