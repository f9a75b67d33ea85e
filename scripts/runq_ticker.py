"""How long a thread that wants a CPU waits for one: ``python scripts/runq_ticker.py SECONDS OUT``.

A thread sleeps 1 ms in a loop; each wake-up more than 150 ms late is written to OUT with the
thread's CPU time and run-queue wait over the gap (``/proc/self/task/<tid>/schedstat``) and
the machine's steal time (``/proc/stat``). Start it in the session of the job it watches
(not under ``setsid``): with ``kernel.sched_autogroup_enabled=1`` a session is a scheduling
group of its own, and what it reads depends on the group it is in (docs/engine.md, "Bursts on
the vLLM-CPU test bed"). Linux only; standard library only.
"""

from __future__ import annotations

import sys
import threading
import time


def _schedstat(tid: int) -> tuple[float, float]:
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        run, wait, _ = f.read().split()
    return int(run) / 1e9, int(wait) / 1e9


def _steal_s() -> float:
    with open("/proc/stat") as f:
        return int(f.readline().split()[8]) / 100.0  # USER_HZ


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    tid = threading.get_native_id()
    end = time.monotonic() + float(argv[0])
    last, (run0, wait0), steal0 = time.monotonic(), _schedstat(tid), _steal_s()
    with open(argv[1], "w", buffering=1) as out:
        while time.monotonic() < end:
            time.sleep(0.001)
            now, (run1, wait1), steal1 = time.monotonic(), _schedstat(tid), _steal_s()
            if now - last > 0.15:
                out.write(f"{time.strftime('%H:%M:%S')} gap {now - last:.3f} run "
                          f"{run1 - run0:.3f} runq_wait {wait1 - wait0:.3f} "
                          f"steal {steal1 - steal0:.2f}\n")  # fmt: skip
            last, run0, wait0, steal0 = now, run1, wait1, steal1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
