"""The router's own scheduling pipelines as the simulator's routing function."""

from __future__ import annotations

import pytest

from costmodel.profiles import load_profile
from loadtest.twin.sim import Simulator, synthetic_agentx
from loadtest.twin.sim_router import RouterPolicy

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
