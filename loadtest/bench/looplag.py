"""How late the event loop wakes while a benchmark runs: :class:`LoopLag`.

A task sleeps ``tick_s`` over and over and records how much later than asked each sleep
returned; a stall of the loop (work done on it, not off it) shows as one long lateness.
Shared by ``bench_analysis_stall`` and ``bench_decisions``.
"""

from __future__ import annotations

import asyncio
import time


class LoopLag:
    """``lag = LoopLag(); lag.start()`` ... ``await lag.stop()``; then ``lag.lateness``
    holds each sleep's lateness in seconds."""

    def __init__(self, tick_s: float = 0.001):
        self.tick_s = tick_s
        self.lateness: list[float] = []
        self._stop = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self._stop = True
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop:
            await asyncio.sleep(self.tick_s)
            now = time.perf_counter()
            self.lateness.append(max(0.0, now - last - self.tick_s))
            last = now
