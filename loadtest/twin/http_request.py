"""The HTTP twin's request side: vLLM's request checks and error shapes.

Owns: what the twin's handlers (:mod:`loadtest.twin.chat`, :mod:`loadtest.twin.apis`) share
— the app keys, reading a JSON body, vLLM's error response and its 400s, the model and tool
checks, a prompt's token ids, the reply's plan (:func:`_turn`, from
:mod:`loadtest.twin.turns`) with ``max_tokens``, session, priority, retention hint and P/D
parameters, the usage block, the twin's reply headers — and the replay's expected-output
table (``POST /twin/expect``). Must not import torch or vllm.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

import orjson
from aiohttp import web

from engine_patches.retention_rule import Hint, parse_hint
from loadtest.twin import TWIN_OUTPUT_FIELD, expect_key
from loadtest.twin.engine import Request
from loadtest.twin.replica import ApiError, Stream, TwinReplica
from loadtest.twin.tokenize import TemplateError
from loadtest.twin.turns import Turn


def _dumps(x: Any) -> str:
    return orjson.dumps(x).decode()


def error_response(e: ApiError) -> web.Response:
    """vLLM's error shape for ``e``."""
    return web.json_response(e.body(), status=e.status, dumps=_dumps)


def _bad(message: str, param: str | None = None, value: Any = None) -> ApiError:
    if param is not None:
        message = f"{message} (parameter={param}" + (
            f", value={value})" if value is not None else ")"
        )
    return ApiError(400, message, "BadRequestError", param)


# ---- request parsing ------------------------------------------------------------------------

APP_TWIN = web.AppKey("twin", TwinReplica)
APP_TASKS = web.AppKey("twin_tasks", set)  # background disruptions (a restart in progress)


async def _json_body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        msg = (
            "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.1', "
            f"'msg': 'JSON decode error', 'input': '<dict of 0 items>', "
            f"'ctx': {{'error': {str(e)!r}}}}}"
        )
        raise ApiError(400, msg, "Bad Request", "body.1") from e
    if not isinstance(body, dict):
        raise ApiError(
            400,
            "1 validation error:\n  {'type': 'model_attributes_type', "
            "'loc': 'body', 'msg': 'Input should be a valid dictionary or object'}",
            "Bad Request",
            "body",
        )
    return body


def _check_model(twin: TwinReplica, body: dict[str, Any]) -> str:
    name = body.get("model")
    served = twin.cfg.served_model_name
    if name is None:
        return served
    if name != served:
        raise ApiError(
            404,
            f"The model `{name}` does not exist. Valid aliases: {served}.",
            "NotFoundError",
            "model",
        )
    return served


def _check_tool_choice(twin: TwinReplica, body: dict[str, Any]) -> None:
    """Tools in a chat-shaped ``body``. With auto tool choice (the twin's default, as vLLM
    with ``--enable-auto-tool-choice --tool-call-parser``) every choice is served; a named tool
    must be one of the ``tools``. Without it (``enable_auto_tool_choice=False``: a bare vLLM
    0.32), tool_choice "auto" (also when absent) and "required" are a 400; "none" and named
    functions render the tools into the prompt."""
    if not body.get("tools"):
        return
    choice = body.get("tool_choice", "auto")
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in {n for n, _ in _function_tools(body.get("tools"))}:
            raise _bad(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                "tool_choice",
            )
    if twin.cfg.enable_auto_tool_choice:
        return
    if choice is None or choice == "auto":
        raise ApiError(
            400,
            '"auto" tool choice requires --enable-auto-tool-choice and '
            "--tool-call-parser to be set",
            "BadRequestError",
        )
    if choice == "required":
        raise ApiError(
            400, 'tool_choice="required" requires --tool-call-parser to be set', "BadRequestError"
        )


def _function_tools(tools: Any) -> list[tuple[str, Any]]:
    """Chat ``tools`` as ``(name, parameters schema)`` of the function tools."""
    out = []
    for t in tools if isinstance(tools, list) else ():
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]:
            if t.get("type", "function") == "function":
                out.append((fn["name"], fn.get("parameters")))
    return out


