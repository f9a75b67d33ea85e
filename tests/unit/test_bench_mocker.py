"""loadtest/bench/bench_mocker.py: its parsing and comparison on a tiny synthetic case (no
Dynamo needed), the trace preparation the mocker needs, and one real mocker replay when the
Dynamo venv is installed."""

from __future__ import annotations

import json
import math
import tarfile
from pathlib import Path

import pytest

from costmodel.profiles import load_profile
from loadtest.bench import bench_mocker as bm

pytestmark = pytest.mark.unit


def _req(ttft: float, n_in: int, reused: int, n_out: int, t0: float, dur: float) -> dict:
    return {
        "ttft_ms": ttft, "input_length": n_in, "reused_input_tokens": reused,
        "output_length": n_out, "arrival_time_ms": t0, "first_token_ms": t0 + ttft,
        "last_token_ms": t0 + ttft + dur,
    }  # fmt: skip


def test_mocker_records_parse_into_hit_ratio_ttft_tpot_and_span() -> None:
    per = [
        _req(100.0, 1000, 0, 11, 0.0, 100.0),  # TPOT 10 ms
        _req(300.0, 3000, 2000, 1, 1000.0, 0.0),  # one token: no TPOT
        {"ttft_ms": None, "input_length": 500},  # never produced a token: dropped
    ]
    calls, span = bm.mocker_calls(per)
    assert len(calls) == 2
    assert calls[0]["tpot_s"] == pytest.approx(0.010)
    assert calls[1]["tpot_s"] is None
    assert span == pytest.approx(1.3)  # first arrival 0 s to last token 1.3 s
    s = bm.summarize(calls, span, gpus=2)
    assert s["hit_ratio"] == pytest.approx(2000 / 4000)
    assert s["ttft_s"]["p50"] == pytest.approx(0.2)
    assert s["tpot_s"]["p90"] == pytest.approx(0.010)
    assert s["out_tok_per_gpu_s"] == pytest.approx(12 / (1.3 * 2))


def test_side_by_side_reports_the_twin_spread_and_ratio() -> None:
    def side(ttfts: list[float], cached_per_100: int) -> dict:
        calls = [
            {"ttft_s": t, "tpot_s": 0.01, "prompt_tokens": 100,
             "cached_tokens": cached_per_100, "output_tokens": 10}
            for t in ttfts
        ]  # fmt: skip
        return bm.summarize(calls, 10.0, 1)

    mockers = [side([1.0] * 4, 50), side([0.5] * 4, 40)]
    twins = [side([2.0] * 4, 80), side([3.0] * 4, 90), side([4.0] * 4, 70)]
    rows = {r["metric"]: r for r in bm.side_by_side(mockers, twins)}
    assert rows["hit_ratio"]["mocker"] == {"min": 0.4, "median": 0.45, "max": 0.5}
    assert rows["hit_ratio"]["twin"] == {"min": 0.7, "median": 0.8, "max": 0.9}
    assert rows["ttft_p50_s"]["twin"]["median"] == pytest.approx(3.0)
    assert rows["ttft_p50_s"]["twin_over_mocker"] == pytest.approx(3.0 / 0.75)
    assert set(rows) >= {"ttft_p10_s", "ttft_p99_s", "tpot_p90_s", "out_tok_per_gpu_s"}
    text = bm.table(list(rows.values()))
    assert "| ttft_p50_s | 0.75 [0.5–1] | 3 [2–4] | 4 |" in text


def test_quantiles_of_nothing_are_nan() -> None:
    assert all(math.isnan(v) for v in bm.quantiles([]).values())


def test_engine_args_carry_the_profile_figures() -> None:
    prof = load_profile("h200-70b-fp8-tp4")
    eng = bm.mocker_engine_args(prof)["engine"]
    assert eng["block_size"] == prof.block_size
    assert eng["num_gpu_blocks"] == prof.gpu_kv_blocks
    assert eng["max_num_seqs"] == prof.max_num_seqs
    assert eng["max_num_batched_tokens"] == prof.max_num_batched_tokens
    assert eng["max_model_len"] == prof.model.max_model_len


def test_prepare_widens_each_files_models_to_what_its_requests_use(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    doc = {
        "id": "a", "models": ["opus"], "block_size": 64,
        "requests": [{"t": 0, "model": "opus", "in": 10, "out": 1, "hash_ids": [1]},
                     {"t": 1, "type": "subagent", "requests": [{"t": 0, "model": "haiku"}]}],
    }  # fmt: skip
    (src / "a.json").write_text(json.dumps(doc))
    (src / "b.json").write_text(json.dumps({**doc, "id": "b"}))
    tar = tmp_path / "t.tar.gz"
    with tarfile.open(tar, "w:gz") as tf:
        tf.add(src, arcname="dev")
    out = tmp_path / "out"
    assert bm.prepare_weka_dir(tar, out, max_sessions=1) == ["a"]
    assert sorted(p.name for p in out.iterdir()) == ["a.json"]
    got = json.loads((out / "a.json").read_text())
    assert got["models"] == ["haiku", "opus"]
    assert got["requests"] == doc["requests"]


@pytest.mark.skipif(bm.dynamo_python() is None, reason=f"no Dynamo venv at {bm.DYNAMO_VENV}")
def test_the_real_mocker_replays_a_tiny_weka_trace(tmp_path: Path) -> None:
    doc = {
        "id": "s", "models": ["m"], "block_size": 64, "hash_id_scope": "local",
        "requests": [
            {"t": 0.0, "type": "s", "model": "m", "in": 256, "out": 8, "hash_ids": [1, 2, 3, 4]},
            {"t": 1.0, "type": "s", "model": "m", "in": 384, "out": 8,
             "hash_ids": [1, 2, 3, 4, 5, 6]},
        ],
    }  # fmt: skip
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "s.json").write_text(json.dumps(doc))
    py = bm.dynamo_python()
    assert py is not None
    eng = {"engine": {"block_size": 64, "num_gpu_blocks": 64}}
    out = bm.run_mocker(tmp_path / "w", eng, workers=1, lanes=1, py=py, timeout_s=240)
    calls, span = bm.mocker_calls(out["per_request"])
    assert len(calls) == 2 and span > 0
    # the second call's prompt extends the first: the mocker reuses its 4 cached blocks
    assert sorted(c["cached_tokens"] for c in calls) == [0, 256]
