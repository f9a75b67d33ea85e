# ruff: noqa: F811  (fixtures shared from test_router_proxy are imported by name)
"""Session conventions pin a session to one replica; tenants never share sessions; admin views."""

from __future__ import annotations

import pytest

from router.keys import MONITOR
from tests.integration.test_router_proxy import fakes, http  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(60)

CONVENTIONS = {
    "claude-code": lambda s: ({"x-claude-code-session-id": s}, {}),
    "claude-code-subagent": lambda s: (
        {
            "x-claude-code-session-id": "main",
            "x-claude-code-agent-id": s,
            "x-claude-code-parent-agent-id": "lead",
        },
        {},
    ),
    "codex-dash": lambda s: ({"session-id": s}, {}),
    "codex-underscore": lambda s: ({"session_id": s}, {}),
    "opencode": lambda s: ({"x-session-id": s, "x-parent-session-id": "p"}, {}),
    "dynamo": lambda s: ({"X-Dynamo-Session-ID": s, "X-Dynamo-Parent-Session-ID": "p"}, {}),
    "sglang": lambda s: ({"X-SMG-Routing-Key": s}, {}),
    "llm-d": lambda s: ({"x-session-token": s}, {}),
    "agentx": lambda s: ({"X-Correlation-ID": s}, {}),
    "prompt_cache_key": lambda s: ({}, {"prompt_cache_key": s}),
    "safety_identifier": lambda s: ({}, {"safety_identifier": s}),
    "user": lambda s: ({}, {"user": s}),
    "cache_salt": lambda s: ({}, {"cache_salt": s}),
    "prefix-fallback": lambda s: (  # one long system prompt for all: the first turn differs
        {},
        {"messages": [{"role": "system", "content": "tools and rules " * 400 + s}]},
    ),
}


@pytest.mark.parametrize("convention", sorted(CONVENTIONS))
async def test_each_convention_pins_a_session_to_one_replica(convention, fakes, router, http):
    reps = await fakes(4)
    url, _ = await router([r.url for r in reps], policy="session_affinity")
    placement: dict[str, set[str]] = {}
    for turn in range(3):
        for i in range(8):
            sid = f"sess-{convention}-{i}"
            headers, fields = CONVENTIONS[convention](sid)
            msgs = fields.pop("messages", [{"role": "system", "content": "sys"}])
            for t in range(turn + 1):  # the conversation grows a turn each time
                msgs += [
                    {"role": "user", "content": f"t{t}"},
                    {"role": "assistant", "content": "a"},
                ]
            body = {"model": "tiny", "messages": msgs[:-1], **fields}
            async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200
                placement.setdefault(sid, set()).add((await r.json())["replica"])
    assert all(len(v) == 1 for v in placement.values()), placement
    assert len(set().union(*placement.values())) >= 2  # sessions do spread over replicas


async def test_round_robin_spreads_a_session_but_affinity_does_not(fakes, router, http):
    reps = await fakes(3)
    url, _ = await router([r.url for r in reps], policy="round_robin")
    seen = set()
    for _ in range(6):
        async with http.post(
            url + "/v1/chat/completions", json={"model": "tiny", "messages": [], "user": "u"}
        ) as r:
            seen.add((await r.json())["replica"])
    assert len(seen) == 3


async def test_tenants_with_the_same_session_id_never_collide(fakes, router, http):
    reps = await fakes(2)
    url, _ = await router(
        [r.url for r in reps], api_keys={"key-a": "alpha", "key-b": "beta"}, admin_key="adm"
    )
    for key in ("key-a", "key-b"):
        async with http.post(
            url + "/v1/chat/completions",
            json={"model": "tiny", "messages": []},
            headers={"Authorization": f"Bearer {key}", "x-session-id": "shared"},
        ) as r:
            assert r.status == 200
    async with http.get(url + "/admin/sessions", headers={"X-Admin-Key": "adm"}) as r:
        keys = {s["key"] for s in (await r.json())["sessions"]}
    assert {"alpha/shared", "beta/shared"} <= keys
    async with http.get(url + "/admin/sessions") as r:
        assert r.status == 401
    async with http.get(url + "/v1/models") as r:
        assert r.status == 401
    # explaining a tenant's call: client key in Authorization, admin key in X-Admin-Key
    async with http.post(
        url + "/admin/route?explain=1",
        json={"model": "tiny", "messages": []},
        headers={"Authorization": "Bearer key-b", "X-Admin-Key": "adm", "x-session-id": "shared"},
    ) as r:
        assert r.status == 200 and (await r.json())["identity"]["key"] == "beta/shared"


async def test_lineage_and_timing_are_recorded(fakes, router, http):
    reps = await fakes(2)
    url, _ = await router([r.url for r in reps], admin_key="adm")
    calls = [
        ({"x-claude-code-session-id": "S"}, 2),
        ({"x-claude-code-session-id": "S", "x-claude-code-agent-id": "sub1"}, 1),
    ]
    for headers, n in calls:
        for _ in range(n):
            async with http.post(
                url + "/v1/chat/completions",
                json={"model": "tiny", "messages": []},
                headers=headers,
            ) as r:
                assert r.status == 200
    async with http.get(url + "/admin/sessions", headers={"X-Admin-Key": "adm"}) as r:
        by_key = {s["key"]: s for s in (await r.json())["sessions"]}
    main, sub = by_key["-/S"], by_key["-/S#sub1"]
    assert sub["parent"] == "-/S" and main["children"] == ["-/S#sub1"]
    assert main["calls"] == 2 and len(main["gaps"]) == 1 and main["gaps"][0] >= 0
    assert main["last_call_end"] >= main["last_seen"] and main["replica"] in {r.url for r in reps}


