"""KV event ingestion: asyncio ZMQ subscribers that keep the block index in step with replicas.

Owns: the SUB sockets (both directions — *connect* to replicas whose publisher binds, e.g.
``tcp://*:5557``; *bind* one socket for replicas whose publisher connects, e.g.
``tcp://router:5557``, told apart by topic), per-publisher ``seq`` tracking, and what happens
when the stream is not clean:

* **gap** (``seq`` jumps, or the first message seen is not ``seq`` 0): mark the replica stale in
  the index and ask its replay endpoint (vLLM ``ZmqEventPublisher`` ROUTER socket: send
  ``[b"", start_seq(8B BE)]``, receive ``[b"", topic, seq, payload]`` per buffered batch, then
  ``[b"", b"", -1(8B signed), b""]``). If every missing batch comes back, apply them in order
  and mark the replica fresh. If not (no replay endpoint, timeout, or the buffer no longer
  reaches back), the replica stays stale — scorers then use approximate mode for it — until
  an ``AllBlocksCleared`` or a restart gives a known-empty cache to start from again.
* the replay runs in its own task, per publisher stream: meanwhile that stream's later
  batches are buffered (at most ``max_buffered_batches``) and applied in order once the
  replay is over; every other stream, on the same socket or not, keeps being applied at once.
  A buffer that overflows abandons the replay: the batches held so far are applied and the
  replica stays stale, as after a failed replay.
* **restart** (``seq`` goes back to 0): the replica's cache is empty; clear it in the index.
* ``AllBlocksCleared``: clear the replica (done by :meth:`BlockIndex.apply`), mark fresh.
* bad messages are counted and logged, never raised; one broken replica never stops the others.

Must not import aiohttp, torch or vllm; talks to the index only through its mutators.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from router.kv.index import BlockIndex
from router.vllm.kvevents import AllBlocksCleared, EventBatch, EventDecodeError, decode_message

log = logging.getLogger(__name__)

MAX_REMOVED = 1024  # removed replicas remembered (their late events are ignored)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def topic_to_replica(topic: str) -> str:
    """Default mapping: ``kv@NAME`` -> ``NAME`` (the bed's convention), else the topic."""
    return topic[3:] if topic.startswith("kv@") else topic


@dataclass
class PublisherState:
    """Per (replica, dp_rank) stream bookkeeping."""

    last_seq: int | None = None
    batches: int = 0
    gaps: int = 0
    replayed: int = 0
    restarts: int = 0
    buffered: int = 0  # batches held back while a replay was in flight
    abandoned: int = 0  # replays given up because the buffer overflowed
    last_lag_s: float | None = None  # apply time minus publish time (ts) of the newest batch


@dataclass
class SubscriberStats:
    decode_errors: int = 0
    unknown_topics: int = 0
    ignored_removed: int = 0
    streams: dict[tuple[str, int | None], PublisherState] = field(default_factory=dict)


StreamKey = tuple[str, int | None]


@dataclass
class _Resync:
    """A stream waiting for its replay: the batch that showed the gap and those after it."""

    start: int
    trigger: EventBatch
    pending: deque[EventBatch] = field(default_factory=deque)
    task: asyncio.Task[None] | None = None


class KVEventSubscriber:
    """Feeds a :class:`BlockIndex` from vLLM KV event streams.

    Start sockets with :meth:`bind` / :meth:`connect` inside a running event loop; each
    socket gets one reader task. :meth:`close` cancels the tasks (replays in flight included)
    and closes the sockets. ``replica_for_topic`` maps a topic to a replica name in bind mode
    (``None`` drops the message as unknown).
    """

    def __init__(
        self,
        index: BlockIndex,
        *,
        replica_for_topic: Callable[[str], str | None] = topic_to_replica,
        replay_timeout_s: float = 2.0,
        max_buffered_batches: int = 4096,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self.index = index
        self.replica_for_topic = replica_for_topic
        self.replay_timeout_s = replay_timeout_s
        self.max_buffered_batches = max_buffered_batches
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.asyncio.Context()
        self._tasks: list[asyncio.Task[None]] = []
        self._socks: list[zmq.asyncio.Socket] = []
        # replica -> the (socket, reader task) pairs connect() opened for it
        self._conns: dict[str, list[tuple[zmq.asyncio.Socket, asyncio.Task[None]]]] = {}
        self._replay: dict[str, str] = {}  # replica -> replay endpoint
        self._removed: dict[str, None] = {}  # removed and not back (insertion order, capped)
        self._resync: dict[StreamKey, _Resync] = {}  # streams whose replay is in flight
        self._replays: set[asyncio.Task[None]] = set()  # until done (cancelled ones too)
        self._changed = asyncio.Event()
        self.stats = SubscriberStats()

    # ---- sockets --------------------------------------------------------------------------

    def _sub(self) -> zmq.asyncio.Socket:
        s = self.ctx.socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 100_000)
        self._socks.append(s)
        return s

    def bind(self, endpoint: str = "tcp://127.0.0.1:0") -> str:
        """Bind one SUB socket for publishers that connect; returns the bound endpoint
        (port 0 picks a free port)."""
        s = self._sub()
        if endpoint.endswith(":0"):
            port = s.bind_to_random_port(endpoint[: endpoint.rfind(":")])
            endpoint = f"{endpoint[: endpoint.rfind(':')]}:{port}"
        else:
            s.bind(endpoint)
        self._tasks.append(asyncio.get_running_loop().create_task(self._read(s, None)))
        return endpoint

    def connect(
        self,
        endpoint: str,
        replica: str,
        replay_endpoint: str | None = None,
        *,
        fresh: bool = True,
    ) -> None:
        """Subscribe to one replica whose publisher binds ``endpoint``. ``fresh`` gives it an
        empty index entry at once (:meth:`add_replica`); else it is only expected
        (:meth:`expect_replica`: approximate mode until its first batch, so a replica whose
        publisher never answers does not look empty). :meth:`disconnect` undoes it."""
        s = self._sub()
        if ":[" in endpoint or endpoint.count(":") > 2:  # an IPv6 address
            s.setsockopt(zmq.IPV6, 1)
        s.connect(endpoint)
        if fresh:
            self.add_replica(replica, replay_endpoint)
        else:
            self.expect_replica(replica, replay_endpoint)
        task = asyncio.get_running_loop().create_task(self._read(s, replica))
        self._tasks.append(task)
        self._conns.setdefault(replica, []).append((s, task))

    def disconnect(self, replica: str) -> None:
        """Close the sockets :meth:`connect` opened for ``replica`` (a replica discovery
        dropped: its address may be another pod's tomorrow)."""
        for s, task in self._conns.pop(replica, []):
            task.cancel()
            with contextlib.suppress(ValueError):
                self._tasks.remove(task)
            with contextlib.suppress(ValueError):
                self._socks.remove(s)
            s.close(0)

    def add_replica(self, replica: str, replay_endpoint: str | None = None) -> None:
        """:meth:`expect_replica`, and give ``replica`` a (fresh, empty) index entry now,
        before any of its events (what :meth:`connect` does for its replica)."""
        self.expect_replica(replica, replay_endpoint)
        self.index.add_replica(replica)

    def expect_replica(self, replica: str, replay_endpoint: str | None = None) -> None:
        """Accept events from ``replica`` (again, after :meth:`remove_replica`); optional
        replay endpoint. No index entry is made: until its first batch arrives the replica is
        absent from the index (scorers use approximate mode for it). That first batch starts
        from no stream state (``seq`` 0: exact from there; else a gap, replayed from 0)."""
        self._removed.pop(replica, None)
        if replay_endpoint:
            self._replay[replica] = replay_endpoint

    def remove_replica(self, replica: str) -> None:
        """Forget a replica: its blocks leave the index, its replays in flight are cancelled;
        its events are ignored until :meth:`expect_replica` / :meth:`add_replica` (the last
        ``MAX_REMOVED`` removed replicas are remembered; an older one's events would make a
        new index entry from a first batch, stale unless it is ``seq`` 0)."""
        self._removed.pop(replica, None)  # to the end: the newest removal is kept longest
        self._removed[replica] = None
        while len(self._removed) > MAX_REMOVED:
            del self._removed[next(iter(self._removed))]
        self._replay.pop(replica, None)
        for key in [k for k in self._resync if k[0] == replica]:
            rs = self._resync.pop(key)
            if rs.task is not None:
                rs.task.cancel()
        for key in [k for k in self.stats.streams if k[0] == replica]:
            del self.stats.streams[key]
        self.index.remove_replica(replica)

    def resyncing(self, replica: str) -> bool:
        """Whether a replay for one of ``replica``'s streams is in flight."""
        return any(k[0] == replica for k in self._resync)

    async def close(self) -> None:
        replays = list(self._replays)
        self._resync.clear()
        for t in [*self._tasks, *replays]:
            t.cancel()
        for t in [*self._tasks, *replays]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for s in self._socks:
            s.close(0)
        self._tasks.clear()
        self._socks.clear()
        self._conns.clear()
        if self._own_ctx:
            self.ctx.term()

    async def wait_changed(self) -> None:
        """Wait until the next batch (or replay) has been handled (tests, admin)."""
        self._changed.clear()
        await self._changed.wait()

    # ---- the stream -------------------------------------------------------------------------

    async def _read(self, sock: zmq.asyncio.Socket, replica: str | None) -> None:
        while True:
            parts = await sock.recv_multipart()
            try:
                await self.handle(parts, replica)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad message kill ingestion
                log.exception("kv events: failed to handle a message")
            self._changed.set()

    async def handle(self, parts: list[bytes], replica: str | None = None) -> None:
        """Decode one multipart message and apply it (public for tests and tools).

        Never waits on a replay: a gap starts one in the background (see the module
        docstring) and this stream's later batches are held until it is over."""
        try:
            batch = decode_message(parts)
        except EventDecodeError as e:
            self.stats.decode_errors += 1
            log.warning("kv events: undecodable message: %s", e)
            return
        mapped = self.replica_for_topic(batch.topic)
        if mapped is None:  # a topic nobody asked for (connect mode: the socket names it)
            self.stats.unknown_topics += 1
            return
        name = replica or mapped
        if name in self._removed:
            self.stats.ignored_removed += 1
            return
        self._ingest(name, batch)

    def _ingest(self, name: str, batch: EventBatch) -> None:
        key = (name, batch.dp_rank)
        while (rs := self._resync.get(key)) is not None:
            st = self.stats.streams.setdefault(key, PublisherState())
            if len(rs.pending) < self.max_buffered_batches:
                rs.pending.append(batch)
                st.buffered += 1
                return
            # Too far behind: give the replay up (the held batches may start a new one).
            log.warning("kv events: %s fell %d batches behind its replay", name, len(rs.pending))
            st.abandoned += 1
            self._finish(name, key, rs, None)
        self._process(name, key, batch)

    def _process(self, name: str, key: StreamKey, batch: EventBatch) -> None:
        st = self.stats.streams.setdefault(key, PublisherState())
        if st.last_seq is not None and batch.seq <= st.last_seq:
            # seq went back: the publisher restarted, so its cache starts empty.
            st.restarts += 1
            log.info("kv events: %s restarted (seq %d after %d)", name, batch.seq, st.last_seq)
            self.index.clear(name)
            self.index.mark_fresh(name)
            st.last_seq = None
            if batch.seq != 0:
                self._gap(name, key, st, 0, batch)
                return
        elif (st.last_seq is None and batch.seq != 0) or (
            st.last_seq is not None and batch.seq != st.last_seq + 1
        ):
            start = 0 if st.last_seq is None else st.last_seq + 1
            self._gap(name, key, st, start, batch)
            return
        self._apply(name, st, batch)

    def _apply(self, name: str, st: PublisherState, batch: EventBatch) -> None:
        self.index.apply(name, batch.events)
        st.last_seq = batch.seq
        st.batches += 1
        st.last_lag_s = max(0.0, time.time() - batch.ts)
        if any(isinstance(e, AllBlocksCleared) for e in batch.events):
            self.index.mark_fresh(name)  # a known-empty cache: whatever we missed is gone

    def _gap(
        self, name: str, key: StreamKey, st: PublisherState, start: int, batch: EventBatch
    ) -> None:
        st.gaps += 1
        self.index.mark_stale(name, f"seq gap: expected {start}, got {batch.seq}")
        log.warning("kv events: %s seq gap %d..%d", name, start, batch.seq - 1)
        if name not in self._replay:  # nothing to wait for: stale from here on
            self._apply(name, st, batch)
            return
        rs = _Resync(start, batch)
        self._resync[key] = rs
        rs.task = asyncio.get_running_loop().create_task(
            self._run_replay(name, key, rs), name=f"kv-replay-{name}"
        )
        self._replays.add(rs.task)
        rs.task.add_done_callback(self._replays.discard)

    async def _run_replay(self, name: str, key: StreamKey, rs: _Resync) -> None:
        try:
            missed = await self._fetch_replay(name, rs.start, rs.trigger.seq)
        except Exception:
            log.exception("kv events: replay for %s failed", name)
            missed = None
        if self._resync.get(key) is not rs:  # removed or abandoned meanwhile
            return
        try:
            self._finish(name, key, rs, missed)
        except Exception:
            log.exception("kv events: failed to apply the replay for %s", name)
        self._changed.set()

    def _finish(
        self, name: str, key: StreamKey, rs: _Resync, missed: list[EventBatch] | None
    ) -> None:
        """End a stream's resync: apply what the replay returned (``None``: nothing, the
        replica stays stale), the batch that showed the gap, then the held batches in order
        (which may start another resync)."""
        del self._resync[key]
        if rs.task is not None and not rs.task.done() and rs.task is not asyncio.current_task():
            rs.task.cancel()
        st = self.stats.streams.setdefault(key, PublisherState())
        if missed is not None:
            for b in missed:
                self._apply(name, st, b)
            st.replayed += len(missed)
            if not self.resyncing(name):
                self.index.mark_fresh(name)
        self._apply(name, st, rs.trigger)
        while rs.pending:
            self._ingest(name, rs.pending.popleft())

    async def _fetch_replay(self, name: str, start: int, stop: int) -> list[EventBatch] | None:
        """Batches ``start..stop-1`` from the replica's replay endpoint, or ``None`` when they
        cannot all be had."""
        ep = self._replay.get(name)
        if ep is None:
            return None
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        got: dict[int, EventBatch] = {}
        try:
            s.connect(ep)
            await s.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(self.replay_timeout_s):
                while True:
                    frames = await s.recv_multipart()
                    if len(frames) >= 3 and frames[0] == b"":
                        frames = frames[1:]
                    if len(frames) == 3 and frames[1] == END_SEQ:
                        break
                    try:
                        b = decode_message(frames)
                    except EventDecodeError:
                        self.stats.decode_errors += 1
                        continue
                    if start <= b.seq < stop:
                        got[b.seq] = b
        except (TimeoutError, zmq.ZMQError) as e:
            log.warning("kv events: replay from %s for %s failed: %r", ep, name, e)
            return None
        finally:
            s.close(0)
        if len(got) != stop - start:
            log.warning(
                "kv events: replay for %s returned %d of %d batches", name, len(got), stop - start
            )
            return None
        return [got[i] for i in range(start, stop)]
