"""NVIDIA Dynamo's real KV router behind a thin HTTP front: the bench target ``dynamo:kv``.

Owns: an aiohttp proxy that, for each ``POST /v1/chat/completions`` (``/v1/completions``,
``/v1/messages``, ``/v1/responses``), tokenizes the prompt as the twins do
(:class:`loadtest.twin.tokenize.ModelTokenizer`: vLLM 0.32's chat template rendering over the
model folder's tokenizer), asks Dynamo's selection core which replica should serve it
(``dynamo._core.SelectionService.select_and_reserve``, the runtime-free core of
``python -m dynamo.select_service``; ``ai-dynamo-runtime`` 1.6.1), forwards the request
bytes unchanged to that replica, streams the answer back, and reports the request's lifecycle
to the service as Dynamo's own frontend does: ``prefill_complete`` when the first body bytes
arrive (the twins and vLLM send the first SSE chunk with the first output token) and
``free_reservation`` when the answer ends, fails or the client goes away.

Dynamo subscribes to each replica's vLLM ZMQ KV-event stream itself (``kv_events_endpoints``
``{0: "tcp://…"}`` per worker) and recomputes its block hashes from the ``token_ids`` of
``BlockStored``; nothing of kvroute's index or cost model is used. Its settings are its own
defaults (overlap credit 1.0, prefill load scale 1.0, host-tier credit 0.75, disk 0.25,
temperature 0, no session affinity) unless ``DYN_ROUTER_*`` variables say otherwise (read by
the service itself). The session id is the one Dynamo's HTTP frontend reads,
``X-Dynamo-Session-ID``; it only steers the choice when session affinity is on
(``--session-affinity-ttl-secs``, Dynamo's ``--router-session-affinity-ttl-secs``; off by
default upstream). docs/peers.md lists what was verified and where this front differs from
Dynamo's own.

Runs in the Dynamo venv (``scripts/setup_peers.sh dynamo``), as its own process:

    python -m loadtest.sweep.dynamo_front --port 8100 --model tiny --block-size 64 \\
        --tokenizer DIR --worker http://127.0.0.1:8001=tcp://127.0.0.1:5557 ...

Imports only the twins' tokenizer (``router.vllm`` / ``router.kv.tokens``: tokenizers, jinja2,
numpy, cbor2) and ``router.errors`` (error shapes) from this repo; never the router's proxy,
policies or KV layer.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

from router.errors import error_response, sse_error_event

log = logging.getLogger("kvroute.dynamo_front")

SESSION_HEADER = "x-dynamo-session-id"  # what Dynamo's HTTP frontend reads for affinity
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
# Not forwarded either way: hop-by-hop headers and those aiohttp recomputes.
HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "host", "content-length", "content-encoding",
}  # fmt: skip


@dataclass
class Worker:
    worker_id: int
    url: str
    events: str  # the replica's bound ZMQ PUB endpoint


@dataclass
class FrontConfig:
    workers: list[Worker]
    model: str = "tiny"
    block_size: int = 64
    tokenizer: str | None = None
    session_affinity_ttl_s: float | None = None  # None: Dynamo's default (off)
    timeout_s: float = 3600.0


@dataclass
class Front:
    """The service, the tokenizer and the upstream client of one front process."""

    cfg: FrontConfig
    svc: Any = None
    tok: Any = None
    http: ClientSession | None = None
    # tokenization is CPU work: one thread (the session cache is not thread-safe) off the loop
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "tokenize"))
    by_id: dict[int, Worker] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1


FRONT = web.AppKey("front", Front)


async def _lifecycle(app: web.Application):  # cleanup_ctx: start what the front needs, then stop it
    from dynamo._core import SelectionService

    from loadtest.twin.tokenize import ModelTokenizer

    front = app[FRONT]
    cfg = front.cfg
    kw = {}
    if cfg.session_affinity_ttl_s is not None:
        kw["session_affinity_ttl_secs"] = cfg.session_affinity_ttl_s
    front.svc = SelectionService(**kw)
    front.tok = ModelTokenizer(cfg.tokenizer, block_size=cfg.block_size) if cfg.tokenizer else None
    for w in cfg.workers:
        rec = await front.svc.upsert_worker(
            {"worker_id": w.worker_id, "model_name": cfg.model, "endpoint": w.url,
             "block_size": cfg.block_size, "kv_events_endpoints": {0: w.events}}
        )  # fmt: skip
        front.by_id[w.worker_id] = w
        log.info("worker %d %s events %s: %s", w.worker_id, w.url, w.events, rec.get("lifecycle"))
    front.http = ClientSession(
        connector=TCPConnector(limit=0, force_close=False),
        timeout=ClientTimeout(total=cfg.timeout_s, sock_connect=10.0),
        auto_decompress=False,
    )
    yield
    await front.http.close()
    front.svc.shutdown()
    front.pool.shutdown(wait=False, cancel_futures=True)


# ---- tokenization ---------------------------------------------------------------------------


class BadRequest(ValueError):
    pass


def prompt_tokens(tok: Any, route: str, body: dict[str, Any], session: str | None) -> list[int]:
    """The prompt's token ids as a twin (vLLM 0.32) computes them for ``route``."""
    from loadtest.twin.tokenize import TemplateError

    if route == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            return list(tok.encode(prompt, session))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise BadRequest("prompt: a non-empty string or list of token ids is required")
    if route == "/v1/chat/completions" or route == "/v1/messages":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("messages: a non-empty list is required")
    elif body.get("input") in (None, "", []):
        raise BadRequest("input: required")
    try:
        ids = list(tok.encode_body(body, session, route=route))
    except TemplateError as e:  # fixed text: error messages never echo request bytes
        raise BadRequest("the messages cannot be rendered by the model's chat template") from e
    if not ids:
        raise BadRequest("the prompt is empty")
    return ids


