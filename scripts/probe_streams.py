"""Concurrent streams probe (docs/reliability.md): N streams of S seconds each through an
in-process router in front of two fake replicas; prints the streams' outcome and the process's
RSS and open fds before, at the peak and after (router, replicas and client share the process).

    .venv/bin/python scripts/probe_streams.py 2000 60
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import time

import aiohttp

sys.path.insert(0, ".")
from router.app import build_app, start_site
from router.config import RouterConfig
from tests.integration.test_router_proxy import FakeReplica


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def probe(n: int, seconds: float) -> dict[str, float]:
    chunks = [b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'] * 20 + [b"data: [DONE]\n\n"]
    reps = [await FakeReplica(f"r{i}", chunks=chunks, chunk_delay_s=seconds / 20).start()
            for i in range(2)]  # fmt: skip
    app = build_app(RouterConfig(replicas=[r.url for r in reps], health_interval_s=30,
                                 metrics_interval_s=30, max_connections=4 * n,
                                 max_connections_per_replica=2 * n))  # fmt: skip
    runner, url = await start_site(app)
    gc.collect()
    base = {"rss_mb": rss_mb(), "fds": fds()}
    peak = dict(base)
    want = b"".join(chunks)
    body = {"model": "tiny", "messages": [], "stream": True}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=conn, timeout=aiohttp.ClientTimeout(total=None)
    ) as s:

        async def one(i: int) -> bool:
            async with s.post(url + "/v1/chat/completions", json=body,
                              headers={"x-session-id": f"s{i}"}) as r:  # fmt: skip
                return r.status == 200 and await r.read() == want

        async def watch() -> None:
            while True:
                await asyncio.sleep(0.5)
                peak["rss_mb"] = max(peak["rss_mb"], rss_mb())
                peak["fds"] = max(peak["fds"], fds())

        w = asyncio.create_task(watch())
        t0 = time.monotonic()
        ok = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
        took = time.monotonic() - t0
        w.cancel()
    await asyncio.sleep(1.0)
    gc.collect()
    after = {"rss_mb": rss_mb(), "fds": fds()}
    await runner.cleanup()
    for r in reps:
        await r.stop()
    gc.collect()
    return {
        "streams": n, "ok": sum(1 for x in ok if x is True), "wall_s": round(took, 1),
        "rss_base_mb": round(base["rss_mb"]), "rss_peak_mb": round(peak["rss_mb"]),
        "rss_after_mb": round(after["rss_mb"]), "fds_base": base["fds"],
        "fds_peak": peak["fds"], "fds_after": after["fds"],
        "fds_after_cleanup": fds(),
    }  # fmt: skip


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    sec = float(sys.argv[2]) if len(sys.argv) > 2 else 60.0
    print(asyncio.run(probe(n, sec)))
