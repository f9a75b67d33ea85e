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


def _sess_point(target: str, seed: int, mean: float, short_ttft: float, tput: float) -> dict:
    size = {"sessions": 4, "p50_s": mean, "p90_s": mean * 2, "ttft_p99_s": short_ttft}
    return {
        "target": target,
        "concurrency": 24,
        "seed": seed,
        "cpu": {"saturated": False},
        "dir": f"points/{target.replace(':', '_')}/c24/s{seed}",
        "summary": {
            "tokens_per_gpu_s": tput,
            "p90_interactivity_tok_s": 30.0,
            "sessions_completed": 6,
            "session_completion_mean_s": mean,
            "session_completion_by_size": {
                "short": size,
                "medium": {"sessions": 2, "p50_s": 90.0, "p90_s": 95.0, "ttft_p99_s": 9.0},
                "long": {"sessions": 0, "p50_s": None, "p90_s": None, "ttft_p99_s": None},
            },
        },
    }


def test_a_priority_run_is_its_own_target_and_sessions_pair_by_seed(tmp_path: Path) -> None:
    """Folders of ``kvroute bench`` with and without ``--priority`` read together: the
    kvroute rows stay apart (not one row whose seeds overwrite each other) and pair by seed."""
    (tmp_path / "prio").mkdir()
    (tmp_path / "prio" / "results.json").write_text(json.dumps({
        "config": {"truth": "nominal", "priority": True},
        "points": [_sess_point("kvroute:kv_cost", s, 40.0, 2.0, 1000) for s in range(3)],
    }))  # fmt: skip
    (tmp_path / "fcfs").mkdir()
    (tmp_path / "fcfs" / "results.json").write_text(json.dumps({
        "config": {"truth": "nominal", "priority": False},
        "points": [_sess_point("kvroute:kv_cost", s, 50.0 + s * 10, 5.0, 1000) for s in range(3)]
        + [_sess_point("sglang:cache_aware", s, 80.0, 8.0, 800) for s in range(2)],
    }))  # fmt: skip
    by_truth = yardstick.load_runs([tmp_path / "prio", tmp_path / "fcfs"])
    ours = "kvroute:kv_cost" + yardstick.PRIORITY_SUFFIX
    t = yardstick.sessions_table(by_truth["nominal"], ours=ours)
    rows = {r["target"]: r for r in t["rows"]}
    assert set(rows) == {ours, "kvroute:kv_cost", "sglang:cache_aware"}
    assert rows[ours]["runs"] == 3 and rows["kvroute:kv_cost"]["runs"] == 3
    assert rows["kvroute:kv_cost"]["completion_mean_s"] == {"min": 50, "median": 60, "max": 70}
    assert rows[ours]["by_size"]["short"]["p90_s"]["median"] == 80.0
    vs = {v["other"]: v for v in t["vs"]}
    assert vs["kvroute:kv_cost"]["ratios"]["completion mean"] == pytest.approx(
        [0.8, 40 / 60, 40 / 70]
    )
    assert vs["kvroute:kv_cost"]["ratios"]["short TTFT p99"] == pytest.approx([0.4] * 3)
    assert vs["sglang:cache_aware"]["seeds"] == [0, 1]
    assert vs["sglang:cache_aware"]["unpaired"] == [2]
    assert vs["sglang:cache_aware"]["ratios"]["tok/GPU-s"] == pytest.approx([1.25, 1.25])
    md = yardstick.sessions_markdown(by_truth, ours=ours)
    assert "÷ kvroute:kv_cost (24 lanes), seeds 0, 1, 2" in md
    assert "completion mean 0.80 / 0.67 / 0.57 (median **0.67×**)" in md


def test_overtaken_counts_first_tokens_after_a_call_arriving_past_the_bound() -> None:
    calls = [
        # r0: a waits 30 s; c, arriving 20 s after it (past an 18 s bound), has its first
        # token at 21 s: a was overtaken. b arrived 10 s after a: within the bound of c
        # (c is 10 s after b), so b is not; nor is c.
        {"ok": True, "replica": "r0", "t_start": 0.0, "ttft_s": 30.0},
        {"ok": True, "replica": "r0", "t_start": 10.0, "ttft_s": 25.0},
        {"ok": True, "replica": "r0", "t_start": 20.0, "ttft_s": 1.0},
        # another replica's early first token overtakes nobody on r0; a failed call is no call
        {"ok": True, "replica": "r1", "t_start": 19.0, "ttft_s": 0.5},
        {"ok": False, "replica": "r0", "t_start": 25.0, "ttft_s": None},
    ]
    o = yardstick.overtaken(calls, bound_s=18.0)
    assert o == {"calls": 4, "overtaken": 1, "ttft_max_s": 30.0}
    assert yardstick.overtaken(calls, bound_s=25.0)["overtaken"] == 0


def test_the_session_table_reads_each_points_calls(tmp_path: Path, capsys) -> None:
    p = _sess_point("kvroute:kv_cost", 0, 40.0, 2.0, 1000)
    p["summary"]["preemptions"] = 5.0
    (tmp_path / p["dir"]).mkdir(parents=True)
    rows = [
        {"ok": True, "replica": "r0", "t_start": 0.0, "ttft_s": 40.0},
        {"ok": True, "replica": "r0", "t_start": 30.0, "ttft_s": 1.0},
    ]
    (tmp_path / p["dir"] / "calls.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    (tmp_path / "results.json").write_text(
        json.dumps({"config": {"truth": "nominal"}, "points": [p]})
    )
    assert yardstick.main([str(tmp_path), "--sessions"]) == 0
    md = capsys.readouterr().out
    assert "| kvroute:kv_cost | 24 | 1 / 1 |" in md
    # one call of two overtaken past 18 s; the longest TTFT; the engines' preemptions
    assert "| 1 / 2, 40.0 s | 5 [5–5] |" in md
