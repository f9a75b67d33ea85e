"""The one generator of AgentX-like synthetic sessions, for any scale.

Owns: :func:`agentx_chains`, the AgentX-like session shape (a chain of calls per session: call
counts, tokens appended per call, output lengths, idle gaps, session starts) drawn from one
seeded RNG, and the two views built on it:

- :func:`loadtest.sim.simulator.synthetic_agentx` (the in-process simulator's sessions) wraps
  :func:`agentx_chains` unchanged: same seed, same sessions, bit for bit;
- :func:`generate` (the replay's ``synthetic:...`` traces, :class:`AgentXParams`) turns the same
  chains into trace sessions (hash ids local to each session, 64-token blocks by default, like
  the WEKA loader's, so every replay feature applies) and adds subagent groups drawn from a
  second RNG, so a trace's main chains are exactly the simulator's sessions for the same seed
  and parameters.

Defaults follow the public corpus figures (``../shared/data/README.md``): ~15k tokens of
tools+system prompt, a 20k-token first call, ~2k tokens appended per call (log-normal, at least
50), a few hundred output tokens, idle gaps with median 18 s and p90 130 s (log-normal), ~46
calls per session (geometric, at most 200), a session ends before the call that would pass
250k tokens of context, session starts uniform over ``duration_s``.

Must not import the router or HTTP clients.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

from loadtest.traces.model import Call, Dep, Session, Trace

# log-normal sigma of idle gaps with median 18 s and p90 130 s (z_0.9 = 1.2816)
GAP_SIGMA = math.log(130.0 / 18.0) / 1.2816
MIN_TURN_TOKENS = 50  # tokens appended per call, at least


@dataclass(frozen=True, slots=True)
class ChainCall:
    """One call of a chain: tokens appended since the previous call (its output is appended
    by whoever replays it), tokens to generate, idle time after the previous call ended."""

    new_tokens: int
    output_tokens: int
    think_s: float


@dataclass(frozen=True, slots=True)
class Chain:
    """One session's main chain; ``shared_prefix_tokens`` lead its first call's tokens."""

    index: int
    start_s: float
    calls: tuple[ChainCall, ...]
    shared_prefix_tokens: int


def _draw_calls(
    rng: random.Random,
    n_calls: int,
    *,
    first_call_tokens: int,
    turn_tokens_median: float,
    turn_tokens_sigma: float,
    output_median: float,
    output_sigma: float,
    think_median_s: float,
    think_sigma: float,
    max_context: int,
) -> list[ChainCall]:
    """Up to ``n_calls`` calls; the chain stops before a call whose context (everything so far
    plus its new tokens and output) would pass ``max_context``."""
    calls: list[ChainCall] = []
    ctx = 0
    for k in range(n_calls):
        if k == 0:
            new = first_call_tokens
            think = 0.0
        else:
            new = max(
                MIN_TURN_TOKENS,
                int(rng.lognormvariate(math.log(turn_tokens_median), turn_tokens_sigma)),
            )
            think = rng.lognormvariate(math.log(think_median_s), think_sigma)
        out = max(1, int(rng.lognormvariate(math.log(output_median), output_sigma)))
        if ctx + new + out > max_context:
            break
        ctx += new + out
        calls.append(ChainCall(new, out, think))
    return calls


def agentx_chains(
    n_sessions: int,
    duration_s: float,
    *,
    seed: int = 0,
    shared_prefix_tokens: int = 15_000,
    first_call_tokens: int = 20_000,
    turn_tokens_median: float = 2_000,
    turn_tokens_sigma: float = 1.0,
    output_median: float = 300,
    output_sigma: float = 0.8,
    think_median_s: float = 18.0,
    think_sigma: float = GAP_SIGMA,
    calls_mean: float = 46.0,
    calls_median: float | None = None,
    calls_sigma: float = 0.6,
    max_calls: int = 200,
    max_context: int = 250_000,
) -> list[Chain]:
    """The AgentX-like session shape (see the module docstring), a pure function of its
    arguments. Calls per session are geometric with mean ``calls_mean`` (``int(Exp) + 1``),
    or log-normal with median ``calls_median`` and ``calls_sigma`` when that is set; at most
    ``max_calls`` either way. A session may come out empty when its first call alone passes
    ``max_context``."""
    rng = random.Random(seed)
    chains = []
    for s in range(n_sessions):
        if calls_median is None:
            drawn = int(rng.expovariate(1.0 / calls_mean)) + 1
        else:
            drawn = int(rng.lognormvariate(math.log(calls_median), calls_sigma))
        n_calls = max(1, min(max_calls, drawn))
        calls = _draw_calls(
            rng,
            n_calls,
            first_call_tokens=first_call_tokens,
            turn_tokens_median=turn_tokens_median,
            turn_tokens_sigma=turn_tokens_sigma,
            output_median=output_median,
            output_sigma=output_sigma,
            think_median_s=think_median_s,
            think_sigma=think_sigma,
            max_context=max_context,
        )
        chains.append(
            Chain(
                s,
                rng.uniform(0, duration_s),
                tuple(calls),
                min(shared_prefix_tokens, first_call_tokens),
            )
        )
    return chains


@dataclass(frozen=True)
class AgentXParams:
    """:func:`generate`'s parameters (``synthetic:key=value,...`` specs name these fields).

    The main chains are :func:`agentx_chains` with ``prefix_tokens`` as the shared prefix,
    ``prefix_tokens + first_user_tokens`` as the first call, ``growth_*`` as the tokens
    appended per call, ``gap_*`` as the idle gaps and ``calls_*`` as the calls per session."""

    sessions: int = 8
    block_size: int = 64
    duration_s: float = 3600.0  # session arrivals (open loop) uniform over this
    calls_mean: float = 46.0  # geometric main-chain calls per session ...
    calls_median: float | None = None  # ... or log-normal with this median, when set
    calls_sigma: float = 0.6
    max_calls: int = 200
    prefix_tokens: int = 15_000  # tools + system prompt
    first_user_tokens: int = 5_000
    growth_median: float = 2_000.0  # tokens appended per call (tool result + user turn)
    growth_sigma: float = 1.0
    output_median: float = 300.0
    output_sigma: float = 0.8
    gap_median_s: float = 18.0
    gap_sigma: float = GAP_SIGMA
    subagent_prob: float = 0.05  # per main call: spawn a group of subagents after it
    subagent_group_max: int = 3
    subagent_calls_median: float = 8.0
    subagent_prefix_tokens: int = 9_000
    max_context_tokens: int = 250_000
    seed: int = 0


def _trace_calls(
    chain: list[ChainCall] | tuple[ChainCall, ...],
    *,
    agent: str,
    parent: str | None,
    prefix_tokens: int,
    group: str,
    block_size: int,
    next_id: list[int],
    first_deps: tuple[Dep, ...],
) -> list[Call]:
    """A chain as trace calls: call k's prompt is call k-1's prompt plus its output plus call
    k's new tokens; it starts ``think_s`` after call k-1 ends."""
    bs = block_size
    ids: list[int] = []
    calls: list[Call] = []
    ctx = 0
    for i, cc in enumerate(chain):
        tokens = ctx + cc.new_tokens
        need = math.ceil(tokens / bs)
        while len(ids) < need:
            ids.append(next_id[0])
            next_id[0] += 1
        deps = first_deps if i == 0 else (Dep(calls[-1].id, cc.think_s),)
        calls.append(
            Call(
                id=f"{agent}/{i}",
                agent=agent,
                hash_ids=tuple(ids[:need]),
                input_tokens=tokens,
                output_tokens=cc.output_tokens,
                deps=deps,
                prefix_blocks=prefix_tokens // bs,
                prefix_group=group,
                parent_agent=parent,
            )
        )
        # The next call resends everything plus this output and new tokens. A partial last
        # block is rewritten with new content (new id), like real traces.
        if tokens % bs:
            ids.pop()
        ctx = tokens + cc.output_tokens
    return calls


