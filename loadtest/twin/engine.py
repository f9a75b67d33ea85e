"""The twin's engine model: vLLM v1 scheduling and KV block management, without a model.

Owns: the state machine one replica runs — requests, the waiting queue (FCFS, or by
priority), the running batch, the GPU block pool with prefix caching, the optional host-DRAM
and storage tiers, KV event generation — and the duration of each step (from a timing model,
:mod:`loadtest.twin.truth`: a truth the router is not told, or ``costmodel.steptime``'s
formula by default in Python). It does
not own time: a driver (the HTTP replica's asyncio loop, or the discrete-event simulator)
calls ``schedule(now)`` to get a :class:`Step`, waits ``step.duration`` and calls
``complete(step, end)``. No sockets, no HTTP, no asyncio; must not import aiohttp or zmq.

vLLM v1 semantics modelled (``vllm/v1/core/sched/scheduler.py``, ``block_pool.py``,
``kv_cache_manager.py`` in 0.32.0):

* One token budget per step (``max_num_batched_tokens``), at most ``max_num_seqs`` running.
  Running requests are scheduled first, in order; then waiting requests FCFS while budget,
  seats and blocks last. Chunked prefill: a prefill takes what budget is left, capped by
  ``long_prefill_token_threshold`` when set. A decode takes one token.
* Blocks: a pool of ``gpu_kv_blocks`` of which one is vLLM's reserved null block. Only full
  blocks are hashed and cached (chained hash of the request's tokens); blocks are cached when
  they are *allocated for* computation (so a request scheduled later in the same step already
  hits them). A prefix hit takes the longest run of cached blocks, capped so that at least
  one prompt token is computed (``(num_tokens - 1) // block_size`` blocks).
  Ref-counted; a freed cached block goes to the tail of the free queue (a request's blocks
  in reverse order, so its last blocks are evicted first) and stays cached until it is
  reallocated from the head (LRU eviction, one ``BlockRemoved`` per evicted block); a freed
  block without a hash goes to the front (reused first). A block recomputed while its hash
  is cached elsewhere becomes a second cached copy (stored and removed on its own).
* Priority policy (profile ``priority_scheduling``, vLLM's ``--scheduling-policy priority``):
  the waiting queue is ordered by (priority, arrival) instead, a preempted request goes back
  at its place in that order, and the running request preempted is the one with the largest
  (priority, arrival), dropped from the step if already scheduled in it.
* No room for a running request: preempt the last running request (recompute: free its
  blocks, back to the front of the waiting queue). A waiting request is admitted only if
  its whole sequence so far fits in the free blocks (``scheduler_reserve_full_isl``, on by
  default), not just its first chunk; an async load from a lower tier only within the free
  blocks less what the other in-flight prefills still need (``reserved_blocks``). No room:
  stop admitting this step — except where stopping would freeze the engine (nothing running,
  a load behind holding blocks), where vLLM 0.32 stops for good (vllm#57841) and the twin
  scans on past the head instead (:meth:`Engine._stranding`).
* Tiers (optional), as vLLM's ``OffloadingConnector`` (``offloading/scheduler.py``,
  ``kv_offload/cpu/manager.py``, ``kv_offload/tiering/manager.py``): write-through, not a
  victim cache. Each prompt block a step computes is offered to host DRAM (:class:`HostTier`,
  LRU, capacity ``cpu_kv_blocks``) by the step that computes it, and written on to storage
  when the write ends (every stored chunk goes to every tier); a GPU eviction moves nothing.
  A request with no lower-tier hit offers all its prompt blocks (so a GPU hit puts back what
  the host tier lost), one that loads offers only the blocks after its hit. When a request
  ends, the host chunks it offered or loaded become the most recently used (its first block
  last). A prefix hit continues into the lower tiers and the request waits (like
  ``WAITING_FOR_REMOTE_KVS``) for ``load_time(cpu) + load_time(storage)`` while other
  requests run (the loaded chunks cannot be evicted meanwhile; storage chunks are staged
  through the host tier), then holds those blocks in GPU. Lower-tier events carry ``medium``
  CPU/STORAGE, empty token ids and block size 0, as vLLM's tiers publish them: removals when
  the store pass evicts, ``BlockStored`` when the step's writes end.
  With ``host_write_back`` (the plugin's write-back tier, ``engine_patches.writeback``)
  nothing is written through: the blocks an allocation evicts from HBM go to the host tier,
  and the step that evicts them waits for the copy (:meth:`Engine._write_back`).
* Prefill cadence (optional, ``prefill_interval_steps`` N > 1): waiting requests are admitted
  only every N-th step, except when nothing is running (the capacity guard: an idle engine
  never waits for its cadence).

The engine plugin (``engine_patches``, docs/engine.md), optional and off by default
(:class:`EnginePlugin`):

* Retention (``EnginePlugin.retention``): the host tier is :class:`HostTier` with vLLM's LRU
  plus the session holds of ``AgentRetentionPolicy``, decided by the same pure rule
  (:mod:`engine_patches.retention_rule`) from the request's ``kvroute`` hint
  (``Request.hint``). Host chunks a hinted request stores belong to its session; when it
  finishes, the chunks it offered or loaded do too and its hint applies (hold, ``running``,
  ``done`` = to the cold end). Each store pass that needs room runs one ``evict(n)`` of the
  plugin's policy.
* Bounded prefill cadence (``EnginePlugin.cadence``): each step asks
  :class:`engine_patches.cadence.PrefillCadence` (the plugin scheduler's pure rule, with the
  same pending list: running prefill chunks, and waiting requests flagged eligible by
  ``eligible_flags`` over the token budget and free seats) whether prefill may run; a held
  step defers all prefill compute as ``throttle_prefills`` does. It replaces
  ``prefill_interval_steps`` when both are set.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Callable
from typing import Any

from costmodel.profiles import ReplicaProfile
from costmodel.steptime import attended_pairs
from engine_patches.cadence import PrefillCadence
from loadtest.twin.blockpool import BlockPool
from loadtest.twin.engine_admission import EngineAdmission
from loadtest.twin.plugin import EnginePlugin
from loadtest.twin.request import (
    ABORTED,
    FINISHED,
    LOADING,
    REMOTE,
    RUNNING,
    WAITING,
    Request,
    Step,
    StepResult,
)
from loadtest.twin.tiers import ClusterPool, HostTier, TierLRU
from loadtest.twin.truth import StepTiming, Truth, timing
from router.vllm.hashing import BlockHasher
from router.vllm.kvevents import encode_all_cleared

__all__ = [
    "ABORTED",
    "FINISHED",
    "LOADING",
    "REMOTE",
    "RUNNING",
    "WAITING",
    "BlockPool",
    "ClusterPool",
    "Engine",
    "EnginePlugin",
    "HostTier",
    "Request",
    "Step",
    "StepResult",
    "TierLRU",
]


class Engine(EngineAdmission):
    """One replica's engine model. See the module docstring for the semantics."""

    def __init__(
        self,
        profile: ReplicaProfile,
        *,
        hasher: BlockHasher | None = None,
        emit_events: bool = True,
        output_token: Callable[[Request, int], int] | None = None,
        keep_digests: bool = False,
        plugin: EnginePlugin | None = None,
        truth: str | Truth | None = None,
        cluster_pool: ClusterPool | None = None,
    ):
        self.profile = profile
        self.plugin = plugin = plugin or EnginePlugin()
        # step and load times: a truth (loadtest.twin.truth), None = costmodel's formula
        self.timing: StepTiming = timing(profile, truth)
        self.block_size = profile.block_size
        self.hasher = hasher
        if hasher is not None and hasher.block_size != profile.block_size:
            raise ValueError("hasher block size differs from the profile's")
        self.events: list[dict[str, Any]] | None = [] if emit_events else None
        if plugin.retention is not None and not profile.cpu_kv_blocks:
            raise ValueError("retention needs a host tier (cpu_kv_blocks > 0)")
        # the write-back tier's host pool is a vLLM BlockPool, whose block 0 is its null block
        host_blocks = profile.cpu_kv_blocks - (1 if profile.host_write_back else 0)
        self.cpu = HostTier(host_blocks, plugin.retention) if profile.cpu_kv_blocks else None
        self.storage = TierLRU(profile.storage_kv_blocks) if profile.storage_kv_blocks else None
        self.pool = BlockPool(profile.gpu_kv_blocks, self.events)
        if profile.host_write_back and self.cpu is not None:
            self.pool.victims = []
        # the cluster pool (shared with the other engines of a cluster; a profile with
        # pool_kv_blocks and no pool handed in gets one of its own: a cluster of one)
        if cluster_pool is None and profile.pool_kv_blocks:
            cluster_pool = ClusterPool(profile.pool_kv_blocks)
        if cluster_pool is not None and (self.cpu is None or profile.host_write_back):
            raise ValueError("a cluster pool needs a write-through host tier (cpu_kv_blocks > 0)")
        self.cluster_pool = cluster_pool
        self._promoting: set[int] = set()  # host chunks being staged from storage or the pool
        # lower-tier stores by group (one per request and store pass): those of the step being
        # planned, and those of the step before, which the worker writes during the next step
        # (vLLM defers a step's stores to the next one's start) — settled when that step ends
        self._writing: list[list[int]] = []
        self._in_flight: list[list[int]] = []
        self.cadence = (
            PrefillCadence(plugin.cadence, profile.max_num_batched_tokens)
            if plugin.cadence is not None
            else None
        )
        self.now = 0.0  # the time of the last schedule() / complete()
        self.waiting: deque[Request] = deque()
        # vLLM's --scheduling-policy priority: the waiting queue by (priority, arrival), and
        # the running request with the largest (priority, arrival) preempted (else FCFS)
        self.by_priority = bool(profile.priority_scheduling)
        self._seq = 0
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.output_token = output_token or _default_output_token
        # key -> full digest, for publishers that send digests (VLLM_KV_EVENTS_USE_INT_...=0)
        self.digests: dict[int, bytes] | None = {} if keep_digests else None
        self.step_count = 0
        self.prefill_capacity_bound = False
        # counters (vLLM metric names in the HTTP layer)
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens hit (any tier)
        self.tier_hit_blocks = {"gpu": 0, "cpu": 0, "storage": 0, "pool": 0}
        self.remote_blocks = 0  # blocks received from a prefill replica (P/D decode side)
        # prompt tokens hit by tier, once per request (vllm:prompt_tokens_cached_by_source:
        # vLLM labels a pool hit "disk", the source of every STORAGE tier)
        self.cached_by_source = {"device": 0, "host": 0, "disk": 0}
        # the same with the pool apart from the disk tier (the twin's own counter)
        self.cached_by_tier = {"device": 0, "host": 0, "disk": 0, "pool": 0}
        self.preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.busy_time = 0.0

    # ---- requests ----------------------------------------------------------------------

    def add(self, req: Request) -> None:
        if req.id in self.requests:
            raise ValueError(f"duplicate request id {req.id!r}")
        if req.prompt_len + req.max_tokens > self.profile.max_model_len:
            raise ValueError(
                f"prompt ({req.prompt_len}) + max_tokens ({req.max_tokens}) exceeds "
                f"max_model_len {self.profile.max_model_len}"
            )
        self.requests[req.id] = req
        self._seq += 1
        req.seq = self._seq
        if self.by_priority:
            self._insert_waiting(req)
        else:
            self.waiting.append(req)

    def abort(self, req_id: str) -> bool:
        req = self.requests.pop(req_id, None)
        if req is None:
            return False
        if req.status == RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.cpu is not None:
            if req.status == LOADING and not req.remote_tokens:
                self.cpu.unpin(req.load_blocks)
            self._host_finish(req, self.now)
        self.pool.release(req.blocks)
        req.blocks = []
        req.status = ABORTED
        return True

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``/reset_prefix_cache``: fails while any request holds blocks."""
        if not self.pool.reset():
            return False
        if self.cpu is not None:
            self.cpu.clear()
        if self.storage is not None:
            self.storage.clear()
        self._writing.clear()
        self._in_flight.clear()
        self._promoting.clear()
        self._emit(encode_all_cleared())  # the cluster pool is not this engine's: it stays
        return True

    def take_events(self) -> list[dict[str, Any]]:
        if not self.events:
            return []
        out = list(self.events)
        self.events.clear()
        return out

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def next_ready(self) -> float | None:
        """When the earliest loading request becomes schedulable (None: none loading)."""
        t = [r.ready_at for r in self.waiting if r.status == LOADING]
        return min(t) if t else None

    def schedule(self, now: float) -> Step | None:
        """Plan one step at time ``now``; None when nothing can run now."""
        p = self.profile
        budget = p.max_num_batched_tokens
        running = self.running
        # vLLM applies long_prefill_token_threshold only when another request could starve
        thresh = p.long_prefill_token_threshold if len(running) + len(self.waiting) > 1 else 0
        max_len = p.max_model_len
        self.now = now
        cadence = p.prefill_interval_steps
        bounded = self.cadence
        pending_left: dict[str, int] | None = None
        if bounded is not None:
            # the engine plugin's bounded cadence decides (throttle_prefills = not admit)
            pending = self.pending_prefills()
            decoding = any(r.num_tokens - r.num_computed <= 1 for r in running)
            defer = not bounded.decide(now, pending, decoding).admit
            pending_left = {x.req_id: x.remaining_tokens for x in pending}
        else:
            # Prefill cadence (vLLM's throttle_prefills): on a step off the cadence, defer all
            # prefill compute, unless the last admitting step could not drain the waiting
            # queue (the capacity guard) or no running request could decode instead.
            defer = (
                cadence > 1
                and self.step_count % cadence != 0
                and not self.prefill_capacity_bound
                and any(r.num_computed >= r.num_tokens - 1 for r in running)
            )
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = req.num_tokens - req.num_computed
            if defer and n > 1:
                i += 1  # an in-progress prefill chunk waits for a cadence step
                continue
            if 0 < thresh < n:
                n = thresh
            n = min(n, budget, max_len - 1 - req.num_computed)
            if n <= 0:
                i += 1
                continue
            while not self._allocate(req, n):
                vi = self._victim(running)
                victim = running.pop(vi)
                if vi < i:  # priority policy: a request already scheduled this step
                    i -= 1
                    k = next(k for k, (r, _) in enumerate(scheduled) if r is victim)
                    budget += scheduled.pop(k)[1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n
                i += 1
                continue
            break  # req preempted itself
        if not preempted:
            skipped: list[Request] = []
            while self.waiting and budget > 0 and len(running) < p.max_num_seqs:
                req = self.waiting[0]
                if req.status == LOADING:
                    if req.ready_at > now:
                        skipped.append(self.waiting.popleft())
                        continue
                    self._finish_load(req)
                if not req.blocks:
                    got = self._admit(req, now, budget, thresh, defer)
                    if got is None:
                        if self._stranding(req, defer):
                            skipped.append(self.waiting.popleft())
                            continue
                        break
                    if got == 0:  # loading from a lower tier
                        skipped.append(self.waiting.popleft())
                        continue
                    n = got
                else:  # loaded from a lower tier: blocks and computed tokens in place
                    n = req.num_tokens - req.num_computed
                    if defer and n > 1:
                        break
                    if 0 < thresh < n:
                        n = thresh
                    n = min(n, budget)
                    if not self._allocate(req, n):
                        if self._stranding(req, defer):
                            skipped.append(self.waiting.popleft())
                            continue
                        break
                self.waiting.popleft()
                req.status = RUNNING
                if req.queued_time is None:
                    req.queued_time = now
                running.append(req)
                scheduled.append((req, n))
                budget -= n
            self.waiting.extendleft(reversed(skipped))
            if not defer:
                self.prefill_capacity_bound = len(self.waiting) > len(skipped)
        if bounded is not None:
            assert pending_left is not None
            bounded.observe(sum(min(n, pending_left[r.id]) for r, n in scheduled
                                if r.id in pending_left))  # fmt: skip
        if not scheduled:
            if self._in_flight or self._writing:  # vLLM steps on to finish its transfers
                self._settle()
                self._in_flight, self._writing = self._writing, []
            if preempted:
                # the only running request preempted itself (it was short of a block, held
                # by a parked load): vLLM's engine core schedules again at once, and that
                # step admits from the waiting queue, which this one skipped. Without this
                # the twin slept until the next arrival, and forever if none came. Once:
                # nothing runs now, so nothing more can be preempted.
                assert not running
                return self.schedule(now)
            return None
        if self.cpu is not None or self.storage is not None:
            # the connector's store pass (build_connector_meta): the prompt blocks this step
            # completes are offered to the lower tiers (offload_prompt_only)
            bs = self.block_size
            for req, n in scheduled:
                horizon = min(req.num_computed + n, req.prompt_len) // bs
                if horizon > req.host_next:
                    self._keys_upto(req, horizon)
                    self._store_lower(req, horizon, now)
        pf_att = pf_kv = dc_kv = 0.0
        pf = dc = 0
        for req, n in scheduled:
            ctx = req.num_computed
            if n == 1:
                dc_kv += ctx
                dc += 1
            else:
                pf_att += attended_pairs(n, ctx)
                pf_kv += ctx
                pf += n
        dur = self.timing.step(pf, pf_att, pf_kv, dc, dc_kv) + self._write_back(now)
        self.step_count += 1
        return Step(scheduled, dur, now, pf, dc, preempted)

    def complete(self, step: Step, end: float) -> StepResult:
        """Apply a step's computation at time ``end``: tokens, first tokens, finishes."""
        self.busy_time += step.duration
        if self._in_flight:
            self._settle()  # the previous step's stores, written during this one
        self._in_flight, self._writing = self._writing, []
        got: list[Request] = []
        first: list[Request] = []
        done: list[Request] = []
        for req, n in step.scheduled:
            if req.status != RUNNING:
                continue  # aborted during the step
            req.num_computed += n
            if req.num_computed < req.num_tokens:
                continue  # a partial prefill chunk
            if req.num_output == 0:
                self.prompt_tokens_total += req.prompt_len
            tok = self.output_token(req, req.num_output)
            req.num_output += 1
            if req.token_ids is not None:
                req.output_ids.append(tok)
            self.generation_tokens_total += 1
            got.append(req)
            if req.first_token_time is None:
                req.first_token_time = end
                first.append(req)
            if req.num_output >= req.max_tokens or req.num_tokens >= self.profile.max_model_len:
                req.status = FINISHED
                req.finish_time = end
                done.append(req)
        if done:
            self.now = end
            ids = {id(r) for r in done}
            self.running = [r for r in self.running if id(r) not in ids]
            for req in done:
                if self.cpu is not None:
                    self._host_finish(req, end)
                self.pool.release(req.blocks)
                req.blocks = []
                self.requests.pop(req.id, None)
        if self._in_flight and not self.has_work:
            self._settle()  # the flush step vLLM runs while transfers are pending
        return StepResult(got, done, first)

    # ---- views -------------------------------------------------------------------------

    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_usage(self) -> float:
        return self.pool.usage()


def _default_output_token(req: Request, i: int) -> int:
    """A deterministic stand-in for sampling (the twin has no model)."""
    return (zlib.crc32(f"{req.id}/{i}".encode()) & 0x7FFFFFFF) % 1000 + 100
