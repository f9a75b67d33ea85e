"""The HTTP replica twin: a simulated vLLM replica on aiohttp.

Owns: one twin replica's web application — vLLM's OpenAI-compatible API (``/v1/completions``,
``/v1/chat/completions`` streaming and not, ``/v1/models``, ``/tokenize``, ``/health``,
``/load``, ``/metrics`` with vLLM's metric names, ``POST /reset_prefix_cache``), vLLM's error
shapes and status codes, the asyncio loop that runs the engine model in (compressed) real
time, and the ZMQ publisher of KV events in vLLM's wire format. Must not import torch or vllm.

Time: the engine lives in *model time* (seconds on the simulated hardware). With ``speedup``
X, a step of d model seconds takes d/X wall seconds, and the API-server overhead of the
profile likewise. Everything a client measures (TTFT, ITL, latency) and the histograms in
``/metrics`` are wall-clock, so they are model time divided by X: multiply by X (the
``x-twin-speedup`` response header and the ``kvroute:twin_speedup`` gauge carry X) to scale
them back. KV-event timestamps are wall-clock ``time.time()`` like vLLM's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
import zlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from costmodel.profiles import ReplicaProfile
from loadtest.twin.engine import Engine, Request
from loadtest.twin.tokenize import ModelTokenizer, TemplateError
from router.hashing import BlockHasher
from router.kvevents import encode_message

log = logging.getLogger("kvroute.twin")

MAX_LAG_WALL_S = 0.01  # how far (wall seconds) the model clock may trail the wall clock
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


@dataclass
class TwinConfig:
    profile: ReplicaProfile
    model_dir: Path
    name: str = "twin"
    served_model_name: str = "tiny"
    speedup: float = 1.0
    kv_events_endpoint: str | None = None  # vLLM semantics: bind if "*"/"::"/ipc/inproc
    kv_events_topic: str | None = None  # default "kv@<name>"
    kv_events_replay: str | None = None  # ROUTER endpoint for replays (binds; "...:*" ok)
    hash_algo: str = "sha256_cbor"
    hash_seed: str | None = None  # the engine's PYTHONHASHSEED
    int_hashes: bool = True  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    max_model_len: int | None = None  # default: the profile's
    # vLLM's --enable-auto-tool-choice (with a --tool-call-parser): without it, a chat request
    # with tools and tool_choice "auto" (the default when tools are given) or "required" is
    # refused, as real vLLM refuses it. The twin never parses tool calls either way.
    enable_auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        if not self.speedup > 0:
            raise ValueError(f"speedup must be > 0, got {self.speedup}")


def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule: the publisher binds for ``*``/``::`` hosts and ipc/inproc, else connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """A ZMQ PUB socket sending ``[topic, seq, msgpack([ts, events, dp_rank])]`` batches, and
    optionally vLLM's replay service: a ROUTER socket on ``replay_endpoint`` that answers
    ``[b"", start_seq(8B BE)]`` with ``[b"", topic, seq, payload]`` for every buffered batch
    from ``start_seq`` on, then ``[b"", b"", -1 (8B signed), b""]`` (``ZmqEventPublisher``,
    last ``buffer_steps`` batches kept)."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(
        self,
        endpoint: str,
        topic: str,
        zmq_ctx: Any = None,
        as_int: bool = True,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
    ):
        import zmq

        self._own_ctx = zmq_ctx is None
        self.ctx = zmq_ctx or zmq.Context()
        # XPUB: on the wire a PUB, but it lets the twin see a subscriber's subscription
        # arrive (wait_subscribed), so a twin started after its subscriber drops nothing.
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        if publisher_binds(endpoint):
            self.sock.bind(endpoint)
            self.endpoint = str(self.sock.getsockopt_string(zmq.LAST_ENDPOINT))
        else:
            self.sock.connect(endpoint)
            self.endpoint = endpoint
        self.topic = topic
        self.seq = 0
        self.as_int = as_int
        self.dropped = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.replay_endpoint: str | None = None
        self._replay: Any = None
        if replay_endpoint:
            import zmq.asyncio

            self._actx = zmq.asyncio.Context.shadow(self.ctx)
            self._replay = self._actx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = str(self._replay.getsockopt_string(zmq.LAST_ENDPOINT))

    def wait_subscribed(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until a subscriber's subscription has arrived (a PUB
        drops what it sends before that: vLLM loses the first events when it starts before
        its subscriber connects). False when none came in time."""
        import zmq

        got = False
        while self.sock.poll(int(max(timeout_s, 0) * 1000) if not got else 0, zmq.POLLIN):
            self.sock.recv(zmq.NOBLOCK)  # b"\x01" + topic prefix; drain them all
            got = True
        return got

    def publish(
        self, events: list[dict[str, Any]], digests: dict[int, bytes] | None = None
    ) -> None:
        import zmq

        if not events:
            return
        if not self.as_int:
            events = [_digest_form(e, digests or {}) for e in events]
        parts = encode_message(self.topic, self.seq, time.time(), events)
        if self._replay is not None:
            self.buffer.append((self.seq, parts[2]))
        try:
            self.sock.send_multipart(parts, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1  # PUB semantics: never block the engine
        self.seq += 1

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled (no-op without a replay endpoint)."""
        if self._replay is None:
            return
        topic = self.topic.encode()
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # vLLM logs and ignores malformed requests
            client, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self._replay.send_multipart(
                        [client, b"", topic, seq.to_bytes(8, "big"), payload]
                    )
            await self._replay.send_multipart([client, b"", b"", self.END_SEQ, b""])

    def close(self) -> None:
        self.sock.close(0)
        if self._replay is not None:
            self._replay.close(0)
        if self._own_ctx:
            self.ctx.term()


