"""The replica monitor: health checks, model lists and ``/metrics`` scrapes, each a plain
loop started by the app's cleanup context, with discovery's loops beside them.

Owns: :class:`ReplicaMonitor` (``GET /health`` and ``GET /v1/models`` per replica, with
``health_failures`` timeouts in a row before a slow replica counts as down; ``GET /metrics``
at a fixed rate, :func:`next_scrape_at`, parsed by :mod:`router.vllm.metrics`), its
:class:`router.discovery.ReplicaDiscovery` and :func:`cancel_all`. One slow replica never blocks
another (every probe has its own timeout). Must not import scheduling, handlers, torch or vllm.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import aiohttp
import orjson

from router.discovery import ReplicaDiscovery
from router.kv.autoconf import CACHE_INFO, cache_config_labels
from router.replicas import Replica, ReplicaSet
from router.vllm.metrics import by_source, parse_vllm_metrics

log = logging.getLogger("kvroute.monitor")


def next_scrape_at(due: float, now: float, interval: float) -> float:
    """When the next ``/metrics`` round starts, given when the last one was due and the time
    now (after it): one interval after it was due, or — when the round ran past that — one
    interval from now (missed rounds are skipped, never run back to back)."""
    nxt = due + interval
    return nxt if nxt >= now else now + interval


class ReplicaMonitor:
    """Health checks, model lists, metrics scrapes and discovery loops for one ReplicaSet."""

    def __init__(self, replicas: ReplicaSet, session: aiohttp.ClientSession, cfg: Any):
        self.replicas = replicas
        self.session = session
        self.cfg = cfg
        self.health_rounds = 0
        self._probe_timeout = aiohttp.ClientTimeout(total=cfg.health_timeout_s)
        self._headers = (
            {"Authorization": f"Bearer {cfg.upstream_api_key}"} if cfg.upstream_api_key else {}
        )
        self.discovery = ReplicaDiscovery(replicas, session, cfg, self.check_one)

    def headers_for(self, r: Replica) -> dict[str, str]:
        """Probe headers: the replica's own URL credentials, else the upstream key."""
        return {"Authorization": r.auth} if r.auth else self._headers

    async def check_one(self, r: Replica) -> None:
        hdrs = self.headers_for(r)
        try:
            async with self.session.get(
                r.url + "/health", timeout=self._probe_timeout, headers=hdrs
            ) as resp:
                ok = resp.status == 200
                await resp.read()
            if ok:
                async with self.session.get(
                    r.url + "/v1/models", timeout=self._probe_timeout, headers=hdrs
                ) as resp:
                    if resp.status == 200:
                        doc = orjson.loads(await resp.read())
                        data = doc.get("data") if isinstance(doc, dict) else None
                        if not isinstance(data, list):
                            raise ValueError("/v1/models answered without a data list")
                        r.model_cards = [m for m in data if isinstance(m, dict) and "id" in m]
                        r.models = frozenset(str(m["id"]) for m in r.model_cards)
            if ok != r.healthy:
                log.warning("replica %s is now %s", r.name, "healthy" if ok else "unhealthy")
            r.healthy, r.last_error = ok, None if ok else "health check failed"
            r.health_strikes = 0
        except TimeoutError as e:
            # slow is not down: only health_failures timeouts in a row take it out
            r.health_strikes += 1
            limit = max(1, int(self.cfg.health_failures))
            if r.health_strikes < limit:
                log.info("replica %s: health check timed out (%d of %d)", r.name,
                         r.health_strikes, limit)  # fmt: skip
                return
            if r.healthy:
                log.warning("replica %s failed its health check %d times: %r", r.name,
                            r.health_strikes, e)  # fmt: skip
            r.healthy, r.last_error = False, f"health: {type(e).__name__}"
        except (aiohttp.ClientError, ValueError, OSError) as e:
            r.health_strikes = 0
            if r.healthy:
                log.warning("replica %s failed its health check: %r", r.name, e)
            r.healthy, r.last_error = False, f"health: {type(e).__name__}"

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check_one(r) for r in self.replicas))
        self.health_rounds += 1

    async def scrape_one(self, r: Replica) -> None:
        mark, sent = r.finished, time.monotonic()
        try:
            async with self.session.get(
                r.url + "/metrics", timeout=self._probe_timeout, headers=self.headers_for(r)
            ) as resp:
                if resp.status != 200:
                    return
                text = await resp.text()
        except (TimeoutError, aiohttp.ClientError, OSError, UnicodeDecodeError):
            return
        m = parse_vllm_metrics(text)
        r.running, r.waiting, r.kv_usage = m.get("running"), m.get("waiting"), m.get("kv_usage")
        r.host_occupancy, r.host_retained = m.get("host_occupancy"), m.get("host_retained")
        r.pending_prefill = m.get("pending_prefill")
        r.cached_by_source = by_source(m)
        r.finished_at_scrape, r.scraped_at = mark, sent
        if r.cache_config is None and CACHE_INFO in text:
            r.cache_config = cache_config_labels(text)

    async def health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            try:
                await self.check_all()
            except Exception:  # one odd replica answer must not stop health checks for good
                log.exception("health round failed; retrying next interval")

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape_one(r) for r in self.replicas if r.healthy))

    async def metrics_loop(self) -> None:
        """Scrape every healthy replica's ``/metrics`` at a fixed rate: a round starts every
        ``metrics_interval_s`` whatever the last one took (a 50 ms interval is 50 ms between
        reads, not 50 ms plus the round), and a round that overran starts the next one an
        interval after it ended (:func:`next_scrape_at`)."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            due = next_scrape_at(due, loop.time(), self.cfg.metrics_interval_s)
            await asyncio.sleep(max(0.0, due - loop.time()))
            try:
                await self.scrape_all()
            except Exception:
                log.exception("metrics round failed; retrying next interval")

    def tasks(self) -> list[asyncio.Task[None]]:
        """The health and scrape loops, and discovery's."""
        return [
            asyncio.create_task(self.health_loop(), name="kvroute-health"),
            asyncio.create_task(self.metrics_loop(), name="kvroute-metrics-scrape"),
            *self.discovery.tasks(),
        ]


async def cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
