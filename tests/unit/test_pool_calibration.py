"""The cluster pool's link, calibrated per replica from observed TTFT (issue 43, Build 2).

The calibrator (:meth:`costmodel.calibration.Calibrator.observe_pool_fetch`) on synthetic
(modelled, observed) samples: it recovers a known link through noise and outliers, stays at
the profile with too few samples or with only loads the model hides behind compute, keeps
within its bounds, lets its samples expire, and keeps a slow pool out of the prefill scale.
Then the router: ``kv_cost`` decisions observed against the twins' truth pool link
(:class:`loadtest.twin.truth.TruthTiming`, ``_pool``), 5x slower than the router's profile says,
move the replica's calibrated link there and flip a fetch to the session's replica.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from scipy.optimize import least_squares

from costmodel.calibration import (
    POOL_SCALE_MAX,
    POOL_SCALE_MIN,
    Calibrator,
    fit_pool_scale,
    pool_link,
)
from costmodel.placement import CallShape, ReplicaLoad, placement_cost, segment_costs
from costmodel.steptime import load_time
from loadtest.twin.truth import POOL, TRUTHS, TruthTiming
from router.kv.sessions import ReplicaStat
from router.metrics import RouterMetrics
from router.scheduling.kv_cost import KVCost
from tests.unit.test_cost_policy import KEYS, PROF, ctx_for, ep, outcome, pick, snap, state
from tests.unit.test_router_metrics import value

BW, LAT = 10e9, 500e-6  # the profile's link
BLOCK_BYTES = 4e6  # bytes of one block on the link


def modelled_load(blocks: np.ndarray) -> np.ndarray:
    return LAT + blocks * BLOCK_BYTES / BW


def samples(
    n: int,
    truth_bw: float,
    truth_lat: float = LAT,
    *,
    seed: int = 0,
    prefill_scale: float = 1.0,
    offset: float = 0.0,
    overlap: float = 0.0,
    compute: tuple[float, float] = (0.01, 0.2),
    noise: float = 0.02,
    outliers: int = 0,
):
    """``n`` pool-loading calls: (pool, queue, compute, other, overlap, observed) columns, the
    observed TTFT made from the truth's link (its load exposed: the replica loads, then
    computes, as vLLM's connector and the twin do) with the replica's prefill scale and
    offset, Gaussian noise and ``outliers`` calls 3 s late (a GC pause, a preemption)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(200, 4000, n).astype(float)
    pool = modelled_load(blocks)
    queue = rng.uniform(0.0, 1.0, n)
    comp = rng.uniform(*compute, n)
    other = np.zeros(n)
    ov = np.full(n, overlap)
    true_load = truth_lat + blocks * BLOCK_BYTES / truth_bw
    observed = offset + prefill_scale * (queue + comp) + true_load
    observed = observed + rng.normal(0.0, noise, n)
    observed[rng.choice(n, outliers, replace=False)] += 3.0
    return pool, queue, comp, other, ov, np.maximum(observed, 1e-3)


def feed(cal: Calibrator, cols, at: float = 0.0) -> None:
    for row in zip(*cols, strict=True):
        cal.observe_pool_fetch(*map(float, row), at=at)


@pytest.mark.parametrize(("truth_bw", "truth_lat"), [(2e9, LAT), (40e9, LAT), (2.5e9, 4 * LAT)])
def test_the_calibrator_recovers_a_known_pool_link_through_noise_and_outliers(truth_bw, truth_lat):
    cal = Calibrator()
    feed(cal, samples(48, truth_bw, truth_lat, outliers=5))
    c = cal.current()
    assert c.pool_samples == 48 and c.ttft_samples == 0  # exposed: not in the TTFT window
    lat, bw = pool_link(LAT, BW, c)
    # one scale: the bandwidth is what sets seconds per prefix (the latency is 0.5-2 ms of it)
    assert bw == pytest.approx(truth_bw, rel=0.05)
    assert lat == pytest.approx(LAT * BW / truth_bw, rel=0.05)
    assert c.pool_scale == pytest.approx(BW / truth_bw, rel=0.05)


