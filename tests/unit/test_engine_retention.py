"""Agent-aware retention hints and the session table (engine_patches.retention), no vLLM."""

from __future__ import annotations

from engine_patches.retention import Hint, RetentionConfig, RetentionTable, parse_hint


def test_parse_hint_accepts_the_documented_shape_and_ignores_the_rest():
    assert parse_hint({"kvroute": {"session": "s", "state": "tool-pause", "return_s": "30"}}) == (
        Hint("s", "tool-pause", 30.0)
    )
    assert parse_hint({"kvroute": {"session": "s"}}) == Hint("s", "running", None)
    assert parse_hint(None) is None
    assert parse_hint({"do_remote_prefill": True}) is None
    assert parse_hint({"kvroute": {"state": "done"}}) is None  # no session
    assert parse_hint({"kvroute": {"session": "s", "state": "asleep"}}) is None


def table(**kw) -> RetentionTable:
    return RetentionTable(RetentionConfig(**kw), capacity=100)


def test_a_paused_session_is_protected_until_its_hold_expires():
    t = table(ttl_s=60, return_slack=1.5)
    t.claim(range(10), Hint("p", "running"))
    t.finish(Hint("p", "tool-pause", return_s=10), now=0.0)
    assert t.protected(now=14.9) == set(range(10))
    assert t.protected(now=15.1) == set()  # 10 s * 1.5


def test_hold_never_outlives_the_ttl():
    t = table(ttl_s=5)
    t.claim([1], Hint("p"))
    t.finish(Hint("p", "waiting-on-children", return_s=1000), now=0.0)
    assert t.protected(4.9) == {1} and t.protected(5.1) == set()
    t.finish(Hint("p", "tool-pause"), now=10.0)  # no return_s: the TTL
    assert t.protected(14.9) == {1}


def test_done_releases_and_running_stops_the_hold():
    t = table()
    t.claim([7, 1, 2], Hint("p"))
    t.claim([7], Hint("other"))  # changed hands: not p's to release
    t.claim([9, 1], Hint("p"))  # 1 again: keeps its place
    t.finish(Hint("p", "tool-pause", 30), now=0.0)
    t.finish(Hint("p", "running"), now=1.0)
    assert t.protected(2.0) == set()
    t.finish(Hint("p", "tool-pause", 30), now=3.0)
    # released head to tail, in the order first claimed (a tier evicts the tail first)
    assert t.finish(Hint("p", "done"), now=4.0) == [1, 2, 9]
    assert t.protected(5.0) == set()


def test_protection_is_capped_at_a_share_of_the_tier_newest_hold_first():
    t = table(max_share=0.25)  # 25 of 100 chunks
    t.claim(range(0, 20), Hint("old"))
    t.finish(Hint("old", "tool-pause", 100), now=0.0)
    t.claim(range(20, 40), Hint("new"))
    t.finish(Hint("new", "tool-pause", 100), now=1.0)
    assert t.protected(2.0) == set(range(20, 40))


def test_evicted_keys_are_forgotten_and_shared_blocks_move_to_the_last_claimant():
    t = table()
    t.claim([1, 2, 3], Hint("a"))
    t.claim([3], Hint("b"))
    t.finish(Hint("a", "tool-pause", 30), now=0.0)
    assert t.protected(1.0) == {1, 2}
    t.forget([2])
    assert t.protected(1.0) == {1}
    assert t.held_sessions(1.0) == {"a": 1}
