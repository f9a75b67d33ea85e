"""Session identity: every agent convention normalized into one :class:`SessionIdentity`.

Owns: reading the session headers/body fields that agent harnesses send, choosing one by a
fixed precedence, namespacing it by tenant, and the fallback for clients that send none
(the conversation's head). Pure: no I/O, no aiohttp (headers arrive as any case-insensitive
mapping). The session *table* lives in
:mod:`router.state`.

Precedence (first match wins for the session id):

====================================  ==========================================
source                                 header / field
====================================  ==========================================
Claude Code                            ``x-claude-code-session-id`` (+ ``-agent-id``,
                                       ``-parent-agent-id``)
Dynamo                                 ``X-Dynamo-Session-ID`` (+ ``-Parent-Session-ID``,
                                       ``X-Dynamo-Session-Final``)
OpenCode                               ``x-session-id`` (+ ``x-parent-session-id``)
Codex                                  ``session-id`` / ``session_id`` header
SGLang gateway                         ``X-SMG-Routing-Key``
llm-d                                  ``x-session-token``
AgentX harness                         ``X-Correlation-ID``
vllm-router body                       ``vllm_xargs.agentic_context.program_id``
                                       (+ ``parent_program_id``)
OpenAI body                            ``prompt_cache_key``, then ``safety_identifier``,
                                       then ``user``
vLLM body                              ``session_id`` field, then ``cache_salt``
fallback                               sha256 of the conversation's head
====================================  ==========================================

The fallback (a client that sends no id, source ``prefix``) keys the session on what does not
change from one turn of a conversation to the next: the system prompt and the first user turn
(:func:`conversation_head`, for Chat, Anthropic Messages and Responses bodies) — not on the
whole prompt, which grows every turn. Two conversations that open alike (same system prompt,
same first request) share a session, as they share their KV prefix. A body without turns
(a completions ``prompt``) is keyed on its first ``prefix_chars`` characters. A Responses call
that chains by ``previous_response_id`` carries only its new turn; :mod:`router.api` gives it
the session of the call that produced that response.

The table key is ``tenant / session[#agent]``: a Claude Code subagent has its own context
(hence its own KV), so it is its own entry whose parent is ``session#parent_agent`` (or the
main ``session`` when the parent agent id is absent). Tenants are never mixed into each
other's keys, so one tenant can neither steer nor observe another's sessions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

SEP = "/"

# (source name, header) in precedence order
_SESSION_HEADERS: tuple[tuple[str, str], ...] = (
    ("claude-code", "x-claude-code-session-id"),
    ("dynamo", "x-dynamo-session-id"),
    ("opencode", "x-session-id"),
    ("codex", "session-id"),
    ("codex", "session_id"),
    ("sglang", "x-smg-routing-key"),
    ("llm-d", "x-session-token"),
    ("agentx", "x-correlation-id"),
)
_BODY_FIELDS: tuple[str, ...] = (
    "prompt_cache_key",
    "safety_identifier",
    "user",
    "session_id",
    "cache_salt",
)
_PARENT_HEADERS = ("x-dynamo-parent-session-id", "x-parent-session-id")
MAX_ID_LEN = 256


@dataclass(frozen=True, slots=True)
class SessionIdentity:
    tenant: str
    session: str
    parent: str | None  # the parent's table key (same tenant), if any
    agent: str | None
    final: bool
    source: str  # which convention produced it ("prefix" for the fallback)
    # the session table key, ``tenant/session[#agent]`` (built once: read several times a call)
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        base = f"{self.tenant}{SEP}{self.session}"
        object.__setattr__(self, "key", f"{base}#{self.agent}" if self.agent else base)


def _clean(v: Any) -> str | None:
    if v is None:
        return None
    s = str(v).strip()
    if not s:
        return None
    return s[:MAX_ID_LEN]


def _agentic_context(body: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """vllm-router's program identity: ``vllm_xargs.agentic_context`` ``program_id`` and
    ``parent_program_id`` (field names as vllm-router 0.1.17's request schema spells them;
    its other program fields are not read)."""
    xargs = body.get("vllm_xargs")
    ctx = xargs.get("agentic_context") if isinstance(xargs, Mapping) else None
    if not isinstance(ctx, Mapping):
        return None, None
    ids = (ctx.get("program_id"), ctx.get("parent_program_id"))
    return tuple(_clean(v) if isinstance(v, (str, int)) else None for v in ids)  # type: ignore[return-value]


def _truthy(v: str | None) -> bool:
    return v is not None and v.strip().lower() in ("1", "true", "yes", "on")


_TEXT_KEYS = ("role", "type", "text", "content", "input", "output", "name", "arguments")
_TEXT_KEYS_LAST_FIRST = tuple(reversed(_TEXT_KEYS))  # the walk's stack pops the last pushed
_BODY_TEXT_KEYS = ("system", "instructions", "messages", "input", "prompt")
HEAD_MAX_CHARS = 1 << 24  # a conversation head is hashed whole (bodies are capped far below)


def prompt_prefix_text(body: Mapping[str, Any], limit: int) -> str:
    """The prompt's leading characters, from whichever API shape the body has."""
    return _text([body[k] for k in _BODY_TEXT_KEYS if k in body], max(0, limit))


