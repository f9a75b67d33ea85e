"""The KV layer's implementation of :class:`router.kv.view.KVView`: :class:`StateView`.

Owns: answering what KV-aware scorers may read — prefix matches by tier (the exact block index
for replicas whose event stream is fresh, approximate mode for the rest), replica profiles and
calibration, GPU blocks in use, per-replica call statistics, session footprints and whether a
session is expected to call again, how long the host tier keeps a chunk, and the cost model's
inputs for a replica — from the state it is given (:class:`ViewSource`, which
:class:`router.kv.state.KVState` satisfies). Nothing here mutates the layer. Like
:class:`router.kv.index.BlockIndexView` it copies nothing: it is consistent for one synchronous
scheduling pass, since the index, footprints and statistics change only when the event loop
runs ingestion or an observer. Must not import aiohttp, nor :mod:`router.kv.state` (the state
imports this module; :class:`ViewSource` names what is read).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from costmodel.calibration import Calibration
from costmodel.placement import (
    CallShape,
    ReplicaLoad,
    Reservation,
    ReservationColumns,
    WarmColumns,
    WarmSession,
    prefill_throughput,
)
from costmodel.profiles import ReplicaProfile
from router.kv.approx import TEXT_CHUNK, ApproxCache
from router.kv.churn import TierChurn
from router.kv.config import KVConfig
from router.kv.footprints import Bucket, FootprintTable, Picked
from router.kv.index import BlockIndex, BlockIndexView, TierDepth
from router.kv.sessions import ReplicaStat, SessionFootprint
from router.replicas import EndpointView


class ViewSource(Protocol):
    """What :class:`StateView` reads of the KV state (:class:`router.kv.state.KVState`)."""

    cfg: KVConfig
    clock: Callable[[], float]
    index: BlockIndex
    approx: ApproxCache
    text_approx: ApproxCache
    sessions: FootprintTable  # footprints by session key, and as columns by replica
    stats: dict[str, ReplicaStat]
    routed: dict[str, tuple[str, list[int], float]]
    host_churn: TierChurn
    gap_ewma: float | None
    output_ewma: float | None

    @property
    def chars_per_token(self) -> float: ...

    def pending_prefill(self) -> dict[str, tuple[int, int]]: ...

    def prefill_sent_since(self, replica: str, t: float) -> int: ...

    def profile_of(self, replica: str) -> ReplicaProfile: ...

    def calibration(self, replica: str) -> Calibration: ...


MIN_GAP_S = 0.1  # a measured mean gap of 0 s counts as this (back-to-back calls)
# a paced agent this unlikely to return is no reservation: it would add < 1e-6 of one prefill
# to a call's cost, and one-call sessions (Mooncake-style traffic) would each be priced on
# every decision until their TTL
P_NEGLIGIBLE = 1e-6
# a host tier this full is turning over (write-through fills it, LRU then evicts its oldest)
HOST_FULL = 0.95
# holds this close to the retention cap (kv ``retention_share``) are not relied on: at the cap
# the engine plugin drops the protection of the sessions that paused earliest — the ones an
# eviction reaches first — so a hint there is honoured as plain LRU
HOLD_CAP_MARGIN = 0.9
# a pending-prefill gauge scraped longer ago than this is not read (the scrape is failing):
# the queue is then estimated from this router's own calls, as for a replica without the gauge
GAUGE_MAX_AGE_S = 5.0


_EMPTY = np.zeros(0)


class StateView:
    """What KV-aware scorers may read (no mutation): matches, profiles, footprints; the
    :class:`router.kv.view.KVView` the KV state hands the scheduler."""

    __slots__ = (
        "_cal",
        "_prefill",
        "_returned",
        "_st",
        "block_size",
        "expected_output_tokens",
        "index",
        "now",
    )

    def __init__(self, st: ViewSource):
        self._st = st
        self.index: BlockIndexView = st.index.view()
        self.now: float = st.clock()
        self.block_size: int = st.cfg.block_size
        self._prefill = st.pending_prefill()
        self._cal: dict[str, Calibration] = {}
        self._returned: float | None = None  # share of known sessions that called again
        # a session that has shown no output yet is expected to write what the others write
        ewma = st.output_ewma
        self.expected_output_tokens: int = (
            st.cfg.expected_output_tokens if ewma is None else max(int(ewma), 1)
        )

    def source(self, replica: str) -> str:
        """``"events"`` when the index is fresh for ``replica``, else ``"approx"``."""
        return "approx" if self.index.is_stale(replica) else "events"

    def match(self, keys: list[int], replicas: list[str]) -> dict[str, TierDepth]:
        fresh = [r for r in replicas if self.source(r) == "events"]
        rest = [r for r in replicas if r not in fresh]
        out = self.index.match(keys, fresh) if fresh else {}
        if rest:
            out.update(self._st.approx.match(keys, rest))
        return out

    def with_routed(
        self, keys: list[int], matches: dict[str, TierDepth], exclude: str | None = None
    ) -> dict[str, TierDepth]:
        """``matches`` deepened by the prompts this router has in flight: a replica gets the
        longest prefix ``keys`` shares with a call routed there and not yet finished (other
        than ``exclude``, the call itself on a retry), as GPU blocks — that call's prefill puts
        them there, and vLLM queues a later call behind it, then hits them — where the replica's
        free GPU blocks hold both calls (else the later one waits for KV space instead). Block
        keys are chained, so the shared prefix is found by bisection."""
        routed = self._st.routed
        if not keys or not routed:
            return matches
        out = dict(matches)
        for rid, (replica, other, _) in routed.items():
            if rid == exclude or not other or other[0] != keys[0]:
                continue
            lo, hi = 1, min(len(keys), len(other))  # keys[:lo] shared; find the last shared
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if keys[mid - 1] == other[mid - 1]:
                    lo = mid
                else:
                    hi = mid - 1
            cur = out.get(replica)
            if cur is not None and lo <= cur.depth:
                continue
            # only where both fit: a replica whose GPU pool cannot hold the call in flight and
            # this one's own blocks besides makes this one wait for KV space, not share blocks
            used = self.gpu_blocks_used(replica)
            prof = self.profile(replica)
            free = None if used is None else (prof.gpu_kv_blocks - used) * prof.block_size
            if free is not None and free < (len(other) + len(keys) - lo) * self.block_size:
                continue
            out[replica] = TierDepth(lo, gpu=lo)
        return out

    def approx_match(self, keys: list[int], replicas: list[str]) -> dict[str, TierDepth]:
        """Approximate mode only (routing history), whatever the event streams say."""
        return self._st.approx.match(keys, replicas)

    def approx_blocks(self, replica: str) -> int:
        return self._st.approx.blocks(replica)

    def profile(self, replica: str) -> ReplicaProfile:
        return self._st.profile_of(replica)

    def calibration(self, replica: str) -> Calibration:
        c = self._cal.get(replica)  # read several times a decision; fixed within one view
        if c is None:
            c = self._cal[replica] = self._st.calibration(replica)
        return c

    def gpu_blocks_used(self, replica: str) -> int | None:
        """GPU blocks in use, in the replica *profile's* block size (the index counts blocks
        of the router's ``block_size``, which may differ)."""
        if self.source(replica) == "events":
            n = self.index.blocks(replica)["GPU"]
        else:  # approximate mode: what this router has routed there, trimmed to capacity
            n = self._st.approx.blocks(replica)
        return n * self.block_size // self.profile(replica).block_size

    def replica_stat(self, replica: str) -> ReplicaStat | None:
        return self._st.stats.get(replica)

    def session(self, key: str) -> SessionFootprint | None:
        return self._st.sessions.get(key)

    def estimate(self, ctx: Any) -> tuple[int, dict[str, TierDepth]]:
        """For a call placed before its analysis landed (no block keys): its prompt size
        guessed from the body's characters (at least the session's context so far), and as
        the match on each replica what is known without tokens — the session's context on the
        replica that holds it, and the leading prompt text routed to each replica (text-chunk
        routing history, as sglang-router's tree keeps it: a new session sharing a prefix with
        earlier calls). Without an estimate: ``(0, {})``."""
        est = getattr(ctx.analysis, "est_tokens", 0) or 0
        if not est:
            return 0, {}
        out: dict[str, TierDepth] = {}
        tkeys = getattr(ctx.analysis, "text_keys", None)
        if tkeys:
            per_chunk = TEXT_CHUNK / max(self._st.chars_per_token, 0.5)
            for replica, d in self._st.text_approx.match(tkeys).items():
                blocks = min(int(d.depth * per_chunk), est) // self.block_size
                if blocks:
                    out[replica] = TierDepth(blocks, gpu=blocks)
        fp = self._st.sessions.get(ctx.identity.key)
        if fp is not None and fp.replica is not None and fp.tokens:
            blocks = min(fp.tokens, est) // self.block_size
            cur = out.get(fp.replica)
            if blocks and (cur is None or blocks > cur.depth):
                out[fp.replica] = TierDepth(blocks, gpu=blocks)
        return est, out

    def p_next_call(self, key: str) -> float:
        """P(the session calls again after the call being placed), from what is seen: 1 for a
        session that has called before (an agent loop: AgentX sessions run dozens of calls);
        for a first call, the share of the sessions this layer knows that came back after
        their first (one-call traffic, e.g. Mooncake conversations, reads ~0)."""
        fp = self._st.sessions.get(key)
        if fp is not None and fp.last_end is not None:
            return 1.0
        if self._returned is None:
            known = [s for s in self._st.sessions.values() if s.last_end is not None]
            self._returned = sum(1 for s in known if s.gaps) / len(known) if known else 0.0
        return self._returned

    def warm_and_reserved(
        self, replica: str, exclude: str | None, holds: bool = False
    ) -> tuple[Sequence[WarmSession], Sequence[Reservation]]:
        """Sessions whose KV sits on ``replica`` (evictable or pinned) and paced agents
        between calls that will come back to it. ``holds``: the replica's host tier honours
        retention hints now (:meth:`holds_honoured`), so a session its last call hinted as
        paused carries that hold (``WarmSession.hold_s``).

        Computed over the replica's footprint columns (:class:`router.kv.footprints.Bucket`)
        at once: the reservations come as :class:`costmodel.placement.ReservationColumns`
        (the cost model sums them as columns), the warm sessions as a sequence built only
        when read (the eviction-harm term reads them only when the call does not fit in the
        free GPU blocks)."""
        table = self._st.sessions
        if isinstance(table, FootprintTable):
            b = table.bucket(replica)
            if b is None:
                return [], ReservationColumns([], _EMPTY, _EMPTY, _EMPTY, _EMPTY)
        else:  # a plain dict of footprints: walked (tests that build the state by hand)
            b = Bucket([s for s in table.values() if s.replica == replica and s.tokens])
        # a session that has not shown a gap yet is expected to behave like the others: with
        # no prior at all a one-call session (Mooncake-style traffic) would look certain to
        # return forever, and its KV could never be evicted without harm
        ewma = self._st.gap_ewma
        prior = self._st.cfg.default_gap_s if ewma is None else max(ewma, MIN_GAP_S)
        idle = np.where(np.isnan(b.last_end), 0.0, np.maximum(self.now - b.last_end, 0.0))
        # a measured 0 is a real gap (back-to-back calls), not a missing one; but
        # p_return_after reads a gap <= 0 as "unknown: P(return) = 1 forever"
        gap = np.where(np.isnan(b.gap), prior, np.maximum(b.gap, MIN_GAP_S))
        # p_return_after, over the columns: 0 after a final call, else exp(-over / gap)
        p = np.where(b.final, 0.0, np.exp(-np.maximum(0.0, idle - gap) / gap))
        keep = np.ones(len(b), bool)
        at = b.pos.get(exclude) if exclude is not None else None
        if at is not None:
            keep[at] = False
        kept = np.flatnonzero(keep)
        warm = WarmColumns(
            Picked(b.keys, kept), b.tokens[kept], idle[kept], p[kept], b.pinned[kept],
            gap[kept], b.hold[kept] if holds else np.zeros(len(kept)),
        )  # fmt: skip
        # memoryless: the time to its return is exponential with the mean gap, however long
        # it has been idle (agent gaps are heavy-tailed: AgentX median 3.84 s, p95 3 min).
        # "gap - idle" read an agent past its mean gap as certain to return at once, which
        # charged a call every overdue neighbour's next prefill in full and drove sessions off
        # their cache (docs/benchmarks-log.md, "the move rule")
        idx = np.flatnonzero(keep & b.reservable & (p > P_NEGLIGIBLE))
        prof = self.profile(replica)
        pre = b.memo(f"prefill:{id(prof)}", lambda: ReservationColumns(
            b.keys, gap, b.next_tokens, b.tokens, p).prefill_s(prof))  # fmt: skip
        cols = ReservationColumns(
            Picked(b.keys, idx), gap[idx], b.next_tokens[idx], b.tokens[idx], p[idx],
            (prof, pre[idx]),
        )  # fmt: skip
        return warm, cols

    # ---- the cost model's inputs -------------------------------------------------------------

    def call_shape(self, replica: str, keys: list[int], n_tokens: int, match: TierDepth | None,
                   output_tokens: int, next_calls: float = 0.0) -> CallShape:  # fmt: skip
        """This call on ``replica``: prompt tokens and its matched prefix by tier, in the
        profile's blocks (the index counts the router's ``block_size``), cut to the share of
        matched prefixes the replica has lately delivered (its calibration's
        ``hit_realization``): what it does not deliver is the match's tail — the slowest tier
        first, then the tail of its GPU part — recomputed. ``next_calls``: the calls the
        session is expected to make after this one."""
        ratio = self.block_size / self.profile(replica).block_size
        g = int((match.gpu if match else 0) * ratio)
        c = int((match.cpu if match else 0) * ratio)
        s = int((match.storage if match else 0) * ratio)
        p = int((match.pool if match else 0) * ratio)
        real = self.calibration(replica).hit_realization
        if real < 1.0 and g + c + s + p:
            cut = (g + c + s + p) - int(real * (g + c + s + p))
            p_cut = min(p, cut)
            s_cut = min(s, cut - p_cut)
            c_cut = min(c, cut - p_cut - s_cut)
            g, c, s, p = g - (cut - p_cut - s_cut - c_cut), c - c_cut, s - s_cut, p - p_cut
        return CallShape(n_tokens, g, c, s, output_tokens, next_calls, pool_blocks=p)

    def host_residence(self, e: EndpointView) -> float | None:
        """How long a chunk stays in ``e``'s host tier after its last use while that tier is
        full: its capacity over the blocks it loses per second (KV events, over the last
        minute). Full: the engine plugin's occupancy gauge says so (at least
        ``HOST_FULL``), or without it the index's count of the tier's blocks. The chunks the
        plugin's retention holds for paused sessions (its retained-share gauge) are skipped
        by the eviction, so the others turn over in what is left: capacity × (1 − retained).
        None: no host tier, not full, no evictions seen, or no event stream (approximate
        mode)."""
        prof = self.profile(e.name)
        if not prof.cpu_kv_blocks or self.source(e.name) != "events":
            return None
        ratio = self.block_size / prof.block_size  # index blocks -> profile blocks
        occ = e.host_occupancy
        if occ is None:
            occ = self.index.blocks(e.name)["CPU"] * ratio / prof.cpu_kv_blocks
        if occ < HOST_FULL:
            return None
        rate = self._st.host_churn.rate(e.name)
        if not rate or rate <= 0.0:
            return None
        held = min(max(e.host_retained or 0.0, 0.0), 1.0)
        return prof.cpu_kv_blocks * (1.0 - held) / (rate * ratio)

    def holds_honoured(self, e: EndpointView) -> bool:
        """Whether ``e``'s host tier keeps hinted sessions' chunks now: the engine plugin's
        retained-share gauge is there (its retention runs) and below ``HOLD_CAP_MARGIN`` of the
        cap. Without the gauge no hold is assumed (a hint to an engine without the plugin's
        retention is ignored by it)."""
        held = e.host_retained
        cap = self._st.cfg.retention_share
        return held is not None and cap > 0 and held < HOLD_CAP_MARGIN * cap

    def replica_load(self, e: EndpointView, exclude: str | None, prior_tokens: int) -> ReplicaLoad:
        """The cost model's load inputs for one replica, from the endpoint view and this view.

        Queued prefill: the uncached tokens of this router's calls there that have not had a
        first byte yet, plus engine-waiting calls beyond those (another router's) sized by the
        replica's recent mean uncached tokens per call as observed by this router; before it
        has observed any, by ``prior_tokens`` (this call's prompt: a pending call counts as a
        cold call this big). With ``KVConfig.pending_prefill_gauge`` on, and where the replica
        exports the engine plugin's ``vllm:num_pending_prefill_tokens`` (scraped within
        ``GAUGE_MAX_AGE_S``), the larger of that and the gauge — the engine's own count, other
        routers' calls in it — less what the replica has prefilled since the scrape at its
        calibrated prefill speed, plus the uncached tokens of this router's calls sent there
        since. Running calls are sized by the recent mean prompt tokens held.
        """
        st = self.replica_stat(e.name)
        prof = self.profile(e.name)
        cal = self.calibration(e.name)
        running = e.running if e.running is not None else None
        waiting = e.waiting if e.waiting is not None else None
        # calls that have not finished their prefill: waiting in the engine, or sent by this
        # router and not yet running there ...
        engine = max(float(waiting or 0.0), float(e.inflight) - float(running or 0.0), 0.0)
        # ... and this router's own calls there without a first byte, each with the uncached
        # tokens it was sent with: a call in chunked prefill counts as running in vLLM, so
        # without these a 250k-token cold prefill looked like an idle replica
        ours, ours_tokens = self._prefill.get(e.name, (0, 0))
        pending = max(engine, float(ours))
        uncached = st.uncached_ewma if st is not None else float(prior_tokens)
        context = st.context_ewma if st is not None else float(prior_tokens)
        queued = float(ours_tokens) + max(engine - ours, 0.0) * uncached
        gauge, age = e.pending_prefill, e.pending_prefill_age_s
        if (
            self._st.cfg.pending_prefill_gauge
            and gauge is not None
            and age is not None
            and 0.0 <= age <= GAUGE_MAX_AGE_S
        ):
            model_s = age * self._st.cfg.time_scale  # the profile's seconds (twins run faster)
            drained = model_s * prefill_throughput(prof) / max(cal.prefill_scale, 1e-9)
            seen = max(float(gauge) - drained, 0.0) + float(
                self._st.prefill_sent_since(e.name, self.now - age)
            )
            queued = max(queued, seen)
        batch = max(int(running) if running is not None else 0, int(e.inflight) - int(pending))
        dctx = batch * context
        used = self.gpu_blocks_used(e.name)
        free = None if used is None else max(prof.gpu_kv_blocks - used, 0)
        warm, reserved = self.warm_and_reserved(e.name, exclude, self.holds_honoured(e))
        return ReplicaLoad(
            queued_prefill_tokens=queued,
            decode_batch=batch,
            decode_context_tokens=dctx,
            free_gpu_blocks=free,
            pending_calls=pending,
            warm=warm,
            reserved=reserved,
            prefill_scale=cal.prefill_scale,
            decode_scale=cal.decode_scale,
            ttft_offset_s=cal.ttft_offset_s,
            host_residence_s=self.host_residence(e),
            hit_realization=cal.hit_realization,
            pool_scale=cal.pool_scale,
        )
