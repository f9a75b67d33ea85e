"""One replica twin: the engine model run in (compressed) real time.

Owns: :class:`TwinConfig` and :class:`TwinReplica` — the engine (:mod:`loadtest.twin.engine`),
the tokenizer, the KV-event publisher (:mod:`loadtest.twin.publisher`), the metrics
(:mod:`loadtest.twin.exporter`) and the asyncio loop that steps the engine in model time and
feeds each request's output tokens to its HTTP handler (:mod:`loadtest.twin.server`). Must
not import aiohttp, torch or vllm.

Time: the engine lives in *model time* (seconds on the simulated hardware). With ``speedup``
X, a step of d model seconds takes d/X wall seconds, and the API-server overhead of the
profile likewise. Everything a client measures (TTFT, ITL, latency) and the histograms in
``/metrics`` are wall-clock, so they are model time divided by X: multiply by X (the
``x-twin-speedup`` response header and the ``kvroute:twin_speedup`` gauge carry X) to scale
them back. KV-event timestamps are wall-clock ``time.time()`` like vLLM's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from costmodel.profiles import ReplicaProfile
from loadtest.twin.engine import FINISHED, ClusterPool, Engine, EnginePlugin, Request
from loadtest.twin.exporter import TwinMetrics
from loadtest.twin.publisher import KVEventPublisher
from loadtest.twin.tokenize import ModelTokenizer
from loadtest.twin.turns import TurnPolicy
from router.vllm.hashing import BlockHasher

log = logging.getLogger("kvroute.twin")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}  # fmt: skip


MAX_LAG_WALL_S = 0.01  # how far (wall seconds) the model clock may trail the wall clock


@dataclass
class TwinConfig:
    profile: ReplicaProfile
    model_dir: Path
    name: str = "twin"
    served_model_name: str = "tiny"
    speedup: float = 1.0
    kv_events_endpoint: str | None = None  # vLLM semantics: bind if "*"/"::"/ipc/inproc
    kv_events_topic: str | None = None  # None: "kv@<name>"; "" is vLLM's default
    kv_events_replay: str | None = None  # ROUTER endpoint for replays (binds; "...:*" ok)
    # bind kv_events_endpoint even with a named host (one twin per loopback address standing
    # in for one vLLM per host binding tcp://*:PORT); None: vLLM's rule (publisher_binds)
    kv_events_bind: bool | None = None
    hash_algo: str = "sha256_cbor"
    hash_seed: str | None = None  # the engine's PYTHONHASHSEED
    int_hashes: bool = True  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    max_model_len: int | None = None  # default: the profile's
    # vLLM's --enable-auto-tool-choice (with a --tool-call-parser), on by default as agents
    # need it: tools with any tool_choice are served, and replies call them (below). False:
    # a bare vLLM, which refuses tool_choice "auto" (the default with tools) and "required".
    enable_auto_tool_choice: bool = True
    # How replies end (loadtest.twin.turns): a reply that ends by itself is a call to one of
    # the offered tools with this probability under tool_choice "auto" (after a tool result:
    # the second rate, so an agent loop comes back to text); lengths are drawn from the
    # profile's output_median_tokens / output_sigma. ``seed`` seeds every such draw (with
    # the request's prompt).
    tool_call_rate: float = 0.5
    tool_call_rate_after_result: float = 0.2
    seed: int = 0
    # the engine plugin's retention (hints) and bounded cadence, as the twin models them;
    # off by default (docs/twin.md). Its times (TTL, deferral bound) are model seconds.
    plugin: EnginePlugin = field(default_factory=EnginePlugin)
    # the engine's timing (loadtest.twin.truth): a truth name, or None for costmodel's formula.
    # Never exposed over HTTP (no header, metric or field names it): a router cannot read it
    truth: str | None = None
    # P/D disaggregation (vLLM's kv_role): "prefill" (kv_producer: answers a
    # ``do_remote_decode`` call with its ``kv_transfer_params``), "decode" (kv_consumer: a
    # call carrying a prefill's params waits for the transfer instead of prefilling) or
    # "both" (kv_both, the default: either); see docs/twin.md
    role: str = "both"
    # where a decode replica would fetch this one's KV from (the params' remote_host/port)
    host: str = "127.0.0.1"
    port: int = 0

    def __post_init__(self) -> None:
        if not self.speedup > 0:
            raise ValueError(f"speedup must be > 0, got {self.speedup}")
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, got {self.role!r}")
        self.turn_policy()  # the rates' checks

    def turn_policy(self) -> TurnPolicy:
        p = self.profile
        return TurnPolicy(p.output_median_tokens, p.output_sigma, self.tool_call_rate,
                          self.tool_call_rate_after_result, self.seed)  # fmt: skip


@dataclass
class Stream:
    """Per-request channel from the engine loop to the HTTP handler."""

    req: Request
    queue: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    t_arrival: float = 0.0


class TwinReplica:
    """One twin: engine, tokenizer, event publisher, and the loop that runs steps."""

    # what a restart keeps of the engine: its counters (a scrape sees one replica's totals)
    COUNTERS = ("prefix_queries", "prefix_hits", "preemptions", "prompt_tokens_total",
                "generation_tokens_total", "busy_time")  # fmt: skip

    def __init__(
        self,
        cfg: TwinConfig,
        tokenizer: ModelTokenizer | None = None,
        zmq_ctx: Any = None,
        cluster_pool: ClusterPool | None = None,
    ):
        self.cfg = cfg
        self.profile = cfg.profile
        self.max_model_len = cfg.max_model_len or cfg.profile.max_model_len
        if self.max_model_len != cfg.profile.max_model_len:
            self.profile = cfg.profile.replace(model=_with_len(cfg.profile, self.max_model_len))
        self.tokenizer = tokenizer or ModelTokenizer(cfg.model_dir, self.profile.block_size)
        self.hasher = BlockHasher(self.profile.block_size, cfg.hash_algo, cfg.hash_seed)
        # the cluster pool this twin shares with the others of its cluster (None: its profile's
        # pool_kv_blocks, if any, gives it one of its own)
        self.cluster_pool = cluster_pool
        self.engine = self._new_engine()
        # disruptions (kvroute bench --disrupt): "up"; "draining" (in-flight calls finish,
        # new ones and /health get 503); "down" (stopped: 503 until it is up again)
        self.state = "up"
        self.restarts = 0
        self.topic = f"kv@{cfg.name}" if cfg.kv_events_topic is None else cfg.kv_events_topic
        self.publisher = (
            KVEventPublisher(
                cfg.kv_events_endpoint,
                self.topic,
                zmq_ctx,
                cfg.int_hashes,
                replay_endpoint=cfg.kv_events_replay,
                bind=cfg.kv_events_bind,
            )
            if cfg.kv_events_endpoint
            else None
        )
        self.speedup = cfg.speedup
        self.turns = cfg.turn_policy()  # how replies end: lengths, finish reasons, tool calls
        self.streams: dict[str, Stream] = {}
        self.in_flight = 0
        self._wake = asyncio.Event()
        self._t0 = time.monotonic()
        self.lagged_s = 0.0  # wall seconds the engine trailed its schedule at the last step
        self.failed: BaseException | None = None  # the engine loop's error, once it died
        self._task: asyncio.Task[None] | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.created = int(time.time())
        self.metrics = TwinMetrics(self)

    def _new_engine(self) -> Engine:
        return Engine(
            self.profile,
            hasher=self.hasher,
            output_token=self._output_token,
            keep_digests=not self.cfg.int_hashes,
            plugin=self.cfg.plugin,
            truth=self.cfg.truth,
            cluster_pool=self.cluster_pool,
        )

    # ---- disruptions --------------------------------------------------------------------

    async def restart(self, downtime_s: float = 0.0, drain_timeout_s: float = 600.0) -> None:
        """A rolling upgrade's turn for this replica: drain (new calls and ``/health`` get
        503 while in-flight calls finish, at most ``drain_timeout_s`` model seconds, then they
        are cut), stop, and start again after ``downtime_s`` model seconds with an empty cache
        (HBM, host and disk tiers; a cluster pool is not the replica's and stays). The new
        engine's first batch is ``AllBlocksCleared`` (what a router that notices the restart
        drops; real vLLM starts a new event stream). Counters carry over."""
        self.state = "draining"
        deadline = time.monotonic() + drain_timeout_s / self.speedup
        while self.streams and time.monotonic() < deadline:  # noqa: ASYNC110 (a poll is enough)
            await asyncio.sleep(0.005)
        self.go_down()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        old, self.engine = self.engine, self._new_engine()
        for name in self.COUNTERS:
            setattr(self.engine, name, getattr(old, name))
        for d in ("tier_hit_blocks", "cached_by_source", "cached_by_tier"):
            getattr(self.engine, d).update(getattr(old, d))
        self.engine.reset_prefix_cache()  # AllBlocksCleared: the router's view starts empty
        self._publish()
        self.restarts += 1
        if downtime_s > 0:
            await asyncio.sleep(downtime_s / self.speedup)
        self.start()
        self.state = "up"

    def go_down(self) -> None:
        """Lost (or stopped): calls in flight are cut, new calls and ``/health`` get 503."""
        self.state = "down"
        for st in list(self.streams.values()):
            if not st.req.finished:
                self.engine.abort(st.req.id)
            st.queue.put_nowait(None)
        self._wake.set()

    def go_up(self) -> None:
        self.state = "up"

    # ---- time ---------------------------------------------------------------------------

    def model_now(self) -> float:
        return (time.monotonic() - self._t0) * self.speedup

    async def _sleep_until(self, t_model: float) -> bool:
        """Sleep until model time ``t_model``; False when it has passed already."""
        delay = (t_model - self.model_now()) / self.speedup
        if delay > 0:
            await asyncio.sleep(delay)
            return True
        return False

    # ---- engine loop --------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._run(), name=self.cfg.name)
            if self.publisher is not None and self.publisher.replay_endpoint:
                self._replay_task = loop.create_task(self.publisher.serve_replay())

    async def stop(self) -> None:
        for task in (self._task, self._replay_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._replay_task = None
        for st in self.streams.values():
            st.queue.put_nowait(None)
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    def _publish(self) -> None:
        evs = self.engine.take_events()
        if evs and self.publisher is not None:
            self.publisher.publish(evs, self.engine.digests)

    async def _run(self) -> None:
        """The engine loop; if the engine model fails, the twin reports itself dead like a
        vLLM whose engine core died (``/health`` 500, requests refused, streams ended)
        instead of hanging its clients."""
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("twin %s: engine loop failed", self.cfg.name)
            self.failed = e
            for st in self.streams.values():
                st.queue.put_nowait(None)

    async def _loop(self) -> None:
        """Step the engine in model time. Back-to-back steps chain on the model clock (a
        step starts when the previous one ended), so the event loop's timer jitter and the
        twin's own CPU time do not accumulate — up to ``MAX_LAG_WALL_S`` behind the wall
        clock, after which the model clock is pulled forward (the twin is then too slow for
        its speedup)."""
        eng = self.engine
        free_at: float | None = None  # model time the last step ended (None: was idle)
        while True:
            if not eng.has_work:
                free_at = None
                self._wake.clear()
                await self._wake.wait()
                continue
            real = self.model_now()
            now = real if free_at is None else max(free_at, real - MAX_LAG_WALL_S * self.speedup)
            self.lagged_s = max(0.0, real - now) / self.speedup
            step = eng.schedule(now)
            if step is None:
                self._publish()
                free_at = None
                nxt = eng.next_ready()
                self._wake.clear()
                timeout = None if nxt is None else max(0.0, (nxt - real) / self.speedup)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
                continue
            end = now + step.duration
            if not await self._sleep_until(end):
                await asyncio.sleep(0)  # behind schedule: still let handlers run
            free_at = end
            res = eng.complete(step, end)
            self._publish()
            wall = time.monotonic()
            for req in res.tokens:
                st = self.streams.get(req.id)
                if st is None:
                    continue
                if req.num_output == 1:
                    self.metrics.ttft.append(wall - st.t_arrival)
                st.queue.put_nowait(req.output_ids[-1] if req.output_ids else 0)
            for req in res.finished:
                st = self.streams.get(req.id)
                if st is not None:
                    st.queue.put_nowait(None)

    def _output_token(self, req: Request, i: int) -> int:
        return self.tokenizer.plain_token(zlib.crc32(f"{req.id}/{i}".encode()))

    def check_alive(self, served: Request | None = None) -> None:
        """Raise the error a call gets from a dead engine (500) or a replica that is not up
        (503: draining, restarting, down). With ``served`` (after its stream ended), only
        what cut it short: a call that finished while its replica drains is answered."""
        if self.failed is not None:
            raise ApiError(
                500, f"EngineCore encountered an issue: {self.failed!r}", "EngineDeadError"
            )
        if served is not None:
            if served.status != FINISHED and self.state != "up":
                raise ApiError(503, f"replica {self.cfg.name} went {self.state}",
                               "ServiceUnavailable")  # fmt: skip
            return
        if self.state != "up":
            raise ApiError(503, f"replica {self.cfg.name} is {self.state}", "ServiceUnavailable")

    def submit(self, req: Request, t_arrival: float | None = None) -> Stream:
        """Hand ``req`` to the engine; ``t_arrival`` (monotonic) is when the HTTP request came
        in, so TTFT in /metrics includes the API overhead, as vLLM's does."""
        st = Stream(req, t_arrival=time.monotonic() if t_arrival is None else t_arrival)
        self.engine.add(req)
        self.streams[req.id] = st
        self._wake.set()
        return st

    def release(self, req: Request) -> None:
        self.streams.pop(req.id, None)
        if not req.finished:
            self.engine.abort(req.id)
            self._wake.set()

    def reset_prefix_cache(self) -> bool:
        ok = self.engine.reset_prefix_cache()
        self._publish()
        return ok


def _with_len(p: ReplicaProfile, n: int):  # -> ModelProfile
    import dataclasses

    return dataclasses.replace(p.model, max_model_len=n)
