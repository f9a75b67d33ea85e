"""Admission at the router: when every replica is past its queue or KV limit, calls wait here.

Owns: :class:`AdmissionGate` (the waiters, in priority order) and the rule for a full replica
(:func:`is_full`). No aiohttp; the replica figures arrive as
:class:`router.replicas.EndpointView` (vLLM's ``num_requests_waiting`` and
``kv_cache_usage_perc``, as the router last scraped them).

A replica is *full* when it is unhealthy or not accepting (breaker), when vLLM's waiting
queue holds ``max_waiting`` requests or more, or its KV cache is ``max_kv_usage`` used or
more. While every healthy replica is full, a call is not pushed onto one (where it would
queue behind everything and, admitted, evict a paused session's KV): it waits in the router,
in the order of its key — the session-level priority (:mod:`router.priority`) under
``priority: session``, else its arrival — and is released when a replica has room again (a
call ends, or the next scrape shows room: at most one waiter per replica with room per
release, since the figures are a scrape old). The wait is bounded: past ``timeout_s`` the
call is answered 503 with ``Retry-After``; with ``max_queued`` calls already waiting, a new
one is answered 429 at once. A call never waits when no replica is healthy (scheduling
answers that) or when nobody waits and some replica has room.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.replicas import EndpointView


@dataclass(frozen=True)
class AdmissionLimits:
    max_waiting: float = 8.0  # vLLM waiting requests that make a replica full
    max_kv_usage: float = 0.98  # KV cache usage that makes a replica full
    timeout_s: float = 30.0  # longest wait in the router, then 503 + Retry-After
    max_queued: int = 1024  # waiters at most, then 429 + Retry-After

    def __post_init__(self) -> None:
        if self.max_waiting <= 0 or not 0 < self.max_kv_usage <= 1:
            raise ValueError("admission max_waiting must be > 0 and max_kv_usage in (0, 1]")
        if self.timeout_s <= 0 or self.max_queued < 1:
            raise ValueError("admission timeout_s must be > 0 and max_queued >= 1")


class AdmissionRefused(Exception):
    """The call is not admitted: ``status`` 503 (waited ``timeout_s``) or 429 (queue full)."""

    def __init__(self, status: int, message: str, retry_after_s: float):
        super().__init__(message)
        self.status, self.message, self.retry_after_s = status, message, retry_after_s


def is_full(v: EndpointView, lim: AdmissionLimits) -> bool:
    """Whether replica ``v`` takes no more calls now (see the module docstring)."""
    if not v.healthy or not v.accepting:
        return True
    if v.waiting is not None and v.waiting >= lim.max_waiting:
        return True
    return v.kv_usage is not None and v.kv_usage >= lim.max_kv_usage


class AdmissionGate:
    """The router's waiting room (see the module docstring)."""

    def __init__(self, limits: AdmissionLimits, views: Callable[[], Sequence[EndpointView]]):
        self.limits = limits
        self._views = views
        self._heap: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self.waiting = 0  # live waiters (the heap may hold ones that gave up)

    def _room(self) -> int | None:
        """Replicas with room now; None when no replica is healthy (not the gate's case)."""
        views = [v for v in self._views() if v.healthy]
        if not views:
            return None
        return sum(1 for v in views if not is_full(v, self.limits))

    async def admit(self, key: int) -> float:
        """Return when the call may go on (the seconds it waited); raise
        :class:`AdmissionRefused` past the bound. ``key``: lower goes first."""
        room = self._room()
        if room is None or (room > 0 and self.waiting == 0):
            return 0.0
        lim = self.limits
        if self.waiting >= lim.max_queued:
            raise AdmissionRefused(429, "every replica is full and the router's queue is full",
                                   lim.timeout_s)  # fmt: skip
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (key, next(self._seq), fut))
        self.waiting += 1
        t0 = time.monotonic()
        self.pump()  # room already (behind earlier waiters): the best waiter goes now
        try:
            await asyncio.wait_for(fut, lim.timeout_s)
        except TimeoutError:
            raise AdmissionRefused(
                503, f"every replica is full; waited {lim.timeout_s:g} s in the router",
                lim.timeout_s,
            ) from None  # fmt: skip
        finally:
            if not fut.done() or fut.cancelled():
                self.waiting -= 1  # gave up (timeout, client gone): pump skips it
        return time.monotonic() - t0

    def pump(self) -> int:
        """Release waiters in key order, one per replica with room; returns how many."""
        room = self._room()
        if room is None:  # no healthy replica: let them go on to scheduling's answer
            room = len(self._heap)
        n = 0
        while self._heap and n < room:
            _, _, fut = heapq.heappop(self._heap)
            if fut.done():
                continue
            fut.set_result(None)
            self.waiting -= 1
            n += 1
        return n

    def observe(self, ctx: object, outcome: object) -> None:
        """A call observer: a call ended, so a replica may have room."""
        self.pump()

    async def run(self, tick_s: float) -> None:
        """Release waiters as scrapes show room (every ``tick_s``)."""
        while True:
            await asyncio.sleep(tick_s)
            self.pump()


def retry_after(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))
