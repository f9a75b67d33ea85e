"""What a routing function sees in the simulator, and the built-in routing functions.

Owns: :class:`CallView` (an arriving call), :class:`ReplicaView` (a replica's read-only view:
load, KV usage, the cached prefix of a call in each tier), :data:`RouteFn`, and the built-in
policies (:func:`route_round_robin`, :func:`route_fewest_requests`,
:func:`route_sticky_spill`, :func:`route_exact_cache`) by name in :data:`ROUTERS`. The
router's own call sequence and pipelines are :mod:`loadtest.sim.router_policy`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from costmodel.profiles import ReplicaProfile
from loadtest.sim.records import CallRecord
from loadtest.twin.engine import Engine

# ---- the replicas' read-only view for routing ----------------------------------------------


@dataclass(slots=True)
class CallView:
    """What a routing function sees of an arriving call."""

    session_id: str
    call_index: int
    prompt_tokens: int
    block_keys: list[int]
    max_tokens: int
    now: float
    final: bool = False  # the session's (for a subagent: the agent's) last call
    agent_id: str | None = None  # a subagent's name (None: the session's main agent)
    parent_session: str | None = None  # a subagent call's root session id


class ReplicaView:
    """Read-only view of one simulated replica for routing functions."""

    __slots__ = ("_eng", "index")

    def __init__(self, index: int, engine: Engine):
        self.index = index
        self._eng = engine

    @property
    def num_running(self) -> int:
        return len(self._eng.running)

    @property
    def num_waiting(self) -> int:
        return len(self._eng.waiting)

    @property
    def kv_usage(self) -> float:
        return self._eng.kv_usage()

    @property
    def host_retained(self) -> float | None:
        """Share of the host tier held for paused sessions: the engine plugin's gauge
        (``vllm:kv_offload_cpu_retained_perc``); None without the plugin's retention."""
        cpu = self._eng.cpu
        return None if cpu is None else cpu.retained_share(self._eng.now)

    @property
    def pending_prefill_gauge(self) -> float | None:
        """The engine plugin's ``vllm:num_pending_prefill_tokens`` as a live router scrapes it:
        exported only where the cadence scheduler and a host tier are both on, as on real vLLM
        (:meth:`loadtest.twin.engine.Engine.pending_prefill_gauge`)."""
        g = self._eng.pending_prefill_gauge()
        return None if g is None else float(g)

    @property
    def profile(self) -> ReplicaProfile:
        return self._eng.profile

    def pending_prefill_tokens(self) -> int:
        e = self._eng
        return sum(r.num_tokens - r.num_computed for r in e.waiting) + sum(
            r.num_tokens - r.num_computed for r in e.running if r.num_output == 0
        )

    def cached_blocks(self, keys: Sequence[int]) -> tuple[int, int, int]:
        """(gpu, cpu, storage) blocks of the longest cached prefix of ``keys`` (the cluster
        pool's count as storage, as the router's index files them)."""
        e = self._eng
        gpu = len(e.pool.match(keys, len(keys)))
        cpu = sto = 0
        cpool = e.cluster_pool
        for k in keys[gpu:]:
            if e.cpu is not None and k in e.cpu:
                cpu += 1
            elif (e.storage is not None and k in e.storage) or (cpool is not None and k in cpool):
                sto += 1
            else:
                break
        return gpu, cpu, sto


RouteFn = Callable[[CallView, Sequence[ReplicaView]], int]


def route_round_robin() -> RouteFn:
    counter = iter(range(1 << 62))

    def route(call: CallView, replicas: Sequence[ReplicaView]) -> int:
        return next(counter) % len(replicas)

    return route


def route_fewest_requests() -> RouteFn:
    def route(call: CallView, replicas: Sequence[ReplicaView]) -> int:
        return min(replicas, key=lambda r: (r.num_running + r.num_waiting, r.kv_usage)).index

    return route


def route_sticky_spill(max_waiting: int = 4) -> RouteFn:
    """Keep a session on its replica unless that replica has a queue; new sessions go to
    the replica with the fewest requests. (Not the router's ``session_affinity``, which is
    bounded-load consistent hashing.)"""
    home: dict[str, int] = {}
    least = route_fewest_requests()

    def route(call: CallView, replicas: Sequence[ReplicaView]) -> int:
        r = home.get(call.session_id)
        if r is None or replicas[r].num_waiting > max_waiting:
            r = least(call, replicas)
            home[call.session_id] = r
        return r

    return route


def route_exact_cache(load_weight_s: float = 2.0) -> RouteFn:
    """Score = estimated uncached prefill tokens + queue, read from every engine's own cache
    (an oracle no router has; not sglang-router's ``cache_aware``). Cost
    O(replicas x prompt blocks): fine for tens of replicas, slow for sweeps of hundreds)."""

    def route(call: CallView, replicas: Sequence[ReplicaView]) -> int:
        best, best_cost = 0, float("inf")
        for r in replicas:
            g, c, s = r.cached_blocks(call.block_keys)
            bs = r.profile.block_size
            uncached = call.prompt_tokens - (g + 0.5 * c + 0.2 * s) * bs
            cost = uncached + r.pending_prefill_tokens() + load_weight_s * 1000 * r.num_waiting
            if cost < best_cost:
                best, best_cost = r.index, cost
        return best

    return route


# Simulator-only routing functions. Their names are not the router's policy names: the
# router's own pipelines run here through loadtest.sim.router_policy.RouterPolicy.
ROUTERS: dict[str, Callable[[], RouteFn]] = {
    "round_robin": route_round_robin,  # the same rule as the router's round_robin
    "fewest_requests": route_fewest_requests,
    "sticky_spill": route_sticky_spill,
    "exact_cache": route_exact_cache,
}


class SimObserver(Protocol):
    """Optional hooks of a routing function object (e.g. the router's pipeline adapter in
    :mod:`loadtest.sim.router_policy`): what a real router would hear back."""

    wants_events: bool

    def on_events(self, replica: int, events: list[dict[str, Any]], now: float) -> None:
        """KV events (vLLM wire form) a replica published at the end of a step."""

    def on_finish(self, record: CallRecord) -> None:
        """A call finished (its usage, TTFT and duration are in the record)."""

    # optional: ``on_first_token(request_id, now)`` — a call's first token (``"sid/index"``)
    # optional: ``kv_transfer_params(call) -> Mapping | None`` — the body field the router
    # would send with the call it just routed (its engine hints); the engines read the
    # ``kvroute`` hint from it as the HTTP twin and vLLM do.
