"""The pressure benchmark's KV headroom: the never-evicting ceiling's line figure against the
best port's, from the line rows the yardstick writes (pure; no simulation)."""

from loadtest.bench.bench_kv_policy import line_row
from loadtest.bench.bench_kv_pressure import CEILINGS, OURS, headroom_rows

CEILING = "weka-dev-unlimited-kv"  # bounds the 2-replica workloads


LANES = (16, 18, 20, 22)  # a grid fine at the line (neighbours within 12.5%)


def _pts(*pairs: tuple[float, float], lanes: tuple[int, ...] = LANES) -> list[dict[str, float]]:
    """Median points as (P90 interactivity, tok/GPU-s) at ``lanes``, TTFT within the SLO."""
    return [{"lanes": n, "p90_interactivity": i, "tok_per_gpu_s": t, "ttft_p90_s": 1.0}
            for n, (i, t) in zip(lanes, pairs, strict=False)]  # fmt: skip


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


def test_headroom_is_flagged_for_all_when_one_grid_is_coarse_at_the_line() -> None:
    pressure = line_row(
        "weka-dev-squeezed-host",
        {
            "kv_cost": _pts((70, 4000), (55, 7000), (20, 9000)),
            # the port's crossing lies between 16 and 32 lanes: 50% apart
            "sglang_tree": _pts((70, 4100), (20, 8000), lanes=(16, 32)),
        },
        0.96,
        OURS,
    )
    assert pressure["line_ok"] is False
    assert "16 -> 32" in pressure["line_flags"]["sglang_tree"]
    assert pressure["sglang_tree"]["measured"] == 4100
    assert pressure["sglang_tree"]["bracket"] == [16, 32]
    ceiling = line_row(CEILING, {"kv_cost": _pts((60, 8000), (45, 9500))}, 0.96, ())
    assert ceiling["line_ok"] is True
    (row,) = headroom_rows([pressure, ceiling])
    assert row["line_ok"] is False and list(row["line_flags"]) == ["sglang_tree"]
    # a ceiling whose crossing lies past its grid: no interpolated ratio for anyone
    above = line_row(CEILING, {"kv_cost": _pts((60, 8000), (55, 9500))}, 0.96, ())
    (row,) = headroom_rows([pressure, above])
    assert row["ceiling_vs_best_port_interpolated"].startswith("not comparable")
    assert row["ceiling_vs_best_port_measured"] == f"{9500 / 4100:.2f}x"


def test_the_yardstick_refines_every_policys_grid_at_the_line(monkeypatch) -> None:
    """Coarse levels (16 / 32 / 48) bracket each policy's crossing 50% apart; the run adds
    lanes for every policy until each is fine at the line, and the line row says so."""
    from loadtest.bench import bench_kv_policy as kp

    crossing = {"kv_cost": 37.0, "llmd": 23.0}  # lanes where P90 interactivity hits 50

    class Policy:
        def __init__(self, name, *a, **kw):
            self.name = name

    class Result:
        def __init__(self, pol, n):
            self.pol, self.n = pol, n

        def summary(self, warmup_s):
            inter = 50.0 * crossing[self.pol.name] / self.n  # falls as lanes rise
            return {"throughput_tok_per_gpu_s": 100.0 * self.n, "p90_interactivity_tok_s": inter,
                    "ttft_p90_s": 1.0, "requests": 10}  # fmt: skip

    ran: list[tuple[str, int]] = []

    def simulate(prof, n_rep, trace, pol, *, concurrency, **kw):
        ran.append((pol.name, concurrency))
        return Result(pol, concurrency)

    monkeypatch.setattr(kp, "simulate_trace", simulate)
    monkeypatch.setattr(kp, "RouterPolicy", Policy)
    monkeypatch.setattr(kp, "load_trace", lambda *a, **kw: None)
    monkeypatch.setattr(kp, "trace_bound", lambda *a: 0.9)
    monkeypatch.delenv("KVROUTE_BENCH_REFINE", raising=False)
    monkeypatch.delenv("KVROUTE_BENCH_POLICIES", raising=False)
    monkeypatch.delenv("KVROUTE_BENCH_WORKLOADS", raising=False)
    w = {"w": ("synthetic:sessions=2", "h200-70b-fp8-tp4", 2, None, (16, 32, 48), (32,))}
    rows = kp.run_workloads(w, ("kv_cost", "llmd"), quick=False)
    line = rows[-1]
    assert line["line_ok"] is True, line["line_flags"]
    for pol, x in crossing.items():
        lo, hi = line[pol]["bracket"]
        assert lo <= x < hi and (hi - lo) / hi <= 0.125
        assert {16, 32, 48} <= {n for p, n in ran if p == pol}  # the levels, then more
    added = [r for r in rows if r.get("added_for_line")]
    assert {r["policy"] for r in added} == {"kv_cost", "llmd"}
    assert all(r["scrape_s"] == kp.SCRAPE_S == 0.05 for r in rows if "scrape_s" in r)
    # off: the levels only, and the coarse grid is flagged
    monkeypatch.setenv("KVROUTE_BENCH_REFINE", "0")
    line = kp.run_workloads(w, ("kv_cost", "llmd"), quick=False)[-1]
    assert line["line_ok"] is False and set(line["line_flags"]) == {"kv_cost", "llmd"}


def test_each_pool_workload_is_its_stock_workload_plus_one_cluster_pool() -> None:
    """Issue 43's capacity target compares a workload on stock engines with the same engines
    sharing a pool: same trace, profile, replicas and lanes, the same ceiling, a pool as large
    as the cluster's host tiers, and a profile that takes it (a write-through host tier)."""
    from costmodel.profiles import load_profile, with_overrides
    from loadtest.bench.bench_kv_pressure import OVERRIDES, WORKLOADS

    for stock in ("weka-dev-squeezed-host", "weka-dev-squeezed-host-8x"):
        pooled = stock.replace("-host", "-host-pool")
        assert WORKLOADS[pooled] == WORKLOADS[stock]
        extra = {k: v for k, v in OVERRIDES[pooled].items() if OVERRIDES[stock].get(k) != v}
        replicas = WORKLOADS[stock][2]
        assert extra == {"pool_kv_blocks": replicas * OVERRIDES[stock]["cpu_kv_blocks"]}
        assert [c for c, ws in CEILINGS.items() if pooled in ws] == [
            c for c, ws in CEILINGS.items() if stock in ws
        ]
        prof = with_overrides(load_profile(WORKLOADS[pooled][1]), OVERRIDES[pooled])
        assert prof.pool_kv_blocks == extra["pool_kv_blocks"]
