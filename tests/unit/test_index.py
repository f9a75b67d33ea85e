"""Block index: the fast index agrees with the naive reference; tiers, removal, clearing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.kv.index import BlockIndex, BlockIndexError, TierDepth, apply_event
from router.kv.index_ref import NaiveBlockIndex
from router.vllm.kvevents import AllBlocksCleared, BlockRemoved, BlockStored

REPLICAS = ["a", "b", "c"]
KEYS = st.integers(min_value=0, max_value=(1 << 64) - 1)
SMALL_KEYS = st.sampled_from([1, 2, 3, 4, 5, 6, 7, (1 << 64) - 1, 1 << 63])
MEDIA = st.sampled_from(["GPU", "CPU", "STORAGE"])

R = st.sampled_from(REPLICAS)
op = st.one_of(
    st.tuples(st.just("store"), R, st.lists(SMALL_KEYS, max_size=6), MEDIA),
    st.tuples(st.just("remove"), R, st.lists(SMALL_KEYS, max_size=4), MEDIA),
    st.tuples(st.just("clear"), st.sampled_from(REPLICAS), st.just([]), st.just("GPU")),
    st.tuples(st.just("drop"), st.sampled_from(REPLICAS), st.just([]), st.just("GPU")),
    st.tuples(st.just("pool_store"), R, st.lists(SMALL_KEYS, max_size=6), st.just("STORAGE")),
    st.tuples(st.just("pool_remove"), R, st.lists(SMALL_KEYS, max_size=4), st.just("STORAGE")),
)


def _run(ops, ix, ref):
    for kind, r, keys, medium in ops:
        if kind == "store":
            ix.apply(r, [BlockStored(keys, None, [], 32, medium=medium)])
            ref.apply(r, [BlockStored(keys, None, [], 32, medium=medium)])
        elif kind == "remove":
            ix.apply(r, [BlockRemoved(keys, medium=medium)])
            ref.apply(r, [BlockRemoved(keys, medium=medium)])
        elif kind in ("pool_store", "pool_remove"):
            cls = BlockStored if kind == "pool_store" else BlockRemoved
            ev = (
                BlockStored(keys, None, [], 0, medium=medium, locality="REMOTE")
                if cls is BlockStored
                else BlockRemoved(keys, medium=medium, locality="REMOTE")
            )
            ix.apply(r, [ev])
            ref.apply(r, [ev])
        elif kind == "clear":
            ix.apply(r, [AllBlocksCleared()])
            ref.apply(r, [AllBlocksCleared()])
        else:
            ix.remove_replica(r)
            ref.remove_replica(r)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(op, max_size=30), st.lists(st.lists(SMALL_KEYS, max_size=8), min_size=1, max_size=4)
)
def test_index_matches_naive_reference(ops, prompts):
    ix, ref = BlockIndex(), NaiveBlockIndex()
    _run(ops, ix, ref)
    for p in prompts:
        assert ix.match(p) == ref.match(p)
        assert ix.match(p, ["a", "c"]) == ref.match(p, ["a", "c"])
    snap, rsnap = ix.snapshot(), ref.snapshot()
    for r in snap:
        assert snap[r] == rsnap[r]
        assert ix.state(r).blocks == {t: len(k) for t, k in snap[r].items()}


def test_apply_event_maps_each_event_to_one_index_operation():
    """The one dispatch: a pool event goes to the pool, others to the event's tier."""
    calls: list[tuple] = []

    class Recorder:
        def store(self, replica, keys, medium="GPU"):
            calls.append(("store", replica, list(keys), medium))

        def remove(self, replica, keys, medium="GPU"):
            calls.append(("remove", replica, list(keys), medium))

        def clear(self, replica, medium=None):
            calls.append(("clear", replica, medium))

        def pool_store(self, replica, keys):
            calls.append(("pool_store", replica, list(keys)))

        def pool_remove(self, keys):
            calls.append(("pool_remove", list(keys)))

    rec = Recorder()
    for ev in [
        BlockStored([1], None, [], 32, medium="cpu"),
        BlockStored([2], None, [], 0, medium="STORAGE", locality="REMOTE"),
        BlockStored([3], None, [], 0, medium="STORAGE"),  # a local disk tier, not the pool
        BlockStored([4], None, [], 32, locality="REMOTE"),  # REMOTE but GPU: not the pool
        BlockRemoved([2], medium="storage", locality="REMOTE"),
        BlockRemoved([1], medium="CPU"),
        AllBlocksCleared(),
    ]:
        apply_event(rec, "a", ev)
    assert calls == [
        ("store", "a", [1], "cpu"),
        ("pool_store", "a", [2]),
        ("store", "a", [3], "STORAGE"),
        ("store", "a", [4], "GPU"),
        ("pool_remove", [2]),
        ("remove", "a", [1], "CPU"),
        ("clear", "a", None),
    ]


@pytest.mark.parametrize("make", [BlockIndex, NaiveBlockIndex], ids=["fast", "reference"])
def test_both_indexes_apply_events_through_the_one_dispatch(make):
    """Each index's ``apply`` path, against fixed answers (the property test only compares
    the two): tiers, the pool, a removal from another replica, a cache reset."""
    ix = make()
    ix.apply("a", [BlockStored([1, 2], None, [], 32), BlockStored([3], None, [], 32, medium="CPU")])
    assert ix.match([1, 2, 3]) == {"a": TierDepth(3, gpu=2, cpu=1)}
    ix.apply("a", [BlockStored([4, 5], None, [], 0, medium="STORAGE", locality="REMOTE")])
    assert ix.match([1, 2, 3, 4]) == {"a": TierDepth(4, gpu=2, cpu=1, pool=1)}
    assert ix.snapshot()["a"]["STORAGE"] == frozenset()  # the pool is not a's own tier
    ix.apply("b", [BlockRemoved([4], medium="STORAGE", locality="REMOTE")])  # shared files
    assert ix.match([1, 2, 3, 4]) == {"a": TierDepth(3, gpu=2, cpu=1)}
    ix.apply("b", [BlockStored([4], None, [], 0, medium="STORAGE")])  # b's own disk tier
    assert ix.match([4]) == {"b": TierDepth(1, storage=1)}
    ix.apply("a", [BlockRemoved([2])])
    assert ix.match([1, 2, 3]) == {"a": TierDepth(1, gpu=1)}
    ix.apply("a", [AllBlocksCleared()])  # a's tiers go, the pool stays
    assert ix.match([1, 5]) == {}
    assert ix.match([5]) == {"a": TierDepth(1, pool=1)}


