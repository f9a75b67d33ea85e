"""How a twin's reply ends: its length, its finish reason, and whether it is a tool call.

Owns: :class:`TurnPolicy` (the twin's stand-in for a model's choices, from the profile's
output-length distribution and the twin's tool-call rates) and the :class:`Turn` it plans for
one request, plus :func:`example_arguments` (arguments that satisfy a tool's JSON schema).
Pure: no I/O, no aiohttp; every draw comes from a ``random.Random`` seeded by the twin's seed
and the request's prompt, so the same request gets the same reply (as a greedy model would).

The rules (docs/twin.md, "How a reply ends"):

- **Length.** A request that gives its expected length (the replay's override, ``vllm_xargs``
  or ``/twin/expect``) ends there; one with ``ignore_eos`` runs to its cap, as in vLLM;
  otherwise the length is drawn from the profile's log-normal (``output_median_tokens``,
  ``output_sigma``), at least ``min_tokens``. The reply generates ``min(cap, length)``
  tokens: it ends by itself (``stop`` / ``end_turn`` / ``completed``) when ``length <= cap``
  (vLLM checks EOS before the length cap), at the cap (``length`` / ``max_tokens`` /
  ``incomplete``) otherwise.
- **Tool calls.** When function tools are offered and the reply ends by itself, it is a call
  to one of them: always under ``tool_choice`` ``required`` (Anthropic ``any``) or a named
  tool, never under ``none``, and under ``auto`` with probability ``tool_call_rate``
  (``tool_call_rate_after_result`` when the conversation's last turn is a tool result, so an
  agent loop comes back to text). A reply cut at its cap is text (a parser finds no whole
  call in it).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ToolCall", "Turn", "TurnPolicy", "example_arguments", "split_pieces"]

PLACEHOLDER = "kvroute-twin"  # the string the twin fills a string argument with
SEED_TAIL_TOKENS = 4096  # the prompt's tail that (with its length) seeds a request's draws
_MAX_DEPTH = 8


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the reply makes: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        """The arguments as a tool parser hands them on (``json.dumps``, as vLLM's do)."""
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class Turn:
    """One reply's plan: ``tokens`` to generate (``<= cap``), whether it ends by itself."""

    cap: int  # the client's cap: max_tokens, else what the context window leaves
    tokens: int
    natural: bool  # ends by itself (a model's EOS); False: stopped at the cap
    tool_call: ToolCall | None = None

    @property
    def capped(self) -> bool:
        return not self.natural


@dataclass(frozen=True, slots=True)
class TurnPolicy:
    """The twin's stand-in for a model's choices (see the module docstring)."""

    output_median_tokens: float = 300.0
    output_sigma: float = 0.8
    tool_call_rate: float = 0.5
    tool_call_rate_after_result: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.output_median_tokens > 0 or self.output_sigma < 0:
            raise ValueError("output_median_tokens must be > 0 and output_sigma >= 0")
        for r in (self.tool_call_rate, self.tool_call_rate_after_result):
            if not 0.0 <= r <= 1.0:
                raise ValueError(f"tool-call rates must be in [0, 1], got {r}")

    def rng(self, prompt_ids: Sequence[int], extra: Any = None) -> random.Random:
        """The request's RNG: the twin's seed, the prompt's length and tail, and ``extra``
        (the body's ``seed``)."""
        h = hashlib.blake2b(digest_size=8)
        h.update(f"{self.seed}/{len(prompt_ids)}/{extra!r}/".encode())
        h.update(array("q", prompt_ids[-SEED_TAIL_TOKENS:]).tobytes())
        return random.Random(int.from_bytes(h.digest(), "big"))

    def plan(
        self,
        rng: random.Random,
        *,
        cap: int,
        expected: int | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        tools: Sequence[tuple[str, Any]] = (),
        tool_choice: Any = "auto",
        after_result: bool = False,
    ) -> Turn:
        """The reply to one request. ``tools``: the offered function tools as ``(name,
        parameters schema)``; ``tool_choice`` in chat form (``"auto"``, ``"none"``,
        ``"required"``, ``{"type": "function", "function": {"name": ...}}``)."""
        if cap < 1:
            raise ValueError("cap must be >= 1")
        # draw in a fixed order, so an override changes the length and nothing else
        drawn = max(1, round(rng.lognormvariate(math.log(self.output_median_tokens),
                                                self.output_sigma)))  # fmt: skip
        u = rng.random()
        pick = rng.random()
        length: int | None = expected if expected is not None else None
        if length is None and not ignore_eos:
            length = drawn
        if length is not None:
            length = max(length, min_tokens)
        natural = length is not None and length <= cap
        tokens = cap if length is None else min(cap, length)
        call = None
        if natural and tools:
            call = self._call(u, pick, tools, tool_choice, after_result)
        return Turn(cap, tokens, natural, call)

    def _call(
        self,
        u: float,
        pick: float,
        tools: Sequence[tuple[str, Any]],
        choice: Any,
        after_result: bool,
    ) -> ToolCall | None:
        if isinstance(choice, Mapping):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, Mapping) else choice.get("name")
            named = [t for t in tools if t[0] == name]
            if not named:
                return None
            chosen = named[0]
        elif choice == "none":
            return None
        else:
            if choice != "required":
                rate = self.tool_call_rate_after_result if after_result else self.tool_call_rate
                if u >= rate:
                    return None
            chosen = tools[min(len(tools) - 1, int(pick * len(tools)))]
        name, schema = chosen
        args = example_arguments(schema)
        return ToolCall(name, args if isinstance(args, dict) else {})


