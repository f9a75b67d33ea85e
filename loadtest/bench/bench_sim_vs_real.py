"""Does the simulator predict the real path's ranking? The same workload in both, side by side.

    .venv/bin/python -m loadtest.bench.bench_sim_vs_real OUT [--json PATH]

``OUT`` is a ``kvroute bench`` output folder (the real HTTP path: twins, routers as processes,
the client's replay). This runs the trace simulator (:func:`loadtest.sim.trace.simulate_trace`,
no HTTP) on the same trace, profile, replicas, lanes, gap cap, duration, seeds, stagger and
warm-up, with each target mapped to the policy the simulator has for it:

* ``kvroute:<policy>`` → the same pipeline (:class:`loadtest.sim.router_policy.RouterPolicy`);
* ``sglang:cache_aware`` → ``sglang_tree`` (the port of sglang-router 0.3.2's cache_aware,
  107 of 107 identical decisions, the balance branch included, against the binary in
  tests/integration/test_sglang_agreement.py);
* ``vllm-router:consistent_hash`` → ``session_affinity`` (consistent hashing on the session;
  the port differs: kvroute's variant bounds each replica's load, vllm-router's does not).

The simulated router reads the engines' running / waiting / KV usage as the live router did,
from a scrape every ``--scrape`` wall seconds: by default the interval the run recorded
(``kvroute bench --scrape``, 50 ms modelled since issue 42), else 1 s (kvroute's
``metrics_interval_s`` default, what runs before it scraped at); 0 is exact load at every
decision, which flatters a policy that leans on it. It prints tokens/GPU-s and TTFT p90
(median over seeds) per target in both, each side's ranking, Kendall's tau between the
rankings (1: the same order) and which pairs of targets the two order differently. Real-path
points marked CPU-saturated are left out, as in the sweep's aggregate.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

# Not a run of its own: it reads another run's output, so ``make bench`` lists it, not runs it.
STANDALONE = "reads a kvroute bench --out folder: python -m loadtest.bench.bench_sim_vs_real OUT"

SCRAPE_S = 1.0  # kvroute's metrics_interval_s default: runs that recorded no scrape used it


def recorded_scrape_s(res: dict[str, Any]) -> float:
    """The wall seconds between the live router's load scrapes in a ``kvroute bench`` run:
    what its kvroute points recorded (modelled seconds / speedup), else ``SCRAPE_S``."""
    speedup = float(res.get("config", {}).get("speedup") or 1.0)
    for p in res.get("points", []):
        if p.get("scrape_s"):
            return float(p["scrape_s"]) / speedup
    return SCRAPE_S


SIM_POLICY = {
    "sglang:cache_aware": "sglang_tree",
    "vllm-router:consistent_hash": "session_affinity",
}


def sim_policy(target: str) -> str | None:
    if target.startswith("kvroute:"):
        return target.split(":", 1)[1]
    return SIM_POLICY.get(target)


def simulate(
    cfg: dict[str, Any], policy: str, seed: int | None, scrape_s: float = 0.0
) -> dict[str, Any]:
    from costmodel.profiles import load_profile, router_profile
    from loadtest.sim.router_policy import RouterPolicy
    from loadtest.sim.trace import simulate_trace
    from loadtest.traces import load_trace

    prof = load_profile(cfg["profile"])
    # the same engine timing and router profile as the HTTP run (runs before issue 42 had
    # neither: their twins ran costmodel's formula, their router the twins' profile)
    truth = cfg.get("truth", "costmodel")
    router_prof = router_profile(cfg.get("router_profile") or cfg["profile"])
    trace = load_trace(
        cfg["trace"], max_gap_s=cfg["max_gap_s"], seed=cfg.get("seed", 0),
        max_sessions=cfg.get("max_sessions"), max_calls=cfg.get("max_calls"),
    )  # fmt: skip
    modelled = cfg["duration_s"] * cfg["speedup"]
    res = simulate_trace(
        prof, cfg["replicas"], trace,
        RouterPolicy(policy, router_prof, seed=seed or 0,
                     scrape_interval_s=scrape_s * cfg["speedup"]),
        concurrency=cfg["concurrency"][0], duration_s=modelled, seed=seed,
        stagger_s=cfg.get("stagger_s", 0.0), shared_prefix=cfg.get("shared_prefix", False),
        truth=truth,
    )  # fmt: skip
    s = res.summary(warmup_s=cfg.get("warmup_s", 0.0))
    return {
        "tokens_per_gpu_s": s.get("throughput_tok_per_gpu_s"),
        "ttft_p90_s": s.get("ttft_p90_s"),
        "cache_hit_ratio": s.get("cache_hit_ratio"),
    }


def _median(xs: list[float | None]) -> float | None:
    vs = [x for x in xs if x is not None and x == x]
    return statistics.median(vs) if vs else None


def compare(out: Path, scrape_s: float | None = None) -> dict[str, Any]:
    """``scrape_s``: wall seconds between simulated scrapes (None: the run's own)."""
    from scipy.stats import kendalltau

    res = json.loads((out / "results.json").read_text())
    if scrape_s is None:
        scrape_s = recorded_scrape_s(res)
    cfg = res["config"]
    real: dict[str, list[dict[str, Any]]] = {}
    for p in res["points"]:
        if p.get("summary") and not (p.get("cpu") or {}).get("saturated"):
            real.setdefault(p["target"], []).append(p["summary"])
    rows: list[dict[str, Any]] = []
    for target, sums in real.items():
        pol = sim_policy(target)
        if pol is None:
            continue
        sims = [simulate(cfg, pol, s, scrape_s) for s in cfg.get("seeds") or [None]]
        rows.append({
            "target": target, "sim_policy": pol, "real_seeds": len(sums),
            "real_tok_per_gpu_s": _median([s["tokens_per_gpu_s"] for s in sums]),
            "real_ttft_p90_s": _median([s["ttft_p90_s"] for s in sums]),
            "sim_tok_per_gpu_s": _median([s["tokens_per_gpu_s"] for s in sims]),
            "sim_ttft_p90_s": _median([s["ttft_p90_s"] for s in sims]),
            "sim_runs": sims,
        })  # fmt: skip
    for side in ("real", "sim"):
        order = sorted(rows, key=lambda r: -float(r[f"{side}_tok_per_gpu_s"] or 0.0))
        for i, r in enumerate(order):
            r[f"{side}_rank"] = i + 1
    tau = None
    if len(rows) >= 2:
        t = kendalltau([r["real_rank"] for r in rows], [r["sim_rank"] for r in rows])
        tau = float(t.statistic)
    # every pair of targets: does the simulator order it as the real path does?
    pairs = [(a, b) for i, a in enumerate(rows) for b in rows[i + 1 :]]
    disagree = [
        sorted((a["target"], b["target"]))
        for a, b in pairs
        if (a["real_rank"] < b["real_rank"]) != (a["sim_rank"] < b["sim_rank"])
    ]
    return {
        "out": str(out),
        "trace": cfg["trace"],
        "scrape_s": scrape_s,
        "rows": rows,
        "kendall_tau": tau,
        "pairs": len(pairs),
        "pairs_agree": len(pairs) - len(disagree),
        "pairs_disagree": disagree,
    }


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        "| target (sim policy) | real tok/GPU·s | sim tok/GPU·s | real rank | sim rank | "
        "real TTFT p90 s | sim TTFT p90 s |",
        "|---|---|---|---|---|---|---|",
    ]

    def f(x: float | None, spec: str) -> str:
        return spec.format(x) if x is not None else "–"

    for r in sorted(doc["rows"], key=lambda r: r["real_rank"]):
        lines.append(
            f"| {r['target']} ({r['sim_policy']}) | {f(r['real_tok_per_gpu_s'], '{:,.0f}')} | "
            f"{f(r['sim_tok_per_gpu_s'], '{:,.0f}')} | {r['real_rank']} | {r['sim_rank']} | "
            f"{f(r['real_ttft_p90_s'], '{:.1f}')} | {f(r['sim_ttft_p90_s'], '{:.1f}')} |"
        )
    lines.append(f"\nKendall's tau between the rankings: {f(doc['kendall_tau'], '{:.2f}')}")
    if doc.get("pairs"):
        lines.append(
            f"Pairs of targets ordered alike: {doc['pairs_agree']} of {doc['pairs']}"
            + "".join(f"; not {a} / {b}" for a, b in doc["pairs_disagree"])
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="a kvroute bench --out folder")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--scrape",
        type=float,
        default=None,
        metavar="S",
        help="the simulated router reads engine load every S wall seconds, as "
        "kvroute's metrics_interval_s (default: the run's recorded interval, else 1; "
        "0: exact at every decision)",
    )
    a = p.parse_args(argv)
    doc = compare(Path(a.out), a.scrape)
    print(markdown(doc))
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
