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
  ``pool_bytes`` and every ``sweep_interval_s`` seconds (engine steps or not: the replicas'
  writes together can pass the bound unseen by each), a background thread scans the
  directory, deletes the least recently used files (modification time: a load touches the
  file) down to ``low_water`` of the bound, and the tier publishes ``BlockRemoved`` for them.
  Any replica may delete any file: a block is the same content whoever wrote it. Two
  replicas sweeping at once may delete a little more than needed; a file deleted between a
  lookup and its load fails that load, and the presets set vLLM's
  ``kv_load_failure_policy`` to ``recompute`` for it.

Agent hints, shared through the files themselves. A request's ``kvroute`` hint (the
``kv_transfer_params`` the host tier's retention reads: :mod:`engine_patches.retention_rule`)
says what its session does after the call. When a request of a ``tool-pause`` /
``waiting-on-children`` session ends, the pool files of the blocks it stored, loaded or touched
get a modification time in the future: the end of its hold, ``min(return_s * return_slack,
ttl_s)`` away. The evictor orders by modification time, so every replica's sweep sees the
hold without a coordination service: held files go after every file not held, earliest
expiry first, and a hold expires by itself. Held files never count for more than
``max_share`` of the bound; beyond it the holds that end first lose protection (they are
ordered as if used now). A later load of a held block ends its hold (the session is back),
as does a ``running`` or ``done`` hint. ``done`` is not demoted below other blocks as on the
host tier: pool blocks are shared across sessions (a system prompt), so the session's
release ends its hold and the blocks age as any other.

Not here yet: a pool that is not a filesystem.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from engine_patches.retention_rule import HOLDING, RetentionConfig, parse_hint

logger = logging.getLogger("vllm.kvroute.pool")

TIER_CLASS = "KVRoutePoolTier"
LOW_WATER = 0.9  # a sweep deletes down to this share of the bound
SWEEP_PASSES = 3  # scans a sweep makes at most (see _sweep)


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
    files: Iterable[tuple[str, float, int]],
    bound: int,
    low_water: float = LOW_WATER,
    now: float | None = None,
    max_held_share: float = 1.0,
) -> tuple[list[str], int]:
    """Which files a sweep deletes to bring ``files`` (``(path, mtime, size)``) from over
    ``bound`` bytes down to ``low_water * bound``, and the total left. Nothing while the total
    is within the bound.

    Order: least recently used first (modification time). A file whose time is past ``now`` is
    held (a paused session's, until that time): held files go after all others, the earliest
    hold first; held bytes beyond ``max_held_share * bound`` lose protection, the holds ending
    first, and are ordered as if used at ``now``."""
    files = list(files)
    total = sum(f[2] for f in files)
    if bound <= 0 or total <= bound:
        return [], total
    now = time.time() if now is None else now
    held = sorted((f for f in files if f[1] > now), key=lambda f: f[1], reverse=True)
    keep, room = set(), max_held_share * bound
    for f in held:  # the holds that end last keep their protection
        if f[2] > room:
            break
        keep.add(f[0])
        room -= f[2]

    def order(f: tuple[str, float, int]) -> float:
        if f[1] <= now:
            return f[1]
        return f[1] if f[0] in keep else now

    target = int(bound * low_water)
    out = []
    for path, _, size in sorted(files, key=order):
        if total <= target:
            break
        out.append(path)
        total -= size
    return out, total


