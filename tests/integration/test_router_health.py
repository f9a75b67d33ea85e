"""Health checks: a replica whose probes time out stays in until ``health_failures`` timeouts
in a row; one that refuses connections or answers non-200 is out at once; one success clears
the count."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from loadtest.vllmbed import free_port
from router.config import RouterConfig
from router.monitor import ReplicaMonitor
from router.replicas import ReplicaSet

pytestmark = pytest.mark.timeout(30)


@pytest.fixture()
async def slow_replica():
    state = {"delay": 0.0, "status": 200}

    async def health(_: web.Request) -> web.Response:
        await asyncio.sleep(state["delay"])
        return web.Response(status=state["status"])

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}", state
    await runner.cleanup()


async def test_timeouts_take_a_replica_out_only_after_health_failures_in_a_row(slow_replica):
    url, state = slow_replica
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens
    cfg = RouterConfig(replicas=[url, dead], health_timeout_s=0.2, health_failures=3)
    rs = ReplicaSet()
    rs.set_source("static", [url, dead])
    async with aiohttp.ClientSession() as http:
        mon = ReplicaMonitor(rs, http, cfg)
        slow, gone = rs.get(url), rs.get(dead)
        await mon.check_all()
        assert slow.healthy and not gone.healthy  # refused: out at the first probe
        state["delay"] = 0.5  # past the probe timeout
        for strike in (1, 2):
            await mon.check_all()
            assert slow.healthy and slow.health_strikes == strike
        state["delay"] = 0.0  # one answer in time clears the count
        await mon.check_all()
        assert slow.healthy and slow.health_strikes == 0
        state["delay"] = 0.5
        for _ in range(3):
            await mon.check_all()
        assert not slow.healthy and slow.last_error == "health: TimeoutError"
        state["delay"], state["status"] = 0.0, 200
        await mon.check_all()
        assert slow.healthy
        state["status"] = 503  # an engine that says it is not healthy: out at once
        await mon.check_all()
        assert not slow.healthy


async def test_the_load_scrape_runs_at_llm_d_s_50_ms():
    """``metrics_interval_s: 0.05``: the monitor reads each replica's queue 20 times a second
    (upstream llm-d's refresh), so a queue that changes is seen within a round or two. Counted
    by the replica, with a generous deadline (at the old 1 s the count would take 30 s)."""
    hits = {"n": 0}

    async def metrics(_: web.Request) -> web.Response:
        hits["n"] += 1
        return web.Response(text=f"vllm:num_requests_waiting {hits['n']}\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    cfg = RouterConfig(replicas=[url], metrics_interval_s=0.05)
    cfg.validate()
    rs = ReplicaSet()
    rs.set_source("static", [url])
    try:
        async with aiohttp.ClientSession() as http:
            mon = ReplicaMonitor(rs, http, cfg)
            task = asyncio.create_task(mon.metrics_loop())
            try:
                for _ in range(200):  # up to 10 s
                    if hits["n"] >= 30:
                        break
                    await asyncio.sleep(0.05)
            finally:
                task.cancel()
            assert hits["n"] >= 30
            assert rs.get(url).waiting is not None and rs.get(url).waiting >= 29
    finally:
        await runner.cleanup()
