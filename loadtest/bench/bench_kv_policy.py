"""kv_cost against the faithful ports of the peers in the trace simulator: the yardstick.

Per workload and routing policy, closed-loop replays at several concurrency levels in the
trace simulator (:func:`loadtest.sim.trace.simulate_trace`: the twin's engine model, no HTTP),
each point over ``SEEDS`` seeds (a seed shuffles which sessions the lanes take and staggers
the lanes' first starts over ``STAGGER_S``), the first ``WARMUP_S`` of every run excluded.

What the router sees is what an agent sends (:mod:`loadtest.sim.router_policy`): the agents'
fixed ``max_tokens`` cap, never the recorded output length, and no last-call flag.

Per point: min / median / max over seeds of tokens per GPU-second, P90 interactivity
(1000 / P90 TPOT ms), TTFT p90, session completion p50 / p90 and the token hit ratio; one
unlimited-cache hit bound per workload (the trace's first play, every policy the same).
Per policy, the line figure by the one rule (:mod:`loadtest.line`): the best *measured*
median point with P90 interactivity ≥ ``LINE`` and beside it the crossing interpolated between
the two lane counts that bracket it, flagged unless they are within 12.5% of each other (a
second measured figure also holds TTFT p90 ≤ ``TTFT_SLO_S``). Each workload's lane levels are
a coarse start: after them every policy's bracket is bisected (and the grid extended where a
policy never crosses the line) until every policy is fine at the line or ``REFINE_ROUNDS``
rounds have run — for all policies alike (``KVROUTE_BENCH_REFINE=0``: the levels only).

The simulated router reads the engines' load through a ``/metrics`` scrape every
``SCRAPE_S`` (50 ms: upstream llm-d's refresh, for every policy alike;
``KVROUTE_BENCH_SCRAPE_S`` overrides it, 0 = exact load at every decision).

Policies (the router's own pipelines through :class:`loadtest.sim.router_policy.RouterPolicy`,
block index fed by the engines' KV events): ``kv_cost`` (the default), ``llmd`` (the port of
llm-d's precise prefix + queue + KV-utilisation scorers), ``sglang_tree`` (the port of
sglang-router's cache_aware) and ``session_affinity`` (bounded-load consistent hashing).

Workloads (profile ``h200-70b-fp8-tp4``: a 70B fp8 model on 4 H200s per replica; one H200
cannot decode a 70B at 50 tok/s/user, see docs/twin.md):

- ``weka-dev``: the real Claude Code sessions, gaps capped at 60 s, 8 replicas (32 GPUs, KV
  for 22M tokens: abundant);
- ``weka-dev-scarce``: the same sessions with tool pauses up to 180 s on 2 replicas with a
  host tier (``h200-70b-fp8-tp4-offload``, 8 GPUs, 5.6M tokens of HBM KV): the lanes' working
  set exceeds the pooled HBM at the higher concurrencies;
- ``mooncake``: the Mooncake conversation trace, 8 replicas;
- ``agentx-long``: long-context agent sessions (``AGENTX_LONG``: AgentX's input, output and gap
  distributions, contexts up to 1M tokens) on 4 replicas of ``h200-70b-fp8-tp4-1m-offload``
  (16 GPUs, 11M tokens of HBM KV, a host tier): a few 700k-token sessions fill a replica.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

from costmodel.profiles import load_profile, with_overrides
from engine_patches.cadence import CadenceConfig
from engine_patches.retention_rule import RetentionConfig
from loadtest.line import LINE_TOK_S, LinePoint, compare_at_line, line_figure, refine_lanes
from loadtest.metrics import UnlimitedCache
from loadtest.sim.router_policy import RouterPolicy
from loadtest.sim.trace import simulate_trace, trace_workload
from loadtest.traces import load_trace
from loadtest.twin.engine import EnginePlugin

# the traces folder: $KVROUTE_TRACES, else ../shared/data/traces beside the checkout (a git
# worktree one level deeper sets the variable)
TRACES = Path(
    os.environ.get("KVROUTE_TRACES")
    or Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"
)
POLICIES = ("kv_cost", "llmd", "sglang_tree", "session_affinity")
SEEDS = (0, 1, 2)
LINE = LINE_TOK_S  # P90 interactivity, tok/s/user
SCRAPE_S = 0.05  # the simulated router's load scrape: upstream llm-d's 50 ms refresh
REFINE_ROUNDS = 4  # lane levels added per policy at most, to resolve the line
TTFT_SLO_S = 10.0  # the second line: TTFT p90 at or under this
WARMUP_S = 120.0
STAGGER_S = 60.0

# Long-context agent sessions (issue 11): synthetic AgentX-shaped chains tuned to AgentX v1.0's
# published distributions — input p50 142k / p95 683k tokens (here 134k–142k / ~740k over
# seeds 0–1, contexts up to 1M), output p50 444 (446), inter-call gap p50 3.84 s / p95 3.08 min
# (3.3 s / ~165 s: log-normal, sigma = ln(185 / 3.84) / 1.645) — with the generator's subagents.
AGENTX_LONG = (
    "synthetic:sessions=64,first_user_tokens=40000,growth_median=5200,"
    "max_context_tokens=1000000,gap_median_s=3.84,gap_sigma=2.36,output_median=444"
)
# name -> (trace file or synthetic spec, profile, replicas, gap cap (s), concurrency (full),
# (quick))
_W = tuple[str, str, int, float | None, tuple[int, ...], tuple[int, ...]]
WORKLOADS: dict[str, _W] = {
    "weka-dev": ("weka-dev.tar.gz", "h200-70b-fp8-tp4", 8, 60.0, (32, 64, 96), (32,)),
    "weka-dev-scarce": ("weka-dev.tar.gz", "h200-70b-fp8-tp4-offload", 2, 180.0, (16, 32, 48),
                        (32,)),
    "mooncake": ("mooncake_synthetic_trace.jsonl.gz", "h200-70b-fp8-tp4", 8, None, (4, 8, 16),
                 (8,)),
    "agentx-long": (AGENTX_LONG, "h200-70b-fp8-tp4-1m-offload", 4, None, (8, 12, 16), (12,)),
}  # fmt: skip
FIELDS = (
    ("tok_per_gpu_s", "throughput_tok_per_gpu_s"),
    ("p90_interactivity", "p90_interactivity_tok_s"),
    ("ttft_p90_s", "ttft_p90_s"),
    ("session_p50_s", "session_p50_s"),
    ("session_p90_s", "session_p90_s"),
    ("hit_ratio", "cache_hit_ratio"),
    ("host_hit_share", "host_hit_share"),  # prompt blocks hit in the host tier / all hit
    ("storage_hit_share", "storage_hit_share"),
)


def with_tier_shares(summary: dict[str, Any]) -> dict[str, Any]:
    """``summary`` plus the shares of hit blocks served by the host tier and by storage."""
    hits = summary.get("tier_hit_blocks") or {}
    total = sum(hits.values())
    out = dict(summary)
    out["host_hit_share"] = hits.get("cpu", 0) / total if total else float("nan")
    out["storage_hit_share"] = hits.get("storage", 0) / total if total else float("nan")
    return out


def trace_bound(trace: Any, block_size: int) -> float:
    """The unlimited-cache token hit ratio of one play of every session (lanes' order does not
    matter for it: sessions share only their own history and the tools+system prefix)."""
    feed = trace_workload(trace, block_size, concurrency=1, duration_s=None)
    cache = UnlimitedCache(block_size)
    hit = total = 0
    for i in range(len(feed.sessions)):
        for c in feed.instance(i).calls:
            keys = c.block_keys
            hit += cache.observe_keys(keys, c.prompt_tokens)
            total += c.prompt_tokens
    return hit / total if total else 0.0


def spread(values: list[float]) -> dict[str, float]:
    vs = [v for v in values if v == v]  # NaN: nothing measured in that run
    if not vs:
        return {"min": float("nan"), "median": float("nan"), "max": float("nan")}
    return {"min": min(vs), "median": statistics.median(vs), "max": max(vs)}


# Engine-plugin variants (issue 12, loadtest/bench/bench_kv_pressure.py): name -> (router
# policy, the router's engine_hints, what of the plugin the simulated engines run).
VARIANTS: dict[str, tuple[str, bool, EnginePlugin]] = {
    "kv_cost+hints": ("kv_cost", True, EnginePlugin(retention=RetentionConfig())),
    "kv_cost+hints+cadence": ("kv_cost", True,
                              EnginePlugin(retention=RetentionConfig(), cadence=CadenceConfig())),
    "kv_cost+hints+cadence+gauge": ("kv_cost", True,
                                    EnginePlugin(retention=RetentionConfig(),
                                                 cadence=CadenceConfig())),
}  # fmt: skip
# the router's KV settings a variant changes (KVConfig fields)
KV_SETTINGS: dict[str, dict[str, Any]] = {
    "kv_cost+hints+cadence+gauge": {"pending_prefill_gauge": True},
}


def policy_spec(name: str) -> tuple[str, bool, EnginePlugin]:
    """A bench policy name -> (router policy, engine hints, engine plugin); plain names are the
    router's policies on plain engines."""
    return VARIANTS.get(name, (name, False, EnginePlugin()))


