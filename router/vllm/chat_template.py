"""vLLM's chat-template rendering, byte for byte: message and tool normalization, the jinja env.

Owns: compiling a model's chat template as transformers compiles it for vLLM (sandboxed jinja
environment, ``raise_exception``, ``tojson``, ``strftime_now``, the ``{% generation %}`` tag),
detecting the template's content format (string or OpenAI parts), normalizing chat messages
and tools as vLLM 0.32 does before it renders them, and :func:`request_prompt`: the prompt text
and special-token flag vLLM builds from a request body on each route (``/v1/messages`` and
``/v1/responses`` first converted to the chat request vLLM's Anthropic and Responses adapters
build: :func:`chat_request`) — shared by the router's KV layer and the replica twin, so both
render exactly what a replica would. Checked against real vLLM's ``/tokenize`` and agent-API
usage in the vllm tier. Must not import transformers, torch or vllm (ported by hand).
"""

from __future__ import annotations

import copy
import json
import time
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


# ---- a request body as the prompt text vLLM builds from it --------------------------------


@dataclass(frozen=True)
class PromptText:
    text: str
    add_special_tokens: bool  # completions: True (BOS from the post-processor); chat: False
    approximate: bool = False  # rendered from a shape vLLM would render differently


# vLLM's ``custom_tool_parameters()``: the shim a freeform custom tool is shown to the model as
CUSTOM_TOOL_PARAMETERS = {
    "type": "object",
    "properties": {
        "input": {"type": "string", "description": "The freeform text payload for this tool."}
    },
    "required": ["input"],
    "additionalProperties": False,
}
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


def _reasoning_kwargs(effort: Any, kwargs: Any) -> dict[str, Any] | None:
    """``chat_template_kwargs`` with vLLM's reasoning extras merged in (``build_chat_params``:
    ``reasoning_effort``, and ``enable_thinking`` unless the caller set it)."""
    out = dict(kwargs) if isinstance(kwargs, Mapping) else {}
    if effort is not None:
        out["reasoning_effort"] = effort
        out.setdefault("enable_thinking", effort != "none")
    return out or None


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
        kw = _reasoning_kwargs(e, None)
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
    kwargs = _reasoning_kwargs(effort, body.get("chat_template_kwargs"))
    if kwargs:
        req["chat_template_kwargs"] = kwargs
    tools = _anthropic_tools(body)
    if tools is not None:
        req["tools"] = tools
    return req


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
    kwargs = _reasoning_kwargs(effort, body.get("chat_template_kwargs"))
    if kwargs:
        req["chat_template_kwargs"] = kwargs
    tools = _responses_tools(body.get("tools"))
    if tools:
        req["tools"] = tools
    return req, bool(body.get("previous_response_id"))


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
        kwargs = _reasoning_kwargs(req.get("reasoning_effort"), req.get("chat_template_kwargs"))
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
