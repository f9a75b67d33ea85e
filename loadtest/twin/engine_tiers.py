"""The twin engine's traffic with its lower tiers.

A part of :class:`loadtest.twin.engine.Engine`.

Owns: :class:`EngineTiers` — the connector's store pass (write-through, or write-back with
``host_write_back``), settling writes and their cascade to storage and the cluster pool,
staging storage and pool hits through the host tier, finishing a load, and a finished
request's host chunks. The semantics are in :mod:`loadtest.twin.engine`'s docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loadtest.twin.engine_blocks import EngineBlocks
from loadtest.twin.request import REMOTE, WAITING, Request
from loadtest.twin.truth import POOL
from router.vllm.kvevents import encode_block_removed, encode_block_stored


class EngineTiers(EngineBlocks):
    """Lower-tier stores, loads and promotions: a part of :class:`loadtest.twin.engine.Engine`."""

    # ---- lower tiers -------------------------------------------------------------------

    def _emit(self, ev: dict[str, Any]) -> None:
        if self.events is not None:
            self.events.append(ev)

    def _store_lower(self, req: Request, horizon: int, now: float) -> None:
        """The connector's store pass for one scheduled request: offer its prompt blocks
        ``[host_next, horizon)`` to the host tier (to storage when there is none); evictions
        are published now, the stored keys when their writes end, a step later
        (:meth:`_settle`)."""
        start = req.host_next
        if horizon <= start:
            return
        if self.pool.victims is not None:  # write-back: the host tier takes evictions only
            req.host_next = horizon
            return
        offer = req.block_keys[start:horizon]
        cpu = self.cpu
        if cpu is None:  # storage only: written through to it
            req.host_next = horizon
            self._writing.append(offer)
            return
        got = cpu.store(offer, now, req.hint)
        if got is None:
            return  # no room now: offered again at the request's next step, as vLLM does
        new, evicted = got
        req.host_next = horizon
        if evicted:
            self._emit(encode_block_removed(evicted, medium="CPU"))
        if new:
            self._writing.append(new)

    def _settle(self) -> None:
        """The writes in flight are done: ``BlockStored`` for the host tier, and the cascade
        to storage (vLLM's tiering manager writes every stored chunk to all tiers)."""
        groups, self._in_flight = self._in_flight, []
        written = [k for g in groups for k in g]
        if self.cpu is not None:
            groups = [self.cpu.settle(g) for g in groups]
        for g in groups:
            if not g:
                continue
            if self.cpu is not None:
                self._emit(encode_block_stored(g, None, [], 0, medium="CPU"))
            self._to_storage(g)
            if self.cluster_pool is not None:
                self._to_pool(g)
        self._promoting.difference_update(written)

    def _to_storage(self, keys: Sequence[int]) -> None:
        sto = self.storage
        if sto is None:
            return
        new = [k for k in keys if k not in sto]
        gone = []
        for k in keys:
            out = sto.put(k)
            if out is not None:
                gone.append(out)
        if gone:
            self._emit(encode_block_removed(gone, medium="STORAGE"))
        if new:
            self._emit(encode_block_stored(new, None, [], 0, medium="STORAGE"))

    def _to_pool(self, keys: Sequence[int]) -> None:
        """The cascade to the cluster pool: every chunk the host tier stored is written (a
        chunk staged *from* a lower tier is not: vLLM's promotion completes a write, not a
        store). ``BlockStored`` for all of them, as vLLM's filesystem tier publishes each
        written file, then ``BlockRemoved`` for what the pool evicted to make room — both
        ``medium`` STORAGE, ``locality`` REMOTE, from this engine (the one that wrote)."""
        pool = self.cluster_pool
        assert pool is not None
        todo = [k for k in keys if k not in self._promoting]
        if not todo:
            return
        gone = pool.put(todo)
        self._emit(encode_block_stored(todo, None, [], 0, medium="STORAGE", locality=REMOTE))
        if gone:
            self._emit(encode_block_removed(gone, medium="STORAGE", locality=REMOTE))

    def _promote(
        self, req: Request, lower: list[int], now: float
    ) -> tuple[list[int], int, int, int]:
        """Stage a request's storage and pool hits through the host tier, as vLLM's tiering
        manager does in its lookup (``_initiate_promotion``): each gets a host chunk, made
        room for least recently used first — which may evict the request's own host hits, not
        pinned before its load begins. vLLM's next lookup finds those gone and promotes them
        from a lower tier too; so here, round by round, until none is lost. A chunk that
        cannot be staged (no room, or in no lower tier either) ends the hit there, as vLLM's
        lookup misses. Returns the hit's lower-tier keys and how many come from host /
        storage / the pool (a promoted key counts for the tier it was staged from, vLLM's
        ``get_load_source``; the disk tier is looked up before the pool)."""
        cpu, sto, cpool = self.cpu, self.storage, self.cluster_pool
        assert cpu is not None
        promoted = req.promoted
        if promoted is None:
            promoted = req.promoted = {}
        while todo := [k for k in lower if k not in cpu]:
            src = {}
            for k in todo:
                if sto is not None and k in sto:
                    src[k] = "storage"
                elif cpool is not None and k in cpool:
                    src[k] = POOL
            lost = next((k for k in todo if k not in src), None)
            if lost is not None:
                lower = lower[: lower.index(lost)]
                continue
            got = cpu.store(todo, now, req.hint)
            if got is None:
                lower = lower[: lower.index(todo[0])]
                break
            new, evicted = got
            if evicted:
                self._emit(encode_block_removed(evicted, medium="CPU"))
            if new:
                self._writing.append(new)
                self._promoting.update(new)
                for k in new:
                    promoted[k] = src[k]
        n_sto = sum(1 for k in lower if promoted.get(k) == "storage")
        n_pool = sum(1 for k in lower if promoted.get(k) == POOL)
        if n_pool and cpool is not None:
            cpool.touch(k for k in lower if promoted.get(k) == POOL)
        return lower, len(lower) - n_sto - n_pool, n_sto, n_pool

    def _finish_load(self, req: Request) -> None:
        """Loaded blocks now hold their keys in GPU (``BlockStored`` medium GPU)."""
        if req.remote_tokens:
            req.remote_tokens = 0  # received (a later preemption recomputes, as vLLM does)
        elif self.cpu is not None:
            self.cpu.unpin(req.load_blocks)
        n_gpu = len(req.blocks) - len(req.load_blocks)
        keys = req.load_blocks
        stored = []
        for b, k in zip(req.blocks[n_gpu:], keys, strict=True):
            if self.pool.cache(b, k):
                stored.append(k)
        if stored and self.events is not None:
            parent = req.block_keys[n_gpu - 1] if n_gpu > 0 else None
            toks = (
                self._tokens(req, n_gpu * self.block_size, len(req.blocks) * self.block_size)
                if req.token_ids
                else []
            )
            self.events.append(
                encode_block_stored(
                    stored, parent, toks, self.block_size, session_id=req.session_id
                )
            )
        req.n_cached = len(req.blocks)
        req.num_computed = len(req.blocks) * self.block_size
        req.load_blocks = []
        req.status = WAITING

    def _write_back(self, now: float) -> float:
        """Write-back (``host_write_back``): the blocks this step's allocations evicted from
        HBM go to the host tier before the step can overwrite them, so the step waits for
        the copy (seconds returned: the tier's link time for them, as a load's). A burst of
        more than half the tier keeps its newest half."""
        pool, cpu = self.pool, self.cpu
        if not pool.victims or cpu is None:
            return 0.0
        todo = list(dict.fromkeys(k for k in pool.victims if k not in cpu))
        pool.victims = []
        got = cpu.store(todo[-(cpu.capacity // 2) :], now) if todo else None
        if got is None:
            return 0.0  # no room (the tier is pinned or being written): those blocks are lost
        new, evicted = got
        if evicted:
            self._emit(encode_block_removed(evicted, medium="CPU"))
        if not new:
            return 0.0
        self._writing.append(new)
        return self.timing.load(len(new), "cpu")

    def _host_finish(self, req: Request, now: float) -> None:
        """The connector's ``on_request_finished``: the host chunks the request offered or
        loaded become the most recently used, then its hint applies (engine plugin)."""
        assert self.cpu is not None
        if req.host_lo >= 0:
            self.cpu.finish(req.block_keys[req.host_lo : req.host_next], req.hint, now)
