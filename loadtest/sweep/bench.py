"""Concurrency sweeps of several routers over one trace, each point on a fresh twin cluster.

Owns: :class:`SweepConfig` and :func:`run_sweep`. For every target (``kvroute:<policy>`` or a
peer from :data:`loadtest.sweep.stack.PEERS`) and every concurrency, it restarts the twin
cluster (cold caches, same profile and speedup), starts the router in front, replays the
trace for ``duration_s`` on closed-loop lanes, stops both and keeps the point's records under
``OUT/points/<target>/c<N>/``. A target that cannot start (a peer not installed) or a point
that fails is recorded with its error; the sweep goes on. Writes ``OUT/results.json`` and the
HTML report (:func:`loadtest.report.html.build_report`). Must not import the router.
"""

from __future__ import annotations

import asyncio
import json
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadtest.prompts import PromptBuilder
from loadtest.replay.runner import ReplayConfig, replay
from loadtest.sweep.cpuwatch import CpuWatch
from loadtest.sweep.disrupt import Disruptor, disruption_figures, scrape
from loadtest.sweep.stack import (
    PEERS,
    Router,
    StackError,
    TwinCluster,
    cleanup,
    needs_events,
    peer_health_args,
)
from loadtest.traces import load_trace

if TYPE_CHECKING:
    from costmodel.profiles import ReplicaProfile

MIN_METRICS_INTERVAL_S = 0.01  # router.config's floor (the harness does not import the router)


@dataclass
class SweepConfig:
    trace: str
    targets: list[str] = field(
        default_factory=lambda: ["kvroute:round_robin", "kvroute:session_affinity"]
    )
    concurrency: list[int] = field(default_factory=lambda: [4, 8])
    duration_s: float = 30.0
    grace_s: float = 5.0
    replicas: int = 4
    profile: str = "h200-70b-fp8"
    speedup: float = 10.0
    max_sessions: int | None = None
    max_calls: int | None = None
    max_gap_s: float = 30.0
    shared_prefix: bool = False
    convention: str = "claude"
    tokens_per_id: int | None = None
    max_prompt_tokens: int | None = None
    open_loop: bool = False
    seed: int = 0  # synthetic traces' generator seed
    # Replay seeds: each point runs once per seed (lane order shuffled, first starts staggered
    # over stagger_s modelled seconds; see ReplayConfig). [None]: trace order, one run.
    seeds: list[int | None] = field(default_factory=lambda: [None])
    stagger_s: float = 0.0
    warmup_s: float = 0.0  # modelled seconds left out of each point's summary
    model: str = "tiny"  # the twins' served model name (peers may not list models)
    progress: bool = True
    # the twins' engine timing (loadtest.twin.truth), which no router is told ...
    truth: str = "nominal"
    # ... and the profile kvroute's KV layer prices with: None = ``profile`` (the nominal
    # profile), "none" = no profile (the generic stand-in, calibrated online)
    router_profile: str | None = None
    # disruptions (loadtest.sweep.disrupt): rolling-restart | scale-out | replica-loss
    disrupt: str | None = None
    disrupt_at_s: float | None = None  # modelled seconds; None: a quarter of the run
    restart_downtime_s: float = 30.0  # modelled seconds a restarted replica is down
    scale_out: int = 0  # scale-out: replicas added (0: half of ``replicas``, at least 1)
    # the cluster KV pool every twin shares, in blocks (0: none; needs a host tier)
    pool_blocks: int = 0
    # session-level priority (issue 47): the twins schedule by request priority (vLLM's
    # --scheduling-policy priority, as the kvroute engine preset) and kvroute targets send it
    # (the router's priority: session); off: FCFS twins, no priority sent
    priority: bool = False
    # P/D disaggregation "P:D": P prefill twins then D decode twins (replicas = P + D);
    # kvroute targets get ``--replica URL#role=...`` (router.disagg), with pd_mode below
    pd: str | None = None
    pd_mode: str = "auto"
    # how often every kvroute target reads the twins' load (its /metrics scrape), in modelled
    # seconds: upstream llm-d's 50 ms refresh, for its port and for kv_cost alike (the peers
    # track load themselves); the router's metrics_interval_s is this / speedup, not under
    # MIN_METRICS_INTERVAL_S (see scrape_wall_s)
    scrape_s: float = 0.05
    # the peers' health checks (sglang-router, vllm-router), wall seconds: every S s, out at
    # the first failure, as kvroute (stack.peer_health_args); None: the peers' own defaults
    peer_health_s: int | None = None

    @property
    def router_profile_name(self) -> str:
        return self.router_profile or self.profile

    def pd_roles(self) -> list[str] | None:
        """Each twin's role for ``pd`` (None: colocated); sets ``replicas`` to P + D."""
        if not self.pd:
            return None
        p, sep, d = self.pd.partition(":")
        if not sep or not p.isdigit() or not d.isdigit() or int(p) < 1 or int(d) < 1:
            raise ValueError(f"--pd takes P:D with P, D >= 1 (e.g. 2:2), not {self.pd!r}")
        self.replicas = int(p) + int(d)
        return ["prefill"] * int(p) + ["decode"] * int(d)

    @property
    def scrape_wall_s(self) -> float:
        """kvroute's ``metrics_interval_s`` (wall seconds) for this sweep."""
        return max(MIN_METRICS_INTERVAL_S, self.scrape_s / self.speedup)


