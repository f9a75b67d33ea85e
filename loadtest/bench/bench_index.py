"""Block index speed and memory (issue 6 targets: ingest ≥1M block events/s, match of a
4k-block prompt ≤0.5 ms, 10M blocks ≤1.5 GB).

Rows: ingest of BlockStored events already decoded (the index's own cost) and from raw ZMQ
frames (decode + apply); match of a 4,437-block prompt (142k tokens / 32) against 8 replicas
each holding part of it, vs the naive reference index; RSS growth for 10M distinct keys
spread over 8 replicas (measured in a fresh subprocess).
"""

from __future__ import annotations

import random
import statistics
import subprocess
import sys
import time

from router.kv.index import BlockIndex
from router.kv.index_ref import NaiveBlockIndex
from router.vllm.kvevents import decode_message, encode_block_stored, encode_message


def _median(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


_MEM_SCRIPT = """
import resource, random, sys
from router.kv.index import BlockIndex
n = int(sys.argv[1])
rng = random.Random(1)
ix = BlockIndex()
for r in range(8):
    ix.add_replica(f"r{r}")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
per = n // 8
for r in range(8):
    for start in range(0, per, 100_000):
        ix.store(f"r{r}", [rng.getrandbits(64) for _ in range(min(100_000, per - start))])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024)
"""


def run(quick: bool = False) -> list[dict]:
    rng = random.Random(0)
    rows: list[dict] = []
    # ---- ingest ----
    n_ev, per_ev = (200, 64) if quick else (2000, 64)
    batches = [[rng.getrandbits(64) for _ in range(per_ev)] for _ in range(n_ev)]
    from router.vllm.kvevents import BlockStored

    events = [BlockStored(b, None, [], 32) for b in batches]
    frames = [
        encode_message("kv@r0", i, 0.0, [encode_block_stored(b, None, [], 32)])
        for i, b in enumerate(batches)
    ]

    def ingest() -> None:
        ix = BlockIndex()
        for i, ev in enumerate(events):
            ix.apply(f"r{i % 8}", [ev])

    def ingest_wire() -> None:
        ix = BlockIndex()
        for i, f in enumerate(frames):
            ix.apply(f"r{i % 8}", decode_message(f).events)

    total = n_ev * per_ev
    t = _median(ingest, 5)
    tw = _median(ingest_wire, 5)
    rows.append(
        {"name": "ingest_block_stored", "blocks": total, "mblocks_per_s": round(total / t / 1e6, 2)}
    )
    rows.append(
        {
            "name": "ingest_from_zmq_frames",
            "blocks": total,
            "mblocks_per_s": round(total / tw / 1e6, 2),
        }
    )
    # ---- match ----
    n = 4437
    prompt = [rng.getrandbits(64) for _ in range(n)]
    ix, ref = BlockIndex(), NaiveBlockIndex()
    for r in range(8):
        depth = n * (r + 1) // 8
        noise = [rng.getrandbits(64) for _ in range(100_000 if not quick else 10_000)]
        for x in (ix, ref):
            x.store(f"r{r}", prompt[: depth // 2], "GPU")
            x.store(f"r{r}", prompt[depth // 2 : depth], "CPU")
            x.store(f"r{r}", noise)
    assert ix.match(prompt) == ref.match(prompt)
    reps = 50 if quick else 300
    tm = _median(lambda: ix.match(prompt), reps)
    tr = _median(lambda: ref.match(prompt), 5)
    only_gpu = BlockIndex()
    for r in range(8):
        only_gpu.store(f"r{r}", prompt[: n * (r + 1) // 8])
    tg = _median(lambda: only_gpu.match(prompt), reps)
    rows.append(
        {
            "name": "match_4437_blocks_8_replicas_2_tiers",
            "median_ms": round(tm * 1e3, 3),
            "naive_ms": round(tr * 1e3, 2),
            "speedup_vs_naive": round(tr / tm, 1),
        }
    )
    rows.append({"name": "match_4437_blocks_8_replicas_gpu_only", "median_ms": round(tg * 1e3, 3)})
    # ---- memory ----
    n_mem = 1_000_000 if quick else 10_000_000
    out = subprocess.run(
        [sys.executable, "-c", _MEM_SCRIPT, str(n_mem)], capture_output=True, text=True, check=True
    )
    b = int(out.stdout.strip())
    rows.append(
        {
            "name": f"rss_{n_mem // 1_000_000}M_keys_8_replicas",
            "gib": round(b / 2**30, 3),
            "bytes_per_key": round(b / n_mem, 1),
        }
    )
    return rows
