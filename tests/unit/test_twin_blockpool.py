"""The twin's GPU block pool (loadtest/twin/blockpool.py) on its own: vLLM's null block, the
LRU free queue, prefix matching, eviction events and reset."""

from __future__ import annotations

import pytest

from loadtest.twin.blockpool import BlockPool
from router.vllm.kvevents import decode_event


def test_block_zero_is_reserved_and_an_allocation_too_large_changes_nothing():
    pool = BlockPool(4, None)
    assert pool.usable == 3 and pool.num_free == 3
    assert pool.allocate(4) is None and pool.num_free == 3
    got = pool.allocate(3)
    assert got is not None and sorted(got) == [1, 2, 3]
    assert pool.usage() == 1.0
    with pytest.raises(ValueError):
        BlockPool(1, None)


def test_match_takes_the_longest_cached_prefix_up_to_the_limit():
    pool = BlockPool(8, None)
    ids = pool.allocate(3)
    assert ids is not None
    for b, k in zip(ids, (11, 12, 13), strict=True):
        pool.cache(b, k)
    assert pool.match([11, 12, 13], 3) == ids
    assert pool.match([11, 12, 13], 2) == ids[:2]
    assert pool.match([11, 99, 13], 3) == ids[:1]  # a miss ends the prefix
    assert pool.match([99, 11], 2) == []


def test_a_requests_cached_blocks_are_evicted_last_block_first_with_a_removed_event():
    sink: list = []
    pool = BlockPool(5, sink)  # 4 usable
    ids = pool.allocate(3)
    assert ids is not None
    for b, k in zip(ids, (11, 12, 13), strict=True):
        pool.cache(b, k)
    pool.release(ids)  # the request ends: its blocks stay cached, in the free queue
    assert pool.num_free == 4 and not sink
    again = pool.allocate(2)  # the never-used block first, then the request's last block
    assert again is not None and ids[2] in again and ids[0] not in again
    assert [decode_event(e).block_hashes for e in sink] == [[13]]
    assert pool.match([11, 12, 13], 3) == ids[:2]


def test_a_freed_block_without_a_hash_is_reused_first():
    pool = BlockPool(6, None)
    ids = pool.allocate(2)
    assert ids is not None
    pool.cache(ids[0], 7)
    pool.release(ids)
    assert pool.allocate(1) == [ids[1]]  # the uncached one went to the front


def test_write_back_collects_the_keys_of_evicted_last_copies():
    pool = BlockPool(3, None)
    pool.victims = []
    ids = pool.allocate(2)
    assert ids is not None
    pool.cache(ids[0], 5)
    pool.cache(ids[1], 6)
    pool.release(ids)
    pool.allocate(2)
    assert sorted(pool.victims) == [5, 6]


def test_reset_is_refused_while_a_block_is_in_use():
    pool = BlockPool(4, None)
    ids = pool.allocate(1)
    assert ids is not None
    pool.cache(ids[0], 1)
    assert not pool.reset() and pool.match([1], 1) == ids
    pool.release(ids)
    assert pool.reset() and pool.match([1], 1) == []
