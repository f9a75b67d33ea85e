"""router.call: the call sequence's begin and end around the send (analysis, the session
table, the not-completed outcome), and finish heard once."""

from __future__ import annotations

from router.call import CallSequence
from router.outcome import CallOutcome
from router.scheduling import RequestContext
from router.scheduling.registry import build_pipeline
from router.sessions import identify
from router.state import MemoryStore


def _seq(analyzed: list[str], heard: list[str]) -> CallSequence:
    async def analyzer(ctx: RequestContext) -> None:
        analyzed.append(ctx.request_id)

    def observer(ctx: RequestContext, outcome: CallOutcome) -> None:
        heard.append(outcome.status)

    return CallSequence(build_pipeline("round_robin"), analyzer=analyzer, observers=[observer])


async def test_begin_analyzes_and_opens_the_call_end_closes_it_once():
    analyzed: list[str] = []
    heard: list[str] = []
    seq, store = _seq(analyzed, heard), MemoryStore()
    ctx = RequestContext("r1", "/v1/chat/completions", "m", identify({"x-session-id": "s"}, {}), {})
    record = await seq.begin(ctx, store)
    assert analyzed == ["r1"] and record is not None and record.inflight == 1
    seq.finish(ctx, CallOutcome("http://a", "200"))
    await seq.end(ctx, store)
    assert heard == ["200"]  # the outcome the relay reported; end adds no second one
    rec = await store.get(ctx.identity.key)
    assert rec is not None and rec.inflight == 0 and rec.calls == 1


async def test_a_call_nothing_finished_ends_as_not_completed():
    heard: list[str] = []
    seq, store = _seq([], heard), MemoryStore()
    ctx = RequestContext("r2", "/v1/messages", "m", identify({"x-session-id": "s"}, {}), {})
    await seq.begin(ctx, store)
    await seq.end(ctx, store)  # a 503, a client gone: no outcome was reported
    assert heard == ["not_completed"]


async def test_a_passthrough_route_is_read_not_analyzed_nor_counted():
    analyzed: list[str] = []
    seq, store = _seq(analyzed, []), MemoryStore()
    ident = identify({"x-session-id": "s"}, {})
    await store.begin_call(ident, now=1.0)
    ctx = RequestContext("r3", "/v1/messages/count_tokens", "m", ident, {})
    ctx.session_call = False
    record = await seq.begin(ctx, store)
    assert record is not None and record.calls == 1 and analyzed == []
    await seq.end(ctx, store)
    assert (await store.get(ident.key)).inflight == 1  # the session's own call is still open
