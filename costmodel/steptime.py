"""Engine step time from a replica profile: prefill, decode, mixed steps and tier loads.

Owns: the first-principles time model every other cost builds on (all results in seconds).
Pure arithmetic on :mod:`costmodel.profiles`; must not import sockets, HTTP, redis, the
router or loadtest.

The model (a roofline per engine step; derivation and numbers in ``docs/twin.md``):

* compute  = (2·params·T + 4·layers·heads·head_dim·Σ attended context) / (flops·prefill_mfu),
  where T is every token the step processes (prefill chunk tokens + one per decoding request)
  and a prefill chunk of n new tokens after c cached ones attends n·(c + (n+1)/2) positions;
* memory   = (weight_bytes + KV bytes read) / (hbm_bw·hbm_efficiency), KV bytes read =
  kv_bytes_per_token · (every decoding request's context + every prefill chunk's context);
* comm     = 2·layers·(allreduce_latency + 2·(tp−1)/tp · T·hidden·2 B / interconnect_bw)
  for a tensor-parallel replica (two all-reduces of bf16 activations per layer), else 0;
* step     = step_overhead_s + comm + max(compute, memory).

A replica of ``tensor_parallel_size`` tp GPUs has tp× the FLOP/s and HBM bandwidth (weights and
KV heads are split across them), and loads from lower tiers over tp host links at once.

Decode-only steps are memory-bound (weights + KV reads), large prefill chunks compute-bound.
Loads from a lower tier cost ``latency + n_blocks·kv_bytes_per_block / bandwidth``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from costmodel.profiles import TIERS, ProfileError, ReplicaProfile


@dataclass(frozen=True, slots=True)
class StepCoefficients:
    """The profile reduced to the handful of floats the hot loops need."""

    overhead_s: float
    s_per_flop: float  # 1 / (flops · mfu)
    s_per_byte: float  # 1 / (hbm_bw · efficiency)
    linear_flops_per_token: float  # 2 · params
    attn_flops_per_pair: float  # 4 · layers · heads · head_dim
    weight_bytes: float
    kv_bytes_per_token: float
    comm_s: float = 0.0  # all-reduce latency per step (tensor parallelism)
    comm_s_per_token: float = 0.0  # all-reduce transfer per token processed

    def step(self, tokens: float, attended: float, kv_read_tokens: float) -> float:
        """Seconds for one step that processes ``tokens`` tokens attending ``attended``
        (token, context-position) pairs and reading ``kv_read_tokens`` tokens of KV."""
        compute = (self.linear_flops_per_token * tokens + self.attn_flops_per_pair * attended) * (
            self.s_per_flop
        )
        memory = (self.weight_bytes + self.kv_bytes_per_token * kv_read_tokens) * self.s_per_byte
        comm = self.comm_s + self.comm_s_per_token * tokens
        return self.overhead_s + comm + (compute if compute > memory else memory)


# coefficients() by profile identity: the cost model asks for them ~10^5 times a second under
# load, and hashing a frozen profile (three nested dataclasses) cost more than the formulas
_BY_ID: dict[int, tuple[ReplicaProfile, StepCoefficients]] = {}


def coefficients(profile: ReplicaProfile) -> StepCoefficients:
    """The profile's step-time coefficients (memoised)."""
    hit = _BY_ID.get(id(profile))
    if hit is not None and hit[0] is profile:
        return hit[1]
    c = _coefficients(profile)
    if len(_BY_ID) >= 64:
        _BY_ID.clear()
    _BY_ID[id(profile)] = (profile, c)  # holds the profile: its id is not reused meanwhile
    return c


