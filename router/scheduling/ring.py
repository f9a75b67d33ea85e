"""Consistent hash ring (with virtual nodes) shared by the hashing baselines.

``walk(key)`` yields every endpoint name once, in ring order from the key's point: the
first is the key's home, the rest are where it spills when the home is full. Rings are
memoized per endpoint set (a pure cache; the result depends only on the names)."""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterator
from functools import lru_cache


def h64(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, names: tuple[str, ...], vnodes: int = 64):
        pts = sorted((h64(f"{n}#{i}"), n) for n in names for i in range(vnodes))
        self._keys = [p for p, _ in pts]
        self._names = [n for _, n in pts]
        self.size = len(set(names))

    def walk(self, key: str) -> Iterator[str]:
        if not self._keys:
            return
        i = bisect.bisect(self._keys, h64(key))
        seen: set[str] = set()
        n = len(self._keys)
        for j in range(n):
            name = self._names[(i + j) % n]
            if name not in seen:
                seen.add(name)
                yield name
                if len(seen) == self.size:
                    return


@lru_cache(maxsize=64)
def ring_for(names: tuple[str, ...], vnodes: int = 64) -> HashRing:
    return HashRing(names, vnodes)


def bounded_capacity(total_load: float, n: int, factor: float) -> float:
    """Consistent hashing with bounded loads (Mirrokni et al.): no endpoint takes more than
    ``ceil(factor * (total + 1) / n)`` requests."""
    import math

    return math.ceil(factor * (total_load + 1) / max(1, n))
