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

import heapq
import time
from collections.abc import Sequence
from typing import Any

from costmodel.profiles import ReplicaProfile
from engine_patches.retention_rule import parse_hint
from loadtest.metrics import UnlimitedCache
from loadtest.sim.records import CallRecord, SimResult
from loadtest.sim.routing import (
    ROUTERS,
    CallView,
    ReplicaView,
    RouteFn,
    SimObserver,
    route_exact_cache,
    route_fewest_requests,
    route_round_robin,
    route_sticky_spill,
)
from loadtest.sim.workload import (
    MASK64,
    Call,
    DagSession,
    Session,
    SessionFeed,
    TraceCall,
    _DagRun,
    _stable64,
    synthetic_agentx,
)
from loadtest.twin.engine import RUNNING, ClusterPool, Engine, EnginePlugin, Request, Step
from loadtest.twin.truth import Truth

# ---- the simulator --------------------------------------------------------------------------


_ARRIVE, _STEP, _WAKE, _ENQUEUE, _DAG_ARRIVE, _SESSION = 0, 1, 2, 3, 4, 5


class _Replica:
    __slots__ = ("burst", "engine", "step", "version")

    def __init__(self, engine: Engine):
        self.engine = engine
        self.step: Step | None = None
        self.burst: tuple[float, list[float], int] | None = None  # start, step ends, batch
        self.version = 0


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

    def _place(self, call: CallView) -> int:
        """The replica a call arriving now goes to (:mod:`loadtest.sim.pd` adds the legs)."""
        return self.route(call, self.views)

    def _leg_done(self, req: Request, now: float) -> bool:
        """Whether ``req`` was a leg before its call's last (no record): never, here."""
        return False

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
                i = self._place(view)
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
                i = self._place(view)
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
                    if self._leg_done(req, now):
                        continue  # a P/D prefill leg: its call goes on decode-side
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


__all__ = ["MASK64", "ROUTERS", "RUNNING", "Call", "CallRecord", "CallView", "DagSession",
           "ReplicaView", "RouteFn", "Session", "SessionFeed", "SimObserver", "SimResult",
           "Simulator", "TraceCall", "route_exact_cache", "route_fewest_requests",
           "route_round_robin", "route_sticky_spill", "simulate", "synthetic_agentx"]  # fmt: skip
