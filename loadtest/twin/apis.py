"""The twin's agent APIs beyond chat/completions: Anthropic Messages and OpenAI Responses.

Owns: ``POST /v1/messages`` (non-streamed, and streamed with Anthropic's events
``message_start``, ``content_block_start``, ``content_block_delta`` (``text_delta``, or
``input_json_delta`` for a ``tool_use`` block), ``content_block_stop``, ``message_delta``,
``message_stop``; ``event: error`` when the engine dies), ``POST /v1/messages/count_tokens``
(``{"input_tokens": n}``) and ``POST /v1/responses`` (non-streamed, and streamed with the
Responses events ``response.created`` … ``response.output_text.delta`` (or
``response.function_call_arguments.delta`` for a ``function_call`` item) …
``response.completed`` / ``response.incomplete``, each with its ``sequence_number``) — what
Claude Code, Codex and the Anthropic and OpenAI SDKs send. Prompts are rendered the way the
router renders them (:func:`router.vllm.prompt.request_prompt` on the route), so the
twin's blocks and the router's block keys agree. How a reply ends — its length (the replay's
override counts here as on chat), ``end_turn`` / ``max_tokens`` / ``tool_use`` and
``completed`` / ``incomplete``, and whether it calls one of the offered function tools — is
:mod:`loadtest.twin.turns`'s plan; tool choice follows the chat rule
(:func:`loadtest.twin.http_request._check_tool_choice`). Errors are Anthropic-shaped on
``/v1/messages*``. Must not import torch or vllm.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from aiohttp import web

from loadtest.twin import http_request as srv
from loadtest.twin.engine import Request
from loadtest.twin.replica import ApiError, Stream, TwinReplica
from loadtest.twin.tokenize import TemplateError
from loadtest.twin.turns import ToolCall, Turn, split_pieces
from router.errors import anthropic_type

__all__ = ["add_routes"]


def anthropic_error(e: ApiError) -> web.Response:
    body = {"type": "error", "error": {"type": anthropic_type(e.status), "message": e.message}}
    return web.json_response(body, status=e.status, dumps=lambda x: orjson.dumps(x).decode())


def _json(x: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(x), status=status, content_type="application/json", headers=headers
    )


def _chat_tools(tools: Any, anthropic: bool) -> list[dict[str, Any]] | None:
    """The function tools of an Anthropic / Responses request as chat ``tools``: Anthropic
    client tools (an ``input_schema``; server tools such as ``web_search_*`` are not callable
    by the model's text) and Responses ``function`` tools (not ``custom``, ``web_search``,
    ``local_shell``, ...)."""
    if not isinstance(tools, list) or not tools:
        return None
    out = []
    for t in tools:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            continue
        if anthropic:
            if t.get("type") not in (None, "custom") or "input_schema" not in t:
                continue
            params = t.get("input_schema", {})
        else:
            if t.get("type") != "function":
                continue
            params = t.get("parameters", {})
        out.append({"type": "function", "function": {"name": t["name"],
                    "description": t.get("description", ""), "parameters": params}})  # fmt: skip
    return out or None


def _tool_choice(choice: Any) -> Any:
    """Anthropic ``{"type": "auto"|"any"|"tool"|"none"}`` / Responses choices as chat ones."""
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "any":
            return "required"
        if kind in ("tool", "function"):
            return {"type": "function", "function": {"name": choice.get("name")}}
        if kind == "allowed_tools":  # Responses: a subset; the twin offers them all
            return "required" if choice.get("mode") == "required" else "auto"
        return kind
    return choice


def _after_tool_result(body: dict[str, Any], anthropic: bool) -> bool:
    """Whether the conversation's last turn hands back a tool's result."""
    if anthropic:
        last = (body.get("messages") or [None])[-1]
        content = last.get("content") if isinstance(last, dict) else None
        return isinstance(content, list) and any(
            isinstance(b, dict) and b.get("type") == "tool_result" for b in content
        )
    items = body.get("input")
    last = items[-1] if isinstance(items, list) and items else None
    return isinstance(last, dict) and str(last.get("type", "")).endswith("_call_output")


def _prepare(
    twin: TwinReplica, request: web.Request, body: dict[str, Any], route: str
) -> tuple[str, list[int], Turn, str | None]:
    """Validate ``body`` and tokenize its prompt: (model, ids, the reply's plan, session)."""
    model = srv._check_model(twin, body)
    anthropic = route.startswith("/v1/messages")
    tools = _chat_tools(body.get("tools"), anthropic)
    chat: dict[str, Any] = {}
    if tools:
        chat = {"tools": tools}
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
        srv._check_tool_choice(twin, chat)
    if anthropic:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise srv._bad("messages: a non-empty list is required", "messages")
    elif body.get("input") in (None, "", []):
        raise srv._bad("input: required", "input")
    session = srv._session_id(request, body)
    try:
        ids = twin.tokenizer.encode_body(body, session, route=route)
    except TemplateError as e:
        raise srv._bad(str(e), "messages" if anthropic else "input") from e
    if not ids:
        raise srv._bad("the prompt is empty", "messages" if anthropic else "input")
    mt = body.get("max_tokens") if anthropic else body.get("max_output_tokens")
    if anthropic and route == "/v1/messages" and mt is None:
        raise srv._bad("max_tokens: Field required", "max_tokens")
    # the whole body goes on: the replay's expected length (vllm_xargs, /twin/expect) counts
    # here as on chat/completions
    turn = srv._turn(twin, body, ids, mt, tools, chat.get("tool_choice"),
                     _after_tool_result(body, anthropic))  # fmt: skip
    return model, ids, turn, session


@asynccontextmanager
async def _generation(
    twin: TwinReplica, ids: list[int], turn: Turn, session: str | None, t_arrival: float
) -> AsyncIterator[Stream]:
    req = Request(uuid.uuid4().hex[:16], len(ids), turn.tokens, token_ids=ids, session_id=session)
    twin.in_flight += 1
    try:
        yield await srv._submit(twin, req, t_arrival)
    finally:
        twin.in_flight -= 1
        twin.release(req)


async def _sse(request: web.Request, twin: TwinReplica) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache",
                                       **srv._headers(twin)})  # fmt: skip
    await resp.prepare(request)
    return resp


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