def _digest_form(ev: dict[str, Any], digests: dict[int, bytes]) -> dict[str, Any]:
    """The event with 32-byte digests instead of 64-bit ints (what vLLM publishes when
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``)."""

    def conv(h: Any) -> Any:
        return digests.get(h, h.to_bytes(8, "big")) if isinstance(h, int) else h

    out = dict(ev)
    if "block_hashes" in out:
        out["block_hashes"] = [conv(h) for h in out["block_hashes"]]
    if out.get("parent_block_hash") is not None:
        out["parent_block_hash"] = conv(out["parent_block_hash"])
    return out


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}  # fmt: skip
        return web.json_response(body, status=self.status, dumps=_dumps)


def _dumps(x: Any) -> str:
    return orjson.dumps(x).decode()


def _bad(message: str, param: str | None = None, value: Any = None) -> ApiError:
    if param is not None:
        message = f"{message} (parameter={param}" + (
            f", value={value})" if value is not None else ")"
        )
    return ApiError(400, message, "BadRequestError", param)


@dataclass
class _Stream:
    """Per-request channel from the engine loop to the HTTP handler."""

    req: Request
    queue: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    t_arrival: float = 0.0


class TwinReplica:
    """One twin: engine, tokenizer, event publisher, and the loop that runs steps."""

    def __init__(
        self, cfg: TwinConfig, tokenizer: ModelTokenizer | None = None, zmq_ctx: Any = None
    ):
        self.cfg = cfg
        self.profile = cfg.profile
        self.max_model_len = cfg.max_model_len or cfg.profile.max_model_len
        if self.max_model_len != cfg.profile.max_model_len:
            self.profile = cfg.profile.replace(model=_with_len(cfg.profile, self.max_model_len))
        self.tokenizer = tokenizer or ModelTokenizer(cfg.model_dir, self.profile.block_size)
        self.hasher = BlockHasher(self.profile.block_size, cfg.hash_algo, cfg.hash_seed)
        self.engine = Engine(
            self.profile,
            hasher=self.hasher,
            output_token=self._output_token,
            keep_digests=not cfg.int_hashes,
        )
        self.topic = cfg.kv_events_topic or f"kv@{cfg.name}"
        self.publisher = (
            KVEventPublisher(
                cfg.kv_events_endpoint,
                self.topic,
                zmq_ctx,
                cfg.int_hashes,
                replay_endpoint=cfg.kv_events_replay,
            )
            if cfg.kv_events_endpoint
            else None
        )
        self.speedup = cfg.speedup
        self.streams: dict[str, _Stream] = {}
        self.in_flight = 0
        self._wake = asyncio.Event()
        self._t0 = time.monotonic()
        self.lagged_s = 0.0  # wall seconds the engine trailed its schedule at the last step
        self.failed: BaseException | None = None  # the engine loop's error, once it died
        self._task: asyncio.Task[None] | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.created = int(time.time())
        self.metrics = _Metrics(self)

    # ---- time ---------------------------------------------------------------------------

    def model_now(self) -> float:
        return (time.monotonic() - self._t0) * self.speedup

    async def _sleep_until(self, t_model: float) -> bool:
        """Sleep until model time ``t_model``; False when it has passed already."""
        delay = (t_model - self.model_now()) / self.speedup
        if delay > 0:
            await asyncio.sleep(delay)
            return True
        return False

    # ---- engine loop --------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._run(), name=self.cfg.name)
            if self.publisher is not None and self.publisher.replay_endpoint:
                self._replay_task = loop.create_task(self.publisher.serve_replay())

    async def stop(self) -> None:
        for task in (self._task, self._replay_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._replay_task = None
        for st in self.streams.values():
            st.queue.put_nowait(None)
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    def _publish(self) -> None:
        evs = self.engine.take_events()
        if evs and self.publisher is not None:
            self.publisher.publish(evs, self.engine.digests)

    async def _run(self) -> None:
        """The engine loop; if the engine model fails, the twin reports itself dead like a
        vLLM whose engine core died (``/health`` 500, requests refused, streams ended)
        instead of hanging its clients."""
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("twin %s: engine loop failed", self.cfg.name)
            self.failed = e
            for st in self.streams.values():
                st.queue.put_nowait(None)

    async def _loop(self) -> None:
        """Step the engine in model time. Back-to-back steps chain on the model clock (a
        step starts when the previous one ended), so the event loop's timer jitter and the
        twin's own CPU time do not accumulate — up to ``MAX_LAG_WALL_S`` behind the wall
        clock, after which the model clock is pulled forward (the twin is then too slow for
        its speedup)."""
        eng = self.engine
        free_at: float | None = None  # model time the last step ended (None: was idle)
        while True:
            if not eng.has_work:
                free_at = None
                self._wake.clear()
                await self._wake.wait()
                continue
            real = self.model_now()
            now = real if free_at is None else max(free_at, real - MAX_LAG_WALL_S * self.speedup)
            self.lagged_s = max(0.0, real - now) / self.speedup
            step = eng.schedule(now)
            if step is None:
                self._publish()
                free_at = None
                nxt = eng.next_ready()
                self._wake.clear()
                timeout = None if nxt is None else max(0.0, (nxt - real) / self.speedup)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
                continue
            end = now + step.duration
            if not await self._sleep_until(end):
                await asyncio.sleep(0)  # behind schedule: still let handlers run
            free_at = end
            res = eng.complete(step, end)
            self._publish()
            wall = time.monotonic()
            for req in res.tokens:
                st = self.streams.get(req.id)
                if st is None:
                    continue
                if req.num_output == 1:
                    self.metrics.ttft.append(wall - st.t_arrival)
                st.queue.put_nowait(req.output_ids[-1] if req.output_ids else 0)
            for req in res.finished:
                st = self.streams.get(req.id)
                if st is not None:
                    st.queue.put_nowait(None)

    def _output_token(self, req: Request, i: int) -> int:
        return self.tokenizer.plain_token(zlib.crc32(f"{req.id}/{i}".encode()))

    def check_alive(self) -> None:
        if self.failed is not None:
            raise ApiError(
                500, f"EngineCore encountered an issue: {self.failed!r}", "EngineDeadError"
            )

    def submit(self, req: Request, t_arrival: float | None = None) -> _Stream:
        """Hand ``req`` to the engine; ``t_arrival`` (monotonic) is when the HTTP request came
        in, so TTFT in /metrics includes the API overhead, as vLLM's does."""
        st = _Stream(req, t_arrival=time.monotonic() if t_arrival is None else t_arrival)
        self.engine.add(req)
        self.streams[req.id] = st
        self._wake.set()
        return st

    def release(self, req: Request) -> None:
        self.streams.pop(req.id, None)
        if not req.finished:
            self.engine.abort(req.id)
            self._wake.set()

    def reset_prefix_cache(self) -> bool:
        ok = self.engine.reset_prefix_cache()
        self._publish()
        return ok


def _with_len(p: ReplicaProfile, n: int):  # -> ModelProfile
    import dataclasses

    return dataclasses.replace(p.model, max_model_len=n)


# ---- request parsing ------------------------------------------------------------------------

APP_TWIN = web.AppKey("twin", TwinReplica)


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
    """vLLM 0.32 without ``--enable-auto-tool-choice --tool-call-parser``: tools with
    tool_choice "auto" (also when absent) or "required" are a 400; "none" and named
    functions render the tools into the prompt."""
    if not body.get("tools") or twin.cfg.enable_auto_tool_choice:
        return
    choice = body.get("tool_choice", "auto")
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


def _prompt_ids(
    twin: TwinReplica, body: dict[str, Any], chat: bool, session: str | None = None
) -> list[int]:
    tk = twin.tokenizer
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _bad("messages must be a non-empty list", "messages")
        kwargs = body.get("chat_template_kwargs")
        try:
            return tk.encode_chat(
                msgs,
                body.get("tools"),
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)),
                chat_template_kwargs=kwargs if isinstance(kwargs, dict) else None,
                session=session,
            )
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


