"""Agentic replay on 2 real vLLM-CPU replicas behind kvroute, with and without the engine
plugin's host tier and retention hints: hit ratio by tier, TTFT p90, session completion.

    .venv/bin/python -m loadtest.bench_engine_replay [--configs vllm,tiers,tiers+hints]
        [--trace SPEC] [--concurrency 8] [--json out.json]

Each config starts two replicas (8192 tokens of engine KV each, so the pooled cache is smaller
than the trace's working set) with ``kvroute engine flags`` words, puts the router in front
(``session_affinity``; ``engine_hints`` on for ``tiers+hints``), replays the trace through it
with ``kvroute replay``'s runner, and reads the replicas' ``cached_by_source`` counters:

* ``vllm``: ``--preset prefix`` (vLLM's prefix cache only);
* ``tiers``: plus a 16384-token host tier per replica (LRU);
* ``tiers+hints``: the host tier with ``AgentRetentionPolicy`` and router hints.

No cadence in any of them (measured separately: ``loadtest.bench_cadence``). Needs the
vLLM-CPU venv with the plugin (``make setup``).
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
from loadtest.prompts import PromptBuilder
from loadtest.replay.runner import ReplayConfig, replay
from loadtest.traces import load_trace
from loadtest.vllmbed import ReplicaConfig, VllmBed
from router.app import build_app, start_site
from router.config import RouterConfig
from router.replicas import cached_by_source

TRACE = (
    "synthetic:sessions=16,calls_median=6,calls_sigma=0.3,prefix_tokens=1200,"
    "first_user_tokens=300,growth_median=250,output_median=8,gap_median_s=2.0,"
    "subagent_prob=0.3,subagent_calls_median=3,subagent_prefix_tokens=400,"
    "max_context_tokens=3800,seed=11"
)
CONFIGS = ("vllm", "tiers", "tiers+hints")
HOST_BYTES = 32 << 20  # 16384 tokens of the tiny model


async def run_config(name: str, trace_spec: str, concurrency: int, work: Path) -> dict[str, Any]:
    model = tinymodel.ensure()
    if name == "vllm":
        words = presets.flags(presets.EngineOptions(preset="prefix"))
    else:
        words = presets.flags(
            presets.EngineOptions(cadence=None, host_tier_bytes=HOST_BYTES,
                                  retention=name == "tiers+hints")
        )  # fmt: skip
    cfgs = [
        ReplicaConfig(name=f"{i}", model_dir=model, kv_cache_bytes=16 << 20, cpu=i,
                      extra_args=words)
        for i in range(2)
    ]  # fmt: skip
    with VllmBed(cfgs, workdir=work / name) as bed:
        urls = [r.url for r in bed]
        app = build_app(RouterConfig(replicas=urls, policy="session_affinity",
                                     engine_hints=name == "tiers+hints",
                                     health_interval_s=1.0, metrics_interval_s=1.0))  # fmt: skip
        runner, url = await start_site(app)
        try:
            trace = load_trace(trace_spec)
            builder = PromptBuilder(model, block_size=32, trace_block_size=trace.block_size,
                                    max_prompt_tokens=4000)  # fmt: skip
            metrics = [u + "/metrics" for u in urls]
            rc = ReplayConfig(target=url, concurrency=concurrency, convention="claude",
                              progress=False, metrics_urls=metrics)  # fmt: skip
            summary = await replay(trace, builder, rc, work / name / "replay")
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
    }


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| config | hit ratio (bound) | cached tokens device / host | TTFT p50 / p90 (ms) | "
           "session completion p90 (s) | calls ok / failed |",
           "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        out.append(
            f"| {r['config']} | {r['cache_hit_ratio']:.3f} ({r['cache_hit_bound']:.3f}) | "
            f"{r['cached_device']:.0f} / {r['cached_host']:.0f} | "
            f"{r['ttft_p50_s'] * 1e3:.0f} / {r['ttft_p90_s'] * 1e3:.0f} | "
            f"{r['session_completion_p90_s']:.1f} | {r['requests_ok']} / {r['requests_failed']} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--trace", default=TRACE)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvroute-engine-replay-"))
    rows = []
    for name in a.configs.split(","):
        row = asyncio.run(run_config(name, a.trace, a.concurrency, work))
        print(json.dumps(row), flush=True)
        rows.append(row)
    shutil.rmtree(work, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
