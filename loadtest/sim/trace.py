"""Real traces in the in-process simulator: a :class:`loadtest.traces.Trace` as DAG sessions.

Owns: turning trace sessions (DAGs of calls with subagents, hash ids of ``trace.block_size``
tokens) into DAG sessions (:class:`loadtest.sim.simulator.DagSession`) with block keys in the
simulated profile's block size, the closed-loop lanes that feed them to the simulator
(:class:`TraceFeed`, :func:`trace_workload`), and :func:`simulate_trace`.

It mirrors the HTTP replay (``loadtest/replay/runner.py`` + ``loadtest/prompts.py``) so a
policy compared here is compared on the same workload:

- **Lanes**: ``concurrency`` lanes handed plays by :class:`loadtest.traces.lanes.PlayCounter`,
  the HTTP replay's own rule (plays after the first only under a ``duration_s`` bound). A
  lane's next session starts when its previous one's last call has finished.
- **Namespaces**: a trace id's blocks are keyed by ``(namespace, id, j)``; the namespace is
  ``"{trace}/{session}#{play}"`` for session-local ids (WEKA) and ``"{trace}#{play}"`` for
  trace-wide ids (Mooncake), so a recycled play never hits an earlier play's cache; with
  ``shared_prefix`` the first ``prefix_blocks`` ids of a call use ``"shared/{prefix_group}"``
  (all sessions of an agent type share their tools+system prompt). Here ``shared_prefix``
  defaults to on; the HTTP replay's ``--shared-prefix`` defaults to off.
- **Block sizes**: trace id i of ``B_t`` tokens becomes ``B_t / B_r`` keys of ``B_r`` tokens
  (``B_t`` must be a multiple of ``B_r``); a call's prompt is ``input_tokens`` kept inside its
  last id's block (as ``PromptBuilder.content_tokens`` with ``tokens_per_id = B_t``); only
  full blocks get keys (vLLM caches full blocks only). Keys are chained like vLLM's block
  hashes: a key names the whole prefix up to its block, not the block alone.
- Not modelled: the chat template's few tokens around the content (the HTTP prompts carry ~8
  more tokens, which shifts block boundaries there), ``--tokens-per-id`` rescaling and
  ``--max-prompt-tokens`` truncation. A call whose prompt + output exceeds the profile's
  ``max_model_len`` is refused (counted in ``requests_failed``, as the HTTP twin's 400), and
  its dependants go on at once.
- **Bound**: calls in flight when ``duration_s`` is reached are not recorded (the HTTP replay
  cancels them after a grace period); throughput is over ``duration_s``.

Like :mod:`loadtest.sim.simulator`: no sockets, no asyncio, no router imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from costmodel.profiles import ReplicaProfile
from loadtest.sim.pd import PDSimulator
from loadtest.sim.simulator import (
    ROUTERS,
    DagSession,
    RouteFn,
    SimResult,
    Simulator,
    TraceCall,
)
from loadtest.sim.workload import _stable64
from loadtest.traces import Trace
from loadtest.traces.lanes import PlayCounter
from loadtest.traces.model import Session

_U = np.uint64
_C1, _C2, _C3 = _U(0x9E3779B97F4A7C15), _U(0xBF58476D1CE4E5B9), _U(0x94D049BB133111EB)
_P = 0x100000001B3  # odd: invertible mod 2**64
_P_INV = pow(_P, -1, 1 << 64)
_pows: list[np.ndarray] = [np.ones(1, dtype=_U), np.ones(1, dtype=_U)]  # P**i, P**-i


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """P**i and P**-i mod 2**64 for i < n (grown on demand, kept)."""
    if len(_pows[0]) < n:
        m = max(n, 2 * len(_pows[0]))
        for w, base in ((0, _P), (1, _P_INV)):
            f = np.full(m, base, dtype=_U)
            f[0] = 1
            _pows[w] = np.cumprod(f, dtype=_U)
    return _pows[0][:n], _pows[1][:n]


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, element-wise on uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> _U(30))) * _C2
    x = (x ^ (x >> _U(27))) * _C3
    return x ^ (x >> _U(31))


def chained_keys(hash_ids: Sequence[int], salts: np.ndarray, per_id: int, n_full: int) -> list[int]:
    """Keys of the first ``n_full`` replica blocks of a prompt of trace ids.

    Block j (< ``per_id``) of id ``hash_ids[i]`` in namespace ``salts[i]`` has content
    ``mix(salt ^ mix(id * C1 + j))``; the key of block b is a polynomial hash of the contents
    of blocks 0..b (vectorised: ``P**b * cumsum(h_k * P**-k)``), then mixed — so equal keys
    mean equal prefixes, like vLLM's chained block hashes. Blocks past the ids (a call
    without hash ids has a prompt but no known content) get no keys."""
    n_full = min(n_full, len(hash_ids) * per_id)
    if n_full <= 0:
        return []
    ids = np.asarray(hash_ids, dtype=np.int64).astype(_U)
    idr = np.repeat(ids, per_id)[:n_full]
    j = np.tile(np.arange(per_id, dtype=_U), len(ids))[:n_full]
    h = _mix(np.repeat(salts, per_id)[:n_full] ^ _mix(idr * _C1 + j))
    pw, inv = _powers(n_full)
    keys = _mix(np.cumsum(h * inv, dtype=_U) * pw)
    return keys.tolist()


def content_tokens(input_tokens: int, n_ids: int, trace_block: int) -> int:
    """The prompt's length, kept inside its last id's block (``PromptBuilder``'s rule with
    ``tokens_per_id`` = the trace block)."""
    if n_ids == 0:
        return max(1, input_tokens)
    lo, hi = (n_ids - 1) * trace_block + 1, n_ids * trace_block
    return min(max(input_tokens, lo), hi)


class TraceFeed:
    """The closed-loop lanes over a trace (a :class:`loadtest.sim.simulator.SessionFeed`).

    ``instance(index, play)`` builds the simulator's :class:`DagSession` for one play of a
    trace session; ``next_session(lane, now)`` hands lanes the next play from one shared
    counter, as the HTTP replay's lanes take them."""

    def __init__(
        self,
        trace: Trace,
        block_size: int,
        *,
        concurrency: int,
        duration_s: float | None,
        shared_prefix: bool = True,
        max_gap_s: float | None = None,
        max_plays: int | None = None,
        seed: int | None = None,
        stagger_s: float = 0.0,
    ):
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if stagger_s < 0:
            raise ValueError("stagger_s must be >= 0")
        if block_size <= 0 or trace.block_size % block_size:
            raise ValueError(
                f"trace block size {trace.block_size} is not a multiple of the profile's "
                f"block size {block_size}"
            )
        from loadtest.traces import cap_gaps

        sessions = [s for s in trace.sessions if s.calls]
        if max_gap_s is not None:
            sessions = [cap_gaps(s, max_gap_s) for s in sessions]
        if not sessions:
            raise ValueError(f"trace {trace.name} has no sessions with calls")
        self._rng = np.random.default_rng(seed) if seed is not None else None
        if self._rng is not None:  # another seed: another order of sessions on the lanes
            sessions = [sessions[i] for i in self._rng.permutation(len(sessions))]
        self.stagger_s = stagger_s
        self._first_of_lane: set[int] = set()
        self.trace = trace
        self.sessions: list[Session] = sessions
        self.block_size = block_size
        self.per_id = trace.block_size // block_size
        self.lanes = concurrency
        self.duration_s = duration_s
        self.shared_prefix = shared_prefix
        self.max_plays = max_plays
        self.plays = PlayCounter(len(sessions), recycle=duration_s is not None,
                                 max_plays=max_plays)  # fmt: skip
        self._salts: dict[str, int] = {}

    def _salt(self, ns: str) -> int:
        s = self._salts.get(ns)
        if s is None:
            s = self._salts[ns] = _stable64(ns)
        return s

    def namespace(self, session: Session, play: int) -> str:
        if self.trace.id_scope == "trace":
            return f"{self.trace.name}#{play}"
        return f"{self.trace.name}/{session.id}#{play}"

    def instance(self, index: int, play: int = 0, start: float = 0.0) -> DagSession:
        """Play ``play`` of session ``index`` as the simulator's DAG session."""
        s = self.sessions[index]
        own = self._salt(self.namespace(s, play))
        pos = {c.id: k for k, c in enumerate(s.calls)}
        tb, bs = self.trace.block_size, self.block_size
        calls = []
        for c in s.calls:
            n = len(c.hash_ids)
            salts = np.full(n, own, dtype=_U)
            if self.shared_prefix and c.prefix_blocks > 0:
                salts[: c.prefix_blocks] = self._salt(f"shared/{c.prefix_group}")
            n_tok = content_tokens(c.input_tokens, n, tb)
            calls.append(
                TraceCall(
                    prompt_tokens=n_tok,
                    output_tokens=max(1, c.output_tokens),
                    block_keys=chained_keys(c.hash_ids, salts, self.per_id, n_tok // bs),
                    deps=tuple((pos[d.call], d.delay_s) for d in c.deps),
                    start_delay_s=c.start_delay_s,
                    not_before_s=c.not_before_s,
                    agent=c.agent,
                    id=c.id,
                )
            )
        return DagSession(f"{self.trace.name}/{s.id}#{play}", calls, start=start)

    def next_session(self, lane: int, now: float) -> DagSession | None:
        if self.duration_s is not None and now >= self.duration_s:
            return None
        nxt = self.plays.next()  # the HTTP replay's lane rule
        if nxt is None:
            return None
        if lane not in self._first_of_lane:  # a lane's first session may start late
            self._first_of_lane.add(lane)
            if self.stagger_s and self._rng is not None:
                now += float(self._rng.uniform(0.0, self.stagger_s))
        return self.instance(nxt[0], nxt[1], start=now)

    @property
    def started(self) -> int:
        """Plays handed out so far."""
        return self.plays.started


def trace_workload(
    trace: Trace,
    profile_block_size: int,
    *,
    concurrency: int,
    duration_s: float | None,
    shared_prefix: bool = True,
    max_gap_s: float | None = None,
    max_plays: int | None = None,
    seed: int | None = None,
    stagger_s: float = 0.0,
) -> TraceFeed:
    """Closed-loop lanes over ``trace`` for :meth:`Simulator.run` (``feed=``).

    ``max_gap_s`` caps every idle gap (``loadtest.traces.cap_gaps``; the HTTP bench loads
    traces with 30 s); ``max_plays`` bounds the session plays started over all lanes;
    ``seed`` shuffles which sessions the lanes take in which order, and with ``stagger_s``
    starts each lane's first session at a seeded time in [0, stagger_s) instead of all at 0."""
    return TraceFeed(
        trace,
        profile_block_size,
        concurrency=concurrency,
        duration_s=duration_s,
        shared_prefix=shared_prefix,
        max_gap_s=max_gap_s,
        max_plays=max_plays,
        seed=seed,
        stagger_s=stagger_s,
    )


def open_loop_sessions(
    trace: Trace,
    profile_block_size: int,
    *,
    shared_prefix: bool = True,
    max_gap_s: float | None = None,
) -> list[DagSession]:
    """Every session once, starting at its ``arrival_s`` from the first arrival (the HTTP
    replay's ``--open-loop`` with ``time_scale`` 1: simulated time is model time)."""
    feed = TraceFeed(
        trace,
        profile_block_size,
        concurrency=1,
        duration_s=None,
        shared_prefix=shared_prefix,
        max_gap_s=max_gap_s,
    )
    t0 = min((s.arrival_s or 0.0) for s in feed.sessions)
    return [
        feed.instance(k, 0, start=(s.arrival_s or 0.0) - t0) for k, s in enumerate(feed.sessions)
    ]


def simulate_trace(
    profile: ReplicaProfile,
    n_replicas: int,
    trace: Trace,
    route: RouteFn | str = "sticky_spill",
    *,
    concurrency: int = 1,
    duration_s: float | None = None,
    shared_prefix: bool = True,
    max_gap_s: float | None = None,
    max_plays: int | None = None,
    open_loop: bool = False,
    seed: int | None = None,
    stagger_s: float = 0.0,
    **sim_kw: Any,
) -> SimResult:
    """Replay ``trace`` on ``n_replicas`` simulated replicas of ``profile``: closed loop at
    ``concurrency`` lanes (or open loop at the trace's arrival times), bounded by
    ``duration_s`` of simulated time. ``route``: a function or a built-in policy name;
    with ``roles`` (one per replica) a P/D run (:class:`loadtest.sim.pd.PDSimulator`, ``route``
    answering ``route_pd``).

    The summary's ``throughput_tok_per_gpu_s`` divides by the bound (``duration_s``) when the
    run was cut by it; ``hit_bound`` is the unlimited-cache hit ratio over the same calls."""
    fn = ROUTERS[route]() if isinstance(route, str) else route
    roles = sim_kw.pop("roles", None)  # P/D: one role per replica (loadtest.sim.pd)
    if roles is not None and len(roles) != n_replicas:
        raise ValueError("roles: one per replica")
    sim = (PDSimulator(profile, roles, fn, **sim_kw) if roles
           else Simulator(profile, n_replicas, fn, **sim_kw))  # fmt: skip
    bs = profile.block_size
    if open_loop:
        sessions = open_loop_sessions(trace, bs, shared_prefix=shared_prefix, max_gap_s=max_gap_s)
        if max_plays is not None:
            sessions = sessions[:max_plays]
        res = sim.run(sessions, until=duration_s)
    else:
        feed = trace_workload(
            trace,
            bs,
            concurrency=concurrency,
            duration_s=duration_s,
            shared_prefix=shared_prefix,
            max_gap_s=max_gap_s,
            max_plays=max_plays,
            seed=seed,
            stagger_s=stagger_s,
        )
        res = sim.run([], until=duration_s, feed=feed)
    return res  # cut by the bound (``res.cut``): ``sim_time_s`` is the bound


__all__ = ["TraceFeed", "chained_keys", "content_tokens", "open_loop_sessions",
           "simulate_trace", "trace_workload"]  # fmt: skip