@settings(max_examples=50, deadline=None)
@given(st.lists(KEYS, min_size=1, max_size=200, unique=True), st.integers(0, 199))
def test_depth_is_longest_consecutive_prefix(keys, hole):
    ix = BlockIndex()
    ix.store("a", keys)
    assert ix.match(keys) == {"a": TierDepth(len(keys), gpu=len(keys))}
    hole = hole % len(keys)
    ix.remove("a", [keys[hole]])
    expect = {"a": TierDepth(hole, gpu=hole)} if hole else {}
    assert ix.match(keys) == expect


def test_tiers_count_fastest_copy_once():
    ix = BlockIndex()
    keys = list(range(10, 20))
    ix.store("a", keys[:4], "GPU")
    ix.store("a", keys[2:7], "CPU")  # 2 overlap GPU
    ix.store("a", keys[6:9], "STORAGE")  # 1 overlaps CPU
    ix.store("b", keys, "STORAGE")
    m = ix.match(keys)
    assert m["a"] == TierDepth(9, gpu=4, cpu=3, storage=2)
    assert m["b"] == TierDepth(10, storage=10)
    assert ix.holds("a", keys[3]) == ("GPU", "CPU")


def test_all_blocks_cleared_and_replica_removal_only_touch_that_replica():
    ix = BlockIndex()
    ix.store("a", [1, 2, 3])
    ix.store("b", [1, 2, 3], "CPU")
    ix.apply("a", [AllBlocksCleared()])
    assert ix.match([1, 2, 3]) == {"b": TierDepth(3, cpu=3)}
    ix.remove_replica("b")
    assert ix.match([1, 2, 3]) == {}
    assert len(ix) == 0 and ix.replicas() == ["a"]
    ix.store("c", [1])  # slot of b is reused, with no ghost blocks
    assert ix.match([1, 2]) == {"c": TierDepth(1, gpu=1)}


def test_view_is_read_only_and_sees_staleness():
    ix = BlockIndex()
    ix.store("a", [5, 6])
    v = ix.view()
    assert not hasattr(v, "store") and not hasattr(v, "clear")
    assert v.match([5, 6, 7]) == {"a": TierDepth(2, gpu=2)}
    assert not v.is_stale("a") and v.is_stale("nobody")
    ix.mark_stale("a", "seq gap")
    assert v.is_stale("a") and v.blocks("a")["GPU"] == 2


def test_bad_medium_and_too_many_replicas_are_clear_errors():
    ix = BlockIndex()
    with pytest.raises(BlockIndexError, match="medium"):
        ix.store("a", [1], "HBM")
    for i in range(64):
        ix.add_replica(f"r{i}")
    with pytest.raises(BlockIndexError, match="at most 64"):
        ix.add_replica("one-more")
    ix.store("r63", [9])
    assert ix.match([9]) == {"r63": TierDepth(1, gpu=1)}  # the top bit (slot 63) works


def test_pool_blocks_reach_every_member_and_one_removal_takes_them_from_all():
    ix = BlockIndex()
    ix.apply("b", [BlockStored([9], None, [], 32)])  # b: a GPU block, not a pool member yet
    ix.apply("a", [BlockStored([1, 2, 3], None, [], 32)])
    ix.apply("a", [BlockStored([1, 2, 3, 4], None, [], 0, medium="STORAGE", locality="REMOTE")])
    # a wrote them (GPU for 1-3, the pool for 4); b has not joined the pool: nothing for b
    assert ix.match([1, 2, 3, 4]) == {"a": TierDepth(4, gpu=3, pool=1)}
    assert ix.pool_members() == ["a"] and ix.pool_blocks() == 4
    ix.add_pool_member("b")
    assert ix.match([1, 2, 3, 4])["b"] == TierDepth(4, pool=4)
    assert ix.holds("b", 4) == ("POOL",) and ix.holds("b", 9) == ("GPU",)
    # a local disk tier (no locality) stays the writer's own
    ix.apply("a", [BlockStored([7], None, [], 0, medium="STORAGE")])
    assert "b" not in ix.match([7]) and ix.match([7])["a"] == TierDepth(1, storage=1)
    # an eviction seen from b's stream removes the block for a too; a's GPU copy stays
    ix.apply("b", [BlockRemoved([3, 4], medium="STORAGE", locality="REMOTE")])
    assert ix.match([1, 2, 3, 4]) == {"a": TierDepth(3, gpu=3), "b": TierDepth(2, pool=2)}
    assert ix.pool_removed == 2
    # an engine's cache reset leaves the pool; dropping a replica ends its membership
    ix.apply("a", [AllBlocksCleared()])
    assert ix.match([1, 2]) == {"a": TierDepth(2, pool=2), "b": TierDepth(2, pool=2)}
    ix.remove_replica("b")
    assert ix.pool_members() == ["a"] and len(ix) == 2  # the pool's 1 and 2; b's 9 went with b
