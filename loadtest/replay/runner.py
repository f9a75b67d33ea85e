"""The closed-loop (and open-loop) replay of a trace against an OpenAI-compatible target.

Owns: :class:`ReplayConfig` and :func:`replay`, which plays sessions as DAGs — each call
starts when its dependencies have ended plus their (scaled) delays — and writes
``calls.jsonl``, ``sessions.jsonl``, ``queue.jsonl`` and ``summary.json`` into the output
folder.

- Calls with ``not_before_s`` also wait until that long (scaled) after their session started.
- **Closed loop** (default): ``concurrency`` lanes; a lane plays one session at a time and
  takes the next when it finishes. When every session has been played, lanes recycle the
  trace as a new *play* whose prompts carry a per-play marker (a new namespace in
  :class:`~loadtest.prompts.PromptBuilder`), so a recycled play never hits a warm cache.
  Recycling goes on only while a ``duration_s`` bound is set and not reached.
- **Open loop**: every session starts at its ``arrival_s / time_scale`` (Mooncake), however
  many are in flight.
- **Bounded**: after ``duration_s`` no new session and no new call starts; calls still in
  flight get ``grace_s`` to finish, then are cancelled (recorded with error ``cancelled``,
  which the metrics count apart from failures). A session play the bound stopped before
  every call had ended is recorded with ``cut`` (the metrics report these plays apart, with
  their elapsed time, so completion times over finished plays can be read for their bias).
- Recorded delays are divided by ``time_scale`` (set it to a twin's ``speedup`` so idle gaps
  shrink with the simulated hardware).

Must not import the router (the harness must measure any router the same way).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from loadtest.metrics import UnlimitedCache, summarize
from loadtest.prompts import PromptBuilder
from loadtest.replay.client import CONVENTIONS, CallResult, session_headers, stream_chat
from loadtest.replay.records import CallRecord, QueueSample, SessionRecord, write_jsonl
from loadtest.traces.lanes import PlayCounter
from loadtest.traces.model import Call, Session, Trace
from loadtest.twin import TWIN_OUTPUT_FIELD, expect_key

AGENT_MAX_TOKENS = 32_000  # the output cap Claude Code and OpenCode send with every call
OUTPUT_LENGTHS = ("twin", "max_tokens")


@dataclass
class ReplayConfig:
    target: str  # base URL, e.g. http://127.0.0.1:8000
    model: str | None = None  # None: the first of GET /v1/models
    concurrency: int = 4
    duration_s: float | None = None
    grace_s: float = 30.0
    max_plays: int | None = None  # session plays to start at most (over all lanes)
    time_scale: float = 1.0
    open_loop: bool = False
    convention: str = "claude"
    request_timeout_s: float = 600.0
    speedup: float = 1.0  # the target's time compression (twins), for metrics
    gpus: int = 1
    metrics_urls: list[str] = field(default_factory=list)  # replicas' /metrics for queues
    queue_sample_s: float = 0.5
    extra_body: dict[str, Any] = field(default_factory=dict)
    progress: bool = True
    # What every call sends as its output cap, as agent clients do: one fixed number (Claude
    # Code and OpenCode send 32,000), or None (no cap: Codex-style, the server's remainder).
    max_tokens: int | None = AGENT_MAX_TOKENS
    # Where the call's recorded output length goes: "twin" — only in vllm_xargs
    # (kvroute_twin_output_tokens), which replica twins read and no router does; or
    # "max_tokens" — as the call's max_tokens, an oracle input a real agent never sends,
    # for real vLLM replicas in tests (a real model stops where it likes).
    output_lengths: str = "twin"
    # The model's context window as the client is configured with it (agents know their
    # model's window); None: as the target lists it in /v1/models (peers may not list it).
    context_limit: int | None = None
    # Twins to tell each call's recorded output length out of band as well (POST
    # /twin/expect, keyed by the request's last message): peer routers that re-serialize a
    # request drop vllm_xargs. A router never sees this channel. One URL per twin process.
    expect_urls: list[str] = field(default_factory=list)
    # Another seed, another workload on the same trace: it shuffles which sessions the lanes
    # take in which order, and starts each lane's first session at a seeded time in
    # [0, stagger_s) modelled seconds (the simulator's rule, loadtest.sim.trace). None: trace
    # order, every lane at 0.
    seed: int | None = None
    stagger_s: float = 0.0
    # Calls and sessions that start before warmup_s (modelled seconds) are left out of the
    # summary (they are still written to calls.jsonl), and so is that time from throughput.
    warmup_s: float = 0.0
    # called with the run clock's origin (time.monotonic()) when the replay starts: a harness
    # that acts during the run on the same clock as calls.jsonl (kvroute bench --disrupt)
    on_start: Callable[[float], None] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.convention not in CONVENTIONS:
            raise ValueError(f"convention must be one of {CONVENTIONS}")
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be positive")
        if self.output_lengths not in OUTPUT_LENGTHS:
            raise ValueError(f"output_lengths must be one of {OUTPUT_LENGTHS}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1 (or None: no cap)")
        if self.stagger_s < 0 or self.warmup_s < 0:
            raise ValueError("stagger_s and warmup_s must be >= 0")
        if self.warmup_s and self.duration_s is not None:
            if self.warmup_s / self.time_scale >= self.duration_s:
                raise ValueError("warmup_s must end before the run's duration")


class _Run:
    """State of one replay: records, the bound cache, in-flight count, the clock."""

    def __init__(self, trace: Trace, builder: PromptBuilder, cfg: ReplayConfig, model: str):
        self.trace = trace
        self.builder = builder
        self.cfg = cfg
        self.model = model
        self.t0 = time.monotonic()
        self.calls: list[CallRecord] = []
        self.sessions: list[SessionRecord] = []
        self.queue: list[QueueSample] = []
        self.bound = UnlimitedCache(builder.block_size)
        self.in_flight = 0
        self.stop_at = (self.t0 + cfg.duration_s) if cfg.duration_s else None
        self.url = cfg.target.rstrip("/") + "/v1/chat/completions"
        self.on_call: Callable[[CallRecord], None] = lambda r: None
        self.context_limit: int | None = None  # the model's max_model_len, when listed

    def now(self) -> float:
        return time.monotonic() - self.t0

    def stopped(self) -> bool:
        return self.stop_at is not None and time.monotonic() >= self.stop_at

    async def sleep_until(self, t_rel: float) -> bool:
        """Sleep until ``t_rel`` (run clock); False if the run's bound comes first."""
        target = self.t0 + t_rel
        if self.stop_at is not None and target >= self.stop_at:
            await asyncio.sleep(max(0.0, self.stop_at - time.monotonic()))
            return False
        await asyncio.sleep(max(0.0, target - time.monotonic()))
        return not self.stopped()

    def session_ns(self, s: Session, play: int) -> str:
        if self.trace.id_scope == "trace":
            return self.trace.name
        return f"{self.trace.name}/{s.id}"

    async def play_session(
        self, http: aiohttp.ClientSession, s: Session, play: int, lane: int
    ) -> None:
        start = self.now()
        ns = self.session_ns(s, play)
        sid = f"{self.trace.name}/{s.id}#{play}"
        ends: dict[str, asyncio.Future[float]] = {
            c.id: asyncio.get_running_loop().create_future() for c in s.calls
        }
        oks: dict[str, bool] = {}
        not_started: set[str] = set()  # calls the run's bound kept from starting

        async def run_call(c: Call) -> None:
            try:
                if c.deps:
                    done = [await ends[d.call] for d in c.deps]
                    ready = max(
                        t + d.delay_s / self.cfg.time_scale
                        for t, d in zip(done, c.deps, strict=True)
                    )
                else:
                    ready = start + c.start_delay_s / self.cfg.time_scale
                if c.not_before_s is not None:  # an absolute turn time (aiperf timestamps)
                    ready = max(ready, start + c.not_before_s / self.cfg.time_scale)
                if not await self.sleep_until(ready):
                    oks[c.id] = False
                    not_started.add(c.id)
                    return
                rec = await self.one_call(http, s.id, c, ns, sid, play, lane)
                oks[c.id] = rec.ok
            finally:
                if not ends[c.id].done():
                    ends[c.id].set_result(self.now())

        tasks = [asyncio.create_task(run_call(c)) for c in s.calls]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            complete = len(oks) == len(s.calls) and all(oks.values())
            # unfinished at the bound: a call never started, or one without an answer
            # (cancelled after the grace); a play that ran every call is not cut, even if
            # some failed
            ran_all = len(oks) == len(s.calls) and not not_started
            self.sessions.append(
                SessionRecord(
                    session=s.id,
                    play=play,
                    lane=lane,
                    t_start=start,
                    t_end=self.now(),
                    calls=sum(1 for c in s.calls if c.id in oks),
                    complete=complete,
                    cut=not complete and not ran_all and self.stopped(),
                )
            )

    async def one_call(
        self,
        http: aiohttp.ClientSession,
        session: str,
        c: Call,
        ns: str,
        sid: str,
        play: int,
        lane: int,
    ) -> CallRecord:
        prompt = self.builder.build(c, ns, play)
        bound = self.bound.observe(prompt.token_ids)
        body: dict[str, Any] = {
            "model": self.model,
            "messages": prompt.messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "temperature": 0.0,
        }
        if self.cfg.output_lengths == "max_tokens":
            body["max_tokens"] = c.output_tokens
        else:
            cap = self.cfg.max_tokens
            if cap is not None and self.context_limit is not None:
                # a client that knows its model's window fits the cap into it (OpenCode does)
                cap = max(1, min(cap, self.context_limit - prompt.n_tokens))
            if cap is not None:
                body["max_tokens"] = cap
            body["vllm_xargs"] = {TWIN_OUTPUT_FIELD: max(1, c.output_tokens)}
            key = expect_key(body) if self.cfg.expect_urls else None
            expected = {"key": key, "output_tokens": max(1, c.output_tokens)}
            for u in self.cfg.expect_urls if key else ():
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with http.post(u + "/twin/expect", json=expected) as r:
                        await r.read()
        body.update(self.cfg.extra_body)
        headers = session_headers(self.cfg.convention, sid, c.agent, c.parent_agent)
        self.in_flight += 1
        t_sent = self.now()
        self.queue.append(QueueSample(t_sent, self.in_flight))
        try:
            res = await stream_chat(
                http, self.url, body, headers, clock=self.now, timeout_s=self.cfg.request_timeout_s
            )
        except asyncio.CancelledError:
            res = CallResult(False, t_sent, self.now(), error="cancelled: run bound")
            self._record(session, c, play, lane, prompt.n_tokens, bound, res)
            raise
        finally:
            self.in_flight -= 1
            self.queue.append(QueueSample(self.now(), self.in_flight))
        return self._record(session, c, play, lane, prompt.n_tokens, bound, res)

    def _record(
        self,
        session: str,
        c: Call,
        play: int,
        lane: int,
        expected: int,
        bound: int,
        res: CallResult,
    ) -> CallRecord:
        rec = CallRecord(
            session=session,
            play=play,
            call=c.id,
            agent=c.agent,
            t_start=res.t_start,
            t_end=res.t_end,
            ok=res.ok,
            ttft_s=res.ttft_s,
            tpot_s=res.tpot_s,
            prompt_tokens=res.prompt_tokens if res.prompt_tokens is not None else expected,
            completion_tokens=res.completion_tokens,
            cached_tokens=res.cached_tokens,
            expected_prompt_tokens=expected,
            bound_cached_tokens=bound,
            replica=res.replica,
            lane=lane,
            status=res.status,
            error=res.error,
        )
        self.calls.append(rec)
        self.on_call(rec)
        return rec


