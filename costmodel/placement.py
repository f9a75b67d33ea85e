"""Placement cost: how many seconds a call costs on one replica, counting where its KV lives.

Owns: the time models the router's ``kv_cost`` policy needs on top of
:mod:`costmodel.steptime` (which owns step/prefill/decode/load time per profile — not
duplicated here) and :func:`placement_cost`, one function that returns every term by name.
Pure: numpy/scipy at most; must not import sockets, HTTP, redis, zmq or the router.

All terms are seconds; an input that is not known is ``None`` and so is every term that needs
it (the total then sums the known terms and lists the missing ones — never a magic value)::

    total = queue_s                                   pending prefill work / prefill speed
          + fetch_or_recompute_s                      Σ over prompt segments of
                                                      min(load from its tier, recompute),
                                                      then the uncached tail's prefill, with
                                                      loads overlapping compute (``overlap``)
          + decode_s                                  expected output × step time in the
                                                      replica's current decode batch
          + eviction_harm_s                           Σ over warm sessions this call would
                                                      evict: P(return) × cost to bring back
                                                      the evicted tail (reload or recompute)
          + reserved_s                                paced agents between calls, both ways:
                                                      P(return while this call runs) × their
                                                      next prefill, + the wait for this
                                                      call's prefill of those that return
                                                      before it is done
          + congestion_s                              the GPU time this call's prefill takes
                                                      × calls already waiting there: on a
                                                      busy replica every second of recompute
                                                      is a second taken from its queue, so
                                                      moving a long context onto it costs
                                                      more than its own latency
          + interference_s                            decode interference on the requests
                                                      already decoding there: the steps they
                                                      share with this call's prefill chunks
                                                      run longer, then every step reads this
                                                      call's KV too, for each token it makes
          + next_calls_s                              the session's next calls, which find
                                                      its context where this call leaves it:
                                                      the share the replica fails to deliver
                                                      (1 − its hit realization) recomputed,
                                                      with the stall that gives its decoders,
                                                      × the calls expected to follow

The first three terms are this call's own latency; the next four are what it costs others
(sessions it evicts, agents that will return, calls waiting, calls decoding), and the last what
it costs the session later: minimising the sum places for the cluster, not just for the call.
The interference term is what keeps interactivity (TPOT) even: without it a cached prefix
pulls every session onto one replica.

The next-calls term is zero on a replica that delivers what it matches (realization 1), so it
decides only against a replica that keeps breaking its matches — one whose working set no
longer fits, where every call recomputes most of its prompt. Without it, a long session there
stays put: moving it costs one cold prefill beside the warm replica's many decoders (a large
interference term, paid once), while staying costs as much on every later call. It is off
unless the call says how many calls follow (``CallShape.next_calls``; ``kv_cost`` sets it only
with ``horizon_calls``): on the squeezed host tier it gained at 48 lanes and lost at 32
(docs/benchmarks-log.md), so it is not the default.

Segments: the matched prefix is ``gpu`` blocks (free), then ``cpu`` and ``storage`` blocks
(each loaded or recomputed, whichever is faster), then the uncached tail (prefilled).
Calibration (:mod:`costmodel.calibration`) scales the prefill and decode terms per replica,
and the pool's load time by the replica's calibrated pool link (``ReplicaLoad.pool_scale``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, overload

import numpy as np

from costmodel.profiles import ReplicaProfile
from costmodel.steptime import (
    decode_step_time,
    load_time,
    prefill_chunk_tokens,
    prefill_stall_time,
    request_prefill_time,
)


@dataclass(frozen=True, slots=True)
class CallShape:
    """The call being placed, as seen against one replica's cache.

    ``gpu_blocks``/``cpu_blocks``/``storage_blocks``/``pool_blocks``: the replica's matched
    prefix split by fastest tier (:class:`router.kv.index.TierDepth`; ``pool``: the cluster
    pool every replica reads), in blocks of the profile's block size.
    """

    prompt_tokens: int
    gpu_blocks: int = 0
    cpu_blocks: int = 0
    storage_blocks: int = 0
    expected_output_tokens: int | None = None
    # calls this session is expected to make after this one (0: none, or not known)
    next_calls: float = 0.0
    pool_blocks: int = 0  # after storage in the prefix (the slowest tier)

    def __post_init__(self) -> None:
        sizes = (self.gpu_blocks, self.cpu_blocks, self.storage_blocks, self.pool_blocks)
        if min(self.prompt_tokens, *sizes) < 0 or self.next_calls < 0:
            raise ValueError(f"negative sizes in {self}")


@dataclass(frozen=True, slots=True)
class WarmSession:
    """A session whose KV sits on the replica (in GPU) and could be evicted by this call.

    ``idle_s``: since its last call ended (eviction order is least recently used first);
    ``p_return``: probability it calls again (0 after its final call); ``tokens``: its cached
    context (the evicted part is its tail); ``pinned``: a parent waiting on children or a call
    in flight — never evicted, it only shrinks the free pool; ``mean_gap_s``: the mean of the
    exponential time to its return (None: unknown); ``hold_s``: how long after its last call's
    end the replica's host tier holds its chunks whatever LRU would evict (a retention hint the
    engine plugin honours, below its cap; 0: no hold).
    """

    key: str
    tokens: int
    idle_s: float
    p_return: float
    pinned: bool = False
    mean_gap_s: float | None = None
    hold_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Reservation:
    """A paced agent between calls: expected to return in ``expected_return_s`` (the mean of
    an exponential time to its return), then prefill ``next_tokens`` new tokens after
    ``context_tokens``."""

    key: str
    expected_return_s: float
    next_tokens: int
    context_tokens: int
    p_return: float = 1.0


class WarmColumns(Sequence[WarmSession]):
    """Warm sessions as numpy columns (see :class:`ReservationColumns`): read as a sequence
    of :class:`WarmSession` (made on first read), and :meth:`lru_first` gives
    :func:`eviction_harm` the few sessions a call evicts without making the others."""

    __slots__ = ("_list", "hold_s", "idle_s", "keys", "mean_gap_s", "p_return", "pinned",
                 "tokens")  # fmt: skip

    def __init__(
        self,
        keys: Sequence[str],
        tokens: np.ndarray,
        idle_s: np.ndarray,
        p_return: np.ndarray,
        pinned: np.ndarray,
        mean_gap_s: np.ndarray,
        hold_s: np.ndarray,
    ):
        self.keys, self.tokens, self.idle_s, self.p_return = keys, tokens, idle_s, p_return
        self.pinned, self.mean_gap_s, self.hold_s = pinned, mean_gap_s, hold_s
        self._list: list[WarmSession] | None = None

    def _one(self, i: int) -> WarmSession:
        return WarmSession(self.keys[i], int(self.tokens[i]), float(self.idle_s[i]),
                           float(self.p_return[i]), bool(self.pinned[i]),
                           float(self.mean_gap_s[i]), float(self.hold_s[i]))  # fmt: skip

    def _items(self) -> list[WarmSession]:
        if self._list is None:
            self._list = [self._one(i) for i in range(len(self.keys))]
        return self._list

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self) -> Iterator[WarmSession]:
        return iter(self._items())

    @overload
    def __getitem__(self, i: int) -> WarmSession: ...
    @overload
    def __getitem__(self, i: slice) -> list[WarmSession]: ...
    def __getitem__(self, i: Any) -> Any:
        return self._items()[i]

    def __eq__(self, other: object) -> bool:  # equal to a list of the same items
        if isinstance(other, Sequence) and not isinstance(other, str):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def lru_first(self, blocks: int, block_size: int) -> list[WarmSession]:
        """The unpinned sessions, least recently used (longest idle) first — in the order
        ``sorted(..., key=-idle_s)`` gives — up to the first whose blocks, with those before
        it, cover ``blocks``."""
        free = np.flatnonzero(~self.pinned)
        if not len(free) or blocks <= 0:
            return []
        order = free[np.argsort(-self.idle_s[free], kind="stable")]
        have = np.ceil(self.tokens[order] / block_size)
        k = int(np.searchsorted(np.cumsum(have), blocks)) + 1
        return [self._one(i) for i in order[:k].tolist()]


class ReservationColumns(Sequence[Reservation]):
    """Reservations as numpy columns, for :func:`reserved_cost`'s vector path (a caller with
    thousands of paced agents per decision: the KV layer's footprint table). Reads as a
    sequence of :class:`Reservation` too. ``prefill``: optionally, ``(profile, seconds)`` —
    each one's :func:`request_prefill_time` on that profile, already computed."""

    __slots__ = ("_prefill", "context_tokens", "expected_return_s", "keys", "next_tokens",
                 "p_return")  # fmt: skip

    def __init__(
        self,
        keys: Sequence[str],
        expected_return_s: np.ndarray,
        next_tokens: np.ndarray,
        context_tokens: np.ndarray,
        p_return: np.ndarray,
        prefill: tuple[ReplicaProfile, np.ndarray] | None = None,
    ):
        self.keys = keys
        self.expected_return_s = expected_return_s
        self.next_tokens = next_tokens
        self.context_tokens = context_tokens
        self.p_return = p_return
        self._prefill = prefill

    def __len__(self) -> int:
        return len(self.keys)

    @overload
    def __getitem__(self, i: int) -> Reservation: ...
    @overload
    def __getitem__(self, i: slice) -> list[Reservation]: ...
    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return Reservation(self.keys[i], float(self.expected_return_s[i]),
                           int(self.next_tokens[i]), int(self.context_tokens[i]),
                           float(self.p_return[i]))  # fmt: skip

    def __eq__(self, other: object) -> bool:  # equal to a list of the same items
        if isinstance(other, Sequence) and not isinstance(other, str):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def prefill_s(self, profile: ReplicaProfile) -> np.ndarray:
        """Each one's next prefill alone on an idle replica of ``profile`` (seconds)."""
        if self._prefill is not None and self._prefill[0] is profile:
            return self._prefill[1]
        pairs = zip(self.next_tokens.tolist(), self.context_tokens.tolist(), strict=True)
        arr = np.fromiter(
            (request_prefill_time(profile, int(n), int(c)) for n, c in pairs), np.float64, len(self)
        )
        self._prefill = (profile, arr)
        return arr


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What is known about one replica right now; ``None`` = unknown."""

    queued_prefill_tokens: float | None = None  # prompt tokens waiting or mid-prefill
    decode_batch: int | None = None  # running requests
    decode_context_tokens: float | None = None  # their summed context
    free_gpu_blocks: int | None = None
    pending_calls: float | None = None  # calls waiting for their prefill there
    warm: Sequence[WarmSession] = ()
    reserved: Sequence[Reservation] = ()
    prefill_scale: float = 1.0  # calibration: observed / modelled
    decode_scale: float = 1.0
    ttft_offset_s: float = 0.0
    # how long a chunk stays in the host tier after its last use (LRU turnover: capacity /
    # evictions per second) while that tier is full; None: not full, or not known
    host_residence_s: float | None = None
    # calibration: the share of a matched prefix the replica has lately delivered, in [0, 1]
    hit_realization: float = 1.0
    # calibration: observed / modelled load time from the cluster pool (the replica's
    # calibrated pool link, costmodel.calibration.pool_link; 1: the profile's link)
    pool_scale: float = 1.0


@dataclass(frozen=True, slots=True)
class CostTerms:
    queue_s: float | None
    fetch_or_recompute_s: float | None
    decode_s: float | None
    eviction_harm_s: float | None
    reserved_s: float | None
    congestion_s: float | None = None
    interference_s: float | None = None
    next_calls_s: float = 0.0
    # detail (for explain)
    load_s: dict[str, float] = field(default_factory=dict)
    recompute_s: dict[str, float] = field(default_factory=dict)
    chose: dict[str, str] = field(default_factory=dict)  # tier -> "load" | "recompute"
    tail_prefill_s: float = 0.0
    evicted: dict[str, int] = field(default_factory=dict)  # session -> blocks

    TERMS = (
        "queue_s",
        "fetch_or_recompute_s",
        "decode_s",
        "eviction_harm_s",
        "reserved_s",
        "congestion_s",
        "interference_s",
        "next_calls_s",
    )

    @property
    def total_s(self) -> float:
        return sum(v for v in (getattr(self, t) for t in self.TERMS) if v is not None)

    @property
    def missing(self) -> list[str]:
        return [t for t in self.TERMS if getattr(self, t) is None]

    def as_dict(self) -> dict[str, object]:
        d: dict[str, object] = {t: _r(getattr(self, t)) for t in self.TERMS}
        d["total_s"] = _r(self.total_s)
        d["missing"] = self.missing
        d["load_s"] = {k: _r(v) for k, v in self.load_s.items()}
        d["recompute_s"] = {k: _r(v) for k, v in self.recompute_s.items()}
        d["chose"] = dict(self.chose)
        d["tail_prefill_s"] = _r(self.tail_prefill_s)
        if self.evicted:
            d["evicted_blocks"] = dict(self.evicted)
        return d


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


# ---- the terms -------------------------------------------------------------------------------


def prefill_throughput(profile: ReplicaProfile) -> float:
    """Tokens/s of back-to-back full prefill chunks at the start of a context."""
    chunk = prefill_chunk_tokens(profile)
    return chunk / request_prefill_time(profile, chunk)


def queue_time(
    profile: ReplicaProfile, queued_prefill_tokens: float | None, scale: float = 1.0
) -> float | None:
    """Wait before this call's prefill starts: pending prefill tokens / prefill throughput."""
    if queued_prefill_tokens is None:
        return None
    if queued_prefill_tokens < 0:
        raise ValueError("queued_prefill_tokens must be >= 0")
    return scale * queued_prefill_tokens / prefill_throughput(profile)


