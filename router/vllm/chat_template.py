"""vLLM's chat-template rendering, byte for byte: the jinja env, message and tool normalization.

Owns: compiling a model's chat template as transformers compiles it for vLLM (sandboxed jinja
environment, ``raise_exception``, ``tojson``, ``strftime_now``, the ``{% generation %}`` tag),
detecting the template's content format (string or OpenAI parts), normalizing chat messages
and tools as vLLM 0.32 does before it renders them (``vllm/renderers/chat_utils.py``
``parse_chat_messages``, ``vllm/renderers/hf.py``), and the reasoning extras vLLM merges into
``chat_template_kwargs`` (:func:`reasoning_kwargs`, from the requests' ``build_chat_params``).
:class:`router.vllm.tokenizer.ModelTokenizer` renders with it; the agent APIs' request
conversions are in :mod:`router.vllm.anthropic_messages` and :mod:`router.vllm.openai_responses`,
the prompt text a request body becomes in :mod:`router.vllm.prompt`. Checked against real
vLLM's ``/tokenize`` in the vllm tier. Must not import transformers, torch or vllm (ported by
hand).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
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
    if not developer_ok and any(m.get("role") == "developer" for m in messages):
        return _consolidate_system_messages(conv)
    return conv


def _consolidate_system_messages(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's ``_consolidate_system_messages`` (``vllm/renderers/hf.py``), applied after a
    ``developer`` message became ``system`` for a template without that role: all system
    messages' text (parts joined by ``\n``) merged into one string message at position 0,
    joined by a blank line — when one is not first or there are several."""
    texts: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(conv):
        if m["role"] != "system":
            rest.append(m)
            continue
        merge = merge or i > 0 or bool(texts)
        c = m.get("content", "")
        if isinstance(c, list):
            c = "\n".join(p["text"] for p in c)  # normalized: text parts only
        if c:
            texts.append(c)
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest] if merge else conv


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


def reasoning_kwargs(effort: Any, kwargs: Any) -> dict[str, Any] | None:
    """``chat_template_kwargs`` with vLLM's reasoning extras merged in (``build_chat_params``:
    ``reasoning_effort``, and ``enable_thinking`` unless the caller set it)."""
    out = dict(kwargs) if isinstance(kwargs, Mapping) else {}
    if effort is not None:
        out["reasoning_effort"] = effort
        out.setdefault("enable_thinking", effort != "none")
    return out or None
