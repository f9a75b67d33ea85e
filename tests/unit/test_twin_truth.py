"""The twins' truths (issue 42): the engine's timing is not the router's model, and each
perturbed truth differs from the nominal one as it says."""

from __future__ import annotations

import pytest

from costmodel import steptime
from costmodel.profiles import load_profile
from loadtest.twin.engine import Engine, Request
from loadtest.twin.truth import COSTMODEL, TRUTHS, Truth, TruthTiming, describe, timing

TP4 = load_profile("h200-70b-fp8-tp4")
ONE = load_profile("h200-70b-fp8-offload")
TP4_HOST = load_profile("h200-70b-fp8-tp4-offload")
GPU_PROFILES = [TP4, ONE, load_profile("h200-8b")]


def prefill_s(profile, truth: str | None, n: int, cached: int = 0) -> float:
    """TTFT of one ``n``-token prompt on an idle engine under ``truth`` (engine steps)."""
    e = Engine(profile, emit_events=False, truth=truth)
    bs = profile.block_size
    # distinct keys; ``cached`` tokens already computed by an earlier request
    keys = list(range(1, n // bs + 1))
    t = 0.0
    if cached:
        first = Request("warm", cached + 1, 1, block_keys=keys[: cached // bs])
        e.add(first)
        t = run(e, t)
    r = Request("r", n, 1, block_keys=keys, arrival=t)
    e.add(r)
    end = run(e, t)
    assert r.first_token_time is not None
    return r.first_token_time - t if end else 0.0


def run(e: Engine, t: float) -> float:
    while e.has_work:
        s = e.schedule(t)
        assert s is not None
        t += s.duration
        e.complete(s, t)
    return t


@pytest.mark.parametrize("profile", GPU_PROFILES, ids=lambda p: p.name)
def test_a_10k_prefill_takes_at_least_1_3x_longer_under_prefill_slow(profile):
    nominal = prefill_s(profile, "nominal", 10_000)
    slow = prefill_s(profile, "prefill-slow", 10_000)
    assert slow >= 1.3 * nominal
    assert slow <= 1.45 * nominal  # 35% slower, not anything slower
    # ... and a long cached context too (attention at its own, slower efficiency)
    assert prefill_s(profile, "prefill-slow", 8192 + 100_032, 100_032) >= 1.3 * prefill_s(
        profile, "nominal", 8192 + 100_032, 100_032
    )


@pytest.mark.parametrize("profile", GPU_PROFILES, ids=lambda p: p.name)
def test_under_prefill_slow_a_decode_sharing_a_step_with_prefill_slows_more(profile):
    chunk = (2048, steptime.attended_pairs(2048, 20_000), 20_000)

    def extra(t) -> float:  # what 16 decoders of 50k add to a prefill chunk's step
        return t.step(*chunk, 16, 800_000) - t.step(*chunk, 0, 0)

    nominal, slow = timing(profile, "nominal"), timing(profile, "prefill-slow")
    # decoders alone are as fast under both truths ...
    assert slow.decode_step(16, 800_000) == pytest.approx(nominal.decode_step(16, 800_000), 0.01)
    # ... but beside a prefill chunk they cost clearly more under prefill-slow
    assert extra(slow) >= 1.5 * extra(nominal)
    assert extra(nominal) > 0


def test_decode_fast_slow_link_decodes_over_20pct_faster_on_tp4_and_loads_at_half_speed():
    nominal, fast = timing(TP4, "nominal"), timing(TP4, "decode-fast-slow-link")
    for batch in (1, 4, 16, 32):
        for ctx in (1_000, 20_000, 50_000):
            ratio = fast.decode_step(batch, batch * ctx) / nominal.decode_step(batch, batch * ctx)
            assert ratio <= 0.82, (batch, ctx, ratio)  # >= 1.22x the tokens per second
            assert ratio >= 0.6, (batch, ctx, ratio)
    # one GPU: weight reads dominate; faster still, by less (HBM is at 0.95 of peak)
    n1, f1 = timing(ONE, "nominal"), timing(ONE, "decode-fast-slow-link")
    assert 0.75 <= f1.decode_step(8, 80_000) / n1.decode_step(8, 80_000) <= 0.9
    # prefill unchanged (within the smaller step overhead)
    assert prefill_s(TP4, "decode-fast-slow-link", 10_000) == pytest.approx(
        prefill_s(TP4, "nominal", 10_000), rel=0.03
    )
    for blocks in (16, 1_000):
        assert fast.load(blocks, "cpu") >= 1.8 * nominal.load(blocks, "cpu")


def test_the_engine_loads_from_the_host_tier_at_the_truths_speed():
    n_blocks = 40
    bs = TP4_HOST.block_size
    # a small GPU pool: a second request evicts the first one's blocks to the host tier
    prof = TP4_HOST.replace(gpu_kv_blocks=n_blocks + 20)

    def ready_after(truth: str) -> tuple[float, int]:
        e = Engine(prof, emit_events=False, truth=truth)
        keys = list(range(1, n_blocks + 2))
        e.add(Request("a", (n_blocks + 1) * bs, 1, block_keys=keys))
        t = run(e, 0.0)
        e.add(Request("b", (n_blocks + 10) * bs, 1, block_keys=list(range(1000, 1060))))
        t = run(e, t)
        again = Request("a2", (n_blocks + 1) * bs, 1, block_keys=keys, arrival=t)
        e.add(again)
        assert e.schedule(t) is None and again.ready_at is not None
        return again.ready_at - t, e.tier_hit_blocks["cpu"]

    slow, n_cpu = ready_after("decode-fast-slow-link")
    assert n_cpu >= n_blocks // 2
    assert slow == pytest.approx(timing(prof, "decode-fast-slow-link").load(n_cpu, "cpu"))
    nominal, n_cpu_nominal = ready_after("nominal")
    assert n_cpu_nominal == n_cpu and slow >= 1.8 * nominal


def test_nominal_is_its_own_model_close_to_the_profile_not_costmodels_formula():
    nominal, model = timing(TP4, "nominal"), timing(TP4, COSTMODEL)
    shapes = [
        (8192, steptime.attended_pairs(8192, 0), 0, 0, 0),  # a cold chunk
        (8192, steptime.attended_pairs(8192, 100_000), 100_000, 0, 0),  # deep in a context
        (0, 0, 0, 16, 800_000),  # decode only
        (2048, steptime.attended_pairs(2048, 20_000), 20_000, 16, 800_000),  # mixed
        (300, steptime.attended_pairs(300, 1_000), 1_000, 40, 400_000),  # near the ridge
    ]
    ratios = [nominal.step(*s) / model.step(*s) for s in shapes]
    assert all(0.85 <= r <= 1.25 for r in ratios), ratios  # the profile is roughly right ...
    assert max(abs(r - 1) for r in ratios) >= 0.05, ratios  # ... but not exact
    assert nominal.load(1_000, "cpu") > 1.1 * model.load(1_000, "cpu")  # DMA granularity


def test_the_truths_timing_reads_nothing_of_costmodels_formula(monkeypatch):
    """The twin under a truth must not run kv_cost's formulas: break them, and it still runs."""

    def broken(*a, **k):
        raise AssertionError("costmodel.steptime called under a truth")

    for name in ("coefficients", "load_time", "prefill_time", "step_time", "decode_step_time"):
        monkeypatch.setattr(steptime, name, broken)
    monkeypatch.setattr(steptime.StepCoefficients, "step", broken)
    for truth in TRUTHS:
        assert prefill_s(TP4, truth, 3_000) > 0
        assert timing(TP4_HOST, truth).load(10, "cpu") > 0
    with pytest.raises(AssertionError):
        prefill_s(TP4, None, 3_000)  # the default (costmodel) does use it


def test_truth_names_and_figures():
    assert {"nominal", "prefill-slow", "decode-fast-slow-link"} <= set(TRUTHS)
    with pytest.raises(ValueError, match="unknown truth"):
        timing(TP4, "no-such")
    with pytest.raises(ValueError):
        Truth("bad", "", gemm=0.0)
    assert describe("prefill-slow")["interference"] == 1.0
    assert describe(COSTMODEL)["name"] == COSTMODEL
    assert isinstance(timing(TP4, TRUTHS["nominal"]), TruthTiming)


def test_the_simulators_bursts_stay_step_exact_under_a_truth():
    from loadtest.sim.simulator import Simulator, route_round_robin, synthetic_agentx

    sessions = synthetic_agentx(6, 600, seed=2)
    recs = []
    for burst in (False, True):
        res = Simulator(TP4, 2, route_round_robin(), burst=burst, truth="prefill-slow").run(
            sessions, until=600
        )
        recs.append([(r.session_id, r.call_index, r.first_token, r.finish) for r in res.records])
    assert len(recs[0]) == len(recs[1]) > 10
    for a, b in zip(*recs, strict=True):
        assert a[:2] == b[:2] and a[2:] == pytest.approx(b[2:])
    base = Simulator(TP4, 2, route_round_robin(), truth="nominal").run(sessions, until=600)
    slow = {(r.session_id, r.call_index): r.ttft for r in res.records}
    nom = {(r.session_id, r.call_index): r.ttft for r in base.records}
    common = slow.keys() & nom.keys()
    assert sum(slow[k] for k in common) > 1.2 * sum(nom[k] for k in common)


def test_kv_cost_with_no_profile_calibrates_online_and_spreads_the_load():
    """``--router-profile none``: kv_cost prices with the generic stand-in (one H200, 3-4x
    slower than a TP4 replica) and must learn the speed online. Before cold replicas borrowed
    the fleet's fit, the first replica calibrated looked ~3x cheaper and took every call."""
    from collections import Counter

    from costmodel.profiles import router_profile
    from loadtest.sim.router_policy import RouterPolicy
    from loadtest.sim.simulator import Simulator, synthetic_agentx

    pol = RouterPolicy("kv_cost", router_profile("none"))
    assert pol.profile.name == "generic"
    res = Simulator(TP4, 4, pol, truth="nominal").run(
        synthetic_agentx(24, 1200, seed=1), until=1200
    )
    per_replica = Counter(r.replica for r in res.records)
    assert len(per_replica) == 4 and min(per_replica.values()) >= len(res.records) // 20
    fits = [pol.kv.calibration(n) for n in pol.names]
    # the stand-in is ~3.4x slower at prefill and ~2.2x at decode than the TP4 truth
    assert all(0.2 <= f.prefill_scale <= 0.45 and 0.3 <= f.decode_scale <= 0.6 for f in fits)


def test_the_sim_command_takes_a_truth_and_a_router_profile(tmp_path, capsys):
    import json

    from kvroute.cli import main

    out = tmp_path / "sim.json"
    argv = ["sim", "--replicas", "2", "--hours", "0.05", "--profile", "h200-70b-fp8-tp4",
            "--policy", "router:kv_cost", "--truth", "prefill-slow", "--router-profile", "none",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert (data["truth"], data["router_profile"]) == ("prefill-slow", "generic")
    assert data["results"]["router:kv_cost"]["requests"] > 0
    assert "truth prefill-slow" in capsys.readouterr().out


def test_the_twin_and_cluster_commands_refuse_an_unknown_truth():
    from kvroute.cli import main

    for cmd in ("twin", "cluster", "sim", "bench"):
        argv = [cmd, "--truth", "no-such"] + (["t", "--out", "x"] if cmd == "bench" else [])
        if cmd == "bench":
            assert main(argv) == 2
            continue
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
