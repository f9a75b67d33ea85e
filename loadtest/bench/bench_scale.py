"""The router at agent scale (issue 45's targets): agent calls per second one router process
sustains with the KV layer on, ``--workers 2``'s scaling, and 2,000 concurrent streams at the
router's defaults.

Two parts, each against twins (``kvroute cluster``, :class:`loadtest.sweep.stack.TwinCluster`)
and ``kvroute serve`` (:class:`loadtest.sweep.stack.Router`) in their own processes, the load
generator in this one; the CPU each used comes from ``/proc`` (:mod:`loadtest.sweep.cpuwatch`).

**agents** (targets: ≥ 200 calls/s from one router process, added TTFT p99 ≤ 10 ms against
direct-to-replica; ``--workers 2`` ≥ 1.8×). Agent sessions of real shape: an agent type's
shared system prompt (~8k tokens), the session's own context (the rest of ``prompt_tokens``,
100k by default), then one exchange per call (an assistant reply and a user/tool turn,
``turn_tokens``), streamed, ``max_tokens`` 16 — text from the tiny model's vocabulary, ~1 token
a word. Twins in simulated time at a high ``--speedup`` (1000: a 1k-token prefill on the
H200 profile is well under a millisecond of wall time) and a GPU pool that holds every session,
so the engine is not what is measured. The router runs ``kv_cost`` with the KV layer on:
the twins' tokenizer, their KV events (each twin binds its own endpoint), the profile; its
health-check timeout is raised to ``TWIN_HEALTH_TIMEOUT_S`` (the twins' loop, not the router,
stalls on a cold 100k-token prompt), every other setting is its default.

Three paths, each with its own sessions (warmed with ``warm_calls`` unmeasured calls per
router worker and 4 more a worker past the first, each on a new connection, so the router's
workers and the twins hold every session's tokens and blocks: a session's first call on a
worker is a cold analysis): ``direct`` (session ``s`` always to twin ``s % replicas``),
``router:w1`` and ``router:w2`` (``--workers`` 1 and 2).

* ``open`` rows: open-loop arrivals at each rate of ``rates`` for ``trial_s`` seconds (longer
  at low rates: ``min_calls`` a path, for a p99), round-robin over the path's sessions (a
  session's calls never overlap: a call waits for its session's previous one). A router's
  path and direct run together, their calls interleaved one by one at the rate each, so
  both see the same machine. Per path: achieved calls/s, TTFT p50/p99 (request sent → first
  token's chunk), errors, how late calls left (a path that cannot keep up falls behind), the
  cores each process group used and the router's CPU per call by process.
  ``added_ttft_p99_ms``: the router's TTFT p99 minus direct's in the same trial. The ramp
  stops once direct itself cannot keep up (the box's limit, not the router's).
* ``capacity`` rows: closed loop, every session of the path calling back to back for
  ``trial_s``: the calls/s the path gives on this box and the router's CPU per call.
  ``scaling_w2_vs_w1`` is router:w2's capacity over router:w1's.
* ``summary``: the highest rate whose router TTFT p99 stayed within ``added_ttft_budget_ms``
  of direct with the router keeping up (achieved ≥ 95 % of offered), per worker count; the
  router process's CPU per call and the calls/s one core would give at that cost.

**streams** (target: 2,000 concurrent streams at the defaults with 0 errors): ``streams``
streamed chat calls opened at once through a router with every default (its default policy,
connection limits and timeouts), twins in slowed time (``stream_speedup`` < 1) so each reply
of ``stream_tokens`` tokens takes many seconds. Reported: calls answered in full (``[DONE]``
seen), errors by kind, peak calls in flight and peak answered streams open (head received),
the time to the response head (``head_*``: calls past the router's default upstream limit,
``max_connections`` 1,024, wait in its pool, up to ``pool_timeout_s`` 60 s, so streams past
1,024 must end within it) and to the first token, the router's peak RSS and CPU, where it
placed the calls and its peak calls in flight per replica (a call waits for its replica's
pool, ``max_connections_per_replica`` 256, and is not moved: an uneven placement makes the
waits of the calls past 256 on one replica longer), the distinct error bodies and the router
log's warnings.

Every row carries the machine's load (``/proc/loadavg`` before and after, and the other
processes running at real-time priority: other benchmarks). On a box with fewer cores than
router workers + load generator + twins, read the CPU columns, not the rates: a rate is what
the box gave, the router's CPU per call is what it costs.

    python -m loadtest.bench.bench_scale [--part agents|streams|all] [--quick] [--out FILE]
    python -m loadtest.benchmarks --only scale [--quick]   # both parts, small sizes with --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest.bench.scale_agents import AgentConfig, run_agents
from loadtest.bench.scale_common import machine_load
from loadtest.bench.scale_streams import StreamConfig, run_streams

# ``make bench`` lists it; ``--only scale`` runs it (``--quick``: seconds)
SLOW = "twins, 3 routers and 2,000 streams: ~5 min; --only scale [--quick]"

QUICK_AGENTS = AgentConfig(
    replicas=2, sessions=4, prompt_tokens=4_000, turn_tokens=50, rates=[5], trial_s=2.0,
    warm_calls=1, min_calls=5, workers=[1, 2], capacity=True,
)  # fmt: skip
# streams of a few seconds: the router's in-flight calls are scraped every 2 s
QUICK_STREAMS = StreamConfig(streams=20, replicas=2, max_num_seqs=64, stream_tokens=16,
                             stream_speedup=0.1, timeout_s=60.0)  # fmt: skip


def run(quick: bool = False) -> list[dict[str, Any]]:
    """``make bench``: both parts (``quick``: a few sessions of 4k tokens, 20 streams)."""
    if quick:
        return run_agents(QUICK_AGENTS, log=lambda r: None) + run_streams(
            QUICK_STREAMS, log=lambda r: None
        )
    return run_agents(AgentConfig(), log=lambda r: None) + run_streams(
        StreamConfig(), log=lambda r: None
    )


# (row name, field, what it is) for :func:`summarize`: the figures the targets are judged on
SUMMARY_FIELDS = [
    ("agents_summary", "w1_capacity_calls_s", "router --workers 1: calls/s (closed loop)"),
    ("agents_summary", "w2_capacity_calls_s", "router --workers 2: calls/s (closed loop)"),
    ("agents_summary", "direct_capacity_calls_s", "direct to twins: calls/s (closed loop)"),
    ("agents_summary", "scaling_w2_vs_w1", "--workers 2 / --workers 1 (closed loop)"),
    ("agents_summary", "w1_router_cpu_ms_per_call", "router CPU ms a call, --workers 1"),
    ("agents_summary", "w1_calls_s_per_router_core", "calls/s one router core gives"),
    ("agents_summary", "w2_router_cpu_ms_per_call", "router CPU ms a call, --workers 2"),
    ("agents_summary", "w1_max_rate_within_budget", "highest rate, added TTFT p99 <= 10 ms, w1"),
    ("agents_summary", "w2_max_rate_within_budget", "highest rate, added TTFT p99 <= 10 ms, w2"),
]


def summarize(paths: list[str]) -> str:
    """A markdown table of the headline figures over repeated runs' JSON: min / median / max,
    then each open-loop rate's added TTFT p99 and the streams' errors and RSS."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    rows_by = [{r["name"]: r for r in d["rows"]} for d in docs]

    def mmm(xs: list[Any]) -> str:
        xs = [x for x in xs if isinstance(x, (int, float))]
        if not xs:
            return "–"
        return f"{min(xs):g} / {statistics.median(xs):g} / {max(xs):g}"

    out = [f"| figure ({len(docs)} files: min / median / max) | value |", "|---|---|"]
    for row, fld, what in SUMMARY_FIELDS:
        vals = [rb.get(row, {}).get(fld) for rb in rows_by]
        if any(v is not None for v in vals):
            out.append(f"| {what} | {mmm(vals)} |")
    names = {n for rb in rows_by for n in rb if n.startswith("open_router:")}
    for n in sorted(names, key=lambda n: (n.rsplit("_", 1)[0], float(n.rsplit("_", 1)[1]))):
        got = [rb[n] for rb in rows_by if n in rb]
        ach = mmm([g.get("achieved_calls_s") for g in got])
        p50 = mmm([g.get("added_ttft_p50_ms") for g in got])
        p99 = mmm([g.get("added_ttft_p99_ms") for g in got])
        out.append(f"| {n}: added TTFT ms (achieved calls/s {ach}) | p50 {p50}; p99 {p99} |")
    for n in sorted({n for rb in rows_by for n in rb if n.startswith("streams_")}):
        got = [rb[n] for rb in rows_by if n in rb]
        out.append(f"| {n}: errors | {mmm([g.get('errors') for g in got])} |")
        rss = [g.get("router_rss_peak_mb") for g in got]
        out.append(f"| {n}: router RSS peak MB | {mmm(rss)} |")
        out.append(f"| {n}: longest pool wait s | {mmm([g.get('head_max_s') for g in got])} |")
    loads = [d.get("started", {}).get("loadavg") for d in docs]
    out.append(f"| loadavg at start | {'; '.join(' '.join(x) for x in loads if x)} |")
    return "\n".join(out)


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.bench_scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--part", choices=("agents", "streams", "all"), default="all")
    ap.add_argument(
        "--summarize", nargs="+", metavar="JSON", help="print a table over runs' --out files"
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the test's)")
    ap.add_argument(
        "--out", default=None, help="write {config, rows} as JSON here (and as rows land)"
    )
    a = AgentConfig()
    ap.add_argument("--replicas", type=int, default=a.replicas)
    ap.add_argument("--sessions", type=int, default=a.sessions)
    ap.add_argument("--prompt-tokens", type=int, default=a.prompt_tokens)
    ap.add_argument("--turn-tokens", type=int, default=a.turn_tokens)
    ap.add_argument("--speedup", type=float, default=a.speedup)
    ap.add_argument("--rates", type=_floats, default=a.rates)
    ap.add_argument("--trial-s", type=float, default=a.trial_s)
    ap.add_argument("--warm-calls", type=int, default=a.warm_calls)
    ap.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=a.workers)
    ap.add_argument("--no-capacity", action="store_true")
    s = StreamConfig()
    ap.add_argument("--streams", type=int, default=s.streams)
    ap.add_argument("--stream-replicas", type=int, default=s.replicas)
    ap.add_argument("--stream-tokens", type=int, default=s.stream_tokens)
    ap.add_argument("--stream-speedup", type=float, default=s.stream_speedup)
    ap.add_argument("--max-num-seqs", type=int, default=s.max_num_seqs)
    ap.add_argument("--stream-timeout-s", type=float, default=s.timeout_s)
    args = ap.parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    if args.quick:
        acfg, scfg = QUICK_AGENTS, QUICK_STREAMS
    else:
        acfg = AgentConfig(replicas=args.replicas, sessions=args.sessions,
                           prompt_tokens=args.prompt_tokens, turn_tokens=args.turn_tokens,
                           speedup=args.speedup, rates=args.rates, trial_s=args.trial_s,
                           warm_calls=args.warm_calls, workers=args.workers,
                           capacity=not args.no_capacity)  # fmt: skip
        scfg = StreamConfig(streams=args.streams, replicas=args.stream_replicas,
                            max_num_seqs=args.max_num_seqs, stream_tokens=args.stream_tokens,
                            stream_speedup=args.stream_speedup,
                            timeout_s=args.stream_timeout_s)  # fmt: skip
    doc: dict[str, Any] = {"argv": sys.argv, "agents": asdict(acfg), "streams": asdict(scfg),
                           "started": machine_load(), "rows": []}  # fmt: skip
    out = Path(args.out) if args.out else None

    def log(row: dict[str, Any]) -> None:
        print(json.dumps(row), flush=True)
        doc["rows"].append(row)
        if out is not None:  # partial results as they land
            out.write_text(json.dumps(doc, indent=1))

    if args.part in ("agents", "all"):
        run_agents(acfg, log=log)
    if args.part in ("streams", "all"):
        run_streams(scfg, log=log)
    doc["finished"] = machine_load()
    if out is not None:
        out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
