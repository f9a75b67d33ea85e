"""Gap recovery is per publisher stream and never stalls the others (KVEventSubscriber).

Everything runs in-process: messages go to ``handle()`` directly or over ``inproc://`` ZMQ
sockets, and replay endpoints are in-process ROUTER sockets that never answer, or answer
only when the test lets them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time

import pytest
import zmq
import zmq.asyncio

from router.kv.events import END_SEQ, KVEventSubscriber
from router.kv.index import BlockIndex
from router.vllm.kvevents import encode_block_removed, encode_block_stored, encode_message

pytestmark = pytest.mark.timeout(20)

_ids = itertools.count()


def msg(replica: str, seq: int, *events) -> list[bytes]:
    return encode_message(f"kv@{replica}", seq, 0.0, list(events))


def stored(*keys):
    return encode_block_stored(list(keys), None, [], 16)


def removed(*keys):
    return encode_block_removed(list(keys))


@pytest.fixture
async def zctx():
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


class ReplayServer:
    """vLLM's replay ROUTER, in-process: answers each request from ``buffer`` once ``release``
    is set (never, unless the test sets it); records the start seqs asked for."""

    def __init__(self, ctx: zmq.asyncio.Context, buffer: dict[int, list[bytes]] | None = None):
        self.endpoint = f"inproc://replay-{next(_ids)}"
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.endpoint)
        self.buffer = buffer or {}
        self.release = asyncio.Event()
        self.asked: list[int] = []
        self.task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self):
        while True:
            cid, _, start_b = await self.sock.recv_multipart()
            start = int.from_bytes(start_b, "big")
            self.asked.append(start)
            await self.release.wait()
            for seq in sorted(self.buffer):
                if seq >= start:
                    await self.sock.send_multipart([cid, b"", *self.buffer[seq]])
            await self.sock.send_multipart([cid, b"", b"", END_SEQ, b""])

    async def close(self):
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.sock.close(0)


class SocketLog:
    """Stands in for the subscriber's context and remembers every socket it made."""

    def __init__(self, ctx: zmq.asyncio.Context):
        self.ctx = ctx
        self.made: list[zmq.asyncio.Socket] = []

    def socket(self, kind: int) -> zmq.asyncio.Socket:
        s = self.ctx.socket(kind)
        self.made.append(s)
        return s

    def replay_sockets(self) -> list[zmq.asyncio.Socket]:
        return [s for s in self.made if s.type == zmq.DEALER]


async def until(pred, sub: KVEventSubscriber, limit_s: float = 5.0):
    async with asyncio.timeout(limit_s):
        while not pred():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05):
                    await sub.wait_changed()


async def test_dead_replay_of_one_replica_does_not_stall_another(zctx):
    """A's replay endpoint never answers (2 s timeout): B's batches are applied at once, A's
    later batches wait and are applied in order after the replay has failed. Whether a step
    waited for the replay is read from the replay still pending after it, not from the clock
    (2 s: room for a loaded machine to run the steps before the replay fails)."""
    ix = BlockIndex()
    timeout_s = 2.0
    sub = KVEventSubscriber(ix, replay_timeout_s=timeout_s, ctx=zctx)
    silent = zctx.socket(zmq.ROUTER)  # swallows every request
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("inproc://replay-silent")
    sub.add_replica("a", "inproc://replay-silent")

    await sub.handle(msg("a", 0, stored(1)))
    t0 = time.monotonic()
    await sub.handle(msg("a", 2, stored(3)))  # seq 1 lost: gap, replay asked for
    # handle() did not wait for the replay: it is still pending
    assert ix.state("a").stale and sub.resyncing("a"), "handle() waited for the replay"
    # A's later batches are held back, in order: store 5 then remove it
    await sub.handle(msg("a", 3, stored(5)))
    await sub.handle(msg("a", 4, removed(5), stored(6)))
    assert not ix.holds("a", 3) and not ix.holds("a", 6)

    # B, same subscriber (same socket in bind mode), is applied while A's replay is pending
    await sub.handle(msg("b", 0, stored(10, 11)))
    await sub.handle(msg("b", 1, stored(12)))
    assert ix.holds("b", 10) and ix.holds("b", 12)
    assert sub.resyncing("a"), "A's replay should still be pending"
    assert not ix.state("b").stale

    await until(lambda: not sub.resyncing("a"), sub)
    assert time.monotonic() - t0 >= timeout_s * 0.9
    # the replay failed: A's batches applied in arrival order, A still stale
    assert ix.snapshot()["a"]["GPU"] == {1, 3, 6}
    assert ix.state("a").stale
    st = sub.stats.streams[("a", 0)]
    assert (st.last_seq, st.gaps, st.replayed, st.buffered) == (4, 1, 0, 2)
    # and A's stream goes on normally afterwards
    await sub.handle(msg("a", 5, stored(7)))
    assert ix.holds("a", 7) and st.last_seq == 5
    await sub.close()
    silent.close(0)


