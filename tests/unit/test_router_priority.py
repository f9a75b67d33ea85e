"""The session-level priority rule (router.priority) and the session table's inputs to it."""

from __future__ import annotations

import pytest

from router.priority import (
    ROLE_BURST,
    ROLE_JOIN,
    ROLE_PLAIN,
    PriorityConfig,
    call_level,
    call_priority,
    client_hint,
    served_tokens,
    service_level,
)
from router.sessions import SessionIdentity
from router.state import MemoryStore

CFG = PriorityConfig(unit_tokens=1000, max_level=4, level_s=2.0, tick_s=0.5, join_boost=2,
                     burst_penalty=1, hint_levels=2)  # fmt: skip


def test_service_level_is_log2_of_attained_service_capped():
    assert [service_level(s, CFG) for s in (0, 999, 1000, 2999, 3000, 7000, 10**9)] == [
        0, 0, 1, 1, 2, 3, 4,
    ]  # fmt: skip


def test_less_attained_service_is_served_first():
    new = call_priority(0, ROLE_PLAIN, None, 100.0, CFG)
    old = call_priority(50_000, ROLE_PLAIN, None, 100.0, CFG)
    assert new < old  # vLLM: lower first


def test_aging_bounds_how_long_later_arrivals_overtake_a_call():
    # the most penalised call possible, arriving at t = 100
    worst = call_priority(10**9, ROLE_BURST, -99, 100.0, CFG)
    assert call_level(10**9, ROLE_BURST, -99, CFG) == CFG.max_level + CFG.burst_penalty
    bound = CFG.bound_s
    assert bound == (4 + 1) * 2.0
    # a fresh call arriving within the bound still overtakes it ...
    assert call_priority(0, ROLE_JOIN, 99, 100.0 + bound - 1.0, CFG) < worst
    # ... one arriving past the bound never does, whatever its level, role and hint
    for t in (bound + 0.5, bound + 3.0, 1000.0):
        assert call_priority(0, ROLE_JOIN, 99, 100.0 + t, CFG) >= worst


def test_roles_and_hints_move_the_level_within_bounds():
    base = call_level(3000, ROLE_PLAIN, None, CFG)
    assert base == 2
    assert call_level(3000, ROLE_JOIN, None, CFG) == 0
    assert call_level(3000, ROLE_BURST, None, CFG) == 3
    assert call_level(3000, ROLE_PLAIN, 1, CFG) == 1  # higher hint = sooner
    assert call_level(3000, ROLE_PLAIN, 50, CFG) == 0  # clamped to hint_levels (and >= 0)
    assert call_level(3000, ROLE_PLAIN, -50, CFG) == 4


def test_client_hint_conventions_and_polarity():
    assert client_hint({"x-dynamo-request-priority": "5"}, {}) == 5
    body = {"nvext": {"agent_hints": {"priority": 3}}, "priority": 7}
    assert client_hint({}, body) == 3  # Dynamo's hint before vLLM's field
    assert client_hint({"x-dynamo-request-priority": "1"}, body) == 1  # header overrides
    assert client_hint({}, {"priority": 7}) == -7  # vLLM polarity: lower = sooner
    assert client_hint({"x-vllm-priority": "-4"}, {"priority": 7}) == 4  # header first
    assert client_hint({}, {"priority": True, "nvext": "x"}) is None
    assert client_hint({"x-vllm-priority": "soon"}, {}) is None


def test_served_tokens_counts_computed_prompt_and_decode():
    assert served_tokens(1000, 800, 50) == 250
    assert served_tokens(None, None, 5) == 5
    assert served_tokens(10, 99, None) == 0  # cached beyond the prompt: nothing computed


def test_config_rejects_nonsense():
    with pytest.raises(ValueError):
        PriorityConfig(level_s=0)
    with pytest.raises(ValueError):
        PriorityConfig(join_boost=-1)


def _ident(session, agent=None, parent_agent=None):
    parent = None
    if agent:
        parent = f"-/{session}#{parent_agent}" if parent_agent else f"-/{session}"
    return SessionIdentity("-", session, parent, agent, False, "test")


def test_subagents_count_with_their_root_and_roles_follow_the_graph():
    st = MemoryStore()
    root = _ident("s")
    st.touch(root, 1.0)
    st.finish(root.key, 2.0)
    st.add_service(root.key, 1000)
    # a burst of two subagents: both in flight
    kids = [_ident("s", agent=a) for a in ("a", "b")]
    for k in kids:
        st.touch(k, 3.0)
    assert st.priority_inputs(kids[0].key) == (1000, ROLE_BURST)
    st.add_service(kids[0].key, 500)  # a subagent's service counts on the root
    assert st.priority_inputs(kids[1].key)[0] == 1500
    nested = _ident("s", agent="c", parent_agent="a")
    st.touch(nested, 3.5)
    st.add_service(nested.key, 100)
    assert st.priority_inputs(nested.key)[0] == 1600  # grandchild -> root
    st.finish(nested.key, 3.6)
    # the root waits on them: a call while they run is no join
    st.touch(root, 4.0)
    assert st.priority_inputs(root.key)[1] == ROLE_PLAIN
    st.finish(root.key, 4.5)
    for k in kids:
        st.finish(k.key, 5.0)
    # the first root call after its subagents ended is the join; the next one is not
    st.touch(root, 6.0)
    assert st.priority_inputs(root.key) == (1600, ROLE_JOIN)
    st.finish(root.key, 7.0)
    st.touch(root, 8.0)
    assert st.priority_inputs(root.key)[1] == ROLE_PLAIN
    # a lone subagent in flight is no burst
    st.finish(root.key, 9.0)
    st.touch(kids[0], 10.0)
    assert st.priority_inputs(kids[0].key)[1] == ROLE_PLAIN
    assert st.priority_inputs("-/unknown") == (0, ROLE_PLAIN)


def test_a_parent_cycle_does_not_hang():
    st = MemoryStore()
    a = SessionIdentity("-", "a", "-/b", None, False, "test")
    b = SessionIdentity("-", "b", "-/a", None, False, "test")
    st.touch(a, 1.0)
    st.touch(b, 1.0)
    st.add_service(a.key, 10)
    assert st.priority_inputs(a.key)[0] >= 10


def test_router_setting_is_checked():
    from router.config import ConfigError, load_config

    cfg = load_config(env={}, overrides={"replicas": ["http://a:1"], "priority": "session"})
    assert cfg.priority == "session" and cfg.priority_config().level_s == 2.0
    assert load_config(env={}, overrides={"replicas": ["http://a:1"]}).priority == "off"
    with pytest.raises(ConfigError, match="priority"):
        load_config(env={}, overrides={"replicas": ["http://a:1"], "priority": "fifo"})
    with pytest.raises(ConfigError):
        load_config(env={}, overrides={"replicas": ["http://a:1"], "priority_level_s": 0})
