"""The twin's KV-event publisher: vLLM's ZMQ wire format, bind or connect as vLLM decides.

Owns: :class:`KVEventPublisher` (PUB socket, ``seq`` numbering, a bounded buffer and a ROUTER
replay socket answering ``seq`` requests as vLLM's replay endpoint does, int or digest-bytes
hashes) and :func:`publisher_binds` (vLLM's rule: bind for ``*``/``::``/ipc/inproc, else
connect). Must not import aiohttp, torch or vllm.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from router.vllm.kvevents import encode_message

log = logging.getLogger("kvroute.twin")


def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule: the publisher binds for ``*``/``::`` hosts and ipc/inproc, else connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """A ZMQ PUB socket sending ``[topic, seq, msgpack([ts, events, dp_rank])]`` batches, and
    optionally vLLM's replay service: a ROUTER socket on ``replay_endpoint`` that answers
    ``[b"", start_seq(8B BE)]`` with ``[b"", topic, seq, payload]`` for every buffered batch
    from ``start_seq`` on, then ``[b"", b"", -1 (8B signed), b""]`` (``ZmqEventPublisher``,
    last ``buffer_steps`` batches kept)."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(
        self,
        endpoint: str,
        topic: str,
        zmq_ctx: Any = None,
        as_int: bool = True,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        bind: bool | None = None,
    ):
        import zmq

        self._own_ctx = zmq_ctx is None
        self.ctx = zmq_ctx or zmq.Context()
        # XPUB: on the wire a PUB, but it lets the twin see a subscriber's subscription
        # arrive (wait_subscribed), so a twin started after its subscriber drops nothing.
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        # ``bind`` True binds even a named host (tcp://127.0.0.2:P): one twin per loopback
        # address stands in for one vLLM per host binding tcp://*:P (tests of kvroute serve
        # --kv-events-port); None: vLLM's rule
        if publisher_binds(endpoint) if bind is None else bind:
            self.sock.bind(endpoint)
            self.endpoint = str(self.sock.getsockopt_string(zmq.LAST_ENDPOINT))
        else:
            self.sock.connect(endpoint)
            self.endpoint = endpoint
        self.topic = topic
        self.seq = 0
        self.as_int = as_int
        self.dropped = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.replay_endpoint: str | None = None
        self._replay: Any = None
        if replay_endpoint:
            import zmq.asyncio

            self._actx = zmq.asyncio.Context.shadow(self.ctx)
            self._replay = self._actx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = str(self._replay.getsockopt_string(zmq.LAST_ENDPOINT))

    def wait_subscribed(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until a subscriber's subscription has arrived (a PUB
        drops what it sends before that: vLLM loses the first events when it starts before
        its subscriber connects). False when none came in time."""
        import zmq

        got = False
        while self.sock.poll(int(max(timeout_s, 0) * 1000) if not got else 0, zmq.POLLIN):
            self.sock.recv(zmq.NOBLOCK)  # b"\x01" + topic prefix; drain them all
            got = True
        return got

    def publish(
        self, events: list[dict[str, Any]], digests: dict[int, bytes] | None = None
    ) -> None:
        import zmq

        if not events:
            return
        if not self.as_int:
            events = [_digest_form(e, digests or {}) for e in events]
        parts = encode_message(self.topic, self.seq, time.time(), events)
        if self._replay is not None:
            self.buffer.append((self.seq, parts[2]))
        try:
            self.sock.send_multipart(parts, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1  # PUB semantics: never block the engine
        self.seq += 1

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled (no-op without a replay endpoint)."""
        if self._replay is None:
            return
        topic = self.topic.encode()
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # vLLM logs and ignores malformed requests
            client, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self._replay.send_multipart(
                        [client, b"", topic, seq.to_bytes(8, "big"), payload]
                    )
            await self._replay.send_multipart([client, b"", b"", self.END_SEQ, b""])

    def close(self) -> None:
        self.sock.close(0)
        if self._replay is not None:
            self._replay.close(0)
        if self._own_ctx:
            self.ctx.term()


def _digest_form(ev: dict[str, Any], digests: dict[int, bytes]) -> dict[str, Any]:
    """The event with 32-byte digests instead of 64-bit ints (what vLLM publishes when
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``)."""

    def conv(h: Any) -> Any:
        return digests.get(h, h.to_bytes(8, "big")) if isinstance(h, int) else h

    out = dict(ev)
    if "block_hashes" in out:
        out["block_hashes"] = [conv(h) for h in out["block_hashes"]]
    if out.get("parent_block_hash") is not None:
        out["parent_block_hash"] = conv(out["parent_block_hash"])
    return out