async def _scrape(http: aiohttp.ClientSession, urls: list[str]) -> tuple[float | None, ...]:
    from prometheus_client.parser import text_string_to_metric_families

    waiting = running = 0.0
    got = False
    for u in urls:
        try:
            async with http.get(u, timeout=aiohttp.ClientTimeout(total=2)) as r:
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError):
            continue
        try:
            for fam in text_string_to_metric_families(text):
                for smp in fam.samples:
                    if smp.name == "vllm:num_requests_waiting":
                        waiting += smp.value
                        got = True
                    elif smp.name == "vllm:num_requests_running":
                        running += smp.value
        except ValueError:
            continue
    return (waiting, running) if got else (None, None)


async def _models(http: aiohttp.ClientSession, target: str) -> list[dict[str, Any]]:
    url = target.rstrip("/") + "/v1/models"
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
            data = await r.json(content_type=None)
        cards = [c for c in data["data"] if isinstance(c, dict) and "id" in c]
        if not cards:
            raise IndexError("no models")
        return cards
    except (aiohttp.ClientError, TimeoutError, KeyError, IndexError, ValueError, TypeError) as e:
        raise RuntimeError(f"cannot list models at {url}: {e!r}; pass --model") from e


async def _model_and_context(
    http: aiohttp.ClientSession, cfg: ReplayConfig
) -> tuple[str, int | None]:
    """The model to call and its context window as the target lists it (vLLM's model card
    has ``max_model_len``), which a client that knows its model uses to fit its cap."""
    try:
        cards = await _models(http, cfg.target)
    except RuntimeError:
        if cfg.model:
            return cfg.model, None  # a target without /v1/models: the cap as given
        raise
    card = next((c for c in cards if c["id"] == cfg.model), cards[0]) if cfg.model else cards[0]
    ctx = card.get("max_model_len")
    return cfg.model or str(card["id"]), ctx if isinstance(ctx, int) and ctx > 0 else None


