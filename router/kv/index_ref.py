"""The reference block index: :class:`NaiveBlockIndex`, a set per (replica, tier) and a plain
loop in ``match`` — what the property tests check :class:`router.kv.index.BlockIndex` against
(and what ``bench_index`` times it against). Not used by the router. Pure Python. Both take
events through the one dispatch, :func:`router.kv.index.apply_event` (its own test in
tests/unit/test_index.py), so the property tests compare what they store and match.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from router.kv.index import POOL, TIERS, TierDepth, apply_event
from router.vllm.kvevents import KVEvent


class NaiveBlockIndex:
    """Reference implementation: a set per (replica, tier), a plain loop in ``match``."""

    def __init__(self) -> None:
        self.sets: dict[str, dict[str, set[int]]] = {}
        self.pool: set[int] = set()
        self.pool_members: set[str] = set()

    def _r(self, replica: str) -> dict[str, set[int]]:
        return self.sets.setdefault(replica, {t: set() for t in TIERS})

    def store(self, replica: str, keys: Iterable[int], medium: str = "GPU") -> None:
        self._r(replica)[medium.upper()].update(keys)

    def remove(self, replica: str, keys: Iterable[int], medium: str = "GPU") -> None:
        if replica in self.sets:
            self.sets[replica][medium.upper()].difference_update(keys)

    def clear(self, replica: str, medium: str | None = None) -> None:
        if replica in self.sets:
            for t in TIERS if medium is None else [medium.upper()]:
                self.sets[replica][t].clear()

    def remove_replica(self, replica: str) -> None:
        self.sets.pop(replica, None)
        self.pool_members.discard(replica)

    def pool_store(self, replica: str, keys: Iterable[int]) -> None:
        self.pool_members.add(replica)
        self.pool.update(keys)

    def pool_remove(self, keys: Iterable[int]) -> None:
        self.pool.difference_update(keys)

    def apply(self, replica: str, events: Iterable[KVEvent]) -> None:
        """The same event dispatch as :meth:`router.kv.index.BlockIndex.apply`
        (:func:`router.kv.index.apply_event`), onto the sets."""
        self._r(replica)
        for ev in events:
            apply_event(self, replica, ev)

    def match(
        self, keys: Sequence[int], replicas: Iterable[str] | None = None
    ) -> dict[str, TierDepth]:
        out = {}
        for name, tiers in self.sets.items():
            if replicas is not None and name not in set(replicas):
                continue
            counts = dict.fromkeys(TIERS, 0)
            depth = 0
            member = name in self.pool_members
            counts[POOL] = 0
            for k in keys:
                tier = next((t for t in TIERS if k in tiers[t]), None)
                if tier is None and member and k in self.pool:
                    tier = POOL
                if tier is None:
                    break
                counts[tier] += 1
                depth += 1
            if depth:
                out[name] = TierDepth(
                    depth, counts["GPU"], counts["CPU"], counts["STORAGE"], counts[POOL]
                )
        return out

    def snapshot(self) -> dict[str, dict[str, frozenset[int]]]:
        return {n: {t: frozenset(s) for t, s in ts.items()} for n, ts in self.sets.items()}
