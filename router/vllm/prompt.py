"""The prompt text vLLM 0.32 builds from a request body on each route.

Owns: :func:`request_prompt` (the prompt text and special-token flag a replica tokenizes for a
call) and :func:`chat_request` (the chat-completion body vLLM renders for a route:
``/v1/messages`` through :mod:`router.vllm.anthropic_messages`, ``/v1/responses`` through
:mod:`router.vllm.openai_responses`, chat completions as they come) — shared by the router's KV
layer and the replica twin, so both render exactly what a replica would. The chat body is
rendered by :meth:`router.vllm.tokenizer.ModelTokenizer.render` with the request fields vLLM
reads (``build_chat_params``). Checked against real vLLM's ``/tokenize`` and agent-API usage
in the vllm tier. Must not import transformers, torch or vllm (ported by hand).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.vllm.anthropic_messages import (
    anthropic_chat_request,
    disabled_thinking_effort,
    merges_inline_system,
)
from router.vllm.chat_template import reasoning_kwargs
from router.vllm.openai_responses import responses_chat_request


@dataclass(frozen=True)
class PromptText:
    text: str
    add_special_tokens: bool  # completions: True (BOS from the post-processor); chat: False
    approximate: bool = False  # rendered from a shape vLLM would render differently


def chat_request(
    tokenizer: Any, route: str, body: Mapping[str, Any]
) -> tuple[dict[str, Any], bool] | None:
    """The chat-completion body vLLM renders for a call on ``route`` and whether it is
    approximate (``None``: no chat body — a completion)."""
    if route in ("/v1/messages", "/v1/messages/count_tokens"):
        merge = tokenizer is not None and any(
            isinstance(m, Mapping) and m.get("role") == "system"
            for m in body.get("messages") or []
        ) and merges_inline_system(tokenizer)  # fmt: skip
        thinking = body.get("thinking")
        off = isinstance(thinking, Mapping) and thinking.get("type") == "disabled"
        effort = disabled_thinking_effort(tokenizer) if off and tokenizer is not None else "none"
        return anthropic_chat_request(
            body, merge_inline_system=merge, disabled_effort=effort
        ), False
    if route == "/v1/responses":
        return responses_chat_request(body)
    if "messages" in body:
        return dict(body), False
    return None


def request_prompt(tokenizer: Any, route: str, body: Mapping[str, Any]) -> PromptText | None:
    """The prompt text a replica builds from ``body`` on ``route`` (``None``: no prompt, e.g.
    token-id prompts). ``tokenizer`` renders chat messages
    (:meth:`router.vllm.tokenizer.ModelTokenizer.render`). Chat bodies follow vLLM's request
    fields (``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``,
    ``reasoning_effort``, ``add_special_tokens``); ``/v1/messages`` and ``/v1/responses`` bodies
    are first converted to the chat body vLLM builds for them (:func:`chat_request`: system
    blocks, tool calls and results, reasoning, tools) and rendered the same way.
    Raises :class:`ChatTemplateError` when the messages cannot be rendered."""
    conv = chat_request(tokenizer, route, body)
    if conv is not None:
        req, approximate = conv
        kwargs = reasoning_kwargs(req.get("reasoning_effort"), req.get("chat_template_kwargs"))
        text = tokenizer.render(
            req["messages"],
            tools=req.get("tools"),
            add_generation_prompt=bool(req.get("add_generation_prompt", True)),
            continue_final_message=bool(req.get("continue_final_message", False)),
            chat_template_kwargs=kwargs,
        )
        return PromptText(text, bool(req.get("add_special_tokens", False)), approximate)
    if isinstance(body.get("prompt"), str):
        return PromptText(body["prompt"], True)
    return None
