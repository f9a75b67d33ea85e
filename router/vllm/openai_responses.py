"""OpenAI ``/v1/responses`` bodies as the chat request vLLM 0.32 renders for them.

Owns: :func:`responses_chat_request`, a port by hand of ``vllm/renderers/online_renderer.py``
``render_responses`` with ``vllm/entrypoints/openai/responses/utils.py``
(``construct_input_messages``, ``_construct_message_from_response_item``,
``construct_tool_dicts``) and ``vllm/tool_parsers/utils.py`` (``get_function_tools``,
``custom_tool_parameters``, ``custom_tool_as_function_dict``): input items folded into chat
messages; function, namespace and custom tools. Rendering the result is
:mod:`router.vllm.chat_template`'s; :func:`router.vllm.prompt.chat_request` picks this
conversion for ``/v1/responses``. Checked against real vLLM's agent-API usage in the vllm
tier. Harmony models (gpt-oss) render Responses differently and are not modelled. Must not
import transformers, torch or vllm.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from router.vllm.chat_template import ChatTemplateError, reasoning_kwargs

# vLLM's ``custom_tool_parameters()``: the shim a freeform custom tool is shown to the model as
CUSTOM_TOOL_PARAMETERS = {
    "type": "object",
    "properties": {
        "input": {"type": "string", "description": "The freeform text payload for this tool."}
    },
    "required": ["input"],
    "additionalProperties": False,
}


def _responses_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The function tools vLLM renders from a Responses ``tools`` list (``construct_tool_dicts``
    / ``get_function_tools``): ``function`` tools, and a ``namespace`` tool's functions named
    ``<namespace>__<name>``, and a ``custom`` tool (Codex's freeform ``apply_patch``) as
    vLLM's one-string function shim (``custom_tool_as_function_dict``). Built-in tools
    (``web_search``, ``file_search``, ``mcp``, ...) are not shown to a non-Harmony model and
    are dropped, as vLLM drops them."""
    if not isinstance(tools, list) or not tools:
        return None
    flat: list[Mapping[str, Any]] = []
    for t in tools:
        if not isinstance(t, Mapping):
            continue
        if t.get("type") == "function":
            flat.append(t)
        elif t.get("type") == "custom":
            flat.append({"name": t.get("name"), "description": t.get("description"),
                         "parameters": CUSTOM_TOOL_PARAMETERS})  # fmt: skip
        elif t.get("type") == "namespace":
            flat += [
                {**f, "name": f"{t.get('name')}__{f.get('name')}"}
                for f in t.get("tools") or []
                if isinstance(f, Mapping) and f.get("type") == "function"
            ]
    return [
        {"type": "function", "function": {k: v for k, v in f.items() if k != "type"}} for f in flat
    ]


def _chat_parts(content: Any) -> Any:
    """Responses ``input_text`` / ``output_text`` parts as chat ``text`` parts: vLLM's chat
    parser reads them alike, and a chat request (``/tokenize``) accepts only the latter."""
    if not isinstance(content, list):
        return content
    return [
        {"type": "text", "text": p.get("text", "")}
        if isinstance(p, Mapping) and p.get("type") in ("input_text", "output_text")
        else p
        for p in content
    ]


def _responses_item(item: Any, prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's ``_construct_message_from_response_item``: a new chat message, or ``None`` when
    the item was folded into ``prev`` (an assistant message: consecutive function calls,
    reasoning and output text join one assistant turn)."""
    if not isinstance(item, Mapping):
        raise ChatTemplateError("each input item must be an object")
    asst = prev if prev is not None and prev.get("role") == "assistant" else None
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        name, args = item.get("name"), item.get("arguments")
        if kind == "custom_tool_call":  # vLLM's encode_custom_tool_input
            args = json.dumps({"input": item.get("input") or ""}, ensure_ascii=False)
        elif item.get("namespace"):
            name = f"{item['namespace']}__{name}"
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": name, "arguments": args}}  # fmt: skip
        if asst is not None and isinstance(asst.setdefault("tool_calls", []), list):
            asst["tool_calls"].append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise ChatTemplateError("Encrypted content is not supported.")
        texts = item.get("content") or item.get("summary") or [{}]
        reasoning = texts[0].get("text", "") if isinstance(texts[0], Mapping) else ""
        if asst is not None and asst.get("reasoning") is None:
            asst["reasoning"] = reasoning
            return None
        return {"role": "assistant", "reasoning": reasoning}
    if kind in ("function_call_output", "custom_tool_call_output"):
        out = _chat_parts(item.get("output"))
        return {"role": "tool", "content": out, "tool_call_id": item.get("call_id")}
    if item.get("role") == "assistant":  # an output message or an assistant input message
        content = item.get("content")
        text = content if isinstance(content, str) else None
        if isinstance(content, list) and content and isinstance(content[0], Mapping):
            text = content[0].get("text")
        if text is not None:
            if asst is not None and asst.get("content") is None:
                asst["content"] = text
                return None
            return {"role": "assistant", "content": text}
    if "role" in item:
        msg = {k: v for k, v in item.items() if k not in ("type", "status", "id")}
        return {**msg, "content": _chat_parts(item.get("content"))}
    raise ChatTemplateError(f"Unsupported input item type: {kind}")


def responses_chat_request(body: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """An OpenAI ``/v1/responses`` body as the chat-completion body vLLM 0.32 renders for it
    (``vllm/renderers/online_renderer.py`` ``render_responses`` with
    ``vllm/entrypoints/openai/responses/utils.py`` ``construct_input_messages`` and
    ``construct_tool_dicts``), and whether that is approximate: ``instructions`` as the system
    message, a string ``input`` as one user message, input items through
    :func:`_responses_item`, function tools (:func:`_responses_tools`), ``reasoning.effort``;
    tokenized with ``add_special_tokens`` (unlike chat completions).
    Approximate when the body has a ``previous_response_id``: vLLM prepends that stored
    response's conversation (with ``VLLM_ENABLE_RESPONSES_API_STORE``), which the router
    cannot see. Harmony models (gpt-oss) render Responses differently and are not modelled."""
    msgs: list[dict[str, Any]] = []
    if body.get("instructions"):
        msgs.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        msgs.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for it in items:
            m = _responses_item(it, msgs[-1] if msgs else None)
            if m is not None:
                msgs.append(m)
    else:
        raise ChatTemplateError("input must be a string or a list of items")
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, Mapping) else None
    # vLLM tokenizes a Responses prompt with the tokenizer's special tokens (``TokenizeParams``'
    # default; ``ResponsesRequest.build_tok_params`` leaves it): a BOS-adding tokenizer puts a
    # second BOS before the template's
    req: dict[str, Any] = {"messages": msgs, "add_generation_prompt": True,
                           "add_special_tokens": True}  # fmt: skip
    kwargs = reasoning_kwargs(effort, body.get("chat_template_kwargs"))
    if kwargs:
        req["chat_template_kwargs"] = kwargs
    tools = _responses_tools(body.get("tools"))
    if tools:
        req["tools"] = tools
    return req, bool(body.get("previous_response_id"))
