"""Prefill cadence trade-off on real vLLM-CPU: decode ITL and TTFT for N = 1/2/4 with vLLM's
guard (capacity escape) and with the plugin's bounded guard, under light/heavy/overload mixes.

    .venv/bin/python -m loadtest.bench.bench_cadence [--intervals 1,2,4] [--guards vllm,bounded]
        [--mixes light,heavy,overload] [--duration 15] [--budget 4096] [--backlog-scale 16]
        [--seeds 0,1,2] [--json out.json]

One replica per (N, guard), started with the plugin's scheduler class
(``engine_patches.scheduler.CadenceScheduler``; ``guard: vllm`` drives vLLM's own
``throttle_prefills`` every N-th step and keeps its ``prefill_capacity_bound`` escape, i.e. what
vLLM's DP engine does; ``N = 1`` is plain vLLM). Each mix runs ``decoders`` long decodes
continuously and Poisson arrivals of long prompts (short outputs) on top.

Decode ITL comes from the scheduler's step trace (engine side: the wall time of every step
that carried decodes, weighted by its decodes), because streamed chunks reach the client in
bursts on this box (docs/vllm-facts.md). TTFT is the client's time to the first streamed
token of the arriving prompts. Needs the vLLM-CPU venv with the plugin (``make setup``).

``make bench`` lists it as slow (``SLOW``) and runs it with ``--slow`` or
``--only cadence``: ``run(quick=True)`` is N = 1 / 2 with the bounded guard on the heavy mix
for 5 s each.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import operator
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from engine_patches.cadence import read_trace
from loadtest import tinymodel
from loadtest.vllmbed import ReplicaConfig, VllmBed


@dataclass(frozen=True)
class Mix:
    name: str
    rate: float  # arrivals per second
    prompt_tokens: int
    decoders: int = 4
    decode_tokens: int = 1500
    decoder_prompt: int = 200


MIXES = {
    "light": Mix("light", rate=1.0, prompt_tokens=1000),
    "heavy": Mix("heavy", rate=6.0, prompt_tokens=1000),
    "overload": Mix("overload", rate=20.0, prompt_tokens=1000),
}


def text(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(tinymodel._WORDS) for _ in range(n))


async def run_mix(url: str, mix: Mix, duration: float, seed: int) -> dict:
    rng = random.Random(seed)  # prompt texts
    gaps = random.Random(seed + 1)  # arrival times: the same schedule for every config
    ttfts: list[float] = []
    errors = 0
    stop = time.monotonic() + duration
    async with httpx.AsyncClient(timeout=300) as http:

        async def decoder(i: int) -> None:
            nonlocal errors
            k = 0
            while time.monotonic() < stop:
                body = {"model": "tiny", "prompt": text(mix.decoder_prompt, rng),
                        "max_tokens": mix.decode_tokens, "ignore_eos": True}  # fmt: skip
                r = await http.post(url + "/v1/completions", json=body)
                errors += r.status_code != 200
                k += 1

        async def arrival() -> None:
            nonlocal errors
            body = {"model": "tiny", "prompt": text(mix.prompt_tokens, rng), "max_tokens": 16,
                    "ignore_eos": True, "stream": True}  # fmt: skip
            t0 = time.monotonic()
            async with http.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    errors += 1
                    return
                first = None
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.monotonic() - t0
                if first is not None:
                    ttfts.append(first)

        t_start = time.monotonic()
        decs = [asyncio.create_task(decoder(i)) for i in range(mix.decoders)]
        await asyncio.sleep(1.0)
        arrivals = []
        # a fixed schedule (absolute times; a late client catches up): the same offered load
        # for every config even when the client is short of CPU
        due = time.monotonic()
        while due < stop:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            arrivals.append(asyncio.create_task(arrival()))
            due += gaps.expovariate(mix.rate)
        await asyncio.gather(*arrivals)
        t_end = time.monotonic()
        await asyncio.gather(*decs)
    return {"t_start": t_start, "t_end": t_end, "ttft": ttfts, "errors": errors,
            "arrivals": len(arrivals)}  # fmt: skip


def itl_from_trace(steps: list[dict], t0: float, t1: float) -> list[float]:
    """Per-token decode ITL samples (s): each step with decodes, weighted by its decodes."""
    out: list[float] = []
    for a, b in itertools.pairwise(steps):
        if t0 <= a["t"] <= t1 and a["decodes"] > 0:
            out += [b["t"] - a["t"]] * a["decodes"]
    return out


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def bench(
    intervals: list[int], guards: list[str], mixes: list[str], duration: float,
    backlog_scale: float = 16.0, budget: int = 4096, seeds: tuple[int, ...] = (0,),
) -> list:  # fmt: skip
    """One row per (N, guard, mix, seed); a seed is a schedule of arrivals and prompt texts
    (seed 0: the schedule of the runs before ``--seeds`` existed), run on the config's one
    replica after the seeds before it."""
    model = tinymodel.ensure()
    rows = []
    configs = [(1, "vllm")] if 1 in intervals else []
    configs += [(n, g) for n in intervals if n > 1 for g in guards]
    for n, guard in configs:
        work = Path(tempfile.mkdtemp(prefix="kvroute-cadence-"))
        trace = work / "steps.jsonl"
        cad = {"interval": n, "guard": guard, "max_defer_steps": 16, "max_defer_ms": 500.0,
               "backlog_scale": backlog_scale, "trace_path": str(trace)}  # fmt: skip
        cfg = ReplicaConfig(
            name=f"n{n}-{guard}", model_dir=model, kv_cache_bytes=64 << 20, cpu=1,
            extra_args=["--scheduler-cls", "engine_patches.scheduler.CadenceScheduler",
                        "--additional-config", json.dumps({"kvroute": {"cadence": cad}}),
                        "--max-num-batched-tokens", str(budget)],
        )  # fmt: skip
        with VllmBed([cfg], workdir=work) as bed:
            url = bed.replicas[0].url
            for (i, m), seed in itertools.product(enumerate(mixes), seeds):
                res = asyncio.run(run_mix(url, MIXES[m], duration, seed=100 + i + 1000 * seed))
                time.sleep(0.5)
                steps = read_trace(trace)[0]
                itl = itl_from_trace(steps, res["t_start"], res["t_end"])
                held = [h[0] for s in steps if res["t_start"] <= s["t"] <= res["t_end"]
                        for h in s["held"].values()]  # fmt: skip
                row = {
                    "interval": n, "guard": "none" if n == 1 else guard, "mix": m, "seed": seed,
                    "itl_p50_ms": pct(itl, 50) * 1e3, "itl_p90_ms": pct(itl, 90) * 1e3,
                    "ttft_p50_ms": pct(res["ttft"], 50) * 1e3,
                    "ttft_p90_ms": pct(res["ttft"], 90) * 1e3,
                    "arrivals": res["arrivals"], "errors": res["errors"],
                    "max_held_steps": max(held, default=0),
                }  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
        shutil.rmtree(work, ignore_errors=True)
    return rows


SLOW = "real vLLM-CPU replicas, one per (N, guard): ~20 min (--quick: ~2 min)"


def run(quick: bool = False) -> list[dict]:
    """``make bench``'s entry: the default grid, or a small one with ``quick``."""
    if quick:
        return bench([1, 2], ["bounded"], ["heavy"], 5.0)
    return bench([1, 2, 4], ["vllm", "bounded"], list(MIXES), 15.0)


