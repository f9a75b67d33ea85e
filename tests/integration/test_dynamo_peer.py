"""``dynamo:kv``: NVIDIA Dynamo's real KV router (``ai-dynamo-runtime``'s SelectionService)
behind the harness's front (:mod:`loadtest.sweep.dynamo_front`), in front of two twins whose
KV events it subscribes to itself.

The prefix test places each session's first call on a replica of our choosing by sending it
to that twin directly (not through the front), so Dynamo can learn where the prefix lives
only from the twins' ``BlockStored`` events (their ``token_ids``, from which it recomputes its
block hashes). The two sessions are placed on different replicas: a front that ignored the
events (a fixed or tie-broken choice) sends at least one second call to the wrong one.

Skipped only when the Dynamo venv is absent (``make peers`` / ``scripts/setup_peers.sh
dynamo`` installs it from the package index in well under a minute).
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from pathlib import Path

import aiohttp
import pytest

from costmodel.profiles import load_profile
from loadtest import tinymodel
from loadtest.sweep.stack import Router, cleanup, peer_python
from loadtest.twin.cluster import start_cluster

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        peer_python("dynamo") is None,
        reason="Dynamo venv absent: run `make peers` (scripts/setup_peers.sh dynamo)",
    ),
]

PROFILE = "cpu-tiny"  # block size 32


def words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(tinymodel._WORDS) for _ in range(n))


async def _post(http: aiohttp.ClientSession, url: str, body: dict, headers=None):
    async with http.post(url, json=body, headers=headers or {}) as r:
        text = await r.text()
        return r.status, r.headers, text


async def _until(pred, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(what)


@pytest.fixture
async def stack():
    """Two twins binding their own event ports, and the Dynamo front subscribed to them."""
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-dynamo-"))
    prof = load_profile(PROFILE)
    try:
        async with start_cluster(2, PROFILE, kv_events="tcp://127.0.0.1:*") as c:
            eps = dict(zip(c.urls, c.event_endpoints, strict=True))
            router = Router("dynamo:kv", c.urls, workdir, event_endpoints=eps,
                            block_size=prof.block_size, model="tiny")  # fmt: skip
            await asyncio.to_thread(router.start)  # health polls off the twins' loop
            try:
                for twin in c.replicas:  # Dynamo's SUB socket has connected to each twin
                    assert twin.publisher is not None
                    assert twin.publisher.wait_subscribed(10.0), "Dynamo never subscribed"
                async with aiohttp.ClientSession() as http:
                    yield c, router, http
            finally:
                await asyncio.to_thread(router.stop)
    finally:
        cleanup(workdir)


async def test_second_call_follows_the_prefix_dynamo_learned_from_kv_events(stack):
    c, router, http = stack
    rng = random.Random(7)
    # session -> the twin its first call is placed on (directly, past the router)
    placed = {"a": 1, "b": 0}
    first: dict[str, dict] = {}
    for sid, i in placed.items():
        msgs = [
            {"role": "system", "content": words(300, rng)},
            {"role": "user", "content": words(600, rng)},
        ]
        body = {"model": "tiny", "messages": msgs, "max_tokens": 8}
        status, headers, text = await _post(http, c.urls[i] + "/v1/chat/completions", body)
        assert status == 200, text
        first[sid] = body

    async def holds(sid: str, i: int) -> bool:
        """Dynamo's own overlap for the session's first prompt shows blocks on twin i only."""
        async with http.post(router.url + "/debug/overlap", json=first[sid]) as r:
            assert r.status == 200, await r.text()
            ws = {w["worker_id"]: w["device_blocks"] for w in (await r.json())["workers"]}
        return ws.get(i + 1, 0) > 0 and ws.get(2 - i, 0) == 0  # worker ids are 1-based

    for sid, i in placed.items():
        await _until(lambda sid=sid, i=i: holds(sid, i), f"Dynamo never saw {sid}'s blocks")

    served = {}
    for sid in ("a", "b"):
        body = dict(first[sid])
        body["messages"] = [
            *first[sid]["messages"],
            {"role": "assistant", "content": words(20, rng)},
            {"role": "user", "content": words(40, rng)},
        ]
        body["stream"] = True
        status, headers, text = await _post(
            http, router.url + "/v1/chat/completions", body, {"X-Dynamo-Session-ID": sid}
        )
        assert status == 200, text
        assert text.rstrip().endswith("data: [DONE]"), text[-200:]  # streamed through
        served[sid] = headers["x-twin-replica"]
    assert served == {sid: f"twin-{i}" for sid, i in placed.items()}

    # the lifecycle was reported: every reservation was freed, nothing is left in flight
    async with http.get(router.url + "/state") as r:
        st = await r.json()
    loads = [w for m in st["loads"] for w in m["loads"]]
    assert st["counts"].get("selected") == 2
    assert loads and all(w["active_requests"] == 0 for w in loads), loads
    assert all(w["potential_prefill_tokens"] == 0 for w in loads), loads


async def test_bad_input_gets_the_api_familys_error(stack):
    _, router, http = stack
    async with http.post(router.url + "/v1/chat/completions", data=b"{nope") as r:
        assert r.status == 400
        assert "message" in (await r.json())["error"]
    async with http.post(router.url + "/v1/messages", data=b"[1]") as r:
        assert r.status == 400
        assert (await r.json())["type"] == "error"
    status, _, text = await _post(
        http, router.url + "/v1/chat/completions", {"model": "tiny", "messages": []}
    )
    assert status == 400 and "messages" in text