def machine() -> str:
    import os

    return (
        f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}"
    )


def _profile(name: str) -> ReplicaProfile:
    from costmodel.profiles import load_profile

    return load_profile(name)


def notes_for(cfg: SweepConfig, trace_block: int, block: int, tpi: int) -> list[str]:
    n = [
        f"Each point restarts {cfg.replicas} twins ({cfg.profile}, speedup {cfg.speedup:g}): "
        "caches start cold; times and throughput are scaled back to modelled seconds.",
        f"Truth {cfg.truth}: the twins' engine timing, which no router is told; kvroute's KV "
        f"layer prices with the profile {cfg.router_profile_name!r} and calibrates online "
        "(docs/twin.md#truths).",
        f"Trace blocks of {trace_block} tokens become {tpi} tokens ({tpi // block} replica "
        f"block(s) of {block}); token counts are "
        + ("kept." if tpi == trace_block else f"scaled by {tpi / trace_block:g}."),
        f"Idle gaps capped at {cfg.max_gap_s:g} s, then divided by the speedup; lanes recycle "
        "sessions with a fresh per-play prompt namespace (no warm cache across plays).",
        "Client and twins share this machine's CPUs: client-side latency is multiplied by the "
        "speedup when scaled back, so compare targets within one run, not absolute numbers.",
        f"kvroute targets read the twins' load from a /metrics scrape every "
        f"{cfg.scrape_wall_s * cfg.speedup * 1e3:g} ms modelled ({cfg.scrape_wall_s * 1e3:g} ms "
        "wall; upstream llm-d refreshes every 50 ms); the peers track load themselves.",
    ]
    if cfg.shared_prefix:
        n.append("Shared tools+system prefix ON: every session of an agent type shares it.")
    return n


