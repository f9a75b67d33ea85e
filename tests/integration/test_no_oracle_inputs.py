"""What the router sees in a benchmark is what it would see from an agent: the recorded
output length of a call never reaches the router's policy, nor a last-call flag — neither
through the HTTP replay nor in the simulator. The length still reaches replica twins (in
``vllm_xargs``, which no router code reads), so the replayed work is the recorded work."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from costmodel.profiles import load_profile
from loadtest import tinymodel
from loadtest.prompts import PromptBuilder
from loadtest.replay.records import CallRecord, read_jsonl
from loadtest.replay.runner import AGENT_MAX_TOKENS, ReplayConfig, replay
from loadtest.sim.router_policy import AGENT_MAX_TOKENS as SIM_MAX_TOKENS
from loadtest.sim.router_policy import RouterPolicy
from loadtest.sim.simulator import Simulator, synthetic_agentx
from loadtest.traces import Call, Dep, Session, Trace
from loadtest.twin import TWIN_OUTPUT_FIELD
from loadtest.twin.cluster import start_cluster
from router.app import build_app, start_site
from router.config import RouterConfig
from router.scheduling.registry import register
from router.sessions import identify

ROUTER = Path(__file__).resolve().parents[2] / "router"
SEEN: list[tuple[dict, bool]] = []  # (body, identity.final) of every call a policy scored


class _Spy:
    name = "test_oracle_spy"

    def score(self, ctx, snap, endpoints):
        SEEN.append((dict(ctx.body), ctx.identity.final))
        return {e.name: 1.0 for e in endpoints}


@register("scorer", "test_oracle_spy")
def _spy() -> _Spy:
    return _Spy()


SPEC = {"scorers": [{"type": "test_oracle_spy", "weight": 1.0}, {"type": "kv_cost", "weight": 1.0}]}


def test_no_router_code_names_the_twin_output_field_or_vllm_xargs():
    """The router cannot read a field it never names: the twins' output field nowhere, and
    ``vllm_xargs`` (where the replay hands it to the twins) only in router/sessions.py, which
    takes vllm-router's ``agentic_context`` from it and nothing else."""
    texts = {p.relative_to(ROUTER).as_posix(): p.read_text() for p in ROUTER.rglob("*.py")}
    assert [f for f, t in texts.items() if TWIN_OUTPUT_FIELD in t] == []
    assert [f for f, t in texts.items() if "vllm_xargs" in t] == ["sessions.py"]
    reads = re.findall(r'xargs\.get\("(\w+)"\)', texts["sessions.py"])
    assert reads == ["agentic_context"]
    # and what the replay puts there never names a session
    body = {"prompt": "x", "vllm_xargs": {TWIN_OUTPUT_FIELD: 7}}
    assert identify({}, body).source == "prefix"


def test_simulated_calls_carry_the_agent_cap_and_no_final_flag():
    SEEN.clear()
    prof = load_profile("h200-70b-fp8-tp4")
    res = Simulator(prof, 2, RouterPolicy(SPEC, prof)).run(synthetic_agentx(6, 120, seed=3))
    outputs = {r.output_tokens for r in res.records}
    assert len(outputs) > 3  # recorded lengths vary ...
    assert len(SEEN) == len(res.records)
    assert {b["max_tokens"] for b, _ in SEEN} == {SIM_MAX_TOKENS}  # ... what the router sees not
    assert set().union(*(b.keys() for b, _ in SEEN)) == {"model", "prompt", "max_tokens"}
    assert not any(final for _, final in SEEN)