@lru_cache(maxsize=64)
def _coefficients(profile: ReplicaProfile) -> StepCoefficients:
    hw, m = profile.hardware, profile.model
    tp = profile.tensor_parallel_size
    allreduces = 2 * m.layers if tp > 1 else 0  # after attention and after the MLP
    return StepCoefficients(
        overhead_s=hw.step_overhead_s,
        s_per_flop=1.0 / (hw.flops * profile.prefill_mfu * tp),
        s_per_byte=1.0 / (hw.hbm_bw * profile.hbm_efficiency * tp),
        linear_flops_per_token=m.linear_flops_per_token,
        attn_flops_per_pair=m.attn_flops_per_token_per_ctx,
        weight_bytes=m.weight_bytes,
        kv_bytes_per_token=m.kv_bytes_per_token,
        comm_s=allreduces * hw.allreduce_latency_s,
        comm_s_per_token=allreduces * 2.0 * (tp - 1) / tp * m.hidden * 2.0 / hw.interconnect_bw,
    )


def _check(n: float, what: str) -> None:
    if n < 0:
        raise ValueError(f"{what} must be >= 0, got {n}")


def attended_pairs(new_tokens: float, context_tokens: float) -> float:
    """(query token, key position) pairs of a causal chunk: n·(c + (n+1)/2)."""
    return new_tokens * (context_tokens + (new_tokens + 1) / 2.0)


def prefill_time(profile: ReplicaProfile, new_tokens: int, context_tokens: int = 0) -> float:
    """Compute time of prefilling ``new_tokens`` after ``context_tokens`` already in KV.

    ``(2·params·n + 4·layers·heads·head_dim·n·(c + (n+1)/2)) / (flops·mfu)``: no step
    overhead, no chunking (see :func:`request_prefill_time` for the wall time of a request).
    """
    _check(new_tokens, "new_tokens")
    _check(context_tokens, "context_tokens")
    c = coefficients(profile)
    flops = c.linear_flops_per_token * new_tokens + c.attn_flops_per_pair * attended_pairs(
        new_tokens, context_tokens
    )
    return flops * c.s_per_flop


def decode_step_time(profile: ReplicaProfile, batch_size: int, total_context_tokens: int) -> float:
    """One decode-only step of ``batch_size`` requests holding ``total_context_tokens``:
    overhead + max(weight reads + KV reads over HBM bandwidth, compute)."""
    _check(batch_size, "batch_size")
    _check(total_context_tokens, "total_context_tokens")
    if batch_size == 0:
        return 0.0
    return coefficients(profile).step(batch_size, total_context_tokens, total_context_tokens)


def step_time(
    profile: ReplicaProfile,
    prefill_chunks: Iterable[tuple[int, int]] = (),
    decode_contexts: Iterable[int] | int = (),
) -> float:
    """One mixed continuous-batching step.

    ``prefill_chunks``: ``(new_tokens, context_tokens)`` per prefilling request this step;
    ``decode_contexts``: the context length of each decoding request (or their sum). A step
    with no work takes 0 s.
    """
    c = coefficients(profile)
    tokens = 0.0
    attended = 0.0
    kv_read = 0.0
    for n, ctx in prefill_chunks:
        if n < 0 or ctx < 0:
            raise ValueError(f"prefill chunk must be (new >= 0, context >= 0), got {(n, ctx)}")
        tokens += n
        attended += attended_pairs(n, ctx)
        kv_read += ctx
    if isinstance(decode_contexts, int | float):
        _check(decode_contexts, "decode context")
        if decode_contexts:
            raise ValueError("pass decode contexts as a list (a bare sum loses the batch size)")
    else:
        for ctx in decode_contexts:
            if ctx < 0:
                raise ValueError(f"decode context must be >= 0, got {ctx}")
            tokens += 1
            attended += ctx
            kv_read += ctx
    if tokens == 0:
        return 0.0
    return c.step(tokens, attended, kv_read)


