"""Shared pytest set-up: tiers are markers given by folder (tests/<tier>/...)."""

from __future__ import annotations

from pathlib import Path

import pytest

TIERS = ("unit", "integration", "vllm", "kernels")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(__file__).parent
    for item in items:
        try:
            tier = Path(item.path).relative_to(root).parts[0]
        except ValueError:
            continue
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
