"""Baseline filters, the default ones in this order: ``healthy`` (health check passing, breaker
lets traffic through), ``serves_model`` (the replica lists the requested model; replicas whose
model list is not known yet are kept) and ``pool_room`` (see :class:`PoolRoom`). Pure
functions of (request, snapshot). No parameters.

.. code-block:: yaml

    scheduling:
      filters: [healthy, serves_model, pool_room]
      scorers: [{type: least_load, weight: 1.0}]
"""

from __future__ import annotations

from router.replicas import EndpointView
from router.scheduling import RequestContext, Snapshot
from router.scheduling.registry import register


class Healthy:
    name = "healthy"

    def filter(
        self, ctx: RequestContext, snap: Snapshot, endpoints: list[EndpointView]
    ) -> list[EndpointView]:
        return [e for e in endpoints if e.healthy and e.accepting]


class ServesModel:
    name = "serves_model"

    def filter(
        self, ctx: RequestContext, snap: Snapshot, endpoints: list[EndpointView]
    ) -> list[EndpointView]:
        if not ctx.model:
            return endpoints
        return [e for e in endpoints if not e.models or ctx.model in e.models]


class PoolRoom:
    """Keep the replicas where a call would wait the fewest rounds for one of the router's
    upstream connections: ``inflight // connections`` (``max_connections_per_replica``; 0
    while the replica has a free one, 1 while the calls past the limit are fewer than the
    limit, …), and the session's own replica whatever its round.

    A call past the limit waits in the router's pool until one of the replica's calls ends
    (a stream: the whole reply), up to ``pool_timeout_s``, and is never placed again; a
    bounded-load scorer alone lets one replica hold 1.25× the mean, past twice the limit
    while others wait less (the 2,000-stream bench, docs/results.md#router-at-scale). A known
    session is kept on its replica: whether to wait there or move and recompute its context
    is its cost scorer's call (``kv_cost`` counts the calls waiting in the queue it prices).
    A replica without a limit (``connections`` None) is round 0."""

    name = "pool_room"

    def filter(
        self, ctx: RequestContext, snap: Snapshot, endpoints: list[EndpointView]
    ) -> list[EndpointView]:
        rounds = [e.inflight // e.connections if e.connections else 0 for e in endpoints]
        least = min(rounds, default=0)
        if all(r == least for r in rounds):
            return endpoints
        own = snap.session.replica if snap.session is not None else None
        return [e for e, r in zip(endpoints, rounds, strict=True) if r == least or e.name == own]


@register("filter", "healthy")
def _healthy() -> Healthy:
    return Healthy()


@register("filter", "serves_model")
def _serves_model() -> ServesModel:
    return ServesModel()


@register("filter", "pool_room")
def _pool_room() -> PoolRoom:
    return PoolRoom()
