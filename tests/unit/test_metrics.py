"""AgentX metrics on a hand-checkable record set, and the unlimited-cache bound."""

from __future__ import annotations

import pytest

from loadtest.metrics import UnlimitedCache, summarize
from loadtest.replay.records import CallRecord, QueueSample, SessionRecord


def rec(t0, t1, ttft, tpot, p, c, cached, bound=0, ok=True, **kw):
    return CallRecord(
        session="s",
        play=0,
        call="c",
        agent="main",
        t_start=t0,
        t_end=t1,
        ok=ok,
        ttft_s=ttft,
        tpot_s=tpot,
        prompt_tokens=p,
        completion_tokens=c,
        cached_tokens=cached,
        bound_cached_tokens=bound,
        **kw,
    )


RECORDS = [
    # TPOTs 10, 20, 30, 40 ms; TTFTs 0.1 .. 0.4 s
    rec(0.0, 1.0, 0.1, 0.010, 1000, 11, 500, bound=600, replica="a"),
    rec(1.0, 2.0, 0.2, 0.020, 2000, 11, 1500, bound=1800, replica="b"),
    rec(2.0, 3.0, 0.3, 0.030, 3000, 11, 0, bound=2900, replica="a"),
    rec(3.0, 4.0, 0.4, 0.040, 4000, 11, 4000 - 32, bound=3968),
    rec(4.0, 4.5, None, None, 5000, 0, None, ok=False, status=503, error="http 503: busy"),
    rec(4.0, 9.0, 0.5, None, 900, 1, None),  # one output token: no TPOT, no cached field
    rec(9.0, 10.0, None, None, 700, 0, None, ok=False, error="cancelled: run bound"),
]
SESSIONS = [
    SessionRecord("s", 0, 0, 0.0, 10.0, 3, True),
    SessionRecord("t", 0, 1, 2.0, 22.0, 3, True),
    SessionRecord("u", 0, 1, 2.0, 3.0, 1, False),
]


def test_summary_by_hand():
    s = summarize(
        RECORDS,
        SESSIONS,
        [QueueSample(0, 1), QueueSample(1, 3), QueueSample(2, 2)],
        wall_s=10.0,
        gpus=2,
    )
    # P90 of TPOT [10, 20, 30, 40] ms with linear interpolation = 37 ms
    assert s["tpot_p90_ms"] == pytest.approx(37.0)
    assert s["p90_interactivity_tok_s"] == pytest.approx(1000 / 37)
    assert s["meets_interactivity_line"] is False
    # tokens: prompts 1000+2000+3000+4000+900 + outputs 4*11+1 over 2 GPUs x 10 s
    assert s["tokens_per_gpu_s"] == pytest.approx((10_900 + 45) / 20)
    assert s["ttft_p50_s"] == pytest.approx(0.3)
    assert s["ttft_p90_s"] == pytest.approx(0.46)
    assert s["ttft_p99_s"] == pytest.approx(0.496)
    # sessions: complete ones last 10 s and 20 s
    assert s["session_completion_p50_s"] == pytest.approx(15.0)
    assert s["session_completion_p90_s"] == pytest.approx(19.0)
    assert s["sessions_completed"] == 2 and s["sessions_started"] == 3
    # hit ratio over calls that reported cached_tokens: (500+1500+0+3968)/(10000)
    assert s["cache_hit_ratio"] == pytest.approx(5968 / 10_000)
    # ... and its bound over the same calls (the one without a cached field is left out)
    assert s["cache_hit_bound"] == pytest.approx((600 + 1800 + 2900 + 3968) / 10_000)
    assert s["requests_ok"] == 5 and s["requests_failed"] == 1
    assert s["requests_cancelled"] == 1
    assert s["failures"] == {"http 503": 1}
    # depth 1 during [0, 1) and 3 during [1, 2) (the last sample closes the series): the
    # time-weighted median is the lower of the two halves
    assert s["queue_depth_max"] == 3 and s["queue_depth_p50"] == 1
    assert s["replicas_used"] == ["a", "b"]


def test_twin_speedup_scales_times_back():
    fast = summarize(RECORDS, SESSIONS, wall_s=10.0, speedup=10.0)
    real = summarize(RECORDS, SESSIONS, wall_s=10.0)
    assert fast["ttft_p50_s"] == pytest.approx(10 * real["ttft_p50_s"])
    assert fast["p90_interactivity_tok_s"] == pytest.approx(real["p90_interactivity_tok_s"] / 10)
    assert fast["tokens_per_gpu_s"] == pytest.approx(real["tokens_per_gpu_s"] / 10)
    assert fast["session_completion_p90_s"] == pytest.approx(190.0)


