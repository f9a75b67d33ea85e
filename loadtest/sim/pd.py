"""Prefill/decode disaggregation in the in-process simulator: prefill-only and decode-only
replicas, and a call split into two legs as ``kvroute serve`` splits it.

Owns: :class:`PDSimulator` (a :class:`loadtest.sim.simulator.Simulator` whose replicas carry
a role, ``prefill`` / ``decode`` / ``both``) and the two P/D routing functions it runs:
:class:`loadtest.sim.router_policy.PDRouterPolicy` (the router's own P/D path —
:func:`router.proxy_pd.forward_pd`'s steps) and :class:`RoundRobinPD`
(prefill and decode legs each round robin: the shape of vllm-router's P/D mode with its
``round_robin`` policy, a cache-blind baseline). Like :mod:`loadtest.sim.simulator`: no
sockets, no asyncio, no router imports.

The legs, as the HTTP twins run them (:mod:`loadtest.twin.http_request`'s ``_pd_params``):

1. A split call's **prefill leg** is a request of the call's prompt with one output token
   (``max_tokens: 1``, ``do_remote_decode``) on the prefill replica, which computes the
   prompt past its own prefix hit and keeps the blocks in its prefix cache.
2. When it finishes, the **decode leg** — the call's own request, its output length — reaches
   the decode replica ``request_overhead_s`` later (the API server's share, as for any
   request) carrying the prefill's parameters: the engine allocates the blocks it lacks past
   its own GPU hit *on arrival* (admission) and waits
   :func:`costmodel.disagg.kv_transfer_time` for them (latency + bytes / link bandwidth ×
   TP), then computes the prompt's last token and decodes
   (:meth:`loadtest.twin.engine_admission.EngineAdmission._admit`'s remote branch).
3. A call the router keeps colocated runs as one request on a decode-capable replica.

Records: one per call, on the replica that decoded it, its TTFT from the call's issue to the
decode leg's first token; ``cached_tokens`` is the prefix hit of the replica that computed
the prompt (the prefill replica for a split call: the decode leg's transferred blocks are not
a cache hit). The decode leg keeps the call's issue time as its arrival (the engines order
by it only under ``priority_scheduling``). The prefill replica holds no blocks for the
transfer after its leg ends (as the twins: vLLM holds them until the decode side reads them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from costmodel.profiles import ReplicaProfile
from loadtest.sim.simulator import _ENQUEUE, CallView, ReplicaView, Simulator
from loadtest.twin.engine import Request

ROLES = ("prefill", "decode", "both")


def pd_roles(spec: str) -> list[str]:
    """``"P:D"`` (e.g. ``"1:3"``) → P ``prefill`` roles then D ``decode`` roles."""
    p, sep, d = spec.partition(":")
    if not (sep and p.isdigit() and d.isdigit() and int(p) >= 1 and int(d) >= 1):
        raise ValueError(f"P/D split takes P:D with P, D >= 1 (e.g. 2:2), not {spec!r}")
    return ["prefill"] * int(p) + ["decode"] * int(d)


class RoundRobinPD:
    """Cache-blind P/D: every call split, prefill legs round robin over the prefill-capable
    replicas and decode legs round robin over the decode-capable ones (vllm-router's P/D
    mode with ``--policy round_robin``)."""

    def __init__(self, roles: Sequence[str]):
        self.pre = [i for i, r in enumerate(roles) if r != "decode"]
        self.dec = [i for i, r in enumerate(roles) if r != "prefill"]
        if not self.pre or not self.dec:
            raise ValueError("P/D needs a prefill-capable and a decode-capable replica")
        self.n = 0

    def route_pd(self, call: CallView, replicas: Sequence[ReplicaView]) -> tuple[int | None, int]:
        self.n += 1
        return self.pre[self.n % len(self.pre)], self.dec[self.n % len(self.dec)]

    def __call__(self, call: CallView, replicas: Sequence[ReplicaView]) -> int:
        return self.dec[0]  # unused: PDSimulator asks route_pd


class PDSimulator(Simulator):
    """A :class:`Simulator` whose replicas carry P/D ``roles`` (one per replica) and whose
    routing function answers ``route_pd(call, replicas) -> (prefill | None, decode)``; the
    legs as the module doc says. The function may also have ``on_leg(request_id, prefill,
    decode)``, called when a prefill leg ends."""

    def __init__(
        self, profile: ReplicaProfile, roles: Sequence[str], route: Any, **kw: Any
    ) -> None:
        if not hasattr(route, "route_pd"):
            raise ValueError("a P/D simulation needs a routing function with route_pd")
        super().__init__(profile, len(roles), route, **kw)
        self.route_pd = route.route_pd
        self.roles = list(roles)
        self._split: dict[str, tuple[int, int]] = {}  # request id -> (prefill, decode)
        self._legs: dict[str, int] = {}  # prefill legs in flight: id -> the call's max_tokens
        self.split_calls = 0
        self.colocated_calls = 0

    def _place(self, call: CallView) -> int:
        p, d = self.route_pd(call, self.views)
        rid = f"{call.session_id}/{call.call_index}"
        if p is None:
            if self.roles[d] == "prefill":
                raise RuntimeError(f"call {rid} placed colocated on prefill-only replica {d}")
            self.colocated_calls += 1
            return d
        if self.roles[p] == "decode" or self.roles[d] == "prefill":
            raise RuntimeError(f"call {rid}: prefill on {p} ({self.roles[p]}), decode on {d}")
        self.split_calls += 1
        self._split[rid] = (p, d)
        return p

    def _enqueue(self, i: int, req: Request, now: float) -> None:
        legs = self._split.get(req.id)
        if legs is not None and legs[0] == i and req.id not in self._legs:
            self._legs[req.id] = req.max_tokens  # the prefill leg: one output token
            req.max_tokens = 1
        super()._enqueue(i, req, now)

    def _leg_done(self, req: Request, now: float) -> bool:
        max_tokens = self._legs.pop(req.id, None)
        if max_tokens is None:
            return False
        p, d = self._split.pop(req.id)
        dreq = Request(req.id, req.prompt_len, max_tokens, block_keys=req.block_keys,
                       arrival=req.arrival, session_id=req.session_id, tag=d, hint=req.hint,
                       priority=req.priority)  # fmt: skip
        dreq.remote_tokens = req.prompt_len  # the params' remote_num_tokens: the whole prompt
        dreq.cached_tokens = req.cached_tokens or 0  # the prefill replica's hit is the call's
        on_leg = getattr(self.route, "on_leg", None)
        if on_leg is not None:
            on_leg(req.id, p, d)
        overhead = self.profile.request_overhead_s
        if overhead > 0:
            self._push(now + overhead, _ENQUEUE, (d, dreq))
        else:
            self._enqueue(d, dreq, now)
        return True

    def transfer_blocks(self) -> int:
        """Blocks the decode replicas received over the link so far."""
        return sum(r.engine.remote_blocks for r in self.replicas)