def test_the_residual_is_taken_after_the_calibrated_prefill_scale_and_offset():
    """A replica 1.5x slower than its profile at compute, with a 0.2 s offset, and a pool 4x
    slower: the non-pool calls fit the prefill part, the pool calls the link — and the slow
    pool does not leak into the prefill scale (its samples stay out of the TTFT window)."""
    rng = np.random.default_rng(3)
    cal = Calibrator()
    for x in rng.uniform(0.5, 8.0, 40):
        cal.observe_ttft(float(x), 0.2 + 1.5 * float(x) + float(rng.normal(0, 0.01)))
    feed(cal, samples(40, BW / 4, prefill_scale=1.5, offset=0.2, compute=(0.5, 3.0), seed=4))
    c = cal.current()
    assert c.prefill_scale == pytest.approx(1.5, rel=0.03)
    assert c.ttft_offset_s == pytest.approx(0.2, abs=0.03)
    assert c.pool_scale == pytest.approx(4.0, rel=0.05)
    # fitted without the prefill part (scale 1, offset 0) the pool would look slower still
    cols = samples(40, BW / 4, prefill_scale=1.5, offset=0.2, compute=(0.5, 3.0), seed=4)
    assert fit_pool_scale(*cols)[0] > 4.4


def test_the_pool_fit_is_scipys_bounded_soft_l1_minimiser_on_the_residuals():
    pool, queue, comp, other, ov, obs = cols = samples(32, 3e9, outliers=4, seed=7)
    got, n = fit_pool_scale(*cols, prefill_scale=1.2, offset_s=0.1)
    y = obs - 0.1 - 1.2 * (queue + comp) - other + ov * 1.2 * comp
    f = 0.1 * float(np.partition(pool, 16)[16])
    want = least_squares(
        lambda p: p[0] * pool - y, x0=[1.0], loss="soft_l1", f_scale=f,
        bounds=([POOL_SCALE_MIN], [POOL_SCALE_MAX]), ftol=1e-15, xtol=1e-15, gtol=1e-15,
    ).x[0]  # fmt: skip
    assert n == 32 and got == pytest.approx(want, rel=1e-6)


def test_too_few_samples_leave_the_profiles_link():
    cal = Calibrator(min_samples=8)
    feed(cal, samples(7, BW / 5))
    c = cal.current()
    assert (c.pool_scale, c.pool_samples) == (1.0, 7)
    assert pool_link(LAT, BW, c) == (LAT, BW)
    feed(cal, samples(1, BW / 5, seed=1))
    assert cal.current().pool_scale == pytest.approx(5.0, rel=0.05)


def test_loads_hidden_behind_compute_say_nothing_about_the_link():
    """Priced with overlap 1 and a long recompute after the pool's segment, a load is hidden
    (compute + max(0, load − compute) = compute) at every scale in the box: such calls are
    ordinary TTFT samples, and the link stays the profile's however slow they came back."""
    cal = Calibrator()
    cols = samples(30, BW / 5, overlap=1.0, compute=(30.0, 60.0))
    feed(cal, cols)
    c = cal.current()
    assert (c.pool_scale, c.pool_samples) == (1.0, 0)
    assert c.ttft_samples == 30  # they calibrate the prefill part instead
    # the same calls with the load exposed (no overlap) do calibrate it
    cal = Calibrator()
    feed(cal, samples(30, BW / 5, overlap=0.0, compute=(30.0, 60.0)))
    assert cal.current().pool_scale == pytest.approx(5.0, rel=0.05)


def test_a_sample_the_fitted_prefill_scale_hides_is_left_out_of_the_pool_fit():
    """Exposed when it arrived (uncalibrated), hidden once the replica's prefill scale is
    fitted at 5: out of the pool fit (and it never was in the TTFT window)."""
    cal = Calibrator()
    # a 1 s pool load, 0.2 s at the box's low end, after 0.15 s of compute: exposed at s = 1,
    # hidden at s = 5 (0.75 s of compute)
    pool = np.full(10, 1.0)
    feed(cal, (pool, np.zeros(10), np.full(10, 0.15), np.zeros(10), np.ones(10), pool * 3))
    assert cal.current().pool_samples == 10
    for x in np.linspace(1.0, 5.0, 10):  # compute 5x slower than modelled
        cal.observe_ttft(float(x), 5.0 * float(x))
    c = cal.current()
    assert c.prefill_scale == pytest.approx(5.0)
    assert (c.pool_scale, c.pool_samples) == (1.0, 0)


