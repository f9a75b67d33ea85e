"""A self-contained HTML report of a sweep (plots embedded as base64 PNG, no network).

Owns: :func:`build_report` — reads a sweep folder's ``results.json`` and each point's
``calls.jsonl``, draws the plots (:mod:`loadtest.report.plots`) and writes ``report.html``
next to them. Must not import the router.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from loadtest.replay.records import CallRecord, QueueSample, read_jsonl
from loadtest.report import plots
from loadtest.report.tables import COLUMNS, fmt


def _img(p: Path) -> str:
    b64 = base64.b64encode(p.read_bytes()).decode()
    return f'<img alt="{html.escape(p.stem)}" src="data:image/png;base64,{b64}">'


def ttfts_at(results: dict[str, Any], root: Path, concurrency: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for p in results["points"]:
        if p["concurrency"] != concurrency or not p.get("summary") or not p.get("dir"):
            continue
        f = root / p["dir"] / "calls.jsonl"
        if f.exists():
            sp = float(p["summary"].get("speedup", 1.0))
            out.setdefault(p["target"], []).extend(  # every seed's calls together
                c.ttft_s * sp for c in read_jsonl(f, CallRecord) if c.ok and c.ttft_s is not None
            )
    return out


def queues_at(
    results: dict[str, Any], root: Path, concurrency: int
) -> tuple[dict[str, list[tuple[float, float, float | None]]], float]:
    out: dict[str, list[tuple[float, float, float | None]]] = {}
    speedup = 1.0
    for p in results["points"]:
        if p["concurrency"] != concurrency or not p.get("summary") or not p.get("dir"):
            continue
        f = root / p["dir"] / "queue.jsonl"
        if f.exists():
            speedup = float(p["summary"].get("speedup", 1.0))
            out[p["target"]] = [(q.t, q.in_flight, q.waiting) for q in read_jsonl(f, QueueSample)]
    return out, speedup


def build_report(root: str | Path) -> Path:
    root = Path(root)
    results = json.loads((root / "results.json").read_text())
    points = results["points"]
    figs = []
    ok = [p for p in points if p.get("summary")]
    if ok:
        figs.append(plots.pareto(points, root / "pareto.png"))
        figs.append(plots.hit_bars(points, root / "hit_ratio.png"))
        top = max(p["concurrency"] for p in ok)
        figs.append(
            plots.ttft_cdf(
                ttfts_at(results, root, top),
                root / "ttft_cdf.png",
                title=f"TTFT CDF at concurrency {top}",
            )
        )
        queues, speedup = queues_at(results, root, top)
        figs.append(
            plots.queue_depth(
                queues,
                root / "queue_depth.png",
                speedup,
                title=f"Queue depth over time at concurrency {top}",
            )
        )
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h, _ in COLUMNS)
    rows = []
    for p in points:
        s = p.get("summary")
        cells = (
            "".join(f"<td>{html.escape(fmt(s.get(k), spec))}</td>" for k, _, spec in COLUMNS)
            if s
            else f'<td colspan="{len(COLUMNS)}">failed: {html.escape(str(p.get("error")))}</td>'
        )
        seed = "" if p.get("seed") is None else str(p["seed"])
        cpu = p.get("cpu") or {}
        mark = "saturated: " + "; ".join(cpu.get("why", [])) if cpu.get("saturated") else ""
        rows.append(
            f"<tr><td>{html.escape(p['target'])}</td><td>{p['concurrency']}</td>"
            f"<td>{seed}</td>{cells}<td>{html.escape(mark)}</td></tr>"
        )
    cfg = results.get("config", {})
    notes = results.get("notes", [])
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>kvroute replay report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; font-size: 13px; }}
td, th {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
img {{ max-width: 48%; margin: 0.5em; border: 1px solid #eee; }}
pre {{ background: #f6f6f6; padding: 1em; font-size: 12px; }}
</style></head><body>
<h1>kvroute replay report</h1>
<p>Trace <b>{html.escape(str(cfg.get("trace")))}</b> on {cfg.get("replicas")} ×
{html.escape(str(cfg.get("profile")))} replica twins (speedup {cfg.get("speedup")}; all
times are scaled back to modelled seconds). Machine: {html.escape(str(results.get("machine")))}.
</p>
<p>Truth (the twins' engine timing, which no router is told):
<b>{html.escape(str(cfg.get("truth", "costmodel (before issue 42)")))}</b>; kvroute's KV
policies price with the profile
<b>{html.escape(str(cfg.get("router_profile", cfg.get("profile"))))}</b> and calibrate online.</p>
<ul>{"".join(f"<li>{html.escape(n)}</li>" for n in notes)}</ul>
<h2>Results</h2>
<table><tr><th>target</th><th>concurrency</th><th>seed</th>{head}<th>CPU</th></tr>
{"".join(rows)}</table>
<h2>Plots</h2>
{"".join(_img(f) for f in figs)}
<h2>Configuration</h2>
<pre>{html.escape(json.dumps(cfg, indent=1))}</pre>
<p>Command: <code>{html.escape(str(results.get("command")))}</code></p>
</body></html>
"""
    out = root / "report.html"
    out.write_text(page)
    return out
