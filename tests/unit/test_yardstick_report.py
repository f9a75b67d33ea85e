"""The yardstick table: ours against the best peer, paired by seed, saturated points left out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.report import yardstick


def _point(target: str, seed: int, tput: float, ttft: float, saturated: bool = False) -> dict:
    return {
        "target": target,
        "concurrency": 16,
        "seed": seed,
        "cpu": {"saturated": saturated},
        "summary": {
            "tokens_per_gpu_s": tput,
            "ttft_p90_s": ttft,
            "cache_hit_ratio": 0.9,
            "cache_hit_bound": 0.95,
        },
    }


def _write(folder: Path, truth: str, points: list[dict]) -> None:
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({"config": {"truth": truth}, "points": points}))


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    # nominal: sglang is the best peer by median (2,000 vs dynamo's 1,900), though dynamo
    # wins seed 2; kvroute's seed 1 is CPU-saturated and must not count.
    _write(tmp_path / "nominal", "nominal", [
        _point("kvroute:kv_cost", 0, 2200, 1.0),
        _point("kvroute:kv_cost", 1, 9999, 0.1, saturated=True),
        _point("kvroute:kv_cost", 2, 1800, 2.0),
        _point("sglang:cache_aware", 0, 2000, 2.0),
        _point("sglang:cache_aware", 1, 2000, 2.0),
        _point("sglang:cache_aware", 2, 2000, 1.0),
        _point("dynamo:kv", 0, 1800, 1.0),
        _point("dynamo:kv", 1, 1900, 1.0),
        _point("dynamo:kv", 2, 2500, 1.0),
    ])  # fmt: skip
    _write(tmp_path / "prefill-slow", "prefill-slow", [
        _point("kvroute:kv_cost", s, 1000, 1.0) for s in range(3)
    ] + [_point("dynamo:kv", s, 1250, 2.0) for s in range(3)])  # fmt: skip
    return tmp_path


def test_best_peer_is_chosen_by_median_and_ratios_are_paired_by_seed(runs: Path) -> None:
    by_truth = yardstick.load_runs([runs])
    assert set(by_truth) == {"nominal", "prefill-slow"}
    t = yardstick.table(by_truth["nominal"])
    (v,) = t["vs_best_peer"]
    assert v["best_peer"] == "sglang:cache_aware"
    assert v["seeds"] == [0, 2]  # seed 1 saturated on our side: no pair
    assert v["unpaired"] == [1]
    assert v["tokens_ratio"] == pytest.approx([1.1, 0.9])
    assert v["ttft_p90_ratio"] == pytest.approx([0.5, 2.0])
    ours = next(r for r in t["rows"] if r["target"] == "kvroute:kv_cost")
    assert ours["used"] == 2 and ours["runs"] == 3
    assert ours["tokens_per_gpu_s"]["max"] == 2200  # not the saturated 9,999

    t2 = yardstick.table(by_truth["prefill-slow"])
    assert t2["vs_best_peer"][0]["tokens_ratio_spread"]["median"] == pytest.approx(0.8)


def test_markdown_names_truth_peer_and_median_ratio(runs: Path, capsys) -> None:
    assert yardstick.main([str(runs), "--json", str(runs / "y.json")]) == 0
    md = capsys.readouterr().out
    assert "**Truth `prefill-slow`**" in md
    assert "best peer (dynamo:kv, 16 lanes)" in md and "median **0.80×**" in md
    assert "unpaired (saturated, failed or not run): seeds [1]" in md
    assert json.loads((runs / "y.json").read_text())["nominal"]["vs_best_peer"][0]["seeds"] == [
        0,
        2,
    ]


def test_no_results_is_a_clear_error(tmp_path: Path, capsys) -> None:
    assert yardstick.main([str(tmp_path)]) == 2
    assert "no results.json" in capsys.readouterr().err
