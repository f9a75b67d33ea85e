"""The router's streaming proxy against real minimal backends on loopback.

:class:`FakeReplica` is a small vLLM-shaped aiohttp server with knobs (delay, failure status,
streaming, dying mid-stream) that records what it received; other router test files import it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from router.app import MONITOR, REPLICAS, build_app, start_site
from router.config import RouterConfig

# event waits are bounded at 60 s: the CI's other tier starts vLLM beds beside this one, and
# stalls of up to 30 s were seen there (docs/engine.md)
pytestmark = pytest.mark.timeout(180)

# Odd bytes on purpose: multi-byte UTF-8 split across writes, CRLF, an SSE comment line.
SSE_CHUNKS = [
    b": keep-alive comment\n\n",
    b'data: {"choices":[{"delta":{"content":"h\xc3',
    b'\xa9llo \xe2\x82\xac"}}]}\n\n',
    b'data: {"choices":[{"delta":{"content":" w\\u00f6rld\\r\\n"}}]}\r\n\r\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":7}}\n\n',
    b"data: [DONE]\n\n",
]


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class FakeReplica:
    """A vLLM-shaped backend. Knobs are plain attributes and may change between calls."""

    name: str
    models: list[str] = field(default_factory=lambda: ["tiny"])
    delay_s: float = 0.0  # before the response headers
    chunk_delay_s: float = 0.0
    chunks: list[bytes] = field(default_factory=lambda: list(SSE_CHUNKS))
    fail_status: int | None = None
    fail_text: str | None = None  # with fail_status: a plain-text error body instead of JSON
    fail_chunked: bool = False  # send the error body chunked (no Content-Length)
    usage: dict[str, Any] = field(default_factory=lambda: {"prompt_tokens": 3})  # JSON answers
    die_after_chunks: int | None = None  # close the connection mid-stream
    healthy: bool = True
    running: float = 0.0
    waiting: float = 0.0
    seen: list[Seen] = field(default_factory=list)
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    completed: int = 0
    responses: set[str] = field(default_factory=set)  # Responses ids this replica produced
    url: str = ""
    _runner: web.AppRunner | None = None

    async def _infer(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.seen.append(Seen(request.path_qs, dict(request.headers), raw))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail_status:
            if self.fail_text is not None and self.fail_chunked:
                err = web.StreamResponse(status=self.fail_status)
                err.content_type = "text/plain"
                await err.prepare(request)
                await err.write(self.fail_text.encode())
                await err.write_eof()
                return err
            if self.fail_text is not None:
                return web.Response(text=self.fail_text, status=self.fail_status)
            return web.json_response({"error": {"message": "injected"}}, status=self.fail_status)
        body = orjson.loads(raw) if raw else {}
        rid = "x"
        if request.path == "/v1/responses":  # a Responses id this replica holds from now on
            rid = f"resp_{self.name}_{len(self.seen)}"
            self.responses.add(rid)
        if not body.get("stream"):
            return web.json_response(
                {"id": rid, "replica": self.name, "echo_len": len(raw), "usage": self.usage}
            )
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "X-Replica": self.name}
        )
        await resp.prepare(request)
        try:
            for i, c in enumerate(self.chunks):
                if self.die_after_chunks is not None and i == self.die_after_chunks:
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                await resp.write(c.replace(b"RID", rid.encode()))
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
            await resp.write_eof()
            self.completed += 1
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted.set()
            raise
        return resp

    async def _response(self, request: web.Request) -> web.Response:
        """vLLM's GET /v1/responses/{id} and POST …/cancel: only the producer knows the id."""
        rid = request.match_info["rid"]
        self.seen.append(Seen(request.path_qs, dict(request.headers), b""))
        if rid not in self.responses:
            err = {"message": f"Response with id '{rid}' not found.",
                   "type": "invalid_request_error", "param": None, "code": 404}  # fmt: skip
            return web.json_response({"error": err}, status=404)
        status = "cancelled" if request.path.endswith("/cancel") else "completed"
        return web.json_response({"id": rid, "replica": self.name, "status": status})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": m, "object": "model", "owned_by": self.name} for m in self.models],
            }
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            text=(
                f'vllm:num_requests_running{{model_name="tiny"}} {self.running}\n'
                f'vllm:num_requests_waiting{{model_name="tiny"}} {self.waiting}\n'
                f'vllm:kv_cache_usage_perc{{model_name="tiny"}} 0.25\n'
            )
        )

    async def start(self) -> FakeReplica:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/v1/responses/{rid}", self._response)
        app.router.add_post("/v1/responses/{rid}/cancel", self._response)
        app.router.add_post("/v1/{tail:.+}", self._infer)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()


