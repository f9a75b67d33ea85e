"""The fuzz tier: hostile and mutated requests over every public endpoint of a live router in
front of a fake replica — 0 router 5xx, every error a JSON body.

Two generators: a hypothesis one of raw HTTP requests (method, path from the served routes
mutated with dot segments, encodings and junk, header lines with arbitrary bytes, bodies from
valid API shapes, mutated JSON, deep nesting, random bytes, gzip or not), sent as bytes over a
socket, and schemathesis over the router's own ``/openapi.json``. ``KVROUTE_FUZZ_CASES`` sets
the hypothesis count (default 10,000: ~90 s on the 2-core dev VM, see docs/reliability.md);
``KVROUTE_FUZZ_SCHEMA_CASES`` the schemathesis examples per operation.
"""

from __future__ import annotations

import asyncio
import gzip
import os
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.app import build_app, start_site
from router.config import RouterConfig
from tests.integration.test_router_proxy import FakeReplica

pytestmark = pytest.mark.timeout(600)

CASES = int(os.environ.get("KVROUTE_FUZZ_CASES", "10000"))
SCHEMA_CASES = int(os.environ.get("KVROUTE_FUZZ_SCHEMA_CASES", "40"))

ROUTES = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
    "/v1/models",
    "/v1/models/tiny",
    "/health",
    "/ready",
    "/metrics",
    "/openapi.json",
    "/admin/replicas",
    "/admin/sessions",
    "/admin/config",
    "/admin/route",
]
HEADER_NAMES = [
    "Authorization", "X-Api-Key", "X-Admin-Key", "Cookie", "X-Session-ID",
    "x-claude-code-session-id", "x-claude-code-agent-id", "x-claude-code-parent-agent-id",
    "session_id", "session-id", "X-Dynamo-Session-ID", "X-Dynamo-Session-Final",
    "X-SMG-Routing-Key", "x-session-token", "X-Correlation-ID", "X-Request-Id",
    "Content-Type", "Accept", "Connection", "Transfer-Encoding", "Expect", "Range",
]  # fmt: skip
KEYS = ["model", "messages", "prompt", "input", "system", "instructions", "stream", "tools",
        "tool_choice", "max_tokens", "role", "content", "type", "text", "user",
        "prompt_cache_key", "cache_salt", "session_id", "stream_options", "n"]  # fmt: skip


class RouterThread:
    """A router and a fake replica on their own event loop in a thread (hypothesis drives
    synchronous examples; each is a blocking socket exchange)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.url = ""
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        fake = await FakeReplica("r0").start()
        cfg = RouterConfig(
            replicas=[fake.url], admin_key="adm", api_keys={"k": "t", "k2": "t2"},
            health_interval_s=30, metrics_interval_s=30, max_body_bytes=1 << 20,
            header_timeout_s=5, client_body_timeout_s=2,
        )  # fmt: skip
        runner, self.url = await start_site(build_app(cfg))
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()
        await fake.stop()

    def start(self) -> RouterThread:
        self._thread.start()
        assert self._ready.wait(30)
        return self

    def stop(self) -> None:
        assert self._stop is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


@pytest.fixture(scope="module")
def live() -> Iterator[RouterThread]:
    rt = RouterThread().start()
    yield rt
    rt.stop()


def exchange(url: str, data: bytes) -> tuple[int, dict[str, str], bytes] | None:
    """Send ``data``; the response's status, headers and (de-chunked) body, or None when the
    server closed the connection without answering."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        buf = b""
        need: int | None = None
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
            if need is None and b"\r\n\r\n" in buf:
                head = buf.split(b"\r\n\r\n", 1)[0].lower()
                for ln in head.split(b"\r\n"):
                    if ln.startswith(b"content-length:"):
                        need = len(head) + 4 + int(ln.split(b":", 1)[1])
                if b"transfer-encoding: chunked" in head:
                    need = -1
            if need is not None and need >= 0 and len(buf) >= need:
                break
            if need == -1 and buf.endswith(b"0\r\n\r\n"):
                break
    if not buf:
        return None
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for ln in lines[1:]:
        k, _, v = ln.partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        out, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            n = int(size_line.split(b";")[0] or b"0", 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2 :]
        body = out
    return status, headers, body


# ---- strategies --------------------------------------------------------------------------

_path_junk = st.sampled_from(
    [
        "",
        "/",
        "/..",
        "/%2e%2e",
        "/%2E%2E/tokenize",
        "/./x",
        "%00",
        "%ff",
        "/%2f",
        "//",
        "?x=1",
        "?limit=-1",
        "?limit=abc",
        "?explain=1&route=/v1/messages",
        "#f",
        "\\..",
        "/reset_prefix_cache",
        "%20",
        "/%c3%28",
    ]
)
paths = st.one_of(
    st.sampled_from(ROUTES),
    st.builds(lambda r, j: r + j, st.sampled_from(ROUTES), _path_junk),
    st.builds(lambda j: "/v1" + j, _path_junk),
    st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=40).map(lambda t: "/" + t),
)
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False),
    st.text(max_size=40), st.sampled_from(["tiny", "nope", "", "auto", "user", "assistant"]),
)  # fmt: skip
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=8)), inner, max_size=5),
    ),
    max_leaves=8,
)
valid_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["tiny", "nope"])},
    optional={
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "system", "assistant", "tool"]),
                    "content": st.one_of(st.text(max_size=30), json_values),
                }
            ),
            max_size=3,
        ),
        "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(0, 5000), max_size=5)),
        "input": json_values,
        "system": json_values,
        "stream": st.one_of(st.booleans(), json_scalars),
        "max_tokens": json_scalars,
        "user": json_scalars,
        "tools": json_values,
    },
)