def _prompt_ids(
    twin: TwinReplica, body: dict[str, Any], chat: bool, session: str | None = None
) -> list[int]:
    tk = twin.tokenizer
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _bad("messages must be a non-empty list", "messages")
        try:
            return tk.encode_body(body, session)
        except TemplateError as e:
            raise _bad(str(e), "messages") from e
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return tk.encode(prompt, session)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < tk.vocab_size]
        if bad:
            raise _bad(f"Token id {bad[0]} is out of vocabulary", "prompt")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise _bad("the twin serves one prompt per request", "prompt")
    raise _bad("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")


# Output lengths a replay registered out of band (``POST /twin/expect``), by
# :func:`loadtest.twin.expect_key`: one table per process, shared by a cluster's twins.
EXPECTED: OrderedDict[str, int] = OrderedDict()
EXPECTED_MAX = 50_000


def _twin_output_tokens(body: dict[str, Any]) -> int | None:
    """The output length a replay asks this twin to produce, standing in for where a real
    model would stop: ``vllm_xargs`` (a field vLLM passes to its sampler and no router reads),
    else what the replay registered for this request out of band (for peer routers that drop
    ``vllm_xargs``)."""
    xargs = body.get("vllm_xargs")
    n = xargs.get(TWIN_OUTPUT_FIELD) if isinstance(xargs, dict) else None
    if n is None and EXPECTED:
        key = expect_key(body)
        n = EXPECTED.get(key) if key is not None else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


async def expect(request: web.Request) -> web.Response:
    """``POST /twin/expect {"key": ..., "output_tokens": n}``: the replay's side channel."""
    try:
        doc = orjson.loads(await request.read())
        key, n = str(doc["key"]), int(doc["output_tokens"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return web.json_response({"error": "need key and output_tokens"}, status=400)
    EXPECTED[key] = n
    EXPECTED.move_to_end(key)
    while len(EXPECTED) > EXPECTED_MAX:
        EXPECTED.popitem(last=False)
    return web.json_response({"ok": True})


def _turn(
    twin: TwinReplica,
    body: dict[str, Any],
    ids: list[int],
    max_tokens: Any,
    tools: Any = None,
    tool_choice: Any = "auto",
    after_result: bool = False,
) -> Turn:
    """How this call's reply ends (:mod:`loadtest.twin.turns`): the client's cap
    (``max_tokens``, checked with vLLM's messages; None: the context window's remainder), the
    replay's expected length when given (:func:`_twin_output_tokens`), ``ignore_eos`` and
    ``min_tokens`` as vLLM's sampler takes them; ``tools`` in chat form."""
    cap = _max_tokens(twin, max_tokens, len(ids))
    mn = body.get("min_tokens")
    policy = twin.turns
    return policy.plan(
        policy.rng(ids, body.get("seed")),
        cap=cap,
        expected=_twin_output_tokens(body),
        ignore_eos=body.get("ignore_eos") is True,
        min_tokens=mn if isinstance(mn, int) and not isinstance(mn, bool) else 0,
        tools=_function_tools(tools),
        tool_choice="auto" if tool_choice is None else tool_choice,
        after_result=after_result,
    )


def _max_tokens(twin: TwinReplica, mt: Any, n_prompt: int) -> int:
    limit = twin.max_model_len
    if n_prompt >= limit:
        shown = min(n_prompt, limit + 1)
        raise _bad(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains at least {shown} input tokens, which exceeds this limit even without "
            "any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            shown,
        )
    if mt is None:
        return limit - n_prompt
    if not isinstance(mt, int) or isinstance(mt, bool):
        raise _bad(f"max_tokens must be an integer, got {mt!r}.", "max_tokens", mt)
    if mt < 1:
        raise _bad(f"max_tokens must be at least 1, got {mt}.", "max_tokens", mt)
    if mt > limit:
        raise _bad(
            f"max_tokens={mt} cannot be greater than max_model_len={limit}. "
            "Please request fewer output tokens.",
            "max_tokens",
            mt,
        )
    if n_prompt + mt > limit:
        raise _bad(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{mt} output tokens and your prompt contains at least {n_prompt} input tokens, "
            f"for a total of at least {n_prompt + mt} tokens. Please reduce the length of "
            "the input prompt or the number of requested output tokens.",
            "max_tokens",
            mt,
        )
    return mt


def _session_id(request: web.Request, body: dict[str, Any]) -> str | None:
    sid = body.get("session_id") or request.headers.get("X-Session-ID")
    xargs = body.get("vllm_xargs")
    if sid is None and isinstance(xargs, dict):
        sid = xargs.get("session_id")
    return str(sid) if sid is not None else None


def _priority(request: web.Request, body: dict[str, Any]) -> int:
    """vLLM's request priority: the ``X-Vllm-Priority`` header (an integer), else the body's
    ``priority`` field, else 0 — as vLLM's ``_get_priority``; it orders the queue only
    under the profile's ``priority_scheduling`` (``--scheduling-policy priority``)."""
    raw = request.headers.get("X-Vllm-Priority")
    if raw is not None:
        try:
            return int(raw)
        except ValueError:
            pass
    p = body.get("priority", 0)
    return p if type(p) is int else 0


def _hint(twin: TwinReplica, body: dict[str, Any]) -> Hint | None:
    """The engine plugin's retention hint, read from ``kv_transfer_params.kvroute`` as vLLM
    hands that field to the plugin's policy (malformed: ignored). ``return_s`` is the client's
    wall seconds: the engine runs in model time, so it is scaled by the speedup."""
    hint = parse_hint(body.get("kv_transfer_params"))
    if hint is not None and hint.return_s is not None and twin.speedup != 1.0:
        hint = Hint(hint.session, hint.state, hint.return_s * twin.speedup)
    return hint


def _pd_params(twin: TwinReplica, body: dict[str, Any], req: Request) -> bool:
    """vLLM's ``kv_transfer_params`` for P/D disaggregation, as its NIXL connector reads them.
    A decode-capable twin given a prefill's params (``do_remote_prefill`` with
    ``remote_block_ids``) takes the prompt's KV over the link: ``req.remote_tokens`` (the
    engine waits ``costmodel.disagg.kv_transfer_time`` and allocates the blocks then). Returns
    whether this call asks a prefill-capable twin to produce params (``do_remote_decode``).
    """
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict):
        return False
    role = twin.cfg.role
    if params.get("do_remote_prefill") and params.get("remote_block_ids") and role != "prefill":
        n = params.get("remote_num_tokens")
        n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else req.prompt_len
        req.remote_tokens = min(n, req.prompt_len)
    return bool(params.get("do_remote_decode")) and role != "decode"


def _produced_params(twin: TwinReplica, req: Request) -> dict[str, Any]:
    """What vLLM's ``NixlConnectorScheduler.request_finished`` returns on a prefill replica:
    where the decode replica reads the prompt's blocks from: the ids of the prompt's blocks
    still cached here (the request's own are released when it ends; the twin's prefix cache
    keeps them, where vLLM holds them for the decode replica's read)."""
    keys = req.block_keys
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [twin.engine.pool.match(keys, len(keys))],
        "remote_engine_id": f"twin-{twin.cfg.name}",
        "remote_request_id": req.id,
        "remote_host": twin.cfg.host,
        "remote_port": twin.cfg.port,
        "tp_size": twin.profile.tensor_parallel_size,
        "remote_num_tokens": req.prompt_len,
    }