class Segments(NamedTuple):
    """What :func:`segment_costs` found for one call on one replica."""

    seconds: float
    load_s: dict[str, float]
    recompute_s: dict[str, float]
    chose: dict[str, str]  # tier -> "load" | "recompute"
    tail_prefill_s: float
    computed_tokens: int  # prompt tokens prefilled there: recomputed segments + the tail


def segment_costs(
    profile: ReplicaProfile,
    call: CallShape,
    *,
    overlap: float = 1.0,
    scale: float = 1.0,
    pool_scale: float = 1.0,
) -> Segments:
    """Σ min(load, recompute) over the prompt's lower-tier segments plus the tail prefill.

    Loads overlap the compute that follows them:
    ``time = compute + max(0, loads − overlap·compute)``. ``scale`` multiplies compute (the
    prefill calibration), ``pool_scale`` the pool's load time (its link's calibration).
    """
    if not 0.0 <= overlap <= 1.0:
        raise ValueError("overlap must be in [0, 1]")
    bs = profile.block_size
    pos = min(call.gpu_blocks * bs, call.prompt_tokens)
    loads = compute = 0.0
    computed = 0
    load_s: dict[str, float] = {}
    rec_s: dict[str, float] = {}
    chose: dict[str, str] = {}
    segments = (
        ("cpu", call.cpu_blocks),
        ("storage", call.storage_blocks),
        ("pool", call.pool_blocks),
    )
    for tier, blocks in segments:
        if blocks <= 0:
            continue
        n = min(blocks * bs, max(call.prompt_tokens - pos, 0))
        lt = load_time(profile, blocks, tier) * (pool_scale if tier == "pool" else 1.0)
        rt = scale * request_prefill_time(profile, n, pos)
        load_s[tier], rec_s[tier] = lt, rt
        if lt <= rt:
            loads += lt
            chose[tier] = "load"
        else:
            compute += rt
            computed += n
            chose[tier] = "recompute"
        pos += n
    # vLLM always recomputes at least the last prompt token
    tail = max(call.prompt_tokens - pos, 1 if call.prompt_tokens else 0)
    tail_s = scale * request_prefill_time(profile, tail, min(pos, call.prompt_tokens - tail))
    compute += tail_s
    seconds = compute + max(0.0, loads - overlap * compute)
    return Segments(seconds, load_s, rec_s, chose, tail_s, computed + tail)


