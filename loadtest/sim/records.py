"""The simulator's results: one record per call and a run's summary in AgentX terms.

Owns: :class:`CallRecord` (a call's replica, times, tokens and cache hits) and
:class:`SimResult` (a run's records and counters, :meth:`SimResult.summary`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadtest.metrics import SIZE_CLASSES, CallNumbers, agentx_numbers, size_class


@dataclass(slots=True)
class CallRecord:
    session_id: str
    call_index: int
    replica: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    first_token: float
    finish: float
    preemptions: int
    agent: str | None = None  # DAG sessions: the call's agent ("main" for the root)
    bound_cached_tokens: int | None = None  # DAG sessions: unlimited-cache prefix hit

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.output_tokens - 1)


@dataclass
class SimResult:
    records: list[CallRecord]
    sim_time_s: float
    wall_s: float
    replicas: int
    events: int
    steps: int
    sessions_done: int
    sessions: int
    engine_busy_s: list[float] = field(default_factory=list)
    tier_hit_blocks: dict[str, int] = field(default_factory=dict)
    gpus_per_replica: int = 1  # the profile's tensor-parallel size
    failed: int = 0  # DAG calls refused (prompt + output over max_model_len)
    cut: bool = False  # stopped by ``until`` with work left: ``sim_time_s`` is ``until``
    session_spans: list[tuple[float, float]] = field(default_factory=list)  # DAG: start, end
    # DAG sessions completed: (session id, start, end, calls) — the size classes' input
    session_runs: list[tuple[str, float, float, int]] = field(default_factory=list)

    @property
    def gpus(self) -> int:
        return self.replicas * self.gpus_per_replica

    def summary(self, warmup_s: float = 0.0) -> dict[str, Any]:
        """AgentX numbers in simulated seconds, by :func:`loadtest.metrics.agentx_numbers`
        (the HTTP replay's definitions: TPOT over calls with ≥2 output tokens, interactivity
        = 1 / P90 TPOT, tokens per GPU-second over ``sim_time_s``); where there is nothing to
        measure, NaN (TPOT, interactivity) or 0 (hit ratio) as before. ``warmup_s``: only
        calls (and completed sessions) that arrived (started) after it count, over the time
        after it. Session completion p50/p90 over DAG sessions that finished."""
        r = [x for x in self.records if x.arrival >= warmup_s] if warmup_s else self.records
        span = self.sim_time_s - warmup_s
        if not r or span <= 0:
            return {"requests": 0, "wall_s": round(self.wall_s, 2)}
        n = agentx_numbers(
            (
                CallNumbers(x.ttft, x.tpot, x.prompt_tokens, x.output_tokens, x.cached_tokens,
                            x.bound_cached_tokens)
                for x in r
            ),
            wall_s=span,
            gpus=self.gpus,
        )  # fmt: skip
        nan = float("nan")
        done = sorted(e - s for s, e in self.session_spans if s >= warmup_s)
        out = {
            "requests": len(r),
            "sessions_done": self.sessions_done,
            "sessions": self.sessions,
            "ttft_p50_s": n["ttft_p50_s"],
            "ttft_p90_s": n["ttft_p90_s"],
            "ttft_p99_s": n["ttft_p99_s"],
            "tpot_p90_s": _or(n["tpot_p90_s"], nan),
            "p90_interactivity_tok_s": _or(n["p90_interactivity_tok_s"], nan),
            "cache_hit_ratio": _or(n["cache_hit_ratio"], 0.0),
            "throughput_tok_per_gpu_s": n["tokens_per_gpu_s"],
            "session_p50_s": float(np.percentile(done, 50)) if done else nan,
            "session_p90_s": float(np.percentile(done, 90)) if done else nan,
            "preemptions": sum(x.preemptions for x in r),
            "tier_hit_blocks": dict(self.tier_hit_blocks),
            "sim_time_s": self.sim_time_s,
            "wall_s": self.wall_s,
            "events": self.events,
            "steps": self.steps,
            "utilization": (sum(self.engine_busy_s) / (self.replicas * self.sim_time_s)
                            if self.sim_time_s else 0.0),
        }  # fmt: skip
        if done:
            out["session_p99_s"] = float(np.percentile(done, 99))
            out["session_mean_s"] = float(np.mean(done))
            out["session_by_size"] = self._by_size(r, warmup_s)
        # runs with DAG sessions track the unlimited-cache bound (synthetic sessions do not)
        if any(x.bound_cached_tokens is not None for x in r):
            out["hit_bound"] = _or(n["cache_hit_bound"], 0.0)
            out["requests_failed"] = self.failed
        return out

    def _by_size(self, r: list[CallRecord], warmup_s: float) -> dict[str, dict[str, Any]]:
        """Completed DAG sessions started after ``warmup_s`` by size class
        (:func:`loadtest.metrics.size_class` of their calls): count, completion p50/p90/p99 and
        the TTFT p99 of their calls ``r`` (a subagent's calls, ``<root>/<agent>``, count with
        their root)."""
        cls = {sid: size_class(n) for sid, st, _, n in self.session_runs if st >= warmup_s}
        out: dict[str, dict[str, Any]] = {}
        for c in SIZE_CLASSES:
            times = [e - st for sid, st, e, _ in self.session_runs
                     if st >= warmup_s and cls.get(sid) == c]  # fmt: skip
            ttft = [
                x.ttft for x in r if x.ttft is not None and cls.get(_root(x.session_id, cls)) == c
            ]
            out[c] = {
                "sessions": len(times),
                "p50_s": float(np.percentile(times, 50)) if times else None,
                "p90_s": float(np.percentile(times, 90)) if times else None,
                "p99_s": float(np.percentile(times, 99)) if times else None,
                "ttft_p99_s": float(np.percentile(ttft, 99)) if ttft else None,
            }
        return out


def _root(sid: str, roots: Mapping[str, Any]) -> str:
    """The root session of a DAG call's session id (``<root>/<agent>`` for a subagent)."""
    return sid if sid in roots else sid.rsplit("/", 1)[0]


def _or(x: float | None, default: float) -> float:
    return default if x is None else x