# ---- handlers -------------------------------------------------------------------------------


def _session_id(request: web.Request) -> str | None:
    sid = request.headers.get(SESSION_HEADER, "").strip()
    return sid or None


async def generate(request: web.Request) -> web.StreamResponse:
    front = request.app[FRONT]
    route = request.path
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return error_response(route, 400, "the request body is not valid JSON")
    if not isinstance(body, dict):
        return error_response(route, 400, "the request body must be a JSON object")
    if front.tok is None:
        return error_response(route, 500, "the front has no tokenizer", "internal_error")
    session = _session_id(request)
    loop = asyncio.get_running_loop()
    try:
        ids = await loop.run_in_executor(front.pool, prompt_tokens, front.tok, route, body, session)
    except BadRequest as e:
        return error_response(route, 400, str(e))
    sel_id = uuid.uuid4().hex
    ask: dict[str, Any] = {"model_name": front.cfg.model, "token_ids": ids, "selection_id": sel_id}
    if session is not None:
        ask["session_id"] = session
    from dynamo._core import SelectionServiceError

    try:
        choice = await front.svc.select_and_reserve(ask)
    except SelectionServiceError as e:
        front.count("select_failed")
        status = int(getattr(e, "status_code", 503) or 503)
        return error_response(route, status, "no replica can take the request", "unavailable")
    front.count("selected")
    try:
        return await _forward(request, front, route, raw, choice, sel_id)
    finally:
        try:
            await front.svc.free_reservation(sel_id)
        except SelectionServiceError:
            pass  # already gone (the service was shut down)


async def _forward(
    request: web.Request,
    front: Front,
    route: str,
    raw: bytes,
    choice: dict[str, Any],
    sel_id: str,
) -> web.StreamResponse:
    w = front.by_id.get(int(choice["worker_id"]))
    url = (w.url if w else str(choice["endpoint"])).rstrip("/") + request.path_qs
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
    assert front.http is not None
    try:
        up = await front.http.post(url, data=raw, headers=headers)
    except (TimeoutError, ClientError) as e:
        front.count("upstream_failed")
        log.warning("replica %s failed: %r", url, e)
        return error_response(route, 502, "the replica did not answer", "upstream_error")
    async with up:
        resp = web.StreamResponse(status=up.status)
        for k, v in up.headers.items():
            if k.lower() not in HOP:
                resp.headers.add(k, v)
        resp.headers["x-dynamo-worker-id"] = str(choice["worker_id"])
        await resp.prepare(request)
        first = True
        try:
            async for chunk in up.content.iter_any():
                if first:  # the first output token is here: its prefill is done
                    first = False
                    await front.svc.prefill_complete(sel_id)
                await resp.write(chunk)
        except (TimeoutError, ClientError) as e:
            front.count("upstream_broke")
            log.warning("replica %s broke mid-answer: %r", url, e)
            if "text/event-stream" in up.headers.get("content-type", ""):
                await resp.write(sse_error_event(route, "the replica failed mid-answer"))
        await resp.write_eof()
        return resp


