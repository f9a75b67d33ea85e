"""The router at agent scale (issue 45's targets): agent calls per second one router process
sustains with the KV layer on, ``--workers 2``'s scaling, and 2,000 concurrent streams at the
router's defaults.

Two parts, each against twins (``kvroute cluster``, :class:`loadtest.sweep.stack.TwinCluster`)
and ``kvroute serve`` (:class:`loadtest.sweep.stack.Router`) in their own processes, the load
generator in this one; the CPU each used comes from ``/proc`` (:mod:`loadtest.sweep.cpuwatch`).

**agents** (targets: ≥ 200 calls/s from one router process, added TTFT p99 ≤ 10 ms against
direct-to-replica; ``--workers 2`` ≥ 1.8×). Agent sessions of real shape: an agent type's
shared system prompt (~8k tokens), the session's own context (the rest of ``prompt_tokens``,
100k by default), then one exchange per call (an assistant reply and a user/tool turn,
``turn_tokens``), streamed, ``max_tokens`` 16 — text from the tiny model's vocabulary, ~1 token
a word. Twins in simulated time at a high ``--speedup`` (1000: a 1k-token prefill on the
H200 profile is well under a millisecond of wall time) and a GPU pool that holds every session,
so the engine is not what is measured. The router runs ``kv_cost`` with the KV layer on:
the twins' tokenizer, their KV events (each twin binds its own endpoint), the profile; its
health-check timeout is raised to ``TWIN_HEALTH_TIMEOUT_S`` (the twins' loop, not the router,
stalls on a cold 100k-token prompt), every other setting is its default.

Three paths, each with its own sessions (warmed with ``warm_calls`` unmeasured calls per
router worker, each on a new connection, so the router's workers and the twins hold every
session's tokens and blocks): ``direct`` (session ``s`` always to twin ``s % replicas``),
``router:w1`` and ``router:w2`` (``--workers`` 1 and 2).

* ``open`` rows: open-loop arrivals at each rate of ``rates`` for ``trial_s`` seconds (longer
  at low rates: ``min_calls`` a path, for a p99), round-robin over the path's sessions (a
  session's calls never overlap: a call waits for its session's previous one). A router's
  path and direct run together, their calls interleaved one by one at the rate each, so
  both see the same machine. Per path: achieved calls/s, TTFT p50/p99 (request sent → first
  token's chunk), errors, how late calls left (a path that cannot keep up falls behind), the
  cores each process group used and the router's CPU per call by process.
  ``added_ttft_p99_ms``: the router's TTFT p99 minus direct's in the same trial. The ramp
  stops once direct itself cannot keep up (the box's limit, not the router's).
* ``capacity`` rows: closed loop, every session of the path calling back to back for
  ``trial_s``: the calls/s the path gives on this box and the router's CPU per call.
  ``scaling_w2_vs_w1`` is router:w2's capacity over router:w1's.
* ``summary``: the highest rate whose router TTFT p99 stayed within ``added_ttft_budget_ms``
  of direct with the router keeping up (achieved ≥ 95 % of offered), per worker count; the
  router process's CPU per call and the calls/s one core would give at that cost.

**streams** (target: 2,000 concurrent streams at the defaults with 0 errors): ``streams``
streamed chat calls opened at once through a router with every default (its default policy,
connection limits and timeouts), twins in slowed time (``stream_speedup`` < 1) so each reply
of ``stream_tokens`` tokens takes many seconds. Reported: calls answered in full (``[DONE]``
seen), errors by kind, peak calls in flight and peak answered streams open (head received),
the time to the response head (``head_*``: calls past the router's default upstream limit,
``max_connections`` 1,024, wait in its pool, up to ``pool_timeout_s`` 60 s, so streams past
1,024 must end within it) and to the first token, the router's peak RSS and CPU, where it
placed the calls and its peak calls in flight per replica (a call waits for its replica's
pool, ``max_connections_per_replica`` 256, and is not moved: an uneven placement makes the
waits of the calls past 256 on one replica longer), the distinct error bodies and the router
log's warnings.

Every row carries the machine's load (``/proc/loadavg`` before and after, and the other
processes running at real-time priority: other benchmarks). On a box with fewer cores than
router workers + load generator + twins, read the CPU columns, not the rates: a rate is what
the box gave, the router's CPU per call is what it costs.

    python -m loadtest.bench.bench_scale [--part agents|streams|all] [--quick] [--out FILE]
    python -m loadtest.benchmarks --only scale [--quick]   # both parts, small sizes with --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# ``make bench`` lists it; ``--only scale`` runs it (``--quick``: seconds)
SLOW = "twins, 3 routers and 2,000 streams: ~5 min; --only scale [--quick]"

PROFILE = "h200-70b-fp8"
BLOCK = 64  # the profile's block size: the router's KV layer hashes the same blocks
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
    warm_calls: int = 2  # per worker
    min_calls: int = 100  # per path and open-loop trial (longer trials at low rates)
    workers: list[int] = field(default_factory=lambda: [1, 2])
    added_ttft_budget_ms: float = 10.0
    capacity: bool = True


@dataclass
class StreamConfig:
    streams: int = 2000
    replicas: int = 4
    max_num_seqs: int = 256  # per twin: the router's 1,024 upstream connections all decode
    stream_tokens: int = 60
    # slowed time: ~0.25 s a token at 256 a twin on the H200 profile, ~30 s a stream, so the
    # calls past the router's 1,024 upstream connections wait well within pool_timeout_s (60)
    stream_speedup: float = 0.1
    timeout_s: float = 240.0


QUICK_AGENTS = AgentConfig(
    replicas=2, sessions=4, prompt_tokens=4_000, turn_tokens=50, rates=[5], trial_s=2.0,
    warm_calls=1, min_calls=5, workers=[1, 2], capacity=True,
)  # fmt: skip
# streams of a few seconds: the router's in-flight calls are scraped every 2 s
QUICK_STREAMS = StreamConfig(streams=20, replicas=2, max_num_seqs=64, stream_tokens=16,
                             stream_speedup=0.1, timeout_s=60.0)  # fmt: skip


# --- the machine ---------------------------------------------------------------------------


def machine_load() -> dict[str, Any]:
    """``/proc/loadavg`` and the processes at real-time priority (other benchmarks)."""
    out: dict[str, Any] = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        out["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        out["loadavg"] = None
    try:
        ps = subprocess.run(["ps", "-eo", "cls=,comm="], capture_output=True, text=True,
                            timeout=10).stdout.split("\n")  # fmt: skip
        rt: dict[str, int] = {}
        for line in ps:
            parts = line.split(None, 1)
            if len(parts) == 2 and parts[0] in ("RR", "FF"):
                rt[parts[1]] = rt.get(parts[1], 0) + 1
        # kernel threads (migration/N, ...) run FF too: only user processes are benches
        out["realtime_procs"] = {k: v for k, v in rt.items() if not k.startswith(
            ("migration", "watchdog", "idle_inject", "irq/", "rcu"))}  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        out["realtime_procs"] = None
    out["cpus"] = os.cpu_count()
    return out


def _group_rss_mb(pgid: int | None) -> float:
    """RSS of every process in ``pgid`` but its leader (the reaper), MiB."""
    from loadtest.sweep.cpuwatch import _group_pids

    if pgid is None:
        return 0.0
    total = 0
    for pid in _group_pids(pgid):
        if pid == pgid:
            continue
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return total * os.sysconf("SC_PAGE_SIZE") / 2**20


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 2)


# --- agent sessions ------------------------------------------------------------------------


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


def _client(limit: int = 0) -> Any:
    import aiohttp

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit),
        timeout=aiohttp.ClientTimeout(total=None, sock_read=120),
    )


async def _warm(sessions: Sessions, route: Callable[[int], str], rounds: int) -> list[str]:
    """Each session's first ``rounds`` calls, unmeasured (cold tokenization, KV placement).
    Every call on a new connection, so behind ``--workers N`` (``SO_REUSEPORT`` places a
    connection, not a call) a session's calls land on the workers at random and each worker
    has most likely seen it (with ``rounds`` = 2 N, a given worker misses a given session with
    odds 4^-N)."""
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
    async with _client() as cs:
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
    async with _client() as cs:
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
        "ttft_p50_ms": _ms(_pct(ttft, 0.5)),
        "ttft_p99_ms": _ms(_pct(ttft, 0.99)),
        "late_p99_ms": _ms(_pct([r.late_s for r in results], 0.99)),
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


def _proc_cpu(pgid: int | None) -> dict[int, tuple[str, float]]:
    """pid -> (what it is, CPU seconds) for each process of a router's group: ``serve`` (a
    router process: the one, or with ``--workers`` the parent and each worker), ``analysis``
    (a multiprocessing child: the prompt analysis off the loop), ``reaper``."""
    from loadtest.sweep.cpuwatch import _group_pids

    out: dict[int, tuple[str, float]] = {}
    if pgid is None:
        return out
    tick = os.sysconf("SC_CLK_TCK")
    for pid in _group_pids(pgid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        f = stat[stat.rindex(")") + 2 :].split()
        what = ("reaper" if "loadtest.reaper" in cmd
                else "analysis" if "multiprocessing" in cmd else "serve")  # fmt: skip
        out[pid] = (what, (int(f[11]) + int(f[12])) / tick)
    return out


def _per_proc(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], calls: int
) -> dict[str, float]:
    """The router group's CPU per call (ms) by process, busiest first within a kind."""
    if not calls:
        return {}
    used: dict[str, list[float]] = {}
    for pid, (what, cpu) in after.items():
        used.setdefault(what, []).append(cpu - before.get(pid, (what, 0.0))[1])
    out: dict[str, float] = {}
    for what, xs in sorted(used.items()):
        for i, x in enumerate(sorted(xs, reverse=True)):
            out[what if len(xs) == 1 else f"{what}{i + 1}"] = round(x * 1e3 / calls, 2)
    return out


