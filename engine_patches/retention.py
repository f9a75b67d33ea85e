"""Agent-aware retention for the host tier: keep a paused agent's KV ahead of cold blocks.

Owns: ``AgentRetentionPolicy``, a vLLM ``CachePolicy`` for the CPU offloading manager
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
from collections.abc import Iterable
from typing import Any

# The pure rule lives in retention_rule (the replica twin's host tier uses it too); these names
# stay importable from here.
from engine_patches.retention_rule import (
    HOLDING,
    STATES,
    Hint,
    RetentionConfig,
    RetentionTable,
    parse_hint,
)

__all__ = ["HOLDING", "STATES", "Hint", "RetentionConfig", "RetentionTable", "parse_hint"]


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
            self._kvroute_cold_rank = 0
            self._kvroute_claims: dict[Any, str] = {}  # the last store miss's keys -> its session

        def configure(self, config: RetentionConfig) -> None:
            self.table.config = config

        def _hint(self, req_context: Any) -> Hint | None:
            return parse_hint(getattr(req_context, "kv_transfer_params", None))

        def touch(self, keys: Iterable[Any], req_context: Any) -> None:
            keys = list(keys)
            self.table.claim(keys, self._hint(req_context))
            super().touch(keys, req_context)

        def on_store_miss(self, keys: Iterable[Any], req_context: Any) -> None:
            # Called before the manager makes room and inserts, so the claim waits for
            # insert(): a store that fails leaves no owner behind, and the eviction that makes
            # room counts only chunks that are here. Not super(): vLLM's default forwards a
            # miss to touch(), which would claim now (for the LRU it does nothing else, the
            # keys being absent).
            hint = self._hint(req_context)
            self._kvroute_claims = dict.fromkeys(keys, hint.session) if hint is not None else {}

        def insert(self, key: Any, chunk: Any) -> None:
            super().insert(key, chunk)
            session = self._kvroute_claims.pop(key, None)
            if session is not None:
                self.table.assign((key,), session)

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
            # only chunks still here: an evicted key claimed would count against the share cap
            keys = [k for k in order_request_keys(key_groups, req_context) if k in self.chunks]
            self.table.claim(keys, hint)
            for key in self.table.finish(hint, time.monotonic()):
                self._make_cold(key)

        def _make_cold(self, key: Any) -> None:
            if key not in self.chunks:
                return
            self._kvroute_cold_rank -= 1
            # below every LRU rank: evicted first (0.32.0 ranks are ints, 0.33.0 int pairs)
            old = self._ranks.get(key)
            self._ranks[key] = (
                (self._kvroute_cold_rank, 0) if isinstance(old, tuple) else self._kvroute_cold_rank
            )
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
