"""kvroute's Triton kernels (``kernels/``) in place of vLLM functions: opt-in, GPU hosts only.

Owns: the ``KVROUTE_KERNELS`` setting (:func:`install_from_env`, called by the plugin's
``register()`` in every vLLM process), the patch targets (:data:`TARGETS`), one adapter per
target that keeps vLLM's signature and semantics, and :func:`install` / :func:`uninstall`.

``KVROUTE_KERNELS=dcp_lse_merge,merge_attn_states,fused_add_rmsnorm`` (or ``all``) replaces:

* ``dcp_lse_merge`` — ``vllm.v1.attention.ops.dcp.correct_attn_out`` (the AG+RS / AG+AR
  combine behind ``cp_lse_ag_out_rs`` / ``cp_lse_ag_out_ar``: out corrected *in place*,
  returns ``(out, lse)``) and ``dcp._dcp_a2a_unpack_combine`` (the merge after
  ``dcp_a2a_lse_reduce``'s all-to-all). Both are called through ``dcp``'s module globals,
  so every caller (FlashAttention, FlashInfer, MLA's ``MLADCPManager``) gets them, however
  it imported the outer functions. Base e or 2 as vLLM passes it (``is_lse_base_on_e``).
* ``merge_attn_states`` — ``vllm._custom_ops.merge_attn_states`` (what vLLM's
  ``merge_attn_states`` dispatcher calls on CUDA; writes ``output`` / ``output_lse`` in
  place, LSEs [H, T] base e, ``prefill_tokens_with_context`` honoured).
* ``fused_add_rmsnorm`` — the ``impl_fn`` of the ``vllm_c`` implementation of
  ``vllm.ir.ops.fused_add_rms_norm`` (what ``RMSNorm.forward_cuda`` reaches when vLLM's IR
  priority picks ``vllm_c``; in place: x <- normed, x_residual <- x + x_residual).

Each adapter hands anything its kernel does not cover (fp8 output, no weight, a variance
override, mismatched dtypes, more than :data:`RMSNORM_MAX_ROWS` rows...) to vLLM's original.
``rope_kv_write`` and ``split_kv_decode`` have no single vLLM function with their semantics
(they fuse several of vLLM's ops, or replace an attention backend): they are refused.

Refusals, each one log line under ``vllm.kvroute`` and nothing patched: a platform other
than CUDA (the CPU platform included) or no Triton; an unknown (or unpatchable) name; a
vLLM version not in :data:`PATCH_VERSIONS`; a target whose signature is not the one the
adapter was written for (that target only). Patching is idempotent (a patched function
carries ``__kvroute_original__``), and lazy: a target module not imported yet is patched
by an import hook right after vLLM imports it, so the API server never imports engine code.
Imports neither vLLM nor torch at module level.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import logging
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

logger = logging.getLogger("vllm.kvroute")

ENV = "KVROUTE_KERNELS"
ENV_IMPL = "KVROUTE_KERNELS_IMPL"  # auto (default) | triton | torch: the kernels' impl=
# vLLM versions whose target functions the adapters were written against (0.32.0: the CPU
# build installed here; 0.33.0: read from the wheel, the same source for every target).
PATCH_VERSIONS: tuple[str, ...] = ("0.32.0", "0.33.0")
# Rows up to which the fused RMSNorm kernel replaces vLLM's (decode batches; it is tuned
# for <= 64 rows, prefill-sized inputs stay on vLLM's kernel).
RMSNORM_MAX_ROWS = 64
UNPATCHABLE: dict[str, str] = {
    "rope_kv_write": "fuses vLLM's rotary_embedding and reshape_and_cache_flash, which vLLM "
    "calls separately (no single function to replace)",
    "split_kv_decode": "replaces an attention backend's decode path, not a function",
}
_FLOATS = ("float16", "bfloat16", "float32")

Adapter = Callable[[Callable[..., Any], str], Callable[..., Any]]


@dataclass(frozen=True)
class Target:
    """One vLLM function: ``module`` then the attribute path (``("f",)`` or ``("impl",
    "impl_fn")``), the parameter names vLLM's function has, and the adapter factory
    ``adapter(original, impl) -> replacement``."""

    setting: str
    module: str
    path: tuple[str, ...]
    params: tuple[str, ...]
    adapter: Adapter

    @property
    def name(self) -> str:
        return ".".join((self.module, *self.path))


class KernelSettingRefused(ValueError):
    pass


# Calls per "setting:kernel" (our kernel ran) and "setting:fallback" (vLLM's original ran):
# the checks read it to tell a patched path that really ran from one that fell back.
CALLS: Counter[str] = Counter()


# --- adapters ---------------------------------------------------------------------------


def _kernels() -> Any:
    import kernels

    return kernels


def _mark(fn: Callable[..., Any], original: Callable[..., Any], setting: str) -> Any:
    fn.__kvroute_original__ = original  # type: ignore[attr-defined]
    fn.__kvroute_setting__ = setting  # type: ignore[attr-defined]
    fn.__wrapped__ = original  # type: ignore[attr-defined]
    return fn


def correct_attn_out_adapter(original: Callable[..., Any], impl: str) -> Callable[..., Any]:
    """vLLM's ``correct_attn_out(out, lses, cp_rank, ctx, is_lse_base_on_e=True)``."""

    def correct_attn_out(
        out: Any, lses: Any, cp_rank: int, ctx: Any, is_lse_base_on_e: bool = True
    ) -> tuple[Any, Any]:
        import torch

        o = out.squeeze(1) if out.ndim == 4 and out.shape[1] == 1 else out
        ls = lses
        if ls.ndim == 4 and ls.shape[-1] == 1:
            ls = ls.squeeze(-1)
        if ls.ndim == 4 and ls.shape[1] == 1:
            ls = ls.squeeze(1)
        if (
            o.ndim != 3
            or ls.ndim != 3
            or ls.shape[1:] != o.shape[:2]
            or ls.dtype != torch.float32
            or str(o.dtype).removeprefix("torch.") not in _FLOATS
        ):
            CALLS["dcp_lse_merge:fallback"] += 1
            return original(out, lses, cp_rank, ctx, is_lse_base_on_e)
        CALLS["dcp_lse_merge:kernel"] += 1
        base = "e" if is_lse_base_on_e else "2"
        part, glse = _kernels().lse_correct(o, ls, cp_rank, base=base, impl=impl)
        o.copy_(part)  # vLLM corrects the output in place and returns that (3-D) view
        return o, glse

    return _mark(correct_attn_out, original, "dcp_lse_merge")


