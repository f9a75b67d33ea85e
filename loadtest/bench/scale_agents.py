"""The scale bench's agents part (:mod:`loadtest.bench.bench_scale` says what it measures):
agent sessions of 100k-token prompts against twins directly and through ``kvroute serve``
(``kv_cost``, the KV layer on, ``--workers`` 1 and 2), open-loop ramps and closed-loop
capacity, the CPU each process used."""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.bench.scale_common import (
    BLOCK,
    PROFILE,
    client,
    cpu_groups,
    machine_load,
    ms,
    pct,
    per_proc,
    proc_cpu,
)

# The agents part's routers wait this long for a twin's health check (default 2 s): a twin's
# loop stalls while it tokenizes a session's first 100k-token prompt, and every twin of the
# cluster shares one process, so on a starved box a warm-up marked them all unhealthy.
TWIN_HEALTH_TIMEOUT_S = 10.0
SYSTEM_TOKENS = 8_000  # an agent type's tools + system prompt, shared by its sessions
AGENT_TYPES = 2


@dataclass
class AgentConfig:
    replicas: int = 2
    sessions: int = 24  # per path
    prompt_tokens: int = 100_000  # a session's first prompt (words; ~1 token each)
    turn_tokens: int = 150  # added per call (assistant reply + user turn)
    max_tokens: int = 16
    speedup: float = 1000.0
    rates: list[float] = field(default_factory=lambda: [5, 10, 20, 40, 80, 160, 200])
    trial_s: float = 8.0
    warm_calls: int = 2  # rounds per worker (+4 a worker past the first: see _warm)
    min_calls: int = 100  # per path and open-loop trial (longer trials at low rates)
    workers: list[int] = field(default_factory=lambda: [1, 2])
    added_ttft_budget_ms: float = 10.0
    capacity: bool = True


