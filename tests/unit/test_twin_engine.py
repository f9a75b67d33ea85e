"""The twin's engine (loadtest/twin/engine.py): requests, steps, chunking, timing, reset,
abort."""

from __future__ import annotations

import pytest

from loadtest.twin.engine import Engine, Request
from router.vllm.hashing import BlockHasher
from tests.helpers.twin_engine import BS, TINY, drive, events, req, toks


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