def a2a_unpack_combine_adapter(original: Callable[..., Any], impl: str) -> Callable[..., Any]:
    """vLLM's ``_dcp_a2a_unpack_combine(recv_buffer, head_dim, lse_pack_dim, return_lse,
    is_lse_base_on_e)`` -> out [B, H/N, D] in the buffer's dtype (, lse [B, H/N] fp32)."""

    def _dcp_a2a_unpack_combine(
        recv_buffer: Any,
        head_dim: int,
        lse_pack_dim: int,
        return_lse: bool,
        is_lse_base_on_e: bool,
    ) -> Any:
        k = _kernels()
        from kernels import reference

        dtype = str(recv_buffer.dtype).removeprefix("torch.")
        if (
            recv_buffer.ndim != 4
            or dtype not in _FLOATS
            or lse_pack_dim != reference.a2a_pack_dim(recv_buffer.dtype)
            or recv_buffer.shape[-1] != head_dim + lse_pack_dim
        ):
            CALLS["dcp_lse_merge:fallback"] += 1
            return original(recv_buffer, head_dim, lse_pack_dim, return_lse, is_lse_base_on_e)
        CALLS["dcp_lse_merge:kernel"] += 1
        base = "e" if is_lse_base_on_e else "2"
        return k.lse_merge_packed(
            recv_buffer, head_dim, base=base, return_lse=bool(return_lse), impl=impl
        )

    return _mark(_dcp_a2a_unpack_combine, original, "dcp_lse_merge")


