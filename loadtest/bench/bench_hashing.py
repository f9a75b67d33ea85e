"""Block hashing speed: the router hashes every prompt it routes (sha256_cbor, 32-token blocks).

Rows: tokens/s for a 142k-token prompt (the median agentic context), and the per-call cost
of extending a session's chain by one turn (~2k new tokens) against hashing from scratch.
"""

from __future__ import annotations

import random
import statistics
import time

from router.vllm.hashing import BlockHasher


def _median_s(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def run(quick: bool = False) -> list[dict]:
    rng = random.Random(0)
    n = 142_000
    toks = [rng.randrange(0, 128_000) for _ in range(n + 2048)]
    h = BlockHasher(32)
    reps = 3 if quick else 9
    full = _median_s(lambda: h.hash_blocks(toks[:n]), reps)
    head = h.hash_blocks(toks[:n])
    inc = _median_s(
        lambda: h.hash_blocks(toks[n : n + 2048], parent=head[-1], start_block=len(head)), reps
    )
    return [
        {
            "name": "hash_142k_tokens",
            "median_ms": round(full * 1e3, 2),
            "mtokens_per_s": round(n / full / 1e6, 2),
        },
        {
            "name": "hash_next_turn_2k_tokens",
            "median_ms": round(inc * 1e3, 3),
            "speedup_vs_full": round(full / inc, 1),
        },
    ]
