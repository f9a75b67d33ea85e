"""Scorer and policy ``kv_cost``: send each call where fetching-or-recomputing its KV is cheapest.

Algorithm, per candidate replica r (all in seconds, :func:`costmodel.placement.placement_cost`):

1. match the prompt's block keys against r: the exact block index when r's KV event stream is
   fresh, else approximate mode (r's predicted cache from routing history) — giving the
   matched prefix split by tier (GPU / CPU / STORAGE) — deepened by the prompts this router
   has in flight to r (a burst sharing a prefix arrives before the first call's blocks are
   stored; vLLM queues the later calls behind that prefill, then hits them) — and cut to the
   share of its matched prefixes r has lately delivered (its calibration's
   ``hit_realization``: under KV pressure a replica with a long queue evicts a waiting call's
   prefix before it schedules it, which the index cannot see coming);
2. cost(r) = queue + Σ min(load, recompute) over the prompt's segments + decode in r's batch
   + eviction harm (sessions whose warm KV this call would evict × their P(return) × the
   cost to bring it back; parents with children in flight are pinned, never evicted)
   + reserved load of paced agents (sessions between calls whose KV lives on r), both ways:
   their next prefills slowing this call, and this call's prefill holding up those that
   return before it is done (what keeps a cold prefill off a replica whose agents are due)
   + congestion (this call's prefill compute × calls already waiting on r)
   + interference (the requests decoding on r share their steps with this call's prefill
   chunks, which run longer, then decode slower while its KV is read with theirs)
   + next calls (opt-in, ``horizon_calls`` > 0: the session's next calls find its context on
   r and recompute the share r fails to deliver, 1 − its hit realization, stalling r's
   decoders as they go; × ``horizon_calls`` × P(the session calls again));
3. session prior with hysteresis: the replica that holds the session (``snap.session.replica``)
   gets ``margin = hysteresis_s + hysteresis_frac · cost`` taken off, so the session moves
   only when another replica is cheaper by more than that;
4. score(r) = min_cost / cost(r) ∈ (0, 1]: the cheapest replica scores 1.

Queue and decode inputs come from the replica's load (router in-flight, engine running and
waiting) times its recent mean uncached/prompt tokens per call; free GPU blocks from the
profile's pool minus the blocks the index (or the approximate cache) holds. Unknown inputs
stay ``None`` and their terms drop out of the sum (listed under ``missing``). Without the
``kv`` state provider (no KV layer installed) the scorer degrades to session affinity.

A call whose prompt analysis is late (the analysis lane busy with another call's cold
tokenization, see :meth:`router.kv.state.KVState.analyze`) is costed on what is known without
tokens (:meth:`router.kv.view.KVView.estimate`): its size from the body's characters, its
session's context as a hit on the replica that holds it. Without that, such a call cost only
its decode and went to the replica with the fewest decoders — the one busy with long cold
prefills.

Subagents (``identity.parent``) are placed by the same cost: the shared system/tool prefix
shows up in the match, and the parent's footprint on its replica is pinned while it waits.

The per-replica terms travel on the decision (:class:`router.scheduling.Scores` ``terms``):
explain shows them, and their ``model_ttft_s`` (the uncalibrated queue + fetch-or-recompute
TTFT) is what the KV layer calibrates against the observed TTFT — or, for a call that loads
from the cluster pool, its parts (``model_pool_fetch``, :func:`pool_parts`) that the
replica's pool link is fitted against
(:meth:`costmodel.calibration.Calibrator.observe_pool_fetch`) — and their ``model_itl_s``
(one decode step in the batch the call joins) what it fits the decode scale against, from the
call's observed inter-token times. Output length: the session's mean output so far, else the
mean over every session the KV layer has seen (else its ``expected_output_tokens``), capped
by the client's ``max_tokens`` / ``max_completion_tokens`` when that is smaller. Parameters:
``hysteresis_s`` (default 0.25),
``hysteresis_frac`` (0.1), ``overlap`` (1.0: tier loads hide behind compute),
``interference_weight`` (1.0; 0 turns the decode-interference term off),
``horizon_calls`` (0: off; the calls after this one the next-calls term counts — measured
on the squeezed host tier, it helps at 48 lanes and costs at 32, see docs/benchmarks-log.md),
``expected_output_tokens`` (None: the session's mean, else the KV layer's default).
Without the KV layer (an app built with none: ``kvroute serve`` always builds one, completed
from the replicas when there are no ``kv:`` settings, docs/kv-routing.md "Zero-config") the
scorer is the ``session_affinity`` scorer (bounded-load consistent hashing, c = 1.25), so
``kv_cost`` — the default policy — never routes worse than plain affinity when it is not
wired; the router says so (``kvroute_kv_layer_mode{mode="affinity"}``, ``/ready``).

.. code-block:: yaml

    scheduling:
      scorers: [{type: kv_cost, weight: 1.0, params: {hysteresis_s: 0.25}}]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from costmodel.placement import CostTerms, Segments, placement_cost, queue_time, segment_costs
from costmodel.steptime import decode_step_time
from router.kv.view import KVView
from router.replicas import EndpointView
from router.scheduling import RequestContext, Scores, Snapshot
from router.scheduling.registry import register, register_policy
from router.scheduling.session_affinity import ring_scores

EPS = 1e-6


def expected_output(ctx: RequestContext, view: Any, fallback: int) -> int:
    body = ctx.body
    cap = body.get("max_completion_tokens") or body.get("max_tokens")
    fp = view.session(ctx.identity.key) if view is not None else None
    mean = fp.mean_output() if fp is not None else None
    guess = int(mean) if mean else fallback
    if isinstance(cap, int) and cap > 0:
        guess = min(guess, cap)
    return guess


def pool_parts(seg: Segments, queue_s: float, overlap: float) -> dict[str, float] | None:
    """The uncalibrated parts of a TTFT that loads from the pool (``seg``: its segments on
    the profile): the pool load, the queue, the prefill compute (recomputed segments and the
    tail), the other tiers' loads and the overlap. None when it does not load from the pool."""
    if seg.chose.get("pool") != "load":
        return None
    how = seg.chose.items()
    return {
        "pool_s": seg.load_s["pool"],
        "queue_s": queue_s,
        "compute_s": seg.tail_prefill_s + sum(seg.recompute_s[t] for t, h in how if h != "load"),
        "other_load_s": sum((seg.load_s[t] for t, h in how if h == "load" and t != "pool"), 0.0),
        "overlap": overlap,
    }


