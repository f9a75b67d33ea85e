"""Trace loaders on real trace slices: DAG shape, join gates, delays, formats, bad input."""

from __future__ import annotations

import gzip
import itertools
import json
import tarfile
from pathlib import Path

import pytest

from loadtest.traces import Dep, TraceError, cap_gaps, load_trace, mooncake, synthetic, weka

DATA = Path(__file__).resolve().parents[2] / "loadtest" / "data"
WEKA = DATA / "weka-dev-slice.tar.gz"
MOONCAKE = DATA / "mooncake-slice.jsonl.gz"


def _raw(name: str) -> dict:
    with tarfile.open(WEKA) as tf:
        f = tf.extractfile(f"weka-dev-slice/{name}.json")
        assert f is not None
        return json.load(f)


@pytest.fixture(scope="module")
def weka_trace():
    return weka.load(WEKA)


def test_weka_slice_loads_every_session_and_call(weka_trace):
    assert weka_trace.block_size == 64 and weka_trace.id_scope == "session"
    assert len(weka_trace.sessions) == 16
    for s in weka_trace.sessions:
        raw = _raw(s.id)
        n_raw = sum(
            len(r["requests"]) if r.get("type") == "subagent" else 1 for r in raw["requests"]
        )
        assert len(s.calls) == n_raw, s.id


def test_main_chain_keeps_order_and_end_to_start_gaps(weka_trace):
    s = next(x for x in weka_trace.sessions if x.id == "trace_0684")
    raw = [r for r in _raw("trace_0684")["requests"] if r.get("type") != "subagent"]
    main = [c for c in s.calls if c.agent == "main"]
    assert [c.recorded_s for c in main] == [r["t"] for r in raw]
    assert main[0].deps == ()
    for i in range(1, len(main)):
        (dep,) = main[i].deps
        assert dep.call == main[i - 1].id
        want = raw[i].get("think_time")
        if want is None:
            want = raw[i]["t"] - raw[i - 1]["t"] - raw[i - 1].get("api_time", 0.0)
        assert dep.delay_s == pytest.approx(min(max(want, 0.0), weka.DEFAULT_MAX_GAP_S))
    assert main[3].hash_ids == tuple(raw[3]["hash_ids"])
    assert main[3].input_tokens == raw[3]["in"]


def test_idle_gaps_are_capped():
    s = weka.load(WEKA, names=["trace_0398"], max_gap_s=5.0).sessions[0]
    delays = [d.delay_s for c in s.calls for d in c.deps]
    assert max(delays) == 5.0  # this session has gaps of hours between turns
    uncapped = weka.load(WEKA, names=["trace_0398"], max_gap_s=1e9).sessions[0]
    assert max(d.delay_s for c in uncapped.calls for d in c.deps) > 3600


def test_subagents_spawn_after_last_parent_call_and_gate_the_join(weka_trace):
    s = next(x for x in weka_trace.sessions if x.id == "trace_0291")
    raw = _raw("trace_0291")["requests"]
    main_raw = [r for r in raw if r.get("type") != "subagent"]
    subs_raw = [r for r in raw if r.get("type") == "subagent"]
    assert s.agents == ["main", "agent_001", "agent_002"]
    order = [c.id for c in s.calls]
    for sub in subs_raw:
        name = sub["agent_id"]
        chain = [c for c in s.calls if c.agent == name]
        assert len(chain) == len(sub["requests"])
        assert all(c.parent_agent == "main" for c in chain)
        spawn = max(i for i, r in enumerate(main_raw) if r["t"] <= sub["t"])
        (dep,) = chain[0].deps
        assert dep.call == f"main/{spawn}"
        end = sub["t"] + sub["duration_ms"] / 1000
        join = next(i for i, r in enumerate(main_raw) if r["t"] >= end)
        gate = next(c for c in s.calls if c.id == f"main/{join}")
        assert any(d.call == chain[-1].id and d.delay_s == 0.0 for d in gate.deps)
        # Topological order: the chain sits between its spawn call and its join gate.
        assert order.index(f"main/{spawn}") < order.index(chain[0].id)
        assert order.index(chain[-1].id) < order.index(gate.id)
        # Subagents start from a fresh context: no block shared with the parent.
        parent_ids = {h for c in s.calls if c.agent == "main" for h in c.hash_ids}
        assert not parent_ids & {h for c in chain for h in c.hash_ids}


