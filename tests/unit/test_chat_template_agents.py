"""``/v1/messages`` and ``/v1/responses`` bodies become the chat request vLLM 0.32 renders
(router.vllm.prompt.chat_request, through router.vllm.anthropic_messages and
router.vllm.openai_responses): tools, tool calls and results, reasoning, system
blocks — checked here through a template that prints what it is handed; byte parity with
real vLLM is in tests/vllm/test_agent_api_render.py."""

from __future__ import annotations

import json

import pytest

from loadtest import tinymodel
from router.kv.autoconf import tokenize_request
from router.vllm.anthropic_messages import disabled_thinking_effort
from router.vllm.chat_template import ChatTemplateError
from router.vllm.openai_responses import CUSTOM_TOOL_PARAMETERS
from router.vllm.prompt import chat_request, request_prompt
from router.vllm.tokenizer import ModelTokenizer

# prints exactly what vLLM hands a template (string content format: no part iteration)
ECHO = (
    "{{ {'m': messages, 't': tools, 'e': reasoning_effort | default(none),"
    " 'k': enable_thinking | default(none)} | tojson }}"
)
SYSTEM_FIRST = (  # Qwen-style: a non-leading system message is an error
    "{%- for m in messages %}{%- if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{%- endif %}{%- endfor %}"
) + ECHO


@pytest.fixture(scope="module")
def tiny() -> ModelTokenizer:
    return ModelTokenizer.from_dir(tinymodel.ensure())


def echo(tiny: ModelTokenizer, template: str = ECHO) -> ModelTokenizer:
    return ModelTokenizer(tiny.tok, template, tiny.special_tokens)


def seen(tok: ModelTokenizer, route: str, body: dict) -> dict:
    p = request_prompt(tok, route, body)
    # vLLM tokenizes Responses prompts with special tokens, chat and Anthropic ones without
    assert p is not None and p.add_special_tokens == (route == "/v1/responses")
    return json.loads(p.text)


def call(cid: str, name: str, args: dict) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


CLAUDE_CODE = {
    "model": "m",
    "max_tokens": 32000,
    "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=9f\nmore"},
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": " Be terse."},
    ],
    "tools": [
        {
            "name": "Bash",
            "description": "Run a command",
            "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
        {"name": "Read", "input_schema": {"type": "object"}, "defer_loading": True},
    ],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>r</system-reminder>"},  # noqa: E501
                                     {"type": "text", "text": "fix the bug"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "look first", "signature": "s"},
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "tu1", "name": "Bash", "input": {"command": "ls"}},
            {"type": "tool_use", "id": "tu2", "name": "Read", "input": {}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "tu1", "content": "a.py\nb.py"},
            {"type": "tool_result", "tool_use_id": "tu2",
             "content": [{"type": "text", "text": "l1"}, {"type": "text", "text": "l2"}]},
        ]},
        {"role": "user", "content": "and test it"},
    ],
}  # fmt: skip


def test_claude_code_body_renders_as_vllm_converts_it(tiny):
    got = seen(echo(tiny), "/v1/messages", CLAUDE_CODE)
    assert got["m"] == [
        # billing-header block dropped whole; the others joined with no separator
        {"role": "system", "content": "You are Claude Code. Be terse."},
        {"role": "user", "content": "<system-reminder>r</system-reminder>\nfix the bug"},
        {"role": "assistant", "content": "Looking.", "reasoning": "look first",
         "reasoning_content": "look first",
         "tool_calls": [call("tu1", "Bash", {"command": "ls"}), call("tu2", "Read", {})]},
        {"role": "tool", "content": "a.py\nb.py", "tool_call_id": "tu1"},
        {"role": "tool", "content": "l1\nl2", "tool_call_id": "tu2"},
        # the tool_result-only user message is dropped
        {"role": "user", "content": "and test it"},
    ]  # fmt: skip
    assert got["t"] == [
        {"type": "function", "function": {
            "name": "Bash", "description": "Run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "Read", "description": None,
                                          "parameters": {"type": "object"},
                                          "defer_loading": True}},
    ]  # fmt: skip
    assert got["e"] is None and got["k"] is None


