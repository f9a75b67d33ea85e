"""``kvroute engine``: the engine plugin's command line.

``kvroute engine flags --preset agentic [--host-tier-bytes N] [--disk-tier-dir DIR]
[--pool-dir DIR [--pool-bytes N]] [--role prefill|decode|both [--pd-connector C]]
[--kv-events ENDPOINT] ...`` prints the vLLM flags of a preset as shell words (copy them
after ``vllm serve MODEL`` / ``python -m vllm.entrypoints.openai.api_server --model MODEL``).
``--json`` prints them as a JSON list instead (for scripts and tests).
``kvroute engine versions`` prints the vLLM versions the plugin supports.
"""

from __future__ import annotations

import argparse
import json
import shlex


def add_arguments(p: argparse.ArgumentParser) -> None:
    from engine_patches.presets import (
        HOST_TIER_MODES,
        PD_CONNECTORS,
        PD_ROLES,
        PRESETS,
        CadenceOptions,
        EngineOptions,
    )

    d, c = EngineOptions(), CadenceOptions()
    sub = p.add_subparsers(dest="engine_action", metavar="ACTION", required=True)
    f = sub.add_parser("flags", help="print the vLLM flags of a preset")
    f.add_argument("--preset", choices=PRESETS, default=d.preset)
    f.add_argument("--platform", choices=["cpu", "gpu"], default=d.platform)
    f.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        default=None,
        help="KV event publisher endpoint (tcp://*:5557, ipc:///path)",
    )
    f.add_argument(
        "--kv-events-replay",
        metavar="ENDPOINT",
        default=None,
        help="replay endpoint (default: next to --kv-events)",
    )
    f.add_argument("--kv-events-topic", default=d.kv_events_topic)
    f.add_argument(
        "--host-tier-bytes",
        type=int,
        default=d.host_tier_bytes,
        help="host-DRAM tier size in bytes (0: no offload tiers)",
    )
    f.add_argument(
        "--host-tier-mode",
        choices=list(HOST_TIER_MODES),
        default=d.host_tier_mode,
        help="write-through: every computed block to host; write-back: a block when HBM evicts it",
    )
    f.add_argument(
        "--disk-tier-dir", metavar="DIR", default=None, help="filesystem tier below the host tier"
    )
    f.add_argument(
        "--pool-dir",
        metavar="DIR",
        default=None,
        help="cluster KV pool: a directory every replica mounts (shared volume), below the "
        "host and disk tiers; blocks one replica writes are found by all",
    )
    f.add_argument(
        "--pool-bytes",
        type=int,
        default=d.pool_bytes,
        help="bound on the pool's size in bytes, kept by every replica's evictor (0: unbounded)",
    )
    f.add_argument("--eviction-policy", choices=["lru", "arc"], default=d.eviction_policy)
    f.add_argument(
        "--retention",
        action="store_true",
        help="agent-aware retention on the host tier (router hints)",
    )
    f.add_argument("--retention-ttl-s", type=float, default=d.retention_ttl_s)
    f.add_argument("--retention-share", type=float, default=d.retention_share)
    f.add_argument("--no-cadence", action="store_true", help="leave vLLM's scheduler alone")
    f.add_argument("--cadence-interval", type=int, default=c.interval)
    f.add_argument("--max-defer-steps", type=int, default=c.max_defer_steps)
    f.add_argument("--max-defer-ms", type=float, default=c.max_defer_ms)
    f.add_argument("--backlog-scale", type=float, default=c.backlog_scale)
    f.add_argument(
        "--long-prefill-token-threshold", type=int, default=d.long_prefill_token_threshold
    )
    f.add_argument(
        "--scheduling-policy",
        choices=["priority", "fcfs"],
        default=d.scheduling_policy,
        help="vLLM's waiting-queue order (agentic preset; fcfs: the flag is not written)",
    )
    f.add_argument("--dcp", type=int, default=d.dcp, help="decode context parallel size (GPU)")
    f.add_argument("--dcp-comm-backend", choices=["ag_rs", "a2a"], default=None)
    f.add_argument(
        "--role",
        choices=list(PD_ROLES),
        default=None,
        help="P/D disaggregation: this replica's role behind the router (URL#role=...)",
    )
    f.add_argument(
        "--pd-connector",
        choices=list(PD_CONNECTORS),
        default=None,
        help="the P/D KV connector (default nixl: vLLM's NixlConnector)",
    )
    f.add_argument(
        "--pd-dir",
        metavar="DIR",
        default=None,
        help="shared-storage connector: the directory prefill and decode replicas mount",
    )
    f.add_argument("--json", action="store_true", help="print a JSON list")
    sub.add_parser("versions", help="print the supported vLLM versions")  # fmt: skip


def options_from_args(args: argparse.Namespace):  # -> EngineOptions
    from engine_patches.presets import CadenceOptions, EngineOptions

    return EngineOptions(
        preset=args.preset,
        platform=args.platform,
        kv_events=args.kv_events,
        kv_events_replay=args.kv_events_replay,
        kv_events_topic=args.kv_events_topic,
        host_tier_bytes=args.host_tier_bytes,
        host_tier_mode=args.host_tier_mode,
        disk_tier_dir=args.disk_tier_dir,
        pool_dir=args.pool_dir,
        pool_bytes=args.pool_bytes,
        eviction_policy=args.eviction_policy,
        retention=args.retention,
        retention_ttl_s=args.retention_ttl_s,
        retention_share=args.retention_share,
        cadence=None
        if args.no_cadence
        else CadenceOptions(
            interval=args.cadence_interval,
            max_defer_steps=args.max_defer_steps,
            max_defer_ms=args.max_defer_ms,
            backlog_scale=args.backlog_scale,
        ),
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        scheduling_policy=args.scheduling_policy,
        dcp=args.dcp,
        dcp_comm_backend=args.dcp_comm_backend,
        pd_role=args.role,
        pd_connector=args.pd_connector,
        pd_dir=args.pd_dir,
    )


def run(args: argparse.Namespace) -> int:
    from engine_patches import presets, versions

    if args.engine_action == "versions":
        print(" ".join(versions.SUPPORTED))
        return 0
    try:
        words = presets.flags(options_from_args(args))
    except ValueError as e:
        print(f"kvroute engine flags: {e}")
        return 2
    print(json.dumps(words) if args.json else shlex.join(words))
    return 0
