"""The twin runs the engine plugin's rules: hint-aware host-tier retention, bounded cadence."""

from __future__ import annotations

import itertools

import pytest

from costmodel.profiles import load_profile
from engine_patches.cadence import CadenceConfig
from engine_patches.retention_rule import Hint, RetentionConfig
from loadtest.cli_args import add_plugin_args, plugin_from_args
from loadtest.sim.router_policy import RouterPolicy
from loadtest.sim.simulator import Simulator, synthetic_agentx
from loadtest.twin.engine import Engine, EnginePlugin, HostTier, Request
from router.vllm.kvevents import decode_event
from tests.helpers.twin_engine import drive

TINY = load_profile("cpu-tiny")
BS = TINY.block_size
# 8 usable GPU blocks, 16 host blocks: a 6-block prompt fills most of the GPU
TIERED = TINY.replace(gpu_kv_blocks=9, cpu_kv_blocks=16)
_ids = itertools.count(1)


def keys(n: int) -> list[int]:
    return [next(_ids) * 0x9E3779B1 for _ in range(n)]


def call(rid: str, ks: list[int], hint: Hint | None = None, max_tokens: int = 1) -> Request:
    return Request(rid, len(ks) * BS + 1, max_tokens, block_keys=ks, hint=hint)


def retaining(**kw) -> Engine:
    return Engine(TIERED, plugin=EnginePlugin(retention=RetentionConfig(**kw)))


def held_anywhere(e: Engine, ks: list[int]) -> bool:
    return all(k in e.pool.cached or k in e.cpu for k in ks)


def pressure(e: Engine, t: float, n: int = 4) -> float:
    """Unhinted prompts with fresh blocks, one after another: evicts the host tier's oldest."""
    for i in range(n):
        t = drive(e, [call(f"x{i}-{t}", keys(6))], t)
    return t


def pause_then_pressure(e: Engine, hint: Hint | None, t_pressure: float = 0.0):
    p, u = keys(6), keys(6)
    t = drive(e, [call("p", p, hint)])
    t = drive(e, [call("u", u)], t)
    pressure(e, max(t, t_pressure))
    return p, u


def test_a_hinted_paused_session_survives_host_pressure_that_evicts_an_unhinted_one():
    e = retaining()
    p, u = pause_then_pressure(e, Hint("p", "tool-pause", return_s=100))
    assert held_anywhere(e, p)
    assert not held_anywhere(e, u)  # stored after p, evicted before it
    assert len(e.cpu) <= e.cpu.capacity
    back = call("p2", p + keys(1), Hint("p", "tool-pause", 100))
    drive(e, [back], 50.0)
    assert back.cached_tokens == 6 * BS  # the whole paused prefix, from host
    # control: without the plugin the same traffic evicts the older session first
    plain = Engine(TIERED)
    p, u = pause_then_pressure(plain, Hint("p", "tool-pause", return_s=100))
    assert not held_anywhere(plain, p)


def test_the_hold_expires_after_return_s_times_slack_and_never_past_the_ttl():
    e = retaining(ttl_s=600, return_slack=1.5)
    p, _ = pause_then_pressure(e, Hint("p", "tool-pause", return_s=2), t_pressure=3.5)
    assert not held_anywhere(e, p)  # held for 3 s only
    e = retaining(ttl_s=5)
    p, _ = pause_then_pressure(e, Hint("p", "waiting-on-children", 1000), t_pressure=6)
    assert not held_anywhere(e, p)  # the TTL caps a long return_s
    e = retaining(ttl_s=5)
    p, _ = pause_then_pressure(e, Hint("p", "waiting-on-children", 1000), t_pressure=1)
    assert held_anywhere(e, p)  # the same within the TTL


def test_done_is_evicted_first_even_when_newer_than_cold_blocks():
    def run(e: Engine) -> tuple[list[int], list[int], list[int]]:
        u, d = keys(6), keys(6)
        t = drive(e, [call("u", u)])
        t = drive(e, [call("d", d, Hint("d", "done"))], t)  # the host tier holds u and d
        drive(e, [call("x", keys(6))], t)  # 18 blocks for 16: two must go
        return u, d, [k for k in u + d if k not in e.cpu]

    _u, d, gone = run(retaining())
    assert len(gone) == 2 and set(gone) <= set(d)  # done's blocks went first, the older u kept
    u, _d, gone = run(Engine(TIERED))  # control: plain LRU evicts the older u first
    assert len(gone) == 2 and set(gone) <= set(u)


