"""Prompt synthesis: every block is exactly block_size tokens, through the chat template too."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadtest import tinymodel
from loadtest.prompts import PromptBuilder, PromptError, load_tokenizer, render_chat
from loadtest.traces.model import Call

BS = 32


@pytest.fixture(scope="module")
def model_dir():
    return tinymodel.ensure()


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def pb(model_dir):
    return PromptBuilder(model_dir, block_size=BS, trace_block_size=64)


def _encode_chat(tok, messages):
    t, template, bos = tok
    return t.encode(render_chat(template, messages, bos), add_special_tokens=False).ids


def _call(ids, n_in, **kw):
    return Call(id="c", agent="main", hash_ids=tuple(ids), input_tokens=n_in, output_tokens=1, **kw)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ids=st.lists(st.integers(0, 2**40), min_size=1, max_size=12),
    frac=st.floats(0.0, 1.0),
    ns=st.text(min_size=1, max_size=8),
    play=st.integers(0, 3),
)
def test_rendered_chat_tokenizes_to_the_predicted_ids(pb, tok, ids, frac, ns, play):
    n_in = int((len(ids) - 1) * 64 + 1 + frac * 63)
    p = pb.build(_call(ids, n_in), ns, play)
    assert p.content_tokens == n_in  # tokens_per_id == trace block size: counts kept
    assert _encode_chat(tok, p.messages) == p.token_ids
    assert p.n_tokens == n_in + pb.template_tokens


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(key=st.tuples(st.text(max_size=6), st.integers(0, 2**62), st.integers(0, 7)))
def test_every_block_is_exactly_block_size_tokens_alone_and_concatenated(pb, tok, key):
    text, ids = pb.block(*key)
    t = tok[0]
    assert len(ids) == BS
    assert t.encode(text, add_special_tokens=False).ids == ids
    other_text, other_ids = pb.block(key[0], key[1] + 1, key[2])
    assert t.encode(text + other_text, add_special_tokens=False).ids == ids + other_ids
    assert pb.block(*key) == (text, ids)  # deterministic


def test_blocks_are_a_pure_function_of_the_key(model_dir):
    a = PromptBuilder(model_dir, block_size=BS, trace_block_size=64)
    b = PromptBuilder(model_dir, block_size=BS, trace_block_size=64)
    assert a.block("s", 5, 1) == b.block("s", 5, 1)
    assert a.block("s", 5, 1) != a.block("s", 5, 0) != a.block("t", 5, 1)


def test_equal_ids_share_an_exact_token_prefix_and_plays_do_not(pb):
    x = pb.build(_call([1, 2, 3], 190), "sess", 0)
    y = pb.build(_call([1, 2, 3, 4, 5], 300), "sess", 0)
    n = len(pb._head_ids) + 3 * 64 - 2  # 190 content tokens: last trace block partial
    assert y.token_ids[:n] == x.token_ids[:n]
    replayed = pb.build(_call([1, 2, 3, 4, 5], 300), "sess", 1)
    assert replayed.token_ids[: len(pb._head_ids)] == y.token_ids[: len(pb._head_ids)]
    first_content = len(pb._head_ids)
    assert (
        replayed.token_ids[first_content : first_content + BS]
        != (y.token_ids[first_content : first_content + BS])
    )


def test_shared_prefix_maps_tools_and_system_blocks_across_sessions(model_dir):
    on = PromptBuilder(model_dir, block_size=BS, trace_block_size=64, shared_prefix=True)
    off = PromptBuilder(model_dir, block_size=BS, trace_block_size=64)
    c = _call([1, 2, 3, 4], 256, prefix_blocks=2, prefix_group="main")
    h = len(on._head_ids)
    a, b = on.build(c, "s1", 0), on.build(c, "s2", 3)
    assert a.token_ids[: h + 128] == b.token_ids[: h + 128]  # 2 shared ids = 128 tokens
    assert a.token_ids[h + 128 : h + 160] != b.token_ids[h + 128 : h + 160]
    a2, b2 = off.build(c, "s1", 0), off.build(c, "s2", 0)
    assert a2.token_ids[h : h + 32] != b2.token_ids[h : h + 32]


def test_rescaling_shrinks_contexts_and_keeps_block_structure(model_dir, tok):
    small = PromptBuilder(model_dir, block_size=BS, trace_block_size=512, tokens_per_id=32)
    c1 = _call([7, 8, 9], 1400)  # Mooncake: 3 ids of 512 tokens
    c2 = _call([7, 8, 10], 1500)
    p1, p2 = small.build(c1, "m", 0), small.build(c2, "m", 0)
    assert p1.content_tokens == round(1400 * 32 / 512) == 88
    assert p2.content_tokens == 94
    h = len(small._head_ids)
    assert p1.token_ids[: h + 64] == p2.token_ids[: h + 64]  # ids 7, 8 shared
    assert p1.token_ids[h + 64 : h + 88] != p2.token_ids[h + 64 : h + 88]
    assert _encode_chat(tok, p1.messages) == p1.token_ids
    with pytest.raises(PromptError, match="multiple"):
        PromptBuilder(model_dir, block_size=BS, trace_block_size=64, tokens_per_id=48)


def test_max_prompt_tokens_truncates_from_the_end(model_dir, tok):
    capped = PromptBuilder(model_dir, block_size=BS, trace_block_size=64, max_prompt_tokens=200)
    full = PromptBuilder(model_dir, block_size=BS, trace_block_size=64)
    c = _call(list(range(10)), 640)
    p, q = capped.build(c, "s", 0), full.build(c, "s", 0)
    assert p.n_tokens == 200
    tail = len(capped._tail_ids)
    assert p.token_ids[:-tail] == q.token_ids[: 200 - tail]
    assert _encode_chat(tok, p.messages) == p.token_ids
