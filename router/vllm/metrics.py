"""What the router reads of a vLLM replica's ``GET /metrics``: the gauge and counter names
and their parser.

``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``,
the engine plugin's pending-prefill and host-tier gauges, and the cached prompt tokens by tier.
Parsed with prometheus_client's exposition parser; a malformed exposition yields what parsed.
Pure: no I/O (the fetch is :mod:`router.monitor`'s).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("kvroute.vllm.metrics")

VLLM_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    # the engine plugin's cadence scheduler (and the twin): prompt tokens still to prefill
    "vllm:num_pending_prefill_tokens": "pending_prefill",
}
# cached prompt tokens by tier (vLLM >= 0.33, label ``source``: device, host, disk, ...), else
# the undivided total (re-exported as source "all")
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
CACHED_TOTAL = "vllm:prompt_tokens_cached_total"
# the engine plugin's host-tier shares (engine_patches.offload, which router/ does not import):
# the largest over label sets (one per engine), not their sum
VLLM_SHARES = {
    "vllm:kv_offload_cpu_cache_occupancy_perc": "host_occupancy",
    "vllm:kv_offload_cpu_retained_perc": "host_retained",
}


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """Sum the gauges the router needs over all label sets (one engine may list several),
    the cached-prompt-token counters as ``cached:<source>`` keys (``cached:all`` only when
    the engine does not split them by tier), and the engine plugin's host-tier shares (their
    largest).

    Parsed with prometheus_client's exposition parser (labels, escapes and timestamps are its
    business); a malformed exposition yields what was parsed before the error.
    """
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not math.isfinite(sample.value):
                    continue
                share = VLLM_SHARES.get(sample.name)
                if share is not None:
                    out[share] = max(out.get(share, 0.0), sample.value)
                    continue
                key = VLLM_GAUGES.get(sample.name)
                if sample.name == CACHED_BY_SOURCE:
                    key = "cached:" + sample.labels.get("source", "unknown")
                elif sample.name == CACHED_TOTAL:
                    key = "cached:all"
                if key is not None:
                    out[key] = out.get(key, 0.0) + sample.value
    except (ValueError, TypeError, IndexError) as e:
        log.warning("malformed /metrics exposition (%s); using what parsed", e)
    if len([k for k in out if k.startswith("cached:")]) > 1:
        out.pop("cached:all", None)
    return out


def by_source(parsed: Mapping[str, float]) -> dict[str, float]:
    return {k[7:]: v for k, v in parsed.items() if k.startswith("cached:")}


def cached_by_source(text: str) -> dict[str, float]:
    """The engine's cached prompt tokens by tier (``device``, ``host``, ``disk``, …) from a
    ``/metrics`` exposition; ``{"all": n}`` when it does not split them."""
    return by_source(parse_vllm_metrics(text))
