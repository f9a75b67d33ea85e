"""``kvroute sim``: a routing policy on N simulated replicas over synthetic agentic traffic.

Runs the in-process discrete-event simulator (no HTTP): synthetic AgentX-like sessions, the
engine model of every replica, and a routing policy — a built-in one (``round_robin``,
``fewest_requests``, ``sticky_spill``, ``exact_cache``) or any of the router's own
pipelines as ``router:<policy>`` (e.g. ``router:kv_cost``). Prints the AgentX summary. With
``--pd P:D`` the replicas are P prefill-only and D decode-only ones (:mod:`loadtest.sim.pd`).
"""

from __future__ import annotations

import argparse

from loadtest import cli_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=8)
    cli_args.add_profile_arg(p)
    p.add_argument(
        "--policy",
        action="append",
        default=None,
        help="built-in name or router:<policy>; repeat to compare (default: router:kv_cost)",
    )
    p.add_argument(
        "--sessions",
        type=int,
        default=None,
        help="sessions starting over the run (default: 6 per replica per hour)",
    )
    p.add_argument("--hours", type=float, default=1.0, help="simulated duration")
    p.add_argument("--seed", type=int, default=0)
    cli_args.add_engine_args(p)
    p.add_argument(
        "--engine-hints",
        action="store_true",
        help="router:<policy> sends retention hints (the router's engine_hints)",
    )
    p.add_argument(
        "--priority",
        action="store_true",
        help="engines schedule by request priority (priority_scheduling=1) and router:<policy> "
        "sends its session-level priority (the router's priority: session)",
    )
    cli_args.add_pd_args(
        p,
        "P prefill-only then D decode-only replicas (replaces --replicas); router:<policy> "
        "runs the router's P/D path, round_robin splits every call round robin "
        "(loadtest/sim/pd.py)",
        "router:<policy>",
    )
    cli_args.add_router_profile_arg(p, "router:<policy>")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the summaries")


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from costmodel.profiles import ProfileError, router_profile
    from loadtest.sim.pd import PDSimulator, RoundRobinPD, pd_roles
    from loadtest.sim.router_policy import PDRouterPolicy, RouterPolicy
    from loadtest.sim.simulator import ROUTERS, RouteFn, Simulator, synthetic_agentx

    try:
        roles = pd_roles(args.pd) if args.pd else None
    except ValueError as e:
        print(f"kvroute sim: {e}")
        return 2
    if roles:
        args.replicas = len(roles)
    if args.replicas < 1 or args.hours <= 0:
        print("kvroute sim: --replicas must be >= 1 and --hours > 0")
        return 2
    try:
        prof = cli_args.profile_from_args(args)
        if args.priority:
            prof = prof.replace(priority_scheduling=1)
        plugin = cli_args.plugin_from_args(args)
        # what the router is told: the nominal profile (with the same --set), or a named one
        router_prof = prof if args.router_profile is None else router_profile(args.router_profile)
        if router_prof.block_size != prof.block_size:
            raise ValueError("the router profile's block size differs from the replicas'")
    except (ProfileError, ValueError) as e:
        print(f"kvroute sim: {e}")
        return 2
    dur = 3600.0 * args.hours
    n_sessions = args.sessions or max(1, round(6 * args.replicas * args.hours))
    sessions = synthetic_agentx(n_sessions, dur, seed=args.seed)
    out = {}
    print(f"truth {args.truth} (the engines' timing); router profile {router_prof.name}")
    for policy in args.policy or ["router:kv_cost"]:
        route: RouteFn
        try:
            if roles and policy.startswith("router:"):
                route = PDRouterPolicy(policy.removeprefix("router:"), router_prof, roles,
                                       pd_mode=args.pd_mode, seed=args.seed,
                                       engine_hints=args.engine_hints,
                                       priority=args.priority)  # fmt: skip
            elif roles and policy == "round_robin":
                route = RoundRobinPD(roles)
            elif roles:
                print(f"kvroute sim: --pd runs router:<policy> or round_robin, not {policy!r}")
                return 2
            elif policy.startswith("router:"):
                route = RouterPolicy(policy.removeprefix("router:"), router_prof, seed=args.seed,
                                     engine_hints=args.engine_hints,
                                     priority=args.priority)  # fmt: skip
            elif policy in ROUTERS:
                route = ROUTERS[policy]()
            else:
                print(
                    f"kvroute sim: unknown policy {policy!r}; built-in: {sorted(ROUTERS)}, "
                    "or router:<name>"
                )
                return 2
        except ValueError as e:
            print(f"kvroute sim: {e}")
            return 2
        try:
            sim = (
                PDSimulator(prof, roles, route, plugin=plugin, truth=args.truth)
                if roles
                else Simulator(prof, args.replicas, route, plugin=plugin, truth=args.truth)
            )
        except ValueError as e:  # e.g. retention without a host tier
            print(f"kvroute sim: {e}")
            return 2
        res = sim.run(sessions, until=dur)
        s = res.summary()
        out[policy] = s
        print(
            f"{policy}: {s['requests']} calls in {s['wall_s']:.1f} s wall | TTFT p50 "
            f"{s['ttft_p50_s']:.2f} s p90 {s['ttft_p90_s']:.2f} s p99 {s['ttft_p99_s']:.2f} s"
            f" | P90 TPOT {1e3 * s['tpot_p90_s']:.0f} ms | hit {s['cache_hit_ratio']:.3f} | "
            f"{s['throughput_tok_per_gpu_s']:.0f} tok/GPU-s | preemptions "
            f"{s['preemptions']}",
            flush=True,
        )
        if roles:
            assert isinstance(sim, PDSimulator)
            s["pd"] = {"split": sim.split_calls, "colocated": sim.colocated_calls,
                       "verdicts": dict(getattr(route, "verdicts", {}))}  # fmt: skip
            print(f"  P/D {args.pd}: {sim.split_calls} split, {sim.colocated_calls} colocated; "
                  f"{s['pd']['verdicts'] or 'every call split'}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "profile": prof.name,
                    "truth": args.truth,
                    "router_profile": router_prof.name,
                    "replicas": args.replicas,
                    "pd": args.pd,
                    "pd_mode": args.pd_mode if args.pd else None,
                    "sessions": n_sessions,
                    "hours": args.hours,
                    "seed": args.seed,
                    "results": out,
                },
                indent=1,
                default=str,
            )
        )
    return 0
