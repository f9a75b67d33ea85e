"""The cluster pool in the twin's engine and the simulator: one LRU key set shared by engines,
written through from each host tier, read by all, its events in the router's index."""

from __future__ import annotations

import pytest

from costmodel.profiles import ProfileError, load_profile, with_overrides
from loadtest.sim.simulator import Call, Session, simulate
from loadtest.twin.engine import ClusterPool, Engine, Request
from loadtest.twin.truth import timing
from router.kv.index import BlockIndex
from router.vllm.kvevents import decode_event
from tests.helpers.twin_engine import drive

TINY = load_profile("cpu-tiny").replace(gpu_kv_blocks=64, cpu_kv_blocks=32)
BS = TINY.block_size


def req(rid: str, n_blocks: int, salt: int) -> Request:
    keys = [(salt << 20) + i for i in range(n_blocks)]
    return Request(rid, n_blocks * BS + 1, 2, block_keys=keys)


def pool_events(e: Engine) -> list:
    evs = [decode_event(x) for x in e.take_events()]
    return [x for x in evs if getattr(x, "locality", None) == "REMOTE"]


def test_the_pool_lru_evicts_down_to_its_low_water():
    p = ClusterPool(10, low_water=0.8)
    assert p.put(list(range(10))) == []
    p.touch([0])  # a load refreshes it
    assert p.put([10]) == [1, 2, 3]  # 11 > 10: down to 8, least recently used first
    assert 0 in p and 1 not in p and len(p) == 8
    with pytest.raises(ValueError):
        ClusterPool(0)


def test_a_block_one_engine_wrote_is_loaded_by_another_from_the_pool():
    pool = ClusterPool(100)
    e1, e2 = Engine(TINY, cluster_pool=pool), Engine(TINY, cluster_pool=pool)
    r1 = req("a", 20, 1)
    drive(e1, [r1])
    got = pool_events(e1)
    assert [x.block_hashes for x in got] == [r1.block_keys[:20]]
    assert got[0].medium == "STORAGE"
    r2 = req("b", 20, 1)
    drive(e2, [r2])
    assert r2.cached_tokens == 20 * BS
    assert e2.cached_by_tier == {"device": 0, "host": 0, "disk": 0, "pool": 20 * BS}
    assert e2.cached_by_source["disk"] == 20 * BS  # vLLM labels a STORAGE tier's hit "disk"
    assert e2.tier_hit_blocks["pool"] == 20
    # a promotion is a write into host, not a store: e2 writes nothing back to the pool
    assert pool_events(e2) == []
    assert pool.loaded == 20


def test_the_pool_load_waits_for_the_pools_link():
    pool = ClusterPool(100)
    e1, e2 = Engine(TINY, cluster_pool=pool), Engine(TINY, cluster_pool=pool)
    drive(e1, [req("a", 20, 1)])
    r = req("b", 20, 1)
    e2.add(r)
    assert e2.schedule(0.0) is None  # loading
    assert r.ready_at == pytest.approx(e2.timing.load(20, "pool"))
    slow = TINY.hardware.__class__(**{**_hw(TINY), "pool_bw": TINY.hardware.pool_bw / 10})
    t_slow = timing(TINY.replace(hardware=slow), "nominal").load(20, "pool")
    assert t_slow > timing(TINY, "nominal").load(20, "pool")


def _hw(p):
    from dataclasses import fields

    return {f.name: getattr(p.hardware, f.name) for f in fields(p.hardware)}


def test_evictions_are_published_by_the_evicting_engine_and_the_index_follows():
    pool = ClusterPool(30, low_water=1.0)
    e1, e2 = Engine(TINY, cluster_pool=pool), Engine(TINY, cluster_pool=pool)
    ix = BlockIndex()
    drive(e1, [req("a", 20, 1)])
    ix.apply("e1", [decode_event(x) for x in e1.take_events()])
    drive(e2, [req("b", 20, 2)])  # 40 > 30: e2's write evicts 10 of e1's blocks
    ev2 = [decode_event(x) for x in e2.take_events()]
    removed = [k for x in ev2 if type(x).__name__ == "BlockRemoved" and x.medium == "STORAGE"
               for k in x.block_hashes]  # fmt: skip
    assert removed == [(1 << 20) + i for i in range(10)]
    ix.apply("e2", ev2)
    assert ix.pool_keys() == frozenset(pool.keys)
    assert sorted(ix.pool_members()) == ["e1", "e2"]
    # a cache reset (or a restart) leaves the pool: it is not the engine's
    assert e1.reset_prefix_cache() and len(pool) == 30


def test_the_profile_takes_a_pool_only_above_a_write_through_host_tier():
    base = load_profile("cpu-tiny")
    assert with_overrides(base, {"cpu_kv_blocks": 8, "pool_kv_blocks": 64}).pool_kv_blocks == 64
    with pytest.raises(ProfileError, match="host tier"):
        with_overrides(base, {"pool_kv_blocks": 64})
    with pytest.raises(ValueError, match="host tier"):
        Engine(base, cluster_pool=ClusterPool(8))


def test_the_simulator_shares_one_pool_across_its_engines():
    prof = TINY.replace(cpu_kv_blocks=512, pool_kv_blocks=4096)
    # one long session, round-robin: every call lands on the other replica
    sess = [Session("s", 0.0, [Call(400, 4, 1.0) for _ in range(4)])]
    with_pool = simulate(prof, 2, sess, "round_robin")
    without = simulate(prof.replace(pool_kv_blocks=0), 2, sess, "round_robin")
    assert len(with_pool.records) == len(without.records) == 4
    assert with_pool.tier_hit_blocks["pool"] > 0
    hit = sum(r.cached_tokens for r in with_pool.records)
    assert hit > sum(r.cached_tokens for r in without.records)
