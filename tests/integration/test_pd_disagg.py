"""P/D disaggregation behind ``kvroute serve``: a prefill leg (``do_remote_decode``, one token)
then a decode leg carrying the prefill leg's ``kv_transfer_params``, one answer to the client.

End to end with a prefill twin and a decode twin (the decode twin takes the prompt's KV over
the modelled link instead of prefilling it); the protocol and the failure paths with small
recording fakes, so what each leg received can be asserted byte for byte."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from loadtest import tinymodel
from loadtest.twin.cluster import start_cluster
from router.app import METRICS, REPLICAS

pytestmark = pytest.mark.timeout(90)
WORDS = tinymodel._WORDS


def words(n: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7919 + i * 104729) % len(WORDS)] for i in range(n))


def chat(text: str, max_tokens: int = 6, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def pd_count(app: web.Application, mode: str, reason: str | None = None) -> float:
    total = 0.0
    for fam in app[METRICS].pd.collect():
        for s in fam.samples:
            if s.name.endswith("_total") and s.labels.get("mode") == mode:
                if reason is None or s.labels.get("reason") == reason:
                    total += s.value
    return total


def retries(app: web.Application, reason: str) -> float:
    return sum(
        s.value
        for fam in app[METRICS].retries.collect()
        for s in fam.samples
        if s.name.endswith("_total") and s.labels.get("reason") == reason
    )


# ---- end to end: twins ---------------------------------------------------------------------


async def test_twins_split_call_runs_both_legs_and_answers_once(router):
    async with start_cluster(2, "cpu-tiny", speedup=20.0, roles=["prefill", "decode"]) as c:
        pre, dec = c.replicas
        url, app = await router(
            [c.urls[0] + "#role=prefill", c.urls[1] + "#role=decode"], pd_mode="always"
        )
        prompt = words(1500, 1)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            async with http.post(url + "/v1/chat/completions", json=chat(prompt)) as r:
                assert r.status == 200, await r.text()
                assert r.headers["x-twin-replica"] == dec.cfg.name  # decoded there
                out = await r.json()
            assert out["object"] == "chat.completion"
            assert out["usage"]["completion_tokens"] == 6
            assert out["choices"][0]["finish_reason"] == "length"
            assert "kv_transfer_params" not in out  # the decode leg asked for none
            # the prefill twin computed the prompt; the decode twin received it over the link
            assert pre.engine.prefix_queries == out["usage"]["prompt_tokens"]
            assert dec.engine.remote_blocks > 0
            got = out["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert got == dec.engine.remote_blocks * pre.profile.block_size

            # streamed: one SSE stream from the decode leg, usage at its end
            async with http.post(
                url + "/v1/chat/completions", json=chat(words(1500, 2), stream=True)
            ) as r:
                assert r.status == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                raw = await r.read()
            events = [e for e in raw.split(b"\n\n") if e.strip()]
            assert events[-1] == b"data: [DONE]"
            chunks = [orjson.loads(e[len(b"data: ") :]) for e in events[:-1]]
            assert chunks[-1]["usage"]["completion_tokens"] == 6
            assert (
                sum(
                    1
                    for ch in chunks
                    if ch["choices"] and ch["choices"][0]["delta"].get("content") is not None
                )
                >= 1
            )
        assert pd_count(app, "split") == 2


# ---- the protocol and the failure paths: recording fakes -----------------------------------


class Leg:
    """A vLLM-shaped replica that records each call's body; a prefill-capable one answers
    ``do_remote_decode`` with ``kv_transfer_params`` naming itself."""

    def __init__(self, name: str, fail: int | None = None):
        self.name, self.fail = name, fail
        self.fail_pull: int | None = None  # the status a decode leg (params in) gets
        self.bodies: list[dict[str, Any]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _infer(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.bodies.append(body)
        params = body.get("kv_transfer_params") or {}
        fail = self.fail or (self.fail_pull if params.get("do_remote_prefill") else None)
        if fail:
            return web.json_response({"error": {"message": "injected", "code": fail}},
                                     status=fail)  # fmt: skip
        if not body.get("stream"):
            choice = {"index": 0, "message": {"content": "x"}}
            ans: dict[str, Any] = {"id": "c1", "object": "chat.completion", "replica": self.name,
                                   "choices": [choice]}  # fmt: skip
            if params.get("do_remote_decode"):
                ans["kv_transfer_params"] = {
                    "do_remote_prefill": True, "do_remote_decode": False,
                    "remote_block_ids": [[1, 2, 3]], "remote_engine_id": f"eng-{self.name}",
                    "remote_request_id": "req-1", "remote_host": "10.0.0.1", "remote_port": 5600,
                    "tp_size": 1,
                }  # fmt: skip
            return web.json_response(ans)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for part in (b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', b"data: [DONE]\n\n"):
            await resp.write(part)
        await resp.write_eof()
        return resp

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _ok(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def start(self) -> Leg:
        app = web.Application()
        app.router.add_post("/v1/{tail:.+}", self._infer)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._ok)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()


@pytest.fixture
async def legs() -> AsyncIterator[Callable[..., Any]]:
    started: list[Leg] = []

    async def make(*specs: tuple[str, int | None]) -> list[Leg]:
        out = [await Leg(n, f).start() for n, f in specs]
        started.extend(out)
        return out

    yield make
    for x in started:
        await x.stop()


async def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None):
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            return r.status, await r.read(), r.headers


async def test_legs_follow_vllms_kv_transfer_params_protocol(router, legs):
    p, d = await legs(("p", None), ("d", None))
    url, _ = await router([p.url + "#role=prefill", d.url + "#role=decode"], pd_mode="always")
    body = chat("hello there", max_tokens=50, stream=True)
    body["max_completion_tokens"] = 50
    status, raw, headers = await _post(url, body, {"X-Request-Id": "rid-7"})
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
    assert len(p.bodies) == 1 and len(d.bodies) == 1
    pre = p.bodies[0]
    assert pre["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None,
    }  # fmt: skip
    assert pre["stream"] is False and pre["max_tokens"] == 1 and pre["max_completion_tokens"] == 1
    assert "stream_options" not in pre and pre["messages"] == body["messages"]
    dec = d.bodies[0]
    # the decode leg: the client's body, with the prefill leg's params as they came back
    assert dec["kv_transfer_params"]["remote_engine_id"] == "eng-p"
    assert dec["kv_transfer_params"]["remote_block_ids"] == [[1, 2, 3]]
    assert {k: v for k, v in dec.items() if k != "kv_transfer_params"} == body
    assert headers["X-Request-Id"] == "rid-7"


async def test_failed_prefill_leg_moves_to_another_prefill_replica(router, legs):
    bad, good, d = await legs(("bad", 503), ("good", None), ("d", None))
    urls = [bad.url + "#role=prefill", good.url + "#role=prefill", d.url + "#role=decode"]
    url, _app = await router(urls, pd_mode="always", policy="round_robin")
    for _ in range(2):  # one of the two calls starts on the failing replica
        status, raw, _ = await _post(url, chat("hi"))
        assert status == 200, raw
        assert orjson.loads(raw)["replica"] == "d"
    assert len(good.bodies) == 2 and len(bad.bodies) >= 1
    assert all(b["kv_transfer_params"]["remote_engine_id"] == "eng-good" for b in d.bodies)


async def test_every_prefill_leg_failing_runs_the_call_colocated(router, legs):
    bad, d = await legs(("bad", 500), ("d", None))
    url, app = await router([bad.url + "#role=prefill", d.url + "#role=decode"], pd_mode="always")
    status, raw, _ = await _post(url, chat("hi"))
    assert status == 200 and orjson.loads(raw)["replica"] == "d"
    assert "kv_transfer_params" not in d.bodies[-1]  # a plain call: it prefills itself
    assert pd_count(app, "colocated") == 1 and pd_count(app, "split") == 0


async def test_prefill_leg_client_error_is_the_answer(router, legs):
    p, d = await legs(("p", 400), ("d", None))
    url, _ = await router([p.url + "#role=prefill", d.url + "#role=decode"], pd_mode="always")
    status, raw, _ = await _post(url, chat("hi"))
    assert status == 400
    assert orjson.loads(raw)["error"]["message"] == "injected"
    assert d.bodies == []  # no decode leg


async def test_decode_leg_failure_is_retried_on_another_decode_replica(router, legs):
    p, bad, good = await legs(("p", None), ("dbad", 503), ("dgood", None))
    urls = [p.url + "#role=prefill", bad.url + "#role=decode", good.url + "#role=decode"]
    url, app = await router(urls, pd_mode="always")
    for _ in range(2):
        status, raw, _ = await _post(url, chat("hi"))
        assert status == 200 and orjson.loads(raw)["replica"] == "dgood"
    assert all(b["kv_transfer_params"]["remote_engine_id"] == "eng-p" for b in good.bodies)
    assert pd_count(app, "split") == 2 and pd_count(app, "colocated") == 0  # a 503 keeps it


async def test_a_decode_leg_whose_kv_pull_failed_runs_the_call_colocated(router, legs):
    """vLLM answers a decode leg 500 when its KV pull failed (``kv_load_failure_policy``
    "fail"): the router runs the call colocated, without the params, instead of sending the
    same doomed pull to another decode replica; the decode replica's breaker is not charged."""
    p, d1, d2 = await legs(("p", None), ("d1", None), ("d2", None))
    d1.fail_pull = d2.fail_pull = 500
    urls = [p.url + "#role=prefill", d1.url + "#role=decode", d2.url + "#role=decode"]
    url, app = await router(urls, pd_mode="always")
    charged: list[str] = []
    for r in app[REPLICAS]:
        r.breaker.on_failure = lambda n=r.name: charged.append(n)  # type: ignore[method-assign]
    for i in range(3):
        status, raw, _ = await _post(url, chat(f"hi {i}"))
        assert status == 200, raw
        assert orjson.loads(raw)["replica"] in ("d1", "d2")
    sent = d1.bodies + d2.bodies
    pulls = [b for b in sent if "kv_transfer_params" in b]
    assert len(pulls) == 3 and len(sent) == 6  # one failed pull per call, then one plain call
    assert len(p.bodies) == 3
    assert pd_count(app, "colocated", "decode_failed") == 3 and pd_count(app, "split") == 0
    assert retries(app, "pd_decode_failed") == 3 and retries(app, "status") == 0
    assert charged == []


