"""Small launch helpers shared by the Triton modules: device checks, padding, constants.

Imports torch and triton (only the Triton modules import this); no kernels live here.
"""

from __future__ import annotations

from typing import Any

import torch
import triton


def next_pow2(n: int) -> int:
    """Smallest power of two ≥ max(n, 2) (tile sides; 2 keeps 1-row tiles out of the compiler)."""
    return max(2, triton.next_power_of_2(int(n)))


def fp8_max() -> float:
    return float(torch.finfo(torch.float8_e4m3fn).max)


def is_interpreted(kernel: Any) -> bool:
    """True when ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_launchable(kernel: Any, *tensors: torch.Tensor) -> None:
    """Refuse a launch Triton cannot do: CPU tensors without the interpreter, mixed devices."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"tensors on different devices: {sorted(map(str, devices))}")
    if any(d.type != "cuda" for d in devices) and not is_interpreted(kernel):
        raise RuntimeError(
            "impl='triton' on CPU tensors needs TRITON_INTERPRET=1 set before the kernel "
            "modules are imported (or use impl='torch' / 'auto')"
        )
