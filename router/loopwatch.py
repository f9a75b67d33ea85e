"""What the event loop was doing when it stalled: a watchdog thread that samples its stack.

Owns: :class:`StallWatch` and :class:`Stall`. ``loop_stall_log_ms`` (off by default, see
docs/router.md) turns it on: :meth:`router.metrics.RouterMetrics.watch_loop` arms it before
each 50 ms tick of ``kvroute_event_loop_lag_seconds`` (:meth:`StallWatch.arm`, the tick's due
time) and tells it when the tick fired (:meth:`StallWatch.fired`). The loop thread notes its
own CPU and run-queue figures at both (Linux ``/proc/self/task/<tid>/schedstat``, one
``pread``: exact even when the watchdog itself gets no CPU). The thread sleeps until due +
threshold and, if the tick has not fired by then, samples the loop thread's Python stack
(``sys._current_frames()``) every ``sample_s`` until it does. It then reports one
:class:`Stall` (by default one WARNING line on the ``kvroute.stall`` logger): how late the tick
was, the loop thread's time on a CPU and waiting for one from armed to fired (absent off
Linux), the other threads of the process that ran meanwhile (the GIL: one of them holding it
stalls the loop as surely as the loop's own work), time in the garbage collector, and the
sampled stacks, innermost frame first.

How to read it: loop CPU close to the stall's length means work on the loop (the stacks say
which); much less, with a run-queue wait, means the process was not scheduled (other
processes on the cores); much less without one means the loop thread was blocked — in a
syscall, or waiting for the GIL while another thread ran (their CPU is listed). A sample is
taken only when the watchdog gets the GIL, so code that holds it without releasing (one long
C call) shows as a long gap between samples and a stack caught just after it.

Costs little while the loop keeps time (per 50 ms tick: two ``pread`` calls on the loop, one
wake-up of the thread); a stall costs a ``/proc`` listing of the threads and a stack walk per
sample.
Must not import aiohttp, the KV layer or scheduling.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

log = logging.getLogger("kvroute.stall")

__all__ = ["IDLE", "Stall", "StallWatch", "frame_label"]

MAX_SAMPLE_S = 30.0  # a stall still going after this long is reported (and sampled again)
IDLE = "(loop idle: in the selector, or waiting for the GIL)"
# innermost Python frames of a loop thread that runs no callback: the runner, the selector
_IDLE_FRAMES = (
    ("uvloop/__init__.py", ""),
    ("asyncio/runners.py", ""),
    ("asyncio/base_events.py", "run_forever"),
    ("asyncio/base_events.py", "run_until_complete"),
    ("asyncio/base_events.py", "_run_once"),
    ("selectors.py", "select"),
)
_ROOT = str(Path(__file__).resolve().parent.parent) + os.sep  # the repository / install root


def frame_label(filename: str, lineno: int, func: str) -> str:
    """``router/call.py:88 decide``: a frame's file relative to site-packages, the repository
    or the standard library, its line and its function."""
    f = filename
    if "site-packages" + os.sep in f:
        f = f.rsplit("site-packages" + os.sep, 1)[1]
    elif f.startswith(_ROOT):
        f = f[len(_ROOT) :]
    else:
        parts = f.split(os.sep)
        for i in range(len(parts) - 1, -1, -1):
            if parts[i].startswith("python3"):
                f = os.sep.join(parts[i + 1 :])
                break
    return f"{f}:{lineno} {func}"


def _stack(frame: FrameType | None, depth: int) -> tuple[str, ...]:
    """The innermost ``depth`` frames of a thread, innermost first (``IDLE`` for a loop that
    runs nothing)."""
    out: list[str] = []
    if frame is not None:
        code = frame.f_code
        for suffix, func in _IDLE_FRAMES:
            if code.co_filename.endswith(suffix) and (not func or code.co_name == func):
                return (IDLE,)
    while frame is not None and len(out) < depth:
        code = frame.f_code
        out.append(frame_label(code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    return tuple(out)


def _schedstat(tid: int) -> tuple[int, int] | None:
    """(ns on a CPU, ns waiting on a run queue) of one of this process's threads (Linux)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
            run, wait, _ = f.read().split(None, 2)
        return int(run), int(wait)
    except (OSError, ValueError):
        return None


