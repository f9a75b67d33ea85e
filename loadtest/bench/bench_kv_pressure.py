"""kv_cost with the engine plugin under KV pressure, against the faithful ports (issue 12).

The yardstick's trace simulator (:mod:`loadtest.bench.bench_kv_policy`: same seeds, stagger,
warm-up, statistics and line), with the engine plugin's rules in the simulated engines
(:class:`loadtest.twin.engine.EnginePlugin`): ``kv_cost+hints`` is kv_cost with the router's
``engine_hints`` on and every engine's host tier honouring them (``AgentRetentionPolicy``'s
rule, default settings: TTL 600 s, share 0.5); ``kv_cost+hints+cadence`` adds the bounded
prefill cadence (N 4, D 16 steps, T 500 ms, backlog scale 16). ``kv_cost``, ``sglang_tree``
and ``llmd`` run on plain engines (vLLM's LRU host tier, no cadence), as in the yardstick.

Workloads (weka-dev's real Claude Code sessions, tool pauses up to 180 s,
``h200-70b-fp8-tp4-offload``):

- ``weka-dev-scarce``: the yardstick's KV-scarce workload (2 replicas, 8 GPUs);
- ``weka-dev-squeezed``: the same with the engine KV and the host tier both cut to 12,000
  blocks (768k tokens) per replica — a stress configuration, not a hardware profile, chosen
  so that the host tier overflows and its eviction order matters (in ``weka-dev-scarce`` it
  never fills: see docs/benchmarks.md);
- ``weka-dev-squeezed-host``: ``weka-dev-squeezed`` with no NVMe tier, so what the host tier
  drops is recomputed: the one workload here where the policies' hit ratios part (0.85–0.87
  at 32 lanes, 0.57–0.67 at 48; docs/benchmarks.md);
- ``weka-dev-scarce-8x``: the yardstick's offload profile on 8 replicas (32 GPUs);
- ``agentx-long-hi``: the yardstick's long-context sessions (``AGENTX_LONG``) at 16–32 lanes
  on 4 replicas of ``h200-70b-fp8-tp4-1m-offload`` — past the line, looking for the load at
  which long contexts fill the HBM (they do not: docs/benchmarks.md, ``agentx-long``).

``KVROUTE_BENCH_WORKLOADS`` / ``KVROUTE_BENCH_POLICIES`` (comma lists) narrow a run.
"""

from __future__ import annotations

from typing import Any

from loadtest.bench.bench_kv_policy import _W, AGENTX_LONG, run_workloads

POLICIES = ("kv_cost", "kv_cost+hints", "kv_cost+hints+cadence", "sglang_tree", "llmd")
OURS = ("kv_cost", "kv_cost+hints", "kv_cost+hints+cadence")
_OFF = "h200-70b-fp8-tp4-offload"
WORKLOADS: dict[str, _W] = {
    "weka-dev-scarce": ("weka-dev.tar.gz", _OFF, 2, 180.0, (16, 32, 48), (32,)),
    "weka-dev-squeezed": ("weka-dev.tar.gz", _OFF, 2, 180.0, (16, 32, 48), (32,)),
    "weka-dev-squeezed-host": ("weka-dev.tar.gz", _OFF, 2, 180.0, (16, 32, 48), (32,)),
    "weka-dev-scarce-8x": ("weka-dev.tar.gz", _OFF, 8, 180.0, (96, 128, 160), (128,)),
    "agentx-long-hi": (AGENTX_LONG, "h200-70b-fp8-tp4-1m-offload", 4, None, (16, 24, 32), (24,)),
}
OVERRIDES: dict[str, dict[str, Any]] = {
    "weka-dev-squeezed": {"gpu_kv_blocks": 12_000, "cpu_kv_blocks": 12_000},
    "weka-dev-squeezed-host": {
        "gpu_kv_blocks": 12_000,
        "cpu_kv_blocks": 12_000,
        "storage_kv_blocks": 0,
    },
}


def run(quick: bool = False) -> list[dict]:
    return run_workloads(WORKLOADS, POLICIES, quick, ours=OURS, overrides=OVERRIDES)
