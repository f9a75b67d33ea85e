"""The router's own cost per call at agent scale (issue 45 "Decisions at scale": kv_cost's
decision ≤ 2 ms CPU p99, a cold 144k-token prompt's analysis ≤ 30 ms of event-loop time).

The scene: 64 replicas (profile ``h200-70b-fp8``, the router's 16-token blocks) and 10,000
agent sessions of ~144k-token prompts (9,000 blocks; eight system prompts of 1,000 blocks
shared by the sessions of each), each session homed on one replica (``s % 64``). The block
index is filled as the replicas' KV events leave it (``BlockStored`` batches applied through
:meth:`router.kv.index.BlockIndex.apply`): each replica's GPU pool holds the blocks of the
sessions it served last that fit (~2.5 of them; the others were evicted), so the index holds
~1.5 M keys. Every session has a footprint (context, gaps, outputs), every replica call
statistics and a calibrated fit, and 200 calls are in flight (prefilling, routed).

Rows:

* ``decision``: one warm call of a session (its prompt one turn longer than its last) placed
  by ``kv_cost`` over the 64 replicas: :meth:`KVState.view` + the scorer; then the call's
  bookkeeping (:meth:`KVState.decided`, :meth:`KVState.observe`) as a row of its own.
  Process CPU time per call (``time.process_time``) and wall time, p50/p99 over the calls.
* ``cold analysis``: one cold 144k-token prompt (a session the router has not seen; the
  tiny model's vocabulary, ~1 token a word): render, tokenize, block hashes, index match —
  each step's CPU time, then the whole analysis through :meth:`KVState.analyze` inside a
  running loop (its analysis thread and encoder process), one at a time: the loop thread's
  CPU in the analyzer's synchronous part, a 1 ms ticker's lateness (how long the loop was
  held: wall time, so on a loaded machine it includes time the process had no CPU), and the
  wall time until the analysis landed.
* ``scene``: the index's keys and the process's RSS growth building the scene (what one
  router process — one ``--workers`` worker — holds for this fleet).

CPU-time figures are what a decision costs; wall figures depend on the machine's load.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

import numpy as np

from loadtest.bench.looplag import LoopLag
from router.kv.config import KVConfig
from router.kv.index import BlockIndex
from router.kv.sessions import ReplicaStat, SessionFootprint
from router.kv.state import KVState
from router.outcome import CallOutcome
from router.replicas import EndpointView
from router.scheduling import RequestContext, Snapshot
from router.scheduling.kv_cost import KVCost
from router.scheduling.pipeline import Decision
from router.sessions import SessionIdentity
from router.vllm.kvevents import BlockStored

N_REPLICAS = 64
N_SESSIONS = 10_000
PROMPT_TOKENS = 144_000
BLOCK = 16
SYSTEM_BLOCKS = 1_000  # the shared system + tools prefix (16k tokens), one of eight
N_SYSTEMS = 8
INFLIGHT = 200


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def session_keys(s: int, n_blocks: int = PROMPT_TOKENS // BLOCK) -> list[int]:
    """Session ``s``'s chained block keys (its system prompt's, then its own)."""
    sysk = np.random.default_rng(1_000_000 + s % N_SYSTEMS).integers(
        1, 2**63, SYSTEM_BLOCKS, dtype=np.int64
    )
    own = np.random.default_rng(s).integers(1, 2**63, n_blocks - SYSTEM_BLOCKS, dtype=np.int64)
    return np.concatenate([sysk, own])[:n_blocks].tolist()


def build_scene(
    n_replicas: int = N_REPLICAS, n_sessions: int = N_SESSIONS, now: float = 10_000.0
) -> tuple[KVState, list[EndpointView]]:
    """A KV layer as 64 replicas' events and 10,000 sessions' calls leave it (see above)."""
    clock = [now]
    st = KVState(KVConfig(block_size=BLOCK), clock=lambda: clock[0])
    names = [f"http://r{i}:8000" for i in range(n_replicas)]
    prof = st.profile_of(names[0])
    cap = prof.gpu_kv_blocks * prof.block_size // BLOCK  # router blocks a GPU pool holds
    rng = random.Random(0)
    ix: BlockIndex = st.index
    for i, name in enumerate(names):
        ix.mark_fresh(name)
        homed = list(range(i, n_sessions, n_replicas))
        held: list[int] = []
        for s in reversed(homed):  # the latest sessions it served, while they fit
            keys = session_keys(s)
            room = cap - len(held)
            if room <= 0:
                break
            held.extend(keys[:room])
        # as the replica's events stored them (batches of a call's blocks)
        ix.apply(name, [BlockStored(held[j : j + 512], None, [], BLOCK)
                        for j in range(0, len(held), 512)])  # fmt: skip
        stat = st.stats.setdefault(name, ReplicaStat())
        for _ in range(20):
            stat.add(rng.uniform(200, 3000), rng.uniform(100_000, 144_000))
        from costmodel.calibration import Calibrator

        cal = st.calibrators.setdefault(name, Calibrator())
        for _ in range(16):
            m = rng.uniform(0.05, 2.0)
            cal.observe_ttft(m, m * rng.uniform(0.8, 1.2), now - rng.uniform(0, 60))
            cal.observe_itl(0.02, 0.02 * rng.uniform(0.8, 1.2), now - rng.uniform(0, 60))
    for s in range(n_sessions):
        key = f"t/s{s}"
        fp = SessionFootprint(key, replica=names[s % n_replicas], tokens=PROMPT_TOKENS)
        fp.last_end = now - rng.expovariate(1 / 10.0)
        fp.gaps = [rng.expovariate(1 / 10.0) for _ in range(10)]
        fp.outputs = [rng.randint(50, 800) for _ in range(10)]
        fp.turn_tokens = rng.randint(200, 3000)
        st.sessions[key] = fp
    for j in range(INFLIGHT):  # calls in flight: prefilling, and their prompts routed
        s = rng.randrange(n_sessions)
        r = names[s % n_replicas]
        st.prefilling[f"inflight{j}"] = (r, rng.randint(100, 3000), now - rng.uniform(0, 2))
        st.routed[f"inflight{j}"] = (r, session_keys(s)[: SYSTEM_BLOCKS + 8], now - 1.0)
    st.gap_ewma, st.output_ewma = 10.0, 400.0
    eps = [
        EndpointView(n, n, True, frozenset({"m"}), rng.randint(0, 8),
                     float(rng.randint(0, 8)), float(rng.randint(0, 2)), rng.random(), "closed")
        for n in names
    ]  # fmt: skip
    return st, eps


def _ctx(s: int, keys: list[int], i: int) -> RequestContext:
    ident = SessionIdentity("t", f"s{s}", None, None, False, "bench")
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 400}
    c = RequestContext(f"call{i}", "/v1/chat/completions", "m", ident, body)
    c.block_keys = keys
    c.prompt_tokens = len(keys) * BLOCK
    return c


def bench_decisions(n_calls: int, st: KVState, eps: list[EndpointView]) -> list[dict[str, Any]]:
    scorer = KVCost()
    rng = random.Random(1)
    cpu: list[float] = []
    wall: list[float] = []
    book_cpu: list[float] = []
    picks: dict[str, int] = {}
    for i in range(n_calls):
        s = rng.randrange(len(st.sessions))
        keys = session_keys(s, PROMPT_TOKENS // BLOCK + 60)  # one turn (~1k tokens) longer
        ctx = _ctx(s, keys, i)
        st.analyze(ctx)  # keys given (as the simulator gives them): counts it in flight
        c0, w0 = time.process_time(), time.perf_counter()
        view = st.view()
        snap = Snapshot(tuple(eps), None, i, {"kv": view})
        scores = scorer.score(ctx, snap, eps)
        w1, c1 = time.perf_counter(), time.process_time()
        cpu.append(c1 - c0)
        wall.append(w1 - w0)
        best = max(scores, key=scores.__getitem__)
        picks[best] = picks.get(best, 0) + 1
        ep = next(e for e in eps if e.name == best)
        dec = Decision(ep, [(ep, 1.0)], terms={"kv_cost": getattr(scores, "terms", {})})
        b0 = time.process_time()
        st.decided(ctx, dec)
        st.observe(ctx, CallOutcome(best, "200", ttft_s=0.5, duration_s=2.0, decision=dec))
        book_cpu.append(time.process_time() - b0)
    return [
        {
            "row": "decision (view + kv_cost over 64 replicas)",
            "calls": n_calls,
            "cpu_p50_ms": round(_pct(cpu, 0.5) * 1e3, 3),
            "cpu_p99_ms": round(_pct(cpu, 0.99) * 1e3, 3),
            "wall_p50_ms": round(_pct(wall, 0.5) * 1e3, 3),
            "wall_p99_ms": round(_pct(wall, 0.99) * 1e3, 3),
            "replicas_picked": len(picks),
        },
        {
            "row": "bookkeeping (decided + observe)",
            "calls": n_calls,
            "cpu_p50_ms": round(_pct(book_cpu, 0.5) * 1e3, 3),
            "cpu_p99_ms": round(_pct(book_cpu, 0.99) * 1e3, 3),
        },
    ]


def _words(rng: random.Random, n: int) -> str:
    from loadtest import tinymodel

    return " ".join(rng.choice(tinymodel._WORDS) for _ in range(n))


def bench_cold(st: KVState, reps: int) -> list[dict[str, Any]]:
    """One cold 144k-token prompt's analysis, step by step, then through the analyzer."""
    from loadtest import tinymodel
    from router.kv.tokens import SessionTokenizer
    from router.vllm.prompt import request_prompt
    from router.vllm.tokenizer import ModelTokenizer

    mtok = ModelTokenizer.from_dir(tinymodel.ensure())
    rng = random.Random(2)
    text = _words(rng, PROMPT_TOKENS)
    body: dict[str, Any] = {"messages": [{"role": "user", "content": text}], "max_tokens": 8}
    steps: dict[str, list[float]] = {"render": [], "tokenize": [], "hash": [], "match": []}
    n_tok = 0
    names = st.index.replicas()
    for _ in range(reps):
        c0 = time.process_time()
        p = request_prompt(mtok, "/v1/chat/completions", body)
        assert p is not None
        c1 = time.process_time()
        ids, _ends = mtok.encode_body(p.text)
        c2 = time.process_time()
        keys = st.hasher.hash_keys(ids.tolist())
        c3 = time.process_time()
        st.view().match(keys, names)
        c4 = time.process_time()
        n_tok = len(ids)
        for k, v in zip(steps, (c1 - c0, c2 - c1, c3 - c2, c4 - c3), strict=True):
            if v:
                steps[k].append(v)
    # the session's next call: its prompt one exchange (~1,000 words) longer; incremental
    # tokens and block hashes (only the new tail is tokenized and hashed)
    inc = SessionTokenizer(mtok, st.hasher)
    first = request_prompt(mtok, "/v1/chat/completions", body)
    assert first is not None
    inc.prompt(first.text, session="w")
    warm_cpu: list[float] = []
    msgs = list(body["messages"])
    for _ in range(reps):
        msgs = [*msgs, {"role": "assistant", "content": _words(rng, 300)},
                {"role": "user", "content": _words(rng, 700)}]  # fmt: skip
        c0 = time.process_time()
        nxt = request_prompt(mtok, "/v1/chat/completions", {**body, "messages": msgs})
        assert nxt is not None
        got = inc.prompt(nxt.text, session="w")
        warm_cpu.append(time.process_time() - c0)
        assert got.reused_tokens > 0
    rows = [
        {
            "row": f"cold {n_tok // 1000}k-token prompt: {k} (CPU)",
            "cpu_median_ms": round(statistics.median(v) * 1e3, 1) if v else 0.0,
        }
        for k, v in steps.items()
    ]
    rows.append({"row": "warm next call (+1k words): render + incremental tokens + hashes (CPU)",
                 "cpu_median_ms": round(statistics.median(warm_cpu) * 1e3, 2)})  # fmt: skip
    # the whole analysis through the analyzer, in a running loop: how long is the loop held?
    st.tokenizer = mtok
    st.tokens = SessionTokenizer(mtok, st.hasher)
    rows.extend(asyncio.run(_cold_on_loop(st, text, reps)))
    return rows


