"""The bounded prefill cadence: when a non-DP engine may admit prefill work.

Owns: :class:`CadenceConfig` and :class:`PrefillCadence`, a pure policy (no vLLM import, no
I/O) that the scheduler class (:mod:`engine_patches.scheduler`) asks once per engine step.

Why. A prefill chunk in a decode step makes that step as slow as the chunk, so every decoder
on the replica waits for it (decode ITL). vLLM defers prefill on off-cadence steps
(``Scheduler.schedule(throttle_prefills=True)``), but only DP engines pass ``True``, and after
every admitting step it sets ``prefill_capacity_bound = num_waiting > len(deferred_waiting)``,
which switches the cadence off as soon as one admitting step leaves anything waiting — exactly
under the load the cadence exists for. A guard that never lets go starves admission instead.

The rule (per engine step, while at least one running request is decoding):

1. *Cadence.* Prefill is admitted when ``steps_since_last_prefill + 1 >= n_eff``; other steps
   defer it (decodes still run).
2. *Backlog.* ``n_eff = max(1, ceil(N / (1 + B / backlog_scale)))`` where ``B`` is the pending
   prefill work in admitting steps: the remaining prefill tokens of the running prefill chunks
   and the waiting requests, divided by the measured prefill tokens per admitting step
   (exponential average, seeded with the token budget). A backlog of ``backlog_scale``
   admitting steps halves the interval; the cadence relaxes gradually as load grows instead of
   switching off.
3. *Bound.* Each request counts the steps (and the milliseconds) its prefill was held back
   while it was *eligible* — a running prefill chunk, or one of the waiting requests at the
   head of the queue that fit the step's token budget and free seats. A step is admitted when
   any eligible request has been held ``max_defer_steps`` steps or ``max_defer_ms`` ms in all,
   so no request is held more than D steps, nor more than T ms plus the step that crosses T.
   Requests further back in the queue are waiting for capacity, not for the cadence, and
   count nothing.

With no decoder running there is nobody to protect and prefill is always admitted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from os import PathLike
from typing import Any


@dataclass(frozen=True)
class CadenceConfig:
    interval: int = 4  # N
    max_defer_steps: int = 16  # D
    max_defer_ms: float = 500.0  # T
    backlog_scale: float = 16.0  # admitting steps of backlog that halve the interval
    ema_alpha: float = 0.2  # weight of the newest admitting step in the throughput average
    # "bounded": this module's guard. "vllm": vLLM's own rule, for comparison — prefill on
    # every N-th step (as the DP engine drives it) with the capacity escape left on.
    guard: str = "bounded"
    # JSONL (tests, benchmarks): one line per scheduled step, and one per request reaching the
    # scheduler (``"arrived"``); :func:`read_trace` splits the two
    trace_path: str | None = None

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError("cadence interval must be >= 1")
        if self.max_defer_steps < 0 or self.max_defer_ms < 0:
            raise ValueError("deferral bounds must be >= 0")
        if self.backlog_scale <= 0:
            raise ValueError("backlog_scale must be > 0")
        if self.guard not in ("bounded", "vllm"):
            raise ValueError("guard must be 'bounded' or 'vllm'")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> CadenceConfig:
        d = dict(d or {})
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown cadence settings: {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_additional_config(cls, additional: Mapping[str, Any] | None) -> CadenceConfig:
        """From vLLM's ``--additional-config '{"kvroute": {"cadence": {...}}}'``."""
        kv = (additional or {}).get("kvroute") or {}
        return cls.from_dict(kv.get("cadence"))


@dataclass(frozen=True)
class PendingPrefill:
    """A request with prompt left to compute, as the scheduler sees it before a step."""

    req_id: str
    remaining_tokens: int
    eligible: bool  # would run this step if the cadence allowed it


@dataclass(frozen=True)
class Decision:
    admit: bool
    reason: str  # idle | no-decoder | cadence | backlog | bound | defer
    interval: int  # n_eff this step
    backlog_tokens: int


@dataclass
class _Held:
    steps: int = 0
    ms: float = 0.0


@dataclass
class CadenceStats:
    steps: int = 0
    deferred_steps: int = 0
    admits: dict[str, int] = field(default_factory=dict)
    max_held_steps: int = 0  # over every request seen so far
    max_held_ms: float = 0.0
    pending_tokens: int = 0  # at the last step
    prefill_tokens_per_admit: float = 0.0


