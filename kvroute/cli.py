"""The ``kvroute`` command line.

Each subcommand lives next to the code it runs, in a module exposing
``add_arguments(parser)`` and ``run(args) -> int``; this file only lists them. Those modules
import their heavy dependencies inside ``run`` so that building the parser stays cheap and
``kvroute serve`` never loads the simulator or the replay harness.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvroute import __version__

# name -> (module, one-line help). Add a line here when a subcommand lands.
COMMANDS: dict[str, tuple[str, str]] = {
    "model": ("loadtest.model_cli", "build or locate the deterministic tiny test model"),
    "serve": ("router.serve", "run the router in front of vLLM replicas"),
    "twin": ("loadtest.twin.twin_cli", "run one simulated vLLM replica (the replica twin)"),
    "cluster": ("loadtest.twin.cluster_cli", "run N replica twins in one process"),
    "sim": ("loadtest.sim.cli", "simulate a routing policy on N replicas (no HTTP)"),
    "replay": ("loadtest.replay.cli", "replay an agentic trace, write AgentX metrics"),
    "bench": ("loadtest.sweep.cli", "concurrency sweeps of routers on a twin cluster"),
    "demo": ("loadtest.demo", "the quick start: twins + kvroute + a real-trace replay"),
    "engine": ("engine_patches.cli", "the vLLM engine plugin: flag presets, supported versions"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute", description="Cache-aware router for agentic LLM traffic."
    )
    parser.add_argument("--version", action="version", version=f"kvroute {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_, description=(mod.__doc__ or help_).strip())
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
