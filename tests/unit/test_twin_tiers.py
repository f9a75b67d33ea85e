"""The twin's lower tiers on their own (loadtest/twin/tiers.py): the storage LRU and the host
tier's write-through rules (writes in flight and loads are not evictable, a finished
request's prefix outlives its tail)."""

from __future__ import annotations

import pytest

from loadtest.twin.tiers import HostTier, TierLRU


def test_the_storage_lru_evicts_the_least_recently_put_and_a_put_refreshes():
    t = TierLRU(2)
    assert t.put(1) is None and t.put(2) is None
    assert t.put(1) is None  # refresh: 2 is now the oldest
    assert t.put(3) == 2
    assert 1 in t and 3 in t and 2 not in t and len(t) == 2


def test_host_chunks_being_written_are_not_evictable_until_settled():
    h = HostTier(2)
    assert h.store([1, 2], 0.0) == ([1, 2], [])
    assert h.store([3], 0.0) is None  # both still being written: no room, nothing changed
    assert 3 not in h and h.pending == {1, 2}
    assert h.settle([1, 2]) == [1, 2]
    assert h.store([3], 0.0) == ([3], [1])  # the least recently used goes


def test_host_chunks_being_loaded_are_not_evictable_until_unpinned():
    h = HostTier(2)
    h.store([1, 2], 0.0)
    h.settle([1, 2])
    h.pin([1, 2])
    assert h.store([3], 0.0) is None
    h.unpin([1])
    assert h.store([3], 0.0) == ([3], [1])


def test_a_finished_requests_first_block_is_the_most_recently_used():
    h = HostTier(3)
    h.store([1, 2, 3], 0.0)
    h.settle([1, 2, 3])
    h.finish([1, 2, 3], None, 0.0)
    h.settle(h.store([4], 0.0)[0])  # type: ignore[index]
    assert 3 not in h and {1, 2, 4} <= set(h.keys)  # the tail went first


def test_an_offer_larger_than_the_tier_stores_nothing():
    h = HostTier(2)
    assert h.store([1, 2, 3], 0.0) is None and len(h) == 0
    with pytest.raises(ValueError):
        HostTier(0)
