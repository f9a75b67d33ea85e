"""The scheduling pipeline: filters, weighted scorers, picker; records the pick after.

Owns: running one request through the configured plugins over a :class:`Snapshot`, the
explanation of the decision (for ``/admin/route?explain=1`` and debug logs: every scorer's
score per endpoint, plus the terms a scorer returned with its :class:`Scores`, e.g.
``kv_cost``'s cost terms in seconds, kept on the :class:`Decision`) and the only
mutable scheduling state, the pick counter (``seq``) that round-robin-like scorers read from
the snapshot. Must not import aiohttp, the proxy or stores.

total(e) = sum_i w_i * clamp(score_i(e), 0, 1); the picker chooses among the totals.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from router.replicas import EndpointView
from router.scheduling import Filter, Picker, RequestContext, Scorer, Scores, Snapshot

log = logging.getLogger("kvroute.scheduling")


class NoCandidates(Exception):
    """No endpoint survived the filters."""

    def __init__(self, removed_by: dict[str, str]):
        super().__init__("no replica can serve this request")
        self.removed_by = removed_by


@dataclass
class Decision:
    endpoint: EndpointView
    ranked: list[tuple[EndpointView, float]]  # best first (for explain; retries re-run)
    explain: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0  # time schedule() took (filters, scorers, picker)
    terms: dict[str, Mapping[str, Mapping[str, Any]]] = field(default_factory=dict)  # scorer ->
    session_replica: str | None = None  # the replica the call's session was on (None: new)
    # why the session leaves ``session_replica`` (None: it stays, or is new): ``retry`` (the
    # replica failed this call before its first byte), ``unavailable`` (no longer a candidate:
    # gone, unhealthy, breaker open, not serving the model), ``cost`` (a cost scorer found
    # another replica cheaper, hysteresis included), ``score`` (other scorers outranked it)
    move_reason: str | None = None

    def term(self, endpoint: str, key: str) -> Any:
        """The first scorer's ``key`` term for ``endpoint`` (``None`` when no scorer gave it)."""
        for per_ep in self.terms.values():
            t = per_ep.get(endpoint)
            if t is not None and key in t:
                return t[key]
        return None

    def terms_for(self, endpoint: str) -> dict[str, Mapping[str, Any]]:
        """Every scorer's terms for ``endpoint``, by scorer name."""
        return {s: per_ep[endpoint] for s, per_ep in self.terms.items() if endpoint in per_ep}


def _clamp(x: float) -> float:
    if not isinstance(x, (int, float)) or math.isnan(x):
        return 0.0
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else float(x)


class Pipeline:
    def __init__(
        self,
        name: str,
        filters: Sequence[Filter],
        scorers: Sequence[tuple[Scorer, float]],
        picker: Picker,
    ):
        self.name = name
        self.filters = list(filters)
        self.scorers = list(scorers)
        self.picker = picker
        self.seq = 0

    def schedule(self, ctx: RequestContext, snap: Snapshot, explain: bool = False) -> Decision:
        t0 = time.perf_counter()
        eps = [e for e in snap.endpoints if e.name not in ctx.excluded]
        removed_by = {n: "already tried" for n in ctx.excluded}
        for f in self.filters:
            kept = f.filter(ctx, snap, eps)
            if explain or not kept:
                keep = {e.name for e in kept}
                removed_by.update({e.name: f.name for e in eps if e.name not in keep})
            eps = kept
            if not eps:
                raise NoCandidates(removed_by)
        totals = {e.name: 0.0 for e in eps}
        detail: dict[str, dict[str, float]] = {e.name: {} for e in eps} if explain else {}
        terms: dict[str, Mapping[str, Mapping[str, Any]]] = {}
        for scorer, w in self.scorers:
            s = scorer.score(ctx, snap, eps)
            if isinstance(s, Scores) and s.terms:
                terms[scorer.name] = s.terms
            for e in eps:
                v = s.get(e.name, 0.0)
                if type(v) is not float or not 0.0 <= v <= 1.0:  # the usual case needs no call
                    v = _clamp(v)
                totals[e.name] += w * v
                if explain:
                    detail[e.name][scorer.name] = round(v, 6)
        # best first; equal totals keep the endpoints' order (a reversed sort is stable too)
        ranked = sorted([(e, totals[e.name]) for e in eps], key=itemgetter(1), reverse=True)
        chosen = self.picker.pick(ctx, snap, ranked)
        sticky = snap.session.replica if snap.session is not None else None
        out = Decision(chosen, ranked, terms=terms, session_replica=sticky)
        if sticky is not None and chosen.name != sticky:
            out.move_reason = (
                "retry" if sticky in ctx.excluded
                else "unavailable" if sticky not in totals
                else "cost" if terms
                else "score"
            )  # fmt: skip
        out.elapsed_s = time.perf_counter() - t0  # explain's bookkeeping below not counted
        if explain:
            out.explain = {
                "policy": self.name,
                "winner": chosen.name,
                "weights": {s.name: w for s, w in self.scorers},
                "candidates": [
                    {"replica": e.name, "total": round(t, 6), "scores": detail[e.name],
                     "terms": out.terms_for(e.name),
                     "load": e.load, "kv_usage": e.kv_usage}
                    for e, t in ranked
                ],
                "filtered_out": removed_by,
                "session": None if snap.session is None else snap.session.key,
                "session_replica": None if snap.session is None else snap.session.replica,
                "move_reason": out.move_reason,
            }  # fmt: skip
        if log.isEnabledFor(logging.DEBUG):
            log.debug("pick %s for %s: %s", chosen.name, ctx.request_id,
                      [(e.name, round(t, 3)) for e, t in ranked])  # fmt: skip
        return out

    def record(self, decision: Decision) -> None:
        """Called by the service after a pick is used (policies never mutate state)."""
        self.seq += 1
