"""The twin engine's block keys, caching and GPU allocation (loadtest/twin/engine_blocks.py),
with vLLM's prefix-cache semantics."""

from __future__ import annotations

from loadtest.twin.engine import Engine
from router.vllm.hashing import BlockHasher
from tests.helpers.twin_engine import BS, TINY, drive, events, removed, req, stored, toks


def test_stored_events_carry_vllm_hashes_tokens_and_parents():
    h = BlockHasher(BS)
    e = Engine(TINY, hasher=h)
    p = toks(300, 5)
    drive(e, [req("a", p), req("b", p + toks(100, 6))])
    evs = events(e)
    keys = stored(evs)
    assert keys == h.hash_keys(p + toks(100, 6))[: len(keys)]
    assert set(h.hash_keys(p)) <= set(keys)
    first = next(ev for ev in evs if type(ev).__name__ == "BlockStored")
    assert first.parent_block_hash is None and first.token_ids == p[: BS * len(first.block_hashes)]
    for ev in evs:
        if ev.parent_block_hash is not None:
            assert keys.index(ev.parent_block_hash) == keys.index(ev.block_hashes[0]) - 1


def test_generated_tokens_fill_blocks_that_are_cached_too():
    h = BlockHasher(BS)
    e = Engine(TINY, hasher=h)
    a = req("a", toks(40, 7), max_tokens=40)
    drive(e, [a])
    keys = stored(events(e))
    # 40 prompt + 39 computed outputs = 79 tokens -> 2 full blocks, the second from outputs
    assert keys == h.hash_keys(a.token_ids + a.output_ids)[:2]


def test_lru_evicts_least_recently_freed_and_a_requests_tail_first():
    prof = TINY.replace(gpu_kv_blocks=9)  # 8 usable
    e = Engine(prof, hasher=BlockHasher(BS))
    h = BlockHasher(BS)
    a, b = toks(4 * BS + 1, 10), toks(4 * BS + 1, 11)
    # a takes blocks 1-5 (5 holds one token, no hash). Freed: 5 to the front (no hash),
    # then 4 3 2 1 to the tail -> queue 5 6 7 8 4 3 2 1.
    drive(e, [req("a", a)])
    drive(e, [req("b", b)])  # takes 5 6 7 8 4: evicts a's 4th block
    drive(e, [req("c", toks(BS + 1, 12))])  # takes b's partial block (front), then 3
    ka = h.hash_keys(a)
    assert removed(events(e)) == [ka[3], ka[2]]
    hit = req("a2", a)
    drive(e, [hit])
    assert hit.cached_tokens == 2 * BS  # a's first two blocks survived


def test_recomputed_block_of_a_cached_hash_is_a_second_copy():
    h = BlockHasher(BS)
    e = Engine(TINY, hasher=h)
    p = toks(2 * BS, 13)  # exactly two blocks: a repeat hits one, recomputes the second
    drive(e, [req("a", p)])
    drive(e, [req("b", p)])
    k = h.hash_keys(p)
    assert stored(events(e)) == [k[0], k[1], k[1]]  # vLLM publishes the copy too
    assert len(e.pool.dups[k[1]]) == 1


def test_blocks_in_use_are_never_evicted_and_waiting_requests_wait_for_room():
    prof = TINY.replace(gpu_kv_blocks=9)
    e = Engine(prof, hasher=BlockHasher(BS))
    long_a = req("a", toks(5 * BS, 20), max_tokens=20)
    b = req("b", toks(5 * BS, 21), max_tokens=1)
    e.add(long_a)
    e.add(b)
    s = e.schedule(0.0)
    assert [r.id for r, _ in s.scheduled] == ["a"]  # b does not fit beside a
    e.complete(s, s.duration)
    assert not removed(events(e))
    t = drive(e, [], s.duration)
    assert long_a.finished and b.finished and b.first_token_time >= long_a.finish_time - 1e-9
    assert t > 0
