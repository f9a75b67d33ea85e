"""router.collectors: the scrape-time collectors, read through RouterMetrics' watch_* hooks."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from costmodel.calibration import Calibrator
from router.kv.events import PublisherState, SubscriberStats
from router.metrics import RouterMetrics
from router.replicas import Replica, ReplicaSet
from tests.unit.test_router_metrics import value


@dataclass
class FakeSubscriber:
    stats: SubscriberStats = field(default_factory=SubscriberStats)


def test_replica_collector_follows_the_live_set():
    rs = ReplicaSet()
    rs.set_source("static", ["http://a:8000", "http://b:8000"])
    a, b = rs.get("http://a:8000"), rs.get("http://b:8000")
    assert isinstance(a, Replica) and isinstance(b, Replica)
    a.running, a.waiting, a.kv_usage = 3.0, 1.0, 0.25
    a.cached_by_source = {"device": 500.0, "host": 150.0}
    b.healthy = False
    m = RouterMetrics()
    m.watch_replicas(rs, SimpleNamespace(inflight=7))
    assert value(m, "kvroute_replica_healthy", replica="http://a:8000") == 1.0
    assert value(m, "kvroute_replica_healthy", replica="http://b:8000") == 0.0
    assert value(m, "kvroute_replica_requests_running", replica="http://a:8000") == 3.0
    assert value(m, "kvroute_replica_requests_waiting", replica="http://a:8000") == 1.0
    assert value(m, "kvroute_replica_kv_cache_usage_perc", replica="http://a:8000") == 0.25
    assert value(m, "kvroute_replica_requests_running", replica="http://b:8000") is None
    assert value(m, "kvroute_replica_prompt_tokens_cached_total", replica="http://a:8000",
                 source="host") == 150.0  # fmt: skip
    assert value(m, "kvroute_router_inflight_requests") == 7.0
    # /admin/replicas shows the same hits by source (issue 43: the pool's hits beside the rest)
    assert a.to_json()["cached_by_source"] == {"device": 500.0, "host": 150.0}
    assert b.to_json()["cached_by_source"] == {}
    rs.set_source("static", ["http://a:8000"])  # b leaves: its series go with it
    assert value(m, "kvroute_replica_healthy", replica="http://b:8000") is None


def test_kv_event_collector_sums_streams_per_replica():
    sub = FakeSubscriber()
    sub.stats.streams[("r1", 0)] = PublisherState(batches=10, gaps=1, replayed=3, last_lag_s=0.02)
    sub.stats.streams[("r1", 1)] = PublisherState(batches=5, restarts=1, last_lag_s=0.05)
    sub.stats.decode_errors = 2
    holder: list[FakeSubscriber | None] = [None]
    m = RouterMetrics()
    m.watch_kv_events(lambda: holder[0])
    assert value(m, "kvroute_kv_event_batches_total", replica="r1") is None  # not started
    holder[0] = sub
    assert value(m, "kvroute_kv_event_batches_total", replica="r1") == 15.0
    assert value(m, "kvroute_kv_event_gaps_total", replica="r1") == 1.0
    assert value(m, "kvroute_kv_event_replayed_total", replica="r1") == 3.0
    assert value(m, "kvroute_kv_event_restarts_total", replica="r1") == 1.0
    assert value(m, "kvroute_kv_event_lag_seconds", replica="r1") == 0.05
    assert value(m, "kvroute_kv_event_decode_errors_total") == 2.0


def test_calibration_collector_shows_each_replicas_fit():
    from router.kv.config import KVConfig
    from router.kv.state import KVState

    kv = KVState(KVConfig(block_size=16), clock=lambda: 0.0)
    m = RouterMetrics()
    m.watch_calibration(kv)
    assert value(m, "kvroute_kv_calibration", replica="r1", term="prefill_scale") is None
    cal = kv.calibrators.setdefault("r1", Calibrator())
    for i in range(10):  # the replica answers 5x faster than modelled: the scale pins at 0.2
        cal.observe_ttft(2.0 + i, (2.0 + i) / 10)
    assert value(m, "kvroute_kv_calibration", replica="r1", term="prefill_scale") == pytest.approx(
        0.2
    )
    assert value(m, "kvroute_kv_calibration", replica="r1", term="decode_scale") == 1.0
    assert value(m, "kvroute_kv_calibration_samples", replica="r1", kind="ttft") == 10.0
    assert value(m, "kvroute_kv_calibration", replica="r1", term="hit_realization") == 1.0
    for _ in range(8):  # a fifth of each matched prefix was still cached when the call ran
        cal.observe_hit(1000, 200)
    assert value(m, "kvroute_kv_calibration", replica="r1", term="hit_realization") == (
        pytest.approx(0.2)
    )
    assert value(m, "kvroute_kv_calibration_samples", replica="r1", kind="hit") == 8.0


def test_analysis_collector_counts_how_calls_fared():
    from router.kv.config import KVConfig
    from router.kv.state import KVState

    kv = KVState(KVConfig(block_size=16), clock=lambda: 0.0)
    m = RouterMetrics()
    m.watch_kv_analysis(kv)
    assert value(m, "kvroute_kv_analyses_total", outcome="not_waited") == 0.0
    kv.burst_waits = 3
    assert value(m, "kvroute_kv_analyses_total", outcome="burst_wait") == 3.0


def test_store_collector_only_for_redis():
    m = RouterMetrics()
    m.watch_store(SimpleNamespace(backend="memory"))
    assert value(m, "kvroute_redis_pending_writes") is None
    m.watch_store(SimpleNamespace(backend="redis", pending_writes=4, reconciles=2))
    assert value(m, "kvroute_redis_pending_writes") == 4.0
    assert value(m, "kvroute_redis_reconciles_total") == 2.0


def test_pool_collector_follows_the_index():
    from router.kv.config import KVConfig
    from router.kv.state import KVState
    from router.vllm.kvevents import BlockRemoved, BlockStored

    kv = KVState(KVConfig(block_size=16), clock=lambda: 0.0)
    m = RouterMetrics()
    m.watch_kv_pool(kv)
    assert value(m, "kvroute_kv_pool_blocks") == 0.0
    kv.index.apply("r1", [BlockStored([1, 2, 3], None, [], 0, "STORAGE", locality="REMOTE")])
    kv.index.apply("r2", [BlockStored([3, 4], None, [], 0, "STORAGE", locality="REMOTE")])
    kv.index.apply("r2", [BlockStored([5], None, [], 0, "STORAGE")])  # its own disk: not pool
    assert value(m, "kvroute_kv_pool_blocks") == 4.0
    assert value(m, "kvroute_kv_pool_members") == 2.0
    kv.index.apply("r1", [BlockRemoved([1, 4], "STORAGE", locality="REMOTE")])
    assert value(m, "kvroute_kv_pool_blocks") == 2.0
    assert value(m, "kvroute_kv_pool_removed_total") == 2.0
