"""Placement: pick a replica for a call and record it in the session table.

Owns: :func:`place_call` (the call sequence's decide — snapshot, pipeline, the pick recorded —
then the session's placement) and :func:`place_session`: a session's first placement is a
claim in the store (a concurrent first placement elsewhere wins), a move an assignment; while
Redis is away every router gives a session the same answer without talking to the others (the
newest binding heard through Redis, else :func:`rendezvous` over the replicas the policy
ranked). Must not import torch, vllm or loadtest.
"""

from __future__ import annotations

import hashlib

from aiohttp import web

from router.keys import CALLS, METRICS, STORE
from router.replicas import EndpointView
from router.scheduling import RequestContext
from router.scheduling.pipeline import Decision
from router.state import SessionRecord


async def place_session(
    app: web.Application, ctx: RequestContext, record: SessionRecord | None, decision: Decision
) -> str:
    """Record the pick in the session table; a concurrent first placement elsewhere wins.
    A call that is not a session call (``count_tokens``) reads the session, places nothing."""
    store = app[STORE]
    chosen = decision.endpoint.name
    if record is None or not ctx.session_call:
        return chosen
    if store.backend == "redis" and not store.up:
        # Redis away: every router must give a session the same answer without talking to
        # the others — the newest binding published through Redis before it went (every
        # router heard it: router.state), else a rendezvous hash of the session over the
        # replicas the policy ranked (the same healthy set on every router)
        names = [e.name for e, _ in decision.ranked]
        if record.replica not in names:
            chosen = rendezvous(ctx.identity.key, names) or chosen
        else:
            chosen = record.replica
        if record.replica != chosen:
            await store.assign(ctx.identity.key, chosen)  # local view, written back later
        app[METRICS].placed(record.replica, chosen, decision)
        record.replica = chosen
        return chosen
    if record.replica is None:
        owner = await store.claim(ctx.identity.key, chosen)
        if owner != chosen and any(e.name == owner for e, _ in decision.ranked):
            chosen = owner
    elif record.replica != chosen:
        await store.assign(ctx.identity.key, chosen)
    app[METRICS].placed(record.replica, chosen, decision)
    record.replica = chosen
    return chosen


def rendezvous(key: str, names: list[str]) -> str | None:
    """Highest-random-weight choice of ``names`` for ``key`` (stable across processes)."""
    best, best_w = None, b""
    for n in names:
        w = hashlib.blake2b(f"{key}\x00{n}".encode("utf-8", "surrogateescape"),
                            digest_size=8).digest()  # fmt: skip
        if best is None or w > best_w:
            best, best_w = n, w
    return best


async def place_call(
    app: web.Application,
    ctx: RequestContext,
    views: tuple[EndpointView, ...],
    record: SessionRecord | None,
) -> tuple[Decision, str]:
    """Decide (:meth:`router.call.CallSequence.decide` over ``views``), then place the session
    (:func:`place_session`); returns the decision and the replica the call goes to. Raises
    :class:`router.scheduling.pipeline.NoCandidates`."""
    decision = app[CALLS].decide(ctx, views, record)
    return decision, await place_session(app, ctx, record, decision)
