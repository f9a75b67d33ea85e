"""Build (or locate) the deterministic tiny Llama model used by the test bed and the twin.

``kvroute model build [--out DIR] [--force]`` writes the model directory and prints its path.
The default location is ``$KVROUTE_CACHE/models/kvroute-tiny-<fingerprint>`` (cache defaults
to ``~/.cache/kvroute``); ``KVROUTE_MODEL`` overrides it.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["build", "path"], help="build it, or print where it is")
    p.add_argument("--out", default=None, help="model directory (default: the cache)")
    p.add_argument("--force", action="store_true", help="rebuild even if present")


def run(args: argparse.Namespace) -> int:
    from loadtest import tinymodel

    if args.action == "path":
        print(args.out or tinymodel.default_dir())
        return 0
    path = (
        tinymodel.build(args.out or tinymodel.default_dir())
        if args.force
        else (tinymodel.ensure(args.out))
    )
    print(path)
    return 0