def _limits(twin: TwinReplica, body: dict[str, Any], n_prompt: int) -> int:
    limit = twin.max_model_len
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
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
        max_tokens = _limits(twin, body, len(ids))
        if body.get("n", 1) != 1:
            raise _bad("the twin supports n=1 only", "n", body.get("n"))
    except ApiError as e:
        return e.response()
    stream = bool(body.get("stream", False))
    so = body.get("stream_options") or {}
    include_usage = bool(so.get("include_usage")) if isinstance(so, dict) else False
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:16]
    req = Request(rid, len(ids), max_tokens, token_ids=ids, session_id=session)
    created = int(time.time())
    twin.in_flight += 1
    try:
        overhead = twin.profile.request_overhead_s / twin.speedup
        if overhead > 0:
            await asyncio.sleep(overhead)
        twin.check_alive()
        st = twin.submit(req, t_arrival)
        if stream:
            return await _stream(request, twin, st, chat, rid, model, created, include_usage)
        toks: list[int] = []
        while (t := await st.queue.get()) is not None:
            toks.append(t)
        twin.check_alive()  # the engine died under this request
        text = twin.tokenizer.decode(toks)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length",
                                  "stop_reason": None}  # fmt: skip
        if chat:
            choice["message"] = {"role": "assistant", "content": text, "refusal": None,
                                 "annotations": None, "audio": None, "function_call": None,
                                 "reasoning": None}  # fmt: skip
        else:
            choice["text"] = text
        resp = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": model, "choices": [choice],
                "system_fingerprint": "kvroute-twin",
                "usage": _usage(req, twin.profile.block_size, chat, stream=False)}  # fmt: skip
        return web.json_response(resp, dumps=_dumps, headers=_headers(twin))
    finally:
        twin.in_flight -= 1
        twin.release(req)


