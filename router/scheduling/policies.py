"""Named policies that combine several scorers (single-scorer policies are registered next to
their scorer).

``llmd`` — the in-house version of llm-d's inference scheduler: 3·kv_prefix + 2·kv_queue +
2·kv_util (the weights of llm-d's example scheduling profiles as remembered; not checked
against an llm-d release here).

.. code-block:: yaml

    policy: llmd
"""

from __future__ import annotations

from router.scheduling.registry import register_policy

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
