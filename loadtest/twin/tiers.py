"""The twin's lower KV tiers: host DRAM, storage and the cluster pool.

Parts of :mod:`loadtest.twin.engine`.

Owns: :class:`HostTier` (vLLM's ``OffloadingConnector`` host tier, LRU or the engine plugin's
retention), :class:`TierLRU` (the storage tier) and :class:`ClusterPool` (the cluster KV pool
every engine of a cluster shares). Key sets and their eviction order only: which blocks an
engine offers or loads, and the events that go with it, are the engine's
(:mod:`loadtest.twin.engine_tiers`).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

from engine_patches.retention_rule import Hint, RetentionConfig, RetentionTable


class TierLRU:
    """The storage tier: an LRU set of block keys with a capacity in blocks (written through
    from the host tier; the host tier itself is :class:`HostTier`)."""

    __slots__ = ("capacity", "keys")

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.keys: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, key: int) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def put(self, key: int) -> int | None:
        """Insert (or refresh) ``key``; returns the key evicted to make room, if any."""
        if key in self.keys:
            self.keys.move_to_end(key)
            return None
        self.keys[key] = None
        if len(self.keys) > self.capacity:
            return self.keys.popitem(last=False)[0]
        return None

    def clear(self) -> None:
        self.keys.clear()


class ClusterPool:
    """The cluster KV pool: ONE key set that every engine of a cluster writes and reads.

    The engine plugin's pool tier (``engine_patches.pool``, docs/engine.md#cluster-pool) as
    the twins model it: a secondary tier below each engine's host tier (and disk tier),
    content-addressed by the block hash, so a block any engine wrote is found by all. Hand
    the same instance to every :class:`Engine` of a cluster. Capacity in blocks; over it, the
    least recently used keys go, down to ``low_water`` of the capacity (the plugin's sweep;
    ``engine_patches.pool.LOW_WATER``). A write or a load refreshes a key (vLLM rewrites the
    file; the plugin touches a loaded file). Counters are the whole pool's."""

    __slots__ = ("capacity", "evicted", "keys", "loaded", "low_water", "stored")

    def __init__(self, capacity: int, low_water: float = 0.9):
        if capacity <= 0:
            raise ValueError("a cluster pool needs a capacity of at least one block")
        if not 0 < low_water <= 1:
            raise ValueError("low_water must be in (0, 1]")
        self.capacity = capacity
        self.low_water = low_water
        self.keys: OrderedDict[int, None] = OrderedDict()
        self.stored = 0  # blocks written (all engines; rewrites included)
        self.loaded = 0  # blocks loaded from it (all engines)
        self.evicted = 0  # blocks evicted

    def __contains__(self, key: int) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def put(self, keys: Sequence[int]) -> list[int]:
        """Write ``keys`` (new or rewritten: most recently used now); returns the keys evicted
        to bring the pool back under its capacity (least recently used first)."""
        pool = self.keys
        for k in keys:
            pool[k] = None
            pool.move_to_end(k)
        self.stored += len(keys)
        if len(pool) <= self.capacity:
            return []
        target = max(0, min(self.capacity, int(self.capacity * self.low_water)))
        out = []
        while len(pool) > target:
            out.append(pool.popitem(last=False)[0])
        self.evicted += len(out)
        return out

    def touch(self, keys: Iterable[int]) -> None:
        """A load of ``keys``: they become the most recently used."""
        pool = self.keys
        n = 0
        for k in keys:
            if k in pool:
                pool.move_to_end(k)
                n += 1
        self.loaded += n

    def clear(self) -> None:
        self.keys.clear()


