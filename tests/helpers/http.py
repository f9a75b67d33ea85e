"""Small HTTP helpers shared by the integration tests."""

from __future__ import annotations

from typing import Any


async def post(http: Any, url: str, body: dict, headers: dict | None = None) -> dict:
    """POST ``body`` as JSON with an aiohttp session; the JSON answer, asserting a 200."""
    async with http.post(url, json=body, headers=headers or {}) as r:
        assert r.status == 200, await r.text()
        return await r.json()