async def test_late_replay_fills_the_gap_then_buffered_batches_follow_in_order(zctx):
    ix = BlockIndex()
    sub = KVEventSubscriber(ix, replay_timeout_s=5.0, ctx=zctx)
    rep = ReplayServer(zctx, {1: msg("a", 1, stored(2)), 2: msg("a", 2, removed(1))})
    sub.add_replica("a", rep.endpoint)
    await sub.handle(msg("a", 0, stored(1)))
    await sub.handle(msg("a", 3, stored(4)))  # 1 and 2 lost
    await sub.handle(msg("a", 4, removed(2), stored(5)))
    await sub.handle(msg("b", 0, stored(9)))
    await until(lambda: rep.asked == [1], sub)
    assert ix.holds("b", 9) and sub.resyncing("a") and not ix.holds("a", 4)

    rep.release.set()
    await until(lambda: not sub.resyncing("a"), sub)
    assert ix.snapshot()["a"]["GPU"] == {4, 5}  # 1 removed by the replay, 2 after it
    assert not ix.state("a").stale
    st = sub.stats.streams[("a", 0)]
    assert (st.last_seq, st.replayed, st.buffered) == (4, 2, 1)
    await sub.close()
    await rep.close()


async def test_buffer_overflow_abandons_the_replay_and_keeps_order(zctx):
    ix = BlockIndex()
    sub = KVEventSubscriber(ix, replay_timeout_s=30.0, max_buffered_batches=2, ctx=zctx)
    socks = sub.ctx = SocketLog(zctx)  # type: ignore[assignment]
    rep = ReplayServer(zctx, {1: msg("a", 1, stored(99))})  # not released until the end
    sub.add_replica("a", rep.endpoint)
    await sub.handle(msg("a", 0, stored(1)))
    await sub.handle(msg("a", 2, stored(2)))  # gap
    await until(lambda: rep.asked == [1], sub)
    (task,) = sub._replays
    await sub.handle(msg("a", 3, stored(3)))
    await sub.handle(msg("a", 4, removed(3)))
    assert sub.resyncing("a")
    await sub.handle(msg("a", 5, stored(5)))  # one more than the buffer holds: give up
    assert not sub.resyncing("a")
    assert ix.snapshot()["a"]["GPU"] == {1, 2, 5}
    assert ix.state("a").stale  # nothing was replayed
    st = sub.stats.streams[("a", 0)]
    assert (st.last_seq, st.abandoned, st.replayed) == (5, 1, 0)
    (dealer,) = socks.replay_sockets()
    await asyncio.wait({task}, timeout=5)
    assert task.cancelled() and dealer.closed  # the abandoned replay was cancelled
    rep.release.set()  # its answer now finds nobody: nothing of it is applied
    await asyncio.sleep(0.1)
    assert not ix.holds("a", 99) and ix.snapshot()["a"]["GPU"] == {1, 2, 5}
    await sub.close()
    await rep.close()


