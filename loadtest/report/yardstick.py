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

A kvroute target of a ``kvroute bench --priority`` run is named ``<target> --priority``
(:data:`PRIORITY_SUFFIX`), so folders with and without it can be read together and paired.
``--sessions`` prints issue 47's table instead: per target, session completion (mean; p50 /
p90 by size class, :func:`loadtest.metrics.size_class`), the TTFT p99 of short sessions'
calls, tokens/GPU-s, and the calls overtaken past the priority rule's starvation bound
(:func:`overtaken`); then ``--ours`` against every other target, seed by seed.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from loadtest.metrics import SIZE_CLASSES

OURS = "kvroute:kv_cost"
PRIORITY_SUFFIX = " --priority"  # a kvroute target of a ``kvroute bench --priority`` run


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
        prio = bool(res.get("config", {}).get("priority"))
        points = res.get("points", [])
        for p in points:
            p["_base"] = str(f.parent)  # where its ``dir`` (calls.jsonl, ...) is relative to
            if prio and p["target"].startswith("kvroute:"):  # not the same router as without
                p["target"] += PRIORITY_SUFFIX
        by_truth.setdefault(truth, []).extend(points)
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


def overtaken(calls: Iterable[dict[str, Any]], bound_s: float) -> dict[str, Any]:
    """Starvation past the bound, read off a point's ``calls.jsonl`` rows (run-clock seconds).

    A successful call *i* counts as overtaken when a call *j* on the same replica arrived more
    than ``bound_s`` after it and had its first token before *i* did. The priority rule
    promises no call is overtaken in the engine's queue by one arriving more than its bound
    later (:attr:`router.priority.PriorityConfig.bound_s`); the first token is what the client
    sees, so this is an upper bound of the breaches: a long prefill still running when a short
    later call gets its first token counts too (an FCFS run shows how many that makes)."""
    by_replica: dict[str, list[tuple[float, float]]] = {}
    ttfts: list[float] = []
    for c in calls:
        if not c.get("ok") or c.get("ttft_s") is None:
            continue
        ttfts.append(c["ttft_s"])
        by_replica.setdefault(c.get("replica") or "", []).append(
            (c["t_start"], c["t_start"] + c["ttft_s"])
        )
    n = 0
    for rows in by_replica.values():
        rows.sort()
        arrivals = [a for a, _ in rows]
        later_first = [math.inf] * (len(rows) + 1)  # min first token over rows[k:]
        for k in range(len(rows) - 1, -1, -1):
            later_first[k] = min(later_first[k + 1], rows[k][1])
        for a, f in rows:
            if later_first[bisect.bisect_right(arrivals, a + bound_s)] < f:
                n += 1
    return {"calls": len(ttfts), "overtaken": n, "ttft_max_s": max(ttfts) if ttfts else None}


def _calls_of(p: dict[str, Any]) -> list[dict[str, Any]] | None:
    if not p.get("_base") or not p.get("dir"):
        return None
    f = Path(p["_base"]) / p["dir"] / "calls.jsonl"
    if not f.exists():
        return None
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()]


SESSION_RATIOS = (  # (label, summary key or size-class path) ours ÷ theirs, seed by seed
    ("completion mean", ("session_completion_mean_s",)),
    ("short TTFT p99", ("session_completion_by_size", "short", "ttft_p99_s")),
    ("tok/GPU-s", ("tokens_per_gpu_s",)),
)


