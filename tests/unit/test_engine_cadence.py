"""The bounded prefill cadence policy (engine_patches.cadence), without vLLM."""

from __future__ import annotations

import pytest

from engine_patches.cadence import (
    CadenceConfig,
    PendingPrefill,
    PrefillCadence,
    eligible_flags,
    read_trace,
)


def run_steps(cad: PrefillCadence, pending, steps: int, dt: float = 0.01, tokens_if_admit=512):
    out = []
    for i in range(steps):
        d = cad.decide(i * dt, pending, decoding=True)
        cad.observe(tokens_if_admit if d.admit else 0)
        out.append(d)
    return out


def test_admits_every_nth_step_while_decoding():
    cad = PrefillCadence(CadenceConfig(interval=4, max_defer_steps=100, max_defer_ms=1e9), 512)
    # a fresh request each step (so no one accumulates holds), small backlog
    ds = []
    for i in range(12):
        p = [PendingPrefill(f"r{i}", 64, True)]
        d = cad.decide(i * 0.01, p, decoding=True)
        cad.observe(64 if d.admit else 0)
        ds.append(d.admit)
    assert ds == [True, False, False, False] * 3


def test_no_decoder_or_no_pending_always_admits():
    cad = PrefillCadence(CadenceConfig(interval=8), 512)
    assert cad.decide(0.0, [PendingPrefill("a", 100, True)], decoding=False).reason == "no-decoder"
    assert cad.decide(0.01, [], decoding=True).reason == "idle"


def test_bound_caps_every_requests_holds_in_steps():
    cad = PrefillCadence(CadenceConfig(interval=8, max_defer_steps=3, max_defer_ms=1e9), 512)
    p = [PendingPrefill("a", 4096, True)]
    cad.observe(512)  # a prefill just ran: the next steps are off-cadence
    ds = run_steps(cad, p, 10)
    assert [d.admit for d in ds[:4]] == [False, False, False, True]
    assert ds[3].reason == "bound"
    assert cad.stats.max_held_steps == 3


def test_bound_caps_holds_in_milliseconds():
    cad = PrefillCadence(CadenceConfig(interval=100, max_defer_steps=1000, max_defer_ms=25), 512)
    cad.observe(512)
    p = [PendingPrefill("a", 4096, True)]
    ds = run_steps(cad, p, 6, dt=0.01)  # 10 ms steps: held 0, 10, 20, 30 ms -> admit
    assert [d.admit for d in ds[:4]] == [False, False, False, True]
    assert ds[3].reason == "bound"


def test_requests_behind_the_budget_are_not_held_by_the_cadence():
    cad = PrefillCadence(CadenceConfig(interval=8, max_defer_steps=2, max_defer_ms=1e9), 512)
    cad.observe(512)
    p = [PendingPrefill("head", 512, True), PendingPrefill("tail", 512, False)]
    run_steps(cad, p, 2)
    assert cad.held("head")[0] == 2 and cad.held("tail") == (0, 0.0)


def test_backlog_shortens_the_interval_gradually():
    cad = PrefillCadence(CadenceConfig(interval=4, backlog_scale=4.0), 512)
    assert cad.interval_for(0) == 4
    assert cad.interval_for(512 * 4) == 2  # a backlog of `scale` admitting steps halves it
    assert cad.interval_for(512 * 12) == 1
    assert cad.interval_for(100) == 4  # a small backlog keeps the full interval


def test_finished_requests_are_forgotten():
    cad = PrefillCadence(CadenceConfig(interval=4), 512)
    cad.observe(512)
    cad.decide(0.0, [PendingPrefill("a", 100, True)], decoding=True)
    assert cad.held("a")[0] == 1
    cad.decide(0.01, [], decoding=True)
    assert cad.held("a") == (0, 0.0)


def test_eligible_flags_head_always_then_budget_and_seats():
    assert eligible_flags([4000, 10, 10], 512, 8) == [True, False, False]
    assert eligible_flags([100, 100, 400, 10], 512, 8) == [True, True, True, False]
    assert eligible_flags([100, 100], 512, 1) == [True, False]
    assert eligible_flags([100], 512, 0) == [False]


def test_config_from_additional_config_rejects_unknown_keys():
    c = CadenceConfig.from_additional_config({"kvroute": {"cadence": {"interval": 2}}})
    assert c.interval == 2 and c.guard == "bounded"
    assert CadenceConfig.from_additional_config({}) == CadenceConfig()
    with pytest.raises(ValueError, match="unknown cadence settings"):
        CadenceConfig.from_additional_config({"kvroute": {"cadence": {"intervall": 2}}})
    with pytest.raises(ValueError):
        CadenceConfig(interval=0)


def test_read_trace_splits_steps_from_arrivals_and_leaves_a_partial_line(tmp_path):
    path = tmp_path / "steps.jsonl"
    assert read_trace(path) == ([], [])  # no trace yet
    lines = [
        '{"t": 1.0, "arrived": "a", "prompt_tokens": 10}\n',
        '{"t": 1.1, "admit": true, "pending_prefill": 10}\n',
        '{"t": 1.2, "arrived": "b", "prompt_tokens": 5}\n',
    ]
    path.write_text("".join(lines) + '{"t": 1.3, "adm')  # the engine is mid-write
    steps, arrivals = read_trace(path)
    assert [s["pending_prefill"] for s in steps] == [10]
    assert [a["arrived"] for a in arrivals] == ["a", "b"]
    # from an offset: only what follows it
    steps, arrivals = read_trace(path, len(lines[0]) + len(lines[1]))
    assert steps == [] and [a["arrived"] for a in arrivals] == ["b"]