async def passthrough_get(request: web.Request) -> web.Response:
    """``GET /v1/models`` from the first replica (all serve the same model)."""
    front = request.app[FRONT]
    assert front.http is not None
    url = front.cfg.workers[0].url.rstrip("/") + request.path_qs
    try:
        async with front.http.get(url) as up:
            return web.Response(
                status=up.status, body=await up.read(), content_type=up.content_type
            )
    except (TimeoutError, ClientError):
        return error_response(request.path, 502, "the replica did not answer", "upstream_error")


async def health(request: web.Request) -> web.Response:
    """200 once Dynamo calls at least one worker schedulable, else 503."""
    front = request.app[FRONT]
    ready = front.svc.ready() if front.svc is not None else {"ready": False}
    return web.json_response(
        {"ready": bool(ready.get("ready")), "schedulable": ready.get("schedulable_workers")},
        status=200 if ready.get("ready") else 503,
    )


async def overlap(request: web.Request) -> web.Response:
    """``POST /debug/overlap?route=/v1/chat/completions`` with a request body: Dynamo's
    per-worker, per-tier overlap for its prompt (``overlap_scores``), without booking."""
    front = request.app[FRONT]
    route = request.query.get("route", "/v1/chat/completions")
    if route not in ROUTES:
        return error_response(request.path, 400, f"route must be one of {list(ROUTES)}")
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return error_response(request.path, 400, "the request body is not valid JSON")
    if not isinstance(body, dict) or front.tok is None:
        return error_response(request.path, 400, "the request body must be a JSON object")
    loop = asyncio.get_running_loop()
    try:
        ids = await loop.run_in_executor(
            front.pool, prompt_tokens, front.tok, route, body, _session_id(request)
        )
    except BadRequest as e:
        return error_response(request.path, 400, str(e))
    scores = await front.svc.overlap_scores({"model_name": front.cfg.model, "token_ids": ids})
    return web.json_response(scores, dumps=lambda x: orjson.dumps(x).decode())


async def state(request: web.Request) -> web.Response:
    """Dynamo's per-worker load (``loads()``) and the front's counters, for diagnosis."""
    front = request.app[FRONT]
    return web.json_response(
        {"loads": front.svc.loads(), "counts": front.counts},
        dumps=lambda x: orjson.dumps(x).decode(),
    )


def build_app(cfg: FrontConfig) -> web.Application:
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app[FRONT] = Front(cfg)
    app.cleanup_ctx.append(_lifecycle)
    for r in ROUTES:
        app.router.add_post(r, generate)
    app.router.add_get("/v1/models", passthrough_get)
    app.router.add_get("/health", health)
    app.router.add_get("/state", state)
    app.router.add_post("/debug/overlap", overlap)
    return app


def parse_worker(spec: str, worker_id: int) -> Worker:
    url, sep, ep = spec.partition("=")
    if not sep or not url.startswith("http") or not ep.startswith(("tcp://", "ipc://")):
        raise argparse.ArgumentTypeError(f"--worker wants URL=ZMQ_ENDPOINT, got {spec!r}")
    return Worker(worker_id, url, ep)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--model", default="tiny", help="the replicas' served model name")
    p.add_argument("--block-size", type=int, default=64, help="the replicas' KV block size")
    p.add_argument("--tokenizer", required=True, help="the replicas' model folder")
    p.add_argument(
        "--worker", action="append", default=[], required=True,
        help="URL=ZMQ_ENDPOINT of one replica and its bound KV-event publisher (repeat)",
    )  # fmt: skip
    p.add_argument(
        "--session-affinity-ttl-secs", type=float, default=None,
        help="Dynamo's session affinity idle TTL (default: off, as upstream)",
    )  # fmt: skip
    p.add_argument("--log-level", default=os.environ.get("KVROUTE_LOG_LEVEL", "WARNING"))
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    workers = [parse_worker(s, i + 1) for i, s in enumerate(a.worker)]
    cfg = FrontConfig(
        workers, a.model, a.block_size, a.tokenizer, a.session_affinity_ttl_secs
    )  # fmt: skip
    web.run_app(build_app(cfg), host=a.host, port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
