"""Router CPU per call for tokens + block keys (issue 6 target: ≤1 ms for the next call of a
142k-token session).

A session of chat turns in the tiny model's vocabulary (≈1 token per word) grows to ~142k
tokens; each row times the router's work for the session's *next* calls, each appending an
assistant reply, a tool result and a user line (~N new words): render the chat template, then
:class:`router.kv.tokens.SessionTokenizer` (incremental) vs tokenizing and hashing from scratch
(also checked equal), measured in the same run. Steady state: the timed calls follow each
other. (Measured right after a full 142k-token tokenization instead, with cold CPU caches,
the 300-word call took ~1.2 ms here.)
"""

from __future__ import annotations

import random
import statistics
import time

from loadtest import tinymodel
from router.kv.tokens import SessionTokenizer
from router.vllm.hashing import BlockHasher
from router.vllm.tokenizer import ModelTokenizer


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(tinymodel._WORDS) for _ in range(n))


def run(quick: bool = False) -> list[dict]:
    rng = random.Random(0)
    mtok = ModelTokenizer.from_dir(tinymodel.ensure())
    hasher = BlockHasher(32)
    msgs: list[dict] = [{"role": "system", "content": _words(rng, 15_000)}]
    while True:
        msgs.append({"role": "user", "content": _words(rng, 3000)})
        if len(mtok.encode(mtok.render(msgs))) >= 142_000:
            break
    n_base = len(mtok.encode(mtok.render(msgs)))
    rows = []
    reps = 5 if quick else 15
    for new_words in (300, 1000, 4000):
        inc_t, render_t, full_t, reused = [], [], [], []
        st = SessionTokenizer(mtok, hasher)
        st.prompt(mtok.render(msgs), session="s")  # the session's history, tokenized once
        turn = list(msgs)
        done = []
        for _ in range(reps):
            # the next call: the history plus one more exchange (the session keeps growing)
            turn = [
                *turn,
                {"role": "assistant", "content": _words(rng, new_words // 4)},
                {"role": "tool", "content": _words(rng, new_words // 2)},
                {"role": "user", "content": _words(rng, new_words // 4)},
            ]
            t0 = time.perf_counter()
            text = mtok.render(turn)
            t1 = time.perf_counter()
            p = st.prompt(text, session="s")
            t2 = time.perf_counter()
            render_t.append(t1 - t0)
            inc_t.append(t2 - t1)
            reused.append(p.reused_tokens / p.n_tokens)
            done.append((text, p.keys))
        for text, keys in done:  # the baseline, and a check that the results are exact
            t2 = time.perf_counter()
            full = hasher.hash_keys(mtok.encode(text))
            full_t.append(time.perf_counter() - t2)
            assert keys == full
        med = statistics.median
        rows.append(
            {
                "name": f"next_call_{n_base // 1000}k_session_plus_{new_words}_words",
                "render_ms": round(med(render_t) * 1e3, 3),
                "incremental_ms": round(med(inc_t) * 1e3, 3),
                "render_plus_incremental_ms": round((med(render_t) + med(inc_t)) * 1e3, 3),
                "full_tokenize_and_hash_ms": round(med(full_t) * 1e3, 2),
                "speedup_vs_full": round(med(full_t) / med(inc_t), 1),
                "reused_fraction": round(med(reused), 4),
            }
        )
    return rows
