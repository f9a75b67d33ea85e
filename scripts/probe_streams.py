"""Concurrent streams probe (docs/reliability.md): N streams of S seconds each through an
in-process router in front of two fake replicas; prints the streams' outcome and the process's
RSS and open fds before, at the peak and after (router, replicas and client share the process).

    .venv/bin/python scripts/probe_streams.py 2000 60
    .venv/bin/python scripts/probe_streams.py 2000 10 --rounds 5 [--new-sessions]  # leak?

``--rounds R`` keeps one router and its replicas up for R rounds of N streams (the same N
session ids every round; ``--new-sessions``: new ones each round) and prints,
after each round (garbage collected, upstream pool idle), the RSS, the number of memory
blocks CPython's allocator has handed out (``sys.getallocatedblocks()``: grows with a
leak of Python objects, not with arenas kept for reuse) and the RSS after glibc's
``malloc_trim(0)`` (returns freed heap pages to the OS: what it gives back is retention,
what stays is live or fragmented).
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
from router.keys import STORE
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


def malloc_trim() -> bool:
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


async def rounds(n: int, seconds: float, count: int, fresh: bool) -> None:
    chunks = [b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'] * 20 + [b"data: [DONE]\n\n"]
    reps = [await FakeReplica(f"r{i}", chunks=chunks, chunk_delay_s=seconds / 20).start()
            for i in range(2)]  # fmt: skip
    app = build_app(RouterConfig(replicas=[r.url for r in reps], health_interval_s=30,
                                 metrics_interval_s=30, max_connections=4 * n,
                                 max_connections_per_replica=2 * n))  # fmt: skip
    runner, url = await start_site(app)
    want = b"".join(chunks)
    body = {"model": "tiny", "messages": [], "stream": True}
    gc.collect()
    print({"round": 0, "rss_mb": round(rss_mb(), 1), "blocks": sys.getallocatedblocks(),
           "fds": fds()}, flush=True)  # fmt: skip
    for k in range(1, count + 1):
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(
            connector=conn, timeout=aiohttp.ClientTimeout(total=None)
        ) as s:

            async def one(i: int, k: int = k) -> bool:
                async with s.post(url + "/v1/chat/completions", json=body,
                                  headers={"x-session-id": f"r{k * fresh}s{i}"}) as r:  # fmt: skip
                    return r.status == 200 and await r.read() == want

            t0 = time.monotonic()
            ok = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
            took = time.monotonic() - t0
        await asyncio.sleep(1.0)
        for r in reps:  # the fake replicas' own record of each call is not the router's
            r.seen.clear()
        gc.collect()
        row = {
            "round": k,
            "ok": sum(1 for x in ok if x is True),
            "wall_s": round(took, 1),
            "rss_mb": round(rss_mb(), 1),
            "blocks": sys.getallocatedblocks(),
            "fds": fds(),
            "sessions": app[STORE].active_count(),
        }
        trimmed = malloc_trim()
        row["rss_after_trim_mb"] = round(rss_mb(), 1) if trimmed else None
        print(row, flush=True)  # fmt: skip
    await runner.cleanup()
    for r in reps:
        await r.stop()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    n = int(args[0]) if args else 2000
    sec = float(args[1]) if len(args) > 1 else 60.0
    if "--rounds" in sys.argv:
        count = int(sys.argv[sys.argv.index("--rounds") + 1])
        asyncio.run(rounds(n, sec, count, fresh="--new-sessions" in sys.argv))
    else:
        print(asyncio.run(probe(n, sec)))