def split_pieces(text: str, n: int) -> list[str]:
    """``text`` over ``n`` output tokens, evenly by characters (a streamed tool call's
    argument deltas, one per token): they join to ``text``; with fewer characters than
    tokens some are empty, never the last one."""
    size = len(text)
    return [text[i * size // n : (i + 1) * size // n] for i in range(n)]


# ---- arguments from a JSON schema -----------------------------------------------------------


def example_arguments(schema: Any) -> Any:
    """A value that satisfies ``schema`` (JSON Schema as tools declare it): an object gets its
    ``required`` properties only; ``const`` / ``enum`` / ``default`` are used when given;
    strings are ``"kvroute-twin"`` (padded or cut to ``minLength`` / ``maxLength``), numbers
    the smallest allowed (1 when unbounded), arrays ``max(1, minItems)`` items; local
    ``$ref``s (``#/$defs/...``, ``#/definitions/...``) are followed; a schema with no type
    is an object. A value an agent runs is harmless: no real path or command is named."""
    root = schema if isinstance(schema, Mapping) else {}
    return _value({"type": "object", **root}, root, 0)  # a tool's arguments are an object


def _resolve(schema: Mapping[str, Any], root: Mapping[str, Any], depth: int) -> Mapping:
    while isinstance(schema.get("$ref"), str) and depth < _MAX_DEPTH:
        ref = schema["$ref"]
        node: Any = root
        if not ref.startswith("#"):
            return {}
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, Mapping) else None
        if not isinstance(node, Mapping):
            return {}
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {**node, **rest}
        depth += 1
    return schema


def _value(schema: Any, root: Mapping[str, Any], depth: int) -> Any:
    if not isinstance(schema, Mapping) or depth > _MAX_DEPTH:
        return PLACEHOLDER
    schema = _resolve(schema, root, depth)
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    if "default" in schema:
        return schema["default"]
    for key in ("anyOf", "oneOf"):
        opts = schema.get(key)
        if isinstance(opts, list) and opts:
            typed = [o for o in opts if isinstance(o, Mapping) and o.get("type") != "null"]
            return _value({**_base(schema), **(typed or opts)[0]}, root, depth + 1)
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and all_of:
        merged: dict[str, Any] = dict(_base(schema))
        props: dict[str, Any] = dict(schema.get("properties") or {})
        required: list[Any] = list(schema.get("required") or [])
        for part in all_of:
            part = _resolve(part, root, depth) if isinstance(part, Mapping) else {}
            merged.update({k: v for k, v in part.items() if k not in ("properties", "required")})
            props.update(part.get("properties") or {})
            required += list(part.get("required") or [])
        merged.update(properties=props, required=required)
        return _value(merged, root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if kinds else "null"
    if kind is None:
        if "properties" in schema or "required" in schema:
            kind = "object"
        elif "items" in schema:
            kind = "array"
        else:
            kind = "string"
    if kind == "object":
        props = schema.get("properties")
        props = props if isinstance(props, Mapping) else {}
        req = schema.get("required")
        names = [k for k in req if isinstance(k, str)] if isinstance(req, list) else []
        return {k: _value(props.get(k, {}), root, depth + 1) for k in names}
    if kind == "array":
        lo = _int(schema.get("minItems")) or 0
        hi = _int(schema.get("maxItems"))
        n = max(1, lo) if hi is None else min(max(1, lo), hi)
        items = schema.get("prefixItems") or schema.get("items")
        if isinstance(items, list):
            vals = [_value(s, root, depth + 1) for s in items[:n]]
            return vals + [PLACEHOLDER] * (n - len(vals))
        return [_value(items or {}, root, depth + 1) for _ in range(n)]
    if kind in ("integer", "number"):
        return _number(schema, kind == "integer")
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    s = PLACEHOLDER
    lo = _int(schema.get("minLength")) or 0
    hi = _int(schema.get("maxLength"))
    if len(s) < lo:
        s += "-" * (lo - len(s))
    if hi is not None:
        s = s[:hi]
    return s


def _base(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf", "allOf")}


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _number(schema: Mapping[str, Any], integer: bool) -> int | float:
    """1, or the nearest value the bounds allow."""

    def num(key: str) -> float | None:
        v = schema.get(key)
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

    lo, xlo, hi, xhi = (
        num("minimum"),
        num("exclusiveMinimum"),
        num("maximum"),
        num("exclusiveMaximum"),
    )
    step = 1.0 if integer else 0.5
    x = 1.0 if lo is None else max(1.0, lo)
    if xlo is not None and x <= xlo:
        x = xlo + step
    if hi is not None and x > hi:
        x = max(hi, lo) if lo is not None else hi
    if xhi is not None and x >= xhi:
        x = xhi - step
    if not integer:
        return x
    n = math.ceil(x)
    return n if (hi is None or n <= hi) and (xhi is None or n < xhi) else math.floor(x)
