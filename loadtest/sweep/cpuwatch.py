"""CPU headroom of a benchmark point's processes, so a CPU-saturated point is marked, not used.

Owns: :class:`CpuWatch`, a background thread that samples, once a ``interval_s``, every thread
of each watched process group (the twin cluster, the router, the client) from Linux's
``/proc/<pid>/task/<tid>/stat`` (CPU time) and ``.../schedstat`` (time spent runnable but
waiting for a CPU), plus the machine's ``/proc/stat``; and :func:`judge`, the rule that marks a
point saturated. Standard library only; on a system without ``/proc`` it records nothing and
says so.

Two ways a process can be short of CPU, and both are recorded per group:

* **its own ceiling**: a Python server's event loop is one thread; when that thread is busy
  ≥ ``BUSY_THREAD_P90`` of a core in 90% of the samples, the process is the bottleneck of the
  point (``busiest_thread_p90``);
* **starved by others**: time runnable but not running, as a share of (running + waiting)
  (``wait_share``, from schedstat's run delay); ≥ ``WAIT_SHARE`` means the machine, not the
  policy, decided its latency.

Figures are cores (1.0 = one CPU busy for the whole interval).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUSY_THREAD_P90 = 0.90  # a group's busiest thread, p90 over samples, in cores
WAIT_SHARE = 0.5  # run-queue wait / (CPU + wait) over the point: waited longer than it ran
MIN_ACTIVE_CORES = 0.05  # below this mean a group's wait share is noise (idle processes)

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PROC = Path("/proc")


def _task_sample(pid: int) -> dict[int, tuple[float, float]]:
    """tid -> (CPU seconds, run-queue wait seconds) for every thread of ``pid``."""
    out: dict[int, tuple[float, float]] = {}
    try:
        tids = os.listdir(_PROC / str(pid) / "task")
    except OSError:
        return out
    for t in tids:
        base = _PROC / str(pid) / "task" / t
        try:
            stat = (base / "stat").read_text()
            sched = (base / "schedstat").read_text().split()
        except OSError:
            continue  # the thread ended between listdir and read
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        cpu = (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime
        wait = int(sched[1]) / 1e9 if len(sched) > 1 else 0.0
        out[int(t)] = (cpu, wait)
    return out


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for name in os.listdir(_PROC):
        if not name.isdigit():
            continue
        try:
            stat = (_PROC / name / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:  # field 5 of stat: process group id
            pids.append(int(name))
    return pids


def scheduling() -> str:
    """This process's scheduling policy and priority, as the record states it: a benchmark
    on a shared machine may run under ``chrt -r 1`` (SCHED_RR) so concurrent jobs delay it
    less; its children (twins, routers) inherit that."""
    try:
        pol = os.sched_getscheduler(0)
        prio = os.sched_getparam(0).sched_priority
    except (AttributeError, OSError):
        return "unknown"
    names = {os.SCHED_OTHER: "SCHED_OTHER", getattr(os, "SCHED_RR", -1): "SCHED_RR",
             getattr(os, "SCHED_FIFO", -2): "SCHED_FIFO"}  # fmt: skip
    return f"{names.get(pol, str(pol))} {prio} nice {os.nice(0)}"


def normal_priority(pgid: int) -> int:
    """Put every thread of process group ``pgid`` back on SCHED_OTHER (a real engine on CPU
    stands for the GPU: under a real-time bench it would starve the router it is measured
    against). Returns the threads changed."""
    n = 0
    for pid in _group_pids(pgid):
        try:
            tids = os.listdir(_PROC / str(pid) / "task")
        except OSError:
            continue
        for t in tids:
            try:
                if os.sched_getscheduler(int(t)) != os.SCHED_OTHER:
                    os.sched_setscheduler(int(t), os.SCHED_OTHER, os.sched_param(0))
                    n += 1
            except OSError:
                continue
    return n


def _machine_busy() -> tuple[float, float]:
    """(busy seconds, total seconds) summed over CPUs, from /proc/stat's first line."""
    vals = [int(x) for x in (_PROC / "stat").read_text().splitlines()[0].split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    total = sum(vals[:8])  # guest time is already counted in user
    return (total - idle) / _TICK, total / _TICK


@dataclass
class _Group:
    name: str
    pgid: int | None  # None: only this process (the client)
    last: dict[int, tuple[float, float]] = field(default_factory=dict)
    cpu_s: float = 0.0
    wait_s: float = 0.0
    samples: list[float] = field(default_factory=list)  # group cores per interval
    busiest: list[float] = field(default_factory=list)  # busiest thread's cores per interval
    peak_threads: int = 0

    def sample(self) -> dict[int, tuple[float, float]]:
        pids = [os.getpid()] if self.pgid is None else _group_pids(self.pgid)
        now: dict[int, tuple[float, float]] = {}
        for p in pids:
            now.update(_task_sample(p))
        return now


class CpuWatch:
    """``CpuWatch({"twins": pgid, "router": pgid, "client": None}).start()`` … ``.stop()``."""

    def __init__(
        self,
        groups: dict[str, int | None],
        interval_s: float = 1.0,
        judged: set[str] | None = None,
    ):
        """``judged``: the groups whose saturation marks the point (default: all). A real
        engine on CPU is meant to be busy: its group is recorded, not judged."""
        self.groups = [_Group(n, g) for n, g in groups.items()]
        self.judged = judged
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._elapsed = 0.0
        self._machine0: tuple[float, float] | None = None
        self._machine1: tuple[float, float] | None = None
        self.available = _PROC.joinpath("self", "task").is_dir()

    def start(self) -> CpuWatch:
        if not self.available:
            return self
        for g in self.groups:
            g.last = g.sample()
        self._machine0 = _machine_busy()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="cpuwatch", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        last_t = self._t0
        while not self._stop.wait(self.interval_s):
            now_t = time.monotonic()
            self._tick(now_t - last_t)
            last_t = now_t
        self._tick(time.monotonic() - last_t)

    def _tick(self, dt: float) -> None:
        if dt <= 0:
            return
        for g in self.groups:
            now = g.sample()
            cpu = wait = busiest = 0.0
            for tid, (c, w) in now.items():
                c0, w0 = g.last.get(tid, (c, w))  # a new thread counts from its first sample
                cpu += c - c0
                wait += w - w0
                busiest = max(busiest, (c - c0) / dt)
            g.last = now
            g.cpu_s += cpu
            g.wait_s += wait
            g.samples.append(cpu / dt)
            g.busiest.append(busiest)
            g.peak_threads = max(g.peak_threads, len(now))

    def stop(self) -> dict[str, Any]:
        """Stop sampling and return the point's CPU record (see :func:`judge`)."""
        if not self.available:
            return {"available": False, "saturated": None, "why": ["no /proc: not measured"]}
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._elapsed = time.monotonic() - self._t0
        self._machine1 = _machine_busy()
        groups = {}
        for g in self.groups:
            groups[g.name] = {
                "mean_cores": round(g.cpu_s / self._elapsed, 3) if self._elapsed else None,
                "p90_cores": round(_quantile(g.samples, 0.9), 3),
                "busiest_thread_p90": round(_quantile(g.busiest, 0.9), 3),
                "wait_share": round(g.wait_s / (g.cpu_s + g.wait_s), 3)
                if g.cpu_s + g.wait_s > 0
                else 0.0,
                "threads": g.peak_threads,
            }
        m0, m1 = self._machine0, self._machine1
        assert m0 is not None and m1 is not None
        ncpu = os.cpu_count() or 1
        machine = {
            "cpus": ncpu,
            "busy_cores": round((m1[0] - m0[0]) / self._elapsed, 3) if self._elapsed else None,
        }
        rec: dict[str, Any] = {
            "available": True,
            "scheduling": scheduling(),
            "interval_s": self.interval_s,
            "elapsed_s": round(self._elapsed, 1),
            "groups": groups,
            "machine": machine,
        }
        rec.update(judge({k: v for k, v in groups.items() if not self.judged or k in self.judged}))
        return rec


def judge(groups: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``{"saturated": bool, "why": [...]}``: which group hit its own ceiling or was starved."""
    why = []
    for name, g in groups.items():
        if g["busiest_thread_p90"] >= BUSY_THREAD_P90:
            why.append(f"{name}: busiest thread p90 {g['busiest_thread_p90']:.2f} cores")
        if (g["mean_cores"] or 0.0) >= MIN_ACTIVE_CORES and g["wait_share"] >= WAIT_SHARE:
            why.append(f"{name}: waited for a CPU {g['wait_share']:.0%} of its runnable time")
    return {"saturated": bool(why), "why": why}


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]
