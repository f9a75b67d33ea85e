"""The KV layer as state: block index, event ingestion, incremental tokens, footprints.

Owns: :class:`KVState`, one per router process, which the call sequence
(:mod:`router.call`) drives through three seams — :meth:`KVState.analyze` (render + tokenize
incrementally per session and fill ``ctx.block_keys`` / ``ctx.prompt_tokens``),
:meth:`KVState.view` (the read-only :class:`router.kv.view.KVView` scorers receive) and
:meth:`KVState.observe` (after each call, from its typed :class:`router.outcome.CallOutcome`:
session footprints, approximate-mode history, per-replica statistics, calibration) — plus
the lifetime of the ZMQ subscribers feeding the block index (:meth:`start` / :meth:`close`)
and replica membership (:meth:`watch`). :func:`router.app.build_app` installs it
(``build_app(cfg, kv=state)``). Must not import aiohttp, the proxy, torch or vllm.

Replica membership: :meth:`watch` subscribes to a :class:`router.replicas.ReplicaSet`'s
changes. A replica that discovery removes and that
stays absent for ``forget_after_s`` (checked on each :meth:`view`, membership change and
sweep) is forgotten everywhere here — index, approximate cache, event streams (its events
are ignored from then on), load stats, calibration, and sessions' homes on it; one that is
back before then (a readiness blip) keeps all of it. One that (re-)appears after being
forgotten is expected by the subscriber again (with its ``replay`` endpoint from the config)
but gets no index entry until its first event batch arrives (``seq`` 0: fresh from there;
else a gap: replayed from 0, or stale) — until then, as for a replica that never sends
events, scorers use approximate mode for it.

Per-session footprints (:mod:`router.kv.sessions`) are keyed by the session table key. A
parent with a child call in flight is *pinned* (kept warm: never counted as evictable). A
session's state is released after its final call (``final`` flag) or ``session_idle_ttl_s``
without calls.

Calibration fits the TTFT a scorer predicted for the chosen replica — the ``model_ttft_s``
term on the decision (``kv_cost`` gives it; any scorer may) — against the observed TTFT, and
the decode scale from the ``model_itl_s`` term against the call's median inter-token time,
and — for a call the scorer priced as loading from the cluster pool (its ``model_pool_fetch``
term) — the replica's pool link from the TTFT left after the calibrated rest
(:meth:`costmodel.calibration.Calibrator.observe_pool_fetch`).
Output lengths and gaps are learnt from what calls show (per session, and an EWMA over every
session as the prior for sessions that have shown none): nothing a client would not send.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

from costmodel.calibration import Calibration, Calibrator, pool_link
from costmodel.profiles import ReplicaProfile, router_profile
from router.kv.analysis import BURST_MIN_CHUNKS, Analyzer, KVCall, _AnalysisLane
from router.kv.approx import TEXT_CHUNK, ApproxCache
from router.kv.autoconf import ReplicaFacts
from router.kv.churn import TierChurn
from router.kv.config import KVConfig
from router.kv.discovery import KVSettingsDiscovery
from router.kv.footprints import FootprintTable
from router.kv.index import BlockIndex
from router.kv.membership import MAX_GONE, Membership
from router.kv.sessions import ReplicaStat
from router.kv.snapshot import StateView
from router.kv.tokens import SessionTokenizer
from router.kv.view import KVView
from router.outcome import CallOutcome
from router.vllm.hashing import BlockHasher
from router.vllm.tokenizer import ModelTokenizer

log = logging.getLogger("kvroute.kv")

# the parts of a pool-loading call's TTFT on the decision (kv_cost's ``model_pool_fetch``), in
# the order Calibrator.observe_pool_fetch takes them
POOL_PARTS = ("pool_s", "queue_s", "compute_s", "other_load_s", "overlap")
HOLDING = ("tool-pause", "waiting-on-children")  # hint states the engine plugin holds for

PREFILLING_MAX = 100_000  # calls tracked as awaiting their first byte, before old ones expire
PREFILLING_MAX_AGE_S = 900.0  # past the longest upstream wait (read_timeout_s 600 s)

# the parts of the state that live in their own modules, re-exported for their old importers
__all__ = ["BURST_MIN_CHUNKS", "HOLDING", "MAX_GONE", "KVCall", "KVState", "TierChurn"]


class KVState(Analyzer, Membership, KVSettingsDiscovery):
    """See the module docstring. One per router process: the analyzer (:mod:`.analysis`),
    membership (:mod:`.membership`) and zero-config (:mod:`.discovery`) are its parts."""

    def __init__(
        self,
        cfg: KVConfig,
        tokenizer: ModelTokenizer | None = None,
        clock: Callable[[], float] = time.time,
        profile: ReplicaProfile | None = None,
    ):
        self.cfg = cfg
        self.clock = clock
        self.index = BlockIndex()
        self.approx = ApproxCache()
        # the same routing history over prompt *text* chunks (text_keys): for a call placed
        # before its tokens are known, the replica that was sent its leading text
        self.text_approx = ApproxCache()
        self.hasher = BlockHasher(cfg.block_size, cfg.hash_algo, cfg.hash_seed)
        if tokenizer is None and cfg.tokenizer:
            tokenizer = ModelTokenizer.from_dir(cfg.tokenizer)
        self.tokenizer = tokenizer
        self.tokens = (
            SessionTokenizer(tokenizer, self.hasher, max_tokens=cfg.max_cached_tokens)
            if tokenizer is not None
            else None
        )
        # zero-config (cfg.discover): what the replicas reported, and what came of it
        self.facts: list[ReplicaFacts] = []
        self.discovered = False  # autoconfigure() has applied a replica's facts
        self.discovery_notes: list[str] = []  # why something could not be discovered
        self.tokenizer_source: str | None = "configured" if tokenizer is not None else None
        self.tokenizer_note: str | None = None  # why discovery found no tokenizer
        self._auto_profile: ReplicaProfile | None = None  # generic, sized to the replicas
        self._auto_events: set[str] = set()  # replicas subscribed at tcp://host:events_port
        # zero-config without a tokenizer on this machine: (route, body) -> a replica's token
        # ids for the prompt (its /tokenize), asked for a session's first call (router.app)
        self.remote_tokens: Callable[[str, Any], Awaitable[list[int] | None]] | None = None
        self.remote_stats = {"asked": 0, "tokenized": 0, "failed": 0}
        self.sessions: FootprintTable = FootprintTable()
        self.stats: dict[str, ReplicaStat] = {}
        self.calibrators: dict[str, Calibrator] = {}
        # This router's calls sent and not yet answered with a first byte: request id ->
        # (replica, uncached prompt tokens, when sent). vLLM counts a request in chunked
        # prefill as *running*, so the engine's waiting count misses exactly the long cold
        # prefill a later call queues behind; this is the prefill work the router knows of.
        self.prefilling: dict[str, tuple[str, int, float]] = {}
        # This router's calls sent and not yet finished, with their prompt's block keys:
        # request id -> (replica, keys, when sent). A burst sharing a prefix (subagents, the
        # Mooncake-style traffic of many one-call sessions) arrives before the first call's
        # blocks are stored and its KV events seen; vLLM queues the later calls behind that
        # prefill and then hits its blocks. ``kv_cost`` reads these as the blocks coming to
        # that replica (:meth:`KVView.with_routed`).
        self.routed: dict[str, tuple[str, list[int], float]] = {}
        # calls analysed and not yet placed, by their prompt text's first chunk key: request
        # id -> (text keys, set when it is placed, when analysed); see :meth:`analyze`
        self._undecided: dict[int, dict[str, tuple[list[int], asyncio.Future[None], float]]] = {}
        self.burst_waits = 0  # calls that waited for a leader's placement
        self._profiles: dict[str, ReplicaProfile] = {}
        self._profile_override = profile  # one profile object for every replica (tests, twins)
        self.subscriber: Any = None
        self.events_endpoint: str | None = None
        self._calls = 0
        self.gap_ewma: float | None = None  # mean gap between calls over every session
        self.output_ewma: float | None = None  # mean output tokens per call, every session
        self._gone: dict[str, None] = {}  # removed by discovery and not back (insertion order)
        self._leaving: dict[str, float] = {}  # removed by discovery, not forgotten yet: since
        self._lane: _AnalysisLane | None = None  # started by the first analysis in a loop
        self.host_churn = TierChurn()

    # ---- lifetime (the caller pairs these in an aiohttp cleanup context) --------------------

    async def start(self) -> None:
        """Start the event subscribers (once: a second call does nothing)."""
        cfg = self.cfg
        if self.subscriber is not None or not (
            cfg.events_bind or cfg.events_connect or cfg.events_port
        ):
            return
        from router.kv.events import KVEventSubscriber, topic_to_replica

        def replica_for(topic: str) -> str | None:
            return self.cfg.topics.get(topic) or topic_to_replica(topic)

        sub = KVEventSubscriber(self.index, replica_for_topic=replica_for)
        if self.cfg.events_bind:
            self.events_endpoint = sub.bind(self.cfg.events_bind)
            log.info("kv events: bound %s", self.events_endpoint)
        for url, ep in self.cfg.events_connect.items():
            sub.connect(ep, url, self.cfg.replay.get(url))
        for url, ep in self.cfg.replay.items():
            if url not in self.cfg.events_connect:  # bind mode: indexed from its first batch
                sub.expect_replica(url, ep)
        for url in self._gone:  # removed by discovery before the subscriber existed
            sub.remove_replica(url)
        self.subscriber = sub

    async def close(self) -> None:
        if self.subscriber is not None:
            await self.subscriber.close()
            self.subscriber = None
        if self._lane is not None:  # queued analyses are dropped: no call waits for them now
            self._lane.pool.shutdown(wait=False, cancel_futures=True)
            self._lane = None

    async def lifespan(self, replicas: Any = None) -> AsyncIterator[None]:
        """Start the subscribers and follow ``replicas`` (a :class:`router.replicas.ReplicaSet`,
        see :meth:`watch`) until the context ends; :func:`router.app.build_app` runs it as a
        cleanup context."""
        await self.start()
        if replicas is not None:
            self.watch(replicas)
        try:
            yield
        finally:
            if replicas is not None:
                replicas.remove_listener(self.replicas_changed)
            await self.close()

    # ---- profiles and calibration -------------------------------------------------------------

    def profile_of(self, replica: str) -> ReplicaProfile:
        """The cost-model profile of ``replica`` (configured by URL, else the default)."""
        p = self._profiles.get(replica)
        if p is None:
            named = self.cfg.profiles.get(replica)
            p = self._profile_override or (
                self._auto_profile
                if named is None and self._auto_profile is not None
                else router_profile(named or self.cfg.profile)
            )
            self._profiles[replica] = p
        return p

    def profile(self, replica: str) -> ReplicaProfile:
        """:meth:`profile_of`, and size ``replica``'s approximate cache from it (in the
        router's block size) the first time it is needed."""
        p = self.profile_of(replica)
        if self.approx.capacity(replica) == 0:
            self.approx.set_capacity(replica, p.gpu_kv_blocks * p.block_size // self.cfg.block_size)
            tokens = p.gpu_kv_blocks * p.block_size  # ~4 characters a token
            self.text_approx.set_capacity(replica, max(tokens * 4 // TEXT_CHUNK, 1))
        return p

    def calibration(self, replica: str) -> Calibration:
        """``replica``'s online calibration. Where its own window holds too few samples for a
        fit (a replica that has had little traffic), a time scale is the **fleet's** when
        that is lower: the median fit over the replicas of the same profile that have one,
        capped at the uncalibrated 1 (and no offset). An unmeasured replica is so priced
        optimistically, never dearer than its profile or its peers. Without that, a profile
        far slower than the engines (no profile at all, ``profile: none``) is a trap: the
        first replica calibrated looks several times cheaper than every uncalibrated one and
        takes all the traffic (found in the simulator: 225 of 225 calls on one of 4
        replicas). A fleet fit above 1 (engines slower than the profile, or queueing the
        model missed) is not borrowed: the cold replica then looks cheaper, is tried, and
        measures itself. The pool link's scale is the replica's own (1 until it has one:
        the profile's link)."""
        c = self.calibrators.get(replica)
        now = self.clock()
        own = c.current(now) if c is not None else Calibration()
        need = c.min_samples if c is not None else Calibrator().min_samples
        if own.ttft_samples >= need and own.itl_samples >= need:
            return own
        name = self.profile_of(replica).name
        fits = [
            f
            for r, k in self.calibrators.items()
            if r != replica and self.profile_of(r).name == name
            for f in (k.current(now),)
        ]
        ttft = [f.prefill_scale for f in fits if f.ttft_samples >= need]
        itl = [f.decode_scale for f in fits if f.itl_samples >= need]
        if own.ttft_samples < need and ttft:
            own = replace(own, prefill_scale=min(1.0, statistics.median(ttft)))
        if own.itl_samples < need and itl:
            own = replace(own, decode_scale=min(1.0, statistics.median(itl)))
        return own

    def pool_link(self, replica: str) -> dict[str, float]:
        """``replica``'s cluster-pool link as the cost model prices it: the profile's figures,
        the calibrated ones (:func:`costmodel.calibration.pool_link`), the scale and the
        exposed pool loads it was fitted on (/metrics, /admin/config)."""
        hw = self.profile_of(replica).hardware
        cal = self.calibration(replica)
        lat, bw = pool_link(hw.pool_latency_s, hw.pool_bw, cal)
        return {"scale": cal.pool_scale, "latency_s": lat, "bw": bw,
                "samples": float(cal.pool_samples), "profile_latency_s": hw.pool_latency_s,
                "profile_bw": hw.pool_bw}  # fmt: skip

    # ---- the decision hook: where it goes ------------------------------------------------------

    def decided(self, ctx: Any, decision: Any) -> None:
        """Record the routed prompt in the chosen replica's approximate cache (routing
        history: approximate mode, and the sglang-style tree), at selection time as
        sglang-router inserts into its tree — a burst sharing a prefix sees it at once."""
        keys = ctx.block_keys
        replica = decision.endpoint.name
        self._placed(ctx)
        if keys:
            self.profile(replica)
            self.approx.record(replica, keys)
            self.routed[ctx.request_id] = (replica, keys, self.clock())
        call = ctx.analysis if isinstance(ctx.analysis, KVCall) else None
        if call is not None and call.text_keys:
            self.profile(replica)
            self.text_approx.record(replica, call.text_keys)
        est = ctx.analysis.est_tokens if isinstance(ctx.analysis, KVCall) else 0
        n_tok = int(ctx.prompt_tokens or len(keys or ()) * self.cfg.block_size or est)
        if n_tok > 0:  # a retry decides again: the entry follows the call to its new replica
            matched = int(decision.term(replica, "match_blocks") or 0) * self.cfg.block_size
            matched = int(matched * self.calibration(replica).hit_realization)
            self.prefilling[ctx.request_id] = (replica, max(n_tok - matched, 0), self.clock())
            if len(self.prefilling) > PREFILLING_MAX or len(self.routed) > PREFILLING_MAX:
                self._expire_prefilling()

    def prefill_done(self, ctx: Any) -> None:
        """The call's first byte arrived: its prompt no longer waits for prefill."""
        self.prefilling.pop(ctx.request_id, None)

    def _expire_prefilling(self) -> None:
        """Drop entries older than ``PREFILLING_MAX_AGE_S`` (a call the router lost track of
        must not count as queued work for ever)."""
        cut = self.clock() - PREFILLING_MAX_AGE_S
        for rid in [k for k, v in self.prefilling.items() if v[2] < cut]:
            del self.prefilling[rid]
        for rid in [k for k, v in self.routed.items() if v[2] < cut]:
            del self.routed[rid]

    def pending_prefill(self) -> dict[str, tuple[int, int]]:
        """Per replica: (calls, uncached prompt tokens) this router sent there that have not
        had their first byte yet."""
        cut = self.clock() - PREFILLING_MAX_AGE_S
        out: dict[str, tuple[int, int]] = {}
        for replica, tokens, at in self.prefilling.values():
            if at >= cut:
                n, t = out.get(replica, (0, 0))
                out[replica] = (n + 1, t + tokens)
        return out

    def prefill_sent_since(self, replica: str, t: float) -> int:
        """Uncached prompt tokens of this router's calls sent to ``replica`` at or after ``t``
        (this state's clock) that have not had their first byte yet."""
        return sum(n for r, n, at in self.prefilling.values() if r == replica and at >= t)

    # ---- the observer: what happened ----------------------------------------------------------

    def observe(self, ctx: Any, outcome: CallOutcome) -> None:
        self._placed(ctx)  # a call that ended before it was placed
        self.prefilling.pop(ctx.request_id, None)  # ended without a first byte, or after one
        self.routed.pop(ctx.request_id, None)  # its blocks are in the index now (or evicted)
        if not getattr(ctx, "session_call", True):  # count_tokens & co.: no turn, no KV
            return
        replica = outcome.replica
        now = self.clock()
        ident = ctx.identity
        fp = self.sessions.get(ident.key)
        call = ctx.analysis if isinstance(ctx.analysis, KVCall) else None
        if call is not None and call.counted:
            call.counted = False
            if fp is not None:
                fp.inflight = max(fp.inflight - 1, 0)
            parent = self.sessions.get(ident.parent) if ident.parent else None
            if parent is not None:
                parent.children_inflight = max(parent.children_inflight - 1, 0)
        if replica is None or fp is None:
            return
        if replica in self._gone:  # the call ended on a replica discovery has removed since
            replica = None
        keys = ctx.block_keys or []
        n_tok = int(ctx.prompt_tokens or len(keys) * self.cfg.block_size)
        if not n_tok:  # its analysis never landed: the engine's count, else the estimate
            used = outcome.usage.prompt_tokens if outcome.usage is not None else None
            n_tok = int(used or (call.est_tokens if call is not None else 0))
        out_tokens = outcome.output_tokens
        if keys and replica is not None:
            decision = outcome.decision
            predicted = decision.term(replica, "model_ttft_s") if decision is not None else None
            bs = self.cfg.block_size
            matched = (
                int(decision.term(replica, "match_blocks") or 0) if decision is not None else 0
            )
            reported = outcome.usage.cached_tokens if outcome.usage is not None else None
            cached = matched * bs if reported is None else reported  # engine's, else the match
            self.stats.setdefault(replica, ReplicaStat()).add(max(n_tok - int(cached), 0), n_tok)
            # vLLM recomputes at least the last prompt token, so a fully matched prompt is
            # served one block short: at most the blocks before the last token are expected
            expected = min(matched * bs, (n_tok - 1) // bs * bs)
            if reported is not None and outcome.ok and expected > 0:
                self.calibrators.setdefault(replica, Calibrator()).observe_hit(
                    expected, reported, now
                )
            ttft = outcome.ttft_s
            if predicted is not None and ttft and outcome.ok:
                # uncalibrated: the fit is absolute; in profile seconds: replica twins run
                # time_scale x faster than their profile
                observed = ttft * self.cfg.time_scale
                cal = self.calibrators.setdefault(replica, Calibrator())
                pool = decision.term(replica, "model_pool_fetch")
                if isinstance(pool, Mapping):  # a pool load: fits the pool link (or TTFT)
                    pool_s, queue_s, compute_s, other_s, overlap = (
                        float(pool.get(k) or 0.0) for k in POOL_PARTS
                    )
                    cal.observe_pool_fetch(
                        pool_s, queue_s, compute_s, other_s, overlap, observed, now
                    )
                else:
                    cal.observe_ttft(predicted, observed, now)
            step = decision.term(replica, "model_itl_s") if decision is not None else None
            if step and outcome.itl_s and outcome.ok:
                itl = statistics.median(outcome.itl_s) * self.cfg.time_scale
                self.calibrators.setdefault(replica, Calibrator()).observe_itl(step, itl, now)
        if fp.last_end is not None and fp.inflight == 0:
            start = now - float(outcome.duration_s or 0.0)
            gap = max(start - fp.last_end, 0.0)
            fp.gaps = [*fp.gaps[-19:], gap]
            g = self.gap_ewma
            self.gap_ewma = gap if g is None else 0.95 * g + 0.05 * gap
        fp.replica = replica
        fp.tokens = n_tok + (out_tokens or 0)
        if out_tokens:
            fp.outputs = [*fp.outputs[-19:], out_tokens]
            o = self.output_ewma
            self.output_ewma = out_tokens if o is None else 0.95 * o + 0.05 * out_tokens
        fp.last_end = now
        fp.hold_s = self.hold_for(ctx.hint)
        if ident.final:
            self.release(ident.key)

    def hold_for(self, hint: Any) -> float:
        """Seconds the engine plugin holds a session's host-tier chunks after the call that
        carried ``hint`` (``engine_patches.retention_rule``: ``min(return_s × slack, ttl)``,
        the TTL without ``return_s``; 0 for ``running`` / ``done`` or no hint)."""
        if not isinstance(hint, Mapping) or hint.get("state") not in HOLDING:
            return 0.0
        cfg = self.cfg
        ret = hint.get("return_s")
        if isinstance(ret, int | float) and ret >= 0:
            return min(float(ret) * cfg.retention_return_slack, cfg.retention_ttl_s)
        return cfg.retention_ttl_s

    def release(self, key: str) -> None:
        """A session ended: forget its footprint and its incremental-tokenizer state (on the
        analysis thread when there is one: only that thread touches the tokenizer's caches)."""
        self.sessions.pop(key, None)
        if self.tokens is not None:
            if self._lane is not None:
                self._lane.pool.submit(self.tokens.forget, key)
            else:
                self.tokens.forget(key)

    def sweep(self) -> None:
        now = self.clock()
        self.expire_removed(now)
        for first, group in list(self._undecided.items()):
            done = [r for r, (_, fut, at) in group.items() if self._undecided_done(fut, at, now)]
            for rid in done:
                del group[rid]
            if not group:
                del self._undecided[first]
        ttl = self.cfg.session_idle_ttl_s
        for k in [
            k
            for k, s in self.sessions.items()
            if s.inflight == 0 and s.last_end is not None and now - s.last_end > ttl
        ]:
            self.release(k)

    # ---- the read-only view -------------------------------------------------------------------

    def view(self) -> KVView:
        self.expire_removed()
        now = self.clock()
        for r in self.index.replicas():
            st = self.index.state(r)
            if st is not None and st.removed["CPU"]:
                self.host_churn.sample(r, now, st.removed["CPU"])
        return StateView(self)
