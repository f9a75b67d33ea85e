"""KV-aware state for the scheduling pipeline: block index, event ingestion, tokens, sessions.

Owns: :class:`KVState`, which plugs into the router core's three seams (see
:mod:`router.scheduling`) — a *prompt analyzer* (render + tokenize incrementally per session
and fill ``ctx.block_keys``), a *state provider* ``"kv"`` (a read-only :class:`KVView` for
scorers) and an *observer* (after each call: session footprints, approximate-mode history,
calibration from observed TTFT) — plus the lifetime of the ZMQ subscribers feeding the block
index (:meth:`start` / :meth:`close`; the caller pairs them in a cleanup context). Also
:class:`KVConfig`. Must not import aiohttp, the proxy, torch or vllm (:meth:`lifespan`, which
only runs inside the router's aiohttp app, looks the app's replica set up when it runs).

Replica membership: :meth:`watch` subscribes to a :class:`router.replicas.ReplicaSet`'s
changes (``lifespan`` does it for the app's set). A replica that discovery removes and that
stays absent for ``forget_after_s`` (checked on each :meth:`view`, membership change and
sweep) is forgotten everywhere here — index, approximate cache, event streams (its events
are ignored from then on), load stats, calibration, and sessions' homes on it; one that is
back before then (a readiness blip) keeps all of it. One that (re-)appears after being
forgotten is expected by the subscriber again (with its ``replay`` endpoint from the config)
but gets no index entry until its first event batch arrives (``seq`` 0: fresh from there;
else a gap: replayed from 0, or stale) — until then, as for a replica that never sends
events, scorers use approximate mode for it.

Per-session footprints (what the cost model's eviction-harm and reserved terms need) live
here, keyed by the session table key: the replica holding the session's KV, its context
size, when its last call ended, its gaps, its parent and in-flight children. A parent with a
child call in flight is *pinned* (kept warm: never counted as evictable). A session's state
is released after its final call (``final`` flag) or ``session_idle_ttl_s`` without calls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from costmodel.calibration import Calibration, Calibrator
from costmodel.placement import Reservation, WarmSession, p_return_after
from costmodel.profiles import ReplicaProfile, load_profile
from router.approx import ApproxCache
from router.hashing import BlockHasher
from router.index import BlockIndex, BlockIndexView, TierDepth
from router.tokens import ChatTemplateError, ModelTokenizer, SessionTokenizer

log = logging.getLogger("kvroute.kv")

MAX_GONE = 1024  # removed replicas remembered (late call outcomes there are not recorded)
MIN_GAP_S = 0.1  # a measured mean gap of 0 s counts as this (back-to-back calls)


@dataclass
class KVConfig:
    """Settings of the KV layer (YAML/env keys of the same names, see docs/kv-routing.md)."""

    tokenizer: str | None = None  # model dir the replicas serve (tokenizer.json + template)
    block_size: int = 16
    hash_algo: str = "sha256_cbor"
    hash_seed: str | None = None  # the engines' PYTHONHASHSEED
    profile: str = "h200-70b-fp8"  # costmodel profile of every replica ...
    profiles: dict[str, str] = field(default_factory=dict)  # ... unless named here (url->name)
    events_bind: str | None = None  # SUB binds here; replicas connect (topic -> replica)
    events_connect: dict[str, str] = field(default_factory=dict)  # replica url -> PUB endpoint
    replay: dict[str, str] = field(default_factory=dict)  # replica url -> replay endpoint
    topics: dict[str, str] = field(default_factory=dict)  # topic -> replica url (bind mode)
    session_idle_ttl_s: float = 1800.0
    expected_output_tokens: int = 400  # until a session has shown its own
    default_gap_s: float = 18.0  # gap between calls until any session has shown one
    forget_after_s: float = 30.0  # a replica discovery removed is forgotten after this long
    time_scale: float = 1.0  # replicas run this many times faster than the profile (twins)
    max_cached_tokens: int = 16_000_000  # incremental tokenizer cache bound

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be positive")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> KVConfig:
        """From a YAML mapping (unknown keys are an error)."""
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown kv settings: {sorted(unknown)}; known: {sorted(known)}")
        return cls(**dict(d))

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> KVConfig | None:
        """``KVROUTE_KV_<KEY>`` variables (mappings as YAML text); ``None`` when none is set."""
        import yaml

        vals: dict[str, Any] = {}
        for name, f in cls.__dataclass_fields__.items():
            raw = env.get("KVROUTE_KV_" + name.upper())
            if raw is None:
                continue
            t = str(f.type)
            if t.startswith("dict"):
                vals[name] = yaml.safe_load(raw) or {}
            elif t.startswith("int"):
                vals[name] = int(raw)
            elif t.startswith("float"):
                vals[name] = float(raw)
            else:
                vals[name] = raw
        return cls(**vals) if vals else None


@dataclass
class SessionFootprint:
    key: str
    replica: str | None = None
    tokens: int = 0  # cached context after its last call (prompt + output)
    last_end: float | None = None
    gaps: list[float] = field(default_factory=list)
    turn_tokens: int = 0  # new tokens its last call added
    outputs: list[int] = field(default_factory=list)
    parent: str | None = None
    inflight: int = 0
    children_inflight: int = 0
    final: bool = False

    def mean_gap(self) -> float | None:
        return sum(self.gaps) / len(self.gaps) if self.gaps else None

    def mean_output(self) -> float | None:
        return sum(self.outputs) / len(self.outputs) if self.outputs else None


@dataclass
class ReplicaStat:
    uncached_ewma: float = 0.0  # prompt tokens a call had to prefill (EWMA)
    context_ewma: float = 0.0  # prompt tokens per call (EWMA)
    calls: int = 0

    def add(self, uncached: float, context: float, alpha: float = 0.2) -> None:
        if self.calls == 0:
            self.uncached_ewma, self.context_ewma = uncached, context
        else:
            self.uncached_ewma += alpha * (uncached - self.uncached_ewma)
            self.context_ewma += alpha * (context - self.context_ewma)
        self.calls += 1


def usage_from_tail(tail: bytes) -> dict[str, Any] | None:
    """The ``usage`` object of a response from its last bytes (SSE or JSON), if present."""
    import orjson

    if not tail or b'"usage"' not in tail:
        return None
    for line in reversed(tail.split(b"\n")):
        line = line.strip()
        if line.startswith(b"data: "):
            line = line[6:]
        if b'"usage"' not in line or not line.startswith(b"{"):
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        u = obj.get("usage") if isinstance(obj, dict) else None
        if isinstance(u, dict):
            return u
    return None


def _text_of_anthropic(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An Anthropic ``/v1/messages`` body as OpenAI chat messages (text parts only)."""

    def text(c: Any) -> str:
        if isinstance(c, str):
            return c
        if isinstance(c, list):
            return "".join(
                p.get("text", "") for p in c if isinstance(p, dict) and p.get("type") == "text"
            )
        return ""

    msgs: list[dict[str, Any]] = []
    if body.get("system"):
        msgs.append({"role": "system", "content": text(body["system"])})
    for m in body.get("messages") or []:
        if isinstance(m, dict):
            msgs.append({"role": m.get("role", "user"), "content": text(m.get("content"))})
    return msgs


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
        self.hasher = BlockHasher(cfg.block_size, cfg.hash_algo, cfg.hash_seed)
        if tokenizer is None and cfg.tokenizer:
            tokenizer = ModelTokenizer.from_dir(cfg.tokenizer)
        self.tokenizer = tokenizer
        self.tokens = (
            SessionTokenizer(tokenizer, self.hasher, max_tokens=cfg.max_cached_tokens)
            if tokenizer is not None
            else None
        )
        self.sessions: dict[str, SessionFootprint] = {}
        self.stats: dict[str, ReplicaStat] = {}
        self.calibrators: dict[str, Calibrator] = {}
        self._profiles: dict[str, ReplicaProfile] = {}
        self._profile_override = profile  # one profile object for every replica (tests, twins)
        self.subscriber: Any = None
        self.events_endpoint: str | None = None
        self._calls = 0
        self.gap_ewma: float | None = None  # mean gap between calls over every session
        self._gone: dict[str, None] = {}  # removed by discovery and not back (insertion order)
        self._leaving: dict[str, float] = {}  # removed by discovery, not forgotten yet: since

    # ---- lifetime (the caller pairs these in an aiohttp cleanup context) --------------------

    async def start(self) -> None:
        if not (self.cfg.events_bind or self.cfg.events_connect):
            return
        from router.events import KVEventSubscriber, topic_to_replica

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

    async def lifespan(self, app: Any) -> Any:
        """An aiohttp cleanup context (``app.cleanup_ctx.append(state.lifespan)``): starts the
        subscribers and follows the app's replica set (:meth:`watch`)."""
        await self.start()
        replicas = _app_replicas(app)
        if replicas is not None:
            self.watch(replicas)
        yield
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

    def expire_removed(self, now: float | None = None) -> None:
        """Forget the replicas discovery removed at least ``forget_after_s`` ago."""
        if not self._leaving:
            return
        now = self.clock() if now is None else now
        for name in [n for n, t in self._leaving.items() if now - t >= self.cfg.forget_after_s]:
            del self._leaving[name]
            self.forget_replica(name)

    def forget_replica(self, name: str) -> None:
        """Drop everything known about ``name``: its blocks (index and approximate mode), its
        event streams and replays in flight (its events are ignored until it is added again),
        load stats, calibration, and the home of every session that lived there."""
        if self.subscriber is not None:
            self.subscriber.remove_replica(name)
        self.index.remove_replica(name)
        self.approx.remove_replica(name)
        self.stats.pop(name, None)
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

    def app_kwargs(self) -> dict[str, Any]:
        """``build_app(cfg, **state.app_kwargs())`` wires the analyzer, provider and observer."""
        return {
            "analyzer": self.analyze,
            "state_providers": {"kv": self.view},
            "observers": [self.observe],
        }

    # ---- profiles and calibration -------------------------------------------------------------

    def profile(self, replica: str) -> ReplicaProfile:
        p = self._profiles.get(replica)
        if p is None:
            p = self._profile_override or load_profile(
                self.cfg.profiles.get(replica, self.cfg.profile)
            )
            self._profiles[replica] = p
            if self.approx.capacity(replica) == 0:  # in the index's (router's) block size
                self.approx.set_capacity(
                    replica, p.gpu_kv_blocks * p.block_size // self.cfg.block_size
                )
        return p

    def calibration(self, replica: str) -> Calibration:
        c = self.calibrators.get(replica)
        return c.current(self.clock()) if c is not None else Calibration()

    # ---- the analyzer: tokens + block keys ----------------------------------------------------

    def analyze(self, ctx: Any) -> None:
        """Fill ``ctx.block_keys`` and ``ctx.extra['kv_prompt_tokens']`` from the body."""
        self._calls += 1
        if self._calls % 256 == 0:
            self.sweep()
        ident = ctx.identity
        fp = self.sessions.get(ident.key)
        if fp is None:
            fp = self.sessions[ident.key] = SessionFootprint(ident.key, parent=ident.parent)
        if self.tokens is None:
            return
        body = ctx.body
        route = ctx.route
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        try:
            if "messages" in body and route != "/v1/messages":
                text = self.tokenizer.render(  # type: ignore[union-attr]
                    body["messages"],
                    tools=body.get("tools"),
                    add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                    continue_final_message=bool(body.get("continue_final_message", False)),
                    chat_template_kwargs=body.get("chat_template_kwargs"),
                )
                special = bool(body.get("add_special_tokens", False))
            elif route == "/v1/messages":
                text = self.tokenizer.render(_text_of_anthropic(body))  # type: ignore[union-attr]
                special = False
                ctx.extra["kv_approximate_tokens"] = True
            elif isinstance(body.get("prompt"), str):
                text, special = body["prompt"], True
            else:
                return
        except ChatTemplateError as e:
            log.debug("kv: cannot render %s: %s", ctx.request_id, e)
            return
        p = self.tokens.prompt(text, session=ident.key, add_special_tokens=special, cache_salt=salt)
        ctx.block_keys = p.keys
        ctx.extra["kv_prompt_tokens"] = p.n_tokens
        ctx.extra["kv_reused_tokens"] = p.reused_tokens
        if fp.tokens:
            fp.turn_tokens = max(p.n_tokens - fp.tokens, 0)
        fp.inflight += 1
        if ident.parent and ident.parent in self.sessions:
            self.sessions[ident.parent].children_inflight += 1
        ctx.extra["kv_counted"] = True

    # ---- the observer: what happened ----------------------------------------------------------

    def observe(self, ctx: Any, outcome: Mapping[str, Any]) -> None:
        replica = outcome.get("replica")
        now = self.clock()
        ident = ctx.identity
        fp = self.sessions.get(ident.key)
        if ctx.extra.pop("kv_counted", False):
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
        n_tok = int(ctx.extra.get("kv_prompt_tokens") or len(keys) * self.cfg.block_size)
        usage = usage_from_tail(outcome.get("tail") or b"")
        out_tokens = None
        if usage is not None:
            out_tokens = usage.get("completion_tokens") or usage.get("output_tokens")
            details = usage.get("prompt_tokens_details") or {}
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                ctx.extra["kv_cached_tokens"] = int(details["cached_tokens"])
        elif outcome.get("events"):
            out_tokens = max(int(outcome["events"]) - 2, 0) or None  # SSE chunks ~ tokens
        if keys and replica is not None:
            # routing history (approximate mode, and the SGLang-style baseline's tree)
            self.profile(replica)
            self.approx.record(replica, keys)
            predicted = ctx.extra.get("kv_cost", {}).get(replica)
            cached = ctx.extra.get("kv_cached_tokens")  # the engine's own count, when given
            if cached is None:
                cached = (predicted["match_blocks"] if predicted else 0) * self.cfg.block_size
            self.stats.setdefault(replica, ReplicaStat()).add(max(n_tok - int(cached), 0), n_tok)
            ttft = outcome.get("ttft_s")
            if predicted and ttft and outcome.get("status") == "200":
                modelled = predicted["model_ttft_s"]  # uncalibrated: the fit is absolute
                # in profile seconds: replica twins run time_scale x faster than their profile
                observed = ttft * self.cfg.time_scale
                cal = self.calibrators.setdefault(replica, Calibrator())
                cal.observe_ttft(modelled, observed, now)
        if fp.last_end is not None and fp.inflight == 0:
            start = now - float(outcome.get("duration_s") or 0.0)
            gap = max(start - fp.last_end, 0.0)
            fp.gaps = [*fp.gaps[-19:], gap]
            g = self.gap_ewma
            self.gap_ewma = gap if g is None else 0.95 * g + 0.05 * gap
        fp.replica = replica
        fp.tokens = n_tok + (out_tokens or 0)
        if out_tokens:
            fp.outputs = [*fp.outputs[-19:], out_tokens]
        fp.last_end = now
        if ident.final:
            self.release(ident.key)

    def release(self, key: str) -> None:
        """A session ended: forget its footprint and its incremental-tokenizer state."""
        self.sessions.pop(key, None)
        if self.tokens is not None:
            self.tokens.forget(key)

    def sweep(self) -> None:
        now = self.clock()
        self.expire_removed(now)
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
        return KVView(self)


