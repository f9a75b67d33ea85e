"""Session identity: every agent convention normalized into one :class:`SessionIdentity`.

Owns: reading the session headers/body fields that agent harnesses send, choosing one by a
fixed precedence, namespacing it by tenant, and the prefix fallback. Pure: no I/O, no aiohttp
(headers arrive as any case-insensitive mapping). The session *table* lives in
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
OpenAI body                            ``prompt_cache_key``, then ``safety_identifier``,
                                       then ``user``
vLLM body                              ``session_id`` field, then ``cache_salt``
fallback                               sha256 of the prompt's leading characters
====================================  ==========================================

The table key is ``tenant / session[#agent]``: a Claude Code subagent has its own context
(hence its own KV), so it is its own entry whose parent is ``session#parent_agent`` (or the
main ``session`` when the parent agent id is absent). Tenants are never mixed into each
other's keys, so one tenant can neither steer nor observe another's sessions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
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


def _truthy(v: str | None) -> bool:
    return v is not None and v.strip().lower() in ("1", "true", "yes", "on")


_TEXT_KEYS = ("role", "type", "text", "content", "input", "output", "name", "arguments")
_TEXT_KEYS_LAST_FIRST = tuple(reversed(_TEXT_KEYS))  # the walk's stack pops the last pushed
_BODY_TEXT_LAST_FIRST = tuple(reversed(("system", "instructions", "messages", "input", "prompt")))


def prompt_prefix_text(body: Mapping[str, Any], limit: int) -> str:
    """The prompt's leading characters, from whichever API shape the body has.

    Walks the body depth-first with its own stack (no recursion: a body nested ~1,000 deep,
    which the JSON parser accepts, must not raise ``RecursionError``)."""
    parts: list[str] = []
    n = 0
    stack: list[Any] = [body[k] for k in _BODY_TEXT_LAST_FIRST if k in body]
    while stack and n < limit:
        x = stack.pop()
        if isinstance(x, str):
            sep = 1 if parts else 0  # n: length of the joined text so far
            room = limit - n - sep
            parts.append(x if len(x) <= room else x[: max(0, room)])  # only what can show
            n += sep + len(x)
        elif isinstance(x, list):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend([x[k] for k in _TEXT_KEYS_LAST_FIRST if k in x])
    return "\x1e".join(parts)[:limit]


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
    if parent_key is None:
        for h in _PARENT_HEADERS:
            raw = headers.get(h)
            if raw is not None and (v := _clean(raw)):
                parent_key = f"{tenant}{SEP}{v}"
                break
    if session is None:
        text = prompt_prefix_text(body, prefix_chars)
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:24]
        session, source = f"prefix:{digest}", "prefix"
    return SessionIdentity(tenant, session, parent_key, agent, final, source or "prefix")
