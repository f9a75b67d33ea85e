"""PNG plots of sweep results (matplotlib, Agg backend: no display needed).

Owns: :func:`pareto` (tokens per GPU-second vs P90 interactivity, one curve per target over
concurrency, with the 50 tok/s/user line), :func:`hit_bars` (token cache-hit ratio per target
next to the unlimited-cache bound) and :func:`ttft_cdf` (TTFT distribution per target).
Input: the ``points`` of a sweep's ``results.json``. Must not import the router.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(
    plt: Any,
    fig: Any,
    ax: Any,
    path: Path,
    title: str,
    *,
    grid: bool = True,
    legend_size: int = 8,
) -> None:
    """Title, grid, legend, write the PNG and free the figure (common to every plot)."""
    ax.set_title(title)
    if grid:
        ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _by_target(points: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    out: dict[str, list[Mapping[str, Any]]] = {}
    for p in points:
        if p.get("summary"):
            out.setdefault(str(p["target"]), []).append(p)
    for v in out.values():
        v.sort(key=lambda p: p["concurrency"])
    return out


def pareto(points: Sequence[Mapping[str, Any]], path: Path, line_tok_s: float = 50.0) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for target, pts in _by_target(points).items():
        xy = [
            (
                p["summary"].get("p90_interactivity_tok_s"),
                p["summary"].get("tokens_per_gpu_s"),
                p["concurrency"],
            )
            for p in pts
        ]
        xy = [t for t in xy if t[0] is not None and t[1] is not None]
        if not xy:
            continue
        ax.plot([t[0] for t in xy], [t[1] for t in xy], marker="o", label=target)
        for x, y, c in xy:
            ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axvline(line_tok_s, color="grey", linestyle="--", linewidth=1)
    ax.text(
        line_tok_s,
        ax.get_ylim()[1],
        f" {line_tok_s:g} tok/s/user",
        va="top",
        fontsize=8,
        color="grey",
    )
    ax.set_xlabel("P90 interactivity (tok/s per user)")
    ax.set_ylabel("throughput (tokens per GPU-second)")
    _finish(plt, fig, ax, path, "Pareto: throughput vs interactivity over concurrency")
    return path


def hit_bars(points: Sequence[Mapping[str, Any]], path: Path) -> Path:
    plt = _plt()
    by = _by_target(points)
    conc = sorted({p["concurrency"] for v in by.values() for p in v})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(by))
    for i, (target, pts) in enumerate(by.items()):
        m = {p["concurrency"]: p["summary"] for p in pts}
        xs = [j + i * width for j in range(len(conc))]
        hits = [(m.get(c) or {}).get("cache_hit_ratio") or 0.0 for c in conc]
        bounds = [(m.get(c) or {}).get("cache_hit_bound") or 0.0 for c in conc]
        ax.bar(xs, hits, width, label=target)
        ax.scatter(xs, bounds, marker="_", s=200, color="black", zorder=3)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(conc))], [f"c={c}" for c in conc])
    ax.set_ylim(0, 1)
    ax.set_ylabel("token cache-hit ratio (— = unlimited-cache bound)")
    _finish(plt, fig, ax, path, "Prefix-cache hits by target", grid=False)
    return path


def ttft_cdf(ttfts: Mapping[str, Sequence[float]], path: Path, title: str = "TTFT") -> Path:
    import numpy as np

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for target, xs in ttfts.items():
        if not xs:
            continue
        v = np.sort(np.asarray(xs, dtype=float))
        ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=target)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, modelled time)")
    ax.set_ylabel("fraction of calls")
    _finish(plt, fig, ax, path, title)
    return path


def queue_depth(
    series: Mapping[str, Sequence[tuple[float, float, float | None]]],
    path: Path,
    speedup: float = 1.0,
    title: str = "Queue depth over time",
) -> Path:
    """Per target: the client's in-flight calls (solid) and the engines' waiting queue summed
    over replicas (dashed, when scraped), against modelled time."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (target, pts) in enumerate(series.items()):
        if not pts:
            continue
        color = f"C{i % 10}"
        t = [p[0] * speedup for p in pts]
        ax.step(t, [p[1] for p in pts], where="post", color=color, label=f"{target} in flight")
        w = [(p[0] * speedup, p[2]) for p in pts if p[2] is not None]
        if w:
            ax.step(
                [x for x, _ in w],
                [y for _, y in w],
                where="post",
                color=color,
                linestyle="--",
                label=f"{target} waiting",
            )
    ax.set_xlabel("time (s, modelled)")
    ax.set_ylabel("requests")
    _finish(plt, fig, ax, path, title, legend_size=7)
    return path