async def test_a_decode_replica_answering_500_to_everything_answers_the_client_once(router, legs):
    p, d = await legs(("p", None), ("d", 500))
    url, app = await router([p.url + "#role=prefill", d.url + "#role=decode"], pd_mode="always")
    status, raw, _ = await _post(url, chat("hi"))
    assert status == 500 and orjson.loads(raw)["error"]["message"] == "injected"
    assert ["kv_transfer_params" in b for b in d.bodies] == [True, False]  # pull, then plain
    assert pd_count(app, "colocated", "decode_failed") == 1


async def test_auto_mode_colocates_short_prompts_and_splits_long_ones(router, legs, tmp_path):
    p, d = await legs(("p", None), ("d", None))
    log = tmp_path / "decisions.jsonl"
    url, app = await router([p.url + "#role=prefill", d.url + "#role=decode"], pd_mode="auto",
                            pd_min_prompt_tokens=500, decision_log=str(log))  # fmt: skip
    status, _raw, _ = await _post(url, chat("short"))
    assert status == 200 and p.bodies == []  # colocated on the decode replica
    assert "kv_transfer_params" not in d.bodies[0]
    status, _raw, _ = await _post(url, chat(words(3000, 5)))
    assert status == 200 and len(p.bodies) == 1
    assert d.bodies[1]["kv_transfer_params"]["remote_engine_id"] == "eng-p"
    assert pd_count(app, "colocated") == 1 and pd_count(app, "split") == 1
    lines = [orjson.loads(x) for x in log.read_bytes().splitlines()]
    split = [x for x in lines if x.get("pd", {}).get("disaggregate")]
    assert len(split) == 1 and split[0]["winner"] == p.url and split[0]["pd"]["decode"] == d.url


