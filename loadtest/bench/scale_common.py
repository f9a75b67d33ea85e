"""Shared by the scale bench's parts (:mod:`loadtest.bench.bench_scale`): the machine's load,
a process group's RSS and CPU from ``/proc``, percentiles, the load generator's HTTP client."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

PROFILE = "h200-70b-fp8"
BLOCK = 64  # the profile's block size: the router's KV layer hashes the same blocks


def machine_load() -> dict[str, Any]:
    """``/proc/loadavg`` and the processes at real-time priority (other benchmarks)."""
    out: dict[str, Any] = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        out["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        out["loadavg"] = None
    try:
        ps = subprocess.run(["ps", "-eo", "cls=,comm="], capture_output=True, text=True,
                            timeout=10).stdout.split("\n")  # fmt: skip
        rt: dict[str, int] = {}
        for line in ps:
            parts = line.split(None, 1)
            if len(parts) == 2 and parts[0] in ("RR", "FF"):
                rt[parts[1]] = rt.get(parts[1], 0) + 1
        # kernel threads (migration/N, ...) run FF too: only user processes are benches
        out["realtime_procs"] = {k: v for k, v in rt.items() if not k.startswith(
            ("migration", "watchdog", "idle_inject", "irq/", "rcu"))}  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        out["realtime_procs"] = None
    out["cpus"] = os.cpu_count()
    return out


def group_rss_mb(pgid: int | None) -> float:
    """RSS of every process in ``pgid`` but its leader (the reaper), MiB."""
    from loadtest.sweep.cpuwatch import _group_pids

    if pgid is None:
        return 0.0
    total = 0
    for pid in _group_pids(pgid):
        if pid == pgid:
            continue
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return total * os.sysconf("SC_PAGE_SIZE") / 2**20


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 2)


def client(limit: int = 0) -> Any:
    import aiohttp

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit),
        timeout=aiohttp.ClientTimeout(total=None, sock_read=120),
    )


def proc_cpu(pgid: int | None) -> dict[int, tuple[str, float]]:
    """pid -> (what it is, CPU seconds) for each process of a router's group: ``serve`` (a
    router process: the one, or with ``--workers`` the parent and each worker), ``analysis``
    (a multiprocessing child: the prompt analysis off the loop), ``reaper``."""
    from loadtest.sweep.cpuwatch import _group_pids

    out: dict[int, tuple[str, float]] = {}
    if pgid is None:
        return out
    tick = os.sysconf("SC_CLK_TCK")
    for pid in _group_pids(pgid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        f = stat[stat.rindex(")") + 2 :].split()
        what = ("reaper" if "loadtest.reaper" in cmd
                else "analysis" if "multiprocessing" in cmd else "serve")  # fmt: skip
        out[pid] = (what, (int(f[11]) + int(f[12])) / tick)
    return out


def per_proc(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], calls: int
) -> dict[str, float]:
    """The router group's CPU per call (ms) by process, busiest first within a kind."""
    if not calls:
        return {}
    used: dict[str, list[float]] = {}
    for pid, (what, cpu) in after.items():
        used.setdefault(what, []).append(cpu - before.get(pid, (what, 0.0))[1])
    out: dict[str, float] = {}
    for what, xs in sorted(used.items()):
        for i, x in enumerate(sorted(xs, reverse=True)):
            out[what if len(xs) == 1 else f"{what}{i + 1}"] = round(x * 1e3 / calls, 2)
    return out


def cpu_groups(rec: dict[str, Any], calls: int, router: str | None) -> dict[str, Any]:
    """Cores each group used over the trial; the router's CPU per call."""
    out: dict[str, Any] = {}
    if not rec.get("available"):
        return {"cpu": "not measured (no /proc)"}
    el = rec["elapsed_s"] or 1.0
    for name, g in rec["groups"].items():
        out[f"{name}_cores"] = g["mean_cores"]
        out[f"{name}_wait_share"] = g["wait_share"]
        out[f"{name}_busiest_thread_p90"] = g["busiest_thread_p90"]
        if name == router and calls:
            out["router_cpu_ms_per_call"] = round(g["mean_cores"] * el * 1e3 / calls, 2)
    out["machine_busy_cores"] = rec["machine"]["busy_cores"]
    out["saturated"] = rec["saturated"]
    return out
