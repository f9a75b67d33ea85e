"""The read-only interface of the KV layer that scorers receive: :class:`KVView`.

Owns: what KV-aware policies may ask of the KV layer, and nothing else — prefix matches by
tier, replica profiles and calibration, GPU blocks in use, per-replica call statistics,
session footprints, whether a session is expected to call again, how long a host tier keeps
a chunk, and the cost model's inputs for a replica. A :class:`typing.Protocol`: the KV state
implements it (:class:`router.kv.snapshot.StateView`, made by
:meth:`router.kv.state.KVState.view`), a policy imports only this module, and a test or an
out-of-tree layer may hand ``snap.state("kv")`` anything that has these members. No method
mutates the layer; a view is consistent for one synchronous scheduling pass. Imports only
types (costmodel's, the index's, the session footprint's, the endpoint view): no state, no
aiohttp.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from costmodel.calibration import Calibration
from costmodel.placement import CallShape, ReplicaLoad, Reservation, WarmSession
from costmodel.profiles import ReplicaProfile
from router.kv.index import BlockIndexView, TierDepth
from router.kv.sessions import ReplicaStat, SessionFootprint
from router.replicas import EndpointView


@runtime_checkable
class KVView(Protocol):
    """What KV-aware scorers may read (see the module docstring). Attributes: ``index`` (the
    block index's read-only view), ``now`` (the layer's clock at the view), ``block_size``
    (the router's tokens per block) and ``expected_output_tokens`` (a call's output length
    before its session has shown one)."""

    index: BlockIndexView
    now: float
    block_size: int
    expected_output_tokens: int

    def source(self, replica: str) -> str:
        """``"events"`` when the index is fresh for ``replica``, else ``"approx"``."""
        ...

    def match(self, keys: list[int], replicas: list[str]) -> dict[str, TierDepth]:
        """Each replica's matched prefix of ``keys`` by tier (index, else approximate mode)."""
        ...

    def with_routed(
        self, keys: list[int], matches: dict[str, TierDepth], exclude: str | None = None
    ) -> dict[str, TierDepth]:
        """``matches`` deepened by the prompts this router has in flight to each replica."""
        ...

    def approx_match(self, keys: list[int], replicas: list[str]) -> dict[str, TierDepth]: ...

    def approx_blocks(self, replica: str) -> int: ...

    def profile(self, replica: str) -> ReplicaProfile: ...

    def calibration(self, replica: str) -> Calibration: ...

    def gpu_blocks_used(self, replica: str) -> int | None:
        """GPU blocks in use, in the replica profile's block size (None: unknown)."""
        ...

    def replica_stat(self, replica: str) -> ReplicaStat | None: ...

    def session(self, key: str) -> SessionFootprint | None: ...

    def estimate(self, ctx: Any) -> tuple[int, dict[str, TierDepth]]:
        """For a call placed before its analysis landed: its size and what is known to match."""
        ...

    def p_next_call(self, key: str) -> float:
        """P(the session calls again after the call being placed)."""
        ...

    def warm_and_reserved(
        self, replica: str, exclude: str | None, holds: bool = False
    ) -> tuple[Sequence[WarmSession], Sequence[Reservation]]:
        """Sessions whose KV sits on ``replica``, and paced agents that will come back to it."""
        ...

    def call_shape(self, replica: str, keys: list[int], n_tokens: int, match: TierDepth | None,
                   output_tokens: int, next_calls: float = 0.0) -> CallShape:  # fmt: skip
        """This call on ``replica``, in the profile's blocks, cut to its hit realization."""
        ...

    def host_residence(self, e: EndpointView) -> float | None:
        """Seconds a chunk stays in ``e``'s full host tier after its last use (None: n/a)."""
        ...

    def holds_honoured(self, e: EndpointView) -> bool: ...

    def replica_load(self, e: EndpointView, exclude: str | None, prior_tokens: int) -> ReplicaLoad:
        """The cost model's load inputs for one replica."""
        ...


__all__ = ["KVView"]
