"""``python -m loadtest.report.yardstick OUT...``: the yardstick table of ``kvroute bench`` runs.

Issue 42's target, read off one or more bench output folders (a folder per truth, or the
parent a ``--truth a,b,c`` run wrote them under): per truth, per target, the seeds' median
[min–max] of tokens/GPU-s and TTFT p90, the TTFT p90 pooled over the seeds' calls, the hit
ratio against its bound, and **ours ÷ the best peer** seed by seed — paired by seed, since
seeds replay the same sessions in the same lane order, so a pair shares its workload.

The best peer is the peer with the highest median tokens/GPU-s under that truth; peers are the
targets that are not kvroute's own (``kvroute:*``). A CPU-saturated point is marked, not used
(:mod:`loadtest.sweep.cpuwatch`): its pair is left out of the ratios and counted. Prints
markdown, ready for docs/results.md; ``--json`` writes the same figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

OURS = "kvroute:kv_cost"


def load_runs(paths: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """truth -> the points of every ``results.json`` under ``paths`` (a folder holding one, or
    holding one folder per truth)."""
    files: list[Path] = []
    for p in paths:
        if (p / "results.json").exists():
            files.append(p / "results.json")
        else:
            files.extend(sorted(p.glob("*/results.json")))
    if not files:
        raise FileNotFoundError(f"no results.json under {', '.join(map(str, paths))}")
    by_truth: dict[str, list[dict[str, Any]]] = {}
    for f in files:
        res = json.loads(f.read_text())
        truth = res.get("config", {}).get("truth") or "nominal"
        by_truth.setdefault(truth, []).extend(res.get("points", []))
    # the nominal truth first, then the perturbed ones by name
    return dict(sorted(by_truth.items(), key=lambda kv: (kv[0] != "nominal", kv[0])))


def _used(p: dict[str, Any]) -> bool:
    return bool(p.get("summary")) and not (p.get("cpu") or {}).get("saturated")


def _spread(xs: list[float]) -> dict[str, float] | None:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)} if xs else None


def table(points: list[dict[str, Any]], ours: str = OURS) -> dict[str, Any]:
    """The figures of one truth: per target (and lane count) spreads over its used seeds, and
    ours against the best peer paired by seed."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for p in points:
        key = (p["target"], p["concurrency"])
        r = rows.setdefault(key, {"target": key[0], "lanes": key[1], "runs": 0, "seeds": {}})
        r["runs"] += 1
        if _used(p):
            r["seeds"][p.get("seed")] = p["summary"]
    for r in rows.values():
        s = list(r["seeds"].values())

        def col(k: str, s: list = s) -> dict[str, float] | None:
            return _spread([x[k] for x in s if x.get(k) is not None])

        r["used"] = len(s)
        r["tokens_per_gpu_s"] = col("tokens_per_gpu_s")
        r["ttft_p90_s"] = col("ttft_p90_s")
        r["hit"] = col("cache_hit_ratio")
        r["bound"] = col("cache_hit_bound")
    out: dict[str, Any] = {"rows": list(rows.values()), "vs_best_peer": []}
    for lanes in sorted({k[1] for k in rows}):
        mine = rows.get((ours, lanes))
        peers = [
            r
            for (t, n), r in rows.items()
            if n == lanes and not t.startswith("kvroute:") and r["tokens_per_gpu_s"]
        ]
        if not mine or not mine["tokens_per_gpu_s"] or not peers:
            continue
        best = max(peers, key=lambda r: r["tokens_per_gpu_s"]["median"])
        pairs = sorted(set(mine["seeds"]) & set(best["seeds"]), key=str)
        tput = [
            mine["seeds"][s]["tokens_per_gpu_s"] / best["seeds"][s]["tokens_per_gpu_s"]
            for s in pairs
        ]
        ttft = [
            mine["seeds"][s]["ttft_p90_s"] / best["seeds"][s]["ttft_p90_s"]
            for s in pairs
            if mine["seeds"][s].get("ttft_p90_s") and best["seeds"][s].get("ttft_p90_s")
        ]
        out["vs_best_peer"].append({
            "lanes": lanes,
            "best_peer": best["target"],
            "seeds": pairs,
            "tokens_ratio": tput,
            "tokens_ratio_spread": _spread(tput),
            "ttft_p90_ratio": ttft,
            "ttft_p90_ratio_spread": _spread(ttft),
            "unpaired": sorted(set(mine["seeds"]) ^ set(best["seeds"]), key=str),
        })  # fmt: skip
    return out


def _mr(v: dict[str, float] | None, spec: str) -> str:
    if not v:
        return "–"
    return f"{spec.format(v['median'])} [{spec.format(v['min'])}–{spec.format(v['max'])}]"


def markdown(by_truth: dict[str, list[dict[str, Any]]], ours: str = OURS) -> str:
    lines: list[str] = []
    for truth, points in by_truth.items():
        t = table(points, ours)
        lines += [
            f"**Truth `{truth}`**",
            "",
            "| target | lanes | used / runs | tok/GPU·s median [min–max] | TTFT p90 s "
            "| hit | bound |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in sorted(t["rows"], key=lambda r: (r["lanes"], r["target"] != ours, r["target"])):
            lines.append(
                f"| {r['target']} | {r['lanes']} | {r['used']} / {r['runs']} | "
                f"{_mr(r['tokens_per_gpu_s'], '{:,.0f}')} | {_mr(r['ttft_p90_s'], '{:.2f}')} | "
                f"{_mr(r['hit'], '{:.2f}')} | {_mr(r['bound'], '{:.2f}')} |"
            )
        for v in t["vs_best_peer"]:
            per = " / ".join(f"{x:.2f}" for x in v["tokens_ratio"])
            tt = " / ".join(f"{x:.2f}" for x in v["ttft_p90_ratio"])
            left = (
                f"; unpaired (saturated, failed or not run): seeds {v['unpaired']}"
                if v["unpaired"]
                else ""
            )
            med = v["tokens_ratio_spread"]["median"] if v["tokens_ratio"] else float("nan")
            lines += [
                "",
                f"{ours} ÷ best peer ({v['best_peer']}, {v['lanes']} lanes), per seed "
                f"{', '.join(map(str, v['seeds']))}: tokens/GPU-s {per} (median **{med:.2f}×**); "
                f"TTFT p90 {tt or '–'}{left}",
            ]  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.report.yardstick", description=__doc__)
    ap.add_argument("out", nargs="+", type=Path, help="kvroute bench --out folder(s)")
    ap.add_argument("--ours", default=OURS, help=f"the target set against the peers ({OURS})")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    a = ap.parse_args(argv)
    try:
        by_truth = load_runs(a.out)
    except (FileNotFoundError, json.JSONDecodeError) as e:
        print(f"yardstick: {e}", file=sys.stderr)
        return 2
    print(markdown(by_truth, a.ours))
    if a.json:
        a.json.write_text(json.dumps({t: table(p, a.ours) for t, p in by_truth.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