@pytest.mark.parametrize(
    ("truth_bw", "bound"), [(BW / 50, POOL_SCALE_MAX), (BW * 50, POOL_SCALE_MIN)]
)
def test_a_bad_window_can_make_the_pool_neither_free_nor_unusable(truth_bw, bound):
    cal = Calibrator()
    feed(cal, samples(20, truth_bw, noise=0.0))
    assert cal.current().pool_scale == pytest.approx(bound)
    # observed below the calibrated rest (the load "took negative time"): the low bound
    cal = Calibrator()
    pool, queue, comp, other, ov, _ = samples(20, BW)
    feed(cal, (pool, queue, comp, other, ov, 0.5 * (queue + comp) + 1e-3))
    assert cal.current().pool_scale == pytest.approx(POOL_SCALE_MIN)


def test_pool_samples_expire_like_the_others():
    cal = Calibrator(max_age_s=300.0)
    feed(cal, samples(10, BW / 5), at=0.0)
    assert cal.current(now=100.0).pool_scale == pytest.approx(5.0, rel=0.05)
    c = cal.current(now=301.0)
    assert (c.pool_scale, c.pool_samples) == (1.0, 0)


def test_bad_input_is_ignored():
    cal = Calibrator()
    for bad in (
        (0.0, 0.0, 0.1, 0.0, 0.0, 1.0),  # no pool load
        (1.0, 0.0, 0.1, 0.0, 0.0, float("nan")),
        (1.0, -1.0, 0.1, 0.0, 0.0, 2.0),
        (1.0, 0.0, 0.1, 0.0, 0.0, 0.0),
    ):
        cal.observe_pool_fetch(*bad)
    c = cal.current()
    assert (c.pool_samples, c.ttft_samples) == (0, 0)


def test_the_priced_pool_load_follows_the_calibrated_link():
    """``ReplicaLoad.pool_scale`` multiplies the pool's load and nothing else: at 1 the
    segments are as before; slow enough, the pool segment is recomputed instead."""
    call = CallShape(PROF.block_size * 300, gpu_blocks=0, cpu_blocks=100, pool_blocks=200)
    base = segment_costs(PROF, call, overlap=0.0)
    same = segment_costs(PROF, call, overlap=0.0, pool_scale=1.0)
    assert same == base and base.chose == {"cpu": "load", "pool": "load"}
    slow = segment_costs(PROF, call, overlap=0.0, pool_scale=4.0)
    assert slow.load_s["pool"] == pytest.approx(4.0 * base.load_s["pool"])
    assert slow.load_s["cpu"] == base.load_s["cpu"]
    rec = base.recompute_s["pool"]
    flip = rec / base.load_s["pool"] * 1.01  # just slower than recomputing those blocks
    assert segment_costs(PROF, call, overlap=0.0, pool_scale=flip).chose["pool"] == "recompute"
    t1 = placement_cost(PROF, call, ReplicaLoad(pool_scale=1.0), overlap=0.0)
    t4 = placement_cost(PROF, call, ReplicaLoad(pool_scale=4.0), overlap=0.0)
    assert t4.fetch_or_recompute_s == pytest.approx(
        t1.fetch_or_recompute_s + 3.0 * base.load_s["pool"]
    )


# ---- the router: kv_cost decisions, observed against the twins' truth -------------------------

# the twins' profile: the router's, with a pool link 5x slower (what the twins run, under the
# nominal truth: staged through the host, at min(pool_bw, host link))
TWIN_PROF = PROF.replace(
    hardware=dataclasses.replace(PROF.hardware, pool_bw=PROF.hardware.pool_bw / 5)
)
TRUTH = TruthTiming(TWIN_PROF, TRUTHS["nominal"])


