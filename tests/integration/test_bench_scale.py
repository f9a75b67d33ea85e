"""``loadtest.bench.bench_scale`` at tiny scale (issue 45's scale bench, so it cannot rot):
twins, kv_cost routers with the KV layer on (``--workers`` 1 and 2) and 20 streams at the
router's defaults, a few seconds each; the JSON's shape and zero errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.bench import bench_scale

pytestmark = pytest.mark.timeout(240)


def test_the_scale_bench_runs_small_and_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    assert bench_scale.main(["--quick", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["started"]["loadavg"] and doc["finished"]["cpus"]
    rows = {r["name"]: r for r in doc["rows"]}
    q = bench_scale.QUICK_AGENTS

    setup = rows["agents_setup"]
    assert setup["warm_errors"] == {"direct": 0, "router:w1": 0, "router:w2": 0}
    rate = q.rates[0]
    names = [f"capacity_{p}" for p in ("direct", "router:w1", "router:w2")]
    for w in (1, 2):  # each router's path beside direct, interleaved
        names += [f"open_router:w{w}_{rate:g}", f"open_direct_beside_router:w{w}_{rate:g}"]
    for name in names:
        row = rows[name]
        assert row["errors"] == 0, row
        assert row["calls"] > 0 and row["achieved_calls_s"] > 0
        assert row["ttft_p50_ms"] > 0 and row["ttft_p99_ms"] >= row["ttft_p50_ms"]
        # the prompts are the sessions' (system + context + turns), seen by the twin
        assert row["prompt_tokens_median"] >= q.prompt_tokens
        assert row["loadavg_before"]
    for w in (1, 2):
        open_row = rows[f"open_router:w{w}_{rate:g}"]
        assert isinstance(open_row["added_ttft_p99_ms"], float)
        assert isinstance(open_row["within_budget"], bool)
        assert open_row["twins_cores"] > 0 and open_row["router_cores"] > 0
        cap = rows[f"capacity_router:w{w}"]
        assert cap["router_cpu_ms_per_call"] > 0 and cap["router_cores"] > 0
        # by process: the router's loop(s) did the work (w2: a parent and two workers)
        serve = {k: v for k, v in cap["router_procs_cpu_ms_per_call"].items() if "serve" in k}
        assert len(serve) == (1 if w == 1 else 3) and sum(serve.values()) > 0
    assert "router_cores" not in rows["capacity_direct"]  # direct has no router to measure

    summary = rows["agents_summary"]
    assert summary["target_calls_s"] == 200 and summary["target_scaling_w2"] == 1.8
    assert summary["scaling_w2_vs_w1"] > 0
    assert summary["w1_router_cpu_ms_per_call"] > 0 and summary["w1_calls_s_per_router_core"] > 0
    assert summary["w2_max_rate_within_budget"] in (0.0, rate)
    for w in (1, 2):  # the KV layer was on, fed by the twins' events
        kv = summary[f"w{w}_kv_layer"]
        assert kv["mode"] == "full" and kv["event_batches"] > 0, kv

    streams = rows[f"streams_{bench_scale.QUICK_STREAMS.streams}"]
    assert streams["ok"] == streams["streams"] == 20
    assert (
        streams["errors"] == 0 and streams["error_kinds"] == {} and streams["error_samples"] == []
    )
    assert isinstance(streams["router_warnings"], list)
    assert sum(streams["calls_by_replica"].values()) == 20  # where the router placed them
    assert 0 < sum(streams["router_inflight_peak_by_replica"].values()) <= 20
    assert streams["peak_in_flight"] == 20
    assert 0 < streams["peak_answered_open"] <= 20
    assert 0 < streams["head_p50_s"] <= streams["head_max_s"] <= streams["ttft_max_s"]
    assert streams["router_rss_peak_mb"] > 0 and streams["router_cores"] > 0
    assert streams["target_met"] is False  # 20 streams are not the 2,000 of the target

    # the table over repeated runs (here the one run twice): min / median / max
    table = bench_scale.summarize([str(out), str(out)]).splitlines()
    assert table[0].startswith("| figure (2 files: min / median / max)")
    scaling = summary["scaling_w2_vs_w1"]
    assert (
        f"| --workers 2 / --workers 1 (closed loop) | {scaling:g} / {scaling:g} / {scaling:g} |"
        in table
    )
    assert "| streams_20: errors | 0 / 0 / 0 |" in table
    assert any(line.startswith(f"| open_router:w2_{rate:g}: added TTFT ms") for line in table)
