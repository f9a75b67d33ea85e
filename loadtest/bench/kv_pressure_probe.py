"""One seed of a bench_kv_pressure point, with how full the host tier got (issue 12).

Not a ``bench_*`` module (``make bench`` skips it): a check of whether a workload puts the host
tier under pressure at all — the peak host-tier occupancy over every replica and step, the
blocks it evicted and the share of hit blocks it served — before paying for 3 seeds.

    python -m loadtest.bench.kv_pressure_probe WORKLOAD LANES POLICY[,POLICY...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from costmodel.profiles import load_profile, with_overrides
from loadtest.bench.bench_kv_policy import STAGGER_S, TRACES, WARMUP_S, policy_spec
from loadtest.bench.bench_kv_pressure import OVERRIDES, WORKLOADS
from loadtest.sim.router_policy import RouterPolicy
from loadtest.sim.trace import simulate_trace
from loadtest.traces import load_trace
from loadtest.twin import engine as twin_engine


def main(argv: list[str]) -> int:
    wname, lanes, policies = argv[0], int(argv[1]), argv[2].split(",")
    fname, pname, n_rep, gap, _levels, _quick = WORKLOADS[wname]
    prof = with_overrides(load_profile(pname), OVERRIDES.get(wname, {}))
    trace = load_trace(Path(TRACES) / fname, max_gap_s=gap)
    peak = {"blocks": 0}
    settle = twin_engine.Engine._settle

    def counting(self: twin_engine.Engine) -> None:
        settle(self)
        if self.cpu is not None:
            peak["blocks"] = max(peak["blocks"], len(self.cpu))

    twin_engine.Engine._settle = counting  # type: ignore[method-assign]
    for pol in policies:
        peak["blocks"] = 0
        router_pol, hints, plugin = policy_spec(pol)
        t0 = time.perf_counter()
        s = simulate_trace(
            prof,
            n_rep,
            trace,
            RouterPolicy(router_pol, prof, seed=0, engine_hints=hints),
            concurrency=lanes,
            duration_s=900.0,
            seed=0,
            stagger_s=STAGGER_S,
            plugin=plugin,
        ).summary(warmup_s=WARMUP_S)
        hits = s["tier_hit_blocks"]
        print(
            f"{wname} c{lanes} {pol}: {s['throughput_tok_per_gpu_s']:.0f} tok/GPU-s, P90 "
            f"{s['p90_interactivity_tok_s']:.1f} tok/s, TTFT p90 {s['ttft_p90_s']:.2f} s, hit "
            f"{s['cache_hit_ratio']:.3f}, hit blocks gpu/host/storage {hits['gpu']}/"
            f"{hits['cpu']}/{hits['storage']}, host tier peak {peak['blocks']} of "
            f"{prof.cpu_kv_blocks} blocks ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
