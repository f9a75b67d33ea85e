"""Arguments shared by ``kvroute twin``, ``kvroute cluster`` and ``kvroute sim``.

Owns the ``--set KEY=VALUE`` profile overrides and turning ``--profile`` + ``--set`` into a
:class:`costmodel.profiles.ReplicaProfile` (raises ``ProfileError`` on bad input), and the
engine plugin's settings (``--retention``, ``--cadence-interval``, ...) into an
:class:`loadtest.twin.engine.EnginePlugin`, ``--truth`` (the engine's timing,
:mod:`loadtest.twin.truth`), and the HTTP twins' reply settings (tools, tool calls,
seed: :func:`add_reply_args`).
"""

from __future__ import annotations

import argparse
from typing import Any

from costmodel.profiles import ReplicaProfile, load_profile, parse_overrides, with_overrides
from loadtest.twin.engine import EnginePlugin
from loadtest.twin.truth import NOMINAL, TRUTH_NAMES, check


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


def add_plugin_args(p: argparse.ArgumentParser) -> None:
    """The engine plugin's settings, by the names ``kvroute engine flags`` takes (off unless
    given: the twin's figures without them stay the plain-vLLM ones)."""
    g = p.add_argument_group("engine plugin (docs/engine.md; off by default)")
    g.add_argument(
        "--retention",
        action="store_true",
        help="the host tier honours kvroute hints (AgentRetentionPolicy's rule)",
    )
    g.add_argument(
        "--retention-ttl-s", type=float, default=600.0, help="no hold outlives this (model seconds)"
    )
    g.add_argument(
        "--retention-share",
        type=float,
        default=0.5,
        help="held chunks never exceed this share of the host tier",
    )
    g.add_argument(
        "--cadence",
        action="store_true",
        help="the bounded prefill cadence (implied by any --cadence-* setting)",
    )
    g.add_argument("--cadence-interval", type=int, default=None, help="N (default 4)")
    g.add_argument("--max-defer-steps", type=int, default=None, help="D (default 16)")
    g.add_argument("--max-defer-ms", type=float, default=None, help="T, model ms (default 500)")
    g.add_argument("--backlog-scale", type=float, default=None, help="(default 16)")


def plugin_from_args(args: argparse.Namespace) -> EnginePlugin:
    """Raises ValueError on settings the plugin would refuse."""
    retention = None
    if args.retention:
        retention = {"ttl_s": args.retention_ttl_s, "max_share": args.retention_share}
    names = {"interval": args.cadence_interval, "max_defer_steps": args.max_defer_steps,
             "max_defer_ms": args.max_defer_ms, "backlog_scale": args.backlog_scale}  # fmt: skip
    given = {k: v for k, v in names.items() if v is not None}
    cadence = given if (args.cadence or given) else None
    return EnginePlugin.from_settings(retention, cadence)


def _truth_name(name: str) -> str:
    """A runnable truth's name (a measured one only once its file exists)."""
    try:
        check(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name


def add_truth_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--truth",
        default=NOMINAL,
        type=_truth_name,
        metavar="{" + ",".join(TRUTH_NAMES) + "}",
        help="the engine's timing, which no router is told (docs/twin.md#truths): nominal "
        "(default), prefill-slow, decode-fast-slow-link, measured-h100 (fitted to a GPU's "
        "step times by `make gpu-check`, once committed: docs/gpu-check.md), or costmodel "
        "(the router's own formula: the twin's timing before issue 42)",
    )


# The default profile of ``kvroute twin`` / ``kvroute cluster``: one that serves an agent (a
# 262k-token window; cpu-tiny's 4,096 is the vLLM-CPU bed's, below Codex's first prompt).
AGENT_PROFILE = "h200-70b-fp8"


def add_reply_args(p: argparse.ArgumentParser) -> None:
    """How an HTTP twin answers agents (docs/twin.md, "How a reply ends")."""
    g = p.add_argument_group("replies (docs/twin.md)")
    g.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve tools with any tool_choice and answer with tool calls, as vLLM with "
        "--enable-auto-tool-choice and a tool parser (default); --no-enable-auto-tool-choice: "
        'a bare vLLM, which refuses tool_choice "auto" and "required" with a 400',
    )
    g.add_argument(
        "--tool-call-rate",
        type=float,
        default=0.5,
        metavar="P",
        help='share of replies under tool_choice "auto" that call an offered tool (default 0.5)',
    )
    g.add_argument(
        "--tool-call-rate-after-result",
        type=float,
        default=0.2,
        metavar="P",
        help="the same right after a tool result, so an agent loop ends its turn (default 0.2)",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds reply lengths and tool calls (with each request's prompt)",
    )


def reply_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`loadtest.twin.replica.TwinConfig` fields :func:`add_reply_args` sets."""
    return {
        "enable_auto_tool_choice": args.enable_auto_tool_choice,
        "tool_call_rate": args.tool_call_rate,
        "tool_call_rate_after_result": args.tool_call_rate_after_result,
        "seed": args.seed,
    }
