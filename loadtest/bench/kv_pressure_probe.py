"""One seed of a bench_kv_pressure point, with how full the host tier got (issue 12).

Not a ``bench_*`` module (``make bench`` skips it): a check of whether a workload puts the host
tier under pressure at all — the peak host-tier occupancy over every replica and step, the
blocks it evicted and the share of hit blocks it served — before paying for 3 seeds; then,
per replica, the calls after warm-up, their hit ratio and TTFT p50 (where a policy left a
replica thrashing).

    python -m loadtest.bench.kv_pressure_probe WORKLOAD LANES POLICY[,POLICY...] [SEED]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from costmodel.profiles import load_profile, with_overrides
from loadtest.bench.bench_kv_policy import KV_SETTINGS, STAGGER_S, TRACES, WARMUP_S, policy_spec
from loadtest.bench.bench_kv_pressure import OVERRIDES, WORKLOADS
from loadtest.sim.router_policy import RouterPolicy
from loadtest.sim.trace import simulate_trace
from loadtest.traces import load_trace
from loadtest.twin import engine as twin_engine
from loadtest.twin.engine_tiers import EngineTiers


def main(argv: list[str]) -> int:
    wname, lanes, policies = argv[0], int(argv[1]), argv[2].split(",")
    seed = int(argv[3]) if len(argv) > 3 else 0
    fname, pname, n_rep, gap, _levels, _quick = WORKLOADS[wname]
    prof = with_overrides(load_profile(pname), OVERRIDES.get(wname, {}))
    trace = load_trace(Path(TRACES) / fname, max_gap_s=gap)
    peak = {"blocks": 0}
    settle = twin_engine.Engine._settle

    def counting(self: EngineTiers) -> None:  # the signature of the _settle it wraps
        settle(self)
        if self.cpu is not None:
            peak["blocks"] = max(peak["blocks"], len(self.cpu))

    twin_engine.Engine._settle = counting  # type: ignore[method-assign]
    for pol in policies:
        peak["blocks"] = 0
        router_pol, hints, plugin = policy_spec(pol)
        t0 = time.perf_counter()
        res = simulate_trace(
            prof,
            n_rep,
            trace,
            RouterPolicy(
                router_pol, prof, seed=seed, engine_hints=hints, kv_settings=KV_SETTINGS.get(pol)
            ),
            concurrency=lanes,
            duration_s=900.0,
            seed=seed,
            stagger_s=STAGGER_S,
            plugin=plugin,
        )
        s = res.summary(warmup_s=WARMUP_S)
        hits = s["tier_hit_blocks"]
        print(
            f"{wname} c{lanes} {pol}: {s['throughput_tok_per_gpu_s']:.0f} tok/GPU-s, P90 "
            f"{s['p90_interactivity_tok_s']:.1f} tok/s, TTFT p90 {s['ttft_p90_s']:.2f} s, hit "
            f"{s['cache_hit_ratio']:.3f}, hit blocks gpu/host/storage {hits['gpu']}/"
            f"{hits['cpu']}/{hits['storage']}, host tier peak {peak['blocks']} of "
            f"{prof.cpu_kv_blocks} blocks ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        for i in range(n_rep):
            rs = [r for r in res.records if r.replica == i and r.arrival >= WARMUP_S]
            prompt = sum(r.prompt_tokens for r in rs)
            if rs and prompt:
                print(f"  replica {i}: {len(rs)} calls, hit "
                      f"{sum(r.cached_tokens for r in rs) / prompt:.3f}, "
                      f"{prompt / len(rs) / 1000:.0f}k prompt tokens per call, TTFT p50 "
                      f"{statistics.median(r.ttft for r in rs):.1f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