def test_holds_never_exceed_the_share_cap_newest_hold_first():
    e = retaining(max_share=0.25)  # 4 of 16 host blocks
    p, _ = pause_then_pressure(e, Hint("p", "tool-pause", 100))
    assert not held_anywhere(e, p)  # 6 blocks > the cap: not protected at all
    e = retaining(max_share=0.5)  # 8 blocks: one 6-block session fits, two do not
    a, b = keys(6), keys(6)
    t = drive(e, [call("a", a, Hint("a", "tool-pause", 100))])
    t = drive(e, [call("b", b, Hint("b", "tool-pause", 100))], t)
    t = pressure(e, t, 5)
    assert isinstance(e.cpu, HostTier) and e.cpu.table is not None
    assert e.cpu.held_blocks(t) <= 8
    assert held_anywhere(e, b) and not held_anywhere(e, a)  # b paused last


def test_retention_yields_instead_of_blocking_an_eviction():
    e = retaining(max_share=1.0)
    a = keys(6)
    t = drive(e, [call("a", a, Hint("a", "tool-pause", 100))])
    b = keys(6)
    t = drive(e, [call("b", b, Hint("b", "tool-pause", 100))], t)
    t = pressure(e, t, 6)  # more than the host tier even if nothing were held
    assert len(e.cpu) <= e.cpu.capacity
    assert not e.has_work


def test_retention_events_keep_the_index_exact_and_hints_reach_the_engines():
    off = load_profile("h200-70b-fp8-offload").replace(gpu_kv_blocks=800, cpu_kv_blocks=1500)
    pol = RouterPolicy("kv_cost", off, engine_hints=True)
    sim = Simulator(off, 3, pol, plugin=EnginePlugin(retention=RetentionConfig()))
    res = sim.run(synthetic_agentx(12, 300, seed=4), until=900)
    assert res.records
    snap = pol.kv.index.snapshot()
    for i, rep in enumerate(sim.replicas):
        assert snap[pol.names[i]]["GPU"] == frozenset(rep.engine.pool.cached)
        assert snap[pol.names[i]]["CPU"] == frozenset(rep.engine.cpu.keys)
        assert len(rep.engine.cpu) <= rep.engine.cpu.capacity
    owners = {rep.engine.cpu.table.owner(k) for rep in sim.replicas for k in rep.engine.cpu.keys}
    assert {o for o in owners if o} and all(o is None or o.startswith("sim/") for o in owners)
    # the router keeps the hold each session's last hint asked for (priced by the cost model
    # while the engine's retained-share gauge, which the simulated router reads, is under cap)
    holds = [fp.hold_s for fp in pol.kv.sessions.values()]
    assert holds and all(0 < h <= RetentionConfig().ttl_s for h in holds)
    assert all(v.host_retained is not None for v in sim.views)
    # without engine_hints the router sends none: nothing is claimed, nothing is held
    pol = RouterPolicy("kv_cost", off)
    sim = Simulator(off, 3, pol, plugin=EnginePlugin(retention=RetentionConfig()))
    sim.run(synthetic_agentx(12, 300, seed=4), until=900)
    assert not any(rep.engine.cpu.table.owner(k) for rep in sim.replicas
                   for k in rep.engine.cpu.keys)  # fmt: skip
    assert not any(fp.hold_s for fp in pol.kv.sessions.values())


def test_retention_needs_a_host_tier():
    with pytest.raises(ValueError, match="host tier"):
        Engine(TINY, plugin=EnginePlugin(retention=RetentionConfig()))


# ---- the bounded cadence ---------------------------------------------------------------------


def cadence_engine(**kw) -> Engine:
    prof = TINY.replace(max_num_batched_tokens=256, gpu_kv_blocks=4096)
    return Engine(prof, plugin=EnginePlugin(cadence=CadenceConfig(**kw)))


def test_cadence_admits_prefill_every_nth_step_while_a_request_decodes():
    e = cadence_engine(interval=4, max_defer_steps=16, max_defer_ms=1e9, backlog_scale=1e9)
    e.add(call("dec", keys(2), max_tokens=400))
    t, admits, n = 0.0, [], 0
    while n < 60:
        if n >= 4:  # a short prompt arrives every step once the decoder runs
            e.add(call(f"q{n}", keys(1)))
        s = e.schedule(t)
        assert s is not None
        t += s.duration
        e.complete(s, t)
        admits.append(any(q.id != "dec" and k > 1 for q, k in s.scheduled))
        n += 1
    steady = admits[8:]
    assert sum(steady) == len(steady) // 4  # one prefill step in four
    assert all(sum(steady[i : i + 4]) == 1 for i in range(0, len(steady) - 3, 4))
    assert e.cadence is not None and e.cadence.stats.max_held_steps <= 3