# ---- Anthropic Messages -------------------------------------------------------------------


def stop_reason(turn: Turn) -> str:
    """Anthropic's ``stop_reason`` of a whole reply."""
    if turn.tool_call is not None:
        return "tool_use"
    return "end_turn" if turn.natural else "max_tokens"


def _tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


async def messages(request: web.Request) -> web.StreamResponse:
    twin = request.app[srv.APP_TWIN]
    t_arrival = time.monotonic()
    try:
        body = await srv._json_body(request)
        model, ids, turn, session = _prepare(twin, request, body, "/v1/messages")
    except ApiError as e:
        return anthropic_error(e)
    mid = "msg_" + uuid.uuid4().hex[:24]
    try:
        async with _generation(twin, ids, turn, session, t_arrival) as st:
            if body.get("stream") is True:
                return await _messages_stream(request, twin, st, mid, model, turn)
            toks: list[int] = []
            while (t := await st.queue.get()) is not None:
                toks.append(t)
            twin.check_alive(st.req)
            call = turn.tool_call
            block: dict[str, Any]
            if call is None:
                block = {"type": "text", "text": twin.tokenizer.decode(toks)}
            else:
                block = {"type": "tool_use", "id": _tool_use_id(), "name": call.name,
                         "input": call.arguments}  # fmt: skip
            return _json(
                {
                    "id": mid,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [block],
                    "stop_reason": stop_reason(turn),
                    "stop_sequence": None,
                    "usage": _anthropic_usage(st.req),
                },
                headers=srv._headers(twin),
            )
    except ApiError as e:
        return anthropic_error(e)


def _anthropic_usage(req: Request, output: int | None = None) -> dict[str, Any]:
    cached = req.cached_tokens or 0
    return {
        "input_tokens": req.prompt_len - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": req.num_output if output is None else output,
    }


