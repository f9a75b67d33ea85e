"""A recording reverse proxy between an agent CLI and kvroute: what each call sent and got.

Owns: :class:`Tap`, an aiohttp server that forwards every request to one upstream (kvroute)
unchanged and streams the answer back unchanged, recording per call a :class:`TapCall` — the
method and path, the request's headers (key values masked) and a few body fields, the status,
kvroute's ``X-Request-Id``, when the first byte and the first token came, and the token usage
the client was told, read from the answer by this module's own reader
(:func:`reply_usage`, written apart from the router's, so a test can hold the router's
``/metrics`` to what the clients saw). Used by the agents test tier and ``kvroute demo
--agent``. Must not import the router package.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

# hop-by-hop headers and those aiohttp sets itself, never forwarded
_SKIP_REQ = frozenset({"host", "content-length", "transfer-encoding", "connection",
                       "keep-alive", "upgrade", "te", "trailer", "accept-encoding"})  # fmt: skip
_SKIP_RESP = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive",
                        "content-encoding"})  # fmt: skip
_SECRET = frozenset({"authorization", "x-api-key", "api-key", "cookie"})
# body fields worth recording (what a router could key a session on, the output cap, tools)
_BODY_FIELDS = ("model", "stream", "max_tokens", "max_output_tokens", "max_completion_tokens",
                "prompt_cache_key", "user", "safety_identifier", "metadata", "store",
                "previous_response_id", "tool_choice", "stream_options",
                "parallel_tool_calls", "temperature")  # fmt: skip


@dataclass
class TapCall:
    method: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any]  # the _BODY_FIELDS present, plus n_tools / n_messages
    t_start: float
    status: int = 0
    request_id: str | None = None  # kvroute's X-Request-Id answer header
    content_type: str = ""
    ttfb_s: float | None = None  # first answer byte
    ttft_s: float | None = None  # first token (streamed) or the whole answer (not streamed)
    duration_s: float | None = None
    usage: dict[str, int] | None = None  # {"prompt", "cached", "output"}: what the client saw
    stop: str | None = None  # stop_reason / finish_reason / response status
    client_closed: bool = False  # the client hung up before the answer's end
    answer: bytes = field(default=b"", repr=False)
    request: bytes = field(default=b"", repr=False)  # the raw body (``Tap(keep_requests=True)``)

    @property
    def inference(self) -> bool:
        """A call of the session (an inference route), not a model list or a HEAD."""
        return self.method == "POST" and self.path in (
            "/v1/messages",
            "/v1/chat/completions",
            "/v1/responses",
            "/v1/completions",
        )


def _num(v: Any) -> int:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0


def _sse_events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data.startswith(b"{"):
                try:
                    out.append(orjson.loads(data))
                except orjson.JSONDecodeError:
                    continue
    return out


def _anthropic(u: dict[str, Any]) -> dict[str, int]:
    read = _num(u.get("cache_read_input_tokens"))
    return {"prompt": _num(u.get("input_tokens")) + read
            + _num(u.get("cache_creation_input_tokens")),
            "cached": read, "output": _num(u.get("output_tokens"))}  # fmt: skip


def _openai(u: dict[str, Any]) -> dict[str, int]:
    if "prompt_tokens" in u:  # chat / completions
        d = u.get("prompt_tokens_details") or {}
        return {"prompt": _num(u.get("prompt_tokens")), "cached": _num(d.get("cached_tokens")),
                "output": _num(u.get("completion_tokens"))}  # fmt: skip
    d = u.get("input_tokens_details") or {}  # Responses
    return {"prompt": _num(u.get("input_tokens")), "cached": _num(d.get("cached_tokens")),
            "output": _num(u.get("output_tokens"))}  # fmt: skip


def reply_usage(path: str, raw: bytes, sse: bool) -> tuple[dict[str, int] | None, str | None]:
    """(usage, stop) of one answer as its client reads it: ``usage`` is ``{"prompt",
    "cached", "output"}`` (Anthropic's prompt = input + cache read + cache creation) or None
    when the answer carried none; ``stop`` the stop reason / finish reason / final status."""
    if not sse:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None, None
        if not isinstance(body, dict) or not isinstance(body.get("usage"), dict):
            return None, None
        u = body["usage"]
        if path == "/v1/messages":
            return _anthropic(u), body.get("stop_reason")
        if path == "/v1/responses":
            return _openai(u), body.get("status")
        choices = body.get("choices") or [{}]
        return _openai(u), choices[0].get("finish_reason")
    events = _sse_events(raw)
    if path == "/v1/messages":
        acc: dict[str, Any] = {}
        stop = None
        for e in events:
            if e.get("type") == "message_start":
                acc.update((e.get("message") or {}).get("usage") or {})
            elif e.get("type") == "message_delta":
                acc.update({k: v for k, v in (e.get("usage") or {}).items() if v is not None})
                stop = (e.get("delta") or {}).get("stop_reason") or stop
        return (_anthropic(acc) if acc else None), stop
    if path == "/v1/responses":
        for e in reversed(events):
            r = e.get("response")
            if isinstance(r, dict) and isinstance(r.get("usage"), dict):
                return _openai(r["usage"]), r.get("status")
        return None, None
    usage = stop = None
    for e in events:
        if isinstance(e.get("usage"), dict):
            usage = _openai(e["usage"])
        for c in e.get("choices") or ():
            stop = c.get("finish_reason") or stop
    return usage, stop


def _first_token(chunk: bytes) -> bool:
    """Whether an SSE chunk carries a generated token (a delta of text, tool arguments or
    reasoning, in any of the three APIs)."""
    for e in _sse_events(chunk):
        kind = e.get("type")
        if kind == "content_block_delta" or (isinstance(kind, str) and kind.endswith(".delta")):
            return True
        for c in e.get("choices") or ():
            d = c.get("delta") or {}
            if d.get("content") or d.get("tool_calls") or d.get("reasoning_content"):
                return True
    return False


class Tap:
    """``async with Tap(upstream) as tap: tap.url`` — forward everything, record each call."""

    def __init__(self, upstream: str, host: str = "127.0.0.1", *, keep_requests: bool = False):
        self.upstream = upstream.rstrip("/")
        self.keep_requests = keep_requests
        self.host = host
        self.calls: list[TapCall] = []
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Tap:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10), auto_decompress=False
        )
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{self.host}:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def inference_calls(self) -> list[TapCall]:
        return [c for c in self.calls if c.inference]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        raw = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP_REQ}
        shown = {k.lower(): ("***" if k.lower() in _SECRET else v)
                 for k, v in request.headers.items()}  # fmt: skip
        body: dict[str, Any] = {}
        if raw[:1] == b"{":
            try:
                parsed = orjson.loads(raw)
            except orjson.JSONDecodeError:
                parsed = None
            if isinstance(parsed, dict):
                body = {k: parsed[k] for k in _BODY_FIELDS if k in parsed}
                body["n_tools"] = len(parsed.get("tools") or ())
                msgs = parsed.get("messages", parsed.get("input"))
                body["n_messages"] = len(msgs) if isinstance(msgs, list) else 1
        call = TapCall(request.method, request.path, shown, body, time.perf_counter())
        if self.keep_requests:
            call.request = raw
        self.calls.append(call)
        url = self.upstream + request.path_qs
        try:
            up = await self._session.request(request.method, url, data=raw or None,
                                             headers=headers)  # fmt: skip
        except aiohttp.ClientError as e:
            call.status = 502
            return web.json_response({"error": {"message": f"tap: upstream: {e}"}}, status=502)
        try:
            call.status = up.status
            call.request_id = up.headers.get("X-Request-Id")
            call.content_type = up.headers.get("Content-Type", "")
            out = web.StreamResponse(status=up.status, reason=up.reason, headers={
                k: v for k, v in up.headers.items() if k.lower() not in _SKIP_RESP})  # fmt: skip
            if up.headers.get("Content-Encoding"):
                out.headers["Content-Encoding"] = up.headers["Content-Encoding"]
            await out.prepare(request)
            sse = call.content_type.startswith("text/event-stream")
            chunks: list[bytes] = []
            gone = False
            async for chunk in up.content.iter_any():
                now = time.perf_counter() - call.t_start
                if call.ttfb_s is None:
                    call.ttfb_s = now
                if sse and call.ttft_s is None and _first_token(chunk):
                    call.ttft_s = now
                chunks.append(chunk)
                if not gone:
                    try:
                        await out.write(chunk)
                    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                        # the client closed once it had what it needed (Codex does after
                        # response.completed): read the rest, so the call is recorded whole
                        gone = True
                        call.client_closed = True
            if not gone:
                with contextlib.suppress(ConnectionResetError,
                                         aiohttp.ClientConnectionResetError):  # fmt: skip
                    await out.write_eof()
        finally:
            up.release()
        call.duration_s = time.perf_counter() - call.t_start
        call.answer = b"".join(chunks)
        if not sse:
            call.ttft_s = call.duration_s
        if call.inference and call.status == 200:
            call.usage, call.stop = reply_usage(request.path, call.answer, sse)
        return out
