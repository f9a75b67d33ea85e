"""vLLM scheduler classes with the bounded prefill cadence (:mod:`engine_patches.cadence`).

Use with ``--scheduler-cls engine_patches.scheduler.CadenceScheduler`` (CPU platform, or any
engine without async scheduling) or ``engine_patches.scheduler.CadenceAsyncScheduler`` (GPU
hosts, where vLLM schedules asynchronously), and settings in
``--additional-config '{"kvroute": {"cadence": {"interval": 4, "max_defer_steps": 16,
"max_defer_ms": 500, "backlog_scale": 4}}}'`` (``kvroute engine flags`` writes both).

The classes are built on first attribute access (module ``__getattr__``), so this module
imports without vLLM; building one checks the vLLM version and refuses unknown ones.

How it hooks in (vLLM 0.32.0 and 0.33.0 alike): ``Scheduler.schedule(throttle_prefills)``
already knows how to hold back new admissions and in-flight prefill chunks for one step while
decodes run. The subclass decides ``throttle_prefills`` itself every step and clears vLLM's
``prefill_capacity_bound`` before each call, so vLLM's capacity escape never switches the
cadence off; the bounded guard in :class:`~engine_patches.cadence.PrefillCadence` replaces it.
0.33.0's own local cadence (``prefill_schedule_interval`` on a non-DP engine, with the same
escape) is turned off in these classes. A DP engine (``data_parallel_size > 1``) keeps vLLM's
own DP cadence: these classes then pass ``throttle_prefills`` through unchanged.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from engine_patches.cadence import CadenceConfig, PendingPrefill, PrefillCadence, eligible_flags

logger = logging.getLogger("vllm.kvroute.scheduler")

# Built lazily by __getattr__ below (so this module imports without vLLM).
SCHEDULER_CLASSES = ("CadenceAsyncScheduler", "CadenceScheduler")

# Prompt tokens this engine process still has to compute after its last scheduled step
# (running prefill chunks, and waiting requests less the prefix the GPU prefix cache already
# holds for them, less what the step schedules): written by the cadence scheduler, read in the
# same EngineCore process by the host tier's stats (engine_patches.offload), which ship it to
# /metrics as vllm:num_pending_prefill_tokens. A waiting request's hit is looked up once, when
# the scheduler first sees it waiting (vLLM's own lookup runs only when it is admitted, and
# would count in its prefix-cache metrics); blocks a connector will load from a lower tier
# still count as pending (they are not in the GPU prefix cache).
_pending_prefill: list[int | None] = [None]


def pending_prefill_tokens() -> int | None:
    """This process's pending prefill tokens after its scheduler's last step (None: no cadence
    scheduler has stepped here)."""
    return _pending_prefill[0]


class CadenceMixin:
    """The cadence, mixed into vLLM's ``Scheduler`` / ``AsyncScheduler``."""

    _kvroute_cadence: PrefillCadence | None
    _kvroute_trace: Any
    _kvroute_step: int
    # vLLM Scheduler attributes this mixin reads (annotations only: vLLM sets them)
    vllm_config: Any
    running: list[Any]
    waiting: Any
    kv_holding_waiting: Any
    max_num_scheduled_tokens: int
    max_num_running_reqs: int
    prefill_capacity_bound: bool
    local_prefill_interval: int
    kv_cache_manager: Any
    _kvroute_hits: dict[str, int]
    _kvroute_hit_lookup: bool

    def _kvroute_init(self) -> None:
        from engine_patches import versions

        version = versions.check()
        vcfg = self.vllm_config
        cfg = CadenceConfig.from_additional_config(vcfg.additional_config)
        self._kvroute_trace = None
        self._kvroute_step = 0
        self._kvroute_hits = {}
        self._kvroute_hit_lookup = True
        if vcfg.parallel_config.data_parallel_size > 1:
            logger.warning(
                "kvroute cadence: data_parallel_size=%d, leaving vLLM's DP cadence in charge",
                vcfg.parallel_config.data_parallel_size,
            )
            self._kvroute_cadence = None
            return
        if getattr(self, "local_prefill_interval", 1) > 1:
            logger.warning(
                "kvroute cadence replaces vLLM's local prefill cadence "
                "(prefill_schedule_interval=%d and its capacity escape)",
                self.local_prefill_interval,
            )
            self.local_prefill_interval = 1
        budget = int(self.max_num_scheduled_tokens)
        self._kvroute_cadence = PrefillCadence(cfg, token_budget=budget)
        if cfg.trace_path:
            self._kvroute_trace = open(cfg.trace_path, "a", buffering=1)
        logger.info(
            "kvroute cadence on vLLM %s: interval %d, hold each request at most %d steps / "
            "%.0f ms, backlog scale %.1f admitting steps (guard %s)",
            version,
            cfg.interval,
            cfg.max_defer_steps,
            cfg.max_defer_ms,
            cfg.backlog_scale,
            cfg.guard,
        )

    def _kvroute_pending(self) -> list[PendingPrefill]:
        from vllm.v1.request import RequestStatus

        out: list[PendingPrefill] = []
        for r in self.running:
            if r.is_prefill_chunk:
                out.append(PendingPrefill(r.request_id, r.num_tokens - r.num_computed_tokens, True))
        waiting = [
            r
            for q in (self.kv_holding_waiting, self.waiting)
            for r in q
            if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        ]
        remaining = [max(0, r.num_tokens - r.num_computed_tokens) for r in waiting]
        seats = self.max_num_running_reqs - len(self.running)
        flags = eligible_flags(remaining, int(self.max_num_scheduled_tokens), seats)
        out += [
            PendingPrefill(r.request_id, n, ok)
            for r, n, ok in zip(waiting, remaining, flags, strict=True)
        ]
        return out

    def _kvroute_gpu_hit(self, r: Any) -> int:
        """Prompt tokens of waiting request ``r`` that the GPU prefix cache holds now, as
        vLLM's admission would find them (``find_longest_cache_hit`` up to ``num_tokens − 1``:
        a pure look-up, no stats, no LRU touch). 0 once a look-up has failed on this version."""
        if not self._kvroute_hit_lookup or r.num_computed_tokens > 0:
            return 0
        mgr = self.kv_cache_manager
        try:
            if not mgr.prefix_cache_lookup_enabled(r):
                return 0
            found = mgr.coordinator.find_longest_cache_hit(r.block_hashes, r.num_tokens - 1)
            return max(int(found[1]), 0)
        except Exception as e:  # another vLLM's coordinator: count waiting prompts in full
            logger.warning(
                "kvroute: no prefix-cache look-up for the pending-prefill gauge on this vLLM "
                "(%r); waiting requests count in full",
                e,
            )
            self._kvroute_hit_lookup = False
            return 0

    def _kvroute_gauge(self) -> int:
        """Prompt tokens left to compute after this step (read after ``schedule()``, which has
        advanced every scheduled request's ``num_computed_tokens``): running requests still in
        prefill, and waiting ones less their cached prefix (looked up once per request); a
        request loading from a lower tier (``WAITING_FOR_REMOTE_KVS``) is not counted."""
        from vllm.v1.request import RequestStatus

        queued = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        total = sum(n for r in self.running if (n := r.num_tokens - r.num_computed_tokens) > 1)
        hits = self._kvroute_hits
        seen: set[str] = set()
        for q in (self.kv_holding_waiting, self.waiting):
            for r in q:
                if r.status not in queued:
                    continue
                rid = r.request_id
                seen.add(rid)
                h = hits.get(rid)
                if h is None:
                    h = hits[rid] = self._kvroute_gpu_hit(r)
                total += max(r.num_tokens - r.num_computed_tokens - h, 0)
        for rid in [k for k in hits if k not in seen]:
            del hits[rid]  # admitted, finished or aborted: its look-up is spent
        return total

    def add_request(self, request: Any, *args: Any, **kwargs: Any) -> None:
        """vLLM's, then an arrival record in the trace: when a request reached the scheduler
        (a test can tell that a burst is in the engine while the engine is paused)."""
        super().add_request(request, *args, **kwargs)  # type: ignore[misc]
        if self._kvroute_trace is not None:
            rec = {"t": time.monotonic(), "arrived": request.request_id,
                   "prompt_tokens": request.num_prompt_tokens}  # fmt: skip
            self._kvroute_trace.write(json.dumps(rec) + "\n")

    def schedule(self, throttle_prefills: bool = False) -> Any:
        cad = self._kvroute_cadence
        if cad is None:
            return super().schedule(throttle_prefills)  # type: ignore[misc]
        now = time.monotonic()
        pending = self._kvroute_pending()
        decoding = any(not r.is_prefill_chunk for r in self.running)
        if cad.config.guard == "vllm":
            # vLLM's rule as its DP engine applies it: throttle off-cadence steps, and let
            # schedule() keep its capacity escape (prefill_capacity_bound).
            self._kvroute_step += 1
            admit = self._kvroute_step % cad.config.interval == 0
            reason = "cadence" if admit else "defer"
            if not admit and self.prefill_capacity_bound:
                reason = "capacity-escape"
            out = super().schedule(throttle_prefills=not admit)  # type: ignore[misc]
            interval, backlog = cad.config.interval, sum(p.remaining_tokens for p in pending)
        else:
            d = cad.decide(now, pending, decoding)
            self.prefill_capacity_bound = False  # vLLM's escape; our bound replaces it
            out = super().schedule(throttle_prefills=not d.admit)  # type: ignore[misc]
            admit, reason, interval, backlog = d.admit, d.reason, d.interval, d.backlog_tokens
        left = {p.req_id: p.remaining_tokens for p in pending}
        prefill_tokens = sum(
            min(n, left[rid]) for rid, n in out.num_scheduled_tokens.items() if rid in left
        )
        # what this step leaves to prefill: the gauge after the engine's last prefill step is 0
        _pending_prefill[0] = self._kvroute_gauge()
        if cad.config.guard != "vllm":
            cad.observe(prefill_tokens)
        if self._kvroute_trace is not None and out.total_num_scheduled_tokens > 0:
            rec = {
                "t": now,
                "admit": admit,
                "reason": reason,
                "interval": interval,
                "backlog": backlog,
                "prefill_tokens": prefill_tokens,
                "decodes": sum(1 for rid in out.num_scheduled_tokens if rid not in left),
                "held": {p.req_id: cad.held(p.req_id) for p in pending if p.eligible},
                "waiting": len(self._kvroute_hits),
                "pending_prefill": _pending_prefill[0],
            }
            self._kvroute_trace.write(json.dumps(rec) + "\n")
        return out


def _build(name: str) -> type:
    from engine_patches import versions

    versions.check()
    if name == "CadenceScheduler":
        from vllm.v1.core.sched.scheduler import Scheduler as base
    else:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as base

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        self._kvroute_init()

    return type(name, (CadenceMixin, base), {"__init__": __init__, "__module__": __name__})


_built: dict[str, type] = {}


def __getattr__(name: str) -> type:
    if name in SCHEDULER_CLASSES:
        if name not in _built:
            _built[name] = _build(name)
        return _built[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
