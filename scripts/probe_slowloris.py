"""Slowloris probe (docs/reliability.md): N connections against an in-process router in front
of a fake replica, half dripping an endless request head, half silent; prints when each group
was cut and a good client's latency meanwhile.  .venv/bin/python scripts/probe_slowloris.py 2000
"""

import asyncio
import sys
import time

sys.path.insert(0, ".")
import aiohttp

from router.app import build_app, start_site
from router.config import RouterConfig
from tests.integration.test_router_proxy import FakeReplica

N = int(sys.argv[1])


async def main():
    f = await FakeReplica("r0").start()
    app = build_app(
        RouterConfig(
            replicas=[f.url],
            header_timeout_s=2.0,
            idle_timeout_s=5.0,
            health_interval_s=30,
            metrics_interval_s=30,
        )
    )
    runner, url = await start_site(app)
    host, port = url.removeprefix("http://").split(":")
    t0 = time.monotonic()
    conns = []
    for _ in range(N):
        conns.append(await asyncio.open_connection(host, int(port)))
    for _, w in conns[: N // 2]:
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")

    async def drip():
        for _ in range(20):
            await asyncio.sleep(0.5)
            for _, w in conns[: N // 2]:
                try:
                    w.write(b"X-a: b\r\n")
                except Exception:
                    pass

    d = asyncio.create_task(drip())
    lat = []
    async with aiohttp.ClientSession() as s:
        for _ in range(5):
            t = time.monotonic()
            async with s.post(
                url + "/v1/chat/completions", json={"model": "tiny", "messages": [], "stream": True}
            ) as r:
                await r.read()
                assert r.status == 200
            lat.append(time.monotonic() - t)

    async def closed(r):
        try:
            await asyncio.wait_for(r.read(), 30)
        except Exception:
            pass
        return time.monotonic() - t0

    times = await asyncio.gather(*(closed(r) for r, _ in conns))
    d.cancel()
    slow, silent = max(times[: N // 2]), max(times[N // 2 :])
    print(f"{N} connections (half dripping a request head every 0.5 s, half silent);")
    print(f"header_timeout_s 2, idle_timeout_s 5: dripping ones cut by {slow:.2f} s,")
    print(f"silent ones by {silent:.2f} s; a good client's median {sorted(lat)[2] * 1e3:.1f} ms")

    for _, w in conns:
        w.close()
    await runner.cleanup()
    await f.stop()


asyncio.run(main())
