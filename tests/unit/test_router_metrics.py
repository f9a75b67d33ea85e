"""The router's operator metrics, in process: names and labels, no ``_created`` series, the
observer's figures (identity source, usage tokens, per-call TPOT, session completion), the
placement outcomes, the loop-lag probe, and usage parsing (router.outcome). The scrape-time
collectors: test_collectors.py; the loop-only metrics: test_loopmetrics.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.metrics import RouterMetrics
from router.outcome import CallOutcome, Usage, usage_from_body, usage_from_stream, usage_from_tail
from router.sessions import SessionIdentity


def samples(m: RouterMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(m.exposition().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: RouterMetrics, name: str, **labels: str) -> float | None:
    return samples(m).get((name, tuple(sorted(labels.items()))))


def ident(key: str = "s1", source: str = "claude-code", final: bool = False) -> SessionIdentity:
    return SessionIdentity("-", key, None, None, final, source)


def ctx(identity: SessionIdentity, model: str = "m") -> SimpleNamespace:
    return SimpleNamespace(identity=identity, model=model)


def sse_tail(prompt: int, cached: int, completion: int) -> bytes:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion,
             "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
    return (
        b'data: {"choices":[]}\n\ndata: ' + orjson.dumps({"usage": usage}) + b"\n\ndata: [DONE]\n\n"
    )


def test_no_created_series_and_counters_end_in_total():
    m = RouterMetrics()
    m.requests.labels("/v1/chat/completions", "r", "200").inc()
    m.placed(None, "r")
    text = m.exposition().decode()
    assert "_created" not in text
    assert (
        'kvroute_requests_total{replica="r",route="/v1/chat/completions",status="200"} 1.0' in text
    )
    for fam in text_string_to_metric_families(text):
        if fam.type == "counter":
            assert all(s.name.endswith("_total") for s in fam.samples), fam.name
        if fam.type == "histogram":
            # a base unit: seconds, or tokens (as vLLM's request_prompt_tokens histogram)
            assert fam.name.endswith(("_seconds", "_tokens")), fam.name


@pytest.mark.parametrize(
    ("previous", "chosen", "outcome"),
    [(None, "a", "new"), ("a", "a", "kept"), ("a", "b", "moved")],
)
def test_placement_outcomes(previous, chosen, outcome):
    m = RouterMetrics()
    m.placed(previous, chosen, SimpleNamespace(elapsed_s=0.002))
    assert value(m, "kvroute_session_placements_total", outcome=outcome) == 1.0
    others = {"new", "kept", "moved"} - {outcome}
    assert all(value(m, "kvroute_session_placements_total", outcome=o) == 0.0 for o in others)
    assert value(m, "kvroute_decision_latency_seconds_count") == 1.0
    assert value(m, "kvroute_decision_latency_seconds_bucket", le="0.0025") == 1.0


def test_moves_are_counted_by_reason():
    m = RouterMetrics()
    for reason in ("retry", "cost", "cost", None):
        m.placed("a", "b", SimpleNamespace(elapsed_s=0.001, move_reason=reason))
    m.placed("a", "a", SimpleNamespace(elapsed_s=0.001, move_reason=None))
    assert value(m, "kvroute_session_moves_total", reason="cost") == 2.0
    assert value(m, "kvroute_session_moves_total", reason="retry") == 1.0
    assert value(m, "kvroute_session_moves_total", reason="other") == 1.0
    assert value(m, "kvroute_session_moves_total", reason="unavailable") == 0.0
    assert value(m, "kvroute_session_placements_total", outcome="moved") == 4.0


def test_observer_counts_identity_usage_and_per_call_tpot():
    m = RouterMetrics()
    outcome = CallOutcome("r", "200", events=12, ttft_s=0.5, duration_s=1.5,
                          usage=usage_from_tail(sse_tail(1000, 768, 11)))  # fmt: skip
    m.observe_call(ctx(ident()), outcome)
    m.observe_call(ctx(ident("p", "prefix")), CallOutcome(None, "not_completed"))
    m.observe_call(ctx(ident("d", "codex")), CallOutcome(None, "dry_run"))
    assert value(m, "kvroute_identity_calls_total", source="claude-code") == 1.0
    assert value(m, "kvroute_identity_calls_total", source="prefix") == 1.0
    assert value(m, "kvroute_identity_calls_total", source="codex") is None  # dry runs skipped
    assert value(m, "kvroute_prompt_tokens_total", model="m") == 1000.0
    assert value(m, "kvroute_prompt_tokens_cached_total", model="m") == 768.0
    # (1.5 - 0.5) s over 10 tokens after the first: 0.1 s per token
    assert value(m, "kvroute_request_time_per_output_token_seconds_sum", model="m") == (
        pytest.approx(0.1)
    )
    assert value(m, "kvroute_request_time_per_output_token_seconds_bucket", model="m",
                 le="0.08") == 0.0  # fmt: skip
    # a non-streamed answer (no SSE events) has no per-token time
    m.observe_call(ctx(ident()), dataclasses.replace(outcome, events=0))
    assert value(m, "kvroute_request_time_per_output_token_seconds_count", model="m") == 1.0


def test_session_completion_on_final_or_after_idle():
    m = RouterMetrics(session_idle_s=60)
    m.observe_call(ctx(ident("a")), CallOutcome("r", "200", duration_s=2.0))
    m.observe_call(ctx(ident("a", final=True)), CallOutcome("r", "200", duration_s=1.0))
    assert value(m, "kvroute_session_duration_seconds_count") == 1.0
    assert value(m, "kvroute_session_duration_seconds_sum") >= 2.0  # first start to last end
    m.observe_call(ctx(ident("b")), CallOutcome("r", "200", duration_s=3.0))
    assert value(m, "kvroute_session_duration_seconds_count") == 1.0  # b is not done yet
    m.expire_sessions(now=1e12)  # long silent
    assert value(m, "kvroute_session_duration_seconds_count") == 2.0


def test_usage_from_json_and_sse_tails():
    assert usage_from_tail(b'{"id":"x","usage":{"prompt_tokens":3}}') == Usage(prompt_tokens=3)
    assert usage_from_tail(sse_tail(5, 1, 2)) == Usage(5, 2, 1)
    assert usage_from_tail(b"data: [DONE]\n\n") is None
    assert usage_from_tail(b'data: {"usage": trunc') is None


def test_usage_reads_anthropic_and_responses_counts():
    # Anthropic: the prompt is input + cache read + cache creation; the cache read is cached
    ant = {"input_tokens": 10, "cache_read_input_tokens": 90, "cache_creation_input_tokens": 5,
           "output_tokens": 3}  # fmt: skip
    assert Usage.from_json(ant) == Usage(105, 3, 90)
    assert Usage.from_json({"input_tokens": 8, "output_tokens": 1}) == Usage(8, 1, None)
    resp = {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 16}, "output_tokens": 2}
    assert Usage.from_json(resp) == Usage(40, 2, 16)
    # streams: Responses' usage under response in its last event; Anthropic's prompt counts in
    # message_start (the head), its output in message_delta (the tail)
    completed = orjson.dumps({"type": "response.completed", "response": {"usage": resp}})
    assert usage_from_tail(b"event: response.completed\ndata: " + completed + b"\n\n") == (
        Usage(40, 2, 16)
    )
    start = orjson.dumps(
        {"type": "message_start", "message": {"usage": {**ant, "output_tokens": 0}}}
    )
    head = b"event: message_start\ndata: " + start + b"\n\n"
    tail = b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":20}}\n\n'
    assert usage_from_stream(head, tail) == Usage(105, 20, 90)
    assert usage_from_stream(b"", tail) == Usage(None, 20, None)
    # vLLM's message_delta repeats the whole usage: the tail's counts win
    full = b'data: {"type":"message_delta","usage":{"input_tokens":1,"cache_read_input_tokens":2,' \
        b'"output_tokens":5}}\n\n'  # fmt: skip
    assert usage_from_stream(head, full) == Usage(3, 5, 2)


def test_usage_from_a_whole_json_answer_of_any_size():
    usage = {"prompt_tokens": 9, "total_tokens": 17, "completion_tokens": 8,
             "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip
    # vLLM's field order: the usage follows the content and other fields follow it
    answer = orjson.dumps({
        "id": "c", "choices": [{"message": {"content": 'say "usage": {1} ' + "x" * 300_000}}],
        "usage": usage, "prompt_logprobs": None, "kv_transfer_params": None,
    })  # fmt: skip
    assert usage_from_body(answer) == Usage(9, 8, 4)
    # the tail holds the usage but not its line's start: the usage object is read on its own
    assert usage_from_tail(answer[-4096:]) == Usage(9, 8, 4)
    anthropic = b'{"content":[{"text":"usage"}],"usage" : {"input_tokens":5,"output_tokens":2}}'
    assert usage_from_body(anthropic) == Usage(5, 2, None)
    # a string that is just "usage" after the key is passed over
    assert usage_from_body(b'{"usage":{"prompt_tokens":2},"note":"usage"}') == Usage(2)
    for bad in (b'{"usage": null}', b'{"usage":{"prompt_tokens":3', b"not json", b'{"a":"usage"}',
                b'{"usage":{"prompt_tokens":3]}}'):  # fmt: skip
        assert usage_from_body(bad) is None, bad


async def test_loop_lag_probe_sees_a_stall():
    import asyncio
    import time

    m = RouterMetrics()
    task = asyncio.create_task(m.watch_loop(tick_s=0.01))
    await asyncio.sleep(0.05)
    time.sleep(0.3)  # noqa: ASYNC251 -- the stall under test: the next tick is ~0.3 s late
    await asyncio.sleep(0.05)
    task.cancel()
    assert value(m, "kvroute_event_loop_lag_seconds_count") >= 3
    assert value(m, "kvroute_event_loop_lag_seconds_bucket", le="0.2") < value(
        m, "kvroute_event_loop_lag_seconds_bucket", le="0.5"
    )
