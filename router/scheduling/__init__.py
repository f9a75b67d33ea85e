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

What a policy sees (kept deliberately small):

1. **The request** (:class:`RequestContext`): the parsed body (parsed once), the session
   identity, and what the prompt analyzer (the KV layer, :meth:`router.kv.state.KVState.analyze`,
   run by :mod:`router.call` before scheduling) filled in: ``block_keys`` (chained block
   keys, :mod:`router.vllm.hashing` int form) and ``prompt_tokens``. ``analysis`` belongs to
   the analyzer (its own per-call record, read back by its observer); policies ignore it.
2. **Named state snapshots** (:class:`Snapshot`): ``snap.state("kv")`` is the KV layer's
   read-only :class:`router.kv.view.KVView` (``None`` when no KV layer is installed, so
   scorers degrade instead of crashing).
3. **Terms on the decision**: a scorer that wants its inputs explained (and, for
   ``model_ttft_s``, calibrated against the observed TTFT) returns :class:`Scores` with
   ``terms[endpoint]``; the pipeline puts them on the
   :class:`router.scheduling.pipeline.Decision`, which reaches ``/admin/route?explain=1`` and
   every observer through :class:`router.outcome.CallOutcome`.

A plugin registers itself with ``@register("scorer", "name")`` on a factory taking keyword
parameters (:mod:`.registry`); out-of-tree plugin modules are named in the ``kvroute.scheduling``
entry-point group and imported at start-up, so a new scorer is one module plus one line of
config.
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
    prompt_tokens: int | None = None  # the prompt's token count, when the analyzer knows it
    analysis: Any = None  # the prompt analyzer's own per-call record (policies ignore it)
    extra: dict[str, Any] = field(default_factory=dict)  # out-of-tree plugins' scratch
    excluded: frozenset[str] = frozenset()  # replicas already tried for this request
    observed: bool = False  # the observers have been told how this request ended
    # False for calls that are not turns of the session (``count_tokens``, embeddings): they
    # are routed like the session's calls, but neither placed, analysed nor counted in it
    session_call: bool = True
    hint: Mapping[str, Any] | None = None  # the retention hint sent upstream (router.hints)
    priority: int | None = None  # the priority sent upstream (router.priority), if any
    priority_level: int | None = None  # its level before aging (0 = most urgent)
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


class Scores(dict[str, float]):
    """A scorer's scores by endpoint name, with the terms it wants on the decision.

    ``terms[endpoint]`` is a mapping of named inputs (seconds, blocks, ...) shown by
    ``/admin/route?explain=1``; a ``model_ttft_s`` term is the TTFT the scorer predicted
    (uncalibrated), which the KV layer calibrates against the observed TTFT.
    """

    __slots__ = ("terms",)

    def __init__(
        self,
        scores: Mapping[str, float] | None = None,
        terms: Mapping[str, Mapping[str, Any]] | None = None,
    ):
        super().__init__(scores or {})
        self.terms: Mapping[str, Mapping[str, Any]] = terms or {}


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


__all__ = ["Filter", "Picker", "RequestContext", "Scorer", "Scores", "Snapshot"]
