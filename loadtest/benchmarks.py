"""``make bench``: run every benchmark module in :mod:`loadtest.bench` and print a report.

Each module ``loadtest/bench/bench_*.py`` exposes ``run(quick: bool) -> list[dict]``; each dict
is one row with at least ``name`` plus measured fields (medians, ratios against a baseline
measured in the same run). Results are printed as a table and written as JSON to
``out/bench/<module>.json`` so docs/results.md and docs/benchmarks-log.md can quote them with
the command.

    python -m loadtest.benchmarks [--only NAME ...] [--quick]
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
from pathlib import Path


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cpus, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.benchmarks")
    ap.add_argument("--only", nargs="*", default=None, help="module names (without bench_)")
    ap.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    ap.add_argument("--out", default="out/bench")
    args = ap.parse_args(argv)
    import loadtest.bench as pkg

    names = sorted(
        m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name.startswith("bench_")
    )
    if args.only:
        names = [n for n in names if n.removeprefix("bench_") in args.only]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"# kvroute benchmarks on {machine()}")
    failed = 0
    for name in names:
        mod = importlib.import_module(f"loadtest.bench.{name}")
        t0 = time.perf_counter()
        try:
            rows = mod.run(quick=args.quick)
        except Exception as e:  # one broken benchmark must not hide the others
            print(f"## {name}: FAILED: {e!r}", file=sys.stderr)
            failed += 1
            continue
        dt = time.perf_counter() - t0
        print(f"\n## {name} ({dt:.1f} s)")
        for r in rows:
            print("  " + ", ".join(f"{k}={v}" for k, v in r.items()))
        (out / f"{name}.json").write_text(
            json.dumps({"machine": machine(), "rows": rows}, indent=1)
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