def _headers(twin: TwinReplica) -> dict[str, str]:
    return {"x-twin-speedup": repr(twin.speedup), "x-twin-replica": twin.cfg.name}


async def _stream(
    request: web.Request,
    twin: TwinReplica,
    st: _Stream,
    chat: bool,
    rid: str,
    model: str,
    created: int,
    include_usage: bool,
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

    if chat:
        await resp.write(
            chunk(
                [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
        )
    req = st.req
    limit = twin.max_model_len
    count = 0
    while (tok := await st.queue.get()) is not None:
        count += 1
        done = count >= req.max_tokens or req.prompt_len + count >= limit
        text = twin.tokenizer.decode([tok])
        c: dict[str, Any] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": "length" if done else None,
        }
        if chat:
            c["delta"] = {"content": text}
        else:
            c["text"] = text
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


async def tokenize(request: web.Request) -> web.Response:
    twin = request.app[APP_TWIN]
    try:
        body = await _json_body(request)
        _check_model(twin, body)
        ids = _prompt_ids(twin, body, chat="messages" in body)
    except ApiError as e:
        return e.response()
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
    return web.Response(status=500 if request.app[APP_TWIN].failed else 200)


async def load(request: web.Request) -> web.Response:
    return web.json_response({"server_load": request.app[APP_TWIN].in_flight})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    twin = request.app[APP_TWIN]
    if not twin.reset_prefix_cache():
        return ApiError(
            500, "prefix cache reset refused: requests hold blocks", "InternalServerError"
        ).response()
    return web.Response(status=200)


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
        return e.response()


def build_app(twin: TwinReplica) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=64 << 20)
    app[APP_TWIN] = twin

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
    return app


# ---- /metrics -------------------------------------------------------------------------------


class _Metrics:
    """vLLM's metric names (``vllm/v1/metrics/loggers.py``), rendered from engine state on
    scrape; labels ``model_name`` and ``engine`` like vLLM's."""

    def __init__(self, twin: TwinReplica):
        self.twin = twin
        self.ttft: list[float] = []
        self._ttft_seen = 0
        from prometheus_client import CollectorRegistry, Histogram

        self.registry = CollectorRegistry()
        self.h_ttft = Histogram("vllm:time_to_first_token_seconds",
                                "Histogram of time to first token in seconds.",
                                ["model_name", "engine"], registry=self.registry,
                                buckets=TTFT_BUCKETS)  # fmt: skip

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        twin = self.twin
        eng = twin.engine
        labels = f'model_name="{twin.cfg.served_model_name}",engine="0"'
        h = self.h_ttft.labels(twin.cfg.served_model_name, "0")
        for v in self.ttft[self._ttft_seen :]:
            h.observe(v)
        self._ttft_seen = len(self.ttft)
        if self._ttft_seen > 10_000:
            self.ttft.clear()
            self._ttft_seen = 0
        p = twin.profile
        lines = []

        def gauge(name: str, doc: str, value: float, extra: str = "") -> None:
            lines.append(
                f"# HELP {name} {doc}\n# TYPE {name} gauge\n"
                f"{name}{{{labels}{extra}}} {float(value)}"
            )

        def counter(name: str, doc: str, value: float) -> None:
            lines.append(
                f"# HELP {name}_total {doc}\n# TYPE {name}_total counter\n"
                f"{name}_total{{{labels}}} {float(value)}"
            )

        gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            eng.num_running(),
        )
        gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            eng.num_waiting(),
        )
        gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", eng.kv_usage()
        )
        counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            eng.prefix_queries,
        )
        counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            eng.prefix_hits,
        )
        counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", eng.prompt_tokens_total
        )
        counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            eng.prefix_hits,
        )
        counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            eng.generation_tokens_total,
        )
        counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            eng.preemptions,
        )
        info = (
            f',block_size="{p.block_size}",num_gpu_blocks="{p.gpu_kv_blocks}",'
            f'num_cpu_blocks="{p.cpu_kv_blocks}",enable_prefix_caching="True",'
            f'prefix_caching_hash_algo="{twin.cfg.hash_algo}"'
        )
        gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", 1, info)
        gauge("kvroute:twin_speedup", "Model seconds per wall second of this twin.", twin.speedup)
        gauge(
            "kvroute:twin_lag_seconds",
            "Wall seconds the engine trailed its model-time "
            "schedule at its last step (> 0.01: too slow for its speedup).",
            twin.lagged_s,
        )
        text = "\n".join(lines) + "\n"
        return text.encode() + generate_latest(self.registry)


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
