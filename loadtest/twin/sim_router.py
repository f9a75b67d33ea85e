"""The router's own scheduling pipeline as the simulator's routing function.

Owns: :class:`RouterPolicy`, an adapter that routes simulated calls with
:func:`router.scheduling.registry.build_pipeline` (any registered policy: ``round_robin``,
``least_load``, ``session_affinity``, ``prefix_hash``, ``kv_cost``, ``llmd``,
``sglang_tree``, ...) exactly as ``kvroute serve`` does, but in simulated time and without
HTTP. It builds what the router's service would build for each call — the session identity
and record, the endpoint views (running / waiting / KV usage from the simulated engines, the
router's own in-flight count), and the ``"kv"`` state provider of
:class:`router.scheduling.kv_state.KVState` with its block index fed by the engines' own KV
events (decoded with :mod:`router.kvevents`, the wire path) and its clock set to simulated
time — and after each call it reports the outcome (replica, TTFT, duration, usage) to the KV
layer's observer, as the proxy does. Must not import aiohttp, zmq, torch or vllm.

Differences from a live router: no tokenization (the simulator's block keys go straight into
``ctx.block_keys``), no HTTP bodies (``body`` holds a synthetic prompt whose text is the
call's leading block keys, so text-prefix policies see the same sharing), no retries, events
arrive at the end of the step that produced them (no network delay).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from costmodel.profiles import ReplicaProfile
from loadtest.twin.sim import CallRecord, CallView, ReplicaView
from router.kvevents import decode_event
from router.replicas import EndpointView
from router.scheduling import RequestContext, Snapshot
from router.sessions import SessionIdentity
from router.state import SessionRecord

MODEL = "tiny"
PREFIX_TEXT_BLOCKS = 64  # block keys rendered into the synthetic prompt text


class RouterPolicy:
    """``route(call, replicas) -> index`` backed by a router scheduling pipeline."""

    wants_events = True

    def __init__(self, policy: str, profile: ReplicaProfile, *, seed: int = 0, tenant: str = "sim"):
        from router.scheduling.kv_state import KVConfig, KVState
        from router.scheduling.registry import build_pipeline

        self.pipeline = build_pipeline(policy, seed=seed)
        self.profile = profile
        self.now = 0.0
        self.kv = KVState(
            KVConfig(block_size=profile.block_size), clock=lambda: self.now, profile=profile
        )
        self.tenant = tenant
        self.sessions: dict[str, SessionRecord] = {}
        self.inflight: dict[int, int] = {}
        self._ctx: dict[tuple[str, int], RequestContext] = {}
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
        self.now = call.now
        for r in replicas:
            self._name(r.index)
        ident = SessionIdentity(
            tenant=self.tenant,
            session=call.session_id,
            parent=None,
            agent=None,
            final=call.final,
            source="sim",
        )
        head = " ".join(f"{k:016x}" for k in call.block_keys[:PREFIX_TEXT_BLOCKS])
        ctx = RequestContext(
            request_id=f"{call.session_id}/{call.call_index}", route="/v1/completions",
            model=MODEL, identity=ident,
            body={"model": MODEL, "prompt": head, "max_tokens": call.max_tokens},
            block_keys=list(call.block_keys),
            extra={"kv_prompt_tokens": call.prompt_tokens},
        )  # fmt: skip
        self.kv.analyze(ctx)  # session footprint (no tokenizer: keys are given)
        rec = self.sessions.get(ident.key)
        if rec is None:
            rec = self.sessions[ident.key] = SessionRecord(
                key=ident.key, tenant=self.tenant, created=call.now
            )
        endpoints = tuple(
            EndpointView(name=self.names[r.index], url=self.names[r.index], healthy=True,
                         models=frozenset({MODEL}), inflight=self.inflight.get(r.index, 0),
                         running=float(r.num_running), waiting=float(r.num_waiting),
                         kv_usage=r.kv_usage, breaker="closed")
            for r in replicas
        )  # fmt: skip
        snap = Snapshot(
            endpoints=endpoints,
            session=rec.copy(),
            seq=self.pipeline.seq,
            states={"kv": self.kv.view()},
        )
        decision = self.pipeline.schedule(ctx, snap)
        self.pipeline.record(decision)
        self.decisions += 1
        i = self.names.index(decision.endpoint.name)
        self.inflight[i] = self.inflight.get(i, 0) + 1
        rec.replica = decision.endpoint.name
        rec.last_seen = call.now
        rec.calls += 1
        rec.final = call.final
        self._ctx[(call.session_id, call.call_index)] = ctx
        return i

    # -- what the replicas and the proxy report back --

    def on_events(self, replica: int, events: list[dict[str, Any]], now: float) -> None:
        self.now = now
        typed = [e for e in (decode_event(x) for x in events) if e is not None]
        self.kv.index.apply(self._name(replica), typed)

    def on_finish(self, record: CallRecord) -> None:
        self.now = record.finish
        self.inflight[record.replica] = max(self.inflight.get(record.replica, 1) - 1, 0)
        ctx = self._ctx.pop((record.session_id, record.call_index), None)
        if ctx is None:
            return
        usage = {
            "prompt_tokens": record.prompt_tokens,
            "completion_tokens": record.output_tokens,
            "prompt_tokens_details": {"cached_tokens": record.cached_tokens},
        }
        outcome = {"replica": self.names[record.replica], "status": "200",
                   "ttft_s": record.ttft, "duration_s": record.finish - record.arrival,
                   "tail": orjson.dumps({"usage": usage})}  # fmt: skip
        self.kv.observe(ctx, outcome)
        rec = self.sessions.get(ctx.identity.key)
        if rec is not None:
            rec.last_call_end = record.finish
            if ctx.identity.final:
                self.sessions.pop(ctx.identity.key, None)
