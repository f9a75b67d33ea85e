"""The simulator's built-in routing functions on their own (loadtest/sim/routing.py), over
stand-in replica views."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from loadtest.sim.routing import (
    ROUTERS,
    CallView,
    route_fewest_requests,
    route_round_robin,
    route_sticky_spill,
)


def call(sid: str) -> CallView:
    return CallView(sid, 0, 100, [], 10, 0.0)


def views(*loads: tuple[int, int, float]) -> list[Any]:
    return [SimpleNamespace(index=i, num_running=r, num_waiting=w, kv_usage=u)
            for i, (r, w, u) in enumerate(loads)]  # fmt: skip


def test_round_robin_cycles_over_the_replicas():
    route = route_round_robin()
    reps = views((0, 0, 0.0), (0, 0, 0.0), (0, 0, 0.0))
    assert [route(call("s"), reps) for _ in range(4)] == [0, 1, 2, 0]


def test_fewest_requests_counts_running_and_waiting_then_kv_usage():
    route = route_fewest_requests()
    assert route(call("s"), views((2, 0, 0.1), (0, 1, 0.9), (1, 0, 0.2))) == 2
    assert route(call("s"), views((1, 0, 0.5), (0, 1, 0.4))) == 1


def test_sticky_spill_keeps_a_session_home_until_its_queue_is_long():
    route = route_sticky_spill(max_waiting=2)
    assert route(call("a"), views((0, 0, 0.0), (1, 0, 0.0))) == 0
    assert route(call("a"), views((5, 2, 0.0), (0, 0, 0.0))) == 0  # a queue of 2: stays
    assert route(call("a"), views((5, 3, 0.0), (0, 0, 0.0))) == 1  # longer: moves, and stays
    assert route(call("a"), views((0, 0, 0.0), (1, 0, 0.0))) == 1


def test_the_built_in_policies_by_name():
    assert set(ROUTERS) == {"round_robin", "fewest_requests", "sticky_spill", "exact_cache"}
