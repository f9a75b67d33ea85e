"""Cost model: a table of cases per term, calibration, and the named total."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from costmodel.calibration import Calibrator, fit_scale, fit_ttft
from costmodel.placement import (
    CallShape,
    ReplicaLoad,
    Reservation,
    WarmSession,
    blocks_needed,
    decode_cost,
    eviction_harm,
    host_survival,
    next_calls_cost,
    p_return_after,
    placement_cost,
    prefill_throughput,
    queue_time,
    reserved_cost,
    segment_costs,
)
from costmodel.profiles import load_profile
from costmodel.steptime import (
    decode_step_time,
    load_time,
    prefill_stall_time,
    request_prefill_time,
    step_time,
)

H200 = load_profile("h200-70b-fp8")
OFF = load_profile("h200-70b-fp8-offload")
BS = H200.block_size  # 64
CTX = 142_000
NB = CTX // BS


@pytest.mark.parametrize(
    ("queued", "scale", "expect"),
    [
        (None, 1.0, None),
        (0, 1.0, 0.0),
        (8192, 1.0, 8192 / prefill_throughput(H200)),
        (8192, 2.0, 2 * 8192 / prefill_throughput(H200)),
    ],
)
def test_queue_term(queued, scale, expect):
    got = queue_time(H200, queued, scale)
    assert got == (None if expect is None else pytest.approx(expect))


def test_queue_negative_is_an_error():
    with pytest.raises(ValueError):
        queue_time(H200, -1)


@pytest.mark.parametrize(
    ("call", "chose", "approx"),
    [
        # all full blocks cached on GPU: only the partial last block is prefilled
        (CallShape(CTX, gpu_blocks=NB), {}, request_prefill_time(OFF, CTX - NB * BS, NB * BS)),
        (CallShape(NB * BS, gpu_blocks=NB), {}, request_prefill_time(OFF, 1, NB * BS - 1)),
        # the whole prefix in host DRAM: loading (~0.5 s) beats recomputing (~65 s)
        (CallShape(CTX, cpu_blocks=NB), {"cpu": "load"}, None),
        # cold: everything prefilled
        (CallShape(CTX), {}, request_prefill_time(H200, CTX, 0)),
    ],
)
def test_fetch_or_recompute_segments(call, chose, approx):
    s, load_s, rec_s, got_chose, tail_s, _ = segment_costs(OFF, call)
    assert got_chose == chose
    if approx is not None:
        assert s == pytest.approx(approx)
    if chose.get("cpu") == "load":
        assert load_s["cpu"] == pytest.approx(load_time(OFF, NB, "cpu"))
        assert rec_s["cpu"] > 50 * load_s["cpu"]
        # overlap=1: the load hides behind the tail prefill when the tail is longer
        assert s == pytest.approx(max(load_s["cpu"], tail_s))


def test_slow_storage_tier_is_recomputed_when_cheaper():
    slow = OFF.replace(
        hardware=OFF.hardware.__class__(
            **{**{f: getattr(OFF.hardware, f) for f in OFF.hardware.__slots__}, "storage_bw": 1e6}
        )
    )
    call = CallShape(4 * BS, storage_blocks=2)
    _, load_s, rec_s, chose, _, _ = segment_costs(slow, call)
    assert chose == {"storage": "recompute"} and load_s["storage"] > rec_s["storage"]


@pytest.mark.parametrize(("overlap", "factor"), [(0.0, "sum"), (1.0, "max")])
def test_overlap_of_loads_with_compute(overlap, factor):
    call = CallShape(CTX, cpu_blocks=NB // 2)
    s, load_s, _, _, tail_s, _ = segment_costs(OFF, call, overlap=overlap)
    want = tail_s + load_s["cpu"] if factor == "sum" else max(tail_s, load_s["cpu"])
    assert s == pytest.approx(want)


@pytest.mark.parametrize(
    ("call", "load", "expect"),
    [
        (
            CallShape(1000, expected_output_tokens=None),
            ReplicaLoad(decode_batch=4, decode_context_tokens=4e5),
            None,
        ),
        (CallShape(1000, expected_output_tokens=200), ReplicaLoad(), None),
        (
            CallShape(1000, expected_output_tokens=200),
            ReplicaLoad(decode_batch=4, decode_context_tokens=400_000),
            200 * decode_step_time(H200, 5, 401_000),
        ),
        (
            CallShape(1000, expected_output_tokens=200),
            ReplicaLoad(decode_batch=4, decode_context_tokens=400_000, decode_scale=1.5),
            1.5 * 200 * decode_step_time(H200, 5, 401_000),
        ),
    ],
)
def test_decode_term(call, load, expect):
    got = decode_cost(H200, call, load)
    assert got == (None if expect is None else pytest.approx(expect))


def test_decode_term_grows_with_the_batch():
    call = CallShape(1000, expected_output_tokens=300)
    idle = decode_cost(H200, call, ReplicaLoad(decode_batch=0, decode_context_tokens=0))
    busy = decode_cost(H200, call, ReplicaLoad(decode_batch=3, decode_context_tokens=3 * CTX))
    assert busy > 1.5 * idle


def warm(key, tokens, idle, p=1.0, pinned=False):
    return WarmSession(key, tokens, idle, p, pinned)


@pytest.mark.parametrize(
    ("free", "warm_list", "evicted", "harm"),
    [
        (None, [], {}, None),
        (10_000, [warm("a", CTX, 5)], {}, 0.0),
        # short by ~NB blocks: the idlest session loses its tail first; p_return scales the harm
        (0, [warm("old", CTX, 100, p=0.5), warm("new", CTX, 1)], {"old": NB + 1}, "half"),
        # pinned sessions (a parent waiting on children) are never evicted
        (
            0,
            [warm("parent", CTX, 100, pinned=True), warm("other", CTX, 1, p=0.0)],
            {"other": NB + 1},
            0.0,
        ),
    ],
)
def test_eviction_harm(free, warm_list, evicted, harm):
    call = CallShape(CTX, expected_output_tokens=0)
    got, ev = eviction_harm(H200, call, ReplicaLoad(free_gpu_blocks=free, warm=warm_list))
    if harm is None:
        assert got is None
        return
    need = max(blocks_needed(H200, call) - free, 0)
    assert sum(ev.values()) == min(
        need, sum(math.ceil(w.tokens / BS) for w in warm_list if not w.pinned)
    )
    if harm == "half":
        full = request_prefill_time(H200, CTX, 0)
        assert got == pytest.approx(0.5 * full, rel=0.01)
        assert set(ev) == {"old"}
    else:
        assert got == harm and ev == evicted


def test_eviction_harm_uses_reload_when_a_host_tier_exists():
    call = CallShape(CTX, expected_output_tokens=0)
    load = ReplicaLoad(free_gpu_blocks=0, warm=[warm("s", CTX, 10)])
    with_host, _ = eviction_harm(OFF, call, load)
    without, _ = eviction_harm(H200, call, load)
    assert with_host < without / 20  # reloading from DRAM is far cheaper than recomputing


def test_host_survival_follows_the_residence_time_and_the_gap():
    assert host_survival(50.0, 10.0, None) == 1.0  # tier not full: nothing leaves it
    assert host_survival(50.0, 10.0, 40.0) == 0.0  # turned over since the session's last call
    assert host_survival(30.0, None, 40.0) == 1.0  # unknown gap: read as an early return
    p = host_survival(30.0, 10.0, 40.0)  # 10 s left, mean gap 10 s: 1 - 1/e
    assert p == pytest.approx(1 - math.exp(-1.0))
    assert host_survival(30.0, 10.0, 400.0) > p > host_survival(30.0, 100.0, 40.0)


def test_eviction_harm_prices_a_host_copy_the_tier_will_have_turned_over_as_recompute():
    call = CallShape(CTX, expected_output_tokens=0)
    s = WarmSession("s", CTX, 10.0, 1.0, mean_gap_s=30.0)
    roomy, _ = eviction_harm(OFF, call, ReplicaLoad(free_gpu_blocks=0, warm=[s]))
    gone, _ = eviction_harm(
        OFF, call, ReplicaLoad(free_gpu_blocks=0, warm=[s], host_residence_s=5.0)
    )
    some, _ = eviction_harm(
        OFF, call, ReplicaLoad(free_gpu_blocks=0, warm=[s], host_residence_s=40.0)
    )
    recompute, _ = eviction_harm(H200, call, ReplicaLoad(free_gpu_blocks=0, warm=[s]))
    assert roomy < some < gone < recompute
    # what the host tier lost is reloaded from NVMe (every stored chunk is written on to it)
    nvme = min(load_time(OFF, math.ceil(CTX / BS), "storage"), recompute)
    assert gone == pytest.approx(nvme)
    no_nvme = OFF.replace(storage_kv_blocks=0)
    assert eviction_harm(
        no_nvme, call, ReplicaLoad(free_gpu_blocks=0, warm=[s], host_residence_s=5.0)
    )[0] == pytest.approx(recompute)  # same model: recompute is recompute
    p = host_survival(10.0, 30.0, 40.0)
    assert some == pytest.approx(p * roomy + (1 - p) * gone)


def test_a_retention_hold_keeps_the_host_copy_past_the_tiers_turnover():
    # the tier turns over in 40 s; a hold of 90 s from the session's last call keeps its
    # chunks out of the eviction, so the horizon is the hold
    assert host_survival(50.0, 10.0, 40.0, hold_s=90.0) == pytest.approx(1 - math.exp(-4.0))
    assert host_survival(50.0, 10.0, 40.0, hold_s=45.0) == 0.0  # the hold ran out too
    assert host_survival(30.0, 10.0, 40.0, hold_s=5.0) == host_survival(30.0, 10.0, 40.0)
    # in the harm: a held session costs a host reload, an unheld one what LRU leaves of it
    call = CallShape(CTX, expected_output_tokens=0)
    no_nvme = OFF.replace(storage_kv_blocks=0)
    unheld = WarmSession("s", CTX, 20.0, 1.0, mean_gap_s=30.0)
    held = dataclasses.replace(unheld, hold_s=300.0)

    def harm(s):
        load = ReplicaLoad(free_gpu_blocks=0, warm=[s], host_residence_s=10.0)
        return eviction_harm(no_nvme, call, load)[0]

    roomy = eviction_harm(no_nvme, call, ReplicaLoad(free_gpu_blocks=0, warm=[unheld]))[0]
    recompute = eviction_harm(H200, call, ReplicaLoad(free_gpu_blocks=0, warm=[unheld]))[0]
    assert harm(unheld) == pytest.approx(recompute)  # turned over: recomputed on return
    p = 1 - math.exp(-(300.0 - 20.0) / 30.0)
    assert harm(held) == pytest.approx(p * roomy + (1 - p) * recompute)
    assert harm(held) < recompute / 20


@pytest.mark.parametrize(
    ("duration", "res", "expect_frac"),
    [
        (10.0, [], 0.0),
        (10.0, [Reservation("a", 0.0, 2000, CTX)], 1.0),
        (10.0, [Reservation("a", 10.0, 2000, CTX)], 1 - math.exp(-1)),
        (10.0, [Reservation("a", 10.0, 2000, CTX, p_return=0.0)], 0.0),
    ],
)
def test_reserved_term(duration, res, expect_frac):
    got = reserved_cost(H200, duration, ReplicaLoad(reserved=res))
    base = request_prefill_time(H200, 2000, CTX)
    assert got == pytest.approx(expect_frac * base)


@pytest.mark.parametrize(
    ("idle", "gap", "final", "p"),
    [
        (5, 18, False, 1.0),
        (36, 18, False, math.exp(-1)),
        (1, 18, True, 0.0),
        (99, None, False, 1.0),
    ],
)
def test_p_return(idle, gap, final, p):
    assert p_return_after(idle, gap, final) == pytest.approx(p)


def test_placement_cost_names_every_term_and_prefers_dram_over_recompute():
    call = CallShape(CTX, expected_output_tokens=300)
    dram = placement_cost(
        OFF,
        CallShape(CTX, cpu_blocks=NB, expected_output_tokens=300),
        ReplicaLoad(
            queued_prefill_tokens=0,
            decode_batch=0,
            decode_context_tokens=0,
            free_gpu_blocks=OFF.gpu_kv_blocks,
        ),
    )
    cold = placement_cost(
        OFF,
        call,
        ReplicaLoad(
            queued_prefill_tokens=0,
            decode_batch=0,
            decode_context_tokens=0,
            free_gpu_blocks=OFF.gpu_kv_blocks,
        ),
    )
    assert dram.fetch_or_recompute_s < cold.fetch_or_recompute_s / 50
    assert dram.decode_s == cold.decode_s and dram.total_s < cold.total_s - 60
    d = dram.as_dict()
    assert set(d) >= {
        "queue_s",
        "fetch_or_recompute_s",
        "decode_s",
        "eviction_harm_s",
        "reserved_s",
        "congestion_s",
        "total_s",
        "missing",
    }
    assert d["missing"] == ["congestion_s"] and d["chose"] == {"cpu": "load"}
    # a saturated DRAM replica (a long prefill queue) loses to recomputing on an idle one
    busy = placement_cost(
        OFF,
        CallShape(CTX, cpu_blocks=NB, expected_output_tokens=300),
        ReplicaLoad(
            queued_prefill_tokens=600_000,
            decode_batch=0,
            decode_context_tokens=0,
            free_gpu_blocks=OFF.gpu_kv_blocks,
        ),
    )
    assert busy.total_s > cold.total_s


def test_missing_inputs_are_none_not_zero():
    t = placement_cost(H200, CallShape(1000), ReplicaLoad())
    assert t.missing == ["queue_s", "decode_s", "eviction_harm_s", "congestion_s", "interference_s"]
    assert t.total_s == pytest.approx(t.fetch_or_recompute_s)


def test_bad_call_shape():
    with pytest.raises(ValueError):
        CallShape(-1)
    with pytest.raises(ValueError):
        segment_costs(H200, CallShape(10), overlap=2.0)


def test_calibration_fits_scale_and_offset_despite_outliers():
    rng = np.random.default_rng(0)
    x = rng.uniform(0.05, 2.0, 60)
    y = 0.02 + 1.7 * x + rng.normal(0, 0.005, 60)
    y[::10] *= 8  # outliers
    s, off = fit_ttft(x, y)
    assert s == pytest.approx(1.7, rel=0.05) and off == pytest.approx(0.02, abs=0.01)
    assert fit_scale(x, 3 * x) == pytest.approx(3.0, rel=1e-3)


def test_calibrator_window_and_min_samples():
    c = Calibrator(window=16, min_samples=4)
    assert c.current().prefill_scale == 1.0
    for m in (0.1, 0.2, 0.3):
        c.observe_ttft(m, 2 * m)
    assert c.current().prefill_scale == 1.0  # not enough samples yet
    c.observe_ttft(0.4, 0.8)
    assert c.current().prefill_scale == pytest.approx(2.0, rel=0.02)
    for _ in range(16):  # the window slides: old behaviour forgotten
        c.observe_ttft(0.5, 0.5)
        c.observe_itl(0.01, 0.03)
    cur = c.current()
    assert cur.prefill_scale == pytest.approx(1.0, rel=0.02) and cur.ttft_samples == 16
    assert cur.decode_scale == pytest.approx(3.0, rel=0.01)
    c.observe_ttft(0.1, float("nan"))  # ignored
    assert c.current().ttft_samples == 16


@pytest.mark.parametrize(("pending", "factor"), [(None, None), (0, 0.0), (3, 3.0)])
def test_congestion_term_is_own_compute_times_waiting_calls(pending, factor):
    call = CallShape(CTX, cpu_blocks=NB // 2, expected_output_tokens=0)
    t = placement_cost(OFF, call, ReplicaLoad(pending_calls=pending))
    if factor is None:
        assert t.congestion_s is None
        return
    # the DRAM half is loaded, not computed: only the tail's prefill counts
    assert t.congestion_s == pytest.approx(factor * t.tail_prefill_s)


TP4 = load_profile("h200-70b-fp8-tp4")


@pytest.mark.parametrize("batch", [0, 1, 4, 8])
def test_interference_is_what_the_shared_steps_and_the_kv_reads_add(batch):
    # 5k uncached tokens after a 15k cached prefix: one chunk, run together with the
    # decoders (vLLM chunked prefill); each decoder loses the step's extra time, then reads
    # this call's KV for each of the 300 tokens it makes
    ctx = batch * 100_000
    cached = 15_000 // TP4.block_size * TP4.block_size
    call = CallShape(20_000, gpu_blocks=cached // TP4.block_size, expected_output_tokens=300)
    t = placement_cost(TP4, call, ReplicaLoad(decode_batch=batch, decode_context_tokens=ctx))
    decoders = [100_000] * batch
    shared = step_time(TP4, [(20_000 - cached, cached)], decoders) - step_time(TP4, [], decoders)
    grow = decode_step_time(TP4, batch + 1, ctx + 20_000) - decode_step_time(TP4, batch, ctx)
    assert t.interference_s == pytest.approx(batch * (shared + 300 * grow), rel=1e-9)
    if batch:
        # less than stalling the decoders for a whole prefill step of their own
        alone = request_prefill_time(TP4, 20_000 - cached, cached)
        assert batch * shared < batch * alone


def test_a_fully_cached_call_barely_interferes():
    # only the last token is computed: the decoders' shared step grows by that token's reads
    # of its 100k-token context (~1 ms on TP4), not by a step overhead and a weight read of
    # its own (~10 ms)
    call = CallShape(100_000, gpu_blocks=100_000 // TP4.block_size, expected_output_tokens=0)
    load = ReplicaLoad(decode_batch=16, decode_context_tokens=1_600_000)
    t = placement_cost(TP4, call, load)
    assert 0 < t.interference_s < 0.2 * 16 * request_prefill_time(TP4, 1, 99_999)


def test_interference_steers_a_cached_prefix_away_from_a_busy_replica():
    # a new session whose shared 15k prefix is cached on a replica decoding 3 requests,
    # against an idle replica that must recompute it: the cached replica is the faster
    # one for the call alone, but not once the decoders it would stall are counted
    call_hot = CallShape(20_000, gpu_blocks=15_000 // TP4.block_size, expected_output_tokens=300)
    call_cold = CallShape(20_000, expected_output_tokens=300)
    busy = ReplicaLoad(decode_batch=3, decode_context_tokens=300_000, pending_calls=0)
    idle = ReplicaLoad(decode_batch=0, decode_context_tokens=0, pending_calls=0)
    hot, cold = placement_cost(TP4, call_hot, busy), placement_cost(TP4, call_cold, idle)
    own = ("fetch_or_recompute_s", "decode_s")
    assert sum(getattr(hot, k) for k in own) < sum(getattr(cold, k) for k in own)
    assert hot.total_s > cold.total_s
    assert placement_cost(TP4, call_hot, busy, interference_weight=0.0).total_s < cold.total_s


@pytest.mark.parametrize(("real", "batch"), [(0.2, 0), (0.2, 6), (0.75, 15)])
def test_next_calls_pay_for_the_share_the_replica_fails_to_deliver(real, batch):
    # the context (prompt + output) stays where the call runs; each of the next calls gets the
    # realized share back and recomputes the rest, stalling the decoders there as it goes
    call = CallShape(100_000, expected_output_tokens=500, next_calls=3.0)
    load = ReplicaLoad(
        decode_batch=batch, decode_context_tokens=batch * 80_000, hit_realization=real,
        prefill_scale=1.3,
    )  # fmt: skip
    kept = int(real * 100_500)
    own = request_prefill_time(TP4, 100_500 - kept, kept)
    stall = prefill_stall_time(TP4, 100_500 - kept, kept, batch, batch * 80_000) if batch else 0
    expect = 3.0 * 1.3 * (own + batch * stall)
    assert next_calls_cost(TP4, call, load) == pytest.approx(expect, rel=1e-9)
    assert placement_cost(TP4, call, load).next_calls_s == pytest.approx(expect, rel=1e-9)


def test_next_calls_cost_nothing_where_matches_hold_or_no_call_follows():
    busy = ReplicaLoad(decode_batch=8, decode_context_tokens=800_000)
    call = CallShape(100_000, expected_output_tokens=500, next_calls=3.0)
    assert next_calls_cost(TP4, call, busy) == 0.0  # realization 1: every match delivered
    last = CallShape(100_000, expected_output_tokens=500)  # no call expected to follow
    assert next_calls_cost(TP4, last, dataclasses.replace(busy, hit_realization=0.1)) == 0.0
    with pytest.raises(ValueError):
        CallShape(100, next_calls=-1.0)


def test_next_calls_move_a_long_session_off_a_replica_that_breaks_its_matches():
    # the thrash of docs/benchmarks-log.md (weka-dev-squeezed-host, 48 lanes): a 120k-token session
    # on a replica that delivers 20% of its matches and runs 5 decoders, against a warm one
    # running 15. This call recomputes on either; moving stalls 15 decoders once, staying
    # recomputes 80% again on every later call. The call alone stays; its next calls move it
    matched = 120_000 // TP4.block_size // 5
    call = CallShape(120_000, gpu_blocks=matched, expected_output_tokens=400)
    moved = CallShape(120_000, expected_output_tokens=400)
    thrash = ReplicaLoad(decode_batch=5, decode_context_tokens=500_000, hit_realization=0.2)
    warm = ReplicaLoad(decode_batch=15, decode_context_tokens=1_500_000, hit_realization=0.98)
    assert placement_cost(TP4, call, thrash).total_s < placement_cost(TP4, moved, warm).total_s
    stay, move = (dataclasses.replace(c, next_calls=3.0) for c in (call, moved))
    assert placement_cost(TP4, stay, thrash).total_s > placement_cost(TP4, move, warm).total_s


def test_calibration_offset_is_bounded_and_samples_expire():
    # TTFTs dominated by queueing the model did not see: the offset may not absorb it
    # (a replica must never look unusable for good) ...
    c = Calibrator(window=16, min_samples=4, max_age_s=60.0)
    for i, m in enumerate((0.1, 0.2, 0.3, 0.4, 0.5)):
        c.observe_ttft(m, 100.0 + m, at=float(i))
    cal = c.current(now=5.0)
    assert cal.ttft_offset_s <= 1.0 and cal.prefill_scale <= 5.0 and cal.ttft_samples == 5
    # ... and without new traffic the fit ages out back to the uncalibrated model
    back = c.current(now=100.0)
    assert (back.prefill_scale, back.ttft_offset_s, back.ttft_samples) == (1.0, 0.0, 0)
    with pytest.raises(ValueError):
        Calibrator(max_age_s=0)


@pytest.mark.parametrize(("window", "compute", "gap"), [(12.0, 12.0, 10.0), (8.0, 2.0, 5.0),
                                                         (0.5, 0.1, 10.0)])  # fmt: skip
def test_reserved_term_counts_the_wait_this_prefill_causes_returning_agents(window, compute, gap):
    """The second half of the reserved term: an agent back after U ~ Exp(gap) waits for what
    is left of this call's prefill compute — E[min(C, T − U)+], checked by sampling."""
    import random

    res = [Reservation("a", gap, 1, CTX)]
    theirs = reserved_cost(H200, 0.0, ReplicaLoad(reserved=res))  # D = 0: only this call's harm
    got = reserved_cost(H200, 0.0, ReplicaLoad(reserved=res),
                        prefill_window_s=window, compute_s=compute) - theirs  # fmt: skip
    rng = random.Random(1)
    n = 200_000
    mc = sum(max(min(compute, window - rng.expovariate(1 / gap)), 0.0) for _ in range(n)) / n
    assert got == pytest.approx(mc, rel=0.02, abs=1e-3)


def test_a_cold_prefill_is_kept_off_a_replica_whose_agents_are_about_to_return():
    """Same call, same replica state, but one replica hosts four agents between calls: a cold
    100k-token prompt costs them seconds of TTFT there, a warm call (a short tail) almost
    nothing."""
    agents = [Reservation(f"a{i}", 5.0, 2000, CTX) for i in range(4)]
    cold = CallShape(100_000, expected_output_tokens=300)
    warm = CallShape(100_000, gpu_blocks=100_000 // H200.block_size - 4, expected_output_tokens=300)
    base = ReplicaLoad(0.0, 0, 0.0, H200.gpu_kv_blocks, 0.0)
    parked = ReplicaLoad(0.0, 0, 0.0, H200.gpu_kv_blocks, 0.0, reserved=agents)

    def extra(call):
        return placement_cost(H200, call, parked).total_s - placement_cost(H200, call, base).total_s

    cold_extra, warm_extra = extra(cold), extra(warm)
    prefill = placement_cost(H200, cold, base).fetch_or_recompute_s
    assert cold_extra > 0.5 * prefill  # four agents likely back before a long prefill is done
    assert warm_extra < 0.2 * cold_extra