async def _messages_stream(
    request: web.Request, twin: TwinReplica, st: Stream, mid: str, model: str, turn: Turn
) -> web.StreamResponse:
    resp = await _sse(request, twin)
    req = st.req
    # as vLLM 0.32: message_start counts the whole prompt as input (no cache split yet);
    # message_delta repeats the whole usage with the cache split (read = the prefix hit)
    start: dict[str, Any] = {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": req.prompt_len, "output_tokens": 0},
    }  # fmt: skip
    call = turn.tool_call
    pieces = split_pieces(call.arguments_json, turn.tokens) if call else []
    n = 0
    while (tok := await st.queue.get()) is not None:
        if n == 0:  # vLLM opens the message with its first output (after prefill)
            await resp.write(_event("message_start", {"type": "message_start", "message": start}))
            if call is None:
                block: dict[str, Any] = {"type": "text", "text": ""}
            else:
                block = {"type": "tool_use", "id": _tool_use_id(), "name": call.name, "input": {}}
            await resp.write(_event("content_block_start", {
                "type": "content_block_start", "index": 0, "content_block": block}))  # fmt: skip
        n += 1
        if call is None:
            delta = {"type": "text_delta", "text": twin.tokenizer.decode([tok])}
        elif n <= len(pieces) and pieces[n - 1]:
            delta = {"type": "input_json_delta", "partial_json": pieces[n - 1]}
        else:
            continue  # a token that adds no argument text
        ev = {"type": "content_block_delta", "index": 0, "delta": delta}
        await resp.write(_event("content_block_delta", ev))
    if twin.failed is not None:
        err = {"type": "api_error", "message": f"EngineCore encountered an issue: {twin.failed!r}"}
        await resp.write(_event("error", {"type": "error", "error": err}))
        await resp.write_eof()
        return resp
    await resp.write(_event("content_block_stop", {"type": "content_block_stop", "index": 0}))
    await resp.write(_event("message_delta", {
        "type": "message_delta", "delta": {"stop_reason": stop_reason(turn), "stop_sequence": None},
        "usage": _anthropic_usage(req, output=n),
    }))  # fmt: skip
    await resp.write(_event("message_stop", {"type": "message_stop"}))
    await resp.write_eof()
    return resp


async def count_tokens(request: web.Request) -> web.Response:
    twin = request.app[srv.APP_TWIN]
    try:
        body = await srv._json_body(request)
        _model, ids, _turn, _s = _prepare(twin, request, body, "/v1/messages/count_tokens")
    except ApiError as e:
        return anthropic_error(e)
    return _json({"input_tokens": len(ids)})


# ---- OpenAI Responses ---------------------------------------------------------------------