def test_empty_and_bad_inputs():
    s = summarize([], wall_s=1.0)
    assert s["requests_ok"] == 0 and s["p90_interactivity_tok_s"] is None
    assert s["cache_hit_ratio"] is None and s["tokens_per_gpu_s"] == 0
    with pytest.raises(ValueError):
        summarize([], wall_s=0)


def test_unlimited_cache_counts_full_block_prefix_hits_like_vllm():
    c = UnlimitedCache(4)
    a = list(range(10))  # blocks [0-3] [4-7], tail 8 9
    assert c.observe(a) == 0
    assert c.observe(a) == 8  # both full blocks held
    assert c.observe(a[:8]) == 4  # a prompt of exactly 2 blocks: the last token is computed
    b = [0, 1, 2, 3, 99, 5, 6, 7, 8, 9]
    assert c.observe(b) == 4  # diverges in block 2: chained hashes stop matching there
    assert c.observe([99, 1, 2, 3, 4, 5, 6, 7, 1]) == 0  # same blocks later, different prefix


def test_queue_depth_median_weights_time_not_sample_count():
    # 9 s at depth 1, then a 1 s burst with many start/end samples at depth 8
    q = [QueueSample(0.0, 1)] + [QueueSample(9.0 + i / 20, 8) for i in range(20)]
    q.append(QueueSample(10.0, 0))
    s = summarize(RECORDS, SESSIONS, q, wall_s=10.0, gpus=2)
    assert s["queue_depth_p50"] == 1 and s["queue_depth_max"] == 8


def test_the_line_rule_reads_the_pareto_curve():
    """The line figure moved to loadtest.line (one rule for every caller, tests/unit/
    test_line.py); the cases the old metrics.throughput_at_line covered, on a fine grid."""
    from loadtest.line import line_figure

    # (lanes, P90 interactivity, tok/GPU-s) by rising lanes
    pts = [(16, 80.0, 1000.0), (18, 60.0, 2000.0), (20, 40.0, 3000.0), (22, 20.0, 4000.0)]
    assert line_figure(pts, 50.0).interpolated == pytest.approx(2500.0)  # halfway 60 -> 40
    assert line_figure(pts, 60.0).interpolated == pytest.approx(2000.0)  # exactly on a point
    assert line_figure(pts, 90.0).measured is None  # never reaches the line
    # always above: the last point is measured; the crossing lies past the grid
    above = line_figure(pts, 10.0)
    assert (above.measured, above.interpolated, above.ok) == (4000.0, None, False)


def test_the_simulator_summary_uses_the_replay_definitions():
    from loadtest.metrics import CallNumbers, agentx_numbers
    from loadtest.sim.simulator import CallRecord as SimCall
    from loadtest.sim.simulator import SimResult

    # the same four calls as a replay would record them and as the simulator does
    # (arrival, first token, finish; TPOT = (finish - first token) / (outputs - 1))
    sim_calls = [
        SimCall("s", 0, 0, 0.0, 1000, 11, 500, 0.1, 0.2, 0),  # TPOT 10 ms
        SimCall("s", 1, 0, 1.0, 2000, 11, 1500, 1.2, 1.4, 0),  # 20 ms
        SimCall("t", 0, 1, 2.0, 3000, 11, 0, 2.3, 2.6, 0),  # 30 ms
        SimCall("t", 1, 1, 3.0, 900, 1, 800, 3.5, 3.5, 0),  # one output token: no TPOT
    ]
    res = SimResult(sim_calls, sim_time_s=10.0, wall_s=0.1, replicas=2, events=0, steps=0,
                    sessions_done=2, sessions=2)  # fmt: skip
    replay = [
        rec(c.arrival, c.finish, c.ttft, c.tpot, c.prompt_tokens, c.output_tokens, c.cached_tokens)
        for c in sim_calls
    ]
    s, r = res.summary(), summarize(replay, wall_s=10.0, gpus=2)
    assert s["tpot_p90_s"] == pytest.approx(r["tpot_p90_ms"] / 1e3)
    assert s["tpot_p90_s"] == pytest.approx(0.028)  # [10, 20, 30] ms; the 1-token call is out
    assert s["p90_interactivity_tok_s"] == pytest.approx(r["p90_interactivity_tok_s"])
    assert s["throughput_tok_per_gpu_s"] == pytest.approx(r["tokens_per_gpu_s"])
    assert s["throughput_tok_per_gpu_s"] == pytest.approx((6900 + 34) / 20)
    assert s["cache_hit_ratio"] == pytest.approx(r["cache_hit_ratio"])
    assert s["cache_hit_ratio"] == pytest.approx(2800 / 6900)
    for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s"):
        assert s[k] == pytest.approx(r[k])
    # the shared helper, in seconds, with a twin's speedup
    n = agentx_numbers([CallNumbers(0.1, 0.01, 10, 5), CallNumbers(0.3, None, 10, 1)],
                       wall_s=2.0, speedup=10.0)  # fmt: skip
    assert n["ttft_p50_s"] == pytest.approx(2.0) and n["tpot_p90_s"] == pytest.approx(0.1)
    assert n["p90_interactivity_tok_s"] == pytest.approx(10.0)
    assert n["tokens_per_gpu_s"] == pytest.approx(26 / 20)
    assert n["cache_hit_ratio"] is None and n["cache_hit_bound"] is None


