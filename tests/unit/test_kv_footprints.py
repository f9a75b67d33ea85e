"""The footprint table's per-replica columns (router/kv/footprints.py) and the cost model's
column paths (costmodel.placement.WarmColumns / ReservationColumns) give exactly what the
per-session loops gave: random footprints, random changes, checked against the reference
loops (the code they replaced, kept here)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from costmodel.placement import (
    CallShape,
    ReplicaLoad,
    Reservation,
    ReservationColumns,
    WarmColumns,
    WarmSession,
    eviction_harm,
    p_return_after,
    reserved_cost,
)
from costmodel.profiles import router_profile
from router.kv.config import KVConfig
from router.kv.footprints import FootprintTable
from router.kv.sessions import SessionFootprint
from router.kv.snapshot import MIN_GAP_S, P_NEGLIGIBLE
from router.kv.state import KVState

pytestmark = pytest.mark.unit

REPLICAS = ["a", "b", "c"]


def reference(st: KVState, now: float, replica: str, exclude: str | None, holds: bool):
    """StateView.warm_and_reserved as it was: a loop over every footprint."""
    warm, res = [], []
    ewma = st.gap_ewma
    prior = st.cfg.default_gap_s if ewma is None else max(ewma, MIN_GAP_S)
    for s in st.sessions.values():
        if s.replica != replica or not s.tokens or s.key == exclude:
            continue
        idle = 0.0 if s.last_end is None else max(now - s.last_end, 0.0)
        gap = s.mean_gap()
        gap = prior if gap is None else max(gap, MIN_GAP_S)
        p = p_return_after(idle, gap, s.final)
        pinned = s.inflight > 0 or s.children_inflight > 0
        warm.append(WarmSession(s.key, s.tokens, idle, p, pinned, gap, s.hold_s if holds else 0.0))
        if s.inflight == 0 and not s.final and p > P_NEGLIGIBLE:
            res.append(Reservation(s.key, gap, max(s.turn_tokens, 1), s.tokens, p))
    return warm, res


def _same(got, want) -> bool:
    """The same items, any order (a bucket's is not the dict's), floats to 1e-12 (numpy's exp
    and math.exp may differ in the last bit)."""
    got, want = sorted(got, key=lambda x: x.key), sorted(want, key=lambda x: x.key)
    if len(got) != len(want):
        return False
    for g, w in zip(got, want, strict=True):
        for f in type(w).__dataclass_fields__:
            a, b = getattr(g, f), getattr(w, f)
            ok = math.isclose(a, b, rel_tol=1e-12) if isinstance(b, float) else a == b
            if not ok or type(a) is not type(b):
                return False
    return True


def _mutate(rng: random.Random, st: KVState, now: float) -> None:
    op = rng.random()
    key = f"t/s{rng.randrange(40)}"
    fp = st.sessions.get(key)
    if fp is None or op < 0.15:
        st.sessions[key] = SessionFootprint(
            key, replica=rng.choice([*REPLICAS, None]), tokens=rng.choice([0, 1000, 50_000])
        )
    elif op < 0.25:
        del st.sessions[key]
    elif op < 0.3:
        st.sessions.pop(key)
    elif op < 0.45:
        fp.replica = rng.choice([*REPLICAS, None])
    elif op < 0.6:
        fp.last_end = now - rng.uniform(0, 200)
        fp.gaps = [*fp.gaps[-3:], rng.choice([0.0, rng.uniform(0, 60)])]
    elif op < 0.7:
        fp.inflight = rng.randint(0, 2)
        fp.children_inflight = rng.randint(0, 1)
    elif op < 0.8:
        fp.final = rng.random() < 0.3
        fp.hold_s = rng.choice([0.0, 30.0])
    elif op < 0.9:
        fp.tokens = rng.choice([0, 2000, 100_000])
        fp.turn_tokens = rng.randint(0, 3000)
    else:
        st.gap_ewma = rng.choice([None, 0.0, 12.0])


@pytest.mark.parametrize("seed", range(6))
def test_columns_match_the_per_session_loop_through_random_changes(seed: int) -> None:
    rng = random.Random(seed)
    now = [1000.0]
    st = KVState(KVConfig(), clock=lambda: now[0])
    assert isinstance(st.sessions, FootprintTable)
    for step in range(300):
        _mutate(rng, st, now[0])
        now[0] += rng.uniform(0, 5)
        if step % 3:
            continue
        view = st.view()
        for r in REPLICAS:
            exclude = rng.choice([None, f"t/s{rng.randrange(40)}"])
            holds = rng.random() < 0.5
            warm, res = view.warm_and_reserved(r, exclude, holds)
            want_w, want_r = reference(st, now[0], r, exclude, holds)
            assert _same(warm, want_w) and _same(res, want_r)


def test_a_session_moving_between_replicas_leaves_the_old_bucket() -> None:
    t = FootprintTable()
    fp = SessionFootprint("k", replica="a", tokens=10)
    t["k"] = fp
    assert t.bucket("a") is not None and t.bucket("a").keys == ["k"]
    fp.replica = "b"  # a field set on a footprint in the table re-buckets it
    assert t.bucket("a") is None and t.bucket("b").keys == ["k"]
    fp.tokens = 0  # no KV: in no bucket
    assert t.bucket("b") is None
    fp.tokens = 5
    t["k"] = SessionFootprint("k", replica="c", tokens=1)  # replaced: the old one is let go
    assert t.bucket("b") is None and t.bucket("c").keys == ["k"]
    fp.replica = "a"
    assert t.bucket("a") is None  # the replaced footprint no longer reports to the table
    t.pop("k")
    assert t.bucket("c") is None and len(t) == 0


def _lists(rng: random.Random, n: int) -> tuple[list[WarmSession], list[Reservation]]:
    warm = [
        WarmSession(f"w{i}", rng.choice([0, 64, 5000, 140_000]),
                    rng.choice([0.0, 5.0, 5.0, rng.uniform(0, 300)]), rng.random(),
                    rng.random() < 0.2, rng.uniform(0.1, 60), rng.choice([0.0, 20.0]))
        for i in range(n)
    ]  # fmt: skip
    res = [
        Reservation(f"r{i}", rng.choice([0.0, rng.uniform(0.1, 60)]), rng.randint(1, 4000),
                    rng.randint(0, 140_000), rng.choice([0.0, rng.random(), 1.0]))
        for i in range(n)
    ]  # fmt: skip
    return warm, res


def _cols(
    warm: list[WarmSession], res: list[Reservation]
) -> tuple[WarmColumns, ReservationColumns]:
    wc = WarmColumns(
        [w.key for w in warm],
        np.array([w.tokens for w in warm], float),
        np.array([w.idle_s for w in warm]),
        np.array([w.p_return for w in warm]),
        np.array([w.pinned for w in warm], bool),
        np.array([w.mean_gap_s for w in warm]),
        np.array([w.hold_s for w in warm]),
    )
    rc = ReservationColumns(
        [r.key for r in res],
        np.array([r.expected_return_s for r in res]),
        np.array([r.next_tokens for r in res]),
        np.array([r.context_tokens for r in res]),
        np.array([r.p_return for r in res]),
    )
    return wc, rc


@pytest.mark.parametrize("seed", range(8))
def test_cost_model_column_paths_equal_the_loops(seed: int) -> None:
    rng = random.Random(seed)
    prof = router_profile("h200-70b-fp8")
    warm, res = _lists(rng, rng.choice([0, 1, 5, 40]))
    wc, rc = _cols(warm, res)
    assert wc == warm and rc == res  # they read as the same sequences
    for _ in range(10):
        call = CallShape(rng.randint(1, 200_000), rng.randint(0, 500), 0, 0, rng.randint(1, 800))
        free = rng.choice([0, 100, 5000])
        a = ReplicaLoad(free_gpu_blocks=free, warm=warm, reserved=res, host_residence_s=30.0)
        b = ReplicaLoad(free_gpu_blocks=free, warm=wc, reserved=rc, host_residence_s=30.0)
        ha, ea = eviction_harm(prof, call, a, scale=1.3)
        hb, eb = eviction_harm(prof, call, b, scale=1.3)
        assert ea == eb and math.isclose(ha or 0.0, hb or 0.0, rel_tol=1e-12, abs_tol=1e-12)
        d, win, comp = rng.uniform(0, 20), rng.uniform(0, 5), rng.choice([0.0, rng.uniform(0, 3)])
        ra = reserved_cost(prof, d, a, scale=1.3, prefill_window_s=win, compute_s=comp)
        rb = reserved_cost(prof, d, b, scale=1.3, prefill_window_s=win, compute_s=comp)
        assert math.isclose(ra, rb, rel_tol=1e-9, abs_tol=1e-12)
