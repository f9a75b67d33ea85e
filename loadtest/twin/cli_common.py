"""Moved: the arguments shared by the harness's commands are :mod:`loadtest.cli_args`.

This name stays for imports written against it.
"""

from __future__ import annotations

from loadtest.cli_args import (
    AGENT_PROFILE,
    add_overrides_arg,
    add_plugin_args,
    add_reply_args,
    add_truth_arg,
    plugin_from_args,
    profile_from_args,
    reply_kwargs,
)

__all__ = [
    "AGENT_PROFILE",
    "add_overrides_arg",
    "add_plugin_args",
    "add_reply_args",
    "add_truth_arg",
    "plugin_from_args",
    "profile_from_args",
    "reply_kwargs",
]