def _get(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    v: Any = summary
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return v if isinstance(v, int | float) else None


def sessions_table(
    points: list[dict[str, Any]], ours: str = OURS, bound_s: float | None = None
) -> dict[str, Any]:
    """Issue 47's figures of one truth: per target (and lane count) spreads over its used seeds
    of session completion (mean, and p50 / p90 by size class), short sessions' TTFT p99,
    tokens/GPU-s and P90 interactivity, the calls :func:`overtaken` past ``bound_s`` (the
    router's default bound when None); then ``ours`` ÷ each other target, paired by seed."""
    if bound_s is None:
        from router.priority import PriorityConfig

        bound_s = PriorityConfig().bound_s
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for p in points:
        key = (p["target"], p["concurrency"])
        r = rows.setdefault(key, {"target": key[0], "lanes": key[1], "runs": 0, "seeds": {},
                                  "overtaken": 0, "calls": 0, "ttft_max_s": None})  # fmt: skip
        r["runs"] += 1
        if not _used(p):
            continue
        r["seeds"][p.get("seed")] = p["summary"]
        calls = _calls_of(p)
        if calls is not None:
            o = overtaken(calls, bound_s)
            r["overtaken"] += o["overtaken"]
            r["calls"] += o["calls"]
            if o["ttft_max_s"] is not None:
                r["ttft_max_s"] = max(r["ttft_max_s"] or 0.0, o["ttft_max_s"])
    for r in rows.values():
        s = list(r["seeds"].values())

        def col(*path: str, s: list = s) -> dict[str, float] | None:
            return _spread([v for x in s if (v := _get(x, path)) is not None])

        r["used"] = len(s)
        r["interactivity"] = col("p90_interactivity_tok_s")
        r["completed"] = col("sessions_completed")
        r["completion_mean_s"] = col("session_completion_mean_s")
        r["by_size"] = {
            size: {
                "sessions": col("session_completion_by_size", size, "sessions"),
                "p50_s": col("session_completion_by_size", size, "p50_s"),
                "p90_s": col("session_completion_by_size", size, "p90_s"),
            }
            for size in SIZE_CLASSES
        }
        r["short_ttft_p99_s"] = col("session_completion_by_size", "short", "ttft_p99_s")
        r["tokens_per_gpu_s"] = col("tokens_per_gpu_s")
        r["preemptions"] = col("preemptions")
    out: dict[str, Any] = {"bound_s": bound_s, "rows": list(rows.values()), "vs": []}
    for (t, lanes), other in sorted(rows.items()):
        mine = rows.get((ours, lanes))
        if mine is None or t == ours:
            continue
        pairs = sorted(set(mine["seeds"]) & set(other["seeds"]), key=str)
        ratios: dict[str, list[float]] = {}
        for label, path in SESSION_RATIOS:
            ratios[label] = [
                a / b
                for sd in pairs
                if (a := _get(mine["seeds"][sd], path)) is not None
                and (b := _get(other["seeds"][sd], path))
            ]
        out["vs"].append({
            "lanes": lanes, "other": t, "seeds": pairs, "ratios": ratios,
            "unpaired": sorted(set(mine["seeds"]) ^ set(other["seeds"]), key=str),
        })  # fmt: skip
    return out


def sessions_markdown(by_truth: dict[str, list[dict[str, Any]]], ours: str = OURS) -> str:
    lines: list[str] = []
    for truth, points in by_truth.items():
        t = sessions_table(points, ours)
        lines += [
            f"**Truth `{truth}`** (median [min–max] over seeds; session times in s)",
            "",
            "| target | lanes | used / runs | P90 tok/s | sessions done | completion mean "
            "| short p50 / p90 | medium p50 / p90 | long p50 / p90 | short TTFT p99 "
            "| tok/GPU·s | overtaken > bound / calls, max TTFT | preemptions |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(t["rows"], key=lambda r: (r["lanes"], r["target"] != ours, r["target"])):
            size = " | ".join(
                f"{_md(b['p50_s'], '{:.0f}')} / {_md(b['p90_s'], '{:.0f}')}"
                f" (n {_md(b['sessions'], '{:.0f}')})"
                for b in (r["by_size"][k] for k in SIZE_CLASSES)
            )
            mx = f"{r['ttft_max_s']:.1f} s" if r["ttft_max_s"] is not None else "–"
            lines.append(
                f"| {r['target']} | {r['lanes']} | {r['used']} / {r['runs']} | "
                f"{_md(r['interactivity'], '{:.0f}')} | {_mr(r['completed'], '{:.0f}')} | "
                f"{_mr(r['completion_mean_s'], '{:.1f}')} | {size} | "
                f"{_mr(r['short_ttft_p99_s'], '{:.2f}')} | "
                f"{_mr(r['tokens_per_gpu_s'], '{:,.0f}')} | "
                f"{r['overtaken']} / {r['calls']}, {mx} | {_mr(r['preemptions'], '{:.0f}')} |"
            )
        lines.append("")
        for v in t["vs"]:
            per = "; ".join(
                f"{label} {' / '.join(f'{x:.2f}' for x in xs) or '–'}"
                + (f" (median **{statistics.median(xs):.2f}×**)" if xs else "")
                for label, xs in v["ratios"].items()
            )
            left = f"; unpaired seeds {v['unpaired']}" if v["unpaired"] else ""
            lines.append(
                f"- {ours} ÷ {v['other']} ({v['lanes']} lanes), seeds "
                f"{', '.join(map(str, v['seeds']))}: {per}{left}"
            )
        lines += [f"Overtaken past the bound: {t['bound_s']:g} s (an upper bound of breaches)", ""]
    return "\n".join(lines)


def _md(v: dict[str, float] | None, spec: str) -> str:
    return spec.format(v["median"]) if v else "–"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.report.yardstick", description=__doc__)
    ap.add_argument("out", nargs="+", type=Path, help="kvroute bench --out folder(s)")
    ap.add_argument("--ours", default=OURS, help=f"the target set against the peers ({OURS})")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--sessions", action="store_true",
                    help="issue 47's session table (completion by size class, short sessions' "
                    "TTFT p99, calls overtaken past the priority bound) instead")  # fmt: skip
    a = ap.parse_args(argv)
    try:
        by_truth = load_runs(a.out)
    except (FileNotFoundError, json.JSONDecodeError) as e:
        print(f"yardstick: {e}", file=sys.stderr)
        return 2
    if a.sessions:
        print(sessions_markdown(by_truth, a.ours))
        if a.json:
            a.json.write_text(json.dumps(
                {t: sessions_table(p, a.ours) for t, p in by_truth.items()}, indent=1
            ))  # fmt: skip
        return 0
    print(markdown(by_truth, a.ours))
    if a.json:
        a.json.write_text(json.dumps({t: table(p, a.ours) for t, p in by_truth.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
