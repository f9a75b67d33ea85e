"""``kvroute demo``: the quick start — twins, kvroute in front, a replay of real sessions.

Owns the demo's choices, nothing else: it runs :func:`loadtest.sweep.bench.run_sweep` with
an embedded-default cluster (4 replica twins of an H200 serving a 70B-class fp8 model, sped
up 10×), kvroute's best available policy against round-robin and the real sglang-router
(``make demo`` installs it; vllm-router too when ``make bench-peers`` has), on the bundled
slice of real Claude Code sessions (``loadtest/data/weka-dev-slice.tar.gz``), then prints a
table, the honest ratio against sglang-router and the HTML report's path. Takes 2-3 minutes
on a warm 2-core machine. ``--agent claude|codex|opencode`` first puts that agent CLI (installed
from npm by ``make agents``) in front of the same cluster and kvroute for a short scripted task
and prints, per call, the replica, cached tokens and TTFT (:mod:`loadtest.agents.demo`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

DATA = Path(__file__).parent / "data"
TRACE = DATA / "weka-dev-slice.tar.gz"
# Best first: the KV-aware policies of later issues, then the session-affinity baseline.
PREFERRED_POLICIES = ("kv_cost", "llmd", "session_affinity")
DEMO_PEERS = ("sglang:cache_aware", "vllm-router:cache_aware")


def best_policy() -> str:
    from router.scheduling import registry

    registry.discover()
    names = set(registry._TABLE["policy"])  # read-only look at what is registered
    return next((p for p in PREFERRED_POLICIES if p in names), "session_affinity")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="out/demo", help="results and report folder")
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of replay per target (default: ~120 s shared by the targets, "
        "25-45 s each, so the demo stays under 3 minutes)",
    )
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--speedup", type=float, default=10.0)
    p.add_argument("--no-peers", action="store_true", help="skip installed peer routers")
    p.add_argument(
        "--agent",
        choices=("claude", "codex", "opencode"),
        default=None,
        help="first run this agent CLI (Claude Code, Codex or OpenCode, pinned in "
        "loadtest/agents/versions.txt; `make agents` installs them) through kvroute in front "
        "of the demo's cluster for a short scripted task, printing per call the replica, "
        "cached tokens and TTFT (docs/agents.md)",
    )


def run(args: argparse.Namespace) -> int:
    import time

    from rich.console import Console

    from loadtest.report.tables import print_summary
    from loadtest.sweep.bench import SweepConfig, run_sweep
    from loadtest.sweep.stack import PEERS, peer_python

    console = Console()
    t0 = time.monotonic()
    best = best_policy()
    agent_ok = True
    if args.agent:
        from loadtest.agents.demo import TASK, print_agent_table, run_agent_leg

        console.print(
            f"[bold]kvroute demo --agent {args.agent}[/]: the real CLI, {len(TASK)} turns of one "
            f"session, through kvroute:{best} in front of 4 replica twins (H200, 70B-class "
            f"fp8, speedup {args.speedup:g}×)"
        )
        report, names = run_agent_leg(args.agent, policy=best, speedup=args.speedup,
                                      workdir=Path(args.out) / f"agent-{args.agent}")  # fmt: skip
        print_agent_table(report, args.speedup, names)
        agent_ok = not report.problems(expect_turns=len(TASK), cost_moves=True)
    targets = ["kvroute:round_robin", f"kvroute:{best}"]
    if not args.no_peers:
        targets += [p for p in DEMO_PEERS if peer_python(PEERS[p][0]) is not None]
    duration = args.duration or min(45.0, max(25.0, 120.0 / len(targets)))
    console.print(
        f"[bold]kvroute demo[/]: 4 replica twins (H200, 70B-class fp8, speedup "
        f"{args.speedup:g}×) behind {', '.join(targets)}; replaying {TRACE.name} "
        f"(real Claude Code sessions) for {duration:g} s per target at "
        f"{args.concurrency} concurrent sessions"
    )
    cfg = SweepConfig(
        trace=str(TRACE),
        targets=targets,
        concurrency=[args.concurrency],
        duration_s=duration,
        replicas=4,
        profile="h200-70b-fp8",
        speedup=args.speedup,
        max_calls=12,
        max_gap_s=30.0,
        progress=True,
    )
    res = run_sweep(cfg, args.out, command="kvroute demo")
    rows = {p["target"]: p.get("summary") or {} for p in res["points"]}
    print_summary(rows, title="kvroute demo (modelled time)")
    for p in res["points"]:
        if p.get("error"):
            console.print(f"[red]{p['target']}: {p['error']}[/]")
    rr, kv = rows.get("kvroute:round_robin") or {}, rows.get(f"kvroute:{best}") or {}
    if rr.get("ttft_p50_s") and kv.get("ttft_p50_s"):
        console.print(
            f"kvroute:{best} vs round_robin: TTFT p50 {rr['ttft_p50_s'] / kv['ttft_p50_s']:.1f}× "
            f"lower, cache hits {kv.get('cache_hit_ratio', 0):.0%} vs "
            f"{rr.get('cache_hit_ratio', 0):.0%}, throughput "
            f"{kv['tokens_per_gpu_s'] / max(rr['tokens_per_gpu_s'], 1e-9):.2f}×"
        )
    sg = rows.get("sglang:cache_aware") or {}
    if sg.get("tokens_per_gpu_s") and kv.get("tokens_per_gpu_s"):
        ratio = kv["tokens_per_gpu_s"] / sg["tokens_per_gpu_s"]
        console.print(
            f"kvroute:{best} vs sglang-router cache_aware: {ratio:.2f}× the tokens/GPU-s "
            f"({'ahead' if ratio >= 1.0 else 'behind'}), TTFT p90 "
            f"{kv.get('ttft_p90_s', float('nan')):.2f} vs "
            f"{sg.get('ttft_p90_s', float('nan')):.2f} s, cache hits "
            f"{kv.get('cache_hit_ratio', 0):.0%} vs {sg.get('cache_hit_ratio', 0):.0%}"
            " — one short run, one seed: a demo, not a benchmark"
        )
    console.print(f"report: {Path(res['report']).resolve()}  ({time.monotonic() - t0:.0f} s)")
    return 0 if agent_ok and all(p.get("summary") for p in res["points"][:2]) else 1
