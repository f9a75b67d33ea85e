"""The pressure benchmark's KV headroom: the never-evicting ceiling's line figure against the
best port's, from the line rows the yardstick writes (pure; no simulation)."""

from loadtest.bench.bench_kv_policy import line_row
from loadtest.bench.bench_kv_pressure import CEILINGS, OURS, headroom_rows

CEILING = "weka-dev-unlimited-kv"  # bounds the 2-replica workloads


def _pts(*pairs: tuple[float, float]) -> list[dict[str, float]]:
    """Median points as (P90 interactivity, tok/GPU-s), TTFT within the SLO."""
    return [{"p90_interactivity": i, "tok_per_gpu_s": t, "ttft_p90_s": 1.0} for i, t in pairs]


def test_headroom_is_the_ceiling_over_the_best_port_not_over_ours() -> None:
    pressure = line_row(
        "weka-dev-squeezed-host",
        {
            "kv_cost": _pts((70, 4000), (55, 7000), (20, 9000)),  # ours: best of all, not a port
            "sglang_tree": _pts((70, 4100), (52, 6000), (20, 8000)),
            "llmd": _pts((70, 3900), (40, 6500)),  # 6500 is past the line: not counted
        },
        0.96,
        OURS,
    )
    ceiling = line_row(
        CEILING,
        {"kv_cost": _pts((60, 8000), (45, 9500)), "sglang_tree": _pts((58, 9000), (44, 9900))},
        0.96,
        (),
    )
    assert "weka-dev-squeezed-host" in CEILINGS[CEILING]
    (row,) = headroom_rows([pressure, ceiling])
    assert row["name"] == "weka-dev-squeezed-host_kv_headroom"
    assert row["ceiling"] == CEILING
    assert row["ceiling_measured"] == 9000  # the better of the ceiling's two policies
    assert row["best_port_measured"] == 6000  # sglang_tree; kv_cost's 7000 is ours
    assert row["best_ours_measured"] == 7000
    assert row["ceiling_vs_best_port_measured"] == "1.50x"
    assert row["ours_vs_best_port_measured"] == "1.17x"
    # interpolated figures go through the same rule (each policy's line crossing)
    assert row["ceiling_interpolated"] > row["ceiling_measured"]
    assert row["best_port_interpolated"] is not None


def test_no_ceiling_run_or_no_port_on_the_line_gives_no_ratio() -> None:
    pressure = line_row(
        "weka-dev-squeezed",
        {"kv_cost": _pts((60, 5000)), "llmd": _pts((40, 5000))},  # the port never reaches it
        0.96,
        OURS,
    )
    assert headroom_rows([pressure]) == []  # no ceiling line row: nothing to bound
    ceiling = line_row(CEILING, {"kv_cost": _pts((60, 8000))}, 0.96, ())
    (row,) = headroom_rows([pressure, ceiling])
    assert row["best_port_measured"] is None
    assert row["ceiling_vs_best_port_measured"] == "not comparable"
    # a workload on 8 replicas is bounded by the 8-replica ceiling only
    other = line_row("weka-dev-scarce-8x", {"kv_cost": _pts((60, 9000))}, 0.96, OURS)
    assert headroom_rows([other, ceiling]) == []
    ceiling_8x = line_row("weka-dev-unlimited-kv-8x", {"kv_cost": _pts((60, 12000))}, 0.96, ())
    (row,) = headroom_rows([other, ceiling, ceiling_8x])
    assert (row["name"], row["ceiling_measured"]) == ("weka-dev-scarce-8x_kv_headroom", 12000)
