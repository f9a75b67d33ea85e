"""Scorer ``kv_sglang_tree`` and policy ``sglang_tree`` — the in-house port of the SGLang
model gateway's cache-aware policy.

SGLang (model gateway, cache-aware policy) — ``kv_sglang_tree``, over the approximate cache
(SGLang's per-worker radix tree of routed text; here the chain of block keys routed to each
replica, :mod:`router.kv.approx`, fed only by routing history — never by events):

* if the load is imbalanced — max − min > ``balance_abs`` *and* max > ``balance_rel`` · min
  (load = router in-flight + engine waiting) — pick the least loaded (score 1);
* else if the best prefix match rate ≥ ``cache_threshold``, pick the replica with the highest
  match rate;
* else pick the replica with the smallest tree (most free cache space).

Policy ``sglang_tree`` uses it alone. Thresholds default to sglang-router 0.3.2's defaults
(``router_args.py``: cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold
1.5); they are parameters.

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
        load = {e.name: float(e.inflight) + float(e.waiting or 0.0) for e in endpoints}
        lo, hi = min(load.values()), max(load.values())
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            return {n: 1.0 if v == lo else 0.0 for n, v in load.items()}
        rate = match_fraction(ctx, snap, endpoints, approx_only=True)
        best = max(rate.values(), default=0.0)
        if best >= self.cache_threshold and best > 0:
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