def dead_url() -> str:
    """A loopback URL where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
async def fakes() -> AsyncIterator[Callable[..., Any]]:
    started: list[FakeReplica] = []

    async def make(n: int = 2, **knobs: Any) -> list[FakeReplica]:
        out = [await FakeReplica(f"r{len(started) + i}", **knobs).start() for i in range(n)]
        started.extend(out)
        return out

    yield make
    for f in started:
        await f.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def test_sse_passthrough_is_byte_exact_and_headers_are_clean(fakes, router, http):
    (f,) = await fakes(1)
    url, _ = await router([f.url])
    hdrs = {
        "Connection": "keep-alive, X-Hop-Secret",
        "X-Hop-Secret": "1",
        "TE": "trailers",
        "X-Request-Id": "req-123",
        "X-Custom": "kept",
    }
    async with http.post(url + "/v1/chat/completions", json=CHAT, headers=hdrs) as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/event-stream"
        assert r.headers["X-Request-Id"] == "req-123"
        got = await r.read()
    assert got == b"".join(SSE_CHUNKS)
    up = {k.lower(): v for k, v in f.seen[-1].headers.items()}
    assert up["x-request-id"] == "req-123" and up["x-custom"] == "kept"
    assert "x-hop-secret" not in up and "te" not in up
    # a request without an id gets one assigned, the same upstream and back
    async with http.post(url + "/v1/chat/completions", json=CHAT) as r:
        rid = r.headers["X-Request-Id"]
        await r.read()
    up = {k.lower(): v for k, v in f.seen[-1].headers.items()}
    assert len(rid) >= 16 and up["x-request-id"] == rid


async def test_non_streaming_body_and_large_request_pass_unchanged(fakes, router, http):
    (f,) = await fakes(1)
    url, _ = await router([f.url])
    body = orjson.dumps({"model": "tiny", "prompt": "x" * 200_000, "max_tokens": 1})
    async with http.post(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 200
        assert (await r.json())["echo_len"] == len(body)
    assert f.seen[-1].body == body


async def test_client_disconnect_aborts_upstream(fakes, router, http):
    (f,) = await fakes(1, chunk_delay_s=0.05, chunks=[b"data: {}\n\n"] * 400)
    url, _ = await router([f.url])
    async with http.post(url + "/v1/chat/completions", json=CHAT) as r:
        await r.content.readuntil(b"\n\n")
        await r.content.readuntil(b"\n\n")
        r.close()  # the client goes away mid-stream
    await asyncio.wait_for(f.aborted.wait(), timeout=60)
    assert f.completed == 0


async def test_failover_before_first_byte_loses_no_call(fakes, router, http):
    good, bad, doomed = await fakes(3)
    bad.fail_status = 503
    url, app = await router(
        [doomed.url, bad.url, good.url],
        policy="round_robin",
        breaker_failures=2,
        breaker_cooldown_s=60,
    )
    await doomed.stop()  # passed its health check, then died: connections are refused
    results = []
    for _ in range(12):
        async with http.post(url + "/v1/chat/completions", json=CHAT) as r:
            results.append((r.status, await r.read()))
    assert all(s == 200 and b == b"".join(SSE_CHUNKS) for s, b in results)
    assert good.completed == 12
    # both bad replicas tripped their breakers and stopped receiving traffic
    states = {r.url: r.breaker.state for r in app[REPLICAS]}
    assert states[bad.url] == "open" and list(states.values()).count("open") == 2
    assert len(bad.seen) == 2
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    assert "kvroute_retries_total" in text and 'kvroute_breaker_state{replica="' in text


async def test_replica_dying_mid_stream_ends_with_sse_error_event(fakes, router, http):
    (f,) = await fakes(1, die_after_chunks=3)
    url, _ = await router([f.url])
    async with http.post(url + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200
        got = await r.read()
    assert got.startswith(b"".join(SSE_CHUNKS[:3]))
    tail = got[len(b"".join(SSE_CHUNKS[:3])) :]
    assert tail.startswith(b"data: ") and tail.endswith(b"\n\n")
    assert orjson.loads(tail[6:])["error"]["type"] == "upstream_error"
    # Anthropic route: a typed SSE error event
    async with http.post(url + "/v1/messages", json={**CHAT, "max_tokens": 4}) as r:
        got = await r.read()
    assert got.endswith(b"\n\n") and b"event: error\ndata: " in got


async def test_bad_input_gets_clear_errors(fakes, router, http):
    (f,) = await fakes(1)
    url, _ = await router(
        [f.url], max_body_bytes=10_000, client_body_timeout_s=0.5, max_header_bytes=2048
    )
    async with http.post(
        url + "/v1/chat/completions",
        data=b"{not json",
        headers={"Content-Type": "application/json"},
    ) as r:
        assert r.status == 400
        err = (await r.json())["error"]
        assert err["type"] == "invalid_request_error" and "JSON" in err["message"]
    async with http.post(url + "/v1/chat/completions", json={**CHAT, "model": "nope"}) as r:
        assert r.status == 404 and (await r.json())["error"]["type"] == "model_not_found"
    async with http.post(url + "/v1/chat/completions", json={**CHAT, "pad": "x" * 20_000}) as r:
        assert r.status == 413
    async with http.post(
        url + "/v1/chat/completions", json=CHAT, headers={"X-Big": "y" * 4096}
    ) as r:
        assert r.status in (400, 431)
    async with http.post(
        url + "/v1/messages", data=b"[1]", headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 400 and (await r.json())["type"] == "error"
    assert f.seen == []  # none of them reached the replica

    # a client that stops sending its body half-way is cut off with 408
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b'Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{"model":'
    )
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), timeout=60)
    assert b" 408 " in status_line
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


async def test_no_healthy_replica_is_503_with_retry_after(fakes, router, http):
    (f,) = await fakes(1, healthy=False)
    url, _ = await router([f.url, dead_url()])
    async with http.post(url + "/v1/chat/completions", json={**CHAT, "model": None}) as r:
        assert r.status == 503 and int(r.headers["Retry-After"]) >= 1
        assert (await r.json())["error"]["type"] == "service_unavailable"
    async with http.get(url + "/ready") as r:
        assert r.status == 503
    async with http.get(url + "/health") as r:
        assert r.status == 200


async def test_models_union_ready_metrics_and_passthrough(fakes, router, http):
    a, b = await fakes(2)
    b.models = ["tiny", "big"]
    url, _ = await router([a.url, b.url])
    async with http.get(url + "/v1/models") as r:
        assert [m["id"] for m in (await r.json())["data"]] == ["big", "tiny"]
    async with http.get(url + "/ready") as r:
        assert r.status == 200 and (await r.json())["healthy_replicas"] == 2
    # 'big' only lives on b: the serves_model filter must send it there
    for _ in range(4):
        async with http.post(
            url + "/v1/completions", json={"model": "big", "prompt": "p", "user": "u1"}
        ) as r:
            assert (await r.json())["replica"] == b.name
    async with http.post(url + "/v1/embeddings", json={"model": "tiny", "input": "x"}) as r:
        assert r.status == 200
    assert any(s.path == "/v1/embeddings" for s in a.seen + b.seen)
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    assert 'kvroute_requests_total{replica="' + b.url in text
    assert 'route="/v1/*"' in text and "kvroute_added_latency_seconds_count" in text
    assert f'kvroute_inflight{{replica="{a.url}"}} 0.0' in text
    assert "kvroute_active_sessions 1.0" in text  # 'u1' (an embeddings call is no session call)


async def test_upstream_key_is_injected_and_never_echoed_or_logged(fakes, router, http, caplog):
    secret = "sk-upstream-SECRET-42"
    (f,) = await fakes(1)
    f.fail_status = None
    url, app = await router(
        [f.url], upstream_api_key=secret, admin_key="adm", api_keys={"client-key": "team-a"}
    )
    caplog.set_level(logging.DEBUG)
    async with http.post(
        url + "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer client-key"}
    ) as r:
        assert r.status == 200
        raw = await r.read()
        echoed = str(dict(r.headers)) + raw.decode()
    assert f.seen[-1].headers["Authorization"] == f"Bearer {secret}"
    async with http.get(url + "/admin/config", headers={"X-Admin-Key": "adm"}) as r:
        echoed += await r.text()
    async with http.post(url + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 401
    assert secret not in echoed and secret not in caplog.text and secret not in repr(app[REPLICAS])


async def test_dns_name_is_resolved_into_replicas(fakes, router, http):
    (f,) = await fakes(1)
    port = f.url.rsplit(":", 1)[1]
    url, app = await router([], replica_dns=[f"http://localhost:{port}"], dns_interval_s=30)
    # the first resolution and health check run before the app takes traffic
    assert any(r.url == f"http://127.0.0.1:{port}" and r.healthy for r in app[REPLICAS])
    assert {r.source for r in app[REPLICAS]} == {"dns:0"}
    async with http.post(url + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200 and await r.read() == b"".join(SSE_CHUNKS)


async def test_prompt_analyzer_state_providers_and_observers_are_wired(fakes, http):
    reps = await fakes(4)
    seen_outcomes: list[tuple[Any, Any]] = []

    def analyzer(ctx):  # what the KV-aware engineer plugs in: token ids and block keys
        ctx.token_ids = [1, 2, 3]
        ctx.block_keys = [int(ctx.body["messages"][0]["content"])] * 4

    app = build_app(
        RouterConfig(
            replicas=[r.url for r in reps],
            admin_key="adm",
            health_interval_s=30,
            scheduling={
                "scorers": [
                    {"type": "prefix_hash", "weight": 1.0},
                    {"type": "test_index_reader", "weight": 0.0},
                ]
            },
        ),
        analyzer=analyzer,
        state_providers={"block_index": lambda: {"version": 7}},
        observers=[lambda ctx, out: seen_outcomes.append((out, ctx.block_keys))],
    )
    runner, url = await start_site(app)
    try:
        picks = {}
        for key in ("5", "5", "9"):
            body = {"model": "tiny", "messages": [{"role": "user", "content": key}]}
            async with http.post(
                url + "/admin/route?explain=1", json=body, headers={"X-Admin-Key": "adm"}
            ) as r:
                picks.setdefault(key, set()).add((await r.json())["winner"])
            async with http.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
        assert len(picks["5"]) == 1
        done = [(o, keys) for o, keys in seen_outcomes if o.replica is not None]
        assert [keys for _, keys in done] == [[5] * 4, [5] * 4, [9] * 4]
        assert all(o.status == "200" and o.bytes > 0 and o.decision is not None for o, _ in done)
        assert all(o.decision.endpoint.name == o.replica for o, _ in done)
        # the three explain calls were dry runs: observed, with no replica
        assert [o.status for o, _ in seen_outcomes if o.replica is None] == ["dry_run"] * 3
        assert INDEX_SEEN and all(s == {"version": 7} for s in INDEX_SEEN)
    finally:
        await runner.cleanup()


INDEX_SEEN: list[Any] = []


async def test_every_analyzed_request_is_observed_exactly_once(fakes, http):
    """Whatever the end (answer, no replica, client gone, dry run), observers hear of each
    analyzed request once, so what an analyzer counts up (sessions in flight) comes down."""
    (slow,) = await fakes(1, chunk_delay_s=0.05, chunks=[b"data: {}\n\n"] * 400)
    counted: dict[str, int] = {}

    def analyzer(ctx):
        counted[ctx.request_id] = counted.get(ctx.request_id, 0) + 1

    def observer(ctx, out):
        counted[ctx.request_id] -= 1
        ends.append(out.status)
        if len(ends) == 3:
            all_seen.set()

    ends: list[str] = []
    all_seen = asyncio.Event()
    runners = []
    try:
        apps = []
        for urls in ([slow.url], [dead_url()]):
            app = build_app(RouterConfig(replicas=urls, admin_key="adm", health_interval_s=30,
                                         retries=0),
                            analyzer=analyzer, observers=[observer])  # fmt: skip
            runner, url = await start_site(app)
            runners.append(runner)
            apps.append(url)
        live, dead = apps
        async with http.post(live + "/v1/chat/completions", json=CHAT) as r:  # client leaves
            await r.content.readuntil(b"\n\n")
            r.close()
        await asyncio.wait_for(slow.aborted.wait(), timeout=60)
        async with http.post(dead + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 503  # nothing listens there
        async with http.post(live + "/admin/route", json=CHAT,
                             headers={"X-Admin-Key": "adm"}) as r:  # fmt: skip
            assert r.status == 200
        await asyncio.wait_for(all_seen.wait(), timeout=60)
        assert len(counted) == 3 and all(v == 0 for v in counted.values()), counted
        assert sorted(ends) == ["dry_run", "not_completed", "not_completed"]
    finally:
        for r in runners:
            await r.cleanup()


def _register_index_reader() -> None:
    from router.scheduling.registry import register

    @register("scorer", "test_index_reader")
    def _make() -> Any:
        class IndexReader:
            name = "test_index_reader"

            def score(self, ctx, snap, endpoints):
                INDEX_SEEN.append(snap.state("block_index"))
                return {}

        return IndexReader()


_register_index_reader()


async def test_open_breaker_lets_a_half_open_probe_through_after_cooldown(fakes, router, http):
    a, b = await fakes(2)
    url, app = await router([a.url, b.url], policy="round_robin", breaker_failures=1,
                            breaker_cooldown_s=3600)  # fmt: skip
    a.fail_status = 503
    for _ in range(4):
        async with http.post(url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
    brk = app[REPLICAS].get(a.url).breaker
    assert brk.state == "open" and len(a.seen) == 1  # no traffic while open
    a.fail_status = None  # the replica recovers; pretend the cooldown has passed
    brk.opened_at -= 7200
    for _ in range(4):
        async with http.post(url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
    assert brk.state == "closed" and len(a.seen) >= 2  # the probe succeeded: traffic is back
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    assert f'kvroute_breaker_state{{replica="{a.url}"}} 0.0' in text
    assert "kvroute_ttft_seconds_count" in text and "kvroute_tpot_seconds_count" in text


async def test_responses_and_messages_routes_proxy_non_streaming(fakes, router, http):
    (f,) = await fakes(1)
    url, app = await router([f.url], admin_key="adm")
    for path, body in [
        ("/v1/responses", {"model": "tiny", "input": "hi"}),
        ("/v1/messages", {"model": "tiny", "max_tokens": 4, "system": "s", "messages": []}),
    ]:
        async with http.post(url + path, json=body) as r:
            assert r.status == 200 and (await r.json())["replica"] == f.name
        assert f.seen[-1].path == path
    async with http.get(url + "/admin/replicas", headers={"X-Admin-Key": "adm"}) as r:
        (rep,) = await r.json()
    assert rep["url"] == f.url and rep["healthy"] and rep["models"] == ["tiny"]
    assert rep["breaker"] == "closed" and rep["inflight"] == 0
    # the async /metrics scrape (what metrics_loop runs every metrics_interval_s)
    f.running, f.waiting = 2.0, 5.0
    await app[MONITOR].scrape_all()
    async with http.get(url + "/admin/replicas", headers={"X-Admin-Key": "adm"}) as r:
        (rep,) = await r.json()
    assert (rep["running"], rep["waiting"], rep["kv_usage"]) == (2.0, 5.0, 0.25)


async def test_a_replica_silent_past_read_timeout_is_retried_elsewhere(fakes, router, http):
    slow, fast = await fakes(2)
    slow.delay_s = 5.0  # never answers within the router's read timeout
    url, _ = await router([slow.url, fast.url], policy="round_robin", read_timeout_s=0.3)
    for _ in range(3):
        async with http.post(url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200 and await r.read() == b"".join(SSE_CHUNKS)
    assert fast.completed == 3 and len(slow.seen) >= 1
    async with http.get(url + "/metrics") as r:
        assert 'kvroute_retries_total{reason="no_response"}' in await r.text()


async def test_kubernetes_endpointslice_discovery_against_a_loopback_api(fakes, router, http,
                                                                         tmp_path):  # fmt: skip
    reps = await fakes(2)
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("tok-1\n")
    state: dict[str, Any] = {"ready": [True, True], "fail": False, "seen": []}

    def slices() -> dict[str, Any]:
        items = []
        for rep, ready in zip(reps, state["ready"], strict=True):
            port = int(rep.url.rsplit(":", 1)[1])
            items.append({
                "addressType": "IPv4",
                "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": ready}}],
                "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            })  # fmt: skip
        return {"kind": "EndpointSliceList", "items": items}

    async def list_slices(request: web.Request) -> web.Response:
        state["seen"].append((request.path, request.query.get("labelSelector"),
                              request.headers.get("Authorization")))  # fmt: skip
        if state["fail"]:
            return web.Response(status=500)
        return web.json_response(slices())

    api = web.Application()
    api.router.add_get("/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices", list_slices)
    api_runner = web.AppRunner(api, access_log=None)
    await api_runner.setup()
    site = web.TCPSite(api_runner, "127.0.0.1", 0)
    await site.start()
    api_url = f"http://127.0.0.1:{api_runner.addresses[0][1]}"
    try:
        url, app = await router(
            [],
            k8s_service="vllm",
            k8s_namespace="llm",
            k8s_port_name="http",
            k8s_api_url=api_url,
            k8s_sa_dir=str(sa),
            k8s_interval_s=3600,
        )
        assert {r.url for r in app[REPLICAS]} == {r.url for r in reps}  # before any traffic
        assert all(r.healthy and r.source == "k8s" for r in app[REPLICAS])
        assert state["seen"][0] == (
            "/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices",
            "kubernetes.io/service-name=vllm",
            "Bearer tok-1",
        )
        async with http.post(url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
        state["ready"] = [True, False]  # the second pod is not ready any more
        (sa / "token").write_text("tok-2\n")  # rotated by the kubelet
        assert await app[MONITOR].discovery.poll_k8s()
        assert {r.url for r in app[REPLICAS]} == {reps[0].url}
        assert state["seen"][-1][2] == "Bearer tok-2"
        state["fail"] = True  # the API server has a bad moment: keep the last answer
        assert not await app[MONITOR].discovery.poll_k8s()
        assert {r.url for r in app[REPLICAS]} == {reps[0].url}
    finally:
        await api_runner.cleanup()


async def test_model_whose_replicas_are_all_down_is_503_not_404(fakes, router, http):
    (f,) = await fakes(1)
    url, app = await router([f.url])
    app[REPLICAS].get(f.url).healthy = False  # as after a failed health check: models kept
    async with http.post(url + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 503 and "Retry-After" in r.headers  # retryable, not "unknown"
    async with http.post(url + "/v1/chat/completions", json={**CHAT, "model": "nope"}) as r:
        assert r.status == 404 and (await r.json())["error"]["type"] == "model_not_found"


# --- Responses ids, usage of every API, replica errors in the client's API shape ----------

RESPONSES_STREAM = [
    b'event: response.created\ndata: {"type":"response.created","sequence_number":0,'
    b'"response":{"id":"RID","status":"in_progress","usage":null}}\n\n',
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
    b'"sequence_number":1,"delta":"hi"}\n\n',
    # the last event repeats the whole response (instructions, tools): longer than 4 KB
    b'event: response.completed\ndata: {"type":"response.completed","sequence_number":2,'
    b'"response":{"id":"RID","instructions":"' + b"be brief " * 800 + b'","status":"completed",'
    b'"usage":{"input_tokens":50,"input_tokens_details":{"cached_tokens":32},'
    b'"output_tokens":4,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":54},'
    b'"user":null}}\n\n',
]
ANTHROPIC_STREAM = [
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":'
    b'"message","role":"assistant","content":[],"usage":{"input_tokens":7,'
    b'"cache_creation_input_tokens":0,"cache_read_input_tokens":64,"output_tokens":0}}}\n\n',
    *[
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"' + b"w" * 200 + b'"}}\n\n'
    ]
    * 30,  # > 4 KB
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
    b'"usage":{"output_tokens":20}}\n\n',
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
]


async def test_responses_by_id_go_to_the_replica_that_produced_them(fakes, router, http):
    reps = await fakes(3)
    url, _ = await router([r.url for r in reps], policy="round_robin")
    made: dict[str, str] = {}  # response id -> the replica that produced it
    for _ in range(3):
        async with http.post(url + "/v1/responses", json={"model": "tiny", "input": "hi"}) as r:
            out = await r.json()
        made[out["id"]] = out["replica"]
    for r in reps:
        r.chunks = list(RESPONSES_STREAM)
    body = {"model": "tiny", "input": "hi", "stream": True}
    async with http.post(url + "/v1/responses", json=body) as r:
        first = (await r.read()).split(b"\n\n")[0]
    rid = orjson.loads(first.split(b"data: ")[1])["response"]["id"]
    made[rid] = next(f.name for f in reps if rid in f.responses)
    assert len(set(made.values())) == 3  # produced on every replica
    for rid, owner in made.items():
        async with http.get(url + f"/v1/responses/{rid}") as r:
            assert r.status == 200 and (await r.json())["replica"] == owner
        async with http.post(url + f"/v1/responses/{rid}/cancel") as r:
            got = await r.json()
            assert r.status == 200 and got == {"id": rid, "replica": owner, "status": "cancelled"}
    # only the owner was asked: the router knew where each id lives
    for f in reps:
        asked = [s.path.split("/")[3] for s in f.seen if s.path.startswith("/v1/responses/")]
        assert set(asked) == {i for i, o in made.items() if o == f.name}, (f.name, asked)
    # a router that never saw the id (another process, a restart) finds it on its replica
    url2, _ = await router([r.url for r in reps])
    rid, owner = next(iter(made.items()))
    async with http.get(url2 + f"/v1/responses/{rid}?stream=false") as r:
        assert r.status == 200 and (await r.json())["replica"] == owner
    assert reps[[f.name for f in reps].index(owner)].seen[-1].path.endswith("?stream=false")
    async with http.get(url2 + "/v1/responses/resp_nowhere") as r:  # on no replica
        assert r.status == 404
        err = (await r.json())["error"]
        assert err["code"] == 404 and "resp_nowhere" in err["message"]
    async with http.get(url + "/v1/responses/a%20b%3Fc") as r:  # not put in a path as it is
        assert r.status == 404
    assert not any("%20" in s.path or " " in s.path for f in reps for s in f.seen)
    async with http.get(url2 + "/metrics") as r:
        text = await r.text()
    assert 'route="/v1/responses/{response_id}"' in text


async def test_usage_of_every_api_reaches_the_token_metrics(fakes, router, http):
    (f,) = await fakes(1)
    url, _ = await router([f.url])
    # Anthropic: input_tokens is the uncached rest; the cache read is the cached part
    f.usage = {"input_tokens": 10, "cache_read_input_tokens": 90,
               "cache_creation_input_tokens": 5, "output_tokens": 3}  # fmt: skip
    msgs = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    async with http.post(url + "/v1/messages", json=msgs) as r:
        assert r.status == 200
    # Responses: input_tokens is the whole prompt, cached in input_tokens_details
    f.usage = {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 16},
               "output_tokens": 2}  # fmt: skip
    async with http.post(url + "/v1/responses", json={"model": "tiny", "input": "x"}) as r:
        assert r.status == 200
    # streamed: Anthropic's prompt counts come in message_start, Responses' in the last event
    f.chunks = list(ANTHROPIC_STREAM)
    async with http.post(url + "/v1/messages", json={**msgs, "stream": True}) as r:
        assert r.status == 200 and len(await r.read()) > 4096
    f.chunks = list(RESPONSES_STREAM)
    body = {"model": "tiny", "input": "x", "stream": True}
    async with http.post(url + "/v1/responses", json=body) as r:
        assert r.status == 200
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    assert 'kvroute_prompt_tokens_total{model="tiny"} 266.0' in text  # 105 + 40 + 71 + 50
    assert 'kvroute_prompt_tokens_cached_total{model="tiny"} 202.0' in text  # 90+16+64+32


async def test_replica_errors_reach_the_client_in_its_api_shape(fakes, router, http):
    (f,) = await fakes(1)
    url, _ = await router([f.url])
    msgs = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    chat = "/v1/chat/completions"
    # vLLM's OpenAI-shaped 400 (e.g. a Messages call without max_tokens) on Anthropic routes
    f.fail_status = 400
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        async with http.post(url + path, json=msgs) as r:
            assert r.status == 400 and r.content_type == "application/json"
            assert await r.json() == {
                "type": "error", "error": {"type": "invalid_request_error", "message": "injected"}
            }  # fmt: skip
    async with http.post(url + chat, json=msgs) as r:  # already OpenAI's: as it came
        assert r.status == 400 and await r.json() == {"error": {"message": "injected"}}
    # a plain-text error page, sized or chunked
    f.fail_status, f.fail_text = 404, "404: Not Found (no route /v1/messages here)"
    for chunked in (False, True):
        f.fail_chunked = chunked
        async with http.post(url + "/v1/messages", json=msgs) as r:
            assert r.status == 404 and r.content_type == "application/json"
            assert await r.json() == {"type": "error", "error": {
                "type": "not_found_error", "message": f.fail_text}}  # fmt: skip
        async with http.post(url + chat, json=msgs) as r:
            assert r.status == 404 and r.content_type == "application/json"
            assert await r.json() == {"error": {"message": f.fail_text, "type": "not_found",
                                                "param": None, "code": 404}}  # fmt: skip
    # FastAPI's validation error shape keeps its detail
    f.fail_status, f.fail_text, f.fail_chunked = 422, '{"detail":[{"msg":"field required"}]}', False
    async with http.post(url + "/v1/messages", json=msgs) as r:
        got = await r.json()
        assert r.status == 422 and got["error"]["type"] == "invalid_request_error"
        assert "field required" in got["error"]["message"]


async def test_a_response_id_is_its_tenants_only(fakes, router, http):
    reps = await fakes(2)
    url, _ = await router([r.url for r in reps], api_keys={"ka": "alpha", "kb": "beta"})
    a, b = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
    async with http.post(url + "/v1/responses", json={"model": "tiny", "input": "hi"},
                         headers=a) as r:  # fmt: skip
        rid = (await r.json())["id"]
    asked = sum(len(f.seen) for f in reps)
    for path in (f"/v1/responses/{rid}", f"/v1/responses/{rid}/cancel"):
        call = http.get if path.endswith(rid) else http.post
        async with call(url + path, headers=b) as r:
            assert r.status == 404
        async with call(url + path) as r:  # no key at all
            assert r.status == 401
    assert sum(len(f.seen) for f in reps) == asked  # no replica was asked
    async with http.get(url + f"/v1/responses/{rid}", headers=a) as r:
        assert r.status == 200 and (await r.json())["id"] == rid
