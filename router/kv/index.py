"""Block index: which replica holds which prompt block, in which tier (GPU / CPU / STORAGE).

Owns: the presence of 64-bit block keys (:func:`router.vllm.hashing.to_key`) per replica and tier,
fed by decoded vLLM KV events (:mod:`router.vllm.kvevents`), and one question about them —
``match(prompt_keys) -> {replica: TierDepth}``: for each replica, how deep the longest
consecutive prefix of the prompt goes, and in which tier each of those blocks sits. Also a
per-replica freshness flag (set by the event ingestion when a ``seq`` gap makes the index
unreliable) and read-only views for scorers. Nothing else: load, sessions and cost live
elsewhere. Pure Python + numpy; must not import sockets, aiohttp, torch or vllm.

Representation (one dict per tier, shared by all replicas): ``key -> bitmask`` where bit ``s``
is the replica's slot (``0 <= s < MAX_REPLICAS``). With ≤8 replicas every mask is a cached
small int, so a key costs one dict entry plus its int object: 68 B measured (RSS of 10 M keys
over 8 replicas, docs/results.md).

The cluster pool (a tier every replica reads: the engine plugin's ``--pool-dir``, whose
events carry ``medium`` STORAGE and ``locality`` REMOTE) is one key set for all replicas, not
a tier per replica: a pool block counts in ``TierDepth.pool`` (after STORAGE, the slowest) for
every *pool member* (a replica that has published a pool event; ``add_pool_member`` for one
known to mount it before it writes), and a ``BlockRemoved`` from any replica takes it out (the
pool's files are shared, so one eviction removes it for all). ``AllBlocksCleared`` (an
engine's cache reset) leaves the pool.

Operations and their cost (n = blocks in the event or prompt, N = keys in the index):

===========================  ===========================================================
``store(r, keys, medium)``   O(n) dict updates
``remove(r, keys, medium)``  O(n)
``clear(r)``                 O(N) — one pass over every tier dict (AllBlocksCleared,
                             replica removal, restart; rare)
``match(keys)``              O(n) dict lookups (C-level ``map``) + O(n) numpy over uint64
                             masks: cumulative AND gives each replica's depth; blocks a
                             replica holds in several tiers count in the fastest one; with
                             a pool, O(n) set lookups more
===========================  ===========================================================

:class:`router.kv.index_ref.NaiveBlockIndex` is the reference (sets per replica and tier, a
Python loop); the property tests check the fast one against it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Protocol

import numpy as np

from router.vllm.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

TIERS: tuple[str, ...] = ("GPU", "CPU", "STORAGE")  # fastest first (per replica)
POOL = "POOL"  # the cluster pool's tier in TierDepth / holds(): after STORAGE
MAX_REPLICAS = 64
POOL_LOCALITY = "REMOTE"  # vLLM's locality of a tier shared with other instances


def is_pool_event(ev: KVEvent) -> bool:
    """A store or removal in the cluster pool: a STORAGE tier marked REMOTE by its publisher."""
    return (
        isinstance(ev, BlockStored | BlockRemoved)
        and ev.locality == POOL_LOCALITY
        and ev.medium.upper() == "STORAGE"
    )


class EventTarget(Protocol):
    """What :func:`apply_event` writes to: :class:`BlockIndex` and the reference
    :class:`router.kv.index_ref.NaiveBlockIndex`."""

    def store(self, replica: str, keys: Iterable[int], medium: str = "GPU") -> object: ...

    def remove(self, replica: str, keys: Iterable[int], medium: str = "GPU") -> object: ...

    def clear(self, replica: str, medium: str | None = None) -> None: ...

    def pool_store(self, replica: str, keys: Iterable[int]) -> object: ...

    def pool_remove(self, keys: Iterable[int]) -> object: ...


def apply_event(target: EventTarget, replica: str, ev: KVEvent) -> None:
    """One decoded KV event of ``replica`` as an index operation on ``target`` — the one
    dispatch both indexes use: a pool event (:func:`is_pool_event`) stores to or removes
    from the cluster pool, other stores and removals go to the event's tier,
    ``AllBlocksCleared`` (no medium on the event) forgets all of the replica's tiers (an
    underestimate at worst; the pool stays)."""
    if is_pool_event(ev):
        if isinstance(ev, BlockStored):
            target.pool_store(replica, ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            target.pool_remove(ev.block_hashes)
    elif isinstance(ev, BlockStored):
        target.store(replica, ev.block_hashes, ev.medium)
    elif isinstance(ev, BlockRemoved):
        target.remove(replica, ev.block_hashes, ev.medium)
    elif isinstance(ev, AllBlocksCleared):
        target.clear(replica)


@dataclass(frozen=True, slots=True)
class TierDepth:
    """How much of a prompt's prefix one replica holds.

    ``depth`` counts consecutive leading blocks present in any tier; ``gpu + cpu + storage +
    pool == depth``, each block counted in the fastest tier that holds it on that replica
    (``pool``: the cluster pool, for a pool member, slowest).
    """

    depth: int
    gpu: int = 0
    cpu: int = 0
    storage: int = 0
    pool: int = 0

    def in_tier(self, tier: str) -> int:
        return {"GPU": self.gpu, "CPU": self.cpu, "STORAGE": self.storage, POOL: self.pool}[tier]


@dataclass(slots=True)
class ReplicaIndexState:
    """What the index knows about one replica besides its blocks."""

    name: str
    slot: int
    blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    stale: bool = False  # events were lost: the index may miss or keep blocks wrongly
    stale_reason: str | None = None
    events: int = 0
    removed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))  # ever


class BlockIndexError(ValueError):
    pass


def _tier_of(medium: str) -> int:
    try:
        return TIERS.index(medium.upper())
    except ValueError:
        raise BlockIndexError(f"unknown medium {medium!r}; known: {TIERS}") from None


def _slot_counts(x: np.ndarray, nbytes: int) -> np.ndarray:
    """Per-slot popcount over a uint64 column: how many entries have bit ``s`` set."""
    if not x.any():
        return np.zeros(nbytes * 8, dtype=np.int64)
    rows = x[x != 0]
    b = rows.view(np.uint8).reshape(len(rows), 8)[:, :nbytes]
    return np.unpackbits(b, axis=1, bitorder="little").sum(axis=0, dtype=np.int64)


def _depths_from_masks(masks: list[np.ndarray], slots: dict[int, str]) -> dict[str, TierDepth]:
    """Per-replica :class:`TierDepth` from per-tier uint64 masks of the prompt's blocks."""
    if not slots:
        return {}
    g, c, s, p = masks
    wanted = 0
    for slot in slots:
        wanted |= 1 << slot
    anym = (g | c | s | p) & np.uint64(wanted)
    cum = np.bitwise_and.accumulate(anym)
    # cum is monotone (bits only drop): a slot's depth is where its bit drops.
    n = len(cum)
    depth: dict[int, int] = {}
    prev = int(cum[0]) if n else 0
    for i in np.flatnonzero(cum[1:] != cum[:-1]).tolist():
        cur = int(cum[i + 1])
        dropped = prev & ~cur
        while dropped:
            low = dropped & -dropped
            depth[low.bit_length() - 1] = i + 1
            dropped ^= low
        prev = cur
    while prev:
        low = prev & -prev
        depth[low.bit_length() - 1] = n
        prev ^= low
    if not depth:
        return {}
    nmax = max(depth.values())
    nbytes = max(depth) // 8 + 1
    cum = cum[:nmax]
    cpu = storage = pool = None
    if c.any():
        cpu = _slot_counts((c[:nmax] & ~g[:nmax]) & cum, nbytes)
    if s.any():
        storage = _slot_counts((s[:nmax] & ~g[:nmax] & ~c[:nmax]) & cum, nbytes)
    if p.any():
        pool = _slot_counts((p[:nmax] & ~g[:nmax] & ~c[:nmax] & ~s[:nmax]) & cum, nbytes)
    out: dict[str, TierDepth] = {}
    for slot, d in depth.items():
        nc = int(cpu[slot]) if cpu is not None else 0
        ns = int(storage[slot]) if storage is not None else 0
        npool = int(pool[slot]) if pool is not None else 0
        out[slots[slot]] = TierDepth(
            depth=d, gpu=d - nc - ns - npool, cpu=nc, storage=ns, pool=npool
        )
    return out