async def test_without_roles_nothing_changes(router, legs):
    a, b = await legs(("a", None), ("b", None))
    url, _app = await router([a.url, b.url])
    status, _raw, _ = await _post(url, chat(words(3000, 6)))
    assert status == 200
    seen = a.bodies + b.bodies
    assert len(seen) == 1 and "kv_transfer_params" not in seen[0]


async def test_client_gone_during_the_prefill_leg_aborts_it_and_sends_no_decode_leg(router, legs):
    p, d = await legs(("p", None), ("d", None))
    gate = asyncio.Event()
    orig = p._infer

    async def slow(request: web.Request) -> web.StreamResponse:
        try:
            gate.set()
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            p.aborted = True
            raise
        return await orig(request)

    p._infer = slow  # type: ignore[method-assign]
    app = web.Application()
    app.router.add_post("/v1/{tail:.+}", slow)
    url, _ = await router([p.url + "#role=prefill", d.url + "#role=decode"], pd_mode="always")
    # the bound method was captured at start(): restart p's app with the slow handler
    await p.stop()
    p._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await p._runner.setup()
    host, port = p.url.rsplit(":", 1)[0][len("http://") :], int(p.url.rsplit(":", 1)[1])
    await web.TCPSite(p._runner, host, port).start()
    task = asyncio.create_task(_post(url, chat("hi")))
    await asyncio.wait_for(gate.wait(), 10)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    for _ in range(100):
        if getattr(p, "aborted", False):
            break
        await asyncio.sleep(0.05)
    assert getattr(p, "aborted", False)  # the router closed the prefill leg's connection
    await asyncio.sleep(0.2)
    assert d.bodies == []


async def test_other_routes_and_pd_mode_never_stay_off_prefill_only_replicas(router, legs):
    p, d = await legs(("p", None), ("d", None))
    urls = [p.url + "#role=prefill", d.url + "#role=decode"]
    url, app = await router(urls, pd_mode="never")
    for i in range(6):  # six sessions: without the rule some would hash to the prefill one
        status, raw, _ = await _post(url, chat(words(3000, 7 + i)))
        assert status == 200 and orjson.loads(raw)["replica"] == "d"
    url2, _ = await router(urls, pd_mode="always")
    async with aiohttp.ClientSession() as http:
        for i in range(6):  # Anthropic messages: not split, run decode-side
            turn = {"role": "user", "content": f"hi {i} " + words(50, i)}
            msg = {"model": "tiny", "max_tokens": 5, "messages": [turn]}
            async with http.post(url2 + "/v1/messages", json=msg) as r:
                assert r.status == 200, await r.text()
    assert p.bodies == [] and len(d.bodies) == 12
    assert pd_count(app, "split") == 0
