"""Scheduling framework: Filter -> Scorer -> Picker over a read-only snapshot.

Owns: the request context handed to policies (:class:`RequestContext`), the snapshot they read
(:class:`Snapshot`), the three plugin protocols, the pipeline (:mod:`.pipeline`) and the
registry with its YAML wiring (:mod:`.registry`). Baseline plugins live in sibling modules
(``round_robin``, ``least_load``, ``session_affinity``, ``prefix_hash``, ``filters``,
``pickers``). Must not import aiohttp handlers, the proxy, stores, torch or vllm: policies are
pure functions of (request, snapshot) and change nothing; the pipeline records the pick after.

Contract (STYLE.md):

* a **Filter** returns the subset of endpoints that may serve the request;
* a **Scorer** returns a score in [0, 1] per endpoint name (missing = 0); the pipeline clamps,
  multiplies by the scorer's configured weight and sums; a scorer without a weight is a config
  error;
* a **Picker** chooses one endpoint from the weighted totals (ties broken by a seeded RNG).

Seams for KV-aware routing (kept deliberately small):

1. **Prompt analyzer.** ``app[PROMPT_ANALYZER]`` (see :mod:`router.app`) is an optional
   callable ``analyzer(ctx: RequestContext) -> None | Awaitable[None]`` run after identity and
   before scheduling. It may fill ``ctx.token_ids`` (the prompt's token ids),
   ``ctx.block_keys`` (chained block keys, :mod:`router.hashing` int form) and anything under
   ``ctx.extra``. It reads ``ctx.body`` (the parsed JSON, parsed once) and ``ctx.identity``.
   An analyzer error is logged and the request is scheduled without those fields.
2. **Named state snapshots.** ``app[STATE_PROVIDERS]`` maps a name (e.g. ``"block_index"``,
   ``"load"``) to a zero-argument callable returning a read-only snapshot; the pipeline calls
   each once per request and a scorer reads it with ``snap.state("block_index")`` (``None``
   when no such provider is installed, so scorers degrade instead of crashing).
3. **Observers.** ``app[OBSERVERS]`` is a list of callables ``observer(ctx, outcome)`` run
   after each proxied call with the replica, status, TTFT, bytes and the parsed ``usage`` when
   the response carried one (for calibration and index feedback). Every request that went
   through the analyzer is observed exactly once, whatever its end: calls that never got a
   complete answer (no replica, client gone, upstream failure, an ``/admin/route`` dry run)
   are observed with ``replica=None`` and a ``status`` saying why, so anything an analyzer
   counted up can be counted down.

A plugin registers itself with ``@register("scorer", "name")`` on a factory taking keyword
parameters; ``discover()`` imports ``router.scheduling.scorers.*`` and
``router.scheduling.kv_*`` so plugins in those modules register without edits here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from router.replicas import EndpointView
from router.sessions import SessionIdentity, prompt_prefix_text
from router.state import SessionRecord


@dataclass
class RequestContext:
    request_id: str
    route: str
    model: str | None
    identity: SessionIdentity
    body: Mapping[str, Any]
    token_ids: list[int] | None = None
    block_keys: list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    excluded: frozenset[str] = frozenset()  # replicas already tried for this request
    observed: bool = False  # the observers have been told how this request ended
    _prefix: str | None = None

    def prompt_prefix(self, chars: int = 2048) -> str:
        """The prompt's leading characters (cached), for text-based prefix policies."""
        if self._prefix is None or len(self._prefix) < chars:
            self._prefix = prompt_prefix_text(self.body, chars)
        return self._prefix[:chars]


@dataclass(frozen=True)
class Snapshot:
    endpoints: tuple[EndpointView, ...]
    session: SessionRecord | None
    seq: int  # number of picks recorded by this pipeline so far
    states: Mapping[str, Any] = field(default_factory=dict)

    def state(self, name: str) -> Any:
        return self.states.get(name)


class Filter(Protocol):
    name: str

    def filter(
        self, ctx: RequestContext, snap: Snapshot, endpoints: list[EndpointView]
    ) -> list[EndpointView]: ...


class Scorer(Protocol):
    name: str

    def score(
        self, ctx: RequestContext, snap: Snapshot, endpoints: list[EndpointView]
    ) -> Mapping[str, float]: ...


class Picker(Protocol):
    name: str

    def pick(
        self, ctx: RequestContext, snap: Snapshot, ranked: list[tuple[EndpointView, float]]
    ) -> EndpointView: ...


__all__ = ["Filter", "Picker", "RequestContext", "Scorer", "Snapshot"]
