"""Session table: the record, the store interface and the in-process store.

Owns: :class:`SessionRecord` (owner replica, lineage, per-session timing), the
:class:`SessionStore` interface and :class:`MemoryStore` — an ordered dict with TTL (refreshed
on every call) and a size cap. The Redis-backed store (active-active across routers, bindings
kept through Redis outages) and :func:`router.redis_store.make_store` are in
:mod:`router.redis_store`. Policies never see a store, only the :class:`SessionRecord` copy
handed to them in the scheduling snapshot. Must not import aiohttp handlers, scheduling,
redis or vllm.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from router.priority import ROLE_BURST, ROLE_JOIN, ROLE_PLAIN
from router.sessions import SessionIdentity

log = logging.getLogger("kvroute.state")
MAX_GAPS = 32
RECONCILE_BATCH = 256  # sessions written back per round trip when Redis returns
MAX_DEPTH = 16  # subagent nesting followed to find a session's root


@dataclass
class SessionRecord:
    key: str
    tenant: str
    parent: str | None = None
    agent: str | None = None
    replica: str | None = None  # the replica that holds (or last held) its KV
    created: float = 0.0
    last_seen: float = 0.0  # start of the latest call (wall clock)
    last_call_end: float | None = None
    gaps: list[float] = field(default_factory=list)  # idle time between calls (s), newest last
    calls: int = 0
    inflight: int = 0  # this router's calls in flight for the session
    final: bool = False
    children: set[str] = field(default_factory=set)
    # tokens served to this session and its subagents (prompt tokens computed + tokens
    # decoded; router.priority's attained service), this router's share
    service: int = 0

    def copy(self) -> SessionRecord:
        # field by field: dataclasses.replace re-runs __init__ through its generic path
        # (~3x the cost, once per call on the hot path); test_router_parts pins the fields
        return SessionRecord(
            self.key, self.tenant, self.parent, self.agent, self.replica, self.created,
            self.last_seen, self.last_call_end, list(self.gaps), self.calls, self.inflight,
            self.final, set(self.children), self.service,
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["children"] = sorted(self.children)
        return d


class SessionStore(Protocol):
    backend: str

    async def begin_call(self, ident: SessionIdentity, now: float) -> SessionRecord: ...
    async def claim(self, key: str, replica: str) -> str: ...
    async def assign(self, key: str, replica: str) -> None: ...
    async def end_call(self, key: str, now: float) -> None: ...
    async def get(self, key: str) -> SessionRecord | None: ...
    def add_service(self, key: str, tokens: int) -> None: ...
    def priority_inputs(self, key: str) -> tuple[int, str]: ...
    def active_count(self) -> int: ...
    def list(self, limit: int = 100) -> list[SessionRecord]: ...
    @property
    def up(self) -> bool: ...
    async def run(self) -> None: ...
    async def close(self) -> None: ...


class MemoryStore:
    """In-process session table with TTL and a size cap (oldest evicted first)."""

    backend = "memory"

    def __init__(self, ttl_s: float = 3600.0, max_sessions: int = 1_000_000):
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._d: OrderedDict[str, SessionRecord] = OrderedDict()

    @property
    def up(self) -> bool:
        return True

    def _live(self, key: str, now: float | None = None) -> SessionRecord | None:
        rec = self._d.get(key)
        if rec is None:
            return None
        now = time.time() if now is None else now
        if now - max(rec.last_seen, rec.last_call_end or 0.0) > self.ttl_s and rec.inflight == 0:
            del self._d[key]
            return None
        return rec

    def touch(self, ident: SessionIdentity, now: float) -> SessionRecord:
        rec = self._live(ident.key, now)
        if rec is None:
            rec = SessionRecord(ident.key, ident.tenant, ident.parent, ident.agent, created=now)
            self._d[ident.key] = rec
            while len(self._d) > self.max_sessions:
                self._d.popitem(last=False)
        else:
            self._d.move_to_end(ident.key)
        if rec.last_call_end is not None and rec.inflight == 0:
            rec.gaps.append(max(0.0, now - rec.last_call_end))
            del rec.gaps[:-MAX_GAPS]
        rec.last_seen = now
        rec.calls += 1
        rec.inflight += 1
        rec.final = rec.final or ident.final
        if ident.parent and rec.parent is None:
            rec.parent = ident.parent
        if rec.parent:
            parent = self._live(rec.parent, now)
            if parent is None:
                parent = SessionRecord(rec.parent, ident.tenant, created=now, last_seen=now)
                self._d[rec.parent] = parent
            parent.children.add(rec.key)
        return rec

    async def begin_call(self, ident: SessionIdentity, now: float) -> SessionRecord:
        return self.touch(ident, now).copy()

    async def claim(self, key: str, replica: str) -> str:
        rec = self._d.get(key)
        if rec is None:
            return replica
        if rec.replica is None:
            rec.replica = replica
        return rec.replica

    async def assign(self, key: str, replica: str) -> None:
        rec = self._d.get(key)
        if rec is not None:
            rec.replica = replica

    def finish(self, key: str, now: float) -> SessionRecord | None:
        rec = self._d.get(key)
        if rec is not None:
            rec.inflight = max(0, rec.inflight - 1)
            rec.last_call_end = now
        return rec

    async def end_call(self, key: str, now: float) -> None:
        self.finish(key, now)

    async def get(self, key: str) -> SessionRecord | None:
        rec = self._live(key)
        return None if rec is None else rec.copy()

    def _ancestors(self, rec: SessionRecord) -> list[SessionRecord]:
        """``rec``'s parent, grandparent, ... up to its root (cycle-safe, bounded)."""
        out: list[SessionRecord] = []
        seen = {rec.key}
        while rec.parent and rec.parent not in seen and len(out) < MAX_DEPTH:
            parent = self._d.get(rec.parent)
            if parent is None:
                break
            seen.add(parent.key)
            out.append(parent)
            rec = parent
        return out

    def add_service(self, key: str, tokens: int) -> None:
        """Count ``tokens`` served to session ``key``, on it and on each of its ancestors
        (a root's ``service`` is its whole tree's)."""
        rec = self._d.get(key)
        if rec is None or tokens <= 0:
            return
        for r in (rec, *self._ancestors(rec)):
            r.service += tokens

    def priority_inputs(self, key: str) -> tuple[int, str]:
        """``(attained service of the session's root, role)`` of a call of ``key`` that has
        begun (:func:`router.priority.call_priority`'s inputs). Roles: ``join`` — the session
        has subagents, none in flight, and one ended after the session's own last call (the
        parent resumes); ``burst`` — a subagent while >= 2 of its parent's subagents are in
        flight (itself included); else ``plain``."""
        rec = self._d.get(key)
        if rec is None:
            return 0, ROLE_PLAIN
        chain = self._ancestors(rec)
        service = (chain[-1] if chain else rec).service
        role = ROLE_PLAIN
        if rec.children:
            kids = [k for c in rec.children if (k := self._d.get(c)) is not None]
            if kids and not any(k.inflight for k in kids):
                ended = max((k.last_call_end or 0.0) for k in kids)
                if ended > (rec.last_call_end if rec.last_call_end is not None else rec.created):
                    role = ROLE_JOIN
        if role == ROLE_PLAIN and chain:
            siblings = (self._d.get(c) for c in chain[0].children)
            if sum(1 for k in siblings if k is not None and k.inflight) >= 2:
                role = ROLE_BURST
        return service, role

    def sweep(self, now: float | None = None) -> int:
        now = time.time() if now is None else now
        dead = [k for k in list(self._d) if self._live(k, now) is None]
        return len(dead)

    def active_count(self) -> int:
        return len(self._d)

    def list(self, limit: int = 100) -> list[SessionRecord]:
        return [r.copy() for r in list(reversed(self._d.values()))[:limit]]

    def merge_remote(self, key: str, remote: dict[str, Any]) -> None:
        rec = self._d.get(key)
        if rec is None:
            return
        if remote.get("replica"):
            rec.replica = remote["replica"]
        end = remote.get("last_call_end")
        if end is not None and (rec.last_call_end is None or end > rec.last_call_end):
            rec.last_call_end = end
        rec.calls = max(rec.calls, int(remote.get("calls", 0)))
        rec.created = min(rec.created, float(remote.get("created", rec.created)))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(min(60.0, self.ttl_s / 4))
            self.sweep()

    async def close(self) -> None:
        return None
