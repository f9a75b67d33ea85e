"""Scorer ``session_affinity``: keep a session on one replica, with bounded load.

Algorithm: capacity = ceil(c · (total load + 1) / n) (consistent hashing with bounded
loads, c = ``load_factor``). If the session already has a replica in the table
(``snap.session.replica``) and it is a candidate (healthy, serving the model, not failed on
this call), it scores 1 whatever its load: the bound places new sessions, it never moves a
known one — moving costs the session's whole context in recompute, which a load count cannot
weigh (``kv_cost`` weighs it). Otherwise walk the consistent-hash ring from the session key:
the first candidate under capacity scores 1. Every other candidate under capacity scores by
ring order, 0.5·(1 - rank/n), so a combined policy still prefers the session's neighbours;
candidates at capacity score 0.
Policy ``session_affinity`` uses it alone.

.. code-block:: yaml

    scheduling:
      scorers:
        - {type: session_affinity, weight: 2.0, params: {load_factor: 1.25}}
        - {type: least_load, weight: 1.0}
"""

from __future__ import annotations

from collections.abc import Mapping

from router.replicas import EndpointView
from router.scheduling import RequestContext, Snapshot
from router.scheduling.registry import register, register_policy
from router.scheduling.ring import bounded_capacity, ring_for


def ring_scores(
    key: str, endpoints: list[EndpointView], factor: float, sticky: str | None = None
) -> dict[str, float]:
    by_name = {e.name: e for e in endpoints}
    total = sum(e.load for e in endpoints)
    cap = bounded_capacity(total, len(endpoints), factor)
    out: dict[str, float] = {}
    if sticky in by_name:  # a known session stays: load alone never moves it (its KV is there)
        out[sticky] = 1.0
    ring = ring_for(tuple(sorted(by_name)))
    n = len(by_name)
    for rank, name in enumerate(ring.walk(key)):
        if by_name[name].load >= cap or name in out:
            continue
        out[name] = 1.0 if not out else 0.5 * (1.0 - rank / n)
    return out


class SessionAffinity:
    name = "session_affinity"

    def __init__(self, load_factor: float = 1.25):
        if load_factor < 1.0:
            raise TypeError("load_factor must be >= 1")
        self.load_factor = load_factor

    def score(
        self, ctx: RequestContext, snap: Snapshot, endpoints: list[EndpointView]
    ) -> Mapping[str, float]:
        sticky = snap.session.replica if snap.session is not None else None
        return ring_scores(ctx.identity.key, endpoints, self.load_factor, sticky)


@register("scorer", "session_affinity")
def _session_affinity(load_factor: float = 1.25) -> SessionAffinity:
    return SessionAffinity(load_factor)


register_policy("session_affinity", {"scorers": [{"type": "session_affinity", "weight": 1.0}]})
