"""Error shapes and request ids: what the router answers when it answers for itself.

Owns: the error body of each API family — OpenAI-style everywhere, Anthropic-style on
``/v1/messages`` and every path under it (``/v1/messages/count_tokens``), with Anthropic's
type names by status — the JSON error response, the SSE error event a stream ends with when
its replica fails mid-stream, and the request id (a client's ``X-Request-Id`` when it is sane,
else a fresh one). Messages never carry request bytes (paths, header values, body text): a
caller passes fixed text. Pure: no state.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from http import HTTPStatus

import orjson
from aiohttp import web

# Anthropic's error type names (https://docs.anthropic.com/en/api/errors), by HTTP status.
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
    503: "overloaded_error",
}


def is_anthropic(route: str) -> bool:
    """Whether ``route`` belongs to the Anthropic Messages API family."""
    return route == "/v1/messages" or route.startswith("/v1/messages/")


def anthropic_type(status: int) -> str:
    if status in ANTHROPIC_TYPES:
        return ANTHROPIC_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(route: str, status: int, message: str, etype: str) -> bytes:
    """OpenAI-style error; Anthropic-style (type named by status) on the Messages API."""
    if is_anthropic(route):
        return orjson.dumps(
            {"type": "error", "error": {"type": anthropic_type(status), "message": message}}
        )
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


def status_error_type(status: int) -> str:
    """The OpenAI-family type name the router gives a bare status (404, 405, parser 400s)."""
    if status == 404:
        return "not_found"
    if status == 405:
        return "method_not_allowed"
    if status == 413:
        return "request_too_large"
    if status >= 500:
        return "internal_error" if status == 500 else "service_unavailable"
    return "invalid_request_error"


def status_message(status: int) -> str:
    try:
        return HTTPStatus(status).phrase.lower()
    except ValueError:
        return f"HTTP {status}"


def sse_error_event(route: str, message: str) -> bytes:
    if is_anthropic(route):
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
    if 0 < len(rid) <= 128 and rid.isascii() and rid.isprintable() and " " not in rid:
        return rid
    return os.urandom(16).hex()  # 32 hex digits like uuid4().hex, at a seventh of its cost
