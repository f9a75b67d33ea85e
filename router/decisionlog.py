"""The decision log: one JSON line per placement, for finding out why a call went where it did.

Owns: a decision hook (:class:`router.call.CallSequence` runs it after each pick) that appends
what the pipeline saw and chose to a file — the session and the replica it was on, the
winner, each candidate's total and the cost terms its scorers returned (``kv_cost``: queue,
fetch-or-recompute, congestion, interference, the session prior, the matched blocks, ...).
``/admin/route?explain=1`` answers the same question for one hypothetical call; this log
answers it for every real call of a run, which is what a benchmark diagnosis needs (see
docs/benchmarks-log.md, "the move rule"). Enabled by ``decision_log: PATH`` (``--decision-log``,
``KVROUTE_DECISION_LOG``); off by default. Lines are written synchronously (line-buffered,
a few hundred bytes each) — a debugging aid, not for a router taking thousands of calls/s.

A line::

    {"t": 1764600000.123, "request_id": "...", "session": "...", "session_replica": "r0",
     "winner": "r1", "move_reason": "cost", "analysed": true, "prompt_tokens": 105096,
     "candidates": {"r0": {"total": 0.41, "kv_cost": {"queue_s": 0.0, ...}}, "r1": {...}}}

With ``priority: session`` a line also carries the ``priority`` sent upstream and its
``priority_level`` before aging (:mod:`router.priority`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, BinaryIO

import orjson

from costmodel.placement import CostTerms

log = logging.getLogger("kvroute.decisions")

# the terms worth a line (explain shows every term; the log keeps the ones that decide):
# kv_cost's cost terms (CostTerms.TERMS) and what they are computed from
KEEP = (
    "total_s",
    "effective_s",
    "session_prior_s",
    *CostTerms.TERMS,
    "match_blocks",
    "source",
    "queued_prefill_tokens",
    "free_gpu_blocks",
)


class DecisionLog:
    """Append-only JSONL of placements; call :meth:`close` when the router stops."""

    def __init__(self, path: str, *, per_process: bool = False):
        if per_process:  # workers: one file each, so lines never interleave
            path = f"{path}.{os.getpid()}"
        self.path = path
        self._f: BinaryIO | None = open(path, "ab", buffering=0)
        self.lines = 0

    def __call__(self, ctx: Any, decision: Any) -> None:
        if self._f is None:
            return
        cands: dict[str, Any] = {}
        for ep, total in decision.ranked:
            row: dict[str, Any] = {"total": round(total, 6)}
            for scorer, terms in decision.terms_for(ep.name).items():
                row[scorer] = {k: terms[k] for k in KEEP if k in terms}
            cands[ep.name] = row
        line = {
            "t": round(time.time(), 4),
            "request_id": ctx.request_id,
            "session": ctx.identity.key,
            "session_replica": decision.session_replica,
            "winner": decision.endpoint.name,
            "move_reason": decision.move_reason,
            # the prompt analysis landed before the pick (a prompt shorter than one block has
            # no block keys but is analysed: ``[]``, not ``None``)
            "analysed": ctx.block_keys is not None,
            "prompt_tokens": ctx.prompt_tokens,
            "excluded": sorted(ctx.excluded),
            "candidates": cands,
        }
        if getattr(ctx, "priority", None) is not None:  # priority: session (router.priority)
            line["priority"] = ctx.priority
            line["priority_level"] = ctx.priority_level
        pd = ctx.extra.get("pd") if isinstance(getattr(ctx, "extra", None), dict) else None
        if pd is not None:  # a P/D split's verdict (router.disagg): the winner is its prefill
            line["pd"] = pd
        try:
            self._f.write(orjson.dumps(line, default=str) + b"\n")
            self.lines += 1
        except OSError as e:  # a full disk must not stop routing
            log.warning("decision log %s: %s; logging stopped", self.path, e)
            self.close()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
