"""The one line method (issue 42, Build item 4): every policy's figure at the P90 interactivity
line by the same rule — measured on a grid fine at the line, the interpolated crossing beside
it, for all policies or none."""

import itertools
import math

import pytest

from loadtest.line import (
    LinePoint,
    compare_at_line,
    fine_enough,
    lane_grid,
    line_figure,
    parse_lanes,
    refine_lanes,
)


def test_the_fine_grid_keeps_neighbours_within_an_eighth() -> None:
    g = lane_grid(16, 48)
    assert g == [16, 18, 20, 22, 25, 28, 32, 36, 41, 46, 48]
    assert all((b - a) / b <= 0.125 for a, b in itertools.pairwise(g))
    # the example grid passes the same test; the coarse grids in use do not
    example = [16, 18, 20, 22, 24, 27, 30, 34, 38, 43, 48]
    assert all(fine_enough(a, b) for a, b in itertools.pairwise(example))
    assert not fine_enough(24, 28)  # one step of 28 vs 24 lanes is already 1.17x
    assert not fine_enough(32, 64)
    assert fine_enough(28, 32)  # exactly 12.5%
    assert fine_enough(4, 5)  # adjacent integers: nothing runs between them
    assert lane_grid(4, 8) == [4, 5, 6, 7, 8]
    assert parse_lanes("4,8,16:20") == [4, 8, 16, 18, 20]
    with pytest.raises(ValueError, match="bad lanes"):
        parse_lanes("16:x")
    with pytest.raises(ValueError, match="bad lanes"):
        parse_lanes("0")


def test_interpolation_matches_a_hand_computation() -> None:
    # 32 lanes: P90 60 tok/s at 8,000 tok/GPU-s; 36 lanes: P90 40 at 9,000. The curve crosses
    # 50 halfway in interactivity: 8,000 + 0.5 * 1,000 = 8,500 at 34 lanes.
    fig = line_figure([(28, 70.0, 7000.0), (32, 60.0, 8000.0), (36, 40.0, 9000.0)])
    assert fig.measured == 8000.0 and fig.measured_lanes == 32
    assert fig.interpolated == pytest.approx(8500.0)
    assert fig.crossing_lanes == pytest.approx(34.0)
    assert fig.bracket == (32, 36) and fig.step == pytest.approx(4 / 36)
    assert fig.ok and fig.why == ""
    # a quarter of the way: 55 -> 35 crosses 50 at frac 0.25
    fig = line_figure([(32, 55.0, 8000.0), (36, 35.0, 8400.0)])
    assert fig.interpolated == pytest.approx(8100.0)
    assert fig.crossing_lanes == pytest.approx(33.0)


def test_measured_and_interpolated_are_reported_side_by_side() -> None:
    fig = line_figure([LinePoint(32, 60.0, 8000.0), LinePoint(36, 40.0, 9000.0)])
    d = fig.as_dict()
    assert (d["measured"], d["interpolated"]) == (8000, 8500)
    assert d["measured_lanes"] == 32 and d["crossing_lanes"] == 34.0
    assert d["bracket"] == [32, 36] and d["ok"] is True


def test_a_grid_too_coarse_at_the_line_is_flagged_and_refined() -> None:
    fig = line_figure([(32, 60.0, 8000.0), (64, 30.0, 12000.0), (96, 20.0, 13000.0)])
    assert fig.measured == 8000.0
    assert fig.interpolated == pytest.approx(8000.0 + (10 / 30) * 4000.0)
    assert not fig.ok
    assert "32 -> 64" in fig.why and "too coarse" in fig.why
    # a coarse step away from the line does not matter
    fine = line_figure([(8, 90.0, 3000.0), (32, 60.0, 8000.0), (36, 40.0, 9000.0)])
    assert fine.ok
    # refinement bisects the bracket geometrically until it is fine
    lanes = [32, 64, 96]
    assert refine_lanes(fig, lanes) == [45]
    curve = {n: (80.0 - 0.6 * n, 250.0 * n) for n in range(1, 200)}  # crosses 50 at 50 lanes
    for _ in range(8):
        fig = line_figure([(n, *curve[n]) for n in lanes])
        more = refine_lanes(fig, lanes)
        if not more:
            break
        lanes = sorted({*lanes, *more})
    assert fig.ok and fig.bracket is not None
    lo, hi = fig.bracket
    assert lo <= 50 < hi and (hi - lo) / hi <= 0.125
    assert fig.crossing_lanes == pytest.approx(50.0)


def test_a_crossing_outside_the_grid_is_flagged() -> None:
    above = line_figure([(8, 90.0, 3000.0), (12, 80.0, 4000.0)])
    assert above.measured == 4000.0 and above.interpolated is None and not above.ok
    assert "run past 12" in above.why
    assert refine_lanes(above, [8, 12]) == [13]
    never = line_figure([(16, 40.0, 3000.0), (24, 30.0, 4000.0)])
    assert never.measured is None and never.interpolated is None and not never.ok
    assert refine_lanes(never, [16, 24]) == [14]
    assert refine_lanes(line_figure([(1, 10.0, 5.0)]), [1]) == []  # not under 1 lane
    # NaN interactivity (nothing measured) counts as below the line; the curve stops there
    nan = line_figure([(32, 55.0, 100.0), (36, math.nan, 300.0)])
    assert nan.measured == 100.0 and nan.interpolated == 100.0 and nan.ok


def test_the_best_point_above_the_line_wins_even_past_an_earlier_dip() -> None:
    fig = line_figure([(30, 55.0, 100.0), (32, 45.0, 300.0), (34, 70.0, 900.0)])
    assert fig.measured == 900.0 and fig.measured_lanes == 34
    assert fig.interpolated is None  # nothing ran past 34 lanes: the crossing is unbracketed


def test_ratios_are_for_all_policies_or_none() -> None:
    fine = {
        "kv_cost": line_figure([(32, 60.0, 8400.0), (36, 40.0, 9400.0)]),
        "sglang_tree": line_figure([(32, 55.0, 8000.0), (36, 45.0, 8600.0)]),
    }
    c = compare_at_line(fine, ["kv_cost"])
    assert c["line_ok"] is True and c["line_flags"] == {}
    assert c["kv_cost_vs_best_measured"] == "1.05x vs sglang_tree"
    # kv_cost 8,900 against sglang_tree 8,300 (halfway between 8,000 and 8,600)
    assert c["kv_cost_vs_best_interpolated"] == f"{8900 / 8300:.2f}x vs sglang_tree"
    coarse = {**fine, "llmd": line_figure([(32, 60.0, 7000.0), (64, 30.0, 9000.0)])}
    c = compare_at_line(coarse, ["kv_cost"])
    assert c["line_ok"] is False and "llmd" in c["line_flags"]
    assert c["kv_cost_vs_best_measured"].endswith("(grid too coarse at the line: see line_flags)")
    unbracketed = {**fine, "llmd": line_figure([(32, 60.0, 7000.0), (36, 55.0, 7500.0)])}
    c = compare_at_line(unbracketed, ["kv_cost"])
    assert c["kv_cost_vs_best_interpolated"].startswith("not comparable")
    never = {**fine, "kv_cost": line_figure([(32, 40.0, 9000.0)])}
    assert compare_at_line(never, ["kv_cost"])["kv_cost_vs_best_measured"].startswith(
        "not comparable"
    )
