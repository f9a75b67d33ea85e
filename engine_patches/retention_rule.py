"""The retention rule, pure: hints, the session table, and which sessions hold their KV now.

Owns: the hint format (:func:`parse_hint`), :class:`RetentionConfig` and
:class:`RetentionTable` — the bookkeeping behind ``AgentRetentionPolicy``
(:mod:`engine_patches.retention`, vLLM's host tier) and behind the replica twin's host tier
(:mod:`loadtest.twin.engine`), so both decide alike. No vLLM, no I/O, no clock of its own
(every call takes ``now`` in seconds of the caller's clock). Must not import ``router`` or
``loadtest``.

Hints. A request says what its session does *after* this call in the body field
``kv_transfer_params`` (vLLM hands that dict to the offloading manager's policy hooks)::

    "kv_transfer_params": {"kvroute": {"session": "s-42", "state": "tool-pause",
                                       "return_s": 30}}

``state``: ``running`` (default) | ``tool-pause`` | ``waiting-on-children`` | ``done``.

The rule (no pin: retention yields whenever it would block an eviction the engine needs):

* Tier chunks stored or reused by a request of session S belong to S (the last claimant).
* While S is ``tool-pause`` / ``waiting-on-children`` and its hold has not expired, its chunks
  are held: an eviction of ``n`` chunks skips them; if the chunks not held cannot give ``n``,
  the eviction runs as plain LRU.
* A hold lasts ``min(return_s * return_slack, ttl_s)`` from the hinting request's end
  (``ttl_s`` when no ``return_s``): never past the TTL.
* Held chunks never exceed ``max_share`` of the tier; beyond it the sessions that paused
  earliest lose protection first.
* ``done`` releases S: :meth:`RetentionTable.finish` returns its chunks, which the tier moves
  to the cold end of its LRU order (evicted first). ``running`` ends the hold.
"""

from __future__ import annotations

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
    if not kv_transfer_params or not isinstance(kv_transfer_params, Mapping):
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

    def __post_init__(self) -> None:
        if self.ttl_s < 0 or self.return_slack < 0:
            raise ValueError("retention ttl_s and return_slack must be >= 0")
        if not 0.0 <= self.max_share <= 1.0:
            raise ValueError("retention max_share must be within [0, 1]")

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
    until: float = 0.0  # hold expiry (caller's clock, s); 0: no hold
    since: float = 0.0  # when the hold started
    # in the order first claimed (a request claims head to tail): ``done`` releases them so
    keys: dict[Hashable, None] = field(default_factory=dict)


class RetentionTable:
    """Which chunks belong to which session and which sessions hold theirs now (pure)."""

    def __init__(self, config: RetentionConfig, capacity: int):
        self.config = config
        self.capacity = capacity
        self._sessions: dict[str, _Session] = {}
        self._owner: dict[Hashable, str] = {}
        self._holding: set[str] = set()  # sessions whose state holds (expired or not)

    def claim(self, keys: Iterable[Hashable], hint: Hint | None) -> None:
        """``keys`` now belong to the hint's session (no hint: nothing changes)."""
        if hint is not None:
            self.assign(keys, hint.session)

    def assign(self, keys: Iterable[Hashable], session: str) -> None:
        s = self._sessions.get(session)
        if s is None:
            s = self._sessions[session] = _Session()
        owner, sessions = self._owner, self._sessions
        for k in keys:
            old = owner.get(k)
            if old is not None and old != session:
                sessions[old].keys.pop(k, None)
            owner[k] = session
            s.keys[k] = None

    def owner(self, key: Hashable) -> str | None:
        return self._owner.get(key)

    def finish(self, hint: Hint | None, now: float) -> list[Hashable]:
        """Apply a finished request's hint; returns the keys it releases (``done``), in the
        order they were first claimed — head to tail — so a tier that sends each below the
        last evicts the tail first, as it would for any finished request."""
        if hint is None:
            return []
        s = self._sessions.setdefault(hint.session, _Session())
        s.state = hint.state
        if hint.state in HOLDING:
            c = self.config
            hold = c.ttl_s if hint.return_s is None else hint.return_s * c.return_slack
            s.since, s.until = now, now + min(hold, c.ttl_s)
            self._holding.add(hint.session)
            return []
        s.until = 0.0
        self._holding.discard(hint.session)
        if hint.state == "done":
            released = list(s.keys)
            for k in released:
                self._owner.pop(k, None)
            del self._sessions[hint.session]
            return released
        return []

    def forget(self, keys: Iterable[Hashable]) -> None:
        for k in keys:
            owner = self._owner.pop(k, None)
            if owner is not None and owner in self._sessions:
                self._sessions[owner].keys.pop(k, None)

    def held(self, now: float) -> dict[str, int]:
        """Sessions holding now -> their chunk count: newest hold first, within
        ``max_share`` of the capacity (a session that would overflow it is skipped)."""
        cap = int(self.config.max_share * self.capacity)
        live: list[tuple[float, str, int]] = []
        for name in list(self._holding):
            s = self._sessions.get(name)
            if s is None or s.state not in HOLDING:
                self._holding.discard(name)
                continue
            if s.until <= now:
                self._holding.discard(name)  # expired: holds only start again on a finish
                continue
            if s.keys:
                live.append((s.since, name, len(s.keys)))
        live.sort(key=lambda x: x[0], reverse=True)
        out: dict[str, int] = {}
        total = 0
        for _since, name, n in live:
            if total + n > cap:
                continue
            out[name] = n
            total += n
        return out

    def protected(self, now: float) -> set[Hashable]:
        """Keys held now (the union of :meth:`held` sessions' chunks)."""
        out: set[Hashable] = set()
        for name in self.held(now):
            out.update(self._sessions[name].keys)
        return out

    def held_sessions(self, now: float) -> dict[str, int]:
        """session -> chunks held now (for logs and metrics)."""
        return self.held(now)
