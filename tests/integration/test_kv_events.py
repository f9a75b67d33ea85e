"""KV event ingestion over real ZMQ sockets on loopback: both directions, gaps, replay,
restarts, AllBlocksCleared, bad messages, replica removal.

The publisher here speaks vLLM's wire format (router.vllm.kvevents.encode_message) and its replay
protocol as vLLM 0.32.0's ``ZmqEventPublisher._service_replay`` implements it (ROUTER socket:
request ``[id, b"", start_seq]``, replies ``[id, b"", topic, seq, payload]`` then
``[id, b"", b"", -1, b""]``).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import zmq
import zmq.asyncio

from router.kv.events import END_SEQ, KVEventSubscriber
from router.kv.index import BlockIndex, TierDepth
from router.vllm.kvevents import (
    encode_all_cleared,
    encode_block_removed,
    encode_block_stored,
    encode_message,
)

pytestmark = pytest.mark.timeout(120)


class Publisher:
    """A vLLM-like publisher: PUB (bind or connect) + optional ROUTER replay buffer."""

    def __init__(
        self, ctx: zmq.asyncio.Context, topic: str, *, replay: bool = False, keep: int = 10_000
    ):
        self.ctx, self.topic, self.seq = ctx, topic, 0
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.buffer: list[tuple[int, list[bytes]]] = []
        self.keep = keep
        self.router = None
        self.replay_endpoint = None
        self.task = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            port = self.router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{port}"
            self.task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self):
        while True:
            cid, _, start_b = await self.router.recv_multipart()
            start = int.from_bytes(start_b, "big")
            for seq, frames in self.buffer[-self.keep :]:
                if seq >= start:
                    await self.router.send_multipart([cid, b"", *frames])
            await self.router.send_multipart([cid, b"", b"", END_SEQ, b""])

    async def send(self, *events, drop: bool = False):
        frames = encode_message(self.topic, self.seq, 0.0, list(events))
        self.buffer.append((self.seq, frames))
        self.seq += 1
        if not drop:
            await self.pub.send_multipart(frames)

    async def close(self):
        if self.task:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.router.close(0)
        self.pub.close(0)


def stored(keys, medium="GPU"):
    return encode_block_stored(keys, None, [], 32, medium=medium)


async def until(pred, sub: KVEventSubscriber, limit_s: float = 5.0):
    async with asyncio.timeout(limit_s):
        while not pred():
            await sub.wait_changed()


async def connected(pub: Publisher, sub: KVEventSubscriber, replica: str = ""):
    """PUB/SUB joins asynchronously: send probes (on a throwaway topic) until one arrives."""
    async with asyncio.timeout(60):  # loaded CI: stalls of up to 30 s seen (docs/engine.md)
        while sub.stats.unknown_topics == 0:
            await pub.pub.send_multipart(encode_message("probe", 0, 0.0, []))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05):
                    await sub.wait_changed()


@pytest.fixture
async def zctx():
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


def probe_unknown(topic: str) -> str | None:
    return None if topic == "probe" else topic.removeprefix("kv@")


async def test_bind_mode_many_replicas_one_socket_and_tiers(zctx):
    ix = BlockIndex()
    sub = KVEventSubscriber(ix, replica_for_topic=probe_unknown, ctx=zctx)
    ep = sub.bind("tcp://127.0.0.1:0")
    pa, pb = Publisher(zctx, "kv@a"), Publisher(zctx, "kv@b")
    pa.pub.connect(ep)
    pb.pub.connect(ep)
    await connected(pa, sub, "a")
    sub.stats.unknown_topics = 0
    await connected(pb, sub, "b")
    await pa.send(stored([1, 2, 3]))
    await pb.send(stored([1, 2]), stored([3], "CPU"))
    await until(lambda: len(ix.match([1, 2, 3])) == 2, sub)
    assert ix.match([1, 2, 3]) == {"a": TierDepth(3, gpu=3), "b": TierDepth(3, gpu=2, cpu=1)}
    await pa.send(encode_block_removed([2]))
    await until(lambda: ix.match([1, 2, 3])["a"].depth == 1, sub)
    assert not ix.state("a").stale and not ix.state("b").stale
    await pa.close(), await pb.close(), await sub.close()


async def test_connect_mode_gap_is_replayed_and_index_is_exact(zctx):
    ix = BlockIndex()
    sub = KVEventSubscriber(ix, replica_for_topic=probe_unknown, ctx=zctx)
    pub = Publisher(zctx, "kv@r", replay=True)
    port = pub.pub.bind_to_random_port("tcp://127.0.0.1")
    sub.connect(f"tcp://127.0.0.1:{port}", "r", replay_endpoint=pub.replay_endpoint)
    await connected(pub, sub, "r")
    await pub.send(stored([10, 11]))
    await pub.send(stored([12]), drop=True)  # lost on the wire
    await pub.send(encode_block_removed([10]), drop=True)  # lost too
    await pub.send(stored([13]))
    await until(lambda: ix.holds("r", 13), sub)
    s = sub.stats.streams[("r", 0)]
    assert (s.gaps, s.replayed, s.last_seq) == (1, 2, 3)
    assert not ix.state("r").stale
    assert ix.snapshot()["r"]["GPU"] == {11, 12, 13}
    await pub.close(), await sub.close()


async def test_gap_without_replay_marks_stale_until_all_blocks_cleared(zctx):
    ix = BlockIndex()
    sub = KVEventSubscriber(ix, replica_for_topic=probe_unknown, ctx=zctx)
    ep = sub.bind("tcp://127.0.0.1:0")
    pub = Publisher(zctx, "kv@r")
    pub.pub.connect(ep)
    await connected(pub, sub, "r")
    await pub.send(stored([1]))
    await pub.send(stored([2]), drop=True)
    await pub.send(stored([3]))
    await until(lambda: ix.holds("r", 3), sub)
    assert ix.state("r").stale and "gap" in ix.state("r").stale_reason
    assert ix.view().is_stale("r")
    await pub.send(encode_all_cleared(), stored([7]))
    await until(lambda: ix.holds("r", 7), sub)
    assert not ix.state("r").stale
    assert ix.snapshot()["r"]["GPU"] == {7}
    await pub.close(), await sub.close()


async def test_restart_clears_replica_and_bad_messages_do_not_stop_ingestion(zctx):
    ix = BlockIndex()
    sub = KVEventSubscriber(ix, replica_for_topic=probe_unknown, ctx=zctx)
    ep = sub.bind("tcp://127.0.0.1:0")
    pub = Publisher(zctx, "kv@r")
    pub.pub.connect(ep)
    await connected(pub, sub, "r")
    await pub.send(stored([1, 2]))
    await pub.send(stored([3]))
    await until(lambda: ix.holds("r", 3), sub)
    await pub.pub.send_multipart([b"kv@r", b"short", b"x"])  # bad seq frame
    await pub.pub.send_multipart([b"kv@r", (9).to_bytes(8, "big"), b"\xc1not msgpack"])
    await pub.pub.send_multipart([b"kv@r"])  # wrong frame count
    await until(lambda: sub.stats.decode_errors == 3, sub)
    pub.seq = 0  # the engine restarted: a new publisher counts from 0 again
    await pub.send(stored([5]))
    await until(lambda: ix.holds("r", 5), sub)
    assert ix.snapshot()["r"]["GPU"] == {5}
    assert sub.stats.streams[("r", 0)].restarts == 1 and not ix.state("r").stale
    await pub.close(), await sub.close()


async def test_removed_replica_is_forgotten_and_ignored(zctx):
    ix = BlockIndex()
    sub = KVEventSubscriber(ix, replica_for_topic=probe_unknown, ctx=zctx)
    ep = sub.bind("tcp://127.0.0.1:0")
    pub = Publisher(zctx, "kv@r")
    pub.pub.connect(ep)
    await connected(pub, sub, "r")
    await pub.send(stored([1]))
    await until(lambda: ix.holds("r", 1), sub)
    sub.remove_replica("r")
    assert ix.match([1]) == {} and "r" not in ix.replicas()
    await pub.send(stored([2]))
    await until(lambda: sub.stats.ignored_removed == 1, sub)
    assert ix.match([2]) == {}
    await pub.close(), await sub.close()