class HostTier:
    """The host-DRAM tier as vLLM's ``OffloadingConnector`` keeps it: write-through.

    vLLM 0.32.0's ``CPUOffloadingManager`` with its LRU policy (``vllm/v1/kv_offload/cpu``), or
    with the plugin's ``AgentRetentionPolicy`` when ``retention`` is given (the same pure rule,
    :class:`RetentionTable`, as ``table``). One chunk per engine block. What it models:

    * :meth:`store` is ``prepare_store``: a request's newly computed prompt blocks are offered
      at the step that computes them; keys already here are left as they are, new keys get a
      fresh LRU rank and are being written (not evictable until :meth:`settle`, when their
      ``BlockStored`` is due: the engine settles them a step later, as vLLM's worker submits
      a step's stores at the start of the next one). Room is made first, evicting the least
      recently used chunks that are not in the offer, not being loaded and not being written;
      if that cannot free enough, nothing is stored (the connector retries at the request's
      next step).
    * Retention claims: chunks a hinted request stores belong to its session once inserted
      (the plugin's ``on_store_miss`` / ``insert``), so the eviction that makes room for them
      does not count them yet.
    * :meth:`finish` is ``on_request_finished``: every chunk the request offered or loaded gets
      a fresh rank, its last block first, so a prefix outlives its tails. No lookup refreshes.
    * Retention: an eviction first skips the chunks of sessions that hold (``evict(n,
      protected | held)``), and runs as plain LRU if that cannot give ``n``; ``done`` sends the
      session's chunks to the cold end, tail first. A held chunk met while evicting is parked
      under its session and goes back to the heap (same rank) when the session stops holding,
      so skipping it costs once per hold, not once per eviction.

    The LRU order is a rank per key in a lazy min-heap (lower: evicted earlier), as vLLM's.
    """

    __slots__ = ("_cold", "_heap", "_next", "_parked", "_pins", "capacity", "keys", "pending",
                 "table")  # fmt: skip

    def __init__(self, capacity: int, retention: RetentionConfig | None = None):
        if capacity <= 0:
            raise ValueError("a host tier needs a capacity of at least one block")
        self.capacity = capacity
        self.table = RetentionTable(retention, capacity) if retention is not None else None
        self.keys: dict[int, int] = {}  # key -> LRU rank
        self.pending: set[int] = set()  # stored, being written (not readable, not evictable)
        self._pins: dict[int, int] = {}  # key -> loads in flight (not evictable)
        self._heap: list[tuple[int, int]] = []
        self._parked: dict[str, list[tuple[int, int]]] = {}
        self._next = 0
        self._cold = 0

    def __contains__(self, key: int) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def _rank(self, key: int, rank: int) -> None:
        self.keys[key] = rank
        heapq.heappush(self._heap, (rank, key))
        if len(self._heap) > 2 * len(self.keys) + 4096:
            self._heap = [(r, k) for k, r in self.keys.items()]
            heapq.heapify(self._heap)
            self._parked.clear()  # their keys are back in the heap

    def _unpark(self, keep: Mapping[str, int]) -> None:
        for name in [x for x in self._parked if x not in keep]:
            for e in self._parked.pop(name):
                heapq.heappush(self._heap, e)

    def _pop(self, n: int, protected: set[int], held: Mapping[str, int]) -> list[int] | None:
        """The ``n`` least recently used evictable keys, skipping ``held`` sessions' (parked);
        None (the heap as it was) when there are not ``n``."""
        heap, keys, pins, pending = self._heap, self.keys, self._pins, self.pending
        owner = self.table.owner if self.table is not None and held else None
        out: list[tuple[int, int]] = []
        skipped: list[tuple[int, int]] = []
        while len(out) < n and heap:
            e = heapq.heappop(heap)
            rank, key = e
            if keys.get(key) != rank:
                continue  # stale: refreshed or gone
            if key in protected or key in pins or key in pending:
                skipped.append(e)
                continue
            if owner is not None:
                who = owner(key)
                if who is not None and who in held:
                    self._parked.setdefault(who, []).append(e)
                    continue
            out.append(e)
        for e in skipped:
            heapq.heappush(heap, e)
        if len(out) < n:
            for e in out:
                heapq.heappush(heap, e)
            return None
        gone = [k for _, k in out]
        for k in gone:
            del keys[k]
        return gone

    def _evict(self, n: int, protected: set[int], now: float) -> list[int] | None:
        held = self.table.held(now) if self.table is not None else {}
        self._unpark(held)
        out = self._pop(n, protected, held) if held else None
        if out is None:  # retention yields: never block an eviction the engine needs
            self._unpark({})
            out = self._pop(n, protected, {})
        if out and self.table is not None:
            self.table.forget(out)
        return out

    def store(
        self, keys: Sequence[int], now: float, hint: Hint | None = None
    ) -> tuple[list[int], list[int]] | None:
        """``prepare_store`` of ``keys``: (keys newly stored, keys evicted for them), or None
        when no room could be made (nothing changed)."""
        new = list(dict.fromkeys(k for k in keys if k not in self.keys))
        if not new:
            return [], []
        n = len(self.keys) + len(new) - self.capacity
        evicted: list[int] = []
        if n > 0:
            if n > len(self.keys):
                return None  # the offer alone is larger than the tier
            got = self._evict(n, set(keys), now)
            if got is None:
                return None
            evicted = got
        for k in new:
            self._next += 1
            self._rank(k, self._next)
            self.pending.add(k)
        if self.table is not None:
            self.table.claim(new, hint)  # the policy's on_store_miss
        return new, evicted

    def settle(self, keys: Iterable[int]) -> list[int]:
        """These writes are done (``complete_store``): returns those of ``keys`` now readable."""
        out = []
        for k in keys:
            if k in self.pending:
                self.pending.discard(k)
                if k in self.keys:
                    out.append(k)
        return out

    def pin(self, keys: Iterable[int]) -> None:
        """A load from this tier began (``prepare_load``): not evictable until :meth:`unpin`."""
        pins = self._pins
        for k in keys:
            pins[k] = pins.get(k, 0) + 1

    def unpin(self, keys: Iterable[int]) -> None:
        pins = self._pins
        for k in keys:
            c = pins.get(k, 0) - 1
            if c > 0:
                pins[k] = c
            else:
                pins.pop(k, None)

    def finish(self, keys: Sequence[int], hint: Hint | None, now: float) -> None:
        """``on_request_finished``: the request's chunks (prompt order) become the most
        recently used, its first block last; then its hint applies (claim, hold, ``done``)."""
        present = [k for k in keys if k in self.keys]
        for k in reversed(present):
            self._next += 1
            self._rank(k, self._next)
        if self.table is not None and hint is not None:
            self.table.claim(present, hint)
            for gone in self.table.finish(hint, now):
                if isinstance(gone, int) and gone in self.keys:
                    self._cold -= 1
                    self._rank(gone, self._cold)

    def held_blocks(self, now: float) -> int:
        return sum(self.table.held(now).values()) if self.table is not None else 0

    def retained_share(self, now: float) -> float | None:
        """The engine plugin's retained-share gauge (``vllm:kv_offload_cpu_retained_perc``):
        held blocks over capacity; None without retention."""
        if self.table is None or self.capacity <= 0:
            return None
        return self.held_blocks(now) / self.capacity

    def clear(self) -> None:
        self.keys.clear()
        self.pending.clear()
        self._pins.clear()
        self._heap.clear()
        self._parked.clear()
        if self.table is not None:
            self.table = RetentionTable(self.table.config, self.capacity)
