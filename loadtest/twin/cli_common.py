"""Arguments shared by ``kvroute twin``, ``kvroute cluster`` and ``kvroute sim``.

Owns the ``--set KEY=VALUE`` profile overrides and turning ``--profile`` + ``--set`` into a
:class:`costmodel.profiles.ReplicaProfile` (raises ``ProfileError`` on bad input).
"""

from __future__ import annotations

import argparse

from costmodel.profiles import ReplicaProfile, load_profile, parse_overrides, with_overrides


def add_overrides_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="override an engine setting of the profile, e.g. "
        "prefill_interval_steps=2 or gpu_kv_blocks=4000 (repeatable)",
    )


def profile_from_args(args: argparse.Namespace) -> ReplicaProfile:
    return with_overrides(load_profile(args.profile), parse_overrides(args.set))
