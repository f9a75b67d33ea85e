"""The agents tier's harness without the CLIs: the pins and their install folder, the tap's
reading of what a client was told (usage of the three APIs, streamed and not), and the
session checks (what makes a session report fail)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from loadtest.agents import install
from loadtest.agents.clis import AGENTS, OFFLINE_PROXY, Turn
from loadtest.agents.session import SessionReport, scrape
from loadtest.agents.tap import TapCall, reply_usage


def sse(*events: dict) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)


def test_pins_name_the_three_clis_and_a_new_pin_gets_a_new_folder(tmp_path, monkeypatch):
    pins = install.pins()
    assert set(pins) == {a.package for a in AGENTS.values()}
    assert pins["@anthropic-ai/claude-code"] == "2.1.197"
    assert pins["@openai/codex"] == "0.171.0" and pins["opencode-ai"] == "1.18.33"
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path))
    other = tmp_path / "v.txt"
    other.write_text("# a comment\n@openai/codex 0.172.0\n")
    assert install.install_dir().parent == tmp_path
    assert install.install_dir(other) != install.install_dir()
    assert install.installed(other) is None  # nothing installed there
    (install.install_dir(other) / "node_modules/.bin").mkdir(parents=True)
    (install.install_dir(other) / ".ready").touch()
    assert install.installed(other) is None  # stamped, but no runnable CLIs


def test_install_without_npm_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))  # no npm here
    with pytest.raises(install.InstallError, match="npm"):
        install.install()


def test_reply_usage_reads_each_api_as_its_client_does():
    # Anthropic: the prompt is input + cache read + cache creation; vLLM's message_delta
    # repeats the whole usage with the cache split
    raw = sse({"type": "message_start", "message": {"usage": {"input_tokens": 547,
                                                              "output_tokens": 0}}},
              {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "x"}},
              {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
               "usage": {"input_tokens": 3, "output_tokens": 8, "cache_creation_input_tokens": 0,
                         "cache_read_input_tokens": 544}})  # fmt: skip
    assert reply_usage("/v1/messages", raw, True) == (
        {"prompt": 547, "cached": 544, "output": 8},
        "end_turn",
    )
    body = orjson.dumps({"stop_reason": "max_tokens", "usage": {
        "input_tokens": 10, "cache_read_input_tokens": 90, "output_tokens": 4}})  # fmt: skip
    assert reply_usage("/v1/messages", body, False) == (
        {"prompt": 100, "cached": 90, "output": 4},
        "max_tokens",
    )
    # Responses: the last event with a response's usage
    raw = sse({"type": "response.created", "response": {"status": "in_progress"}},
              {"type": "response.completed", "response": {"status": "completed", "usage": {
                  "input_tokens": 500, "input_tokens_details": {"cached_tokens": 448},
                  "output_tokens": 7}}})  # fmt: skip
    assert reply_usage("/v1/responses", raw, True) == (
        {"prompt": 500, "cached": 448, "output": 7},
        "completed",
    )
    # chat: the usage chunk (include_usage), the last finish_reason
    usage = {"prompt_tokens": 30, "completion_tokens": 2,
             "prompt_tokens_details": {"cached_tokens": 16}}  # fmt: skip
    raw = sse({"choices": [{"delta": {"content": "hi"}, "finish_reason": None}]},
              {"choices": [{"delta": {}, "finish_reason": "stop"}]},
              {"choices": [], "usage": usage})  # fmt: skip
    assert reply_usage("/v1/chat/completions", raw + b"data: [DONE]\n\n", True) == (
        {"prompt": 30, "cached": 16, "output": 2},
        "stop",
    )
    # a stream without usage: None, never zeros
    assert reply_usage("/v1/chat/completions", sse({"choices": []}), True)[0] is None


def _call(path: str, usage: dict | None, rid: str, session: str = "s1") -> TapCall:
    c = TapCall("POST", path, {"x-claude-code-session-id": session}, {}, 0.0, status=200,
                request_id=rid, usage=usage)  # fmt: skip
    return c


def _report(calls: list[TapCall], metrics_text: str, decisions=None) -> SessionReport:
    turns = [Turn("claude", i, [], 0, "", "", 1.0, ok=True, text="t", session="cli-1")
             for i in range(2)]  # fmt: skip
    return SessionReport("claude", turns, calls, scrape(metrics_text), decisions or {},
                         [0, 1])  # fmt: skip


METRICS = """
kvroute_requests_total{replica="r0",route="/v1/messages",status="200"} 2.0
kvroute_prompt_tokens_total{model="tiny"} 300.0
kvroute_prompt_tokens_cached_total{model="tiny"} 96.0
kvroute_identity_calls_total{source="claude-code"} 2.0
"""


def test_a_good_session_passes_and_each_defect_is_named():
    u1, u2 = {"prompt": 100, "cached": 0, "output": 5}, {"prompt": 200, "cached": 96, "output": 5}
    good = [_call("/v1/messages", u1, "a"), _call("/v1/messages", u2, "b")]
    dec = {"a": {"winner": "r0"}, "b": {"winner": "r0"}}
    assert _report(good, METRICS, dec).problems(expect_turns=2) == []
    # the router counted tokens the client was never told
    off = METRICS.replace("300.0", "301.0")
    assert any("kvroute_prompt_tokens_total" in p
               for p in _report(good, off, dec).problems(expect_turns=2))  # fmt: skip
    # the session moved
    moved = {"a": {"winner": "r0"}, "b": {"winner": "r1"}}
    assert any("2 replicas" in p for p in _report(good, METRICS, moved).problems(expect_turns=2))
    # a call whose session header was not recognised
    unknown = METRICS.replace('source="claude-code"} 2.0', 'source="claude-code"} 1.0')
    assert any("identity" in p for p in _report(good, unknown, dec).problems(expect_turns=2))
    # two session ids in one session
    split = [_call("/v1/messages", u1, "a"), _call("/v1/messages", u2, "b", session="s2")]
    assert any("2 session ids" in p
               for p in _report(split, METRICS, dec).problems(expect_turns=2))  # fmt: skip
    # a turn that did not complete
    r = _report(good, METRICS, dec)
    r.turns[1].ok = False
    assert any("turn 1" in p for p in r.problems(expect_turns=2))


def test_every_agent_builds_a_private_environment(tmp_path: Path):
    for cls in AGENTS.values():
        a = cls(tmp_path / "bin", tmp_path / cls.name, "http://127.0.0.1:9")
        a.prepare()
        env = a.env()
        assert env["HOME"] == str(tmp_path / cls.name)
        # whatever a CLI fetches by itself goes to a proxy that is not there; kvroute is direct
        assert env["HTTPS_PROXY"] == env["HTTP_PROXY"] == OFFLINE_PROXY
        assert "127.0.0.1" in env["NO_PROXY"].split(",")
        blob = repr(env) + "".join(p.read_text() for p in (tmp_path / cls.name).rglob("*")
                                   if p.is_file())  # fmt: skip
        assert "http://127.0.0.1:9" in blob  # the base URL is kvroute's (the tap's)


def test_a_move_passes_the_demo_only_when_the_policy_cost_decided_it():
    u = {"prompt": 150, "cached": 48, "output": 5}
    calls = [_call("/v1/messages", u, "a"), _call("/v1/messages", u, "b")]
    text = METRICS.replace('replica="r0",route="/v1/messages",status="200"} 2.0',
                           'replica="r0",route="/v1/messages",status="200"} 1.0\n'
                           'kvroute_requests_total{replica="r1",route="/v1/messages",'
                           'status="200"} 1.0')  # fmt: skip
    cost = {"a": {"winner": "r0"}, "b": {"winner": "r1", "session_replica": "r0",
                                         "move_reason": "cost"}}  # fmt: skip
    r = _report(calls, text, cost)
    assert r.moves() == [("r0", "r1", "cost")]
    assert any("2 replicas" in p for p in r.problems(expect_turns=2))  # the tier: one replica
    assert r.problems(expect_turns=2, cost_moves=True) == []  # the demo: a priced move is fine
    churn = {**cost, "b": {**cost["b"], "move_reason": "other"}}
    assert any(
        "2 replicas" in p
        for p in _report(calls, text, churn).problems(expect_turns=2, cost_moves=True)
    )


def test_a_subagent_may_run_elsewhere_but_each_conversation_stays_on_one_replica():
    u = {"prompt": 150, "cached": 48, "output": 5}
    calls = [_call("/v1/messages", u, i) for i in "abc"]
    text = METRICS.replace('replica="r0",route="/v1/messages",status="200"} 2.0',
                           'replica="r0",route="/v1/messages",status="200"} 2.0\n'
                           'kvroute_requests_total{replica="r1",route="/v1/messages",'
                           'status="200"} 1.0')  # fmt: skip
    text = text.replace('source="claude-code"} 2.0', 'source="claude-code"} 3.0')
    text = text.replace("300.0", "450.0").replace("96.0", "144.0")
    # the parent on r0; its subagent (kvroute's "<session>#<head>" key) on r1
    sub = {"a": {"winner": "r0", "session": "s"}, "b": {"winner": "r1", "session": "s#h"},
           "c": {"winner": "r0", "session": "s"}}  # fmt: skip
    r = _report(calls, text, sub)
    assert r.replicas_by_conversation() == {"s": {"r0"}, "s#h": {"r1"}}
    assert not [p for p in r.problems(expect_turns=2) if "replicas" in p]
    # the parent split over two replicas is still a problem
    split = {**sub, "c": {"winner": "r1", "session": "s"}}
    assert any("conversation 's' landed on 2 replicas" in p
               for p in _report(calls, text, split).problems(expect_turns=2))  # fmt: skip
