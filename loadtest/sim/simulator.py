"""In-process discrete-event simulator: many twin engines, one routing function, no HTTP.

Owns: driving N :class:`loadtest.twin.engine.Engine` instances (the same engine model the
HTTP twin runs) through simulated time with a heap of events — session calls arriving, engine
steps ending, tier loads completing — and handing each arriving call to a pluggable
``route(call, replicas) -> index``; plus per-request records and a summary in AgentX terms.
Also :func:`synthetic_agentx`, the AgentX-like synthetic sessions for sweeps (the shape is
:func:`loadtest.traces.synthetic.agentx_chains`). No sockets, no asyncio; must not
import aiohttp, zmq, torch or vllm.

Timing: a call reaches its replica's engine ``request_overhead_s`` after it is issued (the
API server's share, as in the HTTP twin); TTFT counts from the issue time.

Cluster pool: with the profile's ``pool_kv_blocks``, the engines share one
:class:`loadtest.twin.engine.ClusterPool` (a block any engine wrote is found by all).

Speed: decode-only stretches are advanced as *bursts* (several steps in one event, each step's
time still from the step model) whenever no block boundary, finish or waiting request can
occur inside them; an arrival at a replica cuts its burst at the next step boundary, so the
result is step-exact, just cheaper.

Workload semantics (closed loop, like AgentX replays): a session's call k+1 is issued
``think_s`` after call k finishes; every call's prompt is the session's whole context so far
(previous prompt + its output + the new tool result / user turn), so prefix sharing inside a
session is exact; the first ``shared_prefix_tokens`` (tools + system prompt) are identical
across sessions when the workload says so.

DAG sessions (:class:`DagSession`, e.g. real traces via :mod:`loadtest.sim.trace`): each
:class:`TraceCall` carries its own prompt (length and full-block keys) and starts ``delay_s``
after all its dependencies *end* (end-to-start), or ``start_delay_s`` after its session starts
when it has none, and never before ``not_before_s`` after its session starts when that is set
(aiperf's absolute turn timestamps). A :class:`SessionFeed` chains sessions on closed-loop
lanes: when a lane's session has ended (its last call finished), the feed is asked for the
lane's next one.
Subagent calls are routed as their own sessions (``f"{session}/{agent}"``) with a parent.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from costmodel.profiles import ReplicaProfile
from engine_patches.retention_rule import parse_hint
from loadtest.metrics import SIZE_CLASSES, CallNumbers, UnlimitedCache, agentx_numbers, size_class
from loadtest.traces.synthetic import agentx_chains
from loadtest.twin.engine import RUNNING, ClusterPool, Engine, EnginePlugin, Request, Step
from loadtest.twin.truth import Truth

MASK64 = (1 << 64) - 1


def _stable64(text: str) -> int:
    """A 64-bit hash of ``text`` that does not change between processes."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


# ---- workload -------------------------------------------------------------------------------


@dataclass(slots=True)
class Call:
    """One model call of a session: tokens appended since the previous call (its output is
    counted by the simulator itself), tokens to generate, idle time before it."""

    new_tokens: int
    output_tokens: int
    think_s: float = 0.0


@dataclass(slots=True)
class Session:
    id: str
    start: float
    calls: list[Call]
    shared_prefix_tokens: int = 0  # leading tokens identical across sessions (tools+system)


def synthetic_agentx(
    n_sessions: int,
    duration_s: float,
    *,
    seed: int = 0,
    shared_prefix_tokens: int = 15_000,
    first_call_tokens: int = 20_000,
    turn_tokens_median: float = 2_000,
    output_median: float = 300,
    think_median_s: float = 18.0,
    think_p90_s: float = 130.0,
    calls_mean: float = 46.0,
    max_context: int = 250_000,
) -> list[Session]:
    """Sessions shaped like the public Claude Code traces (see shared/data/README.md):
    ~15k tokens of tools+system prompt, contexts growing by a few thousand tokens a call to
    ~100k, a few hundred output tokens, think times with median 18 s and p90 130 s
    (log-normal), ~46 calls (geometric), session starts uniform over ``duration_s``.

    The shape is :func:`loadtest.traces.synthetic.agentx_chains` (the one AgentX-like
    generator, also behind the replay's ``synthetic:...`` traces), seen as simulator
    sessions."""
    chains = agentx_chains(
        n_sessions,
        duration_s,
        seed=seed,
        shared_prefix_tokens=shared_prefix_tokens,
        first_call_tokens=first_call_tokens,
        turn_tokens_median=turn_tokens_median,
        output_median=output_median,
        think_median_s=think_median_s,
        think_sigma=math.log(think_p90_s / think_median_s) / 1.2816,
        calls_mean=calls_mean,
        max_context=max_context,
    )
    return [
        Session(
            f"s{ch.index}",
            ch.start_s,
            [Call(c.new_tokens, c.output_tokens, c.think_s) for c in ch.calls],
            ch.shared_prefix_tokens,
        )
        for ch in chains
    ]


