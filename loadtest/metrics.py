"""AgentX metrics over replay records.

Owns: :func:`agentx_numbers` (the one definition of the per-call AgentX numbers: TTFT and
TPOT percentiles, P90 interactivity, tokens per GPU-second, cache hit ratio and its bound),
:func:`summarize` (replay records -> the ``summary.json`` dict, built on it; the in-process
simulator's ``SimResult.summary()`` is built on it too) and :class:`UnlimitedCache` (the
prefix-cache hit bound for the same prompts with infinite capacity). Pure: numpy only, no
HTTP, no router imports.

Definitions (AgentX vocabulary, DESIGN.md):

- P90 interactivity = 1000 / P90 TPOT in ms (tok/s per user); TPOT is a call's
  ``(e2e - ttft) / (completion_tokens - 1)``, over successful calls with ≥2 output tokens.
- Tokens per GPU-second = (prompt tokens incl. cached + completion tokens of successful calls)
  / (GPUs × wall time).
- TTFT p50/p90/p99; session completion p50/p90 over completed session plays (first call's
  start to last call's end). Under a time bound that is biased toward short sessions (long
  ones are still running when it falls), so the plays the bound cut short are reported too:
  their count, their elapsed time (start to when the bound stopped them: a lower bound of
  their completion time), and the P90 over completed plays' completion times and unfinished
  plays' elapsed times together — a lower bound of the P90 over every started play that did
  not fail.
- Session completion by size (issue 47): completed plays classed by their number of calls —
  ``short`` (at most :data:`SHORT_MAX_CALLS`), ``long`` (at least :data:`LONG_MIN_CALLS`),
  ``medium`` between — each with its count, completion p50/p90/p99 and the TTFT p99 of its
  calls (``session_completion_by_size``); plus the mean completion over every completed play.
- Failures exclude calls cut off by the replay's own time bound (``requests_cancelled``).
- Cache hit ratio = Σ cached_tokens / Σ prompt_tokens over successful calls that reported
  ``cached_tokens``; its bound is the same ratio for :class:`UnlimitedCache`.
- Twins run ``speedup`` times faster than the hardware they model: every time is multiplied
  by ``speedup`` (and throughput divided by it) so results read in modelled seconds.

Percentiles use numpy's default (linear interpolation between order statistics).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from loadtest.replay.records import CallRecord, QueueSample, SessionRecord

# The fields every summary.json must carry (the replay harness's contract, issue 5).
SUMMARY_REQUIRED = (
    "p90_interactivity_tok_s",
    "tokens_per_gpu_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "session_completion_p90_s",
    "sessions_unfinished",
    "cache_hit_ratio",
    "cache_hit_bound",
    "requests_ok",
    "requests_failed",
)
CANCELLED = "cancelled"  # CallRecord.error prefix for calls cut off by the run bound
# a completed play of at most this many calls is a short session, of at least LONG_MIN_CALLS
# a long one, medium between (weka-dev's Claude Code sessions: 10th percentile 26 calls,
# median 68, 75th 99)
SHORT_MAX_CALLS = 30
LONG_MIN_CALLS = 100
SIZE_CLASSES = ("short", "medium", "long")


def size_class(calls: int) -> str:
    """``short`` / ``medium`` / ``long`` for a session of ``calls`` calls."""
    if calls <= SHORT_MAX_CALLS:
        return "short"
    return "long" if calls >= LONG_MIN_CALLS else "medium"


def by_session_size(
    done: Sequence[SessionRecord], ok: Sequence[CallRecord], speedup: float
) -> dict[str, dict[str, Any]]:
    """Per size class of the completed plays ``done``: count, completion p50/p90/p99 (s) and
    the TTFT p99 (s) of their successful calls ``ok`` (times in modelled seconds)."""
    cls = {(s.session, s.play): size_class(s.calls) for s in done}
    out: dict[str, dict[str, Any]] = {}
    for c in SIZE_CLASSES:
        times = [(s.t_end - s.t_start) * speedup for s in done if cls[(s.session, s.play)] == c]
        ttft = [x.ttft_s * speedup for x in ok
                if x.ttft_s is not None and cls.get((x.session, x.play)) == c]  # fmt: skip
        out[c] = {
            "sessions": len(times),
            "p50_s": _pct(times, 50),
            "p90_s": _pct(times, 90),
            "p99_s": _pct(times, 99),
            "ttft_p99_s": _pct(ttft, 99),
        }
    return out


def _pct(xs: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else None


def _ms(s: float | None) -> float | None:
    return s * 1e3 if s is not None else None


def _time_weighted_pct(samples: Sequence[QueueSample], q: float) -> float | None:
    """Percentile of the in-flight step function over time: each sample's depth holds until
    the next sample (samples come at every call start and end and on a timer, so counting
    them equally would weight busy moments by their call rate, not their duration)."""
    pts = sorted(samples, key=lambda s: s.t)
    if not pts:
        return None
    if len(pts) == 1:
        return float(pts[0].in_flight)
    depth = np.array([s.in_flight for s in pts[:-1]], dtype=float)
    dt = np.diff(np.array([s.t for s in pts], dtype=float))
    if dt.sum() <= 0:
        return _pct(depth.tolist(), q)
    order = np.argsort(depth, kind="stable")
    cum = np.cumsum(dt[order]) / dt.sum()
    return float(depth[order][np.searchsorted(cum, q / 100.0)])


class CallNumbers(NamedTuple):
    """What the AgentX numbers need of one successful call, in measured seconds."""

    ttft_s: float | None
    tpot_s: float | None  # mean time per output token after the first
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None  # None: the server did not report it
    bound_cached_tokens: int | None = None  # None: no unlimited-cache bound tracked


def agentx_numbers(
    calls: Iterable[CallNumbers], *, wall_s: float, gpus: int = 1, speedup: float = 1.0
) -> dict[str, Any]:
    """The AgentX numbers over successful calls (the module docstring's definitions), in
    modelled seconds (measured × ``speedup``); ``None`` where there is nothing to measure.

    Keys: ``ttft_p50_s``, ``ttft_p90_s``, ``ttft_p99_s``, ``tpot_p50_s``, ``tpot_p90_s``
    (calls with ≥2 completion tokens), ``p90_interactivity_tok_s`` (1 / P90 TPOT),
    ``tokens_per_gpu_s``, ``cache_hit_ratio`` (calls that reported ``cached_tokens``),
    ``cache_hit_bound`` (the same calls, else all), ``prompt_tokens``, ``cached_tokens``,
    ``completion_tokens``. Both :func:`summarize` (HTTP replay) and the in-process
    simulator's summary read these, so their numbers share one definition."""
    cs = list(calls)
    ttft = [c.ttft_s * speedup for c in cs if c.ttft_s is not None]
    tpot = [c.tpot_s * speedup for c in cs if c.tpot_s is not None and c.completion_tokens >= 2]
    p90_tpot = _pct(tpot, 90)
    reported = [c for c in cs if c.cached_tokens is not None]
    prompt_rep = sum(c.prompt_tokens for c in reported)
    hit = sum(c.cached_tokens or 0 for c in reported) / prompt_rep if prompt_rep else None
    # the bound over the same calls as the ratio it is drawn next to
    basis = reported or cs
    prompt_basis = sum(c.prompt_tokens for c in basis)
    tracked = any(c.bound_cached_tokens is not None for c in basis)
    bound = (
        sum(c.bound_cached_tokens or 0 for c in basis) / prompt_basis
        if tracked and prompt_basis
        else None
    )
    tokens = sum(c.prompt_tokens + c.completion_tokens for c in cs)
    return {
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p90_s": _pct(ttft, 90),
        "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50),
        "tpot_p90_s": p90_tpot,
        "p90_interactivity_tok_s": (1.0 / p90_tpot) if p90_tpot else None,
        "tokens_per_gpu_s": tokens / (gpus * (wall_s * speedup)),
        "cache_hit_ratio": hit,
        "cache_hit_bound": bound,
        "prompt_tokens": sum(c.prompt_tokens for c in cs),
        "cached_tokens": sum(c.cached_tokens or 0 for c in cs),
        "completion_tokens": sum(c.completion_tokens for c in cs),
    }


class UnlimitedCache:
    """vLLM-style prefix caching over full blocks, with no capacity limit.

    ``observe(token_ids)`` returns how many leading tokens of the prompt were held (full blocks
    whose whole prefix chain was seen before, capped like vLLM at the last full block before
    the final token, since one token must always be computed), then remembers every full
    block of the prompt. ``observe_keys(keys, n_tokens)`` is the same over a prompt already
    given as chained block keys (the in-process simulator's DAG calls); ``observe`` is built
    on it.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._seen: set[int] = set()

    def observe(self, token_ids: Sequence[int]) -> int:
        b = self.block_size
        keys = []
        parent = 0
        for i in range(len(token_ids) // b):
            parent = hash((parent, tuple(token_ids[i * b : (i + 1) * b])))
            keys.append(parent)
        return self.observe_keys(keys, len(token_ids))

    def observe_keys(self, keys: Sequence[int], n_tokens: int) -> int:
        """Hit tokens of a prompt of ``n_tokens`` tokens whose full blocks have the chained
        keys ``keys`` (key j names the whole prefix through block j, like vLLM's block
        hashes; at most ``n_tokens // block_size`` of them), then remember every key.

        Every observed prompt's keys are all remembered, so with chained keys "key j was
        seen" is monotone in j and the held prefix is found by bisection."""
        b = self.block_size
        seen = self._seen
        lo, hi = 0, min(len(keys), n_tokens // b)
        keys = keys[:hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if keys[mid - 1] in seen:
                lo = mid
            else:
                hi = mid - 1
        seen.update(keys[lo:])
        return max(0, min(lo, (n_tokens - 1) // b)) * b


def summarize(
    calls: Sequence[CallRecord],
    sessions: Sequence[SessionRecord] = (),
    queue: Sequence[QueueSample] = (),
    *,
    wall_s: float,
    gpus: int = 1,
    speedup: float = 1.0,
    interactivity_line_tok_s: float = 50.0,
) -> dict[str, Any]:
    """The AgentX summary of one replay (see the module docstring)."""
    if wall_s <= 0:
        raise ValueError("wall_s must be positive")
    if gpus <= 0 or speedup <= 0:
        raise ValueError("gpus and speedup must be positive")
    ok = [c for c in calls if c.ok]
    # Calls cut off by the run's own time bound are not failures of the target.
    cancelled = [c for c in calls if not c.ok and (c.error or "").startswith(CANCELLED)]
    failed = [c for c in calls if not c.ok and not (c.error or "").startswith(CANCELLED)]
    n = agentx_numbers(
        (
            CallNumbers(c.ttft_s, c.tpot_s, c.prompt_tokens, c.completion_tokens,
                        c.cached_tokens, c.bound_cached_tokens)
            for c in ok
        ),
        wall_s=wall_s,
        gpus=gpus,
        speedup=speedup,
    )  # fmt: skip
    interactivity = n["p90_interactivity_tok_s"]
    modelled_wall = wall_s * speedup
    done = [s for s in sessions if s.complete]
    completion = [(s.t_end - s.t_start) * speedup for s in done]
    cut = [s for s in sessions if not s.complete and s.cut]
    elapsed = [(s.t_end - s.t_start) * speedup for s in cut]
    depth = [q.in_flight for q in queue]
    waiting = [q.waiting for q in queue if q.waiting is not None]
    errors: dict[str, int] = {}
    for c in failed:
        k = c.error.split(":", 1)[0] if c.error else f"http {c.status}"
        errors[k] = errors.get(k, 0) + 1
    return {
        "p90_interactivity_tok_s": interactivity,
        "tpot_p50_ms": _ms(n["tpot_p50_s"]),
        "tpot_p90_ms": _ms(n["tpot_p90_s"]),
        "meets_interactivity_line": (
            interactivity >= interactivity_line_tok_s if interactivity is not None else None
        ),
        "tokens_per_gpu_s": n["tokens_per_gpu_s"],
        "ttft_p50_s": n["ttft_p50_s"],
        "ttft_p90_s": n["ttft_p90_s"],
        "ttft_p99_s": n["ttft_p99_s"],
        "session_completion_p50_s": _pct(completion, 50),
        "session_completion_p90_s": _pct(completion, 90),
        "session_completion_p99_s": _pct(completion, 99),
        "session_completion_mean_s": float(np.mean(completion)) if completion else None,
        "session_completion_by_size": by_session_size(done, ok, speedup),
        "sessions_completed": len(done),
        "sessions_started": len(sessions),
        "sessions_unfinished": len(cut),
        "sessions_failed": len(sessions) - len(done) - len(cut),
        "session_unfinished_elapsed_p50_s": _pct(elapsed, 50),
        "session_unfinished_elapsed_max_s": max(elapsed) if elapsed else None,
        "session_completion_p90_lower_bound_s": _pct(completion + elapsed, 90),
        "cache_hit_ratio": n["cache_hit_ratio"],
        "cache_hit_bound": n["cache_hit_bound"],
        "prompt_tokens": n["prompt_tokens"],
        "cached_tokens": n["cached_tokens"],
        "completion_tokens": n["completion_tokens"],
        "requests_ok": len(ok),
        "requests_failed": len(failed),
        "requests_cancelled": len(cancelled),
        "failures": errors,
        "queue_depth_p50": _time_weighted_pct(queue, 50),
        "queue_depth_max": max(depth) if depth else None,
        "waiting_p90": _pct(waiting, 90),
        "wall_s": wall_s,
        "modelled_wall_s": modelled_wall,
        "speedup": speedup,
        "gpus": gpus,
        "replicas_used": sorted({c.replica for c in ok if c.replica}),
    }
