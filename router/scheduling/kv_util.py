"""Scorer ``kv_util`` — llm-d's KV-cache-utilization scorer, in-house.

score(e) = 1 − KV-cache usage(e) (``vllm:kv_cache_usage_perc`` as scraped; 0 when unknown).
No parameters.

.. code-block:: yaml

    scheduling:
      scorers: [{type: kv_util, weight: 2.0}]
"""

from __future__ import annotations

from collections.abc import Mapping

from router.replicas import EndpointView
from router.scheduling import RequestContext, Snapshot
from router.scheduling.registry import register


class KVUtil:
    name = "kv_util"

    def score(
        self, ctx: RequestContext, snap: Snapshot, endpoints: list[EndpointView]
    ) -> Mapping[str, float]:
        return {e.name: 1.0 - (e.kv_usage or 0.0) for e in endpoints}


@register("scorer", "kv_util")
def _kv_util() -> KVUtil:
    return KVUtil()
