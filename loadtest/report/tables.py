"""Rich tables of replay summaries (one row per target/point). Must not import the router."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

COLUMNS = [
    ("p90_interactivity_tok_s", "P90 tok/s/user", "{:.1f}"),
    ("tokens_per_gpu_s", "tok/GPU·s", "{:,.0f}"),
    ("ttft_p50_s", "TTFT p50", "{:.2f}"),
    ("ttft_p90_s", "TTFT p90", "{:.2f}"),
    ("ttft_p99_s", "TTFT p99", "{:.2f}"),
    ("session_completion_p90_s", "session p90", "{:.0f}"),
    ("cache_hit_ratio", "hit", "{:.0%}"),
    ("cache_hit_bound", "bound", "{:.0%}"),
    ("requests_ok", "ok", "{}"),
    ("requests_failed", "failed", "{}"),
]


def fmt(v: Any, spec: str) -> str:
    if v is None:
        return "–"
    try:
        return spec.format(v)
    except (ValueError, TypeError):
        return str(v)


def print_summary(rows: Mapping[str, Mapping[str, Any]], title: str = "AgentX metrics") -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, caption="times in modelled seconds")
    t.add_column("target", no_wrap=True)
    for _, head, _ in COLUMNS:
        t.add_column(head, justify="right")
    for name, s in rows.items():
        t.add_row(name, *(fmt(s.get(k), spec) for k, _, spec in COLUMNS))
    console = Console()
    console.width = max(console.width, 140)  # never squeeze the table into 80 columns
    console.print(t)


AGGREGATE_COLUMNS = [
    ("tokens_per_gpu_s", "tok/GPU·s", "{:,.0f}"),
    ("p90_interactivity_tok_s", "P90 tok/s/user", "{:.1f}"),
    ("ttft_p90_s", "TTFT p90", "{:.2f}"),
    ("session_completion_p90_s", "session p90", "{:.0f}"),
    ("cache_hit_ratio", "hit", "{:.0%}"),
    ("requests_ok", "ok", "{:.0f}"),
]


def median_range(v: Mapping[str, Any] | None, spec: str) -> str:
    """``median [min–max]`` of an aggregate cell."""
    if not v:
        return "–"
    return f"{fmt(v['median'], spec)} \\[{fmt(v['min'], spec)}–{fmt(v['max'], spec)}]"


def print_aggregate(rows: list[Mapping[str, Any]], title: str = "over seeds") -> None:
    """Per target and concurrency: median [min–max] over the seeds' unsaturated points."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, caption="median \\[min–max] over seeds; CPU-saturated points left out")
    t.add_column("target", no_wrap=True)
    t.add_column("used/runs", justify="right")
    for _, head, _ in AGGREGATE_COLUMNS:
        t.add_column(head, justify="right")
    t.add_column("TTFT p90 pooled", justify="right")  # over the seeds' calls together
    for r in rows:
        t.add_row(
            f"{r['target']} c={r['concurrency']}",
            f"{r['used']}/{r['points']}",
            *(median_range(r.get(k), spec) for k, _, spec in AGGREGATE_COLUMNS),
            fmt(r.get("ttft_p90_pooled_s"), "{:.2f}"),
        )
    console = Console()
    console.width = max(console.width, 160)
    console.print(t)


def print_line(line: Mapping[str, Any], title: str = "at the line") -> None:
    """Each target's line figure, measured and interpolated side by side
    (:func:`loadtest.line.line_figure`), then ours against the best other target."""
    from rich.console import Console
    from rich.table import Table

    figs = line.get("figures") or {}
    if not figs:
        return
    t = Table(title=f"{title}: P90 interactivity >= {line.get('line_tok_s', 50):g} tok/s/user",
              caption="medians over seeds; interpolated between the lane counts that bracket "
              "the crossing; flagged where they are > 12.5% apart")  # fmt: skip
    for head in ("target", "measured tok/GPU·s", "at lanes", "interpolated", "crossing lanes",
                 "fine at the line"):  # fmt: skip
        t.add_column(head, justify="left" if head == "target" else "right")
    for name, f in figs.items():
        t.add_row(name, fmt(f.get("measured"), "{:,.0f}"), fmt(f.get("measured_lanes"), "{}"),
                  fmt(f.get("interpolated"), "{:,.0f}"), fmt(f.get("crossing_lanes"), "{:.1f}"),
                  "yes" if f.get("ok") else f"no: {f.get('why')}")  # fmt: skip
    console = Console()
    console.width = max(console.width, 160)
    console.print(t)
    for k, v in line.items():
        if "_vs_best_" in k:
            console.print(f"  {k}: {v}")
