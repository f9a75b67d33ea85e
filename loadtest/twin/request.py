"""The twin engine's request and step records (:mod:`loadtest.twin.engine`).

Owns: :class:`Request` (one generation request as the engine sees it, with its state
machine's statuses), :class:`Step` (what one engine step computes) and :class:`StepResult`
(what a step produced). Plain data: no scheduling, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine_patches.retention_rule import Hint

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
