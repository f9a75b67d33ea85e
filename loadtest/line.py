"""The line figure: one rule for every policy's throughput at the interactivity line.

Owns: :func:`line_figure` (a policy's figure from its points along a lane sweep),
:func:`compare_at_line` (ours against the best peer, by the same rule for all), the lane-grid
helpers :func:`lane_grid` / :func:`parse_lanes` / :func:`refine_lanes`, and the rule's
constants. Every caller that quotes a "line" figure (the simulator yardstick
:mod:`loadtest.bench.bench_kv_policy` and the pressure benchmark that reads its rows,
``kvroute bench``'s results) goes through :func:`line_figure`. Pure: no I/O.

**The rule.** "The line" is P90 interactivity (1000 / P90 TPOT ms, tok/s per user) ≥
:data:`LINE_TOK_S`. A policy's line figure is two numbers side by side:

* **measured**: its best measured point (tokens per GPU-second) with P90 interactivity at or
  above the line, and the lanes it ran at;
* **interpolated**: where its curve crosses the line — linear in P90 interactivity between the
  two neighbouring lane counts that bracket the crossing (the last at or above the line after
  the measured point, the first below it), or the measured figure if that is higher.

Either is trusted only where the grid is **fine at the line**: the two lane counts that bracket
the crossing differ by at most :data:`MAX_STEP` (12.5%) of the larger — 32 → 36 lanes passes,
28 → 32 passes, 24 → 28 (14%) does not — or are adjacent integers. Otherwise the figure is
flagged (``ok`` false, ``why`` says what to run), and so is a policy whose points never reach
the line, or never leave it (every point above: the crossing lies past the grid). A ratio
between policies is "for all or none": the measured ratios carry the flag of any policy in
the comparison, and the interpolated ratio is given only when every policy's crossing was
bracketed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

LINE_TOK_S = 50.0  # P90 interactivity, tok/s per user
MAX_STEP = 0.125  # neighbouring lane counts at the line differ by at most this share of the larger


@dataclass(frozen=True)
class LinePoint:
    """One point of a lane sweep (medians over seeds, or one run)."""

    lanes: int
    p90_interactivity: float  # tok/s per user; NaN counts as below the line
    tok_per_gpu_s: float


@dataclass(frozen=True)
class LineFigure:
    measured: float | None  # best measured tok/GPU-s at or above the line
    measured_lanes: int | None
    interpolated: float | None  # the crossing (or measured, if higher); None: not bracketed
    crossing_lanes: float | None  # lanes where the curve crosses the line (interpolated)
    bracket: tuple[int, int] | None  # (last lanes at/above the line, first below)
    step: float | None  # the bracket's lane step, as a share of its larger end
    ok: bool  # bracketed and fine enough at the line
    why: str  # "" when ok: else what is wrong and what to run

    def as_dict(self, nd: int = 0) -> dict:
        d = asdict(self)
        for k in ("measured", "interpolated"):
            if d[k] is not None:
                d[k] = round(d[k], nd) if nd else round(d[k])
        if d["crossing_lanes"] is not None:
            d["crossing_lanes"] = round(d["crossing_lanes"], 1)
        if d["step"] is not None:
            d["step"] = round(d["step"], 3)
        d["bracket"] = list(d["bracket"]) if d["bracket"] else None
        return d


def grid_step(a: int, b: int) -> float:
    """How far apart two lane counts are, as a share of the larger (0 ≤ step < 1)."""
    lo, hi = sorted((a, b))
    return (hi - lo) / hi if hi > 0 else 0.0


def fine_enough(a: int, b: int, max_step: float = MAX_STEP) -> bool:
    """Whether neighbours ``a`` and ``b`` resolve the line: ≤ ``max_step`` apart, or adjacent
    integers (nothing runs between 4 and 5 lanes)."""
    return abs(b - a) <= 1 or grid_step(a, b) <= max_step + 1e-12


def lane_grid(lo: int, hi: int, max_step: float = MAX_STEP) -> list[int]:
    """Lane counts from ``lo`` to ``hi`` (both in) whose neighbours are :func:`fine_enough`:
    each the largest integer within ``max_step`` of the next. ``lane_grid(16, 48)`` is 16, 18,
    20, 22, 25, 28, 32, 36, 41, 46, 48."""
    if lo < 1 or hi < lo:
        raise ValueError(f"lane grid needs 1 <= lo <= hi, got {lo}..{hi}")
    if not 0 < max_step < 1:
        raise ValueError("max_step must lie in (0, 1)")
    out = [lo]
    while out[-1] < hi:
        cur = out[-1]
        nxt = max(cur + 1, math.floor(cur / (1.0 - max_step) + 1e-9))
        out.append(min(nxt, hi))
    return out


def parse_lanes(spec: str, max_step: float = MAX_STEP) -> list[int]:
    """``"16:48"`` → :func:`lane_grid` (16, 48); ``"4,8,16"`` → those lane counts; both may be
    mixed (``"4,8,16:32"``). Sorted, without repeats."""
    out: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        try:
            if ":" in part:
                a, b = part.split(":", 1)
                out.update(lane_grid(int(a), int(b), max_step))
            else:
                n = int(part)
                if n < 1:
                    raise ValueError
                out.add(n)
        except ValueError:
            raise ValueError(f"bad lanes {part!r}: N, or LO:HI for a fine grid") from None
    if not out:
        raise ValueError("no lanes given")
    return sorted(out)


def _below(inter: float, line: float) -> bool:
    return not inter >= line  # NaN: below


def line_figure(
    points: Iterable[LinePoint | tuple[int, float, float]],
    line: float = LINE_TOK_S,
    max_step: float = MAX_STEP,
) -> LineFigure:
    """A policy's line figure from its sweep points (any order; one point per lane count):
    ``LinePoint`` or ``(lanes, p90 interactivity, tok/GPU-s)``. See the module docstring."""
    pts = sorted((p if isinstance(p, LinePoint) else LinePoint(*p) for p in points),
                 key=lambda p: p.lanes)  # fmt: skip
    if len({p.lanes for p in pts}) != len(pts):
        raise ValueError("one point per lane count")
    above = [i for i, p in enumerate(pts) if not _below(p.p90_interactivity, line)]
    if not pts or not above:
        lowest = f" (lowest: {pts[0].lanes} lanes)" if pts else ""
        return LineFigure(None, None, None, None, None, None, False,
                          f"no point reaches the line{lowest}: run fewer lanes")  # fmt: skip
    m = max(above, key=lambda i: pts[i].tok_per_gpu_s)
    measured, measured_lanes = pts[m].tok_per_gpu_s, pts[m].lanes
    j = next((k for k in range(m + 1, len(pts)) if _below(pts[k].p90_interactivity, line)), None)
    if j is None:
        return LineFigure(measured, measured_lanes, None, None, None, None, False,
                          f"every point from {measured_lanes} lanes up is above the line: "
                          f"run past {pts[-1].lanes} lanes")  # fmt: skip
    a, b = pts[j - 1], pts[j]
    bracket = (a.lanes, b.lanes)
    step = grid_step(*bracket)
    crossing = crossing_lanes = None
    if b.p90_interactivity == b.p90_interactivity:  # not NaN: interpolate
        frac = (a.p90_interactivity - line) / (a.p90_interactivity - b.p90_interactivity)
        crossing = a.tok_per_gpu_s + frac * (b.tok_per_gpu_s - a.tok_per_gpu_s)
        crossing_lanes = a.lanes + frac * (b.lanes - a.lanes)
    else:  # nothing measured past a: the curve stops there
        crossing, crossing_lanes = a.tok_per_gpu_s, float(a.lanes)
    interpolated = max(measured, crossing)
    ok = fine_enough(*bracket, max_step=max_step)
    why = (
        ""
        if ok
        else f"grid too coarse at the line: {bracket[0]} -> {bracket[1]} lanes "
        f"({step:.0%} > {max_step:.1%}); run lanes between them"
    )
    return LineFigure(measured, measured_lanes, interpolated, crossing_lanes, bracket, step, ok,
                      why)  # fmt: skip


def refine_lanes(
    fig: LineFigure, lanes: Sequence[int], max_step: float = MAX_STEP, max_lanes: int = 4096
) -> list[int]:
    """The lane counts to run next so that ``fig`` becomes fine at the line (empty: nothing
    to add): the geometric middle of a coarse bracket; past the top of the grid by one fine
    step when every point is above the line; below the bottom by one step when none reaches it
    (not under 1 lane). ``lanes``: what already ran."""
    done = set(lanes)
    if fig.ok:
        return []
    if fig.bracket is not None:
        lo, hi = fig.bracket
        mid = round(math.sqrt(lo * hi))
        mid = min(max(mid, lo + 1), hi - 1)
        return [] if mid in done or not lo < mid < hi else [mid]
    if not lanes:
        return []
    if fig.measured is not None:  # above the line everywhere: extend upwards
        top = max(lanes)
        nxt = min(max(top + 1, math.floor(top / (1.0 - max_step) + 1e-9)), max_lanes)
        return [] if nxt in done or nxt <= top else [nxt]
    bottom = min(lanes)  # never at the line: extend downwards
    nxt = min(bottom - 1, math.ceil(bottom * (1.0 - max_step) - 1e-9))
    return [] if nxt < 1 or nxt in done else [nxt]


def compare_at_line(figures: Mapping[str, LineFigure], ours: Sequence[str]) -> dict[str, object]:
    """Each of ``ours`` against the best of the other policies (the peers), by one rule for
    all: ``{mine}_vs_best_measured`` and ``{mine}_vs_best_interpolated`` ("1.05x vs sglang_tree",
    or why not comparable), ``line_ok`` (every figure fine at the line) and ``line_flags`` (each
    flagged policy's reason). A measured ratio is marked "(grid too coarse)" unless every
    figure is ok; an interpolated ratio is given only when every policy's crossing was
    bracketed (for all or none)."""
    flags = {p: f.why for p, f in figures.items() if not f.ok}
    out: dict[str, object] = {"line_ok": not flags, "line_flags": flags}
    all_bracketed = all(f.interpolated is not None for f in figures.values())
    for kind in ("measured", "interpolated"):
        vals = {p: getattr(f, kind) for p, f in figures.items()}
        peers = {p: v for p, v in vals.items() if p not in ours and v is not None}
        for mine in ours:
            if mine not in figures:
                continue
            key = f"{mine}_vs_best_{kind}"
            if kind == "interpolated" and not all_bracketed:
                out[key] = "not comparable (a crossing lies outside its grid: see line_flags)"
                continue
            v = vals[mine]
            if v is None or not peers:
                out[key] = "not comparable (a policy never reached the line)"
                continue
            top = max(peers, key=lambda p: peers[p])
            note = "" if not flags else " (grid too coarse at the line: see line_flags)"
            out[key] = f"{v / peers[top]:.2f}x vs {top}{note}"
    return out
