"""``kvroute serve --replica URL … --kv-events-port P`` with no ``kv:`` settings runs kv_cost
fully: the model, context window, block size, hash algorithm and KV capacity come from the
replicas, the tokenizer from the served model's directory, KV events from
``tcp://<replica host>:P``. Each twin stands on its own loopback address and binds its
publisher there at the one port P, as vLLM binds ``tcp://*:P`` on its own host.

The zero-config router and a router with the full ``kv:`` configuration run side by side, each
in front of its own identical pair of twins, and are sent the same session calls one at a
time: their decisions must be the same. The degraded cases say so at start-up, on ``/ready``
and in ``/metrics``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from costmodel.profiles import load_profile
from loadtest import tinymodel
from loadtest.twin.cluster import start_cluster
from router.app import build_app, start_site
from router.kv.config import KVConfig
from router.kv.state import KVState
from router.serve import add_arguments, config_from_args, kv_layer

pytestmark = pytest.mark.timeout(180)
WORDS = tinymodel._WORDS
PROF = load_profile("cpu-tiny")  # 256 blocks of 32 tokens, 4,096-token context
ADM = {"X-Admin-Key": "adm"}


def words(n: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7919 + i * 104729) % len(WORDS)] for i in range(n))


def free_port(hosts: list[str]) -> int:
    """A TCP port free on every one of ``hosts`` (checked by binding each)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        ok = True
        for h in hosts[1:]:
            with socket.socket() as s:
                try:
                    s.bind((h, port))
                except OSError:
                    ok = False
                    break
        if ok:
            return port
    raise RuntimeError("no common free port")


@contextlib.asynccontextmanager
async def twins_on(hosts: list[str], port: int):
    """One twin per loopback address, each binding its KV-event publisher at ``host:port``."""
    async with contextlib.AsyncExitStack() as stack:
        urls, pubs = [], []
        for h in hosts:
            c = await stack.enter_async_context(
                start_cluster(
                    1,
                    PROF,
                    speedup=1.0,
                    host=h,
                    kv_events=f"tcp://{h}:{port}",
                    kv_events_bind=True,
                    name_prefix=f"twin-{h}",
                )
            )
            urls.append(c.urls[0])
            pubs.append(c.replicas[0].publisher)
        yield urls, pubs


def parse(argv: list[str]):
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(argv), env={})


async def serve_app(cfg, kv):
    app = build_app(cfg, kv=kv)
    runner, url = await start_site(app)
    return app, runner, url


async def wait_subscribed(pubs) -> None:
    """Every twin has seen its router's subscription (a PUB drops what it sends before)."""
    for pub in pubs:
        assert await asyncio.to_thread(pub.wait_subscribed, 5.0), pub.endpoint


def chat(messages: list[dict], max_tokens: int = 8) -> dict:
    return {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "ignore_eos": True}


def winners(path: Path) -> tuple[list[tuple[str, int]], list[str]]:
    """(session, replica) of each placement in a decision log, the replicas numbered in the
    order they were first chosen: the two routers' replicas have other names, and on an empty
    cluster the picker's seeded tie-break goes by name, so only the pattern can agree.
    Also the replicas in that order."""
    out: list[tuple[str, int]] = []
    order: list[str] = []
    for line in path.read_text().splitlines():
        d = json.loads(line)
        if d["winner"] not in order:
            order.append(d["winner"])
        out.append((d["session"], order.index(d["winner"])))
    return out, order