def table(rows: list[dict]) -> str:
    """One line per (mix, N, guard): each figure's median over the seeds, with min–max when
    there are several."""

    def fig(xs: list[float], f: str) -> str:
        mid = format(float(np.median(xs)), f)
        return mid if len(xs) == 1 else f"{mid} ({min(xs):{f}}–{max(xs):{f}})"

    out = ["| mix | N | guard | seeds | decode ITL p50 / p90 (ms) | TTFT p50 / p90 (ms) | "
           "arrivals |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    key = operator.itemgetter("mix", "interval", "guard")
    for k, group in itertools.groupby(sorted(rows, key=key), key=key):
        g = list(group)
        col = {c: [r[c] for r in g] for c in g[0] if c.endswith("_ms") or c == "arrivals"}
        out.append(
            f"| {k[0]} | {k[1]} | {k[2]} | {len(g)} | {fig(col['itl_p50_ms'], '.1f')} / "
            f"{fig(col['itl_p90_ms'], '.1f')} | {fig(col['ttft_p50_ms'], '.0f')} / "
            f"{fig(col['ttft_p90_ms'], '.0f')} | {fig(col['arrivals'], '.0f')} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--intervals", default="1,2,4")
    p.add_argument("--guards", default="vllm,bounded")
    p.add_argument("--mixes", default="light,heavy,overload")
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--backlog-scale", type=float, default=16.0)
    p.add_argument("--budget", type=int, default=4096, help="--max-num-batched-tokens")
    p.add_argument("--seeds", default="0", help="arrival schedules, run one after another")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    rows = bench([int(x) for x in a.intervals.split(",")], a.guards.split(","),
                 a.mixes.split(","), a.duration, a.backlog_scale, a.budget,
                 tuple(int(x) for x in a.seeds.split(",")))  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
