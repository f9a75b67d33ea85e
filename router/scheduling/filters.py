"""Baseline filters: ``healthy`` (health check passing, breaker lets traffic through) and
``serves_model`` (the replica lists the requested model; replicas whose model list is not
known yet are kept). Pure functions of (request, snapshot). No parameters.

.. code-block:: yaml

    scheduling:
      filters: [healthy, serves_model]
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


@register("filter", "healthy")
def _healthy() -> Healthy:
    return Healthy()


@register("filter", "serves_model")
def _serves_model() -> ServesModel:
    return ServesModel()
