"""The router's own scheduling pipelines as the simulator's routing function."""

from __future__ import annotations

from collections import Counter

import pytest

from costmodel.profiles import load_profile
from loadtest.sim.router_policy import RouterPolicy
from loadtest.sim.simulator import Simulator, synthetic_agentx

P70 = load_profile("h200-70b-fp8")
SESSIONS = synthetic_agentx(12, 300, seed=4)


def run(policy: str, profile=P70, n: int = 3):
    pol = RouterPolicy(policy, profile)
    sim = Simulator(profile, n, pol)
    return pol, sim, sim.run(SESSIONS, until=900)


def test_block_index_fed_by_engine_events_equals_what_the_engines_hold():
    off = load_profile("h200-70b-fp8-offload").replace(gpu_kv_blocks=800, cpu_kv_blocks=1500)
    pol, sim, res = run("kv_cost", off)
    assert res.records and pol.decisions >= len(res.records)
    snap = pol.kv.index.snapshot()
    for i, rep in enumerate(sim.replicas):
        held = snap[pol.names[i]]
        assert held["GPU"] == frozenset(rep.engine.pool.cached)
        assert held["CPU"] == frozenset(rep.engine.cpu.keys)
    assert any(snap[n]["CPU"] for n in pol.names)  # the tier was exercised


@pytest.mark.parametrize(
    "policy",
    ["round_robin", "least_load", "session_affinity", "prefix_hash", "llmd", "sglang_tree"],
)
def test_registered_policies_route_simulated_calls(policy):
    pol, _sim, res = run(policy)
    assert len(res.records) > 30
    assert {r.replica for r in res.records} <= {0, 1, 2}
    assert not pol.inflight or max(pol.inflight.values()) <= len(SESSIONS)


def test_kv_cost_finds_the_cache_round_robin_misses():
    _, _, rr = run("round_robin")
    _, _, kv = run("kv_cost")
    assert kv.summary()["cache_hit_ratio"] > rr.summary()["cache_hit_ratio"] + 0.1
    assert kv.summary()["ttft_p50_s"] < rr.summary()["ttft_p50_s"]


def test_unknown_policy_is_a_config_error():
    with pytest.raises(ValueError, match="unknown policy"):
        RouterPolicy("no-such-policy", P70)


def test_kv_cost_spreads_sessions_sharing_a_cached_prefix_by_decode_interference():
    """32 agent sessions share a 15k-token tools+system prefix. Counting only each call's own
    latency, the replica holding the prefix always looks cheapest and every session lands
    there; the interference term (the decoders a call would stall) spreads them."""
    tp4 = load_profile("h200-70b-fp8-tp4")
    sessions = synthetic_agentx(32, 300, seed=2)

    def first_calls(weight: float):
        scorer = {"type": "kv_cost", "weight": 1.0, "params": {"interference_weight": weight}}
        spec = {"scorers": [scorer]}
        res = Simulator(tp4, 4, RouterPolicy(spec, tp4)).run(sessions, until=600)
        homes = Counter(r.replica for r in res.records if r.call_index == 0)
        return homes, res.summary()["p90_interactivity_tok_s"]

    piled, inter_off = first_calls(0.0)
    spread, inter_on = first_calls(1.0)
    # without the interference term the other terms already push some sessions off the
    # prefix holder — the decode term (every call asks for the agents' 32k cap), the cold
    # prefills in flight there counted as queued work, and the reserved term's wait a cold
    # prefill causes agents about to return there (11 / 11 / 10 on three replicas since the
    # simulated calls are counted in flight; 13 / 11 / 8 before; 17 / 15 on two before that
    # half of the reserved term) — but one replica gets no session; with it every replica
    # gets its share (11 / 7 / 7 / 7) and the decoders stall less
    assert len(piled) <= 3
    assert len(spread) == 4 and min(spread.values()) >= 0.2 * 32
    assert inter_on > 1.03 * inter_off


def test_the_simulated_router_can_read_engine_load_through_scrapes():
    """With ``scrape_interval_s`` the router's view of running / waiting / KV usage and the
    pending-prefill gauge is the one of the last scrape (every interval), as a live router's
    /metrics poll gives it."""
    from types import SimpleNamespace as NS

    pol = RouterPolicy("least_load", P70, scrape_interval_s=1.0)

    def view(running, gauge=None):
        return [NS(index=0, num_running=running, num_waiting=0, kv_usage=0.1, host_retained=None,
                   pending_prefill_gauge=gauge)]  # fmt: skip

    pol.now = 0.2  # the first read is a scrape: 1 running, the gauge at 900 tokens ...
    running, _, _, _, gauge = pol._engine_load(view(1, 900.0))[0]
    assert (running, gauge) == (1.0, 900.0)
    # ... and a second read in the same interval still sees that gauge, not the engine's None
    assert pol._engine_load(view(1))[0][4] == 900.0
    pol.now = 0.9  # same scrape interval: the old figure
    assert pol._engine_load(view(5))[0][0] == 1.0
    assert pol._engine_load(view(5))[0][4] == 900.0
    pol.now = 1.05  # the next scrape
    assert pol._engine_load(view(5))[0][0] == 5.0
    assert pol._engine_load(view(5))[0][4] is None
    assert pol._scraped_at == 1.0
    exact = RouterPolicy("least_load", P70)
    exact.now = 0.9
    assert exact._engine_load(view(7))[0][0] == 7.0
    with pytest.raises(ValueError):
        RouterPolicy("least_load", P70, scrape_interval_s=-1)


def test_the_simulated_router_sends_session_priority_to_the_engines():
    """``priority=True``: each engine request carries the router's session-level priority
    (router.priority over the simulated session table's attained service); off: none."""
    from router.priority import ROLE_PLAIN, PriorityConfig, call_priority

    prof = P70.replace(priority_scheduling=1)
    cfg = PriorityConfig()
    levels: dict[str, list[int]] = {}

    class Spy(RouterPolicy):
        def request_priority(self, call):
            p = super().request_priority(call)
            fresh = call_priority(0, ROLE_PLAIN, None, call.now, cfg)  # a new session's
            levels.setdefault(call.session_id, []).append(round((p - fresh) * cfg.tick_s
                                                                / cfg.level_s))  # fmt: skip
            return p

    pol = Spy("kv_cost", prof, priority=True)
    res = Simulator(prof, 2, pol).run(SESSIONS, until=900)
    assert res.records and sum(map(len, levels.values())) >= len(res.records)  # (+ cut ones)
    assert all(v[0] == 0 for v in levels.values())  # a session's first call: no service yet
    # later calls fall behind as their session's service grows (least attained service)
    assert any(max(v) >= 2 for v in levels.values())
    assert all(v == sorted(v) for v in levels.values())  # no subagents here: only service
    assert sum(r.service for r in pol.store.list(1000)) > 0
    assert RouterPolicy("kv_cost", P70).priority is None
