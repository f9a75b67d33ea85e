"""Baseline picker ``max_score``: the highest weighted total; ties broken by a seeded RNG
(``seed`` param, default 0) so tests are reproducible and load still spreads over equals.

.. code-block:: yaml

    scheduling:
      scorers: [{type: round_robin, weight: 1.0}]
      picker: {type: max_score, params: {seed: 7}}
"""

from __future__ import annotations

import random

from router.replicas import EndpointView
from router.scheduling import RequestContext, Snapshot
from router.scheduling.registry import register

TIE_EPS = 1e-9


class MaxScore:
    name = "max_score"

    def __init__(self, seed: int = 0):
        self._rng = random.Random(seed)

    def pick(
        self, ctx: RequestContext, snap: Snapshot, ranked: list[tuple[EndpointView, float]]
    ) -> EndpointView:
        best = ranked[0][1]
        ties = [e for e, t in ranked if t >= best - TIE_EPS]
        return ties[0] if len(ties) == 1 else self._rng.choice(ties)


@register("picker", "max_score")
def _max_score(seed: int = 0) -> MaxScore:
    return MaxScore(seed)
