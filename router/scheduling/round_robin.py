"""Scorer ``round_robin``: 1 for the candidate at position ``seq mod n`` (candidates in name
order, ``seq`` = picks recorded so far), 0 elsewhere. No parameters. Policy ``round_robin``
uses it alone.

.. code-block:: yaml

    policy: round_robin
"""

from __future__ import annotations

from collections.abc import Mapping

from router.replicas import EndpointView
from router.scheduling import RequestContext, Snapshot
from router.scheduling.registry import register, register_policy


class RoundRobin:
    name = "round_robin"

    def score(
        self, ctx: RequestContext, snap: Snapshot, endpoints: list[EndpointView]
    ) -> Mapping[str, float]:
        names = sorted(e.name for e in endpoints)
        return {names[snap.seq % len(names)]: 1.0}


@register("scorer", "round_robin")
def _round_robin() -> RoundRobin:
    return RoundRobin()


register_policy("round_robin", {"scorers": [{"type": "round_robin", "weight": 1.0}]})