def test_subagent_that_ends_after_the_last_parent_call_joins_nothing(tmp_path):
    doc = {
        "id": "x",
        "block_size": 64,
        "requests": [
            {"t": 0.0, "in": 100, "out": 5, "hash_ids": [1, 2], "api_time": 1.0},
            {
                "t": 10.0,
                "type": "subagent",
                "agent_id": "a",
                "duration_ms": 99_000,
                "requests": [
                    {"t": 10.0, "in": 70, "out": 3, "hash_ids": [7, 8]},
                    {"t": 14.0, "in": 90, "out": 3, "hash_ids": [7, 9], "think_time": 2.0},
                ],
            },
            {"t": 20.0, "in": 200, "out": 5, "hash_ids": [1, 2, 3, 4], "think_time": 19.0},
        ],
    }
    p = tmp_path / "x.json"
    p.write_text(json.dumps(doc))
    s = weka.load(p).sessions[0]
    assert [c.id for c in s.calls] == ["main/0", "a/0", "a/1", "main/1"]
    assert s.call("a/0").deps[0].call == "main/0"
    assert s.call("a/0").deps[0].delay_s == pytest.approx(9.0)  # 10 - (0 + 1)
    assert s.call("a/1").deps[0].delay_s == 2.0
    # Absolute inner times (first inner t == subagent t) were made relative.
    assert s.call("a/1").recorded_s == pytest.approx(4.0)
    assert s.call("main/1").deps == (weka.Dep("main/0", 19.0),)


def test_tools_and_system_prefix_blocks_are_marked(weka_trace):
    s = next(x for x in weka_trace.sessions if x.id == "trace_0291")
    raw = _raw("trace_0291")
    c0 = s.calls[0]
    assert c0.prefix_blocks == (raw["tool_tokens"] + raw["system_tokens"]) // 64
    sub = next(c for c in s.calls if c.agent == "agent_001")
    assert sub.prefix_group == "Explore" and 0 < sub.prefix_blocks < c0.prefix_blocks


def test_truncate_keeps_only_calls_with_kept_dependencies(weka_trace):
    t = weka.load(WEKA, names=["trace_0291"], max_calls=5)
    s = t.sessions[0]
    assert len(s.calls) == 5
    ids = {c.id for c in s.calls}
    assert all(d.call in ids for c in s.calls for d in c.deps)


def test_mooncake_slice_jittered_open_loop_with_shared_ids():
    t = mooncake.load_mooncake(MOONCAKE, jitter_s=3.0, seed=7)
    assert t.block_size == 512 and t.id_scope == "trace" and t.open_loop
    assert len(t.sessions) == 300
    raw = [json.loads(x) for x in gzip.open(MOONCAKE, "rt")]
    by_line = {s.id: s for s in t.sessions}
    for n, r in enumerate(raw, 1):
        s = by_line[f"r{n}"]
        (c,) = s.calls
        assert c.hash_ids == tuple(r["hash_ids"]) and c.input_tokens == r["input_length"]
        assert r["timestamp"] / 1e3 <= s.arrival_s < r["timestamp"] / 1e3 + 3.0
    arrivals = [s.arrival_s for s in t.sessions]
    assert arrivals == sorted(arrivals)
    again = mooncake.load_mooncake(MOONCAKE, jitter_s=3.0, seed=7)
    assert [s.arrival_s for s in again.sessions] == arrivals
    # ids are shared across requests (that is what makes the trace cache-relevant)
    seen: set[int] = set()
    shared = 0
    for s in t.sessions:
        shared += bool(seen & set(s.calls[0].hash_ids))
        seen |= set(s.calls[0].hash_ids)
    assert shared > 10


def test_aiperf_sessions_chain_turns_with_delays(tmp_path):
    p = tmp_path / "t.jsonl"
    lines = [
        {
            "session_id": "s1",
            "timestamp": 0,
            "input_length": 600,
            "output_length": 10,
            "hash_ids": [1, 2],
        },
        {
            "session_id": "s2",
            "timestamp": 500,
            "input_length": 300,
            "output_length": 5,
            "hash_ids": [9],
        },
        {
            "session_id": "s1",
            "delay": 2500,
            "input_length": 1100,
            "output_length": 10,
            "hash_ids": [1, 2, 3],
        },
    ]
    p.write_text("\n".join(json.dumps(x) for x in lines))
    t = load_trace(p)  # detected by session_id
    assert t.meta["format"] == "aiperf" and t.open_loop
    s1, s2 = t.sessions
    assert [c.id for c in s1.calls] == ["s1/0", "s1/1"]
    assert s1.calls[1].deps[0].delay_s == 2.5
    assert s2.arrival_s == 0.5


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("not json\n", "not JSON"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}\n', "hash_ids"),
        ('{"timestamp": 0, "text_input": "hi", "output_length": 1}\n', "literal prompts"),
        ("\n", "empty"),
    ],
)
def test_bad_mooncake_lines_are_clear_errors(tmp_path, content, match):
    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    with pytest.raises(TraceError, match=match):
        load_trace(p)


