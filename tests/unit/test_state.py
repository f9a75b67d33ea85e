"""router.state: the session record and the in-process store (the Redis store:
tests/unit/test_redis_store.py and tests/integration/test_router_redis.py)."""

from __future__ import annotations

import time

from router.sessions import identify
from router.state import MemoryStore


async def test_memory_store_lineage_gaps_and_ttl():
    st = MemoryStore(ttl_s=100)
    t0 = time.time()
    parent = identify({"x-claude-code-session-id": "S"}, {})
    child = identify({"x-claude-code-session-id": "S", "x-claude-code-agent-id": "c"}, {})
    await st.begin_call(parent, now=t0 + 0)
    assert await st.claim(parent.key, "r1") == "r1"
    assert await st.claim(parent.key, "r2") == "r1"  # first placement wins
    await st.end_call(parent.key, now=t0 + 2)
    rec = await st.begin_call(parent, now=t0 + 10)
    assert rec.gaps == [8.0] and rec.calls == 2 and rec.replica == "r1"
    await st.end_call(parent.key, now=t0 + 11)
    await st.begin_call(child, now=t0 + 12)
    p = await st.get(parent.key)
    assert p is not None and p.children == {child.key}
    c = await st.get(child.key)
    assert c is not None and c.parent == parent.key
    await st.end_call(child.key, now=t0 + 13)
    assert st.sweep(now=t0 + 200) == 2 and st.active_count() == 0


async def test_memory_store_keeps_sessions_with_calls_in_flight_past_ttl():
    st = MemoryStore(ttl_s=1)
    ident = identify({"x-session-id": "long"}, {})
    await st.begin_call(ident, now=0.0)
    assert st.sweep(now=50.0) == 0  # a 50 s prefill must not lose its session
    await st.end_call(ident.key, now=50.0)
    assert st.sweep(now=52.0) == 1


async def test_memory_store_cap_evicts_oldest():
    st = MemoryStore(max_sessions=3)
    for i in range(5):
        await st.begin_call(identify({"x-session-id": f"s{i}"}, {}), now=float(i))
    assert [r.key for r in st.list()] == ["-/s4", "-/s3", "-/s2"]


def test_session_record_copy_keeps_every_field_and_owns_its_lists():
    import dataclasses

    from router.state import SessionRecord

    values = {
        "key": "t\x1fs", "tenant": "t", "parent": "p", "agent": "a", "replica": "r",
        "created": 1.0, "last_seen": 2.0, "last_call_end": 3.0, "gaps": [0.5],
        "calls": 4, "inflight": 1, "final": True, "children": {"c"}, "service": 7,
    }  # fmt: skip
    assert set(values) == {f.name for f in dataclasses.fields(SessionRecord)}  # a new field
    rec = SessionRecord(**values)  # must be added to SessionRecord.copy too
    dup = rec.copy()
    assert dup == rec and dup.gaps is not rec.gaps and dup.children is not rec.children


def test_vllm_router_program_identity_is_a_session_with_its_parent():
    """vllm-router clients name their program in ``vllm_xargs.agentic_context``: the program is
    the session, its parent program the parent (so a subagent's service counts with its root);
    a session header still wins, and a malformed context is ignored."""
    ctx = {"program_id": "sub-1", "parent_program_id": "root-7", "agent_role": "worker"}
    child = identify({}, {"vllm_xargs": {"agentic_context": ctx}}, tenant="t")
    assert (child.session, child.source, child.parent) == ("sub-1", "vllm-router", "t/root-7")
    root = identify({}, {"vllm_xargs": {"agentic_context": {"program_id": 7}}})
    assert (root.session, root.parent) == ("7", None)
    header = identify({"x-session-id": "h"}, {"vllm_xargs": {"agentic_context": ctx}})
    assert (header.session, header.parent) == ("h", None)
    for bad in ({"vllm_xargs": "x"}, {"vllm_xargs": {"agentic_context": ["sub-1"]}},
                {"vllm_xargs": {"agentic_context": {"program_id": {"a": 1}}}}):  # fmt: skip
        assert identify({}, bad).source == "prefix"
