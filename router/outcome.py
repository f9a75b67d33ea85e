"""How a proxied call ended: one typed record handed to every observer.

Owns: :class:`CallOutcome` (replica, status, TTFT, duration, inter-token latency samples, the
response's ``usage`` parsed once, the scheduling decision), :class:`Usage` (the token counts
of the OpenAI, Responses and Anthropic usage objects, in one meaning), and the readers that
find a ``usage`` object in a whole JSON answer (:func:`usage_from_body`) or in the first and
last bytes of an SSE stream (:func:`usage_from_tail`, :func:`usage_from_stream`). The proxy
builds the outcome; the simulator builds the same record from its own call records. Pure: no I/O.
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
        """Read a ``usage`` object of any of the three APIs.

        * OpenAI Chat / Completions: ``prompt_tokens``, ``completion_tokens``,
          ``prompt_tokens_details.cached_tokens``;
        * Responses: ``input_tokens`` (the whole prompt), ``output_tokens``,
          ``input_tokens_details.cached_tokens``;
        * Anthropic Messages: ``input_tokens`` is only the prompt's uncached rest — the prompt
          is ``input_tokens + cache_read_input_tokens + cache_creation_input_tokens``, and the
          cached part is ``cache_read_input_tokens``."""
        details = u.get("prompt_tokens_details")
        if not isinstance(details, dict):
            details = u.get("input_tokens_details")
        cached = _num(details.get("cached_tokens")) if isinstance(details, dict) else None
        prompt = _num(u.get("prompt_tokens"))
        if prompt is None:
            prompt = _num(u.get("input_tokens"))
            read = _num(u.get("cache_read_input_tokens"))
            created = _num(u.get("cache_creation_input_tokens"))
            if read is not None or created is not None:  # Anthropic's split of the prompt
                prompt = (prompt or 0) + (read or 0) + (created or 0)
                if cached is None:
                    cached = read or 0
        return cls(
            prompt,
            _num(u.get("completion_tokens")) or _num(u.get("output_tokens")),
            cached,
        )

    def merged(self, later: Usage | None) -> Usage:
        """This usage with every count ``later`` gives taken from ``later`` (an Anthropic
        stream: the prompt in ``message_start``, the output in ``message_delta``)."""
        if later is None:
            return self
        return Usage(
            self.prompt_tokens if later.prompt_tokens is None else later.prompt_tokens,
            self.completion_tokens if later.completion_tokens is None else later.completion_tokens,
            self.cached_tokens if later.cached_tokens is None else later.cached_tokens,
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


def _event_usage(obj: Any) -> dict[str, Any] | None:
    """The usage object of one parsed SSE event or JSON answer: top level (OpenAI chunks,
    Anthropic ``message_delta``), under ``response`` (Responses ``response.completed``) or
    under ``message`` (Anthropic ``message_start``)."""
    if not isinstance(obj, dict):
        return None
    u = obj.get("usage")
    if isinstance(u, dict):
        return u
    for k in ("response", "message"):
        inner = obj.get(k)
        if isinstance(inner, dict) and isinstance(inner.get("usage"), dict):
            return inner["usage"]
    return None


def usage_from_tail(tail: bytes) -> Usage | None:
    """The ``usage`` object of a response from its last bytes (SSE or JSON), if present.

    The last event that parses and holds one wins. A Responses stream's last event
    (``response.completed``) repeats the whole response — instructions, tools, output — so it
    is often longer than the tail: then the last ``"usage"`` object in the tail is read on its
    own (:func:`usage_from_body`)."""
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
        u = _event_usage(obj)
        if u is not None:
            return Usage.from_json(u)
    return usage_from_body(tail)


def usage_from_stream(head: bytes, tail: bytes) -> Usage | None:
    """A streamed answer's usage from its first and last bytes: what the tail reports, over
    what the head reported (Anthropic's ``message_start`` carries the prompt's counts, its
    ``message_delta`` at the end may carry only ``output_tokens``)."""
    last = usage_from_tail(tail)
    if not head or b'"usage"' not in head:
        return last
    first = None
    for line in head.split(b"\n"):
        line = line.strip()
        if line.startswith(b"data: ") and b'"usage"' in line:
            try:
                u = _event_usage(orjson.loads(line[6:]))
            except orjson.JSONDecodeError:
                continue
            if u is not None:
                first = Usage.from_json(u)
                break
    if first is None:
        return last
    return first.merged(last)


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
