"""The HTTP twin's OpenAI generation routes: ``/v1/completions`` and ``/v1/chat/completions``.

Owns: running one generation on the :class:`TwinReplica` for either route, the reply in
vLLM's shape (streamed as server-sent events, or whole), ``finish_reason`` and tool calls in
the chat shape. Request checks are :mod:`loadtest.twin.http_request`'s. Must not import torch
or vllm.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson
from aiohttp import web

from loadtest.twin.engine import Request
from loadtest.twin.http_request import (
    APP_TWIN,
    _bad,
    _check_model,
    _check_tool_choice,
    _dumps,
    _headers,
    _hint,
    _json_body,
    _pd_params,
    _priority,
    _produced_params,
    _prompt_ids,
    _session_id,
    _submit,
    _turn,
    _usage,
    error_response,
)
from loadtest.twin.replica import ApiError, Stream, TwinReplica
from loadtest.twin.turns import ToolCall, Turn, split_pieces

# ---- handlers -------------------------------------------------------------------------------


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    twin = request.app[APP_TWIN]
    t_arrival = time.monotonic()
    try:
        body = await _json_body(request)
        model = _check_model(twin, body)
        if chat:
            _check_tool_choice(twin, body)
        session = _session_id(request, body)
        ids = _prompt_ids(twin, body, chat, session)
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        if chat:
            last = body["messages"][-1]  # a non-empty list (_prompt_ids)
            after = isinstance(last, dict) and last.get("role") == "tool"
            turn = _turn(twin, body, ids, mt, body.get("tools"), body.get("tool_choice"), after)
        else:
            turn = _turn(twin, body, ids, mt)
        if body.get("n", 1) != 1:
            raise _bad("the twin supports n=1 only", "n", body.get("n"))
    except ApiError as e:
        return error_response(e)
    stream = bool(body.get("stream", False))
    so = body.get("stream_options") or {}
    include_usage = bool(so.get("include_usage")) if isinstance(so, dict) else False
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:16]
    req = Request(rid, len(ids), turn.tokens, token_ids=ids, session_id=session,
                  hint=_hint(twin, body), priority=_priority(request, body))  # fmt: skip
    produce = _pd_params(twin, body, req)
    created = int(time.time())
    twin.in_flight += 1
    try:
        st = await _submit(twin, req, t_arrival)
        if stream:
            return await _stream(request, twin, st, chat, rid, model, created, include_usage, turn)
        toks: list[int] = []
        while (t := await st.queue.get()) is not None:
            toks.append(t)
        twin.check_alive(st.req)  # the engine died (or the replica went down) under it
        reason = finish_reason(turn)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason,
                                  "stop_reason": None}  # fmt: skip
        call = turn.tool_call
        if chat:
            choice["message"] = {
                "role": "assistant",
                "content": None if call else twin.tokenizer.decode(toks),
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "tool_calls": [] if call is None else [_chat_call(call, tool_call_id())],
                "reasoning": None,
            }
        else:
            choice["text"] = twin.tokenizer.decode(toks)
        resp = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": model, "choices": [choice],
                "system_fingerprint": "kvroute-twin",
                "usage": _usage(req, twin.profile.block_size, chat, stream=False)}  # fmt: skip
        if produce:  # vLLM puts the connector's answer on the response (or null)
            resp["kv_transfer_params"] = _produced_params(twin, req)
        return web.json_response(resp, dumps=_dumps, headers=_headers(twin))
    finally:
        twin.in_flight -= 1
        twin.release(req)


def finish_reason(turn: Turn) -> str:
    """The chat / completions ``finish_reason`` of a whole reply."""
    if turn.tool_call is not None:
        return "tool_calls"
    return "stop" if turn.natural else "length"


def tool_call_id() -> str:
    return "chatcmpl-tool-" + uuid.uuid4().hex  # vLLM's form


def _chat_call(call: ToolCall, cid: str, args: str | None = None) -> dict[str, Any]:
    fn = {"name": call.name, "arguments": call.arguments_json if args is None else args}
    return {"id": cid, "type": "function", "function": fn}


async def _stream(
    request: web.Request,
    twin: TwinReplica,
    st: Stream,
    chat: bool,
    rid: str,
    model: str,
    created: int,
    include_usage: bool,
    turn: Turn,
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            **_headers(twin),
        }
    )
    await resp.prepare(request)
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        d = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": choices,
            **extra,
        }
        return b"data: " + orjson.dumps(d) + b"\n\n"

    role = chunk(
        [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
    )
    req = st.req
    limit = twin.max_model_len
    call = turn.tool_call if chat else None
    pieces = split_pieces(call.arguments_json, turn.tokens) if call else []
    cid = tool_call_id()
    count = 0
    while (tok := await st.queue.get()) is not None:
        if chat and count == 0:
            # vLLM sends the role chunk with the first output, i.e. after prefill: nothing
            # but the head before the first token (a router's TTFT and idle timeouts see that)
            await resp.write(role)
        count += 1
        done = count >= req.max_tokens or req.prompt_len + count >= limit
        c: dict[str, Any] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": finish_reason(turn) if done else None,
        }
        if call is not None:
            # a tool parser's deltas: the call's id and name first, then its arguments; a
            # token that adds no argument text writes no chunk (as a parser buffering it)
            piece = pieces[count - 1] if count <= len(pieces) else ""
            if count == 1:
                c["delta"] = {"tool_calls": [{"index": 0, **_chat_call(call, cid, piece)}]}
            elif piece or done:
                delta = {"index": 0, "function": {"arguments": piece}}
                c["delta"] = {"tool_calls": [delta]} if piece else {}
            else:
                continue
        elif chat:
            c["delta"] = {"content": twin.tokenizer.decode([tok])}
        else:
            c["text"] = twin.tokenizer.decode([tok])
            c["stop_reason"] = None
        await resp.write(chunk([c]))
    if twin.failed is not None:  # the engine died under this stream: say so, as vLLM does
        err = {"message": f"EngineCore encountered an issue: {twin.failed!r}",
               "type": "EngineDeadError", "param": None, "code": 500}  # fmt: skip
        await resp.write(b"data: " + orjson.dumps({"error": err}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    if include_usage:
        usage = _usage(req, twin.profile.block_size, chat, stream=True)
        await resp.write(chunk([], usage=usage, system_fingerprint="kvroute-twin"))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)
