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
the decode scale from the ``model_itl_s`` term against the call's median inter-token time.
Output lengths and gaps are learnt from what calls show (per session, and an EWMA over every
session as the prior for sessions that have shown none): nothing a client would not send.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from costmodel.calibration import Calibration, Calibrator
from costmodel.profiles import ReplicaProfile, router_profile
from router.kv.approx import TEXT_CHUNK, TEXT_LIMIT, ApproxCache, text_keys
from router.kv.autoconf import (
    SEEDED_ALGOS,
    LayerStatus,
    ReplicaFacts,
    events_endpoint,
    find_tokenizer,
)
from router.kv.config import KVConfig
from router.kv.index import BlockIndex
from router.kv.sessions import ReplicaStat, SessionFootprint
from router.kv.tokens import ProcessEncoder, SessionTokenizer
from router.kv.view import KVView
from router.outcome import CallOutcome
from router.sessions import prompt_prefix_text
from router.vllm.chat_template import ChatTemplateError, request_prompt
from router.vllm.hashing import BlockHasher
from router.vllm.tokenizer import ModelTokenizer

log = logging.getLogger("kvroute.kv")

HOLDING = ("tool-pause", "waiting-on-children")  # hint states the engine plugin holds for

MAX_GONE = 1024  # removed replicas remembered (late call outcomes there are not recorded)
PREFILLING_MAX = 100_000  # calls tracked as awaiting their first byte, before old ones expire
# a follower waits for a leader's placement only if their prompt texts share this many leading
# TEXT_CHUNK-character chunks (8 KB, ~2k tokens) and at least half of the follower's text
BURST_MIN_CHUNKS = 8
PREFILLING_MAX_AGE_S = 900.0  # past the longest upstream wait (read_timeout_s 600 s)


@dataclass
class KVCall:
    """What the analyzer learnt of one call (``ctx.analysis``), for the observer."""

    counted: bool = False  # footprint in-flight counts were raised: lower them once
    # the prompt's size guessed from the body's characters, for a call placed before its
    # analysis is done (0: not guessed); the analysis, when it lands, replaces it
    est_tokens: int = 0
    # chained hashes of the prompt text's leading TEXT_CHUNK-character chunks: what a call
    # placed before its analysis matches against the text routed to each replica
    text_keys: list[int] = field(default_factory=list)


def _text_chars(body: Any, limit: int = 100_000) -> int:
    """Characters of text in a request body (its strings, walked; at most ``limit`` nodes)."""
    size = 0
    todo: list[Any] = [body]
    seen = 0
    while todo and seen < limit:
        x = todo.pop()
        seen += 1
        if isinstance(x, str):
            size += len(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, list):
            todo.extend(x)
    return size