def load_time(profile: ReplicaProfile, n_blocks: int, tier: str) -> float:
    """Seconds to bring ``n_blocks`` KV blocks from ``tier`` into device memory (one load
    operation: ``latency + n_blocks·kv_bytes_per_block / bandwidth``; 0 for ``gpu``)."""
    _check(n_blocks, "n_blocks")
    if tier not in TIERS:
        raise ProfileError(f"unknown tier {tier!r}; known: {TIERS}")
    if tier == "gpu" or n_blocks == 0:
        return 0.0
    hw = profile.hardware
    # each GPU of a tensor-parallel replica loads its own KV heads over its own link
    nbytes = n_blocks * profile.kv_bytes_per_block / profile.tensor_parallel_size
    if tier == "cpu":
        return hw.host_latency_s + nbytes / hw.host_load_bw
    if tier == "pool":  # the cluster pool's link (shared volume / network store)
        return hw.pool_latency_s + nbytes / hw.pool_bw
    return hw.storage_latency_s + nbytes / hw.storage_bw


def prefill_chunk_tokens(profile: ReplicaProfile) -> int:
    """Prompt tokens one engine step prefills at most: ``max_num_batched_tokens``, or
    ``long_prefill_token_threshold`` when that is set and smaller."""
    chunk = profile.max_num_batched_tokens
    if 0 < profile.long_prefill_token_threshold < chunk:
        chunk = profile.long_prefill_token_threshold
    return chunk


_PREFILL: dict[tuple[int, int, int], tuple[ReplicaProfile, float]] = {}


def request_prefill_time(profile: ReplicaProfile, new_tokens: int, cached_tokens: int = 0) -> float:
    """Wall time of prefilling one request alone on an idle replica: chunks of
    :func:`prefill_chunk_tokens`, each a full engine step with its overhead and weight reads
    (:func:`prefill_stall_time` with no decoders). Memoised: the cost model prices every
    paced agent's next prefill on every decision, with the same few arguments."""
    key = (id(profile), new_tokens, cached_tokens)
    hit = _PREFILL.get(key)
    if hit is not None and hit[0] is profile:
        return hit[1]
    t = prefill_stall_time(profile, new_tokens, cached_tokens, 0, 0.0)
    if len(_PREFILL) >= 1 << 16:
        _PREFILL.clear()
    _PREFILL[key] = (profile, t)  # holds the profile: its id is not reused meanwhile
    return t


def prefill_stall_time(
    profile: ReplicaProfile,
    new_tokens: int,
    cached_tokens: int,
    decode_batch: int,
    decode_context_tokens: float,
) -> float:
    """What prefilling ``new_tokens`` (after ``cached_tokens``) adds to the steps of a
    replica that is decoding ``decode_batch`` requests holding ``decode_context_tokens``:
    chunked prefill runs the decoders in the same steps as the chunks, so each chunk costs them
    ``step(chunk + decodes) − step(decodes alone)``, summed over the chunks. With no
    decoders that is the prefill's own wall time (:func:`request_prefill_time`)."""
    _check(new_tokens, "new_tokens")
    _check(cached_tokens, "cached_tokens")
    _check(decode_batch, "decode_batch")
    _check(decode_context_tokens, "decode_context_tokens")
    # the decoders' tokens share the step's budget
    chunk = max(prefill_chunk_tokens(profile) - decode_batch, 1)
    c = coefficients(profile)
    d = float(decode_context_tokens)
    alone = c.step(decode_batch, d, d) if decode_batch else 0.0
    t, done = 0.0, 0
    while done < new_tokens:
        n = min(chunk, new_tokens - done)
        ctx = cached_tokens + done
        t += c.step(n + decode_batch, attended_pairs(n, ctx) + d, ctx + d) - alone
        done += n
    return t


def decode_time(
    profile: ReplicaProfile, output_tokens: int, context_tokens: int, batch: Sequence[int] = ()
) -> float:
    """Wall time of decoding ``output_tokens`` for one request whose context starts at
    ``context_tokens``, sharing each step with other requests of contexts ``batch`` (held
    fixed)."""
    _check(output_tokens, "output_tokens")
    c = coefficients(profile)
    others = float(sum(batch))
    b = len(batch) + 1
    t = 0.0
    for i in range(output_tokens):
        ctx = others + context_tokens + i
        t += c.step(b, ctx, ctx)
    return t
