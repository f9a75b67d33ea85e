"""vLLM's chat-template rendering, byte for byte: message and tool normalization, the jinja env.

Owns: compiling a model's chat template as transformers compiles it for vLLM (sandboxed jinja
environment, ``raise_exception``, ``tojson``, ``strftime_now``, the ``{% generation %}`` tag),
detecting the template's content format (string or OpenAI parts), normalizing chat messages
and tools as vLLM 0.32 does before it renders them, and :func:`request_prompt`: the prompt text
and special-token flag vLLM builds from a request body on each route — shared by the router's
KV layer and the replica twin, so both render exactly what a replica would. Checked against
real vLLM's ``/tokenize`` in the vllm tier. Must not import transformers, torch or vllm.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

CLAUDE_CODE_BILLING_HEADER = "x-anthropic-billing-header"  # vLLM drops this system line


class ChatTemplateError(ValueError):
    pass


# ---- chat template (as transformers compiles it for vLLM) --------------------------------


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (as transformers does)."""

    tags = {"generation"}  # noqa: RUF012 - jinja's API

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


def detect_content_format(source: str) -> str:
    """``"openai"`` when the template loops over a message's content parts, else ``"string"``
    (the rule vLLM's ``_detect_content_format`` applies, without its macro tracking)."""
    env = jinja2.Environment(extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    try:
        ast = env.parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        if isinstance(it, jinja2.nodes.Name) and it.name == "content":
            return "openai"
        if (
            isinstance(it, jinja2.nodes.Getitem)
            and isinstance(it.arg, jinja2.nodes.Const)
            and it.arg.value == "content"
        ):
            return "openai"
        if isinstance(it, jinja2.nodes.Getattr) and it.attr == "content":
            return "openai"
    return "string"


def _text_parts(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ChatTemplateError(
            f"message content must be a string or a list, not {type(content).__name__}"
        )
    out = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, dict) and part.get("type") in ("text", "input_text"):
            out.append(str(part.get("text", "")))
        elif isinstance(part, dict) and "text" in part and "type" not in part:
            out.append(str(part["text"]))
        # images/audio: the router cannot hash multimodal inputs; they are skipped here
    return out


def normalize_messages(
    messages: Sequence[Mapping[str, Any]], content_format: str, developer_ok: bool
) -> list[dict[str, Any]]:
    """OpenAI chat messages to the conversation vLLM hands the template."""
    conv: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, Mapping) or "role" not in m:
            raise ChatTemplateError("each message needs a role")
        role = m["role"]
        texts = _text_parts(m.get("content"))
        if role == "system":
            kept = []
            for t in texts:
                if t.startswith(CLAUDE_CODE_BILLING_HEADER):
                    rest = t.partition("\n")[2]
                    if rest:
                        kept.append(rest)
                else:
                    kept.append(t)
            texts = kept
        msg: dict[str, Any] = {"role": role}
        if content_format == "openai":
            msg["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            msg["content"] = "\n".join(texts)
        if role == "assistant":
            calls = m.get("tool_calls")
            if isinstance(calls, list) and calls:
                msg["tool_calls"] = [_parse_call(c) for c in calls]
            if m.get("reasoning") is not None:
                msg["reasoning"] = msg["reasoning_content"] = m["reasoning"]
        elif role == "tool":
            if "tool_call_id" in m:
                msg["tool_call_id"] = m["tool_call_id"]
            if isinstance(msg["content"], list):
                msg["content"] = "\n".join(texts)
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if role == "developer":
            if developer_ok:
                msg["tools"] = m.get("tools")
            else:
                msg["role"] = "system"
        conv.append(msg)
    return conv


def normalize_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools as vLLM hands them to the template (``ChatCompletionToolsParam.model_dump()``:
    unknown keys dropped, ``description``/``parameters`` always present, ``strict`` and
    ``defer_loading`` only when set)."""
    if tools is None:
        return None
    out = []
    for t in tools:
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ChatTemplateError("each tool needs a function with a name")
        f: dict[str, Any] = {
            "name": fn["name"],
            "description": fn.get("description"),
            "parameters": fn.get("parameters"),
        }
        defer = fn.get("defer_loading", t.get("defer_loading"))
        for k, v in (("strict", fn.get("strict")), ("defer_loading", defer)):
            if v is not None:
                f[k] = v
        tool: dict[str, Any] = {"type": t.get("type", "function"), "function": f}
        if t.get("defer_loading") is not None:
            tool["defer_loading"] = t["defer_loading"]
        out.append(tool)
    return out


def _parse_call(call: Any) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ChatTemplateError("assistant tool_calls entries must be function objects")
    call = copy.deepcopy(call)
    args = call["function"].get("arguments")
    if args and isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            parsed = {}
        call["function"]["arguments"] = parsed if isinstance(parsed, dict) else {}
    elif not args:
        call["function"]["arguments"] = {}
    return call


# ---- a request body as the prompt text vLLM builds from it --------------------------------


@dataclass(frozen=True)
class PromptText:
    text: str
    add_special_tokens: bool  # completions: True (BOS from the post-processor); chat: False
    approximate: bool = False  # rendered from a shape vLLM would render differently


def anthropic_as_chat(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An Anthropic ``/v1/messages`` body as OpenAI chat messages (text parts only)."""

    def text(c: Any) -> str:
        if isinstance(c, str):
            return c
        if isinstance(c, list):
            return "".join(
                p.get("text", "") for p in c if isinstance(p, dict) and p.get("type") == "text"
            )
        return ""

    msgs: list[dict[str, Any]] = []
    if body.get("system"):
        msgs.append({"role": "system", "content": text(body["system"])})
    for m in body.get("messages") or []:
        if isinstance(m, dict):
            msgs.append({"role": m.get("role", "user"), "content": text(m.get("content"))})
    return msgs


def responses_as_chat(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An OpenAI ``/v1/responses`` body (``instructions`` + ``input``: a string or a list of
    message / function-call items) as chat messages, text parts only."""

    def text(c: Any) -> str:
        if isinstance(c, str):
            return c
        if isinstance(c, list):
            return "".join(str(p.get("text", "")) for p in c if isinstance(p, dict) and "text" in p)
        return ""

    msgs: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        msgs.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        return [*msgs, {"role": "user", "content": items}]
    for it in items if isinstance(items, list) else []:
        if not isinstance(it, dict):
            continue
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role", "user")
            role = "system" if role == "developer" else role
            msgs.append({"role": str(role), "content": text(it.get("content"))})
        elif kind == "function_call":
            msgs.append({"role": "assistant", "content": f"{it.get('name', '')}"
                         f"({it.get('arguments', '')})"})  # fmt: skip
        elif kind == "function_call_output":
            msgs.append({"role": "user", "content": text(it.get("output"))})
    return msgs


def request_prompt(tokenizer: Any, route: str, body: Mapping[str, Any]) -> PromptText | None:
    """The prompt text a replica builds from ``body`` on ``route`` (``None``: no prompt, e.g.
    token-id prompts). ``tokenizer`` renders chat messages
    (:meth:`router.vllm.tokenizer.ModelTokenizer.render`). Chat bodies follow vLLM's request
    fields (``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``,
    ``add_special_tokens``); ``/v1/messages`` and ``/v1/responses`` are rendered from their
    text parts through the same template (approximate: vLLM's Anthropic and Responses adapters
    may differ in the details).
    Raises :class:`ChatTemplateError` when the messages cannot be rendered."""
    if "messages" in body and route not in ("/v1/messages", "/v1/messages/count_tokens"):
        kwargs = body.get("chat_template_kwargs")
        text = tokenizer.render(
            body["messages"],
            tools=body.get("tools"),
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            continue_final_message=bool(body.get("continue_final_message", False)),
            chat_template_kwargs=kwargs if isinstance(kwargs, Mapping) else None,
        )
        return PromptText(text, bool(body.get("add_special_tokens", False)))
    if route in ("/v1/messages", "/v1/messages/count_tokens"):
        return PromptText(tokenizer.render(anthropic_as_chat(body)), False, approximate=True)
    if route == "/v1/responses":
        return PromptText(tokenizer.render(responses_as_chat(body)), False, approximate=True)
    if isinstance(body.get("prompt"), str):
        return PromptText(body["prompt"], True)
    return None