async def test_zero_config_routes_as_the_full_configuration(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvroute")
    hosts_a, hosts_b = ["127.0.0.2", "127.0.0.3"], ["127.0.0.4", "127.0.0.5"]
    port = free_port(hosts_a + hosts_b)
    model = tinymodel.ensure()
    async with (
        twins_on(hosts_a, port) as (urls_a, pubs_a),
        twins_on(hosts_b, port) as (
            urls_b,
            pubs_b,
        ),
    ):
        # zero-config: exactly what `kvroute serve --replica … --kv-events-port P` builds
        argv = [f"--replica={u}" for u in urls_a] + [
            f"--kv-events-port={port}", "--admin-key=adm", "--metrics-interval-s=0.1",
            f"--decision-log={tmp_path / 'zero.jsonl'}",
        ]  # fmt: skip
        cfg_a = parse(argv)
        kv_a = kv_layer(cfg_a)
        assert kv_a.cfg.discover and kv_a.tokenizer is None  # nothing known before start-up
        # the full configuration, as a kv: YAML section would give it
        cfg_b = parse(
            [f"--replica={u}" for u in urls_b]
            + [
                "--admin-key=adm",
                "--metrics-interval-s=0.1",
                f"--decision-log={tmp_path / 'full.jsonl'}",
            ]
        )
        kv_b = KVState(
            KVConfig(
                tokenizer=str(model),
                block_size=PROF.block_size,
                hash_algo="sha256_cbor",
                profile="cpu-tiny",
                events_connect={
                    u: f"tcp://{h}:{port}" for u, h in zip(urls_b, hosts_b, strict=True)
                },
            )
        )
        _app_a, run_a, url_a = await serve_app(cfg_a, kv_a)
        _app_b, run_b, url_b = await serve_app(cfg_b, kv_b)
        try:
            await wait_subscribed(pubs_a + pubs_b)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
                await _compare(http, url_a, url_b, urls_a, urls_b, kv_a, tmp_path)
        finally:
            await run_a.cleanup()
            await run_b.cleanup()
    # the start-up log line says what was found
    assert any("KV layer: full" in r.getMessage() for r in caplog.records), caplog.text


async def _compare(http, url_a, url_b, urls_a, urls_b, kv_a, tmp_path) -> None:
    # what was discovered
    async with http.get(url_a + "/ready") as r:
        ready = await r.json()
    layer = ready["kv_layer"]
    assert layer["mode"] == "full", layer
    assert layer["block_size"] == PROF.block_size and layer["hash_algo"] == "sha256_cbor"
    assert layer["model"] == "tiny" and layer["max_model_len"] == PROF.max_model_len
    assert layer["tokenizer"].startswith("local directory"), layer
    assert kv_a.profile_of(urls_a[0]).gpu_kv_blocks * kv_a.cfg.block_size == (
        PROF.gpu_kv_blocks * PROF.block_size
    )  # the generic stand-in sized to the replica's reported KV capacity
    async with http.get(url_a + "/metrics") as r:
        text = await r.text()
    assert 'kvroute_kv_layer_mode{mode="full"} 1.0' in text
    assert 'kvroute_kv_layer_mode{mode="affinity"} 0.0' in text

    # two agents, each with its own ~1k-token system prompt, two sessions each
    systems = [words(600, 1), words(600, 2)]
    convs: dict[str, list[dict]] = {}
    for turn in range(3):
        for s in range(4):
            first = [{"role": "system", "content": systems[s % 2]}]
            msgs = convs.setdefault(f"s{s}", first)
            msgs.append({"role": "user", "content": words(120 + 40 * turn, 10 * s + turn)})
            body = chat(msgs)
            hdr = {"x-claude-code-session-id": f"s{s}"}
            ra, rb = await asyncio.gather(
                http.post(url_a + "/v1/chat/completions", json=body, headers=hdr),
                http.post(url_b + "/v1/chat/completions", json=body, headers=hdr),
            )
            out = [await ra.json(), await rb.json()]
            assert ra.status == rb.status == 200, out
            msgs.append(
                {"role": "assistant", "content": out[0]["choices"][0]["message"]["content"]}
            )
            await asyncio.sleep(0.3)  # the calls' KV events reach both routers
    # a new session sharing the system prompt: both match it on the same replica, by events
    probe = chat([{"role": "system", "content": systems[1]}, {"role": "user", "content": "x y"}])
    hdr = {"x-claude-code-session-id": "probe", **ADM}
    ex = []
    for url in (url_a, url_b):
        async with http.post(url + "/admin/route?explain=1", json=probe, headers=hdr) as r:
            ex.append(await r.json())
    a, order_a = winners(tmp_path / "zero.jsonl")
    b, order_b = winners(tmp_path / "full.jsonl")
    assert len(a) == len(b) == 12, (a, b)
    assert a == b, (a, b)
    assert len(order_a) == 2, a  # both replicas were used: the sessions spread
    assert order_a.index(ex[0]["winner"]) == order_b.index(ex[1]["winner"]), ex
    probe_terms = ex[0]["explain"]["candidates"]
    hit = next(c for c in probe_terms if c["replica"] == ex[0]["winner"])["terms"]["kv_cost"]
    assert hit["source"] == "events" and hit["match_blocks"] > 0, hit
    async with http.get(url_a + "/ready") as r:
        streams = (await r.json())["kv_layer"]["event_streams"]
    assert set(streams.values()) == {"fresh"}, streams


# ---- degraded cases: said at start-up, on /ready and in /metrics, never silently -------------


def fake_replica(model_id: str, root: str, metrics: str = "") -> web.Application:
    """A replica that answers health, models and metrics (no cache_config_info unless given),
    and any chat call with a fixed reply."""

    async def health(_r: web.Request) -> web.Response:
        return web.Response()

    async def models(_r: web.Request) -> web.Response:
        card = {"id": model_id, "object": "model", "root": root, "max_model_len": 2048}
        return web.json_response({"object": "list", "data": [card]})

    async def scrape(_r: web.Request) -> web.Response:
        return web.Response(text=metrics + "vllm:num_requests_running 0.0\n")

    async def chat_call(_r: web.Request) -> web.Response:
        msg = {"role": "assistant", "content": "ok"}
        usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion",
                "model": model_id,
                "usage": usage,
                "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}],
            }
        )

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", scrape)
    app.router.add_post("/v1/chat/completions", chat_call)
    return app