def test_tool_results_and_tools_reach_the_real_template(tiny):
    """The old text-only rendering dropped tools and tool results: the prompt is now longer
    by exactly their tokens."""
    p = request_prompt(tiny, "/v1/messages", CLAUDE_CODE)
    assert p is not None and not p.approximate
    assert '"name": "Bash"' in p.text and "a.py\nb.py" in p.text and "cch=" not in p.text
    assert "<|start_header_id|>tool<|end_header_id|>l1\nl2<|eot_id|>" in p.text


def test_anthropic_edge_blocks(tiny):
    body = {
        "system": "top",
        "thinking": {"type": "disabled"},
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "inline"}]},
            {"role": "user", "content": []},  # empty: dropped
            {"role": "assistant", "content": [
                {"type": "redacted_thinking", "data": "xx"},
                {"type": "tool_result", "tool_use_id": "t", "content": "r"},
                {"type": "tool_use", "name": "f"}]},
        ],
    }  # fmt: skip
    got = seen(echo(tiny), "/v1/messages", body)
    assert got["m"][0]["role"] == "system" and got["m"][1] == {
        "role": "system",
        "content": "inline",
    }
    asst = got["m"][2]
    assert asst["content"] == "Tool result: r" and asst["tool_calls"][0]["function"]["name"] == "f"
    assert asst["tool_calls"][0]["id"].startswith("call_")  # vLLM invents one
    # the echo template renders reasoning_effort="none" unlike any effort: vLLM sends "none"
    assert got["e"] == "none" and got["k"] is False
    # a system-first template: inline system text merged into the leading system message
    got = seen(echo(tiny, SYSTEM_FIRST), "/v1/messages", body)
    assert got["m"][0] == {"role": "system", "content": "topinline"}
    assert [m["role"] for m in got["m"]] == ["system", "assistant"]


def test_disabled_thinking_effort_probes_the_template(tiny):
    """vLLM sends ``low`` for ``thinking: disabled`` where the template rejects ``none`` or
    renders it like an effort, else ``none``."""
    rejects = "{% if reasoning_effort == 'none' %}{{ raise_exception('no') }}{% endif %}x"
    assert disabled_thinking_effort(echo(tiny)) == "none"
    assert disabled_thinking_effort(echo(tiny, "{{ messages | tojson }}")) == "low"
    assert disabled_thinking_effort(echo(tiny, rejects)) == "low"


def test_anthropic_tool_addition_and_removal(tiny):
    body = {
        "tools": [{"name": "a", "input_schema": {"type": "object"}, "defer_loading": True},
                  {"name": "b", "input_schema": {"type": "object"}}],
        "messages": [{"role": "user", "content": [
            {"type": "tool_addition", "tool": {"name": "a"}},
            {"type": "tool_removal", "tool": {"name": "b"}},
            {"type": "text", "text": "go"}]}],
    }  # fmt: skip
    got = seen(echo(tiny), "/v1/messages", body)
    assert [t["function"] for t in got["t"]] == [
        {"name": "a", "description": None, "parameters": {"type": "object"}}
    ]
    body["messages"][0]["content"][0]["tool"] = {"name": "zz"}
    with pytest.raises(ChatTemplateError, match="not declared"):
        request_prompt(tiny, "/v1/messages", body)