class PrefillCadence:
    """Per-engine state of the bounded cadence; call :meth:`decide` then :meth:`observe` once
    per step (times in seconds from one monotonic clock)."""

    def __init__(self, config: CadenceConfig, token_budget: int):
        self.config = config
        self._per_admit = float(max(1, token_budget))  # EMA of prefill tokens per admit step
        self._since_prefill = config.interval  # the first step is never held
        self._held: dict[str, _Held] = {}
        self._held_last_step: list[str] = []
        self._last_now: float | None = None
        self.stats = CadenceStats(prefill_tokens_per_admit=self._per_admit)

    def held(self, req_id: str) -> tuple[int, float]:
        h = self._held.get(req_id)
        return (h.steps, h.ms) if h else (0, 0.0)

    def interval_for(self, backlog_tokens: int) -> int:
        c = self.config
        backlog_steps = backlog_tokens / max(1.0, self._per_admit)
        return max(1, math.ceil(c.interval / (1.0 + backlog_steps / c.backlog_scale) - 1e-9))

    def decide(self, now: float, pending: Sequence[PendingPrefill], decoding: bool) -> Decision:
        # Time since the previous step counts for the requests that step held back.
        if self._last_now is not None:
            dt_ms = (now - self._last_now) * 1000.0
            for rid in self._held_last_step:
                h = self._held.get(rid)
                if h is not None:
                    h.ms += dt_ms
                    self.stats.max_held_ms = max(self.stats.max_held_ms, h.ms)
        self._last_now = now
        self._held_last_step = []
        live = {p.req_id for p in pending}
        for rid in [r for r in self._held if r not in live]:
            del self._held[rid]  # its prefill is done (or it left): nothing more to count
        self.stats.steps += 1
        backlog = sum(p.remaining_tokens for p in pending)
        self.stats.pending_tokens = backlog
        n_eff = self.interval_for(backlog)
        if not pending:
            return self._admit("idle", n_eff, backlog)
        if not decoding:
            return self._admit("no-decoder", n_eff, backlog)
        if self._since_prefill + 1 >= n_eff:
            return self._admit("cadence" if n_eff == self.config.interval else "backlog", n_eff,
                               backlog)  # fmt: skip
        c = self.config
        eligible = [p for p in pending if p.eligible]
        for p in eligible:
            h = self._held.get(p.req_id)
            if h is not None and (h.steps >= c.max_defer_steps or h.ms >= c.max_defer_ms):
                return self._admit("bound", n_eff, backlog)
        for p in eligible:
            h = self._held.setdefault(p.req_id, _Held())
            h.steps += 1
            self.stats.max_held_steps = max(self.stats.max_held_steps, h.steps)
            self._held_last_step.append(p.req_id)
        self.stats.deferred_steps += 1
        return Decision(False, "defer", n_eff, backlog)

    def _admit(self, reason: str, n_eff: int, backlog: int) -> Decision:
        self.stats.admits[reason] = self.stats.admits.get(reason, 0) + 1
        return Decision(True, reason, n_eff, backlog)

    def observe(self, prefill_tokens_scheduled: int) -> None:
        """After the step: how many prefill tokens it ran (0 on a held or decode-only step)."""
        if prefill_tokens_scheduled > 0:
            a = self.config.ema_alpha
            self._per_admit = (1 - a) * self._per_admit + a * prefill_tokens_scheduled
            self.stats.prefill_tokens_per_admit = self._per_admit
            self._since_prefill = 0
        else:
            self._since_prefill += 1


def eligible_flags(waiting: Iterable[int], token_budget: int, free_seats: int) -> list[bool]:
    """Which waiting requests (remaining prefill tokens, in queue order) would be admitted by
    one step with ``token_budget`` tokens and ``free_seats`` seats: the head always is (if a
    seat is free); the others while the budget lasts."""
    out: list[bool] = []
    left, seats = token_budget, free_seats
    for tokens in waiting:
        ok = seats > 0 and (not out or left > 0)
        out.append(ok)
        if ok:
            left -= tokens
            seats -= 1
    return out


def read_trace(path: str | PathLike[str], offset: int = 0) -> tuple[list[dict], list[dict]]:
    """The cadence trace from byte ``offset`` on: its step records and its arrival records
    (``{"t", "arrived", "prompt_tokens"}``, one per request added to the scheduler), each in
    file order. A missing file reads as empty; a line still being written is left for the next
    read."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], []
    steps: list[dict] = []
    arrivals: list[dict] = []
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        rec = json.loads(line)
        (arrivals if "arrived" in rec else steps).append(rec)
    return steps, arrivals