def merge_attn_states_adapter(original: Callable[..., Any], impl: str) -> Callable[..., Any]:
    """vLLM's ``merge_attn_states(output, prefix_output, prefix_lse, suffix_output,
    suffix_lse, output_lse=None, prefill_tokens_with_context=None, output_scale=None)``:
    outputs [T, H, D], LSEs [H, T] base e; writes ``output`` (and ``output_lse``)."""

    def merge_attn_states(
        output: Any,
        prefix_output: Any,
        prefix_lse: Any,
        suffix_output: Any,
        suffix_lse: Any,
        output_lse: Any = None,
        prefill_tokens_with_context: int | None = None,
        output_scale: Any = None,
    ) -> None:
        import torch

        args = (output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse)
        if (
            output_scale is not None  # fp8 output: vLLM's kernel
            or str(output.dtype).removeprefix("torch.") not in _FLOATS
            or output.ndim != 3
            or prefix_output.dtype != output.dtype
            or suffix_output.dtype != output.dtype
        ):
            CALLS["merge_attn_states:fallback"] += 1
            original(*args, prefill_tokens_with_context, output_scale)
            return
        CALLS["merge_attn_states:kernel"] += 1
        t = output.shape[0]
        p = t if prefill_tokens_with_context is None else int(prefill_tokens_with_context)
        if p < t:
            output[p:].copy_(suffix_output[p:])
            if output_lse is not None:
                output_lse[:, p:].copy_(suffix_lse[:, p:])
        if p <= 0:
            return
        outs = torch.stack((prefix_output[:p], suffix_output[:p]))  # [2, p, H, D]
        lses = torch.stack((prefix_lse[:, :p].float().t(), suffix_lse[:, :p].float().t()))
        merged = _kernels().lse_merge(
            outs, lses, base="e", return_lse=output_lse is not None, impl=impl
        )
        if output_lse is not None:
            merged, lse = merged
            output_lse[:, :p].copy_(lse.t())
        output[:p].copy_(merged)

    return _mark(merge_attn_states, original, "merge_attn_states")


def fused_add_rms_norm_adapter(original: Callable[..., Any], impl: str) -> Callable[..., Any]:
    """The ``vllm_c`` impl of ``vllm.ir.ops.fused_add_rms_norm(x, x_residual, weight,
    epsilon, variance_size=None) -> (x, x_residual)``, in place like vLLM's C kernel."""

    def fused_add_rms_norm(
        x: Any,
        x_residual: Any,
        weight: Any | None,
        epsilon: float,
        variance_size: int | None = None,
    ) -> tuple[Any, Any]:
        k = x.shape[-1] if x.ndim else 0
        if (
            variance_size is not None
            or weight is None
            or weight.dtype != x.dtype
            or str(x.dtype).removeprefix("torch.") not in _FLOATS
            or x.shape != x_residual.shape
            or x_residual.dtype != x.dtype
            or x.ndim < 2
            or weight.shape != (k,)
            or not x.is_contiguous()
            or not x_residual.is_contiguous()
            or x.numel() // max(k, 1) > RMSNORM_MAX_ROWS
        ):
            CALLS["fused_add_rmsnorm:fallback"] += 1
            return original(x, x_residual, weight, epsilon, variance_size)
        CALLS["fused_add_rmsnorm:kernel"] += 1
        x2, r2 = x.view(-1, k), x_residual.view(-1, k)
        _kernels().rmsnorm_residual(
            x2, r2, weight, float(epsilon), out=x2, residual_out=r2, impl=impl
        )
        return x, x_residual

    return _mark(fused_add_rms_norm, original, "fused_add_rmsnorm")