@dataclass(slots=True)
class TraceCall:
    """One call of a :class:`DagSession`: its whole prompt (``prompt_tokens``, and the keys of
    its full blocks in the simulated profile's block size, chained: equal key at position i
    means equal prompt up to and including block i), tokens to generate, and when it starts:
    ``delay_s`` after the last of its dependencies (``(index of an earlier call, delay_s)``)
    ends, or ``start_delay_s`` after the session starts if it has none; in both cases not
    before ``not_before_s`` after the session starts, when set."""

    prompt_tokens: int
    output_tokens: int
    block_keys: Sequence[int]
    deps: tuple[tuple[int, float], ...] = ()
    start_delay_s: float = 0.0
    not_before_s: float | None = None
    agent: str = "main"
    id: str = ""  # the trace's call id (information only)


@dataclass(slots=True)
class DagSession:
    """A session whose calls form a DAG (topological order: deps point to earlier calls).

    Calls of ``main_agent`` are routed as session ``id``; a subagent's as ``f"{id}/{agent}"``
    with ``parent_session=id``. ``start`` is when it starts if handed to :meth:`Simulator.run`
    directly (a :class:`SessionFeed` starts its sessions itself)."""

    id: str
    calls: list[TraceCall]
    start: float = 0.0
    main_agent: str = "main"

    def __post_init__(self) -> None:
        if not self.calls:
            raise ValueError(f"session {self.id}: no calls")
        for k, c in enumerate(self.calls):
            for d, delay in c.deps:
                if not 0 <= d < k:
                    raise ValueError(f"session {self.id}: call {k} depends on {d}, not earlier")
                if delay < 0:
                    raise ValueError(f"session {self.id}: negative delay on call {k}")
            if c.not_before_s is not None and c.not_before_s < 0:
                raise ValueError(f"session {self.id}: negative not_before_s on call {k}")


class SessionFeed(Protocol):
    """Closed-loop lanes: ``lanes`` sessions in flight, one per lane; when a lane's session
    ends at ``now``, ``next_session(lane, now)`` gives the lane's next one (None: the lane
    stops). At start, each lane in order is asked once at time 0."""

    lanes: int

    def next_session(self, lane: int, now: float) -> DagSession | None: ...


# ---- the replicas' read-only view for routing ----------------------------------------------


@dataclass(slots=True)
class CallView:
    """What a routing function sees of an arriving call."""

    session_id: str
    call_index: int
    prompt_tokens: int
    block_keys: list[int]
    max_tokens: int
    now: float
    final: bool = False  # the session's (for a subagent: the agent's) last call
    agent_id: str | None = None  # a subagent's name (None: the session's main agent)
    parent_session: str | None = None  # a subagent call's root session id


class ReplicaView:
    """Read-only view of one simulated replica for routing functions."""

    __slots__ = ("_eng", "index")

    def __init__(self, index: int, engine: Engine):
        self.index = index
        self._eng = engine

    @property
    def num_running(self) -> int:
        return len(self._eng.running)

    @property
    def num_waiting(self) -> int:
        return len(self._eng.waiting)

    @property
    def kv_usage(self) -> float:
        return self._eng.kv_usage()

    @property
    def host_retained(self) -> float | None:
        """Share of the host tier held for paused sessions: the engine plugin's gauge
        (``vllm:kv_offload_cpu_retained_perc``); None without the plugin's retention."""
        cpu = self._eng.cpu
        return None if cpu is None else cpu.retained_share(self._eng.now)

    @property
    def pending_prefill_gauge(self) -> float | None:
        """The engine plugin's ``vllm:num_pending_prefill_tokens`` as a live router scrapes it:
        exported only where the cadence scheduler and a host tier are both on, as on real vLLM
        (:meth:`loadtest.twin.engine.Engine.pending_prefill_gauge`)."""
        g = self._eng.pending_prefill_gauge()
        return None if g is None else float(g)

    @property
    def profile(self) -> ReplicaProfile:
        return self._eng.profile

    def pending_prefill_tokens(self) -> int:
        e = self._eng
        return sum(r.num_tokens - r.num_computed for r in e.waiting) + sum(
            r.num_tokens - r.num_computed for r in e.running if r.num_output == 0
        )

    def cached_blocks(self, keys: Sequence[int]) -> tuple[int, int, int]:
        """(gpu, cpu, storage) blocks of the longest cached prefix of ``keys`` (the cluster
        pool's count as storage, as the router's index files them)."""
        e = self._eng
        gpu = len(e.pool.match(keys, len(keys)))
        cpu = sto = 0
        cpool = e.cluster_pool
        for k in keys[gpu:]:
            if e.cpu is not None and k in e.cpu:
                cpu += 1
            elif (e.storage is not None and k in e.storage) or (cpool is not None and k in cpool):
                sto += 1
            else:
                break
        return gpu, cpu, sto


