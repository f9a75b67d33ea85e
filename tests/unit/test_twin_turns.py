"""How a twin's reply ends (loadtest.twin.turns): lengths, finish, tool calls, arguments."""

from __future__ import annotations

import json
import statistics

import jsonschema
import pytest

from costmodel.profiles import ProfileError, load_profile, with_overrides
from loadtest.twin.replica import TwinConfig
from loadtest.twin.turns import TurnPolicy, example_arguments, split_pieces

POLICY = TurnPolicy()
TOOLS = [
    ("read", {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}),
    ("ls", {"type": "object", "properties": {}}),
]


def plan(prompt: list[int], **kw):
    return POLICY.plan(POLICY.rng(prompt), **kw)


def test_an_expected_length_ends_the_reply_by_itself_unless_the_cap_comes_first():
    t = plan([1, 2, 3], cap=100, expected=40)
    assert (t.tokens, t.natural) == (40, True)
    t = plan([1, 2, 3], cap=100, expected=100)  # vLLM checks EOS before the length cap
    assert (t.tokens, t.natural) == (100, True)
    t = plan([1, 2, 3], cap=100, expected=101)
    assert (t.tokens, t.natural) == (100, False)
    # the replay's override wins over ignore_eos (the replay sends both)
    assert plan([1, 2, 3], cap=32_000, expected=7, ignore_eos=True).tokens == 7


def test_ignore_eos_runs_to_the_cap_as_vllm_does():
    t = plan([4, 5, 6], cap=123, ignore_eos=True)
    assert (t.tokens, t.natural, t.capped) == (123, False, True)


def test_a_drawn_length_is_deterministic_per_prompt_and_follows_the_profile():
    a = [plan([9, i, 7], cap=100_000) for i in range(600)]
    assert all(t.natural for t in a)
    assert [t.tokens for t in a] == [plan([9, i, 7], cap=100_000).tokens for i in range(600)]
    med = statistics.median(t.tokens for t in a)
    assert 0.85 * 300 < med < 1.15 * 300, med  # the profile's median, 300
    assert len({t.tokens for t in a}) > 200  # a distribution, not one number
    short = TurnPolicy(output_median_tokens=20, output_sigma=0.0)
    assert short.plan(short.rng([1]), cap=1000).tokens == 20
    # another twin seed, another draw; a body seed changes it too
    other = TurnPolicy(seed=1)
    assert [other.plan(other.rng([9, i, 7]), cap=10**5).tokens for i in range(20)] != [
        t.tokens for t in a[:20]
    ]
    assert POLICY.rng([1], extra=5).random() != POLICY.rng([1]).random()


def test_min_tokens_holds_off_the_end():
    short = TurnPolicy(output_median_tokens=5, output_sigma=0.0)
    t = short.plan(short.rng([1]), cap=1000, min_tokens=50)
    assert (t.tokens, t.natural) == (50, True)


def test_tool_choice_required_named_and_none():
    for i in range(20):
        t = plan([i], cap=10_000, tools=TOOLS, tool_choice="required")
        assert t.tool_call is not None and t.tool_call.name in ("read", "ls")
        named = {"type": "function", "function": {"name": "ls"}}
        assert plan([i], cap=10_000, tools=TOOLS, tool_choice=named).tool_call.name == "ls"
        assert plan([i], cap=10_000, tools=TOOLS, tool_choice="none").tool_call is None
        assert plan([i], cap=10_000, tool_choice="required").tool_call is None  # no tools
    picked = {plan([i], cap=10_000, tools=TOOLS, tool_choice="required").tool_call.name
              for i in range(40)}  # fmt: skip
    assert picked == {"read", "ls"}


def test_a_reply_cut_at_its_cap_is_never_a_tool_call():
    for i in range(20):
        t = plan([i], cap=10_000, expected=10_001, tools=TOOLS, tool_choice="required")
        assert t.capped and t.tool_call is None


def test_auto_calls_a_tool_at_its_rate_and_less_after_a_tool_result():
    n = 400
    first = sum(plan([3, i], cap=10**5, tools=TOOLS).tool_call is not None for i in range(n))
    after = sum(
        plan([3, i], cap=10**5, tools=TOOLS, after_result=True).tool_call is not None
        for i in range(n)
    )
    assert 0.4 * n < first < 0.6 * n  # rate 0.5
    assert 0.1 * n < after < 0.3 * n  # rate 0.2 after a result: mostly text
    never = TurnPolicy(tool_call_rate=0.0)
    assert all(never.plan(never.rng([i]), cap=10**5, tools=TOOLS).tool_call is None
               for i in range(50))  # fmt: skip