TARGETS: tuple[Target, ...] = (
    Target(
        "dcp_lse_merge",
        "vllm.v1.attention.ops.dcp",
        ("correct_attn_out",),
        ("out", "lses", "cp_rank", "ctx", "is_lse_base_on_e"),
        correct_attn_out_adapter,
    ),
    Target(
        "dcp_lse_merge",
        "vllm.v1.attention.ops.dcp",
        ("_dcp_a2a_unpack_combine",),
        ("recv_buffer", "head_dim", "lse_pack_dim", "return_lse", "is_lse_base_on_e"),
        a2a_unpack_combine_adapter,
    ),
    Target(
        "merge_attn_states",
        "vllm._custom_ops",
        ("merge_attn_states",),
        (
            "output",
            "prefix_output",
            "prefix_lse",
            "suffix_output",
            "suffix_lse",
            "output_lse",
            "prefill_tokens_with_context",
            "output_scale",
        ),
        merge_attn_states_adapter,
    ),
    Target(
        "fused_add_rmsnorm",
        "vllm.kernels.vllm_c",
        ("fused_add_rms_norm", "impl_fn"),
        ("x", "x_residual", "weight", "epsilon", "variance_size"),
        fused_add_rms_norm_adapter,
    ),
)
PATCHABLE: tuple[str, ...] = tuple(dict.fromkeys(t.setting for t in TARGETS))


# --- settings -----------------------------------------------------------------------------


