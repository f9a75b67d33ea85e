"""Scorer ``kv_sglang_tree`` and policy ``sglang_tree`` — a port of sglang-router's
``cache_aware`` policy (``sgl-router/src/policies/cache_aware.rs``).

sglang-router keeps one approximate radix tree of routed request *text* per worker (never fed
by the engines) and, per request:

* load(w) = the router's own in-flight requests to w (incremented when it routes, decremented
  when the response ends — not the engine's queue); the system is imbalanced when
  max − min > ``balance_abs`` **and** max > ``balance_rel`` · min (both strict): then the
  least-loaded worker wins;
* else match rate = matched prefix / request length against the best-matching worker's tree;
  if it is **strictly** above ``cache_threshold`` that worker wins, else the worker with the
  smallest tree (most free cache);
* the request is inserted into the winner's tree **at selection time** (in both branches),
  so a burst of calls sharing a prefix sees it before the first one finishes.

Here the tree is the KV layer's approximate cache (:mod:`router.kv.approx`: the chain of block
keys routed to each replica, recorded when the call sequence makes a decision, trimmed to the
replica's KV capacity), and the match rate counts blocks, not characters. Policy
``sglang_tree`` uses the scorer alone. Thresholds default to sglang-router 0.3.2's defaults
(``router_args.py``: cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold
1.5).

.. code-block:: yaml

    scheduling:
      scorers: [{type: kv_sglang_tree, weight: 1.0, params: {cache_threshold: 0.3}}]
"""

from __future__ import annotations

from collections.abc import Mapping

from router.replicas import EndpointView
from router.scheduling import RequestContext, Snapshot
from router.scheduling.kv_prefix import match_fraction
from router.scheduling.registry import register, register_policy


class SGLangTree:
    name = "kv_sglang_tree"

    def __init__(
        self, cache_threshold: float = 0.3, balance_abs: float = 64.0, balance_rel: float = 1.5
    ):
        if not 0 <= cache_threshold <= 1 or balance_abs < 0 or balance_rel < 1:
            raise TypeError("0 <= cache_threshold <= 1, balance_abs >= 0, balance_rel >= 1")
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel

    def score(
        self, ctx: RequestContext, snap: Snapshot, endpoints: list[EndpointView]
    ) -> Mapping[str, float]:
        load = {e.name: float(e.inflight) for e in endpoints}
        lo, hi = min(load.values()), max(load.values())
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            return {n: 1.0 if v == lo else 0.0 for n, v in load.items()}
        rate = match_fraction(ctx, snap, endpoints, approx_only=True)
        best = max(rate.values(), default=0.0)
        if best > self.cache_threshold:
            return {n: 1.0 if rate.get(n, 0.0) == best else 0.5 * rate.get(n, 0.0) for n in load}
        view = snap.state("kv")
        size = {n: float(view.approx_blocks(n)) if view is not None else 0.0 for n in load}
        small = min(size.values())
        return {n: 1.0 if v == small else 0.5 / (1.0 + v - small) for n, v in size.items()}


@register("scorer", "kv_sglang_tree")
def _kv_sglang_tree(
    cache_threshold: float = 0.3, balance_abs: float = 64.0, balance_rel: float = 1.5
) -> SGLangTree:
    return SGLangTree(cache_threshold, balance_abs, balance_rel)


register_policy("sglang_tree", {"scorers": [{"type": "kv_sglang_tree", "weight": 1.0}]})
