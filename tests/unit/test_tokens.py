"""Tokens: chat rendering, and incremental per-session tokenization == full tokenization."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadtest import tinymodel
from router.kv.tokens import SessionTokenizer, common_prefix_len
from router.vllm.chat_template import ChatTemplateError
from router.vllm.hashing import BlockHasher
from router.vllm.tokenizer import ModelTokenizer, TokenizerLoadError


@pytest.fixture(scope="module")
def mtok() -> ModelTokenizer:
    return ModelTokenizer.from_dir(tinymodel.ensure())


def full(mtok: ModelTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return mtok.encode(text, add_special_tokens=add_special_tokens)


PIECES = st.sampled_from(
    [
        "the",
        " cache",
        " block",
        "  ",
        " ",
        "\n",
        "\n\n",
        " \n",
        "\t",
        "123",
        "4567",
        "!",
        "?!",
        "'s",
        "def f(x):",
        "    return x",
        "é",
        "日本",
        "🙂",
        "<|eot_id|>",
        "<|start_header_id|>user<|end_header_id|>\n\n",
        " replica",
        "_",
        "--",
        "x",
    ]
)
TEXT = st.lists(PIECES, min_size=0, max_size=60).map("".join)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=TEXT,
    edits=st.lists(st.tuples(st.integers(0, 100), TEXT), min_size=1, max_size=4),
    add_special=st.booleans(),
)
def test_incremental_equals_full_tokenization(mtok, base, edits, add_special):
    hasher = BlockHasher(4)  # small blocks: many block boundaries near the cut
    inc = SessionTokenizer(mtok, hasher)
    text = base * 3
    got = inc.prompt(text, session="s", add_special_tokens=add_special)
    assert got.tokens() == full(mtok, text, add_special)
    for keep_pct, tail in edits:
        # the next call keeps a prefix of the previous text (usually all of it) and adds more
        keep = len(text) if keep_pct >= 50 else len(text) * keep_pct // 50
        text = text[:keep] + tail
        got = inc.prompt(text, session="s", add_special_tokens=add_special)
        want = full(mtok, text, add_special)
        assert got.tokens() == want
        assert got.keys == hasher.hash_keys(want)


def test_next_call_reuses_almost_everything(mtok):
    hasher = BlockHasher(32)
    inc = SessionTokenizer(mtok, hasher)
    msgs = [
        {"role": "system", "content": "You are a coding agent. " * 200},
        {"role": "user", "content": "read the file and fix the test " * 50},
    ]
    p1 = inc.prompt(mtok.render(msgs), session="s")
    msgs += [
        {"role": "assistant", "content": "I will call the tool now."},
        {"role": "tool", "content": "def f(x):\n    return x + 1\n" * 20},
        {"role": "user", "content": "now run the tests"},
    ]
    text2 = mtok.render(msgs)
    p2 = inc.prompt(text2, session="s")
    assert p2.tokens() == mtok.encode(text2)
    assert p2.reused_tokens >= p1.n_tokens - 40  # only the generation prompt's tail redone
    assert p2.keys[: len(p1.keys) - 2] == p1.keys[: len(p1.keys) - 2]
    assert inc.stats["incremental"] == 1
    other = inc.prompt(text2, session="t")  # a different session starts from scratch
    assert other.reused_tokens == 0 and other.keys == p2.keys


def test_salt_or_specials_change_forces_full_and_lru_bounds(mtok):
    inc = SessionTokenizer(mtok, BlockHasher(8), max_sessions=2)
    t = "the cache block " * 40
    a = inc.prompt(t, session="s")
    b = inc.prompt(t + "more", session="s", cache_salt="tenant-1")
    assert b.reused_tokens == 0 and b.keys[0] != a.keys[0]
    inc.prompt(t, session="u")
    inc.prompt(t, session="v")
    assert len(inc) == 2  # "s" was the least recently used
    assert inc.prompt(t + " x", session="s").reused_tokens == 0


def test_render_normalizes_messages_like_vllm(mtok):
    msgs = [
        {
            "role": "system",
            "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=123\nkeep me"}],
        },
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "1",
                    "type": "function",
                    "function": {"name": "grep", "arguments": '{"q": 1}'},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "1",
            "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}],
        },
    ]
    text = mtok.render(msgs, tools=[{"type": "function", "function": {"name": "grep"}}])
    assert "cch=123" not in text and "keep me" in text
    assert "ab" in text  # the template iterates parts: "openai" content format
    assert "r1\nr2" in text  # tool results are joined to one string
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>")  # `{%-` trims
    assert mtok.content_format == "openai"


def test_bad_inputs_are_clear_errors(mtok, tmp_path):
    with pytest.raises(ChatTemplateError, match="role"):
        mtok.render([{"content": "x"}])
    with pytest.raises(ChatTemplateError, match="exclude"):
        mtok.render([{"role": "user", "content": "x"}], continue_final_message=True)
    with pytest.raises(TokenizerLoadError, match=r"tokenizer\.json"):
        ModelTokenizer.from_dir(tmp_path)


@pytest.mark.parametrize(
    ("a", "b", "n"),
    [
        ("", "", 0),
        ("abc", "abd", 2),
        ("abc", "abc", 3),
        ("x" * 100_000 + "a", "x" * 100_000 + "b", 100_000),
        ("ab", "abc", 2),
    ],
)
def test_common_prefix_len(a, b, n):
    assert common_prefix_len(a, b) == n