def test_bad_weka_inputs_are_clear_errors(tmp_path):
    with pytest.raises(TraceError, match="no such trace"):
        load_trace(tmp_path / "missing.tar.gz")
    (tmp_path / "x.json").write_text('{"id": 1}')
    with pytest.raises(TraceError, match="requests"):
        load_trace(tmp_path / "x.json")
    with pytest.raises(TraceError, match="unknown synthetic parameter"):
        load_trace("synthetic:nope=1")


def test_synthetic_sessions_are_deterministic_valid_dags():
    a = synthetic.generate(synthetic.AgentXParams(sessions=6, seed=3, subagent_prob=0.2))
    b = synthetic.generate(synthetic.AgentXParams(sessions=6, seed=3, subagent_prob=0.2))
    assert [[c for c in s.calls] for s in a] == [[c for c in s.calls] for s in b]
    assert a.stats()["subagents"] > 0
    for s in a:
        main = [c for c in s.calls if c.agent == "main"]
        # each main call resends the previous prompt's full blocks: prefix growth
        for x, y in itertools.pairwise(main):
            full = x.input_tokens // a.block_size
            assert y.hash_ids[:full] == x.hash_ids[:full]
            assert y.input_tokens >= x.input_tokens
    c = synthetic.generate(synthetic.AgentXParams(sessions=6, seed=4))
    assert a.sessions[0].calls != c.sessions[0].calls