class _AnalysisLane:
    """The one analysis thread of a :class:`KVState` (the incremental tokenizer's caches are
    touched only there) and what it knows of the queue: calls pending, characters of cold
    work queued, the measured cost per character, and counts of how calls fared."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kvroute-analysis")
        self.pending = 0
        self.cold_chars = 0
        self.s_per_char = 1e-6  # ~1 µs per character to start with, then measured
        self.chars_per_token = 4.0  # the body's characters per prompt token, then measured
        self.stats = {"waited": 0, "not_waited": 0, "late": 0, "dropped": 0}


class TierChurn:
    """Blocks removed per second from each replica's host tier, over the last ``window_s``:
    samples of the index's running count of ``BlockRemoved`` (medium CPU), one per second
    at most, taken when a view is made (a decision is about to read it)."""

    def __init__(self, window_s: float = 60.0, min_span_s: float = 5.0):
        self.window_s = window_s
        self.min_span_s = min_span_s
        self._samples: dict[str, deque[tuple[float, int]]] = {}

    def sample(self, replica: str, now: float, removed: int) -> None:
        dq = self._samples.get(replica)
        if dq is None:
            dq = self._samples[replica] = deque()
        if dq and removed < dq[-1][1]:
            dq.clear()  # the replica's index state was rebuilt: start over
        if not dq or now - dq[-1][0] >= 1.0:
            dq.append((now, removed))
        while len(dq) > 2 and now - dq[1][0] >= self.window_s:
            dq.popleft()

    def rate(self, replica: str) -> float | None:
        """Removals per second over the window; None until it spans ``min_span_s``."""
        dq = self._samples.get(replica)
        if not dq or dq[-1][0] - dq[0][0] < self.min_span_s:
            return None
        return (dq[-1][1] - dq[0][1]) / (dq[-1][0] - dq[0][0])

    def forget(self, replica: str) -> None:
        self._samples.pop(replica, None)


class KVState:
    """See the module docstring. One per router process."""

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
        self.sessions: dict[str, SessionFootprint] = {}
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

    # ---- replica membership (discovery) -------------------------------------------------------

    def watch(self, replicas: Any) -> None:
        """Follow ``replicas`` (a :class:`router.replicas.ReplicaSet`): its current members
        are expected from now on and every later change reaches :meth:`replicas_changed`."""
        replicas.add_listener(self.replicas_changed)
        self.replicas_changed(frozenset(r.name for r in replicas), frozenset())

    def replicas_changed(self, added: frozenset[str], removed: frozenset[str]) -> None:
        """A :class:`router.replicas.ReplicaSet` listener: removed replicas are forgotten once
        they have stayed away ``forget_after_s`` (at once when it is 0); (re-)added ones are
        expected again."""
        now = self.clock()
        for name in removed:
            self._leaving.setdefault(name, now)
        # first forget what has been away too long (an idle router may not have looked since),
        # so a replica that comes back after its grace starts over instead of keeping stale state
        self.expire_removed(now)
        for name in added:
            if self._leaving.pop(name, None) is not None:
                continue  # back before it was forgotten: everything about it still holds
            self._gone.pop(name, None)
            if self.subscriber is not None:  # no index entry: that waits for its events
                self.subscriber.expect_replica(name, self.cfg.replay.get(name))
                self._connect_events(name)

    def _connect_events(self, name: str) -> None:
        """With ``events_port``: subscribe to ``tcp://<name's host>:<events_port>`` (vLLM's
        publisher binds ``tcp://*:PORT``) unless ``events_connect`` names the replica. No
        index entry is made: a replica whose publisher never answers (events not enabled
        there) stays in approximate mode rather than looking empty."""
        port = self.cfg.events_port
        if port is None or name in self.cfg.events_connect or name in self._auto_events:
            return
        ep = events_endpoint(name, port)
        try:
            self.subscriber.connect(ep, name, self.cfg.replay.get(name), fresh=False)
        except Exception as e:  # a malformed address must not break discovery
            log.warning("kv events: cannot subscribe to %s for %s: %s", ep, name, e)
            return
        self._auto_events.add(name)
        log.info("kv events: subscribed to %s for %s", ep, name)

    def expire_removed(self, now: float | None = None) -> None:
        """Forget the replicas discovery removed at least ``forget_after_s`` ago."""
        if not self._leaving:
            return
        now = self.clock() if now is None else now
        for name in [n for n, t in self._leaving.items() if now - t >= self.cfg.forget_after_s]:
            del self._leaving[name]
            self.forget_replica(name)

    def forget_replica(self, name: str) -> None:
        """Drop everything known about ``name``: its blocks (index, approximate mode, the text
        routing history and the prompts in flight there), its event streams and replays in
        flight (its events are ignored until it is added again), load stats, calibration, and
        the home of every session that lived there."""
        if self.subscriber is not None:
            self.subscriber.remove_replica(name)
            if name in self._auto_events:
                self._auto_events.discard(name)
                self.subscriber.disconnect(name)
        self.index.remove_replica(name)
        self.approx.remove_replica(name)
        self.text_approx.remove_replica(name)
        for rid in [k for k, v in self.routed.items() if v[0] == name]:
            del self.routed[rid]
        self.stats.pop(name, None)
        self.host_churn.forget(name)
        self.calibrators.pop(name, None)
        self._profiles.pop(name, None)  # re-sets the approximate capacity if it comes back
        for fp in self.sessions.values():
            if fp.replica == name:
                fp.replica = None
        self._leaving.pop(name, None)
        self._gone.pop(name, None)  # to the end: the newest removal is kept longest
        self._gone[name] = None
        while len(self._gone) > MAX_GONE:
            del self._gone[next(iter(self._gone))]

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

    # ---- zero-config: what the replicas report -------------------------------------------------

    def autoconfigure(self, facts: list[ReplicaFacts]) -> bool:
        """Complete a ``discover`` layer from what the replicas reported (``facts``: one per
        replica that answered ``/v1/models``): the tokenizer (unless configured) found from the
        served model (:func:`router.kv.autoconf.find_tokenizer`), the block size and hash
        algorithm from vLLM's ``vllm:cache_config_info``, and — with profile ``none`` — the
        generic stand-in sized to the replica's reported KV capacity. Applied once, from the
        first replica that reported a model (replicas that disagree are noted in
        :meth:`status`); returns whether it has been applied. Call before the first analysis
        (``build_app``'s KV context does, before traffic)."""
        if not self.cfg.discover or self.discovered:
            return self.discovered
        cards = [f for f in facts if f.model is not None]
        if not cards:
            return False
        self.facts = list(facts)
        ref = next((f for f in cards if f.block_size is not None), cards[0])
        notes: list[str] = []
        cfg = self.cfg
        changes: dict[str, Any] = {}
        if ref.block_size is not None:
            changes["block_size"] = ref.block_size
        else:
            notes.append(
                f"{ref.replica} reports no vllm:cache_config_info block_size on /metrics: "
                f"block keys use {cfg.block_size} tokens and may not match its KV events"
            )
        if ref.hash_algo is not None:
            changes["hash_algo"] = ref.hash_algo
        else:
            notes.append(
                f"{ref.replica} reports no prefix_caching_hash_algo: assuming {cfg.hash_algo}"
            )
        for f in cards:
            if f is ref:
                continue
            for attr in ("model", "block_size", "hash_algo"):
                mine, theirs = getattr(ref, attr), getattr(f, attr)
                if theirs is not None and mine is not None and theirs != mine:
                    notes.append(
                        f"replicas disagree on {attr}: {ref.replica} {mine}, {f.replica} {theirs}"
                        f" (using {mine})"
                    )
        if ref.prefix_caching is False:
            notes.append(f"{ref.replica} runs with prefix caching off: nothing is reused there")
        if changes:
            cfg = self.cfg = replace(cfg, **changes)
            try:
                self.hasher = BlockHasher(cfg.block_size, cfg.hash_algo, cfg.hash_seed)
            except ValueError as e:  # xxhash without the engines' seed, or no xxhash package
                notes.append(f"block keys cannot match the replicas' events: {e}")
                self.hasher = BlockHasher(cfg.block_size, "sha256_cbor", cfg.hash_seed)
        tokenizer = self.tokenizer
        if tokenizer is None:
            path, how = find_tokenizer([ref.root, ref.model])
            if path is not None:
                try:
                    tokenizer = ModelTokenizer.from_dir(path)
                except Exception as e:  # a broken model dir: degrade, never crash
                    self.tokenizer_note = f"{path} failed to load: {e}"
                else:
                    self.cfg = replace(self.cfg, tokenizer=path)
                    self.tokenizer_source = how
            else:
                self.tokenizer_note = how
        self.tokenizer = tokenizer
        self.tokens = (
            SessionTokenizer(tokenizer, self.hasher, max_tokens=self.cfg.max_cached_tokens)
            if tokenizer is not None
            else None
        )
        cap = ref.kv_capacity_tokens
        if self.cfg.profile == "none" and cap:
            base = router_profile("none")
            bs = self.cfg.block_size
            self._auto_profile = base.replace(block_size=bs, gpu_kv_blocks=max(cap // bs, 1))
            self._profiles.clear()
        self.discovery_notes = notes
        self.discovered = True
        return True

    def status(self, replicas: list[str] | None = None) -> LayerStatus:
        """How fully the layer runs: ``full`` (tokens and block keys matching the replicas'
        KV events), else ``approximate`` with the reasons (no tokenizer: placed on prompt
        text and session context; no events: the index is this router's routing history;
        block size or hash unknown: keys may not match the events). ``replicas`` (names)
        adds each one's event stream state: ``fresh``, ``stale`` or ``waiting`` (no batch
        yet: approximate mode for that replica)."""
        cfg = self.cfg
        reasons: list[str] = []
        if cfg.discover and not self.discovered:
            reasons.append("no replica has reported its model (/v1/models) yet")
        if self.tokens is None:
            if not (cfg.discover and not self.discovered):
                why = f" ({self.tokenizer_note})" if self.tokenizer_note else ""
                first = (
                    "a session's first call is tokenized by a replica's /tokenize, later "
                    if self.remote_tokens is not None
                    else ""
                )
                reasons.append(
                    f"no tokenizer{why}: {first}calls are placed on their prompt text and "
                    "session context (give kv.tokenizer, or the model directory on this machine)"
                )
        has_events = bool(cfg.events_bind or cfg.events_connect or cfg.events_port)
        if not has_events:
            reasons.append(
                "no KV events (--kv-events-port): the index is this router's routing history"
            )
        if cfg.hash_algo in SEEDED_ALGOS and cfg.hash_seed is None:
            reasons.append(
                f"hash algorithm {cfg.hash_algo} without hash_seed: block keys cannot match "
                "the replicas' events"
            )
        reasons.extend(self.discovery_notes)
        facts: dict[str, Any] = {
            "block_size": cfg.block_size,
            "hash_algo": cfg.hash_algo,
            "tokenizer": self.tokenizer_source,
            "profile": self._auto_profile.name + " (sized from the replicas)"
            if self._auto_profile is not None
            else cfg.profile,
            "events": f"tcp://<replica host>:{cfg.events_port}"
            if cfg.events_port
            else cfg.events_bind or ("connect" if cfg.events_connect else None),
        }
        if self.facts:
            ref = next((f for f in self.facts if f.model), None)
            if ref is not None:
                facts["model"] = ref.model
                facts["max_model_len"] = ref.max_model_len
        if replicas is not None and has_events:
            streams = {}
            for r in replicas:
                st = self.index.state(r)
                streams[r] = "waiting" if st is None else "stale" if st.stale else "fresh"
            facts["event_streams"] = streams
        return LayerStatus("full" if not reasons else "approximate", reasons, facts)

    @property
    def chars_per_token(self) -> float:
        """Body characters per prompt token, as measured by the analyses so far (4 before)."""
        return self._lane.chars_per_token if self._lane is not None else 4.0

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
        measures itself."""
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

    # ---- the analyzer: tokens + block keys ----------------------------------------------------

    def _count(self, ctx: Any, fp: SessionFootprint, call: KVCall, n_tokens: int) -> None:
        """The call (of ``n_tokens`` prompt tokens) is in flight: its session's footprint is
        pinned (and its parent's, while it waits on this child) until :meth:`observe` lowers
        the counts; the new tokens this turn adds are what the session's next prefill is
        expected to be."""
        if fp.tokens:
            fp.turn_tokens = max(n_tokens - fp.tokens, 0)
        fp.inflight += 1
        parent = ctx.identity.parent
        if parent and parent in self.sessions:
            self.sessions[parent].children_inflight += 1
        call.counted = True

    def analyze(self, ctx: Any) -> Awaitable[None] | None:
        """:meth:`_analyze`, and for a call whose prompt text mostly repeats that of a call
        analysed but not yet placed (a cold burst sharing a prefix: subagents, many one-call
        sessions on one system prompt), also a wait — within ``cfg.analysis_wait_s`` — for
        that call's placement. sglang-router inserts a call's text into its tree at selection
        and sends the next one after it; without the wait, a follower whose analysis queues
        behind the leader's is placed first, blind to it, and both compute the prefix."""
        own = self._analyze(ctx)
        call = ctx.analysis
        if not isinstance(call, KVCall) or not call.text_keys or self.cfg.analysis_wait_s <= 0:
            return own
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return own  # the simulator, tests: calls are analysed and placed one by one
        lead = self._burst_lead(call.text_keys)
        keys = call.text_keys
        self._undecided.setdefault(keys[0], {})[ctx.request_id] = (
            keys, loop.create_future(), self.clock()
        )  # fmt: skip
        if lead is None:
            return own
        self.burst_waits += 1
        return self._follow(lead, own)

    async def _follow(self, lead: asyncio.Future[None], own: Awaitable[None] | None) -> None:
        waits: list[Awaitable[Any]] = [
            asyncio.wait_for(asyncio.shield(lead), self.cfg.analysis_wait_s)
        ]
        if own is not None:
            waits.append(own)
        await asyncio.gather(*waits, return_exceptions=True)

    async def _remote_analysis(
        self, ctx: Any, remote: Callable[[str, Any], Awaitable[list[int] | None]]
    ) -> None:
        """A session's first call without a local tokenizer: its token ids from a replica's
        ``/tokenize`` (within ``analysis_wait_s``), hashed here into its block keys, so it is
        matched against the KV events as with a tokenizer. Later calls of the session are
        placed on their text and the session's context (a round trip per call would load the
        replicas' API servers with every prompt twice)."""
        st = self.remote_stats
        st["asked"] += 1
        try:
            ids = await asyncio.wait_for(remote(ctx.route, ctx.body), self.cfg.analysis_wait_s)
        except Exception as e:  # a slow or failing replica: placed on what is known
            st["failed"] += 1
            log.debug("kv: /tokenize for %s failed: %r", ctx.request_id, e)
            return
        if not ids:
            st["failed"] += 1
            return
        if ctx.observed:  # the call ended (was placed and answered) meanwhile
            return
        salt = ctx.body.get("cache_salt") if isinstance(ctx.body, Mapping) else None
        keys = await asyncio.to_thread(
            self.hasher.hash_keys, ids, cache_salt=salt if isinstance(salt, str) else None
        )
        if ctx.observed:
            return
        ctx.block_keys = keys
        ctx.prompt_tokens = len(ids)
        st["tokenized"] += 1

    def analysis_stats(self) -> dict[str, int]:
        """Calls by how their analysis went (see ``kvroute_kv_analyses_total``)."""
        base = dict.fromkeys(("waited", "not_waited", "late", "dropped"), 0)
        if self._lane is not None:
            base.update(self._lane.stats)
        base["burst_wait"] = self.burst_waits
        return base

    def _burst_lead(self, keys: list[int]) -> asyncio.Future[None] | None:
        """The placement to wait for: the not-yet-placed call sharing the longest leading text
        with ``keys``, if that covers at least half of it (and ``BURST_MIN_CHUNKS``)."""
        group = self._undecided.get(keys[0])
        if not group:
            return None
        now = self.clock()
        need = max(BURST_MIN_CHUNKS, (len(keys) + 1) // 2)
        best: asyncio.Future[None] | None = None
        best_n = 0
        for rid, (other, fut, at) in list(group.items()):
            if self._undecided_done(fut, at, now):
                del group[rid]
                continue
            n = 0
            for a, b in zip(keys, other, strict=False):
                if a != b:
                    break
                n += 1
            if n >= need and n > best_n:
                best, best_n = fut, n
        if not group:
            del self._undecided[keys[0]]
        return best

    def _undecided_done(self, fut: asyncio.Future[None], at: float, now: float) -> bool:
        """An undecided entry to drop: placed, or lost track of (a dropped call) for longer
        than any follower waits."""
        return fut.done() or now - at > self.cfg.analysis_wait_s + 1.0

    def _placed(self, ctx: Any) -> None:
        """``ctx`` was placed (or ended unplaced): calls following it may go on."""
        call = ctx.analysis if isinstance(ctx.analysis, KVCall) else None
        if call is None or not call.text_keys:
            return
        group = self._undecided.get(call.text_keys[0])
        entry = group.pop(ctx.request_id, None) if group is not None else None
        if entry is not None:
            if not entry[1].done():
                entry[1].set_result(None)
            if not group:
                del self._undecided[call.text_keys[0]]

    def _analyze(self, ctx: Any) -> Awaitable[None] | None:
        """Open the session's footprint; fill ``ctx.block_keys``, ``ctx.prompt_tokens`` and
        ``ctx.analysis`` (a :class:`KVCall`) from the body when a tokenizer is configured.

        Inside a running event loop (the router) the render + tokenize + hash work runs on one
        analysis thread, never on the loop, and this returns what the call awaits: its own
        analysis, for at most ``cfg.analysis_wait_s``. A call that would wait behind more than
        ``cfg.analysis_behind_s`` of other calls' cold analyses (sessions the tokenizer does
        not know yet: a full tokenization, ~0.3 s for 142k tokens; estimated from the queued
        characters and the measured cost per character) does not wait (nor does one past the
        wait): it is placed on what is known (session, prefix, load) while its tokens are
        still computed, so the session's next call is warm. Warm analyses (incremental, ~1 ms)
        are not counted as work ahead.
        At most ``cfg.analysis_queue`` analyses wait for the thread; beyond that a call is not
        analyzed. Without a running loop (the simulator,
        unit tests) the work is done here, synchronously."""
        self._calls += 1
        if self._calls % 256 == 0:
            self.sweep()
        ident = ctx.identity
        fp = self.sessions.get(ident.key)
        if fp is None:
            fp = self.sessions[ident.key] = SessionFootprint(ident.key, parent=ident.parent)
        call = KVCall()
        ctx.analysis = call
        tokens, tokenizer = self.tokens, self.tokenizer
        if tokens is None or tokenizer is None:
            if ctx.block_keys:  # keys given by the caller (the simulator): count it in flight
                n = ctx.prompt_tokens or len(ctx.block_keys) * self.cfg.block_size
                self._count(ctx, fp, call, int(n))
            elif ctx.body and self.cfg.discover:
                # zero-config without a tokenizer (approximate mode): the call is placed on
                # its text — the leading prompt text routed to each replica, the session's
                # context on its replica, its size from its characters
                call.text_keys = text_keys(prompt_prefix_text(ctx.body, TEXT_LIMIT))
                call.est_tokens = max(int(_text_chars(ctx.body) / self.chars_per_token), fp.tokens)
                self._count(ctx, fp, call, call.est_tokens)
                remote = self.remote_tokens
                if remote is not None and fp.last_end is None and fp.inflight == 1:
                    return self._remote_analysis(ctx, remote)  # the session's first call
            return None
        if ctx.body:
            call.text_keys = text_keys(prompt_prefix_text(ctx.body, TEXT_LIMIT))
        route, body, request_id = ctx.route, ctx.body, ctx.request_id

        def work() -> Any:  # pure CPU: the template, tokens, block hashes (a TokenizedPrompt)
            try:
                prompt = request_prompt(tokenizer, route, body)
            except ChatTemplateError as e:
                log.debug("kv: cannot render %s: %s", request_id, e)
                return None
            if prompt is None:
                return None
            salt = body.get("cache_salt")
            p = tokens.prompt(
                prompt.text,
                session=ident.key,
                add_special_tokens=prompt.add_special_tokens,
                cache_salt=salt if isinstance(salt, str) else None,
            )
            return p

        def apply(p: Any) -> None:  # on the loop: the call's own fields
            if p is None or ctx.observed:
                return
            ctx.block_keys = p.keys
            ctx.prompt_tokens = p.n_tokens
            self._count(ctx, fp, call, p.n_tokens)

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            apply(work())
            return None
        lane = self._lane
        if lane is None:  # the first call inside the loop: start the analysis thread
            if self.cfg.analysis_process:
                enc = ProcessEncoder(tokenizer)
                tokens.tokenizer = enc  # type: ignore[assignment]
                weakref.finalize(self, enc.close)
            lane = self._lane = _AnalysisLane()
        stats = lane.stats
        if lane.pending >= self.cfg.analysis_queue:
            stats["dropped"] += 1
            return None
        cold = not tokens.knows(ident.key)
        chars = _text_chars(body)  # the body's text: a cold job's cost, the prompt's size
        size = chars if cold else 0
        # the prompt's size as far as it is known now, should the call be placed before its
        # analysis lands: at least the session's context so far
        call.est_tokens = max(int(chars / lane.chars_per_token), fp.tokens)
        # seconds of other calls' cold work queued ahead of this one (estimated)
        ahead_s = lane.cold_chars * lane.s_per_char
        lane.pending += 1
        lane.cold_chars += size
        t_submit = time.perf_counter()
        fut = loop.run_in_executor(lane.pool, work)

        def done(f: asyncio.Future[Any]) -> None:
            lane.pending -= 1
            lane.cold_chars -= size
            if chars > 10_000 and not f.cancelled() and f.exception() is None and f.result():
                n = f.result().n_tokens  # learn the characters per token
                if n > 0:
                    lane.chars_per_token = 0.8 * lane.chars_per_token + 0.2 * (chars / n)
            if size > 10_000 and not f.cancelled():  # learn the cost per character
                per = (time.perf_counter() - t_submit - ahead_s) / size
                if per > 0:
                    lane.s_per_char = 0.8 * lane.s_per_char + 0.2 * per
            if not f.cancelled() and f.exception() is not None:
                log.error("kv: analysis of %s failed: %s", request_id,
                          type(f.exception()).__name__)  # fmt: skip

        fut.add_done_callback(done)
        if ahead_s > self.cfg.analysis_behind_s or self.cfg.analysis_wait_s <= 0:
            stats["not_waited"] += 1
            return None

        async def wait() -> None:
            try:
                res = await asyncio.wait_for(asyncio.shield(fut), self.cfg.analysis_wait_s)
            except TimeoutError:
                stats["late"] += 1
                return
            except Exception:
                return
            stats["waited"] += 1
            apply(res)

        return wait()

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
        return KVView(self)
