"""Peers that route on the twins' KV events, each in front of two twins publishing as the
bench runs them (one bound endpoint per twin, vLLM's default empty topic):

* ``dynamo:kv``: NVIDIA Dynamo's real KV router (``ai-dynamo-runtime``'s SelectionService)
  behind the harness's front (:mod:`loadtest.sweep.dynamo_front`);
* ``vllm-router:kv_aware`` (0.1.17), which credited no prefix at all while the twins
  published on their own ``kv@<name>`` topics.

The prefix test places each session's first call on a replica of our choosing by sending it
to that twin directly (not through the router), so the router can learn where the prefix
lives only from the twins' ``BlockStored`` events (their ``token_ids``, from which both
recompute their own block hashes). The two sessions are placed on different replicas: a
router that ignored the events (a fixed or tie-broken choice) sends at least one second call
to the wrong one.

Each target is skipped only when its venv is absent (``make peers`` installs Dynamo's from
the package index in well under a minute; ``make bench-peers`` adds vllm-router's).
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

pytestmark = pytest.mark.timeout(180)
DYNAMO = pytest.mark.skipif(
    peer_python("dynamo") is None,
    reason="Dynamo venv absent: run `make peers` (scripts/setup_peers.sh dynamo)",
)
VLLM_ROUTER = pytest.mark.skipif(
    peer_python("vllm-router") is None,
    reason="vllm-router venv absent: run `make bench-peers` (scripts/setup_peers.sh vllm-router)",
)
TARGETS = [
    pytest.param("dynamo:kv", marks=DYNAMO),
    pytest.param("vllm-router:kv_aware", marks=VLLM_ROUTER),
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
async def stack(request):
    """Two twins binding their own event ports (vLLM's default topic, as ``kvroute bench``
    runs them), and the router (``request.param``) subscribed to them."""
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-kvpeer-"))
    prof = load_profile(PROFILE)
    try:
        async with start_cluster(
            2, PROFILE, kv_events="tcp://127.0.0.1:*", kv_events_topic=""
        ) as c:
            eps = dict(zip(c.urls, c.event_endpoints, strict=True))
            router = Router(request.param, c.urls, workdir, event_endpoints=eps,
                            block_size=prof.block_size, model="tiny")  # fmt: skip
            await asyncio.to_thread(router.start)  # health polls off the twins' loop
            try:
                for twin in c.replicas:  # the router's SUB socket has connected to each twin
                    assert twin.publisher is not None
                    assert twin.publisher.wait_subscribed(10.0), "the router never subscribed"
                async with aiohttp.ClientSession() as http:
                    yield c, router, http
            finally:
                await asyncio.to_thread(router.stop)
    finally:
        cleanup(workdir)


@pytest.mark.parametrize("stack", TARGETS, indirect=True)
async def test_second_call_follows_the_prefix_learned_from_kv_events(stack):
    c, router, http = stack
    dynamo = router.name.startswith("dynamo:")
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

    if dynamo:
        for sid, i in placed.items():
            await _until(lambda sid=sid, i=i: holds(sid, i), f"Dynamo never saw {sid}'s blocks")
    else:  # vllm-router shows no index: give its subscribers (10 ms polls) time to apply
        await asyncio.sleep(2.0)

    served = {}
    for sid in ("a", "b"):
        body = dict(first[sid])
        body["messages"] = [
            *first[sid]["messages"],
            {"role": "assistant", "content": words(20, rng)},
            {"role": "user", "content": words(40, rng)},
        ]
        body["stream"] = True
        hdr = {"X-Dynamo-Session-ID": sid} if dynamo else {"x-session-id": sid}
        status, headers, text = await _post(http, router.url + "/v1/chat/completions", body, hdr)
        assert status == 200, text
        assert text.rstrip().endswith("data: [DONE]"), text[-200:]  # streamed through
        served[sid] = headers["x-twin-replica"]
    assert served == {sid: f"twin-{i}" for sid, i in placed.items()}
    if not dynamo:
        return
    # the lifecycle was reported: every reservation was freed, nothing is left in flight
    async with http.get(router.url + "/state") as r:
        st = await r.json()
    loads = [w for m in st["loads"] for w in m["loads"]]
    assert st["counts"].get("selected") == 2
    assert loads and all(w["active_requests"] == 0 for w in loads), loads
    assert all(w["potential_prefill_tokens"] == 0 for w in loads), loads


@pytest.mark.parametrize("stack", TARGETS[:1], indirect=True)
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
