"""Shared pytest set-up: tiers are markers given by folder (tests/<tier>/...).

Also: a test run started with SIGINT ignored (a background job of a non-interactive shell —
``make test &`` in a script — ignores SIGINT, and ignored signals survive exec) would pass
that on to every process the tests start, and the tests that stop a server or a bed owner
with Ctrl-C (SIGINT) would wait for it in vain. So the run takes SIGINT back: its children
then start with the default action.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

TIERS = ("unit", "integration", "vllm", "kernels", "agents")

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(__file__).parent
    for item in items:
        try:
            tier = Path(item.path).relative_to(root).parts[0]
        except ValueError:
            continue
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def agent_bin() -> Path:
    """The agent CLIs' bin folder (the agents tier); the test skips, saying why, when they are
    not installed (`make agents`: needs npm)."""
    from loadtest.agents import install

    found = install.installed()
    if found is None:
        pytest.skip(
            f"agents tier skipped: the agent CLIs ({', '.join(install.pins())}) are not "
            f"installed in {install.install_dir()}: run `make agents` (needs npm)"
        )
    return found
