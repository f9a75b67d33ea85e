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
