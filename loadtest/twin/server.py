"""The HTTP replica twin: vLLM's OpenAI-compatible API in front of a :class:`TwinReplica`.

Owns: the twin's web application — its routes: ``/v1/completions`` and
``/v1/chat/completions`` (streaming and not, in :mod:`loadtest.twin.chat`), ``/v1/messages``
(+ ``count_tokens``) and ``/v1/responses`` (in :mod:`loadtest.twin.apis`), ``/v1/models``,
``/tokenize``, ``/health``, ``/load``, ``/metrics`` (vLLM's metric names,
:mod:`loadtest.twin.exporter`), ``POST /reset_prefix_cache``, ``/twin/expect`` and
``/twin/disrupt`` — with vLLM's error shapes and status codes
(:mod:`loadtest.twin.http_request`), and :func:`serve` to run one. How each reply ends (its
length, ``finish_reason`` ``stop`` / ``length`` / ``tool_calls``, a tool call in the chat
shape) is planned by :mod:`loadtest.twin.turns` (:func:`loadtest.twin.http_request._turn`).
The engine loop is :mod:`loadtest.twin.replica`'s, the event publisher
:mod:`loadtest.twin.publisher`'s. Must not import torch or vllm.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from loadtest.twin import apis
from loadtest.twin.chat import chat_completions, completions
from loadtest.twin.http_request import (
    APP_TASKS,
    APP_TWIN,
    _check_model,
    _dumps,
    _json_body,
    _prompt_ids,
    error_response,
    expect,
)
from loadtest.twin.replica import ApiError, TwinConfig, TwinReplica

log = logging.getLogger("kvroute.twin")

__all__ = ["TwinConfig", "TwinReplica", "build_app", "load_json", "runner_port", "serve"]


async def tokenize(request: web.Request) -> web.Response:
    twin = request.app[APP_TWIN]
    try:
        body = await _json_body(request)
        _check_model(twin, body)
        ids = _prompt_ids(twin, body, chat="messages" in body)
    except ApiError as e:
        return error_response(e)
    return web.json_response(
        {"count": len(ids), "max_model_len": twin.max_model_len, "tokens": ids, "token_strs": None},
        dumps=_dumps,
    )


async def models(request: web.Request) -> web.Response:
    twin = request.app[APP_TWIN]
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": twin.cfg.served_model_name,
                    "object": "model",
                    "created": twin.created,
                    "owned_by": "vllm",
                    "root": str(twin.cfg.model_dir),
                    "parent": None,
                    "max_model_len": twin.max_model_len,
                    "permission": [],
                }
            ],
        },
        dumps=_dumps,
    )


async def health(request: web.Request) -> web.Response:
    twin = request.app[APP_TWIN]
    return web.Response(status=500 if twin.failed else 200 if twin.state == "up" else 503)


async def disrupt(request: web.Request) -> web.Response:
    """``POST /twin/disrupt {"action": "restart" | "down" | "up", "downtime_s": s}``: the
    bench's disruptions (kvroute bench --disrupt). ``restart`` answers at once and drains,
    restarts empty and comes back in the background (``GET /twin/disrupt``: the state)."""
    twin = request.app[APP_TWIN]
    if request.method == "GET":
        return web.json_response({"state": twin.state, "restarts": twin.restarts})
    try:
        doc = orjson.loads(await request.read())
        action, downtime = str(doc["action"]), float(doc.get("downtime_s", 0.0))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        return web.json_response({"error": "need action"}, status=400)
    if action == "restart":
        if twin.state != "up":
            return web.json_response({"error": f"replica is {twin.state}"}, status=409)
        task = asyncio.get_running_loop().create_task(twin.restart(downtime))
        request.app[APP_TASKS].add(task)
        task.add_done_callback(request.app[APP_TASKS].discard)
    elif action == "down":
        twin.go_down()
    elif action == "up":
        twin.go_up()
    else:
        return web.json_response({"error": f"unknown action {action!r}"}, status=400)
    return web.json_response({"state": twin.state})


async def load(request: web.Request) -> web.Response:
    return web.json_response({"server_load": request.app[APP_TWIN].in_flight})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """As vLLM 0.32.0's dev endpoint answers: 200 with ``{"success": false}`` while requests
    hold blocks (the caller may retry), ``{"success": true}`` once the cache is empty."""
    return web.json_response({"success": bool(request.app[APP_TWIN].reset_prefix_cache())})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[APP_TWIN].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except ApiError as e:
        return error_response(e)


def build_app(twin: TwinReplica) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=64 << 20)
    app[APP_TWIN] = twin
    app[APP_TASKS] = set()

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        twin.start()
        yield
        await twin.stop()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/load", load)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_post("/twin/expect", expect)
    app.router.add_post("/twin/disrupt", disrupt)
    app.router.add_get("/twin/disrupt", disrupt)
    apis.add_routes(app)  # /v1/messages (+ count_tokens), /v1/responses
    return app


# ---- running one twin -----------------------------------------------------------------------


async def serve(twin: TwinReplica, host: str = "127.0.0.1", port: int = 0) -> web.AppRunner:
    """Start ``twin`` on ``host:port`` (0: a free port); returns the runner (``.addresses``)."""
    runner = web.AppRunner(build_app(twin), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner


def runner_port(runner: web.AppRunner) -> int:
    return int(runner.addresses[0][1])


def load_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())