def decode_cost(profile: ReplicaProfile, call: CallShape, load: ReplicaLoad) -> float | None:
    """Expected output tokens × one decode step in the replica's batch (this call joined):
    what this call pays for the replica's decode load (its own decode interference)."""
    if (
        call.expected_output_tokens is None
        or load.decode_batch is None
        or load.decode_context_tokens is None
    ):
        return None
    b = load.decode_batch + 1
    ctx = load.decode_context_tokens + call.prompt_tokens
    return load.decode_scale * call.expected_output_tokens * decode_step_time(profile, b, int(ctx))


def blocks_needed(profile: ReplicaProfile, call: CallShape) -> int:
    """New GPU blocks the call allocates: prompt blocks not in GPU + its output."""
    out = call.expected_output_tokens or 0
    total = math.ceil((call.prompt_tokens + out) / profile.block_size)
    return max(total - call.gpu_blocks, 0)


def eviction_harm(
    profile: ReplicaProfile, call: CallShape, load: ReplicaLoad, *, scale: float = 1.0
) -> tuple[float | None, dict[str, int]]:
    """Σ P(return) × cost to bring back what this call evicts, least recently used first.

    A session loses its tail blocks first (vLLM frees a request's blocks tail first, so they
    sit earlier in the free queue). Bringing ``n`` tokens back costs min(reload from the host
    tier, recompute them at their position) if the host tier still holds them when the session
    returns (:func:`host_survival`: the host tier is written through, so they are there now
    unless it turned over since the session's last call), and if not min(reload from storage
    if the profile has it — the host tier writes every chunk on to storage — recompute).
    """
    if load.free_gpu_blocks is None:
        return None, {}
    short = blocks_needed(profile, call) - load.free_gpu_blocks
    if short <= 0:
        return 0.0, {}
    bs = profile.block_size
    harm = 0.0
    evicted: dict[str, int] = {}
    if isinstance(load.warm, WarmColumns):  # the same order, made only as far as it is read
        lru: Iterable[WarmSession] = load.warm.lru_first(short, bs)
    else:
        lru = sorted((w for w in load.warm if not w.pinned), key=lambda w: -w.idle_s)
    for s in lru:
        if short <= 0:
            break
        have = math.ceil(s.tokens / bs)
        take = min(have, short)
        short -= take
        evicted[s.key] = take
        n_tok = min(take * bs, s.tokens)
        recompute = scale * request_prefill_time(profile, n_tok, s.tokens - n_tok)
        # what the host tier has lost is still on storage, if there is one (every chunk the
        # host tier stores is written on to it); storage is not priced for turnover
        lost = (
            min(recompute, load_time(profile, take, "storage"))
            if profile.storage_kv_blocks
            else recompute
        )
        back = lost
        if profile.cpu_kv_blocks:
            p = host_survival(s.idle_s, s.mean_gap_s, load.host_residence_s, s.hold_s)
            back = p * min(lost, load_time(profile, take, "cpu")) + (1.0 - p) * lost
        harm += max(0.0, min(1.0, s.p_return)) * back
    return harm, evicted


