"""Where a router's calls went and what it cost: placement measurements from a sweep's calls.

    .venv/bin/python -m loadtest.report.diagnose OUT [OUT ...]   # kvroute bench --out dirs

Reads every point's ``calls.jsonl`` (the replay's records: start, end, TTFT, prompt and cached
tokens, the replica that served the call) and measures, per target over its seeds, the
candidate causes of a routing loss that a client can see:

* **imbalance at placement** — for each call, the calls in flight on the replica it went to
  minus the fewest in flight on any replica at that moment (from the records themselves, so
  the same for every router); ``placed_busier_2`` is the share placed where another replica
  had at least 2 fewer;
* **moves** — a session's call served by another replica than its previous call; their hit
  ratio and TTFT beside those of calls that stayed (a move that loses its prefix pays the
  recompute);
* **cold calls** — first calls of a session (nothing to hit): their TTFT p90;
* **replica occupancy** — busy seconds (sum of call durations) per replica, max over min;
* **the TTFT tail** — the slowest calls with their prompt, cached share and the imbalance at
  their placement;
* **what drove kvroute's moves** — from the point's ``decisions.jsonl`` (the router's
  decision log, :mod:`router.decisionlog`, which ``kvroute bench`` turns on for kvroute
  targets): for each call placed off its session's replica, the cost term that favoured the
  winner most (sticky replica's term minus the winner's), counted by term;
* **how far the P90 interactivity can be trusted** — the point's P90 interactivity (1 / P90
  TPOT, calls after the run's warm-up) with a 90% bootstrap interval from resampling its own
  calls (:func:`interactivity_interval`). A ~150-call point's P90 is its ~15th-slowest call;
  two routers whose intervals overlap are not told apart by that point.

Times are the records' run-clock seconds scaled to modelled seconds by the point's speedup.
Must not import the router.
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from costmodel.placement import CostTerms
from loadtest.replay.records import CallRecord, read_jsonl


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def _inflight_at(calls: list[CallRecord]) -> dict[str, tuple[list[float], list[float]]]:
    """Per replica: sorted starts and sorted ends (in flight at t = starts<t - ends<t)."""
    by: dict[str, tuple[list[float], list[float]]] = {}
    for c in calls:
        if c.replica is None:
            continue
        s, e = by.setdefault(c.replica, ([], []))
        s.append(c.t_start)
        e.append(c.t_end)
    for s, e in by.values():
        s.sort()
        e.sort()
    return by


def point_measures(calls: list[CallRecord], speedup: float = 1.0) -> dict[str, Any]:
    """The measurements of one point (see the module docstring)."""
    served = [c for c in calls if c.replica is not None]
    ok = [c for c in served if c.ok and c.ttft_s is not None]
    inflight = _inflight_at(served)
    reps = sorted(inflight)

    def count(rep: str, t: float) -> int:
        s, e = inflight[rep]
        return bisect.bisect_left(s, t) - bisect.bisect_right(e, t)

    extra = []
    for c in ok:
        n = {r: count(r, c.t_start) for r in reps}
        extra.append(n[c.replica] - min(n.values()) if c.replica in n else 0)
    prev: dict[tuple[str, int, str], str] = {}
    moved, stayed, cold = [], [], []
    for c in sorted(ok, key=lambda c: c.t_start):
        key = (c.session, c.play, c.agent)
        was = prev.get(key)
        if was is None:
            cold.append(c)
        elif was != c.replica:
            moved.append(c)
        else:
            stayed.append(c)
        prev[key] = c.replica or ""

    def hit(cs: list[CallRecord]) -> float | None:
        p = sum(c.prompt_tokens for c in cs)
        return sum(c.cached_tokens or 0 for c in cs) / p if p else None

    def ttft(cs: list[CallRecord], q: float) -> float | None:
        v = _pct([c.ttft_s * speedup for c in cs if c.ttft_s is not None], q)
        return v

    busy: dict[str, float] = defaultdict(float)
    for c in served:
        busy[c.replica or "?"] += (c.t_end - c.t_start) * speedup
    occ = sorted(busy.values())
    tail = sorted(zip(ok, extra, strict=True), key=lambda x: -(x[0].ttft_s or 0.0))[:5]
    return {
        "calls": len(ok),
        "per_replica": {r: sum(1 for c in ok if c.replica == r) for r in reps},
        "imbalance_mean": statistics.fmean(extra) if extra else None,
        "placed_busier_2": sum(1 for x in extra if x >= 2) / len(extra) if extra else None,
        "moves": len(moved),
        "move_share": len(moved) / max(1, len(moved) + len(stayed)),
        "hit_moved": hit(moved),
        "hit_stayed": hit(stayed),
        "ttft_p90_moved_s": ttft(moved, 90),
        "ttft_p90_stayed_s": ttft(stayed, 90),
        "ttft_p90_cold_s": ttft(cold, 90),
        "cold_calls": len(cold),
        "occupancy_max_over_min": occ[-1] / occ[0] if len(occ) > 1 and occ[0] > 0 else None,
        "tail": [_tail_row(c, x, speedup) for c, x in tail],
    }


def _tail_row(c: CallRecord, extra: int, speedup: float) -> dict[str, Any]:
    return {
        "ttft_s": round((c.ttft_s or 0.0) * speedup, 2),
        "prompt": c.prompt_tokens,
        "cached": (c.cached_tokens or 0) / max(1, c.prompt_tokens),
        "replica": c.replica,
        "extra_inflight": extra,
    }


# kv_cost's terms, as the decision log names them (router.scheduling.kv_cost)
COST_TERMS = CostTerms.TERMS


def decision_measures(lines: list[dict[str, Any]], scorer: str = "kv_cost") -> dict[str, Any]:
    """Moves the router decided (the winner is not the session's replica), and per move the
    term that favoured the winner most: ``{"decided_moves": n, "move_drivers": {term: n}}``."""
    drivers: dict[str, int] = defaultdict(int)
    moves = 0
    for d in lines:
        sticky, win = d.get("session_replica"), d.get("winner")
        cands = d.get("candidates") or {}
        if not sticky or sticky == win or sticky not in cands or win not in cands:
            continue
        moves += 1
        a, b = cands[sticky].get(scorer) or {}, cands[win].get(scorer) or {}
        gain = {t: (a.get(t) or 0.0) - (b.get(t) or 0.0) for t in COST_TERMS}
        if gain:
            drivers[max(gain, key=lambda t: gain[t])] += 1
    return {"decided_moves": moves, "move_drivers": dict(drivers)}


def interactivity_interval(
    calls: list[CallRecord],
    speedup: float = 1.0,
    warmup_s: float = 0.0,
    resamples: int = 2000,
    seed: int = 0,
) -> dict[str, Any]:
    """P90 interactivity (tok/s per user, modelled time) of a point's calls that started after
    ``warmup_s`` modelled seconds, as ``loadtest.metrics`` computes it (calls with ≥ 2 output
    tokens; a zero TPOT, which no real stream has, is left out so 1 / P90 stays finite), with
    the 5th and 95th percentiles of the same statistic over ``resamples`` bootstrap resamples
    of those calls."""
    w = warmup_s / speedup  # run clock
    kept = [c for c in calls if c.ok and c.tpot_s and c.completion_tokens >= 2 and c.t_start >= w]
    tpot = np.array([(c.tpot_s or 0.0) * speedup for c in kept])
    if len(tpot) == 0:
        return {}
    rng = np.random.default_rng(seed)
    boot = np.percentile(rng.choice(tpot, (resamples, len(tpot))), 90, axis=1)
    lo, hi = np.percentile(1.0 / boot, [5, 95])
    return {"p90_interactivity": float(1.0 / np.percentile(tpot, 90)),
            "p90_interactivity_lo": float(lo), "p90_interactivity_hi": float(hi),
            "tpot_calls": len(tpot)}  # fmt: skip


def sweep_measures(out: Path) -> list[dict[str, Any]]:
    """Per point of a ``kvroute bench`` output folder, its measurements."""
    res = json.loads((out / "results.json").read_text())
    warmup_s = float((res.get("config") or {}).get("warmup_s") or 0.0)
    rows = []
    for p in res["points"]:
        if not p.get("summary") or not p.get("dir"):
            continue
        f = out / p["dir"] / "calls.jsonl"
        if not f.exists():
            continue
        calls = read_jsonl(f, CallRecord)
        speedup = float(p["summary"].get("speedup", 1.0))
        m = point_measures(calls, speedup)
        m.update(interactivity_interval(calls, speedup, warmup_s))
        log = f.with_name("decisions.jsonl")
        if log.exists():
            m.update(decision_measures([json.loads(x) for x in log.read_text().splitlines()]))
        rows.append({"target": p["target"], "concurrency": p["concurrency"],
                     "seed": p.get("seed"), "saturated": (p.get("cpu") or {}).get("saturated"),
                     **m})  # fmt: skip
    return rows


COLUMNS = (
    ("calls", "{:.0f}"),
    ("imbalance_mean", "{:.2f}"),
    ("placed_busier_2", "{:.0%}"),
    ("move_share", "{:.0%}"),
    ("hit_moved", "{:.0%}"),
    ("hit_stayed", "{:.0%}"),
    ("ttft_p90_moved_s", "{:.1f}"),
    ("ttft_p90_stayed_s", "{:.1f}"),
    ("ttft_p90_cold_s", "{:.1f}"),
    ("occupancy_max_over_min", "{:.2f}"),
    ("p90_interactivity", "{:.1f}"),
)


def markdown(rows: list[dict[str, Any]]) -> str:
    """Median over each target's seeds (saturated points left out), one row per target."""
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if not r.get("saturated"):
            by[f"{r['target']} c={r['concurrency']}"].append(r)
    head = "| target | " + " | ".join(k for k, _ in COLUMNS) + " |"
    out = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for t, rs in by.items():
        cells = []
        for k, spec in COLUMNS:
            xs = [r[k] for r in rs if r.get(k) is not None]
            cells.append(spec.format(statistics.median(xs)) if xs else "–")
        out.append(f"| {t} | " + " | ".join(cells) + " |")
        drivers: dict[str, int] = defaultdict(int)
        for r in rs:
            for k, n in (r.get("move_drivers") or {}).items():
                drivers[k] += n
        if drivers:  # summed over the seeds
            ranked = ", ".join(f"{k} {n}" for k, n in sorted(drivers.items(), key=lambda x: -x[1]))
            out.append(f"|  moves driven by (all seeds) | {ranked} |" + " |" * (len(COLUMNS) - 1))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="+", help="kvroute bench --out folders")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    rows = [r for o in a.out for r in sweep_measures(Path(o))]
    print(markdown(rows))
    print("\nP90 interactivity per point, with its 90% bootstrap interval over the point's calls:")
    for r in rows:
        if "p90_interactivity" in r:
            print(f"- {r['target']} c={r['concurrency']} seed {r['seed']}: "
                  f"{r['p90_interactivity']:.1f} [{r['p90_interactivity_lo']:.1f}–"
                  f"{r['p90_interactivity_hi']:.1f}] tok/s ({r['tpot_calls']} calls)")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
