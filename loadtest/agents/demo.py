"""``kvroute demo --agent claude|codex|opencode``: a real agent CLI in front of the demo's cluster.

Owns: the agent leg of the demo — the demo's cluster (4 replica twins of an H200 serving a
70B-class fp8 model, sped up 10×, KV events on) behind kvroute with the demo's policy, a
recording tap in front of kvroute, the agent CLI for a short scripted task (three turns of one
session: look around, read a file, propose a change), then one line per call: the turn, the
route, the replica kvroute chose (its decision log), prompt and cached tokens as the agent was
told, and TTFT. :func:`run_agent_leg` does the work, :func:`print_agent_table` prints it;
:mod:`loadtest.demo` calls both before its replay comparison. Must not import the router package
(the router runs as its own process, as in the replay).
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from loadtest.agents import install
from loadtest.agents.clis import AGENTS
from loadtest.agents.session import SessionReport, agent_session

TASK = [
    "list the files in this folder",
    "read hello.py and explain what it prints",
    "suggest a unit test for greet() in a few lines",
]


def run_agent_leg(
    agent: str,
    *,
    policy: str,
    speedup: float = 10.0,
    replicas: int = 4,
    profile: str = "h200-70b-fp8",
    workdir: Path | None = None,
    prompts: list[str] | None = None,
) -> tuple[SessionReport, dict[str, str]]:
    """Start the demo's cluster and kvroute (``policy``), run the agent's task, stop both;
    returns the report and the twins' names by URL."""
    from costmodel.profiles import load_profile
    from loadtest.sweep.stack import Router, TwinCluster, needs_events

    bin_dir = install.install()  # installs once (npm) when `make agents` has not
    work = Path(workdir or tempfile.mkdtemp(prefix="kvroute-agent-"))
    work.mkdir(parents=True, exist_ok=True)
    target = f"kvroute:{policy}"
    events = "tcp://127.0.0.1:*" if needs_events(target) else None
    log = work / "decisions.jsonl"
    with TwinCluster(replicas, profile, speedup, kv_events=events) as cluster:
        router = Router(target, cluster.urls, cluster.workdir,
                        event_endpoints=cluster.event_endpoints,
                        block_size=load_profile(profile).block_size, profile=profile,
                        speedup=speedup,
                        extra_env={"KVROUTE_DECISION_LOG": str(log)})  # fmt: skip
        names = dict(zip(cluster.urls, cluster.names, strict=True))
        with router:
            report = asyncio.run(agent_session(AGENTS[agent], bin_dir, work / "home",
                                               router.url, prompts or TASK,
                                               decision_log=log))  # fmt: skip
    return report, names


def print_agent_table(report: SessionReport, speedup: float, names: dict[str, str]) -> None:
    """One row per call; ``names``: replica URL -> twin name."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{report.agent} through kvroute: every call of its session",
              caption=f"TTFT: wall clock at the agent (the twins run {speedup:g}× faster than "
                      "the modelled H200: modelled ≈ wall × speedup)")  # fmt: skip
    for head in ("turn", "route", "replica", "prompt tok", "cached tok", "hit", "TTFT",
                 "stop"):  # fmt: skip
        t.add_column(head, justify="left" if head in ("route", "replica", "stop") else "right")
    for r in report.rows():
        hit = f"{r.cached / r.prompt:.0%}" if r.prompt and r.cached is not None else "-"
        ttft = "-" if r.ttft_s is None else f"{r.ttft_s * 1000:.0f} ms"
        t.add_row(str(r.turn + 1), r.route, names.get(r.replica or "", r.replica or "?"),
                  "-" if r.prompt is None else f"{r.prompt:,}",
                  "-" if r.cached is None else f"{r.cached:,}", hit,
                  ttft, r.stop or "-")  # fmt: skip
    console = Console()
    console.width = max(console.width, 120)
    console.print(t)
    for turn in report.turns:
        state = "completed" if turn.ok else f"NOT completed: {turn.why[:300]}"
        console.print(f"turn {turn.index + 1} ({turn.elapsed_s:.1f} s): {state}")
    for src, dst, why in report.moves():
        console.print(f"the session moved {names.get(src, src)} → {names.get(dst, dst)} "
                      f"(move_reason {why}: kvroute's decision log)")  # fmt: skip
    problems = report.problems(expect_turns=len(report.turns), cost_moves=True)
    if problems:
        console.print("[red]" + "\n".join(problems) + "[/]")
    else:
        reps = sorted(names.get(r, r) for r in report.replicas())
        console.print(f"all {len(report.inference)} calls on {', '.join(reps)}; "
                      "kvroute's token counts equal what the agent was told")  # fmt: skip