CODEX = {
    "model": "m",
    "instructions": "You are Codex.",
    "reasoning": {"effort": "medium"},
    "tools": [
        {"type": "function", "name": "shell", "description": "Run", "strict": False,
         "parameters": {"type": "object", "properties": {"command": {"type": "array"}}}},
        {"type": "custom", "name": "apply_patch", "description": "Patch",
         "format": {"type": "text"}},
        {"type": "web_search"},
        {"type": "namespace", "name": "mcp", "tools": [
            {"type": "function", "name": "fetch", "parameters": {"type": "object"}}]},
    ],
    "input": [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "<permissions>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "reasoning", "id": "rs", "summary": [{"type": "summary_text", "text": "plan"}]},
        {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"command":["ls"]}'},  # noqa: E501
        {"type": "function_call", "call_id": "c2", "name": "shell", "arguments": '{"command":["pwd"]}'},  # noqa: E501
        {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
        {"type": "function_call_output", "call_id": "c2", "output": "/w"},
        {"type": "message", "role": "assistant", "id": "m1", "status": "completed",
         "content": [{"type": "output_text", "text": "done", "annotations": []}]},
        {"type": "custom_tool_call", "call_id": "c3", "name": "apply_patch", "input": "*** Begin"},
        {"type": "custom_tool_call_output", "call_id": "c3", "output": "ok"},
        {"role": "user", "content": "more"},
    ],
}  # fmt: skip


def test_codex_body_renders_as_vllm_converts_it(tiny):
    """Checked against vLLM 0.32's own ``construct_input_messages`` / ``construct_tool_dicts``
    on this body (run once in the vLLM venv)."""
    got = seen(echo(tiny), "/v1/responses", CODEX)
    assert got["m"] == [
        # no developer role in the template: vLLM makes it system and merges the system
        # messages into the first (vllm/renderers/hf.py _consolidate_system_messages)
        {"role": "system", "content": "You are Codex.\n\n<permissions>"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "reasoning": "plan", "reasoning_content": "plan",
         "tool_calls": [call("c1", "shell", {"command": ["ls"]}),
                        call("c2", "shell", {"command": ["pwd"]})]},
        {"role": "tool", "content": "a.py", "tool_call_id": "c1"},
        {"role": "tool", "content": "/w", "tool_call_id": "c2"},
        {"role": "assistant", "content": "done",
         "tool_calls": [call("c3", "apply_patch", {"input": "*** Begin"})]},
        {"role": "tool", "content": "ok", "tool_call_id": "c3"},
        {"role": "user", "content": "more"},
    ]  # fmt: skip
    assert [t["function"]["name"] for t in got["t"]] == ["shell", "apply_patch", "mcp__fetch"]
    assert got["t"][0]["function"]["strict"] is False
    assert got["t"][1]["function"]["parameters"] == CUSTOM_TOOL_PARAMETERS
    assert got["e"] == "medium" and got["k"] is True
    assert not request_prompt(tiny, "/v1/responses", CODEX).approximate


def test_responses_previous_response_id_is_approximate_and_bad_items_fail(tiny):
    body = {"previous_response_id": "resp_1", "input": "next"}
    assert request_prompt(tiny, "/v1/responses", body).approximate
    with pytest.raises(ChatTemplateError, match="Unsupported input item type: item_reference"):
        request_prompt(tiny, "/v1/responses", {"input": [{"type": "item_reference", "id": "x"}]})
    with pytest.raises(ChatTemplateError, match="Encrypted"):
        item = {"type": "reasoning", "encrypted_content": "e", "summary": []}
        chat_request(tiny, "/v1/responses", {"input": [item]})


def test_developer_message_is_merged_into_the_system_message_on_chat_too(tiny):
    """vLLM's consolidation applies to chat completions as well (it happens in rendering)."""
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    msgs = [{"role": "system", "content": parts}, {"role": "user", "content": "u"},
            {"role": "developer", "content": "d"}]  # fmt: skip
    text = tiny.render(msgs)
    assert "<|start_header_id|>system<|end_header_id|>a\nb\n\nd<|eot_id|>" in text
    assert text.count("<|start_header_id|>system") == 1
    assert tiny.render(msgs[:2]).count("<|start_header_id|>system") == 1


def test_tokenize_request_sends_the_converted_chat_body():
    body = tokenize_request("/v1/messages", {**CLAUDE_CODE, "model": "tiny"})
    assert body["model"] == "tiny" and body["add_generation_prompt"] is True
    assert [t["function"]["name"] for t in body["tools"]] == ["Bash", "Read"]
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "tool",
                                                     "tool", "user"]  # fmt: skip
    body = tokenize_request("/v1/responses", {**CODEX, "model": "tiny"})
    assert body["chat_template_kwargs"] == {"reasoning_effort": "medium", "enable_thinking": True}
    assert body["add_special_tokens"] is True
    assert tokenize_request("/v1/responses", {"input": [{"type": "bogus"}]}) is None
