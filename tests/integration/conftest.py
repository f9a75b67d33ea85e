"""Fixtures shared by the integration modules."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web

from router.app import build_app, start_site
from router.config import RouterConfig


@pytest.fixture
async def router() -> AsyncIterator[Callable[..., Any]]:
    """``await router(urls, **settings)`` -> ``(url, app)``: a kvroute router on port 0 in this
    process (health and load scrapes slowed to 30 s unless given), cleaned up after the test."""
    runners: list[web.AppRunner] = []

    async def make(urls: list[str], **cfg: Any) -> tuple[str, web.Application]:
        defaults: dict[str, Any] = {"health_interval_s": 30.0, "metrics_interval_s": 30.0}
        app = build_app(RouterConfig(replicas=urls, **{**defaults, **cfg}))
        runner, url = await start_site(app)
        runners.append(runner)
        return url, app

    yield make
    for r in runners:
        await r.cleanup()
