"""``kvroute bench``: every kvroute policy reads load at upstream llm-d's 50 ms refresh (peers
track their own), and the results carry each target's line figure by the one rule."""

from __future__ import annotations

import argparse

import pytest

from loadtest.sweep import bench, stack
from tests.helpers.sweep import STOPPED, fake_sweep_processes


def _routers_started(monkeypatch, tmp_path, target: str, **cfg_kw) -> list[str]:
    """The router argv ``run_point`` starts for ``target`` (processes faked; the point stops
    as soon as the router would start)."""
    started = fake_sweep_processes(monkeypatch)
    monkeypatch.setattr(stack, "peer_python", lambda kind: tmp_path / "python")
    cfg = bench.SweepConfig(trace="t", replicas=2, profile="h200-70b-fp8-tp4", **cfg_kw)
    point = bench.run_point(cfg, target, 4, tmp_path, None, None)
    assert STOPPED in point["error"]
    (router_argv,) = [a for a, _ in started if "cluster" not in a]
    return router_argv


@pytest.mark.parametrize("policy", ["llmd", "kv_cost", "round_robin"])
def test_every_kvroute_policy_scrapes_load_every_50_ms_at_speedup_1(monkeypatch, tmp_path, policy):
    argv = _routers_started(monkeypatch, tmp_path, f"kvroute:{policy}", speedup=1.0)
    assert float(argv[argv.index("--metrics-interval-s") + 1]) == pytest.approx(0.05)


def test_the_scrape_is_in_modelled_time_and_not_under_the_routers_floor(monkeypatch, tmp_path):
    argv = _routers_started(monkeypatch, tmp_path, "kvroute:llmd", speedup=2.0)
    assert float(argv[argv.index("--metrics-interval-s") + 1]) == pytest.approx(0.025)
    argv = _routers_started(monkeypatch, tmp_path, "kvroute:llmd", speedup=10.0)
    assert float(argv[argv.index("--metrics-interval-s") + 1]) == pytest.approx(0.01)
    argv = _routers_started(monkeypatch, tmp_path, "kvroute:llmd", speedup=1.0, scrape_s=1.0)
    assert float(argv[argv.index("--metrics-interval-s") + 1]) == pytest.approx(1.0)


def test_a_peer_gets_no_scrape_flag(monkeypatch, tmp_path):
    argv = _routers_started(monkeypatch, tmp_path, "sglang:cache_aware", speedup=1.0)
    assert "--metrics-interval-s" not in argv


@pytest.mark.parametrize("peer", ["sglang:cache_aware", "vllm-router:kv_aware"])
def test_peer_health_s_gives_the_peers_kvroutes_health_checks_and_nothing_by_default(
    monkeypatch, tmp_path, peer
):
    """--disrupt rolling-restart: a drained replica answers /health 503; at their defaults
    (every 60 s, 3 failures) the peers never take it out, so --peer-health-s matches kvroute's."""
    argv = _routers_started(monkeypatch, tmp_path, peer, speedup=1.0)
    assert "--health-check-interval-secs" not in argv
    argv = _routers_started(monkeypatch, tmp_path, peer, speedup=1.0, peer_health_s=2)
    assert argv[argv.index("--health-check-interval-secs") + 1] == "2"
    assert argv[argv.index("--health-failure-threshold") + 1] == "1"
    kv = _routers_started(monkeypatch, tmp_path, "kvroute:kv_cost", peer_health_s=2)
    assert "--health-check-interval-secs" not in kv  # kvroute keeps its own flags
    assert stack.peer_health_args("dynamo:kv", 2) == []  # the harness's front checks nothing
    with pytest.raises(stack.StackError):
        stack.peer_health_args(peer, 0)


def _row(target: str, lanes: int, inter: float, tput: float) -> dict:
    def mmm(x: float) -> dict:
        return {"min": x, "median": x, "max": x}

    return {"target": target, "concurrency": lanes, "p90_interactivity_tok_s": mmm(inter),
            "tokens_per_gpu_s": mmm(tput)}  # fmt: skip


def test_the_results_line_uses_the_one_rule_for_every_target():
    rows = [
        _row("kvroute:kv_cost", 32, 60.0, 8400.0),
        _row("kvroute:kv_cost", 36, 40.0, 9400.0),
        _row("sglang:cache_aware", 32, 55.0, 8000.0),
        _row("sglang:cache_aware", 36, 45.0, 8600.0),
    ]
    line = bench.line_summary(rows)
    kv = line["figures"]["kvroute:kv_cost"]
    assert (kv["measured"], kv["measured_lanes"], kv["interpolated"]) == (8400, 32, 8900)
    assert line["line_ok"] is True
    assert line["kvroute:kv_cost_vs_best_measured"] == "1.05x vs sglang:cache_aware"
    # a target run on a coarse grid flags the comparison for every target
    rows += [_row("kvroute:llmd", 16, 70.0, 5000.0), _row("kvroute:llmd", 32, 30.0, 7000.0)]
    line = bench.line_summary(rows)
    assert line["line_ok"] is False
    assert "16 -> 32" in line["line_flags"]["kvroute:llmd"]
    assert "too coarse" in line["kvroute:kv_cost_vs_best_measured"]


def test_bench_lanes_take_a_fine_grid():
    from loadtest.sweep.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(["t", "--out", "o", "--lanes", "16:24"])
    from loadtest.line import parse_lanes

    assert parse_lanes(a.concurrency) == [16, 18, 20, 22, 24]
    assert a.scrape == 0.05


def _started(monkeypatch, tmp_path, target: str, priority: bool) -> tuple[list[str], list[str]]:
    """(cluster argv, router argv) of one point of ``kvroute bench [--priority]``."""
    started = fake_sweep_processes(monkeypatch)
    monkeypatch.setattr(stack, "peer_python", lambda kind: tmp_path / "python")
    cfg = bench.SweepConfig(trace="t", replicas=2, profile="h200-70b-fp8-tp4", priority=priority)
    point = bench.run_point(cfg, target, 4, tmp_path, None, None)
    assert STOPPED in point["error"]
    (cluster,) = [a for a, _ in started if "cluster" in a]
    (router,) = [a for a, _ in started if "cluster" not in a]
    return cluster, router


def _sets(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]


def test_priority_makes_the_twins_schedule_by_priority_and_kvroute_send_it(monkeypatch, tmp_path):
    """``--priority`` (issue 47): every point's twins run vLLM's priority policy; kvroute
    targets send their session priority (``--priority session``); a peer sends none (its
    calls all have priority 0: the policy then orders by arrival, as FCFS)."""
    cluster, router = _started(monkeypatch, tmp_path, "kvroute:kv_cost", priority=True)
    assert "priority_scheduling=1" in _sets(cluster)
    assert router[router.index("--priority") + 1] == "session"
    cluster, router = _started(monkeypatch, tmp_path, "sglang:cache_aware", priority=True)
    assert "priority_scheduling=1" in _sets(cluster) and "--priority" not in router
    cluster, router = _started(monkeypatch, tmp_path, "kvroute:kv_cost", priority=False)
    assert "priority_scheduling=1" not in _sets(cluster) and "--priority" not in router
