"""The chart's Grafana dashboard queries only metrics that really exist: a real router in
front of two replica twins (vLLM's metric names), wired as the chart wires it — workers bind
their KV-event and replay sockets, the router connects to each (``kv.events_connect`` /
``kv.replay``), sessions in a real redis-server — serves a few agent calls; then every metric
name in every dashboard query must appear as a sample in the router's or a twin's live
``/metrics``, and every ``by (...)`` label on a sample of that query's metrics (or be a label
Prometheus adds at scrape time)."""

# ruff: noqa: F811  (fixtures shared from test_router_redis are imported by name)
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest import tinymodel
from loadtest.twin.cluster import start_cluster
from router.app import REPLICAS, build_app, start_site
from router.config import RouterConfig
from router.kv.config import KVConfig
from router.kv.state import KVState
from tests.integration.test_router_redis import redis_server  # noqa: F401

pytestmark = pytest.mark.timeout(90)
DASHBOARD = Path(__file__).resolve().parents[2] / "helm/kvroute/dashboards/kvroute.json"
METRIC = re.compile(r"(?<![\w:])((?:kvroute_|vllm:)[A-Za-z0-9_:]*[A-Za-z0-9_])")
BY = re.compile(r"\bby\s*\(([^)]*)\)")
TARGET_LABELS = {"pod", "namespace", "instance", "job", "le"}  # added by the scrape / buckets
# declared on /metrics from the start, with samples only once the event happens
DECLARED_ONLY = {"kvroute_retries_total"}


def queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    out += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    return out


def chat(text: str, stream: bool = True) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "ignore_eos": True,
        "stream": stream,
        "stream_options": {"include_usage": True},
    }


async def test_dashboard_queries_name_metrics_the_router_and_vllm_export(redis_server):
    model = tinymodel.ensure()
    async with start_cluster(
        2, "cpu-tiny", speedup=20.0, kv_events="tcp://127.0.0.1:*", kv_events_replay=True
    ) as c:
        kv = KVState(KVConfig.from_mapping({
            "tokenizer": str(model), "block_size": 32, "profile": "cpu-tiny",
            "events_connect": dict(zip(c.urls, c.event_endpoints, strict=True)),
            "replay": dict(zip(c.urls, c.replay_endpoints, strict=True)),
        }))  # fmt: skip
        cfg = RouterConfig(replicas=c.urls, redis_url=redis_server.url, metrics_interval_s=0.1)
        app = build_app(cfg, kv=kv)  # as `kvroute serve` does
        runner, url = await start_site(app)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
                await _traffic(http, url)
                await _settle(app, kv, http, url)
                live = await _live(http, [url, *c.urls])
        finally:
            await runner.cleanup()
    _check(live)


async def _traffic(http: aiohttp.ClientSession, url: str) -> None:
    words = tinymodel._WORDS
    text = " ".join(words[i % len(words)] for i in range(300))
    calls = [
        ({"x-claude-code-session-id": "s1"}, chat(text)),
        ({"x-claude-code-session-id": "s1"}, chat(text + " again")),  # kept
        ({"X-Dynamo-Session-ID": "d1", "X-Dynamo-Session-Final": "true"}, chat(text + " d")),
        ({}, chat("no session at all " + text, stream=False)),  # identity from the prefix
    ]
    for headers, body in calls:
        async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            await r.read()


async def _settle(app, kv: KVState, http: aiohttp.ClientSession, url: str) -> None:
    """Until the KV events reached the index and a /metrics scrape saw the cached tokens.
    ZMQ drops what a publisher sends before the subscriber's connection is up (the slow
    joiner): on a loaded machine the first calls can finish before that, so while no batch
    has arrived, one more call every second makes new events."""
    words = " ".join(tinymodel._WORDS[:200])
    for i in range(300):  # no event to await for a scrape: bounded polling
        no_batch = kv.subscriber is None or not any(
            st.batches for st in kv.subscriber.stats.streams.values()
        )
        if no_batch and i % 20 == 19:
            async with http.post(url + "/v1/chat/completions", json=chat(f"{i} {words}")) as r:
                await r.read()
        if (
            kv.subscriber is not None
            and any(st.batches for st in kv.subscriber.stats.streams.values())
            and all(r.cached_by_source for r in app[REPLICAS])
        ):
            return
        await asyncio.sleep(0.05)
    streams = None if kv.subscriber is None else kv.subscriber.stats.streams
    scraped = {r.name: r.cached_by_source for r in app[REPLICAS]}
    raise AssertionError(f"KV events or scrapes never arrived: {streams} {scraped}")


async def _live(http: aiohttp.ClientSession, bases: list[str]) -> dict[str, set[str]]:
    """Sample name -> label names seen on it, over every live /metrics; plus declared
    families (``#family``)."""
    seen: dict[str, set[str]] = {}
    for base in bases:
        async with http.get(base + "/metrics") as r:
            text = await r.text()
        assert "_created" not in text or base != bases[0]  # the router sends no _created
        for fam in text_string_to_metric_families(text):
            seen.setdefault("#" + fam.name, set())
            for s in fam.samples:
                seen.setdefault(s.name, set()).update(s.labels)
    return seen


def _check(live: dict[str, set[str]]) -> None:
    qs = queries()
    assert len(qs) > 20
    missing, bad_labels = set(), []
    for q in qs:
        names = set(METRIC.findall(q))
        assert names, q
        for n in names:
            if n in live:
                continue
            if n in DECLARED_ONLY and "#" + n.removesuffix("_total") in live:
                continue
            missing.add(n)
        have = set().union(*(live.get(n, set()) for n in names))
        for group in BY.findall(q):
            for label in (x.strip() for x in group.split(",")):
                if names <= DECLARED_ONLY and not have:
                    continue  # no sample yet, so no labels to compare
                if label and label not in TARGET_LABELS and label not in have:
                    bad_labels.append((label, q))
    assert not missing, f"dashboard queries metrics nobody exports: {sorted(missing)}"
    assert not bad_labels, f"dashboard groups by labels the metrics lack: {bad_labels}"
