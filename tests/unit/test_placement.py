"""router.placement: a session's placement in the store, and the rendezvous while Redis is
away (two routers agreeing without Redis: tests/integration/test_router_outage.py)."""

from __future__ import annotations

from types import SimpleNamespace

from aiohttp import web

from router.keys import METRICS, STORE
from router.metrics import RouterMetrics
from router.placement import place_session, rendezvous
from router.scheduling import RequestContext
from router.sessions import identify
from router.state import MemoryStore


def _decision(*names: str) -> SimpleNamespace:
    ranked = [(SimpleNamespace(name=n), 1.0) for n in names]
    return SimpleNamespace(endpoint=ranked[0][0], ranked=ranked, move_reason="score",
                           elapsed_s=None)  # fmt: skip


def _app(store: object) -> web.Application:
    app = web.Application()
    app[STORE] = store  # type: ignore[assignment]
    app[METRICS] = RouterMetrics()
    return app


def test_rendezvous_is_stable_and_keeps_a_key_where_it_was_when_others_leave():
    names = [f"http://r{i}" for i in range(5)]
    first = rendezvous("tenant\x1fsession", names)
    assert first in names and rendezvous("tenant\x1fsession", list(reversed(names))) == first
    others = [n for n in names if n != first]
    moved = rendezvous("tenant\x1fsession", others)
    assert rendezvous("tenant\x1fsession", [*others[:2], first, *others[2:]]) == first
    assert moved != first and rendezvous("k", []) is None
    spread = {rendezvous(f"s{i}", names) for i in range(200)}
    assert spread == set(names)  # keys spread over every replica


async def test_a_first_placement_is_claimed_and_a_concurrent_one_elsewhere_wins():
    store = MemoryStore()
    app = _app(store)
    ident = identify({"x-session-id": "s"}, {})
    record = await store.begin_call(ident, now=1.0)
    ctx = RequestContext("rid", "/v1/chat/completions", "m", ident, {})
    await store.claim(ident.key, "http://b")  # another router placed it meanwhile
    got = await place_session(app, ctx, record.copy(), _decision("http://a", "http://b"))
    assert got == "http://b"  # b is among the ranked: the earlier claim wins
    rec = await store.get(ident.key)
    assert rec is not None and rec.replica == "http://b"
    moved = await place_session(app, ctx, rec.copy(), _decision("http://a"))
    assert moved == "http://a" and (await store.get(ident.key)).replica == "http://a"


async def test_a_call_that_is_no_turn_of_its_session_places_nothing():
    store = MemoryStore()
    ident = identify({"x-session-id": "s"}, {})
    record = await store.begin_call(ident, now=1.0)
    ctx = RequestContext("rid", "/v1/messages/count_tokens", "m", ident, {})
    ctx.session_call = False
    assert await place_session(_app(store), ctx, record, _decision("http://a")) == "http://a"
    assert (await store.get(ident.key)).replica is None
