"""Kernels tier: Triton kernels run by the interpreter on CPU tensors, against torch references.

``@triton.jit`` picks the interpreter when the kernel is *decorated*, i.e. when a kernel
module is imported, from ``TRITON_INTERPRET``. So this file sets ``TRITON_INTERPRET=1``,
imports every kernel module, and puts the variable back as it was: the kernels stay
interpreted for this tier, and no other tier (nor a subprocess it starts, e.g. vLLM-CPU
replicas) sees the variable. ``kernels.compile_check`` compiles the real (non-interpreted)
kernels in a subprocess for that reason.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest

KERNEL_MODULES = ("triton_lse", "triton_norm", "triton_rope", "triton_decode")
HAVE_TRITON = all(importlib.util.find_spec(m) for m in ("torch", "triton"))
# Triton imported earlier in this process (without the variable) has compiled-mode helpers
# (tl.sum, tl.cdiv, ...) that interpreted kernels cannot call: detected below, reported per test.
TRITON_WAS_IMPORTED = "triton" in sys.modules

if HAVE_TRITON:
    _previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        # Triton's own jit helpers (tl.standard) are decorated when triton.language is first
        # imported, and the launcher imports triton.experimental.gluon lazily on the first
        # launch, asserting those helpers match the *current* mode: import it now too.
        importlib.import_module("triton.experimental.gluon")
        for _name in KERNEL_MODULES:
            importlib.import_module(f"kernels.{_name}")
    finally:
        if _previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _previous


def _interpreted() -> bool:
    if not HAVE_TRITON:
        return False
    import triton.language.standard as standard

    from kernels import launch, triton_lse

    return launch.is_interpreted(standard.sum) and launch.is_interpreted(
        triton_lse._lse_merge_kernel
    )


INTERPRETED = _interpreted()


@pytest.fixture(autouse=True)
def _interpreter_and_seed() -> None:
    if not INTERPRETED:
        pytest.fail(
            "Triton was imported in this process before tests/kernels/conftest.py could set "
            f"TRITON_INTERPRET (imported early: {TRITON_WAS_IMPORTED}); run the kernels tier "
            "in its own process: make test-kernels"
        )
    import torch

    torch.manual_seed(0)
