"""The real vllm-router (0.1.17) in its P/D mode in front of a prefill twin and a decode twin,
as ``kvroute bench --pd P:D`` runs it (``vllm-router:<policy>``; :func:`loadtest.sweep.stack.
pd_capable`): ``--vllm-pd-disaggregation --prefill URL --decode URL``.

vllm-router drives the two legs in vLLM's ``kv_transfer_params`` protocol (its
``vllm_pd_router.rs``: the prefill leg with ``max_tokens: 1``, ``stream: false`` and
``do_remote_decode``; the decode leg with the prefill answer's parameters), which the twins
answer as vLLM's NIXL connector does: so a call through it is prefilled on the prefill twin,
its KV moved over the modelled link, and decoded on the decode twin. Skipped only when the
vllm-router venv is absent (``make bench-peers``)."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import aiohttp
import orjson
import pytest

from loadtest import tinymodel
from loadtest.sweep import stack
from loadtest.sweep.stack import Router, StackError, cleanup, pd_capable, peer_python
from loadtest.twin.cluster import start_cluster

pytestmark = pytest.mark.timeout(180)
LIVE = pytest.mark.skipif(
    peer_python("vllm-router") is None,
    reason="vllm-router venv absent: run `make bench-peers` (scripts/setup_peers.sh vllm-router)",
)
WORDS = tinymodel._WORDS


def chat(n_words: int, seed: int, stream: bool = False) -> dict:
    text = " ".join(WORDS[(seed * 7919 + i * 104729) % len(WORDS)] for i in range(n_words))
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}],
            "max_tokens": 6, "ignore_eos": True}  # fmt: skip
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


@LIVE
async def test_vllm_router_pd_call_runs_both_legs_through_the_twins():
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-vrpd-"))
    try:
        async with start_cluster(2, "cpu-tiny", speedup=20.0, roles=["prefill", "decode"]) as c:
            pre, dec = c.replicas
            roles = {c.urls[0]: "prefill", c.urls[1]: "decode"}
            router = Router("vllm-router:round_robin", c.urls, workdir, roles=roles)
            await asyncio.to_thread(router.start)  # health polls off the twins' loop
            try:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as h:
                    url = router.url + "/v1/chat/completions"
                    async with h.post(url, json=chat(1200, 1)) as r:
                        assert r.status == 200, await r.text()
                        assert r.headers["x-twin-replica"] == dec.cfg.name  # decoded there
                        out = await r.json()
                    assert out["usage"]["completion_tokens"] == 6
                    prompt = out["usage"]["prompt_tokens"]
                    assert pre.engine.prefix_queries == prompt  # prefilled on the prefill twin
                    moved = dec.engine.remote_blocks  # the decode twin took the KV over the link
                    assert moved == prompt // pre.profile.block_size
                    # vllm-router reports the prefill leg's prefix hit as the call's
                    # cached_tokens (its pd_cached_tokens.rs), not the decode side's transfer
                    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                    async with h.post(url, json=chat(1200, 1)) as r:  # the same prompt again
                        again = (await r.json())["usage"]["prompt_tokens_details"]
                    assert again["cached_tokens"] == pre.engine.prefix_hits > 0
                    moved = dec.engine.remote_blocks
                    # streamed: the decode leg's SSE stream, usage at its end
                    async with h.post(url, json=chat(1200, 2, stream=True)) as r:
                        assert r.status == 200
                        raw = await r.read()
                    events = [e for e in raw.split(b"\n\n") if e.strip()]
                    assert events[-1] == b"data: [DONE]"
                    last = orjson.loads(events[-2][len(b"data: ") :])
                    assert last["usage"]["completion_tokens"] == 6
                    assert dec.engine.remote_blocks > moved
                    assert pre.engine.generation_tokens_total == 3  # one token per prefill leg
            finally:
                await asyncio.to_thread(router.stop)
    finally:
        cleanup(workdir)


def test_pd_argv_names_each_replica_by_role(tmp_path, monkeypatch):
    monkeypatch.setattr(stack, "peer_python", lambda kind: Path("/venv/bin/python"))
    urls = ["http://p0", "http://p1", "http://d0"]
    roles = {"http://p0": "prefill", "http://p1": "prefill", "http://d0": "decode"}
    argv, health = Router("vllm-router:cache_aware", urls, tmp_path, roles=roles).argv()
    assert health == "/health" and "--worker-urls" not in argv
    assert argv[argv.index("--policy") + 1] == "cache_aware"
    assert "--vllm-pd-disaggregation" in argv
    pairs = [(argv[i], argv[i + 1]) for i, a in enumerate(argv) if a in ("--prefill", "--decode")]
    assert pairs == [("--prefill", "http://p0"), ("--prefill", "http://p1"),
                     ("--decode", "http://d0")]  # fmt: skip
    plain, _ = Router("vllm-router:cache_aware", urls, tmp_path).argv()  # no roles: as before
    assert "--vllm-pd-disaggregation" not in plain
    assert plain[plain.index("--worker-urls") + 1 :][:3] == urls


def test_peers_without_a_wired_pd_mode_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(stack, "peer_python", lambda kind: Path("/venv/bin/python"))
    assert pd_capable("vllm-router:cache_aware") is None and pd_capable("kvroute:kv_cost") is None
    assert "block size 16" in (pd_capable("vllm-router:kv_aware") or "")
    assert pd_capable("sglang:cache_aware") is not None
    roles = {"http://a": "prefill", "http://b": "decode"}
    with pytest.raises(StackError, match="cannot run P/D"):
        Router("sglang:cache_aware", list(roles), tmp_path, roles=roles).argv()
    with pytest.raises(StackError, match="prefill or decode roles only"):
        Router("vllm-router:round_robin", ["http://a", "http://c"], tmp_path,
               roles={"http://a": "prefill", "http://c": "both"}).argv()  # fmt: skip
