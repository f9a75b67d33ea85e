"""The KV layer's analyzer: :class:`Analyzer`, the part of :class:`router.kv.state.KVState`
that turns a call's body into its prompt tokens and block keys (``ctx.block_keys``,
``ctx.prompt_tokens``) — off the event loop, on one analysis thread (and a worker process for
long encodes) — holds a burst's followers until their leader is placed, and asks a replica's
``/tokenize`` when no tokenizer is on this machine. Must not import aiohttp, the proxy, torch
or vllm.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from router.kv.approx import TEXT_LIMIT, text_keys
from router.kv.config import KVConfig
from router.kv.sessions import SessionFootprint
from router.kv.tokens import ProcessEncoder, SessionTokenizer
from router.sessions import prompt_prefix_text
from router.vllm.chat_template import ChatTemplateError
from router.vllm.hashing import BlockHasher
from router.vllm.prompt import request_prompt
from router.vllm.tokenizer import ModelTokenizer

log = logging.getLogger("kvroute.kv")

# a follower waits for a leader's placement only if their prompt texts share this many leading
# TEXT_CHUNK-character chunks (8 KB, ~2k tokens) and at least half of the follower's text
BURST_MIN_CHUNKS = 8


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


class Analyzer:
    """The analyzer (a mixin of :class:`router.kv.state.KVState`, whose ``__init__`` sets the
    attributes declared here)."""

    cfg: KVConfig
    clock: Callable[[], float]
    hasher: BlockHasher
    tokenizer: ModelTokenizer | None
    tokens: SessionTokenizer | None
    sessions: dict[str, SessionFootprint]
    remote_tokens: Callable[[str, Any], Awaitable[list[int] | None]] | None
    remote_stats: dict[str, int]
    burst_waits: int
    _undecided: dict[int, dict[str, tuple[list[int], asyncio.Future[None], float]]]
    _lane: _AnalysisLane | None
    _calls: int

    if TYPE_CHECKING:

        def sweep(self) -> None: ...

    @property
    def chars_per_token(self) -> float:
        """Body characters per prompt token, as measured by the analyses so far (4 before)."""
        return self._lane.chars_per_token if self._lane is not None else 4.0

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