def _deep(n: int) -> bytes:
    return b'{"messages":' + b"[" * n + b"]" * n + b"}"


bodies = st.one_of(
    valid_bodies.map(orjson.dumps),
    json_values.map(orjson.dumps),
    st.binary(max_size=200),
    st.builds(
        lambda b, i, c: b[:i] + c + b[i + 1 :],
        valid_bodies.map(orjson.dumps),
        st.integers(0, 60),
        st.binary(min_size=1, max_size=3),
    ),
    st.sampled_from([_deep(990), _deep(1100), b"", b"null", b"[]", b'"x"', b"{" * 5000]),
)


def _no_crlf(b: bytes) -> bytes:
    return b.replace(b"\r", b"").replace(b"\n", b"")


header_values = st.one_of(
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30).map(str.encode),
    st.binary(max_size=30).map(_no_crlf),
    st.sampled_from(
        [
            b"Bearer k",
            b"Bearer k2",
            b"adm",
            b"\xff\xfe",
            b"\xc3\x28",
            b"gzip",
            b"close",
            b"chunked",
            b"100-continue",
            b"true",
        ]
    ),
)
header_lines = st.lists(
    st.one_of(
        st.builds(
            lambda n, v: n.encode() + b": " + v, st.sampled_from(HEADER_NAMES), header_values
        ),
        st.binary(max_size=40).map(_no_crlf),
    ),
    max_size=5,
)
methods = st.sampled_from([b"GET", b"POST", b"POST", b"POST", b"PUT", b"DELETE", b"HEAD",
                           b"OPTIONS", b"PATCH", b"BREW", b"CONNECT"])  # fmt: skip


@st.composite
def requests(draw: Any) -> bytes:
    method = draw(methods)
    path = draw(paths).encode("utf-8", "surrogateescape")
    body = draw(bodies)
    lines = draw(header_lines)
    if draw(st.booleans()):
        lines.append(b"Authorization: Bearer k")
    if draw(st.integers(0, 9)) == 0:
        body = gzip.compress(body) if draw(st.booleans()) else body
        lines.append(b"Content-Encoding: gzip")
    head = method + b" " + path + b" HTTP/1.1\r\nHost: x\r\n"
    if body or method == b"POST":
        lines.append(b"Content-Length: " + str(len(body)).encode())
    return head + b"".join(ln + b"\r\n" for ln in lines) + b"Connection: close\r\n\r\n" + body


def check(data: bytes, status: int, headers: dict[str, str], body: bytes) -> None:
    assert status < 500, (status, data[:300], body[:300])
    if status >= 400 and not data.startswith(b"HEAD "):
        assert headers.get("content-type", "").startswith("application/json"), (status, data)
        doc = orjson.loads(body)
        assert isinstance(doc, dict) and "error" in doc, (status, body)


BATCH = 20  # requests per hypothesis example, sent concurrently (amortizes its overhead)
_POOL = ThreadPoolExecutor(8)
SENT = {"n": 0}
SILENT: list[bytes] = []


def _one(url: str, data: bytes) -> None:
    got = exchange(url, data)
    if got is None:  # counted and reported; the count is asserted below
        SILENT.append(data)
        return
    check(data, *got)


@settings(max_examples=max(1, CASES // BATCH), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))  # fmt: skip
@given(st.lists(requests(), min_size=BATCH, max_size=BATCH))
def test_hostile_requests_get_no_5xx_and_json_errors(live: RouterThread, batch: list[bytes]):
    for f in [_POOL.submit(_one, live.url, data) for data in batch]:
        f.result()
    SENT["n"] += len(batch)


def test_fuzz_case_count_is_what_was_asked(live: RouterThread) -> None:
    # runs after the fuzz test (file order): the figure in docs/reliability.md is this count
    assert SENT["n"] >= (CASES // BATCH) * BATCH, SENT
    assert not SILENT, (len(SILENT), SILENT[:3])  # every request got an answer


def test_openapi_document_lists_every_route(live: RouterThread) -> None:
    got = exchange(live.url, b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n")
    assert got is not None
    status, _, body = got
    doc = orjson.loads(body)
    assert status == 200 and doc["openapi"].startswith("3.")
    from router.api import INFERENCE_ROUTES, PASSTHROUGH_ROUTES

    for p in (*INFERENCE_ROUTES, *PASSTHROUGH_ROUTES, "/v1/models", "/v1/models/{model}",
              "/health", "/ready", "/metrics", "/admin/route", "/admin/replicas"):  # fmt: skip
        assert p in doc["paths"], p


def test_schemathesis_over_the_served_openapi_document(live: RouterThread) -> None:
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import given as sgiven

    schema = schemathesis.openapi.from_url(live.url + "/openapi.json")
    failures: list[str] = []
    ran = 0
    for result in schema.get_all_operations():
        op = result.ok()

        @settings(max_examples=SCHEMA_CASES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @sgiven(case=op.as_strategy())
        def one(case: Any) -> None:
            nonlocal ran
            ran += 1
            resp = case.call(base_url=live.url)
            if resp.status_code >= 500:
                failures.append(f"{case.method} {case.path}: {resp.status_code}")
            elif resp.status_code >= 400:
                ct = resp.headers.get("content-type") or ""
                ct = ct[0] if isinstance(ct, list) else ct
                if not ct.startswith("application/json"):
                    failures.append(f"{case.method} {case.path}: {resp.status_code} {ct}")

        one()
    print(f"schemathesis: {ran} cases")
    assert ran > 0 and not failures, failures[:10]
