"""Replica membership of the KV layer: :class:`Membership`, the part of
:class:`router.kv.state.KVState` that follows a :class:`router.replicas.ReplicaSet`.

A replica that discovery removes and that stays absent for ``forget_after_s`` (checked on each
view, membership change and sweep) is forgotten everywhere in the layer — index, approximate
cache, event streams (its events are ignored from then on), load stats, calibration, and
sessions' homes on it; one that is back before then (a readiness blip) keeps all of it. One
that (re-)appears after being forgotten is expected by the subscriber again (with its
``replay`` endpoint from the config) but gets no index entry until its first event batch
arrives. Must not import aiohttp, the proxy, torch or vllm.
"""

from __future__ import annotations

import logging
from typing import Any

from costmodel.calibration import Calibrator
from costmodel.profiles import ReplicaProfile
from router.kv.approx import ApproxCache
from router.kv.autoconf import events_endpoint
from router.kv.churn import TierChurn
from router.kv.config import KVConfig
from router.kv.index import BlockIndex
from router.kv.sessions import ReplicaStat, SessionFootprint

log = logging.getLogger("kvroute.kv")

MAX_GONE = 1024  # removed replicas remembered (late call outcomes there are not recorded)


class Membership:
    """Replica membership (a mixin of :class:`router.kv.state.KVState`, whose ``__init__`` sets
    the attributes declared here)."""

    cfg: KVConfig
    clock: Any
    subscriber: Any
    index: BlockIndex
    approx: ApproxCache
    text_approx: ApproxCache
    routed: dict[str, tuple[str, list[int], float]]
    stats: dict[str, ReplicaStat]
    host_churn: TierChurn
    calibrators: dict[str, Calibrator]
    sessions: dict[str, SessionFootprint]
    _profiles: dict[str, ReplicaProfile]
    _auto_events: set[str]
    _gone: dict[str, None]
    _leaving: dict[str, float]

    def watch(self, replicas: Any) -> None:
        """Follow ``replicas`` (a :class:`router.replicas.ReplicaSet`): its current members
        are expected from now on and every later change reaches :meth:`replicas_changed`."""
        replicas.add_listener(self.replicas_changed)
        self.replicas_changed(frozenset(r.name for r in replicas), frozenset())

    def replicas_changed(self, added: frozenset[str], removed: frozenset[str]) -> None:
        """A :class:`router.replicas.ReplicaSet` listener: removed replicas are forgotten once
        they have stayed away ``forget_after_s`` (at once when it is 0); (re-)added ones are
        expected again."""
        now = self.clock()
        for name in removed:
            self._leaving.setdefault(name, now)
        # first forget what has been away too long (an idle router may not have looked since),
        # so a replica that comes back after its grace starts over instead of keeping stale state
        self.expire_removed(now)
        for name in added:
            if self._leaving.pop(name, None) is not None:
                continue  # back before it was forgotten: everything about it still holds
            self._gone.pop(name, None)
            if self.subscriber is not None:  # no index entry: that waits for its events
                self.subscriber.expect_replica(name, self.cfg.replay.get(name))
                self._connect_events(name)

    def _connect_events(self, name: str) -> None:
        """With ``events_port``: subscribe to ``tcp://<name's host>:<events_port>`` (vLLM's
        publisher binds ``tcp://*:PORT``) unless ``events_connect`` names the replica. No
        index entry is made: a replica whose publisher never answers (events not enabled
        there) stays in approximate mode rather than looking empty."""
        port = self.cfg.events_port
        if port is None or name in self.cfg.events_connect or name in self._auto_events:
            return
        ep = events_endpoint(name, port)
        try:
            self.subscriber.connect(ep, name, self.cfg.replay.get(name), fresh=False)
        except Exception as e:  # a malformed address must not break discovery
            log.warning("kv events: cannot subscribe to %s for %s: %s", ep, name, e)
            return
        self._auto_events.add(name)
        log.info("kv events: subscribed to %s for %s", ep, name)

    def expire_removed(self, now: float | None = None) -> None:
        """Forget the replicas discovery removed at least ``forget_after_s`` ago."""
        if not self._leaving:
            return
        now = self.clock() if now is None else now
        for name in [n for n, t in self._leaving.items() if now - t >= self.cfg.forget_after_s]:
            del self._leaving[name]
            self.forget_replica(name)

    def forget_replica(self, name: str) -> None:
        """Drop everything known about ``name``: its blocks (index, approximate mode, the text
        routing history and the prompts in flight there), its event streams and replays in
        flight (its events are ignored until it is added again), load stats, calibration, and
        the home of every session that lived there."""
        if self.subscriber is not None:
            self.subscriber.remove_replica(name)
            if name in self._auto_events:
                self._auto_events.discard(name)
                self.subscriber.disconnect(name)
        self.index.remove_replica(name)
        self.approx.remove_replica(name)
        self.text_approx.remove_replica(name)
        for rid in [k for k, v in self.routed.items() if v[0] == name]:
            del self.routed[rid]
        self.stats.pop(name, None)
        self.host_churn.forget(name)
        self.calibrators.pop(name, None)
        self._profiles.pop(name, None)  # re-sets the approximate capacity if it comes back
        for fp in self.sessions.values():
            if fp.replica == name:
                fp.replica = None
        self._leaving.pop(name, None)
        self._gone.pop(name, None)  # to the end: the newest removal is kept longest
        self._gone[name] = None
        while len(self._gone) > MAX_GONE:
            del self._gone[next(iter(self._gone))]