def reserved_cost(
    profile: ReplicaProfile,
    call_duration_s: float,
    load: ReplicaLoad,
    *,
    scale: float = 1.0,
    prefill_window_s: float = 0.0,
    compute_s: float = 0.0,
) -> float:
    """Paced agents between calls on the replica, both ways, in expected seconds.

    An agent returns after a time ``U ~ Exp(expected_return)`` (memoryless: agent gaps are
    heavy-tailed), if at all (``p_return``):

    * **they delay this call**: arriving while it runs (``call_duration_s``), its next prefill
      shares the steps this call's decode runs in — ``p·(1 − e^(−D/E)) × prefill(next_tokens
      after context)``;
    * **this call delays them**: arriving before its prefill is done (``prefill_window_s``,
      queue + fetch-or-recompute), it waits for what is left of this call's ``compute_s``
      (vLLM schedules a running prefill first) — ``p·E[min(C, T − U)⁺] = p·(C − E·e^(−(T−C)/E)
      ·(1 − e^(−C/E)))``. Near zero for a warm call (C small); large for a cold prefill placed
      beside agents about to return, whose TTFTs it would hold up.
    """
    total = 0.0
    t_win = max(prefill_window_s, compute_s, 0.0)
    c = max(compute_s, 0.0)
    if isinstance(load.reserved, ReservationColumns):  # the same sums, over columns
        cols = load.reserved
        if not len(cols):
            return 0.0
        pv = np.clip(cols.p_return, 0.0, 1.0)
        ev = cols.expected_return_s
        pos = ev > 0
        safe = np.where(pos, ev, 1.0)
        p_inv = np.where(pos, 1.0 - np.exp(-max(call_duration_s, 0.0) / safe), 1.0)
        total = float(np.sum(pv * p_inv * scale * cols.prefill_s(profile)))
        if c > 0:
            heldv = np.where(pos, c - safe * np.exp(-(t_win - c) / safe) * -np.expm1(-c / safe), c)
            total += float(np.sum(pv * np.maximum(heldv, 0.0)))
        return total
    for r in load.reserved:
        p = max(0.0, min(1.0, r.p_return))
        if p == 0.0:
            continue
        e = r.expected_return_s
        p_in = 1.0 if e <= 0 else 1.0 - math.exp(-max(call_duration_s, 0.0) / e)
        total += p * p_in * scale * request_prefill_time(profile, r.next_tokens, r.context_tokens)
        if c > 0:
            held = c if e <= 0 else c - e * math.exp(-(t_win - c) / e) * -math.expm1(-c / e)
            total += p * max(held, 0.0)
    return total