def parse(value: str | None) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]`` (``all`` = every patchable name); empty -> ``[]``.

    Raises :class:`KernelSettingRefused` for unknown or unpatchable names.
    """
    names = [n.strip() for n in (value or "").split(",") if n.strip()]
    if names == ["all"]:
        return list(PATCHABLE)
    bad = [n for n in names if n not in PATCHABLE]
    if bad:
        why = [f"{n} ({UNPATCHABLE[n]})" if n in UNPATCHABLE else f"{n} (unknown)" for n in bad]
        raise KernelSettingRefused(
            f"kernel name(s) {', '.join(why)}; known: {', '.join(PATCHABLE)} or all"
        )
    return list(dict.fromkeys(names))


def platform_refusal() -> str | None:
    """Why this process cannot run the kernels (None: it can): vLLM's platform must be CUDA
    and Triton importable. Imports vllm.platforms (call only inside a vLLM process)."""
    try:
        from vllm.platforms import current_platform
    except Exception as e:  # pragma: no cover - no vLLM at all
        return f"vLLM's platform is unknown ({e})"
    if not current_platform.is_cuda():
        name = getattr(current_platform, "device_name", None) or type(current_platform).__name__
        return f"vLLM's platform is {name}, not CUDA"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    return None


# --- patching -----------------------------------------------------------------------------

_lock = threading.RLock()
_installed: dict[str, tuple[Target, Callable[..., Any]]] = {}  # target name -> original
_outcome: dict[str, Any] | None = None  # what install_from_env decided in this process


def _resolve(module: ModuleType, path: Sequence[str]) -> tuple[Any, str]:
    owner: Any = module
    for attr in path[:-1]:
        owner = getattr(owner, attr)
    return owner, path[-1]


def _params(fn: Callable[..., Any]) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def _patch(target: Target, module: ModuleType, impl: str) -> bool:
    """Replace one target in an imported module; False (and a log line) if refused."""
    with _lock:
        try:
            owner, attr = _resolve(module, target.path)
            current = getattr(owner, attr)
        except AttributeError:
            logger.error("kvroute kernels: %s not found; not patched", target.name)
            return False
        if getattr(current, "__kvroute_original__", None) is not None:
            return True  # already ours (register() ran twice, or two installs)
        if _params(current) != target.params:
            logger.error(
                "kvroute kernels: %s%s is not the signature the adapter was written for %s; "
                "not patched",
                target.name,
                inspect.signature(current),
                target.params,
            )
            return False
        setattr(owner, attr, target.adapter(current, impl))
        _installed[target.name] = (target, current)
        logger.debug("kvroute kernels: patched %s (impl %s)", target.name, impl)
        return True


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs the pending patches of a module right after it executes (first import)."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Callable[[ModuleType], None]]] = {}
        self._busy: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.pending or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        # the hooks are taken when the module executes, not here: a find_spec() that does
        # not import (importlib.util.find_spec(name) as a presence check) must not lose them
        spec.loader = _HookedLoader(spec.loader, self, fullname)
        return spec


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, finder: _PatchOnImport, fullname: str) -> None:
        self._loader = loader
        self._finder = finder
        self._fullname = fullname

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        with _lock:
            hooks = self._finder.pending.pop(self._fullname, [])
        for hook in hooks:
            try:
                hook(module)
            except Exception:  # never break vLLM's import
                logger.exception("kvroute kernels: patching %s failed", module.__name__)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... of the real loader
        return getattr(self._loader, name)


_finder = _PatchOnImport()


def _when_imported(module: str, hook: Callable[[ModuleType], None]) -> bool:
    """Run ``hook(module)`` now if imported (True), else right after its first import."""
    with _lock:
        if module in sys.modules:
            hook(sys.modules[module])
            return True
        _finder.pending.setdefault(module, []).append(hook)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        return False


def install(
    settings: Sequence[str],
    *,
    impl: str = "auto",
    check_platform: bool = True,
    version: str | None = None,
    targets: Sequence[Target] = TARGETS,
) -> dict[str, Any]:
    """Patch the targets of ``settings`` (names of :data:`PATCHABLE`); idempotent.

    Returns ``{"patched": [target names patched now], "deferred": [patched on import]}``.
    Raises :class:`KernelSettingRefused` (nothing patched) for an unknown name, a refused
    platform (``check_platform=False`` skips that check: tests on CPU) or a vLLM version
    outside :data:`PATCH_VERSIONS`.
    """
    from engine_patches import versions

    names = parse(",".join(settings))
    if impl not in ("auto", "triton", "torch"):
        raise KernelSettingRefused(f"{ENV_IMPL} must be auto, triton or torch, not {impl!r}")
    v = versions.normalize(version if version is not None else versions.installed_version())
    if v not in PATCH_VERSIONS:
        raise KernelSettingRefused(
            f"vLLM {v} is not a version the kernel adapters were written for "
            f"({', '.join(PATCH_VERSIONS)})"
        )
    if check_platform:
        why = platform_refusal()
        if why is not None:
            raise KernelSettingRefused(f"{why}; the kernels run on CUDA hosts with Triton")
    done: dict[str, Any] = {"patched": [], "deferred": []}
    for target in targets:
        if target.setting not in names:
            continue

        def hook(module: ModuleType, target: Target = target) -> None:
            _patch(target, module, impl)

        now = _when_imported(target.module, hook)
        done["patched" if now else "deferred"].append(target.name)
    return done


def uninstall() -> None:
    """Put every original back and drop pending patches (tests)."""
    with _lock:
        for target, original in _installed.values():
            module = sys.modules.get(target.module)
            if module is None:
                continue
            owner, attr = _resolve(module, target.path)
            setattr(owner, attr, original)
        _installed.clear()
        _finder.pending.clear()
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)


def installed() -> dict[str, Callable[..., Any]]:
    """Target name -> vLLM's original function, for the targets patched in this process."""
    return {name: original for name, (_, original) in _installed.items()}


def install_from_env(environ: dict[str, str] | None = None) -> dict[str, Any] | None:
    """The plugin's entry: read ``KVROUTE_KERNELS`` once per process and install, or refuse
    with one log line. None when the setting is empty or was refused."""
    global _outcome
    env = os.environ if environ is None else environ
    value = env.get(ENV, "").strip()
    if not value:
        return None
    with _lock:
        if _outcome is not None:
            return _outcome or None
        try:
            names = parse(value)
        except KernelSettingRefused as e:
            logger.error("kvroute kernels: %s=%s refused: %s; nothing was patched", ENV, value, e)
            _outcome = {}
            return None
        try:
            result = install(names, impl=env.get(ENV_IMPL, "auto").strip() or "auto")
        except KernelSettingRefused as e:
            logger.warning("kvroute kernels: %s=%s refused: %s; nothing was patched", ENV, value, e)
            _outcome = {}
            return None
        logger.info(
            "kvroute kernels: %s installed (%d target(s) patched now, %d when vLLM imports them)",
            ", ".join(names),
            len(result["patched"]),
            len(result["deferred"]),
        )
        _outcome = result
        return result
