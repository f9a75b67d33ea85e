"""Placement measurements from replay records: imbalance at placement, moves, cold calls."""

from __future__ import annotations

from loadtest.replay.records import CallRecord
from loadtest.report.diagnose import interactivity_interval, point_measures


def call(session, t0, t1, replica, prompt=1000, cached=0, ttft=0.5, agent="main"):
    return CallRecord(session=session, play=0, call=f"{agent}/{t0}", agent=agent, t_start=t0,
                      t_end=t1, ok=True, ttft_s=ttft, prompt_tokens=prompt,
                      cached_tokens=cached, replica=replica)  # fmt: skip


def test_imbalance_moves_and_cold_calls_are_measured_from_the_records():
    calls = [
        call("a", 0.0, 10.0, "r0"),  # cold
        call("b", 1.0, 10.0, "r0"),  # cold, r0 has 1 in flight, r1 none: +1
        call("c", 2.0, 10.0, "r0", ttft=9.0),  # cold, r0 has 2, r1 0: +2
        call("a", 11.0, 12.0, "r0", cached=900),  # stayed, hit 90%
        call("b", 11.5, 13.0, "r1", cached=0, ttft=3.0),  # moved: lost its prefix
    ]
    m = point_measures(calls, speedup=2.0)
    assert m["calls"] == 5 and m["per_replica"] == {"r0": 4, "r1": 1}
    assert m["cold_calls"] == 3 and m["moves"] == 1 and m["move_share"] == 0.5
    assert m["hit_stayed"] == 0.9 and m["hit_moved"] == 0.0
    assert m["ttft_p90_moved_s"] == 6.0  # scaled by the speedup
    assert m["placed_busier_2"] == 1 / 5 and abs(m["imbalance_mean"] - 3 / 5) < 1e-9
    assert m["tail"][0]["ttft_s"] == 18.0 and m["tail"][0]["extra_inflight"] == 2
    # busy seconds: r0 10+9+8+1 = 28, r1 1.5, times the speedup
    assert abs(m["occupancy_max_over_min"] - 28 / 1.5) < 1e-9


def test_moves_in_the_decision_log_are_attributed_to_the_term_that_drove_them():
    from loadtest.report.diagnose import decision_measures

    def line(sticky, winner, a, b):
        return {"session_replica": sticky, "winner": winner,
                "candidates": {"r0": {"kv_cost": a}, "r1": {"kv_cost": b}}}  # fmt: skip

    lines = [
        line(None, "r0", {}, {}),  # a new session: no move
        line("r0", "r0", {"queue_s": 9.0}, {}),  # stayed
        line(
            "r0",
            "r1",
            {"queue_s": 6.0, "fetch_or_recompute_s": 0.1},
            {"queue_s": 0.0, "fetch_or_recompute_s": 3.0},
        ),  # fled a queue
        line(
            "r0",
            "r1",
            {"reserved_s": 29.0, "fetch_or_recompute_s": 0.1},
            {"reserved_s": 0.1, "fetch_or_recompute_s": 12.8},
        ),  # fled reserved agents
        line("r1", "r0", {"interference_s": 0.5}, {"interference_s": 2.0}),  # r1 sticky
    ]
    m = decision_measures(lines)
    assert m["decided_moves"] == 3
    assert m["move_drivers"] == {"queue_s": 1, "reserved_s": 1, "interference_s": 1}


def test_interactivity_interval_leaves_out_warmup_and_widens_with_a_heavy_tail():
    def dec(t0, tpot, n=100):
        c = call("s", t0, t0 + 1.0, "r0")
        c.tpot_s, c.completion_tokens = tpot, n
        return c

    # 10 warm-up calls with a terrible TPOT, then 100 calls at 10 ms and a tail at 30 ms.
    warm = [dec(float(i), 1.0) for i in range(10)]
    steady = [dec(20.0 + i, 0.010) for i in range(90)] + [dec(120.0 + i, 0.030) for i in range(10)]
    one_token = [dec(300.0, 5.0, n=1)]  # no TPOT for a one-token answer
    m = interactivity_interval(warm + steady + one_token, speedup=1.0, warmup_s=15.0)
    assert m["tpot_calls"] == 100
    assert 1 / 0.030 <= m["p90_interactivity"] <= 1 / 0.010
    assert m["p90_interactivity_lo"] <= m["p90_interactivity"] <= m["p90_interactivity_hi"]
    # the P90 sits on the edge of the 10-call tail: resampling moves it across the tail
    assert m["p90_interactivity_hi"] - m["p90_interactivity_lo"] > 20.0
    # without the tail every resample gives the same P90: the interval closes
    flat = interactivity_interval(steady[:90], warmup_s=15.0)
    assert abs(flat["p90_interactivity_hi"] - flat["p90_interactivity_lo"]) < 1e-6
    # the warm-up is in run-clock seconds scaled by the speedup, as the summary's
    assert interactivity_interval(warm + steady, speedup=10.0, warmup_s=15.0)["tpot_calls"] == 108
    assert interactivity_interval([], warmup_s=0.0) == {}
