# ruff: noqa: F811  (fixtures shared from test_router_proxy are imported by name)
"""10k sessions through the HTTP path, then TTL eviction: the table empties by itself and the
router's memory goes back down (issue 13)."""

from __future__ import annotations

import asyncio
import gc
import resource
import time

import pytest

from router.keys import STORE
from tests.integration.test_router_proxy import fakes, http  # noqa: F401

pytestmark = pytest.mark.timeout(120)
N = 10_000


async def test_ten_thousand_sessions_are_evicted_after_their_ttl(fakes, router, http):
    (f,) = await fakes(1)
    url, app = await router([f.url], session_ttl_s=600.0)
    sem = asyncio.Semaphore(32)

    async def one(i: int) -> int:
        async with sem, http.post(url + "/v1/completions",
                                  json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                                  headers={"x-session-id": f"s{i}"}) as r:  # fmt: skip
            await r.read()
            return r.status

    t0 = time.monotonic()
    statuses = await asyncio.gather(*(one(i) for i in range(N)))
    took = time.monotonic() - t0
    assert statuses.count(200) == N
    store = app[STORE]
    assert store.active_count() == N
    # the TTL passes (shortened in place: the call run itself takes ~25 s here); the sweep the
    # store's background task runs evicts every idle session
    store.ttl_s = 0.5  # type: ignore[attr-defined]
    await asyncio.sleep(0.6)
    t1 = time.perf_counter()
    evicted = store.sweep()  # type: ignore[attr-defined]
    sweep_ms = (time.perf_counter() - t1) * 1e3
    assert evicted == N and store.active_count() == 0, store.active_count()
    async with http.get(url + "/metrics") as r:
        assert "kvroute_active_sessions 0.0" in await r.text()
    gc.collect()
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"{N} sessions in {took:.1f} s ({N / took:.0f} calls/s, c=32); one sweep evicted "
        f"{evicted} in {sweep_ms:.1f} ms; max RSS {rss_mb:.0f} MB"
    )
