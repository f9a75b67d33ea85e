"""Decision agreement: the real sglang-router 0.3.2 ``cache_aware`` and kvroute's port
``sglang_tree``, each in front of its own fresh set of replica twins, given one fixed call
sequence; the share of identical replica choices is printed and held at >= 90 %.

The sequence is agent-like: sessions whose chat prompts grow turn by turn (each turn resends
the history plus the reply and a new user message), two groups of sessions sharing a long
system prompt (a new session of a group matches its group's prompt well above the 0.3
threshold), and sessions with prompts of their own (a miss: below the threshold). Calls go in
waves of 3, 1, 2, 3, ... calls, all in flight together: each call is sent once the previous
one of its wave has reached a twin (so the router counted it in its in-flight load), and the
next wave starts when the whole wave has ended and the router's in-flight counts are back to
zero. The load each decision sees is therefore fixed by the sequence, not by timing — it
matters: at 0.3.2 a miss goes to the least-loaded worker. The last wave holds 67 calls in
flight, 65 of them hits on one group's worker: the two after them find the workers imbalanced
(in-flight counts apart by more than 64, sglang-router's ``balance_abs_threshold``, and the
most loaded above 1.5x the least) and go to the least-loaded ones although they match the
group's prompt; both sides must take that branch. Its calls are streamed and closed once the
wave is routed, so they stay in flight however long sending 67 calls takes.

Replica identity: sglang-router breaks load ties by the order of its worker list, which is not
the ``--worker-urls`` order and changes from run to run (the workers register concurrently at
start-up); at equal load a miss always goes to the first one, whichever it is. kvroute breaks
them by its replica order. The replicas of each side are therefore labelled by the order in
which that side first used them (for this sequence, the position in its tie-break order: a
wave's first miss lands on the first worker, the next miss of that wave on the second, ...),
and choices are compared by label. The raw share (twin names) is printed too. sglang-router
answers /health once its first worker has registered, so the sequence starts only when
/workers lists all of them (else the first call sees only one worker, and its choice says
nothing about the order of the full list).

What the sequence avoids, and why a real workload rarely hits it: a match that ends at a tree
node shared by two workers' trees (sglang-router then takes the node's first tenant in hash
order, kvroute the first replica) — here a prompt either extends one session's history, or
shares a system prompt that only one worker holds, or shares nothing; and match rates close to
the threshold, where counting characters (sglang) and 32-token blocks (kvroute) could fall on
either side — here a call matches above 0.8 (characters and blocks alike) or below 0.02.
The prompts stay far below each replica's KV capacity (kvroute trims its approximate tree to
it; sglang-router's tree holds 2^26 characters), so no eviction either.

    .venv/bin/python -m pytest -s tests/integration/test_sglang_agreement.py
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from costmodel.profiles import load_profile
from loadtest import tinymodel
from loadtest.sweep.stack import Router, cleanup
from loadtest.twin.cluster import Cluster, start_cluster
from router.app import REPLICAS, build_app, start_site
from router.config import RouterConfig
from router.kv.config import KVConfig
from router.kv.state import KVState
from router.vllm.tokenizer import ModelTokenizer

pytestmark = pytest.mark.timeout(120)

REPLICAS_N = 3
PROFILE = "cpu-tiny"  # block size 32, ~1.5 ms per decoded token at speedup 1
SPEEDUP = 1.0
OUT_TOKENS = 240  # ~0.4 s per call: a wave's calls stay in flight while the wave is sent
WAVES = (3, 1, 2)  # calls in flight together, in turn
TARGET = 0.9
# sglang-router 0.3.2's balance thresholds (router_args.py): imbalanced when the most loaded
# worker's in-flight count exceeds the least loaded one's by more than 64 and is above 1.5x it
BALANCE_ABS = 64
BIG_HITS = BALANCE_ABS + 1  # calls of the last wave that pile onto the group's worker
BIG_BALANCED = 2  # calls after them that the imbalance sends to the least-loaded workers
BIG_OUT_TOKENS = 3000  # streamed, and closed once the whole wave is routed: never finishes first
WORDS = tinymodel._WORDS


def words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class Session:
    name: str
    system: str
    turns: list[tuple[str, str]] = field(default_factory=list)  # (user, assistant reply)
    out_tokens: int = OUT_TOKENS
    stream: bool = False  # streamed: the client closes it once its whole wave is in flight

    def body(self, turn: int) -> dict:
        msgs = [{"role": "system", "content": self.system}]
        for user, reply in self.turns[:turn]:
            msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        msgs.append({"role": "user", "content": self.turns[turn][0]})
        return {
            "model": "tiny",
            "messages": msgs,
            "max_tokens": self.out_tokens,
            "ignore_eos": True,
            **({"stream": True} if self.stream else {}),
        }


def call_sequence(seed: int = 7) -> list[list[tuple[Session, int]]]:
    """Waves of (session, turn): 10 sessions x 4 turns, three new sessions every step; a step's
    calls (one turn of each active session) go in waves of 3, 1, 2, 3, 1, 2, ... calls. Then a
    last wave of ``BIG_HITS + BIG_BALANCED`` new sessions of group alpha, all in flight
    together: the first ``BIG_HITS`` match alpha's worker (a hit each), which then has 65 calls
    in flight and the others none, so the rest go to the least-loaded workers (the balance
    branch, before any match is looked at). It comes last: after it, alpha's prompt is in
    three workers' trees, the tie the sequence avoids."""
    rng = random.Random(seed)
    shared = {g: f"You are coding agent {g}. " + words(260, rng) for g in ("alpha", "beta")}
    kinds = ["alpha", "own", "beta", "own", "own", "alpha", "own", "beta", "alpha", "own"]
    sessions = []
    for i, kind in enumerate(kinds):
        system = shared[kind] if kind in shared else f"Session {i} rules: " + words(260, rng)
        s = Session(f"s{i}-{kind}", system)
        s.turns = [(words(45, rng), words(25, rng)) for _ in range(4)]
        sessions.append(s)
    steps: dict[int, list[tuple[Session, int]]] = {}
    for i, s in enumerate(sessions):  # session i starts at step i // 3, one turn per step
        for t in range(len(s.turns)):
            steps.setdefault(i // 3 + t, []).append((s, t))
    sizes = itertools.cycle(WAVES)
    waves = []
    for _, calls in sorted(steps.items()):
        while calls:
            n = next(sizes)
            waves.append(calls[:n])
            calls = calls[n:]
    big = []
    for i in range(BIG_HITS + BIG_BALANCED):
        s = Session(f"b{i}-alpha", shared["alpha"], out_tokens=BIG_OUT_TOKENS, stream=True)
        s.turns = [(words(45, rng), words(25, rng))]
        big.append((s, 0))
    waves.append(big)
    return waves


async def _until(cond: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    """Poll ``cond`` (in-process state: no event to await) every 2 ms, at most ``timeout_s``."""
    for _ in range(int(timeout_s / 0.002)):
        if cond():
            return
        await asyncio.sleep(0.002)
    raise AssertionError(what)


async def drive(
    url: str, cluster: Cluster, waves, idle: Callable[[], Awaitable[None]]
) -> list[str]:
    """Send the waves through ``url``; the twin that served each call, in sequence order. A
    streamed call is closed once its whole wave is in flight (its twin is in the headers), so
    a wave of them stays in flight however long sending it takes."""
    chosen: list[str] = []
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def one(s: Session, t: int, sent: asyncio.Event) -> str:
            async with http.post(url + "/v1/chat/completions", json=s.body(t)) as r:
                assert r.status == 200, await r.text()
                if s.stream:
                    await sent.wait()
                    r.close()
                else:
                    await r.read()
                return r.headers["x-twin-replica"]

        for wave in waves:
            tasks, sent = [], asyncio.Event()
            for k, (s, t) in enumerate(wave):
                tasks.append(asyncio.create_task(one(s, t, sent)))
                # routed and counted: the call is on a twin, and so are the wave's earlier ones
                await _until(
                    lambda k=k: sum(r.in_flight for r in cluster.replicas) == k + 1,
                    f"call {k + 1} of a wave not in flight with the others (calls too short?)",
                )
            sent.set()
            chosen += await asyncio.gather(*tasks)
            await idle()
    return chosen


def by_first_use(names: list[str]) -> list[int]:
    order: dict[str, int] = {}
    return [order.setdefault(n, len(order)) for n in names]


async def _sglang_side(waves) -> list[str]:
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-agree-"))
    try:
        async with start_cluster(REPLICAS_N, PROFILE, speedup=SPEEDUP) as c:
            router = Router("sglang:cache_aware", c.urls, workdir)  # 0.3.2 defaults
            # blocking start (health polls) off the loop: the twins run on this loop
            await asyncio.to_thread(router.start)
            try:
                async with aiohttp.ClientSession() as http:

                    async def idle() -> None:
                        """Until it lists every worker (its /health answers once the first
                        one has registered), each healthy, with an in-flight count of zero
                        (a guard: the client has every response of the wave by now)."""
                        for _ in range(2000):
                            async with http.get(router.url + "/workers") as r:
                                ws = (await r.json())["workers"]
                            if len(ws) == REPLICAS_N and all(
                                w["load"] == 0 and w["is_healthy"] for w in ws
                            ):
                                return
                            await asyncio.sleep(0.005)
                        raise AssertionError(f"sglang-router not idle: {ws}")

                    await idle()
                    return await drive(router.url, c, waves, idle)
            finally:
                await asyncio.to_thread(router.stop)
    finally:
        cleanup(workdir)


async def _kvroute_side(waves) -> list[str]:
    model = tinymodel.ensure()
    prof = load_profile(PROFILE)
    st = KVState(
        KVConfig(block_size=prof.block_size), tokenizer=ModelTokenizer.from_dir(model), profile=prof
    )
    async with start_cluster(REPLICAS_N, PROFILE, speedup=SPEEDUP) as c:
        app = build_app(RouterConfig(replicas=c.urls, policy="sglang_tree"), kv=st)
        runner, url = await start_site(app)
        try:

            async def idle() -> None:  # the router's in-flight counts are back to zero
                reps = app[REPLICAS]
                await _until(lambda: all(r.inflight == 0 for r in reps), "kvroute not idle")

            return await drive(url, c, waves, idle)
        finally:
            await runner.cleanup()


async def test_sglang_tree_agrees_with_sglang_router_cache_aware():
    # sglang-router probes each worker for gRPC (HTTP/2 preface) at start-up; the twins
    # answer 400 and aiohttp logs each probe as an error
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    waves = call_sequence()
    calls = [(s.name, t) for w in waves for s, t in w]
    theirs = await _sglang_side(waves)
    ours = await _kvroute_side(waves)
    a, b = by_first_use(theirs), by_first_use(ours)
    same = sum(x == y for x, y in zip(a, b, strict=True))
    raw = sum(x == y for x, y in zip(theirs, ours, strict=True))
    share = same / len(calls)
    print(f"\nsglang-router 0.3.2 cache_aware vs kvroute sglang_tree: {same}/{len(calls)} "
          f"identical choices = {share:.1%} (raw twin names: {raw / len(calls):.1%})")  # fmt: skip
    for (name, t), x, y, tx, ty in zip(calls, a, b, theirs, ours, strict=True):
        if x != y:
            print(f"  differs: {name} turn {t}: sglang {tx} (#{x}), kvroute {ty} (#{y})")
    assert len(set(a)) == len(set(b)) == REPLICAS_N  # the sequence does spread the load
    # the last wave reached the balance branch on both sides: its first BIG_HITS calls hit
    # alpha's worker, the calls after them (which match it as well) went elsewhere
    big = len(waves[-1])
    assert big > BALANCE_ABS
    for side in (a, b):
        hits, rest = side[-big:-BIG_BALANCED], side[-BIG_BALANCED:]
        assert len(set(hits)) == 1 and hits[0] not in rest, side[-big:]
    assert share >= TARGET, (share, list(zip(calls, theirs, ours, strict=True)))
