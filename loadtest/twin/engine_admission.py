"""The twin engine's admission, preemption and pending prefill.

A part of :class:`loadtest.twin.engine.Engine`.

Owns: :class:`EngineAdmission` — a waiting request's first scheduling (its cached prefix in
GPU and the lower tiers, the full-ISL reservation, an async load), the stranding guard, the
priority policy's queue order and victim, preemption, and the pending-prefill view the
plugin's cadence and its gauge read. The semantics are in :mod:`loadtest.twin.engine`'s
docstring.
"""

from __future__ import annotations

import itertools
from bisect import bisect_right

from costmodel.disagg import kv_transfer_time
from engine_patches.cadence import PendingPrefill, eligible_flags
from loadtest.twin.engine_tiers import EngineTiers
from loadtest.twin.request import LOADING, RUNNING, WAITING, Request
from loadtest.twin.truth import POOL


class EngineAdmission(EngineTiers):
    """Admission, preemption and pending prefill: a part of :class:`loadtest.twin.engine.Engine`."""

    # ---- scheduling --------------------------------------------------------------------

    def _admit(
        self, req: Request, now: float, budget: int, thresh: int, defer: bool = False
    ) -> int | None:
        """First scheduling (or rescheduling after preemption) of a waiting request: take
        its cached prefix (GPU, then lower tiers) and blocks for its first chunk. Returns the
        tokens scheduled (0: it now loads from a lower tier), or None when blocks are short
        (nothing changed, also when ``defer`` holds back a request that needs compute)."""
        bs = self.block_size
        limit = (req.num_tokens - 1) // bs
        keys = self._keys_upto(req, limit)
        gpu = self.pool.match(keys, limit)
        n_gpu = len(gpu)
        lower: list[int] = []
        n_cpu = n_sto = n_pool = 0
        cpu, sto, cpool = self.cpu, self.storage, self.cluster_pool
        if req.remote_tokens > 0:
            # P/D decode side: the blocks the prefill replica holds past this replica's own
            # hit are allocated now and filled by the transfer (a load from the link)
            lower = keys[n_gpu : min(limit, req.remote_tokens // bs)]
            if not lower:
                req.remote_tokens = 0
            cpu = sto = cpool = None  # no lower-tier lookup: the link brings the rest
        if cpu is not None or sto is not None:
            # vLLM's tiering lookup: the host tier, then each secondary tier in order (the
            # disk tier, then the pool)
            for k in itertools.islice(keys, n_gpu, limit):
                if cpu is not None and k in cpu:
                    n_cpu += 1
                elif sto is not None and k in sto:
                    n_sto += 1
                elif cpool is not None and k in cpool:
                    n_pool += 1
                else:
                    break
                lower.append(k)
        if (n_sto or n_pool) and cpu is not None:
            lower, n_cpu, n_sto, n_pool = self._promote(req, lower, now)
        hit = (n_gpu + len(lower)) * bs
        if lower:
            n = 0
            need = len(lower)
        else:
            if defer:
                return None  # cadence: this step runs decodes only
            n = req.num_tokens - hit
            if 0 < thresh < n:
                n = thresh
            n = min(n, budget)
            need = -(-(hit + n) // bs) - n_gpu
        # blocks referenced only from the free queue cannot also be allocated
        reusable = sum(1 for b in gpu if self.pool.ref[b] == 0)
        free = self.pool.num_free - reusable
        # vLLM's full-ISL reservation (scheduler_reserve_full_isl, on by default): admit only
        # if the whole sequence so far fits in the free blocks, not just its first chunk
        if self._full_blocks(req) - n_gpu > free:
            return None
        # an async load holds its blocks with no progress and cannot be preempted: admit it
        # only within what other in-flight prefills still need (_inflight_prefill_reserved_blocks)
        if need > (free - self._inflight_reserved(req) if lower else free):
            return None
        self.pool.touch(gpu)
        new = self.pool.allocate(need) if need > 0 else []
        assert new is not None
        req.blocks = gpu + new
        req.n_cached = n_gpu
        req.num_computed = n_gpu * bs
        req.gauge_hit = None
        self.tier_hit_blocks["gpu"] += n_gpu
        if req.cached_tokens is None:
            req.cached_tokens = hit
            self.prefix_queries += req.prompt_len
            self.prefix_hits += hit
            by = self.cached_by_source
            by["device"] += n_gpu * bs
            by["host"] += n_cpu * bs
            by["disk"] += (n_sto + n_pool) * bs
            tier = self.cached_by_tier
            tier["device"] += n_gpu * bs
            tier["host"] += n_cpu * bs
            tier["disk"] += n_sto * bs
            tier["pool"] += n_pool * bs
        # the blocks the request's store pass has covered (vLLM: a load skips them; without
        # one every prompt block is offered, so a GPU hit puts back what the host tier lost)
        lo = n_gpu if lower else 0
        req.host_lo = lo if req.host_lo < 0 else min(req.host_lo, lo)
        if lower and req.remote_tokens:
            req.load_blocks = lower
            req.status = LOADING
            req.ready_at = now + kv_transfer_time(self.profile, len(lower) * bs)
            req.host_next = max(req.host_next, n_gpu + len(lower))
            self.remote_blocks += len(lower)
            return 0
        if lower:
            req.load_blocks = lower
            req.status = LOADING
            req.ready_at = (now + self.timing.load(n_cpu, "cpu")
                            + self.timing.load(n_sto, "storage")
                            + self.timing.load(n_pool, POOL))  # fmt: skip
            req.host_next = max(req.host_next, n_gpu + len(lower))
            if cpu is not None:
                cpu.pin(lower)
            self.tier_hit_blocks["cpu"] += n_cpu
            self.tier_hit_blocks["storage"] += n_sto
            self.tier_hit_blocks["pool"] += n_pool
            return 0
        self._cache_full_blocks(req, req.num_computed + n)
        return n

    def _full_blocks(self, req: Request) -> int:
        """Blocks ``req``'s whole sequence so far needs (``full_num_tokens`` in vLLM)."""
        return -(-min(req.num_tokens, self.profile.max_model_len) // self.block_size)

    def _inflight_reserved(self, req: Request) -> int:
        """Blocks the other in-flight prefills still need to hold their full sequence:
        requests loading (or loaded) from a lower tier and running prefill chunks, as vLLM's
        ``_inflight_prefills`` (0.32.0)."""
        return sum(
            max(0, self._full_blocks(r) - len(r.blocks))
            for r in self.requests.values()
            if r is not req
            and r.blocks
            and (r.status != RUNNING or r.num_computed < r.num_tokens - 1)
        )

    def _stranding(self, head: Request, defer: bool) -> bool:
        """Whether stopping at an unschedulable ``head`` would freeze the engine: nothing runs
        and a request behind it holds blocks (an async load), so nothing would ever free them.
        vLLM 0.32.0 stops there for good (vllm#45388, #57841); the twin scans on instead, as the
        proposed upstream fix (vllm#45406) does, so the loads behind can finish and run."""
        if self.running or defer:
            return False
        return any(r.blocks for r in self.waiting if r is not head)

    # ---- priority policy (vLLM's RequestQueue for SchedulingPolicy.PRIORITY) -------------

    @staticmethod
    def _priority_key(r: Request) -> tuple[int, float, int]:
        """vLLM's ``Request.__lt__``: priority, then arrival time (then, here, arrival order)."""
        return (r.priority, r.arrival, r.seq)

    def _insert_waiting(self, req: Request) -> None:
        """Put ``req`` in the waiting queue at its (priority, arrival) place (vLLM's heap add,
        also for a preempted request: a priority queue has no front to prepend to)."""
        self.waiting.insert(bisect_right(self.waiting, self._priority_key(req),
                                         key=self._priority_key), req)  # fmt: skip

    def _victim(self, running: list[Request]) -> int:
        """Index of the running request to preempt: the last one (FCFS), or the one with the
        largest (priority, arrival) under the priority policy."""
        if not self.by_priority:
            return len(running) - 1
        return max(range(len(running)), key=lambda j: self._priority_key(running[j]))

    def _preempt(self, req: Request) -> None:
        self.pool.release(req.blocks)
        req.blocks = []
        req.n_cached = 0
        req.num_computed = 0
        req.status = WAITING
        req.num_preemptions += 1
        self.preemptions += 1
        if self.by_priority:
            self._insert_waiting(req)
        else:
            self.waiting.appendleft(req)

    def _prefilling(self) -> list[tuple[Request, int]]:
        """Running requests mid-prefill and the prompt tokens each has left (a request with
        one token left is decoding: vLLM recomputes at least the last prompt token)."""
        return [(r, r.num_tokens - r.num_computed) for r in self.running
                if r.num_tokens - r.num_computed > 1]  # fmt: skip

    def pending_prefills(self) -> list[PendingPrefill]:
        """What the plugin's scheduler hands its cadence: running prefill chunks (eligible),
        then the waiting requests not loading, flagged eligible if one step's token budget and
        free seats would admit them (:func:`engine_patches.cadence.eligible_flags`)."""
        out = [PendingPrefill(r.id, left, True) for r, left in self._prefilling()]
        waiting = [r for r in self.waiting if r.status != LOADING]
        remaining = [max(0, r.num_tokens - r.num_computed) for r in waiting]
        seats = self.profile.max_num_seqs - len(self.running)
        flags = eligible_flags(remaining, self.profile.max_num_batched_tokens, seats)
        out += [PendingPrefill(r.id, n, ok) for r, n, ok in zip(waiting, remaining, flags,
                                                                strict=True)]  # fmt: skip
        return out

    def pending_prefill_tokens(self) -> int:
        """Prompt tokens still to compute, as the engine plugin's
        ``vllm:num_pending_prefill_tokens`` counts them: running prefill chunks, and waiting
        requests (not loading from a lower tier) less the prefix the GPU cache holds for them,
        looked up once while they wait (real vLLM's ``SchedulerStats`` has no such field)."""
        total = sum(left for _, left in self._prefilling())
        bs = self.block_size
        for r in self.waiting:
            if r.status == LOADING:
                continue
            if r.gauge_hit is None:
                limit = (r.num_tokens - 1) // bs
                r.gauge_hit = len(self.pool.match(self._keys_upto(r, limit), limit)) * bs
            total += max(r.num_tokens - r.num_computed - r.gauge_hit, 0)
        return total

    def pending_prefill_gauge(self) -> int | None:
        """:meth:`pending_prefill_tokens` where the engine plugin exports it — its cadence and a
        host tier both on (``engine_patches/offload.py`` ships it with the host tier's stats)
        — else None, as on plain vLLM."""
        if self.cadence is None or self.cpu is None:
            return None
        return self.pending_prefill_tokens()

    def decode_only_steps(self, n: int) -> None:
        """``n`` steps that ran decodes only were taken outside :meth:`schedule` (the
        simulator's bursts): the cadence counts them as steps without prefill."""
        if self.cadence is not None:
            for _ in range(n):
                self.cadence.observe(0)