class KVCost:
    name = "kv_cost"

    def __init__(
        self,
        hysteresis_s: float = 0.25,
        hysteresis_frac: float = 0.1,
        overlap: float = 1.0,
        expected_output_tokens: int | None = None,
        interference_weight: float = 1.0,
        horizon_calls: float = 0.0,
    ):
        if hysteresis_s < 0 or not 0 <= hysteresis_frac < 1 or not 0 <= overlap <= 1:
            raise TypeError("hysteresis_s >= 0, 0 <= hysteresis_frac < 1, 0 <= overlap <= 1")
        if interference_weight < 0 or horizon_calls < 0:
            raise TypeError("interference_weight >= 0, horizon_calls >= 0")
        self.horizon_calls = horizon_calls
        self.interference_weight = interference_weight
        self.hysteresis_s = hysteresis_s
        self.hysteresis_frac = hysteresis_frac
        self.overlap = overlap
        self.expected_output_tokens = expected_output_tokens
        self.fallback_load_factor = 1.25

    def costs(
        self, ctx: RequestContext, snap: Snapshot, endpoints: list[EndpointView]
    ) -> dict[str, tuple[CostTerms, dict[str, Any]]]:
        """Per replica: the cost terms and the facts they came from (pure)."""
        view: KVView | None = snap.state("kv")
        if view is None:
            return {}
        keys = ctx.block_keys or []
        n_tok = int(ctx.prompt_tokens or len(keys) * view.block_size)
        names = [e.name for e in endpoints]
        matches = view.with_routed(keys, view.match(keys, names), ctx.request_id) if keys else {}
        if not keys:  # placed before its analysis landed: what is known without tokens
            n_tok, matches = view.estimate(ctx)
        out_tok = self.expected_output_tokens or expected_output(
            ctx, view, view.expected_output_tokens
        )
        nxt = self.horizon_calls * view.p_next_call(ctx.identity.key) if self.horizon_calls else 0.0
        res = {}
        for e in endpoints:
            prof = view.profile(e.name)
            m = matches.get(e.name)
            call = view.call_shape(e.name, keys, n_tok, m, out_tok, nxt)
            load = view.replica_load(e, ctx.identity.key, n_tok)
            terms = placement_cost(
                prof, call, load, overlap=self.overlap, interference_weight=self.interference_weight
            )
            # the same TTFT terms before calibration: what the calibrator must fit against
            # (fitting the calibrated figure would fit the calibration against itself)
            raw_queue = queue_time(prof, load.queued_prefill_tokens) or 0.0
            raw = segment_costs(prof, call, overlap=self.overlap)
            facts: dict[str, Any] = {
                "match_blocks": m.depth if m else 0,
                "tiers": {
                    "gpu": call.gpu_blocks,
                    "cpu": call.cpu_blocks,
                    "storage": call.storage_blocks,
                    "pool": call.pool_blocks,
                },
                "source": view.source(e.name),
                "free_gpu_blocks": load.free_gpu_blocks,
                "host_residence_s": load.host_residence_s,
                "queued_prefill_tokens": load.queued_prefill_tokens,
                "model_ttft_s": raw_queue + raw.seconds,
                # one decode step in the batch this call joins (uncalibrated): what the
                # KV layer fits the decode scale against, from observed inter-token times
                "model_itl_s": decode_step_time(
                    prof, load.decode_batch + 1, int(load.decode_context_tokens) + n_tok
                )
                if load.decode_batch is not None and load.decode_context_tokens is not None
                else None,
            }
            # the TTFT in parts where it loads from the pool: what the KV layer fits the
            # replica's pool link against
            pool = pool_parts(raw, raw_queue, self.overlap)
            if pool is not None:
                facts["model_pool_fetch"] = pool
            res[e.name] = (terms, facts)
        return res

    def score(
        self, ctx: RequestContext, snap: Snapshot, endpoints: list[EndpointView]
    ) -> Mapping[str, float]:
        sticky = snap.session.replica if snap.session is not None else None
        costs = self.costs(ctx, snap, endpoints)
        if not costs:  # no KV layer: bounded-load session affinity
            return ring_scores(ctx.identity.key, endpoints, self.fallback_load_factor, sticky)
        eff: dict[str, float] = {}
        explain: dict[str, Any] = {}
        for name, (terms, facts) in costs.items():
            c = terms.total_s
            prior = 0.0
            if name == sticky:
                prior = min(self.hysteresis_s + self.hysteresis_frac * c, c)
            eff[name] = max(c - prior, EPS)
            explain[name] = {
                **terms.as_dict(),
                **facts,
                "session_prior_s": round(prior, 6),
                "effective_s": round(eff[name], 6),
            }
        best = min(eff.values())
        return Scores({n: best / c for n, c in eff.items()}, terms=explain)


@register("scorer", "kv_cost")
def _kv_cost(
    hysteresis_s: float = 0.25,
    hysteresis_frac: float = 0.1,
    overlap: float = 1.0,
    expected_output_tokens: int | None = None,
    interference_weight: float = 1.0,
    horizon_calls: float = 0.0,
) -> KVCost:
    return KVCost(
        hysteresis_s,
        hysteresis_frac,
        overlap,
        expected_output_tokens,
        interference_weight,
        horizon_calls,
    )


register_policy("kv_cost", {"scorers": [{"type": "kv_cost", "weight": 1.0}]})
