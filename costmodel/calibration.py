"""Online calibration of the time models per replica, from observed TTFT and inter-token latency.

Owns: a sliding window of (modelled, observed) pairs per replica and a robust fit of

    observed TTFT ≈ offset + prefill_scale · modelled prefill-and-queue seconds
    observed ITL  ≈ decode_scale · modelled decode step seconds

and of how much of the prefix the router expected cached the replica delivered
(``hit_realization``: Σ min(cached, expected) / Σ expected over the window, in [0, 1]), and of
the cluster pool's link as this replica sees it (``pool_scale``, below).

by least squares with a soft-L1 loss, so a few outliers (a GC pause, a preempted request) do
not drag the fit. Until ``min_samples`` pairs are in the window the model is used as is (scales
1, offset 0). Fitted values are bounded (a scale in [0.2, 5], an offset in [0,
``MAX_OFFSET_S``]) so one bad window can make a replica look neither free nor unusable: the
model is derived from first principles, and a bigger disagreement than 5× is queueing it did
not see, not a slower GPU.

The fit is the minimiser of ``Σ f²·ρ((rᵢ/f)²)``, ρ(z) = 2(√(1+z) − 1), over the box — the
objective of ``scipy.optimize.least_squares(loss="soft_l1", f_scale=f, bounds=...)``, which
this module used before; it is solved here in numpy because the router refits on its event
loop after every observed call (a refit of both full windows: ~8 ms with scipy, ~0.2–0.4 ms
here; ``python -m loadtest.benchmarks --only calibration``). The loss is convex and smooth, so
Newton's method with a backtracking line search, from median starts, finds the unconstrained
minimiser; when that lies outside the box the bounded one is on an edge, found by a 1-D
projected Newton on each edge until one meets the KKT conditions — the bounded optimum, not a
clip (``tests/unit/test_calibration.py`` holds both fits to scipy's on seeded problems).

Two guards against a feedback trap (found in the simulator: a replica whose first calls
queued behind a burst of cold 100k-token prefills fitted an offset of ~100 s, was never chosen
again, and so was never re-measured): the offset and the scale are bounded — the offset
stands for fixed per-call overhead (API server, network), not for queueing the model missed —
and samples expire after ``max_age_s``, so a replica that gets no traffic returns to the
uncalibrated model.

**The pool link** (issue 43). A call whose placement loaded blocks from the cluster pool
(:meth:`Calibrator.observe_pool_fetch`) is priced as
``offset + s·(queue + compute) + max(0, other loads + pool_scale·pool load − overlap·s·compute)``
(:func:`costmodel.placement.placement_cost` with ``ReplicaLoad.pool_scale``): the pool's
modelled load (the profile's ``pool_latency_s`` + bytes / ``pool_bw``) times one fitted scale,
so the calibrated link is ``pool_latency_s·pool_scale`` and ``pool_bw / pool_scale``
(:func:`pool_link`). One scale, not a latency and a bandwidth: the latency is paid once per
call, like the TTFT offset this calibrator already fits (API server, network) — a
two-parameter fit on the residual would trade one for the other — and it is a fraction of a
millisecond against TTFT noise of milliseconds to seconds, so the data cannot separate it
from the offset; the bandwidth, which sets seconds per prefix, is what the scale recovers.
The fit: ``residual = observed − offset − s·(queue + compute) − other loads +
overlap·s·compute ≈ pool_scale · pool load``, with ``(s, offset)`` this replica's current TTFT
fit, by the same bounded soft-L1 solver (:func:`fit_scale`, ``f_scale`` a tenth of the median
modelled pool load: loads run from milliseconds to seconds across profiles), bounded to
[``POOL_SCALE_MIN``, ``POOL_SCALE_MAX``] — wider than the compute scales', since a profile's
pool link is a guess (a local shared volume or a network store), but never free nor unusable.

``overlap``: a load the model hides behind compute (``other + POOL_SCALE_MIN·pool <
overlap·s·compute``: hidden at some scale in the box) says nothing about the link — the max()
is flat in the scale there — so such a sample is not fitted: where it is hidden under the
uncalibrated model when it arrives it joins the TTFT window as any call does (its modelled
TTFT holds no pool time), and one that the current prefill scale hides later is left out of
both fits. Exposed pool samples stay out of the TTFT window: fitted there, a pool slower than
its profile would read as slower prefill on every call. Until ``min_samples`` exposed samples
are in the window (they expire like the others) the scale is 1: the profile's link as is.
Pure: numpy, no I/O; must not import the router.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import chain

import numpy as np

SCALE_MIN, SCALE_MAX = 0.2, 5.0
MAX_OFFSET_S = 1.0
POOL_SCALE_MIN, POOL_SCALE_MAX = 0.2, 10.0  # the pool link's fitted scale (see above)

_STEP_TOL = 1e-10  # a Newton step this small (relative to 1 + |parameter|) has converged
_DECREMENT_TOL = 1e-8  # a Newton step predicted to gain less (relative) is the last
_ROUNDING = 1e-14  # ... and one predicted to gain less than this is below the cost's rounding
_MAX_ITER = 100
_ARMIJO = 1e-4  # sufficient decrease, as a share of the step's first-order prediction
_MIN_DAMPING = 1e-10  # backtracking gives up below this share of the Newton step


@dataclass(frozen=True, slots=True)
class Calibration:
    prefill_scale: float = 1.0
    ttft_offset_s: float = 0.0
    decode_scale: float = 1.0
    ttft_samples: int = 0
    itl_samples: int = 0
    # the share of the matched prefix the engine reported cached (1: as matched, or too few
    # samples); see :meth:`Calibrator.observe_hit`
    hit_realization: float = 1.0
    hit_samples: int = 0
    # observed / modelled pool load time (1: the profile's link, or too few exposed samples);
    # see :meth:`Calibrator.observe_pool_fetch` and :func:`pool_link`
    pool_scale: float = 1.0
    # pool loads in the window exposed under the current prefill scale (what it is fitted on)
    pool_samples: int = 0


def pool_link(latency_s: float, bw: float, cal: Calibration) -> tuple[float, float]:
    """The calibrated pool link ``(latency_s, bytes/s)`` from the profile's figures: one
    fitted scale on the load time is a latency that many times longer and a bandwidth that
    many times lower."""
    return latency_s * cal.pool_scale, bw / cal.pool_scale


def _soft_l1(r: np.ndarray, f: float) -> tuple[float, np.ndarray, np.ndarray]:
    """``(Σ f²(√(1+u²) − 1), w, w³)`` at residuals ``r``, u = r/f, w = 1/√(1+u²).

    The sum is half the objective ``Σ f²·ρ(u²)`` (same minimiser); its derivative in a residual
    is ``w·r`` and its second derivative ``w³``. Written as ``u²/(√(1+u²) + 1)`` so residuals
    far below ``f`` do not cancel.
    """
    u2 = r * r
    u2 *= 1.0 / (f * f)
    q = u2 + 1.0
    sq = np.sqrt(q)
    w = 1.0 / sq
    sq += 1.0
    u2 /= sq
    return f * f * float(u2.sum()), w, w / q


def _line_search(
    r: np.ndarray, dr: np.ndarray, cost: float, slope: float, f: float
) -> tuple[float, np.ndarray, float, np.ndarray, np.ndarray]:
    """Backtrack from the full step ``r + dr`` (``slope``: the cost's derivative along it, < 0)
    until the cost falls by Armijo's rule, each shorter try at the minimum of the quadratic
    through what is known (kept within [0.1, 0.5] of the last); returns ``(t, r + t·dr, cost,
    w, w³)`` there (t = 0: no decrease found, the point is kept)."""
    t = 1.0
    while t >= _MIN_DAMPING:
        rn = r + t * dr if t != 1.0 else r + dr
        cn, w, w3 = _soft_l1(rn, f)
        if cn < cost and cn <= cost + _ARMIJO * t * slope:
            return t, rn, cn, w, w3
        curv = cn - cost - slope * t
        tq = -slope * t * t / (2.0 * curv) if curv > 0 else 0.5 * t
        t = min(max(tq, 0.1 * t), 0.5 * t)
    _, w, w3 = _soft_l1(r, f)
    return 0.0, r, cost, w, w3


def _done(step: float, slope: float, cost: float) -> bool:
    """After a line search: nothing more to gain. No decrease was found, or the step's
    predicted decrease (``-slope/2``) was below ``_DECREMENT_TOL`` of the cost: Newton's
    convergence is quadratic, so what is left after it is below rounding."""
    return step == 0.0 or -slope <= _DECREMENT_TOL * cost


def _min_1d(
    base: np.ndarray, b: np.ndarray, t: float, lo: float, hi: float, f: float
) -> tuple[float, np.ndarray, np.ndarray]:
    """Minimise the soft-L1 cost of residuals ``base + t·b`` over ``t ∈ [lo, hi]`` (convex in
    t): projected Newton with backtracking from ``t``. Returns ``(t, residuals, w)``."""
    b2 = b * b
    r = base + t * b
    cost, w, w3 = _soft_l1(r, f)
    for _ in range(_MAX_ITER):
        g = float((w * r) @ b)
        tn = min(max(t - g / float(w3 @ b2), lo), hi)
        d = tn - t
        if abs(d) <= _STEP_TOL * (1.0 + abs(t)) or -g * d <= _ROUNDING * cost:
            return tn, base + tn * b, w  # a step the cost cannot resolve: take it, done
        step, r, cost_n, w, w3 = _line_search(r, d * b, cost, g * d, f)
        t = tn if step == 1.0 else t + step * d
        if _done(step, g * d, cost):
            break
        cost = cost_n
    return t, r, w


def _inside(s: float, off: float) -> bool:
    return SCALE_MIN <= s <= SCALE_MAX and 0.0 <= off <= MAX_OFFSET_S


def _min_2d(
    x: np.ndarray, y: np.ndarray, s: float, off: float, f: float, stop_outside: bool
) -> tuple[float, float, bool]:
    """Unconstrained minimiser of the soft-L1 cost of ``off + s·x − y`` (x with spread, so the
    cost is strictly convex): Newton with backtracking from ``(s, off)``. Returns ``(s, off,
    converged)``; with ``stop_outside``, returns unconverged as soon as a full Newton step lands
    outside the box (Newton's model then puts the minimiser there: try the edges first)."""
    design = np.empty((3, len(x)))  # rows x, 1, x²: one product gives all the sums
    design[0], design[1] = x, 1.0
    np.multiply(x, x, out=design[2])
    r = off + s * x - y
    cost, w, w3 = _soft_l1(r, f)
    for _ in range(_MAX_ITER):
        gs, go = (design[:2] @ (w * r)).tolist()
        hso, hoo, hss = (design @ w3).tolist()
        det = hss * hoo - hso * hso
        if det <= 1e-12 * hss * hoo:  # the weights sit on one x: take the IRLS step instead
            hso, hoo, hss = (design @ w).tolist()
            det = hss * hoo - hso * hso
            if det <= 1e-12 * hss * hoo:  # x's spread is lost in rounding: no Newton step
                return s, off, False
        ds = (hso * go - hoo * gs) / det
        do = (hso * gs - hss * go) / det
        slope = gs * ds + go * do
        if -slope <= _ROUNDING * cost or (
            abs(ds) <= _STEP_TOL * (1.0 + abs(s)) and abs(do) <= _STEP_TOL * (1.0 + abs(off))
        ):
            return s + ds, off + do, True  # a step the cost cannot resolve: take it, done
        step, r, cost_n, w, w3 = _line_search(r, ds * x + do, cost, slope, f)
        s, off = s + step * ds, off + step * do
        if _done(step, slope, cost):
            break
        if stop_outside and step == 1.0 and not _inside(s, off):
            return s, off, False
        cost = cost_n
    return s, off, True


def _on_edge(
    x: np.ndarray, y: np.ndarray, s: float, off: float, f: float
) -> tuple[tuple[float, float] | None, tuple[float, float]]:
    """The box's edges, seen from a point ``(s, off)`` outside it. On each edge (one parameter
    at a bound) the other is a 1-D convex problem; an edge's minimiser where the fixed
    parameter's gradient also points out of the box meets the KKT conditions, so it is the
    bounded optimum (the problem is convex). Edges whose bound ``(s, off)`` crosses go first.
    Returns ``(that optimum or None, the cheapest edge minimiser)``."""
    ones = np.ones_like(x)
    sc, oc = min(max(s, SCALE_MIN), SCALE_MAX), min(max(off, 0.0), MAX_OFFSET_S)
    edges = [  # (crossed, fixed is the scale, bound, is the upper bound)
        (off < 0.0, False, 0.0, False),
        (off > MAX_OFFSET_S, False, MAX_OFFSET_S, True),
        (s < SCALE_MIN, True, SCALE_MIN, False),
        (s > SCALE_MAX, True, SCALE_MAX, True),
    ]
    edges.sort(key=lambda e: not e[0])
    best: tuple[float, tuple[float, float]] | None = None
    for _, fix_scale, bound, upper in edges:
        if fix_scale:
            o, r, w = _min_1d(bound * x - y, ones, oc, 0.0, MAX_OFFSET_S, f)
            cand, b = (bound, o), x
        else:
            sv, r, w = _min_1d(bound - y, x, sc, SCALE_MIN, SCALE_MAX, f)
            cand, b = (sv, bound), ones
        wr = w * r
        g = float(wr @ b)
        tol = 1e-9 * float(np.abs(wr) @ b) + 1e-300
        if (g <= tol) if upper else (g >= -tol):
            return cand, cand
        cost = _soft_l1(r, f)[0]
        if best is None or cost < best[0]:
            best = (cost, cand)
    assert best is not None
    return None, best[1]


def _middle(v: np.ndarray) -> float:
    """A median (the upper one of an even count): a start, not a statistic."""
    k = len(v) // 2
    return float(np.partition(v, k)[k])


def fit_ttft(
    modelled: np.ndarray, observed: np.ndarray, f_scale: float = 0.05
) -> tuple[float, float]:
    """Robust fit of ``observed ≈ offset + scale · modelled``; returns ``(scale, offset)``."""
    x = np.asarray(modelled, dtype=float)
    y = np.asarray(observed, dtype=float)
    if len(x) < 2 or float(x.max() - x.min()) <= 1e-12:  # one point or no spread: scale only
        s = float(np.median(y / np.maximum(x, 1e-9)))
        return float(np.clip(s, SCALE_MIN, SCALE_MAX)), 0.0
    # start from medians, which outliers do not move (from least squares, Newton's first
    # steps cross the flat, L1-like tails of the loss and backtrack a lot)
    s0 = _middle(y / np.maximum(x, 1e-9))
    s, off, converged = _min_2d(x, y, s0, _middle(y - s0 * x), f_scale, stop_outside=True)
    if converged and _inside(s, off):
        return s, off
    # the bounded minimiser is on an edge, or (Newton passing outside on its way) inside
    opt, cheapest = _on_edge(x, y, s, off, f_scale)
    if opt is not None:
        return opt
    if not converged:  # no edge meets KKT: the optimum is inside, where Newton goes on to
        s, off, _ = _min_2d(x, y, s, off, f_scale, stop_outside=False)
        if _inside(s, off):
            return s, off
    return cheapest  # only reached at rounding's edge


def fit_scale(
    modelled: np.ndarray,
    observed: np.ndarray,
    f_scale: float = 0.01,
    lo: float = SCALE_MIN,
    hi: float = SCALE_MAX,
) -> float:
    """Robust fit of ``observed ≈ scale · modelled`` (no offset), ``scale ∈ [lo, hi]``."""
    x = np.asarray(modelled, dtype=float)
    y = np.asarray(observed, dtype=float)
    s0 = min(max(_middle(y / np.maximum(x, 1e-9)), lo), hi)
    return _min_1d(-y, x, s0, lo, hi, f_scale)[0]


def fit_pool_scale(
    pool_s: np.ndarray,
    queue_s: np.ndarray,
    compute_s: np.ndarray,
    other_s: np.ndarray,
    overlap: np.ndarray,
    observed_s: np.ndarray,
    prefill_scale: float = 1.0,
    offset_s: float = 0.0,
    min_samples: int = 1,
) -> tuple[float, int]:
    """The pool link's scale from pool-loading calls (see the module docstring): the residual
    of each observed TTFT after the calibrated non-pool part, fitted as ``scale · pool load``
    over the samples whose load is exposed at every scale in the box. Returns ``(scale, exposed
    samples)``; the scale is 1 with fewer than ``min_samples`` exposed samples."""
    s = prefill_scale
    hidden = overlap * s * compute_s
    exposed = other_s + POOL_SCALE_MIN * pool_s >= hidden
    n = int(exposed.sum())
    if n < max(min_samples, 1):
        return 1.0, n
    x = pool_s[exposed]
    y = (observed_s - offset_s - s * (queue_s + compute_s) - other_s + hidden)[exposed]
    f = max(0.1 * _middle(x), 1e-9)
    return fit_scale(x, y, f, POOL_SCALE_MIN, POOL_SCALE_MAX), n


class Calibrator:
    """Sliding windows of observations for one replica; :meth:`current` refits lazily.

    Observations carry the time they were made (``at``, any monotonic clock; 0 when the caller
    has none) and leave the window after ``max_age_s`` (``None``: only the count bounds it).
    Each window's fit is kept until that window changes (an observation enters or leaves it).
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
        self._hit: deque[tuple[float, float, float]] = deque(maxlen=window)
        # (pool, queue, compute, other loads, overlap, observed, at): pool loads, see above
        self._pool: deque[tuple[float, ...]] = deque(maxlen=window)
        self._ttft_fit: tuple[float, float] | None = (1.0, 0.0)
        self._itl_fit: float | None = 1.0
        self._pool_fit: tuple[float, int] | None = (1.0, 0)
        self._cached: Calibration | None = Calibration()

    def observe_ttft(self, modelled_s: float, observed_s: float, at: float = 0.0) -> None:
        if modelled_s > 0 and observed_s > 0 and np.isfinite(observed_s):
            self._ttft.append((modelled_s, observed_s, at))
            self._ttft_fit = self._pool_fit = self._cached = None

    def observe_pool_fetch(
        self,
        pool_s: float,
        queue_s: float,
        compute_s: float,
        other_s: float,
        overlap: float,
        observed_s: float,
        at: float = 0.0,
    ) -> None:
        """A call whose placement loaded blocks from the cluster pool: its uncalibrated
        modelled parts (the pool load ``pool_s`` on the profile's link, the queue, the
        prefill compute, the other tiers' loads, the ``overlap`` it was priced with) and its
        observed TTFT. Where the uncalibrated model hides the load behind compute even at
        ``POOL_SCALE_MIN`` it is an ordinary TTFT sample (:meth:`observe_ttft`, modelled
        ``queue + compute + max(0, loads − overlap·compute)``), else a pool sample."""
        parts = (pool_s, queue_s, compute_s, other_s, overlap, observed_s)
        if not (pool_s > 0 and observed_s > 0 and all(np.isfinite(parts))) or min(parts) < 0:
            return
        if other_s + POOL_SCALE_MIN * pool_s < overlap * compute_s:
            loads = other_s + pool_s
            modelled = queue_s + compute_s + max(0.0, loads - overlap * compute_s)
            self.observe_ttft(modelled, observed_s, at)
            return
        self._pool.append((*parts, at))
        self._pool_fit = self._cached = None

    def observe_itl(self, modelled_s: float, observed_s: float, at: float = 0.0) -> None:
        if modelled_s > 0 and observed_s > 0 and np.isfinite(observed_s):
            self._itl.append((modelled_s, observed_s, at))
            self._itl_fit = self._cached = None

    def observe_hit(self, expected_tokens: float, cached_tokens: float, at: float = 0.0) -> None:
        """A call the router placed expecting ``expected_tokens`` of its prompt cached (the
        matched prefix) for which the engine reported ``cached_tokens``. A match can fail to
        deliver when the blocks are evicted between the match and the engine's lookup at
        scheduling — under KV pressure, while the call waits in a long queue — and the
        router's index cannot see that coming. More cached than expected is counted as
        expected: this measures the promises the index broke, not its misses."""
        if expected_tokens > 0 and cached_tokens >= 0 and np.isfinite(cached_tokens):
            self._hit.append((expected_tokens, min(cached_tokens, expected_tokens), at))
            self._cached = None

    def _expire(self, now: float | None) -> None:
        if now is None or self.max_age_s is None:
            return
        while self._ttft and now - self._ttft[0][2] > self.max_age_s:
            self._ttft.popleft()
            self._ttft_fit = self._cached = None
        while self._itl and now - self._itl[0][2] > self.max_age_s:
            self._itl.popleft()
            self._itl_fit = self._cached = None
        while self._hit and now - self._hit[0][2] > self.max_age_s:
            self._hit.popleft()
            self._cached = None
        while self._pool and now - self._pool[0][6] > self.max_age_s:
            self._pool.popleft()
            self._pool_fit = self._cached = None

    @staticmethod
    def _pairs(q: deque[tuple[float, float, float]]) -> tuple[np.ndarray, np.ndarray]:
        a = np.fromiter(chain.from_iterable(q), float, 3 * len(q)).reshape(-1, 3).T.copy()
        return a[0], a[1]  # contiguous: strided columns slow every pass of the fit

    def current(self, now: float | None = None) -> Calibration:
        """The fit over the samples still in the window at ``now`` (``None``: no expiry)."""
        self._expire(now)
        if self._cached is not None:
            return self._cached
        if self._ttft_fit is None:
            enough = len(self._ttft) >= self.min_samples
            self._ttft_fit = fit_ttft(*self._pairs(self._ttft)) if enough else (1.0, 0.0)
            self._pool_fit = None  # the pool's residuals are after the TTFT fit
        if self._itl_fit is None:
            enough = len(self._itl) >= self.min_samples
            self._itl_fit = fit_scale(*self._pairs(self._itl)) if enough else 1.0
        ps, off = self._ttft_fit
        if self._pool_fit is None:
            self._pool_fit = self._fit_pool(ps, off)
        hit = 1.0
        if len(self._hit) >= self.min_samples:
            expected = sum(e for e, _, _ in self._hit)
            hit = sum(c for _, c, _ in self._hit) / expected
        pool, n_pool = self._pool_fit
        self._cached = Calibration(
            ps, off, self._itl_fit, len(self._ttft), len(self._itl), hit, len(self._hit),
            pool, n_pool,
        )  # fmt: skip
        return self._cached

    def _fit_pool(self, prefill_scale: float, offset_s: float) -> tuple[float, int]:
        """``(pool scale, exposed samples)`` over the pool window (see the module docstring)."""
        if not self._pool:
            return 1.0, 0
        pool, queue, compute, other, overlap, observed = np.array(self._pool, dtype=float).T[:6]
        return fit_pool_scale(
            pool, queue, compute, other, overlap, observed, prefill_scale, offset_s,
            self.min_samples,
        )  # fmt: skip
