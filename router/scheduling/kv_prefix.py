"""Scorer ``kv_prefix`` — a port of llm-d's precise prefix-cache scorer.

llm-d (``llm-d-inference-scheduler``, ``precise_prefix_cache.go`` + the kv-cache indexer's
longest-prefix scorer): each pod's score is its consecutive prefix of the prompt's blocks,
every held block weighted by the fastest tier that holds it (``gpu_weight`` 1.0,
``cpu_weight`` 0.8 — the indexer's defaults; ``storage_weight`` defaults to the CPU weight,
llm-d has no disk tier of its own); then min-max normalised over the pods that hit
(``indexedScoresToNormalizedScoredPods``): a pod without a hit scores 0, the best 1, and
when every pod that hit has the same score (one pod alone, say) they all score 1.

    raw(e)   = gpu_w·gpu(e) + cpu_w·cpu(e) + storage_w·storage(e)   (blocks of the match)
    score(e) = (raw(e) − min raw) / (max raw − min raw)   over pods with raw > 0; 1 if equal

Where the port differs: the match comes from kvroute's ``kv`` view (the exact block index when
the replica's events are fresh — as llm-d's is, from the same vLLM events — else kvroute's
approximate mode, where llm-d would score nothing). :func:`match_fraction` (matched share of
the prompt, no tiers) is shared with ``kv_sglang_tree``.

.. code-block:: yaml

    scheduling:
      scorers:
        - {type: kv_prefix, weight: 3.0, params: {cpu_weight: 0.8}}
        - {type: kv_queue, weight: 2.0}
"""

from __future__ import annotations

from collections.abc import Mapping

from router.kv.index import TierDepth
from router.kv.view import KVView
from router.replicas import EndpointView
from router.scheduling import RequestContext, Snapshot
from router.scheduling.registry import register


def prefix_matches(
    ctx: RequestContext, snap: Snapshot, endpoints: list[EndpointView], approx_only: bool = False
) -> dict[str, TierDepth]:
    """The prompt's matched prefix on each candidate (only those that hold any of it)."""
    view: KVView | None = snap.state("kv")
    keys = ctx.block_keys or []
    if view is None or not keys:
        return {}
    names = [e.name for e in endpoints]
    return view.approx_match(keys, names) if approx_only else view.match(keys, names)


def match_fraction(
    ctx: RequestContext, snap: Snapshot, endpoints: list[EndpointView], approx_only: bool = False
) -> dict[str, float]:
    """Matched blocks / prompt blocks per candidate that holds any of the prompt."""
    n = len(ctx.block_keys or [])
    return {r: d.depth / n for r, d in prefix_matches(ctx, snap, endpoints, approx_only).items()}


class KVPrefix:
    name = "kv_prefix"

    def __init__(
        self, gpu_weight: float = 1.0, cpu_weight: float = 0.8, storage_weight: float | None = None
    ):
        storage_weight = cpu_weight if storage_weight is None else storage_weight
        if min(gpu_weight, cpu_weight, storage_weight) < 0:
            raise TypeError("tier weights must be >= 0")
        self.weights = (gpu_weight, cpu_weight, storage_weight)

    def score(
        self, ctx: RequestContext, snap: Snapshot, endpoints: list[EndpointView]
    ) -> Mapping[str, float]:
        g, c, s = self.weights
        raw = {
            r: g * d.gpu + c * d.cpu + s * (d.storage + d.pool)
            for r, d in prefix_matches(ctx, snap, endpoints).items()
        }
        raw = {r: v for r, v in raw.items() if v > 0}
        if not raw:
            return {}
        lo, hi = min(raw.values()), max(raw.values())
        if hi == lo:
            return dict.fromkeys(raw, 1.0)
        return {r: (v - lo) / (hi - lo) for r, v in raw.items()}


@register("scorer", "kv_prefix")
def _kv_prefix(
    gpu_weight: float = 1.0, cpu_weight: float = 0.8, storage_weight: float | None = None
) -> KVPrefix:
    return KVPrefix(gpu_weight, cpu_weight, storage_weight)
