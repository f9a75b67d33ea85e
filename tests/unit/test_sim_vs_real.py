"""The simulator run on a real-path sweep's workload: targets map to the simulator's ports,
both rankings, Kendall's tau and the pairs ordered alike come out as the inputs imply,
saturated real points are left out."""

from __future__ import annotations

import json

import pytest

from loadtest.bench import bench_sim_vs_real
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
    # two targets: the real order (sglang first) against the simulator's
    agree = rows["sglang:cache_aware"]["sim_rank"] == 1
    assert doc["kendall_tau"] == (1.0 if agree else -1.0)
    assert doc["pairs"] == 1 and doc["pairs_agree"] == int(agree)
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


FOUR = ["kvroute:round_robin", "kvroute:kv_cost", "sglang:cache_aware",
        "vllm-router:consistent_hash"]  # fmt: skip


# the run the four targets' real figures are set for (the stand-in simulator ignores it)
TRACE4 = (
    "synthetic:sessions=16,calls_median=6,calls_sigma=0.3,prefix_tokens=1024,"
    "first_user_tokens=256,growth_median=300,output_median=20,gap_median_s=0.5,"
    "max_context_tokens=3500,seed=11"
)


def _results(tmp_path, tok: dict[str, float]):
    cfg = {"trace": TRACE4, "profile": "cpu-tiny", "replicas": 3, "concurrency": [8],
           "duration_s": 30.0, "speedup": 1.0, "max_gap_s": 30.0, "seeds": [0],
           "stagger_s": 1.0, "warmup_s": 2.0}  # fmt: skip
    points = [{"target": t, "summary": {"tokens_per_gpu_s": v, "ttft_p90_s": 1.0}}
              for t, v in tok.items()]  # fmt: skip
    (tmp_path / "results.json").write_text(json.dumps({"config": cfg, "points": points}))
    return tmp_path


def test_agreement_is_measured_pair_by_pair_on_four_policies(tmp_path, monkeypatch):
    """Four targets, the real figures set to the simulator's order, then with one pair
    swapped, then reversed: tau and the pairs ordered alike must be 1 and 6/6, 2/3 and 5/6,
    -1 and 0/6 — a comparison that ignored either side would not give all three. The
    simulator is a stand-in with four distinct figures (the real one runs in the test above;
    on a small trace two policies may tie, which says nothing about the comparison)."""
    sim_tok = {"round_robin": 10.0, "kv_cost": 40.0, "sglang_tree": 30.0,
               "session_affinity": 20.0}  # fmt: skip

    def stand_in(cfg, policy, seed, scrape_s=0.0):
        return {"tokens_per_gpu_s": sim_tok[policy], "ttft_p90_s": 1.0, "cache_hit_ratio": 0.5}

    monkeypatch.setattr(bench_sim_vs_real, "simulate", stand_in)
    order = sorted(FOUR, key=lambda t: -sim_tok[sim_policy(t)])  # the simulator's, best first

    def real_in(ranking: list[str]) -> dict:
        doc = compare(_results(tmp_path, {t: 100.0 - i for i, t in enumerate(ranking)}))
        assert [r["target"] for r in sorted(doc["rows"], key=lambda r: r["real_rank"])] == ranking
        assert [r["target"] for r in sorted(doc["rows"], key=lambda r: r["sim_rank"])] == order
        return doc

    same = real_in(order)
    assert same["kendall_tau"] == pytest.approx(1.0)
    assert (same["pairs_agree"], same["pairs"], same["pairs_disagree"]) == (6, 6, [])
    swapped = real_in([order[0], order[2], order[1], order[3]])
    assert swapped["kendall_tau"] == pytest.approx(2 / 3)
    assert swapped["pairs_agree"] == 5
    assert swapped["pairs_disagree"] == [sorted((order[1], order[2]))]
    reverse = real_in(order[::-1])
    assert reverse["kendall_tau"] == pytest.approx(-1.0)
    assert reverse["pairs_agree"] == 0 and len(reverse["pairs_disagree"]) == 6
    assert "5 of 6" in markdown(swapped) and f"not {min(order[1], order[2])}" in markdown(swapped)
