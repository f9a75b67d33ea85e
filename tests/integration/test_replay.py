"""End-to-end replay through ``kvroute serve`` against a twin cluster, and a tiny sweep.

Real processes on loopback: ``kvroute cluster`` (twins with the ``cpu-tiny`` profile) and
``kvroute serve`` in front; the replay client drives them over HTTP like any agent would.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from loadtest import tinymodel
from loadtest.metrics import SUMMARY_REQUIRED
from loadtest.prompts import PromptBuilder
from loadtest.replay.records import CallRecord, read_jsonl
from loadtest.replay.runner import ReplayConfig, replay
from loadtest.sweep.bench import SweepConfig, run_sweep
from loadtest.sweep.stack import Router, TwinCluster, cleanup
from loadtest.traces import load_trace

DATA = Path(__file__).resolve().parents[2] / "loadtest" / "data"
TRACE = (
    "synthetic:sessions=6,calls_median=4,calls_sigma=0.2,prefix_tokens=512,"
    "first_user_tokens=128,growth_median=100,output_median=5,gap_median_s=0.02,"
    "subagent_prob=0.3,subagent_calls_median=2,subagent_prefix_tokens=256,"
    "max_context_tokens=2500,seed=11"
)


@pytest.fixture(scope="module")
def stack():
    cluster = TwinCluster(replicas=3, profile="cpu-tiny", speedup=4.0).start()
    # A load factor this high makes the bounded-load affinity strict (never moves a session).
    conf = cluster.workdir / "router.yaml"
    conf.write_text(
        "scheduling:\n  scorers:\n    - {type: session_affinity, weight: 1.0, "
        "params: {load_factor: 1000}}\n"
    )
    router = Router(
        "kvroute:session_affinity",
        cluster.urls,
        cluster.workdir,
        extra_args=["--config", str(conf)],
    ).start()
    yield cluster, router
    router.stop()
    cluster.stop()
    cleanup(cluster.workdir)


@pytest.mark.timeout(90)
async def test_replay_through_kvroute_keeps_sessions_on_one_replica(stack, tmp_path):
    cluster, router = stack
    trace = load_trace(TRACE)
    builder = PromptBuilder(tinymodel.ensure(), block_size=32, trace_block_size=64)
    cfg = ReplayConfig(
        target=router.url,
        concurrency=3,
        convention="claude",
        speedup=4.0,
        time_scale=4.0,
        gpus=3,
        metrics_urls=cluster.metrics_urls,
        queue_sample_s=0.1,
        progress=False,
    )
    summary = await replay(trace, builder, cfg, tmp_path)

    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert all(k in on_disk for k in SUMMARY_REQUIRED)
    assert on_disk["requests_failed"] == 0 and on_disk["requests_ok"] == trace.n_calls
    calls = read_jsonl(tmp_path / "calls.jsonl", CallRecord)
    # The twins tokenize the synthesized chat exactly as predicted.
    assert all(c.prompt_tokens == c.expected_prompt_tokens for c in calls)
    # The router passes the twin's replica header through; session headers pin sessions.
    assert all(c.replica in cluster.names for c in calls)
    per_session: dict[str, set[str]] = defaultdict(set)
    for c in calls:
        if c.agent == "main":
            per_session[c.session].add(c.replica or "")
    assert all(len(v) == 1 for v in per_session.values()), per_session
    # (where they land is the ring's hash of random ports: all six on one replica happens)
    assert all(
        c.cached_tokens is not None and c.cached_tokens <= c.bound_cached_tokens for c in calls
    )
    assert summary["cache_hit_ratio"] > 0.3
    assert summary["waiting_p90"] is not None  # twins' vllm:num_requests_waiting scraped
    assert summary["speedup"] == 4.0 and summary["sessions_completed"] == len(trace.sessions)
    # The DAG was honoured: every call started after each dependency ended plus its delay
    # (scaled by time_scale), including subagent spawns and join gates.
    by_key = {(c.session, c.call): c for c in calls}
    joins = 0
    for s in trace.sessions:
        for call in s.calls:
            rec = by_key[(s.id, call.id)]
            for d in call.deps:
                dep = by_key[(s.id, d.call)]
                assert rec.t_start >= dep.t_end + d.delay_s / 4.0 - 0.005, (call.id, d)
                joins += dep.agent != call.agent and call.agent == "main"
    assert joins >= 1  # the trace has subagents joining their parent


@pytest.mark.timeout(90)
def test_sweep_writes_results_plots_and_a_self_contained_report(tmp_path):
    cfg = SweepConfig(
        trace=TRACE,
        targets=["kvroute:round_robin", "sglang:not_a_policy"],
        concurrency=[2],
        duration_s=3.0,
        grace_s=2.0,
        replicas=2,
        profile="cpu-tiny",
        speedup=4.0,
        progress=False,
    )
    cfg.seeds = [0, 1]
    cfg.warmup_s = 2.0  # modelled seconds: 0.5 s of the run's clock at speedup 4
    res = run_sweep(cfg, tmp_path, command="test")
    ok, ok1, bad, _bad1 = res["points"]
    assert ok["summary"]["requests_ok"] > 0 and ok["summary"]["requests_failed"] == 0
    assert "unknown router" in bad["error"]  # a broken target degrades to an error row
    placed = ok["router_metrics"]["kvroute_session_placements_total"]  # the router's own view
    assert sum(placed.values()) >= ok["summary"]["requests_ok"]
    # every run records its processes' CPU headroom, and the aggregate says what it used
    for p in (ok, ok1):
        assert p["cpu"]["available"] and set(p["cpu"]["groups"]) == {"twins", "router", "client"}
        assert p["cpu"]["groups"]["twins"]["mean_cores"] > 0
    row = next(r for r in res["aggregate"] if r["target"] == "kvroute:round_robin")
    assert row["points"] == 2 and row["used"] + row["saturated"] == 2
    if row["used"]:
        assert row["tokens_per_gpu_s"]["min"] <= row["tokens_per_gpu_s"]["median"]
    # the seeds play the trace's sessions in different orders, and warm-up is left out
    firsts = []
    for p in (ok, ok1):
        calls = [json.loads(x) for x in (tmp_path / p["dir"] / "calls.jsonl").open()]
        firsts.append([c["session"] for c in sorted(calls, key=lambda c: c["t_start"])][:3])
        counted = [c for c in calls if c["ok"] and c["t_start"] >= 0.5]
        assert p["summary"]["requests_ok"] == len(counted) < sum(c["ok"] for c in calls)
    assert firsts[0] != firsts[1]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["points"][0]["summary"]["requests_ok"] == ok["summary"]["requests_ok"]
    # kvroute read the twins' load every 50 ms modelled (12.5 ms wall at speedup 4); the
    # results carry the line figure by the one rule, flagged: one lane count is no sweep
    assert ok["scrape_s"] == pytest.approx(0.05) and "scrape_s" not in bad
    if row["used"]:
        fig = saved["line"]["figures"]["kvroute:round_robin"]
        assert fig["ok"] is False and fig["why"] and saved["line"]["line_ok"] is False
    for png in ("pareto.png", "hit_ratio.png", "ttft_cdf.png", "queue_depth.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4 and "http://" not in page.split("<pre>")[0]
    assert "kvroute:round_robin" in page and "unknown router" in page


@pytest.mark.timeout(60)
async def test_open_loop_mooncake_starts_calls_at_their_scaled_arrival_times(stack, tmp_path):
    _cluster, router = stack
    trace = load_trace(DATA / "mooncake-slice.jsonl.gz", jitter_s=3.0, seed=1)
    # 512-token ids shrunk to one 32-token block each (tiny model, 4k context).
    builder = PromptBuilder(
        tinymodel.ensure(),
        block_size=32,
        trace_block_size=512,
        tokens_per_id=32,
        max_prompt_tokens=3000,
    )
    cfg = ReplayConfig(
        target=router.url,
        open_loop=True,
        max_plays=12,
        time_scale=10.0,
        convention="none",
        progress=False,
    )
    summary = await replay(trace, builder, cfg, tmp_path)
    assert summary["requests_ok"] == 12 and summary["requests_failed"] == 0
    calls = {c.session: c for c in read_jsonl(tmp_path / "calls.jsonl", CallRecord)}
    first = trace.sessions[0].arrival_s
    for s in trace.sessions[:12]:
        want = (s.arrival_s - first) / 10.0
        assert want - 0.005 <= calls[s.id].t_start <= want + 0.5, s.id
    assert all(c.prompt_tokens == c.expected_prompt_tokens for c in calls.values())


@pytest.mark.timeout(90)
def test_pd_sweep_point_runs_split_calls(tmp_path):
    cfg = SweepConfig(
        trace=TRACE,
        targets=["kvroute:session_affinity"],
        concurrency=[2],
        duration_s=3.0,
        grace_s=2.0,
        profile="cpu-tiny",
        speedup=4.0,
        progress=False,
        pd="1:1",
        pd_mode="always",
    )
    res = run_sweep(cfg, tmp_path, command="test")
    (pt,) = res["points"]
    assert pt["pd"] == "1:1" and cfg.replicas == 2
    assert pt["summary"]["requests_ok"] > 0 and pt["summary"]["requests_failed"] == 0
    pd = pt["router_metrics"]["kvroute_pd_calls_total"]
    assert pd.get("mode=split,reason=always", 0) >= pt["summary"]["requests_ok"]
    with pytest.raises(ValueError, match="P:D"):
        run_sweep(SweepConfig(trace=TRACE, pd="2"), tmp_path / "x")
    with pytest.raises(ValueError, match="sglang:cache_aware: its P/D mode is not wired"):
        run_sweep(SweepConfig(trace=TRACE, pd="1:1", targets=["sglang:cache_aware"]), tmp_path)
    with pytest.raises(ValueError, match=r"vllm-router:kv_aware: .*block size 16"):
        run_sweep(SweepConfig(trace=TRACE, pd="1:1", targets=["vllm-router:kv_aware"]), tmp_path)
