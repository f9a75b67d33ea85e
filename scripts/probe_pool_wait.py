"""Pool-wait probe (issue 45, hole 1; docs/reliability.md): one fake replica streaming
``--chunks`` chunks ``--chunk-s`` apart, a router with ``--max-connections-per-replica`` and
``--first-byte-timeout-s``, N concurrent streamed calls. Prints each call's status and time,
the breaker's state and what the replica received: calls that wait for a pooled connection
must be served (or, past ``--pool-timeout-s``, refused with a 503 naming the limit), never
blamed on the replica.

    .venv/bin/python scripts/probe_pool_wait.py 6   # the issue's case: 2 sockets, 3 s, 10 × 1 s
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import aiohttp

sys.path.insert(0, ".")

from router.app import build_app, start_site
from router.config import RouterConfig
from router.keys import REPLICAS
from tests.integration.test_router_proxy import FakeReplica


async def main(a: argparse.Namespace) -> None:
    chunk = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
    f = await FakeReplica("r0", chunks=[chunk] * a.chunks + [b"data: [DONE]\n\n"],
                          chunk_delay_s=a.chunk_s).start()  # fmt: skip
    cfg = RouterConfig(replicas=[f.url], max_connections_per_replica=a.max_connections_per_replica,
                       first_byte_timeout_s=a.first_byte_timeout_s, pool_timeout_s=a.pool_timeout_s,
                       health_interval_s=30, metrics_interval_s=30)  # fmt: skip
    app = build_app(cfg)
    runner, url = await start_site(app)
    body = {"model": "tiny", "messages": [], "stream": True}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:

            async def one(i: int) -> tuple[int, float, str]:
                t0 = time.monotonic()
                async with s.post(url + "/v1/chat/completions", json=body,
                                  headers={"x-session-id": f"s{i}"}) as r:  # fmt: skip
                    got = await r.read()
                    msg = "" if r.status == 200 else got.decode(errors="replace")[:160]
                    return r.status, time.monotonic() - t0, msg

            for status, took, msg in await asyncio.gather(*(one(i) for i in range(a.n))):
                print(f"{status} after {took:.2f} s {msg}")
        r = app[REPLICAS].get(f.url)
        assert r is not None
        print(f"breaker {r.breaker.state} ({r.breaker.failures} failures), healthy {r.healthy}, "
              f"replica received {len(f.seen)} calls")  # fmt: skip
    finally:
        await runner.cleanup()
        await f.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("n", type=int, nargs="?", default=6)
    p.add_argument("--chunks", type=int, default=10)
    p.add_argument("--chunk-s", type=float, default=1.0)
    p.add_argument("--max-connections-per-replica", type=int, default=2)
    p.add_argument("--first-byte-timeout-s", type=float, default=3.0)
    p.add_argument("--pool-timeout-s", type=float, default=60.0)
    asyncio.run(main(p.parse_args()))
