"""The twins' truth: how long an engine step and a tier load really take, kept apart from the
router's model.

Owns: :class:`Truth` (a named set of physical figures), :data:`TRUTHS` (``nominal`` and the
perturbed truths), :class:`TruthTiming` (the step-time model a twin runs under a truth) and
:class:`CostmodelTiming` (``costmodel.steptime``'s formula, the one kv_cost prices with; what
the twin ran before issue 42, kept only to reproduce earlier figures), and
:func:`load_measured`: a truth fitted to a GPU's measured step times (``measured-h100``,
``TRUTHS_DIR/<name>.json``, written by ``make gpu-check``). Pure arithmetic on the profile's
hardware and model figures (reading a measured truth's file is its only I/O); must not
import the router, sockets or HTTP.

Why a separate model. kv_cost prices placements with :mod:`costmodel.steptime`; a twin timed
by the same formula, with the router told the same profile, behaves exactly as the router
predicts, which flatters any policy that reads that model. :class:`TruthTiming` is written
independently of that module (it imports nothing from it) and differs in structure, not only
in constants:

* **compute** splits the linear layers from prefill attention, each at its own efficiency
  (``prefill_mfu × gemm`` and ``prefill_mfu × attn``): costmodel charges both at one MFU, so
  under a truth long-context prefills are relatively slower than short ones;
* **compute and memory overlap imperfectly**: ``(c^p + m^p)^(1/p)`` (a smooth roofline,
  ``sharpness`` p) where costmodel takes ``max(c, m)``; near the ridge a step is slower than
  either bound;
* **prefill/decode interference**: in a step that mixes prefill chunks and decodes, a share
  ``interference`` of the decoders' KV-read time runs serially after the prefill's compute
  (mixed varlen attention kernels), where costmodel hides it under the roofline max;
* **per-sequence cost**: ``per_seq_s`` per request in the batch (sampling, logits, block
  tables), absent from costmodel;
* **tier loads** move one DMA per (block, layer, GPU), whose efficiency rises with its size:
  ``bw · s / (s + link_half_bytes)``; costmodel moves all bytes at the link's full figure.

Each truth's figures are drawn from the uncertainty of the profile's own estimates (the
ranges below, stated in docs/twin.md), as multipliers of the profile's figures, so they apply
to every profile (an H200 70B, the fitted CPU bed):

==========================  =========  =============  =========================================
figure                      profile    range assumed  why
==========================  =========  =============  =========================================
prefill MFU (GEMMs)         0.45       0.30 – 0.60    measured MFU of FP8 / BF16 dense prefill on
                                                      Hopper spreads this wide across kernels,
                                                      chunk sizes and vLLM versions
prefill attention eff.      (0.45)     0.25 – 0.55    FlashAttention-3 reaches ~0.5–0.75 of peak
                                                      alone; varlen + paged + causal in vLLM less
HBM efficiency              0.85       0.70 – 0.95    GEMV weight streaming and paged decode
                                                      attention reach 70–95% of the data sheet
step overhead               4 ms       1.5 – 8 ms     scheduler, sampling, launches; CUDA graphs
                                                      and async scheduling move it a lot
TP all-reduce bandwidth     360 GB/s   250 – 400      NVLink 4 custom/NCCL all-reduce, by size
host link, per GPU          50 GB/s    20 – 55 GB/s   PCIe 5 x16 pinned copies reach ~55; two GPUs
                                                      behind one switch, or scattered per-layer
                                                      block copies, half that
mixed-step interference     (0)        0.2 – 1.0      decode ITL rises 1.2–2× in mixed batches
                                                      (Sarathi-Serve, DistServe measurements)
==========================  =========  =============  =========================================

The ``nominal`` truth sits at the profile's central figures where the profile states one
(prefill ≈ the profile's MFU for an 8k chunk, HBM 0.85, the same step overhead and link) and
in the middle of the ranges for what the profile does not model. It is **not** costmodel's
formula: its step times differ from costmodel's by about −7% to +30% depending on the step's
shape (the most near the compute/memory ridge; tests/unit/test_twin_truth.py holds bounds on
TP4), which is the error a router told the nominal profile faces even when its profile is
"right".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol

from costmodel.profiles import TIERS, ProfileError, ReplicaProfile


class StepTiming(Protocol):
    """What the engine asks of a timing model (seconds)."""

    name: str

    def step(
        self, pf_tokens: float, pf_attended: float, pf_kv: float, decodes: int, dc_kv: float
    ) -> float:
        """One engine step: ``pf_tokens`` prefill tokens attending ``pf_attended`` (token,
        position) pairs over ``pf_kv`` already-computed context tokens, and ``decodes``
        decoding requests holding ``dc_kv`` context tokens between them."""
        ...

    def decode_step(self, batch: int, context_tokens: float) -> float:
        """A decode-only step (the simulator's bursts)."""
        ...

    def load(self, n_blocks: int, tier: str) -> float:
        """Bringing ``n_blocks`` KV blocks from ``tier`` into device memory (or writing them
        back to the host tier: the same link). ``tier`` is one of ``costmodel``'s tiers or
        :data:`POOL` (the cluster pool, staged through the host like storage)."""
        ...


@dataclass(frozen=True, slots=True)
class Truth:
    """A named engine truth: multipliers of the profile's figures and the shape of the terms
    the profile does not model. See the module docstring for the ranges they come from."""

    name: str
    summary: str
    gemm: float = 1.1  # linear-layer MFU = profile.prefill_mfu × gemm
    attn: float = 0.85  # prefill-attention MFU = profile.prefill_mfu × attn
    hbm: float = 1.0  # HBM efficiency = profile.hbm_efficiency × hbm
    sharpness: float = 4.0  # p of the smooth roofline (c^p + m^p)^(1/p); large p -> max(c, m)
    interference: float = 0.3  # share of the decoders' KV reads a mixed step adds serially
    overhead: float = 1.0  # step overhead = hardware.step_overhead_s × overhead
    per_seq_s: float = 10e-6  # per request in the batch (sampling, logits, block tables)
    allreduce: float = 1.0  # all-reduce latency = hardware.allreduce_latency_s × allreduce
    interconnect: float = 1.0  # all-reduce bus bandwidth = hardware.interconnect_bw × this
    link_bw: float = 1.0  # host link = hardware.host_load_bw × link_bw (before DMA efficiency)
    link_latency: float = 1.0  # host load latency = hardware.host_latency_s × link_latency
    link_half_bytes: float = 8e3  # DMA size (per block, layer, GPU) at half the link's rate

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and v < 0:
                raise ValueError(f"truth {self.name}: {f.name} must be >= 0")
        if min(self.gemm, self.attn, self.hbm, self.link_bw, self.interconnect) <= 0 or (
            self.sharpness < 1
        ):
            raise ValueError(f"truth {self.name}: efficiencies > 0 and sharpness >= 1")

    def as_dict(self) -> dict[str, float | str]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


TRUTHS: dict[str, Truth] = {
    t.name: t
    for t in (
        Truth(
            "nominal",
            "the profile's central figures, in the truth's own step model",
        ),
        Truth(
            "prefill-slow",
            "prefill 35% slower (GEMMs, attention and the TP all-reduces' bandwidth at 1/1.35 of "
            "nominal's) and stronger prefill/decode interference (a mixed step adds all of its "
            "decoders' KV reads)",
            gemm=1.1 / 1.35,
            attn=0.85 / 1.35,
            interconnect=1 / 1.35,
            interference=1.0,
        ),
        Truth(
            "decode-fast-slow-link",
            "decode faster (HBM at 0.95 of peak, step overhead 2 ms, all-reduce 5 us, "
            "per-sequence cost halved: 1.22-1.45x on the TP4 profile, 1.1-1.2x on one GPU, "
            "where weight reads dominate) with a host link half as fast and 4x its latency",
            hbm=0.95 / 0.85,
            overhead=0.5,
            allreduce=0.625,
            per_seq_s=5e-6,
            link_bw=0.5,
            link_latency=4.0,
        ),
    )
}
POOL = "pool"  # the cluster KV pool's tier name in load() (not a costmodel tier)
NOMINAL = "nominal"
COSTMODEL = "costmodel"  # costmodel.steptime's formula: the router's own model (not a truth)

# Measured truths: fitted to a real transformer's step times on a GPU by `make gpu-check`
# (loadtest/gpu_check, docs/gpu-check.md) and committed as TRUTHS_DIR/<name>.json (beside
# <name>.raw.json, the timings it was fitted to). Any name "measured-*" is looked up there;
# MEASURED is always offered, and says it has not been measured until its file exists.
TRUTHS_DIR = Path(__file__).with_name("truths")
MEASURED = "measured-h100"
MEASURED_PREFIX = "measured-"
MEASURED_FORMAT = 1


def _measured_on_disk() -> list[str]:
    return sorted(
        p.name.removesuffix(".json")
        for p in TRUTHS_DIR.glob(f"{MEASURED_PREFIX}*.json")
        if not p.name.endswith(".raw.json")
    )


TRUTH_NAMES = (*TRUTHS, *dict.fromkeys([MEASURED, *_measured_on_disk()]), COSTMODEL)


class NotMeasuredError(ValueError):
    """A measured truth whose file does not exist (yet)."""


def load_measured(name: str | Path) -> Truth:
    """The measured truth ``name`` (``TRUTHS_DIR/<name>.json``) or the file at a path ending
    in ``.json``. Raises :class:`NotMeasuredError` when the file is missing, ValueError when
    it is malformed."""
    path = Path(name) if str(name).endswith(".json") else TRUTHS_DIR / f"{name}.json"
    if not path.is_file():
        raise NotMeasuredError(
            f"truth {str(name)!r} has not been measured yet: {path} does not exist. Run "
            "`make gpu-check` on a GPU host, then `python -m loadtest.gpu_check install OUT_DIR` "
            "and commit the fitted truth with its raw timings (docs/gpu-check.md)"
        )
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"measured truth {path}: unreadable ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != MEASURED_FORMAT:
        raise ValueError(f"measured truth {path}: not a format-{MEASURED_FORMAT} truth file")
    figures = data.get("truth")
    numeric = {f.name for f in fields(Truth)} - {"name", "summary"}
    if not isinstance(figures, dict) or set(figures) != numeric:
        raise ValueError(f"measured truth {path}: 'truth' must give exactly {sorted(numeric)}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in figures.values()):
        raise ValueError(f"measured truth {path}: every figure must be a number")
    if data.get("name") != path.name.removesuffix(".json"):
        raise ValueError(f"measured truth {path}: its 'name' must be its file's name")
    return Truth(
        name=str(data["name"]),
        summary=str(data.get("summary", "")),
        **{k: float(v) for k, v in figures.items()},
    )


def check(name: str) -> None:
    """Raises ValueError (:class:`NotMeasuredError` for a measured truth with no file yet)
    unless ``name`` can be run."""
    if name.startswith(MEASURED_PREFIX):
        load_measured(name)
    elif name not in TRUTH_NAMES:
        raise ValueError(f"unknown truth {name!r}; known: {', '.join(TRUTH_NAMES)}")


class TruthTiming:
    """A profile's step and load times under a :class:`Truth` (see the module docstring)."""

    def __init__(self, profile: ReplicaProfile, truth: Truth):
        self.name = truth.name
        self.truth = truth
        hw, m, tp = profile.hardware, profile.model, profile.tensor_parallel_size
        flops = hw.flops * tp
        self._s_gemm = 1.0 / (flops * profile.prefill_mfu * truth.gemm)
        self._s_attn = 1.0 / (flops * profile.prefill_mfu * truth.attn)
        self._s_byte = 1.0 / (hw.hbm_bw * tp * profile.hbm_efficiency * truth.hbm)
        self._lin = 2.0 * m.params  # FLOPs per token in the linear layers
        self._pair = 4.0 * m.layers * m.heads * m.head_dim  # QK^T + AV per (token, position)
        self._weights = m.weight_bytes
        kv_token = 2.0 * m.layers * m.kv_heads * m.head_dim * m.kv_dtype_bytes
        self._kv = kv_token
        self._p = truth.sharpness
        self._mix = truth.interference
        self._fixed = hw.step_overhead_s * truth.overhead
        self._seq = truth.per_seq_s
        ar = 2 * m.layers if tp > 1 else 0  # after attention and after the MLP
        self._ar_fixed = ar * hw.allreduce_latency_s * truth.allreduce
        bus = hw.interconnect_bw * truth.interconnect
        self._ar_token = ar * 2.0 * (tp - 1) / tp * m.hidden * 2.0 / bus
        # tier loads: one DMA per (block, layer, GPU); its size sets the link's efficiency
        self._block_bytes = kv_token * profile.block_size / tp  # per GPU
        dma = self._block_bytes / m.layers
        eff = dma / (dma + truth.link_half_bytes)
        self._host = (hw.host_latency_s * truth.link_latency, hw.host_load_bw * truth.link_bw * eff)
        # storage goes through the host; its own device is the slower part, at the same DMA size
        self._storage = (hw.storage_latency_s, min(hw.storage_bw, self._host[1]))
        # the cluster pool: staged through the host as storage is, over its own link
        self._pool = (hw.pool_latency_s, min(hw.pool_bw, self._host[1]))

    def _roof(self, c: float, mem: float) -> float:
        p = self._p
        if c <= 0.0 or mem <= 0.0:
            return c + mem
        hi = c if c > mem else mem
        lo = mem if c > mem else c
        return hi * (1.0 + (lo / hi) ** p) ** (1.0 / p)

    def step(
        self, pf_tokens: float, pf_attended: float, pf_kv: float, decodes: int, dc_kv: float
    ) -> float:
        tokens = pf_tokens + decodes
        if tokens <= 0:
            return 0.0
        compute = self._lin * tokens * self._s_gemm + self._pair * pf_attended * self._s_attn
        # weights once, every context the step reads (decode attention is memory-bound)
        dc_read = self._kv * dc_kv * self._s_byte
        memory = (self._weights + self._kv * pf_kv) * self._s_byte + dc_read
        t = self._roof(compute, memory)
        if pf_tokens and decodes:
            t += self._mix * dc_read
        n_seq = decodes + (1 if pf_tokens else 0)
        return self._fixed + self._seq * n_seq + self._ar_fixed + self._ar_token * tokens + t

    def decode_step(self, batch: int, context_tokens: float) -> float:
        if batch <= 0:
            return 0.0
        return self.step(0.0, 0.0, 0.0, batch, context_tokens)

    def load(self, n_blocks: int, tier: str) -> float:
        if n_blocks < 0:
            raise ValueError(f"n_blocks must be >= 0, got {n_blocks}")
        if tier not in TIERS and tier != POOL:
            raise ProfileError(f"unknown tier {tier!r}; known: {(*TIERS, POOL)}")
        if tier == "gpu" or n_blocks == 0:
            return 0.0
        lat, bw = {"cpu": self._host, "storage": self._storage, POOL: self._pool}[tier]
        return lat + n_blocks * self._block_bytes / bw


class CostmodelTiming:
    """``costmodel.steptime``'s formula — the router's own model, what the twin ran before the
    truths (kept to reproduce earlier figures and for the engine's exactness tests; a bench
    under it scores a router on an engine that behaves as its model predicts)."""

    name = COSTMODEL

    def __init__(self, profile: ReplicaProfile):
        from costmodel.steptime import coefficients, load_time

        self._profile = profile
        self._c = coefficients(profile)
        self._load = load_time

    def step(
        self, pf_tokens: float, pf_attended: float, pf_kv: float, decodes: int, dc_kv: float
    ) -> float:
        return self._c.step(pf_tokens + decodes, pf_attended + dc_kv, pf_kv + dc_kv)

    def decode_step(self, batch: int, context_tokens: float) -> float:
        return self._c.step(batch, context_tokens, context_tokens)

    def load(self, n_blocks: int, tier: str) -> float:
        if tier == POOL:  # costmodel has no pool tier: its formula, on the pool's link
            if n_blocks < 0:
                raise ValueError(f"n_blocks must be >= 0, got {n_blocks}")
            if n_blocks == 0:
                return 0.0
            p = self._profile
            hw = p.hardware
            nbytes = n_blocks * p.kv_bytes_per_block / p.tensor_parallel_size
            return hw.pool_latency_s + nbytes / hw.pool_bw
        return self._load(self._profile, n_blocks, tier)


def timing(profile: ReplicaProfile, truth: str | Truth | None) -> StepTiming:
    """The timing model for ``truth`` (a name of :data:`TRUTH_NAMES`, a measured truth's name
    — see :func:`load_measured` — or a :class:`Truth`);
    None is :data:`COSTMODEL` (the engine's default in Python: its tests pin step times to
    ``costmodel.steptime``; the CLIs and the bench default to ``nominal``)."""
    if truth is None or truth == COSTMODEL:
        return CostmodelTiming(profile)
    if isinstance(truth, str) and truth.startswith(MEASURED_PREFIX):
        truth = load_measured(truth)
    if isinstance(truth, str):
        if truth not in TRUTHS:
            raise ValueError(f"unknown truth {truth!r}; known: {', '.join(TRUTH_NAMES)}")
        truth = TRUTHS[truth]
    return TruthTiming(profile, truth)


def describe(truth: str) -> dict[str, float | str]:
    """What a run records about its truth: its name and figures."""
    if truth == COSTMODEL:
        return {"name": COSTMODEL, "summary": "costmodel.steptime's formula (the router's model)"}
    if truth.startswith(MEASURED_PREFIX):
        return load_measured(truth).as_dict()
    return TRUTHS[truth].as_dict()
