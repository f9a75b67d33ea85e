"""The ``kvroute`` command line.

Each subcommand lives next to the code it runs, in a module exposing
``add_arguments(parser)`` and ``run(args) -> int``; this file only lists them. Those modules
import their heavy dependencies inside ``run`` so that building the parser stays cheap and
``kvroute serve`` never loads the simulator or the replay harness.

The product's commands (``serve``, ``engine``) come with the router's distribution; the
others run the harness (``loadtest/``, the ``kvroute-harness`` distribution, installed by
``pip install 'kvroute[harness]'``). Without it those commands stay listed and each answers
with one line saying how to install it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
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

# The packages of the router's own distribution: a missing one of these is a broken install,
# never "the harness is not installed".
PRODUCT = ("kvroute", "router", "costmodel", "engine_patches", "kernels")
HARNESS = "loadtest"
INSTALL_HARNESS = "pip install 'kvroute[harness]' (from a clone: pip install -e ./loadtest)"


def is_harness(module: str) -> bool:
    return module.split(".")[0] == HARNESS


def harness_missing(command: str, why: str) -> str:
    """The one line a harness command answers with when the harness cannot be imported."""
    return (
        f"kvroute {command}: needs the kvroute harness, which is not installed ({why}); "
        f"{INSTALL_HARNESS}"
    )


def harness_importable() -> bool:
    try:
        return importlib.util.find_spec(HARNESS) is not None
    except (ImportError, ValueError):  # blocked, or a half-imported stub
        return False


def _import_command(module: str) -> tuple[object | None, str | None]:
    """(module, None), or (None, why) for a harness command whose harness does not import."""
    try:
        return importlib.import_module(module), None
    except ModuleNotFoundError as e:
        if not is_harness(module):
            raise
        if not harness_importable():
            return None, f"no module named {HARNESS!r}"
        top = (e.name or "").split(".")[0]
        if top in (*PRODUCT, HARNESS):  # a module of ours is missing: a bug, not an install
            raise
        return None, f"no module named {e.name!r}"  # a library only the harness needs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute", description="Cache-aware router for agentic LLM traffic."
    )
    parser.add_argument("--version", action="version", version=f"kvroute {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        mod, why = _import_command(module)
        if mod is None:
            line = harness_missing(name, str(why))
            p = sub.add_parser(name, help=f"{help_} [harness not installed]", description=line)
            p.set_defaults(_run=None, _missing=line)
            continue
        p = sub.add_parser(name, help=help_, description=(mod.__doc__ or help_).strip())
        mod.add_arguments(p)  # type: ignore[attr-defined]
        p.set_defaults(_run=mod.run)  # type: ignore[attr-defined]
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    missing = getattr(args, "_missing", None)
    if missing:  # a harness command without the harness: its flags cannot be known here
        print(missing, file=sys.stderr)
        return 2
    if extra:
        parser.error("unrecognized arguments: " + " ".join(extra))
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
