"""The typed keys of the router's aiohttp application, and its service-level runtime state.

Owns: every ``web.AppKey`` (no module singletons) and :class:`Runtime` (drain flag, in-flight
count). :mod:`router.app` fills them, :mod:`router.api` and :mod:`router.proxy` read them; this
module imports none of those, so the three never import each other in a loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from router.admission import AdmissionGate
from router.call import CallSequence
from router.config import RouterConfig
from router.kv.autoconf import LayerStatus
from router.metrics import RouterMetrics
from router.monitor import ReplicaMonitor
from router.priority import PriorityConfig
from router.replicas import ReplicaSet
from router.responses import ResponseOwners
from router.scheduling.pipeline import Pipeline
from router.state import SessionStore
from router.upstream import Upstream

if TYPE_CHECKING:  # typing only: the KV layer (and its tokenizer stack) loads only when installed
    from router.kv.state import KVState


@dataclass
class Runtime:
    """Mutable service-level state: drain flag and the in-flight count it waits on."""

    draining: bool = False
    inflight: int = 0
    worker: int = 0  # this process's index under ``kvroute serve --workers N``
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def enter(self) -> None:
        self.inflight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()


CONFIG = web.AppKey("config", RouterConfig)
METRICS = web.AppKey("metrics", RouterMetrics)
REPLICAS = web.AppKey("replicas", ReplicaSet)
MONITOR = web.AppKey("monitor", ReplicaMonitor)
STORE = web.AppKey("store", SessionStore)
PIPELINE = web.AppKey("pipeline", Pipeline)
CALLS = web.AppKey("calls", CallSequence)
CLIENT = web.AppKey("client", aiohttp.ClientSession)  # probes, https replicas
UPSTREAM = web.AppKey("upstream", Upstream)  # proxied calls
RUNTIME = web.AppKey("runtime", Runtime)
RESPONSES = web.AppKey("responses", ResponseOwners)  # Responses API id -> its replica
PRIORITY = web.AppKey("priority", PriorityConfig)  # the priority rule's constants
ADMISSION = web.AppKey[AdmissionGate | None]("admission")  # a gate under admission: on, else None
KV: web.AppKey[KVState | None] = web.AppKey("kv")  # the KV layer, when installed
# how fully the KV layer runs (/ready, /metrics, logs)
KV_STATUS = web.AppKey[Callable[[], LayerStatus]]("kv_status")