async def replay(
    trace: Trace, builder: PromptBuilder, cfg: ReplayConfig, out_dir: str | Path | None = None
) -> dict[str, Any]:
    """Play ``trace`` against ``cfg.target``; returns the summary (also written to out_dir)."""
    conn = aiohttp.TCPConnector(limit=max(64, cfg.concurrency * 8), force_close=False)
    async with aiohttp.ClientSession(connector=conn) as http:
        model, context = await _model_and_context(http, cfg)
        run = _Run(trace, builder, cfg, model)
        if cfg.on_start is not None:
            cfg.on_start(run.t0)
        run.context_limit = cfg.context_limit or context
        progress = _Progress(cfg, trace) if cfg.progress else None
        if progress:
            run.on_call = progress.update
        sampler = asyncio.create_task(_sample_queue(run, http))
        try:
            if progress:
                progress.start()
            main = _open_loop(run, http) if cfg.open_loop else _closed_loop(run, http)
            await _bounded(run, main)
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            if progress:
                progress.stop()
        wall = max(run.now(), 1e-9)
    calls, sessions, queue = run.calls, run.sessions, run.queue
    if cfg.warmup_s:
        w = cfg.warmup_s / cfg.time_scale  # run clock
        calls = [c for c in calls if c.t_start >= w]
        sessions = [s for s in sessions if s.t_start >= w]
        queue = [q for q in queue if q.t >= w]
        wall = max(wall - w, 1e-9)
    summary = summarize(calls, sessions, queue, wall_s=wall, gpus=cfg.gpus, speedup=cfg.speedup)
    summary.update(
        {
            "trace": trace.name,
            "trace_stats": trace.stats(),
            "target": cfg.target,
            "model": model,
            "concurrency": cfg.concurrency,
            "open_loop": cfg.open_loop,
            "convention": cfg.convention,
            "shared_prefix": builder.shared_prefix,
            "block_size": builder.block_size,
            "trace_block_size": trace.block_size,
            "tokens_per_id": builder.tokens_per_id,
            "template_tokens": builder.template_tokens,
            "time_scale": cfg.time_scale,
            "prompt_tokens_mismatch": sum(
                1 for c in run.calls if c.ok and c.prompt_tokens != c.expected_prompt_tokens
            ),
        }
    )
    if out_dir is not None:
        write_outputs(Path(out_dir), run, summary)
    return summary


