"""kv_cost through the real HTTP path: router + twin cluster + the replay harness, in process.

One process runs a twin cluster (``h200-70b-fp8``, time compressed by ``speedup``; the twins
publish KV events to the router's bound subscriber), the router app with the KV layer
(:class:`router.kv.state.KVState`: incremental tokens, block index, kv view,
observer) and the closed-loop replay client on the weka-dev trace (real Claude Code
sessions). Each policy gets a fresh cluster (cold caches) and the same trace and concurrency.
Client, router and twins share this machine's CPUs, so compare policies within one run.

Rows: per policy — calls, token cache-hit ratio, TTFT p50/p90 (model seconds), P90
interactivity, tokens per GPU-second (as the replay harness computes them).
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from costmodel.profiles import load_profile

TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces" / "weka-dev.tar.gz"
POLICIES = ("round_robin", "session_affinity", "llmd", "sglang_tree", "kv_cost")


async def _point(
    policy: str, trace, builder, prof, n_rep: int, conc: int, dur: float, speedup: float
) -> dict:
    from loadtest import tinymodel
    from loadtest.replay.runner import ReplayConfig, replay
    from loadtest.twin.cluster import start_cluster
    from router.app import build_app, start_site
    from router.config import RouterConfig
    from router.kv.config import KVConfig
    from router.kv.state import KVState
    from router.vllm.tokenizer import ModelTokenizer

    st = KVState(
        KVConfig(block_size=prof.block_size, events_bind="tcp://127.0.0.1:0", time_scale=speedup),
        tokenizer=ModelTokenizer.from_dir(tinymodel.ensure()),
        profile=prof,
    )
    await st.start()
    try:
        async with start_cluster(n_rep, prof, speedup=speedup, kv_events=st.events_endpoint) as c:
            st.cfg.topics.update(zip(c.topics, c.urls, strict=True))
            # generous health timeouts: client, router and twins share one event loop here
            app = build_app(
                RouterConfig(
                    replicas=c.urls,
                    policy=policy,
                    metrics_interval_s=0.2,
                    health_timeout_s=15.0,
                    health_interval_s=5.0,
                ),
                kv=st,
            )
            runner, url = await start_site(app)
            try:
                cfg = ReplayConfig(
                    target=url,
                    model="tiny",
                    concurrency=conc,
                    duration_s=dur,
                    grace_s=5.0,
                    time_scale=speedup,
                    speedup=speedup,
                    gpus=n_rep,
                    metrics_urls=[u + "/metrics" for u in c.urls],
                    progress=False,
                )
                with tempfile.TemporaryDirectory() as d:
                    s = await replay(trace, builder, cfg, d)
            finally:
                await runner.cleanup()
    finally:
        await st.close()
    return s


def run(quick: bool = False) -> list[dict]:
    from loadtest import tinymodel
    from loadtest.prompts import PromptBuilder
    from loadtest.traces import load_trace

    prof = load_profile("h200-70b-fp8")
    n_rep, conc = (4, 8) if quick else (4, 16)
    dur = 20.0 if quick else 60.0
    speedup = 20.0
    trace = load_trace(TRACE, max_sessions=32, max_gap_s=30.0)
    builder = PromptBuilder(
        tinymodel.ensure(),
        block_size=prof.block_size,
        trace_block_size=trace.block_size,
        max_prompt_tokens=prof.max_model_len - 8192,
    )
    rows = []
    for pol in POLICIES:
        s = asyncio.run(_point(pol, trace, builder, prof, n_rep, conc, dur, speedup))
        rows.append(
            {
                "name": f"weka_dev_{n_rep}x{prof.name}_c{conc}_{pol}",
                "policy": pol,
                "requests": s.get("requests_ok"),
                "hit_ratio": round(s["cache_hit_ratio"], 3),
                "hit_bound": round(s["cache_hit_bound"], 3),
                "ttft_p50_s": round(s["ttft_p50_s"], 2),
                "ttft_p90_s": round(s["ttft_p90_s"], 2),
                "p90_interactivity": round(s["p90_interactivity_tok_s"], 1),
                "tok_per_gpu_s": round(s["tokens_per_gpu_s"]),
            }
        )
    return rows
