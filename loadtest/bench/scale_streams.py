"""The scale bench's streams part (:mod:`loadtest.bench.bench_scale` says what it measures):
N concurrent slow streams from twins through a router with every default."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.bench.scale_common import (
    PROFILE,
    client,
    cpu_groups,
    group_rss_mb,
    machine_load,
    pct,
)


@dataclass
class StreamConfig:
    streams: int = 2000
    replicas: int = 4
    max_num_seqs: int = 256  # per twin: the router's 1,024 upstream connections all decode
    stream_tokens: int = 60
    # slowed time: ~0.25 s a token at 256 a twin on the H200 profile, ~40 s a stream (10 s of
    # prefill in the first wave): the calls past the router's 1,024 upstream connections wait
    # ~40 s, within pool_timeout_s (60) while no replica gets more than 512 of the 2,000
    stream_speedup: float = 0.1
    timeout_s: float = 240.0


def _by_replica(text: str, prefix: str) -> dict[str, float]:
    """A Prometheus text's samples starting with ``prefix`` summed by their ``replica``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix) and 'replica="' in line:
            rep = line.split('replica="', 1)[1].split('"', 1)[0]
            out[rep] = out.get(rep, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def _streams(url: str, cfg: StreamConfig, pgid: int | None) -> dict[str, Any]:
    import aiohttp

    msgs = [{"role": "user", "content": "tell me a story"}]
    body = json.dumps({"model": "tiny", "stream": True, "max_tokens": cfg.stream_tokens,
                       "ignore_eos": True, "messages": msgs}).encode()  # fmt: skip
    open_now = 0  # answered (head received), not finished
    peak_open = 0
    in_flight = 0  # sent, not finished (waiting in the router's pool included)
    peak_in_flight = 0
    rss_peak = 0.0
    ttft: list[float] = []
    head: list[float] = []  # request sent -> response head (a wait in the router's pool)
    took: list[float] = []
    errors: dict[str, int] = {}

    samples: list[str] = []  # distinct error bodies (the router's message names the cause)
    inflight_peak: dict[str, int] = {}  # replica -> the most calls the router had on it

    def err(kind: str) -> None:
        errors[kind] = errors.get(kind, 0) + 1

    async with client() as cs:

        async def one(i: int) -> None:
            nonlocal open_now, peak_open, in_flight, peak_in_flight
            t0 = time.perf_counter()
            in_flight += 1
            peak_in_flight = max(peak_in_flight, in_flight)
            try:
                async with cs.post(url + "/v1/chat/completions", data=body,
                                   headers={"Content-Type": "application/json",
                                            "X-Session-ID": f"stream-{i}"}) as r:  # fmt: skip
                    if r.status != 200:
                        text = (await r.read()).decode(errors="replace")[:300]
                        err(f"http {r.status}")
                        if len(samples) < 5 and text not in samples:
                            samples.append(text)
                        return
                    head.append(time.perf_counter() - t0)
                    open_now += 1
                    peak_open = max(peak_open, open_now)
                    try:
                        first = True
                        done = False
                        async for line in r.content:
                            if line.startswith(b"data: ") and first:
                                ttft.append(time.perf_counter() - t0)
                                first = False
                            if line.startswith(b"data: [DONE]"):
                                done = True
                        if not done:
                            err("no [DONE]")
                            return
                        took.append(time.perf_counter() - t0)
                    finally:
                        open_now -= 1
            except (TimeoutError, aiohttp.ClientError) as e:
                err(type(e).__name__)
            finally:
                in_flight -= 1

        async def watch() -> None:
            nonlocal rss_peak
            k = 0
            while True:
                rss_peak = max(rss_peak, group_rss_mb(pgid))
                if k % 4 == 0:  # the router's calls in flight per replica, every 2 s
                    try:
                        async with cs.get(url + "/metrics") as m:
                            for rep, n in _by_replica(await m.text(), "kvroute_inflight{").items():
                                inflight_peak[rep] = max(inflight_peak.get(rep, 0), int(n))
                    except aiohttp.ClientError:
                        pass
                k += 1
                await asyncio.sleep(0.5)

        rss0 = group_rss_mb(pgid)
        w = asyncio.create_task(watch())
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(
                asyncio.gather(*(one(i) for i in range(cfg.streams))), cfg.timeout_s
            )
        except TimeoutError:
            err("bench timeout")
        wall = time.perf_counter() - t0
        w.cancel()
        rss_after = group_rss_mb(pgid)
        async with cs.get(url + "/metrics") as m:
            placed = _by_replica(await m.text(), "kvroute_requests_total{")
    return {
        "streams": cfg.streams,
        "ok": len(took),
        "errors": cfg.streams - len(took),
        "error_kinds": errors,
        "peak_in_flight": peak_in_flight,
        "peak_answered_open": peak_open,
        "head_p50_s": round(pct(head, 0.5) or 0.0, 2),
        "head_max_s": round(max(head, default=0.0), 2),
        "ttft_p50_s": round(pct(ttft, 0.5) or 0.0, 2),
        "ttft_max_s": round(max(ttft, default=0.0), 2),
        "duration_p50_s": round(pct(took, 0.5) or 0.0, 2),
        "duration_max_s": round(max(took, default=0.0), 2),
        "wall_s": round(wall, 1),
        "router_rss_before_mb": round(rss0, 1),
        "router_rss_peak_mb": round(rss_peak, 1),
        "router_rss_after_mb": round(rss_after, 1),
        "error_samples": samples,
        # where the router placed the calls: each replica's pool holds 256 (the default
        # max_connections_per_replica); a call waits for its replica's, never moves
        "calls_by_replica": {k: int(v) for k, v in sorted(placed.items())},
        "router_inflight_peak_by_replica": dict(sorted(inflight_peak.items())),
    }


class DefaultRouter:
    """``kvroute serve --replica URL ...`` with every default but the log level (WARNING, so
    2,000 calls' INFO lines do not cost the router CPU) and a free loopback port."""

    def __init__(self, replicas: list[str], workdir: Path):
        from loadtest.vllmbed import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "kvroute.cli", "serve", "--host", "127.0.0.1",
                     "--port", str(self.port), "--log-level", "WARNING"]  # fmt: skip
        for r in replicas:
            self.argv += ["--replica", r]
        self.workdir = workdir
        self._proc: Any = None

    def start(self, timeout_s: float = 120.0) -> DefaultRouter:
        from loadtest.sweep.stack import _wait_http
        from loadtest.vllmbed import ManagedProcess

        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env = {k: v for k, v in env.items() if not k.startswith("KVROUTE_")}  # defaults only
        self._proc = ManagedProcess(self.argv, env, self.workdir / "router-default.log", Path.cwd())
        self._proc.start()
        try:
            _wait_http(self._proc, self.url + "/ready", time.monotonic() + timeout_s, "router")
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def pgid(self) -> int | None:
        return self._proc.proc.pid if self._proc is not None and self._proc.proc else None

    def warnings(self, n: int = 12) -> list[str]:
        """The router log's last ``n`` WARNING/ERROR lines (replica health, breakers)."""
        try:
            lines = (self.workdir / "router-default.log").read_text(errors="replace").splitlines()
        except OSError:
            return []
        return [x[:300] for x in lines if " WARNING " in x or " ERROR " in x][-n:]

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.stop(grace_s=5.0)
            self._proc = None