RouteFn = Callable[[CallView, Sequence[ReplicaView]], int]


def route_round_robin() -> RouteFn:
    counter = iter(range(1 << 62))

    def route(call: CallView, replicas: Sequence[ReplicaView]) -> int:
        return next(counter) % len(replicas)

    return route


def route_fewest_requests() -> RouteFn:
    def route(call: CallView, replicas: Sequence[ReplicaView]) -> int:
        return min(replicas, key=lambda r: (r.num_running + r.num_waiting, r.kv_usage)).index

    return route


def route_sticky_spill(max_waiting: int = 4) -> RouteFn:
    """Keep a session on its replica unless that replica has a queue; new sessions go to
    the replica with the fewest requests. (Not the router's ``session_affinity``, which is
    bounded-load consistent hashing.)"""
    home: dict[str, int] = {}
    least = route_fewest_requests()

    def route(call: CallView, replicas: Sequence[ReplicaView]) -> int:
        r = home.get(call.session_id)
        if r is None or replicas[r].num_waiting > max_waiting:
            r = least(call, replicas)
            home[call.session_id] = r
        return r

    return route


def route_exact_cache(load_weight_s: float = 2.0) -> RouteFn:
    """Score = estimated uncached prefill tokens + queue, read from every engine's own cache
    (an oracle no router has; not sglang-router's ``cache_aware``). Cost
    O(replicas x prompt blocks): fine for tens of replicas, slow for sweeps of hundreds)."""

    def route(call: CallView, replicas: Sequence[ReplicaView]) -> int:
        best, best_cost = 0, float("inf")
        for r in replicas:
            g, c, s = r.cached_blocks(call.block_keys)
            bs = r.profile.block_size
            uncached = call.prompt_tokens - (g + 0.5 * c + 0.2 * s) * bs
            cost = uncached + r.pending_prefill_tokens() + load_weight_s * 1000 * r.num_waiting
            if cost < best_cost:
                best, best_cost = r.index, cost
        return best

    return route


# Simulator-only routing functions. Their names are not the router's policy names: the
# router's own pipelines run here through loadtest.sim.router_policy.RouterPolicy.
ROUTERS: dict[str, Callable[[], RouteFn]] = {
    "round_robin": route_round_robin,  # the same rule as the router's round_robin
    "fewest_requests": route_fewest_requests,
    "sticky_spill": route_sticky_spill,
    "exact_cache": route_exact_cache,
}


# ---- the simulator --------------------------------------------------------------------------


@dataclass(slots=True)
class CallRecord:
    session_id: str
    call_index: int
    replica: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    first_token: float
    finish: float
    preemptions: int
    agent: str | None = None  # DAG sessions: the call's agent ("main" for the root)
    bound_cached_tokens: int | None = None  # DAG sessions: unlimited-cache prefix hit

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.output_tokens - 1)


