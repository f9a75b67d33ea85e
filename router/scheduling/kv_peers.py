"""In-house versions of the peers' KV-aware policies, as baselines for ``kv_cost``.

llm-d (inference scheduler) — weighted scorers summed by the pipeline:

* ``kv_prefix``: matched prefix blocks / prompt blocks (from the ``kv`` view: exact index when
  the replica's events are fresh, else approximate mode) — llm-d's prefix-cache scorer;
* ``kv_queue``: 1 − (q − q_min) / (q_max − q_min) over the candidates, q = engine waiting
  requests (router in-flight when unknown); all 1 when equal — llm-d's queue scorer;
* ``kv_util``: 1 − KV-cache usage — llm-d's kv-cache-utilization scorer.

Policy ``llmd`` = 3·kv_prefix + 2·kv_queue + 2·kv_util (the weights of llm-d's example
scheduling profiles as remembered; not checked against an llm-d release here).

SGLang (model gateway, cache-aware policy) — ``kv_sglang_tree``, over the approximate cache
(SGLang's per-worker radix tree of routed text; here the chain of block keys routed to each
replica, :mod:`router.approx`, fed only by routing history — never by events):

* if the load is imbalanced — max − min > ``balance_abs`` *and* max > ``balance_rel`` · min
  (load = router in-flight + engine waiting) — pick the least loaded (score 1);
* else if the best prefix match rate ≥ ``cache_threshold``, pick the replica with the highest
  match rate;
* else pick the replica with the smallest tree (most free cache space).

Policy ``sglang_tree`` uses it alone. Thresholds default to sglang-router 0.3.2's defaults
(``router_args.py``: cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold
1.5); they are parameters.
"""

from __future__ import annotations

from collections.abc import Mapping

from router.replicas import EndpointView
from router.scheduling import RequestContext, Snapshot
from router.scheduling.registry import register, register_policy


def _match_fraction(
    ctx: RequestContext, snap: Snapshot, endpoints: list[EndpointView], approx_only: bool = False
) -> dict[str, float]:
    view = snap.state("kv")
    keys = ctx.block_keys or []
    if view is None or not keys:
        return {}
    names = [e.name for e in endpoints]
    if approx_only:
        m = view.approx_match(keys, names)
    else:
        m = view.match(keys, names)
    return {n: d.depth / len(keys) for n, d in m.items()}


class KVPrefix:
    name = "kv_prefix"

    def score(
        self, ctx: RequestContext, snap: Snapshot, endpoints: list[EndpointView]
    ) -> Mapping[str, float]:
        return _match_fraction(ctx, snap, endpoints)


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


class KVUtil:
    name = "kv_util"

    def score(
        self, ctx: RequestContext, snap: Snapshot, endpoints: list[EndpointView]
    ) -> Mapping[str, float]:
        return {e.name: 1.0 - (e.kv_usage or 0.0) for e in endpoints}


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
        rate = _match_fraction(ctx, snap, endpoints, approx_only=True)
        best = max(rate.values(), default=0.0)
        if best >= self.cache_threshold and best > 0:
            return {n: 1.0 if rate.get(n, 0.0) == best else 0.5 * rate.get(n, 0.0) for n in load}
        view = snap.state("kv")
        size = {n: float(view.approx_blocks(n)) if view is not None else 0.0 for n in load}
        small = min(size.values())
        return {n: 1.0 if v == small else 0.5 / (1.0 + v - small) for n, v in size.items()}


@register("scorer", "kv_prefix")
def _kv_prefix() -> KVPrefix:
    return KVPrefix()


@register("scorer", "kv_queue")
def _kv_queue() -> KVQueue:
    return KVQueue()


@register("scorer", "kv_util")
def _kv_util() -> KVUtil:
    return KVUtil()


@register("scorer", "kv_sglang_tree")
def _kv_sglang_tree(
    cache_threshold: float = 0.3, balance_abs: float = 64.0, balance_rel: float = 1.5
) -> SGLangTree:
    return SGLangTree(cache_threshold, balance_abs, balance_rel)


register_policy(
    "llmd",
    {
        "scorers": [
            {"type": "kv_prefix", "weight": 3.0},
            {"type": "kv_queue", "weight": 2.0},
            {"type": "kv_util", "weight": 2.0},
        ]
    },
)
register_policy("sglang_tree", {"scorers": [{"type": "kv_sglang_tree", "weight": 1.0}]})
