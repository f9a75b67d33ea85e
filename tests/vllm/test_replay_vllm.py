"""End-to-end replay against a real vLLM-CPU replica (tiny synthetic agentic trace).

Checks what only a real engine can: the harness's exact-token prompts are tokenized by vLLM
to exactly the predicted count, prefix sharing shows up as ``cached_tokens``, never above the
unlimited-cache bound, and ``summary.json`` carries every field the issue names.
"""

from __future__ import annotations

import json

import httpx
import pytest

from loadtest.metrics import SUMMARY_REQUIRED
from loadtest.prompts import PromptBuilder
from loadtest.replay.records import CallRecord, read_jsonl
from loadtest.replay.runner import ReplayConfig, replay
from loadtest.traces import load_trace

TINY_TRACE = (
    "synthetic:sessions=3,calls_median=4,calls_sigma=0.2,prefix_tokens=640,"
    "first_user_tokens=200,growth_median=120,output_median=6,gap_median_s=0.05,"
    "subagent_prob=0.4,subagent_calls_median=2,subagent_prefix_tokens=256,"
    "max_context_tokens=3000,seed=5"
)


@pytest.mark.timeout(120)
async def test_replay_against_real_vllm_writes_a_valid_summary(replica, tiny_model, tmp_path):
    async with httpx.AsyncClient(timeout=30) as c:
        (await c.post(replica.url + "/reset_prefix_cache")).raise_for_status()
    trace = load_trace(TINY_TRACE)
    assert trace.stats()["subagents"] >= 1
    builder = PromptBuilder(
        tiny_model, block_size=32, trace_block_size=trace.block_size, max_prompt_tokens=4000
    )
    cfg = ReplayConfig(
        target=replica.url,
        concurrency=2,
        convention="claude",
        output_lengths="max_tokens",  # a real model stops where it likes: give it the length
        progress=False,
        metrics_urls=[replica.url + "/metrics"],
        queue_sample_s=0.1,
    )
    summary = await replay(trace, builder, cfg, tmp_path)

    on_disk = json.loads((tmp_path / "summary.json").read_text())
    for k in SUMMARY_REQUIRED:
        assert k in on_disk, k
    assert on_disk["requests_failed"] == 0
    assert on_disk["requests_ok"] == trace.n_calls == summary["requests_ok"]
    calls = read_jsonl(tmp_path / "calls.jsonl", CallRecord)
    # vLLM tokenized every synthesized chat prompt to exactly the predicted length.
    assert all(c.prompt_tokens == c.expected_prompt_tokens for c in calls)
    assert summary["prompt_tokens_mismatch"] == 0
    # Output length is honoured (ignore_eos) and TTFT/TPOT are measured.
    by_id = {(s.id, c.id): c for s in trace.sessions for c in s.calls}
    assert all(c.completion_tokens == by_id[(c.session, c.call)].output_tokens for c in calls)
    assert all(c.ttft_s is not None and 0 < c.ttft_s <= c.e2e_s for c in calls)
    # Sessions resend their history: the engine's prefix cache hits, within the bound.
    assert all(c.cached_tokens is not None for c in calls)
    assert all(c.cached_tokens <= c.bound_cached_tokens for c in calls)
    assert 0.3 < summary["cache_hit_ratio"] <= summary["cache_hit_bound"] < 1.0
    assert summary["sessions_completed"] == len(trace.sessions)
    assert summary["p90_interactivity_tok_s"] > 0 and summary["tokens_per_gpu_s"] > 0
    assert summary["queue_depth_max"] >= 1
    assert summary["waiting_p90"] is not None  # vllm:num_requests_waiting was sampled
