"""Scorer ``kv_prefix`` — llm-d's prefix-cache scorer, in-house: the share of the prompt's
blocks the replica holds as a consecutive prefix.

score(e) = matched prefix blocks(e) / prompt blocks, from the ``kv`` view (the exact block
index when e's events are fresh, else approximate mode); 0 without block keys or without the
KV layer. No parameters. :func:`match_fraction` is shared with ``kv_sglang_tree``.

.. code-block:: yaml

    scheduling:
      scorers: [{type: kv_prefix, weight: 3.0}, {type: kv_queue, weight: 2.0}]
"""

from __future__ import annotations

from collections.abc import Mapping

from router.replicas import EndpointView
from router.scheduling import RequestContext, Snapshot
from router.scheduling.registry import register


def match_fraction(
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
        return match_fraction(ctx, snap, endpoints)


@register("scorer", "kv_prefix")
def _kv_prefix() -> KVPrefix:
    return KVPrefix()