def generate(params: AgentXParams | None = None) -> Trace:
    """A trace of :func:`agentx_chains` main chains plus subagent groups.

    After each main call but the last two, with probability ``subagent_prob``, a group of 1 to
    ``subagent_group_max`` subagents spawns (1 s after the call ends), each a chain from a
    fresh ``subagent_prefix_tokens + first_user_tokens`` context with log-normal(median
    ``subagent_calls_median``, 0.5) calls; the main call 2-4 calls later waits for every
    subagent's last call (join gate). Subagents are drawn from their own RNG (seeded from
    ``seed``), so the main chains stay exactly :func:`agentx_chains`'s. Sessions whose first
    call alone passes ``max_context_tokens`` are left out."""
    p = params or AgentXParams()
    bs = p.block_size
    chains = agentx_chains(
        p.sessions,
        p.duration_s,
        seed=p.seed,
        shared_prefix_tokens=p.prefix_tokens,
        first_call_tokens=p.prefix_tokens + p.first_user_tokens,
        turn_tokens_median=p.growth_median,
        turn_tokens_sigma=p.growth_sigma,
        output_median=p.output_median,
        output_sigma=p.output_sigma,
        think_median_s=p.gap_median_s,
        think_sigma=p.gap_sigma,
        calls_mean=p.calls_mean,
        calls_median=p.calls_median,
        calls_sigma=p.calls_sigma,
        max_calls=p.max_calls,
        max_context=p.max_context_tokens,
    )
    sub_rng = random.Random(f"agentx-subagents/{p.seed}")
    sessions: list[Session] = []
    for ch in chains:
        if not ch.calls:
            continue
        next_id = [1]
        main = _trace_calls(
            ch.calls,
            agent="main",
            parent=None,
            prefix_tokens=ch.shared_prefix_tokens,
            group="main",
            block_size=bs,
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
            if i + 2 < len(main) and sub_rng.random() < p.subagent_prob:
                join_at = min(len(main) - 1, i + 1 + sub_rng.randint(1, 3))
                for _ in range(sub_rng.randint(1, p.subagent_group_max)):
                    n_calls = int(sub_rng.lognormvariate(math.log(p.subagent_calls_median), 0.5))
                    chain = _draw_calls(
                        sub_rng,
                        max(1, min(p.max_calls, n_calls)),
                        first_call_tokens=p.subagent_prefix_tokens + p.first_user_tokens,
                        turn_tokens_median=p.growth_median,
                        turn_tokens_sigma=p.growth_sigma,
                        output_median=p.output_median,
                        output_sigma=p.output_sigma,
                        think_median_s=p.gap_median_s,
                        think_sigma=p.gap_sigma,
                        max_context=p.max_context_tokens,
                    )
                    if not chain:
                        continue
                    n_sub += 1
                    name = f"agent_{n_sub:03d}"
                    sub = _trace_calls(
                        chain,
                        agent=name,
                        parent="main",
                        prefix_tokens=min(p.subagent_prefix_tokens, chain[0].new_tokens),
                        group="Explore",
                        block_size=bs,
                        next_id=next_id,
                        first_deps=(Dep(c.id, 1.0),),
                    )
                    calls.extend(sub)
                    pending_join.append((join_at, sub[-1].id))
        sessions.append(Session(id=f"syn{ch.index:04d}", calls=calls, arrival_s=ch.start_s))
    return Trace(
        name=f"synthetic-agentx-s{p.seed}",
        block_size=bs,
        sessions=sessions,
        id_scope="session",
        open_loop=True,
        meta={"format": "synthetic", "params": asdict(p)},
    )
