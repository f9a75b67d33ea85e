"""The harness's shared command-line groups (loadtest/cli_args.py): every command that takes
a shared flag takes it from one place, with the same help and its own default."""

from __future__ import annotations

import argparse
import importlib

import pytest

from loadtest.cli_args import AGENT_PROFILE, TRUTH_HELP, add_trace_args, add_truth_arg

COMMANDS = {
    "twin": "loadtest.twin.twin_cli",
    "cluster": "loadtest.twin.cluster_cli",
    "sim": "loadtest.sim.cli",
    "replay": "loadtest.replay.cli",
    "bench": "loadtest.sweep.cli",
}


def parser(cmd: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=cmd, exit_on_error=False)
    importlib.import_module(COMMANDS[cmd]).add_arguments(p)
    return p


def action(p: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in p._actions if flag in a.option_strings)


def test_a_shared_flag_has_one_help_wherever_it_is_taken():
    for flag, cmds in {
        "--profile": ("twin", "cluster", "sim", "bench"),
        "--speedup": ("twin", "cluster", "bench"),
        "--router-profile": ("sim", "bench"),
        "--max-gap": ("replay", "bench"),
        "--convention": ("replay", "bench"),
        "--tokens-per-id": ("replay", "bench"),
        "--model": ("twin", "cluster"),
    }.items():
        helps = {action(parser(c), flag).help is not None for c in cmds}
        assert helps == {True}, flag
    profiles = {c: action(parser(c), "--profile").default for c in ("twin", "sim", "bench")}
    assert set(profiles.values()) == {AGENT_PROFILE}


def test_each_command_keeps_its_own_defaults():
    replay = parser("replay").parse_args(["t", "--target", "http://x", "--out", "o"])
    bench = parser("bench").parse_args(["t", "--out", "o"])
    assert replay.max_gap is None and bench.max_gap == 30.0  # replay: the loader's 60 s
    assert replay.speedup == 1.0 and bench.speedup == 10.0
    assert replay.convention == bench.convention == "claude"
    assert "default 30" in action(parser("bench"), "--max-gap").help  # type: ignore[operator]
    assert "default 60" in action(parser("replay"), "--max-gap").help  # type: ignore[operator]


def test_one_truth_is_checked_as_parsed_and_a_list_is_left_to_the_sweep():
    one = argparse.ArgumentParser(exit_on_error=False)
    add_truth_arg(one)
    assert one.parse_args(["--truth", "prefill-slow"]).truth == "prefill-slow"
    with pytest.raises(argparse.ArgumentError):
        one.parse_args(["--truth", "nominal,prefill-slow"])
    many = argparse.ArgumentParser()
    add_truth_arg(many, many=True)
    assert many.parse_args(["--truth", "nominal,prefill-slow"]).truth == "nominal,prefill-slow"
    assert action(many, "--truth").help.startswith(TRUTH_HELP)  # type: ignore[union-attr]


def test_the_trace_group_parses_the_trace_and_its_play():
    p = argparse.ArgumentParser()
    add_trace_args(p, max_gap=5.0)
    a = p.parse_args(["synthetic", "--max-calls", "3", "--open-loop", "--convention", "codex"])
    assert (a.trace, a.max_calls, a.open_loop, a.convention, a.max_gap) == (
        "synthetic", 3, True, "codex", 5.0,
    )  # fmt: skip
