"""How a proxied call ended: one typed record handed to every observer.

Owns: :class:`CallOutcome` (replica, status, TTFT, duration, inter-token latency samples, the
response's ``usage`` parsed once, the scheduling decision) and :func:`usage_from_tail`, which
finds the ``usage`` object in the last bytes of an SSE or JSON response. The proxy builds the
outcome; the simulator builds the same record from its own call records. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

ITL_SAMPLES = 256  # inter-token latency samples kept per call (the first ones)


@dataclass(frozen=True)
class Usage:
    """The token counts a replica reported (OpenAI or Anthropic names); ``None`` = not given."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None

    @classmethod
    def from_json(cls, u: dict[str, Any]) -> Usage:
        details = u.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(
            _num(u.get("prompt_tokens", u.get("input_tokens"))),
            _num(u.get("completion_tokens")) or _num(u.get("output_tokens")),
            _num(cached),
        )


def _num(v: Any) -> int | None:
    """A token count from JSON: a number (not a bool), else None."""
    return int(v) if type(v) is int or type(v) is float else None


def usage_from_body(body: bytes) -> Usage | None:
    """The ``usage`` object of a whole JSON answer (OpenAI, Anthropic, Responses), if present.

    Only that object is parsed: the answer can be megabytes, and its usage sits after the
    content (``usage_from_tail`` would miss it once the last field does not fit the tail).
    The last ``"usage"`` key followed by an object wins; ``"usage"`` inside a longer string is
    escaped (``\\"usage\\"``), so it does not match, and a string that is just ``"usage"`` is
    passed over."""
    end = len(body)
    for _ in range(4):
        i = body.rfind(b'"usage"', 0, end)
        if i < 0:
            return None
        start = body.find(b"{", i + 7)
        if start >= 0 and body[i + 7 : start].strip() == b":":
            break
        end = i
    else:
        return None
    depth, k = 1, start + 1
    while depth:  # to the brace that closes it (usage nests objects, holds no strings)
        close = body.find(b"}", k)
        if close < 0:
            return None
        opened = body.find(b"{", k, close)
        if opened >= 0:
            depth, k = depth + 1, opened + 1
        else:
            depth, k = depth - 1, close + 1
    try:
        u = orjson.loads(body[start:k])
    except orjson.JSONDecodeError:
        return None
    return Usage.from_json(u) if isinstance(u, dict) else None


def usage_from_tail(tail: bytes) -> Usage | None:
    """The ``usage`` object of a response from its last bytes (SSE or JSON), if present."""
    if not tail or b'"usage"' not in tail:
        return None
    for line in reversed(tail.split(b"\n")):
        line = line.strip()
        if line.startswith(b"data: "):
            line = line[6:]
        if b'"usage"' not in line or not line.startswith(b"{"):
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        u = obj.get("usage") if isinstance(obj, dict) else None
        if isinstance(u, dict):
            return Usage.from_json(u)
    return None


@dataclass(frozen=True)
class CallOutcome:
    """``replica`` is ``None`` for a call that never got a complete answer (no replica, client
    gone, upstream failure, a dry run); ``status`` says why (or the HTTP status code)."""

    replica: str | None
    status: str
    ttft_s: float | None = None
    duration_s: float | None = None
    usage: Usage | None = None
    events: int = 0  # SSE events streamed (0: not a stream)
    bytes: int = 0
    itl_s: tuple[float, ...] = ()  # gaps between streamed chunks after the first (s)
    decision: Any = field(default=None, compare=False)  # router.scheduling.pipeline.Decision

    @property
    def ok(self) -> bool:
        return self.status == "200"

    @property
    def output_tokens(self) -> int | None:
        """Completion tokens from ``usage``, else estimated from the SSE event count."""
        if self.usage is not None:
            return self.usage.completion_tokens
        if self.events:
            return max(self.events - 2, 0) or None  # SSE chunks ~ tokens
        return None
