"""The twin's engine model: vLLM v1 scheduling and KV block management, without a model.

Owns: the state machine one replica runs — requests, the waiting queue (FCFS, or by
priority), the running batch, the GPU block pool with prefix caching, the optional host-DRAM
and storage tiers, KV event generation — and the duration of each step (from a timing model,
:mod:`loadtest.twin.truth`: a truth the router is not told, or ``costmodel.steptime``'s
formula by default in Python). It does
not own time: a driver (the HTTP replica's asyncio loop, or the discrete-event simulator)
calls ``schedule(now)`` to get a :class:`Step`, waits ``step.duration`` and calls
``complete(step, end)``. No sockets, no HTTP, no asyncio; must not import aiohttp or zmq.

vLLM v1 semantics modelled (``vllm/v1/core/sched/scheduler.py``, ``block_pool.py``,
``kv_cache_manager.py`` in 0.32.0):

* One token budget per step (``max_num_batched_tokens``), at most ``max_num_seqs`` running.
  Running requests are scheduled first, in order; then waiting requests FCFS while budget,
  seats and blocks last. Chunked prefill: a prefill takes what budget is left, capped by
  ``long_prefill_token_threshold`` when set. A decode takes one token.
* Blocks: a pool of ``gpu_kv_blocks`` of which one is vLLM's reserved null block. Only full
  blocks are hashed and cached (chained hash of the request's tokens); blocks are cached when
  they are *allocated for* computation (so a request scheduled later in the same step already
  hits them). A prefix hit takes the longest run of cached blocks, capped so that at least
  one prompt token is computed (``(num_tokens - 1) // block_size`` blocks).
  Ref-counted; a freed cached block goes to the tail of the free queue (a request's blocks
  in reverse order, so its last blocks are evicted first) and stays cached until it is
  reallocated from the head (LRU eviction, one ``BlockRemoved`` per evicted block); a freed
  block without a hash goes to the front (reused first). A block recomputed while its hash
  is cached elsewhere becomes a second cached copy (stored and removed on its own).
* Priority policy (profile ``priority_scheduling``, vLLM's ``--scheduling-policy priority``):
  the waiting queue is ordered by (priority, arrival) instead, a preempted request goes back
  at its place in that order, and the running request preempted is the one with the largest
  (priority, arrival), dropped from the step if already scheduled in it.
* No room for a running request: preempt the last running request (recompute: free its
  blocks, back to the front of the waiting queue). A waiting request is admitted only if
  its whole sequence so far fits in the free blocks (``scheduler_reserve_full_isl``, on by
  default), not just its first chunk; an async load from a lower tier only within the free
  blocks less what the other in-flight prefills still need (``reserved_blocks``). No room:
  stop admitting this step — except where stopping would freeze the engine (nothing running,
  a load behind holding blocks), where vLLM 0.32 stops for good (vllm#57841) and the twin
  scans on past the head instead (:meth:`Engine._stranding`).
* Tiers (optional), as vLLM's ``OffloadingConnector`` (``offloading/scheduler.py``,
  ``kv_offload/cpu/manager.py``, ``kv_offload/tiering/manager.py``): write-through, not a
  victim cache. Each prompt block a step computes is offered to host DRAM (:class:`HostTier`,
  LRU, capacity ``cpu_kv_blocks``) by the step that computes it, and written on to storage
  when the write ends (every stored chunk goes to every tier); a GPU eviction moves nothing.
  A request with no lower-tier hit offers all its prompt blocks (so a GPU hit puts back what
  the host tier lost), one that loads offers only the blocks after its hit. When a request
  ends, the host chunks it offered or loaded become the most recently used (its first block
  last). A prefix hit continues into the lower tiers and the request waits (like
  ``WAITING_FOR_REMOTE_KVS``) for ``load_time(cpu) + load_time(storage)`` while other
  requests run (the loaded chunks cannot be evicted meanwhile; storage chunks are staged
  through the host tier), then holds those blocks in GPU. Lower-tier events carry ``medium``
  CPU/STORAGE, empty token ids and block size 0, as vLLM's tiers publish them: removals when
  the store pass evicts, ``BlockStored`` when the step's writes end.
  With ``host_write_back`` (the plugin's write-back tier, ``engine_patches.writeback``)
  nothing is written through: the blocks an allocation evicts from HBM go to the host tier,
  and the step that evicts them waits for the copy (:meth:`Engine._write_back`).
* Prefill cadence (optional, ``prefill_interval_steps`` N > 1): waiting requests are admitted
  only every N-th step, except when nothing is running (the capacity guard: an idle engine
  never waits for its cadence).

The engine plugin (``engine_patches``, docs/engine.md), optional and off by default
(:class:`EnginePlugin`):

* Retention (``EnginePlugin.retention``): the host tier is :class:`HostTier` with vLLM's LRU
  plus the session holds of ``AgentRetentionPolicy``, decided by the same pure rule
  (:mod:`engine_patches.retention_rule`) from the request's ``kvroute`` hint
  (``Request.hint``). Host chunks a hinted request stores belong to its session; when it
  finishes, the chunks it offered or loaded do too and its hint applies (hold, ``running``,
  ``done`` = to the cold end). Each store pass that needs room runs one ``evict(n)`` of the
  plugin's policy.
* Bounded prefill cadence (``EnginePlugin.cadence``): each step asks
  :class:`engine_patches.cadence.PrefillCadence` (the plugin scheduler's pure rule, with the
  same pending list: running prefill chunks, and waiting requests flagged eligible by
  ``eligible_flags`` over the token budget and free seats) whether prefill may run; a held
  step defers all prefill compute as ``throttle_prefills`` does. It replaces
  ``prefill_interval_steps`` when both are set.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import zlib
from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from costmodel.disagg import kv_transfer_time
from costmodel.profiles import ReplicaProfile
from costmodel.steptime import attended_pairs
from engine_patches.cadence import CadenceConfig, PendingPrefill, PrefillCadence, eligible_flags
from engine_patches.retention_rule import Hint, RetentionConfig, RetentionTable
from loadtest.twin.truth import POOL, StepTiming, Truth, timing
from router.vllm.hashing import MASK64, BlockHasher
from router.vllm.kvevents import encode_all_cleared, encode_block_removed, encode_block_stored

REMOTE = "REMOTE"  # vLLM's locality of a tier shared with other instances (the pool's)
WAITING, LOADING, RUNNING, FINISHED, ABORTED = (
    "waiting",
    "loading",
    "running",
    "finished",
    "aborted",
)


class Request:
    """One generation request as the engine sees it.

    Either ``token_ids`` (the HTTP twin: hashes are real vLLM hashes from ``hasher``) or
    ``block_keys`` (the simulator: precomputed 64-bit keys of the prompt's full blocks).
    """

    __slots__ = (
        "arrival",
        "block_keys",
        "blocks",
        "cached_tokens",
        "digests",
        "finish_time",
        "first_token_time",
        "gauge_hit",
        "hint",
        "host_lo",
        "host_next",
        "id",
        "load_blocks",
        "max_tokens",
        "n_cached",
        "num_computed",
        "num_output",
        "num_preemptions",
        "output_ids",
        "priority",
        "promoted",
        "prompt_len",
        "queued_time",
        "ready_at",
        "remote_tokens",
        "seq",
        "session_id",
        "status",
        "tag",
        "token_ids",
    )  # fmt: skip

    def __init__(
        self,
        req_id: str,
        prompt_len: int,
        max_tokens: int,
        *,
        token_ids: list[int] | None = None,
        block_keys: list[int] | None = None,
        arrival: float = 0.0,
        session_id: str | None = None,
        tag: Any = None,
        hint: Hint | None = None,
        priority: int = 0,
    ):
        if prompt_len <= 0:
            raise ValueError("a request needs at least one prompt token")
        if max_tokens <= 0:
            raise ValueError("max_tokens must be at least 1")
        self.id = req_id
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.token_ids = token_ids
        self.block_keys: list[int] = list(block_keys) if block_keys is not None else []
        self.digests: list[bytes] = []
        self.arrival = arrival
        self.session_id = session_id
        self.tag = tag
        self.hint = hint  # the request's kvroute retention hint (engine plugin), if any
        self.priority = priority  # vLLM's request priority (lower first; priority policy)
        self.seq = 0  # the engine's arrival count (arrival-time ties, as vLLM's clock breaks)
        self.blocks: list[int] = []
        self.n_cached = 0  # leading blocks already through caching
        self.num_computed = 0
        self.num_output = 0
        self.output_ids: list[int] = []
        self.status = WAITING
        self.cached_tokens: int | None = None  # prompt tokens hit at first scheduling
        # GPU-cached prompt tokens the pending-prefill gauge found while it waits (None: not
        # looked up since it last entered the waiting queue)
        self.gauge_hit: int | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.queued_time: float | None = None  # first scheduled
        self.ready_at = 0.0
        # P/D disaggregation, decode side: leading prompt tokens a prefill replica computed,
        # whose KV arrives over the link instead of being computed here (vLLM's
        # ``kv_transfer_params`` with ``do_remote_prefill``); 0 once received (or none)
        self.remote_tokens = 0
        self.load_blocks: list[int] = []  # keys being loaded from lower tiers
        # keys it staged from storage or the pool to host, and from which ("storage", "pool")
        self.promoted: dict[int, str] | None = None
        self.num_preemptions = 0
        # the lower tiers' store pass (vLLM's next_stored_chunk_idx): blocks [host_lo,
        # host_next) were offered to or loaded from them (-1: not admitted yet)
        self.host_lo = -1
        self.host_next = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_output

    @property
    def finished(self) -> bool:
        return self.status in (FINISHED, ABORTED)


@dataclass(slots=True)
class Step:
    """What one engine step computes: ``(request, new_tokens)`` pairs and its duration."""

    scheduled: list[tuple[Request, int]]
    duration: float
    start: float
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    """After a step: requests that got a token (with how many), and those that finished."""

    tokens: list[Request]
    finished: list[Request]
    first_tokens: list[Request]


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


@dataclass(frozen=True)
class EnginePlugin:
    """What of the engine plugin (``engine_patches``) the twin runs: off by default.

    ``retention``: the host tier honours ``kvroute`` hints (needs a host tier,
    ``cpu_kv_blocks`` > 0). ``cadence``: the bounded prefill cadence. Both take the plugin's
    own settings (:class:`RetentionConfig`, :class:`CadenceConfig`) by the plugin's names."""

    retention: RetentionConfig | None = None
    cadence: CadenceConfig | None = None

    @classmethod
    def from_settings(
        cls, retention: Mapping[str, Any] | None = None, cadence: Mapping[str, Any] | None = None
    ) -> EnginePlugin:
        """From the plugin's dicts: ``kv_connector_extra_config["retention"]`` (``ttl_s``,
        ``max_share``, ...) and ``--additional-config``'s ``kvroute.cadence`` (``interval``,
        ``max_defer_steps``, ``max_defer_ms``, ``backlog_scale``, ...); None: that part off."""
        return cls(
            RetentionConfig.from_dict(retention) if retention is not None else None,
            CadenceConfig.from_dict(cadence) if cadence is not None else None,
        )


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


class Engine:
    """One replica's engine model. See the module docstring for the semantics."""

    def __init__(
        self,
        profile: ReplicaProfile,
        *,
        hasher: BlockHasher | None = None,
        emit_events: bool = True,
        output_token: Callable[[Request, int], int] | None = None,
        keep_digests: bool = False,
        plugin: EnginePlugin | None = None,
        truth: str | Truth | None = None,
        cluster_pool: ClusterPool | None = None,
    ):
        self.profile = profile
        self.plugin = plugin = plugin or EnginePlugin()
        # step and load times: a truth (loadtest.twin.truth), None = costmodel's formula
        self.timing: StepTiming = timing(profile, truth)
        self.block_size = profile.block_size
        self.hasher = hasher
        if hasher is not None and hasher.block_size != profile.block_size:
            raise ValueError("hasher block size differs from the profile's")
        self.events: list[dict[str, Any]] | None = [] if emit_events else None
        if plugin.retention is not None and not profile.cpu_kv_blocks:
            raise ValueError("retention needs a host tier (cpu_kv_blocks > 0)")
        # the write-back tier's host pool is a vLLM BlockPool, whose block 0 is its null block
        host_blocks = profile.cpu_kv_blocks - (1 if profile.host_write_back else 0)
        self.cpu = HostTier(host_blocks, plugin.retention) if profile.cpu_kv_blocks else None
        self.storage = TierLRU(profile.storage_kv_blocks) if profile.storage_kv_blocks else None
        self.pool = BlockPool(profile.gpu_kv_blocks, self.events)
        if profile.host_write_back and self.cpu is not None:
            self.pool.victims = []
        # the cluster pool (shared with the other engines of a cluster; a profile with
        # pool_kv_blocks and no pool handed in gets one of its own: a cluster of one)
        if cluster_pool is None and profile.pool_kv_blocks:
            cluster_pool = ClusterPool(profile.pool_kv_blocks)
        if cluster_pool is not None and (self.cpu is None or profile.host_write_back):
            raise ValueError("a cluster pool needs a write-through host tier (cpu_kv_blocks > 0)")
        self.cluster_pool = cluster_pool
        self._promoting: set[int] = set()  # host chunks being staged from storage or the pool
        # lower-tier stores by group (one per request and store pass): those of the step being
        # planned, and those of the step before, which the worker writes during the next step
        # (vLLM defers a step's stores to the next one's start) — settled when that step ends
        self._writing: list[list[int]] = []
        self._in_flight: list[list[int]] = []
        self.cadence = (
            PrefillCadence(plugin.cadence, profile.max_num_batched_tokens)
            if plugin.cadence is not None
            else None
        )
        self.now = 0.0  # the time of the last schedule() / complete()
        self.waiting: deque[Request] = deque()
        # vLLM's --scheduling-policy priority: the waiting queue by (priority, arrival), and
        # the running request with the largest (priority, arrival) preempted (else FCFS)
        self.by_priority = bool(profile.priority_scheduling)
        self._seq = 0
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.output_token = output_token or _default_output_token
        # key -> full digest, for publishers that send digests (VLLM_KV_EVENTS_USE_INT_...=0)
        self.digests: dict[int, bytes] | None = {} if keep_digests else None
        self.step_count = 0
        self.prefill_capacity_bound = False
        # counters (vLLM metric names in the HTTP layer)
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens hit (any tier)
        self.tier_hit_blocks = {"gpu": 0, "cpu": 0, "storage": 0, "pool": 0}
        self.remote_blocks = 0  # blocks received from a prefill replica (P/D decode side)
        # prompt tokens hit by tier, once per request (vllm:prompt_tokens_cached_by_source:
        # vLLM labels a pool hit "disk", the source of every STORAGE tier)
        self.cached_by_source = {"device": 0, "host": 0, "disk": 0}
        # the same with the pool apart from the disk tier (the twin's own counter)
        self.cached_by_tier = {"device": 0, "host": 0, "disk": 0, "pool": 0}
        self.preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.busy_time = 0.0

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

    # ---- requests ----------------------------------------------------------------------

    def add(self, req: Request) -> None:
        if req.id in self.requests:
            raise ValueError(f"duplicate request id {req.id!r}")
        if req.prompt_len + req.max_tokens > self.profile.max_model_len:
            raise ValueError(
                f"prompt ({req.prompt_len}) + max_tokens ({req.max_tokens}) exceeds "
                f"max_model_len {self.profile.max_model_len}"
            )
        self.requests[req.id] = req
        self._seq += 1
        req.seq = self._seq
        if self.by_priority:
            self._insert_waiting(req)
        else:
            self.waiting.append(req)

    def abort(self, req_id: str) -> bool:
        req = self.requests.pop(req_id, None)
        if req is None:
            return False
        if req.status == RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.cpu is not None:
            if req.status == LOADING and not req.remote_tokens:
                self.cpu.unpin(req.load_blocks)
            self._host_finish(req, self.now)
        self.pool.release(req.blocks)
        req.blocks = []
        req.status = ABORTED
        return True

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``/reset_prefix_cache``: fails while any request holds blocks."""
        if not self.pool.reset():
            return False
        if self.cpu is not None:
            self.cpu.clear()
        if self.storage is not None:
            self.storage.clear()
        self._writing.clear()
        self._in_flight.clear()
        self._promoting.clear()
        self._emit(encode_all_cleared())  # the cluster pool is not this engine's: it stays
        return True

    def take_events(self) -> list[dict[str, Any]]:
        if not self.events:
            return []
        out = list(self.events)
        self.events.clear()
        return out

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def next_ready(self) -> float | None:
        """When the earliest loading request becomes schedulable (None: none loading)."""
        t = [r.ready_at for r in self.waiting if r.status == LOADING]
        return min(t) if t else None

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

    def _allocate(self, req: Request, num_new: int) -> bool:
        need = -(-(req.num_computed + num_new) // self.block_size) - len(req.blocks)
        if need > 0:
            got = self.pool.allocate(need)
            if got is None:
                return False
            req.blocks.extend(got)
        self._cache_full_blocks(req, req.num_computed + num_new)
        return True

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

    def schedule(self, now: float) -> Step | None:
        """Plan one step at time ``now``; None when nothing can run now."""
        p = self.profile
        budget = p.max_num_batched_tokens
        running = self.running
        # vLLM applies long_prefill_token_threshold only when another request could starve
        thresh = p.long_prefill_token_threshold if len(running) + len(self.waiting) > 1 else 0
        max_len = p.max_model_len
        self.now = now
        cadence = p.prefill_interval_steps
        bounded = self.cadence
        pending_left: dict[str, int] | None = None
        if bounded is not None:
            # the engine plugin's bounded cadence decides (throttle_prefills = not admit)
            pending = self.pending_prefills()
            decoding = any(r.num_tokens - r.num_computed <= 1 for r in running)
            defer = not bounded.decide(now, pending, decoding).admit
            pending_left = {x.req_id: x.remaining_tokens for x in pending}
        else:
            # Prefill cadence (vLLM's throttle_prefills): on a step off the cadence, defer all
            # prefill compute, unless the last admitting step could not drain the waiting
            # queue (the capacity guard) or no running request could decode instead.
            defer = (
                cadence > 1
                and self.step_count % cadence != 0
                and not self.prefill_capacity_bound
                and any(r.num_computed >= r.num_tokens - 1 for r in running)
            )
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = req.num_tokens - req.num_computed
            if defer and n > 1:
                i += 1  # an in-progress prefill chunk waits for a cadence step
                continue
            if 0 < thresh < n:
                n = thresh
            n = min(n, budget, max_len - 1 - req.num_computed)
            if n <= 0:
                i += 1
                continue
            while not self._allocate(req, n):
                vi = self._victim(running)
                victim = running.pop(vi)
                if vi < i:  # priority policy: a request already scheduled this step
                    i -= 1
                    k = next(k for k, (r, _) in enumerate(scheduled) if r is victim)
                    budget += scheduled.pop(k)[1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n
                i += 1
                continue
            break  # req preempted itself
        if not preempted:
            skipped: list[Request] = []
            while self.waiting and budget > 0 and len(running) < p.max_num_seqs:
                req = self.waiting[0]
                if req.status == LOADING:
                    if req.ready_at > now:
                        skipped.append(self.waiting.popleft())
                        continue
                    self._finish_load(req)
                if not req.blocks:
                    got = self._admit(req, now, budget, thresh, defer)
                    if got is None:
                        if self._stranding(req, defer):
                            skipped.append(self.waiting.popleft())
                            continue
                        break
                    if got == 0:  # loading from a lower tier
                        skipped.append(self.waiting.popleft())
                        continue
                    n = got
                else:  # loaded from a lower tier: blocks and computed tokens in place
                    n = req.num_tokens - req.num_computed
                    if defer and n > 1:
                        break
                    if 0 < thresh < n:
                        n = thresh
                    n = min(n, budget)
                    if not self._allocate(req, n):
                        if self._stranding(req, defer):
                            skipped.append(self.waiting.popleft())
                            continue
                        break
                self.waiting.popleft()
                req.status = RUNNING
                if req.queued_time is None:
                    req.queued_time = now
                running.append(req)
                scheduled.append((req, n))
                budget -= n
            self.waiting.extendleft(reversed(skipped))
            if not defer:
                self.prefill_capacity_bound = len(self.waiting) > len(skipped)
        if bounded is not None:
            assert pending_left is not None
            bounded.observe(sum(min(n, pending_left[r.id]) for r, n in scheduled
                                if r.id in pending_left))  # fmt: skip
        if not scheduled:
            if self._in_flight or self._writing:  # vLLM steps on to finish its transfers
                self._settle()
                self._in_flight, self._writing = self._writing, []
            if preempted:
                # the only running request preempted itself (it was short of a block, held
                # by a parked load): vLLM's engine core schedules again at once, and that
                # step admits from the waiting queue, which this one skipped. Without this
                # the twin slept until the next arrival, and forever if none came. Once:
                # nothing runs now, so nothing more can be preempted.
                assert not running
                return self.schedule(now)
            return None
        if self.cpu is not None or self.storage is not None:
            # the connector's store pass (build_connector_meta): the prompt blocks this step
            # completes are offered to the lower tiers (offload_prompt_only)
            bs = self.block_size
            for req, n in scheduled:
                horizon = min(req.num_computed + n, req.prompt_len) // bs
                if horizon > req.host_next:
                    self._keys_upto(req, horizon)
                    self._store_lower(req, horizon, now)
        pf_att = pf_kv = dc_kv = 0.0
        pf = dc = 0
        for req, n in scheduled:
            ctx = req.num_computed
            if n == 1:
                dc_kv += ctx
                dc += 1
            else:
                pf_att += attended_pairs(n, ctx)
                pf_kv += ctx
                pf += n
        dur = self.timing.step(pf, pf_att, pf_kv, dc, dc_kv) + self._write_back(now)
        self.step_count += 1
        return Step(scheduled, dur, now, pf, dc, preempted)

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

    def complete(self, step: Step, end: float) -> StepResult:
        """Apply a step's computation at time ``end``: tokens, first tokens, finishes."""
        self.busy_time += step.duration
        if self._in_flight:
            self._settle()  # the previous step's stores, written during this one
        self._in_flight, self._writing = self._writing, []
        got: list[Request] = []
        first: list[Request] = []
        done: list[Request] = []
        for req, n in step.scheduled:
            if req.status != RUNNING:
                continue  # aborted during the step
            req.num_computed += n
            if req.num_computed < req.num_tokens:
                continue  # a partial prefill chunk
            if req.num_output == 0:
                self.prompt_tokens_total += req.prompt_len
            tok = self.output_token(req, req.num_output)
            req.num_output += 1
            if req.token_ids is not None:
                req.output_ids.append(tok)
            self.generation_tokens_total += 1
            got.append(req)
            if req.first_token_time is None:
                req.first_token_time = end
                first.append(req)
            if req.num_output >= req.max_tokens or req.num_tokens >= self.profile.max_model_len:
                req.status = FINISHED
                req.finish_time = end
                done.append(req)
        if done:
            self.now = end
            ids = {id(r) for r in done}
            self.running = [r for r in self.running if id(r) not in ids]
            for req in done:
                if self.cpu is not None:
                    self._host_finish(req, end)
                self.pool.release(req.blocks)
                req.blocks = []
                self.requests.pop(req.id, None)
        if self._in_flight and not self.has_work:
            self._settle()  # the flush step vLLM runs while transfers are pending
        return StepResult(got, done, first)

    def _host_finish(self, req: Request, now: float) -> None:
        """The connector's ``on_request_finished``: the host chunks the request offered or
        loaded become the most recently used, then its hint applies (engine plugin)."""
        assert self.cpu is not None
        if req.host_lo >= 0:
            self.cpu.finish(req.block_keys[req.host_lo : req.host_next], req.hint, now)

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

    # ---- views -------------------------------------------------------------------------

    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_usage(self) -> float:
        return self.pool.usage()


def _default_output_token(req: Request, i: int) -> int:
    """A deterministic stand-in for sampling (the twin has no model)."""
    return (zlib.crc32(f"{req.id}/{i}".encode()) & 0x7FFFFFFF) % 1000 + 100
