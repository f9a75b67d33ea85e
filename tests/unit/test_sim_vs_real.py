"""The simulator run on a real-path sweep's workload: targets map to the simulator's ports,
both rankings and Kendall's tau come out, saturated real points are left out."""

from __future__ import annotations

import json

from loadtest.bench.bench_sim_vs_real import compare, markdown, sim_policy

TRACE = (
    "synthetic:sessions=6,calls_median=4,calls_sigma=0.2,prefix_tokens=512,"
    "first_user_tokens=128,growth_median=100,output_median=5,gap_median_s=0.5,"
    "max_context_tokens=2500,seed=11"
)


def test_targets_map_to_the_simulators_ports():
    assert sim_policy("kvroute:kv_cost") == "kv_cost"
    assert sim_policy("sglang:cache_aware") == "sglang_tree"
    assert sim_policy("vllm-router:consistent_hash") == "session_affinity"
    assert sim_policy("vllm-router:kv_aware") is None  # no port: left out


def test_compare_ranks_both_sides(tmp_path):
    cfg = {"trace": TRACE, "profile": "cpu-tiny", "replicas": 2, "concurrency": [2],
           "duration_s": 20.0, "speedup": 1.0, "max_gap_s": 30.0, "seeds": [0, 1],
           "stagger_s": 1.0, "warmup_s": 2.0}  # fmt: skip

    def point(target, tok, saturated=False):
        return {"target": target, "summary": {"tokens_per_gpu_s": tok, "ttft_p90_s": 1.0},
                "cpu": {"saturated": saturated}}  # fmt: skip

    points = [point("kvroute:round_robin", 10.0), point("kvroute:round_robin", 12.0),
              point("sglang:cache_aware", 50.0), point("sglang:cache_aware", 1e9, True),
              point("vllm-router:kv_aware", 99.0)]  # fmt: skip
    (tmp_path / "results.json").write_text(json.dumps({"config": cfg, "points": points}))
    doc = compare(tmp_path)
    rows = {r["target"]: r for r in doc["rows"]}
    assert set(rows) == {"kvroute:round_robin", "sglang:cache_aware"}
    assert rows["kvroute:round_robin"]["real_tok_per_gpu_s"] == 11.0
    assert rows["sglang:cache_aware"]["real_tok_per_gpu_s"] == 50.0  # saturated one left out
    assert rows["sglang:cache_aware"]["real_rank"] == 1
    for r in rows.values():
        assert len(r["sim_runs"]) == 2 and r["sim_tok_per_gpu_s"] > 0
        assert {r["sim_rank"] for r in rows.values()} == {1, 2}
    assert -1.0 <= doc["kendall_tau"] <= 1.0
    assert "Kendall" in markdown(doc)


def test_the_simulated_scrape_is_the_runs_own():
    from loadtest.bench.bench_sim_vs_real import SCRAPE_S, recorded_scrape_s

    # kvroute bench --scrape 0.05 at speedup 2: the router scraped every 25 ms wall
    res = {"config": {"speedup": 2.0},
           "points": [{"target": "sglang:cache_aware"},
                      {"target": "kvroute:llmd", "scrape_s": 0.05}]}  # fmt: skip
    assert recorded_scrape_s(res) == 0.025
    # a run from before the scrape was recorded: the router's 1 s default
    assert recorded_scrape_s({"config": {"speedup": 1.0}, "points": [{}]}) == SCRAPE_S == 1.0
