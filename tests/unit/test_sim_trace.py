"""Real traces (DAG sessions with subagents) in the in-process simulator, closed loop."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from costmodel.profiles import load_profile
from loadtest.metrics import UnlimitedCache
from loadtest.sim.simulator import DagSession, Simulator, TraceCall
from loadtest.sim.trace import TraceFeed, chained_keys, simulate_trace, trace_workload
from loadtest.traces import Call, Dep, Session, Trace, load_trace

P70 = load_profile("h200-70b-fp8")  # block 64
WEKA = Path(__file__).resolve().parents[2] / "loadtest" / "data" / "weka-dev-slice.tar.gz"


def ids(a: int, b: int) -> tuple[int, ...]:
    return tuple(range(a, b))


def dag_trace() -> Trace:
    """main/0 spawns subagents a (two calls) and b (one); main/1 joins both."""
    calls = [
        Call("main/0", "main", ids(1, 40), 39 * 64 - 10, 30, prefix_blocks=8),
        Call("a/0", "a", ids(100, 120), 20 * 64, 20, deps=(Dep("main/0", 2.0),),
             parent_agent="main", prefix_blocks=4, prefix_group="Explore"),
        Call("a/1", "a", ids(100, 130), 30 * 64, 40, deps=(Dep("a/0", 1.0),),
             parent_agent="main", prefix_blocks=4, prefix_group="Explore"),
        Call("b/0", "b", ids(200, 210), 10 * 64, 500, deps=(Dep("main/0", 0.5),),
             parent_agent="main"),
        Call("main/1", "main", ids(1, 50), 49 * 64, 10,
             deps=(Dep("main/0", 3.0), Dep("a/1"), Dep("b/0")), prefix_blocks=8),
    ]  # fmt: skip
    return Trace("t", 64, [Session("s", calls)])


def by_key(res):
    return {(r.session_id, r.call_index): r for r in res.records}


def test_dag_order_end_to_start_delays_and_subagent_identities():
    views = []

    def route(call, replicas):
        views.append(call)
        return 0

    res = simulate_trace(P70, 2, dag_trace(), route, concurrency=1)
    r = by_key(res)
    m0, m1 = r[("t/s#0", 0)], r[("t/s#0", 1)]
    a0, a1, b0 = r[("t/s#0/a", 0)], r[("t/s#0/a", 1)], r[("t/s#0/b", 0)]
    assert len(res.records) == 5 and res.sessions_done == res.sessions == 1
    assert m0.arrival == 0.0
    assert a0.arrival == pytest.approx(m0.finish + 2.0)
    assert a1.arrival == pytest.approx(a0.finish + 1.0)
    assert b0.arrival == pytest.approx(m0.finish + 0.5)
    # the join waits for the later of its three gates (b decodes 500 tokens: the last)
    assert b0.finish > max(a1.finish, m0.finish + 3.0)
    assert m1.arrival == pytest.approx(b0.finish)
    assert [x.agent for x in (m0, a0, a1, b0, m1)] == ["main", "a", "a", "b", "main"]
    v = {(x.session_id, x.call_index): x for x in views}
    assert v[("t/s#0", 0)].agent_id is None and v[("t/s#0", 0)].parent_session is None
    assert (v[("t/s#0/a", 1)].agent_id, v[("t/s#0/a", 1)].parent_session) == ("a", "t/s#0")
    finals = {k for k, x in v.items() if x.final}
    assert finals == {("t/s#0", 1), ("t/s#0/a", 1), ("t/s#0/b", 0)}
    # prompts: input tokens kept inside the last id's block; keys for full blocks only
    assert v[("t/s#0", 0)].prompt_tokens == 39 * 64 - 10
    assert len(v[("t/s#0", 0)].block_keys) == 38
    # main/1 extends main/0's prompt: everything main/0 had in full blocks is a hit
    assert m1.cached_tokens == 38 * 64


def test_start_delay_of_calls_without_dependencies():
    calls = [
        Call("main/0", "main", ids(1, 5), 256, 5),
        Call("x/0", "x", ids(50, 55), 300, 5, start_delay_s=7.5, parent_agent="main"),
    ]
    res = simulate_trace(P70, 1, Trace("t", 64, [Session("s", calls)]), "round_robin")
    r = by_key(res)
    assert r[("t/s#0", 0)].arrival == 0.0
    assert r[("t/s#0/x", 0)].arrival == 7.5


def small_trace(n: int, block: int = 64) -> Trace:
    sessions = [
        Session(f"s{i}", [Call(f"main/{i}", "main", ids(1, 20), 19 * block, 20 + 40 * i)])
        for i in range(n)
    ]
    return Trace("t", block, sessions)


def test_lanes_chain_sessions_from_one_shared_counter():
    feed = trace_workload(small_trace(3), 64, concurrency=2, duration_s=None)
    got = [feed.next_session(lane, 0.0) for lane in (0, 1, 1, 0)]
    assert [g.id if g else None for g in got] == ["t/s0#0", "t/s1#0", "t/s2#0", None]
    res = simulate_trace(P70, 2, small_trace(3), "round_robin", concurrency=2)
    first = {r.session_id: r for r in res.records}
    assert set(first) == {"t/s0#0", "t/s1#0", "t/s2#0"}  # no recycling without a bound
    assert first["t/s0#0"].arrival == first["t/s1#0"].arrival == 0.0
    # s0 decodes fewer tokens, so its lane is free first and takes s2 when s0 ends
    assert first["t/s0#0"].finish < first["t/s1#0"].finish
    assert first["t/s2#0"].arrival == first["t/s0#0"].finish
    assert res.sessions_done == res.sessions == 3
    # under a time bound lanes recycle the trace as new plays, and stop at the bound
    res = simulate_trace(P70, 2, small_trace(3), "round_robin", concurrency=2, duration_s=30)
    plays = {r.session_id for r in res.records}
    assert {"t/s0#1", "t/s1#1"} <= plays
    assert max(r.arrival for r in res.records) < 30 and res.sim_time_s == 30


def test_lanes_replaying_one_session_share_only_the_tools_system_prefix():
    one = Trace("t", 64, [Session("s", [Call("main/0", "main", ids(1, 41), 40 * 64, 10,
                                              prefix_blocks=12)])])  # fmt: skip
    for shared, want in ((False, 0), (True, 12 * 64)):
        feed = TraceFeed(one, 64, concurrency=2, duration_s=100, shared_prefix=shared)
        k0, k1 = (feed.instance(0, play).calls[0].block_keys for play in (0, 1))
        assert len(k0) == len(k1) == 40
        assert sum(a == b for a, b in zip(k0, k1, strict=True)) == want // 64
        assert len(set(k0) & set(k1)) == want // 64
        # both lanes start the same session at t=0 on one replica: play 1 hits only the
        # shared prefix (blocks are cached when allocated, as in vLLM)
        res = simulate_trace(P70, 1, one, "round_robin", concurrency=2, duration_s=5,
                             shared_prefix=shared)  # fmt: skip
        r = by_key(res)
        assert r[("t/s#0", 0)].arrival == r[("t/s#1", 0)].arrival == 0.0
        assert sorted([r[("t/s#0", 0)].cached_tokens, r[("t/s#1", 0)].cached_tokens]) == [0, want]
        assert r[("t/s#1", 0)].bound_cached_tokens == want


def expansion_trace() -> Trace:
    """512-token trace blocks; call 1 extends call 0, call 2 repeats call 1, call 3 is 30
    full blocks and call 4 repeats it (the last token is always computed: 29 blocks hit)."""
    calls = [
        Call("main/0", "main", (1, 2, 3), 1300, 10),
        Call("main/1", "main", (1, 2, 3, 4), 1900, 10, deps=(Dep("main/0", 1.0),)),
        Call("main/2", "main", (1, 2, 3, 4), 1900, 10, deps=(Dep("main/1", 1.0),)),
        Call("main/3", "main", (1, 2, 3, 4), 1920, 10, deps=(Dep("main/2", 1.0),)),
        Call("main/4", "main", (1, 2, 3, 4), 1920, 10, deps=(Dep("main/3", 1.0),)),
    ]
    return Trace("m", 512, [Session("s", calls)])


def test_trace_blocks_expand_to_profile_blocks_and_the_hit_bound():
    feed = trace_workload(expansion_trace(), 64, concurrency=1, duration_s=None)
    ks = [c.block_keys for c in feed.instance(0).calls]
    assert [len(k) for k in ks] == [20, 29, 29, 30, 30]
    assert ks[1][:20] == ks[0] and ks[2] == ks[1] and ks[3][:29] == ks[1]
    res = simulate_trace(P70, 1, expansion_trace(), "round_robin")
    r = sorted(res.records, key=lambda x: x.call_index)
    # call 0's 20 full prompt blocks (ids 1, 2 and half of 3) are hits for call 1; the block
    # call 0 finished with its own output differs from call 1's prompt
    want = [0, 20 * 64, 29 * 64, 29 * 64, 29 * 64]
    assert [x.cached_tokens for x in r] == want
    assert [x.bound_cached_tokens for x in r] == want
    s = res.summary()
    assert s["hit_bound"] == pytest.approx(107 * 64 / (1300 + 1900 * 2 + 1920 * 2))
    assert s["cache_hit_ratio"] == pytest.approx(s["hit_bound"])
    # alternating over two replicas: call 1 misses, call 2 finds only call 0's blocks; the
    # bound does not depend on routing
    alt = simulate_trace(P70, 2, expansion_trace(), lambda c, reps: c.call_index % 2)
    got = [x.cached_tokens for x in sorted(alt.records, key=lambda x: x.call_index)]
    assert got == [0, 0, 20 * 64, 29 * 64, 29 * 64]
    assert alt.summary()["cache_hit_ratio"] == pytest.approx(78 * 64 / 8940)
    assert alt.summary()["hit_bound"] == pytest.approx(s["hit_bound"])


def test_trace_scope_ids_are_shared_across_sessions_within_a_play():
    sessions = [Session(f"r{i}", [Call(f"r{i}/0", "main", h, 1100, 5)])
                for i, h in enumerate([(7, 8, 9), (7, 8, 10), (6, 8, 9)])]  # fmt: skip
    t = Trace("mc", 512, sessions, id_scope="trace", open_loop=True)
    feed = TraceFeed(t, 64, concurrency=2, duration_s=None, shared_prefix=False)
    a, b, c = (feed.instance(i).calls[0].block_keys for i in (0, 1, 2))
    assert a[:16] == b[:16] and a[16] != b[16]
    assert not set(a) & set(c)  # keys are chained: equal ids after a different prefix differ
    assert feed.instance(0, play=1).calls[0].block_keys[0] != a[0]


def test_refused_calls_are_counted_and_dependants_go_on():
    small = P70.replace(model=dataclasses.replace(P70.model, max_model_len=2000))
    calls = [
        Call("main/0", "main", ids(1, 40), 39 * 64, 10),  # 2496 tokens: over 2000
        Call("main/1", "main", ids(1, 10), 9 * 64, 10, deps=(Dep("main/0", 2.0),)),
    ]
    res = simulate_trace(small, 1, Trace("t", 64, [Session("s", calls)]), "round_robin")
    assert [r.call_index for r in res.records] == [1]
    assert res.records[0].arrival == 2.0
    assert res.summary()["requests_failed"] == 1 and res.sessions_done == 1


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="multiple"):
        trace_workload(small_trace(1, block=48), 64, concurrency=1, duration_s=None)
    with pytest.raises(ValueError, match="concurrency"):
        trace_workload(small_trace(1), 64, concurrency=0, duration_s=None)
    with pytest.raises(ValueError, match="not earlier"):
        DagSession("x", [TraceCall(100, 5, [], deps=((0, 0.0),))])


def test_dag_sessions_run_directly_and_with_the_routers_pipeline():
    from loadtest.sim.router_policy import RouterPolicy

    feed = trace_workload(dag_trace(), 64, concurrency=1, duration_s=None)
    ds = feed.instance(0, start=3.0)
    pol = RouterPolicy("session_affinity", P70)
    res = Simulator(P70, 2, pol).run([ds])
    assert len(res.records) == 5 and min(r.arrival for r in res.records) == 3.0
    assert pol.decisions == 5


def test_real_weka_trace_smoke():
    trace = load_trace(WEKA, max_sessions=3, max_gap_s=30)
    prof = load_profile("h200-70b-fp8-tp4")
    res = simulate_trace(prof, 2, trace, "sticky_spill", concurrency=2, duration_s=120)
    s = res.summary()
    assert s["requests"] > 0 and res.sim_time_s == 120
    assert 0.0 < s["cache_hit_ratio"] < 1.0
    assert s["cache_hit_ratio"] <= s["hit_bound"] + 1e-9 < 1.0
    assert s["throughput_tok_per_gpu_s"] > 0 and res.gpus == 8
    assert {r.session_id.split("#")[0] for r in res.records} <= {
        f"{trace.name}/{x.id}" for x in trace.sessions
    }


def test_absolute_turn_times_wait_for_the_previous_end_and_their_time():
    """aiperf timing in the simulator: call 1 starts 2.5 s after call 0 ends (``delay``);
    call 2 is due 60 s after the session start (``timestamp``), later than call 1's end;
    call 3 is due 3 s after the start, long past, so it starts when call 2 ends."""
    calls = [
        Call("s/0", "main", ids(1, 5), 256, 5),
        Call("s/1", "main", ids(1, 6), 300, 5, deps=(Dep("s/0", 2.5),)),
        Call("s/2", "main", ids(1, 7), 380, 5, deps=(Dep("s/1"),), not_before_s=60.0),
        Call("s/3", "main", ids(1, 8), 440, 5, deps=(Dep("s/2"),), not_before_s=3.0),
    ]
    res = simulate_trace(P70, 1, Trace("t", 64, [Session("s", calls)]), "round_robin")
    r = [by_key(res)[("t/s#0", k)] for k in range(4)]
    assert r[0].arrival == 0.0
    assert r[1].arrival == pytest.approx(r[0].finish + 2.5)
    assert r[1].finish < 60.0 and r[2].arrival == 60.0
    assert r[3].arrival == r[2].finish
    # a call without dependencies also waits for its absolute time
    lone = [Call("x/0", "x", ids(1, 5), 256, 5, start_delay_s=1.0, not_before_s=4.0)]
    res = simulate_trace(P70, 1, Trace("t", 64, [Session("s", lone)]), "round_robin")
    assert res.records[0].arrival == 4.0


def test_a_run_cut_by_the_bound_lasts_the_bound_even_when_its_last_event_is_past_it():
    """One long decode: the only event left at the bound is the burst's end, past it. The run
    was cut (time is the bound), though nothing is left on the heap to tell."""
    one = Trace("t", 64, [Session("s", [Call("main/0", "main", ids(1, 5), 256, 4000)])])
    res = simulate_trace(P70, 1, one, "round_robin", duration_s=5.0, max_plays=1)
    assert res.cut and res.sim_time_s == 5.0 and not res.records
    full = simulate_trace(P70, 1, one, "round_robin", duration_s=1e4, max_plays=1)
    assert not full.cut and full.sim_time_s == full.records[0].finish > 5.0
    # directly: run() reports the cut itself
    ds = trace_workload(one, 64, concurrency=1, duration_s=None).instance(0)
    got = Simulator(P70, 1, lambda c, r: 0).run([ds], until=5.0)
    assert got.cut and got.sim_time_s == 5.0


def test_calls_without_hash_ids_have_a_prompt_but_no_keys():
    assert chained_keys((), np.zeros(0, dtype=np.uint64), 8, 3) == []
    salts = np.zeros(2, dtype=np.uint64)
    assert chained_keys((1, 2), salts, 8, 99) == chained_keys((1, 2), salts, 8, 16)
    calls = [
        Call("main/0", "main", (), 700, 5),
        Call("main/1", "main", (), 700, 5, deps=(Dep("main/0"),)),
    ]
    res = simulate_trace(P70, 1, Trace("t", 64, [Session("s", calls)]), "round_robin")
    assert [(r.prompt_tokens, r.cached_tokens, r.bound_cached_tokens) for r in res.records] == [
        (700, 0, 0),
        (700, 0, 0),
    ]


def test_a_refused_call_does_not_raise_the_hit_bound_of_a_later_call():
    small = P70.replace(model=dataclasses.replace(P70.model, max_model_len=2000))
    calls = [
        Call("main/0", "main", ids(1, 40), 39 * 64, 10),  # refused: over 2000 tokens
        Call("main/1", "main", ids(1, 10), 9 * 64, 10, deps=(Dep("main/0"),)),
        Call("main/2", "main", ids(1, 10), 9 * 64, 10, deps=(Dep("main/1"),)),
    ]
    res = simulate_trace(small, 1, Trace("t", 64, [Session("s", calls)]), "round_robin")
    r = sorted(res.records, key=lambda x: x.call_index)
    assert [x.call_index for x in r] == [1, 2] and res.failed == 1
    # main/1 shares main/0's prefix, but main/0 was never served: nothing to hit
    assert [x.bound_cached_tokens for x in r] == [0, 8 * 64]
    assert [x.cached_tokens for x in r] == [0, 8 * 64]


def test_the_simulators_bound_is_the_unlimited_cache_of_the_metrics():
    cache = UnlimitedCache(4)
    a = list(range(1, 13))
    assert cache.observe(a) == 0
    assert cache.observe([*a, 99]) == 12  # 3 full blocks held
    assert cache.observe(a) == 8  # the last token is always computed
    assert cache.observe([]) == 0
    keys = UnlimitedCache(4)
    assert keys.observe_keys([1, 2, 3], 12) == 0
    assert keys.observe_keys([1, 2, 3, 4], 17) == 12
    assert keys.observe_keys([1, 2, 7], 12) == 8
    assert keys.observe_keys([1, 2, 3, 4, 5], 8) == 4  # only n_tokens // block keys count


def test_seeds_reorder_the_lanes_sessions_and_stagger_their_starts():
    def first_sessions(seed, stagger=0.0):
        feed = trace_workload(small_trace(8), 64, concurrency=3, duration_s=100.0, seed=seed,
                              stagger_s=stagger)  # fmt: skip
        return [feed.next_session(lane, 0.0) for lane in range(3)]

    plain = [s.id for s in first_sessions(None)]
    assert plain == ["t/s0#0", "t/s1#0", "t/s2#0"]  # no seed: the trace's order
    orders = {tuple(s.id for s in first_sessions(seed)) for seed in range(4)}
    assert len(orders) > 1  # seeds give other orders ...
    assert first_sessions(3)[0].id == first_sessions(3)[0].id  # ... reproducibly
    starts = [s.start for s in first_sessions(1, stagger=10.0)]
    assert all(0.0 <= t < 10.0 for t in starts) and len(set(starts)) == 3
    # only a lane's first session starts late; later ones start when the lane frees
    feed = trace_workload(small_trace(8), 64, concurrency=1, duration_s=100.0, seed=1,
                          stagger_s=10.0)  # fmt: skip
    assert feed.next_session(0, 0.0).start > 0.0 and feed.next_session(0, 50.0).start == 50.0
    res = simulate_trace(P70, 2, small_trace(8), "round_robin", concurrency=3,
                         duration_s=60.0, seed=1, stagger_s=10.0)  # fmt: skip
    assert min(r.arrival for r in res.records) > 0.0  # every lane started late


def test_warmup_excludes_early_calls_and_sessions_are_timed():
    res = simulate_trace(P70, 2, small_trace(6), "round_robin", concurrency=2, duration_s=60.0)
    full, late = res.summary(), res.summary(warmup_s=5.0)
    assert late["requests"] == sum(1 for r in res.records if r.arrival >= 5.0) < full["requests"]
    assert full["session_p50_s"] > 0 and full["session_p90_s"] >= full["session_p50_s"]
    spans = sorted(e - s for s, e in res.session_spans)
    assert len(spans) == res.sessions_done and full["session_p50_s"] == np.percentile(spans, 50)


def test_the_simulated_router_files_subagents_under_their_parent_as_the_live_router_does():
    """A subagent's calls reach the router's pipeline as their own session with the root
    session as parent (what Claude Code's agent headers give the live router): the KV layer
    finds the parent's footprint and pins it while a child runs, and the session table's
    lineage makes the parent's later hint ``waiting-on-children``."""
    from loadtest.sim.router_policy import RouterPolicy

    feed = trace_workload(dag_trace(), 64, concurrency=1, duration_s=None)
    pol = RouterPolicy("kv_cost", P70, engine_hints=True)
    pinned, hints = [], {}
    analyze = pol.calls.analyze

    def watch(ctx):
        out = analyze(ctx)
        if ctx.identity.parent is not None:
            parent = pol.kv.sessions.get(ctx.identity.parent)
            pinned.append(parent is not None and parent.children_inflight > 0)
        return out

    pol.calls.analyze = watch
    kv_params = pol.kv_transfer_params

    def keep(call):
        p = kv_params(call)
        hints[(call.session_id, call.call_index)] = (p or {}).get("kvroute", {}).get("state")
        return p

    pol.kv_transfer_params = keep
    ds = feed.instance(0)
    res = Simulator(P70, 2, pol).run([ds])
    assert len(res.records) == 5
    assert pinned == [True, True, True]  # a/0, a/1, b/0: the parent found and pinned
    root = ds.id
    assert hints[(root, 0)] == "tool-pause"  # the spawn was not known before main/0
    assert hints[(root, 1)] == "waiting-on-children"
