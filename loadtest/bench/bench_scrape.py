"""What the router's load scrape costs: kvroute's CPU at each ``metrics_interval_s``.

``python -m loadtest.bench.bench_scrape [--intervals 1,0.05] [--replicas 4] [--duration 30]``

For each interval, a fresh twin cluster (``--replicas`` twins, KV events on, as ``kvroute
bench`` starts them) and ``kvroute serve --policy llmd --metrics-interval-s S`` in front, with
no traffic: the router's CPU over ``--duration`` seconds is then its background work — health
checks every 2 s, the KV-event subscription, and the ``/metrics`` scrape of every replica every
S seconds — and the twins' CPU includes serving those scrapes. The difference between two
intervals, divided by the scrapes it added, is the CPU one scrape costs each side (idle twins
serve the same families a loaded twin does; the values, not the size, change under load). Also
the time :func:`router.vllm.metrics.parse_vllm_metrics` takes on one twin exposition, in this
process. CPU is from :class:`loadtest.sweep.cpuwatch.CpuWatch` (``/proc``), in cores.
Writes JSON to ``--json`` when given; prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import httpx

from loadtest.sweep.cpuwatch import CpuWatch
from loadtest.sweep.stack import Router, TwinCluster, cleanup

# Not part of ``make bench``: it starts its own twin clusters and routers for ~40 s each.
STANDALONE = "starts twins and a router per interval: python -m loadtest.bench.bench_scrape"


def parse_cost(url: str, repeats: int = 200) -> dict[str, float]:
    """Bytes of one twin ``/metrics`` exposition and the median time to parse it (ms)."""
    from router.vllm.metrics import parse_vllm_metrics

    text = httpx.get(url + "/metrics", timeout=5.0).text
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        parse_vllm_metrics(text)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"bytes": len(text.encode()), "parse_ms_median": 1e3 * times[len(times) // 2]}


def measure(interval_s: float, replicas: int, duration_s: float, profile: str) -> dict[str, Any]:
    from costmodel.profiles import load_profile

    cluster = TwinCluster(replicas, profile, 1.0, kv_events="tcp://127.0.0.1:*")
    try:
        cluster.start()
        router = Router(
            "kvroute:llmd",
            cluster.urls,
            cluster.workdir,
            event_endpoints=cluster.event_endpoints,
            block_size=load_profile(profile).block_size,
            profile=profile,
            extra_args=["--metrics-interval-s", repr(interval_s)],
        )
        with router:
            time.sleep(3.0)  # past start-up (tokenizer load, first health round)
            watch = CpuWatch({"router": router.pgid, "twins": cluster.pgid}).start()
            time.sleep(duration_s)
            cpu = watch.stop()
            parsed = parse_cost(cluster.urls[0])
        g = cpu.get("groups") or {}
        return {
            "interval_s": interval_s,
            "replicas": replicas,
            "duration_s": cpu.get("elapsed_s"),
            "router_cores": (g.get("router") or {}).get("mean_cores"),
            "router_busiest_thread_p90": (g.get("router") or {}).get("busiest_thread_p90"),
            "twins_cores": (g.get("twins") or {}).get("mean_cores"),
            "machine_busy_cores": (cpu.get("machine") or {}).get("busy_cores"),
            "scrapes_per_s": replicas / interval_s,
            **parsed,
        }
    finally:
        cluster.stop()
        cleanup(cluster.workdir)


def per_scrape(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """CPU ms per scrape, router and twins, from the slowest and the fastest interval."""
    if len(rows) < 2:
        return None
    slow = max(rows, key=lambda r: r["interval_s"])
    fast = min(rows, key=lambda r: r["interval_s"])
    added = fast["scrapes_per_s"] - slow["scrapes_per_s"]
    if added <= 0:
        return None
    return {
        "router_ms_per_scrape": 1e3 * (fast["router_cores"] - slow["router_cores"]) / added,
        "twins_ms_per_scrape": 1e3 * (fast["twins_cores"] - slow["twins_cores"]) / added,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--intervals", default="1,0.05", help="comma-separated seconds")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--profile", default="h200-70b-fp8-tp4")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    rows = [
        measure(float(s), a.replicas, a.duration, a.profile) for s in a.intervals.split(",") if s
    ]
    print("| interval s | scrapes/s | router cores | router busiest thread p90 | twins cores "
          "| machine busy cores | exposition bytes | parse ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['interval_s']:g} | {r['scrapes_per_s']:g} | {r['router_cores']:.3f} | "
              f"{r['router_busiest_thread_p90']:.3f} | {r['twins_cores']:.3f} | "
              f"{r['machine_busy_cores']:.2f} | {r['bytes']:,} | "
              f"{r['parse_ms_median']:.2f} |")  # fmt: skip
    each = per_scrape(rows)
    if each:
        print(f"per scrape: router {each['router_ms_per_scrape']:.2f} ms CPU, "
              f"twins {each['twins_ms_per_scrape']:.2f} ms CPU")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "per_scrape": each}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