def run(quick: bool = False) -> list[dict]:
    """The rows; ``KVROUTE_BENCH_POLICIES=a,b`` runs only those policies (to re-run one after
    a change: the simulator is deterministic per seed, so the other rows stand)."""
    return run_workloads(WORKLOADS, POLICIES, quick)


def run_workloads(
    workloads: dict[str, _W], default_policies: tuple[str, ...], quick: bool,
    ours: tuple[str, ...] = ("kv_cost",), overrides: dict[str, dict[str, Any]] | None = None,
) -> list[dict]:  # fmt: skip
    """Every workload x policy x concurrency point over the seeds, the lanes added to
    resolve the line (:func:`loadtest.line.refine_lanes`, every policy alike; off with
    ``KVROUTE_BENCH_REFINE=0``), then the line row per workload; ``KVROUTE_BENCH_POLICIES`` /
    ``KVROUTE_BENCH_WORKLOADS`` (comma lists) narrow the run; ``KVROUTE_BENCH_SCRAPE_S``
    (seconds, default ``SCRAPE_S``; 0: exact) is how often the simulated router reads engine
    load. ``overrides``: engine settings per workload over its profile (``with_overrides``)."""
    duration = 480.0 if quick else 900.0
    seeds = SEEDS[:1] if quick else SEEDS
    only = os.environ.get("KVROUTE_BENCH_POLICIES")
    policies = tuple(p for p in only.split(",") if p) if only else default_policies
    # the simulated router's engine-load view: as of a /metrics scrape every S seconds, as a
    # live router sees it (upstream llm-d's 50 ms by default), or exact at each decision (0)
    scrape = float(os.environ.get("KVROUTE_BENCH_SCRAPE_S", repr(SCRAPE_S)) or 0)
    refine = not quick and os.environ.get("KVROUTE_BENCH_REFINE", "1") != "0"
    only_w = os.environ.get("KVROUTE_BENCH_WORKLOADS")
    if only_w:
        workloads = {k: v for k, v in workloads.items() if k in only_w.split(",")}
    rows: list[dict] = []
    for wname, (fname, pname, n_rep, gap, levels, quick_levels) in workloads.items():
        path: Path | str = fname if fname.startswith("synthetic:") else TRACES / fname
        if isinstance(path, Path) and not path.is_file():
            rows.append({"name": f"{wname}: skipped", "reason": f"no trace at {path}"})
            continue
        prof = with_overrides(load_profile(pname), (overrides or {}).get(wname, {}))
        trace = load_trace(path, max_gap_s=gap)
        bound = round(trace_bound(trace, prof.block_size), 3)
        medians: dict[str, list[dict[str, float]]] = {}
        lanes_by_pol: dict[str, list[int]] = {}
        for pol in policies:
            medians[pol] = []
            lanes_by_pol[pol] = list(quick_levels if quick else levels)
            router_pol, hints, plugin = policy_spec(pol)
            pending = list(lanes_by_pol[pol])
            rounds = 0
            while pending:
                n = pending.pop(0)
                t0 = time.perf_counter()
                runs = [
                    simulate_trace(prof, n_rep, trace,
                                   RouterPolicy(router_pol, prof, seed=s, engine_hints=hints,
                                                scrape_interval_s=scrape,
                                                kv_settings=KV_SETTINGS.get(pol)),
                                   concurrency=n, duration_s=duration, seed=s,
                                   stagger_s=STAGGER_S, plugin=plugin).summary(warmup_s=WARMUP_S)
                    for s in seeds
                ]  # fmt: skip
                runs = [with_tier_shares(r) for r in runs]
                stats = {k: spread([float(r.get(src, float("nan"))) for r in runs])
                         for k, src in FIELDS}  # fmt: skip
                medians[pol].append({"lanes": n, **{k: v["median"] for k, v in stats.items()}})
                row: dict[str, Any] = {
                    "name": f"{wname}_c{n}_{pol}", "workload": wname, "concurrency": n,
                    "policy": pol, "gpus": n_rep * prof.gpus, "seeds": len(seeds),
                    "calls": [r.get("requests", 0) for r in runs], "hit_bound": bound,
                    "scrape_s": scrape, "added_for_line": n not in (quick_levels if quick
                                                                    else levels),
                }  # fmt: skip
                for k, v in stats.items():
                    nd = 3 if k.startswith(("hit", "host", "storage")) else 1
                    row[k] = {m: round(x, nd) for m, x in v.items()}
                row["wall_s"] = round(time.perf_counter() - t0, 1)
                rows.append(row)
                if not pending and refine and rounds < REFINE_ROUNDS:
                    rounds += 1
                    pending = refine_lanes(figure_of(medians[pol]), lanes_by_pol[pol])
                    lanes_by_pol[pol] += pending
        rows.append(line_row(wname, medians, bound, ours))
    return rows


