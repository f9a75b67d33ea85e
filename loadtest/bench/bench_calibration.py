"""Calibration refit cost: the router refits a replica's calibration on its event loop after
every observed call (``costmodel.calibration.Calibrator.current``).

Rows: the median time of one refit of both full 64-sample windows (TTFT: scale and offset;
ITL: scale), each refit after one new observation pair, against the same fits by
``scipy.optimize.least_squares(loss="soft_l1")`` (what the calibrator used before, same start
and bounds) on the same windows, measured in the same run; and the largest relative gap
between the two solvers' objective values over those windows.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from scipy.optimize import least_squares

from costmodel.calibration import MAX_OFFSET_S, SCALE_MAX, SCALE_MIN, Calibrator

WINDOW = 64


def _scipy_fits(m: np.ndarray, o: np.ndarray, mi: np.ndarray, oi: np.ndarray) -> tuple:
    a = np.polyfit(m, o, 1)
    ttft = least_squares(
        lambda p: p[1] + p[0] * m - o,
        x0=[float(np.clip(a[0], SCALE_MIN, SCALE_MAX)), float(np.clip(a[1], 0.0, MAX_OFFSET_S))],
        loss="soft_l1",
        f_scale=0.05,
        bounds=([SCALE_MIN, 0.0], [SCALE_MAX, MAX_OFFSET_S]),
    ).x
    s0 = float(np.clip(np.median(oi / mi), SCALE_MIN, SCALE_MAX))
    itl = least_squares(
        lambda p: p[0] * mi - oi,
        x0=[s0],
        loss="soft_l1",
        f_scale=0.01,
        bounds=([SCALE_MIN], [SCALE_MAX]),
    ).x
    return float(ttft[0]), float(ttft[1]), float(itl[0])


def _objective(r: np.ndarray, f: float) -> float:
    return float(np.sum(2.0 * f * f * (np.sqrt(1.0 + (r / f) ** 2) - 1.0)))


def run(quick: bool = False) -> list[dict]:
    rng = np.random.default_rng(0)
    reps = 200 if quick else 2000
    n = WINDOW + reps
    m = rng.uniform(0.05, 3.0, n)  # modelled TTFT, s: 5% of calls stalled 2-8x (GC, preemption)
    o = 0.03 + 1.3 * m + rng.normal(0.0, 0.02, n)
    o[rng.random(n) < 0.05] *= rng.uniform(2.0, 8.0)
    o = np.abs(o) + 1e-3
    mi = rng.uniform(0.01, 0.04, n)  # modelled decode step, s
    oi = np.abs(1.1 * mi + rng.normal(0.0, 0.001, n)) + 1e-4
    c = Calibrator(window=WINDOW, min_samples=8, max_age_s=None)
    for i in range(WINDOW):
        c.observe_ttft(m[i], o[i])
        c.observe_itl(mi[i], oi[i])
    ours, theirs, gap = [], [], 0.0
    for i in range(WINDOW, n):
        c.observe_ttft(m[i], o[i])
        c.observe_itl(mi[i], oi[i])
        t0 = time.perf_counter()
        cal = c.current()
        ours.append(time.perf_counter() - t0)
        w = slice(i + 1 - WINDOW, i + 1)
        t0 = time.perf_counter()
        s, off, ds = _scipy_fits(m[w], o[w], mi[w], oi[w])
        theirs.append(time.perf_counter() - t0)
        for mine, ref, f in (
            ((cal.ttft_offset_s, cal.prefill_scale), (off, s), 0.05),
            ((0.0, cal.decode_scale), (0.0, ds), 0.01),
        ):
            x, y = (m[w], o[w]) if f == 0.05 else (mi[w], oi[w])
            a, b = _objective(mine[0] + mine[1] * x - y, f), _objective(ref[0] + ref[1] * x - y, f)
            gap = max(gap, (a - b) / b)
    med, ref_med = statistics.median(ours), statistics.median(theirs)
    return [
        {
            "name": f"calibrator_refit_{WINDOW}",
            "median_ms": round(med * 1e3, 3),
            "p90_ms": round(float(np.percentile(ours, 90)) * 1e3, 3),
            "speedup_vs_scipy": round(ref_med / med, 1),
            "max_rel_objective_vs_scipy": float(f"{gap:.2g}"),
        },
        {
            "name": f"scipy_least_squares_refit_{WINDOW}",
            "median_ms": round(ref_med * 1e3, 3),
            "p90_ms": round(float(np.percentile(theirs, 90)) * 1e3, 3),
        },
    ]
