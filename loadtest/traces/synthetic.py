"""A synthetic generator of AgentX-like sessions, for any scale.

Owns: :class:`AgentXParams` (distribution parameters, defaults from the public corpus figures
in ``../shared/data/README.md``: ~46 calls per session, contexts growing from ~15k tokens of
tools+system prompt, outputs of a few hundred tokens, idle gaps with median ~18 s, a few
subagent groups starting from fresh ~10k contexts) and :func:`generate`, a pure function of the
parameters and the seed. Sessions come out in the same shape as the WEKA loader's (hash ids
local to each session, 64-token blocks by default), so every replay feature applies.

Must not import the router or HTTP clients.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

from loadtest.traces.model import Call, Dep, Session, Trace


@dataclass(frozen=True)
class AgentXParams:
    sessions: int = 8
    block_size: int = 64
    calls_median: float = 46.0  # lognormal median of main-chain calls per session
    calls_sigma: float = 0.6
    prefix_tokens: int = 15_000  # tools + system prompt
    first_user_tokens: int = 2_000
    growth_median: float = 1_500.0  # tokens appended per call (tool result + last output)
    growth_sigma: float = 1.0
    output_median: float = 250.0
    output_sigma: float = 0.7
    gap_median_s: float = 18.0
    gap_sigma: float = 1.2
    subagent_prob: float = 0.05  # per main call: spawn a group of subagents after it
    subagent_group_max: int = 3
    subagent_calls_median: float = 8.0
    subagent_prefix_tokens: int = 9_000
    max_context_tokens: int = 200_000
    seed: int = 0


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return math.exp(rng.gauss(math.log(median), sigma))


def _chain(
    rng: random.Random,
    p: AgentXParams,
    *,
    agent: str,
    parent: str | None,
    n_calls: int,
    prefix_tokens: int,
    group: str,
    next_id: list[int],
    first_deps: tuple[Dep, ...],
) -> list[Call]:
    bs = p.block_size
    tokens = prefix_tokens + p.first_user_tokens
    ids: list[int] = []
    calls: list[Call] = []
    for i in range(n_calls):
        need = math.ceil(tokens / bs)
        while len(ids) < need:
            ids.append(next_id[0])
            next_id[0] += 1
        out = max(1, int(_lognormal(rng, p.output_median, p.output_sigma)))
        deps = (
            first_deps
            if i == 0
            else (Dep(calls[-1].id, _lognormal(rng, p.gap_median_s, p.gap_sigma)),)
        )
        calls.append(
            Call(
                id=f"{agent}/{i}",
                agent=agent,
                hash_ids=tuple(ids[:need]),
                input_tokens=tokens,
                output_tokens=out,
                deps=deps,
                prefix_blocks=prefix_tokens // bs,
                prefix_group=group,
                parent_agent=parent,
            )
        )
        # The next call resends everything plus this output and a tool result. A partial
        # last block is rewritten with new content (new id), like real traces.
        if tokens % bs:
            ids.pop()
        tokens = min(
            tokens + out + int(_lognormal(rng, p.growth_median, p.growth_sigma)),
            p.max_context_tokens,
        )
    return calls


def generate(params: AgentXParams | None = None) -> Trace:
    p = params or AgentXParams()
    rng = random.Random(p.seed)
    sessions: list[Session] = []
    for k in range(p.sessions):
        next_id = [1]
        n_main = max(1, int(_lognormal(rng, p.calls_median, p.calls_sigma)))
        main = _chain(
            rng,
            p,
            agent="main",
            parent=None,
            n_calls=n_main,
            prefix_tokens=p.prefix_tokens,
            group="main",
            next_id=next_id,
            first_deps=(),
        )
        calls: list[Call] = []
        n_sub = 0
        pending_join: list[tuple[int, str]] = []  # (main index that joins, last sub call)
        for i, c in enumerate(main):
            extra = tuple(Dep(last, 0.0) for j, last in pending_join if j == i)
            pending_join = [pj for pj in pending_join if pj[0] != i]
            calls.append(Call(**{**c.__dict__, "deps": c.deps + extra}) if extra else c)
            if i + 2 < len(main) and rng.random() < p.subagent_prob:
                join_at = min(len(main) - 1, i + 1 + rng.randint(1, 3))
                for _ in range(rng.randint(1, p.subagent_group_max)):
                    n_sub += 1
                    name = f"agent_{n_sub:03d}"
                    sub = _chain(
                        rng,
                        p,
                        agent=name,
                        parent="main",
                        n_calls=max(1, int(_lognormal(rng, p.subagent_calls_median, 0.5))),
                        prefix_tokens=p.subagent_prefix_tokens,
                        group="Explore",
                        next_id=next_id,
                        first_deps=(Dep(c.id, 1.0),),
                    )
                    calls.extend(sub)
                    pending_join.append((join_at, sub[-1].id))
        sessions.append(Session(id=f"syn{k:04d}", calls=calls))
    return Trace(
        name=f"synthetic-agentx-s{p.seed}",
        block_size=p.block_size,
        sessions=sessions,
        id_scope="session",
        meta={"format": "synthetic", "params": asdict(p)},
    )