def interference(
    profile: ReplicaProfile, call: CallShape, load: ReplicaLoad, compute_tokens: int
) -> float | None:
    """Seconds this call adds to the requests already decoding on the replica: B × (what its
    prefill chunks add to the steps they share with the decoders + expected output × the
    step-time increase its KV reads cause). ``compute_tokens``: the prompt tokens it computes
    (the last ones). ``None`` without the batch or the expected output."""
    if (
        call.expected_output_tokens is None
        or load.decode_batch is None
        or load.decode_context_tokens is None
    ):
        return None
    b = load.decode_batch
    if b <= 0:
        return 0.0
    ctx = float(load.decode_context_tokens)
    n = min(compute_tokens, call.prompt_tokens)
    stall = _decoder_stall(profile, load, n, call.prompt_tokens - n)
    grow = decode_step_time(profile, b + 1, int(ctx) + call.prompt_tokens) - decode_step_time(
        profile, b, int(ctx)
    )
    return b * (stall + load.decode_scale * call.expected_output_tokens * max(grow, 0.0))


def _decoder_stall(
    profile: ReplicaProfile, load: ReplicaLoad, new_tokens: int, cached_tokens: int
) -> float:
    """Seconds a prefill of ``new_tokens`` (after ``cached_tokens``) adds to each request
    decoding on the replica, with its prefill calibration; 0 without a known decode batch."""
    b = load.decode_batch or 0
    if b <= 0 or load.decode_context_tokens is None:
        return 0.0
    ctx = float(load.decode_context_tokens)
    return load.prefill_scale * prefill_stall_time(profile, new_tokens, cached_tokens, b, ctx)