class BlockIndex:
    """The production index (see the module docstring for layout and complexity)."""

    def __init__(self) -> None:
        self._tiers: list[dict[int, int]] = [{} for _ in TIERS]
        self._replicas: dict[str, ReplicaIndexState] = {}
        self._slots: dict[int, str] = {}
        self._pool: set[int] = set()  # keys in the cluster pool
        self._pool_members = 0  # slot bitmask of the replicas that read the pool
        self.pool_removed = 0  # pool keys removed, ever
        self.version = 0  # bumps on every change; views and caches can compare it

    # ---- replicas ------------------------------------------------------------------------

    def add_replica(self, name: str) -> ReplicaIndexState:
        st = self._replicas.get(name)
        if st is not None:
            return st
        free = next((s for s in range(MAX_REPLICAS) if s not in self._slots), None)
        if free is None:
            raise BlockIndexError(f"at most {MAX_REPLICAS} replicas per index")
        st = ReplicaIndexState(name=name, slot=free)
        self._replicas[name] = st
        self._slots[free] = name
        return st

    def remove_replica(self, name: str) -> None:
        st = self._replicas.get(name)
        if st is None:
            return
        self.clear(name)
        self._pool_members &= ~(1 << st.slot)
        del self._replicas[name]
        del self._slots[st.slot]

    def replicas(self) -> list[str]:
        return list(self._replicas)

    def state(self, name: str) -> ReplicaIndexState | None:
        return self._replicas.get(name)

    def mark_stale(self, name: str, reason: str) -> None:
        st = self.add_replica(name)
        st.stale, st.stale_reason = True, reason
        self.version += 1

    def mark_fresh(self, name: str) -> None:
        st = self.add_replica(name)
        st.stale, st.stale_reason = False, None
        self.version += 1

    # ---- mutation ------------------------------------------------------------------------

    def store(self, replica: str, keys: Iterable[int], medium: str = "GPU") -> int:
        """Mark ``keys`` present on ``replica`` in ``medium``; returns how many were new."""
        t = _tier_of(medium)
        st = self.add_replica(replica)
        d = self._tiers[t]
        bit = 1 << st.slot
        get = d.get
        new = 0
        for k in keys:
            v = get(k, 0)
            if not v & bit:
                d[k] = v | bit
                new += 1
        st.blocks[TIERS[t]] += new
        self.version += 1
        return new

    def remove(self, replica: str, keys: Iterable[int], medium: str = "GPU") -> int:
        """Drop ``keys`` from ``replica``'s ``medium``; returns how many were present."""
        st = self._replicas.get(replica)
        if st is None:
            return 0
        t = _tier_of(medium)
        d = self._tiers[t]
        bit = 1 << st.slot
        gone = 0
        for k in keys:
            v = d.get(k, 0)
            if v & bit:
                nv = v & ~bit
                if nv:
                    d[k] = nv
                else:
                    del d[k]
                gone += 1
        st.blocks[TIERS[t]] -= gone
        st.removed[TIERS[t]] += gone
        self.version += 1
        return gone

    def clear(self, replica: str, medium: str | None = None) -> None:
        """Forget every block of ``replica`` (in one tier, or all): O(keys in the index)."""
        st = self._replicas.get(replica)
        if st is None:
            return
        bit = 1 << st.slot
        tiers = range(len(TIERS)) if medium is None else [_tier_of(medium)]
        for t in tiers:
            d = self._tiers[t]
            if st.blocks[TIERS[t]] == 0:
                continue
            hit = [k for k, v in d.items() if v & bit]
            for k in hit:
                nv = d[k] & ~bit
                if nv:
                    d[k] = nv
                else:
                    del d[k]
            st.blocks[TIERS[t]] = 0
        self.version += 1

    # ---- the cluster pool -------------------------------------------------------------------

    def add_pool_member(self, replica: str) -> None:
        """``replica`` reads the pool: every pool block counts as a pool block on it."""
        st = self.add_replica(replica)
        if not self._pool_members & (1 << st.slot):
            self._pool_members |= 1 << st.slot
            self.version += 1

    def pool_store(self, replica: str, keys: Iterable[int]) -> int:
        """``replica`` wrote ``keys`` to the pool (and so reads it); returns how many were new."""
        self.add_pool_member(replica)
        before = len(self._pool)
        self._pool.update(keys)
        self.version += 1
        return len(self._pool) - before

    def pool_remove(self, keys: Iterable[int]) -> int:
        """``keys`` left the pool (whichever replica evicted them); returns how many were in it."""
        before = len(self._pool)
        self._pool.difference_update(keys)
        gone = before - len(self._pool)
        self.pool_removed += gone
        self.version += 1
        return gone

    def pool_blocks(self) -> int:
        return len(self._pool)

    def pool_keys(self) -> frozenset[int]:
        """A copy of the pool's keys (tests, debugging; O(N))."""
        return frozenset(self._pool)

    def pool_members(self) -> list[str]:
        return [n for s, n in self._slots.items() if self._pool_members & (1 << s)]

    def apply(self, replica: str, events: Iterable[KVEvent]) -> None:
        """Apply decoded KV events of one replica, in order (:func:`apply_event`)."""
        st = self.add_replica(replica)
        for ev in events:
            st.events += 1
            apply_event(self, replica, ev)

    # ---- queries -------------------------------------------------------------------------

    def _masks(self, keys: Sequence[int]) -> list[np.ndarray]:
        n = len(keys)
        out = []
        for d in self._tiers:
            if d:
                out.append(np.array(list(map(d.get, keys, repeat(0))), dtype=np.uint64))
            else:
                out.append(np.zeros(n, dtype=np.uint64))
        if self._pool and self._pool_members:
            # a pool block is reachable from every member
            in_pool = np.fromiter(map(self._pool.__contains__, keys), dtype=bool, count=n)
            out.append(np.where(in_pool, np.uint64(self._pool_members), np.uint64(0)))
        else:
            out.append(np.zeros(n, dtype=np.uint64))
        return out

    def match(
        self, keys: Sequence[int], replicas: Iterable[str] | None = None
    ) -> dict[str, TierDepth]:
        """For each replica with a non-empty match: depth of the longest consecutive prefix of
        ``keys`` it holds (any tier) and the split of those blocks by fastest tier.

        Replicas holding not even the first block are absent from the result. ``replicas``
        restricts the answer (unknown names are ignored).
        """
        if not keys:
            return {}
        slots = self._slots
        if replicas is not None:
            wanted = set(replicas)
            slots = {s: n for s, n in slots.items() if n in wanted}
        return _depths_from_masks(self._masks(keys), slots)

    def holds(self, replica: str, key: int) -> tuple[str, ...]:
        """Tiers in which ``replica`` holds ``key``."""
        st = self._replicas.get(replica)
        if st is None:
            return ()
        bit = 1 << st.slot
        out = tuple(TIERS[t] for t, d in enumerate(self._tiers) if d.get(key, 0) & bit)
        if self._pool_members & bit and key in self._pool:
            out += (POOL,)
        return out

    def __len__(self) -> int:
        """Distinct keys over all tiers and the pool."""
        if not self._tiers[1] and not self._tiers[2] and not self._pool:
            return len(self._tiers[0])
        return len(set(self._tiers[0]).union(self._tiers[1], self._tiers[2], self._pool))

    def view(self) -> BlockIndexView:
        return BlockIndexView(self)

    def snapshot(self) -> dict[str, dict[str, frozenset[int]]]:
        """A deep, immutable copy ``{replica: {tier: keys}}`` (tests, debugging; O(N))."""
        out: dict[str, dict[str, frozenset[int]]] = {}
        for name, st in self._replicas.items():
            bit = 1 << st.slot
            out[name] = {
                TIERS[t]: frozenset(k for k, v in d.items() if v & bit)
                for t, d in enumerate(self._tiers)
            }
        return out


class BlockIndexView:
    """Read-only face of a :class:`BlockIndex` for scorers: queries only, no mutation.

    Cheap (no copy): consistent for the duration of one synchronous scoring pass, since the
    index only changes when the event loop runs the ingestion task.
    """

    __slots__ = ("_ix", "version")

    def __init__(self, ix: BlockIndex):
        self._ix = ix
        self.version = ix.version

    def match(
        self, keys: Sequence[int], replicas: Iterable[str] | None = None
    ) -> dict[str, TierDepth]:
        return self._ix.match(keys, replicas)

    def holds(self, replica: str, key: int) -> tuple[str, ...]:
        return self._ix.holds(replica, key)

    def replicas(self) -> list[str]:
        return self._ix.replicas()

    def is_stale(self, replica: str) -> bool:
        st = self._ix.state(replica)
        return st is None or st.stale

    def pool_blocks(self) -> int:
        return self._ix.pool_blocks()

    def pool_members(self) -> list[str]:
        return self._ix.pool_members()

    def blocks(self, replica: str) -> dict[str, int]:
        st = self._ix.state(replica)
        return dict(st.blocks) if st else dict.fromkeys(TIERS, 0)
