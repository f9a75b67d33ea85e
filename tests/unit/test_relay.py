"""router.relay without a replica: the Responses stream's opening events, and the 503 for a
call the router's own connection limit held back. Streaming, retries and aborts against live
servers: tests/integration/test_router_proxy.py and test_router_streams.py."""

from __future__ import annotations

import orjson

from router.metrics import RouterMetrics
from router.relay import pool_full, response_head
from router.scheduling import RequestContext
from router.sessions import identify
from router.upstream import PoolTimeout


def test_only_the_opening_events_are_a_responses_head():
    created = b'event: response.created\ndata: {"id": "r"}\n\n'
    progress = b"event: response.in_progress\ndata: {}\n\n"
    delta = b'event: response.output_text.delta\ndata: {"delta": "Hi"}\n\n'
    assert response_head(created) and response_head(created + progress)
    assert not response_head(created + delta)  # the first token came with them
    assert not response_head(b"") and not response_head(b'data: {"choices": []}\n\n')


def test_pool_full_names_the_limit_and_blames_no_replica():
    m = RouterMetrics()
    ctx = RequestContext("rid", "/v1/messages", "m", identify({}, {}), {})
    resp = pool_full(ctx, "/v1/messages", 2.5, PoolTimeout("max_connections", 8, 1.0), m)
    assert resp.status == 503 and resp.headers["Retry-After"] == "2"
    assert resp.headers["X-Request-Id"] == "rid"
    body = orjson.loads(resp.body)
    assert body["type"] == "error" and "max_connections=8" in body["error"]["message"]
    text = m.exposition().decode()
    assert 'kvroute_requests_total{replica="-",route="/v1/messages",status="503"} 1.0' in text