async def _cold_on_loop(st: KVState, text: str, reps: int) -> list[dict[str, Any]]:

    # start the analysis lane (and its worker process) before measuring
    warm = st.analyze(_cold_ctx(-1, "warm " * 30_000))
    if warm is not None:
        await warm
    await asyncio.sleep(0.5)
    lag = LoopLag()
    lag.start()
    done_s: list[float] = []
    loop_cpu: list[float] = []
    assert st.tokens is not None
    for i in range(reps):
        c = _cold_ctx(i, f"{i} {text}")
        t0 = time.perf_counter()
        c0 = time.thread_time()  # the loop thread's CPU in the analyzer's synchronous part
        pending = st.analyze(c)
        loop_cpu.append(time.thread_time() - c0)
        if pending is not None:
            await pending
        while not st.tokens.knows(c.identity.key):  # noqa: ASYNC110 (until it has landed)
            await asyncio.sleep(0.005)
        done_s.append(time.perf_counter() - t0)
        await asyncio.sleep(0.2)
    await lag.stop()
    lateness = lag.lateness
    await st.close()
    return [
        {
            "row": "cold 144k analysis off the loop (KVState.analyze)",
            "loop_cpu_median_ms": round(statistics.median(loop_cpu) * 1e3, 2),
            "loop_stall_max_ms": round(max(lateness) * 1e3, 1),
            "loop_stall_p99_ms": round(_pct(lateness, 0.99) * 1e3, 2),
            "analysis_wall_median_ms": round(statistics.median(done_s) * 1e3, 1),
        }
    ]


def _cold_ctx(i: int, text: str) -> RequestContext:
    ident = SessionIdentity("t", f"cold{i}", None, None, False, "bench")
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 8}
    return RequestContext(f"cold{i}", "/v1/chat/completions", "m", ident, body)


def run(quick: bool = False) -> list[dict[str, Any]]:
    import resource

    t0 = time.perf_counter()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    st, eps = build_scene()
    rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024  # KiB -> MiB
    rows: list[dict[str, Any]] = [
        {"row": "scene", "replicas": len(eps), "sessions": len(st.sessions),
         "index_keys": len(st.index), "build_s": round(time.perf_counter() - t0, 1),
         "rss_growth_mib": round(rss)}
    ]  # fmt: skip
    rows.extend(bench_decisions(100 if quick else 1000, st, eps))
    rows.extend(bench_cold(st, 2 if quick else 5))
    return rows


if __name__ == "__main__":
    import json
    import sys

    for row in run(quick="--quick" in sys.argv):
        print(json.dumps(row))