def run_streams(
    cfg: StreamConfig, log: Callable[[dict[str, Any]], None] = print
) -> list[dict[str, Any]]:
    from loadtest.sweep.cpuwatch import CpuWatch
    from loadtest.sweep.stack import TwinCluster, cleanup

    work = Path(tempfile.mkdtemp(prefix="kvroute-bench-scale-"))
    twins = TwinCluster(replicas=cfg.replicas, profile=PROFILE, speedup=cfg.stream_speedup,
                        workdir=work, overrides=[f"max_num_seqs={cfg.max_num_seqs}"])  # fmt: skip
    router: DefaultRouter | None = None
    rows: list[dict[str, Any]] = []
    try:
        twins.start(timeout_s=120)
        # every router default: ``kvroute serve --replica ...`` and nothing else (stack.Router
        # adds only host, port, log level and the policy, which is given as its default)
        router = DefaultRouter(twins.urls, work).start()
        load0 = machine_load()
        watch = CpuWatch({"twins": twins.pgid, "router": router.pgid, "client": None},
                         interval_s=1.0).start()  # fmt: skip
        res = asyncio.run(_streams(router.url, cfg, router.pgid))
        rec = watch.stop()
        row: dict[str, Any] = {"name": f"streams_{cfg.streams}", "part": "streams",
                               "replicas": cfg.replicas, "stream_tokens": cfg.stream_tokens,
                               "twin_speedup": cfg.stream_speedup, **res}  # fmt: skip
        row.update(cpu_groups(rec, 0, "router"))
        row["router_warnings"] = router.warnings()
        row["load_before"] = load0
        row["load_after"] = machine_load()
        row["target_met"] = res["errors"] == 0 and cfg.streams >= 2000
        rows.append(row)
        log(row)
    finally:
        if router is not None:
            router.stop()
        twins.stop()
        cleanup(work)
    return rows