@contextlib.asynccontextmanager
async def serving(app: web.Application, port: int = 0):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def layer(http, url: str) -> tuple[dict, str]:
    async with http.get(url + "/ready") as r:
        ready = (await r.json())["kv_layer"]
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    modes = [ln for ln in text.splitlines() if ln.startswith("kvroute_kv_layer_mode{")]
    on = [ln.split('"')[1] for ln in modes if ln.endswith(" 1.0")]
    assert len(on) == 1, modes
    return ready, on[0]


MODEL = "acme/never-cached-model"


async def test_a_replica_without_tokenizer_block_size_or_events_is_reported(caplog):
    caplog.set_level(logging.INFO, logger="kvroute")
    rep = fake_replica(MODEL, "/nonexistent/model")
    async with serving(rep) as rurl, aiohttp.ClientSession() as http:
        cfg = parse([f"--replica={rurl}"])  # no --kv-events-port
        kv = kv_layer(cfg)
        app = build_app(cfg, kv=kv)
        runner, url = await start_site(app)
        try:
            ready, mode = await layer(http, url)
            assert mode == ready["mode"] == "approximate", ready
            why = " ".join(ready["reasons"])
            assert "no tokenizer" in why and "no KV events" in why, why
            assert "block_size" in why, why  # no vllm:cache_config_info
            assert ready["model"] == MODEL and ready["max_model_len"] == 2048
            # kv_cost still places calls (on their text and the session's context)
            body = {**chat([{"role": "user", "content": words(50, 3)}]), "model": MODEL}
            hdr = {"x-claude-code-session-id": "s"}
            async with http.post(url + "/v1/chat/completions", json=body, headers=hdr) as r:
                assert r.status == 200, await r.text()
        finally:
            await runner.cleanup()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("KV layer: approximate") and "no tokenizer" in m for m in warned)


@pytest.mark.parametrize(("policy", "mode"), [("kv_cost", "affinity"), ("round_robin", "off")])
async def test_no_kv_layer_is_reported(policy, mode, caplog):
    caplog.set_level(logging.INFO, logger="kvroute")
    rep = fake_replica("tiny", "/nonexistent")
    async with serving(rep) as rurl, aiohttp.ClientSession() as http:
        cfg = parse([f"--replica={rurl}", f"--policy={policy}"])
        app = build_app(cfg)  # no KV layer installed (an embedding that passes none)
        runner, url = await start_site(app)
        try:
            ready, on = await layer(http, url)
            assert on == ready["mode"] == mode, ready
        finally:
            await runner.cleanup()
    if mode == "affinity":
        assert any("KV layer: affinity" in r.getMessage() for r in caplog.records)


