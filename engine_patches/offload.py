"""Host-DRAM and disk KV tiers that work on vLLM's CPU platform.

Owns: two out-of-tree offloading specs for vLLM's ``OffloadingConnector`` and the one piece
the CPU platform lacks, the copy between the engine's KV cache and host memory
(:class:`HostCopyWorker`). Everything else is vLLM's: the scheduler-side managers and their
eviction policies (``lru``, ``arc``, or an out-of-tree ``cache_policy_module_path``), the
tiering manager and its filesystem tier, the KV events (``medium`` CPU / STORAGE) and the
offload metrics.

* ``KVRouteOffloadingSpec`` = vLLM's ``CPUOffloadingSpec`` (host tier only).
* ``KVRouteTieringSpec`` = vLLM's ``TieringOffloadingSpec`` (host tier as the primary, plus
  ``secondary_tiers``, e.g. ``{"type": "fs", "root_dir": DIR}``). The primary tier lives in
  vLLM's shared ``/dev/shm`` region, so the scheduler-side filesystem tier reads what the
  worker copied.

Both refuse the CPU platform in vLLM (``get_worker`` raises "CPU Offloading is currently only
supported on CUDA-alike and XPU GPUs": the worker's copy path is CUDA streams and a
``swap_blocks`` kernel). Here the worker copies rows of the engine's KV tensors with torch
indexing, synchronously, at the point vLLM submits the transfer: stores are submitted at the
start of the step after the blocks were computed (their KV is written by then), loads before
the forward that needs them, so no stream ordering is needed. On CUDA/XPU these specs defer to
vLLM's own worker.

Use (``kvroute engine flags --host-tier-bytes N [--disk-tier-dir DIR]`` writes it)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KVRouteOffloadingSpec",
        "spec_module_path": "engine_patches.offload", "cpu_bytes_to_use": 268435456}}'

The classes are built on first attribute access, so this module imports without vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger("vllm.kvroute.offload")

SPEC_CLASSES = ("KVRouteOffloadingSpec", "KVRouteTieringSpec")


def host_rows(
    host_chunks: Sequence[int], block_index: int, count: int, blocks_per_chunk: int
) -> tuple[list[int], list[int]]:
    """(chunk, sub-block) in host memory of ``count`` consecutive blocks that start at logical
    block ``block_index`` of a request, given the host chunks that cover them (the first chunk
    may start before ``block_index``: vLLM aligns chunks to ``blocks_per_chunk``)."""
    skip = block_index % blocks_per_chunk
    chunks, subs = [], []
    for j in range(count):
        off = skip + j
        chunks.append(int(host_chunks[off // blocks_per_chunk]))
        subs.append(off % blocks_per_chunk)
    return chunks, subs


class HostCopyWorker:
    """``OffloadingWorker`` for engines whose KV cache is in host memory already (the CPU
    platform): a store/load is a row copy between two host tensors.

    ``kv_caches`` is vLLM's ``CanonicalKVCaches`` (tensors of shape (num_blocks, page) int8);
    the host tier keeps, per tensor, ``num_chunks`` rows of ``page * blocks_per_chunk`` bytes
    — either its own tensor or a view of vLLM's shared region (tiering).
    """

    def __init__(
        self,
        kv_caches: Any,
        blocks_per_chunk: int,
        num_chunks: int,
        mmap_region: Any = None,
    ):
        import torch

        self._bpc = blocks_per_chunk
        self._region = mmap_region
        self._engine: list[Any] = []
        self._host: list[Any] = []  # (num_chunks, blocks_per_chunk, page) views
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            eng = t.tensor.view(torch.int8).view(-1, page)
            if mmap_region is not None:
                host = mmap_region.create_next_worker_view(page * blocks_per_chunk)
            else:
                host = torch.zeros((num_chunks, page * blocks_per_chunk), dtype=torch.int8)
            self._engine.append(eng)
            self._host.append(host.view(num_chunks, blocks_per_chunk, page))
        self._tensors_of_group = [
            sorted({ref.tensor_idx for ref in refs}) for refs in kv_caches.group_data_refs
        ]
        self._done: list[Any] = []
        logger.info(
            "kvroute host tier worker: %d tensor(s), %d chunks of %d block(s)%s",
            len(self._host),
            num_chunks,
            blocks_per_chunk,
            " in vLLM's shared region" if mmap_region is not None else "",
        )

    def _copy(self, job_id: int, engine_spec: Any, host_spec: Any, to_host: bool) -> bool:
        import torch
        from vllm.v1.kv_offload.base import TransferResult

        t0 = time.perf_counter()
        eng_ids = engine_spec.block_ids
        host_ids = host_spec.block_ids
        e_off = h_off = 0
        nbytes = 0
        for g, (size, bidx) in enumerate(
            zip(engine_spec.group_sizes, engine_spec.block_indices, strict=True)
        ):
            if size == 0:
                continue
            skip = bidx % self._bpc
            n_chunks = -(-(size + skip) // self._bpc)
            chunks, subs = host_rows(host_ids[h_off : h_off + n_chunks], bidx, size, self._bpc)
            rows = torch.as_tensor(eng_ids[e_off : e_off + size], dtype=torch.long)
            ci = torch.as_tensor(chunks, dtype=torch.long)
            si = torch.as_tensor(subs, dtype=torch.long)
            for t in self._tensors_of_group[g]:
                eng, host = self._engine[t], self._host[t]
                if to_host:
                    host[ci, si] = eng[rows]
                else:
                    eng[rows] = host[ci, si]
                nbytes += size * eng.shape[1]
            e_off += size
            h_off += n_chunks
        self._done.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, dst_spec, src_spec, to_host=False)

    def get_finished(self) -> list[Any]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every transfer completes inside submit_*

    def shutdown(self) -> None:
        if self._region is not None:
            self._host.clear()
            self._region.cleanup()
            self._region = None


# Router-facing signals, next to vLLM's own kv_offload_* series on /metrics.
HOST_OCCUPANCY = "vllm:kv_offload_cpu_cache_occupancy_perc"
HOST_RETAINED = "vllm:kv_offload_cpu_retained_perc"
# the cadence scheduler's pending prefill work (engine_patches.scheduler), which vLLM's
# SchedulerStats has no field for; shipped with the host tier's stats (the same EngineCore
# process), so it is on /metrics when both the cadence and a host tier are on
PENDING_PREFILL = "vllm:num_pending_prefill_tokens"


def _host_tier_manager(manager: Any) -> Any:
    """vLLM's CPU manager: the manager itself, or the tiering manager's primary tier."""
    if hasattr(manager, "_policy"):
        return manager
    return getattr(manager, "primary_tier", None)


def _add_signals(cpu: Any) -> None:
    """Add host-tier occupancy (and the retained share, and the cadence scheduler's pending
    prefill tokens) to the CPU manager's stats, which vLLM ships to the API server's /metrics
    with its own offload metrics."""
    from engine_patches.scheduler import pending_prefill_tokens

    inner = cpu.get_stats

    def get_stats() -> Any:
        stats = inner()
        pending = pending_prefill_tokens()
        if stats is not None and pending is not None:
            stats.set_gauge(PENDING_PREFILL, pending)
        n = getattr(cpu, "_num_chunks", 0)
        if stats is not None and n > 0:
            used = cpu._num_allocated_chunks - len(cpu._free_list)
            stats.set_gauge(HOST_OCCUPANCY, used / n)
            table = getattr(cpu._policy, "table", None)
            if table is not None:
                held = len(table.protected(time.monotonic()))
                stats.set_gauge(HOST_RETAINED, held / n)
        return stats

    cpu.get_stats = get_stats
    cpu._kvroute_signals = True


def _on_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return not (current_platform.is_cuda_alike() or current_platform.is_xpu())


def _build(name: str) -> type:
    from engine_patches import versions

    versions.check()
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    if name == "KVRouteOffloadingSpec":
        from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec as base

        def create_worker(self: Any, kv_caches: Any) -> Any:
            if not _on_cpu_platform():
                return base.create_worker(self, kv_caches)
            return HostCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)

    else:
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec as base

        def create_worker(self: Any, kv_caches: Any) -> Any:
            if not _on_cpu_platform():
                return base.create_worker(self, kv_caches)
            if self.config.canonical_layout:
                raise RuntimeError("kvroute host tier: canonical_layout is not supported on CPU")
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                return HostCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, region)
            except Exception:
                region.cleanup()
                raise

    def get_worker(self: Any, kv_caches: Any) -> Any:
        if not _on_cpu_platform():
            return base.get_worker(self, kv_caches)
        if not self._worker:
            self._worker = self.create_worker(kv_caches)
        return self._worker

    def get_manager(self: Any) -> Any:
        manager = base.get_manager(self)
        cpu = _host_tier_manager(manager)
        policy = getattr(cpu, "_policy", None)  # the host tier's CachePolicy
        if policy is not None and hasattr(policy, "configure"):
            from engine_patches.retention import RetentionConfig

            policy.configure(RetentionConfig.from_dict(self.extra_config.get("retention")))
        if cpu is not None and not getattr(cpu, "_kvroute_signals", False):
            _add_signals(cpu)
        return manager

    def build_metric_definitions(cls: Any, extra_config: dict[str, Any]) -> dict[str, Any]:
        from vllm.v1.kv_offload.base import OffloadingGaugeMetadata

        defs = base.build_metric_definitions.__func__(cls, extra_config)
        defs[HOST_OCCUPANCY] = OffloadingGaugeMetadata(
            documentation="Fraction of host-tier KV chunks holding data (kvroute engine plugin)."
        )
        defs[HOST_RETAINED] = OffloadingGaugeMetadata(
            documentation=(
                "Fraction of host-tier KV chunks held for paused agent sessions "
                "(kvroute retention policy)."
            )
        )
        defs[PENDING_PREFILL] = OffloadingGaugeMetadata(
            documentation=(
                "Prompt tokens still to prefill: running prefill chunks and waiting requests "
                "(kvroute cadence scheduler)."
            )
        )
        return defs

    ns = {
        "create_worker": create_worker,
        "get_worker": get_worker,
        "get_manager": get_manager,
        "build_metric_definitions": classmethod(build_metric_definitions),
        "__module__": __name__,
    }
    return type(name, (base,), ns)


_built: dict[str, type] = {}


def __getattr__(name: str) -> type:
    if name in SPEC_CLASSES:
        if name not in _built:
            _built[name] = _build(name)
        return _built[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
