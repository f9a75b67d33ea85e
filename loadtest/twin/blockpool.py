"""The twin engine's GPU block pool: vLLM's ``BlockPool`` (:mod:`loadtest.twin.engine`).

Owns: :class:`BlockPool` — ref counts, the LRU free queue, the prefix-cache map and the
``BlockRemoved`` events of evictions.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from router.vllm.kvevents import encode_block_removed


class BlockPool:
    """vLLM's GPU block pool: ref counts, an LRU free queue, and the prefix-cache map.

    Block 0 is the reserved null block (never allocated), as in vLLM. Events go to ``sink``
    (already in wire form). An evicted block is gone: the lower tiers already hold what they
    were given when it was computed (write-through, :class:`HostTier`) — or, with
    ``victims`` set (write-back), the engine hands its key to the host tier.
    """

    __slots__ = ("cached", "dups", "free", "key_of", "num_blocks", "ref", "sink", "victims")

    def __init__(self, num_blocks: int, sink: list[dict[str, Any]] | None):
        if num_blocks < 2:
            raise ValueError("a block pool needs at least 2 blocks (one is reserved)")
        self.num_blocks = num_blocks
        self.key_of: list[int | None] = [None] * num_blocks
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached: dict[int, int] = {}
        self.dups: dict[int, set[int]] = {}
        self.sink = sink
        # write-back (``host_write_back``): the keys whose last cached copy an allocation
        # evicted, for the host tier to take; None when the lower tiers are written through
        self.victims: list[int] | None = None

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        """``vllm:kv_cache_usage_perc``: share of usable blocks referenced by requests."""
        return 1.0 - len(self.free) / self.usable

    def match(self, keys: Sequence[int], limit: int) -> list[int]:
        """Block ids of the longest cached prefix of ``keys`` (at most ``limit`` blocks)."""
        out: list[int] = []
        get = self.cached.get
        for k in itertools.islice(keys, limit):
            b = get(k)
            if b is None:
                break
            out.append(b)
        return out

    def touch(self, ids: Sequence[int]) -> None:
        free, ref = self.free, self.ref
        for b in ids:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out = []
        free, ref, key_of = self.free, self.ref, self.key_of
        for _ in range(n):
            b = free.popitem(last=False)[0]
            k = key_of[b]
            if k is not None:
                key_of[b] = None
                if self._uncache(b, k) and self.sink is not None:
                    self.sink.append(encode_block_removed([k]))
                if self.victims is not None and k not in self.cached:
                    self.victims.append(k)
            ref[b] = 1
            out.append(b)
        return out

    def _uncache(self, b: int, k: int) -> bool:
        """Drop block ``b``'s copy of ``k``; True when it was cached."""
        cached = self.cached
        if cached.get(k) == b:
            extra = self.dups.get(k)
            if extra:
                cached[k] = min(extra)  # the oldest remaining copy serves hits
                extra.discard(cached[k])
                if not extra:
                    del self.dups[k]
            else:
                del cached[k]
            return True
        extra = self.dups.get(k)
        if extra and b in extra:
            extra.discard(b)
            if not extra:
                del self.dups[k]
            return True
        return False

    def release(self, ids: Sequence[int]) -> None:
        """Drop one reference from each block, in eviction order (a request's blocks come
        reversed, so its last blocks are evicted first). As vLLM's ``free_blocks``: freed
        cached blocks join the tail of the free queue (LRU), freed blocks without a hash the
        front (reused first)."""
        free, ref, key_of = self.free, self.ref, self.key_of
        front = []
        for b in reversed(ids):
            ref[b] -= 1
            if ref[b] == 0:
                if key_of[b] is None:
                    front.append(b)
                else:
                    free[b] = None
        for b in reversed(front):
            free[b] = None
            free.move_to_end(b, last=False)

    def cache(self, b: int, key: int) -> bool:
        """Mark block ``b`` as holding ``key`` (a second copy of a cached key is kept as a
        duplicate, as vLLM's hash map holds several blocks per hash)."""
        self.key_of[b] = key
        if key in self.cached:
            self.dups.setdefault(key, set()).add(b)
        else:
            self.cached[key] = b
        return True

    def reset(self) -> bool:
        """Drop every cached key (``/reset_prefix_cache``); refused while blocks are in use."""
        if len(self.free) != self.usable:
            return False
        self.cached.clear()
        self.dups.clear()
        self.key_of = [None] * self.num_blocks
        self.free = OrderedDict.fromkeys(range(1, self.num_blocks))
        return True