def write_outputs(out: Path, run: _Run, summary: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "calls.jsonl", sorted(run.calls, key=lambda r: r.t_start))
    write_jsonl(out / "sessions.jsonl", run.sessions)
    write_jsonl(out / "queue.jsonl", run.queue)
    (out / "summary.json").write_text(
        json.dumps({**summary, "config": asdict(run.cfg)}, indent=1, default=str)
    )


async def _bounded(run: _Run, main: Any) -> None:
    task = asyncio.ensure_future(main)
    if run.stop_at is None:
        await task
        return
    deadline = run.stop_at + run.cfg.grace_s - time.monotonic()
    done, _ = await asyncio.wait({task}, timeout=max(0.0, deadline))
    if not done:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _closed_loop(run: _Run, http: aiohttp.ClientSession) -> None:
    sessions = run.trace.sessions
    rng = np.random.default_rng(run.cfg.seed) if run.cfg.seed is not None else None
    if rng is not None:
        sessions = [sessions[i] for i in rng.permutation(len(sessions))]
    plays = PlayCounter(
        len(sessions), recycle=run.cfg.duration_s is not None, max_plays=run.cfg.max_plays
    )
    starts = [
        float(rng.uniform(0.0, run.cfg.stagger_s)) / run.cfg.time_scale
        if rng is not None and run.cfg.stagger_s
        else 0.0
        for _ in range(run.cfg.concurrency)
    ]

    async def lane(i: int) -> None:
        if starts[i] and not await run.sleep_until(starts[i]):
            return
        while not run.stopped():
            nxt = plays.next()
            if nxt is None:
                return
            await run.play_session(http, sessions[nxt[0]], nxt[1], i)

    lanes = [asyncio.create_task(lane(i)) for i in range(run.cfg.concurrency)]
    try:
        await asyncio.gather(*lanes)
    finally:
        for t in lanes:
            t.cancel()
        await asyncio.gather(*lanes, return_exceptions=True)