def next_calls_cost(profile: ReplicaProfile, call: CallShape, load: ReplicaLoad) -> float:
    """Seconds the session's next calls lose to where this call leaves its context: each finds
    the context (prompt + expected output) on this replica, which delivers ``hit_realization``
    of it; the rest — its tail — is recomputed there, and that prefill stalls the replica's
    decoders as this call's does (:func:`interference`'s stall part). × ``next_calls``; 0 where
    the replica delivers every match, or no call is expected to follow."""
    real = min(max(load.hit_realization, 0.0), 1.0)
    if call.next_calls <= 0.0 or real >= 1.0:
        return 0.0
    ctx = call.prompt_tokens + (call.expected_output_tokens or 0)
    kept = int(real * ctx)
    n = ctx - kept
    if n <= 0:
        return 0.0
    per_call = load.prefill_scale * request_prefill_time(profile, n, kept)
    per_call += (load.decode_batch or 0) * _decoder_stall(profile, load, n, kept)
    return call.next_calls * per_call


def placement_cost(
    profile: ReplicaProfile,
    call: CallShape,
    load: ReplicaLoad,
    *,
    overlap: float = 1.0,
    congestion_weight: float = 1.0,
    interference_weight: float = 1.0,
) -> CostTerms:
    """Every term of placing ``call`` on a replica of ``profile`` in state ``load``."""
    queue = queue_time(profile, load.queued_prefill_tokens, load.prefill_scale)
    fetch, load_s, rec_s, chose, tail_s, computed = segment_costs(
        profile, call, overlap=overlap, scale=load.prefill_scale, pool_scale=load.pool_scale
    )
    fetch += load.ttft_offset_s
    decode = decode_cost(profile, call, load)
    harm, evicted = eviction_harm(profile, call, load, scale=load.prefill_scale)
    duration = (queue or 0.0) + fetch + (decode or 0.0)
    compute = tail_s + sum(rec_s[t] for t, how in chose.items() if how == "recompute")
    window = (queue or 0.0) + fetch
    scale = load.prefill_scale
    reserved = reserved_cost(
        profile, duration, load, scale=scale, prefill_window_s=window, compute_s=compute
    )
    congestion = (
        None
        if load.pending_calls is None
        else congestion_weight * compute * max(load.pending_calls, 0.0)
    )
    inter = interference(profile, call, load, computed)
    nxt = next_calls_cost(profile, call, load)
    return CostTerms(
        queue_s=queue,
        fetch_or_recompute_s=fetch,
        decode_s=decode,
        eviction_harm_s=harm,
        reserved_s=reserved,
        congestion_s=congestion,
        interference_s=None if inter is None else interference_weight * inter,
        next_calls_s=nxt,
        load_s=load_s,
        recompute_s=rec_s,
        chose=chose,
        tail_prefill_s=tail_s,
        evicted=evicted,
    )