def _usage(req: Request, block_size: int, chat: bool, stream: bool) -> dict[str, Any]:
    """vLLM 0.32's usage: ``created_cache_tokens`` (prompt tokens this request newly wrote
    into full cached blocks) is reported by the chat endpoint only; non-streaming responses
    also carry ``multimodal_tokens: null`` (and completions ``created_cache_tokens: null``)."""
    cached = req.cached_tokens or 0
    details: dict[str, Any] = {"cached_tokens": cached}
    if chat:
        details["created_cache_tokens"] = max(0, req.prompt_len // block_size * block_size - cached)
    elif not stream:
        details["created_cache_tokens"] = None
    if not stream:
        details["multimodal_tokens"] = None
    return {"prompt_tokens": req.prompt_len,
            "total_tokens": req.prompt_len + req.num_output,
            "completion_tokens": req.num_output,
            "prompt_tokens_details": details}  # fmt: skip


async def _submit(twin: TwinReplica, req: Request, t_arrival: float) -> Stream:
    """Hand ``req`` to the engine after the API server's share of a request
    (``request_overhead_s``, compressed by the speedup), unless the replica went down."""
    overhead = twin.profile.request_overhead_s / twin.speedup
    if overhead > 0:
        await asyncio.sleep(overhead)
    twin.check_alive()
    return twin.submit(req, t_arrival)


def _headers(twin: TwinReplica) -> dict[str, str]:
    return {"x-twin-speedup": repr(twin.speedup), "x-twin-replica": twin.cfg.name}
