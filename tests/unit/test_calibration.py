"""Calibration fits against scipy's ``least_squares(loss="soft_l1")``, the solver they replace.

The numpy fits must land on the same bounded minimiser: the objective within a tight relative
tolerance of scipy's run at tight tolerances, the parameters close. Cases are a table of
seeded problem shapes — clean, with outliers, in the loss's L1-like tails (noise far above
``f_scale``), and with the optimum on each bound and on corners.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import least_squares

import costmodel.calibration as calibration
from costmodel.calibration import (
    MAX_OFFSET_S,
    SCALE_MAX,
    SCALE_MIN,
    Calibrator,
    fit_scale,
    fit_ttft,
)

SEEDS = range(20)
OBJ_RTOL = 1e-9


def objective(r: np.ndarray, f: float) -> float:
    """``Σ f²·ρ((r/f)²)``, ρ(z) = 2(√(1+z) − 1): what both solvers minimise."""
    return float(np.sum(2.0 * f * f * (np.sqrt(1.0 + (r / f) ** 2) - 1.0)))


def scipy_ttft(x: np.ndarray, y: np.ndarray, f: float) -> np.ndarray:
    a = np.polyfit(x, y, 1)  # the start the scipy-based fit used
    x0 = [float(np.clip(a[0], SCALE_MIN, SCALE_MAX)), float(np.clip(a[1], 0.0, MAX_OFFSET_S))]
    return least_squares(
        lambda p: p[1] + p[0] * x - y,
        x0=x0,
        loss="soft_l1",
        f_scale=f,
        bounds=([SCALE_MIN, 0.0], [SCALE_MAX, MAX_OFFSET_S]),
        ftol=1e-15,
        xtol=1e-15,
        gtol=1e-15,
        max_nfev=10_000,
    ).x


def scipy_scale(x: np.ndarray, y: np.ndarray, f: float) -> float:
    s0 = float(np.clip(np.median(y / x), SCALE_MIN, SCALE_MAX))
    return float(
        least_squares(
            lambda p: p[0] * x - y,
            x0=[s0],
            loss="soft_l1",
            f_scale=f,
            bounds=([SCALE_MIN], [SCALE_MAX]),
            ftol=1e-15,
            xtol=1e-15,
            gtol=1e-15,
            max_nfev=10_000,
        ).x[0]
    )


# name: (scale, offset, noise sd, outlier share, largest modelled s, the bounds the optimum sits
# on — "s_lo", "s_hi", "o_lo", "o_hi", or "inside" the box; "" when the seeds differ)
TTFT_CASES = {
    "clean": (1.7, 0.02, 0.005, 0.0, 3.0, "inside"),
    "outliers": (1.7, 0.3, 0.01, 0.15, 3.0, "inside"),
    "l1_tails": (2.5, 0.4, 0.3, 0.1, 3.0, ""),
    "scale_at_max": (6.0, 0.2, 0.01, 0.1, 0.5, "s_hi"),
    "scale_at_min": (0.05, 0.5, 0.005, 0.1, 3.0, "s_lo"),
    "offset_at_0": (1.2, -0.4, 0.01, 0.1, 3.0, "o_lo"),
    "offset_at_max": (0.8, 3.0, 0.02, 0.1, 3.0, "o_hi"),
    "corner_hi_hi": (8.0, 4.0, 0.02, 0.0, 3.0, "s_hi o_hi"),
    "corner_lo_lo": (0.05, 0.0, 0.002, 0.0, 3.0, "s_lo o_lo"),
    "queueing_100s": (1.0, 100.0, 1.0, 0.0, 3.0, "s_hi o_hi"),
}


def ttft_problem(case: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    scale, offset, sd, share, x_max, _ = TTFT_CASES[case]
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 65))
    x = rng.uniform(0.05, x_max, n)
    y = offset + scale * x + rng.normal(0.0, sd, n)
    out = rng.random(n) < share
    y[out] *= rng.uniform(3.0, 10.0, int(out.sum()))  # a GC pause, a preempted request
    return x, np.abs(y) + 1e-4


def where(s: float, off: float) -> set[str]:
    """The bounds a fit sits on (empty: inside the box)."""
    at = {"s_lo": s <= SCALE_MIN + 1e-9, "s_hi": s >= SCALE_MAX - 1e-9}
    at |= {"o_lo": off <= 1e-9, "o_hi": off >= MAX_OFFSET_S - 1e-9}
    return {name for name, hit in at.items() if hit}


def on(expected: str, s: float, off: float) -> bool:
    return (
        where(s, off) == set() if expected == "inside" else set(expected.split()) <= where(s, off)
    )


@pytest.mark.parametrize("case", TTFT_CASES)
def test_fit_ttft_is_scipys_bounded_soft_l1_minimiser(case):
    f = 0.05
    for seed in SEEDS:
        x, y = ttft_problem(case, seed)
        s, off = fit_ttft(x, y)
        ref = scipy_ttft(x, y, f)
        assert SCALE_MIN <= s <= SCALE_MAX and 0.0 <= off <= MAX_OFFSET_S
        ours, theirs = objective(off + s * x - y, f), objective(ref[1] + ref[0] * x - y, f)
        assert ours == pytest.approx(theirs, rel=OBJ_RTOL, abs=1e-15), (case, seed)
        assert (s, off) == pytest.approx((ref[0], ref[1]), abs=2e-5), (case, seed)
        expected = TTFT_CASES[case][-1]
        assert where(s, off) == where(*ref), (case, seed)
        if expected:  # the case exercises what it is named for
            assert on(expected, s, off), (case, seed)


def test_the_bounded_ttft_fit_is_not_a_clip_of_the_unbounded_one():
    # a negative best offset: on the offset = 0 edge the scale must be refitted (steeper), not
    # kept from the unbounded fit
    rng = np.random.default_rng(3)
    x = rng.uniform(0.5, 2.0, 40)
    y = -0.4 + 1.2 * x + rng.normal(0.0, 0.01, 40)
    free = least_squares(lambda p: p[1] + p[0] * x - y, [1.0, 0.0], loss="soft_l1", f_scale=0.05)
    assert free.x[1] < -0.3
    s, off = fit_ttft(x, y)
    assert off == 0.0 and s == pytest.approx(scipy_ttft(x, y, 0.05)[0], abs=1e-6)
    clipped = objective(free.x[0] * x - y, 0.05)
    assert objective(s * x - y, 0.05) < 0.5 * clipped


# name: (scale, noise sd, outlier share, where the optimum sits: "inside", "s_lo", "s_hi")
SCALE_CASES = {
    "clean": (1.1, 0.0005, 0.0, "inside"),
    "outliers": (2.0, 0.001, 0.2, "inside"),
    "l1_tails": (1.5, 0.03, 0.1, "inside"),
    "at_max": (7.0, 0.001, 0.1, "s_hi"),
    "at_min": (0.1, 0.0005, 0.1, "s_lo"),
}


@pytest.mark.parametrize("case", SCALE_CASES)
def test_fit_scale_is_scipys_bounded_soft_l1_minimiser(case):
    scale, sd, share, expected = SCALE_CASES[case]
    f = 0.01
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        n = int(rng.integers(2, 65))
        x = rng.uniform(0.005, 0.05, n)  # decode steps, seconds
        y = scale * x + rng.normal(0.0, sd, n)
        out = rng.random(n) < share
        y[out] *= rng.uniform(2.0, 6.0, int(out.sum()))
        y = np.abs(y) + 1e-5
        s, ref = fit_scale(x, y), scipy_scale(x, y, f)
        ours, theirs = objective(s * x - y, f), objective(ref * x - y, f)
        assert ours == pytest.approx(theirs, rel=OBJ_RTOL, abs=1e-15), (case, seed)
        assert s == pytest.approx(ref, abs=2e-5), (case, seed)
        assert where(s, 0.5) == where(ref, 0.5) and on(expected, s, 0.5), (case, seed)


def test_fit_ttft_without_spread_is_a_median_ratio():
    assert fit_ttft(np.array([0.5]), np.array([1.0])) == (2.0, 0.0)
    assert fit_ttft(np.full(3, 0.5), np.array([1.0, 1.5, 9.0])) == (3.0, 0.0)
    assert fit_ttft(np.full(3, 0.5), np.array([10.0, 11.0, 12.0])) == (SCALE_MAX, 0.0)


def test_calibrator_refits_only_the_window_that_changed(monkeypatch):
    calls = {"ttft": 0, "itl": 0}

    def counting(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return wrapped

    monkeypatch.setattr(calibration, "fit_ttft", counting("ttft", fit_ttft))
    monkeypatch.setattr(calibration, "fit_scale", counting("itl", fit_scale))
    c = Calibrator(window=16, min_samples=4, max_age_s=60.0)
    for i in range(8):
        c.observe_ttft(0.1 * (i + 1), 0.2 * (i + 1), at=float(i))
        c.observe_itl(0.01, 0.02, at=float(i))
    first = c.current(now=8.0)
    assert calls == {"ttft": 1, "itl": 1}
    assert c.current(now=9.0) is first  # nothing entered or left
    c.observe_itl(0.01, 0.03, at=10.0)
    second = c.current(now=10.0)
    assert calls == {"ttft": 1, "itl": 2}
    assert (second.prefill_scale, second.ttft_offset_s) == (
        first.prefill_scale,
        first.ttft_offset_s,
    )
    c.observe_ttft(0.5, 1.5, at=20.0)
    c.current(now=20.0)
    assert calls == {"ttft": 2, "itl": 2}
    # the first TTFT and ITL samples (at 0) leave the window after 60 s: both refit
    c.current(now=60.5)
    assert calls == {"ttft": 3, "itl": 3}


def test_hit_realization_is_the_share_of_the_matched_prefix_the_engine_delivered():
    c = Calibrator(window=16, min_samples=4, max_age_s=60.0)
    for i in range(3):
        c.observe_hit(1000, 200, at=float(i))
    assert c.current(now=3.0).hit_realization == 1.0  # too few samples: as matched
    c.observe_hit(1000, 5000, at=3.0)  # more than matched counts as matched
    cal = c.current(now=3.0)
    assert cal.hit_samples == 4
    assert cal.hit_realization == pytest.approx((3 * 200 + 1000) / 4000)
    c.observe_hit(0, 0, at=4.0)  # nothing was expected: no sample
    c.observe_hit(1000, float("nan"), at=4.0)
    assert c.current(now=4.0).hit_samples == 4
    # the samples expire: a replica nobody sends to is trusted again
    assert c.current(now=100.0).hit_realization == 1.0
