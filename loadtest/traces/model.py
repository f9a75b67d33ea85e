"""The replayable shape of a trace: sessions as DAGs of model calls.

Owns: :class:`Call`, :class:`Dep`, :class:`Session`, :class:`Trace` — plain data that every
loader (WEKA/AgentX, Mooncake, aiperf ``mooncake_trace``, synthetic) produces and the replay
runner consumes. A call starts when every dependency has ended and its delay has passed
(end-to-start); a call without dependencies starts ``start_delay_s`` after its session
starts; a call with ``not_before_s`` also waits until that long after its session started
(absolute turn times, e.g. aiperf's later-turn timestamps); in open loop a session starts at
its ``arrival_s``. Must not import the router, HTTP
clients or the replay runner.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field


class TraceError(ValueError):
    """A trace file that cannot be read or does not have the expected shape."""


@dataclass(frozen=True)
class Dep:
    """Start only after call ``call`` of the same session has ended, plus ``delay_s``."""

    call: str
    delay_s: float = 0.0


@dataclass(frozen=True)
class Call:
    """One model call of a session.

    ``hash_ids`` name the prompt's blocks of ``Trace.block_size`` tokens (equal ids: equal
    content, within the trace's id scope); ``input_tokens`` may end inside the last block.
    ``prefix_blocks`` leading ids are the agent's tools+system prompt, shared across sessions
    with the same ``prefix_group`` when a replay asks for a shared prefix.
    """

    id: str
    agent: str
    hash_ids: tuple[int, ...]
    input_tokens: int
    output_tokens: int
    deps: tuple[Dep, ...] = ()
    start_delay_s: float = 0.0  # a call without deps starts this long after its session
    not_before_s: float | None = None  # and no call starts before this long after its session
    recorded_s: float = 0.0  # start time in the trace (information only)
    prefix_blocks: int = 0
    prefix_group: str = "main"
    parent_agent: str | None = None  # the agent that spawned this call's agent


@dataclass
class Session:
    """A session's calls in a topological order (every dep precedes its dependant)."""

    id: str
    calls: list[Call]
    arrival_s: float | None = None  # open loop: when the session starts, from trace start
    meta: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for c in self.calls:
            if c.id in seen:
                raise TraceError(f"session {self.id}: duplicate call id {c.id}")
            for d in c.deps:
                if d.call not in seen:
                    raise TraceError(
                        f"session {self.id}: call {c.id} depends on {d.call}, "
                        "which is not an earlier call"
                    )
                if d.delay_s < 0:
                    raise TraceError(f"session {self.id}: negative delay on {c.id}")
            if c.not_before_s is not None and c.not_before_s < 0:
                raise TraceError(f"session {self.id}: negative not_before_s on {c.id}")
            seen.add(c.id)

    def call(self, call_id: str) -> Call:
        for c in self.calls:
            if c.id == call_id:
                return c
        raise KeyError(call_id)

    @property
    def agents(self) -> list[str]:
        return list(dict.fromkeys(c.agent for c in self.calls))


@dataclass
class Trace:
    """Sessions plus how to read their ids.

    ``id_scope`` is ``"session"`` when hash ids are local to a session (WEKA/AgentX) and
    ``"trace"`` when they are shared across the whole trace (Mooncake). ``open_loop`` says the
    sessions carry arrival times (``Session.arrival_s``) a replay may honour.
    """

    name: str
    block_size: int
    sessions: list[Session]
    id_scope: str = "session"
    open_loop: bool = False
    meta: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise TraceError(f"block_size must be positive, got {self.block_size}")
        if self.id_scope not in ("session", "trace"):
            raise TraceError(f"id_scope must be 'session' or 'trace', got {self.id_scope!r}")

    def __iter__(self) -> Iterator[Session]:
        return iter(self.sessions)

    @property
    def n_calls(self) -> int:
        return sum(len(s.calls) for s in self.sessions)

    def stats(self) -> dict[str, float]:
        """Counts a report prints next to results."""
        calls = [c for s in self.sessions for c in s.calls]
        subagents = sum(len(s.agents) - 1 for s in self.sessions)
        return {
            "sessions": len(self.sessions),
            "calls": len(calls),
            "subagents": subagents,
            "input_tokens": sum(c.input_tokens for c in calls),
            "output_tokens": sum(c.output_tokens for c in calls),
        }
