"""What the KV layer knows of each session and replica between calls (router-local).

Owns: :class:`SessionFootprint` — the replica holding a session's KV, its context size, when
its last call ended, its gaps and output lengths, its parent and in-flight children (what the
cost model's eviction-harm and reserved terms need) — and :class:`ReplicaStat` (recent mean
uncached and prompt tokens per call on a replica). The session *table* (owner replica, shared
across routers through Redis) is :mod:`router.state`; a footprint is this router's own view of
the same session's KV, keyed by the same session key, kept in simulated time by the simulator
and in wall time by the service. Pure data: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SessionFootprint:
    """One session's footprint. In a :class:`router.kv.footprints.FootprintTable` (the KV
    state's session table), setting a field tells the table (which keeps per-replica columns
    of its footprints); replace the lists, do not change them in place."""

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
    # how long after ``last_end`` the host tier holds its chunks: the retention hint its last
    # call carried (tool-pause / waiting-on-children), as the engine plugin bounds it; 0: none
    hold_s: float = 0.0
    # the FootprintTable holding it (told of every field set), None outside one
    _table: Any = field(default=None, init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        table = self._table
        if table is not None and name != "_table":
            table.changed(self)

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
