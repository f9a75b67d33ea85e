"""Scorer ``least_load``: score(e) = 1 - load(e) / max_load over the candidates (1 for all
when nothing is loaded), where load = max(router in-flight, engine running + waiting).
With ``kv_weight`` k > 0 the score is (1-k)·that + k·(1 - kv_cache_usage).
Policy ``least_load`` uses it alone.

.. code-block:: yaml

    scheduling:
      scorers: [{type: least_load, weight: 1.0, params: {kv_weight: 0.3}}]
"""

from __future__ import annotations

from collections.abc import Mapping

from router.replicas import EndpointView
from router.scheduling import RequestContext, Snapshot
from router.scheduling.registry import register, register_policy


class LeastLoad:
    name = "least_load"

    def __init__(self, kv_weight: float = 0.0):
        if not 0.0 <= kv_weight <= 1.0:
            raise TypeError("kv_weight must be in [0, 1]")
        self.kv_weight = kv_weight

    def score(
        self, ctx: RequestContext, snap: Snapshot, endpoints: list[EndpointView]
    ) -> Mapping[str, float]:
        peak = max((e.load for e in endpoints), default=0.0)
        out = {}
        for e in endpoints:
            s = 1.0 if peak <= 0 else 1.0 - e.load / peak
            if self.kv_weight:
                s = (1 - self.kv_weight) * s + self.kv_weight * (1.0 - (e.kv_usage or 0.0))
            out[e.name] = s
        return out


@register("scorer", "least_load")
def _least_load(kv_weight: float = 0.0) -> LeastLoad:
    return LeastLoad(kv_weight)


register_policy("least_load", {"scorers": [{"type": "least_load", "weight": 1.0}]})