async def test_admin_route_explains_why_a_replica_won(fakes, router, http):
    reps = await fakes(3)
    url, _ = await router([r.url for r in reps], admin_key="adm")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    async with http.post(
        url + "/admin/route?explain=1",
        json=body,
        headers={"X-Admin-Key": "adm", "x-session-id": "abc"},
    ) as r:
        assert r.status == 200
        out = await r.json()
    ex = out["explain"]
    assert out["identity"]["session"] == "abc" and out["identity"]["source"] == "opencode"
    assert ex["winner"] == out["winner"] == ex["candidates"][0]["replica"]
    # the default policy, kv_cost, without a KV layer scores like bounded-load affinity
    assert ex["policy"] == "kv_cost" and ex["weights"] == {"kv_cost": 1.0}
    assert ex["candidates"][0]["scores"]["kv_cost"] == 1.0
    assert sum(len(r.seen) for r in reps) == 0  # explaining routes nothing
    async with http.post(
        url + "/admin/route?explain=1", json=body, headers={"X-Admin-Key": "wrong"}
    ) as r:
        assert r.status == 401


async def _sessions(http, url):
    async with http.get(url + "/admin/sessions", headers={"X-Admin-Key": "adm"}) as r:
        return {s["key"]: s for s in (await r.json())["sessions"]}


@pytest.mark.parametrize("api", ["chat", "anthropic"])
async def test_an_id_less_conversation_is_one_session_on_one_replica(api, fakes, router, http):
    reps = await fakes(3)
    url, _ = await router([r.url for r in reps], policy="session_affinity", admin_key="adm")
    path = "/v1/chat/completions" if api == "chat" else "/v1/messages"
    msgs = [{"role": "user", "content": "fix the failing test"}]
    where = set()
    for turn in range(5):  # five turns, a short system prompt, no session id anywhere
        body = {"model": "tiny", "max_tokens": 8, "messages": msgs}
        if api == "chat":
            body["messages"] = [{"role": "system", "content": "be terse"}, *msgs]
        else:
            body["system"] = "be terse"
        async with http.post(url + path, json=body) as r:
            assert r.status == 200
            where.add((await r.json())["replica"])
        msgs = [*msgs, {"role": "assistant", "content": f"did {turn}"},
                {"role": "user", "content": f"now step {turn}"}]  # fmt: skip
    (only,) = (await _sessions(http, url)).values()
    assert only["calls"] == 5 and len(where) == 1


async def test_count_tokens_is_not_a_call_of_the_session(fakes, router, http):
    reps = await fakes(3)
    url, _ = await router([r.url for r in reps], policy="session_affinity", admin_key="adm")
    h = {"x-claude-code-session-id": "S"}
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    for path in ("/v1/messages", *["/v1/messages/count_tokens"] * 3, "/v1/messages"):
        async with http.post(url + path, json=body, headers=h) as r:
            assert r.status == 200
    s = (await _sessions(http, url))["-/S"]
    assert s["calls"] == 2 and len(s["gaps"]) == 1  # the count_tokens calls added neither
    # routed with the session all the same: every call went to its replica
    assert {len(f.seen) for f in reps} == {0, 5} and s["replica"] in {r.url for r in reps}
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    assert 'kvroute_identity_calls_total{source="claude-code"} 2.0' in text
    assert 'kvroute_session_placements_total{outcome="kept"} 1.0' in text


async def test_responses_chained_by_previous_response_id_stay_one_session(fakes, router, http):
    reps = await fakes(3)
    url, _ = await router([r.url for r in reps], policy="session_affinity", admin_key="adm")
    body = {"model": "tiny", "input": "plan the refactor"}
    where = []
    for turn in range(4):  # each call sends only its new turn and the previous answer's id
        async with http.post(url + "/v1/responses", json=body) as r:
            out = await r.json()
        where.append(out["replica"])
        body = {"model": "tiny", "input": f"go on {turn}", "previous_response_id": out["id"]}
    (only,) = (await _sessions(http, url)).values()
    assert only["calls"] == 4 and len(set(where)) == 1


async def test_load_alone_never_moves_a_session_and_each_move_says_why(fakes, router, http):
    reps = await fakes(3)
    url, app = await router([r.url for r in reps], policy="session_affinity")
    by_name = {r.name: r for r in reps}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}

    async def call() -> str:
        async with http.post(url + "/v1/chat/completions", json=body,
                             headers={"x-session-id": "S"}) as r:  # fmt: skip
            assert r.status == 200
            return (await r.json())["replica"]

    home = await call()
    by_name[home].running = 20.0  # its engine is busy: far over the bounded-load capacity
    await app[MONITOR].scrape_all()
    assert [await call() for _ in range(3)] == [home] * 3  # (the bound moved it every call)
    by_name[home].fail_status = 503  # fails the call before its first byte: moved, "retry"
    second = await call()
    assert second != home
    by_name[second].healthy = False  # its new replica fails its health check: "unavailable"
    await app[MONITOR].check_all()
    third = await call()
    assert third not in (home, second)
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    # (the retried call was placed on its replica first: kept, then moved)
    assert 'kvroute_session_placements_total{outcome="kept"} 4.0' in text
    assert 'kvroute_session_placements_total{outcome="moved"} 2.0' in text
    assert 'kvroute_session_moves_total{reason="retry"} 1.0' in text
    assert 'kvroute_session_moves_total{reason="unavailable"} 1.0' in text
    assert 'kvroute_session_moves_total{reason="cost"} 0.0' in text