def host_survival(
    idle_s: float, mean_gap_s: float | None, residence_s: float | None, hold_s: float = 0.0
) -> float:
    """P(a session's host-tier copy is still there when it returns).

    Its chunks were last ranked when its last call ended (vLLM re-ranks a finished request's
    chunks), ``idle_s`` ago; under LRU a chunk survives while younger than the tier's
    residence time R. The session returns after a further Exp(``mean_gap_s``) (memoryless),
    so P = 1 − exp(−(R − idle) / gap) while R > idle, else 0. A retention hold (``hold_s``
    from the same end: the engine plugin skips held chunks when it evicts) keeps them at
    least that long, so the horizon is max(R, hold). ``residence_s`` None (the tier is not
    full, or its turnover is unknown): 1. An unknown gap reads as an early return.
    """
    if residence_s is None:
        return 1.0
    left = max(residence_s, hold_s) - idle_s
    if left <= 0.0:
        return 0.0
    if mean_gap_s is None or mean_gap_s <= 0.0:
        return 1.0
    return -math.expm1(-left / mean_gap_s)


def p_return_after(idle_s: float, mean_gap_s: float | None, final: bool) -> float:
    """P(a session idle for ``idle_s`` calls again): 0 after its final call; otherwise a
    survival curve with the session's mean gap (exponential tail: ``exp(−max(0, idle −
    mean_gap) / mean_gap)``, 1 while within a typical gap)."""
    if final:
        return 0.0
    if mean_gap_s is None or mean_gap_s <= 0:
        return 1.0
    over = max(0.0, idle_s - mean_gap_s)
    return math.exp(-over / mean_gap_s)
