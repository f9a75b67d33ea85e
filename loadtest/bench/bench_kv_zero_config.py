"""Zero-config KV layer against the full ``kv:`` configuration on the bundled weka-dev slice:
the fraction of placements that are the same.

Two identical clusters of 4 twins (``h200-70b-fp8``, truth ``nominal``, speedup 10), each
twin on its own loopback address (``127.0.<cluster>.<i>``) binding its KV-event publisher at
one port P, as vLLM binds ``tcp://*:P`` on its own host. Router A is ``kvroute serve
--replica … --kv-events-port P`` with no ``kv:`` settings (only ``KVROUTE_KV_TIME_SCALE``,
the twins' speedup: the profile seconds calibration needs); router B is ``kvroute serve`` with
the full ``KVROUTE_KV_*`` wiring the bench gives (tokenizer, block size, profile, events by
endpoint, time scale). The same replay (closed loop, 8 lanes, first 12 calls per session, gaps
capped at 30 s) runs against both at once; each router's decision log is compared call by
call (the k-th placement of each session), under the replica numbering that agrees most (the
clusters' replicas have other names, so an empty cluster's tie-break may differ). A second
pair, full against full, gives the noise floor: two runs of one configuration are not
identical either (timing reaches the load terms and the calibration).

    python -m loadtest.bench.bench_kv_zero_config --out out/zero-config [--duration 40]

Writes ``<out>/<pair>/{a,b}.jsonl`` (decision logs), the replays' folders and
``<out>/results.json``; prints the fractions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

STANDALONE = (
    "two twin clusters and two routers for minutes: "
    "python -m loadtest.bench.bench_kv_zero_config --out DIR"
)

DATA = Path(__file__).resolve().parents[1] / "data" / "weka-dev-slice.tar.gz"
PROFILE = "h200-70b-fp8"


def free_port(hosts: list[str]) -> int:
    for _ in range(100):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        try:
            for h in hosts[1:]:
                with socket.socket() as s:
                    s.bind((h, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no common free port")


async def serve_twins(hosts: list[str], port: int, speedup: float) -> None:
    """Child process: one twin per host, publisher bound at host:port; prints their URLs."""
    from loadtest.twin.cluster import start_cluster

    async with contextlib.AsyncExitStack() as stack:
        for h in hosts:
            c = await stack.enter_async_context(
                start_cluster(
                    1,
                    PROFILE,
                    speedup=speedup,
                    host=h,
                    kv_events=f"tcp://{h}:{port}",
                    kv_events_bind=True,
                    kv_events_topic="",
                    truth="nominal",
                    enable_auto_tool_choice=True,
                    name_prefix=f"twin-{h}",
                )
            )
            print("URL", c.urls[0], flush=True)
        print("READY", flush=True)
        await asyncio.Event().wait()


def spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def stop(p: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(5)


def wait_lines(log: Path, p: subprocess.Popen[bytes], timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "READY" in text:
            return [ln.split()[1] for ln in text.splitlines() if ln.startswith("URL ")]
        if p.poll() is not None:
            raise RuntimeError(f"twins exited:\n{text[-3000:]}")
        time.sleep(0.1)
    raise RuntimeError("twins not ready in time")


def wait_ready(url: str, p: subprocess.Popen[bytes], log: Path, timeout_s: float = 60) -> dict:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"router exited:\n{log.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.get(url + "/ready", timeout=2)
            if r.status_code == 200:
                return r.json()
        time.sleep(0.2)
    raise RuntimeError("router not ready in time")


def router(urls: list[str], hosts: list[str], port: int, zero: bool, dlog: Path,
           speedup: float, log: Path) -> tuple[subprocess.Popen[bytes], str]:  # fmt: skip
    from loadtest import tinymodel

    rport = free_port(["127.0.0.1"])
    argv = [sys.executable, "-m", "kvroute.cli", "serve", "--host", "127.0.0.1", "--port",
            str(rport), "--log-level", "warning", "--decision-log", str(dlog)]  # fmt: skip
    for u in urls:
        argv += ["--replica", u]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env["KVROUTE_KV_TIME_SCALE"] = repr(speedup)
    if zero:
        argv += ["--kv-events-port", str(port)]
    else:
        env.update({
            "KVROUTE_KV_TOKENIZER": str(tinymodel.ensure()),
            "KVROUTE_KV_BLOCK_SIZE": "64",
            "KVROUTE_KV_PROFILE": PROFILE,
            "KVROUTE_KV_EVENTS_CONNECT": json.dumps(
                {u: f"tcp://{h}:{port}" for u, h in zip(urls, hosts, strict=True)}
            ),
        })  # fmt: skip
    return spawn(argv, env, log), f"http://127.0.0.1:{rport}"


def placements(path: Path) -> dict[str, list[str]]:
    """Session -> the winners of its placements, in order."""
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        d = json.loads(line)
        out.setdefault(d["session"], []).append(d["winner"])
    return out


def agreement(a: dict[str, list[str]], b: dict[str, list[str]], ra: list[str],
              rb: list[str]) -> dict[str, Any]:  # fmt: skip
    """Same placements (k-th of each session present in both), under the best numbering."""
    pairs = [(x, y) for s in a.keys() & b.keys() for x, y in zip(a[s], b[s], strict=False)]
    best, best_map = -1, None
    for perm in itertools.permutations(range(len(rb))):
        m = {ra[i]: rb[perm[i]] for i in range(len(ra))}
        n = sum(1 for x, y in pairs if m.get(x) == y)
        if n > best:
            best, best_map = n, m
    firsts = [(a[s][0], b[s][0]) for s in a.keys() & b.keys()]
    # sessions whose placements part at some call (each such split makes the rest of the
    # session's placements differ too: it then lives on another replica)
    parted = sum(
        1
        for s in a.keys() & b.keys()
        if any(best_map and best_map.get(x) != y for x, y in zip(a[s], b[s], strict=False))
    )
    return {
        "compared": len(pairs),
        "identical": best,
        "fraction": round(best / len(pairs), 4) if pairs else None,
        "first_calls_identical": sum(1 for x, y in firsts if best_map and best_map.get(x) == y),
        "sessions": len(firsts),
        "sessions_parted": parted,
        "placements": [sum(map(len, a.values())), sum(map(len, b.values()))],
    }


async def run_pair(name: str, zero_a: bool, args: argparse.Namespace, out: Path) -> dict:
    from costmodel.profiles import load_profile
    from loadtest import tinymodel
    from loadtest.prompts import PromptBuilder
    from loadtest.replay.runner import ReplayConfig, replay
    from loadtest.traces import load_trace

    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    hosts = {k: [f"127.0.{k}.{i + 1}" for i in range(args.replicas)] for k in (1, 2)}
    port = free_port(hosts[1] + hosts[2])
    procs: list[subprocess.Popen[bytes]] = []
    try:
        urls = {}
        for k in (1, 2):
            log = d / f"twins-{k}.log"
            code = ("import asyncio, sys; from loadtest.bench.bench_kv_zero_config import "
                    f"serve_twins; asyncio.run(serve_twins({hosts[k]!r}, {port}, "
                    f"{args.speedup!r}))")  # fmt: skip
            p = spawn([sys.executable, "-c", code], dict(os.environ), log)
            procs.append(p)
            urls[k] = wait_lines(log, p, 120)
        ra, url_a = router(urls[1], hosts[1], port, zero_a, d / "a.jsonl", args.speedup,
                           d / "router-a.log")  # fmt: skip
        procs.append(ra)
        rb, url_b = router(urls[2], hosts[2], port, False, d / "b.jsonl", args.speedup,
                           d / "router-b.log")  # fmt: skip
        procs.append(rb)
        ready = [
            wait_ready(url_a, ra, d / "router-a.log"),
            wait_ready(url_b, rb, d / "router-b.log"),
        ]
        await asyncio.sleep(1.0)  # the routers' subscriptions reach the twins
        prof = load_profile(PROFILE)
        trace = load_trace(str(DATA), max_calls=12, max_gap_s=30.0)
        mml = prof.max_model_len
        builder = PromptBuilder(tinymodel.ensure(), block_size=prof.block_size,
                                trace_block_size=trace.block_size,
                                max_prompt_tokens=mml - min(8192, mml // 4))  # fmt: skip

        def cfg(url: str, k: int) -> ReplayConfig:
            return ReplayConfig(target=url, concurrency=args.concurrency,
                                duration_s=args.duration, time_scale=args.speedup,
                                speedup=args.speedup, gpus=args.replicas, progress=False,
                                metrics_urls=[u + "/metrics" for u in urls[k]])  # fmt: skip

        sa, sb = await asyncio.gather(
            replay(trace, builder, cfg(url_a, 1), d / "replay-a"),
            replay(trace, builder, cfg(url_b, 2), d / "replay-b"),
        )
    finally:
        for p in reversed(procs):
            stop(p)
    res = agreement(placements(d / "a.jsonl"), placements(d / "b.jsonl"), urls[1], urls[2])
    res.update({
        "a": "zero-config" if zero_a else "full kv:",
        "b": "full kv:",
        "a_kv_layer": ready[0].get("kv_layer"),
        "b_kv_layer": ready[1].get("kv_layer"),
        "calls_ok": [sa.get("requests_ok"), sb.get("requests_ok")],
        "cache_hit_ratio": [sa.get("cache_hit_ratio"), sb.get("cache_hit_ratio")],
    })  # fmt: skip
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="out/zero-config")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of replay per pair")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--speedup", type=float, default=10.0)
    p.add_argument("--pairs", default="zero,full", help="comma list of zero (zero vs full) "
                   "and full (full vs full: the noise floor)")  # fmt: skip
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"command": " ".join(sys.argv), "config": vars(args)}
    for i, pair in enumerate(args.pairs.split(",")):
        name = {"zero": "zero-vs-full", "full": "full-vs-full"}[pair] + f"-{i}"
        results[name] = asyncio.run(run_pair(name, pair == "zero", args, out))
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        r = results[name]
        print(f"{name}: {r['identical']}/{r['compared']} placements identical ({r['fraction']}), "
              f"first calls {r['first_calls_identical']}/{r['sessions']}, sessions parted "
              f"{r['sessions_parted']}, ok {r['calls_ok']}, "
              f"hit {r['cache_hit_ratio']}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
