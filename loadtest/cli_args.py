"""Command-line arguments shared by the harness's commands: ``kvroute twin``, ``cluster``,
``sim``, ``replay`` and ``bench``.

Owns one function per shared group, each adding the same flags with the same help and
defaults wherever it is used (a default that is a command's own is a parameter):

* the replica: ``--profile`` (:func:`add_profile_arg`), ``--set KEY=VALUE`` overrides
  (:func:`add_overrides_arg`; :func:`profile_from_args` turns both into a
  :class:`costmodel.profiles.ReplicaProfile`, raising ``ProfileError`` on bad input), the
  engine's timing ``--truth`` (:func:`add_truth_arg`, :mod:`loadtest.twin.truth`), the
  engine plugin's settings (:func:`add_plugin_args` → :func:`plugin_from_args`, an
  :class:`loadtest.twin.plugin.EnginePlugin`), the twins' time compression
  (:func:`add_speedup_arg`), their model (:func:`add_model_args`) and how they reply
  (:func:`add_reply_args` → :func:`reply_kwargs`); :func:`add_engine_args` adds the
  overrides, the plugin's settings and the truth together;
* the router: the profile it prices with (:func:`add_router_profile_arg`) and P/D
  disaggregation (:func:`add_pd_args`);
* the trace and how it plays: path, sessions, calls, gaps, prompt shape, session headers
  (:func:`add_trace_args`; :func:`trace_kwargs`, :func:`prompt_kwargs` and
  :func:`play_kwargs` pass them on by the loader's, the prompt builder's and the replay's
  names).
"""

from __future__ import annotations

import argparse
from typing import Any

from costmodel.profiles import ReplicaProfile, load_profile, parse_overrides, with_overrides
from loadtest.twin.plugin import EnginePlugin
from loadtest.twin.truth import NOMINAL, TRUTH_NAMES, check

# The default profile of every command: one that serves an agent (a 262k-token window;
# cpu-tiny's 4,096 is the vLLM-CPU bed's, below Codex's first prompt).
AGENT_PROFILE = "h200-70b-fp8"


def add_profile_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--profile",
        default=AGENT_PROFILE,
        help=f"replica profile name (default {AGENT_PROFILE}; cpu-tiny: the vLLM-CPU bed's)",
    )


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


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """What a twin's or a simulated engine runs beyond its profile: ``--set`` overrides, the
    engine plugin's settings and ``--truth`` (``kvroute twin``, ``cluster``, ``sim``)."""
    add_overrides_arg(p)
    add_plugin_args(p)
    add_truth_arg(p)


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


TRUTH_HELP = (
    "the engine's timing, which no router is told (docs/twin.md#truths): nominal "
    "(default), prefill-slow, decode-fast-slow-link, measured-h100 (fitted to a GPU's "
    "step times by `make gpu-check`, once committed: docs/gpu-check.md), or costmodel "
    "(the router's own formula: the twin's timing before issue 42)"
)


def add_truth_arg(p: argparse.ArgumentParser, many: bool = False) -> None:
    """``--truth``: one truth (checked as it is parsed), or with ``many`` a comma-separated
    list (``kvroute bench`` runs the whole sweep under each and checks them itself)."""
    if many:
        p.add_argument(
            "--truth",
            default=NOMINAL,
            help=TRUTH_HELP + "; a comma-separated list runs the whole sweep under each, "
            "into OUT/<truth>/",
        )
        return
    p.add_argument(
        "--truth",
        default=NOMINAL,
        type=_truth_name,
        metavar="{" + ",".join(TRUTH_NAMES) + "}",
        help=TRUTH_HELP,
    )


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


TWIN_SPEEDUP_HELP = "model seconds per wall second; multiply measured times by it"


def add_speedup_arg(
    p: argparse.ArgumentParser, default: float = 1.0, help: str = TWIN_SPEEDUP_HELP
) -> None:
    """``--speedup``: the twins' time compression (the replay's own help says what it does
    with the figure)."""
    p.add_argument("--speedup", type=float, default=default, help=help)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model an HTTP twin tokenizes with and the name it serves."""
    p.add_argument("--model", default=None, help="model dir (default: the tiny test model)")
    p.add_argument("--served-model-name", default="tiny")


def add_router_profile_arg(p: argparse.ArgumentParser, who: str) -> None:
    """``--router-profile``: the profile ``who`` (the router under test) prices with."""
    p.add_argument(
        "--router-profile",
        default=None,
        help=f"the profile {who} prices with (default: --profile, the nominal profile; never "
        "the truth); 'none': no profile (a generic stand-in, calibrated online)",
    )


def add_pd_args(p: argparse.ArgumentParser, replicas: str, who: str) -> None:
    """``--pd P:D`` and ``--pd-mode``: prefill/decode disaggregation, ``replicas`` saying what
    the P and D replicas are and ``who`` which router decides each call's split."""
    p.add_argument("--pd", default=None, metavar="P:D", help=f"P/D disaggregation: {replicas}")
    p.add_argument(
        "--pd-mode",
        default="auto",
        choices=["auto", "always", "never"],
        help=f"with --pd: {who}'s per-call split decision (auto: priced)",
    )


CONVENTIONS = ["claude", "codex", "opencode", "dynamo", "none"]


def add_trace_args(p: argparse.ArgumentParser, max_gap: float | None = None) -> None:
    """The trace and how it plays: its path, how much of it loads, how its prompts are
    shaped and which session headers go with the calls (``kvroute replay``, ``kvroute
    bench``). ``max_gap``: the command's default cap on idle gaps (None: the loader's, 60 s)."""
    p.add_argument("trace", help="trace path or synthetic[:k=v,...]")
    p.add_argument("--max-sessions", type=int, default=None, help="sessions to load")
    p.add_argument("--max-calls", type=int, default=None, help="first N calls of each session")
    p.add_argument(
        "--max-gap",
        type=float,
        default=max_gap,
        help="cap on recorded idle gaps, seconds (WEKA; default "
        f"{60 if max_gap is None else f'{max_gap:g}'})",
    )
    p.add_argument(
        "--open-loop",
        action="store_true",
        help="start sessions at their trace timestamps (Mooncake) instead of lanes",
    )
    p.add_argument(
        "--convention", choices=CONVENTIONS, default="claude", help="session headers to send"
    )
    p.add_argument(
        "--shared-prefix",
        action="store_true",
        help="map every session's tools+system blocks to one shared prefix",
    )
    p.add_argument(
        "--tokens-per-id",
        type=int,
        default=None,
        help="tokens each trace hash id becomes (default: the trace block size)",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="truncate longer prompts (keeps prefixes)",
    )


def trace_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """What of the trace loads (``load_trace``'s and the sweep's names), from
    :func:`add_trace_args`."""
    return {"max_sessions": args.max_sessions, "max_calls": args.max_calls,
            "max_gap_s": args.max_gap}  # fmt: skip


def prompt_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """How the trace's prompts are shaped (``PromptBuilder``'s and the sweep's names)."""
    return {"tokens_per_id": args.tokens_per_id, "shared_prefix": args.shared_prefix,
            "max_prompt_tokens": args.max_prompt_tokens}  # fmt: skip


def play_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """How the sessions play (``ReplayConfig``'s and the sweep's names)."""
    return {"open_loop": args.open_loop, "convention": args.convention}
