"""The write-back host tier on real vLLM-CPU, beside the write-through tier of the same size.

Three replicas, each with 8192 tokens of engine KV ("GPU") and an 8192-token host tier,
prefill chunks of 512 tokens (so the eviction-front window, 2 x 512 / 32 = 32 blocks, is an
eighth of the pool): ``wb`` with ``--host-tier-mode write-back`` (:mod:`engine_patches.writeback`;
on this platform it copies a block when the allocator evicts it), ``wbf`` the same with
``"kvroute_copy": "front"`` (the eviction-front walk, CUDA's default), ``wt`` with the default
write-through tier. The same sequence on each — a prompt, its warm rerun, six other prompts
(12,000 tokens: past HBM, within HBM + host), the prompt again:

* write-back, either copy, serves the prompt from host (``cached_tokens``, the by-source
  metric) with the logprobs of its warm rerun (same prefix-cached path, so bit-identical), and
  stored nothing of it to host while HBM held it; its host blocks reach the router's index as
  CPU;
* write-through, whose host tier mirrors HBM, has lost it;
* two ``cpu-tiny`` twins with the same tiers (``cpu_kv_blocks`` 256, ``host_write_back`` 1 or
  0) give every call of the sequence the same ``cached_tokens`` and split by source as ``wb``
  and ``wt``.

The twin's write-back takes a block when an allocation evicts it, as ``wb`` does; the front walk
copies up to the window's 32 blocks ahead of eviction, which on this sequence comes to the same
(docs/engine.md#write-back-host-tier); the host-tier fidelity test's write-back run is where
they part.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest

from costmodel.profiles import load_profile
from router.kv.index import BlockIndex
from router.vllm.hashing import BlockHasher
from router.vllm.kvevents import BlockStored
from router.vllm.metrics import cached_by_source
from tests.vllm.conftest import BLOCK_SIZE, KV_BYTES, unique_text
from tests.vllm.test_twin_fidelity import TwinThread

pytestmark = pytest.mark.timeout(300)

HOST_BYTES = KV_BYTES  # 256 blocks of 32 tokens, as many as the engine's
PROMPT_WORDS = 2000
SOURCES = ("device", "host", "disk")


@pytest.fixture(scope="module")
def pair(writeback_bed, kv_events):
    """The session's ``writeback`` bed (tests/vllm/conftest.py) and two twins (started after
    it: its replicas hold their ports by then)."""
    prof = load_profile("cpu-tiny").replace(cpu_kv_blocks=HOST_BYTES // (BLOCK_SIZE * 2048))
    twins = {
        "twin-wb": TwinThread(kv_events.endpoint, prof.replace(host_write_back=1), name="wb-twin"),
        "twin-wt": TwinThread(kv_events.endpoint, prof, name="wt-twin"),
    }
    try:
        reps = {r.cfg.name: r for r in writeback_bed.replicas}
        yield {**reps, **twins}, kv_events
    finally:
        for t in twins.values():
            t.close()


def _run(http: httpx.Client, url: str, seed: int, mark: Callable[[], int]) -> dict:
    def ask(text: str) -> tuple[int, list[float], str]:
        body = {"model": "tiny", "prompt": text, "max_tokens": 8, "temperature": 0,
                "logprobs": 3}  # fmt: skip
        j = http.post(url + "/v1/completions", json=body).json()
        ch = j["choices"][0]
        return (
            j["usage"]["prompt_tokens_details"]["cached_tokens"],
            (ch.get("logprobs") or {}).get("token_logprobs", []),  # the twin has none
            ch["text"],
        )

    a = unique_text(PROMPT_WORDS, seed=seed)
    tokens = http.post(url + "/tokenize", json={"model": "tiny", "prompt": a}).json()["tokens"]
    out: dict = {"tokens": tokens, "want": (len(tokens) - 1) // BLOCK_SIZE * BLOCK_SIZE}
    calls: list[tuple[int, dict[str, float]]] = []  # per call: cached tokens, split by source

    def timed(text: str) -> tuple[int, list[float], str]:
        before = cached_by_source(http.get(url + "/metrics").text)
        got = ask(text)
        after = cached_by_source(http.get(url + "/metrics").text)
        calls.append((got[0], {k: after[k] - before.get(k, 0.0) for k in SOURCES}))
        return got

    out["cold"] = timed(a)
    out["warm"] = timed(a)
    time.sleep(0.5)  # the events of those two runs reach the collector
    out["before_fill"] = mark()
    for i in range(6):
        timed(unique_text(PROMPT_WORDS, seed=seed + 10 + i))
    out["again"] = timed(a)
    out["delta"] = calls[-1][1]
    out["calls"] = calls
    return out


def test_write_back_keeps_what_hbm_dropped_and_write_through_does_not(pair):
    reps, events = pair
    http = httpx.Client(timeout=120)
    wb_topic = reps["wb"].topic
    wb = _run(http, reps["wb"].url, 1401, lambda: len(events.snapshot(wb_topic)))
    wt = _run(http, reps["wt"].url, 1501, lambda: 0)
    wbf = _run(http, reps["wbf"].url, 1401, lambda: 0)
    twin = {m: _run(http, reps[f"twin-{m}"].url, seed, lambda: 0)
            for m, seed in (("wb", 1401), ("wt", 1501))}  # fmt: skip

    for r in (wb, wt, wbf):
        assert r["cold"][0] == 0 and r["warm"][0] == r["want"]  # a device hit while HBM has it
    # write-back, either copy: every prefix block from host, the warm run's logprobs and text
    for r in (wb, wbf):
        assert r["again"][0] == r["want"], r["delta"]
        assert r["delta"]["host"] == r["want"] and r["delta"]["device"] == 0, r["delta"]
        assert r["again"][1] == r["warm"][1] and r["again"][2] == r["cold"][2]
    # write-through of the same size: host held what HBM held, and both dropped it
    assert wt["again"][0] < wt["want"] / 4, wt["delta"]

    # the twins: the same hits, call by call, split by source
    assert twin["wb"]["calls"] == wb["calls"], (twin["wb"]["calls"], wb["calls"])
    assert twin["wt"]["calls"] == wt["calls"], (twin["wt"]["calls"], wt["calls"])

    hasher = BlockHasher(BLOCK_SIZE)
    keys = hasher.hash_keys(wb["tokens"])[:-1]
    batches = events.wait_for(
        wb_topic,
        lambda bs: set(keys)
        <= {k for x in bs for e in x.events if isinstance(e, BlockStored) and e.medium == "CPU"
            for k in e.block_hashes},
        timeout=20,
    )  # fmt: skip
    # nothing of the prompt went to host before the other prompts pushed it out of HBM
    early = [
        k
        for x in batches[: wb["before_fill"]]
        for e in x.events
        if isinstance(e, BlockStored) and e.medium == "CPU"
        for k in e.block_hashes
    ]
    assert not set(early) & set(keys)
    ix = BlockIndex()
    for x in batches:
        ix.apply(reps["wb"].url, x.events)
    assert "CPU" in ix.holds(reps["wb"].url, keys[0])
    assert ix.match(keys)[reps["wb"].url].depth == len(keys)
    http.close()