class PoolEstimate:
    """One replica's running estimate of the pool's bytes: the last scan's total plus what this
    replica stored since that scan began. A store that completes while a sweep scans is not in
    the scan's total, so a sweep's end keeps it (``left + stored since the scan``); setting the
    estimate to the scan's total alone lost it, so the replica could believe the pool within
    its bound when it was not. Thread-safe: the engine adds, the sweep thread scans."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes = 0
        self._since_scan = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.bytes += n
            self._since_scan += n

    def scan_started(self) -> None:
        with self._lock:
            self._since_scan = 0

    def scanned(self, left: int) -> int:
        """A scan (begun at :meth:`scan_started`) left ``left`` bytes: the estimate is that plus
        what was stored meanwhile; returns the latter."""
        with self._lock:
            self.bytes = left + self._since_scan
            return self._since_scan


class _PoolRequest:
    """What the pool keeps of one request (in its ``ReqContext``): its hint and the blocks it
    stored, loaded or touched in the pool."""

    __slots__ = ("hint", "keys", "until")

    def __init__(self, hint: Any):
        self.hint = hint
        self.keys: dict[Any, None] = {}
        self.until: float | None = None  # set when the request ended with a hold


def hold_until(hint: Any, config: RetentionConfig, end: float) -> float | None:
    """When a hold on the blocks of a request ending at ``end`` with ``hint`` expires (the
    retention rule's length), or None when the hint holds nothing."""
    if hint is None or hint.state not in HOLDING:
        return None
    hold = config.ttl_s
    if hint.return_s is not None:
        hold = min(hint.return_s * config.return_slack, config.ttl_s)
    return end + max(hold, 0.0)


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
        retention: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("locality", "REMOTE")
        base.__init__(self, *args, **kwargs)
        # the base takes it (required) by keyword or as its second positional argument
        view = kwargs["primary_kv_view"] if "primary_kv_view" in kwargs else args[1]
        self.block_bytes = int(view.strides[0])  # one chunk of the host tier = one file
        self.pool_bytes = int(pool_bytes)
        self.sweep_interval_s = float(sweep_interval_s)
        self.low_water = float(low_water)
        # the directory this replica's files go to (rank 0: the mapper is parallel-agnostic)
        self.pool_root = os.path.dirname(self.file_mapper.get_config_file_path()) + "_r0"
        self.retention = RetentionConfig.from_dict(retention)
        self._lock = threading.Lock()
        self._removed = []  # list of OffloadKeys a sweep deleted, not yet published
        self._stores = {}  # store job -> list of its keys
        self._kvroute_pending_holds = {}  # key being written -> hold end (epoch s, a file mtime)
        self._sweeping = False
        self._last_sweep = 0.0
        self._ticker = None  # the periodic sweep's thread (started on the first step)
        self.estimate = PoolEstimate()  # the last scan's total + this replica's writes since
        self.evicted = 0  # files this replica's sweeps deleted (all time)
        if self.pool_bytes > 0:
            self._start_sweep()

    def _kvroute_note(self: Any, req_context: Any, keys: Iterable[Any]) -> None:
        st = req_context.get_state(_PoolRequest) if req_context is not None else None
        if st is not None:
            st.keys.update(dict.fromkeys(keys))

    def on_new_request(self: Any, req_context: Any) -> Any:
        ctx = base.on_new_request(self, req_context)
        hint = parse_hint(getattr(req_context, "kv_transfer_params", None))
        if hint is not None:
            req_context.set_state(_PoolRequest(hint))
        return ctx

    def touch(self: Any, keys: Any, req_context: Any) -> Any:
        keys = list(keys)
        self._kvroute_note(req_context, keys)
        return base.touch(self, keys, req_context)

    def on_request_finished(self: Any, req_context: Any) -> None:
        base.on_request_finished(self, req_context)
        st = req_context.get_state(_PoolRequest)
        if st is None or not st.keys:
            return
        now = time.time()
        until = st.until = hold_until(st.hint, self.retention, now)
        t = now if until is None else until  # running / done: the hold (if any) ends now
        for key in st.keys:
            try:
                os.utime(self.file_mapper.get_file_name(key), (t, t))
            except FileNotFoundError:
                if until is not None:  # still being written: held when the write completes
                    self._kvroute_pending_holds[key] = until
            except OSError:
                pass

    def submit_store(self: Any, job: Any) -> None:
        self._stores[job.job_id] = list(job.keys)
        self._kvroute_note(job.req_context, job.keys)
        st = job.req_context.get_state(_PoolRequest) if job.req_context is not None else None
        if st is not None and st.until is not None:  # a write after its request ended held
            for key in job.keys:
                self._kvroute_pending_holds[key] = st.until
        base.submit_store(self, job)

    def submit_load(self: Any, job: Any) -> None:
        # recency for the evictor: a loaded block is used again (the mtime orders eviction;
        # a held block's session is back, so its hold ends here)
        self._kvroute_note(job.req_context, job.keys)
        for key in job.keys:
            try:
                os.utime(self.file_mapper.get_file_name(key))
            except OSError:
                pass  # gone: the load fails and vLLM recomputes (kv_load_failure_policy)
        base.submit_load(self, job)

    def get_finished_jobs(self: Any) -> list[Any]:
        results = list(base.get_finished_jobs(self))
        holds = self._kvroute_pending_holds
        for r in results:
            keys = self._stores.pop(r.job_id, None)
            if keys and r.success:
                self.estimate.add(len(keys) * self.block_bytes)
                for key in keys:
                    until = holds.pop(key, None)
                    if until is not None:
                        try:
                            os.utime(self.file_mapper.get_file_name(key), (until, until))
                        except OSError:
                            pass
            elif keys:
                for key in keys:
                    holds.pop(key, None)
        if self.pool_bytes > 0:
            if self._ticker is None:  # here, not in __init__: only the engine steps the tier
                self._ticker = threading.Thread(
                    target=self._tick, name="kvroute-pool-ticker", daemon=True
                )
                self._ticker.start()
            if self.estimate.bytes > self.pool_bytes:
                self._start_sweep()
        return results

    def _tick(self: Any) -> None:
        """A sweep every ``sweep_interval_s``, whether or not the engine steps. Each replica's
        estimate counts only its own writes since its last scan, so replicas can together
        pass the bound while none of them sees it; a sweep on the engine's steps alone then
        left the pool over its bound for as long as the engines stayed idle (2 replicas:
        381 blocks against 256, for good)."""
        while True:
            time.sleep(self.sweep_interval_s)
            if time.monotonic() - self._last_sweep >= self.sweep_interval_s:
                self._start_sweep()

    def _start_sweep(self: Any) -> None:
        with self._lock:
            if self._sweeping:
                return
            self._sweeping = True
            self._last_sweep = time.monotonic()
        threading.Thread(target=self._sweep, name="kvroute-pool-sweep", daemon=True).start()

    def _sweep(self: Any) -> None:
        try:
            # again at once while stores that completed during a scan leave the pool over its
            # bound (bounded: held files can keep it over, and another pass would not help)
            for _ in range(SWEEP_PASSES):
                self.estimate.scan_started()
                files = pool_files(self.pool_root)
                doomed, left = plan_eviction(
                    files, self.pool_bytes, self.low_water, max_held_share=self.retention.max_share
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
                late = self.estimate.scanned(left)
                if gone:
                    logger.info(
                        "kvroute pool: evicted %d blocks, %d bytes left of %d",
                        len(gone), left, self.pool_bytes,
                    )  # fmt: skip
                if not late or self.estimate.bytes <= self.pool_bytes:
                    break
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
        "_kvroute_note": _kvroute_note,
        "on_new_request": on_new_request,
        "touch": touch,
        "on_request_finished": on_request_finished,
        "submit_store": submit_store,
        "submit_load": submit_load,
        "get_finished_jobs": get_finished_jobs,
        "_tick": _tick,
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
