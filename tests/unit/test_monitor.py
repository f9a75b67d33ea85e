"""router.monitor: the scrape cadence (health rounds against live servers:
tests/integration/test_router_health.py)."""

from __future__ import annotations

import pytest

from router.monitor import next_scrape_at


def test_scrape_rounds_keep_a_fixed_rate_and_skip_what_they_overran():
    # a round due at 10.0 that took 30 ms: the next is due 50 ms after 10.0, not after 10.03
    assert next_scrape_at(10.0, 10.03, 0.05) == pytest.approx(10.05)
    # a round that ran 2 s (a replica timing out): the next starts an interval after it ended,
    # not at once and not 40 rounds back to back
    assert next_scrape_at(10.0, 12.0, 0.05) == pytest.approx(12.05)


async def test_monitor_starts_discoverys_loops_beside_its_own():
    import asyncio

    import aiohttp

    from router.config import RouterConfig
    from router.monitor import ReplicaMonitor, cancel_all
    from router.replicas import ReplicaSet

    async with aiohttp.ClientSession() as http:
        plain = ReplicaMonitor(ReplicaSet(), http, RouterConfig(health_interval_s=30))
        tasks = plain.tasks()
        assert {t.get_name() for t in tasks} == {"kvroute-health", "kvroute-metrics-scrape"}
        await cancel_all(tasks)
        cfg = RouterConfig(replica_dns=["http://localhost:1"], dns_interval_s=30)
        tasks = ReplicaMonitor(ReplicaSet(), http, cfg).tasks()
        assert "kvroute-dns" in {t.get_name() for t in tasks}
        await cancel_all(tasks)
        assert all(t.done() for t in tasks)
        await asyncio.sleep(0)
