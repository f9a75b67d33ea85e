"""The router's own OpenAPI 3.0 document, served at ``GET /openapi.json``.

Owns: the description of every public endpoint the router answers (the inference and
passthrough API routes, the model list, health, readiness, metrics, the admin views) with the
request bodies it accepts and its error shape — what ``tests/integration/test_fuzz.py`` hands
schemathesis. Kept by hand next to :func:`router.api.add_routes`; a test checks that every
route added there is described here. Pure: no aiohttp, no state.
"""

from __future__ import annotations

from typing import Any

_ERROR = {
    "description": "an error of the route's API family (OpenAI; Anthropic on /v1/messages*)",
    "content": {"application/json": {"schema": {"type": "object"}}},
}
_MESSAGES = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
            "content": {"type": "string"},
        },
        "required": ["role", "content"],
    },
}
_COMMON = {
    "model": {"type": "string"},
    "stream": {"type": "boolean"},
    "max_tokens": {"type": "integer"},
    "user": {"type": "string"},
    "prompt_cache_key": {"type": "string"},
}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": _MESSAGES},
    "/v1/completions": {"prompt": {"type": "string"}},
    "/v1/responses": {"input": {"type": "string"}, "instructions": {"type": "string"}},
    "/v1/messages": {"messages": _MESSAGES, "system": {"type": "string"}},
    "/v1/messages/count_tokens": {"messages": _MESSAGES},
    "/v1/embeddings": {"input": {"type": "string"}},
    "/v1/score": {"text_1": {"type": "string"}, "text_2": {"type": "string"}},
    "/v1/rerank": {"query": {"type": "string"}, "documents": {"type": "array"}},
    "/v1/classify": {"input": {"type": "string"}},
}
_SESSION_HEADERS = ["x-session-id", "x-claude-code-session-id", "session-id", "x-request-id"]


def _post(path: str, props: dict[str, Any]) -> dict[str, Any]:
    return {
        "post": {
            "operationId": "post" + path.replace("/", "_"),
            "parameters": [
                {"name": h, "in": "header", "required": False, "schema": {"type": "string"}}
                for h in _SESSION_HEADERS
            ],
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"type": "object", "properties": {**_COMMON, **props}}
                    }
                },
            },
            "responses": {"200": {"description": "the replica's answer"}, "default": _ERROR},
        }
    }


def _get(op: str, desc: str, params: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "operationId": op,
        "responses": {"200": {"description": desc}, "default": _ERROR},
    }
    if params:
        out["parameters"] = params
    return {"get": out}


def openapi_document() -> dict[str, Any]:
    paths: dict[str, Any] = {p: _post(p, props) for p, props in BODIES.items()}
    paths["/v1/models"] = _get("models", "the union of the healthy replicas' model cards")
    paths["/v1/models/{model}"] = _get(
        "model",
        "one model card",
        [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
    )
    rid = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    paths["/v1/responses/{response_id}"] = _get(
        "get_response",
        "a response, from the replica that produced it",
        [*rid, {"name": "stream", "in": "query", "schema": {"type": "boolean"}},
         {"name": "starting_after", "in": "query", "schema": {"type": "integer"}}],
    )  # fmt: skip
    paths["/v1/responses/{response_id}/cancel"] = {
        "post": {
            "operationId": "cancel_response",
            "parameters": rid,
            "responses": {"200": {"description": "the cancelled response"}, "default": _ERROR},
        }
    }
    paths["/health"] = _get("health", "liveness")
    paths["/ready"] = _get("ready", "readiness")
    paths["/metrics"] = _get("metrics", "Prometheus text")
    paths["/openapi.json"] = _get("openapi", "this document")
    admin_key = [
        {"name": "x-admin-key", "in": "header", "required": False, "schema": {"type": "string"}}
    ]
    paths["/admin/replicas"] = _get("admin_replicas", "replicas", admin_key)
    paths["/admin/config"] = _get("admin_config", "configuration", admin_key)
    paths["/admin/sessions"] = _get(
        "admin_sessions",
        "sessions",
        [*admin_key, {"name": "limit", "in": "query", "schema": {"type": "integer"}}],
    )
    route = _post("/admin/route", BODIES["/v1/chat/completions"])
    route["post"]["operationId"] = "admin_route"
    route["post"]["parameters"] = [
        *admin_key,
        {"name": "explain", "in": "query", "schema": {"type": "string"}},
        {"name": "route", "in": "query", "schema": {"type": "string"}},
    ]
    paths["/admin/route"] = route
    return {
        "openapi": "3.0.3",
        "info": {"title": "kvroute", "version": "1"},
        "paths": paths,
    }
