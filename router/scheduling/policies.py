"""Named policies that combine several scorers (single-scorer policies are registered next to
their scorer).

``llmd`` — the in-house version of llm-d's inference scheduler: 3·kv_prefix + 2·kv_queue +
2·kv_util. Checked (2026-12-06) against llm-d's own configs: these are the weights of the
precise-prefix-cache-aware guide that ships llm-d-inference-scheduler v0.5.0
(``guides/precise-prefix-cache-aware/gaie-kv-events/values.yaml`` in llm-d/llm-d:
precise-prefix-cache-scorer 3.0, kv-cache-utilization-scorer 2.0, queue-scorer 2.0,
max-score-picker). Later configs weigh them 2 / 1 / 1 (the guide's scheduler values for
v0.8.0-rc.1, and ``deploy/config/epp-precise-prefix-cache-config.yaml`` in
llm-d/llm-d-inference-scheduler): a larger prefix share (1/2 against 3/7), not ported here.
Upstream refreshes the load these scorers read every 50 ms; kvroute reads it every
``metrics_interval_s`` (docs/router.md#load-scrape).

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
