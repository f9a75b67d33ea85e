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
  never fills: see docs/benchmarks-log.md);
- ``weka-dev-squeezed-host``: ``weka-dev-squeezed`` with no NVMe tier, so what the host tier
  drops is recomputed: the one workload here where the policies' hit ratios part (0.85–0.87
  at 32 lanes, 0.57–0.67 at 48; docs/benchmarks-log.md);
- ``weka-dev-squeezed-hbm``: the engine KV cut to 12,000 blocks as in ``weka-dev-squeezed``, the
  host tier kept at the profile's own ratio to it (4.9M / 2.8M tokens: 1.76×, 21,000 blocks),
  no NVMe: a working set larger than the HBM that fits HBM + DRAM;
- ``weka-dev-squeezed-host-writeback``: ``weka-dev-squeezed-host`` with a write-back host tier
  (``host_write_back``: it takes what HBM evicts instead of every computed block) for every
  policy — the plugin's ``--host-tier-mode write-back`` (``engine_patches.writeback``);
- ``weka-dev-scarce-8x``: the yardstick's offload profile on 8 replicas (32 GPUs);
- ``agentx-long-hi``: the yardstick's long-context sessions (``AGENTX_LONG``) at 16–32 lanes
  on 4 replicas of ``h200-70b-fp8-tp4-1m-offload`` — past the line, looking for the load at
  which long contexts fill the HBM (they do not: docs/benchmarks-log.md, ``agentx-long``);
- ``weka-dev-squeezed-host-8x``: ``weka-dev-squeezed-host``'s engines on 8 replicas (32 GPUs):
  KV pressure at the scale where placement also decides interactivity;
- ``weka-dev-squeezed-host-writeback-8x``: ``weka-dev-squeezed-host-8x`` with the write-back
  host tier (96 and 128 lanes);
- ``weka-dev-squeezed-host-pool`` and ``weka-dev-squeezed-host-pool-8x`` (issue 43):
  ``weka-dev-squeezed-host``'s engines (and ``-8x``'s) sharing one cluster KV pool
  (``pool_kv_blocks``, :class:`loadtest.twin.tiers.ClusterPool`: written through from every
  host tier, read by every engine at the hardware's pool link) as large as the cluster's host
  tiers together (12,000 blocks per replica): every policy, ports included, on the same
  pool-enabled engines; compare with the workload without ``-pool`` for the stock engines;
- ``weka-dev-unlimited-kv`` and ``weka-dev-unlimited-kv-8x``: **the ceilings**, not pressure
  workloads — the same trace, profile and replicas with a KV cache that never evicts (and no
  tier below it, so nothing is ever fetched), run with ``CEILING_POLICIES``. No router, tier
  or retention rule can serve more hits than that, so a ``<workload>_kv_headroom`` row gives,
  for each workload a ceiling bounds (``CEILINGS``), the ceiling's line figure ÷ the best
  port's: the most that keeping KV could add there. (Not a bound on other levers: placement
  for interactivity, or the prefill cadence, change what the engines do with the same hits.)
