"""Hardware, model and replica profiles: the numbers every time model starts from.

Owns: the frozen dataclasses :class:`HardwareProfile`, :class:`ModelProfile`,
:class:`ReplicaProfile`, the pure parser :func:`profile_from_dict` (dicts in, dataclasses out,
validated), and one small loader that reads the YAML data files shipped in
``costmodel/profiles/`` (``hardware.yaml`` plus one file per replica profile).

Units everywhere: bytes, bytes/s, FLOP/s, seconds, tokens, blocks. Pure: numpy/scipy at most;
must not import sockets, HTTP clients, redis, the router or loadtest. The first-principles
derivation of the GPU profiles is in ``docs/twin.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml

TIERS = ("gpu", "cpu", "storage", "pool")  # pool: the cluster KV pool (every replica reads)


class ProfileError(ValueError):
    """A profile that is missing, malformed or physically inconsistent."""


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """One accelerator (or the CPU bed), as one replica sees it."""

    name: str
    hbm_bytes: float  # device memory
    hbm_bw: float  # device memory bandwidth, B/s
    flops: float  # dense FLOP/s in the served model's compute dtype
    compute_dtype: str = "bf16"
    host_dram_bytes: float = 0.0  # host DRAM available to this replica for KV
    host_load_bw: float = 50e9  # host DRAM -> device, B/s
    host_latency_s: float = 50e-6  # per load operation
    storage_bytes: float = 0.0
    storage_bw: float = 5e9  # storage -> device, B/s
    storage_latency_s: float = 200e-6
    # the cluster KV pool (a tier every replica of a cluster reads: a shared volume, a
    # network store): pool -> host -> device per GPU, B/s, and per load operation
    pool_bw: float = 10e9
    pool_latency_s: float = 500e-6
    step_overhead_s: float = 4e-3  # fixed cost of one engine step
    interconnect_bw: float = 360e9  # GPU-GPU all-reduce bus bandwidth per GPU, B/s
    allreduce_latency_s: float = 8e-6  # one small all-reduce (tensor parallelism)
    # prefill -> decode KV transfer between replicas (P/D disaggregation, NIXL over RDMA:
    # 400 Gb/s per GPU, ~50 GB/s; costmodel.disagg): bandwidth B/s and per-transfer latency
    kv_transfer_bw: float = 50e9
    kv_transfer_latency_s: float = 2e-3
    description: str = ""


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """A dense (GQA) transformer, sized for time models."""

    name: str
    params: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    kv_dtype_bytes: float
    weight_bytes: float
    max_model_len: int
    compute_dtype: str = "fp8"

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V for every layer: ``2 * layers * kv_heads * head_dim * kv_dtype_bytes``."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def linear_flops_per_token(self) -> float:
        """Matrix multiplies per token: ``2 * params`` (a multiply-add is 2 FLOPs)."""
        return 2.0 * self.params

    @property
    def attn_flops_per_token_per_ctx(self) -> float:
        """Attention FLOPs one token spends per context token it attends to (QK^T and AV)."""
        return 4.0 * self.layers * self.heads * self.head_dim


@dataclass(frozen=True, slots=True)
class ReplicaProfile:
    """One vLLM replica: hardware, model and engine configuration.

    ``tensor_parallel_size`` GPUs of ``hardware`` serve the replica (weights, KV heads,
    FLOPs and HBM bandwidth split across them; :mod:`costmodel.steptime` adds the
    all-reduces). ``gpu_kv_blocks`` is derived from memory unless the profile gives it:
    ``tp * (hbm_bytes * gpu_memory_utilization - weight_bytes / tp - activation_reserve_bytes)
    // kv_bytes_per_block``. ``cpu_kv_blocks`` / ``storage_kv_blocks`` of 0 mean no such tier.
    ``prefill_interval_steps`` > 1 admits new prefills only every N engine steps (a local
    prefill cadence); 0 or 1 means every step (vLLM's default). ``request_overhead_s`` is the
    API server's fixed cost per request (before the engine sees it), part of every TTFT.
    ``host_write_back`` 1 fills the host tier when HBM evicts a block (write-back, as SGLang's
    HiCache ``write_back`` policy) instead of at compute (write-through, 0: what vLLM's
    ``OffloadingConnector`` does); the engine plugin's ``--host-tier-mode write-back``
    (``engine_patches.writeback``) is the real one, which copies a little ahead of eviction.
    ``output_median_tokens`` / ``output_sigma``: the log-normal length of a reply that ends by
    itself (a model's EOS), which the replica twin draws when a request neither gives its
    expected length nor sets ``ignore_eos`` (defaults: the AgentX-like synthetic traces'
    outputs, median 300; Claude Code's median output is ~216-444 tokens, DESIGN.md).
    """

    name: str
    hardware: HardwareProfile
    model: ModelProfile
    block_size: int
    gpu_kv_blocks: int
    tensor_parallel_size: int = 1
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0
    prefill_mfu: float = 0.45
    hbm_efficiency: float = 0.85
    cpu_kv_blocks: int = 0
    storage_kv_blocks: int = 0
    prefill_interval_steps: int = 0
    request_overhead_s: float = 0.0  # API server: parse, tokenize, detokenize (once per request)
    host_write_back: int = 0  # 1: the host tier takes HBM's evictions (write-back; see above)
    # 1: vLLM's --scheduling-policy priority (the twin's waiting queue by request priority,
    # then arrival; preemption of the largest); 0: FCFS
    priority_scheduling: int = 0
    output_median_tokens: float = 300.0  # replies that end by themselves (twin): median ...
    output_sigma: float = 0.8  # ... and log-normal sigma of their length
    # the cluster KV pool's capacity in blocks: ONE pool shared by every replica of a cluster
    # (the twins of one ``kvroute cluster``, the simulator's engines), below the host tier;
    # 0: no pool. Its link is the hardware's ``pool_bw`` / ``pool_latency_s``.
    pool_kv_blocks: int = 0
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes: float = 0.0
    description: str = ""
    source: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def gpus(self) -> int:
        """GPUs one replica occupies (its tensor-parallel size)."""
        return self.tensor_parallel_size

    @property
    def kv_bytes_per_token(self) -> float:
        return self.model.kv_bytes_per_token

    @property
    def kv_bytes_per_block(self) -> float:
        return self.model.kv_bytes_per_token * self.block_size

    @property
    def gpu_kv_tokens(self) -> int:
        return self.gpu_kv_blocks * self.block_size

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    def tier_blocks(self, tier: str) -> int:
        if tier == "gpu":
            return self.gpu_kv_blocks
        if tier == "cpu":
            return self.cpu_kv_blocks
        if tier == "storage":
            return self.storage_kv_blocks
        if tier == "pool":
            return self.pool_kv_blocks
        raise ProfileError(f"unknown tier {tier!r}; known: {TIERS}")

    def replace(self, **changes: Any) -> ReplicaProfile:
        """A copy with some fields changed (e.g. a smaller pool for a test)."""
        return dataclasses.replace(self, **changes)


# ---- parsing (pure) ------------------------------------------------------------------------


def _num(d: Mapping[str, Any], key: str, where: str, default: Any = ..., positive: bool = True):
    if key not in d or d[key] is None:
        if default is ...:
            raise ProfileError(f"{where}: missing {key!r}")
        return default
    v = d[key]
    try:
        x = float(v)  # YAML reads "70.6e9" as a string
    except (TypeError, ValueError) as e:
        raise ProfileError(f"{where}: {key!r} must be a number, got {v!r}") from e
    if x < 0 or (positive and x == 0):
        raise ProfileError(f"{where}: {key!r} must be {'> 0' if positive else '>= 0'}, got {v!r}")
    return x


def _int(d: Mapping[str, Any], key: str, where: str, default: Any = ..., positive: bool = True):
    x = _num(d, key, where, default, positive)
    if x is default:
        return x
    if x != int(x):
        raise ProfileError(f"{where}: {key!r} must be an integer, got {d[key]!r}")
    return int(x)


_HW_KEYS = {
    "description", "hbm_bytes", "hbm_bw", "flops", "host_dram_bytes", "host_load_bw",
    "host_latency_s", "storage_bytes", "storage_bw", "storage_latency_s", "step_overhead_s",
    "interconnect_bw", "allreduce_latency_s", "pool_bw", "pool_latency_s", "kv_transfer_bw",
    "kv_transfer_latency_s",
}  # fmt: skip
_MODEL_KEYS = {
    "name", "params", "layers", "hidden", "heads", "kv_heads", "head_dim", "kv_dtype_bytes",
    "weight_bytes", "max_model_len", "compute_dtype",
}  # fmt: skip
_REPLICA_KEYS = {
    "name", "description", "hardware", "model", "base", "block_size", "gpu_kv_blocks",
    "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "prefill_mfu",
    "hbm_efficiency", "cpu_kv_blocks", "storage_kv_blocks", "cpu_kv_bytes", "storage_kv_bytes",
    "prefill_interval_steps", "gpu_memory_utilization", "activation_reserve_bytes",
    "request_overhead_s", "tensor_parallel_size", "host_write_back", "output_median_tokens",
    "output_sigma", "pool_kv_blocks", "priority_scheduling",
}  # fmt: skip


def _unknown(d: Mapping[str, Any], known: set[str], where: str) -> None:
    extra = sorted(set(d) - known)
    if extra:
        raise ProfileError(f"{where}: unknown keys {extra}")


def hardware_from_dict(name: str, d: Mapping[str, Any], compute_dtype: str) -> HardwareProfile:
    where = f"hardware {name!r}"
    if not isinstance(d, Mapping):
        raise ProfileError(f"{where}: expected a mapping")
    _unknown(d, _HW_KEYS, where)
    flops_d = d.get("flops")
    if isinstance(flops_d, Mapping):
        if compute_dtype not in flops_d:
            raise ProfileError(
                f"{where}: no flops for compute dtype {compute_dtype!r} (has {sorted(flops_d)})"
            )
        flops = _num(flops_d, compute_dtype, where + ".flops")
    else:
        flops = _num(d, "flops", where)
    return HardwareProfile(
        name=name,
        hbm_bytes=_num(d, "hbm_bytes", where),
        hbm_bw=_num(d, "hbm_bw", where),
        flops=flops,
        compute_dtype=compute_dtype,
        host_dram_bytes=_num(d, "host_dram_bytes", where, 0.0, positive=False),
        host_load_bw=_num(d, "host_load_bw", where, 50e9),
        host_latency_s=_num(d, "host_latency_s", where, 50e-6, positive=False),
        storage_bytes=_num(d, "storage_bytes", where, 0.0, positive=False),
        storage_bw=_num(d, "storage_bw", where, 5e9),
        storage_latency_s=_num(d, "storage_latency_s", where, 200e-6, positive=False),
        pool_bw=_num(d, "pool_bw", where, 10e9),
        pool_latency_s=_num(d, "pool_latency_s", where, 500e-6, positive=False),
        step_overhead_s=_num(d, "step_overhead_s", where, 4e-3, positive=False),
        interconnect_bw=_num(d, "interconnect_bw", where, 360e9),
        allreduce_latency_s=_num(d, "allreduce_latency_s", where, 8e-6, positive=False),
        kv_transfer_bw=_num(d, "kv_transfer_bw", where, 50e9),
        kv_transfer_latency_s=_num(d, "kv_transfer_latency_s", where, 2e-3, positive=False),
        description=str(d.get("description", "")),
    )


def model_from_dict(d: Mapping[str, Any]) -> ModelProfile:
    where = f"model {d.get('name', '?')!r}" if isinstance(d, Mapping) else "model"
    if not isinstance(d, Mapping):
        raise ProfileError(f"{where}: expected a mapping")
    _unknown(d, _MODEL_KEYS, where)
    m = ModelProfile(
        name=str(d.get("name", "model")),
        params=_num(d, "params", where),
        layers=_int(d, "layers", where),
        hidden=_int(d, "hidden", where),
        heads=_int(d, "heads", where),
        kv_heads=_int(d, "kv_heads", where),
        head_dim=_int(d, "head_dim", where),
        kv_dtype_bytes=_num(d, "kv_dtype_bytes", where),
        weight_bytes=_num(d, "weight_bytes", where),
        max_model_len=_int(d, "max_model_len", where),
        compute_dtype=str(d.get("compute_dtype", "fp8")),
    )
    if m.heads % m.kv_heads:
        raise ProfileError(f"{where}: heads ({m.heads}) not a multiple of kv_heads ({m.kv_heads})")
    return m


def profile_from_dict(
    d: Mapping[str, Any], hardware: Mapping[str, Mapping[str, Any]]
) -> ReplicaProfile:
    """Build a :class:`ReplicaProfile` from a parsed profile file and the hardware table.

    ``d["hardware"]`` names an entry of ``hardware`` (or is an inline mapping). Pure: no I/O.
    Profiles with ``base`` must be merged by the caller first (see :func:`merge_base`).
    """
    if not isinstance(d, Mapping):
        raise ProfileError("profile: expected a mapping")
    name = str(d.get("name") or "")
    if not name:
        raise ProfileError("profile: missing 'name'")
    where = f"profile {name!r}"
    _unknown(d, _REPLICA_KEYS, where)
    if "model" not in d:
        raise ProfileError(f"{where}: missing 'model'")
    model = model_from_dict(d["model"])
    hw_ref = d.get("hardware")
    if isinstance(hw_ref, Mapping):
        hw = hardware_from_dict(f"{name}-hw", hw_ref, model.compute_dtype)
    elif isinstance(hw_ref, str):
        if hw_ref not in hardware:
            raise ProfileError(f"{where}: unknown hardware {hw_ref!r}; known: {sorted(hardware)}")
        hw = hardware_from_dict(hw_ref, hardware[hw_ref], model.compute_dtype)
    else:
        raise ProfileError(f"{where}: 'hardware' must name an entry or be a mapping")

    block_size = _int(d, "block_size", where)
    tp = _int(d, "tensor_parallel_size", where, 1)
    if model.kv_heads % tp:  # tp > kv_heads would replicate KV heads: not modelled
        raise ProfileError(
            f"{where}: tensor_parallel_size {tp} does not split {model.kv_heads} KV heads"
        )
    util = _num(d, "gpu_memory_utilization", where, 0.9)
    if util > 1:
        raise ProfileError(f"{where}: gpu_memory_utilization must be <= 1, got {util}")
    reserve = _num(d, "activation_reserve_bytes", where, 0.0, positive=False)
    kv_block = model.kv_bytes_per_token * block_size
    gpu_blocks = _int(d, "gpu_kv_blocks", where, None)
    if gpu_blocks is None:
        free = hw.hbm_bytes * util - model.weight_bytes / tp - reserve  # per GPU
        gpu_blocks = int(tp * free // kv_block)
        if gpu_blocks <= 0:
            raise ProfileError(
                f"{where}: no room for KV: {hw.hbm_bytes:.3g} B x {util} - weights "
                f"{model.weight_bytes:.3g} B / {tp} GPUs - reserve {reserve:.3g} B <= 0"
            )

    def tier(blocks_key: str, bytes_key: str, cap: float, cap_name: str) -> int:
        n = _int(d, blocks_key, where, None, positive=False)
        nbytes = _num(d, bytes_key, where, None, positive=False)
        if n is not None and nbytes is not None:
            raise ProfileError(f"{where}: give {blocks_key} or {bytes_key}, not both")
        if nbytes is not None:
            if nbytes > cap:
                raise ProfileError(
                    f"{where}: {bytes_key} {nbytes:.3g} exceeds {cap_name} x "
                    f"tensor_parallel_size {tp} = {cap:.3g}"
                )
            n = int(nbytes // kv_block)
        return int(n or 0)

    # host DRAM and NVMe are per-GPU shares of the node: a TP replica gets tp shares
    dram, nvme = tp * hw.host_dram_bytes, tp * hw.storage_bytes
    cpu_blocks = tier("cpu_kv_blocks", "cpu_kv_bytes", dram, "host_dram_bytes")
    sto_blocks = tier("storage_kv_blocks", "storage_kv_bytes", nvme, "storage_bytes")
    prof = ReplicaProfile(
        name=name,
        hardware=hw,
        model=model,
        block_size=block_size,
        gpu_kv_blocks=gpu_blocks,
        tensor_parallel_size=tp,
        max_num_seqs=_int(d, "max_num_seqs", where, 256),
        max_num_batched_tokens=_int(d, "max_num_batched_tokens", where, 8192),
        long_prefill_token_threshold=_int(d, "long_prefill_token_threshold", where, 0, False),
        prefill_mfu=_num(d, "prefill_mfu", where, 0.45),
        hbm_efficiency=_num(d, "hbm_efficiency", where, 0.85),
        cpu_kv_blocks=cpu_blocks,
        storage_kv_blocks=sto_blocks,
        prefill_interval_steps=_int(d, "prefill_interval_steps", where, 0, positive=False),
        request_overhead_s=_num(d, "request_overhead_s", where, 0.0, positive=False),
        host_write_back=_int(d, "host_write_back", where, 0, positive=False),
        priority_scheduling=_int(d, "priority_scheduling", where, 0, positive=False),
        output_median_tokens=_num(d, "output_median_tokens", where, 300.0),
        output_sigma=_num(d, "output_sigma", where, 0.8, positive=False),
        pool_kv_blocks=_int(d, "pool_kv_blocks", where, 0, positive=False),
        gpu_memory_utilization=util,
        activation_reserve_bytes=reserve,
        description=str(d.get("description", "")),
        source=dict(d),
    )
    if prof.prefill_mfu > 1 or prof.hbm_efficiency > 1:
        raise ProfileError(f"{where}: prefill_mfu and hbm_efficiency must be <= 1")
    _check_write_back(prof, where)
    return prof


def _check_write_back(prof: ReplicaProfile, where: str) -> None:
    if prof.host_write_back not in (0, 1):
        raise ProfileError(f"{where}: host_write_back must be 0 or 1")
    if prof.host_write_back and not prof.cpu_kv_blocks:
        raise ProfileError(f"{where}: host_write_back needs a host tier (cpu_kv_blocks > 0)")
    if prof.pool_kv_blocks and not prof.cpu_kv_blocks:
        raise ProfileError(f"{where}: pool_kv_blocks needs a host tier (cpu_kv_blocks > 0)")
    if prof.pool_kv_blocks and prof.host_write_back:
        raise ProfileError(f"{where}: the pool is written through: not with host_write_back")


def merge_base(d: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """``d`` over ``base`` (one level; ``model`` merges key by key). Pure."""
    out = {k: v for k, v in base.items() if k not in ("name", "description")}
    for k, v in d.items():
        if k == "base":
            continue
        if k == "model" and isinstance(v, Mapping) and isinstance(out.get("model"), Mapping):
            out["model"] = {**out["model"], **v}
        else:
            out[k] = v
    return out


# ---- the one loader (package data) ---------------------------------------------------------


def _data_dir() -> Path:
    # Next to this module (package data, see pyproject). Not importlib.resources.files():
    # an editable install can present ``costmodel`` as a namespace package, which it refuses.
    return Path(__file__).with_name("profiles")


def _read_yaml(name: str) -> Any:
    p = _data_dir().joinpath(name)
    if not p.is_file():
        raise ProfileError(f"no profile file {name!r}; known profiles: {list_profiles()}")
    try:
        return yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ProfileError(f"{name}: not valid YAML: {e}") from e


def list_profiles() -> list[str]:
    """Names of the shipped replica profiles."""
    return sorted(
        p.name[: -len(".yaml")]
        for p in _data_dir().iterdir()
        if p.name.endswith(".yaml") and p.name != "hardware.yaml"
    )


def _raw_profile(name: str, depth: int = 0) -> dict[str, Any]:
    if depth > 4:
        raise ProfileError(f"profile {name!r}: 'base' chain too deep")
    d = _read_yaml(f"{name}.yaml")
    if not isinstance(d, Mapping):
        raise ProfileError(f"profile {name!r}: file is not a mapping")
    if "base" in d:
        return merge_base(d, _raw_profile(str(d["base"]), depth + 1))
    return dict(d)


NO_PROFILE = "none"  # a router told no profile ...
GENERIC_PROFILE = "generic"  # ... prices with this stand-in and calibrates it online


def router_profile(name: str) -> ReplicaProfile:
    """The profile a router prices ``name``'s replicas with: :func:`load_profile`, except
    :data:`NO_PROFILE` (``none``: nothing is known), which is the :data:`GENERIC_PROFILE`
    stand-in that the router's online calibration corrects."""
    return load_profile(GENERIC_PROFILE if name == NO_PROFILE else name)


@cache
def load_profile(name: str) -> ReplicaProfile:
    """The shipped replica profile ``name`` (see :func:`list_profiles`)."""
    if name not in list_profiles():
        raise ProfileError(f"unknown profile {name!r}; known: {list_profiles()}")
    hardware = _read_yaml("hardware.yaml")
    return profile_from_dict(_raw_profile(name), hardware)


_OVERRIDABLE = {
    "block_size": int, "gpu_kv_blocks": int, "max_num_seqs": int,
    "max_num_batched_tokens": int, "long_prefill_token_threshold": int,
    "prefill_mfu": float, "hbm_efficiency": float, "cpu_kv_blocks": int,
    "storage_kv_blocks": int, "prefill_interval_steps": int, "request_overhead_s": float,
    "host_write_back": int, "output_median_tokens": float, "output_sigma": float,
    "pool_kv_blocks": int,
    "priority_scheduling": int,
}  # fmt: skip


def with_overrides(profile: ReplicaProfile, overrides: Mapping[str, Any]) -> ReplicaProfile:
    """``profile`` with engine settings changed (``{"prefill_interval_steps": 2}``), values
    checked like the YAML's. Pure. Hardware and model stay as loaded."""
    changes: dict[str, Any] = {}
    for key, raw in overrides.items():
        kind = _OVERRIDABLE.get(key)
        if kind is None:
            raise ProfileError(f"cannot override {key!r}; overridable: {sorted(_OVERRIDABLE)}")
        positive = key in (
            "block_size",
            "gpu_kv_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "prefill_mfu",
            "hbm_efficiency",
            "output_median_tokens",
        )
        v = (_int if kind is int else _num)(
            {key: raw}, key, f"override of {profile.name!r}", positive=positive
        )
        changes[key] = v
    out = dataclasses.replace(profile, **changes)
    if out.prefill_mfu > 1 or out.hbm_efficiency > 1:
        raise ProfileError("prefill_mfu and hbm_efficiency must be <= 1")
    if out.gpu_kv_blocks < 2:
        raise ProfileError("gpu_kv_blocks must be at least 2 (one is reserved)")
    _check_write_back(out, f"override of {profile.name!r}")
    return out


def parse_overrides(items: list[str] | None) -> dict[str, str]:
    """``["k=v", ...]`` (command-line ``--set``) to a mapping; a clear error otherwise."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ProfileError(f"--set expects KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out
