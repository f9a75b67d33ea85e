"""Scorer ``kv_sglang_tree`` and policy ``sglang_tree`` — a port of sglang-router 0.3.2's
``cache_aware`` policy (the SGLang Model Gateway's ``src/policies/cache_aware.rs``).

sglang-router keeps one approximate radix tree of routed request *text* per worker (never fed
by the engines; for a chat call the text is the messages' contents joined by spaces) and, per
request:

* load(w) = the router's own in-flight requests to w (incremented when it routes, decremented
  when the response ends — not the engine's queue); the system is imbalanced when
  max − min > ``balance_abs`` **and** max > ``balance_rel`` · min (both strict): then the
  least-loaded worker wins;
* else match rate = matched prefix / request length against the best-matching worker's tree;
  if it is **strictly** above ``cache_threshold`` that worker wins, else the **least-loaded**
  worker (0.3.2; earlier sgl-router releases, ``sgl-router/src/policies``, took the worker
  with the smallest tree instead: ``miss: smallest_tree``);
* ties on load go to the first worker in its list (Rust's ``min_by_key``), so at equal load
  — e.g. every call of a sequential client — a miss always lands on the same worker;
* the request is inserted into the winner's tree **at selection time** (in both branches),
  so a burst of calls sharing a prefix sees it before the first one finishes.

Here the tree is the KV layer's approximate cache (:mod:`router.kv.approx`: the chain of block
keys routed to each replica, recorded when the call sequence makes a decision, trimmed to the
replica's KV capacity), and the match rate counts blocks, not characters. Ties (on load, on
match depth, on tree size) go to the first endpoint in the router's replica order, where
sglang-router's worker order is its registration order (concurrent at start-up, so it varies
from run to run) and a tie between workers holding the same deepest tree node goes to the
node's first tenant in hash order. Policy ``sglang_tree`` uses the scorer alone. Thresholds
default to sglang-router 0.3.2's defaults (``router_args.py``: cache_threshold 0.3,
balance_abs_threshold 64, balance_rel_threshold 1.5). The decision agreement with the real
binary is measured by ``tests/integration/test_sglang_agreement.py`` (docs/results.md).

.. code-block:: yaml

    scheduling:
      scorers: [{type: kv_sglang_tree, weight: 1.0, params: {cache_threshold: 0.3}}]
"""

from __future__ import annotations

from collections.abc import Mapping

from router.kv.view import KVView
from router.replicas import EndpointView
from router.scheduling import RequestContext, Snapshot
from router.scheduling.kv_prefix import match_fraction
from router.scheduling.registry import register, register_policy

MISS_RULES = ("min_load", "smallest_tree")


def _first_min(values: Mapping[str, float]) -> dict[str, float]:
    """1.0 for the first name (in order) with the smallest value, less for every other one."""
    lo = min(values.values())
    winner = next(n for n, v in values.items() if v == lo)
    return {n: 1.0 if n == winner else 0.5 / (1.0 + v - lo) for n, v in values.items()}


class SGLangTree:
    name = "kv_sglang_tree"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs: float = 64.0,
        balance_rel: float = 1.5,
        miss: str = "min_load",
    ):
        if not 0 <= cache_threshold <= 1 or balance_abs < 0 or balance_rel < 1:
            raise TypeError("0 <= cache_threshold <= 1, balance_abs >= 0, balance_rel >= 1")
        if miss not in MISS_RULES:
            raise TypeError(f"miss must be one of {MISS_RULES}")
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.miss = miss

    def score(
        self, ctx: RequestContext, snap: Snapshot, endpoints: list[EndpointView]
    ) -> Mapping[str, float]:
        load = {e.name: float(e.inflight) for e in endpoints}
        lo, hi = min(load.values()), max(load.values())
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            return _first_min(load)
        rate = match_fraction(ctx, snap, endpoints, approx_only=True)
        best = max(rate.values(), default=0.0)
        if best > self.cache_threshold:
            winner = next(n for n in load if rate.get(n, 0.0) == best)
            return {n: 1.0 if n == winner else 0.5 * rate.get(n, 0.0) for n in load}
        if self.miss == "min_load":
            return _first_min(load)
        view: KVView | None = snap.state("kv")
        return _first_min(
            {n: float(view.approx_blocks(n)) if view is not None else 0.0 for n in load}
        )


@register("scorer", "kv_sglang_tree")
def _kv_sglang_tree(
    cache_threshold: float = 0.3,
    balance_abs: float = 64.0,
    balance_rel: float = 1.5,
    miss: str = "min_load",
) -> SGLangTree:
    return SGLangTree(cache_threshold, balance_abs, balance_rel, miss)


register_policy("sglang_tree", {"scorers": [{"type": "kv_sglang_tree", "weight": 1.0}]})
