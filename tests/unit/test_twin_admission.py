"""The twin engine's admission, preemption, prefill cadence and priority policy
(loadtest/twin/engine_admission.py)."""

from __future__ import annotations

import dataclasses

import pytest

from loadtest.twin.engine import LOADING, Engine
from router.vllm.hashing import BlockHasher
from tests.helpers.twin_engine import BS, TINY, drive, req, toks


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