def _busy_session_replica(st) -> list:
    """The session's replica A holds the prefix on GPU (and wrote it to the pool) behind a
    queued call; B reads the pool."""
    st.index.store("A", KEYS)
    st.index.pool_store("A", KEYS)
    st.index.add_pool_member("B")
    st.stats["A"] = ReplicaStat(uncached_ewma=20_000, context_ewma=120_000, calls=10)
    st.stats["B"] = ReplicaStat(uncached_ewma=2_000, context_ewma=100_000, calls=10)
    return [ep("A", inflight=1, running=0, waiting=1), ep("B")]


def test_the_router_calibrates_the_pool_link_toward_the_truth_and_stops_fetching_over_it():
    """With the profile's link, B fetching the prefix from the pool beats queueing behind A's
    call. B then serves calls that load from the pool (A draining: B the only candidate),
    whose TTFTs come from the twins' truth link, 5x slower; the router's calibrated link for
    B moves there, and the same call goes back to the session's replica."""
    st = state()
    eps = _busy_session_replica(st)
    winner, s = pick(st, eps, ctx_for(), sticky="A")
    assert winner == "B" and s.terms["B"]["chose"] == {"pool": "load"}
    assert "model_pool_fetch" in s.terms["B"] and "model_pool_fetch" not in s.terms["A"]

    rng = random.Random(5)
    truth_ratio = TRUTH.load(len(KEYS), POOL) / load_time(PROF, len(KEYS), "pool")
    assert truth_ratio == pytest.approx(5.0, rel=0.02)  # the twins' link: 5x slower
    only_b = [ep("B")]
    for i in range(12):
        keys = KEYS[: rng.randrange(500, len(KEYS))]
        c = ctx_for(session=f"d{i}", keys=keys)
        c.request_id = f"d{i}"
        sc = KVCost().score(c, snap(st, only_b, session=f"d{i}"), only_b)
        st.analyze(c)
        parts = sc.terms["B"]["model_pool_fetch"]
        ttft = parts["queue_s"] + parts["compute_s"] + TRUTH.load(len(keys), POOL)
        ttft *= 1.0 + rng.uniform(-0.03, 0.03)
        st.observe(c, outcome(sc, replica="B", ttft_s=ttft if i != 3 else ttft + 5.0))
    cal = st.calibration("B")
    assert cal.pool_samples == 12 and cal.ttft_samples == 0
    assert cal.pool_scale == pytest.approx(truth_ratio, rel=0.1)
    assert st.calibration("A").pool_scale == 1.0  # measured per replica
    view_load = st.view().replica_load(ep("B"), None, 0)
    assert view_load.pool_scale == cal.pool_scale

    winner, s = pick(st, eps, ctx_for(), sticky="A")
    assert winner == "A", s.terms  # the session's replica, queue and all
    assert s.terms["B"]["load_s"]["pool"] == pytest.approx(
        cal.pool_scale * load_time(PROF, len(KEYS), "pool")
    )
    # the link it priced B with is on /metrics and in /admin/config's kv_pool
    m = RouterMetrics()
    m.watch_calibration(st)
    assert value(m, "kvroute_kv_calibration", replica="B", term="pool_scale") == pytest.approx(
        cal.pool_scale
    )
    bw = value(m, "kvroute_kv_calibration", replica="B", term="pool_bw")
    assert bw == pytest.approx(PROF.hardware.pool_bw / cal.pool_scale)
    assert value(m, "kvroute_kv_calibration_samples", replica="B", kind="pool") == 12.0
    # a replica that is no pool member and has no pool samples shows no pool terms
    st.calibrators.setdefault("C", Calibrator())
    assert value(m, "kvroute_kv_calibration", replica="C", term="pool_scale") is None


def test_without_a_pool_no_call_carries_pool_parts():
    st = state()
    st.index.store("A", KEYS, "CPU")
    _, s = pick(st, [ep("A"), ep("B")], ctx_for())
    assert all("model_pool_fetch" not in t for t in s.terms.values())
    assert st.view().replica_load(ep("A"), None, 0).pool_scale == 1.0
