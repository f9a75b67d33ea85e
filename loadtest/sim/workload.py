"""The simulator's workloads: closed-loop sessions and DAG sessions (:mod:`loadtest.sim.simulator`).

Owns: :class:`Call` / :class:`Session` (a closed-loop session: each call's prompt is the whole
context so far), :func:`synthetic_agentx` (AgentX-like synthetic sessions for sweeps),
:class:`TraceCall` / :class:`DagSession` (a session as a DAG of calls, e.g. a real trace) and
the :class:`SessionFeed` protocol that chains sessions on closed-loop lanes. The semantics
are in :mod:`loadtest.sim.simulator`'s docstring. Plain data and pure functions.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from loadtest.traces.synthetic import agentx_chains

MASK64 = (1 << 64) - 1


def _stable64(text: str) -> int:
    """A 64-bit hash of ``text`` that does not change between processes."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


# ---- workload -------------------------------------------------------------------------------


@dataclass(slots=True)
class Call:
    """One model call of a session: tokens appended since the previous call (its output is
    counted by the simulator itself), tokens to generate, idle time before it."""

    new_tokens: int
    output_tokens: int
    think_s: float = 0.0


@dataclass(slots=True)
class Session:
    id: str
    start: float
    calls: list[Call]
    shared_prefix_tokens: int = 0  # leading tokens identical across sessions (tools+system)


def synthetic_agentx(
    n_sessions: int,
    duration_s: float,
    *,
    seed: int = 0,
    shared_prefix_tokens: int = 15_000,
    first_call_tokens: int = 20_000,
    turn_tokens_median: float = 2_000,
    output_median: float = 300,
    think_median_s: float = 18.0,
    think_p90_s: float = 130.0,
    calls_mean: float = 46.0,
    max_context: int = 250_000,
) -> list[Session]:
    """Sessions shaped like the public Claude Code traces (see shared/data/README.md):
    ~15k tokens of tools+system prompt, contexts growing by a few thousand tokens a call to
    ~100k, a few hundred output tokens, think times with median 18 s and p90 130 s
    (log-normal), ~46 calls (geometric), session starts uniform over ``duration_s``.

    The shape is :func:`loadtest.traces.synthetic.agentx_chains` (the one AgentX-like
    generator, also behind the replay's ``synthetic:...`` traces), seen as simulator
    sessions."""
    chains = agentx_chains(
        n_sessions,
        duration_s,
        seed=seed,
        shared_prefix_tokens=shared_prefix_tokens,
        first_call_tokens=first_call_tokens,
        turn_tokens_median=turn_tokens_median,
        output_median=output_median,
        think_median_s=think_median_s,
        think_sigma=math.log(think_p90_s / think_median_s) / 1.2816,
        calls_mean=calls_mean,
        max_context=max_context,
    )
    return [
        Session(
            f"s{ch.index}",
            ch.start_s,
            [Call(c.new_tokens, c.output_tokens, c.think_s) for c in ch.calls],
            ch.shared_prefix_tokens,
        )
        for ch in chains
    ]


@dataclass(slots=True)
class TraceCall:
    """One call of a :class:`DagSession`: its whole prompt (``prompt_tokens``, and the keys of
    its full blocks in the simulated profile's block size, chained: equal key at position i
    means equal prompt up to and including block i), tokens to generate, and when it starts:
    ``delay_s`` after the last of its dependencies (``(index of an earlier call, delay_s)``)
    ends, or ``start_delay_s`` after the session starts if it has none; in both cases not
    before ``not_before_s`` after the session starts, when set."""

    prompt_tokens: int
    output_tokens: int
    block_keys: Sequence[int]
    deps: tuple[tuple[int, float], ...] = ()
    start_delay_s: float = 0.0
    not_before_s: float | None = None
    agent: str = "main"
    id: str = ""  # the trace's call id (information only)


@dataclass(slots=True)
class DagSession:
    """A session whose calls form a DAG (topological order: deps point to earlier calls).

    Calls of ``main_agent`` are routed as session ``id``; a subagent's as ``f"{id}/{agent}"``
    with ``parent_session=id``. ``start`` is when it starts if handed to :meth:`Simulator.run`
    directly (a :class:`SessionFeed` starts its sessions itself)."""

    id: str
    calls: list[TraceCall]
    start: float = 0.0
    main_agent: str = "main"

    def __post_init__(self) -> None:
        if not self.calls:
            raise ValueError(f"session {self.id}: no calls")
        for k, c in enumerate(self.calls):
            for d, delay in c.deps:
                if not 0 <= d < k:
                    raise ValueError(f"session {self.id}: call {k} depends on {d}, not earlier")
                if delay < 0:
                    raise ValueError(f"session {self.id}: negative delay on call {k}")
            if c.not_before_s is not None and c.not_before_s < 0:
                raise ValueError(f"session {self.id}: negative not_before_s on call {k}")


class SessionFeed(Protocol):
    """Closed-loop lanes: ``lanes`` sessions in flight, one per lane; when a lane's session
    ends at ``now``, ``next_session(lane, now)`` gives the lane's next one (None: the lane
    stops). At start, each lane in order is asked once at time 0."""

    lanes: int

    def next_session(self, lane: int, now: float) -> DagSession | None: ...


class _DagRun:
    """One DAG session in flight: dependency counters, ready times, routing identities."""

    __slots__ = ("agent_index", "children", "final", "lane", "left", "pending", "ready",
                 "session", "sids", "start")  # fmt: skip

    def __init__(self, s: DagSession, lane: int | None, start: float):
        n = len(s.calls)
        self.session = s
        self.start = start
        self.lane = lane
        self.left = n
        self.pending = [len(c.deps) for c in s.calls]
        # a call is ready at the latest of its dependencies' ends plus delays and its
        # not_before_s after the session start
        self.ready = [-math.inf if c.not_before_s is None else start + c.not_before_s
                      for c in s.calls]  # fmt: skip
        self.children: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        self.agent_index = [0] * n
        self.sids: list[tuple[str, str | None, str | None]] = []  # (session, agent, parent)
        count: dict[str, int] = {}
        last: dict[str, int] = {}
        for k, c in enumerate(s.calls):
            for d, delay in c.deps:
                self.children[d].append((k, delay))
            self.agent_index[k] = count.get(c.agent, 0)
            count[c.agent] = self.agent_index[k] + 1
            last[c.agent] = k
            if c.agent == s.main_agent:
                self.sids.append((s.id, None, None))
            else:
                self.sids.append((f"{s.id}/{c.agent}", c.agent, s.id))
        self.final = [last[c.agent] == k for k, c in enumerate(s.calls)]
