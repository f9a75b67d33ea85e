"""``make bench``: run every benchmark module in :mod:`loadtest.bench` and print a report.

Every module ``loadtest/bench/bench_*.py`` is found (every benchmark lives there; a test holds
that no ``bench_*.py`` sits elsewhere in loadtest/ but the GPU kernel bench,
``loadtest/kernel_tools/bench_all.py``, run by ``make bench-kernels``). Each one is one of:

* a benchmark: ``run(quick: bool) -> list[dict]``; each dict is one row with at least
  ``name`` plus measured fields (medians, ratios against a baseline measured in the same
  run). Run by default.
* a slow benchmark: the same ``run`` and a ``SLOW`` string saying why (real vLLM-CPU
  replicas, tens of minutes). Listed and skipped by default; run with ``--slow`` or by name
  with ``--only``.
* a stand-alone tool: no ``run``, a ``STANDALONE`` string saying how it is run (it needs
  arguments, e.g. another run's output). Listed, never run here.

A ``bench_*`` module that is none of these is reported as broken and fails the run.
Results are printed as a table and written as JSON to ``out/bench/<module>.json`` so
docs/results.md and docs/benchmarks-log.md can quote them with the command.

    python -m loadtest.benchmarks [--only NAME ...] [--quick] [--slow] [--list]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

PACKAGE = "loadtest.bench"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cpus, Python {platform.python_version()}"


@dataclass(frozen=True)
class Bench:
    name: str  # module name, bench_*
    kind: str  # "bench" | "slow" | "standalone" | "broken"
    note: str  # SLOW / STANDALONE text, or what is wrong
    module: ModuleType | None

    @property
    def short(self) -> str:
        return self.name.removeprefix("bench_")


def classify(name: str, mod: ModuleType) -> Bench:
    run = getattr(mod, "run", None)
    if callable(run):
        slow = getattr(mod, "SLOW", None)
        return Bench(name, "slow" if slow else "bench", slow or "", mod)
    standalone = getattr(mod, "STANDALONE", None)
    if standalone:
        return Bench(name, "standalone", standalone, mod)
    return Bench(name, "broken", "no run(quick) and no STANDALONE: make bench cannot run it", mod)


def discover(package: str = PACKAGE) -> list[Bench]:
    """Every ``bench_*`` module of ``package``, classified (an import error is ``broken``)."""
    pkg = importlib.import_module(package)
    names = sorted(
        m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name.startswith("bench_")
    )
    out = []
    for name in names:
        try:
            mod = importlib.import_module(f"{package}.{name}")
        except Exception as e:  # listed as broken with the reason, the others still run
            out.append(Bench(name, "broken", f"import failed: {e!r}", None))
            continue
        out.append(classify(name, mod))
    return out


def main(argv: list[str] | None = None, package: str = PACKAGE) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.benchmarks")
    ap.add_argument("--only", nargs="*", default=None, help="module names (without bench_)")
    ap.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    ap.add_argument("--slow", action="store_true", help="also run the SLOW benchmarks")
    ap.add_argument("--list", action="store_true", help="list every benchmark and its kind")
    ap.add_argument("--out", default="out/bench")
    args = ap.parse_args(argv)
    benches = discover(package)
    broken = [b for b in benches if b.kind == "broken"]
    if args.list:
        for b in benches:
            print(f"{b.short:24} {b.kind:10} {b.note}")
        return 1 if broken else 0
    if args.only is not None:
        unknown = set(args.only) - {b.short for b in benches}
        if unknown:
            print(f"unknown benchmark(s): {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        benches = [b for b in benches if b.short in args.only]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"# kvroute benchmarks on {machine()}")
    failed = 0
    for b in benches:
        if b.kind == "broken":
            print(f"## {b.name}: BROKEN: {b.note}", file=sys.stderr)
            failed += 1
            continue
        if b.kind == "standalone":
            print(f"\n## {b.name}: not run here ({b.note})")
            continue
        if b.kind == "slow" and not (args.slow or args.only):
            print(f"\n## {b.name}: skipped, slow ({b.note}); --slow or --only {b.short}")
            continue
        assert b.module is not None
        t0 = time.perf_counter()
        try:
            rows = b.module.run(quick=args.quick)
        except Exception as e:  # one broken benchmark must not hide the others
            print(f"## {b.name}: FAILED: {e!r}", file=sys.stderr)
            failed += 1
            continue
        dt = time.perf_counter() - t0
        print(f"\n## {b.name} ({dt:.1f} s)")
        for r in rows:
            print("  " + ", ".join(f"{k}={v}" for k, v in r.items()))
        (out / f"{b.name}.json").write_text(
            json.dumps({"machine": machine(), "rows": rows}, indent=1)
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