class Sessions:
    """One path's agent sessions: ``body(s)`` is session ``s``'s next call (its prompt one
    exchange longer than the last)."""

    def __init__(self, tag: str, cfg: AgentConfig, seed: int):
        from loadtest import tinymodel

        words = tinymodel._WORDS
        rng = random.Random(seed)
        n_sys = min(SYSTEM_TOKENS, cfg.prompt_tokens // 2)
        systems = [" ".join(random.Random(1000 + a).choices(words, k=n_sys))
                   for a in range(AGENT_TYPES)]  # fmt: skip
        own = cfg.prompt_tokens - n_sys
        self.tag = tag
        self.cfg = cfg
        self.rng = rng
        self.words = words
        self.ids = [f"{tag}-{seed}-{s}" for s in range(cfg.sessions)]
        self.messages: list[list[dict[str, str]]] = [
            [{"role": "system", "content": systems[s % AGENT_TYPES]},
             {"role": "user", "content": " ".join(rng.choices(words, k=own))}]
            for s in range(cfg.sessions)
        ]  # fmt: skip
        self.calls = [0] * cfg.sessions

    def body(self, s: int) -> bytes:
        import orjson

        msgs = self.messages[s]
        if self.calls[s]:  # the agent's exchange since its last call
            reply = max(1, self.cfg.turn_tokens // 3)
            msgs.append(
                {"role": "assistant", "content": " ".join(self.rng.choices(self.words, k=reply))}
            )
            msgs.append({"role": "user", "content": " ".join(
                self.rng.choices(self.words, k=self.cfg.turn_tokens - reply))})  # fmt: skip
        self.calls[s] += 1
        body = {"model": "tiny", "messages": msgs, "max_tokens": self.cfg.max_tokens,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        return orjson.dumps(body)


@dataclass
class CallResult:
    ok: bool
    ttft_s: float | None
    total_s: float
    prompt_tokens: int | None
    late_s: float  # how long after its planned start it was sent
    error: str | None = None


async def _call(
    session: Any, url: str, body: bytes, sid: str, planned: float, t_base: float
) -> CallResult:
    import aiohttp
    import orjson

    t0 = time.perf_counter()
    late = max(0.0, t0 - (t_base + planned))
    ttft = None
    prompt_tokens = None
    try:
        async with session.post(url + "/v1/chat/completions", data=body,
                                headers={"Content-Type": "application/json",
                                         "X-Session-ID": sid}) as r:  # fmt: skip
            if r.status != 200:
                await r.read()
                return CallResult(
                    False, None, time.perf_counter() - t0, None, late, f"http {r.status}"
                )
            done = False
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - t0
                if line.startswith(b"data: [DONE]"):
                    done = True
                    continue
                if b'"usage"' in line:
                    u = orjson.loads(line[6:]).get("usage") or {}
                    prompt_tokens = u.get("prompt_tokens", prompt_tokens)
            if not done:
                return CallResult(False, ttft, time.perf_counter() - t0, prompt_tokens, late,
                                  "no [DONE]")  # fmt: skip
    except (TimeoutError, aiohttp.ClientError) as e:
        return CallResult(False, ttft, time.perf_counter() - t0, None, late, type(e).__name__)
    return CallResult(True, ttft, time.perf_counter() - t0, prompt_tokens, late)


async def _warm(sessions: Sessions, route: Callable[[int], str], rounds: int) -> list[str]:
    """Each session's first ``rounds`` calls, unmeasured (cold tokenization, KV placement).
    Every call on a new connection, so behind ``--workers N`` (``SO_REUSEPORT`` places a
    connection, not a call) a session's calls land on the workers at random and each worker
    has most likely seen it (behind 2 workers a given worker misses a given session with odds
    2^-rounds: a call there is a cold 100k-token analysis, +150–250 ms of TTFT)."""
    import aiohttp

    errors: list[str] = []
    for _ in range(rounds):
        conn = aiohttp.TCPConnector(limit=4, force_close=True)
        async with aiohttp.ClientSession(connector=conn) as cs:

            async def one(s: int, cs: aiohttp.ClientSession = cs) -> None:
                r = await _call(
                    cs, route(s), sessions.body(s), sessions.ids[s], 0.0, time.perf_counter()
                )
                if not r.ok:
                    errors.append(r.error or "?")

            await asyncio.gather(*(one(s) for s in range(len(sessions.ids))))
    return errors


async def _open_loop(
    paths: list[tuple[Sessions, Callable[[int], str]]], rate: float, duration_s: float
) -> tuple[list[list[CallResult]], float]:
    """Calls at ``rate``/s on each path for ``duration_s``, the paths' calls interleaved (one
    to each in turn, so both see the same machine), round-robin over each path's sessions."""
    n = max(1, int(rate * duration_s)) * len(paths)
    total = rate * len(paths)
    locks = [[asyncio.Lock() for _ in ss.ids] for ss, _ in paths]
    out: list[list[CallResult]] = [[] for _ in paths]
    async with client() as cs:
        t_base = time.perf_counter() + 0.05

        async def one(k: int) -> None:
            p, j = k % len(paths), k // len(paths)
            ss, route = paths[p]
            s = j % len(ss.ids)
            planned = k / total
            await asyncio.sleep(max(0.0, t_base + planned - time.perf_counter()))
            async with locks[p][s]:
                r = await _call(cs, route(s), ss.body(s), ss.ids[s], planned, t_base)
                out[p].append(r)

        await asyncio.gather(*(one(k) for k in range(n)))
        wall = time.perf_counter() - t_base
    return out, wall


async def _closed_loop(
    sessions: Sessions, route: Callable[[int], str], duration_s: float
) -> tuple[list[CallResult], float]:
    out: list[CallResult] = []
    async with client() as cs:
        t0 = time.perf_counter()
        end = t0 + duration_s

        async def loop(s: int) -> None:
            while time.perf_counter() < end:
                out.append(
                    await _call(
                        cs, route(s), sessions.body(s), sessions.ids[s], 0.0, time.perf_counter()
                    )
                )

        await asyncio.gather(*(loop(s) for s in range(len(sessions.ids))))
        wall = time.perf_counter() - t0
    return out, wall


def _summarize(results: list[CallResult], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    errs: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errs[r.error or "?"] = errs.get(r.error or "?", 0) + 1
    toks = [r.prompt_tokens for r in ok if r.prompt_tokens]
    return {
        "calls": len(results),
        "errors": len(results) - len(ok),
        "error_kinds": errs,
        "achieved_calls_s": round(len(ok) / wall, 1) if wall > 0 else None,
        "ttft_p50_ms": ms(pct(ttft, 0.5)),
        "ttft_p99_ms": ms(pct(ttft, 0.99)),
        "late_p99_ms": ms(pct([r.late_s for r in results], 0.99)),
        "prompt_tokens_median": int(statistics.median(toks)) if toks else None,
        "wall_s": round(wall, 2),
    }


def kv_layer(url: str) -> dict[str, Any]:
    """What the router's ``/metrics`` says of its KV layer: the mode it runs in, how its
    calls' prompt analyses went, the KV event batches applied (one worker's, with
    ``--workers``: whichever answers)."""
    import httpx

    out: dict[str, Any] = {"mode": None, "analyses": {}, "event_batches": 0.0}
    try:
        text = httpx.get(url + "/metrics", timeout=10.0).text
    except httpx.HTTPError as e:
        return {"error": repr(e)}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, val = line.rsplit(" ", 1)
        if key.startswith("kvroute_kv_layer_mode{") and float(val) == 1.0:
            out["mode"] = key.split('mode="', 1)[1].split('"', 1)[0]
        elif key.startswith("kvroute_kv_analyses_total{"):
            out["analyses"][key.split('outcome="', 1)[1].split('"', 1)[0]] = float(val)
        elif key.startswith("kvroute_kv_event_batches_total"):
            out["event_batches"] += float(val)
    return out


def _keeps_up(row: dict[str, Any], rate: float) -> bool:
    return bool(row["achieved_calls_s"] and row["achieved_calls_s"] >= 0.95 * rate)


def _to(url: str) -> Callable[[int], str]:
    """Every session's calls to ``url`` (a router)."""
    return lambda s: url


def run_agents(
    cfg: AgentConfig, log: Callable[[dict[str, Any]], None] = print
) -> list[dict[str, Any]]:
    from loadtest.sweep.cpuwatch import CpuWatch
    from loadtest.sweep.stack import Router, TwinCluster, cleanup

    rows: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:
        rows.append(row)
        log(row)

    work = Path(tempfile.mkdtemp(prefix="kvroute-bench-scale-"))
    # a GPU pool that holds every session of every path (3 paths' sessions, ~+30 % growth)
    per_twin = 3 * cfg.sessions * (cfg.prompt_tokens * 13 // 10) // BLOCK // cfg.replicas
    twins = TwinCluster(replicas=cfg.replicas, profile=PROFILE, speedup=cfg.speedup,
                        kv_events="tcp://127.0.0.1:*", workdir=work,
                        overrides=[f"gpu_kv_blocks={max(per_twin, 4096)}"])  # fmt: skip
    routers: dict[int, Router] = {}
    try:
        twins.start(timeout_s=120)
        for w in cfg.workers:
            r = Router("kvroute:kv_cost", twins.urls, work, event_endpoints=twins.event_endpoints,
                       block_size=BLOCK, profile=PROFILE, speedup=cfg.speedup,
                       extra_args=["--workers", str(w), "--health-timeout-s",
                                   repr(TWIN_HEALTH_TIMEOUT_S)])  # fmt: skip
            routers[w] = r.start(timeout_s=120)
        paths: dict[str, tuple[Sessions, Callable[[int], str], int | None]] = {}
        urls = twins.urls
        paths["direct"] = (Sessions("direct", cfg, 1), lambda s: urls[s % len(urls)], None)
        rounds = {"direct": cfg.warm_calls}
        for w, r in routers.items():
            paths[f"router:w{w}"] = (Sessions(f"w{w}", cfg, 10 + w), _to(r.url), r.pgid)
            # every worker sees every session: 2 workers, 8 rounds (misses 1 pair in 256)
            rounds[f"router:w{w}"] = cfg.warm_calls * w + 4 * (w - 1)
        t0 = time.perf_counter()
        warm_errors = {name: asyncio.run(_warm(ss, route, rounds[name]))
                       for name, (ss, route, _) in paths.items()}  # fmt: skip
        emit({"name": "agents_setup", "replicas": cfg.replicas, "sessions_per_path": cfg.sessions,
              "prompt_tokens": cfg.prompt_tokens, "turn_tokens": cfg.turn_tokens,
              "speedup": cfg.speedup, "gpu_kv_blocks_per_twin": max(per_twin, 4096),
              "warm_s": round(time.perf_counter() - t0, 1), "warm_rounds": rounds,
              "warm_errors": {k: len(v) for k, v in warm_errors.items()},
              "warm_error_kinds": {k: sorted(set(v)) for k, v in warm_errors.items() if v},
              "load": machine_load()})  # fmt: skip

        def groups(pgid: int | None) -> dict[str, int | None]:
            g: dict[str, int | None] = {"twins": twins.pgid, "client": None}
            if pgid is not None:
                g["router"] = pgid
            return g

        best: dict[str, float] = {}
        direct = paths["direct"]
        for rate in cfg.rates:
            box_limit = False
            for name, (ss, route, pgid) in paths.items():
                if name == "direct":
                    continue
                # the router's path and direct, interleaved call by call at ``rate`` each
                load0 = machine_load()
                watch = CpuWatch(groups(pgid), interval_s=0.5).start()
                p0 = proc_cpu(pgid)
                trial_s = min(max(cfg.trial_s, cfg.min_calls / rate), 4 * cfg.trial_s)
                (rres, dres), wall = asyncio.run(
                    _open_loop([(ss, route), (direct[0], direct[1])], rate, trial_s)
                )
                p1 = proc_cpu(pgid)
                rec = watch.stop()
                load = {"loadavg_before": load0["loadavg"],
                        "realtime_procs": load0["realtime_procs"]}  # fmt: skip
                d = {"name": f"open_direct_beside_{name}_{rate:g}", "part": "agents",
                     "mode": "open", "path": "direct", "offered_calls_s": rate,
                     **_summarize(dres, wall), **load}  # fmt: skip
                d["keeps_up"] = _keeps_up(d, rate)
                row = {"name": f"open_{name}_{rate:g}", "part": "agents", "mode": "open",
                       "path": name, "offered_calls_s": rate, **_summarize(rres, wall)}  # fmt: skip
                row.update(cpu_groups(rec, row["calls"] - row["errors"], "router"))
                row["router_procs_cpu_ms_per_call"] = per_proc(p0, p1, row["calls"])
                row["keeps_up"] = _keeps_up(row, rate)
                row.update(load)
                if row["ttft_p99_ms"] is not None and d["ttft_p99_ms"] is not None:
                    row["added_ttft_p99_ms"] = round(row["ttft_p99_ms"] - d["ttft_p99_ms"], 2)
                    row["added_ttft_p50_ms"] = round(row["ttft_p50_ms"] - d["ttft_p50_ms"], 2)
                    row["within_budget"] = bool(
                        row["keeps_up"] and row["errors"] == 0
                        and row["added_ttft_p99_ms"] <= cfg.added_ttft_budget_ms
                    )  # fmt: skip
                    if row["within_budget"]:
                        best[name] = max(best.get(name, 0.0), rate)
                emit(d)
                emit(row)
                box_limit = box_limit or not d["keeps_up"]
            if box_limit:
                break  # the box's limit: direct itself falls behind
        cap: dict[str, dict[str, Any]] = {}
        if cfg.capacity:
            for name, (ss, route, pgid) in paths.items():
                load0 = machine_load()
                watch = CpuWatch(groups(pgid), interval_s=0.5).start()
                p0 = proc_cpu(pgid)
                res, wall = asyncio.run(_closed_loop(ss, route, cfg.trial_s))
                p1 = proc_cpu(pgid)
                rec = watch.stop()
                row = {"name": f"capacity_{name}", "part": "agents", "mode": "closed",
                       "path": name, "concurrency": cfg.sessions}  # fmt: skip
                row.update(_summarize(res, wall))
                row.update(
                    cpu_groups(rec, row["calls"] - row["errors"], "router" if pgid else None)
                )
                if pgid is not None:
                    row["router_procs_cpu_ms_per_call"] = per_proc(p0, p1, row["calls"])
                row["loadavg_before"] = load0["loadavg"]
                row["realtime_procs"] = load0["realtime_procs"]
                cap[name] = row
                emit(row)
        summary: dict[str, Any] = {"name": "agents_summary", "part": "agents",
                                   "target_calls_s": 200, "target_added_ttft_p99_ms": 10.0,
                                   "target_scaling_w2": 1.8}  # fmt: skip
        for w in cfg.workers:
            name = f"router:w{w}"
            summary[f"w{w}_max_rate_within_budget"] = best.get(name, 0.0)
            c = cap.get(name)
            if c:
                summary[f"w{w}_capacity_calls_s"] = c["achieved_calls_s"]
                cpc = c.get("router_cpu_ms_per_call")
                summary[f"w{w}_router_cpu_ms_per_call"] = cpc
                if cpc:
                    summary[f"w{w}_calls_s_per_router_core"] = round(1e3 / cpc, 1)
        if "direct" in cap:
            summary["direct_capacity_calls_s"] = cap["direct"]["achieved_calls_s"]
        for w, r in routers.items():
            summary[f"w{w}_kv_layer"] = kv_layer(r.url)
        c1, c2 = cap.get("router:w1"), cap.get("router:w2")
        if c1 and c2 and c1["achieved_calls_s"]:
            summary["scaling_w2_vs_w1"] = round(c2["achieved_calls_s"] / c1["achieved_calls_s"], 2)
        summary["load_after"] = machine_load()
        emit(summary)
    finally:
        for r in routers.values():
            r.stop()
        twins.stop()
        cleanup(work)
    return rows
