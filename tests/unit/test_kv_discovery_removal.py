"""Discovery changes reach the KV layer: ReplicaSet listeners -> KVState.

A replica that discovery removes (and that stays away ``forget_after_s``) leaves the block
index, approximate mode, the event subscriber (its events are ignored) and sessions' homes;
one that comes back is expected again and its new events are applied, but has no index entry
(approximate mode) until they arrive. Everything in-process (``handle()`` and ``inproc://``).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import zmq
import zmq.asyncio

from costmodel.profiles import load_profile
from router.kv.config import KVConfig
from router.kv.events import END_SEQ
from router.kv.sessions import SessionFootprint
from router.kv.state import KVState
from router.outcome import CallOutcome
from router.replicas import EndpointView, ReplicaSet
from router.scheduling import RequestContext, Snapshot
from router.scheduling.kv_cost import KVCost
from router.sessions import SessionIdentity
from router.vllm.kvevents import encode_block_stored, encode_message

pytestmark = pytest.mark.timeout(20)

PROF = load_profile("h200-70b-fp8-offload")
BS = PROF.block_size
A, B = "http://a:8000", "http://b:8000"
TOPICS = {"kv@a": A, "kv@b": B}
KEYS = list(range(5_000, 5_064))


def msg(topic: str, seq: int, keys) -> list[bytes]:
    return encode_message(topic, seq, 0.0, [encode_block_stored(list(keys), None, [], BS)])


def ep(name: str) -> EndpointView:
    return EndpointView(name, name, True, frozenset({"m"}), 0, 0.0, 0.0, 0.1, "closed")


def ctx_for(session: str = "s") -> RequestContext:
    ident = SessionIdentity("t", session, None, None, False, "test")
    c = RequestContext("r1", "/v1/chat/completions", "m", ident, {"max_tokens": 100})
    c.block_keys = list(KEYS)
    c.prompt_tokens = len(KEYS) * BS
    return c


@pytest.fixture
async def started():
    """``await started(cfg, **kw)``: a started KVState, closed at the end even if the test
    fails (a subscriber left open hangs the run)."""
    made: list[KVState] = []

    async def make(cfg: KVConfig, **kw) -> KVState:
        st = KVState(cfg, profile=PROF, **kw)
        made.append(st)
        await st.start()
        return st

    yield make
    for st in made:
        await st.close()


@pytest.fixture
async def kv():
    cfg = KVConfig(block_size=BS, profile=PROF.name, events_bind="inproc://kv-disc",
                   topics=TOPICS, forget_after_s=0)  # fmt: skip
    st = KVState(cfg, profile=PROF, clock=lambda: 1000.0)
    await st.start()
    yield st
    await st.close()


def test_replica_set_tells_listeners_what_entered_and_left():
    rs = ReplicaSet()
    seen = []
    rs.add_listener(lambda added, removed: seen.append((set(added), set(removed))))
    rs.add_listener(lambda added, removed: 1 / 0)  # a broken listener breaks nothing
    rs.set_source("static", [A, B + "/"])
    rs.set_source("dns:0", [B])  # already there from another source: no change
    rs.set_source("static", [B])
    b = rs.get(B)
    rs.set_source("static", [])  # dns:0 still lists B: it stays, same entry (breaker, load)
    assert rs.get(B) is b and b.source == "dns:0" and rs.sources(B) == {"dns:0"}
    rs.set_source("dns:0", [B])  # no change
    assert seen == [({A, B}, set()), (set(), {A})]
    rs.set_source("static", [B])
    rs.set_source("dns:0", [])  # static lists it again: still no change
    rs.set_source("static", [])  # now nobody does: B leaves
    assert seen == [({A, B}, set()), (set(), {A}), (set(), {B})]
    assert list(rs) == [] and rs.sources(B) == set()


async def test_a_url_two_sources_list_keeps_its_kv_state_when_one_drops_it(kv):
    rs = ReplicaSet()
    rs.set_source("static", [A])
    rs.set_source("dns:0", [A])
    kv.watch(rs)
    await kv.subscriber.handle(msg("kv@a", 0, KEYS))
    kv.sessions["t/s"] = SessionFootprint("t/s", replica=A, tokens=len(KEYS) * BS)
    for _ in range(3):  # each source's refresh: dns:0 still lists A, then static again
        rs.set_source("static", [])
        kv.view()
        rs.set_source("static", [A])
    assert kv.index.match(KEYS)[A].depth == len(KEYS) and kv.sessions["t/s"].replica == A
    await kv.subscriber.handle(msg("kv@a", 1, [1]))  # its stream goes on, no gap
    assert kv.subscriber.stats.ignored_removed == 0 and not kv.index.state(A).stale


async def test_replica_without_an_event_stream_stays_approximate(started):
    """events_connect lists only A: B (discovered, never sending events) is not in the index
    and scorers use approximate mode for it; A keeps its connect-mode start-up entry."""
    st = await started(KVConfig(block_size=BS, events_connect={A: "inproc://kv-disc-pub-a"}))
    rs = ReplicaSet()
    rs.set_source("static", [A, B])
    st.watch(rs)
    view = st.view()
    assert B not in st.index.replicas() and view.source(B) == "approx"
    assert view.source(A) == "events" and st.index.view().blocks(A)["GPU"] == 0
    st.profile(B)
    st.approx.record(B, KEYS)
    assert view.match(KEYS, [A, B])[B].depth == len(KEYS)  # from routing history
    rs.set_source("static", [A])
    rs.set_source("static", [A, B])  # removed and back: still no index entry
    assert B not in st.index.replicas() and st.view().source(B) == "approx"


async def test_readded_replica_whose_first_batch_is_not_seq_0_is_stale(kv):
    rs = ReplicaSet()
    rs.set_source("static", [A])
    kv.watch(rs)
    await kv.subscriber.handle(msg("kv@a", 0, [1]))
    rs.set_source("static", [])
    rs.set_source("static", [A])
    assert A not in kv.index.replicas()
    await kv.subscriber.handle(msg("kv@a", 1, [2]))  # the stream went on: what came before?
    assert kv.index.state(A).stale and kv.view().source(A) == "approx"


async def test_a_short_absence_forgets_nothing_a_long_one_forgets_all(started):
    now = [1000.0]
    cfg = KVConfig(block_size=BS, events_bind="inproc://kv-disc-4", topics=TOPICS)
    assert cfg.forget_after_s == 30.0
    st = await started(cfg, clock=lambda: now[0])
    rs = ReplicaSet()
    rs.set_source("k8s", [A, B])
    st.watch(rs)
    await st.subscriber.handle(msg("kv@a", 0, KEYS))
    st.sessions["t/s"] = SessionFootprint("t/s", replica=A, tokens=len(KEYS) * BS)

    rs.set_source("k8s", [B])  # a readiness blip
    now[0] += 10
    st.view()
    assert st.index.match(KEYS)[A].depth == len(KEYS)  # not forgotten yet
    rs.set_source("k8s", [A, B])  # back within forget_after_s: everything still holds
    now[0] += 60
    st.view()
    assert st.index.match(KEYS)[A].depth == len(KEYS) and st.sessions["t/s"].replica == A
    await st.subscriber.handle(msg("kv@a", 1, [1]))  # its stream simply goes on
    assert not st.index.state(A).stale and st.subscriber.stats.ignored_removed == 0

    rs.set_source("k8s", [B])  # gone for good
    now[0] += 29
    st.view()
    assert A in st.index.replicas()
    now[0] += 1
    st.view()  # forget_after_s has passed: forgotten at the next look
    assert A not in st.index.replicas() and st.sessions["t/s"].replica is None
    await st.subscriber.handle(msg("kv@a", 2, [2]))
    assert st.subscriber.stats.ignored_removed == 1


async def test_a_replica_back_after_its_grace_starts_over_even_if_nobody_looked(started):
    """An idle router (no view(), no sweep) must still forget a replica that was away longer
    than forget_after_s when it comes back: its old blocks and session homes are stale."""
    now = [1000.0]
    cfg = KVConfig(block_size=BS, events_bind="inproc://kv-disc-grace", topics=TOPICS)
    st = await started(cfg, clock=lambda: now[0])
    rs = ReplicaSet()
    rs.set_source("k8s", [A, B])
    st.watch(rs)
    await st.subscriber.handle(msg("kv@a", 0, KEYS))
    st.sessions["t/s"] = SessionFootprint("t/s", replica=A, tokens=len(KEYS) * BS)
    rs.set_source("k8s", [B])
    now[0] += 120  # four times the grace, and nothing looked in between
    rs.set_source("k8s", [A, B])
    assert A not in st.index.replicas() and st.sessions["t/s"].replica is None


async def test_removal_forgets_replica_everywhere_and_readd_accepts_events(kv):
    rs = ReplicaSet()
    rs.set_source("static", [A, B])
    kv.watch(rs)
    sub = kv.subscriber
    await sub.handle(msg("kv@a", 0, KEYS))
    await sub.handle(msg("kv@b", 0, KEYS[:8]))
    kv.profile(A)
    kv.approx.record(A, KEYS)
    kv.text_approx.record(A, [11, 12, 13])
    kv.routed["in-flight"] = (A, list(KEYS), 0.0)
    kv.sessions["t/s"] = SessionFootprint("t/s", replica=A, tokens=len(KEYS) * BS)
    kv.sessions["t/o"] = SessionFootprint("t/o", replica=B, tokens=8 * BS)
    view = kv.view()
    assert view.match(KEYS, [A, B])[A].depth == len(KEYS)
    assert view.warm_and_reserved(A, None)[0]

    rs.set_source("static", [B])  # discovery drops A

    assert A not in kv.index.replicas() and A not in kv.index.match(KEYS)
    assert A not in kv.approx.match(KEYS) and kv.approx.capacity(A) == 0
    assert A not in kv.text_approx.match([11, 12, 13]) and "in-flight" not in kv.routed
    view = kv.view()
    assert set(view.match(KEYS, [A, B])) == {B}  # even if A were still offered
    assert view.warm_and_reserved(A, None) == ([], [])
    assert kv.sessions["t/s"].replica is None and kv.sessions["t/o"].replica == B
    scores = KVCost().score(ctx_for(), Snapshot((ep(B),), None, 0, {"kv": view}), [ep(B)])
    assert set(scores) == {B}
    # A's events are ignored while it is gone
    await sub.handle(msg("kv@a", 1, [1, 2]))
    assert sub.stats.ignored_removed == 1 and A not in kv.index.replicas()
    # a call that ends on A after its removal does not make A a home again
    c = ctx_for()
    kv.observe(c, CallOutcome(A, "200", ttft_s=0.1, duration_s=1.0))
    assert kv.sessions["t/s"].replica is None and A not in kv.approx.match(KEYS)

    rs.set_source("static", [A, B])  # A is back (say, a new pod at the same address)
    assert A not in kv.index.replicas() and kv.view().source(A) == "approx"  # until events
    await sub.handle(msg("kv@a", 0, [7, 8]))  # its publisher starts from seq 0 again
    assert kv.index.holds(A, 8) == ("GPU",) and not kv.index.state(A).stale
    await sub.handle(msg("kv@a", 1, [9]))
    assert kv.index.match([7, 8, 9])[A].depth == 3
    assert set(kv.view().match([7, 8, 9], [A, B])) == {A}
    kv.observe(ctx_for(), CallOutcome(A, "200"))
    assert kv.sessions["t/s"].replica == A  # routing history counts again


async def test_readded_replica_uses_its_configured_replay_endpoint():
    cfg = KVConfig(block_size=BS, events_bind="inproc://kv-disc-2", topics=TOPICS,
                   replay={A: "inproc://replay-a"}, forget_after_s=0)  # fmt: skip
    st = KVState(cfg, profile=PROF)
    await st.start()
    router = st.subscriber.ctx.socket(zmq.ROUTER)  # inproc: the subscriber's own context
    router.setsockopt(zmq.LINGER, 0)
    router.bind("inproc://replay-a")
    asked: list[int] = []

    async def serve():  # has nothing buffered: answers with the end marker only
        while True:
            cid, _, start = await router.recv_multipart()
            asked.append(int.from_bytes(start, "big"))
            await router.send_multipart([cid, b"", b"", END_SEQ, b""])

    task = asyncio.get_running_loop().create_task(serve())
    rs = ReplicaSet()
    rs.set_source("static", [A])
    st.watch(rs)
    rs.set_source("static", [])
    rs.set_source("static", [A])
    await st.subscriber.handle(msg("kv@a", 5, [1]))  # missed 0..4 while it was away
    async with asyncio.timeout(5):
        while st.subscriber.resyncing(A):
            await st.subscriber.wait_changed()  # set once the replay has been handled
    assert asked == [0]
    assert st.index.holds(A, 1) and st.index.state(A).stale  # replay came back short
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    router.close(0)
    await st.close()


async def test_build_app_installs_the_kv_layer_and_follows_its_replica_set():
    from router.app import build_app
    from router.config import RouterConfig
    from router.keys import KV, REPLICAS

    st = KVState(KVConfig(block_size=BS, events_bind="inproc://kv-disc-3", topics=TOPICS,
                          forget_after_s=0), profile=PROF)  # fmt: skip
    app = build_app(RouterConfig(replicas=[A, B]), kv=st)
    assert app[KV] is st
    app[REPLICAS].set_source("static", [A, B])  # what the replicas context does first
    life = app.cleanup_ctx[-1](app)  # the KV layer's context runs after the replica set's
    await life.__anext__()
    await st.subscriber.handle(msg("kv@a", 0, [1]))
    app[REPLICAS].set_source("static", [B])
    assert A not in st.index.replicas()
    await st.subscriber.handle(msg("kv@a", 1, [2]))
    assert st.subscriber.stats.ignored_removed == 1
    with pytest.raises(StopAsyncIteration):
        await life.__anext__()
    assert st.subscriber is None and app[REPLICAS]._listeners == []
