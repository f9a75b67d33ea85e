"""``kvroute bench TRACE --out DIR``: concurrency sweeps of routers on one twin cluster.

Each target — ``kvroute:<policy>`` for any registered policy, or a peer router
(``sglang:cache_aware``, ``sglang:consistent_hashing``, ``vllm-router:cache_aware``,
``vllm-router:consistent_hash``, ``vllm-router:kv_aware``; install with ``make bench-peers``)
— runs at each concurrency on a freshly restarted twin cluster. Writes ``DIR/results.json``,
PNG plots (Pareto of tokens/GPU-s vs P90 interactivity with the 50 tok/s line, cache-hit bars,
TTFT CDF) and a self-contained ``DIR/report.html``. See docs/replay.md.
"""

from __future__ import annotations

import argparse

from loadtest import cli_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli_args.add_trace_args(p, max_gap=30.0)
    p.add_argument("--out", required=True)
    p.add_argument(
        "--targets",
        default="kvroute:round_robin,kvroute:session_affinity",
        help="comma-separated routers",
    )
    p.add_argument(
        "--concurrency", "--lanes", dest="concurrency", default="4,8",
        help="comma-separated lane counts; LO:HI is a grid fine enough for a line figure "
        "(neighbours within 12.5%%: 16:48 = 16,18,20,22,25,28,32,36,41,46,48)",
    )  # fmt: skip
    p.add_argument("--duration", type=float, default=30.0, help="seconds of replay per point")
    p.add_argument("--replicas", type=int, default=4)
    cli_args.add_profile_arg(p)
    cli_args.add_speedup_arg(p, default=10.0)
    p.add_argument(
        "--seeds",
        default=None,
        help="comma-separated replay seeds: each point runs once per seed (lane order "
        "shuffled, first starts staggered); default: trace order, one run",
    )
    p.add_argument(
        "--stagger", type=float, default=None,
        help="modelled seconds over which lanes' first sessions start (default 60 with --seeds)",
    )  # fmt: skip
    p.add_argument("--warmup", type=float, default=0.0, help="modelled seconds left out")
    cli_args.add_truth_arg(p, many=True)
    cli_args.add_router_profile_arg(p, "kvroute's KV layer")
    p.add_argument(
        "--disrupt",
        default=None,
        choices=["rolling-restart", "scale-out", "replica-loss"],
        help="disrupt every point: restart each replica in turn with an empty cache, add "
        "replicas mid-run, or lose one (docs/replay.md#disruptions)",
    )
    p.add_argument(
        "--disrupt-at", type=float, default=None,
        help="modelled seconds into the run (default: a quarter of --duration x --speedup)",
    )  # fmt: skip
    p.add_argument(
        "--restart-downtime", type=float, default=30.0,
        help="rolling-restart: modelled seconds each replica is down (default 30)",
    )  # fmt: skip
    p.add_argument(
        "--scale-out", type=int, default=0,
        help="scale-out: replicas added (default: half of --replicas, at least 1)",
    )  # fmt: skip
    p.add_argument(
        "--pool-blocks", type=int, default=0,
        help="a cluster KV pool every twin shares, in blocks (needs a profile with a host "
        "tier; 0: none)",
    )  # fmt: skip
    p.add_argument(
        "--priority",
        action="store_true",
        help="twins schedule by request priority (vLLM --scheduling-policy priority) and "
        "kvroute targets send their session-level priority (router priority: session)",
    )
    cli_args.add_pd_args(
        p,
        "P prefill twins and D decode twins (replicas = P + D); kvroute targets "
        "(docs/router.md, Disaggregation) and vllm-router's P/D mode (vllm-router:<policy> "
        "but kv_aware; docs/peers.md)",
        "kvroute",
    )
    p.add_argument(
        "--scrape", type=float, default=0.05,
        help="modelled seconds between kvroute's /metrics scrapes of the twins' load, for "
        "every kvroute policy (default 0.05: upstream llm-d's refresh; 1 was the router's "
        "default before); the wall interval is this / speedup, at least 10 ms",
    )  # fmt: skip
    p.add_argument(
        "--peer-health-s",
        type=int,
        default=None,
        metavar="S",
        help="peer routers (sglang-router, vllm-router) check each replica's /health every S "
        "wall seconds and take it out at the first failure, as kvroute does (every 2 s); "
        "default: the peers' own (every 60 s, 3 failures: a replica drained for "
        "--disrupt rolling-restart is never taken out)",
    )
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from loadtest.twin.truth import TRUTH_NAMES, check

    truths = [t for t in args.truth.split(",") if t]
    if not truths:
        print(f"kvroute bench: no truth; known: {', '.join(TRUTH_NAMES)}", file=sys.stderr)
        return 2
    for t in truths:  # unknown, or measured but not yet (docs/gpu-check.md)
        try:
            check(t)
        except ValueError as exc:
            print(f"kvroute bench: {exc}", file=sys.stderr)
            return 2

    seeds: list[int | None] = [int(x) for x in args.seeds.split(",") if x] if args.seeds else [None]
    stagger = args.stagger if args.stagger is not None else (60.0 if args.seeds else 0.0)
    code = 1  # 0 when any sweep measured something
    for truth in truths:
        out = args.out if len(truths) == 1 else str(Path(args.out) / truth)
        code = min(code, _run_one(args, truth, out, seeds, stagger))
        if code == 2:
            return 2
    return code


