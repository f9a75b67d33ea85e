"""P/D disaggregation in the simulator: prefill-only and decode-only replicas, a split call's
two legs (the KV transfer priced, the decode replica's blocks allocated on arrival), and the
router's own P/D path (prefill pick, decode pick, the per-call verdict)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from costmodel.disagg import kv_transfer_time
from costmodel.profiles import load_profile
from loadtest.sim.pd import PDSimulator, RoundRobinPD, pd_roles
from loadtest.sim.router_policy import PDRouterPolicy
from loadtest.sim.simulator import Call, Session
from loadtest.twin.request import LOADING

P70 = load_profile("h200-70b-fp8")
BS = P70.block_size


def slow_link(bw: float) -> object:
    return P70.replace(hardware=dataclasses.replace(P70.hardware, kv_transfer_bw=bw))


def one_call(prompt: int = 20_000, out: int = 50) -> list[Session]:
    return [Session("s", 0.0, [Call(prompt, out)])]


def test_pd_roles_parses_the_split():
    assert pd_roles("1:3") == ["prefill", "decode", "decode", "decode"]
    for bad in ("0:2", "2", "a:b", "2:0"):
        with pytest.raises(ValueError, match="P:D"):
            pd_roles(bad)


def test_split_call_prefills_on_one_replica_and_decodes_on_the_other():
    sim = PDSimulator(P70, ["prefill", "decode"], RoundRobinPD(["prefill", "decode"]))
    res = sim.run(one_call(), until=600)
    (rec,) = res.records
    pre, dec = (r.engine for r in sim.replicas)
    assert rec.replica == 1 and rec.output_tokens == 50  # decoded on the decode replica
    assert pre.prefix_queries == 20_000  # the prefill replica computed the prompt
    assert pre.generation_tokens_total == 1  # its leg: one output token
    assert dec.prefix_queries == 0  # the decode leg's KV came over the link, not a prefill
    assert dec.remote_blocks == 20_000 // BS
    assert dec.generation_tokens_total == 50
    assert rec.cached_tokens == 0  # the call's hit: the prefill replica's (cold)
    assert sim.split_calls == 1 and sim.colocated_calls == 0


def test_transfer_time_is_in_the_ttft():
    """The same call over a link 100× slower: TTFT grows by the transfer's difference."""
    fast = PDSimulator(P70, ["prefill", "decode"], RoundRobinPD(["prefill", "decode"]))
    slow_prof = slow_link(P70.hardware.kv_transfer_bw / 100)
    slow = PDSimulator(slow_prof, ["prefill", "decode"], RoundRobinPD(["prefill", "decode"]))
    a = fast.run(one_call(), until=600).records[0]
    b = slow.run(one_call(), until=600).records[0]
    moved = 20_000 // BS * BS
    extra = kv_transfer_time(slow_prof, moved) - kv_transfer_time(P70, moved)
    assert extra > 1.0  # the slow link is seconds, not noise
    assert b.ttft - a.ttft == pytest.approx(extra, rel=0.05)


def test_decode_blocks_are_allocated_when_the_leg_arrives():
    """Mid-transfer the decode replica already holds the prompt's blocks (LOADING)."""
    prof = slow_link(P70.hardware.kv_transfer_bw / 1000)  # a transfer of tens of seconds
    sim = PDSimulator(prof, ["prefill", "decode"], RoundRobinPD(["prefill", "decode"]))
    free = sim.replicas[1].engine.pool.num_free
    sim.run(one_call(), until=10.0)  # the prefill leg is done, the transfer is not
    dec = sim.replicas[1].engine
    (req,) = dec.waiting  # vLLM keeps a request whose KV is loading in its waiting queue
    assert req.status == LOADING and len(req.blocks) == 20_000 // BS
    assert dec.pool.num_free == free - 20_000 // BS
    assert dec.generation_tokens_total == 0


