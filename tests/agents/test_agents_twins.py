"""Each agent CLI for two turns of one session through kvroute in front of two replica twins:
both turns complete (exit 0, the CLI's own result says so), every call of the session lands on
one replica (kvroute's decision log), kvroute recognises the CLI's session header on every call,
and ``/metrics``'s prompt and cached token counts equal the usage the CLI was told (read at a
recording proxy in front of kvroute). Codex speaks Responses, Claude Code Anthropic Messages,
OpenCode chat completions."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.agents.clis import AGENTS
from loadtest.agents.session import agent_session
from loadtest.twin.cluster import start_cluster
from router.app import build_app, start_site
from router.config import RouterConfig

pytestmark = pytest.mark.timeout(300)
PROMPTS = ["list the files in this folder", "now read README.md and summarise it"]


@pytest.mark.parametrize("name", list(AGENTS))
async def test_two_turns_of_one_session_on_twins(name: str, agent_bin: Path,
                                                 tmp_path: Path) -> None:  # fmt: skip
    log = tmp_path / "decisions.jsonl"
    # the demo's replicas (a 70B-class model on H200: a context window agents fit in)
    async with start_cluster(2, "h200-70b-fp8", speedup=20.0) as c:
        app = build_app(RouterConfig(replicas=list(c.urls), decision_log=str(log),
                                     health_interval_s=30, metrics_interval_s=30))  # fmt: skip
        runner, url = await start_site(app)
        try:
            report = await agent_session(AGENTS[name], agent_bin, tmp_path / "home", url,
                                         PROMPTS, decision_log=log)  # fmt: skip
        finally:
            await runner.cleanup()
    assert report.inference and all(c.path == AGENTS[name].api for c in report.inference)
    assert len(report.decisions) == len(report.inference)  # every call was placed, and logged
    assert not report.problems(expect_turns=len(PROMPTS)), report.problems(expect_turns=2)


@pytest.mark.timeout(400)
def test_demo_agent_leg_prints_every_call(agent_bin: Path, tmp_path: Path, capsys) -> None:
    """`kvroute demo --agent claude`'s leg: the demo's cluster (4 twins, KV events) and kvroute
    as processes, the CLI's three-turn task, one printed row per call with its replica."""
    from loadtest.agents.demo import TASK, print_agent_table, run_agent_leg

    report, names = run_agent_leg("claude", policy="kv_cost", workdir=tmp_path)
    print_agent_table(report, 10.0, names)
    out = capsys.readouterr().out
    assert not report.problems(expect_turns=len(TASK)), report.problems(expect_turns=3)
    assert len(report.rows()) == len(report.inference) >= len(TASK)
    # one row per call, naming its replica (a subagent Claude spawns may run on another one)
    rows = sum(out.count(f"│ {names[r]} ") for r in report.replicas())
    assert rows == len(report.inference)
    assert out.count("completed") == len(TASK)
    assert "kvroute's token counts equal what the agent was told" in out
