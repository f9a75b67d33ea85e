"""The router sends its session-level priority upstream (``priority: session``) in
``X-Vllm-Priority``, replacing the client's; off by default, it leaves the request alone."""

from __future__ import annotations

from tests.integration.test_router_proxy import fakes, http  # noqa: F401

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def _sent(f) -> int:
    return int({k.lower(): v for k, v in f.seen[-1].headers.items()}["x-vllm-priority"])


async def test_priority_follows_attained_service(fakes, router, http):  # noqa: F811
    (f,) = await fakes(1)
    f.usage = {"prompt_tokens": 200_000, "completion_tokens": 1000}
    url, _ = await router([f.url], priority="session")
    long_s = {"Content-Type": "application/json", "x-session-id": "long"}
    async with http.post(url + "/v1/chat/completions", json=BODY, headers=long_s) as r:
        assert r.status == 200
    first = _sent(f)
    # the session has had ~200k tokens of service: its next call ranks behind a new one's,
    # even though the new one arrives later; a client's own vLLM priority is replaced
    async with http.post(url + "/v1/chat/completions", json=BODY,
                         headers={**long_s, "X-Vllm-Priority": "-1000000"}) as r:  # fmt: skip
        assert r.status == 200
    second = _sent(f)
    new_s = {"Content-Type": "application/json", "x-session-id": "new"}
    async with http.post(url + "/v1/chat/completions", json=BODY, headers=new_s) as r:
        assert r.status == 200
    fresh = _sent(f)
    assert second > fresh > -1000000
    assert second - first >= 10  # several levels (of level_s / tick_s = 20 ticks each) later


async def test_priority_off_by_default_leaves_headers_alone(fakes, router, http):  # noqa: F811
    (f,) = await fakes(1)
    url, _ = await router([f.url])
    async with http.post(url + "/v1/chat/completions", json=BODY,
                         headers={"Content-Type": "application/json", "x-session-id": "s",
                                  "X-Vllm-Priority": "3"}) as r:  # fmt: skip
        assert r.status == 200
    assert _sent(f) == 3


async def test_metrics_show_service_and_wait_by_priority_class(fakes, router, http):  # noqa: F811
    (f,) = await fakes(1)
    f.usage = {"prompt_tokens": 300_000, "completion_tokens": 100,
               "prompt_tokens_details": {"cached_tokens": 100_000}}  # fmt: skip
    url, _ = await router([f.url], priority="session")
    hdr = {"Content-Type": "application/json", "X-Dynamo-Session-ID": "d1"}
    async with http.post(url + "/v1/chat/completions", json=BODY, headers=hdr) as r:
        assert r.status == 200
    async with http.post(url + "/v1/chat/completions", json=BODY,
                         headers={**hdr, "X-Dynamo-Session-Final": "true"}) as r:  # fmt: skip
        assert r.status == 200
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    lines = dict(ln.rsplit(" ", 1) for ln in text.splitlines() if ln and ln[0] != "#")
    # first call: a new session (high); second: ~200k tokens of service (low)
    assert float(lines['kvroute_priority_ttft_seconds_count{priority_class="high"}']) == 1
    assert float(lines['kvroute_priority_ttft_seconds_count{priority_class="low"}']) == 1
    # the session ended (final): its attained service is 2 x (300k - 100k cached + 100)
    assert float(lines["kvroute_session_service_tokens_sum"]) == 2 * 200_100
    assert float(lines["kvroute_session_service_tokens_count"]) == 1


async def test_admin_route_explains_the_priority(fakes, router, http):  # noqa: F811
    (f,) = await fakes(1)
    f.usage = {"prompt_tokens": 50_000, "completion_tokens": 0}
    url, _ = await router([f.url], priority="session", admin_key="adm")
    hdr = {"Content-Type": "application/json", "x-session-id": "e"}
    async with http.post(url + "/v1/chat/completions", json=BODY, headers=hdr) as r:
        assert r.status == 200
    body = {**BODY, "nvext": {"agent_hints": {"priority": 1}}}
    async with http.post(url + "/admin/route?explain=1", json=body,
                         headers={**hdr, "X-Admin-Key": "adm"}) as r:  # fmt: skip
        out = await r.json()
    p = out["priority"]
    assert p["service_tokens"] == 50_000 and p["role"] == "plain" and p["client_hint"] == 1
    assert p["level"] == 3 - 1  # floor(log2(1 + 50000/4096)) = 3, less the hint's level
    assert p["bound_s"] == 18.0


async def test_admission_holds_calls_while_every_replica_is_full(fakes, router, http):  # noqa: F811
    import asyncio

    (f,) = await fakes(1)
    f.waiting = 50  # vLLM's queue is long: the replica is full
    url, _ = await router([f.url], admission="on", admission_timeout_s=1.0,
                          metrics_interval_s=0.05, priority="session")  # fmt: skip
    await asyncio.sleep(0.3)  # a scrape has seen it
    hdr = {"Content-Type": "application/json", "x-session-id": "w"}
    n = len(f.seen)
    async with http.post(url + "/v1/chat/completions", json=BODY, headers=hdr) as r:
        assert r.status == 503 and int(r.headers["Retry-After"]) >= 1
        assert (await r.json())["error"]["type"] == "service_unavailable"
    async with http.post(url + "/v1/messages", json=BODY, headers=hdr) as r:
        assert r.status == 503  # Anthropic shape
        assert (await r.json())["error"]["type"] == "overloaded_error"
    assert len(f.seen) == n  # nothing was pushed onto the full replica
    # a waiting call goes on once a scrape shows room
    call = asyncio.create_task(http.post(url + "/v1/chat/completions", json=BODY, headers=hdr))
    await asyncio.sleep(0.1)
    f.waiting = 0
    async with await call as r:
        assert r.status == 200
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    assert 'kvroute_admission_refused_total{reason="timeout"} 2.0' in text
    assert 'kvroute_admission_wait_seconds_count{priority_class="high"} 1.0' in text