def _threads(skip: set[int]) -> dict[int, tuple[str, int]]:
    """native thread id -> (name, ns on a CPU) for the process's other threads (Linux): the
    Python name when it is a Python thread, else the kernel's (libzmq's ``ZMQbg/...``)."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[int, tuple[str, int]] = {}
    try:
        tids = [int(x) for x in os.listdir("/proc/self/task")]
    except (OSError, ValueError):
        return out
    for tid in tids:
        if tid in skip:
            continue
        st = _schedstat(tid)
        if st is None:
            continue
        name = names.get(tid)
        if name is None:
            try:
                name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            except OSError:
                name = str(tid)
        out[tid] = (name, st[0])
    return out


@dataclass
class Stall:
    """One tick that fired more than the threshold late."""

    late_s: float  # the tick's due time to when it fired (the watchdog's clock)
    # the loop thread on a CPU from when the tick was armed (a tick before its due time) to
    # when it fired (None: not on Linux) ...
    loop_cpu_s: float | None
    # ... and runnable, waiting for a CPU (the loop sleeps until due: a wait is the stall's)
    loop_wait_s: float | None
    gc_s: float  # garbage collection (any thread) over the stall
    gc_runs: int
    others: dict[str, float]  # other threads' CPU seconds once the stall was noticed, by name
    stacks: Counter[tuple[str, ...]] = field(default_factory=Counter)  # sampled loop stacks
    max_gap_s: float = 0.0  # longest time between two samples (the GIL held in C code)
    window_s: float = 0.0  # what loop_cpu_s / loop_wait_s cover: armed to fired

    @property
    def samples(self) -> int:
        return sum(self.stacks.values())

    def describe(self, stacks: int = 3, frames: int = 8) -> str:
        ms = 1000.0
        parts = [f"event loop stalled {self.late_s * ms:.0f} ms"]
        if self.loop_cpu_s is not None and self.loop_wait_s is not None:
            parts.append(
                f"loop thread ran {self.loop_cpu_s * ms:.0f} ms and waited "
                f"{self.loop_wait_s * ms:.0f} ms for a CPU"
            )
        parts.append(f"gc {self.gc_s * ms:.0f} ms ({self.gc_runs} runs)")
        busy = sorted(((s, n) for n, s in self.others.items() if s >= 0.0005), reverse=True)
        parts.append(
            "other threads on a CPU: "
            + (", ".join(f"{n} {s * ms:.0f} ms" for s, n in busy) if busy else "none")
        )
        head = "; ".join(parts)
        tops = [f"{n}x " + " < ".join(st[:frames]) for st, n in self.stacks.most_common(stacks)]
        return f"{head}; {self.samples} samples (longest gap {self.max_gap_s * ms:.0f} ms): " + (
            " | ".join(tops) if tops else "none"
        )


class StallWatch:
    """See the module docstring. ``on_stall`` receives each :class:`Stall` (default: log it)."""

    def __init__(
        self,
        threshold_s: float,
        *,
        sample_s: float = 0.005,
        depth: int = 16,
        on_stall: Callable[[Stall], Any] | None = None,
    ):
        if threshold_s <= 0:
            raise ValueError("threshold_s must be positive")
        self.threshold_s = threshold_s
        self.sample_s = sample_s
        self.depth = depth
        self.on_stall = on_stall or (lambda s: log.warning("%s", s.describe()))
        self.stalls = 0
        # (tick number, due on time.monotonic, when armed, the loop thread's schedstat then,
        # gc seconds and runs then) — written by the loop thread only
        self._armed: tuple[int, float, float, tuple[int, int] | None, float, int] = (
            0, 0.0, 0.0, None, 0.0, 0)  # fmt: skip
        # (tick number, when it fired, the loop thread's schedstat then)
        self._fired: tuple[int, float, tuple[int, int] | None] = (0, 0.0, None)
        self._fd: int | None = None  # the loop thread's /proc/self/task/<tid>/schedstat
        self._seq = 0
        self._ident: int | None = None  # the loop thread (threading.get_ident)
        self._tid: int | None = None  # ... and its native id
        self._gc_s = 0.0
        self._gc_runs = 0
        self._gc_t0 = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the loop's side (called on the loop thread) -----------------------------------------

    def arm(self, due: float) -> None:
        """The next tick is due at ``due`` (``time.monotonic()``)."""
        if self._ident is None:
            self._ident = threading.get_ident()
            self._tid = threading.get_native_id()
            try:
                self._fd = os.open(f"/proc/self/task/{self._tid}/schedstat", os.O_RDONLY)
            except OSError:  # not Linux: no CPU / run-queue figures
                self._fd = None
        self._seq += 1
        self._armed = (self._seq, due, time.monotonic(), self._own_schedstat(),
                       self._gc_s, self._gc_runs)  # fmt: skip

    def fired(self) -> None:
        """The armed tick fired (now)."""
        self._fired = (self._seq, time.monotonic(), self._own_schedstat())

    def _own_schedstat(self) -> tuple[int, int] | None:
        """The loop thread's (ns on a CPU, ns waiting for one), read on the loop thread
        itself: exact even when the watchdog thread gets no CPU during a stall."""
        fd = self._fd
        if fd is None:
            return None
        try:
            run, wait, _ = os.pread(fd, 128, 0).split(None, 2)
            return int(run), int(wait)
        except (OSError, ValueError):
            return None

    # ---- lifetime ------------------------------------------------------------------------------

    def start(self) -> StallWatch:
        if self._thread is None:
            gc.callbacks.append(self._on_gc)
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="kvroute-stallwatch",
                                            daemon=True)  # fmt: skip
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=1.0)
            self._thread = None
            if self._on_gc in gc.callbacks:
                gc.callbacks.remove(self._on_gc)
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self._gc_s += time.perf_counter() - self._gc_t0
            self._gc_runs += 1

    # ---- the watchdog thread -------------------------------------------------------------------

    def _run(self) -> None:
        stop = self._stop
        while not stop.is_set():
            armed = self._armed
            seq, due = armed[0], armed[1]
            if seq == 0 or self._fired[0] >= seq:  # not armed yet, or between fired and arm
                stop.wait(0.001)
                continue
            stop.wait(max(due + self.threshold_s - time.monotonic(), 0.0))
            if stop.is_set() or self._on_time(seq, due):
                continue
            # late: sample until it fires — or, when this thread got the GIL (or a CPU) only
            # after it fired, report it unsampled (one long C call holding the GIL shows so)
            try:
                self._sample(armed)
            except Exception:  # a diagnosis aid must never take the router down
                log.exception("stall watch: sampling failed")

    def _on_time(self, seq: int, due: float) -> bool:
        """Tick ``seq`` fired, and not more than the threshold late (or a later one fired too:
        this thread was held up past a whole tick, so when ``seq`` fired is not known)."""
        fired_seq, fired_at, _ = self._fired
        return fired_seq > seq or (fired_seq == seq and fired_at - due <= self.threshold_s)

    def _sample(self, armed: tuple[int, float, float, tuple[int, int] | None, float, int]) -> None:
        seq, due, armed_at, base, gc_s0, gc_runs0 = armed
        stop, ident, tid = self._stop, self._ident, self._tid
        skip = {threading.get_native_id(), *((tid,) if tid is not None else ())}
        others0 = _threads(skip)
        stacks: Counter[tuple[str, ...]] = Counter()
        last = due + self.threshold_s  # when the first sample was due
        max_gap = 0.0
        while self._fired[0] < seq and not stop.is_set():
            if time.monotonic() - due > MAX_SAMPLE_S:  # report a long stall while it lasts
                break
            now = time.monotonic()
            max_gap = max(max_gap, now - last)
            last = now
            frame = sys._current_frames().get(ident) if ident is not None else None
            stacks[_stack(frame, self.depth)] += 1
            del frame
            stop.wait(self.sample_s)
        if stop.is_set():
            return
        others1 = _threads(skip)
        fired_seq, fired_at, end = self._fired
        if fired_seq < seq:  # still going (MAX_SAMPLE_S): as of now
            fired_at, end = time.monotonic(), _schedstat(tid) if tid is not None else None
        late = fired_at - due
        busy: dict[str, float] = {}
        for t, (name, ns) in others1.items():
            d = ns - others0.get(t, (name, ns))[1]
            if d > 0:
                busy[name] = busy.get(name, 0.0) + d / 1e9
        cpu = wait = None
        if base is not None and end is not None:
            cpu, wait = (end[0] - base[0]) / 1e9, (end[1] - base[1]) / 1e9
        stall = Stall(
            late_s=late,
            loop_cpu_s=cpu,
            loop_wait_s=wait,
            gc_s=self._gc_s - gc_s0,
            gc_runs=self._gc_runs - gc_runs0,
            others=busy,
            stacks=stacks,
            max_gap_s=max_gap,
            window_s=fired_at - armed_at,
        )
        self.stalls += 1
        self.on_stall(stall)
