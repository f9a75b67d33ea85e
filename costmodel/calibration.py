"""Online calibration of the time models per replica, from observed TTFT and inter-token latency.

Owns: a sliding window of (modelled, observed) pairs per replica and a robust fit of

    observed TTFT ≈ offset + prefill_scale · modelled prefill-and-queue seconds
    observed ITL  ≈ decode_scale · modelled decode step seconds

by least squares with a soft-L1 loss (``scipy.optimize.least_squares``), so a few outliers (a
GC pause, a preempted request) do not drag the fit. Until ``min_samples`` pairs are in the
window the model is used as is (scales 1, offset 0). Fitted values are clamped to sane ranges
(a scale in [0.2, 5], an offset in [0, ``MAX_OFFSET_S``]) so one bad window can make a
replica look neither free nor unusable: the model is derived from first principles, and a
bigger disagreement than 5× is queueing it did not see, not a slower GPU.

Two guards against a feedback trap (found in the simulator: a replica whose first calls
queued behind a burst of cold 100k-token prefills fitted an offset of ~100 s, was never chosen
again, and so was never re-measured): the offset and the scale are bounded — the offset
stands for fixed per-call overhead (API server, network), not for queueing the model missed —
and samples expire after ``max_age_s``, so a replica that gets no traffic returns to the
uncalibrated model.
Pure: numpy/scipy, no I/O; must not import the router.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

SCALE_MIN, SCALE_MAX = 0.2, 5.0
MAX_OFFSET_S = 1.0


@dataclass(frozen=True, slots=True)
class Calibration:
    prefill_scale: float = 1.0
    ttft_offset_s: float = 0.0
    decode_scale: float = 1.0
    ttft_samples: int = 0
    itl_samples: int = 0


def fit_ttft(
    modelled: np.ndarray, observed: np.ndarray, f_scale: float = 0.05
) -> tuple[float, float]:
    """Robust fit of ``observed ≈ offset + scale · modelled``; returns ``(scale, offset)``."""
    x = np.asarray(modelled, dtype=float)
    y = np.asarray(observed, dtype=float)
    if len(x) < 2 or np.ptp(x) <= 1e-12:  # one point or no spread: scale only, no offset
        s = float(np.median(y / np.maximum(x, 1e-9)))
        return float(np.clip(s, SCALE_MIN, SCALE_MAX)), 0.0
    a0 = np.polyfit(x, y, 1)
    res = least_squares(
        lambda p: p[1] + p[0] * x - y,
        x0=[
            float(np.clip(a0[0], SCALE_MIN, SCALE_MAX)),
            float(np.clip(a0[1], 0.0, MAX_OFFSET_S)),
        ],
        loss="soft_l1",
        f_scale=f_scale,
        bounds=([SCALE_MIN, 0.0], [SCALE_MAX, MAX_OFFSET_S]),
    )
    return float(res.x[0]), float(res.x[1])


def fit_scale(modelled: np.ndarray, observed: np.ndarray, f_scale: float = 0.01) -> float:
    """Robust fit of ``observed ≈ scale · modelled`` (no offset)."""
    x = np.asarray(modelled, dtype=float)
    y = np.asarray(observed, dtype=float)
    s0 = float(np.clip(np.median(y / np.maximum(x, 1e-9)), SCALE_MIN, SCALE_MAX))
    res = least_squares(
        lambda p: p[0] * x - y,
        x0=[s0],
        loss="soft_l1",
        f_scale=f_scale,
        bounds=([SCALE_MIN], [SCALE_MAX]),
    )
    return float(res.x[0])


class Calibrator:
    """Sliding windows of observations for one replica; :meth:`current` refits lazily.

    Observations carry the time they were made (``at``, any monotonic clock; 0 when the caller
    has none) and leave the window after ``max_age_s`` (``None``: only the count bounds it).
    """

    def __init__(self, window: int = 64, min_samples: int = 8, max_age_s: float | None = 300.0):
        if window < 2 or min_samples < 2 or min_samples > window:
            raise ValueError("need 2 <= min_samples <= window")
        if max_age_s is not None and max_age_s <= 0:
            raise ValueError("max_age_s must be > 0 (or None)")
        self.min_samples = min_samples
        self.max_age_s = max_age_s
        self._ttft: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._itl: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._cached: Calibration | None = Calibration()

    def observe_ttft(self, modelled_s: float, observed_s: float, at: float = 0.0) -> None:
        if modelled_s > 0 and observed_s > 0 and np.isfinite(observed_s):
            self._ttft.append((modelled_s, observed_s, at))
            self._cached = None

    def observe_itl(self, modelled_s: float, observed_s: float, at: float = 0.0) -> None:
        if modelled_s > 0 and observed_s > 0 and np.isfinite(observed_s):
            self._itl.append((modelled_s, observed_s, at))
            self._cached = None

    def _expire(self, now: float | None) -> None:
        if now is None or self.max_age_s is None:
            return
        for q in (self._ttft, self._itl):
            while q and now - q[0][2] > self.max_age_s:
                q.popleft()
                self._cached = None

    def current(self, now: float | None = None) -> Calibration:
        """The fit over the samples still in the window at ``now`` (``None``: no expiry)."""
        self._expire(now)
        if self._cached is not None:
            return self._cached
        ps, off, ds = 1.0, 0.0, 1.0
        if len(self._ttft) >= self.min_samples:
            m, o, _ = np.array(self._ttft).T
            ps, off = fit_ttft(m, o)
        if len(self._itl) >= self.min_samples:
            m, o, _ = np.array(self._itl).T
            ds = fit_scale(m, o)
        self._cached = Calibration(ps, off, ds, len(self._ttft), len(self._itl))
        return self._cached
