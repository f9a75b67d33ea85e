"""Agent-aware retention for the host tier: keep a paused agent's KV ahead of cold blocks.

Owns: the hint format (:func:`parse_hint`), the session table (:class:`RetentionTable`, pure)
and ``AgentRetentionPolicy``, a vLLM ``CachePolicy`` for the CPU offloading manager
(``eviction_policy: "AgentRetentionPolicy"``, ``cache_policy_module_path:
"engine_patches.retention"``; ``kvroute engine flags --retention`` writes both). The policy
class is built lazily, so this module imports without vLLM.

Hints. The offloading manager's hooks (``touch``, ``on_store_miss``, ``on_request_finished``,
``evict``) receive vLLM's per-request ``ReqContext``, which carries the request's
``kv_transfer_params``. So a request says what its session does *after* this call in the body
field ``kv_transfer_params`` (a dict; ``vllm_xargs`` values cannot be dicts)::

    "kv_transfer_params": {"kvroute": {"session": "s-42", "state": "tool-pause",
                                       "return_s": 30}}

``state``: ``running`` (default) | ``tool-pause`` | ``waiting-on-children`` | ``done``.

Rule (no pin: retention yields whenever it would block an eviction vLLM needs):

* Host chunks first stored or reused by a request of session S belong to S.
* While S is ``tool-pause`` / ``waiting-on-children`` and its hold has not expired, its chunks
  are protected from eviction: ``evict(n, protected)`` first tries with S's chunks added to
  ``protected``; if that cannot free ``n`` chunks it evicts as plain LRU.
* A hold lasts ``min(return_s * return_slack, ttl_s)`` from the hinting request's end
  (``ttl_s`` when no ``return_s``): never past the TTL.
* Protected chunks never exceed ``max_share`` of the tier; beyond it the sessions that paused
  earliest lose protection first.
* ``done`` releases S: its chunks move to the cold end of the LRU order (evicted first).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

STATES = ("running", "tool-pause", "waiting-on-children", "done")
HOLDING = ("tool-pause", "waiting-on-children")


@dataclass(frozen=True)
class Hint:
    session: str
    state: str = "running"
    return_s: float | None = None


def parse_hint(kv_transfer_params: Mapping[str, Any] | None) -> Hint | None:
    """The ``kvroute`` hint of a request, or None (absent or malformed: ignored, never fatal)."""
    if not kv_transfer_params:
        return None
    raw = kv_transfer_params.get("kvroute")
    if not isinstance(raw, Mapping) or not raw.get("session"):
        return None
    state = str(raw.get("state") or "running")
    if state not in STATES:
        return None
    ret = raw.get("return_s")
    try:
        ret_s = float(ret) if ret is not None else None
    except (TypeError, ValueError):
        ret_s = None
    return Hint(str(raw["session"]), state, ret_s)


@dataclass(frozen=True)
class RetentionConfig:
    ttl_s: float = 600.0
    max_share: float = 0.5  # of the tier's chunks
    return_slack: float = 1.5  # hold for return_s * slack (a late return still hits)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> RetentionConfig:
        d = dict(d or {})
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown retention settings: {sorted(unknown)}")
        return cls(**d)


@dataclass
class _Session:
    state: str = "running"
    until: float = 0.0  # hold expiry (monotonic s); 0: no hold
    since: float = 0.0  # when the hold started
    keys: set[Hashable] = field(default_factory=set)


class RetentionTable:
    """Which chunks belong to which session and which sessions hold theirs now (pure)."""

    def __init__(self, config: RetentionConfig, capacity: int):
        self.config = config
        self.capacity = capacity
        self._sessions: dict[str, _Session] = {}
        self._owner: dict[Hashable, str] = {}

    def claim(self, keys: Iterable[Hashable], hint: Hint | None) -> None:
        if hint is None:
            return
        s = self._sessions.setdefault(hint.session, _Session())
        for k in keys:
            old = self._owner.get(k)
            if old is not None and old != hint.session:
                self._sessions[old].keys.discard(k)
            self._owner[k] = hint.session
            s.keys.add(k)

    def finish(self, hint: Hint | None, now: float) -> set[Hashable]:
        """Apply a finished request's hint; returns the keys it releases (``done``)."""
        if hint is None:
            return set()
        s = self._sessions.setdefault(hint.session, _Session())
        s.state = hint.state
        if hint.state in HOLDING:
            c = self.config
            hold = c.ttl_s if hint.return_s is None else hint.return_s * c.return_slack
            s.since, s.until = now, now + min(hold, c.ttl_s)
            return set()
        s.until = 0.0
        if hint.state == "done":
            released = set(s.keys)
            for k in released:
                self._owner.pop(k, None)
            del self._sessions[hint.session]
            return released
        return set()

    def forget(self, keys: Iterable[Hashable]) -> None:
        for k in keys:
            owner = self._owner.pop(k, None)
            if owner is not None and owner in self._sessions:
                self._sessions[owner].keys.discard(k)

    def protected(self, now: float) -> set[Hashable]:
        """Keys held now: sessions holding, newest hold first, within ``max_share``."""
        cap = int(self.config.max_share * self.capacity)
        holding = [
            s for s in self._sessions.values() if s.state in HOLDING and s.until > now and s.keys
        ]
        holding.sort(key=lambda s: s.since, reverse=True)
        out: set[Hashable] = set()
        for s in holding:
            if len(out) + len(s.keys) > cap:
                continue
            out |= s.keys
        return out

    def held_sessions(self, now: float) -> dict[str, int]:
        """session -> chunks held now (for logs and metrics)."""
        prot = self.protected(now)
        return {name: len(s.keys & prot) for name, s in self._sessions.items() if s.keys & prot}


