"""Router configuration: one typed object, filled from defaults < YAML < env < flags.

Owns: :class:`RouterConfig` and :func:`load_config`. Every field is settable three ways:
a YAML key of the same name (``config.yaml``), an env var ``KVROUTE_<FIELD>`` (upper case)
and a ``--field-name`` flag of ``kvroute serve``; the KV layer's settings are the typed
``kv:`` mapping (:class:`router.kv.config.KVConfig`), with ``KVROUTE_KV_<KEY>`` env vars on
top key by key — parsed here with the rest, so a bad ``kv:`` key fails at start-up.
Secrets (``upstream_api_key``,
``admin_key``, ``api_keys``) never appear in ``repr``/logs. Pure: no sockets, no aiohttp.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from router.admission import AdmissionLimits
from router.kv.config import KVConfig
from router.priority import PRIORITY_MODES, PriorityConfig
from router.urls import (
    mask_url_password,
    redacted,
    split_role,
    strip_url_credentials,
    url_problem,
)

SECRET_FIELDS = frozenset({"upstream_api_key", "admin_key", "api_keys"})
# the shortest metrics_interval_s accepted: llm-d's scheduler refreshes every 50 ms; below
# 10 ms the scrapes alone would take most of a core at a few dozen replicas
MIN_METRICS_INTERVAL_S = 0.01


class ConfigError(ValueError):
    """A configuration value is missing, malformed or contradictory."""


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # static URLs; ``URL#role=prefill|decode`` gives a replica a P/D role (default: both)
    replicas: list[str] = field(default_factory=list)
    replica_dns: list[str] = field(default_factory=list)  # http://name:port, re-resolved
    dns_interval_s: float = 10.0
    k8s_service: str | None = None  # EndpointSlice discovery: service name
    k8s_namespace: str = "default"
    k8s_port_name: str | None = None
    k8s_interval_s: float = 5.0  # longest back-off between failed EndpointSlice list/watch tries
    k8s_watch_timeout_s: float = 300.0  # server-side timeoutSeconds of one watch request
    k8s_dns_suffix: str | None = None  # e.g. svc.cluster.local: name pods by hostname, not IP
    k8s_api_url: str | None = None  # default: https://$KUBERNETES_SERVICE_HOST:$..._PORT
    k8s_sa_dir: str = "/var/run/secrets/kubernetes.io/serviceaccount"  # token + ca.crt
    policy: str = "kv_cost"
    scheduling: dict[str, Any] | None = None  # explicit pipeline (overrides policy)
    kv: KVConfig | None = None  # the KV layer (``kv:`` YAML mapping + KVROUTE_KV_* env)
    redis_url: str | None = None
    session_ttl_s: float = 3600.0
    redis_timeout_s: float = 0.25
    redis_reconcile_interval_s: float = 1.0
    health_interval_s: float = 2.0
    # how often each replica's /metrics is scraped for its queue and KV usage (the load every
    # load-aware policy reads); down to MIN_METRICS_INTERVAL_S. llm-d's scheduler refreshes
    # every 50 ms; one scrape of a twin's 5 KB exposition costs this router ~0.8 ms of CPU
    # (docs/router.md#load-scrape), so 50 ms is ~1.6% of a core per replica
    metrics_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    # consecutive timed-out probes before a replica is marked unhealthy (a refused connection
    # or a non-200 answer marks it at once): an engine whose API server is busy tokenizing a
    # burst of long prompts answers late, it is not down
    health_failures: int = 3
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0  # longest upstream silence, incl. the first byte (prefill)
    # a call whose replica sent no response head by then is moved to another replica (0: off)
    first_byte_timeout_s: float = 30.0
    # the same for non-streamed calls, whose head follows the whole generation (vLLM answers
    # a non-streamed call when it is done): off by default, since any fixed deadline cuts —
    # and re-runs elsewhere — every generation longer than it (a 100k-token prompt with a
    # few hundred output tokens takes tens of seconds); set it above the longest one you
    # serve (None: first_byte_timeout_s; 0: off)
    unstreamed_first_byte_timeout_s: float | None = 0.0
    stream_idle_timeout_s: float = 60.0  # silence after a stream's first chunk (0: off)
    header_timeout_s: float = 10.0  # a client's request head must be complete by then
    idle_timeout_s: float = 75.0  # a client connection with no request in progress
    client_body_timeout_s: float = 30.0  # a client must finish sending its body by then
    # a client that reads nothing of a streamed answer for this long (one write blocked by
    # backpressure) is cut, and the upstream call closed (0: off)
    send_timeout_s: float = 30.0
    max_body_bytes: int = 32 << 20
    max_header_bytes: int = 8190
    max_connections: int = 1024  # upstream connections in all
    max_connections_per_replica: int = 256
    # a call waits at most this long for an upstream connection when one of the two limits
    # above is reached, then gets a 503 naming the limit (the replica is not blamed; 0: no
    # bound). first_byte_timeout_s starts once the request is sent, after this wait.
    pool_timeout_s: float = 60.0
    retries: int = 2  # extra replicas tried before the first byte
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0
    drain_timeout_s: float = 30.0
    workers: int = 1  # processes serving one port (SO_REUSEPORT); see docs/router.md
    upstream_api_key: str | None = None
    admin_key: str | None = None
    api_keys: dict[str, str] = field(default_factory=dict)  # client key -> tenant
    prefix_chars: int = 4096  # fallback session identity: leading prompt characters
    engine_hints: bool = False  # send retention hints to replicas (router.hints, docs/engine.md)
    # session-level call priority sent to replicas as X-Vllm-Priority (router.priority):
    # off | session. Off by default: it only acts on engines started with
    # --scheduling-policy priority (the kvroute engine preset), and vLLM documents a non-zero
    # priority as an error on engines without that policy
    priority: str = "off"
    priority_unit_tokens: float = 4096.0  # attained service of one level doubling
    priority_max_level: int = 8
    priority_level_s: float = 2.0  # aging: seconds per level (bound: levels x this)
    # admission at the router (router.admission): while every replica is full, calls wait
    # in the router in priority order (bounded), then 503/429 with Retry-After. off | on
    admission: str = "off"
    admission_max_waiting: float = 8.0  # vLLM waiting requests that make a replica full
    admission_max_kv_usage: float = 0.98  # ... or this KV cache usage
    admission_timeout_s: float = 30.0  # longest wait in the router
    admission_max_queued: int = 1024  # waiters at most
    log_level: str = "info"
    # append one JSON line per placement here (router.decisionlog; with workers, one file each)
    decision_log: str | None = None
    # a watchdog thread logs what the event loop ran when a tick of the loop-lag probe fires
    # more than this late (router.loopwatch; 0: off)
    loop_stall_log_ms: float = 0.0
    # P/D disaggregation (replicas with ``#role=prefill|decode``; router.disagg): ``auto``
    # prices each call split against colocated (costmodel.disagg), ``always`` splits every
    # chat/completions call, ``never`` runs each on one decode-side replica
    pd_mode: str = "auto"
    pd_min_prompt_tokens: int = 512  # uncached prompts shorter than this run colocated

    def __repr__(self) -> str:
        parts = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in SECRET_FIELDS and v:
                v = "***"
            elif f.name == "redis_url" and v:
                v = mask_url_password(v)
            elif f.name == "k8s_api_url" and v:
                v = strip_url_credentials(v)
            elif f.name in ("replicas", "replica_dns"):
                v = [strip_url_credentials(u) for u in v]
            parts.append(f"{f.name}={v!r}")
        return f"RouterConfig({', '.join(parts)})"

    def first_byte_deadline_s(self, streamed: bool) -> float:
        """Seconds a call may wait for its response head before it moves (0: no deadline)."""
        if streamed or self.unstreamed_first_byte_timeout_s is None:
            return self.first_byte_timeout_s
        return self.unstreamed_first_byte_timeout_s

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    def validate(self) -> None:
        if not (self.replicas or self.replica_dns or self.k8s_service):
            raise ConfigError("no replicas: give --replica URL, --replica-dns URL or --k8s-service")
        for u in [*self.replicas, *self.replica_dns]:
            if not u.startswith(("http://", "https://")):
                raise ConfigError("replica URL must start with http:// or https://: "
                                  f"{redacted(u)!r}")  # fmt: skip
            try:
                u, _role = split_role(u)  # ``URL#role=prefill|decode|both`` (P/D)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            problem = url_problem(u)
            if problem is None and urlsplit(u).query:
                problem = f"{mask_url_password(u)!r} has a query; a replica's base URL has none"
            if problem is not None:
                raise ConfigError(f"replica URL {problem}")
        for name in ("redis_url", "k8s_api_url"):
            u = getattr(self, name)
            problem = None if not u else url_problem(u)
            if problem is not None and not (name == "redis_url" and u.startswith("unix:")):
                raise ConfigError(f"{name} {problem}")
        if self.workers < 1:
            raise ConfigError("workers >= 1")
        if self.max_body_bytes <= 0 or self.retries < 0 or self.breaker_failures < 1:
            raise ConfigError("max_body_bytes > 0, retries >= 0 and breaker_failures >= 1")
        if self.pool_timeout_s < 0:
            raise ConfigError("pool_timeout_s >= 0 (0: no bound)")
        if self.pd_mode not in ("auto", "always", "never") or self.pd_min_prompt_tokens < 0:
            raise ConfigError("pd_mode: auto, always or never; pd_min_prompt_tokens >= 0")
        if self.loop_stall_log_ms < 0:
            raise ConfigError("loop_stall_log_ms >= 0 (0: off)")
        if not self.metrics_interval_s >= MIN_METRICS_INTERVAL_S:
            raise ConfigError(f"metrics_interval_s >= {MIN_METRICS_INTERVAL_S:g} (seconds)")
        if not self.health_interval_s > 0:
            raise ConfigError("health_interval_s > 0 (seconds)")
        if self.priority not in PRIORITY_MODES:
            raise ConfigError(f"priority must be one of {', '.join(PRIORITY_MODES)}, "
                              f"not {self.priority!r}")  # fmt: skip
        if self.admission not in ("off", "on"):
            raise ConfigError(f"admission must be off or on, not {self.admission!r}")
        try:
            self.priority_config()
            self.admission_limits()
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def admission_limits(self) -> AdmissionLimits:
        return AdmissionLimits(self.admission_max_waiting, self.admission_max_kv_usage,
                               self.admission_timeout_s, self.admission_max_queued)  # fmt: skip

    def priority_config(self) -> PriorityConfig:
        return PriorityConfig(unit_tokens=self.priority_unit_tokens,
                              max_level=self.priority_max_level,
                              level_s=self.priority_level_s)  # fmt: skip


_FIELDS = {f.name: f for f in dataclasses.fields(RouterConfig)}


def _coerce(name: str, value: Any) -> Any:
    """Turn a YAML/env/flag value into the field's type; clear error otherwise."""
    f = _FIELDS[name]
    t = str(f.type)
    try:
        if name == "kv":  # a mapping (typed by KVConfig.merged in load_config)
            if isinstance(value, str):
                value = yaml.safe_load(value)
            if value is not None and not isinstance(value, (dict, KVConfig)):
                raise TypeError("expected a mapping")
            return value
        if t.startswith("list"):
            if isinstance(value, str):
                return [v for v in (s.strip() for s in value.split(",")) if v]
            return [str(v) for v in value]
        if t.startswith("dict"):
            if name == "api_keys":
                return _parse_api_keys(value)
            if isinstance(value, str):
                value = yaml.safe_load(value)
            if value is not None and not isinstance(value, dict):
                raise TypeError("expected a mapping")
            return value
        if value is None:
            return None
        if t.startswith("int"):
            return int(value)
        if t.startswith("float"):
            return float(value)
        if t.startswith("bool"):  # "false" from a flag or env var is False, not a truthy str
            flag = str(value).strip().lower()
            if flag not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError("expected true or false")
            return flag in ("1", "true", "yes", "on")
        return str(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config {name}: cannot use {value!r}: {e}") from None


def _parse_api_keys(value: Any) -> dict[str, str]:
    """``{key: tenant}``, or ``"key[:tenant],..."`` / a list of such strings."""
    if isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()}
    items = value.split(",") if isinstance(value, str) else list(value)
    out: dict[str, str] = {}
    for item in items:
        item = str(item).strip()
        if not item:
            continue
        key, _, tenant = item.partition(":")
        out[key] = tenant or _tenant_of_key(key)
    return out


def _tenant_of_key(key: str) -> str:
    import hashlib

    return "k-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def load_config(
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> RouterConfig:
    """Defaults < YAML ``file`` < ``KVROUTE_*`` env < ``overrides`` (flags; None = unset)."""
    values: dict[str, Any] = {}
    if file:
        try:
            data = yaml.safe_load(Path(file).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read config file {file}: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {file} must hold a mapping")
        unknown = set(data) - set(_FIELDS)
        if unknown:
            raise ConfigError(f"unknown config keys in {file}: {sorted(unknown)}")
        values.update({k: _coerce(k, v) for k, v in data.items()})
    envmap: Mapping[str, str] = os.environ if env is None else env
    for name in _FIELDS:
        raw = envmap.get("KVROUTE_" + name.upper())
        if raw is not None:
            values[name] = _coerce(name, raw)
    for name, v in (overrides or {}).items():
        if v is None or (isinstance(v, list) and not v):
            continue
        values[name] = _coerce(name, v)
    try:
        kv = values.get("kv")
        if not isinstance(kv, KVConfig):
            values["kv"] = KVConfig.merged(kv, envmap)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config kv: {e}") from None
    cfg = RouterConfig(**values)
    cfg.validate()
    return cfg