async def test_discovery_waits_for_a_replica_that_starts_late():
    """No replica answers at start-up: the layer says so, and completes itself once one
    does (the tokenizer is the twin's model directory, found from the card's root)."""
    model = str(tinymodel.ensure())
    labels = (
        'vllm:cache_config_info{block_size="32",engine="0",enable_prefix_caching="True",'
        'num_gpu_blocks="100",prefix_caching_hash_algo="sha256_cbor"} 1.0\n'
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = parse([f"--replica=http://127.0.0.1:{port}", "--health-interval-s=0.1"])
    kv = kv_layer(cfg)
    app = build_app(cfg, kv=kv)
    runner, url = await start_site(app)
    try:
        async with aiohttp.ClientSession() as http:
            ready, mode = await layer(http, url)
            assert mode == "approximate" and "no replica has reported" in " ".join(
                ready["reasons"]
            ), ready
            async with serving(fake_replica("tiny", model, labels), port):
                async with asyncio.timeout(20):
                    while not kv.discovered:  # noqa: ASYNC110 (no event to wait on)
                        await asyncio.sleep(0.05)
                ready, _ = await layer(http, url)
        assert kv.tokenizer is not None and kv.cfg.block_size == 32, ready
        assert ready["tokenizer"].startswith("local directory"), ready
        assert kv.profile_of("x").gpu_kv_blocks == 100  # sized: 100 blocks of 32 tokens
    finally:
        await runner.cleanup()


async def test_without_a_local_tokenizer_a_sessions_first_call_is_tokenized_by_a_replica(
    tmp_path, monkeypatch
):
    """The model directory is not on the router's machine: a session's first call gets its
    tokens from a replica's /tokenize, so it is matched by KV events all the same."""
    import router.kv.discovery as discovery  # where KVState.autoconfigure looks it up

    monkeypatch.setattr(discovery, "find_tokenizer", lambda names: (None, "not here"))
    hosts = ["127.0.0.6", "127.0.0.7"]
    port = free_port(hosts)
    async with twins_on(hosts, port) as (urls, pubs), aiohttp.ClientSession() as http:
        argv = [f"--replica={u}" for u in urls]
        cfg = parse([*argv, f"--kv-events-port={port}", "--admin-key=adm",
                     f"--decision-log={tmp_path / 'd.jsonl'}"])  # fmt: skip
        kv = kv_layer(cfg)
        app = build_app(cfg, kv=kv)
        runner, url = await start_site(app)
        try:
            await wait_subscribed(pubs)
            ready, mode = await layer(http, url)
            assert mode == "approximate" and "/tokenize" in " ".join(ready["reasons"]), ready
            assert kv.tokens is None and ready["tokenizer"].startswith("a replica's /tokenize")
            system = words(600, 4)
            first = chat([{"role": "system", "content": system}, {"role": "user", "content": "a"}])
            hdr = {"x-claude-code-session-id": "one"}
            async with http.post(url + "/v1/chat/completions", json=first, headers=hdr) as r:
                assert r.status == 200, await r.text()
                used = (await r.json())["usage"]["prompt_tokens"]
            row = json.loads((tmp_path / "d.jsonl").read_text().splitlines()[0])
            assert row["analysed"] and row["prompt_tokens"] == used, row
            await asyncio.sleep(0.3)  # its KV events arrive
            probe = chat([{"role": "system", "content": system}, {"role": "user", "content": "b"}])
            hdr = {"x-claude-code-session-id": "two", **ADM}
            async with http.post(url + "/admin/route?explain=1", json=probe, headers=hdr) as r:
                ex = await r.json()
            assert ex["winner"] == row["winner"], ex
            won = next(c for c in ex["explain"]["candidates"] if c["replica"] == ex["winner"])
            terms = won["terms"]["kv_cost"]
            assert terms["source"] == "events" and terms["match_blocks"] >= 15, terms
            assert kv.remote_stats["tokenized"] == 2, kv.remote_stats
        finally:
            await runner.cleanup()