def test_cadence_never_holds_past_its_bound_under_sustained_overload():
    e = cadence_engine(interval=8, max_defer_steps=3, max_defer_ms=1e9, backlog_scale=1e9)
    for i in range(2):
        e.add(call(f"dec{i}", keys(2), max_tokens=300))
    t = 0.0
    worst = 0
    for n in range(300):
        if n % 2 == 0:  # 2 prompts of ~500 tokens every 2 steps: more than the budget takes
            e.add(call(f"q{n}", keys(16)))
        s = e.schedule(t)
        if s is None:
            break
        t += s.duration
        e.complete(s, t)
        assert e.cadence is not None
        worst = max(worst, max((e.cadence.held(r.id)[0] for r in e.waiting), default=0))
    stats = e.cadence.stats
    assert stats.deferred_steps > 0 and e.waiting  # overloaded, and the cadence was on
    assert stats.max_held_steps <= 3 and worst <= 3


def test_cadence_bound_in_milliseconds_counts_model_time():
    e = cadence_engine(interval=1000, max_defer_steps=1000, max_defer_ms=20.0, backlog_scale=1e9)
    e.add(call("dec", keys(2), max_tokens=400))
    t = drive_steps(e, 3, 0.0)
    q = call("q", keys(4))
    e.add(q)
    step_ms = []
    while q.first_token_time is None:
        s = e.schedule(t)
        assert s is not None
        step_ms.append(s.duration * 1e3)
        t += s.duration
        e.complete(s, t)
    assert e.cadence is not None
    assert e.cadence.stats.max_held_ms <= 20.0 + max(step_ms)


def drive_steps(e: Engine, n: int, t: float) -> float:
    for _ in range(n):
        s = e.schedule(t)
        assert s is not None
        t += s.duration
        e.complete(s, t)
    return t


def test_plugin_settings_take_the_plugin_names_and_are_off_by_default():
    import argparse

    p = argparse.ArgumentParser()
    add_plugin_args(p)
    assert plugin_from_args(p.parse_args([])) == EnginePlugin()
    argv = ["--retention", "--retention-share", "0.3", "--cadence-interval", "2",
            "--max-defer-ms", "50"]  # fmt: skip
    got = plugin_from_args(p.parse_args(argv))
    assert got.retention == RetentionConfig(ttl_s=600.0, max_share=0.3)
    assert got.cadence == CadenceConfig(interval=2, max_defer_ms=50.0)
    assert EnginePlugin.from_settings({"ttl_s": 30}, {"interval": 3}) == EnginePlugin(
        RetentionConfig(ttl_s=30), CadenceConfig(interval=3)
    )
    with pytest.raises(ValueError, match="unknown"):
        EnginePlugin.from_settings({"ttl": 30})
    assert Engine(TINY).cadence is None  # off by default: the plain twin


def test_decoded_events_of_a_retaining_tier_are_vllm_cpu_events():
    e = retaining()
    pause_then_pressure(e, Hint("p", "tool-pause", 100))
    evs = [decode_event(x) for x in e.take_events()]
    cpu = [ev for ev in evs if getattr(ev, "medium", None) == "CPU"]
    assert cpu and all(getattr(ev, "block_size", 0) == 0 for ev in cpu
                       if type(ev).__name__ == "BlockStored")  # fmt: skip


def test_the_pending_prefill_gauge_counts_a_waiting_prompt_net_of_its_cached_prefix():
    """As the plugin's ``vllm:num_pending_prefill_tokens``: a cold prompt in chunked prefill
    counts what it has left, a waiting prompt whose prefix the GPU holds counts only its tail
    (an agent's next call is mostly cached), a cold waiting one counts in full."""
    e = cadence_engine(interval=1, max_defer_steps=16, max_defer_ms=1e9, backlog_scale=1e9)
    warm_keys = keys(40)
    t = drive(e, [call("warm-1", warm_keys)])  # cached now
    e.add(call("cold", keys(40)))  # 40 blocks + 1 token: several 256-token chunks
    t = drive_steps(e, 1, t)
    running_left = sum(r.num_tokens - r.num_computed for r in e.running)
    assert running_left > 256
    assert e.pending_prefill_tokens() == running_left
    e.add(call("warm-2", warm_keys))  # waits behind the chunks; 40 of its 40 blocks cached
    e.add(call("new", keys(10)))
    assert e.pending_prefill_tokens() == running_left + 1 + (10 * BS + 1)
    drive(e, (), t)
    assert e.pending_prefill_tokens() == 0
