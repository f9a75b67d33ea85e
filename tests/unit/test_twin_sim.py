"""The discrete-event simulator: closed-loop sessions, pluggable routing, step-exact bursts."""

from __future__ import annotations

import pytest

from costmodel.profiles import load_profile
from loadtest.sim.simulator import (
    Call,
    Session,
    Simulator,
    route_fewest_requests,
    simulate,
    synthetic_agentx,
)

P70 = load_profile("h200-70b-fp8")


def test_bursts_are_step_exact():
    # short think times: many calls arrive while replicas are in the middle of a burst
    sessions = synthetic_agentx(16, 200, seed=5, think_median_s=2.0, think_p90_s=6.0)
    a = Simulator(P70, 2, route_fewest_requests(), burst=False)
    b = Simulator(P70, 2, route_fewest_requests(), burst=True)
    ra_, rb_ = a.run(sessions[:8]), b.run(sessions[:8])
    assert b.cuts > 20
    key = lambda r: (r.session_id, r.call_index)  # noqa: E731
    ra, rb = sorted(ra_.records, key=key), sorted(rb_.records, key=key)
    assert len(ra) == len(rb) > 50
    for x, y in zip(ra, rb, strict=True):
        assert (x.replica, x.cached_tokens, x.output_tokens, x.arrival) == (
            y.replica,
            y.cached_tokens,
            y.output_tokens,
            y.arrival,
        )
        assert x.first_token == pytest.approx(y.first_token, abs=1e-9)
        assert x.finish == pytest.approx(y.finish, abs=1e-9)
    assert ra_.steps == rb_.steps and rb_.events < ra_.events / 3


def test_closed_loop_next_call_waits_think_time_after_the_previous_finishes():
    s = Session("s", 1.0, [Call(5000, 10), Call(500, 20, think_s=7.0), Call(300, 5, 3.0)])
    res = simulate(P70, 1, [s], "round_robin")
    r = sorted(res.records, key=lambda x: x.call_index)
    assert [x.call_index for x in r] == [0, 1, 2]
    assert r[0].arrival == 1.0
    assert r[1].arrival == pytest.approx(r[0].finish + 7.0)
    assert r[2].arrival == pytest.approx(r[1].finish + 3.0)
    # each call's prompt is the whole context: previous prompt + output + new tokens
    assert r[1].prompt_tokens == 5000 + 10 + 500
    assert r[2].prompt_tokens == r[1].prompt_tokens + 20 + 300
    # and hits what the previous call left cached (full blocks of the previous prompt)
    assert r[1].cached_tokens == 5000 // 64 * 64
    assert r[1].ttft < r[0].ttft
    assert res.sessions_done == 1


def test_routing_function_sees_views_and_its_choice_is_used():
    seen = []

    def route(call, replicas):
        seen.append(
            (
                call.session_id,
                call.call_index,
                len(replicas),
                replicas[1].cached_blocks(call.block_keys),
            )
        )
        return 1

    s = [Session("a", 0.0, [Call(3000, 5), Call(100, 5, 1.0)])]
    res = Simulator(P70, 3, route).run(s)
    assert {r.replica for r in res.records} == {1}
    assert seen[0][:3] == ("a", 0, 3) and seen[0][3] == (0, 0, 0)
    assert seen[1][3][0] == 3005 // 64  # the first call's prompt and output blocks


def test_cache_affinity_beats_round_robin_on_hit_ratio():
    sessions = synthetic_agentx(16, 600, seed=7)
    rr = simulate(P70, 4, sessions, "round_robin", until=900).summary()
    aff = simulate(P70, 4, sessions, "sticky_spill", until=900).summary()
    assert aff["cache_hit_ratio"] > rr["cache_hit_ratio"] + 0.1
    assert aff["ttft_p50_s"] < rr["ttft_p50_s"]


def test_offload_tier_serves_hits_after_gpu_eviction():
    off = load_profile("h200-70b-fp8-offload").replace(gpu_kv_blocks=1200)  # ~77k tokens
    sessions = synthetic_agentx(4, 60, seed=8)
    res = simulate(off, 1, sessions, "round_robin", until=600)
    hits = res.summary()["tier_hit_blocks"]
    assert hits["cpu"] > 0 and hits["gpu"] > 0
    gpu_only = simulate(
        off.replace(cpu_kv_blocks=0, storage_kv_blocks=0), 1, sessions, "round_robin", until=600
    ).summary()
    assert res.summary()["ttft_p50_s"] < gpu_only["ttft_p50_s"]


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError):
        Simulator(P70, 0, lambda c, r: 0)
    with pytest.raises(KeyError):
        simulate(P70, 1, [], "no-such-policy")


def test_two_arrivals_within_one_step_of_a_burst_do_not_overlap_steps():
    sessions = [Session("a", 0.0, [Call(3000, 2000)])] + [
        Session(f"b{i}", 5.0 + 0.002 * i, [Call(1000 + i, 50)]) for i in range(4)
    ]
    runs = [Simulator(P70, 1, route_fewest_requests(), burst=flag) for flag in (False, True)]
    step, fast = (sim.run(sessions) for sim in runs)
    assert runs[1].cuts >= 1
    by = {r.session_id: r for r in step.records}
    for r in fast.records:
        assert r.first_token == pytest.approx(by[r.session_id].first_token, abs=1e-9)
        assert r.finish == pytest.approx(by[r.session_id].finish, abs=1e-9)
    assert step.steps == fast.steps
    busy = sum(fast.engine_busy_s)
    assert busy == pytest.approx(sum(step.engine_busy_s)) and busy <= fast.sim_time_s


def test_sim_command_compares_policies_and_writes_json(tmp_path, capsys):
    import json

    from kvroute.cli import main

    out = tmp_path / "sim.json"
    rc = main(
        [
            "sim",
            "--replicas",
            "2",
            "--hours",
            "0.1",
            "--policy",
            "round_robin",
            "--policy",
            "router:session_affinity",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "round_robin:" in text and "router:session_affinity:" in text
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"round_robin", "router:session_affinity"}
    assert all(r["requests"] > 0 for r in data["results"].values())
    assert main(["sim", "--policy", "no-such"]) == 2
    assert main(["sim", "--policy", "router:no-such"]) == 2


def test_a_run_cut_by_until_lasts_until_and_keeps_what_finished_before():
    sessions = synthetic_agentx(6, 200, seed=3)
    full = Simulator(P70, 2, route_fewest_requests()).run(sessions)
    assert not full.cut and full.sim_time_s == max(r.finish for r in full.records) > 30
    cut = Simulator(P70, 2, route_fewest_requests()).run(sessions, until=30.0)
    assert cut.cut and cut.sim_time_s == 30.0
    key = lambda r: (r.session_id, r.call_index)  # noqa: E731
    assert sorted(cut.records, key=key) == sorted(
        (r for r in full.records if r.finish <= 30.0), key=key
    )
    # a bound the run never reaches changes nothing
    late = Simulator(P70, 2, route_fewest_requests()).run(sessions, until=1e9)
    assert not late.cut and late.sim_time_s == full.sim_time_s
    assert late.records == full.records
