"""Approximate mode: a capacity-aware LRU of routed prompts, evicting tails first."""

from __future__ import annotations

import pytest

from router.kv.approx import ApproxCache
from router.kv.index import TierDepth


def test_routed_prompt_is_predicted_cached_and_extends():
    c = ApproxCache(100)
    c.record("a", [1, 2, 3])
    assert c.match([1, 2, 3, 4]) == {"a": TierDepth(3, gpu=3)}
    c.record("a", [1, 2, 3, 4])
    assert c.match([1, 2, 3, 4, 5]) == {"a": TierDepth(4, gpu=4)}
    assert c.match([9]) == {}


def test_capacity_evicts_least_recent_and_tails_before_heads():
    c = ApproxCache()
    c.set_capacity("a", 5)
    c.record("a", [1, 2, 3])  # session x
    c.record("a", [10, 11, 12])  # session y pushes x's tail (3) out first
    assert c.blocks("a") == 5
    assert c.match([1, 2, 3]) == {"a": TierDepth(2, gpu=2)}
    assert c.match([10, 11, 12]) == {"a": TierDepth(3, gpu=3)}
    c.record("a", [1, 2])  # touching x again makes y's tail the oldest
    c.record("a", [20])
    assert c.match([10, 11, 12]) == {"a": TierDepth(2, gpu=2)}
    assert c.match([1, 2]) == {"a": TierDepth(2, gpu=2)}


def test_clear_remove_and_restrict():
    c = ApproxCache(10)
    c.record("a", [1])
    c.record("b", [1, 2])
    assert c.match([1, 2], ["a"]) == {"a": TierDepth(1, gpu=1)}
    c.clear("b")
    assert c.match([1, 2]) == {"a": TierDepth(1, gpu=1)}
    c.remove_replica("a")
    assert c.match([1]) == {}
    with pytest.raises(ValueError):
        c.set_capacity("a", -1)