def _cpu_groups(rec: dict[str, Any], calls: int, router: str | None) -> dict[str, Any]:
    """Cores each group used over the trial; the router's CPU per call."""
    out: dict[str, Any] = {}
    if not rec.get("available"):
        return {"cpu": "not measured (no /proc)"}
    el = rec["elapsed_s"] or 1.0
    for name, g in rec["groups"].items():
        out[f"{name}_cores"] = g["mean_cores"]
        out[f"{name}_wait_share"] = g["wait_share"]
        if name == router and calls:
            out["router_cpu_ms_per_call"] = round(g["mean_cores"] * el * 1e3 / calls, 2)
            out["router_busiest_thread_p90"] = g["busiest_thread_p90"]
    out["machine_busy_cores"] = rec["machine"]["busy_cores"]
    out["saturated"] = rec["saturated"]
    return out


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
            u = r.url
            paths[f"router:w{w}"] = (Sessions(f"w{w}", cfg, 10 + w), lambda s, u=u: u, r.pgid)
            rounds[f"router:w{w}"] = cfg.warm_calls * w  # every worker sees every session
        t0 = time.perf_counter()
        warm_errors = {name: asyncio.run(_warm(ss, route, rounds[name]))
                       for name, (ss, route, _) in paths.items()}  # fmt: skip
        emit({"name": "agents_setup", "replicas": cfg.replicas, "sessions_per_path": cfg.sessions,
              "prompt_tokens": cfg.prompt_tokens, "turn_tokens": cfg.turn_tokens,
              "speedup": cfg.speedup, "gpu_kv_blocks_per_twin": max(per_twin, 4096),
              "warm_s": round(time.perf_counter() - t0, 1),
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
                p0 = _proc_cpu(pgid)
                trial_s = min(max(cfg.trial_s, cfg.min_calls / rate), 4 * cfg.trial_s)
                (rres, dres), wall = asyncio.run(
                    _open_loop([(ss, route), (direct[0], direct[1])], rate, trial_s)
                )
                p1 = _proc_cpu(pgid)
                rec = watch.stop()
                load = {"loadavg_before": load0["loadavg"],
                        "realtime_procs": load0["realtime_procs"]}  # fmt: skip
                d = {"name": f"open_direct_beside_{name}_{rate:g}", "part": "agents",
                     "mode": "open", "path": "direct", "offered_calls_s": rate,
                     **_summarize(dres, wall), **load}  # fmt: skip
                d["keeps_up"] = _keeps_up(d, rate)
                row = {"name": f"open_{name}_{rate:g}", "part": "agents", "mode": "open",
                       "path": name, "offered_calls_s": rate, **_summarize(rres, wall)}  # fmt: skip
                row.update(_cpu_groups(rec, row["calls"] - row["errors"], "router"))
                row["router_procs_cpu_ms_per_call"] = _per_proc(p0, p1, row["calls"])
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
                p0 = _proc_cpu(pgid)
                res, wall = asyncio.run(_closed_loop(ss, route, cfg.trial_s))
                p1 = _proc_cpu(pgid)
                rec = watch.stop()
                row = {"name": f"capacity_{name}", "part": "agents", "mode": "closed",
                       "path": name, "concurrency": cfg.sessions}  # fmt: skip
                row.update(_summarize(res, wall))
                row.update(
                    _cpu_groups(rec, row["calls"] - row["errors"], "router" if pgid else None)
                )
                if pgid is not None:
                    row["router_procs_cpu_ms_per_call"] = _per_proc(p0, p1, row["calls"])
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


# --- streams -------------------------------------------------------------------------------


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

    async with _client() as cs:

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
                rss_peak = max(rss_peak, _group_rss_mb(pgid))
                if k % 4 == 0:  # the router's calls in flight per replica, every 2 s
                    try:
                        async with cs.get(url + "/metrics") as m:
                            for rep, n in _by_replica(await m.text(), "kvroute_inflight{").items():
                                inflight_peak[rep] = max(inflight_peak.get(rep, 0), int(n))
                    except aiohttp.ClientError:
                        pass
                k += 1
                await asyncio.sleep(0.5)

        rss0 = _group_rss_mb(pgid)
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
        rss_after = _group_rss_mb(pgid)
        async with cs.get(url + "/metrics") as m:
            placed = _by_replica(await m.text(), "kvroute_requests_total{")
    return {
        "streams": cfg.streams,
        "ok": len(took),
        "errors": cfg.streams - len(took),
        "error_kinds": errors,
        "peak_in_flight": peak_in_flight,
        "peak_answered_open": peak_open,
        "head_p50_s": round(_pct(head, 0.5) or 0.0, 2),
        "head_max_s": round(max(head, default=0.0), 2),
        "ttft_p50_s": round(_pct(ttft, 0.5) or 0.0, 2),
        "ttft_max_s": round(max(ttft, default=0.0), 2),
        "duration_p50_s": round(_pct(took, 0.5) or 0.0, 2),
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
        row.update(_cpu_groups(rec, 0, "router"))
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


# --- entry points --------------------------------------------------------------------------


def run(quick: bool = False) -> list[dict[str, Any]]:
    """``make bench``: both parts (``quick``: a few sessions of 4k tokens, 20 streams)."""
    if quick:
        return run_agents(QUICK_AGENTS, log=lambda r: None) + run_streams(
            QUICK_STREAMS, log=lambda r: None
        )
    return run_agents(AgentConfig(), log=lambda r: None) + run_streams(
        StreamConfig(), log=lambda r: None
    )


# (row name, field, what it is) for :func:`summarize`: the figures the targets are judged on
SUMMARY_FIELDS = [
    ("agents_summary", "w1_capacity_calls_s", "router --workers 1: calls/s (closed loop)"),
    ("agents_summary", "w2_capacity_calls_s", "router --workers 2: calls/s (closed loop)"),
    ("agents_summary", "direct_capacity_calls_s", "direct to twins: calls/s (closed loop)"),
    ("agents_summary", "scaling_w2_vs_w1", "--workers 2 / --workers 1 (closed loop)"),
    ("agents_summary", "w1_router_cpu_ms_per_call", "router CPU ms a call, --workers 1"),
    ("agents_summary", "w1_calls_s_per_router_core", "calls/s one router core gives"),
    ("agents_summary", "w2_router_cpu_ms_per_call", "router CPU ms a call, --workers 2"),
    ("agents_summary", "w1_max_rate_within_budget", "highest rate, added TTFT p99 <= 10 ms, w1"),
    ("agents_summary", "w2_max_rate_within_budget", "highest rate, added TTFT p99 <= 10 ms, w2"),
]


def summarize(paths: list[str]) -> str:
    """A markdown table of the headline figures over repeated runs' JSON: min / median / max,
    then each open-loop rate's added TTFT p99 and the streams' errors and RSS."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    rows_by = [{r["name"]: r for r in d["rows"]} for d in docs]

    def mmm(xs: list[Any]) -> str:
        xs = [x for x in xs if isinstance(x, (int, float))]
        if not xs:
            return "–"
        return f"{min(xs):g} / {statistics.median(xs):g} / {max(xs):g}"

    out = [f"| figure ({len(docs)} files: min / median / max) | value |", "|---|---|"]
    for row, fld, what in SUMMARY_FIELDS:
        vals = [rb.get(row, {}).get(fld) for rb in rows_by]
        if any(v is not None for v in vals):
            out.append(f"| {what} | {mmm(vals)} |")
    names = {n for rb in rows_by for n in rb if n.startswith("open_router:")}
    for n in sorted(names, key=lambda n: (n.rsplit("_", 1)[0], float(n.rsplit("_", 1)[1]))):
        got = [rb[n] for rb in rows_by if n in rb]
        ach = mmm([g.get("achieved_calls_s") for g in got])
        p50 = mmm([g.get("added_ttft_p50_ms") for g in got])
        p99 = mmm([g.get("added_ttft_p99_ms") for g in got])
        out.append(f"| {n}: added TTFT ms (achieved calls/s {ach}) | p50 {p50}; p99 {p99} |")
    for n in sorted({n for rb in rows_by for n in rb if n.startswith("streams_")}):
        got = [rb[n] for rb in rows_by if n in rb]
        out.append(f"| {n}: errors | {mmm([g.get('errors') for g in got])} |")
        rss = [g.get("router_rss_peak_mb") for g in got]
        out.append(f"| {n}: router RSS peak MB | {mmm(rss)} |")
        out.append(f"| {n}: longest pool wait s | {mmm([g.get('head_max_s') for g in got])} |")
    loads = [d.get("started", {}).get("loadavg") for d in docs]
    out.append(f"| loadavg at start | {'; '.join(' '.join(x) for x in loads if x)} |")
    return "\n".join(out)


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.bench_scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--part", choices=("agents", "streams", "all"), default="all")
    ap.add_argument(
        "--summarize", nargs="+", metavar="JSON", help="print a table over runs' --out files"
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the test's)")
    ap.add_argument(
        "--out", default=None, help="write {config, rows} as JSON here (and as rows land)"
    )
    a = AgentConfig()
    ap.add_argument("--replicas", type=int, default=a.replicas)
    ap.add_argument("--sessions", type=int, default=a.sessions)
    ap.add_argument("--prompt-tokens", type=int, default=a.prompt_tokens)
    ap.add_argument("--turn-tokens", type=int, default=a.turn_tokens)
    ap.add_argument("--speedup", type=float, default=a.speedup)
    ap.add_argument("--rates", type=_floats, default=a.rates)
    ap.add_argument("--trial-s", type=float, default=a.trial_s)
    ap.add_argument("--warm-calls", type=int, default=a.warm_calls)
    ap.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=a.workers)
    ap.add_argument("--no-capacity", action="store_true")
    s = StreamConfig()
    ap.add_argument("--streams", type=int, default=s.streams)
    ap.add_argument("--stream-replicas", type=int, default=s.replicas)
    ap.add_argument("--stream-tokens", type=int, default=s.stream_tokens)
    ap.add_argument("--stream-speedup", type=float, default=s.stream_speedup)
    ap.add_argument("--max-num-seqs", type=int, default=s.max_num_seqs)
    ap.add_argument("--stream-timeout-s", type=float, default=s.timeout_s)
    args = ap.parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    if args.quick:
        acfg, scfg = QUICK_AGENTS, QUICK_STREAMS
    else:
        acfg = AgentConfig(replicas=args.replicas, sessions=args.sessions,
                           prompt_tokens=args.prompt_tokens, turn_tokens=args.turn_tokens,
                           speedup=args.speedup, rates=args.rates, trial_s=args.trial_s,
                           warm_calls=args.warm_calls, workers=args.workers,
                           capacity=not args.no_capacity)  # fmt: skip
        scfg = StreamConfig(streams=args.streams, replicas=args.stream_replicas,
                            max_num_seqs=args.max_num_seqs, stream_tokens=args.stream_tokens,
                            stream_speedup=args.stream_speedup,
                            timeout_s=args.stream_timeout_s)  # fmt: skip
    doc: dict[str, Any] = {"argv": sys.argv, "agents": asdict(acfg), "streams": asdict(scfg),
                           "started": machine_load(), "rows": []}  # fmt: skip
    out = Path(args.out) if args.out else None

    def log(row: dict[str, Any]) -> None:
        print(json.dumps(row), flush=True)
        doc["rows"].append(row)
        if out is not None:  # partial results as they land
            out.write_text(json.dumps(doc, indent=1))

    if args.part in ("agents", "all"):
        run_agents(acfg, log=log)
    if args.part in ("streams", "all"):
        run_streams(scfg, log=log)
    doc["finished"] = machine_load()
    if out is not None:
        out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