@dataclass
class SimResult:
    records: list[CallRecord]
    sim_time_s: float
    wall_s: float
    replicas: int
    events: int
    steps: int
    sessions_done: int
    sessions: int
    engine_busy_s: list[float] = field(default_factory=list)
    tier_hit_blocks: dict[str, int] = field(default_factory=dict)
    gpus_per_replica: int = 1  # the profile's tensor-parallel size
    failed: int = 0  # DAG calls refused (prompt + output over max_model_len)
    cut: bool = False  # stopped by ``until`` with work left: ``sim_time_s`` is ``until``
    session_spans: list[tuple[float, float]] = field(default_factory=list)  # DAG: start, end
    # DAG sessions completed: (session id, start, end, calls) — the size classes' input
    session_runs: list[tuple[str, float, float, int]] = field(default_factory=list)

    @property
    def gpus(self) -> int:
        return self.replicas * self.gpus_per_replica

    def summary(self, warmup_s: float = 0.0) -> dict[str, Any]:
        """AgentX numbers in simulated seconds, by :func:`loadtest.metrics.agentx_numbers`
        (the HTTP replay's definitions: TPOT over calls with ≥2 output tokens, interactivity
        = 1 / P90 TPOT, tokens per GPU-second over ``sim_time_s``); where there is nothing to
        measure, NaN (TPOT, interactivity) or 0 (hit ratio) as before. ``warmup_s``: only
        calls (and completed sessions) that arrived (started) after it count, over the time
        after it. Session completion p50/p90 over DAG sessions that finished."""
        r = [x for x in self.records if x.arrival >= warmup_s] if warmup_s else self.records
        span = self.sim_time_s - warmup_s
        if not r or span <= 0:
            return {"requests": 0, "wall_s": round(self.wall_s, 2)}
        n = agentx_numbers(
            (
                CallNumbers(x.ttft, x.tpot, x.prompt_tokens, x.output_tokens, x.cached_tokens,
                            x.bound_cached_tokens)
                for x in r
            ),
            wall_s=span,
            gpus=self.gpus,
        )  # fmt: skip
        nan = float("nan")
        done = sorted(e - s for s, e in self.session_spans if s >= warmup_s)
        out = {
            "requests": len(r),
            "sessions_done": self.sessions_done,
            "sessions": self.sessions,
            "ttft_p50_s": n["ttft_p50_s"],
            "ttft_p90_s": n["ttft_p90_s"],
            "ttft_p99_s": n["ttft_p99_s"],
            "tpot_p90_s": _or(n["tpot_p90_s"], nan),
            "p90_interactivity_tok_s": _or(n["p90_interactivity_tok_s"], nan),
            "cache_hit_ratio": _or(n["cache_hit_ratio"], 0.0),
            "throughput_tok_per_gpu_s": n["tokens_per_gpu_s"],
            "session_p50_s": float(np.percentile(done, 50)) if done else nan,
            "session_p90_s": float(np.percentile(done, 90)) if done else nan,
            "preemptions": sum(x.preemptions for x in r),
            "tier_hit_blocks": dict(self.tier_hit_blocks),
            "sim_time_s": self.sim_time_s,
            "wall_s": self.wall_s,
            "events": self.events,
            "steps": self.steps,
            "utilization": (sum(self.engine_busy_s) / (self.replicas * self.sim_time_s)
                            if self.sim_time_s else 0.0),
        }  # fmt: skip
        if done:
            out["session_p99_s"] = float(np.percentile(done, 99))
            out["session_mean_s"] = float(np.mean(done))
            out["session_by_size"] = self._by_size(r, warmup_s)
        # runs with DAG sessions track the unlimited-cache bound (synthetic sessions do not)
        if any(x.bound_cached_tokens is not None for x in r):
            out["hit_bound"] = _or(n["cache_hit_bound"], 0.0)
            out["requests_failed"] = self.failed
        return out

    def _by_size(self, r: list[CallRecord], warmup_s: float) -> dict[str, dict[str, Any]]:
        """Completed DAG sessions started after ``warmup_s`` by size class
        (:func:`loadtest.metrics.size_class` of their calls): count, completion p50/p90/p99 and
        the TTFT p99 of their calls ``r`` (a subagent's calls, ``<root>/<agent>``, count with
        their root)."""
        cls = {sid: size_class(n) for sid, st, _, n in self.session_runs if st >= warmup_s}
        out: dict[str, dict[str, Any]] = {}
        for c in SIZE_CLASSES:
            times = [e - st for sid, st, e, _ in self.session_runs
                     if st >= warmup_s and cls.get(sid) == c]  # fmt: skip
            ttft = [
                x.ttft for x in r if x.ttft is not None and cls.get(_root(x.session_id, cls)) == c
            ]
            out[c] = {
                "sessions": len(times),
                "p50_s": float(np.percentile(times, 50)) if times else None,
                "p90_s": float(np.percentile(times, 90)) if times else None,
                "p99_s": float(np.percentile(times, 99)) if times else None,
                "ttft_p99_s": float(np.percentile(ttft, 99)) if ttft else None,
            }
        return out


def _root(sid: str, roots: Mapping[str, Any]) -> str:
    """The root session of a DAG call's session id (``<root>/<agent>`` for a subagent)."""
    return sid if sid in roots else sid.rsplit("/", 1)[0]


def _or(x: float | None, default: float) -> float:
    return default if x is None else x


_ARRIVE, _STEP, _WAKE, _ENQUEUE, _DAG_ARRIVE, _SESSION = 0, 1, 2, 3, 4, 5


