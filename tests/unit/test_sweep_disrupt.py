"""kvroute bench --disrupt: which calls count as a session's first after a disruption, and the
hit ratio by source from the twins' metrics."""

from __future__ import annotations

import pytest

from loadtest.sweep.bench import SweepConfig, scale_out_of
from loadtest.sweep.disrupt import Disruptor, after_disruption_ttfts, hit_sources, preemptions


def call(session: str, t: float, replica: str, ttft: float | None = 0.1, ok: bool = True) -> dict:
    return {"session": session, "play": 0, "t_start": t, "t_end": t + 1.0, "ok": ok,
            "ttft_s": ttft, "replica": replica}  # fmt: skip


def test_a_restart_affects_the_sessions_last_served_by_that_replica_once_each():
    calls = [
        call("a", 1.0, "twin-0"),
        call("b", 2.0, "twin-1"),
        call("a", 11.0, "twin-1", ttft=3.0),  # a's first call after the restart of twin-0
        call("b", 12.0, "twin-1", ttft=0.2),  # b was on twin-1: not affected
        call("a", 13.0, "twin-1", ttft=0.5),  # not a's first after it
    ]
    ev = {"kind": "restart", "replica": "twin-0", "url": "http://x:1", "t_s": 10.0}
    assert after_disruption_ttfts(calls, [ev]) == [3.0]
    # a failed first call counts its time to fail
    calls[2] = call("a", 11.0, "twin-1", ttft=None, ok=False)
    assert after_disruption_ttfts(calls, [ev]) == [1.0]
    # a scale-out affects every session
    up = {"kind": "up", "replica": "twin-2", "url": "http://x:3", "t_s": 10.0}
    assert sorted(after_disruption_ttfts(calls, [up])) == [0.2, 1.0]


def test_hits_by_source_from_the_twins_metrics():
    t = 'kvroute:twin_prompt_tokens_cached_by_tier_total{model_name="m",engine="0",source="%s"} %s'
    q = 'vllm:prefix_cache_queries_total{model_name="m",engine="0"} 100.0'
    text = "\n".join([t % ("device", 50.0), t % ("pool", 30.0), q])
    got = hit_sources([text, text])
    assert got == pytest.approx(
        {"device": 0.5, "host": 0.0, "disk": 0.0, "pool": 0.3, "recomputed": 0.2}
    )
    assert hit_sources(["vllm:prefix_cache_queries_total{} 5.0"]) is None


def test_preemptions_are_summed_over_the_twins():
    a = 'vllm:num_preemptions_total{model_name="m",engine="0"} 3.0'
    b = "# TYPE vllm:num_preemptions_total counter\nvllm:num_preemptions_total{} 4.0"
    assert preemptions([a, b, "vllm:num_requests_waiting{} 9.0"]) == 7.0
    assert preemptions(["vllm:num_requests_waiting{} 9.0"]) is None


def test_disruptions_are_checked():
    with pytest.raises(ValueError, match="unknown disruption"):
        Disruptor("earthquake", ["u"], ["n"], 1.0, 0.0)
    with pytest.raises(ValueError, match="extra"):
        Disruptor("scale-out", ["u"], ["n"], 1.0, 0.0, extra=1)
    assert scale_out_of(SweepConfig(trace="x", replicas=4, disrupt="scale-out")) == 2
    assert scale_out_of(SweepConfig(trace="x", replicas=1, disrupt="scale-out")) == 1
    assert scale_out_of(SweepConfig(trace="x", replicas=4, disrupt="rolling-restart")) == 0
