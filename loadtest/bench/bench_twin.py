"""The in-process simulator's speed: 64 H200 replicas x 1 hour of agentic traffic.

Rows: the target run (64 x ``h200-70b-fp8``, 384 synthetic AgentX-like sessions over one
simulated hour, session-affinity routing) with its wall time and AgentX summary; the same
workload on 8 replicas with decode bursts off vs on (bursts are step-exact: the summaries must
agree; the ratio is the speed-up); the simulator's built-in routing functions and the router's
own pipelines (:class:`loadtest.sim.router_policy.RouterPolicy`) compared on one workload; and
the target run again with the router's ``kv_cost`` pipeline.
"""

from __future__ import annotations

from costmodel.profiles import load_profile
from loadtest.sim.router_policy import RouterPolicy
from loadtest.sim.simulator import Simulator, simulate, synthetic_agentx


def _row(name: str, res, **extra) -> dict:
    s = res.summary()
    return {
        "name": name,
        **extra,
        "wall_s": round(res.wall_s, 2),
        "sim_s": round(res.sim_time_s),
        "requests": s["requests"],
        "steps": s["steps"],
        "ttft_p50_s": round(s["ttft_p50_s"], 3),
        "ttft_p90_s": round(s["ttft_p90_s"], 3),
        "tpot_p90_ms": round(1e3 * s["tpot_p90_s"], 1),
        "hit_ratio": round(s["cache_hit_ratio"], 3),
        "tok_per_gpu_s": round(s["throughput_tok_per_gpu_s"]),
        "preemptions": s["preemptions"],
    }


def run(quick: bool = False) -> list[dict]:
    prof = load_profile("h200-70b-fp8")
    rows = []
    n, hours = (16, 0.25) if quick else (64, 1.0)
    dur = 3600 * hours
    sessions = synthetic_agentx(6 * n, dur, seed=1)
    res = simulate(prof, n, sessions, "sticky_spill", until=dur)
    rows.append(
        _row(
            f"sim_{n}x{prof.name}_{hours:g}h",
            res,
            replicas=n,
            sessions=len(sessions),
            target_wall_s=300,
        )
    )

    small = synthetic_agentx(24, 600 if quick else 1800, seed=2)
    step = simulate(prof, 8, small, "sticky_spill", burst=False)
    fast = simulate(prof, 8, small, "sticky_spill", burst=True)

    def key(r):
        return (r.session_id, r.call_index, r.replica, r.cached_tokens, r.first_token, r.finish)

    same = step.steps == fast.steps and sorted(map(key, step.records)) == sorted(
        map(key, fast.records)
    )
    rows.append(_row("sim_8x_stepwise", step))
    rows.append(
        _row(
            "sim_8x_bursts",
            fast,
            speedup_vs_stepwise=round(step.wall_s / fast.wall_s, 2),
            identical_results=same,
        )
    )

    pol = synthetic_agentx(4 * 8, 900 if quick else 1800, seed=3)
    for route in ("round_robin", "fewest_requests", "sticky_spill", "exact_cache"):
        rows.append(_row(f"route_{route}_8x", simulate(prof, 8, pol, route)))

    # the router's own pipelines (router.scheduling), fed by the engines' KV events
    for policy in (
        "round_robin",
        "least_load",
        "sticky_spill",
        "prefix_hash",
        "kv_cost",
        "llmd",
        "sglang_tree",
    ):
        res = Simulator(prof, 8, RouterPolicy(policy, prof)).run(pol)
        rows.append(_row(f"router_{policy}_8x", res))
    res = Simulator(prof, n, RouterPolicy("kv_cost", prof)).run(sessions, until=dur)
    rows.append(
        _row(
            f"router_kv_cost_{n}x{prof.name}_{hours:g}h",
            res,
            replicas=n,
            sessions=len(sessions),
            target_wall_s=300,
        )
    )
    return rows
