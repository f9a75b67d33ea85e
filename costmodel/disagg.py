"""Conditional prefill/decode disaggregation: whether one call is cheaper split or colocated.

Owns: :func:`kv_transfer_time` (moving a prompt's KV from the prefill replica to the decode
replica) and :func:`disagg_cost`, the per-call decision the router's disaggregated path takes
(Dynamo's *conditional disaggregation*: a short prompt, or one the decode replica mostly holds
already, is cheaper prefilled where it decodes). Pure: no I/O; must not import sockets, HTTP,
redis or the router.

Both ways are priced in seconds of the call's own time-to-first-token plus what it costs the
requests already decoding on the decode replica (``B`` of them, holding ``ctx`` tokens)::

    disaggregated = prefill_queue_s                         wait on the prefill replica
                  + prefill(prompt − prefill_cached)        on the prefill replica, alone
                  + transfer(prompt − decode_cached)        latency + bytes / link bandwidth
    colocated     = prefill(prompt − decode_cached)         the call's own prefill there
                  + B × stall(prompt − decode_cached)       chunked prefill shares the B
                                                            decoders' steps (each waits)

The transfer moves only the blocks the decode replica lacks (vLLM's NIXL connector pulls
``num_computed_tokens`` minus the decode side's own prefix hit). With tensor parallelism every
GPU moves its own KV heads over its own link, so the bytes divide by the TP size. The call is
disaggregated when that is cheaper and its uncached prompt is at least ``min_prompt_tokens``
(Dynamo's ``max_local_prefill_length``; 0: the cost alone decides).
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.profiles import ReplicaProfile
from costmodel.steptime import prefill_stall_time, request_prefill_time


@dataclass(frozen=True, slots=True)
class DisaggTerms:
    """The two prices of one call (seconds) and the verdict; ``reason`` says which rule won."""

    disaggregate: bool
    reason: str  # "cheaper_split" | "cheaper_colocated" | "short_prompt" | "decode_warm"
    disagg_s: float
    colocated_s: float
    transfer_s: float
    transfer_tokens: int
    interference_s: float  # the colocated prefill's cost to the decode replica's decoders

    def as_dict(self) -> dict[str, object]:
        return {
            "disaggregate": self.disaggregate,
            "reason": self.reason,
            "disagg_s": round(self.disagg_s, 6),
            "colocated_s": round(self.colocated_s, 6),
            "transfer_s": round(self.transfer_s, 6),
            "transfer_tokens": self.transfer_tokens,
            "interference_s": round(self.interference_s, 6),
        }


def kv_transfer_time(profile: ReplicaProfile, tokens: int) -> float:
    """Seconds to move ``tokens`` tokens of KV from a prefill replica to a decode replica:
    ``kv_transfer_latency_s + tokens × kv_bytes_per_token / (kv_transfer_bw × TP)``
    (0 for no tokens: nothing is sent)."""
    if tokens < 0:
        raise ValueError("tokens >= 0")
    if tokens == 0:
        return 0.0
    hw = profile.hardware
    nbytes = tokens * profile.kv_bytes_per_token
    return hw.kv_transfer_latency_s + nbytes / (hw.kv_transfer_bw * profile.tensor_parallel_size)


def disagg_cost(
    profile: ReplicaProfile,
    prompt_tokens: int,
    *,
    prefill_cached_tokens: int = 0,
    decode_cached_tokens: int = 0,
    decode_batch: int | None = 0,
    decode_context_tokens: float | None = 0.0,
    prefill_queue_s: float = 0.0,
    min_prompt_tokens: int = 0,
) -> DisaggTerms:
    """Price ``prompt_tokens`` split (prefill replica → transfer → decode replica) against
    colocated on the decode replica, and decide (see the module doc). Cached token counts are
    clamped to the prompt; an unknown decode batch (``None``) counts as no decoders there."""
    if prompt_tokens < 0 or prefill_queue_s < 0 or min_prompt_tokens < 0:
        raise ValueError("prompt_tokens, prefill_queue_s and min_prompt_tokens must be >= 0")
    p_cached = max(0, min(prefill_cached_tokens, prompt_tokens))
    d_cached = max(0, min(decode_cached_tokens, prompt_tokens))
    d_new = prompt_tokens - d_cached
    b = max(0, decode_batch or 0)
    ctx = max(0.0, float(decode_context_tokens or 0.0))
    transfer = kv_transfer_time(profile, d_new)
    split = (
        prefill_queue_s
        + request_prefill_time(profile, prompt_tokens - p_cached, p_cached)
        + transfer
    )
    own = request_prefill_time(profile, d_new, d_cached)
    harm = b * prefill_stall_time(profile, d_new, d_cached, b, ctx) if b and d_new else 0.0
    colocated = own + harm
    if d_new == 0:
        verdict, reason = False, "decode_warm"
    elif d_new < min_prompt_tokens:
        verdict, reason = False, "short_prompt"
    elif split < colocated:
        verdict, reason = True, "cheaper_split"
    else:
        verdict, reason = False, "cheaper_colocated"
    return DisaggTerms(verdict, reason, split, colocated, transfer, d_new, harm)
