# ruff: noqa: F811  (fixtures shared from test_router_proxy are imported by name)
"""Session conventions pin a session to one replica; tenants never share sessions; admin views."""

from __future__ import annotations

import pytest

from tests.integration.test_router_proxy import fakes, http, router  # noqa: F401 - fixtures

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
    "prefix-fallback": lambda s: (
        {},
        {"messages": [{"role": "system", "content": f"{s} " + "tools and rules " * 400}]},
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
            body = {
                "model": "tiny",
                "messages": [*msgs, {"role": "user", "content": f"t{turn}"}],
                **fields,
            }
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