def test_replay_cli_reports_bad_traces_and_prompt_settings_clearly(tmp_path, capsys):
    from kvroute.cli import main

    rc = main(
        [
            "replay",
            str(tmp_path / "nope.tar.gz"),
            "--target",
            "http://127.0.0.1:9",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert rc == 2 and "no such trace" in capsys.readouterr().err
    rc = main(
        [
            "replay",
            str(WEKA),
            "--target",
            "http://127.0.0.1:9",
            "--out",
            str(tmp_path / "o"),
            "--block-size",
            "32",
            "--tokens-per-id",
            "48",
        ]
    )
    assert rc == 2 and "multiple of the replica block size" in capsys.readouterr().err


def test_idle_gap_cap_applies_to_synthetic_traces_too():
    from loadtest.traces import load_trace as _load

    spec = "synthetic:sessions=4,gap_median_s=300,seed=3"
    raw = _load(spec)
    capped = _load(spec, max_gap_s=30)
    delays = lambda t: [d.delay_s for s in t.sessions for c in s.calls for d in c.deps]  # noqa: E731
    assert max(delays(raw)) > 30  # the uncapped trace has long gaps to cap
    assert max(delays(capped)) <= 30 and capped.meta["max_gap_s"] == 30


def test_synthetic_traces_and_the_simulator_share_one_agentx_generator():
    from loadtest.sim.simulator import synthetic_agentx

    t = synthetic.generate(synthetic.AgentXParams(sessions=6, seed=3, subagent_prob=0.3))
    sim = synthetic_agentx(6, 3600, seed=3)  # the same defaults: the same main chains
    assert t.stats()["subagents"] > 0 and len(t.sessions) == len(sim)
    for ts, ss in zip(t.sessions, sim, strict=True):
        assert ts.arrival_s == ss.start
        main = [c for c in ts.calls if c.agent == "main"]
        assert len(main) == len(ss.calls)
        ctx = 0
        for c, sc in zip(main, ss.calls, strict=True):
            ctx += sc.new_tokens  # the prompt: everything so far plus the call's new tokens
            assert (c.input_tokens, c.output_tokens) == (ctx, sc.output_tokens)
            assert c.prefix_blocks == ss.shared_prefix_tokens // t.block_size
            if c.deps and c.deps[0].call.startswith("main/"):
                assert c.deps[0].delay_s == sc.think_s
            ctx += sc.output_tokens
    # subagents come from their own RNG: turning them off leaves the main chains as they are
    bare = synthetic.generate(synthetic.AgentXParams(sessions=6, seed=3, subagent_prob=0.0))
    assert bare.stats()["subagents"] == 0
    for a, b in zip(t.sessions, bare.sessions, strict=True):
        main = [(c.input_tokens, c.output_tokens) for c in a.calls if c.agent == "main"]
        assert main == [(c.input_tokens, c.output_tokens) for c in b.calls]


def test_aiperf_turn_timing_follows_aiperf_delay_after_the_previous_end(tmp_path):
    """aiperf issues turn k+1 when turn k's response returns: ``delay`` counts from that end
    (end-to-start); a later turn's ``timestamp`` is an absolute trace time (fixed schedule),
    which wins over a delay. Hand-checked: session s starts at t=1000 ms."""
    p = tmp_path / "t.jsonl"
    rows = [
        {"session_id": "s", "timestamp": 1000, "input_length": 600, "output_length": 9,
         "hash_ids": [1, 2]},
        {"session_id": "s", "delay": 2500, "input_length": 900, "output_length": 9,
         "hash_ids": [1, 2, 3]},  # 2.5 s after turn 0 ends
        {"session_id": "s", "timestamp": 61000, "input_length": 1200, "output_length": 9,
         "hash_ids": [1, 2, 3, 4]},  # not before 60 s after the session start (1000 ms)
        {"session_id": "s", "timestamp": 4000, "delay": 700, "input_length": 1300,
         "output_length": 9, "hash_ids": [1, 2, 3, 4, 5]},  # both: the timestamp wins
        {"session_id": "s", "input_length": 1400, "output_length": 9,
         "hash_ids": [1, 2, 3, 4, 5, 6]},  # neither: right after turn 3 ends
        {"session_id": "u", "input_length": 100, "output_length": 9, "hash_ids": [7]},
        {"session_id": "u", "timestamp": 9000, "delay": 1500, "input_length": 200,
         "output_length": 9, "hash_ids": [7, 8]},  # no first timestamp: the delay counts
    ]  # fmt: skip
    p.write_text("\n".join(json.dumps(x) for x in rows))
    t = load_trace(p)
    s, u = t.sessions
    timing = [(c.deps, c.not_before_s) for c in s.calls]
    assert timing == [
        ((), None),
        ((Dep("s/0", 2.5),), None),
        ((Dep("s/1", 0.0),), 60.0),
        ((Dep("s/2", 0.0),), 3.0),
        ((Dep("s/3", 0.0),), None),
    ]
    assert [(c.deps, c.not_before_s) for c in u.calls] == [((), None), ((Dep("u/0", 1.5),), None)]
    # idle-gap capping leaves absolute turn times alone
    assert [c.not_before_s for c in cap_gaps(s, 1.0).calls] == [None, None, 60.0, 3.0, None]
    assert cap_gaps(s, 1.0).calls[1].deps == (Dep("s/0", 1.0),)


def test_the_long_context_workload_has_agentx_distributions():
    """The yardstick's ``agentx-long`` sessions follow AgentX v1.0's published figures (input
    p50 142k / p95 683k tokens, output p50 444, gap p50 3.84 s / p95 3.08 min) and fit the
    1M-token profile they run on."""
    from costmodel.profiles import load_profile
    from loadtest.bench.bench_kv_policy import AGENTX_LONG, WORKLOADS

    spec, profile, *_ = WORKLOADS["agentx-long"]
    assert spec == AGENTX_LONG
    t = load_trace(spec)
    ins = sorted(c.input_tokens for s in t.sessions for c in s.calls)
    outs = sorted(c.output_tokens for s in t.sessions for c in s.calls)
    gaps = sorted(d.delay_s for s in t.sessions for c in s.calls for d in c.deps if d.delay_s > 0)

    def q(xs, p):
        return xs[int(p * (len(xs) - 1))]

    assert 120_000 <= q(ins, 0.5) <= 165_000 and 600_000 <= q(ins, 0.95) <= 850_000
    assert 380 <= q(outs, 0.5) <= 520
    assert 2.5 <= q(gaps, 0.5) <= 5.0 and 120 <= q(gaps, 0.95) <= 240
    assert ins[-1] + max(outs) <= load_profile(profile).max_model_len
