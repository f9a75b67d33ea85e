"""Approximate mode: predict a replica's prefix cache from where the router sent prompts.

Owns: for replicas without KV events (or whose event stream is stale), a per-replica LRU of
block keys with the replica's capacity in blocks, fed by the router's own routing history —
what SGLang's cache-aware router keeps as a radix tree of request text, here over chained
block keys (a chain of keys *is* a path in that tree: key i identifies the whole prefix up to
block i). Answers the same question as :class:`router.kv.index.BlockIndex` —
``match(keys) -> {replica: TierDepth}`` (all blocks counted as GPU) — so scorers can use
either. Pure Python; must not import sockets, aiohttp, torch or vllm.

Eviction order follows vLLM: when a request finishes its blocks are freed tail first, so a
prompt's last blocks are evicted before its first ones; :meth:`record` therefore touches a
prompt's keys from the last to the first (the first block ends up most recently used).

The same cache keyed by chained hashes of the prompt *text* (:func:`text_keys`, 1,024-character
chunks) is the KV layer's routing history for calls placed before their tokens are known.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from router.kv.index import TierDepth

TEXT_CHUNK = 1024  # characters per text-prefix key
TEXT_LIMIT = 256 * 1024  # leading characters keyed (~64k tokens): ~1 ms of hashing on the loop


def text_keys(text: str) -> list[int]:
    """Chained 64-bit keys of ``text``'s full ``TEXT_CHUNK``-character chunks (key i names the
    whole prefix up to chunk i, as block keys do for tokens): the same LRU over routed prompt
    text instead of tokens, for calls placed before their tokens are known."""
    out: list[int] = []
    prev = b""
    for i in range(0, len(text) - TEXT_CHUNK + 1, TEXT_CHUNK):
        prev = hashlib.blake2b(
            prev + text[i : i + TEXT_CHUNK].encode("utf-8", "surrogatepass"), digest_size=8
        ).digest()
        out.append(int.from_bytes(prev, "little"))
    return out


class ApproxCache:
    """Capacity-aware LRU of block keys per replica (see the module docstring)."""

    def __init__(self, default_capacity_blocks: int = 0):
        if default_capacity_blocks < 0:
            raise ValueError("capacity must be >= 0")
        self.default_capacity = default_capacity_blocks
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._cap: dict[str, int] = {}

    def set_capacity(self, replica: str, blocks: int) -> None:
        if blocks < 0:
            raise ValueError("capacity must be >= 0")
        self._cap[replica] = blocks
        self._trim(replica)

    def capacity(self, replica: str) -> int:
        return self._cap.get(replica, self.default_capacity)

    def record(self, replica: str, keys: Sequence[int]) -> None:
        """The router sent a prompt with ``keys`` to ``replica`` (it now caches them)."""
        lru = self._lru.setdefault(replica, OrderedDict())
        for k in reversed(keys):
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
        self._trim(replica)

    def _trim(self, replica: str) -> None:
        lru = self._lru.get(replica)
        if lru is None:
            return
        cap = self.capacity(replica)
        while len(lru) > cap:
            lru.popitem(last=False)

    def clear(self, replica: str) -> None:
        self._lru.pop(replica, None)

    def remove_replica(self, replica: str) -> None:
        self._lru.pop(replica, None)
        self._cap.pop(replica, None)

    def blocks(self, replica: str) -> int:
        return len(self._lru.get(replica, ()))

    def match(
        self, keys: Sequence[int], replicas: Iterable[str] | None = None
    ) -> dict[str, TierDepth]:
        names = self._lru.keys() if replicas is None else [r for r in replicas if r in self._lru]
        out = {}
        for name in names:
            lru = self._lru[name]
            d = 0
            for k in keys:
                if k not in lru:
                    break
                d += 1
            if d:
                out[name] = TierDepth(d, gpu=d)
        return out
