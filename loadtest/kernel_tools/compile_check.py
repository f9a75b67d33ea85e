"""Compile every kernel variant for an NVIDIA target without a GPU (``triton.compile``).

The interpreter accepts code the GPU compiler rejects (``break``, branches whose types
differ, 1-row ``tl.dot``), so the CPU tests also compile each variant that the launchers
can pick, down to a cubin (Triton's bundled ptxas; no driver needed). Run as a separate
process, ``python -m loadtest.kernel_tools.compile_check [--arch 90]``, so the kernels are decorated
without ``TRITON_INTERPRET``; it prints one JSON line per variant and exits non-zero if
any variant fails.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from typing import Any

FLOAT_ARGS = {"eps", "qk_scale"}


def _signature(kernel: Any, ptrs: dict[str, str], consts: dict[str, Any]) -> dict[str, str]:
    """Triton signature: pointers from ``ptrs`` (dtype), floats by name, other args i32."""
    sig: dict[str, str] = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + ptrs[name]
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any], int]]:
    """(label, kernel, pointer dtypes, constexprs, num_warps) for each launchable variant."""
    from kernels import triton_decode, triton_lse, triton_norm, triton_rope

    fp8max = 448.0
    out: list[tuple[str, Any, dict[str, str], dict[str, Any], int]] = []

    def merge(label: str, i: str, o: str, n: int, d: int, base_e: bool, ret: bool) -> None:
        ptrs = {"out_ptr": o, "out_lse_ptr": "fp32", "in_ptr": i, "lse_ptr": "fp32"}
        ptrs["scale_ptr"] = "fp32"
        consts: dict[str, Any] = {
            "D": d,
            "N_PAD": max(2, 1 << (n - 1).bit_length()),
            "BASE_E": base_e,
        }
        consts.update(D_PAD=max(2, 1 << (d - 1).bit_length()), RETURN_LSE=ret)
        consts.update(OUT_FP8=o == "fp8e4nv", FP8_MAX=fp8max)
        size = {"fp32": 4, "bf16": 2, "fp16": 2}[i]
        block_h = triton_lse.merge_block_h(32, consts["N_PAD"], consts["D_PAD"], size)
        consts["BLOCK_H"] = block_h
        warps = triton_lse.merge_num_warps(block_h * consts["N_PAD"] * consts["D_PAD"])
        label += f" BLOCK_H={block_h}"
        out.append((label, triton_lse._lse_merge_kernel, ptrs, consts, warps))

    merge("lse_merge bf16 N=4 D=128 e lse", "bf16", "bf16", 4, 128, True, True)
    merge("lse_merge fp32->fp8 N=8 D=96 2", "fp32", "fp8e4nv", 8, 96, False, False)
    merge("lse_merge fp16 N=1 D=48 e", "fp16", "fp16", 1, 48, True, False)
    for dt, n, d, base_e in (("bf16", 4, 128, True), ("fp16", 2, 48, False)):
        ptrs = {"out_ptr": dt, "glse_ptr": "fp32", "x_ptr": dt, "lse_ptr": "fp32"}
        consts: dict[str, Any] = {
            "D": d,
            "N_PAD": max(2, n),
            "D_PAD": 1 << (d - 1).bit_length(),
        }
        consts["BASE_E"] = base_e
        label = f"lse_correct {dt} N={n} D={d}"
        warps = triton_lse.merge_num_warps(consts["N_PAD"] * consts["D_PAD"])
        out.append((label, triton_lse._lse_correct_kernel, ptrs, consts, warps))
    for dt, o, block, single in (
        ("bf16", "bf16", 8192, True),
        ("bf16", "bf16", 1024, False),
        ("fp16", "fp8e4nv", 4096, True),
        ("bf16", "fp8e4nv", 2048, False),
    ):
        ptrs = {"out_ptr": o, "res_out_ptr": dt, "x_ptr": dt, "res_ptr": dt, "w_ptr": dt}
        ptrs["scale_ptr"] = "fp32"
        consts = {"BLOCK": block, "SINGLE_PASS": single, "OUT_FP8": o == "fp8e4nv"}
        consts["FP8_MAX"] = fp8max
        label = f"rmsnorm_residual {dt}->{o} BLOCK={block} single={single}"
        kern = triton_norm._rmsnorm_residual_kernel
        out.append((label, kern, ptrs, consts, triton_norm.num_warps_for(block)))
    for dt, d, hq, hk, neox in (("bf16", 128, 32, 8, True), ("fp16", 96, 13, 1, False)):
        ptrs = dict.fromkeys(("q_out_ptr", "k_out_ptr", "q_ptr", "k_ptr", "v_ptr"), dt)
        ptrs.update(pos_ptr="i64", cs_ptr="fp32", kc_ptr=dt, vc_ptr=dt, slot_ptr="i64")
        pad = 1 << (d - 1).bit_length()
        consts = {"D": d, "D_PAD": pad, "HALF_PAD": pad // 2, "IS_NEOX": neox}
        consts.update(HQ_PAD=1 << (hq - 1).bit_length(), HK_PAD=max(2, 1 << (hk - 1).bit_length()))
        label = f"rope_kv_write {dt} D={d} Hq={hq} Hk={hk} neox={neox}"
        out.append((label, triton_rope._rope_kv_write_kernel, ptrs, consts, 4))
    for dt, g, d, bn, f32 in (
        ("bf16", 8, 128, 64, False),
        ("fp16", 1, 48, 16, False),
        ("bf16", 4, 96, 32, True),
        ("fp32", 13, 96, 16, True),
    ):
        ptrs = {"o_ptr": "fp32", "lse_ptr": "fp32", "q_ptr": dt, "kc_ptr": dt, "vc_ptr": dt}
        ptrs.update(bt_ptr="i32", sl_ptr="i32")
        pad = max(16, 1 << (d - 1).bit_length())
        consts = {
            "G": g,
            "G_PAD": max(16, 1 << (g - 1).bit_length()),
            "D": d,
            "D_PAD": pad,
        }
        consts.update(BLOCK_N=bn, DOT_F32=f32)
        label = f"decode_partial {dt} G={g} D={d} BLOCK_N={bn} f32dot={f32}"
        out.append((label, triton_decode._decode_partial_kernel, ptrs, consts, 4))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="SM version (90 = H100/H200)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_check: unset TRITON_INTERPRET (kernels must be real JIT functions)")
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", args.arch, 32)
    failed = 0
    for label, kernel, ptrs, consts, warps in variants():
        t0 = time.perf_counter()
        rec: dict[str, Any] = {"variant": label, "arch": args.arch}
        try:
            src = ASTSource(
                fn=kernel, signature=_signature(kernel, ptrs, consts), constexprs=consts
            )
            compiled = triton.compile(src, target=target, options={"num_warps": warps})
            rec.update(ok=True, cubin_bytes=len(compiled.asm["cubin"]))
        except Exception as exc:  # report every failing variant, not just the first
            failed += 1
            rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        print(json.dumps(rec), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