class _DagRun:
    """One DAG session in flight: dependency counters, ready times, routing identities."""

    __slots__ = ("agent_index", "children", "final", "lane", "left", "pending", "ready",
                 "session", "sids", "start")  # fmt: skip

    def __init__(self, s: DagSession, lane: int | None, start: float):
        n = len(s.calls)
        self.session = s
        self.start = start
        self.lane = lane
        self.left = n
        self.pending = [len(c.deps) for c in s.calls]
        # a call is ready at the latest of its dependencies' ends plus delays and its
        # not_before_s after the session start
        self.ready = [-math.inf if c.not_before_s is None else start + c.not_before_s
                      for c in s.calls]  # fmt: skip
        self.children: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        self.agent_index = [0] * n
        self.sids: list[tuple[str, str | None, str | None]] = []  # (session, agent, parent)
        count: dict[str, int] = {}
        last: dict[str, int] = {}
        for k, c in enumerate(s.calls):
            for d, delay in c.deps:
                self.children[d].append((k, delay))
            self.agent_index[k] = count.get(c.agent, 0)
            count[c.agent] = self.agent_index[k] + 1
            last[c.agent] = k
            if c.agent == s.main_agent:
                self.sids.append((s.id, None, None))
            else:
                self.sids.append((f"{s.id}/{c.agent}", c.agent, s.id))
        self.final = [last[c.agent] == k for k, c in enumerate(s.calls)]


class _Replica:
    __slots__ = ("burst", "engine", "step", "version")

    def __init__(self, engine: Engine):
        self.engine = engine
        self.step: Step | None = None
        self.burst: tuple[float, list[float], int] | None = None  # start, step ends, batch
        self.version = 0


class SimObserver(Protocol):
    """Optional hooks of a routing function object (e.g. the router's pipeline adapter in
    :mod:`loadtest.sim.router_policy`): what a real router would hear back."""

    wants_events: bool

    def on_events(self, replica: int, events: list[dict[str, Any]], now: float) -> None:
        """KV events (vLLM wire form) a replica published at the end of a step."""

    def on_finish(self, record: CallRecord) -> None:
        """A call finished (its usage, TTFT and duration are in the record)."""

    # optional: ``on_first_token(request_id, now)`` — a call's first token (``"sid/index"``)
    # optional: ``kv_transfer_params(call) -> Mapping | None`` — the body field the router
    # would send with the call it just routed (its engine hints); the engines read the
    # ``kvroute`` hint from it as the HTTP twin and vLLM do.