def _build(name: str) -> type:
    from engine_patches import versions

    versions.check()
    from vllm.v1.kv_offload.cpu.policies.base import order_request_keys
    from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

    class AgentRetentionPolicy(LRUCachePolicy):
        """vLLM's LRU host-tier policy plus the session holds of :class:`RetentionTable`."""

        def __init__(self, cache_capacity: int):
            super().__init__(cache_capacity)
            self.table = RetentionTable(RetentionConfig(), cache_capacity)
            self._cold_rank = 0

        def configure(self, config: RetentionConfig) -> None:
            self.table.config = config

        def _hint(self, req_context: Any) -> Hint | None:
            return parse_hint(getattr(req_context, "kv_transfer_params", None))

        def touch(self, keys: Iterable[Any], req_context: Any) -> None:
            keys = list(keys)
            self.table.claim(keys, self._hint(req_context))
            super().touch(keys, req_context)

        def on_store_miss(self, keys: Iterable[Any], req_context: Any) -> None:
            keys = list(keys)
            self.table.claim(keys, self._hint(req_context))
            super().on_store_miss(keys, req_context)

        def on_request_access(self, keys: Iterable[Any], req_context: Any) -> None:
            # vLLM 0.33.0 only: first accesses during a request
            keys = list(keys)
            self.table.claim(keys, self._hint(req_context))
            parent = getattr(super(), "on_request_access", None)
            if parent is not None:
                parent(keys, req_context)

        def on_request_finished(
            self, key_groups: Any, insertion_only_keys: Any, reused_keys: Any, req_context: Any
        ) -> None:
            super().on_request_finished(key_groups, insertion_only_keys, reused_keys, req_context)
            hint = self._hint(req_context)
            self.table.claim(order_request_keys(key_groups, req_context), hint)
            for key in self.table.finish(hint, time.monotonic()):
                self._make_cold(key)

        def _make_cold(self, key: Any) -> None:
            if key not in self.chunks:
                return
            self._cold_rank -= 1
            # below every LRU rank: evicted first (0.32.0 ranks are ints, 0.33.0 int pairs)
            old = self._ranks.get(key)
            self._ranks[key] = (self._cold_rank, 0) if isinstance(old, tuple) else self._cold_rank
            if key in self._evictable:
                self._push_evictable(key)

        def evict(self, n: int, protected: set[Any]) -> Any:
            keep = self.table.protected(time.monotonic())
            out = super().evict(n, protected | keep) if keep else None
            if out is None:  # retention yields: never block an eviction vLLM needs
                out = super().evict(n, protected)
            if out:
                self.table.forget(k for k, _ in out)
            return out

        def remove(self, key: Any) -> None:
            super().remove(key)
            self.table.forget([key])

        def clear(self) -> None:
            super().clear()
            self.table = RetentionTable(self.table.config, self.cache_capacity)

    AgentRetentionPolicy.__module__ = __name__
    return AgentRetentionPolicy


_built: dict[str, type] = {}


def __getattr__(name: str) -> type:
    if name == "AgentRetentionPolicy":
        if name not in _built:
            _built[name] = _build(name)
        return _built[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