def figure_of(points: list[dict[str, float]]) -> Any:
    """A policy's :class:`loadtest.line.LineFigure` from its median points."""
    return line_figure(
        LinePoint(int(p["lanes"]), p["p90_interactivity"], p["tok_per_gpu_s"]) for p in points
    )


def line_row(
    wname: str, medians: dict[str, list[dict[str, float]]], bound: float,
    ours: tuple[str, ...] = ("kv_cost",),
) -> dict:  # fmt: skip
    """Each policy at the line by the one rule (:func:`loadtest.line.line_figure`): the best
    measured median point and the interpolated crossing side by side, with the lanes of
    each, whether the grid is fine there and, if not, why; a second measured figure that also
    holds the TTFT SLO; ratios of each of ``ours`` to the best of the others (the peers: every
    policy not in ``ours``) by :func:`loadtest.line.compare_at_line` — flagged for all when
    any policy's grid is too coarse at the line."""

    def with_slo(points: list[dict[str, float]]) -> float | None:
        ok = [p["tok_per_gpu_s"] for p in points
              if p["p90_interactivity"] >= LINE and p["ttft_p90_s"] <= TTFT_SLO_S]  # fmt: skip
        return max(ok) if ok else None

    out: dict[str, Any] = {"name": f"{wname}_at_p90_{LINE:g}tok_s", "hit_bound": bound}
    figs = {pol: figure_of(pts) for pol, pts in medians.items()}
    slo: dict[str, float | None] = {}
    for pol, pts in medians.items():
        held = slo[pol] = with_slo(pts)
        out[pol] = {
            **figs[pol].as_dict(),
            f"measured_ttft_p90_le_{TTFT_SLO_S:g}s": None if held is None else round(held),
        }
    out.update(compare_at_line(figs, [p for p in ours if p in figs]))
    peers = {p: v for p, v in slo.items() if p not in ours and v is not None}
    for mine in ours:
        if mine not in slo:
            continue
        kv = slo[mine]
        if kv is not None and peers:
            top = max(peers, key=lambda p: peers[p])
            out[f"{mine}_vs_best_with_slo"] = f"{kv / peers[top]:.2f}x vs {top}"
        else:
            out[f"{mine}_vs_best_with_slo"] = "not comparable (a policy never reached the line)"
    return out
