"""Error shapes and request ids: what the router answers when it answers for itself.

Owns: the error body of each API family — OpenAI-style everywhere, Anthropic-style on
``/v1/messages`` and every path under it (``/v1/messages/count_tokens``), with Anthropic's
type names by status — the JSON error response, a replica's error answer put in its route's
family (:func:`replica_error_body`: an OpenAI-shaped or plain-text error reaches an Anthropic
client in Anthropic's shape, plain text reaches an OpenAI client as an OpenAI error), the SSE
error event a stream ends with when its replica fails mid-stream, and the request id (a
client's ``X-Request-Id`` when it is sane, else a fresh one). The router's own messages never
carry request bytes (paths, header values, body text): a caller passes fixed text; a
replica's message is passed on as the replica wrote it. Pure: no state.
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


def replica_error_body(route: str, status: int, body: bytes) -> bytes | None:
    """A replica's error answer (status >= 400) in the route's API family, or ``None`` when
    it already has that shape.

    On the Anthropic routes an OpenAI-shaped body (vLLM's ``{"error": {...}}`` or its older
    ``{"object": "error", "message": ...}``), FastAPI's ``{"detail": ...}`` or a plain-text
    body (a 404 page) becomes ``{"type": "error", "error": {"type": <by status>, "message":
    <the replica's text>}}``; on the OpenAI routes anything that is not an OpenAI error object
    becomes one (``type`` by status, ``code`` the status). The replica's message text is kept
    whole."""
    try:
        obj = orjson.loads(body) if body.strip() else None
    except orjson.JSONDecodeError:
        obj = None
    message = _error_message(obj)
    if message is None:  # not JSON, or JSON without a message we know: keep the whole text
        message = body.decode("utf-8", "replace").strip()
    anthropic = is_anthropic(route)
    if isinstance(obj, dict):
        err = obj.get("error")
        if anthropic and obj.get("type") == "error" and isinstance(err, dict):
            return None
        if not anthropic and (isinstance(err, dict) or obj.get("object") == "error"):
            return None
    return error_body(route, status, message or status_message(status), status_error_type(status))


def _error_message(obj: object) -> str | None:
    """The message of a JSON error body of the shapes replicas send, if it has one."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"]
    if isinstance(err, str):
        return err
    if isinstance(obj.get("message"), str):
        return obj["message"]
    detail = obj.get("detail")
    if isinstance(detail, str):
        return detail
    if detail is not None:  # FastAPI's validation errors: a list of objects
        return orjson.dumps(detail).decode()
    return None


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
