"""The router's retention hints for the engine plugin (router.hints)."""

from __future__ import annotations

import orjson

from router.hints import call_hint, hinted_body, retention_hint, with_hint
from router.sessions import SessionIdentity
from router.state import SessionRecord


def ident(final: bool = False, source: str = "claude-code") -> SessionIdentity:
    return SessionIdentity("t1", "s1", None, None, final, source)


def test_states_follow_what_the_router_knows():
    rec = SessionRecord(key="t1/s1", tenant="t1", gaps=[10.0, 30.0, 20.0])
    assert retention_hint(ident(), rec) == {
        "session": ident().key, "state": "tool-pause", "return_s": 20.0,
    }  # fmt: skip
    rec.children = {"t1/child"}
    assert retention_hint(ident(), rec)["state"] == "waiting-on-children"
    done = retention_hint(ident(final=True), rec)
    assert done == {"session": ident().key, "state": "done"}
    first_call = SessionRecord(key="t1/s1", tenant="t1")
    assert "return_s" not in retention_hint(ident(), first_call)  # the engine's TTL applies


def test_no_hint_without_a_session():
    rec = SessionRecord(key="t1/prefix:ab", tenant="t1")
    assert retention_hint(ident(source="prefix"), rec) is None
    assert retention_hint(ident(), None) is None


def test_a_client_cannot_set_its_own_hint():
    spoofed = {"kvroute": {"session": "victim", "state": "done"}, "x": 1}
    body = {"model": "m", "kv_transfer_params": spoofed}
    out = orjson.loads(with_hint(body, None))
    assert out["kv_transfer_params"] == {"x": 1}
    out = orjson.loads(with_hint({"model": "m", "kv_transfer_params": {"kvroute": {}}}, None))
    assert "kv_transfer_params" not in out
    hint = {"session": "t1/s1", "state": "tool-pause"}
    assert orjson.loads(with_hint(body, hint))["kv_transfer_params"] == {"x": 1, "kvroute": hint}


def test_hinted_body_only_rewrites_when_needed():
    rec = SessionRecord(key="t1/s1", tenant="t1")
    plain = {"model": "m", "messages": []}
    chat = "/v1/chat/completions"
    assert call_hint(chat, ident(), rec, enabled=False) is None
    assert call_hint("/v1/messages", ident(), rec, enabled=True) is None  # no kv_transfer_params
    assert hinted_body(chat, plain, call_hint(chat, ident(), rec, enabled=False)) is None
    assert hinted_body("/v1/messages", plain, {"session": "t1/s1"}) is None
    hint = call_hint(chat, ident(), rec, enabled=True)
    assert hint == retention_hint(ident(), rec)
    got = orjson.loads(hinted_body(chat, plain, hint))
    assert got["kv_transfer_params"]["kvroute"]["state"] == "tool-pause"
    spoof = {**plain, "kv_transfer_params": {"kvroute": {"session": "x"}}}
    assert orjson.loads(hinted_body("/v1/completions", spoof, None)) == plain
