"""Anthropic ``/v1/messages`` bodies as the chat request vLLM 0.32 renders for them.

Owns: :func:`anthropic_chat_request`, a port by hand of ``vllm/entrypoints/anthropic/serving.py``
(``AnthropicServingMessages.to_chat_completion_request`` with ``_convert_messages``,
``_convert_message_content``, ``_convert_block``, ``_convert_user_tool_result``,
``_extract_system_text``, ``_resolve_tools`` and ``_convert_tools``): system text and blocks,
tool calls and results, thinking, tools with their ``tool_addition`` / ``tool_removal``
blocks; and the two template probes vLLM runs once per server and the router once per
template (:func:`merges_inline_system`, :func:`disabled_thinking_effort`). Rendering the
result is :mod:`router.vllm.chat_template`'s; :func:`router.vllm.prompt.chat_request` picks
this conversion for ``/v1/messages`` and ``/v1/messages/count_tokens``. Checked against real
vLLM's agent-API usage in the vllm tier. Must not import transformers, torch or vllm.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from router.vllm.chat_template import (
    CLAUDE_CODE_BILLING_HEADER,
    ChatTemplateError,
    reasoning_kwargs,
)

ANTHROPIC_EFFORTS = ("low", "medium", "high", "xhigh", "max")  # vLLM's AnthropicEffort
_REASONING_PROBE = [{"role": "user", "content": "Hi"}]
_INLINE_SYSTEM_PROBE = [
    {"role": "system", "content": "t"},
    {"role": "user", "content": "t"},
    {"role": "system", "content": "t"},
    {"role": "user", "content": "t"},
]


def _blocks(content: Any) -> list[Mapping[str, Any]]:
    return [b for b in content if isinstance(b, Mapping)] if isinstance(content, list) else []


def _system_text(content: Any) -> str | None:
    """An Anthropic system string or text blocks, the billing-header blocks dropped, joined
    (vLLM's ``AnthropicServingMessages._extract_system_text``)."""
    if isinstance(content, str):
        return None if content.startswith(CLAUDE_CODE_BILLING_HEADER) else content
    parts = [
        b["text"]
        for b in _blocks(content)
        if b.get("type") == "text"
        and isinstance(b.get("text"), str)
        and b["text"]
        and not b["text"].startswith(CLAUDE_CODE_BILLING_HEADER)
    ]
    return "".join(parts) if parts else None


def _image_url(source: Any) -> str:
    src = source if isinstance(source, Mapping) else {}
    if src.get("type") == "url":
        return str(src.get("url", ""))
    return f"data:{src.get('media_type', 'image/jpeg')};base64,{src.get('data', '')}"


def _user_tool_result(block: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
    """vLLM's ``AnthropicServingMessages._convert_user_tool_result``: a ``tool`` message (its
    text items joined by newlines), then the result's images as a user message and its
    ``tool_reference`` items as a second tool message."""
    text, images, refs = "", [], []
    content = block.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in _blocks(content):
            if item.get("type") == "text":
                texts.append(str(item.get("text", "")))
            elif item.get("type") == "image":
                url = _image_url(item.get("source", {}))
                if url:
                    images.append(url)
            elif item.get("type") == "tool_reference":
                name = item.get("tool_name") or item.get("name")
                if name:
                    refs.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    call_id = block.get("tool_use_id") or ""
    out.append({"role": "tool", "tool_call_id": call_id, "content": text or ""})
    if images:
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in images]
        out.append({"role": "user", "content": parts})
    if refs:
        out.append({"role": "tool", "tool_call_id": call_id, "content": refs})


def _anthropic_message(m: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
    """One Anthropic message appended to ``out`` as vLLM's ``_convert_messages`` /
    ``_convert_message_content`` / ``_convert_block`` do: text and image blocks become content
    (one text block: a plain string), ``thinking`` the message's ``reasoning``, ``tool_use``
    its ``tool_calls``; a user's ``tool_result`` becomes a ``tool`` message *before* it, an
    assistant's a ``"Tool result: ..."`` text part; a user message left empty is dropped."""
    role = m.get("role", "user")
    msg: dict[str, Any] = {"role": role}
    content = m.get("content")
    if isinstance(content, str):
        msg["content"] = content
    else:
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for b in _blocks(content):
            kind = b.get("type")
            if kind == "text" and b.get("text"):
                parts.append({"type": "text", "text": b["text"]})
            elif kind == "image" and b.get("source"):
                parts.append({"type": "image_url", "image_url": {"url": _image_url(b["source"])}})
            elif kind == "thinking" and b.get("thinking") is not None:
                reasoning.append(str(b["thinking"]))
            elif kind == "tool_use":
                calls.append(
                    {
                        # vLLM invents ``call_<unix time>`` for a missing id
                        "id": b.get("id") or f"call_{int(time.time())}",
                        "type": "function",
                        "function": {
                            "name": b.get("name") or "",
                            "arguments": json.dumps(b.get("input") or {}),
                        },
                    }
                )
            elif kind == "tool_result":
                if role == "user":
                    _user_tool_result(b, out)
                else:  # str() of the content as vLLM has it (a list: its Python repr)
                    res = str(b["content"]) if b.get("content") else ""
                    parts.append({"type": "text", "text": f"Tool result: {res}"})
            # redacted_thinking, tool_reference, tool_addition/removal: nothing rendered
        if reasoning:
            msg["reasoning"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        if len(parts) == 1 and parts[0]["type"] == "text":
            msg["content"] = parts[0]["text"]
        elif parts:
            msg["content"] = parts
    if not (role == "user" and "content" not in msg):
        out.append(msg)


def _anthropic_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """``tools`` as OpenAI function tools after the messages' ``tool_addition`` /
    ``tool_removal`` blocks (vLLM's ``_resolve_tools`` + ``_convert_tools``)."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return None
    by_name = {t["name"]: dict(t) for t in tools if isinstance(t, Mapping) and "name" in t}
    removed: set[str] = set()
    for m in body.get("messages") or []:
        for b in _blocks(m.get("content") if isinstance(m, Mapping) else None):
            if b.get("type") not in ("tool_addition", "tool_removal"):
                continue
            tool = b.get("tool")
            change: Mapping[str, Any] = tool if isinstance(tool, Mapping) else {}
            if isinstance(change.get("definition"), Mapping):
                name = change["definition"].get("name")
                by_name[name] = dict(change["definition"])
            else:
                name = change.get("name")
                if name not in by_name:
                    raise ChatTemplateError(
                        f"{b['type']} references tool {name!r}, which is not declared in tools"
                    )
                if b["type"] == "tool_addition":
                    by_name[name]["defer_loading"] = None
            (removed.add if b["type"] == "tool_removal" else removed.discard)(name)
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description"),
                "parameters": t.get("input_schema"),
                "strict": t.get("strict"),
                "defer_loading": t.get("defer_loading"),
            },
        }
        for name, t in by_name.items()
        if name not in removed
    ]


def _renders(tokenizer: Any, messages: list[dict[str, Any]], **kw: Any) -> str | None:
    try:
        return tokenizer.render(messages, add_generation_prompt=False, **kw)
    except ChatTemplateError:
        return None


_PROBED: dict[tuple[str, str | None], Any] = {}  # (probe, template source) → its answer


def _probed(name: str, tokenizer: Any, probe: Any) -> Any:
    """A template probe's answer, once per template (vLLM probes once per server)."""
    key = (name, getattr(tokenizer, "chat_template", None))
    if key not in _PROBED:
        _PROBED[key] = probe(tokenizer)
    return _PROBED[key]


def merges_inline_system(tokenizer: Any) -> bool:
    """Whether vLLM merges a ``/v1/messages`` request's inline system messages into the leading
    one: when the template rejects a non-leading system message
    (``AnthropicServingMessages._detect_merge_inline_system``)."""
    return _probed("merge", tokenizer, lambda t: _renders(t, _INLINE_SYSTEM_PROBE) is None)


def disabled_thinking_effort(tokenizer: Any) -> str:
    """The ``reasoning_effort`` vLLM sends for ``thinking: {"type": "disabled"}``: ``none``,
    or ``low`` where the template rejects ``none`` or renders it like an effort
    (``AnthropicServingMessages._probe_disabled_thinking_effort``)."""

    def probe(e: str) -> str | None:
        kw = reasoning_kwargs(e, None)
        return _renders(tokenizer, _REASONING_PROBE, chat_template_kwargs=kw)

    def effort(_: Any) -> str:
        none = probe("none")
        if none is None or any(probe(e) == none for e in ANTHROPIC_EFFORTS):
            return "low"
        return "none"

    return _probed("effort", tokenizer, effort)


def anthropic_chat_request(
    body: Mapping[str, Any], *, merge_inline_system: bool = False, disabled_effort: str = "none"
) -> dict[str, Any]:
    """An Anthropic ``/v1/messages`` (or ``count_tokens``) body as the chat-completion body vLLM
    0.32 renders for it (``vllm/entrypoints/anthropic/serving.py``,
    ``AnthropicServingMessages.to_chat_completion_request``): one system message from the
    ``system`` string or text blocks joined with no separator (billing-header blocks dropped;
    with ``merge_inline_system`` the inline system messages' text too), the messages converted
    block by block (:func:`_anthropic_message`), ``tools`` as OpenAI function tools
    (``input_schema`` → ``parameters``), and the reasoning effort from ``thinking`` /
    ``output_config.effort``. ``tool_choice`` is left out: it changes the rendered prompt only
    for Kimi-K3's renderer, which the router does not model."""
    msgs: list[dict[str, Any]] = []
    raw = [m for m in body.get("messages") or [] if isinstance(m, Mapping)]
    top = body.get("system")  # a top-level string is kept whole; only its blocks are filtered
    system = [top if isinstance(top, str) else _system_text(top)] if top else []
    if merge_inline_system:
        system += [_system_text(m.get("content")) for m in raw if m.get("role") == "system"]
    if any(system):
        msgs.append({"role": "system", "content": "".join(s for s in system if s)})
    for m in raw:
        if m.get("role") == "system":
            text = None if merge_inline_system else _system_text(m.get("content"))
            if text:
                msgs.append({"role": "system", "content": text})
        else:
            _anthropic_message(m, msgs)
    effort = None
    out_cfg = body.get("output_config")
    if isinstance(out_cfg, Mapping) and out_cfg.get("effort") is not None:
        effort = out_cfg["effort"]
    thinking = body.get("thinking")
    if isinstance(thinking, Mapping) and thinking.get("type") == "disabled":
        effort = disabled_effort
    req: dict[str, Any] = {"messages": msgs, "add_generation_prompt": True}
    kwargs = reasoning_kwargs(effort, body.get("chat_template_kwargs"))
    if kwargs:
        req["chat_template_kwargs"] = kwargs
    tools = _anthropic_tools(body)
    if tools is not None:
        req["tools"] = tools
    return req
