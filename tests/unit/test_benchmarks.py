"""``make bench`` (loadtest/benchmarks.py) finds every benchmark and runs what it should.

Every benchmark lives in loadtest/bench/ as ``bench_*.py`` and is a benchmark, a slow one or a
stand-alone tool; a fake package checks that a broken module fails the run, that slow ones
are skipped unless asked for, and that stand-alone ones are listed but never run.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest import benchmarks

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LOADTEST = ROOT / "loadtest"


def test_every_benchmark_lives_in_loadtest_bench() -> None:
    stray = [
        p.relative_to(ROOT).as_posix()
        for p in LOADTEST.rglob("bench_*.py")
        if p.parent != LOADTEST / "bench" and p.parent != LOADTEST / "kernel_tools"
    ]
    assert not stray, f"move these into loadtest/bench/: {stray}"


def test_make_bench_finds_every_bench_module_and_none_is_broken() -> None:
    files = {p.stem for p in (LOADTEST / "bench").glob("bench_*.py")}
    found = {b.name: b for b in benchmarks.discover()}
    assert set(found) == files
    assert {"bench_cadence", "bench_engine_replay"} <= set(found)
    broken = {n: b.note for n, b in found.items() if b.kind == "broken"}
    assert not broken, broken
    # the engines' benchmarks need real replicas, the scale bench minutes of load: slow, but
    # run by name or with --slow
    for name in ("bench_cadence", "bench_engine_replay", "bench_real_vllm", "bench_scale"):
        assert found[name].kind == "slow" and found[name].note
    assert found["bench_sim_vs_real"].kind == "standalone"


@pytest.fixture()
def fake_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    pkg = tmp_path / "fakebench"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "bench_fast.py").write_text(
        "def run(quick=False):\n    return [{'name': 'fast', 'quick': quick}]\n"
    )
    (pkg / "bench_slow.py").write_text(
        "SLOW = 'takes an hour'\ndef run(quick=False):\n    return [{'name': 'slow'}]\n"
    )
    (pkg / "bench_tool.py").write_text(
        "STANDALONE = 'python -m fakebench.bench_tool OUT'\n"
        "def main(argv=None):\n    raise AssertionError('never run')\n"
    )
    (pkg / "helper.py").write_text("raise AssertionError('not a bench_ module: never imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fakebench"
    for m in [m for m in sys.modules if m.startswith("fakebench")]:
        del sys.modules[m]


def test_slow_is_skipped_and_a_standalone_is_listed_not_run(
    fake_package: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert benchmarks.main(["--quick", "--out", str(out)], package=fake_package) == 0
    text = capsys.readouterr().out
    assert "## bench_fast" in text and "quick=True" in text
    assert "bench_slow: skipped, slow (takes an hour); --slow or --only slow" in text
    assert "bench_tool: not run here (python -m fakebench.bench_tool OUT)" in text
    assert sorted(p.name for p in out.iterdir()) == ["bench_fast.json"]
    assert benchmarks.main(["--slow", "--out", str(out)], package=fake_package) == 0
    assert (out / "bench_slow.json").exists()


def test_only_runs_a_slow_benchmark_by_name_and_refuses_unknown_names(
    fake_package: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert benchmarks.main(["--only", "slow", "--out", str(out)], package=fake_package) == 0
    assert sorted(p.name for p in out.iterdir()) == ["bench_slow.json"]
    assert benchmarks.main(["--only", "nope", "--out", str(out)], package=fake_package) == 2
    assert "unknown benchmark(s): nope" in capsys.readouterr().err


def test_a_bench_module_without_run_or_standalone_fails_the_run(
    fake_package: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "fakebench" / "bench_lost.py").write_text("def main():\n    return 0\n")
    assert benchmarks.main(["--list"], package=fake_package) == 1
    assert "lost" in capsys.readouterr().out
    assert benchmarks.main(["--out", str(tmp_path / "o")], package=fake_package) == 1
    assert "bench_lost: BROKEN" in capsys.readouterr().err