"""

from __future__ import annotations

from typing import Any

from loadtest.bench.bench_kv_policy import _W, AGENTX_LONG, run_workloads

POLICIES = ("kv_cost", "kv_cost+hints", "kv_cost+hints+cadence", "sglang_tree", "llmd")
OURS = ("kv_cost", "kv_cost+hints", "kv_cost+hints+cadence")
_WB = "weka-dev-squeezed-host-writeback"
_WB8 = "weka-dev-squeezed-host-writeback-8x"
_POOL = "weka-dev-squeezed-host-pool"
_POOL8 = "weka-dev-squeezed-host-pool-8x"
# each ceiling and the workloads it bounds (same trace, profile, replicas and gap cap)
CEILINGS: dict[str, tuple[str, ...]] = {
    "weka-dev-unlimited-kv": (
        "weka-dev-scarce",
        "weka-dev-squeezed",
        "weka-dev-squeezed-host",
        "weka-dev-squeezed-hbm",
        _WB,
        _POOL,
    ),
    "weka-dev-unlimited-kv-8x": ("weka-dev-scarce-8x", "weka-dev-squeezed-host-8x", _WB8, _POOL8),
}
CEILING_POLICIES = ("kv_cost", "sglang_tree")
_OFF = "h200-70b-fp8-tp4-offload"
WORKLOADS: dict[str, _W] = {
    "weka-dev-scarce": ("weka-dev.tar.gz", _OFF, 2, 180.0, (16, 32, 48), (32,)),
    "weka-dev-squeezed": ("weka-dev.tar.gz", _OFF, 2, 180.0, (16, 32, 48), (32,)),
    # 24 lanes: where every policy's P90 interactivity crosses the line on this workload
    "weka-dev-squeezed-host": ("weka-dev.tar.gz", _OFF, 2, 180.0, (16, 24, 32, 48), (32,)),
    "weka-dev-squeezed-hbm": ("weka-dev.tar.gz", _OFF, 2, 180.0, (16, 24, 28, 32), (28,)),
    _WB: ("weka-dev.tar.gz", _OFF, 2, 180.0, (16, 24, 28, 32), (28,)),
    "weka-dev-scarce-8x": ("weka-dev.tar.gz", _OFF, 8, 180.0, (96, 128, 160), (128,)),
    "agentx-long-hi": (AGENTX_LONG, "h200-70b-fp8-tp4-1m-offload", 4, None, (16, 24, 32), (24,)),
    "weka-dev-squeezed-host-8x": ("weka-dev.tar.gz", _OFF, 8, 180.0, (64, 96, 128), (96,)),
    _WB8: ("weka-dev.tar.gz", _OFF, 8, 180.0, (96, 128), (96,)),
    _POOL: ("weka-dev.tar.gz", _OFF, 2, 180.0, (16, 24, 32, 48), (32,)),
    _POOL8: ("weka-dev.tar.gz", _OFF, 8, 180.0, (64, 96, 128), (96,)),
    "weka-dev-unlimited-kv": ("weka-dev.tar.gz", _OFF, 2, 180.0, (24, 32, 40), (32,)),
    "weka-dev-unlimited-kv-8x": ("weka-dev.tar.gz", _OFF, 8, 180.0, (128, 144, 160), (144,)),
}
_SQUEEZED_HOST = {"gpu_kv_blocks": 12_000, "cpu_kv_blocks": 12_000, "storage_kv_blocks": 0}
# never full: weka-dev's 88 sessions reach 14.2M tokens between them (222k blocks of 64)
_NEVER_EVICTS = {"gpu_kv_blocks": 500_000, "cpu_kv_blocks": 0, "storage_kv_blocks": 0}
OVERRIDES: dict[str, dict[str, Any]] = {
    "weka-dev-squeezed": {"gpu_kv_blocks": 12_000, "cpu_kv_blocks": 12_000},
    "weka-dev-squeezed-host": _SQUEEZED_HOST,
    "weka-dev-squeezed-host-8x": _SQUEEZED_HOST,
    _WB: {**_SQUEEZED_HOST, "host_write_back": 1},
    _WB8: {**_SQUEEZED_HOST, "host_write_back": 1},
    # one pool for the cluster, as large as its host tiers together
    _POOL: {**_SQUEEZED_HOST, "pool_kv_blocks": 2 * 12_000},
    _POOL8: {**_SQUEEZED_HOST, "pool_kv_blocks": 8 * 12_000},
    "weka-dev-squeezed-hbm": {
        "gpu_kv_blocks": 12_000,
        "cpu_kv_blocks": 21_000,
        "storage_kv_blocks": 0,
    },
    **{c: _NEVER_EVICTS for c in CEILINGS},
}


def run(quick: bool = False) -> list[dict]:
    pressure = {k: v for k, v in WORKLOADS.items() if k not in CEILINGS}
    rows = run_workloads(pressure, POLICIES, quick, ours=OURS, overrides=OVERRIDES)
    ceilings = {k: v for k, v in WORKLOADS.items() if k in CEILINGS}
    rows += run_workloads(ceilings, CEILING_POLICIES, quick, ours=(), overrides=OVERRIDES)
    return rows + headroom_rows(rows)


def headroom_rows(rows: list[dict]) -> list[dict]:
    """Per workload a ceiling of ``CEILINGS`` bounds, when both ran: the ceiling's line figure
    (the best policy on a cache that never evicts) ÷ the best port's (every policy not in
    ``OURS``), measured and interpolated, beside the best of ``OURS`` — by the one line rule
    (:mod:`loadtest.line`) for all or none: ``line_ok`` only when every policy of both rows is
    fine at the line (else ``line_flags`` says which is not), and no interpolated ratio where
    any policy's crossing was not bracketed. Pure: reads line rows."""
    lines = {r["name"].split("_at_p90_")[0]: r for r in rows if "_at_p90_" in r.get("name", "")}

    def figs(line: dict) -> dict[str, dict]:
        return {p: v for p, v in line.items() if isinstance(v, dict) and "measured" in v}

    def top(line: dict, keep: Any, kind: str) -> float | None:
        vals = [v[kind] for p, v in figs(line).items() if keep(p) and v.get(kind) is not None]
        return max(vals) if vals else None

    out: list[dict] = []
    for cname, bounded in CEILINGS.items():
        ceiling = lines.get(cname)
        for w in bounded:
            line = lines.get(w)
            if ceiling is None or line is None:
                continue
            both = {**{f"{cname}:{p}": v for p, v in figs(ceiling).items()}, **figs(line)}
            flags = {p: v.get("why") for p, v in both.items() if v.get("ok") is False}
            row: dict[str, Any] = {"name": f"{w}_kv_headroom", "ceiling": cname,
                                   "line_ok": not flags, "line_flags": flags}  # fmt: skip
            bracketed = all(v.get("interpolated") is not None for v in both.values())
            for kind in ("measured", "interpolated"):
                ceil = top(ceiling, lambda p: True, kind)
                port = top(line, lambda p: p not in OURS, kind)
                ours = top(line, lambda p: p in OURS, kind)
                row[f"ceiling_{kind}"] = ceil
                row[f"best_port_{kind}"] = port
                row[f"best_ours_{kind}"] = ours
                for label, x in (("ceiling", ceil), ("ours", ours)):
                    row[f"{label}_vs_best_port_{kind}"] = (
                        "not comparable (a crossing lies outside its grid)"
                        if kind == "interpolated" and not bracketed
                        else f"{x / port:.2f}x"
                        if x is not None and port
                        else "not comparable"
                    )
            out.append(row)
    return out