def _app_replicas(app: Any) -> Any:
    """The router app's :class:`router.replicas.ReplicaSet`, or ``None`` (no app, or not the
    router's). Imported here, not at module level, so this module stays free of aiohttp."""
    if app is None:
        return None
    try:
        from router.app import REPLICAS

        return app.get(REPLICAS)
    except (ImportError, AttributeError, TypeError):
        return None


class KVView:
    """What KV-aware scorers may read (no mutation): matches, profiles, footprints."""

    def __init__(self, st: KVState):
        self._st = st
        self.index: BlockIndexView = st.index.view()
        self.now = st.clock()
        self.block_size = st.cfg.block_size
        self.expected_output_tokens = st.cfg.expected_output_tokens

    def source(self, replica: str) -> str:
        """``"events"`` when the index is fresh for ``replica``, else ``"approx"``."""
        s = self._st.index.state(replica)
        return "events" if s is not None and not s.stale else "approx"

    def match(self, keys: list[int], replicas: list[str]) -> dict[str, TierDepth]:
        fresh = [r for r in replicas if self.source(r) == "events"]
        rest = [r for r in replicas if r not in fresh]
        out = self._st.index.match(keys, fresh) if fresh else {}
        if rest:
            out.update(self._st.approx.match(keys, rest))
        return out

    def approx_match(self, keys: list[int], replicas: list[str]) -> dict[str, TierDepth]:
        """Approximate mode only (routing history), whatever the event streams say."""
        return self._st.approx.match(keys, replicas)

    def approx_blocks(self, replica: str) -> int:
        return self._st.approx.blocks(replica)

    def profile(self, replica: str) -> ReplicaProfile:
        return self._st.profile(replica)

    def calibration(self, replica: str) -> Calibration:
        return self._st.calibration(replica)

    def gpu_blocks_used(self, replica: str) -> int | None:
        """GPU blocks in use, in the replica *profile's* block size (the index counts blocks
        of the router's ``block_size``, which may differ)."""
        if self.source(replica) == "events":
            n = self.index.blocks(replica)["GPU"]
        elif self._st.approx.capacity(replica):
            n = self._st.approx.blocks(replica)
        else:
            return None
        return n * self.block_size // self.profile(replica).block_size

    def replica_stat(self, replica: str) -> ReplicaStat | None:
        return self._st.stats.get(replica)

    def session(self, key: str) -> SessionFootprint | None:
        return self._st.sessions.get(key)

    def warm_and_reserved(
        self, replica: str, exclude: str | None
    ) -> tuple[list[WarmSession], list[Reservation]]:
        """Sessions whose KV sits on ``replica`` (evictable or pinned) and paced agents
        between calls that will come back to it."""
        warm: list[WarmSession] = []
        res: list[Reservation] = []
        # a session that has not shown a gap yet is expected to behave like the others: with
        # no prior at all a one-call session (Mooncake-style traffic) would look certain to
        # return forever, and its KV could never be evicted without harm
        ewma = self._st.gap_ewma
        prior = self._st.cfg.default_gap_s if ewma is None else max(ewma, MIN_GAP_S)
        for s in self._st.sessions.values():
            if s.replica != replica or s.key == exclude or not s.tokens:
                continue
            idle = 0.0 if s.last_end is None else max(self.now - s.last_end, 0.0)
            gap = s.mean_gap()
            # a measured 0 is a real gap (back-to-back calls), not a missing one; but
            # p_return_after reads a gap <= 0 as "unknown: P(return) = 1 forever"
            gap = prior if gap is None else max(gap, MIN_GAP_S)
            p = p_return_after(idle, gap, s.final)
            pinned = s.inflight > 0 or s.children_inflight > 0
            warm.append(WarmSession(s.key, s.tokens, idle, p, pinned))
            if s.inflight == 0 and not s.final and p > 0:
                expect = max(gap - idle, 0.0)
                res.append(Reservation(s.key, expect, max(s.turn_tokens, 1), s.tokens, p))
        return warm, res