def test_sessions_cut_by_the_bound_are_reported_apart_with_their_elapsed_time():
    sessions = [
        SessionRecord("a", 0, 0, 0.0, 10.0, 3, True),
        SessionRecord("b", 0, 1, 0.0, 20.0, 3, True),
        SessionRecord("c", 0, 2, 5.0, 35.0, 2, False, cut=True),  # 30 s so far at the bound
        SessionRecord("d", 0, 3, 0.0, 50.0, 1, False, cut=True),  # 50 s so far
        SessionRecord("e", 0, 0, 10.0, 12.0, 3, False),  # ran every call, one failed
    ]
    s = summarize(RECORDS, sessions, wall_s=50.0, speedup=2.0)
    # completed plays as before: [10, 20] s × speedup 2
    assert s["session_completion_p90_s"] == pytest.approx(2 * 19.0)
    assert s["sessions_completed"] == 2 and s["sessions_started"] == 5
    assert s["sessions_unfinished"] == 2 and s["sessions_failed"] == 1
    assert s["session_unfinished_elapsed_p50_s"] == pytest.approx(2 * 40.0)
    assert s["session_unfinished_elapsed_max_s"] == pytest.approx(2 * 50.0)
    # P90 of [10, 20, 30, 50] (linear: 30 + 0.7 × 20 = 44), a lower bound of the true P90
    assert s["session_completion_p90_lower_bound_s"] == pytest.approx(2 * 44.0)
    assert s["session_completion_p90_lower_bound_s"] > s["session_completion_p90_s"]
    # none cut: the bound equals the completed plays' P90
    plain = summarize(RECORDS, SESSIONS, wall_s=10.0)
    assert plain["sessions_unfinished"] == 0 and plain["session_unfinished_elapsed_max_s"] is None
    assert plain["session_completion_p90_lower_bound_s"] == plain["session_completion_p90_s"]
    from loadtest.metrics import SUMMARY_REQUIRED

    assert "sessions_unfinished" in SUMMARY_REQUIRED and set(SUMMARY_REQUIRED) <= set(plain)


def test_session_completion_by_size_classes_and_short_session_ttft():
    from loadtest.metrics import LONG_MIN_CALLS, SHORT_MAX_CALLS, size_class

    assert [size_class(n) for n in (1, SHORT_MAX_CALLS, SHORT_MAX_CALLS + 1,
                                    LONG_MIN_CALLS - 1, LONG_MIN_CALLS)] == [
        "short", "short", "medium", "medium", "long"]  # fmt: skip
    sessions = [
        SessionRecord("a", 0, 0, 0.0, 10.0, 2, True),  # short, 10 s
        SessionRecord("b", 0, 1, 0.0, 30.0, 3, True),  # short, 30 s
        SessionRecord("c", 0, 2, 0.0, 50.0, SHORT_MAX_CALLS + 1, True),  # medium
        SessionRecord("d", 0, 3, 0.0, 90.0, LONG_MIN_CALLS, True),  # long
        SessionRecord("e", 0, 0, 0.0, 5.0, 1, False, cut=True),  # not completed: no class
    ]
    calls = [
        CallRecord("a", 0, "x", "main", 0.0, 1.0, True, ttft_s=0.5),
        CallRecord("b", 0, "x", "main", 0.0, 1.0, True, ttft_s=1.5),
        CallRecord("d", 0, "x", "main", 0.0, 1.0, True, ttft_s=9.0),
        CallRecord("e", 0, "x", "main", 0.0, 1.0, True, ttft_s=99.0),
    ]
    s = summarize(calls, sessions, wall_s=100.0, speedup=2.0)
    by = s["session_completion_by_size"]
    assert by["short"]["sessions"] == 2 and by["short"]["p50_s"] == pytest.approx(40.0)
    assert by["short"]["p99_s"] == pytest.approx(20 + 0.99 * 40)  # modelled s (x speedup)
    assert by["short"]["ttft_p99_s"] == pytest.approx(2 * (0.5 + 0.99 * 1.0))
    assert by["medium"]["sessions"] == 1 and by["medium"]["ttft_p99_s"] is None
    assert by["long"]["p90_s"] == pytest.approx(180.0) and by["long"]["ttft_p99_s"] == 18.0
    assert s["session_completion_mean_s"] == pytest.approx(2 * (10 + 30 + 50 + 90) / 4)
