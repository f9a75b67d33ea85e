"""Scorer ``prefix_hash``: route by the prompt's leading blocks on a consistent-hash ring.

Key: the first ``blocks`` chained block keys when a prompt analyzer filled
``ctx.block_keys`` (vLLM-compatible, so equal keys mean equal KV), else the prompt's first
``chars`` characters. Same bounded-load walk as ``session_affinity`` (c = ``load_factor``),
without the session table. Policy ``prefix_hash`` uses it alone.

.. code-block:: yaml

    scheduling:
      scorers: [{type: prefix_hash, weight: 1.0, params: {blocks: 4, load_factor: 1.25}}]
"""

from __future__ import annotations

from collections.abc import Mapping

from router.replicas import EndpointView
from router.scheduling import RequestContext, Snapshot
from router.scheduling.registry import register, register_policy
from router.scheduling.session_affinity import ring_scores


class PrefixHash:
    name = "prefix_hash"

    def __init__(self, blocks: int = 4, chars: int = 1024, load_factor: float = 1.25):
        if blocks < 1 or chars < 1 or load_factor < 1.0:
            raise TypeError("blocks >= 1, chars >= 1, load_factor >= 1")
        self.blocks, self.chars, self.load_factor = blocks, chars, load_factor

    def key(self, ctx: RequestContext) -> str:
        if ctx.block_keys:
            return "b:" + ",".join(str(k) for k in ctx.block_keys[: self.blocks])
        return "t:" + ctx.prompt_prefix(self.chars)

    def score(
        self, ctx: RequestContext, snap: Snapshot, endpoints: list[EndpointView]
    ) -> Mapping[str, float]:
        return ring_scores(self.key(ctx), endpoints, self.load_factor)


@register("scorer", "prefix_hash")
def _prefix_hash(blocks: int = 4, chars: int = 1024, load_factor: float = 1.25) -> PrefixHash:
    return PrefixHash(blocks, chars, load_factor)


register_policy("prefix_hash", {"scorers": [{"type": "prefix_hash", "weight": 1.0}]})