def test_router_pd_always_splits_and_keeps_the_session_where_its_prefix_lives():
    roles = ["prefill", "prefill", "decode", "decode"]
    pol = PDRouterPolicy("kv_cost", P70, roles, pd_mode="always")
    sim = PDSimulator(P70, roles, pol)
    calls = [Call(20_000, 40, think_s=1.0), Call(1_000, 40, think_s=1.0), Call(1_000, 40)]
    res = sim.run([Session("a", 0.0, calls)], until=600)
    assert len(res.records) == 3 and sim.split_calls == 3
    assert all(roles[r.replica] == "decode" for r in res.records)
    pre = [i for i in (0, 1) if sim.replicas[i].engine.prefix_queries]
    assert len(pre) == 1  # every prefill leg on the replica holding the session's prefix
    assert res.records[1].cached_tokens >= 20_000 // BS * BS  # found there
    assert pol.verdicts == {"always": 3}
    assert not any(pol.inflight.values())  # each leg's in-flight count given back


def test_router_pd_auto_splits_only_where_decoders_would_stall():
    """pd_mode auto (Dynamo's conditional disaggregation): on an idle decode replica a call is
    cheaper prefilled there (no transfer, nobody stalls); a 30k-token prompt arriving while 16
    calls decode there is split (its chunked prefill would stall each of them). A colocated
    call never lands on the prefill-only replica; pd_mode never splits nothing."""
    roles = ["prefill", "decode"]
    decoders = [Session(f"d{i}", 0.0, [Call(2_000, 2_000)]) for i in range(16)]
    big = Session("big", 5.0, [Call(30_000, 20)])
    pol = PDRouterPolicy("kv_cost", P70, roles, pd_mode="auto")
    sim = PDSimulator(P70, roles, pol)
    res = sim.run([*decoders, big], until=600)
    assert pol.verdicts == {"cheaper_colocated": 16, "cheaper_split": 1}
    assert sim.split_calls == 1 and all(r.replica == 1 for r in res.records)
    assert sim.replicas[0].engine.prefix_queries == 30_000  # only the big call prefilled there
    pol_n = PDRouterPolicy("kv_cost", P70, roles, pd_mode="never")
    sim_n = PDSimulator(P70, roles, pol_n)
    res_n = sim_n.run([*decoders, big], until=600)
    assert sim_n.split_calls == 0 and sim_n.replicas[0].engine.prefix_queries == 0
    assert all(r.replica == 1 for r in res_n.records) and pol_n.verdicts == {"never": 17}


def test_router_pd_auto_short_prompt_runs_colocated():
    roles = ["prefill", "decode"]
    pol = PDRouterPolicy("kv_cost", P70, roles, pd_mode="auto", pd_min_prompt_tokens=4_000)
    sim = PDSimulator(P70, roles, pol)
    res = sim.run(one_call(prompt=2_000, out=20), until=600)
    assert sim.split_calls == 0 and res.records[0].replica == 1
    assert pol.verdicts == {"short_prompt": 1}


def test_a_router_without_route_pd_is_refused():
    with pytest.raises(ValueError, match="route_pd"):
        PDSimulator(P70, ["prefill", "decode"], lambda call, reps: 0)
    with pytest.raises(ValueError, match="pd_mode"):
        PDRouterPolicy("kv_cost", P70, ["prefill", "decode"], pd_mode="sometimes")


def test_kvroute_sim_pd_flag(tmp_path, capsys):
    from loadtest.sim import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    out = tmp_path / "s.json"
    argv = ["--pd", "1:1", "--hours", "0.05", "--sessions", "4", "--pd-mode", "always",
            "--policy", "router:kv_cost", "--policy", "round_robin",
            "--json", str(out)]  # fmt: skip
    assert cli.run(p.parse_args(argv)) == 0
    got = json.loads(out.read_text())
    assert got["replicas"] == 2 and got["pd"] == "1:1"
    for name in ("router:kv_cost", "round_robin"):
        pd = got["results"][name]["pd"]
        assert pd["split"] > 0 and pd["colocated"] == 0
    assert got["results"]["router:kv_cost"]["pd"]["verdicts"] == {
        "always": got["results"]["router:kv_cost"]["pd"]["split"]
    }
    assert "split, 0 colocated" in capsys.readouterr().out
    assert cli.run(p.parse_args(["--pd", "1:1", "--policy", "sticky_spill"])) == 2
    assert cli.run(p.parse_args(["--pd", "0:1"])) == 2
