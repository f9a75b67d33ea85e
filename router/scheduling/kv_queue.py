"""Scorer ``kv_queue`` — llm-d's queue scorer, in-house: min-max normalised queue length.

score(e) = 1 − (q(e) − q_min) / (q_max − q_min) over the candidates, q = the engine's waiting
requests (the router's in-flight count when the engine's is unknown); 1 for all when every q is
equal. No parameters.

.. code-block:: yaml

    scheduling:
      scorers: [{type: kv_queue, weight: 2.0}]
"""

from __future__ import annotations

from collections.abc import Mapping

from router.replicas import EndpointView
from router.scheduling import RequestContext, Snapshot
from router.scheduling.registry import register


class KVQueue:
    name = "kv_queue"

    def score(
        self, ctx: RequestContext, snap: Snapshot, endpoints: list[EndpointView]
    ) -> Mapping[str, float]:
        q = {
            e.name: float(e.waiting) if e.waiting is not None else float(e.inflight)
            for e in endpoints
        }
        lo, hi = min(q.values(), default=0.0), max(q.values(), default=0.0)
        if hi <= lo:
            return dict.fromkeys(q, 1.0)
        return {n: 1.0 - (v - lo) / (hi - lo) for n, v in q.items()}


@register("scorer", "kv_queue")
def _kv_queue() -> KVQueue:
    return KVQueue()
