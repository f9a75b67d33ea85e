"""The HTTP twin's request checks on their own (loadtest/twin/http_request.py): vLLM's 400s
and 404s, ``max_tokens`` against the context, session id and priority sources, function
tools. The routes that use them are tests/integration/test_twin_http.py's."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from loadtest.twin import http_request as hr
from loadtest.twin.replica import ApiError


def twin(max_model_len: int = 100, name: str = "tiny", auto: bool = True) -> Any:
    cfg = SimpleNamespace(served_model_name=name, enable_auto_tool_choice=auto)
    return SimpleNamespace(max_model_len=max_model_len, cfg=cfg)


def request(headers: dict[str, str] | None = None) -> Any:
    return SimpleNamespace(headers=headers or {})


def test_a_bad_request_names_its_parameter_and_value_as_vllm_does():
    e = hr._bad("max_tokens must be at least 1, got 0.", "max_tokens", 0)
    assert e.status == 400 and e.param == "max_tokens"
    assert e.message.endswith("(parameter=max_tokens, value=0)")
    assert hr._bad("x").message == "x"
    resp = hr.error_response(e)
    assert resp.status == 400 and resp.body is not None and b'"code":400' in resp.body


def test_max_tokens_defaults_to_the_rest_of_the_context_and_is_checked_against_it():
    t = twin(100)
    assert hr._max_tokens(t, None, 30) == 70
    assert hr._max_tokens(t, 70, 30) == 70
    for bad, param in ((True, "max_tokens"), (0, "max_tokens"), (101, "max_tokens"),
                       (71, "max_tokens")):  # fmt: skip
        with pytest.raises(ApiError) as err:
            hr._max_tokens(t, bad, 30)
        assert err.value.status == 400 and err.value.param == param
    with pytest.raises(ApiError) as err:
        hr._max_tokens(t, None, 100)  # the prompt alone fills the context
    assert err.value.param == "input_tokens"


def test_the_model_is_optional_but_another_name_is_a_404():
    assert hr._check_model(twin(name="m"), {}) == "m"
    assert hr._check_model(twin(name="m"), {"model": "m"}) == "m"
    with pytest.raises(ApiError) as err:
        hr._check_model(twin(name="m"), {"model": "other"})
    assert err.value.status == 404


def test_a_named_tool_choice_must_be_an_offered_function_and_auto_needs_the_flag():
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {}}}]
    assert hr._function_tools(tools) == [("ls", {})]
    named = {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "ls"}}}
    hr._check_tool_choice(twin(), named)
    with pytest.raises(ApiError):
        hr._check_tool_choice(twin(), {**named, "tool_choice": {"function": {"name": "rm"}}})
    hr._check_tool_choice(twin(auto=False), named)  # a named tool renders without the flag
    with pytest.raises(ApiError):
        hr._check_tool_choice(twin(auto=False), {"tools": tools})  # "auto" by default


def test_session_and_priority_come_from_the_body_or_the_headers():
    assert hr._session_id(request(), {"session_id": "s1"}) == "s1"
    assert hr._session_id(request({"X-Session-ID": "s2"}), {}) == "s2"
    assert hr._session_id(request(), {"vllm_xargs": {"session_id": 7}}) == "7"
    assert hr._session_id(request(), {}) is None
    assert hr._priority(request({"X-Vllm-Priority": "3"}), {"priority": 5}) == 3
    assert hr._priority(request({"X-Vllm-Priority": "x"}), {"priority": 5}) == 5
    assert hr._priority(request(), {"priority": True}) == 0  # not an int