def _run_one(args: argparse.Namespace, truth: str, out: str, seeds: list, stagger: float) -> int:
    import sys

    from loadtest.line import parse_lanes
    from loadtest.prompts import PromptError
    from loadtest.report.tables import print_aggregate, print_line, print_summary
    from loadtest.sweep.bench import SweepConfig, run_sweep
    from loadtest.traces import TraceError

    try:
        lanes = parse_lanes(args.concurrency)
    except ValueError as e:
        print(f"kvroute bench: {e}", file=sys.stderr)
        return 2
    if not args.scrape > 0:
        print("kvroute bench: --scrape must be > 0 seconds", file=sys.stderr)
        return 2
    if args.peer_health_s is not None and args.peer_health_s < 1:
        print("kvroute bench: --peer-health-s must be at least 1 (whole seconds)", file=sys.stderr)
        return 2
    cfg = SweepConfig(
        trace=args.trace,
        targets=[t for t in args.targets.split(",") if t],
        concurrency=lanes,
        duration_s=args.duration,
        replicas=args.replicas,
        profile=args.profile,
        speedup=args.speedup,
        **cli_args.trace_kwargs(args),
        **cli_args.prompt_kwargs(args),
        **cli_args.play_kwargs(args),
        progress=not args.no_progress,
        seeds=seeds,
        stagger_s=stagger,
        warmup_s=args.warmup,
        truth=truth,
        router_profile=args.router_profile,
        disrupt=args.disrupt,
        disrupt_at_s=args.disrupt_at,
        restart_downtime_s=args.restart_downtime,
        scale_out=args.scale_out,
        pool_blocks=args.pool_blocks,
        priority=args.priority,
        pd=args.pd,
        pd_mode=args.pd_mode,
        scrape_s=args.scrape,
        peer_health_s=args.peer_health_s,
    )
    try:
        res = run_sweep(cfg, out, command="kvroute bench " + " ".join(sys.argv[2:]))
    except (TraceError, PromptError, ValueError) as e:
        print(f"kvroute bench: {e}", file=sys.stderr)
        return 2
    rows = {_label(p): p.get("summary") or {"error": p.get("error")} for p in res["points"]}
    print_summary(
        rows,
        title=f"kvroute bench: {res['config']['trace']} | truth {truth} | router profile "
        f"{res['config']['router_profile']}",
    )
    for p in res["points"]:
        if p.get("error"):
            print(f"  {_label(p)}: {p['error']}")
        line = _disruption_line(p.get("summary") or {})
        if line:
            print(f"  {_label(p)}: {line}")
        cpu = p.get("cpu") or {}
        if cpu.get("saturated"):
            print(f"  {_label(p)}: CPU-saturated, not used: {'; '.join(cpu['why'])}")
    if any(p.get("seed") is not None for p in res["points"]):
        print_aggregate(res["aggregate"], title=f"over seeds, truth {truth}")
    if len(cfg.concurrency) > 1 and res.get("line"):
        print_line(res["line"], title=f"truth {truth}")
    print(f"report: {res['report']}")
    return 0 if any(p.get("summary") for p in res["points"]) else 1


def _disruption_line(s: dict) -> str:
    """The disruption's figures and the hit ratio by source, for the console."""
    parts = []
    d = s.get("disruption")
    if d:
        p50, p99 = d.get("ttft_after_p50_s"), d.get("ttft_after_p99_s")
        fmt = lambda x: "-" if x is None else f"{x:.2f}s"  # noqa: E731
        parts.append(f"{d['kind']}: {len(d['events'])} events, first call after: "
                     f"n={d['first_calls_after']} p50 {fmt(p50)} p99 {fmt(p99)}")  # fmt: skip
        if d.get("error"):
            parts.append(f"error {d['error']}")
    h = s.get("hit_by_source")
    if h:
        parts.append("hits " + " ".join(f"{k} {v:.1%}" for k, v in h.items()))
    return "; ".join(parts)


def _label(p: dict) -> str:
    seed = f" s{p['seed']}" if p.get("seed") is not None else ""
    return f"{p['target']} c={p['concurrency']}{seed}"
