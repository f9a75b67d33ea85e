"""The sweep's CPU headroom record: a busy process is seen busy, an idle one idle, and the
saturation rule marks the point only for the reasons it names."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from loadtest.sweep.cpuwatch import BUSY_THREAD_P90, WAIT_SHARE, CpuWatch, judge

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads Linux /proc")


def _group(mean=0.5, busiest=0.5, wait=0.0):
    return {"mean_cores": mean, "p90_cores": mean, "busiest_thread_p90": busiest,
            "wait_share": wait, "threads": 1}  # fmt: skip


def test_judge_names_a_busy_event_loop_and_a_starved_process():
    assert judge({"router": _group(), "twins": _group()}) == {"saturated": False, "why": []}
    busy = judge({"router": _group(busiest=BUSY_THREAD_P90), "twins": _group()})
    assert busy["saturated"] and busy["why"][0].startswith("router: busiest thread")
    starved = judge({"client": _group(wait=WAIT_SHARE + 0.1)})
    assert starved["saturated"] and "waited for a CPU" in starved["why"][0]
    # an almost idle process that waited for its few wake-ups does not mark the point
    assert not judge({"twins": _group(mean=0.01, busiest=0.01, wait=0.9)})["saturated"]


def test_a_spinning_group_is_measured_busy_and_a_sleeping_one_idle():
    spin = "import time\nt=time.time()\nwhile time.time()-t<30: pass"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        for code in (spin, "import time; time.sleep(30)")
    ]
    try:
        time.sleep(0.3)
        w = CpuWatch({"spin": procs[0].pid, "sleep": procs[1].pid}, interval_s=0.2).start()
        time.sleep(2.0)
        rec = w.stop()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    g = rec["groups"]
    assert rec["available"] and rec["elapsed_s"] >= 1.9
    # loose bounds: the test machine is shared, a spinning thread still gets a good share
    assert g["spin"]["mean_cores"] > 0.3 and g["spin"]["busiest_thread_p90"] > 0.3
    assert g["sleep"]["mean_cores"] < 0.05
    assert 0 < rec["machine"]["busy_cores"] <= rec["machine"]["cpus"] + 0.1
