"""Settings of the KV layer: one typed object, parsed with the rest of the router's config.

Owns: :class:`KVConfig` (the ``kv:`` YAML mapping, or ``KVROUTE_KV_<KEY>`` env vars key by
key; see docs/kv-routing.md) and its parsers. :func:`router.config.load_config` calls them, so
a typo in ``kv:`` fails at start-up like any other config error. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

# the settings zero-config discovery fills in from the replicas (see KVConfig.is_bare)
WIRING = ("tokenizer", "block_size", "hash_algo", "profile", "profiles", "events_bind",
          "events_connect", "topics")  # fmt: skip
_BOOLS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}  # fmt: skip


@dataclass
class KVConfig:
    """Settings of the KV layer (YAML/env keys of the same names, see docs/kv-routing.md)."""

    tokenizer: str | None = None  # model dir the replicas serve (tokenizer.json + template)
    block_size: int = 16
    hash_algo: str = "sha256_cbor"
    hash_seed: str | None = None  # the engines' PYTHONHASHSEED
    profile: str = "h200-70b-fp8"  # costmodel profile of every replica ...
    profiles: dict[str, str] = field(default_factory=dict)  # ... unless named here (url->name)
    events_bind: str | None = None  # SUB binds here; replicas connect (topic -> replica)
    # every replica's publisher binds tcp://*:PORT: subscribe to tcp://<replica host>:PORT for
    # each replica in the set (static, DNS or Kubernetes), unless events_connect names it
    events_port: int | None = None
    events_connect: dict[str, str] = field(default_factory=dict)  # replica url -> PUB endpoint
    replay: dict[str, str] = field(default_factory=dict)  # replica url -> replay endpoint
    topics: dict[str, str] = field(default_factory=dict)  # topic -> replica url (bind mode)
    session_idle_ttl_s: float = 1800.0
    expected_output_tokens: int = 400  # until a session has shown its own
    default_gap_s: float = 18.0  # gap between calls until any session has shown one
    forget_after_s: float = 30.0  # a replica discovery removed is forgotten after this long
    time_scale: float = 1.0  # replicas run this many times faster than the profile (twins)
    max_cached_tokens: int = 16_000_000  # incremental tokenizer cache bound
    # prompt analysis runs on one thread off the event loop; a call waits at most this long
    # for its own (0: never — placed on what is known) and never behind another call's
    analysis_wait_s: float = 1.0
    analysis_behind_s: float = 0.05  # most other calls' cold analysis a call waits behind
    analysis_queue: int = 64  # analyses waiting for the thread; beyond that: not analyzed
    analysis_process: bool = True  # long encodes in a worker process (the GIL), see tokens.py
    # the engines' retention settings (`kvroute engine flags --retention`, RetentionConfig in
    # engine_patches/retention_rule.py): with `engine_hints` on, a session hinted as paused
    # is priced as kept in the host tier for min(return_s x slack, ttl) after its call
    retention_ttl_s: float = 600.0
    retention_return_slack: float = 1.5
    retention_share: float = 0.5  # held chunks never exceed this share of a host tier
    # kv_cost's queue term also reads the engine plugin's vllm:num_pending_prefill_tokens
    # (the larger of it and this router's own count): off by default, it added nothing in a
    # single router's simulations and cost throughput with a host tier (docs/kv-routing.md);
    # for several routers in front of the same replicas, whose calls no one router sees
    pending_prefill_gauge: bool = False
    # zero-config (router/kv/autoconf.py): take the tokenizer (when unset), block size and hash
    # algorithm from the replicas (/v1/models, vLLM's vllm:cache_config_info) at start-up, and
    # with profile "none" the generic stand-in sized to the replicas' reported KV capacity.
    # `kvroute serve` turns it on when no kv: settings are given and the policy reads the layer
    discover: bool = False

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be positive")
        if self.retention_ttl_s < 0 or self.retention_return_slack < 0:
            raise ValueError("retention_ttl_s and retention_return_slack must be >= 0")
        if not 0.0 <= self.retention_share <= 1.0:
            raise ValueError("retention_share must be within [0, 1]")
        if self.events_port is not None and not 0 < self.events_port < 65536:
            raise ValueError(f"events_port must be a TCP port (1-65535), got {self.events_port}")

    def is_bare(self) -> bool:
        """Whether these settings leave the KV layer's wiring unsaid — tokenizer, block size,
        hash algorithm, profiles and event endpoints (``WIRING``) all at their defaults; tuning
        (``time_scale``, ``analysis_wait_s``, …), ``events_port``, ``hash_seed`` and
        ``replay`` may be set: what ``kvroute serve`` completes from the replicas
        (zero-config)."""
        base = KVConfig()
        return all(getattr(self, name) == getattr(base, name) for name in WIRING)

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> KVConfig:
        """From a YAML mapping (unknown keys are an error)."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown kv settings: {sorted(unknown)}; known: {sorted(known)}")
        return cls(**dict(d))

    @classmethod
    def env_values(cls, env: Mapping[str, str]) -> dict[str, Any]:
        """The ``KVROUTE_KV_<KEY>`` variables set in ``env``, typed (mappings as YAML text)."""
        import yaml

        vals: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get("KVROUTE_KV_" + f.name.upper())
            if raw is None:
                continue
            t = str(f.type)
            if t.startswith("dict"):
                vals[f.name] = yaml.safe_load(raw) or {}
            elif t.startswith("int"):
                vals[f.name] = int(raw)
            elif t.startswith("float"):
                vals[f.name] = float(raw)
            elif t.startswith("bool"):
                flag = raw.strip().lower()
                if flag not in _BOOLS:
                    raise ValueError(f"KVROUTE_KV_{f.name.upper()}={raw!r}: not a boolean")
                vals[f.name] = _BOOLS[flag]
            else:
                vals[f.name] = raw
        return vals

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> KVConfig | None:
        """``KVROUTE_KV_<KEY>`` variables only; ``None`` when none is set."""
        vals = cls.env_values(env)
        return cls(**vals) if vals else None

    @classmethod
    def merged(cls, base: Mapping[str, Any] | None, env: Mapping[str, str]) -> KVConfig | None:
        """A YAML ``kv:`` mapping with ``KVROUTE_KV_*`` env vars on top (env wins key by key);
        ``None`` when neither sets anything (no KV layer)."""
        vals = cls.env_values(env)
        if not base and not vals:
            return None
        return cls.from_mapping({**dict(base or {}), **vals})
