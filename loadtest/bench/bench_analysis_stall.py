"""Event-loop stall while the router analyzes cold prompts (issue 13): a Mooncake replay's
prompts through the KV layer's analyzer, on the loop (the old path) vs off it (the analysis
thread of :meth:`router.kv.state.KVState.analyze`).

The bundled Mooncake slice (``loadtest/data/mooncake-slice.jsonl.gz``): every line is a
one-call session, so every prompt is cold (a full tokenization + hash). Each call's prompt is
``input_length`` words of the tiny model's vocabulary (~1 token per word), capped at
``MAX_WORDS``; calls arrive every ``GAPS_S`` (compressed trace time; at 0.05 s the cold work
arrives faster than two cores can tokenize it).
A 1 ms ticker on the same loop records how late it runs: that lateness is what every other
stream through the process would see. Rows: stall p50 / p99 / max, and the calls' own wait
for their analysis (off the loop a call waits only for its own, and not behind another
cold one: it is then placed on what is known).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import statistics
import time
from importlib import resources
from typing import Any

from loadtest import tinymodel
from loadtest.bench.looplag import LoopLag
from router.kv.config import KVConfig
from router.kv.state import KVState
from router.scheduling import RequestContext
from router.sessions import SessionIdentity
from router.vllm.prompt import request_prompt
from router.vllm.tokenizer import ModelTokenizer

GAPS_S = (0.05, 0.5)  # between arrivals: an overload (cold work outruns the CPU) and not
MAX_WORDS = 150_000


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _calls(n: int) -> list[int]:
    raw = resources.files("loadtest").joinpath("data/mooncake-slice.jsonl.gz").read_bytes()
    lines = [json.loads(x) for x in gzip.decompress(raw).splitlines() if x.strip()]
    return [min(int(d["input_length"]), MAX_WORDS) for d in lines[:n]]


def _ctx(i: int, text: str) -> RequestContext:
    ident = SessionIdentity("t", f"mc{i}", None, None, False, "bench")
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 8}
    return RequestContext(f"r{i}", "/v1/chat/completions", "tiny", ident, body)


async def _replay(st: KVState, texts: list[str], off_loop: bool, gap_s: float) -> dict[str, Any]:

    waits: list[float] = []
    keyed = 0

    async def one(i: int, text: str) -> None:
        nonlocal keyed
        c = _ctx(i, text)
        t0 = time.perf_counter()
        if off_loop:
            pending = st.analyze(c)
            if pending is not None:
                await pending
        else:  # the pre-issue-13 analyzer: render + tokenize + hash on the loop
            assert st.tokens is not None and st.tokenizer is not None
            p = request_prompt(st.tokenizer, c.route, c.body)
            assert p is not None
            c.block_keys = st.tokens.prompt(p.text, session=c.identity.key).keys
        waits.append(time.perf_counter() - t0)
        keyed += bool(c.block_keys)

    if off_loop:  # start the analysis thread and worker process first (once per router)
        warm = st.analyze(_ctx(-1, "warm " * 5000))
        if warm is not None:
            await warm
        for _ in range(3000):
            if st.tokens is None or st.tokens.knows("t/mc-1"):
                break
            await asyncio.sleep(0.01)
    lag = LoopLag()
    lag.start()
    tasks = []
    t0 = time.perf_counter()
    for i, text in enumerate(texts):
        tasks.append(asyncio.create_task(one(i, text)))
        await asyncio.sleep(gap_s)
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    await lag.stop()
    lateness = lag.lateness
    return {
        "path": "off the loop" if off_loop else "on the loop",
        "gap_s": gap_s,
        "calls": len(texts),
        "stall_p50_ms": round(_pct(lateness, 0.5) * 1e3, 2),
        "stall_p99_ms": round(_pct(lateness, 0.99) * 1e3, 2),
        "stall_max_ms": round(max(lateness) * 1e3, 1),
        "call_wait_median_ms": round(statistics.median(waits) * 1e3, 1),
        "calls_with_keys": keyed,
        "wall_s": round(wall, 2),
    }


def run(quick: bool = False) -> list[dict[str, Any]]:
    mtok = ModelTokenizer.from_dir(tinymodel.ensure())
    rng = random.Random(0)
    sizes = _calls(10 if quick else 40)
    texts = [" ".join(rng.choice(tinymodel._WORDS) for _ in range(n)) for n in sizes]
    rows = []
    for gap in GAPS_S:
        for off in (False, True):
            st = KVState(KVConfig(block_size=16, analysis_wait_s=1.0), tokenizer=mtok)
            rows.append(asyncio.run(_replay(st, texts, off, gap)))
    rows[0]["mean_prompt_words"] = round(statistics.mean(sizes))
    return rows


if __name__ == "__main__":
    for r in run():
        print(r)
