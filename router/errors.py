"""Error shapes and request ids: what the router answers when it answers for itself.

Owns: the OpenAI-style error body (Anthropic-style on ``/v1/messages``), the JSON error
response, the SSE error event a stream ends with when its replica fails mid-stream, and the
request id (a client's ``X-Request-Id`` when it is sane, else a fresh one). Pure: no state.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

import orjson
from aiohttp import web


def error_body(route: str, status: int, message: str, etype: str) -> bytes:
    """OpenAI-style error (Anthropic-style on /v1/messages)."""
    if route == "/v1/messages":
        return orjson.dumps({"type": "error", "error": {"type": etype, "message": message}})
    return orjson.dumps(
        {"error": {"message": message, "type": etype, "param": None, "code": status}}
    )


def error_response(
    route: str,
    status: int,
    message: str,
    etype: str = "invalid_request_error",
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    return web.Response(
        status=status, body=error_body(route, status, message, etype),
        content_type="application/json", headers=headers,
    )  # fmt: skip


def sse_error_event(route: str, message: str) -> bytes:
    if route == "/v1/messages":
        payload = orjson.dumps(
            {"type": "error", "error": {"type": "api_error", "message": message}}
        )
        return b"event: error\ndata: " + payload + b"\n\n"
    payload = orjson.dumps(
        {"error": {"message": message, "type": "upstream_error", "param": None, "code": 502}}
    )
    return b"data: " + payload + b"\n\n"


def request_id(headers: Mapping[str, str]) -> str:
    rid = headers.get("x-request-id", "")
    if 0 < len(rid) <= 128 and rid.isprintable() and " " not in rid:
        return rid
    return uuid.uuid4().hex