def test_an_override_changes_the_length_and_not_the_tool_decision():
    for i in range(30):
        a = plan([5, i], cap=10**5, tools=TOOLS)
        b = plan([5, i], cap=10**5, tools=TOOLS, expected=17)
        assert b.tokens == 17 and (a.tool_call is None) == (b.tool_call is None)


def test_the_policy_and_the_config_refuse_bad_rates():
    with pytest.raises(ValueError):
        TurnPolicy(tool_call_rate=1.5)
    with pytest.raises(ValueError):
        TwinConfig(load_profile("cpu-tiny"), model_dir=".", tool_call_rate_after_result=-0.1)


def test_profiles_carry_an_output_length_distribution():
    p = load_profile("h200-70b-fp8")
    assert (p.output_median_tokens, p.output_sigma) == (300.0, 0.8)
    q = with_overrides(p, {"output_median_tokens": "216", "output_sigma": "0.5"})
    assert (q.output_median_tokens, q.output_sigma) == (216.0, 0.5)
    with pytest.raises(ProfileError):
        with_overrides(p, {"output_median_tokens": "0"})
    cfg = TwinConfig(q, model_dir=".")
    assert cfg.turn_policy().output_median_tokens == 216.0


def test_split_pieces_join_to_the_text_and_end_with_text():
    for text in ('{"path": "kvroute-twin"}', "{}", "x"):
        for n in (1, 2, 5, 24, 300):
            pieces = split_pieces(text, n)
            assert len(pieces) == n and "".join(pieces) == text and pieces[-1]


# real agents' tool schemas (trimmed): Claude Code, Codex, OpenCode, and the shapes around them
BASH = {"type": "object", "additionalProperties": False, "required": ["command"],
        "properties": {"command": {"type": "string"}, "timeout": {"type": "number",
                       "maximum": 600000}, "description": {"type": "string"}},
        "$schema": "http://json-schema.org/draft-07/schema#"}  # fmt: skip
TODO = {"type": "object", "required": ["todos"], "additionalProperties": False,
        "properties": {"todos": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["content", "status", "activeForm"],
            "additionalProperties": False,
            "properties": {"content": {"type": "string", "minLength": 1},
                           "status": {"type": "string",
                                      "enum": ["pending", "in_progress", "completed"]},
                           "activeForm": {"type": "string", "minLength": 1}}}}}}  # fmt: skip
SHELL = {"type": "object", "required": ["command"], "additionalProperties": False,
         "properties": {"command": {"type": "array", "items": {"type": "string"}},
                        "workdir": {"type": "string"},
                        "timeout_ms": {"type": "number"}}}  # fmt: skip
REFS = {"type": "object", "required": ["edit", "mode", "n", "x", "tag"],
        "$defs": {"Edit": {"type": "object", "required": ["old", "new"],
                           "properties": {"old": {"type": "string", "minLength": 20},
                                          "new": {"type": "string", "maxLength": 3}}}},
        "properties": {"edit": {"$ref": "#/$defs/Edit"},
                       "mode": {"anyOf": [{"type": "null"}, {"const": "fast"}]},
                       "n": {"type": "integer", "minimum": 3, "exclusiveMaximum": 9},
                       "x": {"type": ["null", "number"], "exclusiveMinimum": 2.5},
                       "tag": {"allOf": [{"type": "object", "required": ["a"],
                                          "properties": {"a": {"type": "boolean"}}},
                                         {"required": ["b"],
                                          "properties": {"b": {"type": "integer",
                                                               "maximum": -4}}}]}}}  # fmt: skip


@pytest.mark.parametrize("schema", [BASH, TODO, SHELL, REFS, {"type": "object"}, {}])
def test_arguments_satisfy_the_tools_schema(schema):
    args = example_arguments(schema)
    jsonschema.validate(args, schema)
    assert isinstance(args, dict)
    json.loads(json.dumps(args))
    if schema is SHELL:
        assert args == {"command": ["kvroute-twin"]}  # harmless when an agent runs it