def _response(
    rid: str, model: str, created: int, status: str, item: dict[str, Any] | None,
    req: Request | None, body: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    choice = body.get("tool_choice")
    out: dict[str, Any] = {
        "id": rid,
        "object": "response",
        "created_at": created,
        "model": model,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "output": [item] if item is not None else [],
        "parallel_tool_calls": True,
        "tool_choice": "auto" if choice is None else choice,
        "tools": body.get("tools") if isinstance(body.get("tools"), list) else [],
        "max_output_tokens": body.get("max_output_tokens"),
        "usage": None,
    }
    if req is not None and status != "in_progress":
        cached = req.cached_tokens or 0
        out["usage"] = {
            "input_tokens": req.prompt_len,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": req.num_output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": req.prompt_len + req.num_output,
        }
    return out


def response_status(turn: Turn) -> str:
    """A whole reply's Responses ``status``: ``incomplete`` only when the cap stopped it."""
    return "completed" if turn.natural else "incomplete"


async def responses(request: web.Request) -> web.StreamResponse:
    twin = request.app[srv.APP_TWIN]
    t_arrival = time.monotonic()
    try:
        body = await srv._json_body(request)
        model, ids, turn, session = _prepare(twin, request, body, "/v1/responses")
    except ApiError as e:
        return srv.error_response(e)
    rid = "resp_" + uuid.uuid4().hex[:24]
    created = int(time.time())
    try:
        async with _generation(twin, ids, turn, session, t_arrival) as st:
            if body.get("stream") is True:
                return await _responses_stream(request, twin, st, rid, model, created, body, turn)
            toks: list[int] = []
            while (t := await st.queue.get()) is not None:
                toks.append(t)
            twin.check_alive(st.req)
            status = response_status(turn)
            if turn.tool_call is not None:
                item = _call_item(rid, turn.tool_call, "completed")
            else:
                item = _message_item("msg_" + rid[5:], twin.tokenizer.decode(toks), "completed")
            return _json(_response(rid, model, created, status, item, st.req, body),
                         headers=srv._headers(twin))  # fmt: skip
    except ApiError as e:
        return srv.error_response(e)


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": content}  # fmt: skip


def _call_item(rid: str, call: ToolCall, status: str, args: str | None = None) -> dict[str, Any]:
    """A Responses ``function_call`` output item (ids derived from the response's)."""
    return {"id": "fc_" + rid[5:], "type": "function_call", "status": status,
            "call_id": "call_" + rid[5:], "name": call.name,
            "arguments": call.arguments_json if args is None else args}  # fmt: skip


async def _responses_stream(
    request: web.Request, twin: TwinReplica, st: Stream, rid: str, model: str, created: int,
    body: dict[str, Any], turn: Turn,
) -> web.StreamResponse:  # fmt: skip
    resp = await _sse(request, twin)
    seq = 0

    async def emit(kind: str, **data: Any) -> None:
        nonlocal seq
        await resp.write(_event(kind, {"type": kind, "sequence_number": seq, **data}))
        seq += 1

    call = turn.tool_call
    item_id = ("fc_" if call else "msg_") + rid[5:]
    head = _response(rid, model, created, "in_progress", None, None, body)
    # vLLM sends response.created / in_progress at once, the output item with the first token
    await emit("response.created", response=head)
    await emit("response.in_progress", response=head)
    part = {"type": "output_text", "text": "", "annotations": []}
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    pieces = split_pieces(call.arguments_json, turn.tokens) if call else []
    texts: list[str] = []
    n = 0
    while (tok := await st.queue.get()) is not None:
        n += 1
        if n == 1 and call is not None:
            await emit("response.output_item.added", output_index=0,
                       item=_call_item(rid, call, "in_progress", ""))  # fmt: skip
        elif n == 1:
            await emit("response.output_item.added", output_index=0,
                       item=_message_item(item_id, None, "in_progress"))  # fmt: skip
            await emit("response.content_part.added", **where, part=part)
        if call is not None:
            piece = pieces[n - 1] if n <= len(pieces) else ""
            if piece:
                await emit("response.function_call_arguments.delta", item_id=item_id,
                           output_index=0, delta=piece)  # fmt: skip
            continue
        t = twin.tokenizer.decode([tok])
        texts.append(t)
        await emit("response.output_text.delta", **where, delta=t, logprobs=[])
    if twin.failed is not None:
        await emit("error", code="server_error", message="EngineCore encountered an issue",
                   param=None)  # fmt: skip
        await resp.write_eof()
        return resp
    if call is not None:
        await emit("response.function_call_arguments.done", item_id=item_id, output_index=0,
                   name=call.name, arguments=call.arguments_json)  # fmt: skip
        item = _call_item(rid, call, "completed")
    else:
        text = "".join(texts)
        await emit("response.output_text.done", **where, text=text, logprobs=[])
        await emit("response.content_part.done", **where, part={**part, "text": text})
        item = _message_item(item_id, text, "completed")
    await emit("response.output_item.done", output_index=0, item=item)
    status = response_status(turn)
    await emit("response." + status,
               response=_response(rid, model, created, status, item, st.req, body))  # fmt: skip
    await resp.write_eof()
    return resp


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_post("/v1/responses", responses)