async def _open_loop(run: _Run, http: aiohttp.ClientSession) -> None:
    tasks: list[asyncio.Task[None]] = []
    sessions = run.trace.sessions
    if run.cfg.max_plays is not None:
        sessions = sessions[: run.cfg.max_plays]
    t_first = min((s.arrival_s or 0.0) for s in sessions) if sessions else 0.0
    try:
        for s in sessions:
            at = ((s.arrival_s or 0.0) - t_first) / run.cfg.time_scale
            if not await run.sleep_until(at):
                break
            tasks.append(asyncio.create_task(run.play_session(http, s, 0, 0)))
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _sample_queue(run: _Run, http: aiohttp.ClientSession) -> None:
    while True:
        await asyncio.sleep(run.cfg.queue_sample_s)
        waiting = running = None
        if run.cfg.metrics_urls:
            waiting, running = await _scrape(http, run.cfg.metrics_urls)
        run.queue.append(QueueSample(run.now(), run.in_flight, waiting, running))


class _Progress:
    """Rich progress: calls finished (of the trace's calls, or of the time bound)."""

    def __init__(self, cfg: ReplayConfig, trace: Trace):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.p = Progress(
            TextColumn("[bold]replay[/] {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            transient=True,
        )
        total = trace.n_calls if cfg.duration_s is None else None
        if cfg.max_plays is not None and not cfg.duration_s:
            total = sum(
                len(s.calls)
                for s in (trace.sessions * (cfg.max_plays // max(1, len(trace.sessions)) + 1))[
                    : cfg.max_plays
                ]
            )
        self.task = self.p.add_task(trace.name, total=total)
        self.failed = 0

    def start(self) -> None:
        self.p.start()

    def stop(self) -> None:
        self.p.stop()

    def update(self, rec: CallRecord) -> None:
        if not rec.ok:
            self.failed += 1
            self.p.update(self.task, description=f"({self.failed} failed)")
        self.p.advance(self.task)
