"""The twin engine's block keys and GPU block allocation.

A part of :class:`loadtest.twin.engine.Engine`.

Owns: :class:`EngineBlocks`, the base of the engine's parts — hashing a request's full
blocks into keys (real vLLM hashes for the HTTP twin, synthetic ones for the simulator's
generated tokens), caching the blocks a step fills (``BlockStored``) and allocating a
request's next blocks. The semantics are in :mod:`loadtest.twin.engine`'s docstring.
"""

from __future__ import annotations

import hashlib
from collections import deque
from typing import Any

from costmodel.profiles import ReplicaProfile
from engine_patches.cadence import PrefillCadence
from loadtest.twin.blockpool import BlockPool
from loadtest.twin.request import Request
from loadtest.twin.tiers import ClusterPool, HostTier, TierLRU
from loadtest.twin.truth import StepTiming
from router.vllm.hashing import MASK64, BlockHasher
from router.vllm.kvevents import encode_block_stored


class EngineBlocks:
    """Block keys and allocation: the base of :class:`loadtest.twin.engine.Engine`."""

    # the engine's state, set by :class:`loadtest.twin.engine.Engine` (declared for the
    # mixins that read it)
    profile: ReplicaProfile
    timing: StepTiming
    block_size: int
    hasher: BlockHasher | None
    events: list[dict[str, Any]] | None
    cpu: HostTier | None
    storage: TierLRU | None
    pool: BlockPool
    cluster_pool: ClusterPool | None
    cadence: PrefillCadence | None
    _promoting: set[int]
    _writing: list[list[int]]
    _in_flight: list[list[int]]
    waiting: deque[Request]
    running: list[Request]
    requests: dict[str, Request]
    by_priority: bool
    digests: dict[int, bytes] | None
    preemptions: int
    prefix_queries: int
    prefix_hits: int
    tier_hit_blocks: dict[str, int]
    remote_blocks: int
    cached_by_source: dict[str, int]
    cached_by_tier: dict[str, int]

    # ---- hashing -----------------------------------------------------------------------

    def _keys_upto(self, req: Request, n_blocks: int) -> list[int]:
        """The request's block keys, extended to ``n_blocks`` full blocks."""
        keys = req.block_keys
        if len(keys) >= n_blocks:
            return keys
        bs = self.block_size
        if req.token_ids is not None and self.hasher is not None:
            start = len(req.digests)
            toks = req.token_ids
            if len(toks) < n_blocks * bs:
                toks = toks + req.output_ids
            parent = req.digests[-1] if req.digests else None
            new = self.hasher.hash_blocks(
                toks[start * bs : n_blocks * bs], parent=parent, start_block=start
            )
            req.digests.extend(new)
            new_keys = [int.from_bytes(d, "big") & MASK64 for d in new]
            keys.extend(new_keys)
            if self.digests is not None:
                self.digests.update(zip(new_keys, new, strict=True))
                if len(self.digests) > 4 * self._capacity_blocks():
                    self._prune_digests()
            return keys
        # synthetic keys for blocks filled by generated tokens (simulator)
        prev = keys[-1] if keys else 0x9E3779B97F4A7C15
        salt = int.from_bytes(hashlib.blake2b(req.id.encode(), digest_size=8).digest(), "big")
        while len(keys) < n_blocks:
            prev = (prev * 0x100000001B3 ^ salt ^ len(keys)) & MASK64
            keys.append(prev)
        return keys

    def _capacity_blocks(self) -> int:
        return (
            self.pool.num_blocks
            + (self.cpu.capacity if self.cpu else 0)
            + (self.storage.capacity if self.storage else 0)
        )

    def _prune_digests(self) -> None:
        """Keep digests of keys some tier or live request still holds."""
        assert self.digests is not None
        live = set(self.pool.cached)
        for r in self.requests.values():
            live.update(r.block_keys)
        for t in (self.cpu, self.storage):
            if t is not None:
                live.update(t.keys)
        for ev in self.events or ():  # not yet published
            live.update(ev.get("block_hashes", ()))
        self.digests = {k: d for k, d in self.digests.items() if k in live}

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Cache the request's blocks that ``num_tokens`` computed tokens fill; one
        ``BlockStored`` for the newly cached run, as vLLM's ``cache_full_blocks``."""
        bs = self.block_size
        n_full = min(num_tokens // bs, len(req.blocks))
        start = req.n_cached
        if n_full <= start:
            return
        req.n_cached = n_full
        keys = self._keys_upto(req, n_full)
        new_keys, new_tokens = [], []
        for i in range(start, n_full):
            b = req.blocks[i]
            if self.pool.key_of[b] is not None:
                continue
            if self.pool.cache(b, keys[i]):
                new_keys.append(keys[i])
                if self.events is not None and req.token_ids is not None:
                    new_tokens.extend(self._tokens(req, i * bs, (i + 1) * bs))
        if new_keys and self.events is not None:
            parent = keys[start - 1] if start > 0 else None
            self.events.append(
                encode_block_stored(new_keys, parent, new_tokens, bs, session_id=req.session_id)
            )

    @staticmethod
    def _tokens(req: Request, lo: int, hi: int) -> list[int]:
        assert req.token_ids is not None
        p = req.prompt_len
        if hi <= p:
            return req.token_ids[lo:hi]
        return (req.token_ids + req.output_ids)[lo:hi]

    def _allocate(self, req: Request, num_new: int) -> bool:
        need = -(-(req.num_computed + num_new) // self.block_size) - len(req.blocks)
        if need > 0:
            got = self.pool.allocate(need)
            if got is None:
                return False
            req.blocks.extend(got)
        self._cache_full_blocks(req, req.num_computed + num_new)
        return True
