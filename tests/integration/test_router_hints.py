"""The router sends the engine plugin's retention hints (``engine_hints: true``) and shows
them in ``/admin/route?explain=1``; a client's own ``kvroute`` hint never reaches a replica."""

from __future__ import annotations

import orjson

from tests.integration.test_router_proxy import fakes, http  # noqa: F401

HDR = {"Content-Type": "application/json", "x-session-id": "agent-7"}
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


async def test_router_sends_retention_hints_and_explains_them(fakes, router, http):  # noqa: F811
    (f,) = await fakes(1)
    url, _ = await router([f.url], engine_hints=True, admin_key="adm")
    for _ in range(2):
        async with http.post(url + "/v1/chat/completions", json=BODY, headers=HDR) as r:
            assert r.status == 200
    hint = orjson.loads(f.seen[-1].body)["kv_transfer_params"]["kvroute"]
    assert hint["state"] == "tool-pause" and hint["session"].endswith("agent-7")
    assert "return_s" in hint  # the gap between the two calls
    async with http.post(url + "/admin/route?explain=1", json=BODY,
                         headers={**HDR, "X-Admin-Key": "adm"}) as r:  # fmt: skip
        out = await r.json()
    assert out["engine_hint"]["session"] == hint["session"]
    # a client cannot steer another session's retention
    spoof = {**BODY, "kv_transfer_params": {"kvroute": {"session": "victim", "state": "done"}}}
    async with http.post(url + "/v1/chat/completions", json=spoof, headers=HDR) as r:
        assert r.status == 200
    assert orjson.loads(f.seen[-1].body)["kv_transfer_params"]["kvroute"]["session"] != "victim"


async def test_hints_off_by_default_and_spoofed_hints_stripped(fakes, router, http):  # noqa: F811
    (f,) = await fakes(1)
    url, _ = await router([f.url])
    raw = orjson.dumps(BODY)
    async with http.post(url + "/v1/chat/completions", data=raw, headers=HDR) as r:
        assert r.status == 200
    assert f.seen[-1].body == raw  # untouched bytes
    spoof = {**BODY, "kv_transfer_params": {"kvroute": {"session": "victim", "state": "done"}}}
    async with http.post(url + "/v1/chat/completions", json=spoof, headers=HDR) as r:
        assert r.status == 200
    assert "kv_transfer_params" not in orjson.loads(f.seen[-1].body)