class Simulator:
    """N engines of one profile, a routing function, and a workload of sessions.

    ``route`` may be a plain function or an object with ``__call__`` and the
    :class:`SimObserver` hooks: with ``wants_events`` the engines publish KV events (block
    stored / removed, as on the wire) and the simulator hands them over at the end of each
    step; ``on_finish`` sees every finished call; with ``kv_transfer_params`` each request
    carries the ``kvroute`` hint the router attached (the engine plugin's retention reads it
    when ``plugin`` turns retention on).
    """

    def __init__(
        self,
        profile: ReplicaProfile,
        n_replicas: int,
        route: RouteFn,
        *,
        burst: bool = True,
        max_burst_steps: int = 256,
        plugin: EnginePlugin | None = None,
        truth: str | Truth | None = None,
    ):
        if n_replicas < 1:
            raise ValueError("need at least one replica")
        self.profile = profile
        self.truth = truth  # the engines' timing (loadtest.twin.truth); None: costmodel's
        self.observer: Any = route if hasattr(route, "on_finish") else None
        events = bool(getattr(route, "wants_events", False))
        self._on_events = route.on_events if events else None  # type: ignore[attr-defined]
        self.plugin = plugin or EnginePlugin()
        self._params = getattr(route, "kv_transfer_params", None)
        # one cluster KV pool shared by every engine (the profile's pool_kv_blocks; 0: none)
        self.cluster_pool = ClusterPool(profile.pool_kv_blocks) if profile.pool_kv_blocks else None
        # optional: ``request_priority(call) -> int`` — the priority the router sent (vLLM's
        # ``priority``; the engines order by it under the profile's priority_scheduling)
        self._prio = getattr(route, "request_priority", None)
        self.replicas = [_Replica(Engine(profile, emit_events=events, plugin=self.plugin,
                                         truth=truth, cluster_pool=self.cluster_pool))
                         for _ in range(n_replicas)]  # fmt: skip
        self.views = [ReplicaView(i, r.engine) for i, r in enumerate(self.replicas)]
        self.route = route
        self.burst = burst
        self.max_burst_steps = max_burst_steps
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.steps = 0
        self.events = 0
        self.cuts = 0  # bursts cut short by an arrival

    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    # -- engine driving --

    def _kick(self, i: int, now: float) -> None:
        """Start replica ``i``'s next step (or burst) at ``now`` if it is idle."""
        rep = self.replicas[i]
        if rep.step is not None or rep.burst is not None:
            return
        eng = rep.engine
        if not eng.has_work:
            return
        if self.burst:
            k = self._burst_len(eng)
            if k >= 2:
                self._start_burst(i, rep, now, k)
                return
        step = eng.schedule(now)
        if step is None:
            self._flush_events(i, now)  # lower-tier loads allocate (and evict) blocks
            nxt = eng.next_ready()
            if nxt is not None:
                rep.version += 1
                self._push(nxt, _WAKE, (i, rep.version))
            return
        rep.step = step
        rep.version += 1
        self._push(now + step.duration, _STEP, (i, rep.version))

    def _flush_events(self, i: int, now: float) -> None:
        if self._on_events is not None:
            evs = self.replicas[i].engine.take_events()
            if evs:
                self._on_events(i, evs, now)

    def _burst_len(self, eng: Engine) -> int:
        """Steps that can run as pure decode with no allocation, caching or finish."""
        if eng.waiting or not eng.running:
            return 0
        bs = eng.block_size
        max_len = eng.profile.max_model_len
        k = self.max_burst_steps
        for r in eng.running:
            c = r.num_computed
            if c != r.num_tokens - 1:
                return 0  # still prefilling
            pos = c % bs
            if pos == 0 or pos == bs - 1:
                return 0
            k = min(k, bs - 1 - pos, r.max_tokens - r.num_output - 1, max_len - 1 - r.num_tokens)
            if k < 2:
                return 0
        return k

    def _start_burst(self, i: int, rep: _Replica, now: float, k: int) -> None:
        eng = rep.engine
        b = len(eng.running)
        ctx = float(sum(r.num_computed for r in eng.running))
        step = eng.timing.decode_step
        ends = []
        t = now
        for j in range(k):
            t += step(b, ctx + j * b)
            ends.append(t)
        rep.burst = (now, ends, b)
        rep.version += 1
        self._push(ends[-1], _STEP, (i, rep.version))

    def _apply_burst(self, rep: _Replica, n_steps: int) -> float:
        """Apply the first ``n_steps`` of the replica's burst; returns when they end."""
        assert rep.burst is not None
        start, ends, _b = rep.burst
        rep.burst = None
        eng = rep.engine
        for r in eng.running:
            r.num_computed += n_steps
            r.num_output += n_steps
        eng.generation_tokens_total += n_steps * len(eng.running)
        eng.busy_time += ends[n_steps - 1] - start
        eng.step_count += n_steps
        eng.decode_only_steps(n_steps)
        self.steps += n_steps
        return ends[n_steps - 1]

    def _cut_burst(self, i: int, now: float) -> None:
        """An arrival at ``now`` during a burst: the burst now ends with the step in
        progress (applied when that step ends, like any step)."""
        rep = self.replicas[i]
        assert rep.burst is not None
        start, ends, b = rep.burst
        m = next(j for j, e in enumerate(ends) if e >= now)
        self.cuts += 1
        if m + 1 == len(ends):
            return
        rep.burst = (start, ends[: m + 1], b)
        rep.version += 1  # the burst's old end event is now stale
        self._push(ends[m], _STEP, (i, rep.version))

    def _hint(self, call: CallView) -> Any:
        """The ``kvroute`` hint the router attached to the call it just routed, if any."""
        return parse_hint(self._params(call)) if self._params is not None else None

    def _enqueue(self, i: int, req: Request, now: float) -> None:
        rep = self.replicas[i]
        if rep.burst is not None:
            self._cut_burst(i, now)
        rep.engine.add(req)
        self._kick(i, now)  # no-op unless the replica is idle

    # -- main loop --

    def run(
        self,
        sessions: Sequence[Session | DagSession],
        until: float | None = None,
        *,
        feed: SessionFeed | None = None,
    ) -> SimResult:
        """Run ``sessions`` (and ``feed``'s lanes) until no event is left or ``until``.

        ``feed``: closed-loop lanes of DAG sessions (see :class:`SessionFeed`). When an event
        is still due after ``until`` the run stops there: the result's ``cut`` is set and its
        ``sim_time_s`` is ``until`` (the run lasted that long, whenever its last event fell);
        otherwise ``sim_time_s`` is the time of the last event."""
        wall0 = time.perf_counter()
        bs = self.profile.block_size
        max_len = self.profile.max_model_len
        overhead = self.profile.request_overhead_s
        shared_salt = 0x5EED
        state: dict[str, dict[str, Any]] = {}
        n_sessions = 0
        for sess in sessions:
            n_sessions += 1
            if isinstance(sess, DagSession):
                self._push(sess.start, _SESSION, (sess, None))
                continue
            state[sess.id] = {"keys": [], "ctx": 0, "k": 0, "session": sess}
            self._push(sess.start, _ARRIVE, sess.id)
        if feed is not None:
            for lane in range(feed.lanes):
                nxt = feed.next_session(lane, 0.0)
                if nxt is not None:
                    n_sessions += 1
                    self._push(nxt.start, _SESSION, (nxt, lane))  # a lane may start late
        records: list[CallRecord] = []
        spans: list[tuple[float, float]] = []  # DAG sessions completed: (start, end)
        runs: list[tuple[str, float, float, int]] = []  # ... (id, start, end, calls)
        done_sessions = 0
        failed = 0
        # DAG sessions: request id -> (run, call, unlimited-cache hit); the bound's cache
        dag_reqs: dict[str, tuple[_DagRun, int, int]] = {}
        unlimited = UnlimitedCache(bs)

        def dag_end(run: _DagRun, k: int, now: float) -> None:
            """Call ``k`` of ``run`` ended at ``now``: release its dependants; at the
            session's end, the lane's next session starts."""
            nonlocal done_sessions, n_sessions
            for c, delay in run.children[k]:
                if now + delay > run.ready[c]:
                    run.ready[c] = now + delay
                run.pending[c] -= 1
                if run.pending[c] == 0:
                    self._push(run.ready[c], _DAG_ARRIVE, (run, c))
            run.left -= 1
            if run.left == 0:
                done_sessions += 1
                spans.append((run.start, now))
                runs.append((run.session.id, run.start, now, len(run.session.calls)))
                if feed is not None and run.lane is not None:
                    nxt = feed.next_session(run.lane, now)
                    if nxt is not None:
                        n_sessions += 1
                        self._push(now, _SESSION, (nxt, run.lane))

        tier_hits = {"gpu": 0, "cpu": 0, "storage": 0, "pool": 0}
        now = 0.0
        cut = False
        heap = self._heap
        while heap:
            t, seq, kind, payload = heapq.heappop(heap)
            if until is not None and t > until:
                if kind in (_STEP, _WAKE) and payload[1] != self.replicas[payload[0]].version:
                    continue  # stale: no work left behind it
                heapq.heappush(heap, (t, seq, kind, payload))  # still due, for the record
                now, cut = until, True
                break
            now = t
            self.events += 1
            if kind == _ARRIVE:
                st = state[payload]
                s: Session = st["session"]
                call = s.calls[st["k"]]
                ctx = st["ctx"] + call.new_tokens
                if ctx + call.output_tokens > max_len:
                    done_sessions += 1
                    continue
                keys: list[int] = st["keys"]
                shared = s.shared_prefix_tokens // bs
                sid_salt = _stable64(s.id)
                while len(keys) < ctx // bs:
                    j = len(keys)
                    if j < shared:
                        keys.append((shared_salt * 0x9E3779B97F4A7C15 + j) & MASK64)
                    else:
                        keys.append(
                            ((sid_salt ^ (j * 0xBF58476D1CE4E5B9)) * 0x94D049BB133111EB) & MASK64
                        )
                st["ctx"] = ctx
                view = CallView(
                    s.id,
                    st["k"],
                    ctx,
                    keys,
                    call.output_tokens,
                    now,
                    final=st["k"] == len(s.calls) - 1,
                )
                i = self.route(view, self.views)
                req = Request(f"{s.id}/{st['k']}", ctx, call.output_tokens,
                              block_keys=keys[: ctx // bs], arrival=now, session_id=s.id,
                              tag=i, hint=self._hint(view),
                              priority=self._prio(view) if self._prio else 0)  # fmt: skip
                if overhead > 0:  # the API server's share of TTFT, before the engine
                    self._push(now + overhead, _ENQUEUE, (i, req))
                else:
                    self._enqueue(i, req, now)
                continue
            if kind == _ENQUEUE:
                self._enqueue(payload[0], payload[1], now)
                continue
            if kind == _DAG_ARRIVE:
                run, k = payload
                tc: TraceCall = run.session.calls[k]
                n_tok = tc.prompt_tokens
                if n_tok < 1 or n_tok + tc.output_tokens > max_len:
                    failed += 1  # refused like the HTTP twin (400); dependants go on
                    dag_end(run, k, now)
                    continue  # never served: it caches nothing, not even in the bound
                keys = list(tc.block_keys[: n_tok // bs])
                # the unlimited-cache bound over the calls actually issued
                bound = unlimited.observe_keys(keys, n_tok)
                sid, agent_id, parent = run.sids[k]
                idx = run.agent_index[k]
                view = CallView(sid, idx, n_tok, keys, tc.output_tokens, now,
                                final=run.final[k], agent_id=agent_id,
                                parent_session=parent)  # fmt: skip
                i = self.route(view, self.views)
                req = Request(f"{sid}/{idx}", n_tok, tc.output_tokens, block_keys=keys,
                              arrival=now, session_id=sid, tag=i, hint=self._hint(view),
                              priority=self._prio(view) if self._prio else 0)  # fmt: skip
                dag_reqs[req.id] = (run, k, bound)
                if overhead > 0:
                    self._push(now + overhead, _ENQUEUE, (i, req))
                else:
                    self._enqueue(i, req, now)
                continue
            if kind == _SESSION:
                ds, lane = payload
                run = _DagRun(ds, lane, now)
                for k, tc in enumerate(ds.calls):
                    if not tc.deps:
                        self._push(max(now + tc.start_delay_s, run.ready[k]), _DAG_ARRIVE,
                                   (run, k))  # fmt: skip
                continue
            i, version = payload
            rep = self.replicas[i]
            if version != rep.version:
                continue  # stale (a cut burst or a superseded wake-up)
            if kind == _WAKE:
                self._kick(i, now)
                continue
            # _STEP
            eng = rep.engine
            if rep.burst is not None:
                self._apply_burst(rep, len(rep.burst[1]))
            else:
                step = rep.step
                assert step is not None
                rep.step = None
                self.steps += 1
                res = eng.complete(step, now)
                self._flush_events(i, now)
                if res.first_tokens and self.observer is not None:
                    first = getattr(self.observer, "on_first_token", None)
                    if first is not None:  # the proxy's first byte: prefill is over
                        for req in res.first_tokens:
                            first(req.id, now)
                for req in res.finished:
                    if dag_reqs:
                        got = dag_reqs.pop(req.id, None)
                        if got is not None:
                            run, k, bound = got
                            rec = CallRecord(
                                req.session_id or "", run.agent_index[k], i, req.arrival,
                                req.prompt_len, req.num_output, req.cached_tokens or 0,
                                req.first_token_time or now, now, req.num_preemptions,
                                run.session.calls[k].agent, bound)  # fmt: skip
                            records.append(rec)
                            if self.observer is not None:
                                self.observer.on_finish(rec)
                            dag_end(run, k, now)
                            continue
                    st = state[req.session_id]
                    s = st["session"]
                    rec = CallRecord(
                        s.id, st["k"], i, req.arrival, req.prompt_len, req.num_output,
                        req.cached_tokens or 0, req.first_token_time or now, now,
                        req.num_preemptions)  # fmt: skip
                    records.append(rec)
                    if self.observer is not None:
                        self.observer.on_finish(rec)
                    st["ctx"] += req.num_output
                    st["k"] += 1
                    if st["k"] < len(s.calls):
                        self._push(now + s.calls[st["k"]].think_s, _ARRIVE, s.id)
                    else:
                        done_sessions += 1
            self._kick(i, now)
        for rep in self.replicas:
            for k_, v in rep.engine.tier_hit_blocks.items():
                tier_hits[k_] += v
        return SimResult(
            records=records, sim_time_s=now, wall_s=time.perf_counter() - wall0,
            replicas=len(self.replicas), events=self.events, steps=self.steps,
            sessions_done=done_sessions, sessions=n_sessions,
            engine_busy_s=[r.engine.busy_time for r in self.replicas],
            tier_hit_blocks=tier_hits, gpus_per_replica=self.profile.gpus, failed=failed,
            cut=cut, session_spans=spans, session_runs=runs,
        )  # fmt: skip


def simulate(
    profile: ReplicaProfile,
    n_replicas: int,
    sessions: Sequence[Session],
    route: RouteFn | str = "sticky_spill",
    **kw: Any,
) -> SimResult:
    """One run: ``route`` is a function or the name of a built-in policy (:data:`ROUTERS`)."""
    fn = ROUTERS[route]() if isinstance(route, str) else route
    until = kw.pop("until", None)
    return Simulator(profile, n_replicas, fn, **kw).run(sessions, until=until)


__all__ = ["RUNNING", "Call", "CallView", "DagSession", "ReplicaView", "Session", "SessionFeed",
           "SimResult", "Simulator", "TraceCall", "simulate", "synthetic_agentx"]  # fmt: skip