def run_point(
    cfg: SweepConfig,
    target: str,
    conc: int,
    out: Path,
    trace: Any,
    builder: PromptBuilder,
    seed: int | None = None,
) -> dict[str, Any]:
    point: dict[str, Any] = {
        "target": target,
        "concurrency": conc,
        "seed": seed,
        "truth": cfg.truth,
        "router_profile": router_profile_of(cfg, target),
        "peer_health_s": cfg.peer_health_s if peer_health_args(target, cfg.peer_health_s) else None,
    }
    d = out / "points" / target.replace(":", "_") / f"c{conc}"
    if seed is not None:
        d = d / f"s{seed}"
    events = "tcp://127.0.0.1:*" if needs_events(target) else None
    extra_replicas = scale_out_of(cfg)
    overrides = [f"pool_kv_blocks={cfg.pool_blocks}"] if cfg.pool_blocks else []
    if cfg.priority:
        overrides.append("priority_scheduling=1")
    roles = cfg.pd_roles()
    point["pd"] = cfg.pd
    cluster = TwinCluster(cfg.replicas + extra_replicas, cfg.profile, cfg.speedup,
                          kv_events=events, truth=cfg.truth, overrides=overrides,
                          roles=roles)  # fmt: skip
    disruptor: Disruptor | None = None
    try:
        cluster.start()
        extra = {}
        if target.startswith("kvroute:"):  # why each call went where it did (diagnose reads it)
            d.mkdir(parents=True, exist_ok=True)
            extra["KVROUTE_DECISION_LOG"] = str(d / "decisions.jsonl")
            if roles:
                extra["KVROUTE_PD_MODE"] = cfg.pd_mode
        scrape_args = []
        if target.startswith("kvroute:"):  # every kvroute policy reads load this often
            scrape_args = ["--metrics-interval-s", repr(cfg.scrape_wall_s)]
            point["scrape_s"] = cfg.scrape_wall_s * cfg.speedup  # modelled seconds
        router = Router(
            target,
            cluster.urls,
            cluster.workdir,
            event_endpoints=cluster.event_endpoints,
            block_size=_profile(cfg.profile).block_size,
            model=cfg.model,
            profile=cfg.router_profile_name,
            speedup=cfg.speedup,
            extra_env=extra,
            extra_args=scrape_args
            + (["--priority", "session"] if cfg.priority and target.startswith("kvroute:") else [])
            + peer_health_args(target, cfg.peer_health_s),
            roles=dict(zip(cluster.urls, roles, strict=True)) if roles else {},
        )
        with router:
            if cfg.disrupt:
                at = cfg.disrupt_at_s
                disruptor = Disruptor(
                    cfg.disrupt, cluster.urls, cluster.names, cfg.speedup,
                    at if at is not None else cfg.duration_s * cfg.speedup / 4,
                    downtime_s=cfg.restart_downtime_s, extra=extra_replicas,
                )  # fmt: skip
                disruptor.prepare()
            rcfg = ReplayConfig(
                target=router.url,
                model=cfg.model,
                concurrency=conc,
                duration_s=cfg.duration_s,
                grace_s=cfg.grace_s,
                time_scale=cfg.speedup,
                speedup=cfg.speedup,
                gpus=(cfg.replicas + extra_replicas) * _profile(cfg.profile).gpus,
                open_loop=cfg.open_loop,
                convention=PEERS[target][2] if target in PEERS else cfg.convention,
                metrics_urls=cluster.metrics_urls,
                progress=cfg.progress,
                context_limit=_profile(cfg.profile).max_model_len,
                expect_urls=cluster.urls[:1],  # one cluster process: one table for its twins
                seed=seed,
                stagger_s=cfg.stagger_s,
                warmup_s=cfg.warmup_s,
                on_start=_starter(disruptor),
            )
            watch = CpuWatch({"twins": cluster.pgid, "router": router.pgid, "client": None}).start()
            try:
                summary = asyncio.run(replay(trace, builder, rcfg, d))
            finally:
                point["cpu"] = watch.stop()
                if disruptor is not None:
                    disruptor.stop()
            summary.update(
                disruption_figures(
                    _read_calls(d / "calls.jsonl"), disruptor, scrape(cluster.urls), cfg.speedup
                )
            )
            if target.startswith("kvroute:"):
                point["router_metrics"] = router_state(router.url)
        # every run says under which truth, and with which router profile, it was measured
        summary = {**summary, "truth": point["truth"], "router_profile": point["router_profile"]}
        (d / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        point["summary"] = summary
        point["dir"] = str(d.relative_to(out))
    except (StackError, RuntimeError, OSError) as e:
        lines = [x for x in str(e).splitlines() if x.strip()]
        point["error"] = (
            " | ".join([lines[0], *lines[-3:]] if len(lines) > 1 else lines)[:600]
            if lines
            else repr(e)
        )
    finally:
        cluster.stop()
        cleanup(cluster.workdir)
    return point


def scale_out_of(cfg: SweepConfig) -> int:
    """Replicas a scale-out adds (0 for any other run)."""
    if cfg.disrupt != "scale-out":
        return 0
    return cfg.scale_out or max(1, cfg.replicas // 2)


def _starter(d: Disruptor | None) -> Any:
    """The replay's ``on_start`` for ``d``: a plain function (the replay's config is copied
    with ``asdict``, which cannot copy the disruptor's thread state)."""
    if d is None:
        return None

    def on_start(t0: float) -> None:
        d.on_start(t0)

    return on_start


def _read_calls(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def router_profile_of(cfg: SweepConfig, target: str) -> str | None:
    """The profile ``target`` prices with: kvroute's KV policies get
    :attr:`SweepConfig.router_profile_name`; other routers read no profile (None)."""
    kv = target.startswith("kvroute:") and needs_events(target)
    return cfg.router_profile_name if kv else None


# The router's own view at the end of a point, kept for diagnosis (docs/router.md has them).
ROUTER_FAMILIES = (
    "kvroute_kv_calibration",
    "kvroute_session_placements_total",
    "kvroute_kv_analyses_total",
    "kvroute_event_loop_lag_seconds_bucket",
    "kvroute_event_loop_lag_seconds_count",
    "kvroute_pd_calls_total",
)


def router_state(url: str) -> dict[str, Any]:
    """kvroute's calibration per replica, placement and analysis counts and event-loop lag
    histogram, from its ``/metrics``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url + "/metrics", timeout=5.0).text
    except httpx.HTTPError as e:
        return {"error": repr(e)}
    out: dict[str, Any] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name in ROUTER_FAMILIES:
                key = ",".join(f"{k}={v}" for k, v in sorted(smp.labels.items()))
                out.setdefault(smp.name, {})[key] = smp.value
    return out


def run_sweep(cfg: SweepConfig, out: str | Path, command: str | None = None) -> dict[str, Any]:
    from loadtest import tinymodel
    from loadtest.report.html import build_report
    from loadtest.sweep.stack import pd_capable

    out = Path(out)
    roles = cfg.pd_roles()  # a bad --pd fails before any point runs (and sets replicas)
    no_pd = {t: why for t in cfg.targets if roles and (why := pd_capable(t)) is not None}
    if no_pd:
        raise ValueError(f"--pd: {'; '.join(f'{t}: {w}' for t, w in no_pd.items())}")
    if roles and cfg.disrupt:
        raise ValueError("--pd with --disrupt is not wired (which role would a new replica get?)")
    out.mkdir(parents=True, exist_ok=True)
    trace = load_trace(
        cfg.trace,
        max_sessions=cfg.max_sessions,
        max_calls=cfg.max_calls,
        max_gap_s=cfg.max_gap_s,
        seed=cfg.seed,
    )
    from loadtest.twin.truth import TRUTH_NAMES, describe

    if cfg.truth not in TRUTH_NAMES:
        raise ValueError(f"unknown truth {cfg.truth!r}; known: {', '.join(TRUTH_NAMES)}")
    if cfg.router_profile not in (None, "none"):
        rp = _profile(cfg.router_profile)  # an unknown name fails before any point runs
        if rp.block_size != _profile(cfg.profile).block_size:
            raise ValueError("the router profile's block size differs from the twins'")
    block = _profile(cfg.profile).block_size
    # Prompts longer than the profile's context are cut (from the end) to fit with the output.
    mml = _profile(cfg.profile).max_model_len
    max_prompt = cfg.max_prompt_tokens or mml - min(8192, mml // 4)
    builder = PromptBuilder(
        tinymodel.ensure(),
        block_size=block,
        trace_block_size=trace.block_size,
        tokens_per_id=cfg.tokens_per_id,
        shared_prefix=cfg.shared_prefix,
        max_prompt_tokens=max_prompt,
    )
    results: dict[str, Any] = {
        "config": {**asdict(cfg), "router_profile": cfg.router_profile_name},
        "truth": describe(cfg.truth),
        "machine": machine(),
        "command": command or " ".join(shlex.quote(a) for a in sys.argv),
        "trace_stats": trace.stats(),
        "notes": [
            *notes_for(cfg, trace.block_size, block, builder.tokens_per_id),
            f"Prompts longer than {max_prompt:,} tokens (the profile's context minus "
            "room for output) are truncated from the end.",
        ],
        "points": [],
    }
    t0 = time.monotonic()
    for target in cfg.targets:
        for conc in cfg.concurrency:
            for seed in cfg.seeds:
                results["points"].append(run_point(cfg, target, conc, out, trace, builder, seed))
                results["elapsed_s"] = round(time.monotonic() - t0, 1)
                results["aggregate"] = aggregate(results["points"], out, cfg.warmup_s)
                results["line"] = line_summary(results["aggregate"])
                (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    results["report"] = str(build_report(out))
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    return results


# What a point's summary contributes to the per-target figures over seeds.
AGGREGATE_KEYS = (
    "tokens_per_gpu_s",
    "p90_interactivity_tok_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "cache_hit_ratio",
    "session_completion_p50_s",
    "session_completion_p90_s",
    "requests_ok",
)


def pooled_ttft(out: Path, points: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    """TTFT p90 / p99 (modelled seconds) over the calls of every point in ``points`` pooled
    — the calls after each run's warm-up, read back from its ``calls.jsonl``. A p90 of one
    ~100-call run is its 10th-slowest call and moves by seconds between seeds; pooled over the
    seeds it is the 30th of ~300, a steadier figure to compare routers by."""
    ttfts: list[float] = []
    for p in points:
        f = out / p["dir"] / "calls.jsonl" if p.get("dir") else None
        if f is None or not f.exists():
            continue
        speed = float(p["summary"].get("speedup") or 1.0)
        w = warmup_s / speed  # run clock
        for line in f.read_text().splitlines():
            c = json.loads(line)
            if c.get("ok") and c.get("ttft_s") is not None and c["t_start"] >= w:
                ttfts.append(c["ttft_s"] * speed)
    if not ttfts:
        return {}
    ttfts.sort()

    def q(x: float) -> float:
        return ttfts[min(len(ttfts) - 1, int(x * len(ttfts)))]

    return {"ttft_p90_pooled_s": q(0.9), "ttft_p99_pooled_s": q(0.99), "pooled_calls": len(ttfts)}


def aggregate(
    points: list[dict[str, Any]], out: Path | None = None, warmup_s: float = 0.0
) -> list[dict[str, Any]]:
    """Per (target, concurrency): min / median / max over the seeds' points of each of
    :data:`AGGREGATE_KEYS`, from the points whose processes were **not** CPU-saturated
    (``cpu.saturated`` false or unmeasured); how many were left out is kept beside them. With
    ``out`` (the sweep's folder), also the TTFT percentiles pooled over those points' calls
    (:func:`pooled_ttft`)."""
    import statistics

    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for p in points:
        groups.setdefault((p["target"], p["concurrency"]), []).append(p)
    rows = []
    for (target, conc), pts in groups.items():
        ok = [p for p in pts if p.get("summary")]
        used = [p for p in ok if not (p.get("cpu") or {}).get("saturated")]
        row: dict[str, Any] = {
            "target": target,
            "concurrency": conc,
            "points": len(pts),
            "failed": len(pts) - len(ok),
            "saturated": len(ok) - len(used),
            "used": len(used),
        }
        for k in AGGREGATE_KEYS:
            xs = [p["summary"][k] for p in used if p["summary"].get(k) is not None]
            row[k] = (
                {"min": min(xs), "median": statistics.median(xs), "max": max(xs)} if xs else None
            )
        if out is not None:
            row.update(pooled_ttft(out, used, warmup_s))
        row["truth"] = pts[0].get("truth")
        row["router_profile"] = pts[0].get("router_profile")
        rows.append(row)
    return rows


# kvroute's default policy: the one a line comparison puts against the best of the others
OURS = ("kvroute:kv_cost",)


def line_summary(rows: list[dict[str, Any]], ours: tuple[str, ...] = OURS) -> dict[str, Any]:
    """Each target's line figure (:func:`loadtest.line.line_figure`: measured and interpolated
    side by side, flagged where the lane grid is too coarse at the line) from the medians over
    seeds of :func:`aggregate`'s rows, and ours against the best other target
    (:func:`loadtest.line.compare_at_line`). A target with one lane count is flagged: a line
    figure needs a sweep (``--lanes LO:HI``)."""
    from loadtest.line import LINE_TOK_S, LinePoint, compare_at_line, line_figure

    pts: dict[str, list[LinePoint]] = {}
    for r in rows:
        inter, tput = r.get("p90_interactivity_tok_s"), r.get("tokens_per_gpu_s")
        if not inter or not tput:
            continue
        pts.setdefault(r["target"], []).append(
            LinePoint(r["concurrency"], inter["median"], tput["median"])
        )
    figs = {t: line_figure(p) for t, p in pts.items()}
    return {
        "line_tok_s": LINE_TOK_S,
        "figures": {t: f.as_dict() for t, f in figs.items()},
        **compare_at_line(figs, [t for t in ours if t in figs]),
    }
