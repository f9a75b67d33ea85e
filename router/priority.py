"""Session-level call priority: least attained service over the session, with aging.

Owns: :func:`call_priority` (the rule, pure), :func:`client_hint` (the client's own priority
hint, read from the conventions it may arrive in) and :class:`PriorityConfig`. No I/O, no
clock: the caller passes ``now``; the state the rule reads (the session's attained service,
its children) lives in the session table (:mod:`router.state`).

The rule (vLLM's polarity: a *lower* value is served first; vLLM's ``--scheduling-policy
priority`` orders its waiting queue by ``(priority, arrival_time)`` and, short of KV blocks,
preempts the running request with the largest ``(priority, arrival_time)``)::

    level    = min(max_level, floor(log2(1 + S / unit_tokens)))      # attained service
             - join_boost      if the call is a join (first parent call after its children ended)
             + burst_penalty   if the call is one of a subagent burst (>= 2 siblings in flight)
             - clamp(hint, -hint_levels, hint_levels)                 # client hint, higher = sooner
    level    = clamp(level, 0, max_level + burst_penalty)
    priority = floor((now + level * level_s) / tick_s)

``S`` is the tokens the session's *root* has had served: prompt tokens computed (prompt less
cached) plus tokens decoded, over all its calls and all its subagents' calls (a subagent
counts with its root, so a fan-out does not look like a crowd of new sessions).

Aging, and the starvation bound: ordering by ``now + level * level_s`` is ordering by the
linearly aged priority ``level - waited / level_s`` — a waiting call gains one level every
``level_s`` seconds against every call that arrives after it. So a call is never overtaken by
one that arrives more than ``(max_level + burst_penalty) * level_s`` seconds after it: its wait
behind newer calls is bounded, whatever their level. The value is absolute (wall-clock
ticks), so it needs no re-aging once sent: the engine's static ``(priority, arrival)`` order
already carries it, and routers that share a clock agree on it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Roles a call can have in its session's graph.
ROLE_PLAIN = "plain"
ROLE_JOIN = "join"  # the parent's first call after its subagents ended: unblocks the session
ROLE_BURST = "burst"  # a subagent call while >= 2 siblings are in flight (a fan-out)
ROLES = (ROLE_PLAIN, ROLE_JOIN, ROLE_BURST)
PRIORITY_MODES = ("off", "session")
PRIORITY_HEADER = "x-vllm-priority"  # vLLM reads it before the body's ``priority`` field


@dataclass(frozen=True)
class PriorityConfig:
    """The rule's constants (router settings ``priority_*``, docs/router.md)."""

    unit_tokens: float = 4096.0  # service of one doubling step
    max_level: int = 8  # levels from attained service (a session past ~1M tokens is at 8)
    level_s: float = 2.0  # seconds of aging per level
    tick_s: float = 0.1  # resolution of the value sent (ties fall back to arrival order)
    join_boost: int = 2
    burst_penalty: int = 1
    hint_levels: int = 2  # at most this many levels from a client hint, either way

    def __post_init__(self) -> None:
        if self.unit_tokens <= 0 or self.level_s <= 0 or self.tick_s <= 0:
            raise ValueError("priority unit_tokens, level_s and tick_s must be > 0")
        if min(self.max_level, self.join_boost, self.burst_penalty, self.hint_levels) < 0:
            raise ValueError("priority levels must be >= 0")

    @property
    def bound_s(self) -> float:
        """The longest a call can be overtaken by later arrivals (the starvation bound)."""
        return (self.max_level + self.burst_penalty) * self.level_s


def service_level(service_tokens: float, cfg: PriorityConfig) -> int:
    """The attained-service part of the level: ``min(max_level, floor(log2(1 + S/unit)))``."""
    s = max(0.0, float(service_tokens))
    return min(cfg.max_level, math.floor(math.log2(1.0 + s / cfg.unit_tokens)))


def call_level(service_tokens: float, role: str, hint: int | None, cfg: PriorityConfig) -> int:
    """The call's level before aging (0 = most urgent); see the module docstring."""
    level = service_level(service_tokens, cfg)
    if role == ROLE_JOIN:
        level -= cfg.join_boost
    elif role == ROLE_BURST:
        level += cfg.burst_penalty
    if hint:
        level -= max(-cfg.hint_levels, min(cfg.hint_levels, int(hint)))
    return max(0, min(cfg.max_level + cfg.burst_penalty, level))


def call_priority(
    service_tokens: float, role: str, hint: int | None, now: float, cfg: PriorityConfig
) -> int:
    """vLLM's ``priority`` for a call arriving at ``now`` (wall-clock s): lower = sooner."""
    level = call_level(service_tokens, role, hint, cfg)
    return math.floor((now + level * cfg.level_s) / cfg.tick_s)


def served_tokens(prompt: int | None, cached: int | None, completion: int | None) -> int:
    """Service one answered call gave its session: prompt tokens computed (the prompt less
    its cached part) plus tokens decoded (a replica's ``usage``; missing counts as 0)."""
    p = max(0, prompt or 0)
    return max(0, p - max(0, min(p, cached or 0))) + max(0, completion or 0)


def class_of(level: int) -> str:
    """A coarse label for metrics: ``high`` (level 0-1), ``mid`` (2-4), ``low`` (5+)."""
    return "high" if level <= 1 else "mid" if level <= 4 else "low"


def _int(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and math.isfinite(v):
        return int(v)
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            return None
    return None


def client_hint(headers: Mapping[str, str], body: Mapping[str, Any]) -> int | None:
    """The client's own priority hint in the Dynamo polarity (higher = sooner), or None.

    Read in this order (the first present wins):

    * ``X-Dynamo-Request-Priority`` header (Dynamo: overrides the body's hint);
    * ``nvext.agent_hints.priority`` (Dynamo's agent hints; higher = more important);
    * ``X-Vllm-Priority`` header, then the body's ``priority`` field (vLLM's polarity, lower =
      sooner: negated here).

    The router bounds it (``hint_levels``) and sends its own value upstream instead, so one
    tenant cannot take the head of every queue."""
    v = _int(headers.get("x-dynamo-request-priority"))
    if v is not None:
        return v
    nvext = body.get("nvext")
    if isinstance(nvext, Mapping):
        hints = nvext.get("agent_hints")
        if isinstance(hints, Mapping):
            v = _int(hints.get("priority"))
            if v is not None:
                return v
    v = _int(headers.get(PRIORITY_HEADER))
    if v is None:
        v = _int(body.get("priority"))
    return None if v is None else -v