@pytest.mark.timeout(120)
async def test_http_replay_sends_the_agent_cap_and_gives_lengths_only_to_twins(tmp_path):
    SEEN.clear()
    outs = {"a": (3, 9), "b": (5, 2), "c": (7, 4)}
    trace = Trace("t", 64, [
        Session(s, [Call(f"{s}/0", "main", (1, 2), 100, o0),
                    Call(f"{s}/1", "main", (1, 2, 3), 160, o1, deps=(Dep(f"{s}/0"),))])
        for s, (o0, o1) in outs.items()
    ])  # fmt: skip
    prof = load_profile("cpu-tiny")
    async with start_cluster(2, prof, speedup=8.0) as c:
        app = build_app(RouterConfig(replicas=c.urls, scheduling=SPEC, health_interval_s=30))
        runner, url = await start_site(app)
        try:
            builder = PromptBuilder(tinymodel.ensure(), block_size=32, trace_block_size=64)
            cfg = ReplayConfig(target=url, model="tiny", concurrency=3, progress=False)
            assert cfg.max_tokens == AGENT_MAX_TOKENS and cfg.output_lengths == "twin"
            await replay(trace, builder, cfg, tmp_path)
        finally:
            await runner.cleanup()
    calls = read_jsonl(tmp_path / "calls.jsonl", CallRecord)
    assert len(calls) == 6 and all(r.ok for r in calls)
    # the twins wrote the recorded lengths ...
    assert sorted(r.completion_tokens for r in calls) == sorted(o for p in outs.values() for o in p)
    # ... while every body the policy saw asked for the agents' cap fitted to the window
    window = prof.model.max_model_len
    caps = sorted(b["max_tokens"] for b, _ in SEEN)
    assert caps == sorted(min(AGENT_MAX_TOKENS, window - r.prompt_tokens) for r in calls)
    assert not any(final for _, final in SEEN)


# ---- the twins' truth (issue 42): the engines' timing never reaches the router -------------

TRUTH_WORDS = ("truth", "nominal", "prefill-slow", "decode-fast-slow-link", "costmodel")


@pytest.mark.parametrize("router_profile", [None, "none"])
def test_the_bench_gives_the_truth_to_the_twins_and_only_a_profile_to_the_router(
    monkeypatch, tmp_path, router_profile
):
    """What ``kvroute bench --truth prefill-slow`` starts: the twin cluster with the truth,
    kvroute with the nominal profile (or ``none``) and no argument or variable that names the
    truth or any of its figures (the decision log's output path aside)."""
    import os

    from loadtest.sweep import bench
    from loadtest.twin.truth import TRUTHS
    from tests.helpers.sweep import STOPPED, fake_sweep_processes

    started = fake_sweep_processes(monkeypatch)
    cfg = bench.SweepConfig(
        trace="t", replicas=2, profile="h200-70b-fp8-tp4", truth="prefill-slow",
        router_profile=router_profile,
    )  # fmt: skip
    point = bench.run_point(cfg, "kvroute:kv_cost", 4, tmp_path, None, None)
    assert STOPPED in point["error"]
    assert point["truth"] == "prefill-slow"
    assert point["router_profile"] == (router_profile or "h200-70b-fp8-tp4")
    (cluster_argv, _), (router_argv, router_env) = started
    assert cluster_argv[cluster_argv.index("--truth") + 1] == "prefill-slow"
    assert cluster_argv[cluster_argv.index("--profile") + 1] == "h200-70b-fp8-tp4"
    # the router: its own arguments and the variables the bench set for it
    given = {k: v for k, v in router_env.items() if os.environ.get(k) != v}
    given.pop("KVROUTE_DECISION_LOG")  # where it writes, under the sweep's output folder
    assert given["KVROUTE_KV_PROFILE"] == (router_profile or "h200-70b-fp8-tp4")
    text = " ".join([*router_argv, *given, *given.values()]).lower()
    assert not [w for w in TRUTH_WORDS if w in text], text
    figures = {f"{v!r}" for t in TRUTHS.values() for v in t.as_dict().values()}
    assert not figures & set(text.split()), figures & set(text.split())


@pytest.mark.timeout(60)
async def test_a_twin_says_nothing_of_its_truth_over_http():
    """A router reads the twins' headers, /metrics and models list: none names the truth."""
    import httpx

    async with start_cluster(1, "cpu-tiny", truth="prefill-slow") as c:
        async with httpx.AsyncClient(base_url=c.urls[0], timeout=20) as h:
            seen = [await h.get("/metrics"), await h.get("/v1/models"), await h.get("/health")]
            body = {"model": "tiny", "prompt": "hi there", "max_tokens": 3}
            seen.append(await h.post("/v1/completions", json=body))
    assert all(r.status_code == 200 for r in seen)
    text = " ".join(f"{r.headers} {r.text}" for r in seen).lower()
    assert not [w for w in ("truth", "prefill-slow", "prefill_slow") if w in text]
