"""One call's sequence around the network send — the same code for the proxy and the simulator.

Owns: :class:`CallSequence`, the steps every routed call goes through, in order:

0. **begin** (the proxy's calls; the simulator keeps its own session table) — analyze, then
   the session's record from the store: ``begin_call`` for a call of the session, a plain
   read for a passthrough route (``count_tokens``), which analyzes nothing;
1. **analyze** — the prompt analyzer (the KV layer: tokens, block keys) fills the context;
   an analyzer error is logged and the call is scheduled without those fields;
2. **decide** — snapshot (endpoint views, the session's record, named state views such as
   ``"kv"``) → ``pipeline.schedule`` → ``pipeline.record`` (the pick counter) → the
   decision hooks (the KV layer records the routed prompt in its approximate cache, at
   selection time as sglang-router does);
3. *send* — the caller's part: :mod:`router.placement` places the session in the store and
   :mod:`router.relay` sends the call over HTTP (:mod:`router.proxy` retries elsewhere before
   the first byte: decide again with the tried replicas excluded); the simulator's adapter
   (:mod:`loadtest.sim.router_policy`) hands it to a simulated engine;
   When the first byte of the answer arrives (a stream's first chunk: prefill is over), the
   caller runs :meth:`CallSequence.first_byte` — the first-byte hooks (the KV layer stops
   counting the call's prompt as prefill queued on its replica);
4. **finish** — every observer hears how the call ended, exactly once, as a typed
   :class:`router.outcome.CallOutcome` (with the decision and its scorer terms), whatever the
   end: calls that never got a complete answer are reported with ``replica=None``;
   **end** (with **begin**) also closes the call in the session table (``end_call``).

Must not import aiohttp, the stores' back ends, torch or vllm (the store is the
:class:`router.state.SessionStore` interface).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from router.outcome import CallOutcome
from router.replicas import EndpointView
from router.scheduling import RequestContext, Snapshot
from router.scheduling.pipeline import Decision, Pipeline
from router.state import SessionRecord, SessionStore

log = logging.getLogger("kvroute.call")

PromptAnalyzer = Callable[[RequestContext], Awaitable[None] | None]
Observer = Callable[[RequestContext, CallOutcome], None]
DecisionHook = Callable[[RequestContext, Decision], None]
FirstByteHook = Callable[[RequestContext], None]


class CallSequence:
    """The analyze → decide → finish steps of a call over one pipeline (see the module doc)."""

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        analyzer: PromptAnalyzer | None = None,
        state_providers: Mapping[str, Callable[[], Any]] | None = None,
        observers: list[Observer] | None = None,
        decision_hooks: list[DecisionHook] | None = None,
        first_byte_hooks: list[FirstByteHook] | None = None,
    ):
        self.pipeline = pipeline
        self.analyzer = analyzer
        self.state_providers = dict(state_providers or {})
        self.observers = list(observers or [])
        self.decision_hooks = list(decision_hooks or [])
        self.first_byte_hooks = list(first_byte_hooks or [])

    async def begin(self, ctx: RequestContext, store: SessionStore) -> SessionRecord | None:
        """Analyze a call of its session, then open it in the session table (``begin_call``:
        timing, lineage); a passthrough route (``ctx.session_call`` false) is neither analyzed
        nor counted: its session's record is only read. Pair with :meth:`end`."""
        if not ctx.session_call:
            return await store.get(ctx.identity.key)
        pending = self.analyze(ctx)
        if pending is not None:
            await pending
        return await store.begin_call(ctx.identity, time.time())

    async def end(self, ctx: RequestContext, store: SessionStore) -> None:
        """After :meth:`begin`, however the call ended: the observers hear of a call that never
        got a complete answer (503, client gone, upstream failure) as ``not_completed``, and a
        call of its session is closed in the session table."""
        self.finish(ctx, CallOutcome(None, "not_completed"))
        if ctx.session_call:
            await store.end_call(ctx.identity.key, time.time())

    def analyze(self, ctx: RequestContext) -> Awaitable[None] | None:
        """Run the analyzer; returns what the caller must await when it is asynchronous."""
        if self.analyzer is None:
            return None
        try:
            res = self.analyzer(ctx)
        except Exception:
            log.exception("prompt analyzer failed for %s; scheduling without it", ctx.request_id)
            return None
        if inspect.isawaitable(res):
            return self._await(ctx, res)
        return None

    async def _await(self, ctx: RequestContext, res: Awaitable[None]) -> None:
        try:
            await res
        except Exception:
            log.exception("prompt analyzer failed for %s; scheduling without it", ctx.request_id)

    def snapshot(
        self, endpoints: tuple[EndpointView, ...], session: SessionRecord | None
    ) -> Snapshot:
        states = {}
        for name, fn in self.state_providers.items():
            try:
                states[name] = fn()
            except Exception:
                log.exception("state provider %s failed; scorers see None", name)
        return Snapshot(endpoints, session, self.pipeline.seq, states)

    def decide(
        self,
        ctx: RequestContext,
        endpoints: tuple[EndpointView, ...],
        session: SessionRecord | None,
        *,
        explain: bool = False,
        dry_run: bool = False,
    ) -> Decision:
        """Schedule ``ctx`` over ``endpoints``; the pick is recorded and the decision hooks
        run unless ``dry_run``. Raises :class:`router.scheduling.pipeline.NoCandidates`."""
        d = self.pipeline.schedule(ctx, self.snapshot(endpoints, session), explain=explain)
        if not dry_run:
            self.commit(ctx, d)
        return d

    def commit(self, ctx: RequestContext, d: Decision) -> None:
        """Use a decision taken with ``dry_run``: record the pick and run the decision hooks
        (a disaggregated call decides its prefill leg first, then whether to split at all)."""
        self.pipeline.record(d)
        for fn in self.decision_hooks:
            try:
                fn(ctx, d)
            except Exception:
                log.exception("decision hook %r failed", fn)

    def first_byte(self, ctx: RequestContext) -> None:
        """The answer's first byte arrived (its prefill is done); hooks must be idempotent."""
        for fn in self.first_byte_hooks:
            try:
                fn(ctx)
            except Exception:
                log.exception("first-byte hook %r failed", fn)

    def finish(self, ctx: RequestContext, outcome: CallOutcome) -> None:
        """Tell every observer how ``ctx`` ended (once: later calls do nothing)."""
        if ctx.observed:
            return
        ctx.observed = True
        for fn in self.observers:
            try:
                fn(ctx, outcome)
            except Exception:
                log.exception("observer %r failed", fn)
