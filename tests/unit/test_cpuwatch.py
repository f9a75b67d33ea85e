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
    # loose bounds: the test machine is shared (at a load of 6 on 2 cores a spinning thread
    # gets ~0.3 of a core), but a spinner still gets far more than a sleeper's nothing
    assert g["spin"]["mean_cores"] > 0.1 and g["spin"]["busiest_thread_p90"] > 0.1
    assert g["sleep"]["mean_cores"] < 0.05
    assert g["spin"]["mean_cores"] > 5 * g["sleep"]["mean_cores"]
    assert 0 < rec["machine"]["busy_cores"] <= rec["machine"]["cpus"] + 0.1


def test_aggregate_pools_ttft_over_the_used_seeds_after_warmup(tmp_path):
    """The pooled TTFT p90 reads every used point's calls after its warm-up (modelled
    seconds, speedup applied) and leaves saturated points out."""
    import json

    from loadtest.sweep.bench import aggregate

    def point(seed, ttfts, saturated=False):
        d = tmp_path / "points" / "t" / f"s{seed}"
        d.mkdir(parents=True)
        # run clock at speedup 2: warm-up 10 modelled s = 5 s; the first call is before it
        rows = [{"ok": True, "t_start": 1.0, "ttft_s": 99.0}]
        rows += [{"ok": True, "t_start": 6.0 + i, "ttft_s": x} for i, x in enumerate(ttfts)]
        rows.append({"ok": False, "t_start": 7.0, "ttft_s": None})
        (d / "calls.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        return {"target": "t", "concurrency": 1, "seed": seed, "dir": f"points/t/s{seed}",
                "cpu": {"saturated": saturated},
                "summary": {"speedup": 2.0, "ttft_p90_s": max(ttfts) * 2}}  # fmt: skip

    pts = [point(0, [0.1] * 9 + [1.0]), point(1, [0.2] * 10), point(2, [50.0] * 10, True)]
    (row,) = aggregate(pts, tmp_path, warmup_s=10.0)
    assert row["used"] == 2 and row["pooled_calls"] == 20
    # 20 calls, ×2 for the speedup: 9 × 0.2, 10 × 0.4, 1 × 2.0 — p90 is the 18th: 0.4
    assert row["ttft_p90_pooled_s"] == 0.4 and row["ttft_p99_pooled_s"] == 2.0
    assert "ttft_p90_pooled_s" not in aggregate(pts)[0]  # no folder: no pooled figures