def _text(roots: Iterable[Any], limit: int | None = None) -> str:
    """The texts under ``roots`` in order, joined by ``\x1e`` (at most ``limit`` characters).

    Walks depth-first with its own stack (no recursion: a body nested ~1,000 deep, which the
    JSON parser accepts, must not raise ``RecursionError``)."""
    parts: list[str] = []
    n = 0
    cap = HEAD_MAX_CHARS if limit is None else limit
    stack: list[Any] = list(roots)[::-1]
    while stack and n < cap:
        x = stack.pop()
        if isinstance(x, str):
            sep = 1 if parts else 0  # n: length of the joined text so far
            room = cap - n - sep
            parts.append(x if len(x) <= room else x[: max(0, room)])  # only what can show
            n += sep + len(x)
        elif isinstance(x, list):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend([x[k] for k in _TEXT_KEYS_LAST_FIRST if k in x])
    return "\x1e".join(parts)[:cap]


def conversation_head(body: Mapping[str, Any]) -> list[Any] | None:
    """The parts of a chat body that stay the same as its conversation grows: the system
    prompt (Anthropic ``system``, Responses ``instructions``, the leading system / developer
    turns) and the first user turn (Chat and Anthropic ``messages``, Responses ``input``: its
    first user item, or the input itself when it is a string). ``None`` for a body without
    turns (a completions ``prompt``)."""
    head: list[Any] = [body[k] for k in ("system", "instructions") if k in body]
    turns = body.get("messages")
    if turns is None:
        turns = body.get("input")
        if isinstance(turns, str):
            return [*head, turns]
    if not isinstance(turns, list):
        return None
    for item in turns:
        head.append(item)
        if isinstance(item, dict) and item.get("role") == "user":
            break
    return head


def identify(
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    tenant: str = "-",
    prefix_chars: int = 4096,
) -> SessionIdentity:
    """Normalize every known convention into one identity (see the module docstring)."""
    session = source = None
    # (``_clean`` only for what is there: most of these headers are absent on most calls)
    for src, h in _SESSION_HEADERS:
        raw = headers.get(h)
        if raw is not None and (v := _clean(raw)):
            session, source = v, src
            break
    program_parent = None
    if session is None:
        program, program_parent = _agentic_context(body)
        if program:
            session, source = program, "vllm-router"
    if session is None:
        for f in _BODY_FIELDS:
            raw = body.get(f)
            if isinstance(raw, (str, int)) and (v := _clean(raw)):
                session, source = v, f
                break
    agent = parent_key = None
    final = _truthy(headers.get("x-dynamo-session-final"))
    if source == "claude-code":
        agent = _clean(headers.get("x-claude-code-agent-id"))
        parent_agent = _clean(headers.get("x-claude-code-parent-agent-id"))
        if agent:
            base = f"{tenant}{SEP}{session}"
            parent_key = f"{base}#{parent_agent}" if parent_agent else base
    if parent_key is None and program_parent and source == "vllm-router":
        parent_key = f"{tenant}{SEP}{program_parent}"
    if parent_key is None:
        for h in _PARENT_HEADERS:
            raw = headers.get(h)
            if raw is not None and (v := _clean(raw)):
                parent_key = f"{tenant}{SEP}{v}"
                break
    if session is None:
        head = conversation_head(body)
        text = _text(head) if head is not None else prompt_prefix_text(body, prefix_chars)
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:24]
        session, source = f"prefix:{digest}", "prefix"
    return SessionIdentity(tenant, session, parent_key, agent, final, source or "prefix")
