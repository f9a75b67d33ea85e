"""The router's own call sequence as the simulator's routing function.

Owns: :class:`RouterPolicy`, an adapter that routes simulated calls through
:class:`router.call.CallSequence` — the same analyze → decide → finish steps
``kvroute serve``'s proxy runs around its network send — over any registered policy
(``round_robin``, ``least_load``, ``session_affinity``, ``prefix_hash``, ``kv_cost``, ``llmd``,
``sglang_tree``, ...), in simulated time and without HTTP. It builds what the service builds
for each call — the session identity, the session's record in the router's own session table
(:class:`router.state.MemoryStore`, in simulated time), the endpoint views (running / waiting
/ KV usage from the simulated engines, the router's own in-flight count) and the KV layer
(:class:`router.kv.state.KVState`, its block index fed by the engines' own KV events decoded
with :mod:`router.vllm.kvevents`, the wire path, and its clock set to simulated time; each
call counted in flight in its session's footprint from its analysis to its end, as the live
router's analysis counts it — until 2026-12-02 the simulated calls were not, so every session
looked idle between calls even while one ran: never pinned, always a paced agent) — and
after each call it reports a :class:`router.outcome.CallOutcome` (replica, TTFT, duration,
usage, the decision) to the call sequence's observers, as the proxy does. Must not import
aiohttp, zmq, torch or vllm.

P/D: :class:`PDRouterPolicy` runs the proxy's disaggregated path
(:func:`router.proxy_pd.forward_pd`: prefill pick, decode pick, the per-call verdict) for
:class:`loadtest.sim.pd.PDSimulator`.

Engine hints: with ``engine_hints`` (the router's ``engine_hints`` option) each routed call's
body gets the ``kvroute`` retention hint exactly as the proxy sets it
(:func:`router.hints.hinted_body` over the session's record), and
:meth:`RouterPolicy.kv_transfer_params` hands the body's ``kv_transfer_params`` to the simulator,
whose engines read the hint as vLLM with the engine plugin does (``Simulator(plugin=...)``).

What the router sees is what it would see from an agent: the body carries the fixed
``max_tokens`` cap Claude Code and OpenCode send (``AGENT_MAX_TOKENS``), never the call's
recorded output length (only the simulated engine knows that), and no last-call flag; a
subagent's calls carry its lineage (its own session, the root session as its parent: what
Claude Code's agent headers give the live router — until 2026-12-02 the simulated router got
no parent, so parents were never pinned while their subagents ran and no hint said
``waiting-on-children``).

Differences from a live router: no tokenization (the simulator's block keys go straight into
``ctx.block_keys``), no HTTP bodies (``body`` holds a synthetic prompt whose text is the
call's leading block keys, so text-prefix policies see the same sharing), no retries, no
concurrent placement by another router (the pick is the session's replica), events arrive at
the end of the step that produced them (no network delay), and sessions never expire from
the table during a run. The engines' load (running, waiting, KV usage) is exact at every
decision unless ``scrape_interval_s`` is set, which reads it as a live router does — from a
``/metrics`` scrape every that many seconds (``metrics_interval_s``, 1 s by default);
:mod:`loadtest.bench.bench_sim_vs_real` sets it. The engine plugin's pending-prefill gauge is
in that load where the engine runs the plugin's cadence and a host tier, as on real vLLM; the
router reads it with ``kv_settings={"pending_prefill_gauge": True}`` (any
:class:`router.kv.config.KVConfig` field can be set there).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from costmodel.profiles import ReplicaProfile
from loadtest.sim.pd import ROLES
from loadtest.sim.simulator import CallRecord, CallView, ReplicaView
from router import disagg
from router.call import CallSequence
from router.hints import call_hint, hinted_body
from router.kv.config import KVConfig
from router.kv.state import KVState
from router.outcome import CallOutcome, Usage
from router.priority import PriorityConfig, call_priority, served_tokens
from router.replicas import EndpointView
from router.scheduling import RequestContext
from router.scheduling.pipeline import Decision, NoCandidates
from router.scheduling.registry import build_pipeline
from router.sessions import SEP, SessionIdentity
from router.state import MemoryStore, SessionRecord
from router.vllm.kvevents import decode_event

MODEL = "tiny"
PREFIX_TEXT_BLOCKS = 64  # block keys rendered into the synthetic prompt text
AGENT_MAX_TOKENS = 32_000  # the fixed cap agent clients send (Claude Code, OpenCode)


class RouterPolicy:
    """``route(call, replicas) -> index`` backed by a router scheduling pipeline."""

    wants_events = True

    def __init__(
        self, policy: str, profile: ReplicaProfile, *, seed: int = 0, tenant: str = "sim",
        engine_hints: bool = False, scrape_interval_s: float = 0.0,
        kv_settings: Mapping[str, Any] | None = None, priority: bool = False,
    ):  # fmt: skip
        if scrape_interval_s < 0:
            raise ValueError("scrape_interval_s must be >= 0")
        self.engine_hints = engine_hints
        # the engines' running / waiting / KV usage as a live router sees them: read from
        # /metrics every metrics_interval_s (1 s by default), not at every decision (0: exact)
        self.scrape_interval_s = scrape_interval_s
        self._scraped: dict[int, tuple[Any, ...]] = {}
        self._scrape_tick = -1
        self._scraped_at = 0.0
        self._params: dict[tuple[str, int], Any] = {}
        # the router's priority: session (router.priority), handed to the engines' requests
        self.priority = PriorityConfig() if priority else None
        self._priority: dict[tuple[str, int], int] = {}
        self.pipeline = build_pipeline(policy, seed=seed)
        self.profile = profile
        self.now = 0.0
        self.kv = KVState(
            KVConfig(**{"block_size": profile.block_size, **(kv_settings or {})}),
            clock=lambda: self.now, profile=profile,
        )  # fmt: skip
        self.calls = CallSequence(
            self.pipeline,
            analyzer=self.kv.analyze,
            state_providers={"kv": self.kv.view},
            observers=[self.kv.observe],
            decision_hooks=[self.kv.decided],
            first_byte_hooks=[self.kv.prefill_done],
        )
        self.tenant = tenant
        self.store = MemoryStore(ttl_s=float("inf"))
        self.inflight: dict[int, int] = {}
        self._ctx: dict[tuple[str, int], tuple[RequestContext, Decision]] = {}
        self.names: list[str] = []
        self.decisions = 0

    # -- routing --

    def _name(self, i: int) -> str:
        while len(self.names) <= i:
            n = f"http://sim-replica-{len(self.names)}"
            self.names.append(n)
            self.kv.index.add_replica(n)
        return self.names[i]

    def __call__(self, call: CallView, replicas: Sequence[ReplicaView]) -> int:
        ctx, rec, endpoints = self._prepare(call, replicas)
        return self._decided(call, ctx, rec, self.calls.decide(ctx, endpoints, rec.copy()))

    def _prepare(
        self, call: CallView, replicas: Sequence[ReplicaView]
    ) -> tuple[RequestContext, SessionRecord, tuple[EndpointView, ...]]:
        """What the service builds for a call before deciding: its context (analysed), the
        session's record (touched) and the endpoint views (with each replica's role)."""
        self.now = call.now
        for r in replicas:
            self._name(r.index)
        # a subagent is its own session whose parent is the session that spawned it, as the
        # live router files Claude Code's / OpenCode's subagent headers (the replay's
        # session_headers); the simulator names the root session as every subagent's parent
        parent = f"{self.tenant}{SEP}{call.parent_session}" if call.parent_session else None
        ident = SessionIdentity(
            tenant=self.tenant,
            session=call.session_id,
            parent=parent,
            agent=None,
            final=False,  # no agent convention the replays use sends a last-call flag
            source="sim",
        )
        head = " ".join(f"{k:016x}" for k in call.block_keys[:PREFIX_TEXT_BLOCKS])
        ctx = RequestContext(
            request_id=f"{call.session_id}/{call.call_index}", route="/v1/completions",
            model=MODEL, identity=ident,
            body={"model": MODEL, "prompt": head, "max_tokens": AGENT_MAX_TOKENS},
            block_keys=list(call.block_keys), prompt_tokens=call.prompt_tokens,
        )  # fmt: skip
        self.calls.analyze(ctx)  # the KV layer's footprint (no tokenizer: keys are given)
        rec = self.store.touch(ident, call.now)
        load = self._engine_load(replicas)
        age = self.now - self._scraped_at if self.scrape_interval_s else 0.0
        endpoints = tuple(
            EndpointView(name=self.names[r.index], url=self.names[r.index], healthy=True,
                         models=frozenset({MODEL}), inflight=self.inflight.get(r.index, 0),
                         running=load[r.index][0], waiting=load[r.index][1],
                         kv_usage=load[r.index][2], host_retained=load[r.index][3],
                         pending_prefill=load[r.index][4],
                         pending_prefill_age_s=None if load[r.index][4] is None else age,
                         breaker="closed", role=self.role(r.index))
            for r in replicas
        )  # fmt: skip
        return ctx, rec, endpoints

    def role(self, i: int) -> str:
        """Replica ``i``'s P/D role as the router is configured with it (here: ``both``)."""
        return "both"

    def _decided(
        self, call: CallView, ctx: RequestContext, rec: SessionRecord, decision: Decision
    ) -> int:
        """The proxy's bookkeeping for a committed decision: the session placed there, the
        replica's in-flight count, the hint and priority the body carries. Returns its index."""
        ident = ctx.identity
        assert ident is not None
        self.decisions += 1
        rec.replica = decision.endpoint.name  # the proxy's placement, uncontended
        i = self.names.index(decision.endpoint.name)
        self.inflight[i] = self.inflight.get(i, 0) + 1
        self._ctx[(call.session_id, call.call_index)] = (ctx, decision)
        if self.engine_hints:
            ctx.hint = call_hint(ctx.route, ident, rec, True)
            body = hinted_body(ctx.route, ctx.body, ctx.hint)
            if body is not None:
                params = orjson.loads(body).get("kv_transfer_params")
                self._params[(call.session_id, call.call_index)] = params
        if self.priority is not None:
            service, role = self.store.priority_inputs(ident.key)
            self._priority[(call.session_id, call.call_index)] = call_priority(
                service, role, None, call.now, self.priority
            )
        return i

    def request_priority(self, call: CallView) -> int:
        """The priority the router sent with ``call`` (0: none, vLLM's default)."""
        return self._priority.pop((call.session_id, call.call_index), 0)

    def _engine_load(self, replicas: Sequence[ReplicaView]) -> dict[int, tuple[Any, ...]]:
        """(running, waiting, KV usage, host tier's retained share, pending-prefill gauge) per
        replica: the engines' figures now, or with a scrape interval as of the last scrape
        (every replica at t = k × interval; a replica first seen after it is read at once)."""
        exact: dict[int, tuple[Any, ...]] = {
            r.index: (float(r.num_running), float(r.num_waiting), r.kv_usage, r.host_retained,
                      r.pending_prefill_gauge)
            for r in replicas
        }  # fmt: skip
        if not self.scrape_interval_s:
            return exact
        tick = int(self.now // self.scrape_interval_s)
        if tick != self._scrape_tick:
            self._scrape_tick = tick
            self._scraped_at = tick * self.scrape_interval_s
            self._scraped = exact
        for i, v in exact.items():
            self._scraped.setdefault(i, v)
        return self._scraped

    def kv_transfer_params(self, call: CallView) -> Any:
        """The ``kv_transfer_params`` of the body sent upstream for ``call`` (None: none)."""
        return self._params.pop((call.session_id, call.call_index), None)

    # -- what the replicas and the proxy report back --

    def on_events(self, replica: int, events: list[dict[str, Any]], now: float) -> None:
        self.now = now
        typed = [e for e in (decode_event(x) for x in events) if e is not None]
        self.kv.index.apply(self._name(replica), typed)

    def on_first_token(self, request_id: str, now: float) -> None:
        """The call's first token: what the proxy's first byte tells the KV layer."""
        self.now = now
        sid, _, idx = request_id.rpartition("/")
        got = self._ctx.get((sid, int(idx))) if idx.isdigit() else None
        if got is not None:
            self.calls.first_byte(got[0])

    def on_finish(self, record: CallRecord) -> None:
        self.now = record.finish
        self.inflight[record.replica] = max(self.inflight.get(record.replica, 1) - 1, 0)
        got = self._ctx.pop((record.session_id, record.call_index), None)
        if got is None:
            return
        ctx, decision = got
        usage = Usage(record.prompt_tokens, record.output_tokens, record.cached_tokens)
        itl = () if record.tpot is None else (record.tpot,)  # the mean gap: engines are exact
        self.calls.finish(ctx, CallOutcome(
            self.names[record.replica], "200", ttft_s=record.ttft,
            duration_s=record.finish - record.arrival, usage=usage, itl_s=itl, decision=decision,
        ))  # fmt: skip
        self.store.add_service(ctx.identity.key, served_tokens(
            record.prompt_tokens, record.cached_tokens, record.output_tokens))  # fmt: skip
        self.store.finish(ctx.identity.key, record.finish)


class PDRouterPolicy(RouterPolicy):
    """The router's P/D path in simulated time: the prefill leg on the replica the policy
    picks among the prefill-capable ones (``ctx.excluded`` = the decode-only ones; the session
    is placed there), the decode replica by :func:`router.disagg.pick_decode` (fewest requests,
    then KV room), and the per-call verdict of :func:`router.disagg.plan` (``pd_mode``
    ``auto``: priced by :func:`costmodel.disagg.disagg_cost` from the KV layer's view;
    ``always``; ``never``). A call kept colocated is decided again among the decode-capable
    replicas, as the proxy's colocated path does."""

    def __init__(
        self, policy: str, profile: ReplicaProfile, roles: Sequence[str], *,
        pd_mode: str = "auto", pd_min_prompt_tokens: int = 0, **kw: Any,
    ):  # fmt: skip
        if pd_mode not in ("auto", "always", "never"):
            raise ValueError(f"pd_mode must be auto, always or never, not {pd_mode!r}")
        bad = [r for r in roles if r not in ROLES]
        if bad:
            raise ValueError(f"roles must be prefill, decode or both, not {bad}")
        super().__init__(policy, profile, **kw)
        self.roles = list(roles)
        self.pd_mode = pd_mode
        self.pd_min_prompt_tokens = pd_min_prompt_tokens
        self.verdicts: dict[str, int] = {}  # reason -> calls (split and colocated)

    def role(self, i: int) -> str:
        return self.roles[i]

    def route_pd(self, call: CallView, replicas: Sequence[ReplicaView]) -> tuple[int | None, int]:
        """(prefill replica, decode replica) for a split call; (None, replica) colocated."""
        ctx, rec, views = self._prepare(call, replicas)
        ctx.excluded = disagg.not_prefill(views)
        decision = None
        if self.pd_mode != "never":
            try:
                decision = self.calls.decide(ctx, views, rec.copy(), dry_run=True)
            except NoCandidates:
                decision = None
        dview = disagg.pick_decode(ctx, views) if decision is not None else None
        reason = "never" if self.pd_mode == "never" else "no_replica"
        if decision is not None and dview is not None:
            kv = self.calls.snapshot(views, rec.copy()).state("kv")
            terms = disagg.plan(ctx, decision.endpoint, dview, kv, mode=self.pd_mode,
                                min_prompt_tokens=self.pd_min_prompt_tokens)  # fmt: skip
            reason = self.pd_mode if terms is None else terms.reason
            if terms is None or terms.disaggregate:
                self.verdicts[reason] = self.verdicts.get(reason, 0) + 1
                self.calls.commit(ctx, decision)
                p = self._decided(call, ctx, rec, decision)
                return p, self.names.index(dview.name)
        self.verdicts[reason] = self.verdicts.get(reason, 0) + 1
        ctx.excluded = disagg.not_decode(views)
        return None, self._decided(call, ctx, rec, self.calls.decide(ctx, views, rec.copy()))

    def on_leg(self, request_id: str, prefill: int, decode: int) -> None:
        """The prefill leg answered: the call is in flight on the decode replica now."""
        self.inflight[prefill] = max(self.inflight.get(prefill, 1) - 1, 0)
        self.inflight[decode] = self.inflight.get(decode, 0) + 1