async def test_close_and_removal_cancel_replays_in_flight(zctx):
    ix = BlockIndex()
    sub = KVEventSubscriber(ix, replay_timeout_s=30.0, ctx=zctx)
    socks = sub.ctx = SocketLog(zctx)  # type: ignore[assignment]
    # each would answer with a batch that fills the gap, once released
    ra = ReplayServer(zctx, {s: msg("a", s, stored(50 + s)) for s in range(3)})
    rb = ReplayServer(zctx, {s: msg("b", s, stored(60 + s)) for s in range(3)})
    sub.add_replica("a", ra.endpoint)
    sub.add_replica("b", rb.endpoint)
    await sub.handle(msg("a", 3, stored(1)))  # first message not seq 0: gap
    await sub.handle(msg("b", 3, stored(1)))
    await until(lambda: ra.asked == [0] and rb.asked == [0], sub)
    task_a, task_b = sorted(sub._replays, key=lambda t: t.get_name())
    dealer_a, dealer_b = socks.replay_sockets()  # a's gap came first
    sub.remove_replica("a")
    await asyncio.sleep(0)
    assert task_a.cancelled() and dealer_a.closed and not dealer_b.closed
    assert not sub.resyncing("a") and "a" not in ix.replicas()
    await sub.handle(msg("a", 4, stored(2)))  # ignored: removed
    assert sub.stats.ignored_removed == 1
    sub.expect_replica("a")  # back, and its old replay now answers: too late to count
    ra.release.set()
    await asyncio.sleep(0.1)
    assert "a" not in ix.replicas() and ra.asked == [0]
    t0 = time.monotonic()
    await sub.close()
    # cancelled, not waited for (its 30 s timeout; the bound has room for a loaded machine)
    assert time.monotonic() - t0 < 10.0 and task_b.cancelled() and dealer_b.closed
    rb.release.set()  # b's answer after close() applies nothing either
    await asyncio.sleep(0.1)
    assert not ix.snapshot()["b"]["GPU"]  # neither the replay nor the batch held for it
    await ra.close(), await rb.close()


async def test_bound_socket_keeps_ingesting_while_one_replica_replays(zctx):
    """The same over one bound SUB socket: two publishers connect, A's replay hangs."""
    ix = BlockIndex()
    sub = KVEventSubscriber(
        ix, replay_timeout_s=30.0, ctx=zctx, replica_for_topic=lambda t: t.removeprefix("kv@")
    )
    ep = sub.bind(f"inproc://kv-events-{next(_ids)}")
    rep = ReplayServer(zctx, {1: msg("a", 1, stored(2))})
    sub.add_replica("a", rep.endpoint)
    pubs = {}
    for name in ("a", "b"):
        p = zctx.socket(zmq.PUB)
        p.setsockopt(zmq.LINGER, 0)
        p.connect(ep)
        pubs[name] = p
    # PUB/SUB joins asynchronously: probe until both publishers are heard
    async with asyncio.timeout(5):
        for name, p in pubs.items():
            while f"probe-{name}" not in ix.replicas():
                await p.send_multipart(msg(f"probe-{name}", 0))
                await asyncio.sleep(0.01)
    await pubs["a"].send_multipart(msg("a", 0, stored(1)))
    await pubs["a"].send_multipart(msg("a", 2, stored(3)))  # gap: replay hangs
    await pubs["a"].send_multipart(msg("a", 3, stored(4)))
    for seq in range(5):
        await pubs["b"].send_multipart(msg("b", seq, stored(100 + seq)))
    await until(lambda: ix.holds("b", 104), sub)
    assert sub.resyncing("a") and not ix.holds("a", 4)
    rep.release.set()
    await until(lambda: ix.holds("a", 4), sub)
    assert ix.snapshot()["a"]["GPU"] == {1, 2, 3, 4} and not ix.state("a").stale
    await sub.close()
    await rep.close()
    for p in pubs.values():
        p.close(0)
