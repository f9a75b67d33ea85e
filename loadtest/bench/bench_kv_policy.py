"""kv_cost vs the baselines on the in-process twin simulator (8 x H200-70B, agentic sessions).

The simulator (:mod:`loadtest.twin.sim`, the twin's engine model, no HTTP) hands each arriving
call to a routing function. :func:`route_kv_cost` is the ``kv_cost`` policy's cost model
(:func:`costmodel.placement.placement_cost`, the same function the router's scorer calls) fed
from what a router can know in the simulator: each replica's cached prefix by tier (what the
KV events give the block index), its pending prefill tokens and running batch (engine
metrics), and the router's own session footprints (home replica, context, last call, gaps),
with the same session prior + hysteresis. Baselines: the simulator's round-robin,
least-loaded, session-affinity and cache-aware (uncached tokens + queue) policies.

Rows: per profile (``h200-70b-fp8``; ``h200-70b-fp8-offload`` with host-DRAM and NVMe tiers)
and load level (sessions over the window): token cache-hit ratio, TTFT p50/p90, P90
interactivity (1000 / P90 TPOT ms), tokens per GPU-second; then per profile the best
throughput among load levels meeting P90 interactivity ≥ 50 tok/s for every policy, and
kv_cost's ratio to the best baseline. Synthetic AgentX-like sessions (the shape of the public
Claude Code traces; see loadtest/twin/sim.py); each session's first 15k tokens
(tools + system prompt) are shared.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from costmodel.placement import (
    CallShape,
    ReplicaLoad,
    Reservation,
    WarmSession,
    p_return_after,
    placement_cost,
)
from costmodel.profiles import load_profile
from loadtest.twin.sim import CallView, ReplicaView, RouteFn, simulate, synthetic_agentx


@dataclass
class _Sess:
    replica: int
    tokens: int
    last: float
    gaps: list[float] = field(default_factory=list)
    turn: int = 0


def route_kv_cost(
    hysteresis_s: float = 0.25, hysteresis_frac: float = 0.1, expected_output_tokens: int = 400
) -> RouteFn:
    """The kv_cost policy as a simulator routing function (see the module docstring)."""
    sessions: dict[str, _Sess] = {}

    def route(call: CallView, replicas: Sequence[ReplicaView]) -> int:
        me = sessions.get(call.session_id)
        best, best_eff = 0, math.inf
        for r in replicas:
            prof = r.profile
            bs = prof.block_size
            g, c, s = r.cached_blocks(call.block_keys)
            warm, res = [], []
            held = 0
            for key, ss in sessions.items():
                if ss.replica != r.index or key == call.session_id:
                    continue
                idle = max(call.now - ss.last, 0.0)
                gap = sum(ss.gaps) / len(ss.gaps) if ss.gaps else None
                p = p_return_after(idle, gap, False)
                warm.append(WarmSession(key, ss.tokens, idle, p))
                held += math.ceil(ss.tokens / bs)
                if p > 0.05:
                    res.append(
                        Reservation(
                            key, max((gap or 18.0) - idle, 0.0), max(ss.turn, 1), ss.tokens, p
                        )
                    )
            used = max(held, int(r.kv_usage * prof.gpu_kv_blocks))
            running = r.num_running
            load = ReplicaLoad(
                queued_prefill_tokens=r.pending_prefill_tokens(),
                decode_batch=running,
                decode_context_tokens=r.kv_usage * prof.gpu_kv_blocks * bs,
                free_gpu_blocks=max(prof.gpu_kv_blocks - used, 0),
                pending_calls=r.num_waiting,
                warm=warm,
                reserved=res,
            )
            terms = placement_cost(
                prof, CallShape(call.prompt_tokens, g, c, s, expected_output_tokens), load
            )
            cost = terms.total_s
            if me is not None and me.replica == r.index:
                cost -= min(hysteresis_s + hysteresis_frac * cost, cost)
            if cost < best_eff:
                best, best_eff = r.index, cost
        if me is None:
            sessions[call.session_id] = _Sess(best, call.prompt_tokens, call.now)
        else:
            me.gaps = [*me.gaps[-9:], max(call.now - me.last, 0.0)]
            me.turn = max(call.prompt_tokens - me.tokens, 1)
            me.replica, me.tokens, me.last = best, call.prompt_tokens, call.now
        return best

    return route


POLICIES = ("round_robin", "least_loaded", "session_affinity", "cache_aware", "kv_cost")


def _row(profile: str, n_sessions: int, policy: str, res) -> dict:
    s = res.summary()
    return {
        "name": f"{profile}_{n_sessions}sess_{policy}",
        "profile": profile, "sessions": n_sessions, "policy": policy,
        "requests": s["requests"],
        "hit_ratio": round(s["cache_hit_ratio"], 3),
        "ttft_p50_s": round(s["ttft_p50_s"], 2),
        "ttft_p90_s": round(s["ttft_p90_s"], 2),
        "p90_interactivity": round(s["p90_interactivity_tok_s"], 1),
        "tok_per_gpu_s": round(s["throughput_tok_per_gpu_s"]),
        "wall_s": round(res.wall_s, 1),
    }  # fmt: skip


def run(quick: bool = False) -> list[dict]:
    n_rep = 8
    dur = 900.0 if quick else 3600.0
    loads = (16, 32) if quick else (16, 32, 48, 64, 96)
    profiles = ("h200-70b-fp8",) if quick else ("h200-70b-fp8", "h200-70b-fp8-offload")
    rows: list[dict] = []
    for pname in profiles:
        prof = load_profile(pname)
        per_policy: dict[str, list[dict]] = {p: [] for p in POLICIES}
        for n in loads:
            sessions = synthetic_agentx(n, dur * 0.5, seed=7)
            for pol in POLICIES:
                fn = route_kv_cost() if pol == "kv_cost" else pol
                res = simulate(prof, n_rep, sessions, fn, until=dur)
                row = _row(pname, n, pol, res)
                rows.append(row)
                per_policy[pol].append(row)
        for line in (50, 25):
            best = {}
            for pol, rs in per_policy.items():
                ok = [r for r in rs if r["p90_interactivity"] >= line]
                best[pol] = max((r["tok_per_gpu_s"] for r in ok), default=0)
            base = max(v for p, v in best.items() if p != "kv_cost")
            rows.append(
                {
                    "name": f"{pname}_best_at_p90_{line}tok_s",
                    **{f"{p}_tok_per_gpu_s": v for p, v in best.items()},
                    "kv_cost_vs_best_baseline": round(best["kv_cost"] / base, 2) if base else None,
                }
            )
    return rows
